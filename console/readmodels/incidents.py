"""Incidents: the list with its filters and totals, one incident with its timeline, its figures (recovery, requests
moved, shed and failed, stalls, degradation), the requests it touched and its latency chart."""

import datetime as dt
import math

from django.db.models import Count, Q
from django.urls import reverse
from django.utils import timezone

from recovery.actions import conditions
from recovery.choices import (
    INCIDENT_SEVERITY_BADGE,
    INCIDENT_STATUS_BADGE,
    SYSTEM_EVENT_KINDS,
    EventKind,
    FailureClass,
    IncidentSeverity,
    IncidentStatus,
)
from recovery.models import Incident, IncidentEvent, RequestOutcome
from recovery.policy import severity as severity_policy

CHART_BEFORE_S = 120
CHART_AFTER_S = 60


def _ts(value: dt.datetime | None) -> float | None:
    return value.timestamp() if value else None


def _after(value: dt.datetime | None, start: dt.datetime) -> float | None:
    return (value - start).total_seconds() if value else None


def incident_row(incident: Incident) -> dict:
    return {
        "id": incident.pk,
        "title": incident.title,
        "status": incident.status,
        "status_label": IncidentStatus(incident.status).label,
        "badge": INCIDENT_STATUS_BADGE[IncidentStatus(incident.status)],
        "severity": incident.severity,
        "severity_label": IncidentSeverity(incident.severity).label,
        "severity_badge": INCIDENT_SEVERITY_BADGE[IncidentSeverity(incident.severity)],
        "severity_why": (incident.details.get("severity") or {}).get("why", ""),
        "opened_at": _ts(incident.opened_at),
        "detected_at": _ts(incident.detected_at),
        "recovered_at": _ts(incident.recovered_at),  # latency recovered
        "capacity_restored_at": _ts(incident.capacity_restored_at),
        "closed_at": _ts(incident.closed_at),
        "recovery_time_s": incident.recovery_time_s,  # first symptom → latency recovered
        "capacity_time_s": _after(incident.capacity_restored_at, incident.opened_at),
        "acknowledged_at": _ts(incident.acknowledged_at),
        "acknowledged_by": incident.acknowledged_by.get_username() if incident.acknowledged_by else None,
        "commander": incident.commander.get_username() if incident.commander else None,
        "nodes": [n.name for n in incident.nodes.all()],
        "drains": [d.pk for d in incident.drains.all()],
        "baseline_ttft_ms": incident.baseline_ttft_ms,
        "baseline_tpot_ms": incident.baseline_tpot_ms,
        "simulated": incident.simulated,  # generated history (recovery.actions.history)
    }


def filtered(
    status: str = "",
    severity: str = "",
    node: str = "",
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
):
    """Incidents by status, severity, a node involved, and first symptom between `since` and `until` (UTC)."""
    incidents = Incident.objects.all()
    if status:
        incidents = incidents.filter(status=status)
    if severity:
        incidents = incidents.filter(severity=severity)
    if node:
        incidents = incidents.filter(nodes__name=node)
    if since:
        incidents = incidents.filter(opened_at__gte=since)
    if until:
        incidents = incidents.filter(opened_at__lte=until)
    return incidents


def _with_counts(incidents):
    """Each incident with its requests moved (distinct requests) and failed, counted in the database."""
    return incidents.annotate(
        moved=Count("events__request_id", filter=Q(events__kind=EventKind.REQUEST_MOVED), distinct=True),
        failed=Count("outcomes", filter=Q(outcomes__status="error"), distinct=True),
    )


def incident_list(limit: int = 100, **filters) -> list[dict]:
    incidents = _with_counts(filtered(**filters)).order_by("-opened_at").select_related("acknowledged_by", "commander")
    incidents = incidents.prefetch_related("nodes", "drains")[:limit]
    return [{**incident_row(i), "moved": i.moved, "failed": i.failed} for i in incidents]


def totals(**filters) -> dict:
    """How many incidents the filters match, by status and by severity, and the requests moved and failed in them."""
    incidents = filtered(**filters)
    counts = incidents.aggregate(
        total=Count("pk", distinct=True),
        **{f"status_{s.value}": Count("pk", filter=Q(status=s.value), distinct=True) for s in IncidentStatus},
        **{f"severity_{s.value}": Count("pk", filter=Q(severity=s.value), distinct=True) for s in IncidentSeverity},
    )
    ids = incidents.values("pk")
    moved = (
        IncidentEvent.objects.filter(incident__in=ids, kind=EventKind.REQUEST_MOVED)
        .values("incident_id", "request_id")
        .distinct()
        .count()
    )
    return {
        "incidents": counts["total"],
        "by_status": [
            {
                "status": s.value,
                "label": s.label,
                "badge": INCIDENT_STATUS_BADGE[s],
                "count": counts[f"status_{s.value}"],
            }
            for s in IncidentStatus
        ],
        "by_severity": [
            {
                "severity": s.value,
                "label": s.label,
                "badge": INCIDENT_SEVERITY_BADGE[s],
                "count": counts[f"severity_{s.value}"],
            }
            for s in IncidentSeverity
        ],
        "moved": moved,
        "failed": RequestOutcome.objects.filter(incident__in=ids, status="error").count(),
    }


def _percentile(ordered: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ordered list; None for none."""
    if not ordered:
        return None
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def incident_figures(incident: Incident) -> dict:
    """What the incident's header shows: requests moved (and their stall p50/p99), shed and failed; the degradation
    level's peak and its fall. Shed requests are the cluster's, refused while the incident lasted."""
    moves = list(incident.events.filter(kind=EventKind.REQUEST_MOVED).values_list("request_id", "details"))
    stalls = sorted(float(d["stall_ms"]) for _, d in moves if (d or {}).get("stall_ms") is not None)
    ended = (
        max(incident.recovered_at, incident.capacity_restored_at)
        if incident.recovered_at and incident.capacity_restored_at
        else timezone.now()
    )
    levels = list(incident.events.filter(kind=EventKind.DEGRADATION).order_by("at", "pk").values_list("at", "details"))
    peak = max(((d or {}).get("new", 0) for _, d in levels), default=0)
    peak_at = next((at for at, d in levels if (d or {}).get("new", 0) == peak), None) if peak else None
    level_now = (levels[-1][1] or {}).get("new", 0) if levels else 0
    fell_at = levels[-1][0] if levels and peak and level_now == 0 else None
    return {
        "moved": len({request_id for request_id, _ in moves}),
        "moves": len(moves),
        "stall_p50_ms": _percentile(stalls, 0.50),
        "stall_p99_ms": _percentile(stalls, 0.99),
        "shed": RequestOutcome.objects.filter(
            status="shed", finished_at__gte=incident.opened_at, finished_at__lte=ended
        ).count(),
        "failed": incident.outcomes.filter(status="error").count(),
        "degradation": {
            "peak": peak,
            "peak_at": _ts(peak_at),
            "now": level_now,
            "fell_back_at": _ts(fell_at),
        },
    }


def incident_facts(incident: Incident) -> dict:
    """The incident's header: its row, its figures and its lasting failures."""
    return {
        **incident_row(incident),
        "figures": incident_figures(incident),
        "severity_rule": severity_policy.RULE,
        "conditions": condition_rows(incident),
    }


def condition_rows(incident: Incident) -> list[dict]:
    """The incident's lasting failures (recovery.actions.conditions), each with its runbook."""
    return [
        {
            "id": c.pk,
            "class": c.failure_class,
            "label": FailureClass(c.failure_class).label,
            "subject": c.subject,
            "node": c.node.name if c.node_id else None,
            "started_at": c.started_at.timestamp(),
            "cleared_at": c.cleared_at.timestamp() if c.cleared_at else None,
            "lasted_s": (c.cleared_at - c.started_at).total_seconds() if c.cleared_at else None,
            "summary": c.summary,
            "cleared_by": c.cleared_by,
            "runbook": reverse("runbook", args=[conditions.KINDS[FailureClass(c.failure_class)].runbook]),
        }
        for c in incident.conditions.select_related("node")
    ]


def event_row(event: IncidentEvent) -> dict:
    return {
        "id": event.pk,
        "at": event.at.timestamp(),
        "kind": event.kind,
        "label": EventKind(event.kind).label,
        "source": event.source,
        "node": event.node.name if event.node_id else None,
        "request_id": event.request_id,
        "description": event.description,
        "details": event.details,
        "actor": event.actor,
        "system": event.kind in SYSTEM_EVENT_KINDS,
    }


def affected_requests(incident: Incident) -> list[dict]:
    rows = incident.outcomes.order_by("started_at")[:500]
    return [
        {
            "request_id": o.request_id,
            "tenant": o.tenant,
            "tier": o.tier,
            "status": o.status,
            "nodes": o.nodes,
            "completion_tokens": o.completion_tokens,
            "ttft_ms": o.ttft_ms,
            "tpot_ms": o.tpot_ms,
            "moves": [
                {
                    k: m.get(k)
                    for k in (
                        "from",
                        "to",
                        "at_token",
                        "method",
                        "planned_method",
                        "stall_ms",
                        "restored_tokens",
                        "reprefill_tokens",
                    )
                }
                for m in o.migrations
            ],
        }
        for o in rows
    ]


def latency_series(incident: Incident) -> dict:
    """TTFT and TPOT of every request that finished around the incident, for its chart."""
    start = incident.opened_at - dt.timedelta(seconds=CHART_BEFORE_S)
    recovered = incident.recovered_at and incident.capacity_restored_at  # both, or it goes on
    last = max(incident.recovered_at, incident.capacity_restored_at) if recovered else timezone.now()
    end = last + dt.timedelta(seconds=CHART_AFTER_S)
    rows = RequestOutcome.objects.filter(status="ok", finished_at__gte=start, finished_at__lte=end).order_by(
        "finished_at"
    )
    rows = rows.values_list("finished_at", "ttft_ms", "tpot_ms")[:5000]
    return {
        "t": [r[0].timestamp() for r in rows],
        "ttft_ms": [r[1] for r in rows],
        "tpot_ms": [r[2] for r in rows],
        "marks": {
            "opened": _ts(incident.opened_at),
            "detected": _ts(incident.detected_at),
            "recovered": _ts(incident.recovered_at),
            "capacity_restored": _ts(incident.capacity_restored_at),
        },
        "baseline": {"ttft_ms": incident.baseline_ttft_ms, "tpot_ms": incident.baseline_tpot_ms},
    }


def checkpoint_snapshots(incident: Incident) -> list[dict]:
    """The checkpoint distribution as each node of the incident failed, in the order they failed."""
    failures = incident.details.get("failures") or {}
    if not failures and "checkpoints_before" in incident.details:  # an incident recorded before per-failure tables
        return [{"node": None, "at": _ts(incident.opened_at), "checkpoints": incident.details["checkpoints_before"]}]
    return [
        {"node": name, "at": f["at"], "checkpoints": f["checkpoints"]}
        for name, f in sorted(failures.items(), key=lambda item: item[1]["at"])
    ]


def incident_detail(incident: Incident) -> dict:
    return {
        **incident_facts(incident),
        "checkpoints_before": checkpoint_snapshots(incident),
        "notes": incident.notes,
        "details": incident.details,
        "events": [event_row(e) for e in incident.events.select_related("node")],
        "requests": affected_requests(incident),
    }
