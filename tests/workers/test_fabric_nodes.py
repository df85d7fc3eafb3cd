"""Real node processes time KV moves over the link between them: NVLink inside a domain, the network when it is down."""

import asyncio

import aiohttp
import pytest

from tests.helpers import http_json, wait_for
from tests.workers.test_node_recovery import HEAD, PROMPT, Stream, body, reference, run, run_until_killed
from workers import catalog

FAULT = "fault-token-for-tests"
ENV = {"LIFELINE_AGENT_TOKEN": HEAD["Authorization"].removeprefix("Bearer "), "LIFELINE_FAULT_TOKEN": FAULT}
KV_PER_TOKEN = catalog.model("Qwen3-32B").kv_bytes_per_token
# Two TP-2 nodes of one NVL72 rack, on different compute trays.
TRAY_1 = ("--tp", "2", "--server", "tray-1", "--nvl-domain", "nvl72-a")
TRAY_2 = ("--tp", "2", "--server", "tray-2", "--nvl-domain", "nvl72-a")


def placed(node, server, nvl_domain="nvl72-a", rack="rack-a"):
    return {"name": node.name, "address": node.address, "rack": rack, "server": server, "nvl_domain": nvl_domain}


@pytest.fixture
def tray_nodes(node_factory):
    def start(name, *flags):
        return node_factory(name, "--time-scale", "0.2", "--enable-faults", *flags, env=ENV)

    return start


async def migrate(source, request_id, target) -> dict:
    """Stream `request_id` from `source`, hand it to `target` after 40 tokens, and return the move's answer."""
    streamed = Stream()

    async def client():
        async with aiohttp.ClientSession() as session:
            async with session.post(source.address + "/v1/completions", json=body(request_id), headers=HEAD) as r:
                await streamed.read(r)

    task = asyncio.create_task(client())
    await asyncio.to_thread(wait_for, lambda: len(streamed.ids) >= 40, 10, 0.01, "40 tokens")
    async with aiohttp.ClientSession() as session:
        url = f"{source.address}/agent/requests/{request_id}/migrate"
        async with session.post(url, json={"target": target}, headers=HEAD) as response:
            assert response.status == 200, await response.text()
            moved = await response.json()
    await task
    return moved


async def test_a_migration_in_one_nvlink_domain_moves_over_nvlink_and_over_infiniband_when_nvlink_is_down(tray_nodes):
    a, b = tray_nodes("fab-a", *TRAY_1), tray_nodes("fab-b", *TRAY_2)
    assert http_json(f"{a.address}/agent/status")[1]["nvl_domain"] == "nvl72-a"
    moved = await migrate(a, "r-nvl", placed(b, "tray-2"))
    assert moved["link"] == "nvlink"
    assert moved["transfer_ms"] == pytest.approx(moved["bytes"] / 900e9 * 1000, abs=1e-3)

    status, _ = http_json(
        a.address + "/agent/faults", data={"kind": "nvlink_down"}, headers={"Authorization": f"Bearer {FAULT}"}
    )
    assert status == 200
    moved = await migrate(a, "r-down", placed(b, "tray-2"))
    # The trays' NVLink is gone: the KV crosses the rack's network instead, at InfiniBand's 50 GB/s.
    assert moved["link"] == "infiniband"
    assert moved["transfer_ms"] == pytest.approx(moved["bytes"] / 50e9 * 1000, abs=1e-3)


async def test_a_resume_fetches_from_a_holder_in_its_nvlink_domain_at_nvlink_speed(tray_nodes):
    a, b, c = tray_nodes("fab-fa"), tray_nodes("fab-fb", *TRAY_1), tray_nodes("fab-fc", *TRAY_2)
    expected = await reference(c)
    holder = placed(b, "tray-1")
    first = await run_until_killed(a, body("r-fetch", holders=[holder]), b, 50, 32 + len(PROMPT.split()))
    second = await run(c.address, body("r-fetch", resume={"generated_token_ids": first.ids, "sources": [holder]}))
    resume = second.extensions[0]["resume"]
    assert resume["method"] == "checkpoint-fetched" and resume["source"] == "fab-fb"
    assert resume["restore_ms"] == pytest.approx(resume["restored_tokens"] * KV_PER_TOKEN / 900e9 * 1000, rel=0.01)
    assert first.ids + second.ids == expected.ids
