"""Issue 11, "time and recovery that mean what they say": an incident's timeline that does not contradict itself,
its checkpoints as they were at the failure, latency recovered and capacity restored as two figures, the degradation
level's rise and fall, requests moved, shed and failed, and a severity."""

import datetime as dt
import time

import pytest
from django.utils import timezone

from console.readmodels import incidents as incident_model
from recovery import hot
from recovery.actions import incidents, streams
from recovery.choices import EventKind, IncidentSeverity, IncidentStatus, NodeState
from recovery.models import Incident, Node, RequestOutcome
from recovery.policy import severity as severity_policy
from tests.recovery.test_incidents import outcome, register, signal

pytestmark = pytest.mark.django_db


def moved(request_id, source, target, **fields):
    signal("request_moved", request_id=request_id, tenant="t", **{"from": source, "to": target, **fields})


def test_a_moved_request_says_what_happened_not_what_was_planned(commit):
    commit(register, "tl-1")
    signal("symptom", node="tl-1")
    # Planned: restore on tl-2's host memory; tl-2 had no usable pages and re-prefilled (the demo said both).
    moved(
        "r-1",
        "tl-1",
        "tl-2",
        at_token=40,
        planned_method="restore",
        method="re-prefill",
        restored_tokens=0,
        reprefill_tokens=612,
        resume_reason="this node holds no pages for the request",
        stall_ms=180.0,
        reason="holder tl-2 not overloaded (L̂ 1.0 <= θ 2.0); restore 240 tokens from its host memory",
        tried=["tl-4"],
        kind="failure",
    )
    # As planned: the plan's reason stands beside what happened.
    moved(
        "r-2",
        "tl-1",
        "tl-3",
        at_token=12,
        planned_method="restore",
        method="checkpoint-local",
        restored_tokens=256,
        reprefill_tokens=8,
        stall_ms=20.5,
        reason="holder tl-3 not overloaded; restore 256 tokens from its host memory",
        kind="failure",
    )
    signal("holder_replaced", request_id="r-5", node="tl-3", lost="tl-1", holders=[])
    signal("holder_replaced", request_id="r-6", node="tl-3", lost="tl-1", holders=[], error="tl-3 answered 500")
    commit(streams.process)
    incident = Incident.objects.get()
    first = incident.events.get(kind=EventKind.REQUEST_MOVED, request_id="r-1").description
    assert first.startswith("r-1: tl-1 → tl-2 at token 40 (after tl-4 could not take it), re-prefilled 612 tokens")
    assert "restore 240 tokens" not in first and "from its host memory" not in first
    assert "the plan was to restore it from tl-2's host memory; this node holds no pages for the request" in first
    second = incident.events.get(kind=EventKind.REQUEST_MOVED, request_id="r-2").description
    assert "tl-1 → tl-3 at token 12, restored from checkpoint (256 tokens, 8 re-prefilled), stalled 20.5 ms" in second
    assert "(holder tl-3 not overloaded; restore 256 tokens from its host memory)" in second
    replaced = [e.description for e in incident.events.filter(kind=EventKind.HOLDER_REPLACED).order_by("request_id")]
    assert all("none (no checkpoint)" not in line for line in replaced)
    assert replaced[0] == (
        "r-5 on tl-3: checkpoint held by tl-1 lost; no other node had room for it: "
        "the request runs on without a checkpoint"
    )
    assert "could not re-place it (tl-3 answered 500)" in replaced[1]


def test_the_checkpoints_before_are_those_at_the_failure_not_at_its_processing(commit, client, cast):
    commit(register, "cp-1")
    commit(register, "cp-2")
    commit(register, "cp-3")
    t0 = time.time()
    held = {"cp-1": {"bytes": 4 << 20, "requests": 3}}
    hot.heartbeat("cp-2", t0 - 0.5, "serving", {}, held)  # cp-2 holds cp-1's requests when cp-1 fails...
    hot.heartbeat("cp-1", t0 - 0.2, "serving", {}, {})  # cp-1's last heartbeat
    hot.heartbeat("cp-2", t0 + 1.0, "serving", {}, {})  # ...and has restored them (pages dropped) when it is read
    hot.heartbeat("cp-3", t0 - 30, "serving", {}, {"cp-9": {"bytes": 1, "requests": 1}})  # too old to count
    signal("symptom", node="cp-1", at=t0)
    commit(streams.process)
    incident = Incident.objects.get()
    assert incident.details["failures"]["cp-1"]["checkpoints"] == {"cp-2": held}
    assert incident.details["checkpoints_before"] == {"cp-2": held}
    # A second failure in the window has its own table, as of its own moment.
    hot.heartbeat("cp-3", t0 + 4.5, "serving", {}, {"cp-2": {"bytes": 2 << 20, "requests": 1}})
    hot.heartbeat("cp-2", t0 + 4.8, "serving", {}, {})  # its last before it fails
    signal("symptom", node="cp-2", at=t0 + 5)
    commit(streams.process)
    incident.refresh_from_db()
    assert incident.details["failures"]["cp-2"]["checkpoints"] == {"cp-3": {"cp-2": {"bytes": 2 << 20, "requests": 1}}}
    client.force_login(cast["operator"])
    page = client.get(f"/incidents/{incident.pk}/").content.decode()
    assert "Checkpoints when cp-1 failed" in page and "Checkpoints when cp-2 failed" in page
    assert "cp-1: 3 req" in page  # cp-2's holdings of cp-1, as they were


def test_a_hot_spare_in_service_restores_capacity(commit, react):
    failed, _ = commit(register, "sp-1")
    spare, _ = commit(register, "sp-spare")
    Node.objects.filter(pk=spare.pk).update(spare=True)
    signal("symptom", node="sp-1", at=time.time() - 20)  # no traffic before or since: latency is not in question
    commit(streams.process)
    react()  # DOWN: detected; the spare is promoted in its place (recovery.reactions)
    incident = Incident.objects.get()
    assert Node.objects.get(name="sp-1").state == NodeState.DOWN
    assert incidents.out_of_service(incident) == []  # sp-spare serves in its place
    react()  # the promotion's reaction: on the timeline, capacity restored
    incident.refresh_from_db()
    assert incident.capacity_restored_at is not None
    restored = incident.events.get(kind=EventKind.CAPACITY_RESTORED)
    assert "hot spare sp-spare serves in place of sp-1" in restored.description
    assert incident.recovered_at is None and incident.status == IncidentStatus.ACTIVE  # latency: not judged yet


def test_a_promoted_spare_goes_back_to_the_pool_once_the_node_it_stood_in_for_serves_again(commit, react):
    """Issue 43: a kill promoted the demo's spare, and every later start kept it in service: one spare fewer for
    good, while the banner still said one. Back to the pool once the node it replaced serves again; where another
    node of its model is out with no spare, it stands in for that one instead; a person's choice is never undone."""
    from recovery.actions import health, nodes

    for name in ("rs-1", "rs-2"):
        commit(register, name)
    spare, _ = commit(register, "rs-spare")
    Node.objects.filter(pk=spare.pk).update(spare=True)
    signal("symptom", node="rs-1", at=time.time() - 20)
    commit(streams.process)
    react()
    assert not Node.objects.get(name="rs-spare").spare and health.standing_in() == {spare: "rs-1"}
    assert commit(health.return_spares) == []  # rs-1 is down: it stays in service

    # rs-2 fails too, with no spare left for it; then rs-1 is back: the spare stands in for rs-2 instead.
    commit(nodes.transition_node, Node.objects.get(name="rs-2"), NodeState.DOWN, "killed")
    commit(register, "rs-1")  # a new session, serving
    assert commit(health.return_spares) == []
    assert health.standing_in() == {spare: "rs-2"} and not Node.objects.get(name="rs-spare").spare

    commit(register, "rs-2")  # back as well: the spare goes back to the pool
    assert commit(health.return_spares) == ["rs-spare"]
    returned = Node.objects.get(name="rs-spare")
    assert returned.spare and health.standing_in() == {}
    last = returned.health_transitions.filter(kind="spare").first()
    assert last.actor == "system" and last.cause == "back to the pool: rs-2 serves again"

    # Put in service by a person: theirs, whatever returns.
    commit(health.set_spare, returned, False, "oncall", "more capacity for the launch")
    commit(nodes.transition_node, Node.objects.get(name="rs-1"), NodeState.DOWN, "killed")
    commit(register, "rs-1")
    assert commit(health.return_spares) == [] and not Node.objects.get(name="rs-spare").spare


def test_capacity_is_judged_and_told_from_one_reading_of_the_nodes(commit, react, monkeypatch):
    """A node that leaves routing while capacity is being judged (a fault takes it again as its drain returns it)
    is told as it was judged: the chaos soak found the two reads disagree, and the check died on a KeyError."""
    commit(register, "rd-1")
    commit(register, "rd-2")
    signal("symptom", node="rd-1", at=time.time() - 20)
    commit(streams.process)
    react()
    incident = Incident.objects.get()
    Node.objects.filter(name="rd-1").update(state=NodeState.SERVING)  # back in routing...
    readings = []
    judged = incidents._in_service

    def leaving(node):  # ...and out of it again for every later read
        readings.append(node.name)
        return judged(node) and readings.count(node.name) == 1

    monkeypatch.setattr(incidents, "_in_service", leaving)
    commit(incidents.note_capacity, incident, timezone.now())
    incident.refresh_from_db()
    assert incident.capacity_restored_at is not None
    assert "rd-1 in routing" in incident.events.get(kind=EventKind.CAPACITY_RESTORED).description


def test_the_degradation_level_rises_and_falls_in_the_incident_and_raises_its_severity(commit, react):
    for name in ("dg-1", "dg-2", "dg-3", "dg-4", "dg-5", "dg-6", "dg-7", "dg-8", "dg-9", "dg-10", "dg-11"):
        commit(register, name)
    signal("symptom", node="dg-1", at=time.time() - 20)
    commit(streams.process)
    react()
    incident = Incident.objects.get()
    assert incident.details["nodes_in_service"] == 11
    assert incident.severity == IncidentSeverity.SEV3  # 1 of 11 nodes: 9 %, no request failed, no degradation
    now = timezone.now()
    commit(incidents.on_degradation, 0, 2, "capacity 60 % of the required", now)
    incident.refresh_from_db()
    assert incident.severity == IncidentSeverity.SEV2 and "degradation level 2" in incident.details["severity"]["why"]
    # The node comes back and latency is fine: Stable, while the level has yet to fall (its hysteresis holds it).
    Node.objects.filter(name="dg-1").update(state=NodeState.SERVING)
    assert commit(incidents.check_recovery) == [incident.pk]
    commit(incidents.on_degradation, 2, 0, "capacity back", now + dt.timedelta(seconds=30))
    incident.refresh_from_db()
    assert incident.status == IncidentStatus.STABLE
    levels = [e.details for e in incident.events.filter(kind=EventKind.DEGRADATION).order_by("at")]
    assert levels == [{"old": 0, "new": 2}, {"old": 2, "new": 0}]  # the fall, on a Stable incident too
    figures = incident_model.incident_figures(incident)["degradation"]
    assert figures["peak"] == 2 and figures["now"] == 0
    assert figures["peak_at"] == pytest.approx(now.timestamp())
    assert figures["fell_back_at"] == pytest.approx(now.timestamp() + 30)
    commit(incidents.on_degradation, 0, 1, "later", now + dt.timedelta(seconds=90))  # not this incident's any more
    assert incident.events.filter(kind=EventKind.DEGRADATION).count() == 2
    assert incident.severity == IncidentSeverity.SEV2  # never lowered


def test_requests_moved_shed_and_failed_and_the_stall_of_moved_streams(commit, react):
    commit(register, "ct-1")
    commit(register, "ct-2")
    start = time.time() - 5
    signal("symptom", node="ct-1", at=start)
    for i, stall in enumerate([10.0, 20.0, 30.0, 40.0, 500.0]):
        moved(f"m-{i}", "ct-1", "ct-2", at_token=5, planned_method="reprefill", method="re-prefill", stall_ms=stall)
    moved("m-0", "ct-1", "ct-2", at_token=9, planned_method="reprefill", method="re-prefill", stall_ms=15.0)
    commit(streams.process)
    react()
    for _ in range(2):  # failed on the lost node while the incident was active: its failed requests
        outcome(None, None, start + 0.1, status="error", nodes=["ct-1"], node="ct-1")
    outcome(None, None, start + 0.1, status="error", nodes=["ct-2"], node="ct-2")  # not on a node of the incident
    for _ in range(3):  # turned away by the degradation level
        outcome(None, None, start + 0.2, status="shed", e2e_ms=0.0)
    outcome(None, None, start - 60, status="shed", e2e_ms=0.0)  # before the incident
    commit(streams.process)
    incident = Incident.objects.get()
    figures = incident_model.incident_figures(incident)
    assert figures["moved"] == 5 and figures["moves"] == 6  # m-0 moved twice: one request
    assert figures["failed"] == 2 and figures["shed"] == 3
    assert figures["stall_p50_ms"] == 20.0 and figures["stall_p99_ms"] == 500.0
    commit(incidents.check_recovery)
    incident.refresh_from_db()
    assert incident.severity == IncidentSeverity.SEV1  # one of two nodes lost
    assert RequestOutcome.objects.filter(incident=incident, status="error").count() == 2


@pytest.mark.parametrize(
    ("lost", "level", "failed", "expected"),
    [
        (0.0, 0, 0, "sev3"),
        (0.09, 0, 0, "sev3"),
        (0.10, 0, 0, "sev2"),
        (0.05, 1, 0, "sev2"),
        (0.05, 0, 1, "sev2"),
        (1 / 3, 0, 0, "sev1"),
        (0.05, 3, 0, "sev1"),
        (0.05, 0, 100, "sev1"),
    ],
)
def test_the_severity_rule(lost, level, failed, expected):
    assert severity_policy.severity(lost, level, failed)[0] == expected
    assert {s.value for s in IncidentSeverity} == set(severity_policy.ORDER)
    assert severity_policy.worse("sev2", "sev3") == "sev2" and severity_policy.worse("sev2", "sev1") == "sev1"
    assert "SEV1" in Incident._meta.get_field("severity").help_text  # the rule, where the model documents it


def test_a_new_failure_in_an_active_incident_reopens_its_recovery(commit):
    commit(register, "ro-1")
    commit(register, "ro-2")
    now = time.time()
    signal("symptom", node="ro-1", at=now - 20)
    commit(streams.process)
    incident = Incident.objects.get()
    Node.objects.filter(name="ro-1").update(state=NodeState.SERVING)
    Incident.objects.filter(pk=incident.pk).update(capacity_restored_at=timezone.now())
    signal("symptom", node="ro-2", at=now - 10)  # within the window, still Active (latency not judged)
    commit(streams.process)
    incident.refresh_from_db()
    assert incident.capacity_restored_at is None  # ro-2 is out now: capacity is to be restored again


async def test_the_gateway_reports_a_move_from_the_node_the_request_streamed_on():
    """A request streamed on node-08, node-08 died, node-04 refused it, node-01 took it: the gateway's signal says
    node-08 → node-01 with node-04 apart (the timeline said "node-04 → node-01"), and why it re-prefilled."""
    from types import SimpleNamespace

    from recovery.gateway.coordinator import Flight
    from recovery.gateway.relay import Relay
    from recovery.policy.dispatch import Decision

    reported = []

    co = SimpleNamespace(report=reported.append)
    flight = Flight("r-1", "t", "standard", "Qwen3-32B", 10, 100, node="node-01", generated=[7] * 40)
    relay = Relay(co, None, {}, SimpleNamespace(stream=False, include_usage=False), flight, "/v1/completions", "k")
    relay.nodes, relay.streamed_on = ["node-08", "node-04", "node-01"], "node-08"
    resume = {"method": "re-prefill", "restored_tokens": 0, "reprefill_tokens": 50, "reason": "no usable pages"}
    decision = Decision("r-1", "node-04", "restore", "node-04", "holder node-04 not overloaded")
    await relay._announce("node-01", decision, None, time.monotonic(), {"lifeline": {"resume": resume}}, "broke")
    [signal] = reported
    move = signal.to_wire()
    assert signal.KIND == "request_moved"
    assert (move["from"], move["to"], move["tried"]) == ("node-08", "node-01", ["node-04"])
    assert move["resume_reason"] == "no usable pages"
    assert streams.describe_move({**move, "request_id": "r-1"}).startswith(
        "r-1: node-08 → node-01 at token 40 (after node-04 could not take it), re-prefilled 50 tokens"
    )


async def test_a_moves_stall_is_broken_down_into_noticing_the_target_answering_and_its_first_token():
    """Where a stall went, timed by the gateway: the break noticed after the last token, the target's answer (the
    plan, the request, its restore), its first token; the parts add up to the stall, and the timeline says them."""
    from types import SimpleNamespace

    from recovery.gateway.coordinator import Flight
    from recovery.gateway.relay import Relay
    from recovery.policy.dispatch import Decision

    reported = []
    co = SimpleNamespace(report=lambda signal: reported.append(signal.to_wire()))
    flight = Flight("r-2", "t", "standard", "Qwen3-32B", 10, 100, node="node-08", generated=[7] * 40)
    relay = Relay(co, None, {}, SimpleNamespace(stream=False, include_usage=False), flight, "/v1/completions", "k")
    relay.nodes, relay.streamed_on = ["node-08", "node-01"], "node-08"
    now = time.monotonic()
    flight.last_token_at, broke_at, relay._answered_at = now - 0.100, now - 0.095, now - 0.030
    resume = {"method": "checkpoint-local", "restored_tokens": 1024, "reprefill_tokens": 8, "restore_ms": 11.498983}
    decision = Decision("r-2", "node-01", "restore", "node-01", "holder node-01 not overloaded")
    await relay._announce("node-01", decision, broke_at, now, {"lifeline": {"resume": resume}}, "node-08 closed")

    [move] = reported
    timing = move["stall_breakdown_ms"]
    assert timing == {"noticed_ms": 5.0, "answered_ms": 65.0, "restore_ms": 11.498983, "first_token_ms": 30.0}
    assert timing["noticed_ms"] + timing["answered_ms"] + timing["first_token_ms"] == pytest.approx(move["stall_ms"])
    assert streams.describe_move({**move, "request_id": "r-2"}) == (
        "r-2: node-08 → node-01 at token 40, restored from checkpoint (1024 tokens, 8 re-prefilled), stalled 100.0 ms:"
        " the break noticed 5 ms after the last token, node-01 answered 65 ms later, its restore 11.5 ms, and sent"
        " its first token 30 ms after (holder node-01 not overloaded)"
    )
    # A move the node answered before the break was noticed (a takeover) counts no negative time.
    relay._answered_at = 0.0
    await relay._announce("node-01", decision, broke_at, now, {"lifeline": {"resume": resume}}, "node-08 closed")
    assert reported[-1]["stall_breakdown_ms"]["answered_ms"] == 0.0


def test_a_level_rise_no_failure_explains_opens_an_incident_that_a_failure_joins(commit, react):
    """Issue 12: the report counts every failure class. Demand past capacity raises the level with no node down: an
    incident of its own (shed and slowed requests burn the budget like a failure's), which a node failure joins."""
    for name in ("cp-1", "cp-2", "cp-3", "cp-4"):
        commit(register, name)
    now = timezone.now()
    commit(incidents.on_degradation, 0, 2, "capacity 70 % of the required", now)
    incident = Incident.objects.get()
    assert incident.title == "Capacity below the objective: degradation level 2"
    assert incident.status == IncidentStatus.ACTIVE and incident.detected_at == now
    assert incident.details["kind"] == incidents.CAPACITY_KIND and incident.details["nodes_in_service"] == 4
    assert incident.severity == IncidentSeverity.SEV2 and "degradation level 2" in incident.details["severity"]["why"]
    assert [e.details for e in incident.events.filter(kind=EventKind.DEGRADATION)] == [{"old": 0, "new": 2}]
    # A node's failure found a moment later, its first symptom before the rise: it joins, and the incident began then.
    signal("symptom", node="cp-1", at=now.timestamp() - 3)
    commit(streams.process)
    react()
    incident = Incident.objects.get()
    assert incident.title == "cp-1 failed"
    assert incident.opened_at == pytest.approx(now - dt.timedelta(seconds=3), abs=dt.timedelta(milliseconds=1))


def test_a_capacity_incident_is_restored_when_the_level_is_back_at_zero(commit):
    for name in ("cq-1", "cq-2"):
        commit(register, name)
    now = timezone.now()
    commit(incidents.on_degradation, 0, 1, "required rose to 120 req/s", now)
    commit(incidents.on_degradation, 1, 2, "required rose to 160 req/s", now + dt.timedelta(seconds=10))
    assert Incident.objects.count() == 1  # the second rise is on the same incident's timeline
    commit(incidents.on_degradation, 2, 0, "required back to 80 req/s", now + dt.timedelta(seconds=60))
    incident = Incident.objects.get()
    assert incident.capacity_restored_at == now + dt.timedelta(seconds=60)
    restored = incident.events.get(kind=EventKind.CAPACITY_RESTORED)
    assert "60.0 s after the level first rose" in restored.description
    levels = [e.details for e in incident.events.filter(kind=EventKind.DEGRADATION).order_by("at")]
    assert levels == [{"old": 0, "new": 1}, {"old": 1, "new": 2}, {"old": 2, "new": 0}]
    # No traffic at all: latency cannot be judged from requests; the periodic check decides it like any incident's.
    commit(incidents.check_recovery, now + dt.timedelta(hours=2))
    incident.refresh_from_db()
    assert incident.status == IncidentStatus.STABLE, incident.events.values_list("description", flat=True)
