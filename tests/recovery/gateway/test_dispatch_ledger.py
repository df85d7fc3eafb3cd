"""Issue 17 (hardening): the gateway's dispatch ledger never leaks a request whose arrival event was lost.

The gateway counts a request on its node at dispatch and stops when the node's
status counts it (document 002). A node drops a slow subscriber's oldest
statuses; the arrival event may be among them. The next status that subscriber
gets is a full one, naming the requests the node has and those it finished
lately, and the gateway settles its ledger from it.
"""

import asyncio
import os

import pytest

from recovery.gateway.table import RoutingView
from recovery.gateway.watch import NodeWatcher
from workers import catalog, tokens
from workers.engine import Engine
from workers.engine_api import EngineConfig, FinishEvent, SamplingParams
from workers.status_feed import StatusFeed

FAST = 0.02


@pytest.fixture
async def watcher():
    view = RoutingView(os.environ["REDIS_URL"], "ledger-test")
    yield NodeWatcher(view, on_lost=lambda *args: None)
    await view.redis.aclose()


def status(reason: str, seq: int, **extra) -> dict:
    return {"seq": seq, "at": 1000.0 + seq, "running": 1, "reason": reason, **extra}


def outstanding(watcher: NodeWatcher, node: str) -> tuple[int, int, dict]:
    pending = watcher.pending_for(node)
    return pending.requests, pending.prompt_tokens, dict(watcher._ledger.get(node, {}))


async def test_the_arrival_event_settles_the_ledger(watcher):
    watcher.dispatched("n1", "r1", 500)
    assert outstanding(watcher, "n1") == (1, 500, {"r1": 500})
    watcher._update("n1", status("tokens", 1))  # another request's step: r1 still counted here
    assert outstanding(watcher, "n1")[0] == 1
    watcher._update("n1", status("arrival", 2, request_id="r1"))
    assert outstanding(watcher, "n1") == (0, 0, {})


async def test_a_lost_arrival_is_settled_by_the_next_full_status(watcher):
    watcher.dispatched("n1", "r1", 500)
    watcher.dispatched("n1", "r2", 300)
    watcher.dispatched("n1", "r3", 200)  # still on its way to the node: stays counted
    # r1's and r2's arrivals were dropped with the node's older statuses; r2 finished meanwhile.
    watcher._update("n1", status("tokens", 40, requests=["r1", "other"], finished=["r2", "older"]))
    assert outstanding(watcher, "n1") == (1, 200, {"r3": 200})
    watcher._update("n1", status("arrival", 41, request_id="r3"))
    assert outstanding(watcher, "n1") == (0, 0, {})


async def test_any_later_event_naming_the_request_settles_it(watcher):
    watcher.dispatched("n1", "r1", 500)
    watcher._update("n1", status("finished", 7, request_id="r1"))  # its arrival was dropped, its end was not
    assert outstanding(watcher, "n1") == (0, 0, {})


async def test_a_full_status_of_another_node_settles_nothing_here(watcher):
    watcher.dispatched("n1", "r1", 500)
    watcher._update("n2", status("tokens", 3, requests=["r1"], finished=[]))
    assert outstanding(watcher, "n1") == (1, 500, {"r1": 500})


async def test_a_real_engine_whose_subscriber_overflows_leaks_nothing_into_the_ledger(watcher):
    """The emulated engine, a subscriber that reads nothing until its queue has overflowed many times over: the
    statuses it finally reads settle every request dispatched to the node, the first one's arrival long gone."""
    config = EngineConfig(time_scale=FAST, status_every_steps=1)
    engine = Engine(catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1), config)
    engine.start()
    try:
        queue = engine.subscribe()
        params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
        watcher.dispatched("n1", "long", 50)
        watcher.dispatched("n1", "short", 10)
        long = engine.submit(tokens.encode("a long answer " * 4), params, "long")
        short = engine.submit(tokens.encode("a short one"), SamplingParams(max_tokens=3, temperature=0.0), "short")
        while not isinstance(await asyncio.wait_for(short.events.get(), 10), FinishEvent):
            pass
        for _ in range(2 * queue.maxsize):  # far past a full queue: the arrivals and the short one's end are dropped
            await asyncio.wait_for(long.events.get(), 10)
        read = []
        while not queue.empty():
            read.append(queue.get_nowait())
        reasons = [s["reason"] for s in read]
        assert len(read) == queue.maxsize and "arrival" not in reasons  # the overflow really dropped them
        for data in read:
            watcher._update("n1", data)
        assert outstanding(watcher, "n1") == (0, 0, {})  # "long" runs, "short" is over: neither counted here
        assert "long" in read[-1]["requests"] and "short" in read[-1]["finished"]
    finally:
        await engine.stop()


def test_a_new_subscriber_gets_a_full_status_first_and_a_caught_up_one_plain_statuses():
    feed = StatusFeed(queue_size=2)
    queue = feed.subscribe()
    feed.publish({"reason": "a"}, ["r1"])
    feed.publish({"reason": "b"}, ["r1"])
    assert queue.get_nowait() == {"reason": "a", "requests": ["r1"], "finished": []}
    assert queue.get_nowait() == {"reason": "b"}
    feed.publish({"reason": "c"}, ["r1"])
    feed.publish({"reason": "d"}, ["r1"])
    feed.finished("r1")
    feed.publish({"reason": "e"}, [])  # the queue was full: "c" is dropped, "e" comes full
    full = {"reason": "e", "requests": [], "finished": ["r1"]}
    assert [queue.get_nowait() for _ in range(2)] == [{"reason": "d"}, full]
    assert feed.dropped == 1
