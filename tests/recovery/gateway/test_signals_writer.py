"""The gateway's writes to the control plane: one queue, one writer, a batch per round trip, in order (real Redis)."""

import asyncio
import json
import logging
import os

import pytest

from recovery.gateway.signals import Signals
from recovery.protocol import RequestMoved


@pytest.fixture
async def signals(redis_keys, monkeypatch):
    """A gateway's Signals on the real Redis, with the commands of each round trip counted (`sent.round_trips`)."""
    client, keys = redis_keys
    sent = Signals(os.environ["REDIS_URL"], keys.namespace, "gw-writer")
    pipeline = type(sent.redis.pipeline())
    execute, sent.round_trips = pipeline.execute, []

    async def counted(pipe, *args, **kwargs):
        sent.round_trips.append(len(pipe.command_stack))
        return await execute(pipe, *args, **kwargs)

    monkeypatch.setattr(pipeline, "execute", counted)
    yield sent, client, keys
    await sent.close()


async def test_what_a_turn_of_the_loop_queues_goes_out_in_one_round_trip_in_order(signals):
    sent, client, keys = signals
    for i in range(3):
        sent.stream_record(f"r{i}", {"node": "n0", "tenant": "t"})
    sent.outcome(request_id="r0", status="ok")
    sent.stream_over("r0", "ok")
    sent.emit(RequestMoved("r1", "n0", "n1"))
    await sent.flush()
    # 3 records, an outcome, the end of r0 (a delete and a marker) and a signal: 7 commands, 1 round trip
    assert sent.round_trips == [7]
    assert client.get(keys.stream("r0")) is None  # recorded, then ended: in that order
    assert json.loads(client.get(keys.stream_over("r0")))["how"] == "ok"
    assert json.loads(client.get(keys.stream("r2")))["node"] == "n0"
    assert [json.loads(f["data"])["request_id"] for _, f in client.xrange(keys.outcomes)] == ["r0"]
    assert [f["kind"] for _, f in client.xrange(keys.signals)] == ["request_moved"]


async def test_writes_queued_while_a_batch_is_on_its_way_go_in_the_next(signals):
    sent, client, keys = signals
    sent.stream_record("early", {"node": "n0"})
    writer = sent._writer
    await asyncio.sleep(0)  # the writer has taken the first batch and waits on Redis
    sent.stream_record("late", {"node": "n1"})
    await sent.flush()
    assert sent._writer is None and writer.done()
    assert sent.round_trips == [1, 1]
    assert json.loads(client.get(keys.stream("late")))["node"] == "n1"


async def test_a_batch_redis_refuses_is_logged_by_what_it_held_and_later_writes_go_on(signals, caplog):
    sent, client, keys = signals
    good = sent.redis
    sent.redis = type(good).from_url("redis://127.0.0.1:1/0")  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="recovery.gateway.signals"):
        sent.stream_record("lost-1", {"node": "n0"})
        sent.outcome(request_id="lost-1", status="ok")
        await sent.flush()  # never raises: writing never fails a request
    assert "lost 2 write(s) to the control plane" in caplog.text
    assert "the stream record of lost-1" in caplog.text and "an outcomes entry" in caplog.text
    await sent.redis.aclose()
    sent.redis = good
    sent.stream_record("kept", {"node": "n0"})
    await sent.flush()
    assert client.get(keys.stream("kept")) is not None
