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


def incident_group(incident_id: int) -> str:
    return f"incident-{incident_id}"


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
