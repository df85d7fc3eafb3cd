"""The fleet as the routing and placement policies read it, kept current by events.

A decision must take well under a millisecond at hundreds of nodes, so the
gateway does not walk its routes for every request. Each node has one entry
in a `load.NodeIndex` (its status, pending work, deployment and weight) and
one `HolderCandidate` in a `placement.HolderRanking` (its recovery load L̂,
checkpoint bytes and budget, alive or not), and an entry is replaced when
something about that node changed: a status event, a checkpoint placed on
it, such a placement aging out, the node lost or back. A status event
re-ranks the node at once, so a request waiting for its decision only
searches. What a decision itself changes (the pages it placed on its
holders, the bounds its search sharpened) is kept up to date by `tidy`,
which the gateway runs once the request is on its way; a decision that comes
first brings the holders it needs up to date itself, so every decision reads
the same figures whenever `tidy` ran. A route or setting change rebuilds the
indexes.
"""

import time
from collections import deque
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from recovery.gateway.table import RoutingView
from recovery.policy import load, placement
from recovery.protocol import Route

# Pages placed on a holder count in its L̂ at once, until its own status reports them (a
# status event comes within a few steps) or this long has passed.
RECENT_S = 2.0
# No request has this many KV pages (a 1M-token context is 65,536 blocks of 16): a figure above it is nonsense.
MAX_REQUEST_PAGES = 1e9
UNLIMITED = 1 << 62


@dataclass
class Pool:
    """One model's routable nodes."""

    nodes: load.NodeIndex
    holders: placement.HolderRanking


class FleetState:
    def __init__(self, view: RoutingView, watcher, failed: dict[str, float], clock=time.time):
        self.view = view
        self.watcher = watcher  # recovery.gateway.watch.NodeWatcher: statuses and pending work
        self.failed = failed  # node -> when this gateway lost it (the coordinator's)
        self.clock = clock  # epoch seconds, as node statuses are stamped
        self.pools: dict[str, Pool] = {}
        self._model_of: dict[str, str] = {}
        self._recent: deque[tuple[float, str, float]] = deque()  # (when, holder, pages) in time order
        self._recent_pages: dict[str, float] = {}
        self._recent_count: dict[str, int] = {}  # placements behind each sum: at 0 the sum goes, whatever rounding left
        self._stale: set[str] = set()  # holders whose L̂ moved since their candidate was made: re-ranked before a use
        self._kv: dict[str, tuple[int, int]] = {}  # model -> its KV bytes per token and per block
        self._signature: tuple | None = None

    # --- events ---------------------------------------------------------------------------
    def rebuild(self) -> None:
        """After a reload of the routing table: start over if a route or a setting changed."""
        signature = (self.view.routes, self.view.config)
        if signature == self._signature:
            return
        self._signature = signature
        by_model: dict[str, list[Route]] = {}
        for _, route in sorted(self.view.routes.items()):
            if route.weight > 0:  # cordoned or weight 0: neither routed to nor given checkpoints
                by_model.setdefault(route.model, []).append(route)
        self._model_of = {r.name: model for model, routes in by_model.items() for r in routes}
        self.pools = {
            model: Pool(
                load.NodeIndex({r.name: self._entry(r) for r in routes}),
                placement.HolderRanking([self._holder(r) for r in routes]),
            )
            for model, routes in by_model.items()
        }
        self._stale.clear()  # every holder was made just now

    def node_changed(self, name: str) -> None:
        """A status event from `name`, or the gateway lost it or got it back."""
        pool, route = self._pool_of(name)
        if pool is not None and route is not None:
            pool.nodes.set(name, self._entry(route))
            pool.holders.set(self._holder(route))
            self._stale.discard(name)

    def placed(self, holders: tuple[Route, ...], pages: float) -> None:
        """Checkpoints of a new request go to `holders`: their L̂ counts the pages from now.

        Pages are a count: one that is not a positive number below MAX_REQUEST_PAGES books
        nothing, so the bookkeeping cannot go negative, overflow to infinity when two huge
        figures add up, nor keep a load that never expires.
        """
        if not (isinstance(pages, (int, float)) and 0 < pages < MAX_REQUEST_PAGES):
            return
        now = self.clock()
        for route in holders:
            self._recent.append((now, route.name, pages))
            self._recent_pages[route.name] = self._recent_pages.get(route.name, 0.0) + pages
            self._recent_count[route.name] = self._recent_count.get(route.name, 0) + 1
            self._stale.add(route.name)

    def expire(self, now: float) -> None:
        """Placements older than RECENT_S stop counting: the holder's own status has them by now."""
        while self._recent and now - self._recent[0][0] >= RECENT_S:
            _, name, pages = self._recent.popleft()
            count = self._recent_count.get(name, 1) - 1
            if count <= 0:
                self._recent_pages.pop(name, None)
                self._recent_count.pop(name, None)
            else:
                self._recent_pages[name] = max(self._recent_pages.get(name, 0.0) - pages, 0.0)
                self._recent_count[name] = count
            self._stale.add(name)

    def tidy(self) -> None:
        """What the last decisions changed, brought into the indexes: holders whose L̂ moved, routing bounds a search
        sharpened. Off a request's path: a decision works the same without it. Placements age out at a placement
        (`place`), not here: L̂ is read between placements too (a second holder, a recovery plan), and the simulator
        reads it as this does."""
        self._refresh_stale()
        for pool in self.pools.values():
            pool.nodes.tidy()

    def _refresh_stale(self) -> None:
        while self._stale:
            self._refresh_holder(self._stale.pop())

    # --- what the policies read -------------------------------------------------------------
    def l_hat(self, name: str) -> float:
        """Recovery load (eq. 4): checkpoint pages held, plus recent placements here, and queue depth."""
        return self._l_hat(name, self.view.routes.get(name), self.watcher.status(name))

    def _l_hat(self, name: str, route: Route | None, status) -> float:
        config = self.view.config
        return load.holder_load(
            status.checkpoint_bytes_held,
            self._kv_bytes(route)[1] if route else 1,
            status.running + status.waiting,
            config.alpha,
            config.beta,
            self._recent_pages.get(name, 0.0),
        )

    def _kv_bytes(self, route: Route) -> tuple[int, int]:
        """(per token, per block) of the route's model's KV: a decision reads them, and the catalog computes them."""
        kv = self._kv.get(route.model)
        if kv is None:
            model = route.deployment.model
            kv = self._kv[route.model] = (model.kv_bytes_per_token, model.kv_bytes_per_block)
        return kv

    def choose(self, model: str, prompt_tokens: int, exclude) -> str | None:
        pool = self.pools.get(model)
        if pool is None:
            return None
        silent = self.watcher.silent  # no open status stream here (yet): nothing is sent there
        if exclude or silent:
            exclude = set(exclude) | set(self.failed) | silent
        else:
            exclude = self.failed
        return pool.nodes.choose(prompt_tokens, self.clock(), exclude, upkeep=False)

    def place(
        self,
        model: str,
        serving: str,
        request_tokens: int,
        prefix_tokens: int,
        exclude: AbstractSet[str] = frozenset(),
    ) -> tuple[str, ...]:
        """Holders for a request on `serving` by the cluster's policy; never one of `exclude` (nodes its key does
        not trust)."""
        pool = self.pools.get(model)
        route = self.view.routes.get(serving)
        if pool is None or route is None or not route.holds_checkpoints:
            return ()  # a node that cannot stream its KV pages (a real engine's) gets no holders
        self.expire(self.clock())
        self._refresh_stale()
        config = self.view.config
        return placement.place(
            config.placement_policy,
            serving,
            [c for c in pool.holders if c.name not in exclude] if exclude else pool.holders,
            request_bytes=request_tokens * self._kv_bytes(route)[0],
            prefix_tokens=prefix_tokens,
            tau=config.tau_tokens,
        )

    # --- building entries -------------------------------------------------------------------------
    def _pool_of(self, name: str) -> tuple[Pool | None, Route | None]:
        model = self._model_of.get(name)
        route = self.view.routes.get(name)
        if model is None or route is None:
            return None, None
        return self.pools[model], route

    def _entry(self, route: Route) -> tuple:
        return (self.watcher.status(route.name), self.watcher.pending_for(route.name), route.deployment, route.weight)

    def _holder(self, route: Route) -> placement.HolderCandidate:
        name = route.name
        status = self.watcher.status(name)
        return placement.HolderCandidate(
            name,
            route.rack,
            self._l_hat(name, route, status),
            status.checkpoint_bytes_held,
            # A node that cannot hold checkpoints (a real engine's) has no room for any.
            (status.checkpoint_budget_bytes or UNLIMITED) if route.holds_checkpoints else 0,
            name not in self.failed and name not in self.watcher.silent,
        )

    def _refresh_holder(self, name: str) -> None:
        pool, route = self._pool_of(name)
        if pool is not None and route is not None:
            pool.holders.set(self._holder(route))
