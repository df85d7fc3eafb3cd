"""Incidents: the list, one incident with its timeline, the requests it touched and its latency chart."""

import datetime as dt

from django.utils import timezone

from recovery.choices import (
    INCIDENT_STATUS_BADGE,
    SYSTEM_EVENT_KINDS,
    EventKind,
    IncidentStatus,
)
from recovery.models import Incident, IncidentEvent, RequestOutcome

CHART_BEFORE_S = 120
CHART_AFTER_S = 60


def _ts(value: dt.datetime | None) -> float | None:
    return value.timestamp() if value else None


def incident_row(incident: Incident) -> dict:
    return {
        "id": incident.pk,
        "title": incident.title,
        "status": incident.status,
        "status_label": IncidentStatus(incident.status).label,
        "badge": INCIDENT_STATUS_BADGE[IncidentStatus(incident.status)],
        "opened_at": _ts(incident.opened_at),
        "detected_at": _ts(incident.detected_at),
        "recovered_at": _ts(incident.recovered_at),
        "closed_at": _ts(incident.closed_at),
        "recovery_time_s": incident.recovery_time_s,
        "acknowledged_at": _ts(incident.acknowledged_at),
        "acknowledged_by": incident.acknowledged_by.get_username() if incident.acknowledged_by else None,
        "commander": incident.commander.get_username() if incident.commander else None,
        "nodes": [n.name for n in incident.nodes.all()],
        "baseline_ttft_ms": incident.baseline_ttft_ms,
        "baseline_tpot_ms": incident.baseline_tpot_ms,
    }


def incident_list(limit: int = 100) -> list[dict]:
    incidents = Incident.objects.select_related("acknowledged_by", "commander").prefetch_related("nodes")[:limit]
    return [incident_row(i) for i in incidents]


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
    end = (incident.recovered_at or timezone.now()) + dt.timedelta(seconds=CHART_AFTER_S)
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
        },
        "baseline": {"ttft_ms": incident.baseline_ttft_ms, "tpot_ms": incident.baseline_tpot_ms},
    }


def incident_detail(incident: Incident) -> dict:
    return {
        **incident_row(incident),
        "notes": incident.notes,
        "details": incident.details,
        "events": [event_row(e) for e in incident.events.select_related("node")],
        "requests": affected_requests(incident),
    }
