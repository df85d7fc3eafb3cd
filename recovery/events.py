"""Channel-layer events for the browser: small messages, group names in one place.

Consumers turn these into frames; they carry ids and figures, never rendered
HTML, so a publisher needs no template and no request.

State changes are published at once. Load figures come with every heartbeat
(256 a second from 256 nodes), so they are coalesced: each process keeps every
node's latest figures and publishes them as one message per interval.
"""

import asyncio
import logging
import os
import sys
import threading
import time

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

CLUSTER_GROUP = "cluster"
INCIDENTS_GROUP = "incidents"
CHECKPOINTS_GROUP = "checkpoints"
STATUS_GROUP = "status"  # every page: the degradation banner, on-call notifications
DRAINS_GROUP = "drains"
MOE_GROUP = "moe"


def incident_group(incident_id: int) -> str:
    return f"incident-{incident_id}"


def node_group(node_id: int) -> str:
    return f"node-{node_id}"


def drain_group(drain_id: int) -> str:
    return f"drain-{drain_id}"


def _failed(message: str, *args) -> None:
    """Log a publish that failed: one line when Redis is away (an outage, not a bug), the traceback otherwise."""
    exc = sys.exc_info()[1]
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)):
        log.warning(message + " (Redis unreachable: %s)", *args, exc)
    else:
        log.exception(message, *args)


def send(group: str, event: dict) -> None:
    """Publish to a group; a broken channel layer never breaks a state change."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(group, event)
    except Exception:  # noqa: BLE001 - the browser misses one update; the state change stands
        _failed("could not publish %s to %s", event.get("type"), group)


def node_changed(node_id: int) -> None:
    send(CLUSTER_GROUP, {"type": "node.changed", "id": node_id})
    send(node_group(node_id), {"type": "node.changed", "id": node_id})


# How long a heartbeat's figures may wait to be published with the other nodes' (at most; a quarter of it on average
# at one heartbeat a second per node): one message a quarter second instead of one per heartbeat.
LOAD_PUBLISH_INTERVAL_S = 0.25


class LoadPublisher:
    """Every node's latest load figures, published to the cluster group as one `node.loads` message per interval.

    `put` only keeps the figures (a dictionary write under a lock); a thread of this process, with an event loop of
    its own (and so a channel-layer connection of its own), waits for the first figures after a quiet spell, lets the
    interval pass, and publishes what it has. A node's newer figures replace its older ones before they go out."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: dict[str, dict] = {}
        self._pending = threading.Event()
        self._pid: int | None = None

    def put(self, name: str, figures: dict) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: the parent's thread did not come along
                self._latest.clear()
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="lifeline-load-publisher", daemon=True).start()
            self._latest[name] = {"name": name, **figures}
        self._pending.set()

    def take(self) -> list[dict]:
        """The figures kept since the last take, one entry per node."""
        with self._lock:
            latest, self._latest = self._latest, {}
        return list(latest.values())

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        while True:
            self._pending.wait()
            time.sleep(LOAD_PUBLISH_INTERVAL_S)
            self._pending.clear()  # before the take: figures put after it wake the next round
            latest = self.take()
            if latest:
                loop.run_until_complete(self._publish(latest))

    @staticmethod
    async def _publish(latest: list[dict]) -> None:
        layer = get_channel_layer()
        if layer is None:
            return
        try:
            await layer.group_send(CLUSTER_GROUP, {"type": "node.loads", "nodes": latest})
        except Exception:  # noqa: BLE001 - the browser misses a quarter second of figures; the next ones come
            _failed("could not publish the load of %d nodes", len(latest))


loads = LoadPublisher()  # this process's


def node_load(name: str, figures: dict) -> None:
    """A heartbeat's figures, for the browser: published with every other node's within LOAD_PUBLISH_INTERVAL_S."""
    loads.put(name, figures)


def incident_event(incident_id: int, event_id: int) -> None:
    send(incident_group(incident_id), {"type": "incident.event", "id": event_id})
    send(INCIDENTS_GROUP, {"type": "incident.changed", "id": incident_id})


def incident_changed(incident_id: int) -> None:
    send(incident_group(incident_id), {"type": "incident.changed", "id": incident_id})
    send(INCIDENTS_GROUP, {"type": "incident.changed", "id": incident_id})


# How long a change of the checkpoint distribution may wait to reach the checkpoint pages (at most): with the page's
# own 0.3 s debounce, well inside the console's 1 s goal, and one message however many holders moved meanwhile.
CHECKPOINTS_PUBLISH_INTERVAL_S = 0.25


class CheckpointsPublisher:
    """`checkpoints.changed` to the checkpoint pages, at most once per interval, and only when asked.

    A heartbeat whose checkpoint holdings differ from the node's previous ones (and a node joining or leaving the
    distribution) calls `moved`, which only sets a flag; a thread of this process, with an event loop of its own,
    waits for it, lets the interval pass and publishes one message for every change meanwhile."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending = threading.Event()
        self._pid: int | None = None

    def moved(self) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: the parent's thread did not come along
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="lifeline-checkpoints-publisher", daemon=True).start()
        self._pending.set()

    def take(self) -> bool:
        """Whether a change waits to be published, forgetting it."""
        waiting = self._pending.is_set()
        self._pending.clear()
        return waiting

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        while True:
            self._pending.wait()
            time.sleep(CHECKPOINTS_PUBLISH_INTERVAL_S)
            if self.take():  # changes after the take wake the next round
                loop.run_until_complete(self._publish())

    @staticmethod
    async def _publish() -> None:
        layer = get_channel_layer()
        if layer is None:
            return
        try:
            await layer.group_send(CHECKPOINTS_GROUP, {"type": "checkpoints.changed"})
        except Exception:  # noqa: BLE001 - the pages miss one change; the next one refreshes them whole
            _failed("could not publish a change of the checkpoint distribution")


checkpoint_changes = CheckpointsPublisher()  # this process's


def checkpoints_moved() -> None:
    """The checkpoint distribution changed: the checkpoint pages hear of it within CHECKPOINTS_PUBLISH_INTERVAL_S."""
    checkpoint_changes.moved()


def node_canary(node_id: int, result_id: int) -> None:
    send(node_group(node_id), {"type": "node.canary", "id": result_id})


def degradation_changed(level: int) -> None:
    send(STATUS_GROUP, {"type": "status.changed", "level": level})


def service_changed() -> None:
    """A node's health, breaker, cordon or spare status changed: the banner names nodes left out of service."""
    send(STATUS_GROUP, {"type": "status.service"})


def notification(notification_id: int) -> None:
    send(STATUS_GROUP, {"type": "status.notification", "id": notification_id})


def drain_changed(drain_id: int) -> None:
    send(drain_group(drain_id), {"type": "drain.changed", "id": drain_id})
    send(DRAINS_GROUP, {"type": "drain.changed", "id": drain_id})


def moe_changed(name: str) -> None:
    """An MoE deployment's figures or table changed (recovery.actions.moe, each watch pass)."""
    send(MOE_GROUP, {"type": "moe.changed", "name": name})
