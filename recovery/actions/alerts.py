"""Lifeline as an Alertmanager receiver: a webhook notification (Alertmanager's payload, version 4) becomes
incidents and incident events.

The alerts of one Alertmanager group (its groupKey) share an incident: the first firing alert of a group opens one
(or joins the active incident of the node it names: a failure Lifeline saw, that Prometheus saw too), and later
notifications of the group add to its timeline while it is active. Each alert is one row per firing (its
fingerprint and start), so Alertmanager's repeats change nothing and a resolution is written once. An alert that
names a node (Lifeline's `node` label, a DCGM exporter's `Hostname`, a node exporter's `nodename` or `instance`) is
attached to that node: the incident lists it, and the node's page and /api/incidents?node= find it. Once every
alert of an incident has resolved it is Stable, unless nodes failed in it too, which return as for any failure
(recovery.actions.incidents); while any of its alerts fires it is not Stable.

Each alert is linked back to the pages that explain it: its runbook (its rule's runbook_url; Lifeline's own rules
link the console's /runbooks/<alert>/), its node's page, the incident. A page-severity alert that opens an incident
is also sent to on-call (recovery.actions.notify), so a page from Prometheus reaches on-call in the console as
Lifeline's own do.
"""

import datetime as dt
import hashlib
import json

from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from recovery import events
from recovery.actions import incidents, notify
from recovery.choices import AlertStatus, EventKind, IncidentSeverity, IncidentStatus
from recovery.models import Alert, Incident, Node

VERSION = "4"  # the webhook payload version Alertmanager sends (0.x to today)
# Labels that name the machine an alert is about, in the order they are tried: Lifeline's rules, NVIDIA's DCGM
# exporter, Prometheus's node exporter, and any target's instance ("host:port").
NODE_LABELS = ("node", "Hostname", "hostname", "nodename", "instance")
# An alert's severity label, as rules commonly set it, to the incident's severity it starts from (never lowered;
# recovery.policy.severity raises it for what the incident did to users).
SEVERITIES = {
    "critical": IncidentSeverity.SEV1,
    "page": IncidentSeverity.SEV2,
    "error": IncidentSeverity.SEV2,
    "warning": IncidentSeverity.SEV3,
    "ticket": IncidentSeverity.SEV3,
    "info": IncidentSeverity.SEV3,
}
PAGING = {"critical", "page"}


class BadNotification(ValueError):
    """The payload is not an Alertmanager webhook notification Lifeline can take: says which field, and why."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _time(value, field: str) -> dt.datetime | None:
    """An RFC 3339 time; None for Alertmanager's zero time (an alert with no end yet)."""
    if not isinstance(value, str) or not value:
        raise BadNotification(field, "an RFC 3339 time is required, such as 2026-12-07T03:11:46.961Z")
    try:
        when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise BadNotification(field, f"{value[:40]!r} is not an RFC 3339 time") from None
    if when.tzinfo is None:
        raise BadNotification(field, f"{value[:40]!r} has no time zone (end it with Z or +00:00)")
    return None if when.year <= 1 else when


def _parsed(payload) -> tuple[str, list[dict]]:
    """The group key and the alerts of a notification, each checked; BadNotification names what is wrong."""
    if not isinstance(payload, dict):
        raise BadNotification("body", "a JSON object is required: Alertmanager's webhook notification")
    if str(payload.get("version", "")) != VERSION:
        raise BadNotification("version", f"version {VERSION} of Alertmanager's webhook payload is required")
    group_key = payload.get("groupKey")
    if not isinstance(group_key, str) or not group_key:
        raise BadNotification("groupKey", "the group's key, as Alertmanager sends it, is required")
    raw = payload.get("alerts")
    if not isinstance(raw, list) or not raw:
        raise BadNotification("alerts", "a list of at least one alert is required")
    alerts = []
    for i, alert in enumerate(raw):
        where = f"alerts[{i}]"
        if not isinstance(alert, dict):
            raise BadNotification(where, "an object is required")
        labels, annotations = alert.get("labels"), alert.get("annotations") or {}
        if not isinstance(labels, dict) or not isinstance(labels.get("alertname"), str) or not labels["alertname"]:
            raise BadNotification(f"{where}.labels.alertname", "every alert needs its alertname label")
        if not all(isinstance(v, str) for v in [*labels.values(), *labels.keys()]):
            raise BadNotification(f"{where}.labels", "label names and values are strings")
        if not isinstance(annotations, dict):
            raise BadNotification(f"{where}.annotations", "an object of strings is required")
        if alert.get("status") not in AlertStatus.values:
            raise BadNotification(f"{where}.status", "'firing' or 'resolved' is required")
        starts = _time(alert.get("startsAt"), f"{where}.startsAt")
        if starts is None:
            raise BadNotification(f"{where}.startsAt", "an alert must have started")
        ends = _time(alert.get("endsAt") or "0001-01-01T00:00:00Z", f"{where}.endsAt")
        fingerprint = alert.get("fingerprint")
        if fingerprint is None:  # Alertmanager's is 16 hex digits of its labels' hash
            fingerprint = hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]
        elif not isinstance(fingerprint, str) or not fingerprint:
            raise BadNotification(f"{where}.fingerprint", "a string is required, as Alertmanager sends it")
        alerts.append(
            {
                "name": labels["alertname"][:200],
                "status": alert["status"],
                "labels": labels,
                "annotations": {str(k): str(v) for k, v in annotations.items()},
                "starts_at": starts,
                "ends_at": ends,
                "fingerprint": fingerprint[:64],
                "generator_url": str(alert.get("generatorURL") or "")[:2000],
            }
        )
    return group_key, alerts


def node_named(labels: dict) -> Node | None:
    """The node an alert's labels name: by its name, then its machine's host name, then its server's."""
    for label in NODE_LABELS:
        value = labels.get(label, "")
        if label == "instance":
            value = value.rsplit(":", 1)[0] if value.count(":") == 1 else value  # "host:port", not an IPv6 address
        if not value:
            continue
        for field in ("name", "host", "server"):
            node = Node.objects.filter(**{field: value}).order_by("name").first()
            if node is not None:
                return node
    return None


def links(alert: Alert) -> dict[str, str]:
    """The pages that explain `alert`: its runbook (its rule's runbook_url: Lifeline's own rules link their page at
    /runbooks/<alert>/), its node's page, its incident's."""
    found = {"incident": reverse("incident", args=[alert.incident_id])}
    if alert.annotations.get("runbook_url", "").startswith(("http://", "https://", "/")):
        found["runbook"] = alert.annotations["runbook_url"]
    if alert.node_id is not None:
        found["node"] = reverse("node", args=[alert.node.name])
    return found


def _describe(alert: Alert) -> str:
    summary = alert.annotations.get("summary") or alert.annotations.get("description") or ""
    where = f" on {alert.node.name}" if alert.node_id is not None else ""
    return f"{alert.name}{where} {alert.status}" + (f": {summary}" if summary else "")


@transaction.atomic
def receive(payload) -> dict:
    """Take one webhook notification; what it did: the incident, and each alert with its links."""
    group_key, parsed = _parsed(payload)
    now = timezone.now()
    incident = _incident_of(group_key)
    opened, seen_on = False, None  # seen_on: the incident of an alert seen before
    rows = []
    for item in parsed:
        alert = (
            Alert.objects.select_for_update()
            .filter(fingerprint=item["fingerprint"], starts_at=item["starts_at"])
            .first()
        )
        if alert is not None:  # seen before: a repeat changes nothing; a resolution goes on its own incident
            if alert.status != item["status"]:
                alert.status, alert.ends_at, alert.updated_at = item["status"], item["ends_at"], now
                alert.annotations = item["annotations"] or alert.annotations
                alert.save(update_fields=["status", "ends_at", "updated_at", "annotations"])
                _on_timeline(alert, now)
            seen_on = seen_on or alert.incident
            rows.append(alert)
            continue
        if item["status"] == AlertStatus.RESOLVED and incident is None:
            continue  # resolved before Lifeline ever saw it firing (a receiver added since): nothing to open
        if incident is None:
            incident, opened = _open_for(group_key, item, now), True
        alert = Alert.objects.create(
            incident=incident,
            group_key=group_key,
            node=node_named(item["labels"]),
            severity=item["labels"].get("severity", "")[:32],
            received_at=now,
            updated_at=now,
            **{k: item[k] for k in ("fingerprint", "name", "status", "labels", "annotations", "starts_at")},
            ends_at=item["ends_at"],
            generator_url=item["generator_url"],
        )
        _on_timeline(alert, now)
        rows.append(alert)
    incident = incident or seen_on
    if incident is None:
        return {"incident": None, "opened": False, "alerts": []}
    _after(incident, opened, now)
    return {
        "incident": incident.pk,
        "opened": opened,
        "status": incident.status,
        "alerts": [
            {"name": a.name, "status": a.status, "node": a.node.name if a.node_id else None, "links": links(a)}
            for a in rows
        ],
    }


def _incident_of(group_key: str) -> Incident | None:
    """The active incident the group's alerts opened or joined, if any."""
    return (
        Incident.objects.select_for_update()
        .filter(alerts__group_key=group_key, status=IncidentStatus.ACTIVE)
        .order_by("-opened_at")
        .first()
    )


def _open_for(group_key: str, first: dict, now: dt.datetime) -> Incident:
    """The incident of a group's first firing alert: the active incident of the node it names (a node's failure that
    Prometheus saw too), or a new one of its own."""
    node = node_named(first["labels"])
    joined = None
    if node is not None:
        joined = node.incidents.select_for_update().filter(status=IncidentStatus.ACTIVE).order_by("-opened_at").first()
    if joined is not None:
        return joined
    summary = first["annotations"].get("summary", "")
    title = f"{first['name']}: {summary}" if summary else first["name"]
    at = min(first["starts_at"], now)
    incident = incidents.open_incident(title[:200], at, kind="alert", detected_at=now, alert_group=group_key)
    severity = SEVERITIES.get(first["labels"].get("severity", "").lower())
    if severity is not None and severity != incident.severity:
        Incident.objects.filter(pk=incident.pk).update(severity=severity)
        incident.severity = severity
    return incident


def _on_timeline(alert: Alert, now: dt.datetime) -> None:
    incident = alert.incident
    if alert.node_id is not None and not incident.nodes.filter(pk=alert.node_id).exists():
        incident.nodes.add(alert.node)
    at = alert.starts_at if alert.status == AlertStatus.FIRING else (alert.ends_at or now)
    incidents.add_event(
        incident,
        EventKind.ALERT,
        _describe(alert),
        at=min(at, now),
        source="alertmanager",
        node=alert.node,
        details={
            "alertname": alert.name,
            "status": alert.status,
            "labels": alert.labels,
            "annotations": alert.annotations,
            "generator_url": alert.generator_url,
            "links": links(alert),
        },
    )


def _after(incident: Incident, opened: bool, now: dt.datetime) -> None:
    """On-call told of a paging alert's new incident; the incident Stable once every alert of it has resolved and
    no node failed in it (nodes that failed return as for any failure: the periodic check stabilizes it then)."""
    alerts = list(incident.alerts.all())
    paging = [a for a in alerts if a.severity.lower() in PAGING and a.status == AlertStatus.FIRING]
    if opened and paging:
        first = paging[0]
        notify.send(
            "alert",
            f"Alert: {incident.title}"[:200],
            f"{_describe(first)}. From Alertmanager; incident #{incident.pk}.",
            reverse("incident", args=[incident.pk]),
            severity=incident.severity,
        )
    firing = [a for a in alerts if a.status == AlertStatus.FIRING]
    failed = incident.events.filter(kind=EventKind.DETECTED).exists() or incident.details.get("failures")
    if not firing and not failed and incident.status == IncidentStatus.ACTIVE:
        claimed = Incident.objects.filter(pk=incident.pk, status=IncidentStatus.ACTIVE).update(
            status=IncidentStatus.STABLE, status_changed_at=now
        )
        if claimed:
            incident.status = IncidentStatus.STABLE
            incidents.add_event(
                incident,
                EventKind.STATUS,
                f"Active → Stable: every alert of it resolved ({', '.join(sorted({a.name for a in alerts}))})",
                at=now,
                source="alertmanager",
            )
    transaction.on_commit(lambda pk=incident.pk: events.incident_changed(pk))


def firing(incident: Incident) -> bool:
    """Whether any alert of `incident` still fires (it is not Stable while one does)."""
    return incident.alerts.filter(status=AlertStatus.FIRING).exists()
