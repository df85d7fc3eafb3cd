"""The gateway in front of real node processes: keys, round-robin, streaming, failover."""

import asyncio
import hashlib
import json
import os

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from recovery.gateway.app import GatewayConfig, build_app
from recovery.keys import Keys

KEY = "llk_test-key-for-the-gateway"
FAST = ("--time-scale", "0.05")


@pytest.fixture
def keys():
    import redis

    client = redis.Redis.from_url(os.environ["REDIS_URL"], decode_responses=True)
    k = Keys(os.environ["LIFELINE_NAMESPACE"] + "-gw")
    yield client, k
    for name in client.scan_iter(match=k.namespace + ":*"):
        client.delete(name)


def publish(client, k: Keys, nodes: dict):
    client.delete(k.routing)
    if nodes:
        client.hset(k.routing, mapping={name: json.dumps({"address": n.address, "model": "Qwen3-32B", "rack": "r", "weight": 1.0}) for name, n in nodes.items()})
    client.hset(k.gateway_keys, hashlib.sha256(KEY.encode()).hexdigest(), json.dumps({"id": 1, "tenant": "acme", "tier": "standard"}))
    client.publish(k.routing_changed, "1")


@pytest.fixture
async def gateway(keys):
    server = TestServer(build_app(GatewayConfig(redis_url=os.environ["REDIS_URL"], namespace=keys[1].namespace)), host="127.0.0.1")
    await server.start_server()
    yield f"http://127.0.0.1:{server.port}"
    await server.close()


async def call(base, body, key=KEY, path="/v1/completions"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session:
        async with session.post(base + path, json=body, headers=headers) as response:
            return response.status, dict(response.headers), await response.text()


async def wait_routes(base, count):
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            async with session.get(base + "/healthz") as response:
                if (await response.json())["nodes"] == count:
                    return
            await asyncio.sleep(0.05)
    raise AssertionError(f"gateway never saw {count} nodes")


BODY = {"model": "Qwen3-32B", "prompt": "route me", "max_tokens": 8, "temperature": 0}


async def test_keys_are_required(gateway, keys, node_factory):
    publish(*keys, {"gw-a": node_factory("gw-a", *FAST)})
    await wait_routes(gateway, 1)
    status, _, text = await call(gateway, BODY, key=None)
    assert status == 401 and "create_api_key" in text
    status, _, _ = await call(gateway, BODY, key="llk_wrong")
    assert status == 401


async def test_round_robin_streams_identical_text_and_names_the_node(gateway, keys, node_factory):
    nodes = {name: node_factory(name, *FAST) for name in ("gw-a", "gw-b")}
    publish(*keys, nodes)
    await wait_routes(gateway, 2)
    served = []
    texts = set()
    for _ in range(4):
        status, headers, text = await call(gateway, {**BODY, "stream": True})
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        served.append(headers["X-Lifeline-Node"])
        texts.add("".join(json.loads(line[6:])["choices"][0]["text"] for line in text.splitlines() if line.startswith("data: {")))
        assert text.rstrip().endswith("data: [DONE]")
    assert served == ["gw-a", "gw-b", "gw-a", "gw-b"]
    assert len(texts) == 1  # the same prompt gives the same text on every node
    status, headers, body = await call(gateway, {**BODY, "model": "Qwen/Qwen3-32B"})  # the full name is an alias
    assert status == 200 and json.loads(body)["model"] == "Qwen3-32B"


async def test_a_dead_node_is_skipped_and_no_node_gives_503(gateway, keys, node_factory):
    nodes = {name: node_factory(name, *FAST) for name in ("gw-a", "gw-b")}
    publish(*keys, nodes)
    await wait_routes(gateway, 2)
    nodes["gw-a"].kill()
    for _ in range(3):
        status, headers, _ = await call(gateway, BODY)
        assert status == 200 and headers["X-Lifeline-Node"] == "gw-b"
    publish(*keys, {})
    await wait_routes(gateway, 0)
    status, headers, text = await call(gateway, BODY)
    assert status == 503 and headers["Retry-After"] == "2" and "try again" in text


async def test_unknown_model_and_bad_body(gateway, keys, node_factory):
    publish(*keys, {"gw-a": node_factory("gw-a", *FAST)})
    await wait_routes(gateway, 1)
    status, _, text = await call(gateway, {**BODY, "model": "gpt-9"})
    assert status == 404 and "gpt-9" in text and "Qwen3-32B" in text
    status, _, text = await call(gateway, {**BODY, "max_tokens": -3})
    assert status == 400 and json.loads(text)["error"]["param"] == "max_tokens"  # the node's own validation, passed through
