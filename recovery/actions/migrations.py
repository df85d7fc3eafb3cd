"""Planned (live) migration of every request off a node, and cordons.

The control plane cannot move a request itself: the gateway that holds the
client's stream does it (it stops the request at a token boundary, has the
node hand its KV blocks to the target, and resumes there). So a planned
migration is a command to every gateway, and each reports what it moved.
"""

import json
import time
import uuid

from django.db import transaction
from django.utils import timezone

from recovery import hot
from recovery.actions.nodes import publish_routing
from recovery.models import AuditEntry, Node


def audit(actor: str, action: str, target: str, reason: str = "", **details) -> AuditEntry:
    return AuditEntry.objects.create(actor=actor, action=action, target=target, reason=reason, details=details)


@transaction.atomic
def set_cordon(node: Node, cordoned: bool, actor: str, reason: str) -> bool:
    """Cordon (no new requests) or uncordon a node; False when it already was."""
    changed = Node.objects.filter(pk=node.pk, cordoned=not cordoned).update(cordoned=cordoned)
    if not changed:
        return False
    node.cordoned = cordoned
    audit(actor, "cordon" if cordoned else "uncordon", f"node:{node.name}", reason)
    transaction.on_commit(publish_routing)
    return True


def migrate_node(node: Node, actor: str, reason: str) -> str:
    """Ask every gateway to move its requests off `node`, live; returns the command's id."""
    command = uuid.uuid4().hex[:12]
    r = hot.client()
    key = hot.keys().migration(command)
    r.hset(key, mapping={"node": node.name, "requested_at": time.time(), "by": actor, "reason": reason})
    r.expire(key, 3600)
    r.publish(hot.keys().gateway_commands, json.dumps({"action": "migrate", "node": node.name, "id": command}))
    audit(actor, "migrate_requests", f"node:{node.name}", reason, command=command)
    return command


def record_gateway_result(gateway: str, data: dict) -> None:
    command = data.get("command")
    if command:
        key = hot.keys().migration(command)
        hot.client().hset(key, f"gateway:{gateway}", json.dumps(data))


def migration_status(command: str) -> dict | None:
    raw = hot.client().hgetall(hot.keys().migration(command))
    if not raw:
        return None
    gateways = {k.split(":", 1)[1]: json.loads(v) for k, v in raw.items() if k.startswith("gateway:")}
    node = Node.objects.filter(name=raw.get("node")).first()
    live = hot.node(node.name) if node else None
    return {
        "command": command,
        "node": raw.get("node"),
        "requested_at": float(raw.get("requested_at", 0)),
        "by": raw.get("by"),
        "gateways": gateways,
        "moved": sum(g.get("transfer", 0) + g.get("reprefill", 0) for g in gateways.values()),
        "failed": sum(g.get("failed", 0) for g in gateways.values()),
        "running_on_node": int(live.get("running", 0)) if live else None,
        "checked_at": timezone.now().timestamp(),
    }
