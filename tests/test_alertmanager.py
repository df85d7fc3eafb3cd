"""The Alertmanager configuration Lifeline ships (prometheus/alertmanager/alertmanager.yml), checked by amtool and
run for real (issue 48): Debian's Alertmanager, with that configuration (only its addresses and secret files made
local), takes a page and a ticket as Prometheus posts them; the page reaches Lifeline's receiver (an incident on
the node it names, on-call told) and PagerDuty's Events API v2, the ticket Lifeline and Slack; and when the page
resolves, the incident is Stable and PagerDuty's incident resolved. PagerDuty and Slack are stand-ins here that
record what they receive, in their documented shapes."""

import datetime as dt
import subprocess

import pytest

from console.models import ApiToken
from harness import alertmanager as am
from harness.processes import http_json, wait_for
from recovery.choices import IncidentSeverity, IncidentStatus
from recovery.models import Alert, Notification
from tests.recovery.test_alerts import register

CONFIG = am.CONFIG


def routes(*labels: str) -> str:
    """The receiver amtool says the configuration routes an alert with `labels` to."""
    argv = [str(am.amtool()), "config", "routes", "test", f"--config.file={CONFIG}", *labels]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout.strip()


def test_the_shipped_configuration_is_valid_and_routes_pages_tickets_and_moe_models():
    checked = am.check_config(CONFIG)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    assert routes("alertname=LifelineCanaryMismatch", "severity=page", "model=Qwen3-32B") == "pager"
    assert routes("alertname=LifelineExpertWorkerDown", "severity=page", "model=Mixtral-8x7B") == "pager-moe"
    assert routes("alertname=LifelineDegraded", "severity=ticket", "model=Qwen3-32B") == "chat"
    assert routes("alertname=DCGMXidErrors", "Hostname=dgx-07") == "lifeline"


@pytest.fixture
def outside():
    """The stand-ins for PagerDuty and Slack, on one local server."""
    with am.StandIns() as stand_ins:
        yield stand_ins.url, stand_ins.received


@pytest.fixture
def alertmanager(tmp_path):
    """Debian's Alertmanager on a free port with the given configuration, alone (no cluster peers)."""
    started = []

    def start(config: dict) -> str:
        started.append(am.start(tmp_path, config))
        return started[-1].url

    yield start
    for server in started:
        server.stop()


def posted(name: str, severity: str, model: str, ends: dt.datetime | None = None, **labels) -> dict:
    """An alert as Prometheus posts it to Alertmanager's API (v2)."""
    alert = {
        "labels": {"alertname": name, "severity": severity, "model": model, **labels},
        "annotations": {"summary": f"{name} on {model}", "runbook_url": f"http://console.test/runbooks/{name}/"},
        "startsAt": "2026-12-07T03:00:00Z",
        "generatorURL": "http://prometheus.test/graph",
    }
    if ends is not None:
        alert["endsAt"] = ends.isoformat().replace("+00:00", "Z")
    return alert


def test_a_page_reaches_lifeline_on_call_and_pagerduty_a_ticket_slack_and_the_resolution_all_of_them(
    live_server, cast, outside, alertmanager, tmp_path
):
    stand_in, received = outside
    _, token = ApiToken.issue(cast["operator"], "alertmanager")
    register("am-node-1", "gpu-host-9")
    url = alertmanager(am.local_config(tmp_path, live_server.url, stand_in, token))
    page = posted("LifelineCanaryMismatch", "page", "Qwen3-32B", node="am-node-1", check="logprob")
    ticket = posted("LifelineDegraded", "ticket", "Llama-3.1-8B")
    assert http_json(url + "/api/v2/alerts", data=[page, ticket])[0] == 200

    def taken():
        return Alert.objects.count() == 2 and received.get("/v2/enqueue") and received.get("/slack/serving")

    wait_for(taken, 30, 0.2, "both alerts at Lifeline, the page at PagerDuty, the ticket at Slack")
    paged = Alert.objects.select_related("incident", "node").get(name="LifelineCanaryMismatch")
    assert paged.node.name == "am-node-1" and paged.incident.severity == IncidentSeverity.SEV2
    assert paged.incident.status == IncidentStatus.ACTIVE and paged.group_key.endswith('model="Qwen3-32B"}')
    assert Notification.objects.filter(kind="alert", url=f"/incidents/{paged.incident_id}/").exists()
    ticketed = Alert.objects.get(name="LifelineDegraded")
    assert ticketed.incident_id != paged.incident_id and ticketed.node is None  # another group, no node
    [trigger] = received["/v2/enqueue"]
    assert trigger["routing_key"] == "routing-serving" and trigger["event_action"] == "trigger"
    assert trigger["payload"]["summary"] == "LifelineCanaryMismatch on Qwen3-32B"
    assert trigger["links"][0]["href"] == "http://console.test/runbooks/LifelineCanaryMismatch/"
    [chat] = received["/slack/serving"]
    assert chat["channel"] == "#serving-alerts" and chat["attachments"][0]["title"] == "LifelineDegraded (firing)"

    # The page resolves in Prometheus: Alertmanager tells Lifeline and PagerDuty.
    ended = dt.datetime.now(dt.UTC).replace(microsecond=0)
    resolved = posted("LifelineCanaryMismatch", "page", "Qwen3-32B", ended, node="am-node-1", check="logprob")
    assert http_json(url + "/api/v2/alerts", data=[resolved])[0] == 200

    def stable():
        paged.incident.refresh_from_db()
        return paged.incident.status == IncidentStatus.STABLE and len(received["/v2/enqueue"]) == 2

    wait_for(stable, 30, 0.2, "the page's incident Stable and PagerDuty's resolved")
    assert received["/v2/enqueue"][1]["event_action"] == "resolve"
    assert Alert.objects.get(pk=paged.pk).status == "resolved"
    assert Alert.objects.get(pk=ticketed.pk).incident.status == IncidentStatus.ACTIVE  # the ticket still fires
