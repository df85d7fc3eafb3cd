"""Recovery dispatch (source document 000, eq. 6 and Algorithm 2) with document 003's migration cost.

When a node fails, each of its in-flight requests goes either to its checkpoint
holder, which restores the KV from its own host memory, or to the least loaded
survivor, which fetches the KV from the holder or re-prefills, whichever is
cheaper. Decisions are made in order and each one raises its target's load
estimate, so a burst of interrupted requests spreads instead of piling up.
"""

import heapq
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from workers.catalog import BLOCK_TOKENS, Deployment, Placement, kv_transfer_s, node_link

METHODS = ("restore", "fetch", "reprefill")


class NoSurvivors(RuntimeError):
    """No node is left alive to take the interrupted requests."""


@dataclass(frozen=True)
class Interrupted:
    """A request cut off by a failure."""

    request_id: str
    holders: tuple[str, ...]  # in preference order
    checkpointed_tokens: int  # KV tokens the holders have; 0 if none
    context_tokens: int  # prompt plus generated tokens the client has


@dataclass
class Survivor:
    """A node that can take recovered requests, with its recovery load L̂ (eq. 4) and free KV blocks."""

    name: str
    rack: str
    l_hat: float
    free_blocks: int
    deployment: Deployment
    alive: bool = True
    # Where it sits in the fabric beyond its rack (workers.catalog.Placement): a node that does
    # not say is alone on its server and reached over InfiniBand.
    server: str = ""
    nvl_domain: str = ""
    network: str = "infiniband"
    nvlink_down: bool = False

    @property
    def placement(self) -> Placement:
        return Placement(self.rack, self.server, self.nvl_domain, self.network, self.nvlink_down)


@dataclass(frozen=True)
class Decision:
    request_id: str
    target: str
    method: str  # "restore", "fetch" or "reprefill"
    source: str | None  # the holder the KV comes from, for restore and fetch
    reason: str  # one sentence for the incident timeline


def blocks(tokens: int) -> int:
    """KV blocks (pages) for `tokens` tokens."""
    return math.ceil(max(0, tokens) / BLOCK_TOKENS)


def transfer_cost(context_tokens: int, kv_tokens: int, source: Placement, target: Survivor) -> tuple[float, float]:
    """(seconds to get the request ready by moving its KV, seconds to re-prefill it) on `target`.

    Moving covers the KV of `kv_tokens` over the link between the two nodes'
    places in the fabric (workers.catalog.node_link: NVLink in one NVLink
    domain, PCIe in one server, the network in one rack, a third of it
    across the shared spine) and the prefill of the context tokens the KV
    lacks: a checkpoint a few tokens behind still costs a full pass over the
    weights to catch up, which is why a short request re-prefills rather
    than fetches.
    """
    deployment = target.deployment
    link, share = node_link(source, target.placement, deployment.gpu)
    kv_tokens = max(0, min(kv_tokens, context_tokens))
    move_s = kv_transfer_s(deployment.model.kv_bytes_per_token * kv_tokens, link, share)
    catch_up_s = deployment.prefill_s(context_tokens - kv_tokens, kv_tokens)
    return move_s + catch_up_s, deployment.prefill_s(context_tokens)


def migration_method(
    context_tokens: int, kv_tokens: int, source: Placement, target: Survivor
) -> tuple[str, float, float]:
    """For a live migration (the source still up): ("transfer" or "reprefill", transfer_s, reprefill_s).

    Transfer when moving the KV is faster than re-prefilling and the target
    has free blocks for the whole context; else re-prefill (document 003).
    """
    transfer_s, reprefill_s = transfer_cost(context_tokens, kv_tokens, source, target)
    ok = transfer_s < reprefill_s and target.free_blocks >= blocks(context_tokens)
    return ("transfer" if ok else "reprefill"), transfer_s, reprefill_s


def theta_for(l_hats: Sequence[float], factor: float = 2.0, floor: float = 1.0) -> float:
    """θ of eq. 6: `factor` times the mean L̂ of the alive nodes ("2× normal queue depth"), at least `floor`."""
    if not l_hats:
        return floor
    return max(floor, factor * sum(l_hats) / len(l_hats))


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


class _Loads:
    """The survivors' L̂ and free blocks as the plan goes, with the least loaded at hand (a lazy heap)."""

    def __init__(self, survivors: Mapping[str, Survivor], failed: Collection[str]):
        self.nodes = {name: s for name, s in survivors.items() if s.alive and name not in failed}
        self.l_hat = {name: float(s.l_hat) for name, s in self.nodes.items()}
        self.free = {name: s.free_blocks for name, s in self.nodes.items()}
        self.heap = [(load, name) for name, load in self.l_hat.items()]
        heapq.heapify(self.heap)

    def least(self) -> str:
        while True:
            load, name = self.heap[0]
            if load == self.l_hat[name]:
                return name
            heapq.heappop(self.heap)  # stale: the node has taken work since

    def take(self, name: str, pages: int, alpha: float, beta: float) -> None:
        """Algorithm 2's update: one more queued request and its pages."""
        self.l_hat[name] += beta * 1 + alpha * pages
        self.free[name] = max(0, self.free[name] - pages)
        heapq.heappush(self.heap, (self.l_hat[name], name))

    def survivor(self, name: str) -> Survivor:
        return replace(self.nodes[name], l_hat=self.l_hat[name], free_blocks=self.free[name], alive=True)


def plan_recovery(
    interrupted: Sequence[Interrupted],
    survivors: Mapping[str, Survivor],
    failed: Collection[str],
    theta: float,
    tau: int = 512,
    alpha: float = 1.0,
    beta: float = 1.0,
) -> list[Decision]:
    """One Decision per interrupted request, in order (eq. 6, Algorithm 2).

    To its first surviving holder when that holder is not overloaded
    (L̂ <= θ) or the checkpointed prefix is long (> τ); otherwise to the least
    loaded survivor, which fetches the KV from a holder when that beats
    re-prefilling and it has the blocks, and re-prefills when not. A holder
    that failed too is passed over for the next. `survivors` is keyed by node
    name and is not modified: the plan updates copies of the estimates.
    Raises NoSurvivors when requests are interrupted and no node is left.
    """
    failed = set(failed)
    loads = _Loads(survivors, failed)
    if interrupted and not loads.nodes:
        raise NoSurvivors(
            f"no surviving node can take {len(interrupted)} interrupted requests: every node is failed or dead"
        )
    decisions = []
    for r in interrupted:
        alive_holders = [h for h in r.holders if h in loads.nodes]
        lost = [h for h in r.holders if h not in loads.nodes]
        note = f"holder {', '.join(lost)} failed too; " if lost and alive_holders else ""
        has_kv = r.checkpointed_tokens > 0 and bool(alive_holders)
        decision = None
        if has_kv:
            h = alive_holders[0]
            load, prefix = loads.l_hat[h], r.checkpointed_tokens
            if load <= theta:
                why = (
                    f"holder {h} not overloaded (L̂ {load:.1f} <= θ {theta:.1f}); "
                    f"restore {prefix} tokens from its host memory"
                )
                decision = Decision(r.request_id, h, "restore", h, note + why)
            elif prefix > tau:
                why = (
                    f"holder {h} overloaded (L̂ {load:.1f} > θ {theta:.1f}) but its {prefix}-token prefix "
                    f"exceeds τ {tau}; restore from its host memory"
                )
                decision = Decision(r.request_id, h, "restore", h, note + why)
        if decision is None:
            decision = _to_least_loaded(r, loads, alive_holders if has_kv else [], theta, note)
        decisions.append(decision)
        loads.take(decision.target, blocks(r.context_tokens), alpha, beta)
    return decisions


def _to_least_loaded(r: Interrupted, loads: _Loads, holders: list[str], theta: float, note: str) -> Decision:
    """The other branch of eq. 6: the least loaded survivor, fetching the KV only when it pays (document 003)."""
    w = loads.least()
    target = loads.survivor(w)
    if not holders:
        lost = r.holders and r.checkpointed_tokens > 0
        why = f"holder {', '.join(r.holders)} failed too" if lost else "no checkpoint"
        where = f"re-prefill {r.context_tokens} tokens on least-loaded {w} (L̂ {target.l_hat:.1f})"
        return Decision(r.request_id, w, "reprefill", None, f"{why}; {where}")
    h = holders[0]
    over = (
        f"{note}holder {h} overloaded (L̂ {loads.l_hat[h]:.1f} > θ {theta:.1f}) "
        f"with a {r.checkpointed_tokens}-token prefix"
    )
    if w in holders:
        return Decision(
            r.request_id, w, "restore", w, f"{over}; least-loaded {w} holds a copy: restore from its host memory"
        )
    # The holder with the fastest link to w (same NVLink domain first), in preference order on a tie.
    costs = [
        (transfer_cost(r.context_tokens, r.checkpointed_tokens, loads.nodes[s].placement, target), s) for s in holders
    ]
    (fetch_s, reprefill_s), source = min(costs, key=lambda c: c[0][0])
    needed = blocks(r.context_tokens)
    if fetch_s < reprefill_s and target.free_blocks >= needed:
        why = f"fetch its KV from {source} to least-loaded {w} ({_ms(fetch_s)}, re-prefill {_ms(reprefill_s)})"
        return Decision(r.request_id, w, "fetch", source, f"{over}; {why}")
    if fetch_s >= reprefill_s:
        why = f"re-prefill ({_ms(reprefill_s)}) beats fetching from {source} ({_ms(fetch_s)})"
    else:
        why = f"{w} has {target.free_blocks} free blocks, a fetch needs {needed}"
    return Decision(r.request_id, w, "reprefill", None, f"{over}; re-prefill on least-loaded {w}: {why}")
