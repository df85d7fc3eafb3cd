"""The control plane owns an MoE deployment's expert routing table (recovery.actions.moe; document 001 §5): with real
expert-worker processes and a real attention worker node, an EW killed with SIGKILL is confirmed lost, the table
that serves its experts from their shadows is pushed to the attention worker, a standby EW is provisioned with the
lost one's experts and joins the table, the incident's timeline says each step, and the lost EW coming back becomes
the next standby. A table that would leave an expert nowhere is refused with the expert named; a drain moves an
EW's experts onto their shadows first."""

import datetime as dt
import json
import threading
import time

import pytest

from recovery.actions import capacity, moe
from recovery.choices import EventKind, ExpertWorkerState, NodeState
from recovery.models import (
    AuditEntry,
    Cluster,
    ClusterState,
    DegradationChange,
    ExpertWorkerNode,
    Incident,
    IncidentEvent,
    ModelCapacity,
    MoeDeployment,
    Node,
    Rack,
)
from recovery.policy import moe as moe_policy
from tests.helpers import http_json
from tests.workers.test_expert_workers import MIXTRAL, Ew
from tests.workers.test_moe_attention_worker import (
    AGENT,
    moe_aw,  # noqa: F401 - the fixture, reused
    stream,
)
from tests.workers.test_moe_attention_worker import aw as _aw  # noqa: F401 - the fixture, reused
from workers.moe import expert_bytes

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def agent_token(settings, monkeypatch):
    settings.LIFELINE_AGENT_TOKEN = AGENT  # what the control plane presents
    monkeypatch.setenv("LIFELINE_AGENT_TOKEN", AGENT)  # what the EWs started here take /moe/load with


@pytest.fixture
def aw(agent_token, _aw):  # noqa: F811
    return _aw


@pytest.fixture
def standby(agent_token):
    worker = Ew("ew-spare", [], [])
    yield worker
    if worker.proc.poll() is None:
        worker.proc.terminate()
        worker.proc.wait(10)


def an_attention_worker_node(node) -> Node:
    cluster = Cluster.default()
    rack, _ = Rack.objects.get_or_create(cluster=cluster, name="rack-a")
    return Node.objects.create(
        cluster=cluster,
        rack=rack,
        name="aw-1",
        model_key="Mixtral-8x7B",
        gpu_key="H200-SXM",
        address=node.address,
        state=NodeState.SERVING,
    )


def registered(aw, standby) -> MoeDeployment:
    node, table, workers = aw
    an_attention_worker_node(node)
    return moe.register(
        "mixtral",
        "Mixtral-8x7B",
        {ew: w.address for ew, w in workers.items()},
        ["aw-1"],
        table,
        standby={"ew-spare": standby.address},
    )


def aw_version(node) -> int:
    return http_json(node.address + "/agent/status")[1]["counters"]["moe_ert_version"]


def watch_until(condition, timeout_s=20.0, what=""):
    deadline = time.monotonic() + timeout_s
    done = []
    while time.monotonic() < deadline:
        done += moe.watch()["mixtral"]
        if condition():
            return done
        time.sleep(0.3)
    raise AssertionError(f"not reached in {timeout_s} s: {what}; did {done}")


def test_a_lost_ew_is_confirmed_healed_replaced_and_comes_back_as_the_standby(aw, standby):
    node, table, workers = aw
    deployment = registered(aw, standby)
    expected, _ = stream(node.address)
    first = [a for a in moe.watch()["mixtral"] if not a.startswith("canary")]
    assert first == []  # the table in force pushed: the AW started with v1 (409, nothing new)
    assert MoeDeployment.objects.get().details["pushed"] == {"aw-1": 1}
    ew = ExpertWorkerNode.objects.get(deployment=deployment, name="ew-0")
    assert ew.state == ExpertWorkerState.SERVING and ew.primaries == table.primaries_of("ew-0")
    assert ExpertWorkerNode.objects.get(name="ew-spare").state == ExpertWorkerState.STANDBY
    lost_experts, lost_shadows = table.primaries_of("ew-0"), table.shadows_of("ew-0")

    workers["ew-0"].kill()
    moe.watch()
    assert ExpertWorkerNode.objects.get(name="ew-0").state == ExpertWorkerState.SUSPECT  # one miss is not a loss
    done = moe.watch()["mixtral"]
    assert "ew-0 lost; table v2" in done and "provisioning ew-spare" in done and "v2 to aw-1" in done
    deployment.refresh_from_db()
    healed = moe.table(deployment)
    assert "ew-0" not in healed.ews()
    assert all(healed.experts[e].primaries == table.experts[e].shadows[:1] for e in lost_experts)  # shadows promoted
    assert aw_version(node) == 2
    text, _ = stream(node.address)  # served from the shadows, nothing waits on ew-0
    assert text == expected

    # The standby loads ew-0's experts at disk bandwidth (two experts and their shadows: seconds), then joins.
    assert ExpertWorkerNode.objects.get(name="ew-spare").state == ExpertWorkerState.LOADING
    watch_until(lambda: "ew-spare" in moe.table(MoeDeployment.objects.get()).ews(), 30, "the replacement joined")
    joined = moe.table(MoeDeployment.objects.get())
    assert joined.version == 3 and joined.primaries_of("ew-spare") == lost_experts
    assert joined.shadows_of("ew-spare") == lost_shadows
    assert aw_version(node) == 3
    text, _ = stream(node.address)
    assert text == expected

    incident = Incident.objects.get(details__moe="mixtral")
    kinds = list(incident.events.values_list("kind", flat=True))
    assert kinds[:5] == [EventKind.SYMPTOM, EventKind.DETECTED, EventKind.ERT, EventKind.PROVISIONING, EventKind.ERT]
    assert incident.opened_at < incident.detected_at  # opened at the first unanswered poll, confirmed at the second
    assert EventKind.CAPACITY_RESTORED in kinds and incident.capacity_restored_at is not None
    assert "lost" in incident.title and "ew-0" in incident.title

    # ew-0 comes back (its supervisor's restart): its experts are served by the replacement, so it is the standby.
    workers["ew-0"] = Ew("ew-0", lost_experts, lost_shadows)
    ExpertWorkerNode.objects.filter(name="ew-0").update(address=workers["ew-0"].address)  # a new port here
    done = watch_until(lambda: ExpertWorkerNode.objects.get(name="ew-0").state == ExpertWorkerState.STANDBY, 10)
    assert "ew-0 back as standby" in done
    assert http_json(workers["ew-0"].address + "/moe/status")[1]["primaries"] == []

    # The standby dies and its supervisor starts it again with its first command line (its old experts): it is
    # still the standby, it does not take experts back from the EW that serves them now.
    workers["ew-0"].kill()
    watch_until(lambda: ExpertWorkerNode.objects.get(name="ew-0").state == ExpertWorkerState.DOWN, 10)
    version = moe.table(MoeDeployment.objects.get()).version
    workers["ew-0"] = Ew("ew-0", lost_experts, lost_shadows)
    ExpertWorkerNode.objects.filter(name="ew-0").update(address=workers["ew-0"].address)
    done = watch_until(lambda: ExpertWorkerNode.objects.get(name="ew-0").state == ExpertWorkerState.STANDBY, 10)
    assert "ew-0 back as standby" in done and moe.table(MoeDeployment.objects.get()).version == version

    # Balancedness and tokens per expert were recorded from the EWs' own counts.
    details = MoeDeployment.objects.get().details
    assert sum(details["tokens_per_expert"].values()) > 0
    assert details["series"] and all(0 < p["balancedness"] <= 1 for p in details["series"])


def test_an_ew_not_heard_since_the_control_plane_started_is_awaited_through_the_grace_not_lost(aw, standby):
    """Found by `./lifeline run --moe` stopped and run again: the new control plane polled the EWs at the addresses of
    the run before, before the demo registered the deployment anew, and opened 'Expert worker ew-1 of mixtral-moe
    lost' for all four, an incident that stayed active for good. An EW not heard since the start is awaited through
    the start-up grace; one heard since then and gone is lost at once; the grace over, an unheard one is lost."""
    _, _, workers = aw
    registered(aw, standby)
    moe.watch()  # every EW heard, before the start
    capacity.control_plane_started()
    workers["ew-0"].kill()
    for _ in range(3):
        done = moe.watch()["mixtral"]
    assert "ew-0 not heard since the control plane started: awaited until the start-up grace ends" in done
    assert ExpertWorkerNode.objects.get(name="ew-0").state == ExpertWorkerState.SUSPECT
    assert not Incident.objects.exists()
    # ew-1 answered since the start: gone now, it is a failure, grace or not.
    workers["ew-1"].kill()
    moe.watch()
    done = moe.watch()["mixtral"]
    assert any(a.startswith("ew-1 lost") for a in done), done
    assert ExpertWorkerNode.objects.get(name="ew-1").state == ExpertWorkerState.DOWN
    # The grace over, ew-0, still unheard, is lost too.
    cluster = Cluster.default()
    started = cluster.state.control_plane_started_at
    ClusterState.objects.filter(cluster=cluster).update(
        control_plane_started_at=started - dt.timedelta(seconds=cluster.startup_grace_s + 1)
    )
    moe.watch()
    assert ExpertWorkerNode.objects.get(name="ew-0").state == ExpertWorkerState.DOWN
    assert IncidentEvent.objects.filter(kind=EventKind.DETECTED, details__ew="ew-0").exists()  # on ew-1's incident
    # The stack restarted registers the deployment anew: the incident its old rows held is not left open for good.
    incident = Incident.objects.get(details__moe="mixtral")
    assert incident.capacity_restored_at is None
    _, table, _ = aw
    moe.register("mixtral", "Mixtral-8x7B", {ew: w.address for ew, w in workers.items()}, ["aw-1"], table)
    incident.refresh_from_db()
    assert incident.capacity_restored_at is not None
    assert "mixtral registered again" in incident.events.get(kind=EventKind.CAPACITY_RESTORED).description


def test_a_loss_that_leaves_an_expert_nowhere_is_refused_naming_it_and_the_lost_ew_reloads_its_place(aw, monkeypatch):
    node, table, workers = aw
    monkeypatch.setattr(moe, "STALL_GRACE_S", 0.0)  # the stall counts against capacity at once
    an_attention_worker_node(node)
    moe.register("mixtral", "Mixtral-8x7B", {ew: w.address for ew, w in workers.items()}, ["aw-1"], table)
    # Mixtral has a throughput objective its one attention worker meets; the level drops back without a hold.
    ModelCapacity.objects.filter(pk=ModelCapacity.of("Mixtral-8x7B").pk).update(required_rps=0.5)
    Cluster.objects.update(degradation_hold_s=0)
    assert capacity.evaluate() == 0
    expert = 0
    primary, shadow = table.experts[expert].primaries[0], table.experts[expert].shadows[0]
    workers[primary].kill()
    workers[shadow].kill()
    moe.watch()
    done = moe.watch()["mixtral"]
    assert any(f"expert {expert} has no live location" in d or "no live location" in d for d in done)
    assert "no standby" in done
    assert moe.table(MoeDeployment.objects.get()).version == 1  # never a table that drops an expert
    incident = Incident.objects.filter(details__moe="mixtral").first()
    refused = incident.events.filter(kind=EventKind.ERT).first()
    assert "no live location" in refused.description and refused.details["expert"] is not None
    # The control plane raises degradation instead: the AW cannot finish a step that selects the expert, so it
    # carries nothing and Mixtral's level rises (its low-priority traffic shed) while the stall lasts.
    assert any(d.startswith("stalled on experts") for d in done)
    assert expert in MoeDeployment.objects.get().details["stalled"]["experts"]
    assert capacity.level_of("Mixtral-8x7B") > 0
    assert DegradationChange.objects.filter(model_key="Mixtral-8x7B", new_level__gt=0).exists()
    stall = next(
        e for e in incident.events.filter(kind=EventKind.DEGRADATION) if expert in e.details.get("stalled", [])
    )
    assert "no live location" in stall.description and "aw-1" in stall.description

    # The primary comes back holding nothing (a process started afresh): the table still has its place (the loss
    # was refused), so it is told to load what the table gives it, and the table, a version on, tells the AW to use
    # it again once it has.
    workers[primary] = Ew(primary, [], [])
    ExpertWorkerNode.objects.filter(name=primary).update(address=workers[primary].address)
    done = watch_until(lambda: moe.table(MoeDeployment.objects.get()).version == 2, 30, f"{primary} back")
    assert f"{primary} reloading" in done and f"{primary} back in the table" in done
    back = moe.table(MoeDeployment.objects.get())
    assert back.experts[expert].primaries[0] == primary and back.experts == table.experts
    status = http_json(workers[primary].address + "/moe/status")[1]
    assert status["primaries"] == table.primaries_of(primary) and status["shadows"] == table.shadows_of(primary)
    assert aw_version(node) == back.version
    # The stall is over, its length on the timeline, and the level falls back.
    assert "stalled" not in MoeDeployment.objects.get().details
    over = incident.events.filter(kind=EventKind.DEGRADATION, description__contains="stall").last()
    assert "live location again" in over.description
    assert capacity.evaluate() == 0 and capacity.level_of("Mixtral-8x7B") == 0

    # The shadow comes back as it was (its supervisor's restart with its first command line): it still has its place
    # in the table and holds what the table gives it, so the table, a version on, tells the AW to use it again.
    workers[shadow] = Ew(shadow, table.primaries_of(shadow), table.shadows_of(shadow))
    ExpertWorkerNode.objects.filter(name=shadow).update(address=workers[shadow].address)
    done = watch_until(lambda: moe.table(MoeDeployment.objects.get()).version == 3, 10, f"{shadow} back")
    assert f"{shadow} back in the table" in done and f"{shadow} reloading" not in done
    assert ExpertWorkerNode.objects.get(name=shadow).state == ExpertWorkerState.SERVING
    assert "still has its place" in incident.events.filter(kind=EventKind.ERT).last().description
    assert aw_version(node) == 3


@pytest.fixture
def aw_no_shadows(agent_token, moe_aw):  # noqa: F811
    """An attention worker whose three EWs hold their experts with no shadow at all."""
    node, table, workers, _ = moe_aw(False)
    return node, table, workers


def test_an_ew_lost_without_shadows_stalls_its_experts_until_the_standby_serves_them_and_no_token_is_lost(
    aw_no_shadows, standby
):
    """No shadow to fail over to: the table is refused, the AW waits on the lost EW's experts (a bounded stall),
    the standby loads them and takes the lost EW's place in the table (which no longer names it), the stream that
    waited ends with the text of an undisturbed run, and the lost EW, back, is the next standby."""
    node, table, workers = aw_no_shadows
    registered(aw_no_shadows, standby)
    ModelCapacity.objects.filter(pk=ModelCapacity.of("Mixtral-8x7B").pk).update(required_rps=0.5)
    expected, _ = stream(node.address)
    victim = "ew-1"
    lost_experts = table.primaries_of(victim)
    moe.watch()

    result, decoding = {}, threading.Event()
    waiting = threading.Thread(
        target=lambda: result.update(
            zip(("text", "times"), stream(node.address, on_token=lambda n: n >= 2 and decoding.set()))
        )
    )
    waiting.start()
    # Killed once the stream decodes (two tokens in), not after a fixed 0.3 s: on a loaded host the first token came
    # later than that, the stall fell into the prefill, and no gap between tokens showed it (a loaded run was red so).
    assert decoding.wait(30), "the stream decoding"
    workers[victim].kill()
    watch_until(
        lambda: (
            victim in moe.table(MoeDeployment.objects.get()).ews() and "stalled" in MoeDeployment.objects.get().details
        ),
        10,
        "the loss refused, the deployment stalled",
    )
    # A stall the standby ends in seconds sheds nothing: within its grace the AWs still count.
    assert MoeDeployment.objects.get().details["stalled"]["degrade_at"] > time.time()
    assert capacity.evaluate() == 0
    done = watch_until(lambda: "ew-spare" in moe.table(MoeDeployment.objects.get()).ews(), 30, "the standby joined")
    joined = moe.table(MoeDeployment.objects.get())
    assert victim not in joined.ews() and joined.primaries_of("ew-spare") == lost_experts
    assert joined.version == table.version + 1 and "stall over" in done
    waiting.join(60)
    assert result["text"] == expected  # waited, never lost a token
    gaps = [b - a for a, b in zip(result["times"], result["times"][1:])]
    # The stream did wait across the loss (not finished before it), and no longer than the stall's grace: two
    # polls to confirm, then the standby's load of two experts at disk bandwidth, about 5 s.
    assert 1.0 < max(gaps) < moe.STALL_GRACE_S
    incident = Incident.objects.get(details__moe="mixtral")
    texts = " | ".join(incident.events.values_list("description", flat=True))
    assert "no live location" in texts and "in place of ew-1" in texts and "stall" in texts

    workers[victim] = Ew(victim, lost_experts, [])
    ExpertWorkerNode.objects.filter(name=victim).update(address=workers[victim].address)
    done = watch_until(lambda: ExpertWorkerNode.objects.get(name=victim).state == ExpertWorkerState.STANDBY, 10)
    assert f"{victim} back as standby" in done and moe.table(MoeDeployment.objects.get()).version == joined.version


def test_a_lost_ew_back_before_its_replacement_has_loaded_takes_its_place_and_the_replacement_stands_by(
    aw_no_shadows, standby
):
    node, table, workers = aw_no_shadows
    registered(aw_no_shadows, standby)
    victim = "ew-1"
    port = workers[victim].address.rsplit(":", 1)[1]
    workers[victim].kill()
    watch_until(lambda: ExpertWorkerNode.objects.get(name="ew-spare").replacing == victim, 10, "provisioning")
    workers[victim] = Ew(victim, table.primaries_of(victim), [], "--port", port)  # back, warm, at its address
    done = watch_until(lambda: ExpertWorkerNode.objects.get(name=victim).state == ExpertWorkerState.SERVING, 10)
    assert "ew-spare called off" in done and f"{victim} back in the table" in done
    watch_until(lambda: ExpertWorkerNode.objects.get(name="ew-spare").state == ExpertWorkerState.STANDBY, 10)
    ert = moe.table(MoeDeployment.objects.get())
    assert "ew-spare" not in ert.ews() and ert.primaries_of(victim) == table.primaries_of(victim)
    assert http_json(standby.address + "/moe/status")[1]["primaries"] == []
    assert "stalled" not in MoeDeployment.objects.get().details
    text, _ = stream(node.address)
    assert text


def test_an_ew_restarted_between_two_polls_is_seen_as_a_loss_and_the_table_gives_it_anew(aw):
    """Its supervisor started it again, at its address with what it held, before two polls went unanswered: the
    control plane sees another process, opens an incident, and bumps the table so the AWs, which took it as down,
    use it again."""
    node, table, workers = aw
    an_attention_worker_node(node)
    moe.register("mixtral", "Mixtral-8x7B", {ew: w.address for ew, w in workers.items()}, ["aw-1"], table)
    moe.watch()
    victim = "ew-1"
    first = ExpertWorkerNode.objects.get(name=victim).pid
    assert first == workers[victim].proc.pid
    port = workers[victim].address.rsplit(":", 1)[1]
    workers[victim].kill()
    workers[victim] = Ew(victim, table.primaries_of(victim), table.shadows_of(victim), "--port", port)
    done = moe.watch()["mixtral"]
    assert f"{victim} restarted" in done and f"{victim} back in the table" in done
    assert moe.table(MoeDeployment.objects.get()).version == table.version + 1 == aw_version(node)
    row = ExpertWorkerNode.objects.get(name=victim)
    assert row.state == ExpertWorkerState.SERVING and row.pid == workers[victim].proc.pid != first
    incident = Incident.objects.get(details__moe="mixtral")
    assert "restarted" in incident.title and incident.capacity_restored_at is not None
    detected = incident.events.get(kind=EventKind.DETECTED)
    assert "another process" in detected.description and str(first) in detected.description
    assert not any("restarted" in action for action in moe.watch()["mixtral"])  # seen once, not at every poll


def test_a_drain_moves_an_ews_experts_to_their_shadows_first_then_empties_it(aw, standby):
    node, table, workers = aw
    deployment = registered(aw, standby)
    expected, _ = stream(node.address)
    drained = moe.drain_ew(deployment, "ew-1", "oncall", "firmware update")
    assert "ew-1" not in drained.ews() and aw_version(node) == drained.version
    assert http_json(workers["ew-1"].address + "/moe/status")[1]["state"] == "standby"  # it holds nothing
    assert ExpertWorkerNode.objects.get(name="ew-1").state == ExpertWorkerState.DRAINED
    assert AuditEntry.objects.filter(action="moe_drain", target="mixtral/ew-1", actor="oncall").exists()
    text, _ = stream(node.address)
    assert text == expected
    with pytest.raises(moe.MoeRefused, match="nothing to drain"):
        moe.drain_ew(MoeDeployment.objects.get(), "ew-1", "oncall", "again")


def test_an_expert_worker_takes_a_new_holding_only_with_the_agent_token_and_refuses_a_bad_one(standby):
    status, body = http_json(standby.address + "/moe/load", data={"experts": [1]})
    assert status == 401 and "agent token" in body["error"]["message"]
    head = {"Authorization": f"Bearer {AGENT}"}
    status, body = http_json(standby.address + "/moe/load", data={"experts": [99]}, headers=head)
    assert status == 400 and "[99] are not experts of Mixtral-8x7B" in body["error"]["message"]
    status, body = http_json(standby.address + "/moe/load", data={"experts": "1"}, headers=head)
    assert status == 400 and body["error"]["param"] == "experts"
    status, body = http_json(standby.address + "/moe/load", data={"experts": [1], "shadows": [2]}, headers=head)
    assert status == 202 and body["state"] == "loading" and body["loading"] == [1, 2] and body["load_s"] > 0
    deadline = time.monotonic() + body["load_s"] + 5
    while http_json(standby.address + "/moe/status")[1]["state"] != "serving":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert http_json(standby.address + "/moe/status")[1]["primaries"] == [1]


def test_registration_refuses_a_table_naming_an_ew_with_no_address(db):
    table = moe_policy.plan(MIXTRAL, [moe_policy.ExpertWorker(f"ew-{i}", 10**12) for i in range(2)])
    with pytest.raises(moe.MoeRefused, match="no address: ew-1"):
        moe.register("m", "Mixtral-8x7B", {"ew-0": "http://127.0.0.1:1"}, [], table)
    with pytest.raises(moe.MoeRefused, match="not an MoE model"):
        moe.register("m", "Qwen3-32B", {}, [], table)


def test_a_silently_corrupt_ew_is_found_by_canaries_sent_to_one_ew_at_a_time_and_drained(agent_token, monkeypatch):
    monkeypatch.setenv("LIFELINE_FAULT_TOKEN", "moe-fault-token")
    table = moe_policy.plan(MIXTRAL, [moe_policy.ExpertWorker(f"ew-{i}", expert_bytes(MIXTRAL) * 6) for i in range(3)])
    workers = {
        ew: Ew(ew, table.primaries_of(ew), table.shadows_of(ew), "--enable-faults") for ew in sorted(table.ews())
    }
    try:
        deployment = moe.register("mixtral", "Mixtral-8x7B", {ew: w.address for ew, w in workers.items()}, [], table)
        done = moe.canary(deployment.pk)
        goldens = MoeDeployment.objects.get().details["canary_golden"]
        assert len(goldens) == MIXTRAL.experts * len(moe.CANARY_LAYERS)  # every expert has two holders that agree
        assert not any("mismatch" in d for d in done)
        assert moe.canary(deployment.pk) == [f"canary: 3 EWs, {len(goldens)} goldens"]  # healthy: nothing found

        head = {"Authorization": "Bearer moe-fault-token"}
        assert http_json(workers["ew-1"].address + "/moe/faults", data={"kind": "corrupt"})[0] == 401
        status, _ = http_json(workers["ew-1"].address + "/moe/faults", data={"kind": "corrupt"}, headers=head)
        assert status == 200
        done = moe.canary(deployment.pk)
        assert "canary mismatch on ew-1" in done and not any("mismatch on ew-0" in d or "on ew-2" in d for d in done)
        healed = moe.table(MoeDeployment.objects.get())
        assert "ew-1" not in healed.ews() and healed.version == 2
        assert ExpertWorkerNode.objects.get(name="ew-1").state == ExpertWorkerState.DRAINED
        assert http_json(workers["ew-1"].address + "/moe/status")[1]["state"] == "standby"  # holds nothing now
        incident = Incident.objects.get(details__moe="mixtral")
        detected = incident.events.get(kind=EventKind.DETECTED)
        held = sorted({*table.primaries_of("ew-1"), *table.shadows_of("ew-1")})
        assert detected.details["experts"] == held and "silently corrupt" in incident.title
        assert AuditEntry.objects.filter(action="moe_drain", actor="control-plane", target="mixtral/ew-1").exists()
    finally:
        for worker in workers.values():
            worker.proc.terminate()
            worker.proc.wait(10)


def test_fault_injection_on_an_ew_is_off_unless_switched_on(standby):
    status, body = http_json(standby.address + "/moe/faults", data={"kind": "corrupt"})
    assert status == 404 and "--enable-faults" in body["error"]["message"]


def test_an_operator_hangs_and_clears_an_ew_from_the_console_api_only_where_the_cluster_allows_it(
    cast, settings, monkeypatch
):
    """POST /api/moe/<name>/ews/<ew>/faults: refused while the cluster's fault injection is off, an operator's
    only, audited; "hang" stops the EW answering its data path and status (the attention workers' probes find it),
    null clears it; a kind that is not an EW's fault is named."""
    from django.test import Client

    settings.LIFELINE_FAULT_TOKEN = "moe-fault-token"
    monkeypatch.setenv("LIFELINE_FAULT_TOKEN", "moe-fault-token")
    table = moe_policy.plan(MIXTRAL, [moe_policy.ExpertWorker(f"ew-{i}", expert_bytes(MIXTRAL) * 6) for i in range(2)])
    workers = {ew: Ew(ew, table.primaries_of(ew), table.shadows_of(ew), "--enable-faults") for ew in table.ews()}
    try:
        moe.register("mixtral", "Mixtral-8x7B", {ew: w.address for ew, w in workers.items()}, [], table)
        operator, manager = Client(), Client()
        operator.force_login(cast["operator"])
        manager.force_login(cast["manager"])
        url = "/api/moe/mixtral/ews/ew-1/faults"

        def post(client, body):
            return client.post(url, json.dumps(body), content_type="application/json")

        off = post(operator, {"kind": "hang", "reason": "game day"})
        assert off.status_code == 403 and "off for this cluster" in off.json()["error"]["message"]
        Cluster.objects.update(fault_injection_enabled=True)
        assert post(manager, {"kind": "hang", "reason": "game day"}).status_code == 403
        wrong = post(operator, {"kind": "crash"})
        assert wrong.status_code == 400 and wrong.json()["error"]["field"] == "kind"
        hung = post(operator, {"kind": "hang", "reason": "game day"})
        assert hung.status_code == 200 and hung.json()["hung"] is True
        with pytest.raises(OSError):  # a hung process: its status does not answer
            http_json(workers["ew-1"].address + "/moe/status", timeout=1)
        assert http_json(workers["ew-0"].address + "/moe/status")[0] == 200
        cleared = post(operator, {"kind": None, "reason": "game day over"})
        assert cleared.status_code == 200 and cleared.json() == {"corrupt": False, "hung": False}
        assert http_json(workers["ew-1"].address + "/moe/status")[0] == 200
        audited = list(AuditEntry.objects.filter(target="moe:mixtral/ew-1").values_list("action", "reason"))
        assert ("inject_fault", "game day") in audited and ("clear_fault", "game day over") in audited
        missing = Client()
        missing.force_login(cast["operator"])
        gone = missing.post("/api/moe/mixtral/ews/ew-7/faults", "{}", content_type="application/json")
        assert gone.status_code == 404 and gone.json()["error"]["field"] == "ew"
    finally:
        for worker in workers.values():
            worker.kill()


def test_an_attention_workers_canary_canaries_its_ews_first_and_a_corrupt_one_is_drained(aw, monkeypatch):
    """The node canary task on an AW runs the per-EW canaries first: an EW gone silently corrupt is named and drained
    before the AW's own canary is judged, so the AW is not blamed for its EW."""
    from recovery import tasks

    node, table, workers = aw
    an_attention_worker_node(node)
    deployment = moe.register("mixtral", "Mixtral-8x7B", {ew: w.address for ew, w in workers.items()}, ["aw-1"], table)
    moe.canary(deployment.pk)  # goldens, from a healthy deployment
    corrupt = {"ew-2"}
    real_ask = moe._ask

    def ask(address, experts):  # ew-2 answers wrong, as a corrupt EW would (its process has no faults enabled here)
        answers = real_ask(address, experts)
        if address == workers["ew-2"].address and answers:
            return {key: "00" * 16 for key in answers}
        return answers

    monkeypatch.setattr(moe, "_ask", ask)
    said = tasks.run_canary(Node.objects.get(name="aw-1").pk)
    assert "its EWs first: canary mismatch on ew-2" in said
    assert corrupt.isdisjoint(moe.table(MoeDeployment.objects.get()).ews())
    assert ExpertWorkerNode.objects.get(name="ew-2").state == ExpertWorkerState.DRAINED
    assert aw_version(node) == moe.table(MoeDeployment.objects.get()).version  # the AW uses the healed table
