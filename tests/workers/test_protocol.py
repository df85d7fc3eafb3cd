"""The node protocol's messages: what both sides accept, and the field a refusal names."""

import json
import uuid

import pytest

from workers import catalog
from workers.adapter import AdapterEngine
from workers.checkpoint import Peer
from workers.engine import Engine
from workers.engine_api import Assist
from workers.kvstore import CheckpointStore
from workers.protocol import (
    HEARTBEAT_LOAD_FIELDS,
    MAX_HEARTBEAT_XIDS,
    Heartbeat,
    Load,
    NodeStatus,
    ProtocolError,
    Registration,
)

SESSION = uuid.uuid4().hex


def registration(**extra) -> dict:
    body = {
        "name": "node-x",
        "session": SESSION,
        "address": "http://127.0.0.1:9001",
        "rack": "rack-a",
        "model": "Qwen3-32B",
        "gpu": "H100-SXM",
        "tp": 2,
        "pid": 4242,
        "host": "gpu-host-7",
        "gpus": [
            {"index": i, "uuid": f"GPU-node-x-{i}", "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 10**9}
            for i in range(2)
        ],
    }
    body.update(extra)
    return body


def reading(index=0, **figures) -> dict:
    return {
        "index": index,
        "utilization_pct": 57.5,
        "memory_used_bytes": 20 * 2**30,
        "memory_total_bytes": 80 * 2**30,
        "temperature_c": 61,
        "power_w": 412.5,
        "sm_clock_mhz": 1755,
        "sm_clock_max_mhz": 1980,
        "throttle_reasons": 0,
        "ecc_uncorrected_volatile": None,
        "nvlink_links": 18,
        "nvlink_links_down": 0,
        "lost": False,
        **figures,
    }


def heartbeat(**extra) -> dict:
    return {"session": SESSION, "model_state": "serving", "load": {"running": 1}, **extra}


def refusal(parse, body) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        parse(body)
    return caught.value


# --- registration: hot spares -----------------------------------------------------------


def test_a_registration_is_not_a_spare_unless_it_says_so():
    assert Registration.parse(registration()).spare is False
    assert Registration.parse(registration(spare=None)).spare is False
    spare = Registration.parse(registration(spare=True))
    assert spare.spare is True
    assert Registration.parse(json.loads(json.dumps(spare.to_json()))) == spare


@pytest.mark.parametrize("value", ["yes", 1, 0, [True]])
def test_spare_must_be_a_bool(value):
    error = refusal(Registration.parse, registration(spare=value))
    assert error.field == "spare" and str(error) == f"spare: must be bool, got {type(value).__name__}"


# --- heartbeat: Xid events and GPU readings ----------------------------------------------


def test_an_older_nodes_heartbeat_without_xids_or_gpus_reads_as_empty():
    beat = Heartbeat.parse(heartbeat())
    assert beat.xids == [] and beat.gpus == []
    assert Heartbeat.parse(heartbeat(xids=None, gpus=None)) == beat


def test_xids_and_gpu_readings_round_trip_through_json():
    xids = [{"at": 1700000000.5, "gpu": 1, "code": 48}, {"at": 1700000001, "gpu": -1, "code": 79}]
    gpus = [reading(0), reading(1, temperature_c=None, power_w=None, utilization_pct=None, lost=True)]
    beat = Heartbeat.parse(heartbeat(xids=xids, gpus=gpus))
    assert beat.xids == [{"at": 1700000000.5, "gpu": 1, "code": 48}, {"at": 1700000001.0, "gpu": -1, "code": 79}]
    assert isinstance(beat.xids[1]["at"], float)
    assert beat.gpus == gpus
    assert beat.gpus[1]["temperature_c"] is None  # n/a stays null, never 0
    wire = json.loads(json.dumps(beat.to_json()))
    assert wire["xids"] == beat.xids and wire["gpus"] == gpus
    assert Heartbeat.parse(wire) == beat


def test_a_reading_without_some_figures_has_them_as_null():
    [gpu] = Heartbeat.parse(heartbeat(gpus=[{"index": 3}])).gpus
    assert gpu["index"] == 3 and gpu["lost"] is False
    assert {k for k, v in gpu.items() if v is None} == set(reading()) - {"index", "lost"}


@pytest.mark.parametrize(
    "xids,message",
    [
        ({"at": 1.0}, "xids: must be a list, got dict"),
        ([{"at": 1.0, "gpu": 0, "code": 48}, "48"], "xids[1]: must be an object"),
        ([{"gpu": 0, "code": 48}], "xids[0].at: is required"),
        ([{"at": "now", "gpu": 0, "code": 48}], "xids[0].at: must be int or float, got str"),
        ([{"at": True, "gpu": 0, "code": 48}], "xids[0].at: must be int or float, got bool"),
        ([{"at": 1.0, "gpu": 0.5, "code": 48}], "xids[0].gpu: must be int, got float"),
        ([{"at": 1.0, "gpu": -2, "code": 48}], "xids[0].gpu: must be a GPU index, or -1 when the GPU is unknown"),
        (
            [{"at": 1.0, "gpu": 0, "code": 48}] * 2 + [{"at": 1.0, "gpu": 0, "code": "48"}],
            "xids[2].code: must be int, got str",
        ),
        (
            [{"at": 1.0, "gpu": 0, "code": 48}] * (MAX_HEARTBEAT_XIDS + 1),
            f"xids: {MAX_HEARTBEAT_XIDS + 1} events: a heartbeat carries at most {MAX_HEARTBEAT_XIDS}",
        ),
    ],
)
def test_bad_xids_are_refused_naming_the_field(xids, message):
    assert str(refusal(Heartbeat.parse, heartbeat(xids=xids))) == message


@pytest.mark.parametrize(
    "gpus,message",
    [
        ("all fine", "gpus: must be a list, got str"),
        ([reading(0), None], "gpus[1]: must be an object"),
        ([{"temperature_c": 60}], "gpus[0].index: is required"),
        ([reading(-1)], "gpus[0].index: must be 0 or more"),
        ([reading(0, temperature_c="hot")], "gpus[0].temperature_c: must be a number or null, got str"),
        (
            [reading(0), reading(1, ecc_uncorrected_volatile=False)],
            "gpus[1].ecc_uncorrected_volatile: must be a number or null, got bool",
        ),
        ([reading(0, lost="no")], "gpus[0].lost: must be bool, got str"),
        ([reading(0), reading(0)], "gpus: two readings share a GPU index"),
    ],
)
def test_bad_gpu_readings_are_refused_naming_the_field(gpus, message):
    assert str(refusal(Heartbeat.parse, heartbeat(gpus=gpus))) == message


# --- the node's status: one schema for every engine ---------------------------------------------


def emulated_status(assist: bool = False) -> NodeStatus:
    engine = Engine(catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1), store=CheckpointStore(10**9))
    engine.steps, engine.step_s, engine.decode_step = 42, 0.0125, (0.011, 3, 900)
    if assist:
        engine.assist = Assist(Peer("draft-1", "http://127.0.0.1:1"), 4, 0.6, propose=None)
    return engine.status()


def test_the_emulated_engines_status_round_trips_through_json():
    for status in (emulated_status(), emulated_status(assist=True)):
        wire = json.loads(json.dumps(status.to_json()))
        assert NodeStatus.parse(wire) == status
        assert (
            NodeStatus.parse({**wire, "reason": "arrival", "request_id": "r-1", "from_a_newer_node": [1]}) == status
        )  # unknown keys ignored
    wire = emulated_status(assist=True).to_json()
    assert wire["assist"] == {"draft": "draft-1", "k": 4, "agreement": 0.6, "acceptance": None}
    assert (
        wire["steps"] == 42
        and wire["step_ms"] == 12.5
        and wire["decode_step_batch"] == 3
        and wire["checkpoint_budget_bytes"] == 10**9
    )


def test_what_an_adapter_cannot_report_stays_null_and_a_figure_left_out_is_null_too():
    engine = AdapterEngine("http://127.0.0.1:9", catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1), "adapter")
    status = engine.status()
    wire = json.loads(json.dumps(status.to_json()))
    # No step measured yet and no engine series read: n/a. What the adapter counts itself is a number.
    assert wire["step_ms"] is None and wire["waiting"] is None and wire["source"] == "engine_metrics"
    assert wire["running"] == 0 and wire["decode_batch"] == 0 and wire["checkpoint_bytes_held"] is None
    assert NodeStatus.parse(wire) == status
    older = NodeStatus.parse({"seq": 1, "at": 1.5, "model_state": "serving", "running": 2})
    assert older.running == 2 and older.checkpoint_requests is None and older.waiting is None
    # The gateway's lenient reading: n/a counts as nothing for routing.
    routed = NodeStatus.from_event(wire)
    assert routed.running == 0 and routed.step_ms == 0.0 and routed.steps == 0 and routed.model_state == "loading_full"


@pytest.mark.parametrize(
    "figures,message",
    [
        ({"running": "3"}, "running: must be int, got str"),
        ({"kv_blocks_used": 1.5}, "kv_blocks_used: must be int, got float"),
        ({"step_ms": True}, "step_ms: must be float, got bool"),
        ({"decode_step_context_tokens": -1}, "decode_step_context_tokens: must be 0 or more"),
        ({"seq": None}, "seq: must not be null: only a figure may be n/a"),
        (
            {"model_state": "asleep"},
            "model_state: 'asleep' is not known: expected one of loading_draft, draft_ready, loading_full, serving",
        ),
        ({"source": 7}, "source: must be str, got int"),
        ({"assist": "draft-1"}, "assist: must be an object or null, got str"),
        ({"assist": {"draft": "d", "k": "four", "agreement": 0.6}}, "assist.k: must be int, got str"),
        ({"assist": {"draft": "d", "k": 4}}, "assist.agreement: is required"),
    ],
)
def test_a_bad_status_is_refused_naming_the_field(figures, message):
    wire = {**emulated_status().to_json(), **figures}
    assert str(refusal(NodeStatus.parse, wire)) == message
    assert refusal(NodeStatus.parse, wire).field == message.split(":")[0]


def test_a_status_must_be_an_object():
    assert str(refusal(NodeStatus.parse, [1, 2])) == "status: must be an object, got list"


def test_a_heartbeat_carries_the_status_with_its_heartbeat_figures_as_numbers():
    adapter = AdapterEngine("http://127.0.0.1:9", catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1), "adapter")
    load = Load.of(adapter.status(), tokens_per_s=12.5)
    wire = json.loads(json.dumps(Heartbeat(session=SESSION, load=load).to_json()))["load"]
    assert set(HEARTBEAT_LOAD_FIELDS) <= set(wire) and all(
        isinstance(wire[f], (int, float)) for f in HEARTBEAT_LOAD_FIELDS
    )
    assert (
        wire["step_ms"] == 0.0 and wire["running"] == 0 and wire["tokens_per_s"] == 12.5
    )  # an older control plane refuses null
    assert wire["checkpoint_budget_bytes"] is None  # the rest of the status keeps its n/a
    assert Heartbeat.parse(heartbeat(load=wire)).load == load
    status = emulated_status()
    assert {k: v for k, v in vars(Load.of(status, 0.0)).items() if k != "tokens_per_s"} == vars(status)


def test_an_older_nodes_heartbeat_load_reads_as_before():
    old = {"running": 4, "waiting": 1, "kv_blocks_used": 50, "kv_blocks_total": 200, "step_ms": 12, "tokens_per_s": 0.0}
    load = Heartbeat.parse(heartbeat(load=old)).load
    assert (
        load.running,
        load.waiting,
        load.kv_blocks_used,
        load.step_ms,
        load.decode_step_ms,
        load.decode_step_batch,
    ) == (4, 1, 50, 12.0, 0.0, 0)
    assert isinstance(load.step_ms, float) and Heartbeat.parse(heartbeat(load=None)).load == Load()
    assert str(refusal(Heartbeat.parse, heartbeat(load={"running": None}))) == "load.running: is required"
    assert str(refusal(Heartbeat.parse, heartbeat(load={"waiting": -2}))) == "load.waiting: must be 0 or more"
    assert str(refusal(Heartbeat.parse, heartbeat(load=[]))) == "load: must be an object, got list"
