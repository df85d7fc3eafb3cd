"""WebSocket consumers: they turn channel-layer events into frames, nothing more."""

import time

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.template.loader import render_to_string

from console import presenters, roles
from console import incidents as shapes
from recovery.events import CHECKPOINTS_GROUP, CLUSTER_GROUP, DRAINS_GROUP, INCIDENTS_GROUP, STATUS_GROUP, drain_group, incident_group, node_group
from recovery.models import IncidentEvent


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


class RoleConsumer(AsyncJsonWebsocketConsumer):
    """A live page for any user with a Lifeline role: join `groups`, say hello."""

    def groups_for(self) -> list[str]:
        raise NotImplementedError

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or await _role(user) is None:
            await self.close(code=4403)
            return
        self.joined = self.groups_for()
        for group in self.joined:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()
        await self.send_json({"kind": "hello", "now": time.time()})

    async def disconnect(self, code):
        for group in getattr(self, "joined", []):
            await self.channel_layer.group_discard(group, self.channel_name)


@database_sync_to_async
def _event_frame(event_id: int) -> dict | None:
    event = IncidentEvent.objects.select_related("node", "incident").filter(pk=event_id).first()
    if event is None:
        return None
    row = shapes.event_row(event)
    html = render_to_string("console/_incident_event.html", {"event": row, "opened": event.incident.opened_at.timestamp()})
    return {"kind": "event", "id": event.pk, "event": row, "html": html}


class IncidentsConsumer(RoleConsumer):
    def groups_for(self):
        return [INCIDENTS_GROUP]

    async def incident_changed(self, event):
        await self.send_json({"kind": "incident", "id": event["id"]})


class IncidentConsumer(RoleConsumer):
    """One incident: each new timeline event as a rendered row, and a nudge when its facts change."""

    def groups_for(self):
        return [incident_group(int(self.scope["url_route"]["kwargs"]["incident_id"]))]

    async def incident_event(self, event):
        frame = await _event_frame(event["id"])
        if frame is not None:
            await self.send_json(frame)

    async def incident_changed(self, event):
        await self.send_json({"kind": "incident", "id": event["id"]})


class CheckpointsConsumer(RoleConsumer):
    def groups_for(self):
        return [CHECKPOINTS_GROUP]

    async def checkpoints_changed(self, event):
        await self.send_json({"kind": "checkpoints"})


class StatusConsumer(RoleConsumer):
    """Every page: the degradation banner and on-call notifications."""

    def groups_for(self):
        return [STATUS_GROUP]

    async def status_changed(self, event):
        await self.send_json({"kind": "status", "level": event["level"]})

    async def status_notification(self, event):
        await self.send_json({"kind": "notification", "id": event["id"]})


class DrainsConsumer(RoleConsumer):
    def groups_for(self):
        return [DRAINS_GROUP]

    async def drain_changed(self, event):
        await self.send_json({"kind": "drain", "id": event["id"]})


class DrainConsumer(RoleConsumer):
    """One drain: a nudge at each step, and the page refreshes its body."""

    def groups_for(self):
        return [drain_group(int(self.scope["url_route"]["kwargs"]["drain_id"]))]

    async def drain_changed(self, event):
        await self.send_json({"kind": "drain", "id": event["id"]})


class NodeConsumer(RoleConsumer):
    """One node's page: a nudge when its state, health or canaries change."""

    def groups_for(self):
        return [node_group(int(self.scope["url_route"]["kwargs"]["node_id"]))]

    async def node_changed(self, event):
        await self.send_json({"kind": "node", "id": event["id"]})

    async def node_canary(self, event):
        await self.send_json({"kind": "canary", "id": event["id"]})
