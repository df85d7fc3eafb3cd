"""A gateway that starts beside a starting fleet (issue 18): addresses left from a previous run are unreachable, not
failed nodes, and a request no node can take yet waits for one, or gets a 503 that says the fleet is starting."""

import asyncio
import json
import socket
import time

import pytest

from recovery.gateway import coordinator
from tests.gateway_cluster import KEY, gw

pytestmark = pytest.mark.asyncio

CHAT = {"model": "Qwen3-32B", "messages": [{"role": "user", "content": "hello after a restart"}], "max_tokens": 4}


def _dead_address() -> str:
    """An address nobody listens on: a node of the previous run, gone."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _route_of_a_previous_run(cluster, name: str, address: str, session: str = "previous-run") -> None:
    route = {"address": address, "model": "Qwen3-32B", "rack": "rack-a", "gpu": "H100-SXM", "tp": 1, "weight": 1.0}
    cluster.client.hset(cluster.keys.routing, name, json.dumps({**route, "session": session}))
    cluster.client.publish(cluster.keys.routing_changed, "1")


async def test_a_request_waits_for_the_node_that_joins_and_the_old_address_is_no_failure(cluster):
    cluster.config["starting_until"] = time.time() + 60
    cluster.publish()
    _route_of_a_previous_run(cluster, "st-a", _dead_address())
    base = await cluster.gateway()
    await cluster.until(base, lambda h: "st-a" in h["weights"], "routing the previous run's st-a")

    request = asyncio.create_task(
        gw(base + "/v1/chat/completions", data=CHAT, headers={"Authorization": f"Bearer {KEY}"})
    )
    await asyncio.sleep(1.5)  # the gateway dials the old address again and again meanwhile
    assert not request.done()
    cluster.start_nodes("st-a")  # the node comes back with a new session and address
    status, answer = await request
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"]

    await cluster.flushed()
    assert cluster.signals("symptom") == []  # the previous run's address was never reported as a failure
    health = await cluster.until(base, lambda h: h["watching"] == ["st-a"], "watching the new st-a")
    assert health["degradation_level"] == 0


async def test_with_no_node_ready_the_503_says_the_fleet_is_starting(cluster, monkeypatch):
    monkeypatch.setattr(coordinator, "JOIN_WAIT_S", 1.0)
    cluster.config["starting_until"] = time.time() + 60
    cluster.publish()
    _route_of_a_previous_run(cluster, "st-b", _dead_address())
    base = await cluster.gateway()
    await cluster.until(base, lambda h: "st-b" in h["weights"], "routing the previous run's st-b")

    started = time.monotonic()
    status, answer = await gw(base + "/v1/chat/completions", data=CHAT, headers={"Authorization": f"Bearer {KEY}"})
    assert status == 503 and time.monotonic() - started >= 1.0  # it waited for a node first
    message = answer["error"]["message"]
    assert "the fleet is starting" in message and "st-b" in message and "have not answered" in message
    await cluster.flushed()
    assert cluster.signals("symptom") == []


async def test_a_node_that_answered_and_then_died_is_lost_at_once(cluster):
    (node,) = cluster.start_nodes("st-c")
    base = await cluster.gateway()
    node.kill()
    health = await cluster.until(base, lambda h: "st-c" in h["lost"], "losing st-c")
    assert health["lost"] == ["st-c"]
    await cluster.flushed()
    assert [s["node"] for s in cluster.signals("symptom")] == ["st-c"]
