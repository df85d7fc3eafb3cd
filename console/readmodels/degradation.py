"""The degradation banner on every page, and the level's history."""

import time

import redis

from recovery import hot
from recovery.actions import capacity, drains
from recovery.choices import DrainState
from recovery.models import Cluster, DegradationChange, ModelCapacity
from recovery.policy.capacity import EFFECTS, LEVEL_DOCS

LEVEL_BADGE = {0: "green", 1: "amber", 2: "amber", 3: "red", 4: "red"}


def degradation(cluster: Cluster | None = None) -> dict:
    """The banner on every page: the fleet's level (the worst model's), what it does, since when, and the capacity
    behind it; each served model's own level and figures under `models` (a model sheds only its own traffic)."""
    cluster = cluster or Cluster.default()
    state = cluster.state
    level = state.degradation_level
    latest = _latest_capacity()
    models = [_model(row, (latest.get("models") or {}).get(row.model_key, {})) for row in _served(cluster, latest)]
    worst = next((m for m in models if m["model"] == latest.get("model")), models[0] if models else None)
    effects = EFFECTS[level]
    return {
        "level": level,
        "badge": LEVEL_BADGE[level],
        "doc": LEVEL_DOCS[level],
        "since": state.degradation_changed_at.timestamp() if state.degradation_changed_at else None,
        "batch_factor": effects.batch_factor,
        "shed_tiers": list(effects.shed_tiers),
        "accept_new": effects.accept_new,
        "latency_slo_factor": effects.latency_slo_factor,
        "model": worst["model"] if worst else None,  # the model the figures on top are of
        "slo": worst["slo"] if worst else {"ttft_ms": None, "tpot_ms": None, "required_rps": 0.0},
        "capacity": latest,
        "models": models,
        "starting": _starting(latest),
        "cluster_breaker_open": state.auto_cordon_breaker_open,
        "cluster_breaker_reason": state.auto_cordon_breaker_reason,
        "left_out_of_service": left_out_of_service(cluster),
    }


def _served(cluster: Cluster, latest: dict) -> list[ModelCapacity]:
    """The models with a level: those the last evaluation judged (every model with an objective or a node that has
    not left, recovery.actions.capacity.served_models), and any with an objective. One query, on every page."""
    evaluated = set(latest.get("models") or {})
    rows = [r for r in ModelCapacity.objects.filter(cluster=cluster) if r.model_key in evaluated or r.required_rps > 0]
    known = {r.model_key for r in rows}
    rows += [ModelCapacity(cluster=cluster, model_key=key) for key in evaluated - known]
    return sorted(rows, key=lambda r: r.model_key)


def _model(row: ModelCapacity, figures: dict) -> dict:
    level = row.degradation_level
    effects = EFFECTS[level]
    return {
        "model": row.model_key,
        "level": level,
        "badge": LEVEL_BADGE[level],
        "doc": LEVEL_DOCS[level],
        "since": row.degradation_changed_at.timestamp() if row.degradation_changed_at else None,
        "batch_factor": effects.batch_factor,
        "shed_tiers": list(effects.shed_tiers),
        "accept_new": effects.accept_new,
        "latency_slo_factor": effects.latency_slo_factor,
        "slo": {
            "ttft_ms": row.ttft_ms * effects.latency_slo_factor,
            "tpot_ms": row.tpot_ms * effects.latency_slo_factor,
            "required_rps": row.required_rps,
        },
        "capacity": figures,
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
            "model": c.model_key,
            "old": c.old_level,
            "new": c.new_level,
            "ratio": c.ratio,
            "capacity_rps": c.capacity_rps,
            "required_rps": c.required_rps,
            "cause": c.cause,
            "badge": LEVEL_BADGE[c.new_level],
            "simulated": c.simulated,  # generated history: never the live level, which the cluster row holds
        }
        for c in DegradationChange.objects.all()[:limit]
    ]
