"""WebSocket consumers: they turn channel-layer events into frames, nothing more."""

import time

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.template.loader import render_to_string

from console import presenters, roles
from recovery.events import CLUSTER_GROUP


@database_sync_to_async
def _role(user):
    return roles.role_of(user)


@database_sync_to_async
def _node_frame(node_id: int) -> dict | None:
    card = presenters.node_card_by_id(node_id)
    if card is None:
        return None
    return {
        "kind": "node",
        "name": card["name"],
        "rack": card["rack"],
        "state": card["state"],
        "html": render_to_string("console/_node_tile.html", {"node": card}),
        "summary": render_to_string("console/_summary.html", {"summary": presenters.cluster_summary()}),
    }


class ClusterConsumer(AsyncJsonWebsocketConsumer):
    """Live cluster page: node tiles on state changes, figures on every heartbeat."""

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or await _role(user) is None:
            await self.close(code=4403)
            return
        await self.channel_layer.group_add(CLUSTER_GROUP, self.channel_name)
        await self.accept()
        await self.send_json({"kind": "hello", "now": time.time()})

    async def disconnect(self, code):
        await self.channel_layer.group_discard(CLUSTER_GROUP, self.channel_name)

    async def node_changed(self, event):
        frame = await _node_frame(event["id"])
        if frame is not None:
            await self.send_json(frame)

    async def node_load(self, event):
        frame = {key: value for key, value in event.items() if key != "type"}
        frame["kind"] = "load"
        await self.send_json(frame)
