"""Issue 11, "stays live at 256 nodes": heartbeats' figures reach the browser as one channel-layer message per interval
carrying every node's latest figures, while a node's state change is published at once, never held by that interval."""

import asyncio
import time
import uuid

import pytest
from channels.layers import get_channel_layer

from recovery import events
from recovery.actions import nodes
from recovery.events import CLUSTER_GROUP
from recovery.models import Node
from workers.protocol import Heartbeat, Load, Registration

pytestmark = pytest.mark.django_db

INTERVAL_S = 2.0  # longer than the beats below take on a busy machine, so that they all fall in one interval


@pytest.fixture
def publisher(monkeypatch):
    """A load publisher of the test's own (its own thread, nothing kept from earlier tests), at INTERVAL_S."""
    monkeypatch.setattr(events, "LOAD_PUBLISH_INTERVAL_S", INTERVAL_S)
    monkeypatch.setattr(events, "loads", events.LoadPublisher())


@pytest.fixture
def cluster_group():
    """What the cluster page's sockets hear: receive(timeout) the next message, or None. One event loop throughout,
    as a consumer's: a receive that timed out leaves the layer's buffer bound to its loop."""
    layer = get_channel_layer()
    loop = asyncio.new_event_loop()
    channel = loop.run_until_complete(layer.new_channel())
    loop.run_until_complete(layer.group_add(CLUSTER_GROUP, channel))

    async def next_message(timeout_s):
        try:
            return await asyncio.wait_for(layer.receive(channel), timeout_s)
        except TimeoutError:
            return None

    yield lambda timeout_s=5: loop.run_until_complete(next_message(timeout_s))
    loop.run_until_complete(layer.group_discard(CLUSTER_GROUP, channel))
    loop.close()


def register(name: str) -> Registration:
    reg = Registration.parse(
        {
            "name": name,
            "session": uuid.uuid4().hex,
            "address": "http://127.0.0.1:9100",
            "rack": "rack-a",
            "model": "Qwen3-32B",
            "gpu": "H100-SXM",
            "tp": 1,
            "pid": 77,
            "host": "h",
            "gpus": [{"index": 0, "uuid": f"GPU-{name}", "name": "H100", "memory_bytes": 80 * 10**9}],
        }
    )
    nodes.register_node(reg)
    return reg


def test_many_heartbeats_make_one_message_and_a_state_change_goes_at_once(publisher, cluster_group, commit):
    names = [f"node-{i}" for i in range(8)]
    sessions = {name: commit(register, name).session for name in names}
    joined = [cluster_group() for _ in names]
    assert {m["type"] for m in joined} == {"node.changed"}

    started = time.monotonic()
    for round_ in range(4):
        for i, name in enumerate(names):
            model_state = "serving" if (name == "node-5" and round_ >= 2) else "loading_full"
            beat = Heartbeat(
                session=sessions[name], model_state=model_state, load=Load(running=10 * round_ + i, waiting=round_)
            )
            state = commit(nodes.record_heartbeat, name, beat)
            assert state == ("serving" if name == "node-5" and round_ >= 2 else "join")
    beating_s = time.monotonic() - started
    assert beating_s < INTERVAL_S / 2, f"the beats took {beating_s:.2f} s: this machine is too busy for the test"

    # node-5's SERVING went out at once, ahead of the figures of the beats before it, which wait for the interval.
    changed = cluster_group(timeout_s=INTERVAL_S / 2)
    assert changed == {"type": "node.changed", "id": Node.objects.get(name="node-5").pk}

    # Then one message for the 32 beats, with each node's latest figures (from the fourth round).
    message = cluster_group(timeout_s=3 * INTERVAL_S)
    assert message["type"] == "node.loads"
    figures = {entry["name"]: entry for entry in message["nodes"]}
    assert sorted(figures) == names and len(message["nodes"]) == len(names)
    for i, name in enumerate(names):
        assert (figures[name]["running"], figures[name]["waiting"]) == (30 + i, 3)
    assert figures["node-5"]["model_state"] == "serving" and figures["node-0"]["model_state"] == "loading_full"
    assert cluster_group(timeout_s=0.3) is None  # nothing else: no message per heartbeat

    # The next beats are published on their own, in the next interval's message.
    beat = Heartbeat(session=sessions["node-3"], model_state="loading_full", load=Load(running=99))
    commit(nodes.record_heartbeat, "node-3", beat)
    message = cluster_group(timeout_s=3 * INTERVAL_S)
    assert message["type"] == "node.loads" and [(n["name"], n["running"]) for n in message["nodes"]] == [("node-3", 99)]
