"""Issue 11, "time and recovery that mean what they say", as the pages show it: one rule for time (UTC with the
date), the incident's header (latency recovered and capacity restored apart, requests moved, shed and failed, the
stall of moved streams, the degradation level's peak and fall, a severity), and the incidents list's dates, filters
and totals."""

import datetime as dt
import re

import pytest
from django.utils import timezone

from console.templatetags.lifeline import utc
from recovery.actions import audit, drains
from recovery.choices import EventKind, IncidentSeverity, IncidentStatus
from recovery.models import Incident, IncidentEvent, Node, RequestOutcome
from tests.console.test_console import make_node

pytestmark = pytest.mark.django_db

MOMENT = dt.datetime(2026, 11, 23, 22, 50, 20, 123456, tzinfo=dt.UTC)
LIST_TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC")
TIMELINE_TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} UTC")


def test_one_rule_for_time_utc_with_the_date():
    assert utc(MOMENT.timestamp()) == "2026-11-23 22:50:20.123 UTC"
    assert utc(MOMENT) == "2026-11-23 22:50:20.123 UTC"
    assert utc(MOMENT.astimezone(dt.timezone(dt.timedelta(hours=-5)))) == "2026-11-23 22:50:20.123 UTC"
    assert utc(MOMENT, "min") == "2026-11-23 22:50 UTC" and utc(MOMENT, "s") == "2026-11-23 22:50:20 UTC"
    assert utc(None) == "—"


def incident(name="node-01", *, at=None, status=IncidentStatus.ACTIVE, severity=IncidentSeverity.SEV3, **fields):
    node = Node.objects.filter(name=name).first() or make_node(name)
    at = at or timezone.now() - dt.timedelta(minutes=5)
    created = Incident.objects.create(
        cluster=node.cluster,
        title=f"{name} failed",
        opened_at=at,
        status=status,
        severity=severity,
        details={"nodes_in_service": 3},
        **fields,
    )
    created.nodes.add(node)
    return created


def event(inc, kind, seconds, **fields):
    return IncidentEvent.objects.create(
        incident=inc, kind=kind, at=inc.opened_at + dt.timedelta(seconds=seconds), source="test", **fields
    )


def test_the_header_shows_two_recovery_figures_counts_stalls_degradation_and_severity(client, cast):
    opened = timezone.now() - dt.timedelta(minutes=2)
    inc = incident(
        at=opened,
        severity=IncidentSeverity.SEV2,
        recovered_at=opened + dt.timedelta(seconds=1.6),
        recovery_time_s=1.6,
        capacity_restored_at=opened + dt.timedelta(seconds=38.2),
        status=IncidentStatus.STABLE,
    )
    for i, stall in enumerate((12.0, 30.0, 400.0)):
        event(inc, EventKind.REQUEST_MOVED, 0.5, request_id=f"r-{i}", details={"stall_ms": stall})
    event(inc, EventKind.DEGRADATION, 2.0, details={"old": 0, "new": 1})
    event(inc, EventKind.DEGRADATION, 3.0, details={"old": 1, "new": 2})
    event(inc, EventKind.DEGRADATION, 41.0, details={"old": 2, "new": 0})
    common = {"gateway": "gw", "tenant": "t", "tier": "standard", "model_key": "Qwen3-32B"}
    during = {"started_at": opened + dt.timedelta(seconds=5), "finished_at": opened + dt.timedelta(seconds=5)}
    RequestOutcome.objects.create(request_id="f-1", status="error", incident=inc, **common, **during)
    for i in range(4):
        RequestOutcome.objects.create(request_id=f"s-{i}", status="shed", **common, **during)
    client.force_login(cast["manager"])
    html = client.get(f"/incidents/{inc.pk}/").content.decode()
    latency = re.search(r'id="latency-recovered"[^>]*>(.*?)</dd>', html, re.S).group(1)
    capacity = re.search(r'id="capacity-restored"[^>]*>(.*?)</dd>', html, re.S).group(1)
    assert "after 1.6 s" in latency and TIMELINE_TIME.search(latency)
    assert "after 38.2 s" in capacity and TIMELINE_TIME.search(capacity)
    assert re.search(r'data-count="moved">3<.*data-count="shed"[^>]*>4<.*data-count="failed">1<', html, re.S)
    assert "p50 30 ms · p99 400 ms" in html
    assert "peak level 2 at +3000 ms; back to 0 at +41.0 s" in html
    assert 'id="incident-severity" data-severity="sev2"' in html and ">SEV2<" in html
    assert TIMELINE_TIME.search(re.search(r'id="incident-opened">(.*?)<', html).group(1))
    facts = client.get(f"/incidents/{inc.pk}/?partial=facts").content.decode()  # the live refresh shows the same
    assert 'id="capacity-restored"' in facts and 'data-count="shed"' in facts
    chart = client.get(f"/incidents/{inc.pk}/?partial=chart").json()
    assert chart["marks"]["capacity_restored"] == pytest.approx(inc.capacity_restored_at.timestamp())
    api = client.get(f"/api/incidents/{inc.pk}").json()
    assert api["figures"]["shed"] == 4 and api["severity"] == "sev2" and api["capacity_time_s"] == pytest.approx(38.2)


def test_the_list_has_dates_filters_and_totals(client, cast):
    now = timezone.now()
    old = incident("node-01", at=now - dt.timedelta(days=3), status=IncidentStatus.CLOSED)
    bad = incident("node-02", at=now - dt.timedelta(hours=2), severity=IncidentSeverity.SEV1)
    fresh = incident("node-03", at=now - dt.timedelta(minutes=1), severity=IncidentSeverity.SEV2)
    event(bad, EventKind.REQUEST_MOVED, 1, request_id="r-1")
    event(bad, EventKind.REQUEST_MOVED, 2, request_id="r-1")  # moved twice: one request
    event(bad, EventKind.REQUEST_MOVED, 2, request_id="r-2")
    common = {"gateway": "gw", "tenant": "t", "tier": "standard", "model_key": "Qwen3-32B"}
    for i in range(3):
        RequestOutcome.objects.create(
            request_id=f"e-{i}", status="error", incident=bad, started_at=now, finished_at=now, **common
        )
    client.force_login(cast["manager"])

    def rows(query=""):
        response = client.get("/incidents/" + query)
        assert response.status_code == 200, response.content[:500]
        html = response.content.decode()
        return [int(i) for i in re.findall(r'data-incident="(\d+)"', html)], html

    ids, html = rows()
    assert ids == [fresh.pk, bad.pk, old.pk]
    assert len(LIST_TIME.findall(re.search(r'id="incident-rows">(.*)</tbody>', html, re.S).group(1))) == 3
    assert '<strong data-total="incidents">3</strong>' in html
    assert 'data-total-status="active">2 active' in html and 'data-total-severity="sev1">1 SEV1' in html
    assert '<strong data-total="moved">2</strong>' in html and '<strong data-total="failed">3</strong>' in html
    assert rows("?status=active")[0] == [fresh.pk, bad.pk]
    ids, html = rows("?severity=sev1")
    assert ids == [bad.pk] and '<strong data-total="incidents">1</strong>' in html
    assert rows("?node=node-03")[0] == [fresh.pk]
    since = (now - dt.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    until = (now - dt.timedelta(minutes=30)).strftime("%Y-%m-%dT%H:%M")
    ids, html = rows(f"?since={since}&until={until}")
    assert ids == [bad.pk]
    assert f"?since={since.replace(':', '%3A')}&amp;until={until.replace(':', '%3A')}&amp;partial=rows" in html
    partial = client.get("/incidents/?severity=sev2&partial=rows").content.decode()  # the live refresh, filtered
    assert re.findall(r'data-incident="(\d+)"', partial) == [str(fresh.pk)] and 'id="incident-totals"' in partial
    assert "No incident matches these filters" in rows("?node=node-01&status=active")[1]
    api = client.get("/api/incidents?severity=sev1").json()
    assert [i["id"] for i in api["incidents"]] == [bad.pk] and api["incidents"][0]["moved"] == 2
    assert api["totals"]["failed"] == 3 and api["totals"]["incidents"] == 1


@pytest.mark.parametrize(
    ("query", "field", "says"),
    [
        ("status=broken", "status", "broken is not one of active, stable, closed"),
        ("severity=sev9", "severity", "sev9 is not one of sev1, sev2, sev3"),
        ("node=node-99", "node", "there is no node named node-99"),
        ("since=yesterday", "since", "not a time in UTC"),
        ("since=2026-11-23&until=2026-11-01", "until", "must be after since"),
    ],
)
def test_a_bad_filter_is_a_400_that_names_it(client, cast, query, field, says):
    incident("node-01")
    client.force_login(cast["operator"])
    response = client.get(f"/incidents/?{query}")
    html = response.content.decode()
    assert response.status_code == 400 and f'<li data-field="{field}">{field}: ' in html and says in html
    api = client.get(f"/api/incidents?{query}")
    assert api.status_code == 400 and api.json()["error"]["param"] == field and says in api.json()["error"]["message"]
    assert client.get("/api/incidents?limit=many").json()["error"]["param"] == "limit"


def test_lists_and_timelines_elsewhere_show_utc_with_the_date(client, cast, commit):
    node = make_node("node-01")
    commit(drains.propose, node, source="health machine", reason="canaries failing")
    audit.record("operator", "cordon", "node:node-01", "fan noise")
    client.force_login(cast["admin"])
    drains_page = client.get("/drains/").content.decode()
    assert LIST_TIME.search(re.search(r"<tbody id=\"drain-rows\">(.*?)</tbody>", drains_page, re.S).group(1))
    drain = client.get(f"/drains/{node.drains.get().pk}/").content.decode()
    assert TIMELINE_TIME.search(drain)
    assert TIMELINE_TIME.search(
        re.search(r'id="audit-rows">(.*)</table>', client.get("/audit/").content.decode(), re.S).group(1)
    )
    assert TIMELINE_TIME.search(client.get("/nodes/node-01/").content.decode())
