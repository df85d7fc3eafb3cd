"""Shapes for the on-call pages: drains, the degradation banner and its history, a node's health.

One function per shape, used by the page, the JSON API and the live refresh alike.
"""

import redis
from django.utils import timezone

from recovery import hot
from recovery.actions import capacity
from recovery.choices import DRAIN_BADGE, OPEN_DRAIN_STATES, DrainState
from recovery.models import CanaryResult, Cluster, DegradationChange, Drain, HealthTransition, Node, Notification, XidEvent
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
        "slo": {"ttft_ms": cluster.slo_ttft_ms * effects.latency_slo_factor, "tpot_ms": cluster.slo_tpot_ms * effects.latency_slo_factor,
                "required_rps": cluster.slo_required_rps},
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
        {"at": c.at.timestamp(), "old": c.old_level, "new": c.new_level, "ratio": c.ratio, "capacity_rps": c.capacity_rps,
         "required_rps": c.required_rps, "cause": c.cause, "badge": LEVEL_BADGE[c.new_level]}
        for c in DegradationChange.objects.all()[:limit]
    ]


def drain_row(drain: Drain) -> dict:
    decisions = [
        {"user": d.user.get_username(), "decision": d.decision, "reason": d.reason, "at": d.at.timestamp()}
        for d in drain.decisions.all()
    ]
    return {
        "id": drain.pk,
        "node": drain.node.name,
        "node_health": drain.node.health,
        "state": drain.state,
        "state_label": DrainState(drain.state).label,
        "badge": DRAIN_BADGE[DrainState(drain.state)],
        "open": drain.state in OPEN_DRAIN_STATES,
        "waiting": drain.state == DrainState.PROPOSED,
        "mode": drain.mode,
        "mode_label": drain.get_mode_display(),
        "deadline_s": drain.deadline_s,
        "remediation": drain.remediation,
        "remediation_label": drain.get_remediation_display(),
        "source": drain.source,
        "requested_by": drain.requested_by.get_username() if drain.requested_by else None,
        "reason": drain.reason,
        "approvals_required": drain.approvals_required,
        "approvals": sum(1 for d in decisions if d["decision"] == "approve"),
        "approvals_why": drain.approvals_why,
        "decisions": decisions,
        "created_at": drain.created_at.timestamp(),
        "state_changed_at": drain.state_changed_at.timestamp(),
        "finished_at": drain.finished_at.timestamp() if drain.finished_at else None,
        "outcome": drain.outcome,
    }


def drain_list(limit: int = 100) -> list[dict]:
    drains = Drain.objects.select_related("node", "requested_by").prefetch_related("decisions__user")
    waiting = [drain_row(d) for d in drains.filter(state=DrainState.PROPOSED).order_by("created_at")]
    others = [drain_row(d) for d in drains.exclude(state=DrainState.PROPOSED)[:limit]]
    return waiting + others


def drain_detail(drain: Drain) -> dict:
    row = drain_row(drain)
    row["evidence"] = drain.evidence
    row["blast_radius"] = drain.blast_radius
    row["steps"] = [
        {"at": s.at.timestamp(), "old": s.old_state, "new": s.new_state, "label": DrainState(s.new_state).label, "cause": s.cause,
         "actor": s.actor, "details": s.details}
        for s in drain.steps.all()
    ]
    live = hot.node(drain.node.name) or {}
    row["live"] = {"running": live.get("running"), "waiting": live.get("waiting"), "model_state": live.get("model_state"),
                   "in_flight_via_gateways": sum(1 for f in hot.gateway_flights() if f.get("node") == drain.node.name)}
    return row


def spare_pool() -> dict:
    spares = list(Node.objects.filter(spare=True).exclude(state="left").order_by("name").values_list("name", "state", "model_key"))
    return {"size": sum(1 for _, state, _ in spares if state == "serving"), "nodes": [{"name": n, "state": s, "model": m} for n, s, m in spares]}


def node_health(node: Node) -> dict:
    """The node page's health panel: state, weight, breaker, canaries, Xid events, the health timeline."""
    canaries = list(CanaryResult.objects.filter(node=node)[:200])
    return {
        "health": node.health,
        "weight": node.weight,
        "breaker": node.breaker,
        "breaker_failures": node.breaker_failures,
        "breaker_opened_at": node.breaker_opened_at,
        "spare": node.spare,
        "canary_failures": node.canary_failures,
        "canary_baseline_ms": node.canary_baseline_ms,
        "canary_last_at": node.canary_last_at.timestamp() if node.canary_last_at else None,
        "canaries": [
            {"at": c.at.timestamp(), "passed": c.passed, "kind": c.kind, "detail": c.detail, "latency_ms": c.latency_ms,
             "baseline_ms": c.baseline_ms, "trial": c.trial, "gpu_ms": c.gpu_ms, "prompt": c.prompt_key}
            for c in canaries
        ],
        "xids": [
            {"first_at": x.first_at.timestamp(), "last_at": x.last_at.timestamp(), "gpu": x.gpu_index, "code": x.code, "codes": x.codes,
             "count": x.count, "severity": x.severity, "meaning": x.meaning, "action": x.action, "acted": x.acted}
            for x in XidEvent.objects.filter(node=node)[:50]
        ],
        "transitions": [
            {"at": t.at.timestamp(), "kind": t.kind, "old": t.old, "new": t.new, "cause": t.cause, "actor": t.actor}
            for t in HealthTransition.objects.filter(node=node)[:50]
        ],
        "drains": [drain_row(d) for d in node.drains.select_related("node", "requested_by").prefetch_related("decisions__user")[:10]],
    }


def canary_series(node: Node) -> dict:
    """The canary chart: latency of each check, passed or not, and the moving baseline."""
    rows = list(CanaryResult.objects.filter(node=node).order_by("-at")[:300])[::-1]
    return {
        "t": [r.at.timestamp() for r in rows],
        "latency_ms": [r.latency_ms for r in rows],
        "baseline_ms": [r.baseline_ms for r in rows],
        "passed": [r.passed for r in rows],
        "kind": [r.kind for r in rows],
    }


def telemetry_series(node: Node) -> dict:
    """The telemetry charts, from the readings the heartbeats carried (newest ten minutes), per GPU."""
    readings = hot.telemetry(node.name)[::-1]
    series: dict[int, dict] = {}
    for reading in readings:
        for gpu in reading.get("gpus") or []:
            s = series.setdefault(gpu.get("index", 0), {"t": [], "utilization_pct": [], "temperature_c": [], "power_w": [], "sm_clock_mhz": []})
            s["t"].append(reading["at"])
            for key in ("utilization_pct", "temperature_c", "power_w", "sm_clock_mhz"):
                s[key].append(gpu.get(key))
    return {"gpus": {str(k): v for k, v in sorted(series.items())}, "generated_at": timezone.now().timestamp()}


def notifications(limit: int = 20) -> list[dict]:
    return [{"id": n.pk, "at": n.at.timestamp(), "kind": n.kind, "title": n.title, "body": n.body, "url": n.url, "delivery": n.delivery}
            for n in Notification.objects.all()[:limit]]


def waiting_drains() -> int:
    return Drain.objects.filter(state=DrainState.PROPOSED).count()
