"""The demo's past: thirty days of generated history, made from the models the live demo runs on.

A fresh demo has no past, so its objectives, incident list and reports would be empty for a month. `History` makes
one up, from one seed, and everything it makes is marked as generated wherever it is stored and shown.

- Failures arrive as a Poisson process at FAULTS_PER_1000_NODE_DAYS, 4 per 1,000 servers a day: Meta's Llama 3 run
  had 419 interruptions in 54 days on 2,048 hosts of eight H100s (../shared/REFERENCE.md), 3.8 per 1,000 hosts a
  day, and source document 003 quotes 2–5% of GPUs failing a year. A demo node is one server. At that rate the demo's
  eight nodes would fail about once a month, so the history raises the rate ACCELERATION (30) times, plainly: about
  one failure a day. Each failure's cause is drawn from Meta's mix; the cause decides the blast radius (a network
  switch or cable takes its whole rack) and how long the nodes stay out (software restarts in a minute or two; a
  faulty GPU is drained and reset or replaced in hours).
- Capacity follows the live rule (recovery.actions.capacity): what the nodes in service carry, a hot spare counted
  in place of a failed node from the moment the failure is confirmed, against the cluster's required throughput;
  the degradation level moves by recovery.policy.capacity.next_level (worse at once, better after the hold).
- Requests arrive as the demo's traffic generator sends them (workers.traffic): Poisson arrivals, its prompt and
  output lengths, one of its keys (a tenant and its tier) picked uniformly. Their latency is the catalog's roofline
  for the fleet's deployments at the demo's load. The history's rate is lower than the demo's (HISTORY_RATE_RPS, a
  twelfth of the demo's default 6 req/s) so the back-fill takes seconds, not minutes; attainment and budgets are
  ratios, so they read the same, while goodput and the number of requests a failure touches read a twelfth.
- During a failure: requests in flight on a failed node (or sent to it before the failure was confirmed) stall and
  are moved, restored from a checkpoint or re-prefilled, and a few fail (more when a whole rack goes, holders
  included); the survivors answer slower until latency recovers; the level sheds best-effort traffic (429) at 2 and
  more and refuses every new request (503) at 4. No token is ever lost: that is the product's guarantee.

Every minute's requests come from a generator seeded by the seed and the minute's place in the window alone, so a
minute is the same whenever it is generated: a back-fill cut short resumes where it stopped, a test regenerates what
was stored, and every demo gets the same past, shifted to end where it starts.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from recovery.policy import capacity as capacity_policy
from recovery.policy import severity as severity_policy
from workers import catalog

DAY_S = 86400
HISTORY_DAYS = 30
FAULTS_PER_1000_NODE_DAYS = 4.0
ACCELERATION = 30.0  # the fleet's real rate, raised so the demo's few nodes show a failure about once a day
HISTORY_RATE_RPS = 0.5  # the demo sends 6 req/s by default; a twelfth keeps 30 days to seconds of work

# workers.traffic: log-normal prompt lengths (words, one token each in the emulated engine), clipped; max_tokens.
PROMPT_LOGNORMAL = (4.3, 0.9)
PROMPT_RANGE = (8, 3000)
OUTPUT_TOKENS = (32, 64, 128, 128, 256)
DECODE_BATCH = 2  # sequences a demo node decodes at once at 6 req/s over eight nodes
QUEUE_MS = 20.0  # mean wait for a batch slot, on top of the prefill
TPOT_JITTER = 0.1  # log-normal sigma of a request's time per output token

DETECT_S = (0.5, 5.0)  # a broken stream is seen at once; a silent node by its missed heartbeats
PROMOTE_S = 2.0  # recovery.reactions promotes a hot spare within a second or two of the DOWN
IN_FLIGHT_S = 15.0  # after the detection, requests still finishing that were on the failed node
STALL_MS = (300.0, 2000.0)  # a moved stream's pause: TARRAGON's 0.3–0.4 s from a checkpoint, longer re-prefilled
FIRST_TOKEN_SHARE = 0.3  # of moved requests, those that had not streamed a token yet (the stall is TTFT)
ERROR_SHARE = {"node": 0.03, "rack": 0.10}  # of moved requests, those that fail: a rack takes holders with it
SURVIVOR_TTFT = (1.5, 4.0)  # TTFT factor on the survivors until latency recovers
SURVIVOR_TPOT = 1.2
LEVEL_TTFT = {0: 1.0, 1: 1.3, 2: 1.3, 3: 2.0, 4: 2.0}  # smaller batches queue longer
LEVEL_TPOT = {0: 1.0, 1: 0.95, 2: 0.95, 3: 0.9, 4: 0.9}
SETTLE_S = (5.0, 30.0)  # from capacity back (or the level shedding) to latency within 10% of the baseline
CLOSE_AFTER_S = (900.0, 3 * 3600.0)  # on-call closes a recovered incident
CHART_BEFORE_S, CHART_AFTER_S = 120.0, 60.0  # an incident's requests are kept one by one this far around it
KEPT_AT_MOST_S = 2 * 3600.0  # ... for at most this long after the failure


@dataclass(frozen=True)
class Cause:
    label: str
    weight: int  # interruptions of Meta's Llama 3 run (REFERENCE.md)
    scope: str  # "node", or "rack": every node of the failed node's rack
    out_s: tuple[float, float]  # how long the nodes stay out of routing
    xid: int | None = None


CAUSES = (
    Cause("faulty GPU (fallen off the bus)", 148, "node", (1800, 6 * 3600), 79),
    Cause("HBM3 memory (double-bit ECC)", 72, "node", (1800, 4 * 3600), 48),
    Cause("software (engine crashed)", 54, "node", (40, 120)),
    Cause("network switch or cable", 35, "rack", (300, 2700)),
    Cause("host maintenance", 32, "node", (600, 1800)),
    Cause("GPU SRAM (uncontained ECC)", 19, "node", (1800, 4 * 3600), 95),
    Cause("GPU system processor (GSP timeout)", 17, "node", (600, 3600), 119),
    Cause("NIC", 7, "node", (1800, 2 * 3600)),
    Cause("NCCL watchdog", 7, "node", (40, 120)),
    Cause("silent data corruption", 6, "node", (1800, 4 * 3600)),
    Cause("GPU thermal", 6, "node", (600, 3600)),
    Cause("other", 16, "node", (60, 600)),
)


@dataclass(frozen=True)
class NodeSpec:
    name: str
    rack: str
    model_key: str
    gpu_key: str
    tp: int
    rps: float  # what it carries within the SLOs (recovery.policy.capacity.node_capacity)
    spare: bool = False


@dataclass(frozen=True)
class Inputs:
    """What a history is made from; kept as JSON with the run, so a resumed run makes the same one."""

    seed: int
    start: float  # epoch seconds, a minute's start
    days: int
    nodes: tuple[NodeSpec, ...]
    required_rps: float  # the cluster's throughput objective (0: none, so the level never moves)
    scopes: tuple[tuple[str, str], ...]  # (tenant, tier) of each key the traffic uses
    model_key: str
    rate_rps: float = HISTORY_RATE_RPS
    acceleration: float = ACCELERATION
    faults_per_1000_node_days: float = FAULTS_PER_1000_NODE_DAYS
    margin: float = 0.05  # the cluster's degradation margin and hold
    hold_s: float = 30.0

    @property
    def end(self) -> float:
        return self.start + self.days * DAY_S

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Inputs:
        return cls(
            **{
                **data,
                "nodes": tuple(NodeSpec(**n) for n in data["nodes"]),
                "scopes": tuple((tenant, tier) for tenant, tier in data["scopes"]),
            }
        )


@dataclass
class Fault:
    """One failure, from the first symptom to the incident closed (epoch seconds)."""

    index: int
    cause: Cause
    nodes: tuple[str, ...]
    failed_at: float
    detected_at: float
    back_at: float  # the nodes back in routing
    settle_s: float
    close_after_s: float
    in_service: int = 0  # nodes in service as it began
    serving_lost: tuple[str, ...] = ()  # those of its nodes that were in service
    spare: str | None = None  # the hot spare promoted in place of its first node
    moved_to: str = ""
    recovered_at: float = 0.0  # latency recovered
    capacity_restored_at: float = 0.0
    closed_at: float = 0.0
    peak_level: int = 0

    @property
    def title(self) -> str:
        return f"{', '.join(self.nodes)} failed"

    @property
    def lost_share(self) -> float:
        """The share of the requests in service that ran on the failed nodes."""
        return len(self.serving_lost) / max(self.in_service, 1)

    @property
    def ended_at(self) -> float:
        return max(self.recovered_at, self.capacity_restored_at)

    @property
    def kept(self) -> tuple[float, float]:
        """The span whose requests belong to the incident one by one: its chart, its moved, shed and failed."""
        return self.failed_at - CHART_BEFORE_S, min(self.ended_at, self.failed_at + KEPT_AT_MOST_S) + CHART_AFTER_S

    def severity(self, failed: int) -> tuple[str, str]:
        return severity_policy.severity(self.lost_share, self.peak_level, failed)


@dataclass(frozen=True)
class LevelChange:
    at: float
    old: int
    new: int
    capacity_rps: float
    required_rps: float
    cause: str

    @property
    def ratio(self) -> float | None:
        return round(self.capacity_rps / self.required_rps, 4) if self.required_rps > 0 else None


class Outcome(NamedTuple):
    """One request as a gateway would report it (recovery.gateway.app._report): `at` is when it finished."""

    at: float
    tenant: str
    tier: str
    status: str  # ok, error or shed
    http_status: int
    ttft_ms: float | None
    tpot_ms: float | None
    level: int
    prompt_tokens: int
    completion_tokens: int
    move: dict | None  # how it was moved off a failed node
    fault: int | None  # the failure whose kept span it finished in


@dataclass
class _Latency:
    """The roofline's figures for the fleet, averaged over its serving deployments."""

    prefill_ms: list[float] = field(default_factory=list)  # by prompt tokens
    tpot_ms: float = 0.0

    @classmethod
    def of(cls, nodes: tuple[NodeSpec, ...]) -> _Latency:
        serving = [n for n in nodes if not n.spare] or list(nodes)
        deployments = [catalog.Deployment.of(n.model_key, n.gpu_key, n.tp) for n in serving]
        if not deployments:
            return cls([0.0] * (PROMPT_RANGE[1] + 1), 20.0)
        mean_prompt = math.exp(PROMPT_LOGNORMAL[0] + PROMPT_LOGNORMAL[1] ** 2 / 2)
        context = int(DECODE_BATCH * (mean_prompt + sum(OUTPUT_TOKENS) / len(OUTPUT_TOKENS) / 2))
        tables: dict[catalog.Deployment, list[float]] = {}
        for d in set(deployments):
            tables[d] = [d.step_s(p, 0, 0, 0) * 1000 for p in range(PROMPT_RANGE[1] + 1)]
        prefill = [sum(tables[d][p] for d in deployments) / len(deployments) for p in range(PROMPT_RANGE[1] + 1)]
        tpot = sum(d.step_s(0, 0, DECODE_BATCH, context) * 1000 for d in deployments) / len(deployments)
        return cls(prefill, tpot)


class History:
    """Thirty days (or `inputs.days`) of a fleet's failures, levels and requests, made from `inputs`."""

    def __init__(self, inputs: Inputs):
        self.inputs = inputs
        self.latency = _Latency.of(inputs.nodes)
        self.faults = _faults(inputs)
        self.changes = _levels(inputs, self.faults)
        self._level_at = [c.at for c in self.changes]
        self._level_new = [c.new for c in self.changes]
        self._kept = sorted((f.kept[0], f.kept[1], f.index) for f in self.faults)

    # --- lookups -------------------------------------------------------------------------------------------------
    def level_at(self, at: float) -> int:
        i = bisect.bisect_right(self._level_at, at)
        return self._level_new[i - 1] if i else 0

    def owner(self, at: float) -> Fault | None:
        """The first failure whose kept span holds `at` (kept spans rarely overlap; the earlier one takes it)."""
        return next((self.faults[index] for start, end, index in self._kept if start <= at < end), None)

    def _quiet(self, t0: float) -> bool:
        """No failure near the minute and level 0 all through it: every request there is an ordinary one."""
        if self.level_at(t0) or bisect.bisect_right(self._level_at, t0) != bisect.bisect_left(self._level_at, t0 + 60):
            return False
        return not any(start < t0 + 60 and end > t0 for start, end, _ in self._kept)

    def faults_in(self, start: float, end: float) -> list[Fault]:
        return [f for f in self.faults if start <= f.failed_at < end]

    def changes_in(self, start: float, end: float) -> list[LevelChange]:
        return [c for c in self.changes if start <= c.at < end]

    # --- requests ------------------------------------------------------------------------------------------------
    def minute(self, t0: float) -> list[Outcome]:
        """The requests that finished in the minute starting at `t0`, the same whenever it is asked for."""
        inputs = self.inputs
        rng = random.Random(inputs.seed * 1_000_003 + int((t0 - inputs.start) // 60))  # the same past whenever it ends
        rate, scopes, prefill, tpot0 = inputs.rate_rps, inputs.scopes, self.latency.prefill_ms, self.latency.tpot_ms
        low, high = PROMPT_RANGE
        mu, sigma = PROMPT_LOGNORMAL
        quiet = self._quiet(t0)
        outcomes = []
        # rng.gauss and indexing by rng.random() rather than lognormvariate and choice: the same distributions, at
        # a third of the cost (30 days are millions of requests).
        at = t0 + rng.expovariate(rate)
        while at < t0 + 60:
            tenant, tier = scopes[int(rng.random() * len(scopes))]
            prompt = int(min(max(math.exp(mu + sigma * rng.gauss()), low), high))
            tokens = OUTPUT_TOKENS[int(rng.random() * len(OUTPUT_TOKENS))]
            ttft = prefill[prompt] + rng.expovariate(1 / QUEUE_MS)
            tpot = tpot0 * math.exp(TPOT_JITTER * rng.gauss())
            u, v = rng.random(), rng.random()  # drawn for every request, so a minute's draws never depend on `quiet`
            if quiet:
                outcomes.append(Outcome(at, tenant, tier, "ok", 200, ttft, tpot, 0, prompt, tokens, None, None))
            else:
                outcomes.append(self._during_failure(at, tenant, tier, prompt, tokens, ttft, tpot, u, v))
            at += rng.expovariate(rate)
        return outcomes

    def _during_failure(self, at, tenant, tier, prompt, tokens, ttft, tpot, u: float, v: float) -> Outcome:
        level = self.level_at(at)
        fault = self.owner(at)
        index = fault.index if fault else None
        effects = capacity_policy.EFFECTS[level]
        if not effects.accept_new or tier in effects.shed_tiers:
            code = 503 if not effects.accept_new else 429
            return Outcome(at, tenant, tier, "shed", code, None, None, level, prompt, 0, None, index)
        ttft *= LEVEL_TTFT[level]
        tpot *= LEVEL_TPOT[level]
        move = None
        if fault is not None and fault.failed_at <= at < fault.detected_at + IN_FLIGHT_S and u < fault.lost_share:
            # It ran on a failed node (or was sent there before the failure was confirmed).
            error_share = ERROR_SHARE[fault.cause.scope]
            if v < error_share:
                return Outcome(at, tenant, tier, "error", 502, None, None, level, prompt, 0, None, index)
            w = (v - error_share) / (1 - error_share)  # uniform again
            stall = STALL_MS[0] + (STALL_MS[1] - STALL_MS[0]) * w
            at_token = 0 if w < FIRST_TOKEN_SHARE else 1 + int((tokens - 2) * (w - FIRST_TOKEN_SHARE))
            if at_token == 0:
                ttft += stall
            else:
                tpot += stall / max(tokens - 1, 1)
            restored = w >= 0.2  # most had a checkpoint on a holder that survived
            move = {
                "kind": "failure",
                "from": fault.serving_lost[int(u / fault.lost_share * len(fault.serving_lost))],
                "to": fault.moved_to,
                "at_token": at_token,
                "planned_method": "restore" if restored else "reprefill",
                "method": "checkpoint-local" if restored else "re-prefill",
                "restored_tokens": prompt + at_token if restored else 0,
                "reprefill_tokens": 0 if restored else prompt + at_token,
                "stall_ms": round(stall, 1),
                "reason": "generated history: its node failed",
            }
        elif fault is not None and fault.detected_at <= at < fault.recovered_at:
            ttft *= SURVIVOR_TTFT[0] + (SURVIVOR_TTFT[1] - SURVIVOR_TTFT[0]) * v
            tpot *= SURVIVOR_TPOT
        return Outcome(at, tenant, tier, "ok", 200, ttft, tpot, level, prompt, tokens, move, index)


# --- the failures and the levels they cause --------------------------------------------------------------------------
def _faults(inputs: Inputs) -> list[Fault]:
    """Failures as a Poisson process over the serving nodes, each resolved (back in routing, level settled) before
    the history ends: the live demo starts from a whole fleet at level 0."""
    rng = random.Random(inputs.seed)
    serving = [n for n in inputs.nodes if not n.spare]
    if not serving:
        return []
    per_s = len(serving) * inputs.faults_per_1000_node_days / 1000 * inputs.acceleration / DAY_S
    weights = [c.weight for c in CAUSES]
    faults: list[Fault] = []
    at = inputs.start + rng.expovariate(per_s)
    while at < inputs.end:
        cause = rng.choices(CAUSES, weights)[0]
        node = rng.choice(serving)
        names = tuple(n.name for n in inputs.nodes if n.rack == node.rack) if cause.scope == "rack" else (node.name,)
        detected = at + rng.uniform(*DETECT_S)
        fault = Fault(
            index=len(faults),
            cause=cause,
            nodes=names,
            failed_at=at,
            detected_at=detected,
            back_at=detected + rng.uniform(*cause.out_s),
            settle_s=rng.uniform(*SETTLE_S),
            close_after_s=rng.uniform(*CLOSE_AFTER_S),
        )
        if fault.back_at + inputs.hold_s + CHART_AFTER_S < inputs.end:
            faults.append(fault)
        at += rng.expovariate(per_s)
    return faults


def _levels(inputs: Inputs, faults: list[Fault]) -> list[LevelChange]:
    """Sweep the detections and returns in time order: the nodes in service, the spares promoted, the level by
    recovery.policy.capacity.next_level; fills in each failure's figures. Returns the level changes."""
    rps = {n.name: n.rps for n in inputs.nodes}
    spares = [n.name for n in inputs.nodes if n.spare]
    lost: dict[str, int] = {}  # node → failures that hold it out
    covering: dict[str, int] = {}  # spare → the failure it stands in for
    events: list[tuple[float, int, str, int]] = []
    for f in faults:
        heapq.heappush(events, (f.detected_at, 0, "lost", f.index))
        heapq.heappush(events, (f.back_at, 0, "back", f.index))
    level, better_since, changes = 0, None, []
    open_faults: set[int] = set()
    seq = 1
    while events:
        at, _, kind, index = heapq.heappop(events)
        fault = faults[index]
        if kind == "lost":
            serving = [n.name for n in inputs.nodes if _serves(n.name, n.spare, lost, covering)]
            fault.in_service = len(serving)
            fault.serving_lost = tuple(name for name in fault.nodes if name in serving)
            for name in fault.nodes:
                lost[name] = lost.get(name, 0) + 1
            free = [s for s in spares if s not in covering and not lost.get(s)]
            if free:
                fault.spare = free[0]
                covering[free[0]] = index
            fault.moved_to = fault.spare or next(
                (n.name for n in inputs.nodes if _serves(n.name, n.spare, lost, covering)), ""
            )
            open_faults.add(index)
        elif kind == "back":
            for name in fault.nodes:
                lost[name] -= 1
            for spare, covered in list(covering.items()):
                if covered == index:
                    del covering[spare]  # back in the pool once the node it stood in for serves (a person's step)
            open_faults.discard(index)
        capacity = sum(rps[n.name] for n in inputs.nodes if _serves(n.name, n.spare, lost, covering))
        ratio = capacity / inputs.required_rps if inputs.required_rps > 0 else float("inf")
        decision = capacity_policy.next_level(level, ratio, at, better_since, inputs.margin, inputs.hold_s)
        if decision.changed:
            changes.append(LevelChange(at, level, decision.level, round(capacity, 3), inputs.required_rps, _why(kind)))
            level = decision.level
            for i in open_faults | {index}:
                faults[i].peak_level = max(faults[i].peak_level, level)
        better_since = decision.better_since
        if better_since is not None and kind != "hold":
            heapq.heappush(events, (better_since + inputs.hold_s, seq, "hold", index))  # look again after the hold
            seq += 1
    for f in faults:
        covered_at_once = f.spare is not None and len(f.nodes) == 1
        f.capacity_restored_at = f.detected_at + PROMOTE_S if covered_at_once else f.back_at
        # Latency recovers once the spare serves, or once the level sheds what the survivors cannot carry.
        f.recovered_at = (f.capacity_restored_at if covered_at_once else f.detected_at) + f.settle_s
        f.closed_at = min(f.ended_at + f.close_after_s, inputs.end)
    return changes


def _serves(name: str, spare: bool, lost: dict[str, int], covering: dict[str, int]) -> bool:
    return not lost.get(name) and (not spare or name in covering)


def _why(kind: str) -> str:
    return {
        "lost": "generated history: nodes lost",
        "back": "generated history: nodes back in routing",
        "hold": "generated history: capacity back for the hold",
    }[kind]
