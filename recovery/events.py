"""Channel-layer events for the browser: small messages, group names in one place.

Consumers turn these into frames; they carry ids and figures, never rendered
HTML, so a publisher needs no template and no request.
"""

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)

CLUSTER_GROUP = "cluster"
INCIDENTS_GROUP = "incidents"
CHECKPOINTS_GROUP = "checkpoints"
STATUS_GROUP = "status"  # every page: the degradation banner, on-call notifications
DRAINS_GROUP = "drains"


def incident_group(incident_id: int) -> str:
    return f"incident-{incident_id}"


def node_group(node_id: int) -> str:
    return f"node-{node_id}"


def drain_group(drain_id: int) -> str:
    return f"drain-{drain_id}"


def send(group: str, event: dict) -> None:
    """Publish to a group; a broken channel layer never breaks a state change."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(group, event)
    except Exception:  # noqa: BLE001 - the browser misses one update; the state change stands
        log.exception("could not publish %s to %s", event.get("type"), group)


def node_changed(node_id: int) -> None:
    send(CLUSTER_GROUP, {"type": "node.changed", "id": node_id})
    send(node_group(node_id), {"type": "node.changed", "id": node_id})


def node_load(name: str, figures: dict) -> None:
    send(CLUSTER_GROUP, {"type": "node.load", "name": name, **figures})


def incident_event(incident_id: int, event_id: int) -> None:
    send(incident_group(incident_id), {"type": "incident.event", "id": event_id})
    send(INCIDENTS_GROUP, {"type": "incident.changed", "id": incident_id})


def incident_changed(incident_id: int) -> None:
    send(incident_group(incident_id), {"type": "incident.changed", "id": incident_id})
    send(INCIDENTS_GROUP, {"type": "incident.changed", "id": incident_id})


def checkpoints_changed() -> None:
    send(CHECKPOINTS_GROUP, {"type": "checkpoints.changed"})


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
