"""An MoE attention worker as a real node process in front of real expert-worker processes (document 001): its
streams run every layer's experts on the EWs; an EW killed with SIGKILL mid-stream is replayed on shadows, the
text identical to an undisturbed run and no token gap over half a second; the control plane's new table is taken
through `POST /agent/ert`, an older one or a malformed one refused."""

import json
import threading
import time
import urllib.request

import pytest

from console.stack import free_port
from recovery.policy import moe as moe_policy
from tests.helpers import http_json
from tests.workers.test_expert_workers import MIXTRAL, Ew
from workers.moe import expert_bytes

AGENT = "moe-agent-token"
HEAD = {"Authorization": f"Bearer {AGENT}"}


@pytest.fixture
def moe_aw(node_factory, tmp_path):
    """Makes an attention worker node in front of three EW processes (each on a port of its own, so one can be
    started again at its address): every expert shadowed, or none with `shadows=False`."""
    workers: dict[str, Ew] = {}

    def make(shadows: bool = True, *node_args: str):
        room = [moe_policy.ExpertWorker(f"ew-{i}", expert_bytes(MIXTRAL) * 6) for i in range(3)]
        table = moe_policy.plan(MIXTRAL, room, shadows=shadows)
        ports = {ew: free_port() for ew in sorted(table.ews())}
        for ew, port in ports.items():
            workers[ew] = Ew(ew, table.primaries_of(ew), table.shadows_of(ew), "--port", str(port))
        ert = tmp_path / "ert.json"
        ert.write_text(json.dumps(table.to_json()))
        node = node_factory(
            "aw-1",
            *("--model", "Mixtral-8x7B", "--gpu", "H200-SXM", "--tp", "1", *node_args),
            *("--expert-workers", ",".join(f"{ew}={w.address}" for ew, w in workers.items()), "--ert", str(ert)),
            env={"LIFELINE_AGENT_TOKEN": AGENT},
        )
        return node, table, workers, ports

    yield make
    for worker in workers.values():
        if worker.proc.poll() is None:
            worker.proc.terminate()
            worker.proc.wait(10)


@pytest.fixture
def aw(moe_aw):
    node, table, workers, _ = moe_aw()
    return node, table, workers


class StreamFailed(Exception):
    """The stream ended with an error event."""


def stream(address: str, on_token=None) -> tuple[str, list[float]]:
    """A greedy streamed completion; returns its text and each token's arrival time."""
    body = {
        "model": "Mixtral-8x7B",
        "prompt": "Explain expert parallelism " * 4,
        "max_tokens": 24,
        "stream": True,
        "temperature": 0,
    }
    request = urllib.request.Request(
        address + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    text, times = [], []
    with urllib.request.urlopen(request, timeout=60) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise StreamFailed(chunk["error"].get("message", ""))
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    text.append(chunk["choices"][0]["text"])
                    times.append(time.monotonic())
                    if on_token:
                        on_token(len(times))
    return "".join(text), times


def test_an_ew_killed_mid_stream_leaves_the_attention_workers_stream_whole_and_barely_paused(aw):
    node, table, workers = aw
    expected, times = stream(node.address)
    undisturbed_gap = max(b - a for a, b in zip(times, times[1:]))
    status = http_json(node.address + "/agent/status")[1]
    assert status["counters"]["moe_layers"] >= 24 * MIXTRAL.layers and status["counters"]["moe_mismatches"] == 0
    victim = max(workers, key=lambda ew: len(table.primaries_of(ew)))

    def kill_at_8(count):
        if count == 8:
            workers[victim].kill()

    text, times = stream(node.address, kill_at_8)
    assert text == expected
    gap = max(b - a for a, b in zip(times, times[1:]))
    # The pause the failover adds: the longest gap over the longest of the undisturbed stream just before, on the
    # same host at the same load (a step on a loaded 2-core host takes up to a quarter second by itself: an
    # absolute bound on the gap failed there at 0.571 s with 0.233 s undisturbed). Without a shadow the standby
    # loads the lost experts first: seconds (benchmarks/moe_fleet).
    counters = http_json(node.address + "/agent/status")[1]["counters"]
    said = f"longest token gap {gap:.3f} s (undisturbed {undisturbed_gap:.3f} s); {counters}"
    assert gap - undisturbed_gap < 0.5, said
    # Every expert had a live location at once, its shadow: no wait, unless a live EW was also taken as down for
    # missed probes (a loaded host; a run under a CPU hog left one expert with neither for a moment so).
    assert counters["moe_waits"] == 0 or counters["moe_failovers_silent"] >= 1, counters
    # The killed EW found dead once; a live one that missed its probes on a loaded machine costs a replay, counted
    # apart (moe_failovers_silent), not a failure. On such a host a live EW may also miss its answers (MAX_MISSES:
    # alive but not answering is as good as down) and be taken down without being silent: a loaded run on 2026-12-07
    # had 3 so beside 5 silent. More than the one only where the host showed its load so (a silent failover).
    real = counters["moe_failovers"] - counters["moe_failovers_silent"]
    assert real == 1 or (real > 1 and counters["moe_failovers_silent"] >= 1), counters
    assert counters["moe_mismatches"] == 0, counters


def test_an_ew_restarted_at_its_address_with_what_it_held_is_used_again_without_a_new_table(moe_aw):
    """No shadows, no control plane: the stream waits on the killed EW's experts; the EW started again at its
    address holding them (a supervisor's quick restart, loading cold) is asked by the AW whether it serves them and
    used again, on the table the AW had. The text equals an undisturbed run. (Only a new table used to make an AW
    try a down EW again, so this stream waited out its bound and failed.)"""
    node, table, workers, ports = moe_aw(False)
    expected, _ = stream(node.address)
    victim = "ew-1"

    def restart():
        workers[victim] = Ew(victim, table.primaries_of(victim), [], "--port", str(ports[victim]), "--start", "cold")

    def kill_at_8(count):
        if count == 8:
            workers[victim].kill()
            threading.Timer(0.5, restart).start()

    text, times = stream(node.address, kill_at_8)
    assert text == expected
    gap = max(b - a for a, b in zip(times, times[1:]))
    assert 0.5 < gap < 20, f"longest token gap {gap:.3f} s"  # waited for the restart and the cold load
    counters = http_json(node.address + "/agent/status")[1]["counters"]
    assert counters["moe_readmitted"] >= 1 and counters["moe_ert_version"] == table.version
    assert counters["moe_waits"] >= 1


def test_a_step_that_waits_out_its_bound_fails_its_requests_and_the_attention_worker_serves_on(moe_aw):
    """An expert with no live location past --expert-wait: the step's requests end with an error (the gateway
    resumes them elsewhere), the engine is not taken down with them, and once the EW is back the AW serves."""
    node, table, workers, ports = moe_aw(False, "--expert-wait", "2")
    expected, _ = stream(node.address)
    workers["ew-1"].kill()
    began = time.monotonic()
    with pytest.raises(StreamFailed, match="expert"):
        stream(node.address)
    assert time.monotonic() - began < 15
    assert http_json(node.address + "/health")[0] == 200
    workers["ew-1"] = Ew("ew-1", table.primaries_of("ew-1"), [], "--port", str(ports["ew-1"]))
    text, _ = stream(node.address)
    assert text == expected


def test_the_control_planes_new_table_is_taken_and_an_older_or_malformed_one_refused(aw):
    node, table, workers = aw
    url = node.address + "/agent/ert"
    lost = sorted(workers)[0]
    newer = moe_policy.after_loss(table, [lost])
    assert http_json(url, data={"ert": newer.to_json()})[0] == 401  # the agent token, as every control endpoint
    status, body = http_json(url, data={"ert": newer.to_json()}, headers=HEAD)
    assert status == 200 and body["version"] == table.version + 1
    status, body = http_json(url, data={"ert": table.to_json()}, headers=HEAD)
    assert status == 409 and "is not newer" in body["error"]["message"]
    broken = {**newer.to_json(), "version": newer.version + 1, "experts": newer.to_json()["experts"][:3]}
    status, body = http_json(url, data={"ert": broken}, headers=HEAD)
    assert status == 400 and body["error"]["param"] == "ert.experts"
    elsewhere = moe_policy.with_replacement(newer, table.primaries_of(lost), "ew-new")
    status, body = http_json(url, data={"ert": elsewhere.to_json()}, headers=HEAD)
    assert status == 400 and "ew-new" in body["error"]["message"]  # an EW with no address
    # The stream goes on with the new table.
    text, _ = stream(node.address)
    assert text


def test_a_node_refuses_to_start_as_an_attention_worker_of_a_dense_model(tmp_path):
    import subprocess
    import sys

    from tests.helpers import BASE_DIR

    ert = tmp_path / "ert.json"
    ert.write_text("{}")
    run = subprocess.run(
        [sys.executable, "-m", "workers.node", "--model", "Qwen3-32B", "--expert-workers", "ew-0=http://x:1"]
        + ["--ert", str(ert)],
        cwd=BASE_DIR,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 2 and "Qwen3-32B is not a mixture of experts" in run.stderr
