"""The gateway's fleet state: what routing and placement read, kept current by events, not rebuilt per request."""

import pytest

from recovery.gateway.coordinator import Coordinator, Flight
from recovery.gateway.table import RoutingView
from recovery.protocol import ClusterConfig, Route

NOW = 1_700_000_000.0
GB = 10**9


def route(name, rack="rack-a", weight=1.0, model="Qwen3-32B"):
    return Route(name, f"http://{name}", model, rack, weight, "H100-SXM", 2, "s1")


@pytest.fixture
def gateway():
    view = RoutingView("redis://127.0.0.1:1/0", "unused")  # never connected: the routes are set here
    view.config = ClusterConfig(placement_policy="lifeline", tau_tokens=512)
    view.routes = {r.name: r for r in (route("a"), route("b"), route("c", "rack-b"), route("d", "rack-b", weight=0.0))}
    co = Coordinator(view, None, "gw-test", {})
    clock = [NOW]
    co.fleet.clock = lambda: clock[0]
    for name in view.routes:
        status(co, name)
    co.fleet.rebuild()
    return co, clock


def status(co, name, **fields):
    """A status event from `name`, delivered as the watcher delivers it."""
    data = {"at": NOW, "checkpoint_budget_bytes": 100 * GB, **fields}
    co.watcher._update(name, data)


def flight(i, prompt=100):
    return Flight(f"r{i}", "acme", "premium", "Qwen3-32B", prompt, 100)


def test_a_status_event_moves_the_next_pick_without_a_rebuild(gateway):
    co, _ = gateway
    pools = co.fleet.pools
    status(co, "a", decode_batch=40, decode_context_tokens=80_000)
    status(co, "b", decode_batch=40, decode_context_tokens=80_000)
    assert co.choose("Qwen3-32B", 100).name == "c"
    status(co, "c", decode_batch=60, decode_context_tokens=120_000)
    assert co.choose("Qwen3-32B", 100).name in ("a", "b")
    assert co.fleet.pools is pools  # same indexes: only the changed entries moved


def test_a_cordoned_node_is_neither_routed_to_nor_a_holder(gateway):
    co, _ = gateway
    picks = set()
    for i in range(12):
        f = flight(i, prompt=2000)
        r = co.choose("Qwen3-32B", 2000)
        holders = co.place(f, r)
        co.watcher.dispatched(r.name, f.request_id, 2000)
        picks.add(r.name)
        assert "d" not in {h.name for h in holders}
    assert "d" not in picks


def test_placements_count_at_once_and_age_out(gateway):
    co, clock = gateway
    before = co.l_hat("a")
    first = co.place(flight(1), co.view.routes["c"])
    assert [h.name for h in first] == ["a"]  # least L̂, smallest name
    assert co.l_hat("a") > before
    # the next request does not pile onto the same holder: a's L̂ already counts the pages
    assert [h.name for h in co.place(flight(2), co.view.routes["c"])] == ["b"]
    clock[0] += 2.5
    co.fleet.expire(clock[0])
    assert co.l_hat("a") == before


def test_a_lost_node_takes_no_request_and_no_checkpoint_until_it_is_back(gateway):
    co, _ = gateway
    co.failed["a"] = NOW  # as node_lost does, without its follow-up work
    co.fleet.node_changed("a")
    for i in range(6):
        r = co.choose("Qwen3-32B", 100)
        assert r.name != "a"
        assert "a" not in {h.name for h in co.place(flight(i), r)}
    co._node_back("a")
    status(co, "b", decode_batch=50, decode_context_tokens=90_000)
    status(co, "c", decode_batch=50, decode_context_tokens=90_000)
    assert co.choose("Qwen3-32B", 100).name == "a"


def test_a_long_prefix_gets_a_second_holder_in_another_rack(gateway):
    co, _ = gateway
    holders = co.place(flight(1, prompt=2000), co.view.routes["a"])
    assert [h.rack for h in holders] == ["rack-a", "rack-b"]


def test_a_route_change_rebuilds_and_an_unchanged_reload_does_not(gateway):
    co, _ = gateway
    pools = co.fleet.pools
    co.view.routes = dict(co.view.routes)  # a reload with the same routes
    co.fleet.rebuild()
    assert co.fleet.pools is pools
    co.view.routes = {**co.view.routes, "d": route("d", "rack-b", weight=1.0)}  # uncordoned
    co.fleet.rebuild()
    assert co.fleet.pools is not pools
    status(co, "a", decode_batch=60, decode_context_tokens=120_000)
    status(co, "b", decode_batch=60, decode_context_tokens=120_000)
    status(co, "c", decode_batch=60, decode_context_tokens=120_000)
    assert co.choose("Qwen3-32B", 100).name == "d"


async def test_a_planned_migration_to_a_full_target_re_prefills_rather_than_transfers():
    """A target whose status says 0 free KV blocks is full: its KV cannot take a transfer (it was read as empty)."""
    import aiohttp
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    asked = []

    async def migrate(request):
        asked.append(await request.json())
        return web.json_response({"migrated": True})

    app = web.Application()
    app.router.add_post("/agent/requests/{request_id}/migrate", migrate)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        view = RoutingView("redis://127.0.0.1:1/0", "unused")
        view.config = ClusterConfig(placement_policy="none")
        source = Route("src", f"http://127.0.0.1:{server.port}", "Qwen3-32B", "rack-a", 1.0, "H100-SXM", 2, "s1")
        view.routes = {"src": source, "full": route("full")}
        co = Coordinator(view, _Signals(), "gw-test", {})
        co._session = aiohttp.ClientSession()
        for name in view.routes:
            status(co, name, kv_blocks_total=1000, kv_blocks_used=1000 if name == "full" else 0)
        co.fleet.rebuild()
        moving = Flight("m1", "acme", "premium", "Qwen3-32B", 4000, 100, node="src")
        assert co.admit(moving)
        assert co.survivor(view.routes["full"]).free_blocks == 0
        result = await co.migrate_node("src", "cmd-1")
        await co._session.close()
    finally:
        await server.close()
    assert result["reprefill"] == 1 and result["transfer"] == 0
    assert asked == [{"target": view.routes["full"].peer(), "transfer": False}]


class _Signals:
    def __init__(self):
        self.emitted = []

    def emit(self, kind, **data):
        self.emitted.append((kind, data))


async def test_a_real_engines_node_neither_holds_checkpoints_nor_gets_holders_and_only_resumers_continue(gateway):
    co, _ = gateway
    real = Route("v", "http://v", "Qwen3-32B", "rack-b", 1.0, "H100-SXM", 2, "s1", frozenset({"resume"}))
    stock = Route("s", "http://s", "Qwen3-32B", "rack-b", 1.0, "H100-SXM", 2, "s1", frozenset())
    co.view.routes = {**co.view.routes, "v": real, "s": stock}
    for name in ("v", "s"):
        status(co, name, checkpoint_budget_bytes=None)
    co.fleet.rebuild()
    # A request served by the real engine's node gets no holders: it cannot stream its KV pages.
    assert co.place(flight(1), real) == ()
    # Nor is that node, or one offering nothing, ever a holder, however idle it is.
    for i in range(2, 12):
        holders = co.place(flight(i, prompt=2000), co.view.routes["a"])
        assert {h.name for h in holders}.isdisjoint({"v", "s"})
    # A request that must continue elsewhere goes only to a node that can resume it.
    moving = flight(20)
    moving.generated = [1, 2, 3]
    co.flights[moving.request_id] = moving
    for name in ("a", "b", "c"):
        status(co, name, decode_batch=200, decode_context_tokens=400_000)  # the emulated nodes are busy
    targets = set()
    for _ in range(5):
        target, _ = co.route_for(moving, co.redirect(moving, "a"), {"a"})
        targets.add(target.name)
    assert "s" not in targets and targets <= {"b", "c", "v"}
