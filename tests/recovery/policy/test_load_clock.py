"""Issue 17 (hardening): load prediction does not depend on how well a node's clock is set.

A node stamps its status with its own clock; the gateway predicts it forward to its own
`now`. A node whose clock is 30 s off would look 30 s further along (or not started) in
its prefill. The gateway dates each status on its own clock (`ClockOffset`), so a node
off by +/-30 s is predicted, and routed to, exactly as one whose clock is right.
"""

import os

import pytest

from recovery.gateway.table import RoutingView
from recovery.gateway.watch import NodeWatcher
from recovery.policy import load
from workers.catalog import Deployment

DEPLOYMENT = Deployment.of("Qwen3-32B", "H100-SXM", 1)
SKEWS = (-30.0, 30.0)


def test_a_status_is_dated_on_the_receivers_clock_whatever_the_senders():
    # (taken, received) on the gateway's clock: trips of a millisecond, one status held back 0.4 s in a queue
    trips = [(100.0, 100.001), (100.2, 100.2012), (100.3, 100.7), (100.5, 100.5011)]
    right = load.ClockOffset()
    dated_right = [right.observe(taken, received) for taken, received in trips]
    for skew in SKEWS:
        off = load.ClockOffset()
        dated = [off.observe(taken + skew, received) for taken, received in trips]
        assert dated == pytest.approx(dated_right, abs=1e-9)
        assert off.offset == pytest.approx(-skew + 0.001, abs=1e-9)
    assert dated_right[2] == pytest.approx(100.301)  # the held-back status keeps the time it was taken


def test_the_offset_follows_a_clock_that_is_stepped():
    clock = load.ClockOffset(window=4)
    for i in range(4):
        clock.observe(100.0 + i - 30.0, 100.0 + i)  # 30 s behind
    for i in range(4, 9):
        clock.observe(100.0 + i, 100.0 + i)  # set right (NTP): within the window, the old offset is gone
    assert clock.offset == pytest.approx(0.0)


# --- through the gateway's watcher, as statuses come off the wire -----------------------------


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def view():
    view = RoutingView(os.environ["REDIS_URL"], "clock-test")
    yield view
    await view.redis.aclose()


PREFILLING = {"running": 1, "uncomputed_prefill_tokens": 20_000, "step_ms": 300.0, "steps": 5}
DECODING = {"running": 8, "decode_batch": 8, "decode_context_tokens": 30_000, "step_ms": 35.0, "steps": 9}


def fed(view, skew: float) -> tuple[NodeWatcher, Clock]:
    """A watcher that got a status from `busy` (its clock `skew` off) and one from `steady` (its clock right), each a
    millisecond after it was taken; it is now half a second after the busy node's status was taken."""
    clock = Clock(0.0)
    watcher = NodeWatcher(view, on_lost=lambda *args: None, clock=clock)
    for second, (name, figures, node_skew) in enumerate([("busy", PREFILLING, skew), ("steady", DECODING, 0.0)]):
        for i in range(3):  # a few statuses, so the offset is measured over more than one
            taken = 1_000.0 + 0.1 * i + 0.01 * second
            clock.now = taken + 0.001
            watcher._update(name, {"seq": i, "at": taken + node_skew, "reason": "tokens", **figures})
    clock.now = 1_000.2 + 0.5
    return watcher, clock


async def test_a_node_with_a_skewed_clock_is_predicted_as_one_with_a_right_clock(view):
    right, clock = fed(view, 0.0)
    expected = load.predict(right.status("busy"), clock(), DEPLOYMENT)
    assert 0 < expected.uncomputed_prefill_tokens < 20_000  # half a second of prefill predicted, not all of it
    for skew in SKEWS:
        watcher, clock = fed(view, skew)
        predicted = load.predict(watcher.status("busy"), clock(), DEPLOYMENT)
        assert predicted.uncomputed_prefill_tokens == expected.uncomputed_prefill_tokens
        assert predicted.decode_context_tokens == expected.decode_context_tokens
        assert predicted.decode_batch == expected.decode_batch


async def test_a_node_with_a_skewed_clock_is_routed_to_as_one_with_a_right_clock(view):
    def choice(watcher, clock):
        candidates = {
            name: (watcher.status(name), watcher.pending_for(name), DEPLOYMENT, 1.0) for name in ("busy", "steady")
        }
        return load.choose_node(candidates, 500, clock())

    right = choice(*fed(view, 0.0))
    assert right == "steady"  # the busy node has seconds of prefill left
    for skew in SKEWS:
        assert choice(*fed(view, skew)) == right
