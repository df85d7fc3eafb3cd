"""The degradation banner on every page, and the level's history."""

import redis

from recovery import hot
from recovery.actions import capacity
from recovery.models import Cluster, DegradationChange
from recovery.policy.capacity import EFFECTS, LEVEL_DOCS

LEVEL_BADGE = {0: "green", 1: "amber", 2: "amber", 3: "red", 4: "red"}


def degradation(cluster: Cluster | None = None) -> dict:
    """The banner on every page: the level, what it does, since when, and the capacity behind it."""
    cluster = cluster or Cluster.default()
    level = cluster.degradation_level
    effects = EFFECTS[level]
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
        "capacity": _latest_capacity(),
        "cluster_breaker_open": cluster.auto_cordon_breaker_open,
        "cluster_breaker_reason": cluster.auto_cordon_breaker_reason,
    }


def _latest_capacity() -> dict:
    try:
        return capacity.latest()
    except (redis.RedisError, hot.RedisNotConfigured):
        return {}


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
