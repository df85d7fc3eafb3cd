"""Incidents against the real database and Redis: what the gateways report becomes a timeline."""

import datetime as dt
import json
import socket
import time
import uuid

import pytest
from django.utils import timezone

from recovery import hot, protocol
from recovery.actions import incidents, live_migration, nodes, streams
from recovery.choices import EventKind, IncidentStatus, NodeState
from recovery.models import AuditEntry, Cluster, Incident, Node, RequestOutcome
from workers.protocol import Heartbeat, Load, Registration

pytestmark = pytest.mark.django_db

AGENT = "agent-token-for-tests"


def register(name, address="http://127.0.0.1:9", rack="rack-a", serving=True):
    reg = Registration.parse(
        {
            "name": name,
            "session": uuid.uuid4().hex,
            "address": address,
            "rack": rack,
            "model": "Qwen3-32B",
            "gpu": "H100-SXM",
            "tp": 1,
            "pid": 1,
            "host": "h",
            "gpus": [{"index": 0, "uuid": f"GPU-{name}", "name": "H100", "memory_bytes": 80 * 10**9}],
        }
    )
    node = nodes.register_node(reg)
    if serving:
        nodes.transition_node(node, "serving", "test")
    return node, reg


def signal(kind, /, gateway="gw-1", **data):
    """A gateway's signal on the stream, as the gateway writes it (recovery.protocol: a malformed one fails here)."""
    if kind == "symptom":
        data.setdefault("reason", "stream broke (ClientPayloadError)")
    sent = protocol.read_signal(kind, {"at": time.time(), **data})
    hot.client().xadd(hot.keys().signals, {"kind": kind, "gateway": gateway, "data": json.dumps(sent.to_wire())})


def outcome(ttft, tpot, started, e2e_ms=100.0, **extra):
    data = {
        "request_id": uuid.uuid4().hex,
        "tenant": "t",
        "tier": "standard",
        "model": "Qwen3-32B",
        "status": "ok",
        "node": "n",
        "prompt_tokens": 10,
        "completion_tokens": 20,
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "e2e_ms": e2e_ms,
        "started_at": started,
        **extra,
    }
    hot.client().xadd(hot.keys().outcomes, {"gateway": "gw-1", "data": json.dumps(data)})


def kinds(incident):
    return list(incident.events.values_list("kind", flat=True))


def test_a_gateways_symptom_opens_an_incident_and_a_dead_node_leaves_routing(commit, react):
    node, _ = commit(register, "dead-1")  # its address answers nothing
    assert "dead-1" in hot.routing_table()
    signal("symptom", node="dead-1", reason="status stream broke: ClientPayloadError", in_flight=3)
    commit(streams.process)
    react()  # the DOWN step's reaction: detected and removed, on the incident the symptom opened
    incident = Incident.objects.get()
    assert incident.status == IncidentStatus.ACTIVE and incident.title == "dead-1 failed"
    assert kinds(incident) == [EventKind.SYMPTOM, EventKind.DETECTED, EventKind.REMOVED]
    assert Node.objects.get(name="dead-1").state == "down"
    assert "dead-1" not in hot.routing_table()
    symptom, detected, _ = incident.events.all()
    assert symptom.source == "gateway gw-1" and symptom.description == "dead-1: status stream broke: ClientPayloadError"
    assert "/health does not answer" in detected.description  # nothing listens at its address
    assert incident.detected_at is None or incident.detected_at >= incident.opened_at


def test_a_symptom_whose_reason_names_its_node_names_it_once(commit):
    """The relay words a broken stream with its node ("dead-2: stream broke (…)"): the timeline said
    "dead-2: dead-2: stream broke"."""
    commit(register, "dead-2")
    signal("symptom", node="dead-2", reason="dead-2: stream broke (ClientPayloadError)", in_flight=1)
    commit(streams.process)
    symptom = Incident.objects.get().events.get(kind=EventKind.SYMPTOM)
    assert symptom.description == "dead-2: stream broke (ClientPayloadError)"


def test_a_symptom_on_a_node_that_answers_is_not_confirmed(commit, node_factory):
    live = node_factory("alive-1")
    commit(register, "alive-1", address=live.address)
    signal("symptom", node="alive-1", reason="one stream broke")
    commit(streams.process)
    incident = Incident.objects.get()
    assert kinds(incident) == [EventKind.SYMPTOM, EventKind.NOT_CONFIRMED]
    assert Node.objects.get(name="alive-1").state == "serving"


@pytest.fixture
def mute():
    """An address that takes connections and never answers: a node that is there and slow, or hung."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # accepted by the kernel, never read
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_node_slow_to_answer_is_judged_by_its_heartbeat_not_by_one_probe(commit, react, mute):
    """A probe that times out does not say the node is gone (a loaded host answers late); its heartbeat does: one
    within the deaf allowance leaves it serving, watched; none for longer takes it DOWN at once."""
    commit(register, "slow-1", address=mute)  # registered just now: heard now
    signal("symptom", node="slow-1", reason="slow-1 unreachable (TimeoutError)")
    commit(streams.process)
    incident = Incident.objects.get()
    assert kinds(incident) == [EventKind.SYMPTOM, EventKind.NOT_CONFIRMED]
    assert Node.objects.get(name="slow-1").state == "serving"
    said = incident.events.get(kind=EventKind.NOT_CONFIRMED).description
    assert "does not answer within 0.5 s" in said and "its last heartbeat 0." in said, said

    commit(register, "hung-1", address=mute)
    hot.heartbeat("hung-1", time.time() - 4, "serving", {})  # silent for 4 s: hung, not slow
    signal("symptom", node="hung-1", reason="hung-1: no byte for 3.0 s and its status stream is silent too (hung)")
    commit(streams.process)
    react()
    assert Node.objects.get(name="hung-1").state == "down"
    down = Node.objects.get(name="hung-1").transitions.get(new_state="down").cause
    assert "does not answer within 0.5 s" in down and "its last heartbeat 4." in down, down


def test_failures_within_the_window_share_an_incident_and_later_ones_do_not(commit):
    commit(register, "g-1")
    commit(register, "g-2")
    commit(register, "g-3")
    now = time.time()
    signal("symptom", node="g-1", at=now)
    signal("symptom", node="g-2", at=now + 5)
    commit(streams.process)
    assert Incident.objects.count() == 1
    assert Incident.objects.get().title == "g-1, g-2 failed"
    signal("symptom", node="g-3", at=now + Cluster.default().incident_window_s + 1)
    commit(streams.process)
    assert Incident.objects.count() == 2


def test_request_fates_and_re_placements_join_the_timeline(commit):
    commit(register, "fate-1")
    signal("symptom", node="fate-1")
    signal(
        "request_moved",
        request_id="r-9",
        tenant="t",
        **{
            "from": "fate-1",
            "to": "fate-2",
            "at_token": 57,
            "method": "checkpoint-local",
            "planned_method": "restore",
            "stall_ms": 41.5,
            "reason": "holder fate-2 not overloaded",
            "kind": "failure",
        },
    )
    signal("holder_replaced", request_id="r-3", node="fate-4", lost="fate-1", holders=["fate-5"], blocks_resent=12)
    commit(streams.process)
    incident = Incident.objects.get()
    moved = incident.events.get(kind=EventKind.REQUEST_MOVED)
    assert (
        moved.request_id == "r-9"
        and "fate-1 → fate-2 at token 57, restored from checkpoint, stalled 41.5 ms" in moved.description
    )
    replaced = incident.events.get(kind=EventKind.HOLDER_REPLACED)
    assert "re-placed on fate-5, 12 blocks resent" in replaced.description


def test_outcomes_are_stored_and_recovery_is_judged_against_the_baseline(commit, react):
    commit(register, "rec-1")
    start = time.time() - 8  # the failure, a little while ago
    for _ in range(10):  # the minute before: TTFT 100 ms, TPOT 20 ms
        outcome(100.0, 20.0, start - 30)
    commit(streams.process)
    signal("symptom", node="rec-1", at=start)
    commit(streams.process)
    incident = Incident.objects.get()
    assert incident.baseline_ttft_ms == pytest.approx(100.0) and incident.baseline_tpot_ms == pytest.approx(20.0)
    for _ in range(5):  # overloaded survivors: TTFT doubled
        outcome(200.0, 20.0, start + 0.1, migrations=[{"from": "rec-1", "to": "x", "kind": "failure"}])
    commit(streams.process)
    assert incidents.check_recovery() == []
    assert RequestOutcome.objects.filter(incident=incident).count() == 5
    RequestOutcome.objects.filter(ttft_ms=200.0).update(finished_at=timezone.now() - dt.timedelta(seconds=60))
    for _ in range(5):  # back to normal
        outcome(104.0, 21.0, start + 0.2)  # started after the failure, finished since
    commit(streams.process)
    # Latency recovered, but rec-1 is still down: not Stable (it was, before capacity counted).
    assert commit(incidents.check_recovery) == []
    incident.refresh_from_db()
    assert incident.status == IncidentStatus.ACTIVE and incident.recovery_time_s > 0
    assert incident.recovered_at is not None and incident.capacity_restored_at is None
    recovered = incident.events.get(kind=EventKind.RECOVERED)
    assert "within 10% of the baseline" in recovered.description
    assert "checkpoints_after" not in incident.details
    # The node comes back: capacity restored, at the moment it returned to routing, and then Stable.
    node = Node.objects.get(name="rec-1")
    commit(nodes.transition_node, node, NodeState.JOIN, "restarted", new_session=uuid.uuid4().hex)
    commit(nodes.transition_node, Node.objects.get(name="rec-1"), NodeState.SERVING, "model loaded")
    react()
    incident.refresh_from_db()
    assert incident.status == IncidentStatus.STABLE and incident.capacity_restored_at >= incident.recovered_at
    restored = incident.events.get(kind=EventKind.CAPACITY_RESTORED)
    assert "rec-1 in routing" in restored.description and restored.at == incident.capacity_restored_at
    assert "checkpoints_after" in incident.details
    assert incident.events.filter(kind=EventKind.STATUS, description__startswith="Active → Stable").exists()


def test_an_incident_with_no_request_since_the_failure_recovers_when_its_nodes_serve_again(commit):
    node, _ = commit(register, "quiet-1")
    start = time.time() - 30
    for _ in range(10):  # traffic before the failure: a baseline
        outcome(100.0, 20.0, start - 30)
    commit(streams.process)
    signal("symptom", node="quiet-1", at=start)
    commit(streams.process)
    incident = Incident.objects.get()
    assert incident.baseline_ttft_ms == pytest.approx(100.0)
    Node.objects.filter(name="quiet-1").update(state=NodeState.DOWN)
    assert commit(incidents.check_recovery) == []  # no traffic, and its node is still down
    Node.objects.filter(name="quiet-1").update(state=NodeState.SERVING)
    assert commit(incidents.check_recovery) == [incident.pk]  # before: Active until the next request came
    recovered = Incident.objects.get().events.get(kind=EventKind.RECOVERED)
    assert "no request since the failure" in recovered.description


def test_people_acknowledge_command_note_and_close(commit, cast, client):
    commit(register, "ppl-1")
    signal("symptom", node="ppl-1")
    commit(streams.process)
    incident = Incident.objects.get()
    client.force_login(cast["manager"])
    assert client.post(f"/incidents/{incident.pk}/ack").status_code == 403  # managers read only
    client.force_login(cast["operator"])
    assert client.post(f"/incidents/{incident.pk}/ack").status_code == 302
    response = client.post(f"/incidents/{incident.pk}/ack", follow=True)
    assert b"already acknowledged by operator" in response.content
    response = client.post(f"/incidents/{incident.pk}/command", {"commander": "operator"}, follow=True)
    assert b"not on call" in response.content
    client.post(f"/incidents/{incident.pk}/command", {"commander": "oncall"})
    client.post(f"/incidents/{incident.pk}/note", {"text": "rack b PSU suspected"})
    response = client.post(f"/incidents/{incident.pk}/close", {"reason": "done"}, follow=True)
    assert b"needs the oncall or admin role" in response.content
    client.force_login(cast["oncall"])
    response = client.post(f"/incidents/{incident.pk}/close", {"reason": "done"}, follow=True)
    assert b"only a Stable incident can be closed" in response.content
    Incident.objects.filter(pk=incident.pk).update(status=IncidentStatus.STABLE)
    commit(client.post, f"/incidents/{incident.pk}/close", {"reason": "PSU replaced"})
    incident.refresh_from_db()
    assert (
        incident.status == IncidentStatus.CLOSED
        and incident.commander.username == "oncall"
        and incident.acknowledged_by.username == "operator"
    )
    timeline = list(incident.events.values_list("kind", "actor"))
    assert (EventKind.ACKNOWLEDGED, "operator") in timeline and (EventKind.NOTE, "operator") in timeline
    assert (EventKind.STATUS, "oncall") in timeline
    assert AuditEntry.objects.filter(action="incident_close", actor="oncall").exists()


def test_incident_api_and_pages(commit, cast, client, react):
    commit(register, "api-1")
    signal("symptom", node="api-1")
    commit(streams.process)
    react()
    incident = Incident.objects.get()
    client.force_login(cast["manager"])
    listing = client.get("/api/incidents").json()["incidents"]
    assert listing[0]["id"] == incident.pk and listing[0]["nodes"] == ["api-1"] and listing[0]["status"] == "active"
    detail = client.get(f"/api/incidents/{incident.pk}").json()
    assert [e["kind"] for e in detail["events"]] == ["symptom", "detected", "removed"]
    assert all(isinstance(e["at"], float) for e in detail["events"])
    assert client.get("/api/incidents/999").status_code == 404
    page = client.get(f"/incidents/{incident.pk}/").content.decode()
    assert "First symptom" in page and "Failure confirmed" in page and 'id="latency-chart"' in page
    assert f"/incidents/{incident.pk}/ack" not in page  # a manager cannot act
    assert client.get(f"/incidents/{incident.pk}/?partial=chart").json()["marks"]["opened"] == pytest.approx(
        incident.opened_at.timestamp()
    )
    assert b"api-1 failed" in client.get("/incidents/").content


def test_draft_ready_pairs_the_restarting_node_with_the_most_loaded_survivor(commit, node_factory, settings, react):
    settings.LIFELINE_AGENT_TOKEN = AGENT
    env = {"LIFELINE_AGENT_TOKEN": AGENT}
    busy = node_factory("pr-busy", env=env)
    idle = node_factory("pr-idle", env=env)
    draft = node_factory("pr-draft", "--start", "cold", env=env)  # draft model in ~3 s, full model ~25 s later
    commit(register, "pr-busy", address=busy.address)
    commit(register, "pr-idle", address=idle.address)
    restarting, reg = commit(register, "pr-draft", address=draft.address, serving=False)
    hot.heartbeat("pr-busy", time.time(), "serving", {"running": 9, "waiting": 3})
    # The idle survivor holds many checkpoints, so its L̂ is the highest; but it decodes nothing, so speculation
    # cannot help it (the demo paired a survivor running 0 requests).
    hot.heartbeat(
        "pr-idle", time.time(), "serving", {"running": 0, "waiting": 0}, {"pr-busy": {"bytes": 8 << 30, "requests": 40}}
    )
    commit(
        incidents.note_failure, restarting, time.time() - 30, "gateway gw-1", "it crashed"
    )  # what it is restarting from
    from tests.helpers import http_json, wait_for

    wait_for(
        lambda: http_json(draft.address + "/agent/status")[1]["load"]["model_state"] == "draft_ready",
        15,
        0.1,
        "draft ready",
    )
    # Its heartbeats say so: the timeline notes it and assist starts (the task, called directly here).
    nodes.record_heartbeat("pr-draft", Heartbeat(session=reg.session, model_state="loading_draft", load=Load()))
    commit(nodes.record_heartbeat, "pr-draft", Heartbeat(session=reg.session, model_state="draft_ready", load=Load()))
    react()  # the model-load transition's reaction: draft_ready on the timeline (and start_assist enqueued)
    node = Node.objects.get(name="pr-draft")
    assert commit(incidents.start_assist, node.pk) == "pr-busy"
    assert http_json(busy.address + "/agent/status")[1]["load"]["assist"]["draft"] == "pr-draft"
    # A second draft-ready node finds the only decoding survivor already verifying pr-draft's drafts.
    other, _ = commit(register, "pr-draft-2", address="http://127.0.0.1:9", serving=False)
    assert commit(incidents.start_assist, other.pk) == "no survivor"
    assert http_json(busy.address + "/agent/status")[1]["load"]["assist"]["draft"] == "pr-draft"
    assert commit(incidents.end_assist, node.pk) == "pr-busy"
    assert http_json(busy.address + "/agent/status")[1]["load"]["assist"] is None
    incident = Incident.objects.get()
    assert [k for k in kinds(incident) if k in ("draft_ready", "assist_started", "assist_ended")] == [
        "draft_ready",
        "assist_started",
        "assist_ended",
    ]
    started = incident.events.get(kind=EventKind.ASSIST_STARTED)
    assert "the most loaded survivor decoding" in started.description and "pr-busy" in started.description
    ended = incident.events.get(kind=EventKind.ASSIST_ENDED)
    assert "assisted steps" in ended.description and ended.details["draft"] == "pr-draft"


def test_cordon_planned_migration_and_fault_injection_from_the_console(commit, cast, client, node_factory, settings):
    settings.LIFELINE_FAULT_TOKEN = "fault-token"
    live = node_factory("ops-1", "--enable-faults", env={"LIFELINE_FAULT_TOKEN": "fault-token"})
    commit(register, "ops-1", address=live.address)
    client.force_login(cast["operator"])
    commit(client.post, "/nodes/ops-1/cordon", {"reason": "suspect fan"})
    assert json.loads(hot.client().hget(hot.keys().routing, "ops-1"))["weight"] == 0.0
    pubsub = hot.client().pubsub()
    pubsub.subscribe(hot.keys().gateway_commands)
    pubsub.get_message(timeout=1)
    response = client.post("/api/nodes/ops-1/migrate", {"reason": "drain"}, content_type="application/json")
    assert response.status_code == 202
    command = json.loads(pubsub.get_message(timeout=2)["data"])
    assert command == {"action": "migrate", "node": "ops-1", "id": response.json()["command"]}
    live_migration.record_gateway_result("gw-1", {"command": command["id"], "transfer": 3, "reprefill": 1, "failed": 0})
    status = client.get(response.json()["status_url"]).json()
    assert status["moved"] == 4 and status["gateways"]["gw-1"]["transfer"] == 3
    # Faults: off for the cluster until an admin turns it on; then audited and carried out.
    response = client.post("/api/nodes/ops-1/faults", {"kind": "slow", "factor": 2}, content_type="application/json")
    assert response.status_code == 403 and "off for this cluster" in response.json()["error"]["message"]
    Cluster.objects.update(fault_injection_enabled=True)
    client.force_login(cast["manager"])
    assert client.post("/api/nodes/ops-1/faults", {"kind": "slow"}, content_type="application/json").status_code == 403
    client.force_login(cast["operator"])
    response = client.post(
        "/api/nodes/ops-1/faults", {"kind": "slow", "factor": 2, "reason": "rehearsal"}, content_type="application/json"
    )
    assert response.status_code == 200 and response.json()["faults"]["active"][0]["kind"] == "slow"
    assert list(AuditEntry.objects.exclude(action="create_user").values_list("action", flat=True).order_by("at")) == [
        "cordon",
        "migrate_requests",
        "inject_fault",
    ]
    assert client.get("/nodes/ops-1/").status_code == 200
    assert client.post("/api/nodes/nope/faults", {"kind": "slow"}, content_type="application/json").status_code == 404
