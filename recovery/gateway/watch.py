"""Each node's live load, as the gateway sees it (source document 002).

The gateway keeps one connection to every routed node's status stream
(`/agent/events`), so its view changes at every load-changing event on the
node, not at a polling interval. At dispatch it counts the request on the
node at once (the local account) and settles that count when the node's
arrival event for the request comes back. The stream doubles as a liveness
signal: when a node dies its stream breaks, and the gateway knows at once,
even for a node with no request in flight.
"""

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from typing import cast

import aiohttp

from recovery.gateway.table import RoutingView
from recovery.policy.load import ClockOffset, NodeStatus, Pending
from recovery.protocol import Route
from workers.aio import cancel
from workers.protocol import RoutingStatus

log = logging.getLogger(__name__)

# Nodes send a status or a keep-alive at least every second (workers.agent.KEEPALIVE_S); a stream
# silent this long belongs to a node that is frozen or gone.
SILENT_S = 3.0
UNREACHABLE_RETRY_S = 0.5  # a node that has not answered yet (still starting) is dialled again this often


class NodeWatcher:
    def __init__(
        self,
        view: RoutingView,
        on_lost: Callable[[str, str, float], None],
        headers: dict | None = None,
        on_back: Callable[[str], None] | None = None,
        on_status: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.view = view
        self.on_lost = on_lost
        self.on_back = on_back or (lambda name: None)
        self.on_status = on_status or (lambda name: None)  # after every new status of a node
        self.headers = headers or {}
        self.clock = clock  # the gateway's epoch seconds: what a node's status time is put on
        self._clocks: dict[str, ClockOffset] = {}  # node -> its clock's offset from ours, as its statuses show it
        self.statuses: dict[str, RoutingStatus] = {}  # every figure a number (NodeStatus.from_event, or defaults)
        self.pending: dict[str, Pending] = {}
        self._ledger: dict[str, dict[str, int]] = {}  # node -> request id -> prompt tokens, until the node confirms
        self._tasks: dict[str, tuple[str, asyncio.Task]] = {}  # node -> (session, task)
        self.lost: dict[str, float] = {}  # node -> when its stream broke
        self._heard: set[str] = set()  # nodes whose status stream is up and has spoken
        self._heard_at: dict[str, float] = {}  # node -> monotonic time of its stream's last line (a keep-alive counts)
        self._progress_at: dict[str, float] = {}  # node -> monotonic time its engine's step count last moved
        self._step_gap: dict[str, float] = {}  # node -> seconds between the last two moves while it was busy
        # Sessions whose stream this gateway has been connected to: only one of those can be lost. A session that
        # never answered (a node still starting, an address left from a previous run) is unreachable, not failed.
        self._answered: set[tuple[str, str]] = set()
        self.silent: set[str] = set()  # routed nodes without an open status stream here: not routed to
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        # A node's stream speaks at least every second (a keep-alive when idle): silence this long is a frozen node.
        timeout = aiohttp.ClientTimeout(total=None, connect=2, sock_read=SILENT_S * 3)
        self._session = aiohttp.ClientSession(timeout=timeout, headers=self.headers)
        self.view.listeners.append(self.sync)
        self.sync()

    async def close(self) -> None:
        for _, task in self._tasks.values():
            await cancel(task)
        if self._session is not None:
            await self._session.close()

    def sync(self) -> None:
        """Follow exactly the routed nodes; a node back with a new session is followed afresh."""
        for name, route in self.view.routes.items():
            current = self._tasks.get(name)
            if current is None or current[0] != route.session or current[1].done():
                if current is not None:
                    current[1].cancel()
                self.lost.pop(name, None)
                if name not in self._heard or current is None or current[0] != route.session:
                    self.silent.add(name)
                task = asyncio.get_running_loop().create_task(self._follow(route), name=f"watch-{name}")
                self._tasks[name] = (route.session, task)
        for name in list(self._tasks):
            if name not in self.view.routes:
                self._tasks.pop(name)[1].cancel()
                self.statuses.pop(name, None)
                self._heard.discard(name)
                self.silent.discard(name)

    async def _follow(self, route: Route) -> None:
        while True:
            connected = False
            try:
                assert self._session is not None, "start() opens the session before any stream is followed"
                async with self._session.get(route.address + "/agent/events") as response:
                    response.raise_for_status()
                    connected = True
                    self._answered.add((route.name, route.session))
                    self._clocks[route.name] = ClockOffset()  # a new connection, maybe a new host: measured afresh
                    data = None
                    async for raw in response.content:
                        self._heard_at[route.name] = time.monotonic()
                        line = raw.decode().rstrip("\n")
                        if line.startswith("data: "):
                            data = line[6:]
                        elif line == "" and data is not None:
                            self._update(route.name, json.loads(data))
                            data = None
                reason = "status stream ended"
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                reason = f"status stream {'broke' if connected else 'unreachable'}: {exc.__class__.__name__}"
            self._heard.discard(route.name)
            self.silent.add(route.name)
            current = self.view.routes.get(route.name)
            if current is None or current.session != route.session:
                return
            if (route.name, route.session) in self._answered:
                self._settle_all(route.name)
                self.lost[route.name] = time.time()
                self.on_lost(route.name, reason, time.time())
                return
            # It never answered this gateway: not routed to, not reported; asked again in a moment.
            await asyncio.sleep(UNREACHABLE_RETRY_S)

    def _update(self, name: str, data: dict) -> None:
        status = NodeStatus.from_event(data)
        # Dated on this gateway's clock, not the node's (built here, not shared yet): forward prediction compares
        # it with our own time, and hosts' clocks disagree.
        status.at = self._clocks.setdefault(name, ClockOffset()).observe(status.at, self.clock())
        previous = self.statuses.get(name)
        if previous is None or status.steps != previous.steps:
            now = time.monotonic()
            if previous is not None and (previous.running or previous.waiting) and name in self._progress_at:
                self._step_gap[name] = now - self._progress_at[name]  # how often a busy node is seen to step
            self._progress_at[name] = now
        self.statuses[name] = status
        if name not in self._heard:
            self._heard.add(name)
            self.silent.discard(name)
            self.on_back(name)
        if self._ledger.get(name):
            self._reconcile(name, data)
        self.on_status(name)

    def _reconcile(self, name: str, data: dict) -> None:
        """Settle the local account of `name` against its status: a request the status counts is no longer ours to.

        Its arrival event settles a request; any later event naming it (its end) does too. A node whose
        subscriber queue overflowed drops old events, the arrival among them, and then sends a full status
        naming every request it has and those it finished lately: what it names is settled, so a lost event
        never leaves a request counted here for good.
        """
        ledger = self._ledger[name]
        settled = []
        request_id = data.get("request_id")
        if isinstance(request_id, str) and request_id in ledger:
            settled.append(request_id)
        for key in ("requests", "finished"):
            ids = data.get(key)
            if isinstance(ids, list):
                settled.extend(rid for rid in ids if isinstance(rid, str) and rid in ledger)
        for rid in settled:
            prompt = ledger.pop(rid, None)
            if prompt is not None:
                self.pending_for(name).confirm(prompt)  # the node's status now counts it (or it is over)

    # --- the local account ---------------------------------------------------------------
    def dispatched(self, name: str, request_id: str, prompt_tokens: int) -> None:
        if not self.view.config.dispatch_accounting:
            return
        self.pending_for(name).add(prompt_tokens)
        self._ledger.setdefault(name, {})[request_id] = prompt_tokens

    def settle(self, name: str, request_id: str) -> None:
        """The request left the node before its arrival event reached us (refused, or the node died)."""
        prompt = self._ledger.get(name, {}).pop(request_id, None)
        if prompt is not None:
            self.pending_for(name).confirm(prompt)

    def _settle_all(self, name: str) -> None:
        """The node is lost: what was dispatched to it and not confirmed is not coming (its requests move on), and
        if it comes back its first status counts whatever it has."""
        for prompt in self._ledger.pop(name, {}).values():
            self.pending_for(name).confirm(prompt)

    def status(self, name: str) -> RoutingStatus:
        status = self.statuses.get(name)
        if status is None:  # not heard from yet: idle as far as we know (kept, so it is the same object next time)
            status = self.statuses[name] = cast(RoutingStatus, NodeStatus(at=self.clock()))
        return status

    def pending_for(self, name: str) -> Pending:
        return self.pending.setdefault(name, Pending())

    def connected(self, name: str) -> bool:
        return name in self._heard and name not in self.lost

    def answering(self, name: str) -> bool:
        """The node's status stream spoke within the last few seconds: the process is alive."""
        heard = self._heard_at.get(name)
        return self.connected(name) and heard is not None and time.monotonic() - heard < SILENT_S

    def frozen(self, name: str) -> bool:
        """The node's status stream spoke to this gateway and has been silent for SILENT_S since (keep-alives come
        every second): its process froze or died, whatever its request streams still promise."""
        heard = self._heard_at.get(name)
        return heard is not None and time.monotonic() - heard >= SILENT_S

    def progressed_within(self, name: str, window_s: float) -> bool:
        """The node's engine took a step in the last `window_s` seconds, or in the last three of its own
        steps where those are longer (a slow GPU's long prefill chunks): it is working."""
        window_s = max(window_s, 3 * self._step_gap.get(name, 0.0))
        return time.monotonic() - self._progress_at.get(name, -math.inf) < window_s
