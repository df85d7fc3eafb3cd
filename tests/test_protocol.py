"""The node protocol's messages: what both sides accept, and the field a refusal names."""

import json
import uuid

import pytest

from workers.protocol import MAX_HEARTBEAT_XIDS, Heartbeat, ProtocolError, Registration

SESSION = uuid.uuid4().hex


def registration(**extra) -> dict:
    body = {
        "name": "node-x", "session": SESSION, "address": "http://127.0.0.1:9001", "rack": "rack-a",
        "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2, "pid": 4242, "host": "gpu-host-7",
        "gpus": [{"index": i, "uuid": f"GPU-node-x-{i}", "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 10**9} for i in range(2)],
    }
    body.update(extra)
    return body


def reading(index=0, **figures) -> dict:
    return {
        "index": index, "utilization_pct": 57.5, "memory_used_bytes": 20 * 2**30, "memory_total_bytes": 80 * 2**30,
        "temperature_c": 61, "power_w": 412.5, "sm_clock_mhz": 1755, "throttle_reasons": 0, "ecc_uncorrected_volatile": None,
        "lost": False, **figures,
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
        ([{"at": 1.0, "gpu": 0, "code": 48}] * 2 + [{"at": 1.0, "gpu": 0, "code": "48"}], "xids[2].code: must be int, got str"),
        ([{"at": 1.0, "gpu": 0, "code": 48}] * (MAX_HEARTBEAT_XIDS + 1), f"xids: {MAX_HEARTBEAT_XIDS + 1} events: a heartbeat carries at most {MAX_HEARTBEAT_XIDS}"),
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
        ([reading(0), reading(1, ecc_uncorrected_volatile=False)], "gpus[1].ecc_uncorrected_volatile: must be a number or null, got bool"),
        ([reading(0, lost="no")], "gpus[0].lost: must be bool, got str"),
        ([reading(0), reading(0)], "gpus: two readings share a GPU index"),
    ],
)
def test_bad_gpu_readings_are_refused_naming_the_field(gpus, message):
    assert str(refusal(Heartbeat.parse, heartbeat(gpus=gpus))) == message
