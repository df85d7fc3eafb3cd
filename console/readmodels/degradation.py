"""The degradation banner on every page, and the level's history."""

import time

import redis

from recovery import hot
from recovery.actions import capacity, drains
from recovery.choices import DrainState
from recovery.models import Cluster, DegradationChange
from recovery.policy.capacity import EFFECTS, LEVEL_DOCS

LEVEL_BADGE = {0: "green", 1: "amber", 2: "amber", 3: "red", 4: "red"}


def degradation(cluster: Cluster | None = None) -> dict:
    """The banner on every page: the level, what it does, since when, and the capacity behind it."""
    cluster = cluster or Cluster.default()
    level = cluster.degradation_level
    effects = EFFECTS[level]
    latest = _latest_capacity()
    return {
        "level": level,
        "badge": LEVEL_BADGE[level],
        "doc": LEVEL_DOCS[level],
        "since": cluster.degradation_changed_at.timestamp() if cluster.degradation_changed_at else None,
        "batch_factor": effects.batch_factor,
        "shed_tiers": list(effects.shed_tiers),
        "accept_new": effects.accept_new,
        "latency_slo_factor": effects.latency_slo_factor,
        "slo": {
            "ttft_ms": cluster.slo_ttft_ms * effects.latency_slo_factor,
            "tpot_ms": cluster.slo_tpot_ms * effects.latency_slo_factor,
            "required_rps": cluster.slo_required_rps,
        },
        "capacity": latest,
        "starting": _starting(latest),
        "cluster_breaker_open": cluster.auto_cordon_breaker_open,
        "cluster_breaker_reason": cluster.auto_cordon_breaker_reason,
        "left_out_of_service": left_out_of_service(cluster),
    }


def left_out_of_service(cluster: Cluster) -> list[dict]:
    """Nodes out of service with no drain open, which nobody is deciding on: each with why, its last drain, and when
    that drain is proposed again (a cancelled or rejected one, after the cluster's hold-off)."""
    rows = []
    for entry in drains.left_out_of_service():
        last = entry["last_drain"]
        again_at = None
        if last is not None and last.state in (DrainState.CANCELLED, DrainState.REJECTED):
            again_at = (last.finished_at or last.state_changed_at).timestamp() + cluster.drain_propose_again_s
        rows.append(
            {
                "name": entry["node"].name,
                "why": ", ".join(entry["why"]),
                "last_drain": last.pk if last else None,
                "last_drain_state": last.get_state_display().lower() if last else None,
                "proposed_again_at": again_at,
            }
        )
    return rows


def _latest_capacity() -> dict:
    try:
        return capacity.latest()
    except (redis.RedisError, hot.RedisNotConfigured):
        return {}


def _starting(latest: dict) -> dict | None:
    """The fleet is starting: the nodes joining since the control plane started, counted as serving for now."""
    until = latest.get("starting_until")
    joining = latest.get("starting") or []
    if not joining or until is None or until <= time.time():
        return None
    return {
        "nodes": joining,
        "until": until,
        "ratio_once_started": latest.get("ratio_once_started"),
        "reason": f"the control plane started and {len(joining)} node{'s have' if len(joining) != 1 else ' has'} "
        "not served since: joining, not lost, so the level is not raised for them",
    }


def degradation_history(limit: int = 100) -> list[dict]:
    return [
        {
            "at": c.at.timestamp(),
            "old": c.old_level,
            "new": c.new_level,
            "ratio": c.ratio,
            "capacity_rps": c.capacity_rps,
            "required_rps": c.required_rps,
            "cause": c.cause,
            "badge": LEVEL_BADGE[c.new_level],
        }
        for c in DegradationChange.objects.all()[:limit]
    ]
