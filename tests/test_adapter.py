"""A node fronting a real engine, tested against our own emulated node serving as the engine."""

import asyncio

import aiohttp

from tests.helpers import http_json, wait_for
from workers.adapter import parse_vllm_metrics


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
            async with session.post(adapter.address + "/v1/completions", json={**body, "max_tokens": 100, "stream": True}) as response:
                assert response.headers["X-Lifeline-Node"] == "adapter-1"
                return [raw async for raw in response.content if raw.startswith(b"data: {")]

    task = asyncio.create_task(long_stream())
    running = await asyncio.to_thread(wait_for, lambda: http_json(adapter.address + "/agent/status")[1]["load"]["running"] == 1, 5, 0.05, "running 1")
    assert running
    load = http_json(adapter.address + "/agent/status")[1]["load"]
    assert load["source"] == "engine_metrics" and load["uncomputed_prefill_tokens"] is None and load["step_ms"] is None  # n/a, not 0
    assert len(await task) == 101  # 100 tokens and the finish chunk

    status, answer = http_json(adapter.address + "/v1/completions", data={**body, "lifeline": {"resume": {"generated_token_ids": [1, 2]}}})
    assert status == 501 and "resume a request from a checkpoint" in answer["error"]["message"]
    status, answer = http_json(adapter.address + "/v1/completions", data={**body, "lifeline": {"holders": [{"name": "x", "address": "http://x:1"}]}})
    assert status == 501 and answer["error"]["param"] == "lifeline"
    assert http_json(adapter.address + "/agent/requests/a-1/migrate", data={})[0] == 501
    capabilities = http_json(adapter.address + "/agent/capabilities")[1]
    assert set(capabilities["cannot"]) >= {"checkpoint", "resume", "assist"} and capabilities["engine"] == engine.address

    engine.kill()
    wait_for(lambda: http_json(adapter.address + "/health")[0] == 503, 5, 0.1, "adapter notices the engine is gone")
    status, answer = http_json(adapter.address + "/v1/completions", data=body)
    assert status == 502 and "did not answer" in answer["error"]["message"]
