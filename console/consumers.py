"""WebSocket consumers: they turn channel-layer events into frames, nothing more."""

import time
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.template.loader import render_to_string

from console.readmodels import cluster as cluster_model
from console.readmodels import incidents as incident_model
from recovery import roles
from recovery.events import (
    CHECKPOINTS_GROUP,
    CLUSTER_GROUP,
    DRAINS_GROUP,
    INCIDENTS_GROUP,
    MOE_GROUP,
    STATUS_GROUP,
    drain_group,
    incident_group,
    node_group,
)
from recovery.models import IncidentEvent


@database_sync_to_async
def _role(user):
    return roles.role_of(user)


NODE_FRAGMENTS = {"tiles": "console/_node_tile.html", "table": "console/_node_row.html"}


@database_sync_to_async
def _node_frame(node_id: int, view: str = "tiles") -> dict | None:
    card = cluster_model.node_card_by_id(node_id)
    if card is None:
        return None
    return {
        "kind": "node",
        "name": card["name"],
        "rack": card["rack"],
        "state": card["state"],
        "html": render_to_string(NODE_FRAGMENTS[view], {"node": card}),
        "summary": render_to_string("console/_summary.html", {"summary": cluster_model.cluster_summary()}),
    }


class ClusterConsumer(AsyncJsonWebsocketConsumer):
    """Live cluster page: node tiles on state changes, the figures of the latest heartbeats a few times a second."""

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or await _role(user) is None:
            await self.close(code=4403)
            return
        # The page shows nodes as tiles or as table rows (`?view=`): each node change comes rendered as it shows them.
        view = parse_qs(self.scope.get("query_string", b"").decode()).get("view", ["tiles"])[0]
        self.view = view if view in NODE_FRAGMENTS else "tiles"
        await self.channel_layer.group_add(CLUSTER_GROUP, self.channel_name)
        await self.accept()
        await self.send_json({"kind": "hello", "now": time.time()})

    async def disconnect(self, code):
        await self.channel_layer.group_discard(CLUSTER_GROUP, self.channel_name)

    async def node_changed(self, event):
        frame = await _node_frame(event["id"], self.view)
        if frame is not None:
            await self.send_json(frame)

    async def node_loads(self, event):
        # Every node's latest figures, a few times a second (recovery.events.LoadPublisher): one frame for all.
        await self.send_json({"kind": "loads", "nodes": event["nodes"]})


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
    row = incident_model.event_row(event)
    html = render_to_string(
        "console/_incident_event.html", {"event": row, "opened": event.incident.opened_at.timestamp()}
    )
    return {"kind": "event", "id": event.pk, "event": row, "html": html}


class IncidentsConsumer(RoleConsumer):
    def groups_for(self):
        return [INCIDENTS_GROUP]

    async def incident_changed(self, event):
        await self.send_json({"kind": "incident", "id": event["id"]})


@database_sync_to_async
def _events_after(incident_id: int, after: int) -> list[int]:
    return list(
        IncidentEvent.objects.filter(incident_id=incident_id, pk__gt=after)
        .order_by("at", "pk")
        .values_list("pk", flat=True)
    )


class IncidentConsumer(RoleConsumer):
    """One incident: each new timeline event as a rendered row, and a nudge when its facts change.

    The page says which event it shows last (`?after=<id>`); on connecting it is sent every one written
    since, so what committed between its render and its subscription is not lost."""

    def groups_for(self):
        return [incident_group(self._incident_id())]

    def _incident_id(self) -> int:
        return int(self.scope["url_route"]["kwargs"]["incident_id"])

    async def connect(self):
        await super().connect()
        if not getattr(self, "joined", None):
            return
        query = parse_qs(self.scope.get("query_string", b"").decode())
        try:
            after = int(query.get("after", ["0"])[0])
        except ValueError:
            after = 0
        for event_id in await _events_after(self._incident_id(), after):
            frame = await _event_frame(event_id)
            if frame is not None:
                await self.send_json(frame)

    async def incident_event(self, event):
        frame = await _event_frame(event["id"])
        if frame is not None:
            await self.send_json(frame)

    async def incident_changed(self, event):
        await self.send_json({"kind": "incident", "id": event["id"]})


class CheckpointsConsumer(RoleConsumer):
    """The checkpoint distribution: a nudge when it changes (recovery.events.checkpoints_moved, coalesced), and the
    page fetches its fragment again."""

    def groups_for(self):
        return [CHECKPOINTS_GROUP]

    async def checkpoints_changed(self, event):
        await self.send_json({"kind": "checkpoints"})


class StatusConsumer(RoleConsumer):
    """Every page: the degradation banner, on-call notifications and the drains waiting for on-call (the nav's count
    and the page title follow every drain's change, approvals and cancellations included)."""

    def groups_for(self):
        return [STATUS_GROUP, DRAINS_GROUP]

    async def status_changed(self, event):
        await self.send_json({"kind": "status", "level": event["level"]})

    async def status_notification(self, event):
        await self.send_json({"kind": "notification", "id": event["id"]})

    async def status_service(self, event):
        await self.send_json({"kind": "service"})

    async def drain_changed(self, event):
        await self.send_json({"kind": "drain", "id": event["id"]})


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


class MoeConsumer(RoleConsumer):
    """MoE deployments: a nudge after each pass of the control plane's watch (recovery.actions.moe), and the page
    fetches its fragment again (tiles, the table's heatmap, tokens per expert, balancedness)."""

    def groups_for(self):
        return [MOE_GROUP]

    async def moe_changed(self, event):
        await self.send_json({"kind": "moe", "name": event["name"]})
