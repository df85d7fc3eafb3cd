"""The gateway's recovery coordinator (source document 000's Load Monitor,
Checkpoint Manager and Recovery Coordinator in one).

It holds every request in flight through this gateway, picks its node
(least load, document 002) and its checkpoint holders (the cluster's
placement policy), and when a node is lost it plans where each of that
node's requests continues (Algorithm 2) in one pass, so the plan sees its
own decisions. Once that node's requests stream again it re-places the
checkpoints the node kept of others (recovery.REPLACE_HOLDERS_WITHIN_S), and it
carries out planned migrations the control plane asks for.
"""

import asyncio
import logging
import math
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from recovery.gateway.fleet import FleetState
from recovery.gateway.signals import Signals
from recovery.gateway.table import RoutingView
from recovery.gateway.watch import NodeWatcher
from recovery.policy import dispatch, placement, recovery
from recovery.protocol import HolderReplaced, MigrationCommandDone, Route, Signal, Symptom, Trust
from workers.catalog import BLOCK_TOKENS

log = logging.getLogger(__name__)

FIRST_TOKEN_MARGIN = 2.0
# A request that no node can take while the fleet is starting waits this long for one to answer, then gets a 503
# that says the fleet is starting (issue 18: a start is not an emergency).
JOIN_WAIT_S = 10.0
JOIN_POLL_S = 0.05


@dataclass
class Flight:
    """One request in flight: what the gateway needs to place, watch and resume it."""

    request_id: str
    tenant: str
    tier: str
    model: str
    prompt_tokens: int
    max_tokens: int
    node: str = ""
    holders: tuple[str, ...] = ()
    generated: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)
    first_token_at: float | None = None
    last_token_at: float | None = None
    migrations: list[dict] = field(default_factory=list)
    # The node's stream now, and whether this gateway is ending it to move the request (a node that cannot
    # hand a request over itself, a real engine's: the gateway stops reading it and re-prefills elsewhere).
    upstream: aiohttp.ClientResponse | None = field(default=None, repr=False)
    handing_over: bool = False
    # Its API key's trusted providers and regions: it runs, and keeps its checkpoints, only on their nodes.
    trust: Trust | None = None

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + len(self.generated)

    def summary(self) -> dict:
        return {
            "node": self.node,
            "holders": list(self.holders),
            "context": self.context_tokens,
            "tier": self.tier,
            "tenant": self.tenant,
        }


class Coordinator:
    def __init__(self, view: RoutingView, signals: Signals, name: str, headers: dict):
        self.view = view
        self.signals = signals
        self.name = name
        self.headers = headers
        self.watcher = NodeWatcher(
            view, self.node_lost, headers, on_back=self._node_back, on_status=self._status_changed
        )
        self.flights: dict[str, Flight] = {}
        self.failed: dict[str, float] = {}  # node -> when this gateway lost it
        self.fleet = FleetState(view, self.watcher, self.failed)
        # Owned here and nowhere else: each interrupted request's recovery decision (with the node it was
        # made for), and each planned migration under way (target, method, command).
        self._decisions: dict[str, tuple[str, asyncio.Future]] = {}
        self._planned: dict[str, dict] = {}
        self._second_asked: set[str] = set()
        # A lost node's requests not yet streaming from their new node: its other checkpoints wait for them.
        self._replacing: dict[str, set[str]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()
        self._tidy_due = False

    def start(self) -> None:
        self._session = aiohttp.ClientSession(headers=self.headers, timeout=aiohttp.ClientTimeout(total=10))
        self.view.listeners.append(self._forget_recovered)
        self.watcher.start()
        self.view.listeners.append(self.fleet.rebuild)
        self.fleet.rebuild()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The session calls to nodes go through; start() opens it."""
        assert self._session is not None, "start() opens the session before any call to a node"
        return self._session

    async def close(self) -> None:
        await self.watcher.close()
        for task in list(self._tasks):
            task.cancel()
        if self._session is not None:
            await self._session.close()

    # --- the relay's side: one request's life ------------------------------------------------
    @property
    def config(self):
        return self.view.config

    def admit(self, flight: Flight) -> bool:
        """Take `flight` in; False when a request with its id is already in flight here."""
        if flight.request_id in self.flights:
            return False
        self.flights[flight.request_id] = flight
        return True

    def finished(self, flight: Flight) -> None:
        """The request is over, however it ended: nothing of it stays."""
        self.flights.pop(flight.request_id, None)
        self._served(flight.request_id)
        self._decisions.pop(flight.request_id, None)
        self._planned.pop(flight.request_id, None)
        self._second_asked.discard(flight.request_id)

    def route_for(
        self, flight: Flight, decision: dispatch.Decision | None, exclude: set[str]
    ) -> tuple[Route | None, dispatch.Decision | None]:
        """The node to (re)start `flight` on, and the decision that goes with it."""
        outside = self.untrusted(flight)
        if decision is not None:
            route = self.view.routes.get(decision.target)
            if route is not None and not {decision.target} & (self.failed.keys() | exclude | outside):
                return route, decision
            # The planned target left routing meanwhile: whoever is least loaded re-prefills it.
            exclude.add(decision.target)
        if decision is not None:  # only a node that can resume continues a request
            exclude = exclude | {r.name for r in self.view.candidates(flight.model) if not r.resumes}
        route = self.choose(flight.model, flight.context_tokens, exclude | outside if outside else exclude)
        if route is not None and decision is not None:
            decision = dispatch.Decision(
                flight.request_id,
                route.name,
                "reprefill",
                None,
                f"{decision.target} gone; re-prefill on least-loaded {route.name}",
            )
        return route, decision

    def assign(self, flight: Flight, route: Route) -> tuple[Route, ...]:
        """`flight` goes to `route` now: its checkpoint holders by the cluster's policy, and the node's local
        account."""
        holders = self.place(flight, route)
        flight.node, flight.holders = route.name, tuple(h.name for h in holders)
        self.watcher.dispatched(route.name, flight.request_id, flight.context_tokens)
        self._tidy_soon()
        return holders

    def _tidy_soon(self) -> None:
        """The fleet state's upkeep after a decision (FleetState.tidy), run once the request is on its way: the
        loop's next turn, when the relay awaits the node."""
        if self._tidy_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside a loop (a tool, a test): at once
            self.fleet.tidy()
            return
        self._tidy_due = True
        loop.call_soon(self._tidy)

    def _tidy(self) -> None:
        self._tidy_due = False
        self.fleet.tidy()

    def adopt(self, flight: Flight, route: Route, holders: tuple[str, ...]) -> None:
        """`flight` is a stream taken over from another gateway: it runs on `route` already, its holders placed."""
        outside = self.untrusted(flight)
        flight.node, flight.holders = (
            route.name,
            tuple(h for h in holders if h in self.view.routes and h not in outside),
        )
        self.watcher.dispatched(route.name, flight.request_id, flight.context_tokens)

    def refused(self, flight: Flight, node: str) -> None:
        """The node never took the request (it refused, or could not be reached): stop counting it there."""
        self.watcher.settle(node, flight.request_id)

    async def send(self, route: Route, path: str, payload: dict) -> aiohttp.ClientResponse:
        """POST a request to a node, its stream read as it comes (no read timeout: the relay watches for stalls)."""
        return await self.session.post(
            route.address + path, json=payload, timeout=aiohttp.ClientTimeout(total=None, connect=2, sock_read=None)
        )

    def resume_sources(self, decision: dispatch.Decision) -> list[dict]:
        """The holder a resumed request's KV comes from, for the node that continues it."""
        if decision.method in ("restore", "fetch") and decision.source in self.view.routes:
            return [self.view.routes[decision.source].peer()]
        return []

    def report(self, signal: Signal) -> None:
        """Tell the control plane (recovery.gateway.signals)."""
        self.signals.emit(signal)

    def answering(self, node: str) -> bool:
        return self.watcher.answering(node)

    def frozen(self, node: str) -> bool:
        return self.watcher.frozen(node)

    def working(self, node: str, window_s: float) -> bool:
        return self.watcher.progressed_within(node, window_s)

    async def recover(self, flight: Flight, node: str, reason: str, *, lost: bool) -> dispatch.Decision | None:
        """Where `flight` goes on now that `node` broke it; None when nothing was sent yet and a fresh pick will do.

        A node that is `lost` (dead, unreachable, silent) is lost for every request
        this gateway has on it, and reported. A node that answered (a server error,
        still loading, a request stuck on a live engine) is only left out for this
        request: no symptom, no incident, its other requests untouched.
        """
        if not flight.generated and flight.request_id not in self._decisions:
            if lost:
                self.node_lost(node, reason, time.time())
            return None
        try:
            if lost:
                return await self.decision_for(flight, node, reason)
            return self.redirect(flight, node)
        except dispatch.NoSurvivors:
            # The plan saw no survivor; a node may have come back since: a fresh pick, re-prefilling.
            return dispatch.Decision(flight.request_id, node, "reprefill", None, "no survivor in the plan")

    async def planned_move(self, flight: Flight) -> dispatch.Decision:
        """The decision a finished planned migration hands the relay: KV already on the target, or re-prefill there.

        The source ends the request's stream at the token boundary and only then sends its KV to the target;
        it answers the migrate call once the KV is there. The request continues when it has answered: resumed
        sooner, the target may not have the pages yet and re-prefills what was meant to be a transfer.
        """
        handed_over = (self._planned.get(flight.request_id) or {}).get("handed_over")
        if handed_over is not None:
            await handed_over.wait()
        plan = self._planned.pop(flight.request_id, None) or {}
        transfer = plan.get("method") == "transfer"
        return dispatch.Decision(
            flight.request_id,
            plan.get("target", ""),
            "restore" if transfer else "reprefill",
            plan.get("target") if transfer else None,
            f"planned migration ({plan.get('method', 'reprefill')})",
        )

    def consider_second_holder(self, flight: Flight) -> None:
        """Ours: once a request's prefix passes τ, a second holder in another rack (asked once)."""
        config = self.view.config
        if (
            config.placement_policy == "lifeline"
            and len(flight.holders) == 1
            and flight.context_tokens > config.tau_tokens
            and flight.request_id not in self._second_asked
        ):
            self._second_asked.add(flight.request_id)
            self._spawn(self.add_second_holder(flight))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _forget_recovered(self) -> None:
        """A node this gateway lost is routable again once its status stream speaks again."""
        for name in list(self.failed):
            if name in self.view.routes and self.watcher.connected(name):
                del self.failed[name]
                self.fleet.node_changed(name)

    def _node_back(self, name: str) -> None:
        if self.failed.pop(name, None) is not None:
            log.info("node %s is back", name)
            self.fleet.node_changed(name)

    def _status_changed(self, name: str) -> None:
        self.fleet.node_changed(name)

    # --- load, as the policies see it -------------------------------------------------------
    def untrusted(self, flight: Flight) -> set[str]:
        """The nodes of `flight`'s model its API key does not trust: never its node, nor a holder of its KV. Empty
        for a key with no restriction."""
        if flight.trust is None:
            return set()
        return {r.name for r in self.view.candidates(flight.model) if not flight.trust.trusts(r)}

    def routable(self, model: str, exclude: AbstractSet[str] = frozenset()) -> dict[str, Route]:
        return {r.name: r for r in self.view.candidates(model) if r.name not in self.failed and r.name not in exclude}

    def l_hat(self, name: str) -> float:
        """Recovery load (eq. 4) of `name` as this gateway sees it (`FleetState.l_hat`)."""
        return self.fleet.l_hat(name)

    def joining(self, model: str) -> list[str]:
        """Routed nodes of `model` that have not answered this gateway yet (it has just started, or they have):
        they may take requests in a moment."""
        return [
            r.name for r in self.view.candidates(model) if r.name in self.watcher.silent and r.name not in self.failed
        ]

    def starting(self) -> bool:
        """The control plane started a moment ago: nodes are joining (its start-up grace, from the cluster config)."""
        until = self.view.config.starting_until
        return until is not None and time.time() < until

    async def wait_for_a_node(self, flight: Flight, exclude: set[str]) -> Route | None:
        """No node can take `flight` now; while nodes of its model are joining (or the fleet is starting) it
        waits up to JOIN_WAIT_S for one. None when none came."""
        deadline = time.monotonic() + JOIN_WAIT_S
        while (self.joining(flight.model) or self.starting()) and time.monotonic() < deadline:
            await asyncio.sleep(JOIN_POLL_S)
            route, _ = self.route_for(flight, None, exclude)
            if route is not None:
                return route
        return None

    def why_no_node(self, flight: Flight) -> str:
        """The reason `flight` found no node, for its 503."""
        model = flight.model
        if flight.trust is not None and not any(flight.trust.trusts(r) for r in self.view.candidates(model)):
            return (
                f"no node of {model} in this API key's trusted {flight.trust} is in service "
                "(the key is restricted to them, for data residency)"
            )
        joining = self.joining(model)
        if joining:
            shown = ", ".join(sorted(joining)[:5]) + (" …" if len(joining) > 5 else "")
            return f"the fleet is starting: {len(joining)} node(s) of it have not answered this gateway yet ({shown})"
        if self.starting():
            return "the fleet is starting: no node of it has finished loading its model yet"
        return "no node can take it"

    def choose(self, model: str, prompt_tokens: int, exclude: AbstractSet[str] = frozenset()) -> Route | None:
        """The least-loaded node for a new request (document 002), by its predicted status and pending work."""
        name = self.fleet.choose(model, prompt_tokens, exclude)
        return self.view.routes.get(name) if name else None

    def place(self, flight: Flight, serving: Route) -> tuple[Route, ...]:
        """Checkpoint holders for a request dispatched to `serving`, by the cluster's policy."""
        tokens = flight.prompt_tokens + flight.max_tokens
        outside = self.untrusted(flight)
        chosen = self.fleet.place(flight.model, serving.name, tokens, flight.prompt_tokens, outside)
        holders = tuple(self.view.routes[name] for name in chosen)
        self.fleet.placed(holders, math.ceil(tokens / BLOCK_TOKENS))
        return holders

    # --- losing a node ------------------------------------------------------------------------
    def node_lost(self, name: str, reason: str, at: float) -> None:
        """This gateway lost `name`: take it out of routing here, plan its requests, and re-place its checkpoints
        once they stream again."""
        if name in self.failed:
            return
        self.failed[name] = at
        self.fleet.node_changed(name)
        log.warning("node %s lost: %s", name, reason)
        self.signals.emit(
            Symptom(node=name, reason=reason, at=at, in_flight=sum(1 for f in self.flights.values() if f.node == name))
        )
        self._plan(name)
        waiting = {f.request_id for f in self.flights.values() if f.node == name}
        if not waiting:
            self._replace_holders(name)
            return
        self._replacing[name] = waiting
        self._schedule(recovery.REPLACE_HOLDERS_WITHIN_S, self._replace_due, name, waiting)

    def streams_on(self, flight: Flight) -> None:
        """`flight`'s tokens come from its node now (its first, or its first after a move)."""
        if self._replacing:
            self._served(flight.request_id)

    def _served(self, request_id: str) -> None:
        """A lost node's request streams again, or is over: once all of them are, its checkpoints are re-placed
        (recovery.REPLACE_HOLDERS_WITHIN_S)."""
        for lost, waiting in list(self._replacing.items()):
            if request_id in waiting:
                waiting.discard(request_id)
                if not waiting:
                    self._schedule(0.0, self._replace_due, lost, waiting)

    def _schedule(self, delay: float, callback, *args) -> None:
        """`callback(*args)` on the event loop, `delay` seconds from now (after the current turn at 0)."""
        asyncio.get_running_loop().call_later(delay, callback, *args)

    def _replace_due(self, lost: str, waiting: set[str]) -> None:
        if self._replacing.get(lost) is waiting:  # not done already, nor a later loss of the same node's
            del self._replacing[lost]
            self._replace_holders(lost)

    def survivor(self, route: Route) -> dispatch.Survivor:
        """`route` as a recovery target: its L̂, its free KV blocks as its status says and its place in the
        fabric (recovery.survivor, as the simulator reads its nodes)."""
        return recovery.survivor(
            route.name, route.placement, self.l_hat(route.name), self.watcher.status(route.name), route.deployment
        )

    def _plan(
        self, failed_node: str, only: list[Flight] | None = None, exclude: AbstractSet[str] = frozenset()
    ) -> None:
        stranded = only if only is not None else [f for f in self.flights.values() if f.node == failed_node]
        by_trust: dict[Trust | None, list[Flight]] = {}
        for flight in stranded:  # a restricted key's requests are planned among the nodes it trusts only
            by_trust.setdefault(flight.trust, []).append(flight)
        for flights in by_trust.values():
            self._plan_among(failed_node, flights, set(exclude) | self.untrusted(flights[0]))

    def _plan_among(self, failed_node: str, stranded: list[Flight], exclude: set[str]) -> None:
        model = stranded[0].model
        survivors = {}
        for name, route in self.routable(model, exclude).items():
            if route.resumes:  # a node that cannot continue a request is no survivor for it
                survivors[name] = self.survivor(route)
        interrupted = [
            dispatch.Interrupted(
                request_id=f.request_id,
                holders=f.holders,
                checkpointed_tokens=self._checkpointed_estimate(f),
                context_tokens=f.context_tokens,
            )
            for f in stranded
        ]
        config = self.view.config
        try:
            decisions = recovery.plan(
                interrupted,
                survivors,
                set(self.failed) | set(exclude),
                config.theta_factor,
                config.tau_tokens,
                config.alpha,
                config.beta,
            )
        except dispatch.NoSurvivors as exc:
            for flight in stranded:
                future = asyncio.get_running_loop().create_future()
                future.set_exception(exc)
                self._decisions[flight.request_id] = (failed_node, future)
            return
        for flight, decision in zip(stranded, decisions):
            future = asyncio.get_running_loop().create_future()
            future.set_result(decision)
            self._decisions[flight.request_id] = (failed_node, future)

    def _checkpointed_estimate(self, flight: Flight) -> int:
        """KV tokens the holders most likely have (recovery.checkpointed_estimate); under lifeline the nodes
        checkpoint completed prefill chunks too."""
        lifeline = self.view.config.placement_policy == "lifeline"
        return recovery.checkpointed_estimate(flight.holders, bool(flight.generated), flight.context_tokens, lifeline)

    async def decision_for(self, flight: Flight, failed_node: str, reason: str) -> dispatch.Decision:
        """Where `flight` continues now that `failed_node` is gone (planned with its companions)."""
        self.node_lost(failed_node, reason, time.time())
        made_for, _ = self._decisions.get(flight.request_id, (None, None))
        if made_for != failed_node:
            self._plan(failed_node, only=[flight])  # it reached that node after the plan was made
        return await self._decisions[flight.request_id][1]

    def redirect(self, flight: Flight, node: str) -> dispatch.Decision:
        """Where `flight` continues after `node` failed or refused it while staying up.

        Planned for this request alone with `node` left out; nothing is marked
        lost, so the node's other requests and its routing are untouched.
        Raises NoSurvivors when no other node can take it.
        """
        self._plan(node, only=[flight], exclude={node})
        return self._decisions[flight.request_id][1].result()

    def first_token_s(self, route: Route, prompt_tokens: int) -> float:
        """How long the first token may take on `route`: its queued prefill plus this one, by the roofline, with margin.

        Twice the modelled time, scaled as the node runs (an emulated node's time scale).
        A node still working after that is given more time by the relay; this only
        sets when it first asks.
        """
        status = self.watcher.status(route.name)
        pending = self.watcher.pending_for(route.name)
        ahead = status.uncomputed_prefill_tokens + pending.prompt_tokens
        return (
            FIRST_TOKEN_MARGIN * (status.time_scale or 1.0) * route.deployment.prefill_s(max(ahead + prompt_tokens, 1))
        )

    def _replace_holders(self, lost: str) -> None:
        """Requests elsewhere that had `lost` as a holder get a new one (the serving node resends its blocks)."""
        for flight in list(self.flights.values()):
            if lost not in flight.holders or flight.node == lost or flight.node not in self.view.routes:
                continue
            serving = self.view.routes[flight.node]
            keep = [
                self.view.routes[h]
                for h in flight.holders
                if h != lost and h in self.view.routes and h not in self.failed
            ]
            fresh = [r for r in self.place(flight, serving) if r.name not in {k.name for k in keep}]
            wanted = 2 if len(flight.holders) > 1 else 1
            holders = (keep + fresh)[:wanted]
            self._spawn(self._set_holders(flight, serving, lost, holders))

    async def _set_holders(self, flight: Flight, serving: Route, lost: str, holders: list[Route]) -> None:
        try:
            async with self.session.post(
                f"{serving.address}/agent/requests/{flight.request_id}/holders",
                json={"holders": [h.peer() for h in holders]},
            ) as response:
                answer = await response.json(content_type=None)
                if response.status != 200:
                    raise RuntimeError(answer.get("error", {}).get("message", response.status))
        except Exception as exc:  # noqa: BLE001 - the request goes on without a checkpoint; say so
            log.warning("could not re-place the checkpoint of %s: %s", flight.request_id, exc)
            self.signals.emit(
                HolderReplaced(request_id=flight.request_id, node=serving.name, lost=lost, holders=[], error=str(exc))
            )
            return
        flight.holders = tuple(h.name for h in holders)
        self.signals.emit(
            HolderReplaced(
                request_id=flight.request_id,
                node=serving.name,  # the node told about its holders: the request may have moved on since the call
                lost=lost,
                holders=list(flight.holders),
                blocks_resent=answer.get("blocks_sent", 0),
            )
        )

    async def add_second_holder(self, flight: Flight) -> None:
        """Ours: once a request's prefix passes tau, a second holder in another rack."""
        serving = self.view.routes.get(flight.node)
        if serving is None or len(flight.holders) != 1:
            return
        first = self.view.routes.get(flight.holders[0])
        request_bytes = (flight.prompt_tokens + flight.max_tokens) * serving.deployment.model.kv_bytes_per_token
        routes = {
            name: route
            for name, route in self.routable(
                flight.model, {serving.name, flight.holders[0]} | self.untrusted(flight)
            ).items()
            if placement.second_copy_fits(
                self.watcher.status(name).checkpoint_bytes_held,
                self.watcher.status(name).checkpoint_budget_bytes,
                request_bytes,
            )
        }
        other_rack = [r for r in routes.values() if first is None or r.rack != first.rack] or list(routes.values())
        if not other_rack:
            return
        second = min(other_rack, key=lambda r: (self.l_hat(r.name), r.name))
        holders = [h for h in (first, second) if h is not None]
        await self._set_holders(flight, serving, "", holders)

    # --- planned migration ---------------------------------------------------------------------
    async def migrate_node(self, name: str, command: str) -> dict:
        """Move every request this gateway has on `name` elsewhere, live, at token boundaries."""
        moving = [f for f in self.flights.values() if f.node == name and f.request_id not in self._planned]
        source = self.view.routes.get(name)
        results: dict[str, Any] = {
            "command": command,
            "node": name,
            "gateway": self.name,
            "requests": len(moving),
            "transfer": 0,
            "reprefill": 0,
            "failed": 0,
        }
        for flight in moving:
            target = self.choose(flight.model, flight.context_tokens, {name} | self.untrusted(flight))
            if target is None or source is None:
                results["failed"] += 1
                continue
            method, transfer_s, reprefill_s = dispatch.migration_method(
                flight.context_tokens, flight.context_tokens, source.placement, self.survivor(target)
            )
            if not source.migrates:
                # Its engine cannot stop a request at a token boundary: this gateway ends the node's stream
                # between two tokens (the node aborts it) and continues the request on the target by re-prefill.
                if flight.upstream is None or not flight.generated:
                    results["failed"] += 1  # not streaming yet: it finishes where it is, or fails over as usual
                    continue
                self._planned[flight.request_id] = {"target": target.name, "method": "reprefill", "command": command}
                flight.handing_over = True
                flight.upstream.close()
                results["reprefill"] += 1
                continue
            handed_over = asyncio.Event()  # the source has answered: the KV is on the target, or it never will be
            self._planned[flight.request_id] = {
                "target": target.name,
                "method": method,
                "command": command,
                "transfer_s": transfer_s,
                "reprefill_s": reprefill_s,
                "handed_over": handed_over,
            }
            try:
                async with self.session.post(
                    f"{source.address}/agent/requests/{flight.request_id}/migrate",
                    json={"target": target.peer(), "transfer": method == "transfer"},
                ) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"{response.status}")
                results[method] += 1
            except Exception as exc:  # noqa: BLE001 - finished meanwhile, or the node failed: the relay handles both
                log.info("planned migration of %s did not start: %s", flight.request_id, exc)
                self._planned.pop(flight.request_id, None)
                results["failed"] += 1
            finally:
                handed_over.set()
        self.signals.emit(MigrationCommandDone(**results))
        return results
