"""Issue 11, "drains no one can bypass": a drain cancelled or rejected while its node stays out of service is proposed
again after a hold-off; a node found corrupt has its requests in flight moved off at once and those it served named;
silent corruption and a CRITICAL Xid open an incident linked to the drain. Against the real database and Redis."""

import datetime as dt
import json
import time

import pytest
from django.conf import settings
from django.utils import timezone

from recovery import hot, tasks
from recovery.actions import cluster_settings, drains, health
from recovery.choices import DrainState, EventKind, Health
from recovery.models import CanaryResult, Cluster, Drain, Node, Notification, RequestOutcome
from recovery.policy import health as policy
from tests.helpers import wait_for
from tests.recovery.test_health import configure, hand_to_repair, register

pytestmark = pytest.mark.django_db


def critical_xid(commit, name):
    commit(health.ingest_xids, name, [{"at": time.time(), "gpu": 0, "code": 48}])


def later(seconds: float) -> dt.datetime:
    return timezone.now() + dt.timedelta(seconds=seconds)


# --- proposed again after a hold-off -------------------------------------------------------------------------------
def test_a_cancelled_drain_of_a_node_still_out_of_service_is_proposed_again_after_the_hold_off(
    commit, react, tokens, cast
):
    configure(auto_cordon_max_share=1.0)
    node, _ = commit(register, "nb-xid")
    critical_xid(commit, "nb-xid")
    react()
    first = Drain.objects.get(node=node)
    assert first.source == "health machine" and first.requested_by is None
    commit(drains.cancel, first, cast["oncall"], "looking at it myself")
    node.refresh_from_db()
    assert node.health == Health.UNHEALTHY  # left out of service, and nobody deciding

    assert Cluster.default().drain_propose_again_s == 600  # the default: ten minutes
    assert commit(drains.propose_again, later(599)) == []  # not before the hold-off
    [again] = commit(drains.propose_again, later(601))
    assert again.state == DrainState.PROPOSED and again.proposed_again_of == first
    assert again.source == "health machine" and again.requested_by is None  # on-call's to withdraw, as the first
    assert again.reason.startswith("Proposed again: nb-xid is still out of service (UNHEALTHY)")
    assert f"after drain #{first.pk} was cancelled by oncall: looking at it myself" in again.reason
    assert again.reason.endswith(f"First raised: {first.reason}")
    assert again.remediation == first.remediation and again.incident_id == first.incident_id is not None
    assert Notification.objects.filter(kind="drain_requested", url=f"/drains/{again.pk}/").exists()  # on-call told
    assert commit(drains.propose_again, later(1200)) == []  # one open drain is enough

    # Rejected, then proposed again: the reason names the drain just rejected and still the first cause.
    commit(drains.decide, again, cast["oncall"], "reject", "rehearsal noise")
    [third] = commit(drains.propose_again, later(1300))
    assert f"after drain #{again.pk} was rejected by oncall: rehearsal noise" in third.reason
    assert third.reason.count("Proposed again") == 1 and third.reason.endswith(f"First raised: {first.reason}")


def test_a_node_back_in_service_or_handed_to_repair_is_not_proposed_again(commit, react, tokens, cast):
    configure(auto_cordon_max_share=1.0)
    node, _ = commit(register, "nb-back")
    critical_xid(commit, "nb-back")
    react()
    commit(drains.decide, Drain.objects.get(node=node), cast["oncall"], "reject", "the ECC count is stable")
    node.refresh_from_db()
    commit(health.set_health, node, Health.HEALTHY, "canary passed")
    # A node handed to hardware repair stays out of service on purpose, until a person returns it.
    repaired, _ = commit(register, "nb-repair")
    assert hand_to_repair(commit, cast, repaired).state == DrainState.HANDED_OFF
    assert Node.objects.get(pk=repaired.pk).weight == 0.0
    assert drains.left_out_of_service() == []
    assert commit(drains.propose_again, later(3600)) == []


def test_the_hold_off_is_a_cluster_setting_and_beat_runs_the_re_proposal(commit, react, tokens, cast):
    with pytest.raises(cluster_settings.SettingsRefused) as refused:
        cluster_settings.update(Cluster.default(), {"drain_propose_again_s": 5}, "admin")
    assert refused.value.field == "drain_propose_again_s" and "between 10 and" in str(refused.value)
    cluster_settings.update(Cluster.default(), {"drain_propose_again_s": 30}, "admin", "faster")
    assert "recovery.tasks.propose_drains_again" in {e["task"] for e in settings.CELERY_BEAT_SCHEDULE.values()}

    configure(auto_cordon_max_share=1.0)
    node, _ = commit(register, "nb-beat")
    critical_xid(commit, "nb-beat")
    react()
    first = Drain.objects.get(node=node)
    commit(drains.cancel, first, cast["admin"], "checking the cable")
    Drain.objects.filter(pk=first.pk).update(finished_at=later(-31))
    assert commit(tasks.propose_drains_again) == [Drain.objects.get(node=node, state=DrainState.PROPOSED).pk]


# --- silent corruption: requests moved off at once, those served named -----------------------------------------
def outcome(request_id, node, started, finished, nodes=None):
    return RequestOutcome.objects.create(
        request_id=request_id,
        gateway="gw-t",
        tenant="acme",
        tier="premium",
        model_key="Qwen3-32B",
        node=node,
        nodes=nodes or [node],
        status="ok",
        started_at=started,
        finished_at=finished,
    )


def test_a_corrupt_node_has_its_requests_moved_off_at_once_and_those_it_served_named(commit, react, tokens):
    configure(auto_cordon_max_share=1.0)
    node, _ = commit(register, "nb-sdc")
    commit(register, "nb-ok", rack="rack-b")
    t0 = timezone.now()
    good = CanaryResult.objects.create(node=node, at=t0 - dt.timedelta(seconds=30), passed=True, kind="ok")
    outcome("before-the-good-canary", "nb-sdc", t0 - dt.timedelta(seconds=60), t0 - dt.timedelta(seconds=40))
    outcome("served-since", "nb-sdc", t0 - dt.timedelta(seconds=20), t0 - dt.timedelta(seconds=10))
    outcome("moved-through", "nb-ok", t0 - dt.timedelta(seconds=25), t0 - dt.timedelta(seconds=5), ["nb-sdc", "nb-ok"])
    outcome("elsewhere", "nb-ok", t0 - dt.timedelta(seconds=20), t0 - dt.timedelta(seconds=10))
    # What a gateway holds in flight, as it publishes it every second.
    r, k = hot.client(), hot.keys()
    r.hset(k.gateway_inflight("gw-t"), mapping={"in-flight": json.dumps({"node": "nb-sdc", "tier": "premium"})})
    r.hset(k.gateway_inflight("gw-t"), mapping={"on-another": json.dumps({"node": "nb-ok", "tier": "premium"})})
    r.zadd(k.gateways, {"gw-t": time.time()})
    commands = r.pubsub(ignore_subscribe_messages=True)
    commands.subscribe(k.gateway_commands)

    wrong = policy.Verdict(False, "token_mismatch", "token 3: expected 17, got 912")
    for _ in range(3):
        commit(health.record_canary, node, wrong, 12.0)
    node.refresh_from_db()
    assert node.health == Health.UNHEALTHY and node.weight == 0.0
    react()

    drain = Drain.objects.get(node=node)
    assert drain.state == DrainState.PROPOSED  # the move did not wait for on-call
    message = wait_for(lambda: commands.get_message(timeout=0.1), 2, 0, "the migration command")
    command = json.loads(message["data"])
    assert command["action"] == "migrate" and command["node"] == "nb-sdc"
    assert r.hget(k.migration(command["id"]), "by") == "health machine"
    assert not Node.objects.get(pk=node.pk).cordoned  # not a drain: weight 0 already keeps new requests away

    incident = drain.incident
    suspects = incident.details["suspect_requests"]["nb-sdc"]
    assert suspects["finished"] == ["moved-through", "served-since"] and suspects["in_flight"] == ["in-flight"]
    assert suspects["last_good_canary"] == good.pk and suspects["command"] == command["id"]
    assert set(incident.outcomes.values_list("request_id", flat=True)) == {"served-since", "moved-through"}
    detected = incident.events.get(kind=EventKind.DETECTED)
    assert "3 requests it served since its last good canary" in detected.description
    assert "may have received corrupt tokens: moved-through, served-since, in-flight" in detected.description
    moved = incident.events.get(kind=EventKind.MIGRATION)
    assert moved.details == {"command": command["id"], "requests": ["in-flight"]}
    assert "do not wait for the drain's approval" in moved.description
    commands.close()


def slow_node_drained(commit, react, name):
    """A node whose canaries time out three times: the health machine proposes its drain."""
    configure(auto_cordon_max_share=1.0)
    node, _ = commit(register, name)
    for _ in range(3):
        commit(health.record_canary, node, policy.Verdict(False, "timeout", "no answer in 3 s"), None)
    react()
    return node, Drain.objects.get(node=node)


def test_a_slow_node_is_not_treated_as_corrupt(commit, react, tokens):
    """A timeout is a sick engine, not wrong answers: a drain and no incident of corruption, nothing moved at once."""
    node, drain = slow_node_drained(commit, react, "nb-slow")
    assert drain.incident is None and not node.incidents.exists()


def test_an_approved_drain_takes_capacity_out_and_opens_its_incident(commit, react, tokens, cast):
    """Issue 12: a drain is a failure class the report counts. Once on-call approves it the node leaves service: an
    incident linked to the drain both ways, its node in it, the drain on its timeline."""
    _, drain = slow_node_drained(commit, react, "nb-drained")
    commit(drains.decide, drain, cast["oncall"], "approve", "engine hangs: restart it")
    react()
    drain.refresh_from_db()
    incident = drain.incident
    assert incident is not None and list(incident.nodes.values_list("name", flat=True)) == ["nb-drained"]
    assert incident.detected_at is not None
    detected = incident.events.get(kind=EventKind.DETECTED)
    assert detected.description.startswith(f"nb-drained: drain #{drain.pk} approved: ")
    assert incident.events.filter(kind=EventKind.DRAIN, details={"drain": drain.pk}).exists()


# --- incidents linked to the drain ------------------------------------------------------------------------------
def test_a_critical_xid_opens_an_incident_linked_to_its_drain_both_ways(commit, react, tokens, cast, client):
    configure(auto_cordon_max_share=1.0)
    node, _ = commit(register, "nb-link")
    critical_xid(commit, "nb-link")
    react()
    drain = Drain.objects.get(node=node)
    incident = drain.incident
    assert incident is not None and list(incident.nodes.values_list("name", flat=True)) == ["nb-link"]
    assert incident.detected_at is not None
    assert incident.events.get(kind=EventKind.DETECTED).description.startswith("nb-link: CRITICAL Xid 48")
    assert incident.events.get(kind=EventKind.DRAIN).details == {"drain": drain.pk}
    # Its steps go on the same incident's timeline.
    commit(drains.decide, drain, cast["oncall"], "reject", "ECC burst during a rehearsal")
    assert incident.events.filter(kind=EventKind.DRAIN, description__contains="rejected").exists()

    client.force_login(cast["oncall"])
    assert f'href="/incidents/{incident.pk}/"' in client.get(f"/drains/{drain.pk}/").content.decode()
    assert f'href="/drains/{drain.pk}/"' in client.get(f"/incidents/{incident.pk}/").content.decode()
    assert client.get(f"/api/drains/{drain.pk}").json()["incident"] == incident.pk


def test_a_waiting_drain_is_withdrawn_through_the_api_by_the_roles_the_page_allows(commit, react, tokens, cast, client):
    """POST /api/drains/<id>/cancel: what the drain page's cancel does, for a client with a token. One the health
    machine raised is on-call's or an admin's to withdraw; a reason is needed; only a waiting drain is withdrawn."""
    configure(auto_cordon_max_share=1.0)
    node, _ = commit(register, "nb-api")
    critical_xid(commit, "nb-api")
    react()
    drain = Drain.objects.get(node=node)
    url = f"/api/drains/{drain.pk}/cancel"

    def post(role: str, body: dict):
        client.force_login(cast[role])
        return client.post(url, json.dumps(body), content_type="application/json")

    refused = post("operator", {"reason": "the fans were fine"})
    assert (
        refused.status_code == 403
        and "only the oncall and admin roles may withdraw it" in refused.json()["error"]["message"]
    )
    assert post("oncall", {}).status_code == 409  # no reason given
    drain.refresh_from_db()
    assert drain.state == DrainState.PROPOSED
    answer = post("oncall", {"reason": "I will look at it myself"})
    assert answer.status_code == 200 and answer.json()["state"] == DrainState.CANCELLED, answer.content
    again = post("admin", {"reason": "twice"})
    assert (
        again.status_code == 409
        and "only a drain waiting for approval can be cancelled" in again.json()["error"]["message"]
    )
    assert client.post(f"/api/drains/{drain.pk}/withdraw", "{}", content_type="application/json").status_code == 404
