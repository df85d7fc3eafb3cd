"""Faults for the simulator: scripted, or drawn at a rate per node-day; how long each keeps its target out;
and how long the real system takes to notice each kind.

Kinds
-----
========== ==================================================================================================
crash      the node's engine process dies: its connections close (workers.faults "crash", a SIGKILL)
hang       the node stops answering but closes nothing: a frozen process (workers.faults "hang"), a cut cable
sdc        silent data corruption: the node answers, wrongly (workers.faults "sdc")
gpu_lost   one GPU of the node's tensor-parallel group is lost (Xid 79, 48, 95, 119...), and the group with it
rack       every node of a rack is cut off at once (its top-of-rack switch)
========== ==================================================================================================

Rate
----
``FAULTS_PER_1000_NODE_DAYS`` = 4, all causes, a node being one server (one host's tensor-parallel group):

- Meta's Llama 3 405B pre-training (Dubey et al., "The Llama 3 Herd of Models", 2024, §3.3.4): 419 unexpected
  interruptions in 54 days on 16,384 H100s in 2,048 hosts of eight, 419 / (2,048 × 54) = 3.8 per 1,000
  host-days (../shared/REFERENCE.md; recovery.policy.history uses the same rate);
- StepFun's public fault trace (InfiniteHBD, Shou et al., SIGCOMM 2025, github.com/stepfun-ai/InfiniteHBD-Trace):
  584 faults on 400 servers over 348 days, 4.2 per 1,000 server-days.

Source document 003's 2–5 % of GPUs per year counts hard GPU deaths only: 5 % a year on eight GPUs is
8 × 0.05 / 365 = 1.1 per 1,000 node-days at most, about a quarter of all causes.

Each node fails as a Poisson process whose clock runs while the node is in service: after a fault it is out for
its outage, then its next fault is drawn. At the default outage (mean about 9 days) a node spends about 3.5 % of
its days out, so a long run counts about 3.86 faults per 1,000 calendar node-days instead of 4.

Cause mix: Meta's 419 interruptions by cause (REFERENCE.md), each mapped to what the serving system sees:

========== ===== ===================================================================================
gpu_lost    262  faulty GPU 148, HBM3 72, GPU SRAM 19, GPU system processor 17, GPU thermal 6: the GPU
                 leaves its tensor-parallel group and the group cannot run without it
crash       102  software 54, host maintenance 32, other 16: the process or the host goes down
hang         49  network switch or cable 35, NIC 7, NCCL watchdog 7: cut off, or stuck in a collective,
                 with nothing closed
sdc           6  silent data corruption 6
========== ===== ===================================================================================

Meta's and not StepFun's, because StepFun files 41 % of its faults as "unknown error" or "stress test
failure", which say nothing about how the node fails; Meta names a cause for all but 16 of 419.

Rack events are off by default (``rack_per_1000_rack_days`` = 0): Meta's switch and cable failures are already
in ``hang`` as single nodes. If every one of them had taken a whole rack they would run at 4 × 35 / 419 = 0.33
per 1,000 node-days, that is 0.33 × (nodes per rack) per 1,000 rack-days: an upper bound worth a run.

Outage
------
From the fault to the node back in service: log-normal, median 22 h and 90th percentile 341 h, StepFun's
figures (its trace's fault_start, node unavailable, to fault_end, repaired). Recomputed from the released trace
the median is 20.4 h and the p90 311–321 h, by the quantile convention: the same within 10 %. The fit
(recovery.sim.distributions):

    mu    = ln(22 h)                         = 3.091  (hours)
    sigma = ln(341 h / 22 h) / Φ⁻¹(0.9)      = ln(15.5) / 1.28155 = 2.1387
    mean  = 22 h · exp(sigma² / 2)           = 217 h, about 9 days; p99 = 22 h · exp(2.3263 · sigma) ≈ 3,200 h

It applies to every drawn fault and every drawn rack event. A software crash that restarts by itself within a
minute never reached StepFun's count (it records servers taken out of the pool): script such a crash with its own
``repair_s``.

Detection
---------
How long after the fault the gateways stop sending the node requests (``routing_s``) and the control plane
records its verdict (``confirmed_s``), as the real system does it with its shipped defaults
(``DetectionDefaults``, each field naming where its default lives):

========== ======================================================== =============================================
kind       out of routing                                           confirmed
========== ======================================================== =============================================
crash      when its streams break as its connections close           DOWN after the heartbeat miss
           (recovery/gateway/watch.py): stream_break_s, measured
hang       DOWN after the heartbeat miss (republished routing), or   DOWN after the heartbeat miss
           the stall timeout of a request in flight, or the event
           stream's read timeout, whichever is first
sdc        weight 0 at the unhealthy_after-th failed canary's        UNHEALTHY at the same moment; SUSPICIOUS
           verdict: the next canary comes in [0, interval), then     (weight 0.5) at the first failed canary's
           one retry every canary_retry_s, and each canary takes     verdict
           its own run time (``canary_s``) to answer
gpu_lost   at once: the engine fails its requests in flight and      UNHEALTHY when the Xid arrives with the next
           refuses new ones (workers/engine.py)                      heartbeat: a CRITICAL Xid acts at once
rack       as hang, for each node of the rack                        as hang
========== ======================================================== =============================================

The heartbeat miss: the last beat came a uniform [0, interval) before the fault; the node is silent "too long"
``miss`` after that beat, and the check that notices runs every ``heartbeat_check_s``, a uniform wait. With the
defaults a silent node is DOWN 2–4 s after its fault, 3 s on average. A canary's own run time (well under its 3 s
timeout, Cluster.canary_timeout_s) is the caller's ``canary_s`` (the simulator gives the roofline's time for one
of document 003's canary prompts, as recovery.actions.health.canary_gpu_ms counts it; 0 by default), and a
corrupting GPU is taken to fail every canary it gets. Retries are scheduled from each canary's start
(recovery.actions.health.schedule_canaries stamps canary_last_at when it sends one), so the run time adds once.
The canary round before the first failing one (``first_canary_s`` − interval after the fault) passed: the
requests the node served since then are the ones the real system names as possibly corrupt.

Determinism: every node's faults come from its own ``random.Random`` seeded by the run's seed and the node's name
(a string seed is hashed with SHA-512, the same in every process), so adding a node to a fleet leaves the others'
faults as they were.
"""

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from recovery.sim.distributions import LogNormal
from recovery.sim.errors import ScenarioError

NODE_KINDS = ("crash", "hang", "sdc", "gpu_lost")
KINDS = (*NODE_KINDS, "rack")

DAY_S = 86400.0
HOUR_S = 3600.0
FAULTS_PER_1000_NODE_DAYS = 4.0
MAX_FAULTS_PER_1000_DAYS = (
    1e7  # one fault per node every 9 s or so: room for a rate raised to show faults in short runs
)

# Meta's Llama 3 interruptions by cause (REFERENCE.md), summed by kind as in the table above.
META_LLAMA3_MIX: Mapping[str, float] = {
    "gpu_lost": 148 + 72 + 19 + 17 + 6,
    "crash": 54 + 32 + 16,
    "hang": 35 + 7 + 7,
    "sdc": 6,
}

OUTAGE_MEDIAN_H, OUTAGE_P90_H = 22.0, 341.0  # StepFun's trace: node unavailable to repaired
STEPFUN_OUTAGE = LogNormal.from_median_p90(OUTAGE_MEDIAN_H * HOUR_S, OUTAGE_P90_H * HOUR_S)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


@dataclass(frozen=True)
class Fault:
    """One fault: from `at_s` its target is out for `repair_s` (None: for the rest of the run)."""

    at_s: float  # seconds from the run's start
    kind: str  # one of KINDS
    target: str  # a node's name; a rack's for kind "rack"
    repair_s: float | None = None
    scripted: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScenarioError("kind", f"{self.kind!r} is not a fault", ", ".join(KINDS))
        if not _number(self.at_s) or not 0 <= self.at_s < math.inf:
            raise ScenarioError("at_s", f"{self.at_s!r}", "seconds from the run's start, a number ≥ 0")
        if self.repair_s is not None and (not _number(self.repair_s) or not 0 < self.repair_s < math.inf):
            raise ScenarioError(
                "repair_s", f"{self.repair_s!r}", "seconds above 0, or null: out for the rest of the run"
            )

    @property
    def back_at_s(self) -> float:
        return math.inf if self.repair_s is None else self.at_s + self.repair_s


@dataclass(frozen=True)
class FaultRates:
    """Faults drawn per node and per rack; see the module's docstring for the figures and their sources."""

    per_1000_node_days: float = FAULTS_PER_1000_NODE_DAYS
    rack_per_1000_rack_days: float = 0.0
    mix: Mapping[str, float] = field(default_factory=lambda: dict(META_LLAMA3_MIX))
    outage: LogNormal = STEPFUN_OUTAGE

    def __post_init__(self) -> None:
        for name in ("per_1000_node_days", "rack_per_1000_rack_days"):
            value = getattr(self, name)
            if not _number(value) or not 0 <= value <= MAX_FAULTS_PER_1000_DAYS:
                raise ScenarioError(name, f"{value!r}", f"a number from 0 (none) to {MAX_FAULTS_PER_1000_DAYS:g}")
        for kind, weight in self.mix.items():
            if kind not in NODE_KINDS:
                raise ScenarioError(f"mix.{kind}", "is not a kind of node fault", ", ".join(NODE_KINDS))
            if not _number(weight) or not 0 <= weight < math.inf:
                raise ScenarioError(f"mix.{kind}", f"{weight!r}", "a weight ≥ 0")
        if not sum(self.mix.values()) > 0:
            raise ScenarioError("mix", "gives every kind a weight of 0", "at least one weight above 0")

    def expected_faults(self, node_days: float) -> float:
        """Faults expected in `node_days` of service: the rate's own arithmetic."""
        return self.per_1000_node_days * node_days / 1000

    def draw(self, nodes: Sequence[str], racks: Sequence[str], duration_s: float, seed: int | str) -> list[Fault]:
        """Faults in [0, duration_s) on `nodes` and, at their own rate, on whole `racks`, in time order.

        Times and outages come from one stream per target, kinds from another: a different mix changes
        what fails, never when."""
        kinds = list(self.mix)
        weights = [self.mix[k] for k in kinds]
        faults = []
        for name in nodes:
            kind_rng = random.Random(f"{seed}:fault-kinds:{name}")
            for at, repair in self._process(
                random.Random(f"{seed}:faults:{name}"), self.per_1000_node_days, duration_s
            ):
                faults.append(Fault(at, kind_rng.choices(kinds, weights)[0], name, repair))
        for rack in racks:
            rng = random.Random(f"{seed}:rack-faults:{rack}")
            for at, repair in self._process(rng, self.rack_per_1000_rack_days, duration_s):
                faults.append(Fault(at, "rack", rack, repair))
        return sorted(faults, key=lambda f: (f.at_s, f.kind, f.target))

    def _process(self, rng: random.Random, per_1000_days: float, duration_s: float) -> list[tuple[float, float]]:
        """(start, outage) of each fault of a Poisson process whose clock stops while its target is out."""
        if per_1000_days <= 0:
            return []
        rate_per_s = per_1000_days / 1000 / DAY_S
        faults = []
        t = rng.expovariate(rate_per_s)
        while t < duration_s:
            repair = self.outage.sample(rng)
            faults.append((t, repair))
            t += repair + rng.expovariate(rate_per_s)
        return faults


# --- detection ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DetectionDefaults:
    """The real system's detection settings, with the defaults it ships."""

    # console/settings.py LIFELINE_HEARTBEAT_INTERVAL_S; the node's --heartbeat-interval (workers/node.py)
    heartbeat_interval_s: float = 1.0
    # console/settings.py LIFELINE_HEARTBEAT_MISS_S: silent longer than this is DOWN (recovery.policy.lifecycle)
    heartbeat_miss_s: float = 3.0
    # console/settings.py LIFELINE_HEARTBEAT_CHECK_S: how often recovery.tasks.check_heartbeats runs
    heartbeat_check_s: float = 1.0
    # recovery/gateway/table.py ClusterConfig.stall_timeout_s: no byte of a stream this long, the node has failed
    stall_timeout_s: float = 5.0
    # recovery/gateway/watch.py: the event stream's read timeout, 3 × SILENT_S (nodes speak every second)
    event_stream_timeout_s: float = 9.0
    # From a node's SIGKILL to the gateway noticing its streams broke: measured, not a setting (benchmarks/move_hop.py,
    # noticed_ms_mean, 2026-11-29: 8.95 ms, sd 3 ms, over 82 moves of 1 to 12 requests moving at once).
    stream_break_s: float = 0.00895
    # recovery/models.py Cluster.canary_interval_s, canary_retry_s, suspicious_after, unhealthy_after
    canary_interval_s: float = 30.0
    canary_retry_s: float = 2.0
    suspicious_after: int = 1
    unhealthy_after: int = 3

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            integer = name.endswith("_after")
            if not _number(value) or not 0 < value < math.inf or (integer and value != int(value)):
                raise ScenarioError(name, f"{value!r}", "a whole number ≥ 1" if integer else "seconds above 0")
        if self.suspicious_after > self.unhealthy_after:
            raise ScenarioError(
                "suspicious_after",
                f"{self.suspicious_after} is more than unhealthy_after {self.unhealthy_after}",
                "at most unhealthy_after: a node is SUSPICIOUS before it is UNHEALTHY",
            )

    def heartbeat_down_s(self, rng: random.Random) -> float:
        """From a node falling silent to its DOWN: the miss counted from its last beat, then the next check."""
        since_last_beat = rng.uniform(0, self.heartbeat_interval_s)
        return max(0.0, self.heartbeat_miss_s - since_last_beat) + rng.uniform(0, self.heartbeat_check_s)


DETECTION = DetectionDefaults()


@dataclass(frozen=True)
class Detection:
    routing_s: float  # after the fault: the gateways stop sending the node requests
    confirmed_s: float  # after the fault: the control plane's DOWN or UNHEALTHY
    by: str  # what noticed it first
    suspicious_s: float | None = None  # sdc: the first failed canary halves the node's routing weight
    first_canary_s: float | None = None  # sdc: when the first canary after the fault starts


def detect(kind: str, rng: random.Random, defaults: DetectionDefaults = DETECTION, canary_s: float = 0.0) -> Detection:
    """When the real system notices a fault of `kind` (for a rack: one of its nodes); `canary_s` is one canary's
    run time, from its start to its verdict (sdc only)."""
    d = defaults
    if kind == "crash":
        return Detection(d.stream_break_s, d.heartbeat_down_s(rng), "event stream closed")
    if kind in ("hang", "rack"):
        down = d.heartbeat_down_s(rng)
        routing, by = min((down, "heartbeat miss"), (d.stall_timeout_s, "stall timeout"))
        routing, by = min((routing, by), (d.event_stream_timeout_s, "event stream timeout"))
        return Detection(routing, down, by)
    if kind == "sdc":
        first = rng.uniform(0, d.canary_interval_s)
        suspicious = first + (d.suspicious_after - 1) * d.canary_retry_s + canary_s
        unhealthy = first + (d.unhealthy_after - 1) * d.canary_retry_s + canary_s
        return Detection(unhealthy, unhealthy, "canary", suspicious_s=suspicious, first_canary_s=first)
    if kind == "gpu_lost":
        return Detection(0.0, rng.uniform(0, d.heartbeat_interval_s), "requests failed; Xid on the next heartbeat")
    raise ScenarioError("kind", f"{kind!r} is not a fault", ", ".join(KINDS))
