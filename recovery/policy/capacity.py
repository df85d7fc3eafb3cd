"""Capacity and degradation levels (source document 003).

The control plane computes the throughput the healthy nodes can carry while
meeting the latency SLOs, compares it with the throughput the SLO settings
require, and sets a degradation level from the ratio:

    ratio ≥ 1 → 0, ≥ 0.75 → 1, ≥ 0.5 → 2, ≥ 0.25 → 3, else 4

Level 1 cuts the nodes' batch limit to 0.75; level 2 also sheds best-effort
traffic; level 3 cuts the batch to 0.5 and doubles the latency SLOs; level 4
rejects new requests while the ones in flight finish. Levels rise at once and
fall only after the ratio has cleared the better level's threshold by a
margin for a hold time, so they do not flap.
"""

import math
from dataclasses import dataclass

from workers.catalog import Deployment

THRESHOLDS = (1.0, 0.75, 0.5, 0.25)  # the least ratio of levels 0, 1, 2, 3
MAX_LEVEL = 4


@dataclass(frozen=True)
class Slo:
    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0
    required_rps: float = 0.0  # 0: no throughput objective, so no degradation
    avg_prompt_tokens: int = 512
    avg_output_tokens: int = 256


@dataclass(frozen=True)
class NodeCapacity:
    rps: float  # requests per second the node completes within the SLOs
    batch: int  # the decode batch it runs at to do so
    limited_by: str  # "kv" (memory), "batch limit", "tpot" (compute), "ttft"


def node_capacity(deployment: Deployment, slo: Slo, max_num_seqs: int = 128, slowdown: float = 1.0) -> NodeCapacity:
    """The throughput one node sustains within the SLOs (document 003's capacity model, per node).

    KV memory bounds the concurrent sequences (prompt plus output tokens each);
    compute bounds the decode batch whose step still meets the TPOT objective.
    Each request costs its prefill plus its share of the decode steps:

        rps = 1 / (prefill_s(P) + O · step_s(B) / B)

    with P and O the average prompt and output tokens, B the batch. `slowdown`
    (≥ 1: the node's measured step time over the model's, e.g. a throttled GPU)
    stretches both. A node whose prefill alone misses the TTFT objective, or
    whose single-sequence step misses TPOT, contributes nothing.
    """
    slowdown = max(1.0, slowdown)
    per_sequence = slo.avg_prompt_tokens + slo.avg_output_tokens
    kv_limit = deployment.kv_capacity_tokens // max(per_sequence, 1)
    limit, limited_by = (kv_limit, "kv") if kv_limit < max_num_seqs else (max_num_seqs, "batch limit")
    if limit < 1:
        return NodeCapacity(0.0, 0, "kv")
    context = slo.avg_prompt_tokens + slo.avg_output_tokens // 2  # a sequence's mean context while it decodes
    tpot_s = slo.tpot_ms / 1000

    def step(batch: int) -> float:  # with the tensor-parallel all-reduces, as the node steps
        return deployment.step_s(0, 0, batch, batch * context) * slowdown

    if step(1) > tpot_s:
        return NodeCapacity(0.0, 0, "tpot")
    if step(limit) > tpot_s:  # the step grows with the batch: the largest batch within TPOT
        low, high = 1, limit
        while low < high:
            mid = (low + high + 1) // 2
            if step(mid) <= tpot_s:
                low = mid
            else:
                high = mid - 1
        limit, limited_by = low, "tpot"
    prefill = deployment.step_s(slo.avg_prompt_tokens, 0, 0, 0) * slowdown
    if prefill * 1000 > slo.ttft_ms:
        return NodeCapacity(0.0, limit, "ttft")
    return NodeCapacity(1 / (prefill + slo.avg_output_tokens * step(limit) / limit), limit, limited_by)


SLOWDOWN_DEADBAND = 1.15  # within this of the model, a step's excess is measurement jitter, not the GPU


def slowdown(deployment: Deployment, step_ms: float, batch: int, context_tokens: int) -> float:
    """How much slower the node ran its last decode-only step than the model says (1 when idle or unknown).

    `step_ms` is a step without a prefill chunk: a mixed step is long by design. A node
    within 15% of the model counts as running at full speed, so that capacity does not
    jitter with a real engine's step times; a throttled GPU, a slow one or a tensor-parallel
    group fallen back to PCIe (1.5× and more) shows plainly.
    """
    if step_ms <= 0 or batch <= 0:
        return 1.0
    model = deployment.step_s(0, 0, batch, context_tokens) * 1000
    ratio = step_ms / model if model > 0 else 1.0
    return ratio if ratio >= SLOWDOWN_DEADBAND else 1.0


# --- levels -------------------------------------------------------------------------------------------
def level_for(ratio: float) -> int:
    """Document 003's level for capacity ÷ required throughput."""
    if math.isnan(ratio):
        raise ValueError("capacity ratio is NaN")
    for level, least in enumerate(THRESHOLDS):
        if ratio >= least:
            return level
    return MAX_LEVEL


@dataclass(frozen=True)
class LevelDecision:
    level: int
    better_since: float | None  # since when the ratio has justified a lower level (hysteresis)
    changed: bool


def next_level(
    current: int, ratio: float, now: float, better_since: float | None, margin: float = 0.05, hold_s: float = 30.0
) -> LevelDecision:
    """The level after one evaluation, with hysteresis.

    Worse at once. Better only when the ratio, less `margin` (a share of it),
    still reaches a lower level, and has done so continuously for `hold_s`.
    """
    target = level_for(ratio)
    if target >= current:
        return LevelDecision(target, None, target != current)
    cleared = level_for(ratio / (1 + margin))
    if cleared >= current:
        return LevelDecision(current, None, False)
    since = better_since if better_since is not None else now
    if now - since >= hold_s:
        return LevelDecision(cleared, None, True)
    return LevelDecision(current, since, False)


@dataclass(frozen=True)
class Effects:
    batch_factor: float
    shed_tiers: tuple[str, ...]  # tiers answered 429
    latency_slo_factor: float
    accept_new: bool


EFFECTS = {
    0: Effects(1.0, (), 1.0, True),
    1: Effects(0.75, (), 1.0, True),
    2: Effects(0.75, ("best_effort",), 1.0, True),
    3: Effects(0.5, ("best_effort",), 2.0, True),
    4: Effects(0.5, ("best_effort",), 2.0, False),
}

LEVEL_DOCS = {
    0: "Full capacity: every SLO can be met.",
    1: "Batch limit ×0.75 on every node.",
    2: "Batch ×0.75, best-effort traffic shed (429).",
    3: "Batch ×0.5, best-effort shed, latency SLOs ×2.",
    4: "Emergency: new requests rejected (503); requests in flight finish.",
}
