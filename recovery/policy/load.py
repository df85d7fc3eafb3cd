"""Instant and accurate load (source document 002) and the recovery load (document 000, eq. 4).

A node pushes a status at every load-changing event; the gateway adds what it
has dispatched but the node has not yet confirmed (`Pending`, Llumnix's local
account) and predicts a stale status forward to the moment it decides
(`predict`). Load is measured the way the engine spends it: prefill by the
prompt tokens not yet computed, decode by batch size plus the tokens its
sequences attend to; `routing_cost` turns both into seconds with the roofline
model, and adds the decode load itself as a share of the node's KV capacity,
so nodes of different GPUs compare and a busy node never looks as cheap as an
idle one.
"""

import bisect
import heapq
import math
import threading
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from workers.catalog import DECODE_BANDWIDTH_EFFICIENCY, PREFILL_COMPUTE_EFFICIENCY, Deployment
from workers.protocol import NodeStatus as NodeStatus  # the node's status, one schema; the gateway imports it here
from workers.protocol import RoutingStatus  # a status as NodeStatus.from_event reads it: every figure a number

INF = math.inf
DEFAULT_CHUNK_TOKENS = 2048


@dataclass
class Pending:
    """Dispatched to a node but not yet in its status: counted at dispatch, released on confirmation.

    Without it consecutive decisions see the same snapshot and all pick the same
    node (the herd effect of document 002).
    """

    requests: int = 0
    prompt_tokens: int = 0

    def add(self, prompt_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += max(0, prompt_tokens)

    def confirm(self, prompt_tokens: int) -> None:
        """The node's status now includes a request of `prompt_tokens`: stop counting it here."""
        self.requests = max(0, self.requests - 1)
        self.prompt_tokens = max(0, self.prompt_tokens - max(0, prompt_tokens))


# --- the node's clock ----------------------------------------------------------------


class ClockOffset:
    """A node's status times on the gateway's clock: hosts' clocks disagree, and prediction must not.

    A status's `at` is the node's own clock. The offset to the gateway's is measured
    from the statuses themselves: the least (received - at) over the last `window`
    statuses is the node's clock error plus the shortest trip a status made. A status
    pushed at once arrives within a millisecond or so; one held back in a queue or a
    socket shows a larger difference and is not taken as the offset, so it is dated
    when it was taken, not when it came in, and predicted forward accordingly. The
    window lets the offset follow a clock that is stepped (NTP).
    """

    def __init__(self, window: int = 64):
        self.window = window
        self._count = 0
        # (sample number, received - at) of the window, the differences increasing: its minimum comes first
        self._low: deque[tuple[int, float]] = deque()

    def observe(self, at: float, received: float) -> float:
        """`at`, a status's time on its node's clock, on the gateway's clock; `received` is when it came in here."""
        difference = received - at
        while self._low and self._low[-1][1] >= difference:
            self._low.pop()
        self._low.append((self._count, difference))
        self._count += 1
        while self._low[0][0] <= self._count - 1 - self.window:
            self._low.popleft()
        return at + self._low[0][1]

    @property
    def offset(self) -> float | None:
        """Seconds to add to the node's clock to read the gateway's (with the shortest trip); None before a status."""
        return self._low[0][1] if self._low else None


# --- forward prediction and cost ----------------------------------------------------


def _step_s(status: RoutingStatus, deployment: Deployment) -> float:
    """The node's step time: as it reported, else the roofline's decode step for its batch."""
    if status.step_ms > 0:
        return status.step_ms / 1000
    return deployment.decode_step_s(max(status.decode_batch, 1), status.decode_context_tokens)


def _advance(status: RoutingStatus, now: float, step_s: float, chunk_tokens: int) -> tuple[int, int, int]:
    """(uncomputed prefill, decode context, decode batch) after the steps run since the status was taken."""
    uncomputed, context, batch = status.uncomputed_prefill_tokens, status.decode_context_tokens, status.decode_batch
    elapsed = now - status.at
    if elapsed <= 0 or step_s <= 0:
        return uncomputed, context, batch
    steps = elapsed / step_s
    computed = min(uncomputed, int(chunk_tokens * steps))
    context += computed + int(batch * steps)
    if computed == uncomputed and status.running > batch:
        batch = status.running  # no prefill left: the requests that were prefilling decode now
    return uncomputed - computed, context, batch


def predict(
    status: RoutingStatus, now: float, deployment: Deployment, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> RoutingStatus:
    """Forward-predict a stale status to `now` (document 002, status forward-prediction).

    Each step computes up to `chunk_tokens` of pending prefill and grows every
    decode sequence by one token. Prompt tokens computed in the window join
    the context they will be attended as, and once no prefill is left the
    requests that were prefilling join the decode batch: predicted load never
    falls below what the status reported, so a node busy prefilling never
    looks idle. Requests that finish in the window are not removed: the next
    status says so. `status.at` and `now` must be on one clock: the gateway dates
    a node's status on its own (`ClockOffset`), as a node's clock may be off.
    """
    uncomputed, context, batch = _advance(status, now, _step_s(status, deployment), chunk_tokens)
    return replace(
        status, at=now, uncomputed_prefill_tokens=uncomputed, decode_context_tokens=context, decode_batch=batch
    )


def prefill_load(status: RoutingStatus) -> int:
    """Prefill compute load: prompt tokens not yet computed (cached prefixes cost nothing)."""
    return status.uncomputed_prefill_tokens


def decode_load(status: RoutingStatus) -> int:
    """Decode compute load: batch size (weight and expert reads) plus tokens attended to."""
    return status.decode_batch + status.decode_context_tokens


def _cost(
    deployment: Deployment, uncomputed: int, queued: int, context: int, pending: Pending, prompt_tokens: int
) -> float:
    new_tokens = pending.prompt_tokens + prompt_tokens
    batch = queued + pending.requests + 1
    context += new_tokens
    # the same operations in the same order as _Index.search, which must match to the last bit
    return (
        deployment.prefill_s(uncomputed + new_tokens)
        + deployment.decode_step_s(batch, context)
        + deployment.decode_step_s(1, 0) * (batch + context) / deployment.kv_capacity_tokens
    )


def routing_cost(status: RoutingStatus, pending: Pending, deployment: Deployment, prompt_tokens: int) -> float:
    """Seconds a new request would wait for its prefill, plus one decode step after
    it, plus the decode load it joins as a share of the node's KV capacity:

        prefill_s(U + P + p) + decode_step_s(B + 1 + n, C + P + p)
            + idle_step * (B + 1 + n + C + P + p) / K

    U is the node's uncomputed prefill tokens, B its decode batch plus waiting
    requests, C its decode context tokens (of the status as given: `choose_node`
    predicts it forward first), P and n the prompt tokens and requests dispatched
    to it unconfirmed (`Pending`), p the new prompt's tokens, idle_step the
    deployment's decode step with nothing else (`decode_step_s(1, 0)`) and K its
    KV capacity in tokens.

    The last term is document 002's decode load (batch size plus the sum of
    sequence lengths) once the request and the unconfirmed ones are admitted.
    The roofline alone does not see it: at small batches a decode step is
    memory-bound, one pass over the weights, so it costs nearly the same at
    batch 1 and batch 7, and a node running six long requests looked as cheap
    as an identical idle one. Counted against the node's own KV capacity, a
    node whose decode load fills it costs one more idle step, so heterogeneous
    GPUs compare by the share of their own capacity in use. A node not serving
    (loading, draft-ready) costs infinity.
    """
    if status.model_state != "serving":
        return INF
    return _cost(
        deployment,
        status.uncomputed_prefill_tokens,
        status.decode_batch + status.waiting,
        status.decode_context_tokens,
        pending,
        prompt_tokens,
    )


# --- choosing a node -------------------------------------------------------------------


def _plain_choose_node(candidates, prompt_tokens, now, exclude=()):
    """The definition of `choose_node`, one node at a time (the tests hold the fast one to it)."""
    best_name, best = None, INF
    for name, (status, pending, deployment, weight) in candidates.items():
        if not weight > 0 or name in exclude:
            continue
        cost = routing_cost(predict(status, now, deployment), pending, deployment, prompt_tokens) / weight
        if cost < best or (cost == best and best_name is not None and name < best_name):
            best_name, best = name, cost
    return best_name


# A node is pruned only when its bound exceeds the best cost by this factor: the bound and
# the cost round differently, by far less than this, so pruning never changes the answer.
_MARGIN = 1 + 1e-9


class _Roofline:
    """A Deployment's prefill_s and decode_step_s with its constants computed once.

    The same floating-point operations in the same order as workers.catalog, so
    the results are identical (the tests hold it to that), at a fifth of the
    time: the catalog recomputes its properties on every call.
    """

    def __init__(self, deployment: Deployment):
        m = deployment.model
        self.deployment = deployment
        self.two_params = 2 * m.active_params
        self.attention = 4 * m.layers * m.q_heads * m.head_dim  # FLOPs per query token per attended token
        self.kv = m.kv_bytes_per_token
        self.flops_rate = deployment.peak_flops * PREFILL_COMPUTE_EFFICIENCY
        self.byte_rate = deployment.bandwidth * DECODE_BANDWIDTH_EFFICIENCY
        self.weights = None if m.experts else m.weight_bytes  # MoE: depends on the batch
        self.prefill_token_s = (self.two_params / self.flops_rate, self.kv / self.byte_rate)
        self._moe_weights: dict[int, float] = {}
        # routing_cost's decode-load term: idle_step * decode load / kv_tokens, that is at
        # least load_slope per unit of decode load (batch or context token)
        self.idle_step = self.decode_step_s(1, 0)
        self.kv_tokens = deployment.kv_capacity_tokens
        self.load_slope = self.idle_step / self.kv_tokens

    def weight_bytes(self, batch: int) -> float:
        if self.weights is not None:
            return self.weights
        w = self._moe_weights.get(batch)
        if w is None:
            w = self._moe_weights[batch] = self.deployment._weight_bytes_read(batch)
        return w

    def prefill_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        flops = self.two_params * tokens + self.attention * tokens * (0 + tokens / 2)
        weights = self.weights if self.weights is not None else self.weight_bytes(tokens)
        bytes_read = weights + (0 + tokens) * self.kv
        return max(flops / self.flops_rate, bytes_read / self.byte_rate)

    def prefill_parts(self, tokens: int) -> tuple[float, float, float]:
        """(prefill_s, its compute part, its memory part); more tokens add at least
        `prefill_token_s` per token to each part."""
        if tokens <= 0:
            return 0.0, 0.0, 0.0
        flops = self.two_params * tokens + self.attention * tokens * (0 + tokens / 2)
        weights = self.weights if self.weights is not None else self.weight_bytes(tokens)
        compute, memory = flops / self.flops_rate, (weights + (0 + tokens) * self.kv) / self.byte_rate
        return max(compute, memory), compute, memory

    def queue_floor(self, tokens: int) -> float:
        """Seconds that `tokens` queued ahead of a prompt add to its prefill_s at least, whatever the prompt: the
        memory part grows by the memory rate per token; the compute part by the compute rate, which counts in full
        unless the prompt's own prefill was memory-bound, by at most the weights' read time (a dense model, whose
        compute part grows faster than its memory part, so the prompt's memory margin is largest at 0 tokens)."""
        compute_rate, memory_rate = self.prefill_token_s
        floor = tokens * memory_rate
        if self.weights is not None and compute_rate >= memory_rate:
            floor = max(floor, tokens * compute_rate - self.weights / self.byte_rate)
        return floor

    def decode_step_s(self, batch: int, context: int) -> float:
        return self.decode_parts(batch, context)[0]

    def decode_parts(self, batch: int, context: int) -> tuple[float, float]:
        """(decode step seconds, seconds per extra context token on the bound that sets it)."""
        if batch <= 0:
            return 0.0, 0.0
        compute = (self.two_params * batch + self.attention * 1 * context) / self.flops_rate
        weights = self.weights if self.weights is not None else self.weight_bytes(batch)
        memory = (weights + context * self.kv) / self.byte_rate
        if compute >= memory:
            return compute, self.attention / self.flops_rate
        return memory, self.kv / self.byte_rate


_rooflines: dict[int, _Roofline] = {}


def _roofline(deployment: Deployment) -> _Roofline:
    roof = _rooflines.get(id(deployment))
    if roof is None or roof.deployment is not deployment:
        if len(_rooflines) >= 256:
            _rooflines.clear()
        roof = _rooflines[id(deployment)] = _Roofline(deployment)
    return roof


def _changed_slots(new: list, old: list, chunk: int = 32) -> list[int]:
    """Positions where `new` and `old` (same length) hold unequal entries.

    Between two decisions only a few of a fleet's entries are replaced, so the
    lists are compared a chunk at a time (in C, identity first) and only a
    chunk that differs is looked at entry by entry.
    """
    out = []
    for start in range(0, len(new), chunk):
        end = start + chunk
        if new[start:end] != old[start:end]:
            out += [i for i in range(start, min(end, len(new))) if new[i] != old[i]]
    return out


class _Index:
    """A candidates mapping's nodes, grouped and ordered by a lower bound on their cost.

    A group is a deployment, a weight and the resource (compute or memory) that
    bounds its decode step. Within a group every node's cost, over the weight,
    is at least (prefill_s(p) + bound + slope·p) / weight, where

        bound = decode_step_s(B + 1, C0) + idle_step·(B + 1 + C0) / K
        slope = decode slope + idle_step / K

    B is the node's batch plus waiting and C0 its last reported context; the
    decode slope is the seconds per context token of the resource that sets
    decode_step_s(B + 1, C0) (attention FLOPs over the FLOP rate, or KV bytes
    over the byte rate), and idle_step / K the decode-load term's seconds per
    batch or context token (a per-deployment constant, `_Roofline.load_slope`).
    Prediction, pending work and the prompt only add to the prefill queue, the
    batch and the context: both roofline bounds and the load term are
    nondecreasing in the batch and linear in the context, so decode_step_s
    grows by at least the decode slope per context token and the load term by
    exactly idle_step / K per batch or context token. The bound is therefore a
    true lower bound; it and the cost round differently by a few ulps, which
    `_MARGIN` covers. At a decision a node's bound is sharpened with its own
    prediction and pending work: slope·(grown context + P) + load_slope·n, and
    the prefill queue's increase. The bound's per-node part is computed once per
    status, so a decision reads pending work and `now` only for the few nodes
    whose bound beats the best cost found.

    A group's nodes are ordered by their bound plus a prefill floor: what the
    prompt tokens the node will still have to prefill at a horizon add to a new
    prompt's prefill at least (`_Roofline.queue_floor`). The queue only shrinks
    as time passes, so the floor holds for every decision up to the horizon,
    which is set halfway to when the prediction has the queue empty; a decision
    after it first sets a new floor from its own time. Without it a node busy
    prefilling looks as cheap as one that is not and is visited by every
    decision until its next status: in a large fleet, the hundreds of nodes
    that just took a request. The bound in `where` is the floorless one, good
    until the next status.
    """

    def __init__(self, names: list, values: list):
        self.names = names
        self.values = values
        self.where: list[tuple | None] = [None] * len(values)  # (group, decode bound)
        self.step: list[float] = [0.0] * len(values)
        # The (decode context, decode batch) each bound was computed at: the status's, or a prediction of it that a
        # decision found and kept (`_rebase`): a node's predicted load only grows until its next status.
        self.basis: list[tuple[int, int]] = [(0, 0)] * len(values)
        self.rebased: set[int] = set()
        self.rebased_for = -INF  # the latest decision time a bound was rebased for
        # Bounds a search found it could sharpen, left for `tidy` (node -> (context, batch, decision time)); a new
        # status for the node drops its entry, as the prediction was of the old one.
        self.deferred: dict[int, tuple[int, int, float]] = {}
        self.groups: dict[tuple, list] = {}  # (roofline id, weight, slope) -> [(bound + floor, name, i)]
        self.meta: dict[tuple, tuple[_Roofline, float, float]] = {}
        self.floor: list[float] = [0.0] * len(values)  # seconds of prefill the node has left at its horizon
        self.horizon: list[float] = [INF] * len(values)  # the last decision time its floor holds for
        self.lapses: list[tuple[float, int]] = []  # (horizon, node) of the floors, soonest first
        for i, entry in enumerate(values):
            self._measure(i, entry)
            where = self.where[i]
            if where is not None:
                group, bound = where
                self.groups[group].append((bound + self.floor[i], names[i], i))
        for members in self.groups.values():
            members.sort()

    def _measure(self, i: int, entry) -> None:
        status, _pending, deployment, weight = entry
        roof = _roofline(deployment)
        if status.step_ms > 0:
            self.step[i] = status.step_ms / 1000
        else:
            self.step[i] = roof.decode_step_s(max(status.decode_batch, 1), status.decode_context_tokens)
        if not weight > 0 or status.model_state != "serving":
            self.where[i] = None  # never chosen
            self.floor[i], self.horizon[i] = 0.0, INF
            return
        self._bound(i, roof, weight, status.decode_context_tokens, status.decode_batch, status.waiting)
        self._set_floor(i, roof, status.at)

    def _set_floor(self, i: int, roof: "_Roofline", since: float) -> None:
        """Node `i`'s prefill floor from `since` on: its predicted prefill queue halfway from `since` to when the
        prediction has it empty (`_advance` computes chunk tokens per step), valid for decisions until then."""
        status = self.values[i][0]
        step = self.step[i]
        queue = status.uncomputed_prefill_tokens
        start = max(since, status.at)
        empty = status.at + step * queue / DEFAULT_CHUNK_TOKENS if queue > 0 and step > 0 else -INF
        if empty > start:  # (a horizon before `since` would lapse at once, again and again)
            horizon = start + (empty - start) / 2
            left = _advance(status, horizon, step, DEFAULT_CHUNK_TOKENS)[0]
            if left > 0:
                self.floor[i], self.horizon[i] = roof.queue_floor(left), horizon
                heapq.heappush(self.lapses, (horizon, i))
                return
        self.floor[i], self.horizon[i] = 0.0, INF

    def _bound(self, i: int, roof: "_Roofline", weight: float, context: int, decode_batch: int, waiting: int) -> None:
        self.basis[i] = (context, decode_batch)
        self.rebased.discard(i)
        batch = decode_batch + waiting + 1
        decode, slope = roof.decode_parts(batch, context)
        bound = decode + roof.idle_step * (batch + context) / roof.kv_tokens
        slope += roof.load_slope
        group = (id(roof), weight, slope)
        if group not in self.groups:
            self.groups[group] = []
            self.meta[group] = (roof, weight, slope)
        self.where[i] = (group, bound)

    def refresh(self, values: list) -> None:
        """Re-measure the entries that changed since the last decision.

        Entries compare in C, identity first: a caller that builds new tuples of the same
        status, Pending, deployment and weight objects for every call loses little.
        """
        for i in _changed_slots(values, self.values):
            self.replace(i, values[i])
        self.values = values

    def replace(self, i: int, entry) -> None:
        """Entry `i` is now `entry`: re-measure it and move it within its group."""
        before, floor = self.where[i], self.floor[i]
        self.values[i] = entry
        self.deferred.pop(i, None)
        self._measure(i, entry)
        self._move(i, before, floor)

    def _rebase(self, i: int, context: int, decode_batch: int, now: float) -> None:
        """Node `i`'s bound, computed anew at its load predicted for a decision at `now` (context, batch): tighter
        than the status's, and still a lower bound for every later decision until its next status, as prediction
        only grows. Nodes whose statuses age between decisions are otherwise sharpened at every one."""
        before, floor = self.where[i], self.floor[i]
        status, _pending, deployment, weight = self.values[i]
        roof = _roofline(deployment)
        self._bound(i, roof, weight, context, decode_batch, status.waiting)
        self._set_floor(i, roof, now)
        self.rebased.add(i)
        self._move(i, before, floor)

    def _move(self, i: int, before: tuple | None, floor: float) -> None:
        """Node `i` within its group (or into another) after its bound changed from `before` and its floor from
        `floor`."""
        after = self.where[i]
        if before == after and floor == self.floor[i]:
            return
        name = self.names[i]
        if after is not None:
            group, bound = after
            bisect.insort(self.groups[group], (bound + self.floor[i], name, i))
        if before is not None:
            members = self.groups[before[0]]
            del members[bisect.bisect_left(members, (before[1] + floor, name, i))]
            if not members:  # a weight level or a deployment no node has any more
                del self.groups[before[0]], self.meta[before[0]]

    def _lapse_floors(self, now: float) -> None:
        """New floors, from `now`, for the nodes whose floor does not hold for a decision at `now`."""
        while self.lapses and self.lapses[0][0] < now:
            horizon, i = heapq.heappop(self.lapses)
            if self.horizon[i] != horizon or self.where[i] is None:
                continue  # replaced since by a later floor, or by a status
            floor = self.floor[i]
            self._set_floor(i, _roofline(self.values[i][2]), now)
            self._move(i, self.where[i], floor)

    def tidy(self) -> None:
        """Sharpen the bounds the searches since the last call found they could (`search(..., upkeep=False)`)."""
        deferred, self.deferred = self.deferred, {}
        for i, (context, batch, now) in deferred.items():
            self._rebase(i, context, batch, now)
            self.rebased_for = max(self.rebased_for, now)

    def search(self, prompt_tokens: int, now: float, exclude: Collection[str], upkeep: bool = True) -> str | None:
        """The least-cost node: groups in order of their best bound, each scanned until its
        bound passes the best cost found. A node's bound is first sharpened with its own
        prediction and pending work (a few multiplications); only a node that could still win
        is costed with the roofline, and that cost is routing_cost's to the last bit.

        The nodes whose sharpened bound ruled them out keep it for later searches: at once, or with
        `upkeep=False` at the next `tidy`, which a caller runs once the request is on its way. The
        answer is the same either way; only the next searches' work differs."""
        if now < self.rebased_for:  # a decision for an earlier time: the rebased bounds may overshoot it
            for i in list(self.rebased):
                before, floor = self.where[i], self.floor[i]
                self._measure(i, self.values[i])
                self._move(i, before, floor)
            self.rebased_for = -INF
        self._lapse_floors(now)
        prefill = {}  # per deployment: the prompt's own prefill and its compute and memory parts
        heads = []
        for group, members in self.groups.items():
            if members:
                roof, weight, slope = self.meta[group]
                if roof not in prefill:
                    prefill[roof] = roof.prefill_parts(prompt_tokens)
                shift = prefill[roof][0] + slope * prompt_tokens
                heads.append(((shift + members[0][0]) / weight, group, shift))
        heads.sort()
        best_name, best = None, INF
        values, steps, basis, where = self.values, self.step, self.basis, self.where
        stale = []  # nodes the sharpened bound ruled out: rebased after the search, not while it walks
        for head, group, shift in heads:
            if head > best * _MARGIN:
                break
            roof, weight, slope = self.meta[group]
            own_prefill, compute_p, memory_p = prefill[roof]
            compute_rate, memory_rate = roof.prefill_token_s
            load_slope, idle_step, kv_tokens = roof.load_slope, roof.idle_step, roof.kv_tokens
            cut = best * _MARGIN * weight  # a node whose cost, before the weight, passes this loses
            for bound_and_floor, name, i in self.groups[group]:
                if shift + bound_and_floor > cut:
                    break
                if name in exclude:
                    continue
                low = shift + where[i][1]  # the floorless bound: the queue's increase is added below, as predicted
                status, pending, _deployment, _weight = values[i]
                uncomputed, context_now, batch_now = _advance(status, now, steps[i], DEFAULT_CHUNK_TOKENS)
                basis_context, basis_batch = basis[i]
                grown = context_now - basis_context
                waiting_tokens = pending.prompt_tokens
                queued = uncomputed + waiting_tokens  # prefill ahead of the prompt
                # decode >= the bound's branch at the longer context, the load term grows by
                # load_slope per token and per request; prefill >= its parts' slopes
                low += slope * (grown + waiting_tokens) + load_slope * (pending.requests + batch_now - basis_batch)
                if queued:
                    low += max(compute_p + queued * compute_rate, memory_p + queued * memory_rate) - own_prefill
                if low > cut:
                    if grown or batch_now != basis_batch:
                        stale.append((i, context_now, batch_now))
                    continue
                new_tokens = waiting_tokens + prompt_tokens
                prefill_s = own_prefill if queued == 0 else roof.prefill_s(uncomputed + new_tokens)
                batch = batch_now + status.waiting + pending.requests + 1
                context = context_now + new_tokens
                # routing_cost's operations in its order, so the cost is the same to the last bit
                cost = (
                    prefill_s + roof.decode_step_s(batch, context) + idle_step * (batch + context) / kv_tokens
                ) / weight
                if cost < best or (cost == best and best_name is not None and name < best_name):
                    best_name, best = name, cost
                    cut = best * _MARGIN * weight
        if not upkeep:
            for i, context, batch in stale:
                self.deferred[i] = (context, batch, now)
            return best_name
        for i, context, batch in stale:
            self._rebase(i, context, batch, now)
        if stale:
            self.rebased_for = max(self.rebased_for, now)
        return best_name


_indexes: dict[int, _Index] = {}
_last: list[_Index] = []
_lock = threading.Lock()


def _index_for(candidates: Mapping, names: list, values: list) -> _Index:
    """The index kept for this mapping, brought up to date; a mapping rebuilt per call
    with the same names reuses the last one, so only its changed entries are measured."""
    index = _indexes.get(id(candidates))
    if index is None or index.names != names:
        index = _last[0] if _last and _last[0].names == names else None
        if len(_indexes) >= 64:
            _indexes.clear()
        if index is None:
            index = _Index(names, values)
        _indexes[id(candidates)] = index
    index.refresh(values)
    _last[:] = [index]
    return index


def choose_node(
    candidates: Mapping[str, tuple[RoutingStatus, Pending, Deployment, float]],
    prompt_tokens: int,
    now: float,
    exclude: Collection[str] = (),
) -> str | None:
    """The node where a new request of `prompt_tokens` costs least, for its routing weight.

    Each value is (status, pending, deployment, weight in (0, 1]); the cost is
    routing_cost of the status predicted to `now`, divided by the weight, so a
    SUSPICIOUS node at weight 0.5 must be twice as good to be chosen. Weight
    <= 0, excluded names and nodes that are not serving are never chosen; ties
    go to the smallest name; None when nothing is left.

    Fast for large fleets: nodes are searched in order of a lower bound kept
    per mapping (see `_Index`), and the search stops at the first bound above
    the best cost found, typically after a handful of nodes. Keep one mapping
    per pool and replace an entry's tuple when its status, deployment or weight
    changes (Pending is read live); a mapping rebuilt for every call is still
    answered correctly, only slower. Weights are expected in a few levels
    (1, 0.5, 0): each level is a group of the index.
    """
    names = list(candidates)
    values = list(candidates.values())
    with _lock:
        return _index_for(candidates, names, values).search(prompt_tokens, now, exclude)


class NodeIndex:
    """`choose_node` over a pool that changes one node at a time, as the gateway's does.

    The same search and the same answer as `choose_node` over a mapping of the
    same entries, but an entry is measured when it is replaced (`set`, at the
    moment the node's status arrives), not when a request is waiting for its
    decision. The pool's names are fixed; build a new index when they change.
    Pending work is read live at each decision, as in `choose_node`.
    """

    def __init__(self, candidates: Mapping[str, tuple[RoutingStatus, Pending, Deployment, float]]):
        names = list(candidates)
        self._slot = {name: i for i, name in enumerate(names)}
        self._index = _Index(names, list(candidates.values()))

    def __contains__(self, name: str) -> bool:
        return name in self._slot

    def set(self, name: str, entry: tuple[RoutingStatus, Pending, Deployment, float]) -> None:
        self._index.replace(self._slot[name], entry)

    def choose(self, prompt_tokens: int, now: float, exclude: Collection[str] = (), upkeep: bool = True) -> str | None:
        """The least-cost node. `upkeep=False` leaves the index's own upkeep for `tidy` (the same answer now, and
        the next searches' as fast once `tidy` has run): a caller with a request waiting runs it afterwards."""
        return self._index.search(prompt_tokens, now, exclude, upkeep)

    def tidy(self) -> None:
        self._index.tidy()


# --- recovery load (document 000) ------------------------------------------------------


def recovery_load(pages_held: float, queue_depth: float, alpha: float = 1.0, beta: float = 1.0) -> float:
    """L̂(w) = α·Σ checkpoint pages held + β·queue depth (eq. 4): how much recovery work a node would absorb."""
    return alpha * pages_held + beta * queue_depth


def pages(num_bytes: int, kv_bytes_per_block: int) -> float:
    """Checkpoint bytes in KV pages (blocks), the unit of eq. 4."""
    if kv_bytes_per_block <= 0:
        raise ValueError(f"kv_bytes_per_block must be positive, got {kv_bytes_per_block}")
    return num_bytes / kv_bytes_per_block


def holder_load(
    bytes_held: int,
    kv_bytes_per_block: int,
    queue_depth: int,
    alpha: float = 1.0,
    beta: float = 1.0,
    recent_pages: float = 0.0,
) -> float:
    """L̂ of a node from its live figures: the checkpoint bytes it holds (in pages of its model's KV, plus pages just
    placed on it that its status does not show yet) and its queue. The one place L̂ is computed from live figures:
    the gateway's placement, the control plane's assist choice and the checkpoint page all call it."""
    return recovery_load(pages(bytes_held, kv_bytes_per_block) + recent_pages, queue_depth, alpha, beta)
