"""The cluster: each node's tile (database and its latest load in Redis) and the summary above them.

One function per shape, used by the page, the JSON API and the WebSocket
push alike, so all three always agree.
"""

import logging
import time

import redis
from django.conf import settings
from django.db.models import OuterRef, Subquery

from recovery import hot
from recovery.choices import (
    BREAKER_BADGE,
    HEALTH_BADGE,
    NODE_STATE_BADGE,
    BreakerState,
    Health,
    NodeState,
)
from recovery.models import Node, NodeTransition
from recovery.policy import lifecycle
from workers import catalog

log = logging.getLogger(__name__)

MODEL_STATE_LABELS = {
    "loading_draft": "loading draft model",
    "draft_ready": "draft ready, loading full model",
    "loading_full": "loading model",
    "serving": "serving",
}


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _hot_nodes(names: list[str]) -> tuple[dict[str, hot.NodeEntry], bool]:
    try:
        return hot.nodes(names), True
    except (redis.RedisError, hot.RedisNotConfigured) as exc:
        log.warning("live load unavailable: %s", exc)
        return {}, False


def node_card(node: Node, live: hot.NodeEntry | None) -> dict:
    """Everything a node tile shows. Figures a node does not report are None ("n/a")."""
    gpu = catalog.GPUS.get(node.gpu_key)
    alive = node.state in lifecycle.ALIVE
    live = live or hot.NodeEntry()
    last_seen = live.last_seen
    if last_seen is None and node.last_seen_at is not None:
        last_seen = node.last_seen_at.timestamp()
    load = None
    if alive and live.running is not None:
        kv_used, kv_total = live.kv_blocks_used, live.kv_blocks_total
        load = {
            "running": live.running,
            "waiting": live.waiting,
            "kv_used": kv_used,
            "kv_total": kv_total,
            "kv_pct": round(100 * kv_used / kv_total, 1) if kv_used is not None and kv_total else None,
            "step_ms": _round(live.step_ms),
        }
    gpus = [
        {"index": g.index, "uuid": g.uuid, "name": g.name, "memory_gb": round(g.memory_bytes / 1e9)}
        for g in node.gpus.all()
    ]
    return {
        "id": node.pk,
        "name": node.name,
        "state": node.state,
        "state_label": NodeState(node.state).label,
        "badge": NODE_STATE_BADGE[NodeState(node.state)],
        "state_changed_at": node.state_changed_at.timestamp(),
        "state_cause": getattr(node, "state_cause", None),
        "rack": node.rack.name,
        "address": node.address,
        "host": node.host,
        "pid": node.pid,
        "session": node.session,
        "model": node.model_key,
        "model_state": live.model_state if alive else None,
        "model_state_label": MODEL_STATE_LABELS.get(live.model_state, live.model_state) if alive else None,
        "gpu": node.gpu_key,
        "gpu_name": gpu.name if gpu else node.gpu_key,
        "tp": node.tp,
        "engine": node.engine,
        "gpus": gpus,
        "load": load,
        "last_report_at": last_seen,
        "health": node.health,
        "health_label": Health(node.health).label,
        "health_badge": HEALTH_BADGE[Health(node.health)],
        "weight": node.weight,
        "breaker": node.breaker,
        "breaker_label": BreakerState(node.breaker).label,
        "breaker_badge": BREAKER_BADGE[BreakerState(node.breaker)],
        "spare": node.spare,
        "cordoned": node.cordoned,
    }


def _nodes():
    latest_cause = NodeTransition.objects.filter(node=OuterRef("pk")).order_by("-at", "-id").values("cause")[:1]
    return (
        Node.objects.select_related("rack")
        .prefetch_related("gpus")
        .annotate(state_cause=Subquery(latest_cause))
        .order_by("rack__name", "name")
    )


def summary(cards: list[dict]) -> dict:
    counts = {state.value: 0 for state in NodeState}
    for card in cards:
        counts[card["state"]] += 1
    loads = [c["load"] for c in cards if c["load"]]
    return {
        "nodes": len(cards),
        "by_state": counts,
        "spares": sum(1 for c in cards if c["spare"] and c["state"] == NodeState.SERVING),
        "in_service": sum(1 for c in cards if c["weight"] > 0),
        "gpus": sum(len(c["gpus"]) for c in cards if c["state"] in lifecycle.ALIVE),
        "running": sum(load["running"] or 0 for load in loads),
        "waiting": sum(load["waiting"] or 0 for load in loads),
    }


def cluster_snapshot() -> dict:
    nodes = list(_nodes())
    live, live_ok = _hot_nodes([n.name for n in nodes])
    cards = [node_card(n, live.get(n.name)) for n in nodes]
    racks: dict[str, list[dict]] = {}
    for card in cards:
        racks.setdefault(card["rack"], []).append(card)
    return {
        "cluster": settings.LIFELINE_CLUSTER_NAME,
        "generated_at": time.time(),
        "live": live_ok,
        "heartbeat_miss_s": settings.LIFELINE_HEARTBEAT_MISS_S,
        "summary": summary(cards),
        "racks": [{"name": name, "nodes": rack_cards} for name, rack_cards in racks.items()],
        "nodes": cards,
    }


def node_card_by_id(node_id: int) -> dict | None:
    node = _nodes().filter(pk=node_id).first()
    if node is None:
        return None
    live, _ = _hot_nodes([node.name])
    return node_card(node, live.get(node.name))


def cluster_summary() -> dict:
    nodes = list(_nodes())
    live, _ = _hot_nodes([n.name for n in nodes])
    return summary([node_card(n, live.get(n.name)) for n in nodes])
