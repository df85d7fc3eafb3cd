"""The node's link to the control plane: registration and heartbeats.

A heartbeat refused because the control plane does not know this session
(it restarted, or marked the node DOWN) leads to a fresh registration: within
one session the lifecycle only moves forward, so coming back means a new
session that starts at JOIN.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from workers import protocol

log = logging.getLogger(__name__)


class ControlPlaneLink:
    def __init__(
        self,
        base_url: str,
        token: str | None,
        registration: Callable[[], protocol.Registration],
        heartbeat: Callable[[], Awaitable[protocol.Heartbeat]],
        interval_s: float = 1.0,
        timeout_s: float = 3.0,
        on_session_closed: Callable[[], None] | None = None,
        partitioned: Callable[[], bool] = lambda: False,
    ):
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.registration = registration
        self.heartbeat = heartbeat
        self.on_session_closed = on_session_closed or (lambda: None)
        self.partitioned = partitioned  # an injected network partition (workers.faults): nothing gets through
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.registered = False
        self.last_error: str | None = None
        self._last_logged = 0.0

    async def run(self) -> None:
        session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
        try:
            while True:
                started = time.monotonic()
                try:
                    if self.partitioned():
                        raise OSError("network partition (injected fault)")
                    if not self.registered:
                        await self._register(session)
                    await self._beat(session)
                    self._ok()
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    self._fail(f"control plane unreachable at {self.base_url}: {exc.__class__.__name__} {exc}")
                except ControlPlaneRefused as exc:
                    self._fail(str(exc))
                await asyncio.sleep(max(self.interval_s - (time.monotonic() - started), 0.05))
        finally:
            await session.close()

    async def leave(self, reason: str = "node stopped") -> None:
        """Tell the control plane this node is leaving on purpose (LEFT, not DOWN)."""
        registration = self.registration()
        url = self.base_url + protocol.DEREGISTER_PATH.format(name=registration.name)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2), headers=self.headers) as session:
                async with session.post(url, json={"session": registration.session, "reason": reason}) as response:
                    await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("could not tell the control plane that this node is leaving: %s", exc)

    async def _register(self, session: aiohttp.ClientSession) -> None:
        registration = self.registration()
        async with session.post(self.base_url + protocol.REGISTER_PATH, json=registration.to_json()) as response:
            body = await _json(response)
            if response.status == 409:
                self.on_session_closed()  # that session is over: the next attempt starts a new one
            if response.status != 200:
                raise ControlPlaneRefused(f"registration refused ({response.status}): {_message(body)}")
        self.registered = True
        self.interval_s = float(body.get("heartbeat_interval_s", self.interval_s))
        log.info("registered %s (session %s) as %s", registration.name, registration.session, body.get("state"))

    async def _beat(self, session: aiohttp.ClientSession) -> None:
        heartbeat = await self.heartbeat()
        name = self.registration().name
        async with session.post(
            self.base_url + protocol.HEARTBEAT_PATH.format(name=name), json=heartbeat.to_json()
        ) as response:
            body = await _json(response)
            if response.status in (404, 409):
                # Unknown node (register again), or a session the control plane closed
                # (DOWN or LEFT): within a session the lifecycle only moves forward, so start a new one.
                self.registered = False
                if response.status == 409:
                    self.on_session_closed()
                raise ControlPlaneRefused(f"heartbeat refused ({response.status}): {_message(body)}; registering again")
            if response.status != 200:
                raise ControlPlaneRefused(f"heartbeat refused ({response.status}): {_message(body)}")

    def _ok(self) -> None:
        if self.last_error is not None:
            log.info("control plane reachable again")
        self.last_error = None

    def _fail(self, message: str) -> None:
        now = time.monotonic()
        if message != self.last_error or now - self._last_logged > 30:
            log.warning("%s", message)
            self._last_logged = now
        self.last_error = message


class ControlPlaneRefused(Exception):
    pass


async def _json(response: aiohttp.ClientResponse) -> dict:
    try:
        body = await response.json(content_type=None)
    except (ValueError, aiohttp.ContentTypeError):
        return {"error": {"message": (await response.text())[:200]}}
    return body if isinstance(body, dict) else {}


def _message(body: dict) -> str:
    error = body.get("error")
    if isinstance(error, dict):
        return str(error.get("message"))
    return str(error or body)
