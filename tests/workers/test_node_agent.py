"""A real node process: the OpenAI API, /health, /metrics, status and its event stream,
the batch limit, GPU reset, and registering as a hot spare."""

import asyncio
import json
import os
import time

import aiohttp
import pytest

from tests.fake_control_plane import FakeControlPlane
from tests.helpers import http_json, wait_for

FAST = ("--time-scale", "0.05")


@pytest.fixture
def node(node_factory):
    return node_factory("agent-a", *FAST)


async def stream_text(address: str, path: str, body: dict) -> tuple[str, list[dict], dict]:
    chunks = []
    async with aiohttp.ClientSession() as session:
        async with session.post(address + path, json={**body, "stream": True}) as response:
            assert response.status == 200, await response.text()
            assert response.headers["Content-Type"].startswith("text/event-stream")
            headers = dict(response.headers)
            async for raw in response.content:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    text = "".join(
        c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content", "")
        for c in chunks
        if c["choices"]
    )
    return text, chunks, headers


async def test_streamed_completion_equals_the_whole_one_and_is_the_same_on_every_node(node, node_factory):
    other = node_factory("agent-b", *FAST, "--gpu", "H200-SXM")
    body = {"model": "Qwen3-32B", "prompt": "Explain what a canary checks", "max_tokens": 40, "temperature": 0}
    streamed, chunks, headers = await stream_text(node.address, "/v1/completions", body)
    assert headers["X-Lifeline-Node"] == "agent-a"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    status, whole = http_json(node.address + "/v1/completions", data=body)
    assert status == 200
    assert whole["choices"][0]["text"] == streamed
    assert whole["usage"]["completion_tokens"] == len(chunks) - 1
    _, on_other = http_json(other.address + "/v1/completions", data=body)
    assert on_other["choices"][0]["text"] == streamed  # different GPU, same text


def test_ignore_eos_generates_through_the_end_of_sequence_as_vllm_does(node):
    from benchmarks.harness import expected_ids
    from workers import tokens

    prompt = "Summarize the on-call runbook for a GPU that returns plausible but wrong answers " * 3 + "2"
    natural = expected_ids("Qwen3-32B", prompt, 400)
    assert natural[-1] == tokens.EOS and len(natural) < 200  # this prompt ends on its own
    body = {
        "model": "Qwen3-32B",
        "prompt": prompt,
        "max_tokens": 300,
        "temperature": 0,
        "lifeline": {"return_token_ids": True},
    }
    status, stopped = http_json(node.address + "/v1/completions", data=body)
    assert (
        status == 200
        and stopped["choices"][0]["finish_reason"] == "stop"
        and stopped["usage"]["completion_tokens"] == len(natural)
    )
    status, full = http_json(node.address + "/v1/completions", data={**body, "ignore_eos": True})
    assert (
        status == 200 and full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 300
    )
    assert full["choices"][0]["text"].startswith(stopped["choices"][0]["text"])
    status, answer = http_json(node.address + "/v1/completions", data={**body, "ignore_eos": "yes"})
    assert status == 400 and answer["error"]["param"] == "ignore_eos"


async def test_chat_completion_with_logprobs_and_usage(node):
    body = {
        "model": "Qwen/Qwen3-32B",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "status?"}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "stream_options": {"include_usage": True},
    }
    text, chunks, _ = await stream_text(node.address, "/v1/chat/completions", body)
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    content = chunks[0]["choices"][0]["logprobs"]["content"][0]
    assert len(content["top_logprobs"]) == 3 and content["logprob"] == content["top_logprobs"][0]["logprob"]
    status, whole = http_json(node.address + "/v1/chat/completions", data={**body, "stream": False})
    assert status == 200 and whole["choices"][0]["message"]["content"] == text


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"prompt": "x"}, 400, "model"),
        ({"model": "Qwen3-32B", "prompt": ""}, 400, "prompt"),
        ({"model": "Qwen3-32B", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "Qwen3-32B", "prompt": "x", "temperature": 9}, 400, "temperature"),
        ({"model": "Qwen3-32B", "prompt": "x", "stop": [1]}, 400, "stop[0]"),
        ({"model": "Llama-3-70B", "prompt": "x"}, 404, "model"),
    ],
)
def test_bad_requests_name_the_field(node, body, status, param):
    code, answer = http_json(node.address + "/v1/completions", data=body)
    assert code == status
    assert answer["error"]["param"] == param and param in answer["error"]["message"]


def test_bad_chat_messages_name_the_index(node):
    code, answer = http_json(
        node.address + "/v1/chat/completions",
        data={"model": "Qwen3-32B", "messages": [{"role": "robot", "content": "hi"}]},
    )
    assert code == 400 and answer["error"]["param"] == "messages[0].role"


def test_health_status_and_metrics(node):
    assert http_json(node.address + "/health") == (200, {"status": "ok"})
    http_json(
        node.address + "/v1/completions",
        data={"model": "Qwen3-32B", "prompt": "count me", "max_tokens": 5, "temperature": 0},
    )
    status, doc = http_json(node.address + "/agent/status")
    assert status == 200
    assert doc["pid"] == node.pid and doc["name"] == "agent-a" and doc["model"] == "Qwen3-32B"
    assert set(doc["load"]) >= {
        "waiting",
        "running",
        "uncomputed_prefill_tokens",
        "decode_batch",
        "decode_context_tokens",
        "kv_blocks_used",
        "kv_blocks_total",
        "step_ms",
        "seq",
        "at",
    }
    import urllib.request

    metrics = urllib.request.urlopen(node.address + "/metrics").read().decode()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
    ):
        assert f"{name}{{" in metrics, name
    assert 'vllm:generation_tokens_total{model_name="Qwen3-32B",node="agent-a"} 5.0' in metrics


async def test_event_stream_pushes_a_status_at_each_load_change(node):
    async with aiohttp.ClientSession() as session:
        async with session.get(node.address + "/agent/events") as events:
            first = json.loads((await _next_event(events))["data"])
            assert first["running"] == 0
            async with session.post(
                node.address + "/v1/completions",
                json={"model": "Qwen3-32B", "prompt": "load", "max_tokens": 20, "temperature": 0},
            ) as response:
                await response.read()
            reasons, seqs = [], []
            while "finished" not in reasons:
                status = json.loads((await _next_event(events))["data"])
                reasons.append(status["reason"])
                seqs.append(status["seq"])
    assert reasons[:2] == ["arrival", "admitted"]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


async def _next_event(response) -> dict:
    fields = {}
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if not line:
            if fields:
                return fields
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(": ")
        fields[key] = value
    raise AssertionError("event stream ended")


def test_a_node_that_cannot_fit_its_model_says_so(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "workers.node", "--name", "x", "--model", "Llama-3-70B", "--gpu", "RTX-4090"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ},
    )
    assert result.returncode == 2 and "does not fit" in result.stderr and "Traceback" not in result.stderr


# --- the batch limit --------------------------------------------------------------------------

AGENT = "agent-token-for-tests"
CONTROL = {"LIFELINE_AGENT_TOKEN": AGENT}
AGENT_HEAD = {"Authorization": f"Bearer {AGENT}"}


def load_status(node) -> dict:
    return http_json(node.address + "/agent/status")[1]["load"]


def set_batch_factor(node, body) -> tuple[int, dict]:
    return http_json(node.address + "/agent/config", data=body, headers=AGENT_HEAD)


class StatusRecorder:
    """Every status a node pushes on /agent/events, read in the background."""

    def __init__(self, session: aiohttp.ClientSession, address: str):
        self.session, self.address = session, address
        self.statuses: list[dict] = []
        self.connected = asyncio.Event()

    async def __aenter__(self):
        self.task = asyncio.create_task(self._read())
        await self.connected.wait()
        return self

    async def __aexit__(self, *exc):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def _read(self):
        async with self.session.get(self.address + "/agent/events") as events:
            while True:
                self.statuses.append(json.loads((await _next_event(events))["data"]))
                self.connected.set()


async def stream_finish(session: aiohttp.ClientSession, address: str, max_tokens: int) -> str:
    """Stream one completion; its finish reason, or the error that ended it."""
    body = {
        "model": "Qwen3-32B",
        "prompt": "batch limit drill",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    async with session.post(address + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        last = None
        async for raw in response.content:
            if raw.startswith(b"data: {"):
                last = json.loads(raw[6:])
    return last["choices"][0]["finish_reason"] if "choices" in last else "error: " + last["error"]["message"]


def test_batch_factor_is_validated_and_needs_the_agent_token(node_factory):
    node = node_factory("batch-v", *FAST, "--max-num-seqs", "10", env=CONTROL)
    assert http_json(node.address + "/agent/config", headers=AGENT_HEAD) == (
        200,
        {"batch_factor": 1.0, "batch_limit": 10, "max_num_seqs": 10},
    )
    assert http_json(node.address + "/agent/config")[0] == 401
    assert http_json(node.address + "/agent/config", data={"batch_factor": 0.5})[0] == 401
    for body in (
        {},
        {"batch_factor": None},
        {"batch_factor": "0.5"},
        {"batch_factor": True},
        {"batch_factor": 0},
        {"batch_factor": -0.5},
        {"batch_factor": 1.01},
    ):
        status, answer = set_batch_factor(node, body)
        assert (
            status == 400
            and answer["error"]["param"] == "batch_factor"
            and "batch_factor" in answer["error"]["message"]
        ), body
    assert set_batch_factor(node, {"batch_factor": 0.29}) == (
        200,
        {"batch_factor": 0.29, "batch_limit": 2, "max_num_seqs": 10},
    )
    assert set_batch_factor(node, {"batch_factor": 0.01})[1]["batch_limit"] == 1  # never below one
    assert set_batch_factor(node, {"batch_factor": 0.7})[1]["batch_limit"] == 7  # 10 x 0.7 is 7.000000000000001
    load = load_status(node)
    assert load["batch_limit"] == 7 and load["batch_factor"] == 0.7


async def test_a_lower_batch_factor_limits_admission_until_running_requests_finish(node_factory):
    node = node_factory("batch-a", "--time-scale", "0.2", "--max-num-seqs", "8", env=CONTROL)
    async with aiohttp.ClientSession() as session, StatusRecorder(session, node.address) as recorder:
        assert set_batch_factor(node, {"batch_factor": 0.5}) == (
            200,
            {"batch_factor": 0.5, "batch_limit": 4, "max_num_seqs": 8},
        )
        config_event = await asyncio.to_thread(
            wait_for,
            lambda: next((s for s in recorder.statuses if s.get("reason") == "config"), None),
            5,
            0.02,
            "a config status",
        )
        assert config_event["batch_limit"] == 4 and config_event["batch_factor"] == 0.5

        streams = [asyncio.create_task(stream_finish(session, node.address, 60)) for _ in range(8)]
        # Four run while four wait, as /agent/status shows.
        await asyncio.to_thread(
            wait_for,
            lambda: (lambda s: s["running"] == 4 and s["waiting"] == 4)(load_status(node)),
            10,
            0.02,
            "4 running, 4 waiting",
        )
        assert await asyncio.gather(*streams) == ["length"] * 8

    loads = [s for s in recorder.statuses if "running" in s]
    assert max(s["running"] for s in loads) == 4, "more than the batch limit ran at once"
    assert any(s["waiting"] >= 1 and s["running"] == 4 for s in loads)


async def test_lowering_the_batch_factor_preempts_nothing_and_holds_new_admissions(node_factory):
    node = node_factory("batch-p", "--time-scale", "0.2", "--max-num-seqs", "8", env=CONTROL)
    async with aiohttp.ClientSession() as session, StatusRecorder(session, node.address) as recorder:
        first = [asyncio.create_task(stream_finish(session, node.address, 200)) for _ in range(6)]
        await asyncio.to_thread(wait_for, lambda: load_status(node)["running"] == 6, 10, 0.02, "6 running")
        # The recorder's stream has the sixth admission too (CI 2026-11-29: it came after the change was counted).
        await asyncio.to_thread(
            wait_for, lambda: any(s.get("running") == 6 for s in recorder.statuses), 10, 0.02, "6 running recorded"
        )
        assert set_batch_factor(node, {"batch_factor": 0.5})[1]["batch_limit"] == 4
        after_change = len(recorder.statuses)
        assert load_status(node)["running"] == 6  # the running batch goes on above the new limit
        later = [asyncio.create_task(stream_finish(session, node.address, 20)) for _ in range(2)]
        assert await asyncio.gather(*first, *later) == ["length"] * 8

    admitted = [s for s in recorder.statuses[after_change:] if s.get("reason") == "admitted"]
    assert admitted and all(s["running"] <= 4 for s in admitted), [s["running"] for s in admitted]
    assert http_json(node.address + "/agent/status")[1]["counters"]["preemptions"] == 0


# --- GPU reset ------------------------------------------------------------------------------


async def test_gpu_reset_fails_work_in_flight_and_reloads_the_model_cold(node_factory):
    node = node_factory("reset-a", *FAST, env={**CONTROL, "LIFELINE_FAULT_TOKEN": "fault-token"})
    assert http_json(node.address + "/agent/reset", method="POST")[0] == 401
    assert (
        http_json(node.address + "/agent/reset", method="POST", headers={"Authorization": "Bearer fault-token"})[0]
        == 401
    )
    async with aiohttp.ClientSession() as session, StatusRecorder(session, node.address) as recorder:
        stream = asyncio.create_task(stream_finish(session, node.address, 5000))
        await asyncio.to_thread(wait_for, lambda: load_status(node)["running"] == 1, 10, 0.02, "the stream running")
        status, answer = await asyncio.to_thread(
            http_json, node.address + "/agent/reset", method="POST", headers=AGENT_HEAD
        )
        assert (status, answer) == (200, {"reset": True, "aborted": 1, "model_state": "loading_draft"})
        assert await stream == "error: GPU reset on node reset-a"
        assert http_json(node.address + "/health")[0] == 503
        await asyncio.to_thread(
            wait_for, lambda: http_json(node.address + "/health")[0] == 200, 10, 0.05, "serving again"
        )
        # The status that says so travels on /agent/events, read here in the background: it can arrive just after
        # /health answers 200 (CI once closed the reader first).
        deadline = time.monotonic() + 5
        while not any(s.get("reason") == "model_serving" for s in recorder.statuses) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    reasons = [s.get("reason") for s in recorder.statuses]
    assert "reset" in reasons
    assert reasons.index("model_loading_draft") < reasons.index("model_draft_ready") < reasons.index("model_serving")
    status, whole = http_json(
        node.address + "/v1/completions", data={"model": "Qwen3-32B", "prompt": "after the reset", "max_tokens": 5}
    )
    assert status == 200 and whole["usage"]["completion_tokens"] == 5


# --- hot spares, and what an adapter cannot do ------------------------------------------------


def test_a_spare_node_registers_as_one(node_factory):
    with FakeControlPlane() as plane:
        spare = node_factory("spare-a", *FAST, "--spare", "--control-url", plane.url)
        assert plane.wait_for_registration().spare is True
        assert http_json(spare.address + "/agent/status")[1]["spare"] is True
    with FakeControlPlane() as plane:
        node_factory("spare-b", *FAST, "--control-url", plane.url, env={"LIFELINE_NODE_SPARE": "1"})
        assert plane.wait_for_registration().spare is True
    with FakeControlPlane() as plane:
        node_factory("spare-c", *FAST, "--control-url", plane.url)
        assert plane.wait_for_registration().spare is False


def test_an_adapter_node_cannot_change_its_batch_limit_or_reset_its_gpus(node_factory):
    adapter = node_factory("adapter-c", "--engine-url", "http://127.0.0.1:9", env=CONTROL)
    status, answer = http_json(adapter.address + "/agent/config", data={"batch_factor": 0.5}, headers=AGENT_HEAD)
    assert status == 501 and "cannot change its batch limit" in answer["error"]["message"]
    status, answer = http_json(adapter.address + "/agent/reset", method="POST", headers=AGENT_HEAD)
    assert status == 501 and "cannot reset its GPUs" in answer["error"]["message"]
    assert {"config", "reset"} <= set(http_json(adapter.address + "/agent/capabilities")[1]["cannot"])


def test_a_node_registers_what_it_offers_and_its_heartbeats_carry_its_status(node_factory):
    with FakeControlPlane() as plane:
        node = node_factory("offers-a", *FAST, "--control-url", plane.url)
        registration = plane.wait_for_registration()
        assert registration.engine == "emulated" and list(registration.capabilities) == [
            "openai",
            "events",
            "checkpoint",
            "resume",
            "migrate",
            "assist",
            "draft",
            "reload",
            "config",
            "reset",
            "tokenize",
            "switch_model",
            "telemetry",
        ]
        capabilities = http_json(node.address + "/agent/capabilities")[1]
        assert capabilities == {"engine": {"kind": "emulated"}, "offers": list(registration.capabilities), "cannot": {}}
        body = {
            "model": "Qwen3-32B",
            "prompt": "keep the heartbeat busy",
            "max_tokens": 200,
            "temperature": 0,
            "ignore_eos": True,
        }
        assert http_json(node.address + "/v1/completions", data=body)[0] == 200
        # The heartbeat measures the token rate, and carries the whole status beside the figures the control plane
        # keeps.
        beat = plane.wait_for_heartbeat(lambda h: h.load.tokens_per_s > 0)
        assert beat.load.steps > 0 and beat.load.kv_blocks_total > 0 and beat.load.source == "engine"
    with FakeControlPlane() as plane:
        node_factory(
            "offers-b",
            *FAST,
            "--control-url",
            plane.url,
            "--enable-faults",
            env={"LIFELINE_FAULT_TOKEN": "fault-token"},
        )
        assert plane.wait_for_registration().capabilities[-2:] == ("telemetry", "faults")
    with FakeControlPlane() as plane:
        # A node in front of a real engine registers only once the engine answers as its adapter needs.
        node_factory("offers-c", "--engine-url", "http://127.0.0.1:9", "--control-url", plane.url)
        time.sleep(2)
        assert plane.registrations == []
    with FakeControlPlane() as plane:
        engine = node_factory("offers-engine", *FAST)  # an emulated node serves vLLM's API: the engine here
        node_factory("offers-d", "--engine-url", engine.address, "--control-url", plane.url)
        registration = plane.wait_for_registration()
        assert registration.engine == "vllm"
        assert registration.capabilities == ("openai", "events", "resume", "telemetry")
        # Once the engine's metrics are read after the registration probe's request, the engine is idle.
        beat = plane.wait_for_heartbeat(lambda h: h.load.model_state == "serving" and h.load.running == 0)
        assert beat.load.step_ms == 0.0 and beat.load.decode_batch == 0  # the heartbeat's own figures are numbers
