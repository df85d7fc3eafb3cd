"""Lifeline as an Alertmanager receiver (issue 48, item 2): a group's alerts open or join one incident and add to its
timeline, an alert naming a node (Lifeline's `node` label, a DCGM exporter's `Hostname`, a node exporter's
`instance`) is attached to it, each alert links to the pages that explain it, a paging alert reaches on-call, the
incident is Stable once every alert of it has resolved and not before, repeats change nothing, and a notification
Lifeline cannot take is refused naming its field. Through the endpoint, with a user's API token, as Alertmanager
sends it (payload version 4)."""

import datetime as dt
import uuid

import pytest
from django.test import Client
from django.utils import timezone

from console.models import ApiToken
from recovery.actions import incidents, nodes
from recovery.choices import EventKind, IncidentSeverity
from recovery.models import Alert, Incident, Notification
from workers.protocol import Registration

pytestmark = pytest.mark.django_db
URL = "/api/alerts/alertmanager"
STARTED = "2026-12-07T03:11:46.961Z"


def register(name: str, host: str):
    registration = {
        "name": name,
        "session": uuid.uuid4().hex,
        "address": "http://127.0.0.1:9",
        "rack": "rack-a",
        "model": "Qwen3-32B",
        "gpu": "H100-SXM",
        "tp": 1,
        "pid": 1,
        "host": host,
        "gpus": [{"index": 0, "uuid": f"GPU-{name}", "name": "H100", "memory_bytes": 80 * 10**9}],
    }
    node = nodes.register_node(Registration.parse(registration))
    nodes.transition_node(node, "serving", "test")
    return node


def alert(name: str, status: str = "firing", starts: str = STARTED, ends: str = "", **labels) -> dict:
    return {
        "status": status,
        "labels": {"alertname": name, **labels},
        "annotations": {
            "summary": f"{name} summary",
            "runbook_url": f"http://console.example/runbooks/{name}/",
        },
        "startsAt": starts,
        "endsAt": ends or "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus.example/graph?g0.expr=up",
        "fingerprint": uuid.uuid5(uuid.NAMESPACE_OID, name + repr(sorted(labels.items()))).hex[:16],
    }


def notification(group: str, *alerts: dict) -> dict:
    status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"
    return {
        "version": "4",
        "groupKey": group,
        "status": status,
        "receiver": "lifeline",
        "groupLabels": {"alertname": alerts[0]["labels"]["alertname"]},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "http://alertmanager.example:9093",
        "truncatedAlerts": 0,
        "alerts": list(alerts),
    }


@pytest.fixture
def alertmanager(cast, commit):
    """Alertmanager's webhook as it posts it, with an operator's API token (its http_config's credentials)."""
    _, token = ApiToken.issue(cast["operator"], "alertmanager")
    client = Client()

    def post(body) -> tuple[int, dict]:
        response = commit(client.post, URL, body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}")
        return response.status_code, response.json()

    return post


def test_a_groups_alerts_share_an_incident_link_their_pages_page_on_call_and_resolve_it(alertmanager):
    node = register("am-1", "gpu-host-1")
    first = alert("LifelineCanaryMismatch", node="am-1", severity="page", check="logprob")
    status, body = alertmanager(notification('{}:{alertname="LifelineCanaryMismatch"}', first))
    assert status == 200 and body["opened"] and body["status"] == "active", body
    incident = Incident.objects.get(pk=body["incident"])
    assert incident.title == "LifelineCanaryMismatch: LifelineCanaryMismatch summary"
    assert incident.severity == IncidentSeverity.SEV2 and incident.details["kind"] == "alert"
    assert incident.opened_at == dt.datetime(2026, 12, 7, 3, 11, 46, 961000, tzinfo=dt.UTC)
    assert list(incident.nodes.values_list("name", flat=True)) == ["am-1"]
    [said] = body["alerts"]
    assert said["node"] == "am-1" and said["links"] == {
        "incident": f"/incidents/{incident.pk}/",
        "runbook": "http://console.example/runbooks/LifelineCanaryMismatch/",
        "node": "/nodes/am-1/",
    }
    paged = Notification.objects.get(kind="alert")
    assert paged.url == f"/incidents/{incident.pk}/" and "am-1" in paged.body
    # Alertmanager repeats a group's notification every repeat_interval: nothing new.
    assert alertmanager(notification('{}:{alertname="LifelineCanaryMismatch"}', first))[0] == 200
    assert Alert.objects.count() == 1 and incident.events.filter(kind=EventKind.ALERT).count() == 1
    # A second alert of the group joins the incident; one of them resolving leaves it active.
    second = alert("LifelineCanaryMismatch", node="am-1", severity="page", check="tokens")
    group = '{}:{alertname="LifelineCanaryMismatch"}'
    status, body = alertmanager(notification(group, first, second))
    assert status == 200 and body["incident"] == incident.pk and not body["opened"]
    done = {**first, "status": "resolved", "endsAt": "2026-12-07T03:14:00Z"}
    status, body = alertmanager(notification(group, done, second))
    assert body["status"] == "active" and Alert.objects.get(fingerprint=first["fingerprint"]).status == "resolved"
    # Every alert resolved: Stable, saying why, each step on the timeline.
    status, body = alertmanager(
        notification(group, done, {**second, "status": "resolved", "endsAt": "2026-12-07T03:15:00Z"})
    )
    assert body["status"] == "stable", body
    incident.refresh_from_db()
    lines = list(
        incident.events.filter(kind__in=(EventKind.ALERT, EventKind.STATUS)).values_list("description", flat=True)
    )
    assert lines[:2] == ["LifelineCanaryMismatch on am-1 firing: LifelineCanaryMismatch summary"] * 2, lines
    assert "LifelineCanaryMismatch on am-1 resolved: LifelineCanaryMismatch summary" in lines
    assert lines[-1] == "Active → Stable: every alert of it resolved (LifelineCanaryMismatch)", lines
    assert Notification.objects.filter(kind="alert").count() == 1  # paged once, when it opened
    # The same group firing again later is a new incident.
    again = alert("LifelineCanaryMismatch", starts="2026-12-07T05:00:00Z", node="am-1", severity="page", check="x")
    status, body = alertmanager(notification(group, again))
    assert body["opened"] and body["incident"] != incident.pk and node.incidents.count() == 2


def test_outside_exporters_alerts_attach_to_the_node_they_name(alertmanager):
    register("am-2", "dgx-07.example")
    register("am-3", "dgx-08.example")
    dcgm = alert("DCGMXidErrors", Hostname="dgx-07.example", gpu="3", severity="critical")
    exporter = alert("NodeFilesystemAlmostFull", instance="dgx-08.example:9100", severity="warning")
    stranger = alert("NodeClockSkew", instance="10.9.9.9:9100")
    status, body = alertmanager(notification("{}:{}", dcgm, exporter, stranger))
    assert status == 200, body
    assert [(a["name"], a["node"]) for a in body["alerts"]] == [
        ("DCGMXidErrors", "am-2"),
        ("NodeFilesystemAlmostFull", "am-3"),
        ("NodeClockSkew", None),
    ]
    incident = Incident.objects.get(pk=body["incident"])
    assert incident.severity == IncidentSeverity.SEV1  # the first alert's severity: critical
    assert sorted(incident.nodes.values_list("name", flat=True)) == ["am-2", "am-3"]
    assert "runbook" in body["alerts"][2]["links"] and "node" not in body["alerts"][2]["links"]


def test_an_incident_is_not_stable_while_an_alert_of_it_fires(alertmanager):
    """Latency recovered and capacity restored (its node serves) would make it Stable; a firing alert keeps it
    Active until it resolves."""
    register("am-4", "h4")
    group = '{}:{alertname="DCGMThermalViolation"}'
    hot = alert("DCGMThermalViolation", node="am-4", severity="page")
    incident = Incident.objects.get(pk=alertmanager(notification(group, hot))[1]["incident"])
    now = timezone.now()
    Incident.objects.filter(pk=incident.pk).update(recovered_at=now, capacity_restored_at=now)
    incident.refresh_from_db()
    assert not incidents._stabilize(incident, now)
    cool = {**hot, "status": "resolved", "endsAt": "2026-12-07T03:20:00Z"}
    Alert.objects.filter(incident=incident).update(status="resolved")  # as the receiver records it
    assert incidents._stabilize(incident, now)
    assert alertmanager(notification(group, cool))[0] == 200


def test_a_resolution_of_an_alert_never_seen_firing_opens_nothing(alertmanager):
    late = alert("LifelineDegraded", status="resolved", ends="2026-12-07T03:30:00Z")
    assert alertmanager(notification("{}:{}", late)) == (200, {"incident": None, "opened": False, "alerts": []})
    assert not Incident.objects.exists()


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (lambda n: n.update(version="3"), "version", "version 4"),
        (lambda n: n.pop("groupKey"), "groupKey", "required"),
        (lambda n: n.update(alerts=[]), "alerts", "at least one alert"),
        (lambda n: n["alerts"][0]["labels"].pop("alertname"), "alerts[0].labels.alertname", "alertname"),
        (lambda n: n["alerts"][0].update(status="pending"), "alerts[0].status", "'firing' or 'resolved'"),
        (lambda n: n["alerts"][0].update(startsAt="yesterday"), "alerts[0].startsAt", "not an RFC 3339 time"),
        (lambda n: n["alerts"][0].update(startsAt="2026-12-07T03:11:46"), "alerts[0].startsAt", "no time zone"),
        (lambda n: n["alerts"][0]["labels"].update(gpu=3), "alerts[0].labels", "strings"),
        (lambda n: n["alerts"][0].update(fingerprint=7), "alerts[0].fingerprint", "a string"),
    ],
)
def test_a_notification_lifeline_cannot_take_is_refused_naming_its_field(alertmanager, change, field, words):
    body = notification("{}:{}", alert("LifelineDegraded"))
    change(body)
    status, answer = alertmanager(body)
    assert status == 400 and answer["error"]["field"] == field and words in answer["error"]["message"], answer
    assert not Incident.objects.exists() and not Alert.objects.exists()  # nothing half-taken


def test_the_incident_page_shows_each_alert_with_links_to_its_runbook_and_node(alertmanager, cast):
    register("am-5", "h5")
    firing = alert("LifelineCanaryMismatch", node="am-5", severity="page")
    incident = alertmanager(notification("{}:{}", firing))[1]["incident"]
    client = Client()
    client.force_login(cast["oncall"])
    page = client.get(f"/incidents/{incident}/").content.decode()
    assert "LifelineCanaryMismatch on am-5 firing: LifelineCanaryMismatch summary" in page
    assert '<a href="http://console.example/runbooks/LifelineCanaryMismatch/" rel="noopener">runbook</a>' in page
    assert '<a href="/nodes/am-5/" rel="noopener">am-5</a>' in page


def test_a_runbook_link_that_is_not_a_web_address_is_not_shown(alertmanager):
    firing = alert("Odd")
    firing["annotations"]["runbook_url"] = "javascript:alert(1)"
    [said] = alertmanager(notification("{}:{}", firing))[1]["alerts"]
    assert "runbook" not in said["links"]


def test_an_alert_naming_a_node_in_an_active_incident_joins_it_and_another_opens_its_own(alertmanager, commit):
    node = register("am-6", "h6")
    failed = commit(incidents.note_failure, node, timezone.now(), "gw-1", "stream broke")
    target = alert("LifelineTargetDown", severity="page", instance="h6:8000")
    assert alertmanager(notification("{}:{a}", target))[1]["incident"] == failed.pk
    elsewhere = alert("LifelineDegraded", severity="ticket", model="Qwen3-32B")
    status, body = alertmanager(notification("{}:{b}", elsewhere))
    assert body["opened"] and body["incident"] != failed.pk  # active too, but about no node of it
