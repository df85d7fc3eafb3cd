"""Channel-layer events for the browser: small messages, group names in one place.

Consumers turn these into frames; they carry ids and figures, never rendered
HTML, so a publisher needs no template and no request.
"""

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)

CLUSTER_GROUP = "cluster"


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
