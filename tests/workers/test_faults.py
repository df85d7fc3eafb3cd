"""Fault injection on a real node: off unless enabled, behind a token, and each kind observable."""

import socket
import time

import pytest

from tests.fake_control_plane import FakeControlPlane
from tests.helpers import http_json, wait_for

FAULT = "fault-token-for-tests"
ENV = {"LIFELINE_FAULT_TOKEN": FAULT, "LIFELINE_AGENT_TOKEN": "agent"}
HEAD = {"Authorization": f"Bearer {FAULT}"}
SCALE = ("--time-scale", "0.2")


@pytest.fixture
def faulty(node_factory):
    def start(name, *extra):
        return node_factory(name, "--enable-faults", *SCALE, *extra, env=ENV)

    return start


def inject(node, kind, **params):
    return http_json(node.address + "/agent/faults", data={"kind": kind, **params}, headers=HEAD)


def gpus(node):
    status, body = http_json(node.address + "/agent/telemetry")
    assert status == 200 and body["source"] == "emulated"
    return body["gpus"]


def complete(node, n=20, **extra):
    status, body = http_json(
        node.address + "/v1/completions",
        data={"model": "Qwen3-32B", "prompt": "fault drill", "max_tokens": n, "temperature": 0, **extra},
    )
    return status, body


def timed(node, n=20):
    started = time.monotonic()
    status, body = complete(node, n)
    assert status == 200, body
    return time.monotonic() - started


def metric(node, name):
    import urllib.request

    text = urllib.request.urlopen(node.address + "/metrics").read().decode()
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def test_fault_injection_is_off_unless_enabled_and_needs_its_token(node_factory, faulty):
    plain = node_factory("f-off", *SCALE, env=ENV)
    status, body = inject(plain, "crash")
    assert status == 403 and "--enable-faults" in body["error"]["message"]
    node = faulty("f-on")
    assert http_json(node.address + "/agent/faults", data={"kind": "slow"})[0] == 401
    assert (
        http_json(node.address + "/agent/faults", data={"kind": "slow"}, headers={"Authorization": "Bearer agent"})[0]
        == 401
    )
    status, body = inject(node, "meltdown")
    assert status == 400 and body["error"]["param"] == "kind"
    status, body = inject(node, "xid")
    assert status == 400 and body["error"]["param"] == "code"
    status, body = inject(node, "nvlink_down")  # one GPU: no NVLink peers
    assert status == 400 and "tensor-parallel" in body["error"]["message"]
    status, body = inject(node, "slow", factor=0.5)
    assert status == 400 and body["error"]["param"] == "factor"


def test_slow_then_cleared(faulty):
    node = faulty("f-slow")
    base = timed(node)
    assert inject(node, "slow", factor=4)[0] == 200
    slowed = timed(node)
    assert slowed > 2.5 * base, (base, slowed)
    assert http_json(node.address + "/agent/faults?kind=slow", method="DELETE", headers=HEAD)[1]["active"] == []
    assert timed(node) < 1.5 * base


def test_silent_data_corruption_changes_tokens_and_drifts_logprobs(faulty):
    node = faulty("f-sdc")
    _, clean = complete(node, 30, logprobs=1)
    inject(node, "sdc", rate=0.5, logprob_drift=-3.0)
    _, corrupt = complete(node, 30, logprobs=1)
    assert corrupt["choices"][0]["text"] != clean["choices"][0]["text"]  # still looks like text, but wrong
    assert corrupt["usage"] == clean["usage"]
    first_clean = clean["choices"][0]["logprobs"]["token_logprobs"][0]
    first_corrupt = corrupt["choices"][0]["logprobs"]["token_logprobs"][0]
    assert first_corrupt == pytest.approx(first_clean - 3.0)


def test_thermal_throttling_heats_slows_and_shows_throttle_reasons(faulty):
    node = faulty("f-heat")
    cool = gpus(node)[0]
    base = timed(node)
    inject(node, "thermal", target_c=94, ramp_s=0, min_clock_factor=0.5)
    hot = gpus(node)[0]
    assert cool["temperature_c"] < 80 and hot["temperature_c"] == pytest.approx(94, abs=0.5)
    assert hot["sm_clock_mhz"] == pytest.approx(cool["sm_clock_max_mhz"] * 0.5, rel=0.02)
    assert hot["throttle_reasons"] & 0x20 and hot["throttle_reasons"] & 0x40
    assert timed(node) > 1.6 * base  # steps at half the clock
    assert metric(node, "DCGM_FI_DEV_GPU_TEMP")[0].endswith(" 94.0")


def test_xid_and_ecc_events_show_in_telemetry(faulty):
    node = faulty("f-xid", "--tp", "2")
    status, body = inject(node, "xid", code=48, gpu=1)
    assert status == 200
    readings = gpus(node)
    assert readings[1]["last_xid"] == 48 and readings[1]["ecc_uncorrected_volatile"] == 1
    assert readings[0]["last_xid"] is None and readings[0]["ecc_uncorrected_volatile"] == 0
    assert any(line.endswith(" 48.0") and 'gpu="1"' in line for line in metric(node, "DCGM_FI_DEV_XID_ERRORS"))
    assert complete(node)[0] == 200  # a double-bit ECC error alone does not stop serving


def test_gpu_fallen_off_the_bus_fails_the_group(faulty):
    node = faulty("f-lost", "--tp", "2")
    inject(node, "xid", code=79, gpu=0)
    assert http_json(node.address + "/health")[0] == 503
    status, body = complete(node)
    assert status == 503 and "lost GPU" in body["error"]["message"]
    readings = gpus(node)
    assert readings[0]["lost"] and readings[0]["temperature_c"] is None and not readings[1]["lost"]
    assert any(line.endswith(" 1.0") and 'gpu="0"' in line for line in metric(node, "lifeline_gpu_lost"))


def test_nvlink_down_slows_the_tensor_parallel_group(faulty):
    node = faulty("f-nvl", "--tp", "2")
    assert all(gpus(node)[0]["nvlink_up"])
    complete(node, 5)
    before = http_json(node.address + "/agent/status")[1]["load"]["step_ms"]
    inject(node, "nvlink_down")
    assert not any(gpus(node)[0]["nvlink_up"])
    complete(node, 5)
    after = http_json(node.address + "/agent/status")[1]["load"]["step_ms"]
    assert after > before * 1.1, (before, after)  # all-reduces fell back to PCIe


def test_hang_keeps_sockets_open_but_answers_nothing(faulty):
    node = faulty("f-hang")
    status, _ = inject(node, "hang", seconds=3)
    assert status == 202
    time.sleep(0.3)
    host, port = node.address.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=2):  # it still accepts connections
        pass
    with pytest.raises(OSError):
        import urllib.request

        urllib.request.urlopen(node.address + "/health", timeout=1)
    assert node.proc.poll() is None
    wait_for(lambda: http_json(node.address + "/health", timeout=2)[0] == 200, 10, 0.2, "the node answers again")


def test_crash_exits_at_once(faulty):
    node = faulty("f-crash")
    status, _ = inject(node, "crash")
    assert status == 202
    wait_for(lambda: node.proc.poll() is not None, 5, 0.05, "the process to exit")
    assert node.proc.returncode == -9


# --- what heartbeats carry -------------------------------------------------------------------


def test_heartbeats_carry_gpu_readings_and_each_injected_xid_event(faulty):
    with FakeControlPlane() as plane:
        node = faulty("f-beat", "--tp", "2", "--control-url", plane.url)
        first = plane.wait_for_heartbeat(lambda h: h.gpus)
        assert first.xids == [] and [g["index"] for g in first.gpus] == [0, 1]
        assert (
            first.gpus[0]["temperature_c"] == pytest.approx(45, abs=1)
            and first.gpus[0]["ecc_uncorrected_volatile"] == 0
        )
        assert first.gpus[0]["memory_total_bytes"] == 80 * 10**9 and first.gpus[0]["lost"] is False

        before = time.time()
        assert inject(node, "xid", code=48, gpu=1, count=3)[0] == 200
        beat = plane.wait_for_heartbeat(lambda h: h.xids)
        assert [(x["gpu"], x["code"]) for x in beat.xids] == [(1, 48)] * 3
        ats = [x["at"] for x in beat.xids]
        assert ats == sorted(ats) and before <= ats[0] <= time.time()
        assert beat.gpus[1]["ecc_uncorrected_volatile"] == 3 and beat.gpus[0]["ecc_uncorrected_volatile"] == 0

        # Recent events are sent again in later heartbeats: the control plane de-duplicates them by time.
        count = len(plane.heartbeats)
        inject(node, "xid", code=79, gpu=0)
        beat = plane.heartbeats_after(count, lambda h: len(h.xids) == 4)
        assert beat.xids[:3] == [x for x in beat.xids if x["code"] == 48] and beat.xids[3]["code"] == 79
        lost = beat.gpus[0]
        assert lost["lost"] is True and lost["temperature_c"] is None and lost["utilization_pct"] is None  # n/a, not 0
        assert beat.gpus[1]["lost"] is False


# --- GPU reset ends what a reset ends ---------------------------------------------------------

AGENT_HEAD = {"Authorization": "Bearer agent"}
RELOAD_FAST = ("--time-scale", "0.02")  # a reset reloads the model cold: 0.5 s instead of 25


def reset(node) -> dict:
    status, answer = http_json(node.address + "/agent/reset", method="POST", headers=AGENT_HEAD)
    assert status == 200 and answer["reset"] is True, answer
    wait_for(lambda: http_json(node.address + "/health")[0] == 200, 10, 0.05, "serving again after the reset")
    return answer


def test_reset_ends_silent_data_corruption_and_thermal_throttling(faulty):
    node = faulty("f-reset", *RELOAD_FAST)
    _, clean = complete(node, 30)
    inject(node, "sdc", rate=0.5)
    inject(node, "thermal", target_c=94, ramp_s=0, min_clock_factor=0.5)
    assert complete(node, 30)[1]["choices"][0]["text"] != clean["choices"][0]["text"]
    assert gpus(node)[0]["throttle_reasons"] & 0x40

    reset(node)

    assert http_json(node.address + "/agent/faults", headers=HEAD)[1]["active"] == []
    assert complete(node, 30)[1]["choices"][0]["text"] == clean["choices"][0]["text"]
    cool = gpus(node)[0]
    assert (
        cool["temperature_c"] < 80
        and cool["sm_clock_mhz"] == cool["sm_clock_max_mhz"]
        and not cool["throttle_reasons"] & 0x60
    )


def test_reset_brings_a_lost_gpu_back_and_keeps_the_hardware_history(faulty):
    node = faulty("f-back", "--tp", "2", *RELOAD_FAST)
    inject(node, "xid", code=63, gpu=1)  # a row remap pending: history
    inject(node, "xid", code=48, gpu=1)  # a volatile ECC count: state
    inject(node, "xid", code=79, gpu=0)
    assert http_json(node.address + "/health")[0] == 503
    assert gpus(node)[0]["lost"]

    answer = reset(node)

    assert answer["model_state"] == "loading_draft"  # cold, as after a restart
    assert complete(node)[0] == 200
    gpu0, gpu1 = gpus(node)
    assert not gpu0["lost"] and gpu0["temperature_c"] is not None
    assert gpu1["ecc_uncorrected_volatile"] == 0
    assert gpu1["remapped_rows"]["pending"] is True and gpu1["remapped_rows"]["uncorrectable"] == 1
    assert gpu0["last_xid"] == 79 and gpu1["last_xid"] == 48
    assert [x["code"] for x in http_json(node.address + "/agent/faults", headers=HEAD)[1]["xids"]] == [63, 48, 79]
