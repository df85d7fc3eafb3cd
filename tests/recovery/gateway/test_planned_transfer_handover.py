"""A planned migration continues its request on the target only once the source has handed the KV over.

The source ends the request's stream at the token boundary and then sends the KV pages to the target,
answering the migrate call when they are there. The relay used to resume the request on the target as soon
as the stream ended: the target often had no pages yet and re-prefilled what was meant to be a transfer
(2 of 20 planned transfers in benchmarks/recovery_kill, and 6 more found their pages only on a second look).
"""

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from recovery.gateway.coordinator import Coordinator, Flight
from recovery.gateway.table import RoutingView
from recovery.protocol import ClusterConfig, Route

NOW = 1_700_000_000.0


class _Signals:
    def emit(self, kind, **data):
        pass


@pytest.fixture
async def source():
    """A source node whose migrate call answers when the test lets it (the pages on their way until then)."""
    state = {"release": asyncio.Event(), "asked": asyncio.Event(), "status": 200}

    async def migrate(request):
        state["asked"].set()
        await state["release"].wait()
        return web.json_response({"request_id": request.match_info["request_id"]}, status=state["status"])

    app = web.Application()
    app.router.add_post("/agent/requests/{request_id}/migrate", migrate)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    state["address"] = f"http://127.0.0.1:{server.port}"
    yield state
    state["release"].set()
    await server.close()


async def migrating(source) -> tuple[Coordinator, Flight, asyncio.Task]:
    view = RoutingView("redis://127.0.0.1:1/0", "unused")  # never connected: the routes are set here
    view.config = ClusterConfig(placement_policy="lifeline")
    view.routes = {
        "src": Route("src", source["address"], "Qwen3-32B", "rack-a", 1.0, "H100-SXM", 1, "s1"),
        "dst": Route("dst", "http://dst", "Qwen3-32B", "rack-a", 1.0, "H100-SXM", 1, "s1"),
    }
    co = Coordinator(view, _Signals(), "gw-test", {})
    co._session = aiohttp.ClientSession()
    for name in view.routes:
        co.watcher._update(name, {"at": NOW, "kv_blocks_total": 1000, "kv_blocks_used": 0})
    co.fleet.rebuild()
    flight = Flight("m1", "acme", "premium", "Qwen3-32B", 2000, 100, node="src")
    assert co.admit(flight)
    command = asyncio.create_task(co.migrate_node("src", "cmd-1"))
    await asyncio.wait_for(source["asked"].wait(), 5)  # the source has the call: the stream ends at the boundary
    return co, flight, command


async def test_the_request_continues_on_the_target_once_the_source_has_answered(source):
    co, flight, command = await migrating(source)
    try:
        move = asyncio.create_task(co.planned_move(flight))
        await asyncio.sleep(0.2)
        assert not move.done(), "resumed on the target while the source was still sending it the KV"
        source["release"].set()
        decision = await asyncio.wait_for(move, 5)
        assert (decision.target, decision.method, decision.source) == ("dst", "restore", "dst")
        assert (await command)["transfer"] == 1
    finally:
        await co._session.close()


async def test_a_handover_that_failed_re_prefills_on_the_target(source):
    source["status"] = 502  # the source could not send the pages
    co, flight, command = await migrating(source)
    try:
        move = asyncio.create_task(co.planned_move(flight))
        source["release"].set()
        decision = await asyncio.wait_for(move, 5)
        assert decision.method == "reprefill" and decision.source is None
        assert (await command)["failed"] == 1
    finally:
        await co._session.close()
