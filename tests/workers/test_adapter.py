"""A node fronting a real engine, tested against our own emulated node serving as the engine."""

import asyncio
import json
import urllib.request

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import http_json, wait_for
from workers import catalog
from workers.adapter import AdapterEngine, parse_vllm_metrics
from workers.engine import FinishEvent, TokenEvent
from workers.engine_api import CAPABILITIES
from workers.openai_schema import parse

AGENT = "adapter-agent-token"
AGENT_HEAD = {"Authorization": f"Bearer {AGENT}"}


def test_parse_vllm_metrics_sums_label_sets_and_knows_old_names():
    text = """# HELP vllm:num_requests_running x
vllm:num_requests_running{model_name="a",engine="0"} 3.0
vllm:num_requests_running{model_name="a",engine="1"} 2.0
vllm:num_requests_waiting{model_name="a"} 7
vllm:gpu_cache_usage_perc{model_name="a"} 0.25
vllm:generation_tokens_total{model_name="a"} 1.5e3
"""
    assert parse_vllm_metrics(text) == {"running": 5.0, "waiting": 7.0, "kv_usage": 0.25, "generation_tokens": 1500.0}


async def test_adapter_proxies_derives_load_and_refuses_what_the_engine_cannot_do(node_factory):
    engine = node_factory("real-engine", "--time-scale", "1")
    adapter = node_factory("adapter-1", "--engine-url", engine.address, "--model", "Qwen3-32B", "--gpu", "H100-SXM")
    wait_for(lambda: http_json(adapter.address + "/health")[0] == 200, 10, 0.1, "adapter sees the engine")
    body = {"model": "Qwen3-32B", "prompt": "fronted request", "max_tokens": 12, "temperature": 0}
    direct = http_json(engine.address + "/v1/completions", data=body)[1]["choices"][0]["text"]
    status, through = http_json(adapter.address + "/v1/completions", data={**body, "lifeline": {"request_id": "a-1"}})
    assert status == 200 and through["choices"][0]["text"] == direct

    # Load comes from the engine's metrics: a long stream shows as one running request.
    async def long_stream():
        async with aiohttp.ClientSession() as session:
            async with session.post(
                adapter.address + "/v1/completions", json={**body, "max_tokens": 100, "stream": True}
            ) as response:
                assert response.headers["X-Lifeline-Node"] == "adapter-1"
                return [raw async for raw in response.content if raw.startswith(b"data: {")]

    task = asyncio.create_task(long_stream())
    running = await asyncio.to_thread(
        wait_for, lambda: http_json(adapter.address + "/agent/status")[1]["load"]["running"] == 1, 5, 0.05, "running 1"
    )
    assert running
    load = http_json(adapter.address + "/agent/status")[1]["load"]
    assert (
        load["source"] == "engine_metrics" and load["uncomputed_prefill_tokens"] is None and load["step_ms"] is None
    )  # n/a, not 0
    assert len(await task) == 101  # 100 tokens and the finish chunk

    status, answer = http_json(
        adapter.address + "/v1/completions", data={**body, "lifeline": {"resume": {"generated_token_ids": [1, 2]}}}
    )
    assert status == 501 and "resume a request from a checkpoint" in answer["error"]["message"]
    status, answer = http_json(
        adapter.address + "/v1/completions",
        data={**body, "lifeline": {"holders": [{"name": "x", "address": "http://x:1"}]}},
    )
    assert status == 501 and answer["error"]["param"] == "lifeline"
    assert http_json(adapter.address + "/agent/requests/a-1/migrate", data={})[0] == 501
    capabilities = http_json(adapter.address + "/agent/capabilities")[1]
    assert set(capabilities["cannot"]) >= {"checkpoint", "resume", "assist"} and capabilities["engine"] == {
        "kind": "adapter",
        "url": engine.address,
    }

    engine.kill()
    wait_for(lambda: http_json(adapter.address + "/health")[0] == 503, 5, 0.1, "adapter notices the engine is gone")
    status, answer = http_json(adapter.address + "/v1/completions", data=body)
    assert status == 502 and "did not answer" in answer["error"]["message"]


# --- one agent face for every engine ------------------------------------------------------------


async def sse_choices(address: str, path: str, body: dict) -> tuple[list[dict], dict]:
    """The choices of every chunk of a streamed answer, and its usage."""
    choices, usage = [], None
    async with aiohttp.ClientSession() as session:
        async with session.post(
            address + path, json={**body, "stream": True, "stream_options": {"include_usage": True}}
        ) as response:
            assert response.status == 200, await response.text()
            async for raw in response.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    choices += chunk["choices"]
                    usage = chunk.get("usage") or usage
    return choices, usage


async def test_the_adapter_streams_the_engines_tokens_through_the_one_agent(node_factory):
    engine = node_factory("stock-engine", "--time-scale", "0.05")
    adapter = node_factory("adapter-s", "--engine-url", engine.address)
    wait_for(lambda: http_json(adapter.address + "/health")[0] == 200, 10, 0.1, "adapter sees the engine")

    # Token ids come from the engine (vLLM's return_token_ids), logprobs as the engine spelled them.
    body = {
        "model": "Qwen3-32B",
        "prompt": "stream me through",
        "max_tokens": 20,
        "temperature": 0,
        "logprobs": 2,
        "lifeline": {"return_token_ids": True},
    }
    direct, direct_usage = await sse_choices(engine.address, "/v1/completions", body)
    through, usage = await sse_choices(adapter.address, "/v1/completions", body)
    assert through == direct and usage == direct_usage
    assert [c["token_ids"] for c in through[:-1]] == [c["token_ids"] for c in direct[:-1]] and len(through) == 21

    chat = {
        "model": "Qwen3-32B",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 15,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
    }
    direct, direct_usage = await sse_choices(engine.address, "/v1/chat/completions", chat)
    through, usage = await sse_choices(adapter.address, "/v1/chat/completions", chat)
    assert through == direct and usage == direct_usage
    status, whole = http_json(adapter.address + "/v1/chat/completions", data=chat)
    assert status == 200 and whole["choices"][0]["message"]["content"] == "".join(
        c["delta"].get("content", "") for c in direct
    )

    # The agent's own series, with every series labelled by node, as for the emulated engine.
    metrics = urllib.request.urlopen(adapter.address + "/metrics").read().decode()
    assert 'vllm:time_to_first_token_seconds_count{model_name="Qwen3-32B",node="adapter-s"}' in metrics
    assert 'vllm:num_requests_running{model_name="Qwen3-32B",node="adapter-s"}' in metrics
    assert "lifeline_step_seconds" not in metrics  # n/a for a stock engine: absent, not 0


def test_an_adapter_node_answers_501_for_each_capability_its_engine_lacks(node_factory):
    adapter = node_factory(
        "adapter-501",
        "--engine-url",
        "http://127.0.0.1:9",
        "--enable-faults",
        env={"LIFELINE_AGENT_TOKEN": AGENT, "LIFELINE_FAULT_TOKEN": "fault-token"},
    )
    capabilities = http_json(adapter.address + "/agent/capabilities")[1]
    assert capabilities["offers"] == ["openai", "events", "telemetry"]
    assert capabilities["cannot"] == {name: c.does for name, c in CAPABILITIES.items()}
    for method, path, capability in [
        ("POST", "/agent/kv/batch", "checkpoint"),
        ("GET", "/agent/kv", "checkpoint"),
        ("GET", "/agent/kv/r-1", "checkpoint"),
        ("DELETE", "/agent/kv/r-1", "checkpoint"),
        ("POST", "/agent/requests/r-1/holders", "checkpoint"),
        ("POST", "/agent/requests/r-1/migrate", "migrate"),
        ("POST", "/agent/assist", "assist"),
        ("DELETE", "/agent/assist", "assist"),
        ("POST", "/agent/draft", "draft"),
        ("POST", "/agent/reload", "reload"),
        ("GET", "/agent/config", "config"),
        ("POST", "/agent/reset", "reset"),
        ("POST", "/agent/faults", "faults"),
        ("GET", "/agent/faults", "faults"),
    ]:
        status, answer = http_json(
            adapter.address + path, data={} if method == "POST" else None, method=method, headers=AGENT_HEAD
        )
        assert status == 501, (path, answer)
        error = answer["error"]
        assert error["type"] == "not_implemented" and set(error) == {"message", "type", "param", "code"}
        assert f"cannot {CAPABILITIES[capability].does}: it does not offer `{capability}`" in error["message"]
        assert "/agent/capabilities" in error["message"]
    body = {"model": "Qwen3-32B", "prompt": "x", "lifeline": {"checkpoint_prefill_chunks": True}}
    status, answer = http_json(adapter.address + "/v1/completions", data=body)
    assert status == 501 and "`checkpoint`" in answer["error"]["message"] and answer["error"]["param"] == "lifeline"


# --- a stock engine: no token ids ----------------------------------------------------------------


def stock_engine_app(chunks: list[dict | str], bodies: list[dict]) -> web.Application:
    """An OpenAI-compatible engine that streams the given chunks, as a stock server does (no token ids)."""

    async def stream(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n".encode())
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    app.router.add_post("/v1/completions", stream)
    return app


@pytest.fixture
async def stock_engine():
    """A stock engine with an adapter in front: `await stock_engine(chunks)` starts one that streams
    `chunks` to every request, and returns the adapter and the list of bodies the engine is sent."""
    runners, engines = [], []

    async def start(chunks):
        bodies = []
        runner = web.AppRunner(stock_engine_app(chunks, bodies))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]
        engine = AdapterEngine(
            f"http://127.0.0.1:{port}", catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1), "adapter-unit"
        )
        engine.start()
        engines.append(engine)
        return engine, bodies

    yield start
    for engine in engines:
        await engine.stop()
    for runner in runners:
        await runner.cleanup()


async def events_of(seq) -> tuple[list[TokenEvent], FinishEvent]:
    tokens = []
    while not isinstance(event := await asyncio.wait_for(seq.events.get(), 5), FinishEvent):
        tokens.append(event)
    return tokens, event


def chat_chunk(delta: dict, finish: str | None = None) -> dict:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


async def test_a_stock_engines_stream_becomes_token_events_with_the_ids_unknown(stock_engine):
    engine, bodies = await stock_engine(
        [
            chat_chunk({"role": "assistant", "content": ""}),  # the role alone: no token
            chat_chunk({"content": "Hello"}),
            chat_chunk({"content": " there"}),
            chat_chunk({"content": "!"}, finish="stop"),
            {
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
            },
            "[DONE]",
        ]
    )
    body = {
        "model": "Qwen3-32B",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "lifeline": {"request_id": "chat-1"},
    }
    seq = await engine.submit_request(parse(body, "chat", 4096))
    tokens, finish = await events_of(seq)
    assert [(t.index, t.token_id, t.text) for t in tokens] == [(0, None, "Hello"), (1, None, " there"), (2, None, "!")]
    assert (finish.reason, finish.prompt_tokens, finish.completion_tokens) == ("stop", 9, 3)  # the engine's own counts
    assert engine.by_id == {} and seq.finished == "stop"
    [sent] = bodies
    assert (
        sent["stream"] is True
        and sent["return_token_ids"] is True
        and sent["stream_options"] == {"include_usage": True}
    )
    assert "lifeline" not in sent and sent["messages"] == body["messages"]


async def test_an_engine_failing_mid_stream_ends_the_request_with_an_error(stock_engine):
    engine, _ = await stock_engine(
        [
            {
                "object": "text_completion",
                "choices": [{"index": 0, "text": "partial", "logprobs": None, "finish_reason": None}],
            },
            {
                "error": {
                    "message": "CUDA error: an illegal memory access",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            },
        ]
    )
    seq = await engine.submit_request(
        parse({"model": "Qwen3-32B", "prompt": "fail me", "max_tokens": 8}, "completion", 4096)
    )
    tokens, finish = await events_of(seq)
    assert [t.text for t in tokens] == ["partial"]
    assert finish.reason == "error" and "illegal memory access" in finish.detail["reason"]
    assert engine.counters["engine_errors"] == 1
