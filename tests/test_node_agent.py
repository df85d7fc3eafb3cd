"""A real node process: the OpenAI API, /health, /metrics, status and its event stream."""

import json
import os

import aiohttp
import pytest

from tests.helpers import http_json

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
    text = "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content", "") for c in chunks if c["choices"])
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


async def test_chat_completion_with_logprobs_and_usage(node):
    body = {
        "model": "Qwen/Qwen3-32B", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "status?"}],
        "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 3, "stream_options": {"include_usage": True},
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
        ({"model": "Qwen3-32B", "prompt": "x", "stop": [1]}, 400, "stop"),
        ({"model": "Llama-3-70B", "prompt": "x"}, 404, "model"),
    ],
)
def test_bad_requests_name_the_field(node, body, status, param):
    code, answer = http_json(node.address + "/v1/completions", data=body)
    assert code == status
    assert answer["error"]["param"] == param and param in answer["error"]["message"]


def test_bad_chat_messages_name_the_index(node):
    code, answer = http_json(node.address + "/v1/chat/completions", data={"model": "Qwen3-32B", "messages": [{"role": "robot", "content": "hi"}]})
    assert code == 400 and answer["error"]["param"] == "messages[0].role"


def test_health_status_and_metrics(node):
    assert http_json(node.address + "/health") == (200, {"status": "ok"})
    http_json(node.address + "/v1/completions", data={"model": "Qwen3-32B", "prompt": "count me", "max_tokens": 5, "temperature": 0})
    status, doc = http_json(node.address + "/agent/status")
    assert status == 200
    assert doc["pid"] == node.pid and doc["name"] == "agent-a" and doc["model"] == "Qwen3-32B"
    assert set(doc["load"]) >= {"waiting", "running", "uncomputed_prefill_tokens", "decode_batch", "decode_context_tokens", "kv_blocks_used", "kv_blocks_total", "step_ms", "seq", "at"}
    import urllib.request

    metrics = urllib.request.urlopen(node.address + "/metrics").read().decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket"):
        assert f'{name}{{' in metrics, name
    assert 'vllm:generation_tokens_total{model_name="Qwen3-32B"} 5.0' in metrics


async def test_event_stream_pushes_a_status_at_each_load_change(node):
    async with aiohttp.ClientSession() as session:
        async with session.get(node.address + "/agent/events") as events:
            first = json.loads((await _next_event(events))["data"])
            assert first["running"] == 0
            async with session.post(node.address + "/v1/completions", json={"model": "Qwen3-32B", "prompt": "load", "max_tokens": 20, "temperature": 0}) as response:
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

    result = subprocess.run([sys.executable, "-m", "workers.node", "--name", "x", "--model", "Llama-3-70B", "--gpu", "RTX-4090"],
                            capture_output=True, text=True, timeout=30, env={**os.environ})
    assert result.returncode == 2 and "does not fit" in result.stderr and "Traceback" not in result.stderr
