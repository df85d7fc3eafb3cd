"""Drains for on-call: the list, one drain with its evidence, blast radius and steps; the spare pool; notifications."""

from console.readmodels import slo as slo_readmodel
from recovery import hot
from recovery.actions import notify
from recovery.choices import DRAIN_BADGE, OPEN_DRAIN_STATES, DrainState
from recovery.models import Drain, Node, Notification, SloObjective


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
        "incident": drain.incident_id,
        "proposed_again_of": drain.proposed_again_of_id,
    }


def model_budgets(model_key: str) -> list[dict]:
    """The error budgets left now of the model's objectives (every tier, each indicator: availability, TTFT, TPOT),
    from the rollups as on /slo/, the least first: what a drain of one of its nodes spends."""
    rows = []
    for objective in SloObjective.objects.filter(model_key=model_key, tenant=""):
        status = slo_readmodel.objective_status(objective)
        for indicator in status["indicators"]:
            rows.append(
                {
                    "objective": objective.pk,
                    "tier": objective.tier,
                    "tier_label": objective.get_tier_display(),
                    "indicator": indicator["indicator"],
                    "name": indicator["name"],
                    "budget_remaining": indicator["budget_remaining"],
                    "budget_text": indicator["budget_text"],
                    "budget_badge": indicator["budget_badge"],
                    "window": status["window_label"],
                }
            )
    return sorted(rows, key=lambda r: (r["budget_remaining"] is None, r["budget_remaining"] or 0.0))


def drain_list(limit: int = 100) -> list[dict]:
    drains = Drain.objects.select_related("node", "requested_by").prefetch_related("decisions__user")
    waiting = [drain_row(d) for d in drains.filter(state=DrainState.PROPOSED).order_by("created_at")]
    others = [drain_row(d) for d in drains.exclude(state=DrainState.PROPOSED)[:limit]]
    return waiting + others


def drain_detail(drain: Drain) -> dict:
    row = drain_row(drain)
    row["evidence"] = drain.evidence
    row["blast_radius"] = drain.blast_radius
    row["budgets"] = model_budgets(drain.node.model_key)
    row["steps"] = [
        {
            "at": s.at.timestamp(),
            "old": s.old_state,
            "new": s.new_state,
            "label": DrainState(s.new_state).label,
            "cause": s.cause,
            "actor": s.actor,
            "details": s.details,
        }
        for s in drain.steps.all()
    ]
    live = hot.node(drain.node.name) or hot.NodeEntry()
    row["live"] = {
        "running": live.running,
        "waiting": live.waiting,
        "model_state": live.model_state,
        "in_flight_via_gateways": sum(1 for f in hot.gateway_flights() if f.get("node") == drain.node.name),
    }
    return row


def spare_pool() -> dict:
    spares = list(
        Node.objects.filter(spare=True).exclude(state="left").order_by("name").values_list("name", "state", "model_key")
    )
    return {
        "size": sum(1 for _, state, _ in spares if state == "serving"),
        "nodes": [{"name": n, "state": s, "model": m} for n, s, m in spares],
    }


def notifications(limit: int = 20, undelivered: bool = False) -> list[dict]:
    """The latest notifications with how each channel's delivery went; `undelivered`: only those a channel gave up on
    (dead letters), each with the channels that may be sent again."""
    rows = notify.undelivered() if undelivered else Notification.objects.all()
    return [
        {
            "id": n.pk,
            "at": n.at.timestamp(),
            "kind": n.kind,
            "title": n.title,
            "body": n.body,
            "url": n.url,
            "delivery": n.delivery,
            "gave_up": [c for c in notify.CHANNELS if n.delivery.get(c, "").startswith(notify.GAVE_UP)],
        }
        for n in rows[:limit]
    ]


def waiting_drains() -> list[int]:
    """The drains waiting for on-call, oldest first (the one to decide next leads)."""
    return list(
        Drain.objects.filter(state=DrainState.PROPOSED).order_by("created_at", "pk").values_list("pk", flat=True)
    )
