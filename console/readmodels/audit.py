"""The audit log: who did what to what, when and why, newest first, filtered by actor, action and time."""

import datetime as dt

from recovery.models import AuditEntry

LIMIT = 500  # rows on one page; narrow the filters to see older ones


def actions() -> list[str]:
    return sorted(set(AuditEntry.objects.values_list("action", flat=True).distinct()))


def actors() -> list[str]:
    return sorted(set(AuditEntry.objects.values_list("actor", flat=True).distinct()))


def entries(
    actor: str = "", action: str = "", since: dt.datetime | None = None, until: dt.datetime | None = None
) -> list[dict]:
    rows = AuditEntry.objects.all()
    if actor:
        rows = rows.filter(actor__iexact=actor)
    if action:
        rows = rows.filter(action=action)
    if since:
        rows = rows.filter(at__gte=since)
    if until:
        rows = rows.filter(at__lte=until)
    return [
        {
            "id": e.pk,
            "at": e.at.timestamp(),
            "actor": e.actor,
            "action": e.action,
            "target": e.target,
            "reason": e.reason,
            "details": e.details,
        }
        for e in rows[:LIMIT]
    ]
