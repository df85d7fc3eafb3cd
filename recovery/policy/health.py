"""Node health (source document 003): canary verdicts, health states and routing weights, Xid severities.

A canary is a known prompt at temperature 0 whose tokens and top log
probabilities were recorded on a node known to be good (the golden run). A
check fails on no response, a timeout, a token that differs, a top logprob
outside its recorded range, or a latency over 3× the node's moving baseline, scaled by how much slower
than their own baselines the fleet's other canaries answer now (a host or control plane under load slows every
canary alike; a sick GPU slows its own).
One failure makes a node SUSPICIOUS (routing weight 0.5), three in a row
UNHEALTHY (weight 0, a drain is proposed); a pass makes a SUSPICIOUS node
HEALTHY again, while an UNHEALTHY one comes back only through its circuit
breaker's half-open trial, and never while a drain holds it.
Telemetry feeds the same machine: a CRITICAL Xid makes a node UNHEALTHY at
once; WARN Xids are shown for triage only.
"""

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from recovery.policy import breaker as breakers

HEALTHY = "healthy"
SUSPICIOUS = "suspicious"
UNHEALTHY = "unhealthy"
DRAINING = "draining"
STATES = (HEALTHY, SUSPICIOUS, UNHEALTHY, DRAINING)

# Document 003's worker status gauge: 0 healthy ... 4 dead (a node whose lifecycle is DOWN or LEFT).
STATUS_CODE = {HEALTHY: 0, SUSPICIOUS: 1, UNHEALTHY: 2, DRAINING: 3}
DEAD_CODE = 4

EMA_ALPHA = 0.1  # document 003's moving-average weight for the latency baseline
# The latency check needs a baseline learnt from this many passing canaries: a node's first answers (a cold
# engine, a host still starting its fleet) teach the baseline and are not judged against one.
BASELINE_SAMPLES = 3
# Other nodes' canaries answered within this long count as "now" for the fleet's slowness; at least MIN_PEERS of
# them, or the node is judged against its own baseline alone.
PEERS_WITHIN_S = 60.0
MIN_PEERS = 2


# --- canary verdicts --------------------------------------------------------------------------
@dataclass(frozen=True)
class GoldenToken:
    token_id: int
    top_logprob: float  # the log probability of the most likely token at this position


@dataclass(frozen=True)
class CanaryAnswer:
    """What the node answered, or None fields when it did not."""

    token_ids: tuple[int, ...]
    top_logprobs: tuple[float | None, ...]
    latency_ms: float


@dataclass(frozen=True)
class Verdict:
    passed: bool
    kind: str  # ok, no_response, timeout, token_mismatch, logprob_out_of_range, latency_spike
    detail: str


def judge_canary(
    golden: Sequence[GoldenToken] | None,
    answer: CanaryAnswer | None,
    baseline_ms: float | None,
    *,
    logprob_tolerance: float = 0.5,
    latency_factor: float = 3.0,
    min_spike_ms: float = 50.0,
    failure: str | None = None,
    fleet_factor: float = 1.0,
) -> Verdict:
    """Document 003's four checks, in its order: a response, the tokens, the logprob range, the latency.

    `failure` says how the call failed when there is no answer: "timeout",
    or a reason (no response). The logprob range is the recorded value
    ± `logprob_tolerance` at each position; the latency check needs a
    baseline (the node's moving average of passing checks) and a spike of
    at least `min_spike_ms` over it: a few milliseconds over a 10 ms baseline
    is the host's scheduling noise, not a sick GPU. `fleet_factor` (fleet_slowdown:
    how much slower than their own baselines the other nodes' canaries answer now)
    scales the limit, so a canary is slow only against what the fleet's hosts can
    do at the moment. Without a golden run (None) only the response and the latency
    are checked.
    """
    if answer is None:
        kind = "timeout" if failure and failure.startswith("timeout") else "no_response"
        return Verdict(False, kind, failure or "no answer")
    got = list(answer.token_ids)
    if golden is not None:
        expected = [g.token_id for g in golden]
        if got != expected:
            at = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
            return Verdict(
                False,
                "token_mismatch",
                f"token {at}: expected {expected[at] if at < len(expected) else 'end'}, "
                f"got {got[at] if at < len(got) else 'end'} ({len(got)} of {len(expected)} tokens)",
            )
        for i, (g, top) in enumerate(zip(golden, answer.top_logprobs)):
            if top is None or not math.isfinite(top):
                return Verdict(False, "logprob_out_of_range", f"token {i}: no top logprob reported")
            low, high = g.top_logprob - logprob_tolerance, g.top_logprob + logprob_tolerance
            if not low <= top <= high:
                return Verdict(
                    False, "logprob_out_of_range", f"token {i}: top logprob {top:.3f} outside [{low:.3f}, {high:.3f}]"
                )
        if len(answer.top_logprobs) < len(golden):
            return Verdict(
                False, "logprob_out_of_range", f"{len(answer.top_logprobs)} top logprobs for {len(golden)} tokens"
            )
    fleet_factor = max(1.0, fleet_factor)
    if (
        baseline_ms
        and answer.latency_ms > latency_factor * fleet_factor * baseline_ms
        and answer.latency_ms - baseline_ms * fleet_factor >= min_spike_ms
    ):
        limit = f"limit {latency_factor:g}×"
        if fleet_factor > 1.0:
            limit += f" of the baseline × {fleet_factor:.2f}, the other nodes' canaries' slowness now"
        return Verdict(
            False,
            "latency_spike",
            f"{answer.latency_ms:.1f} ms against a baseline of {baseline_ms:.1f} ms ({limit})",
        )
    if golden is None:
        return Verdict(True, "ok", f"answered in {answer.latency_ms:.1f} ms (no golden run yet to compare tokens with)")
    matched = "1 token matches" if len(got) == 1 else f"{len(got)} tokens match"
    return Verdict(True, "ok", f"{matched}, {answer.latency_ms:.1f} ms")


def fleet_slowdown(ratios: Sequence[float]) -> float:
    """How much slower than their own baselines the other nodes' canaries answer now: the lower median of their
    latest latency ÷ baseline ratios (so one sick peer, or half of two, never excuses a node), at least 1; 1 when
    fewer than MIN_PEERS answered lately."""
    ratios = [r for r in ratios if math.isfinite(r) and r > 0]
    if len(ratios) < MIN_PEERS:
        return 1.0
    return max(1.0, statistics.median_low(ratios))


def next_baseline(baseline_ms: float | None, latency_ms: float, alpha: float = EMA_ALPHA) -> float:
    """The moving latency baseline after a passing check (document 003: EMA with α = 0.1)."""
    if not baseline_ms:
        return latency_ms
    return alpha * latency_ms + (1 - alpha) * baseline_ms


# --- health states ------------------------------------------------------------------------------
@dataclass(frozen=True)
class HealthStep:
    state: str
    failures: int  # consecutive failures after this result
    propose_drain: bool  # the node just became UNHEALTHY: a drain should be proposed
    half_open: bool = False  # an UNHEALTHY node passed: its breaker goes half-open, the next canary is its trial


def after_canary(
    state: str,
    failures: int,
    passed: bool,
    suspicious_after: int = 1,
    unhealthy_after: int = 3,
    *,
    breaker: str = breakers.CLOSED,
    held: bool = False,
) -> HealthStep:
    """The health state after one canary result.

    HEALTHY → SUSPICIOUS after `suspicious_after` consecutive failures, →
    UNHEALTHY after `unhealthy_after`; a pass resets the count and makes a
    SUSPICIOUS node HEALTHY. An UNHEALTHY node is not returned by a pass alone
    (document 003): a pass with its breaker closed sends the breaker half-open,
    a pass with it open waits for the breaker's own timeout, and only the
    half-open trial's pass (`breaker` is HALF_OPEN) makes it HEALTHY; the
    trial's failure opens the breaker again and it stays UNHEALTHY. While a
    drain holds the node (`held`: proposed or approved, on-call is deciding or
    it runs) no pass returns it: the drain does, after its remediation.
    A DRAINING node's state belongs to its drain: results only count.
    An UNHEALTHY node stays UNHEALTHY through further failures (its drain is
    already proposed).
    """
    if state not in STATES:
        raise ValueError(f"unknown health state {state!r}: expected one of {', '.join(STATES)}")
    if breaker not in breakers.STATES:
        raise ValueError(f"unknown breaker state {breaker!r}: expected one of {', '.join(breakers.STATES)}")
    if passed:
        if state == DRAINING:
            return HealthStep(DRAINING, 0, False)
        if state == UNHEALTHY:
            if held:
                return HealthStep(UNHEALTHY, 0, False)
            if breaker == breakers.HALF_OPEN:
                return HealthStep(HEALTHY, 0, False)  # the trial passed: the breaker closes, the node returns
            return HealthStep(UNHEALTHY, 0, False, half_open=breaker == breakers.CLOSED)
        return HealthStep(HEALTHY, 0, False)
    failures += 1
    if state == DRAINING:
        return HealthStep(DRAINING, failures, False)
    if failures >= unhealthy_after:
        return HealthStep(UNHEALTHY, failures, state != UNHEALTHY)
    if failures >= suspicious_after:
        return HealthStep(SUSPICIOUS if state != UNHEALTHY else UNHEALTHY, failures, False)
    return HealthStep(state, failures, False)


def routing_weight(health: str, *, cordoned: bool = False, spare: bool = False, breaker: str = "closed") -> float:
    """What the gateways multiply a node's attractiveness by: 1, 0.5 while SUSPICIOUS, else 0.

    0 when cordoned, a hot spare, UNHEALTHY or DRAINING, or its circuit breaker is
    not closed (half-open lets only the trial canary through, not traffic).
    """
    if cordoned or spare or breaker != "closed" or health in (UNHEALTHY, DRAINING):
        return 0.0
    return 0.5 if health == SUSPICIOUS else 1.0


# --- Xid events ---------------------------------------------------------------------------------
CRITICAL = "critical"
WARN = "warn"


@dataclass(frozen=True)
class XidInfo:
    meaning: str
    action: str
    severity: str  # CRITICAL proposes a drain; WARN is shown for triage


# REFERENCE.md's table, as operators of large fleets use it.
XIDS: dict[int, XidInfo] = {
    13: XidInfo("graphics engine exception: usually the application", "restart the application", WARN),
    31: XidInfo("GPU memory page fault (MMU): usually the application", "restart the application", WARN),
    43: XidInfo("GPU stopped processing a channel (reset)", "look at the preceding Xid", WARN),
    45: XidInfo("channel torn down, usually after another Xid", "look at the preceding Xid", WARN),
    46: XidInfo("GPU stopped processing", "reset GPU", CRITICAL),
    48: XidInfo("double-bit ECC error", "drain, reset GPU", CRITICAL),
    62: XidInfo("internal micro-controller halt", "reset GPU", CRITICAL),
    63: XidInfo("row remap recorded", "reset at a convenient time", WARN),
    64: XidInfo("row remap failed", "reset GPU", CRITICAL),
    74: XidInfo("NVLink fatal error", "reset GPU; the whole NVLink domain is affected", CRITICAL),
    79: XidInfo("GPU has fallen off the bus", "reboot node", CRITICAL),
    92: XidInfo("excessive single-bit ECC rate", "watch", WARN),
    94: XidInfo("contained ECC error", "restart the application", WARN),
    95: XidInfo("uncontained ECC error", "reset GPU", CRITICAL),
    109: XidInfo("context-switch timeout", "reset GPU", CRITICAL),
    119: XidInfo("GSP RPC timeout", "reset GPU", CRITICAL),
    120: XidInfo("GSP error", "reset GPU", CRITICAL),
    154: XidInfo("the driver changed the recovery action", "follow the action it reports", CRITICAL),
}


def xid_info(code: int) -> XidInfo:
    """What an Xid code means and calls for; an unknown code is shown for triage, never acted on."""
    return XIDS.get(code, XidInfo(f"Xid {code} (not in the table)", "look it up in NVIDIA's Xid catalog", WARN))


@dataclass(frozen=True)
class XidBurst:
    """Xid events on one GPU close together: one event for the operator."""

    gpu: int
    first_at: float
    last_at: float
    codes: dict  # code -> count

    @property
    def severity(self) -> str:
        return CRITICAL if any(xid_info(c).severity == CRITICAL for c in self.codes) else WARN

    @property
    def worst(self) -> int:
        """The code that decides the action: the first critical one by number, else the most frequent."""
        critical = sorted(c for c in self.codes if xid_info(c).severity == CRITICAL)
        if critical:
            return critical[0]
        return max(sorted(self.codes), key=lambda c: self.codes[c])


def group_xids(events: Sequence[tuple[float, int, int]], window_s: float = 10.0) -> list[XidBurst]:
    """(at, gpu, code) events, in any order, grouped into bursts per GPU: an event within
    `window_s` of its GPU's previous event joins that burst."""
    bursts: list[XidBurst] = []
    open_by_gpu: dict[int, int] = {}
    for at, gpu, code in sorted(events):
        i = open_by_gpu.get(gpu)
        if i is not None and at - bursts[i].last_at <= window_s:
            b = bursts[i]
            bursts[i] = XidBurst(gpu, b.first_at, at, {**b.codes, code: b.codes.get(code, 0) + 1})
        else:
            open_by_gpu[gpu] = len(bursts)
            bursts.append(XidBurst(gpu, at, at, {code: 1}))
    return bursts
