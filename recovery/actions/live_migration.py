"""Planned (live) migration of every request off a node.

The control plane cannot move a request itself: the gateway that holds the
client's stream does it (it stops the request at a token boundary, has the
node hand its KV blocks to the target, and resumes there). So a planned
migration is a command to every gateway, and each reports what it moved.
The node is cordoned first, whoever asks and from wherever, so nothing new
lands on it while its requests leave.
"""

import json
import time
import uuid

from django.utils import timezone

from recovery import hot
from recovery.actions import audit, health
from recovery.models import Node


def start(node: Node, actor: str, reason: str, *, cordon: bool = True) -> str:
    """Ask every gateway to move its requests off `node`, live; returns the command's id."""
    if cordon:
        health.set_cordon(node, True, actor, reason)
    command = uuid.uuid4().hex[:12]
    r = hot.client()
    key = hot.keys().migration(command)
    r.hset(key, mapping={"node": node.name, "requested_at": time.time(), "by": actor, "reason": reason})
    r.expire(key, 3600)
    r.publish(hot.keys().gateway_commands, json.dumps({"action": "migrate", "node": node.name, "id": command}))
    audit.record(actor, "migrate_requests", f"node:{node.name}", reason, command=command)
    return command


def move_off_corrupt(node: Node, cause: str, found_at) -> dict:
    """`node` was found corrupt (silent data corruption) and is out of routing at weight 0: its requests in flight
    leave it now, live, without waiting for a drain's approval (this is not a drain: nothing new reaches it).

    Returns the requests it served since its last good canary, which may have received corrupt tokens
    (health.served_since_last_good_canary), and the migration command that moves those still in flight."""
    suspects = health.served_since_last_good_canary(node, found_at)
    command = start(node, "health machine", f"{node.name} found corrupt: {cause}", cordon=False)
    return {**suspects, "command": command}


def record_gateway_result(gateway: str, data: dict) -> None:
    command = data.get("command")
    if command:
        key = hot.keys().migration(command)
        hot.client().hset(key, f"gateway:{gateway}", json.dumps(data))


def status(command: str) -> dict | None:
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
        "running_on_node": live.running if live else None,
        "checked_at": timezone.now().timestamp(),
    }
