"""A lost node's checkpoints of requests running elsewhere are re-placed after its own requests stream again.

Re-placing makes every serving node resend every block of those requests to a
new holder. Done the moment the node was lost, that burst competed with the
moves of the node's own requests, whose clients are waiting (benchmarks/README.md,
"sim_validation"); it only guards against a second failure, so it waits for them,
for at most recovery.REPLACE_HOLDERS_WITHIN_S. The simulator does the same
(tests/recovery/sim/test_replay.py replays one log through both).
"""

import asyncio

import pytest

from recovery.gateway.coordinator import Coordinator, Flight
from recovery.gateway.table import RoutingView
from recovery.policy import recovery
from recovery.protocol import ClusterConfig, Route

MODEL = "Qwen3-32B"


class Signals:
    def __init__(self):
        self.emitted = []

    def emit(self, kind, **data):
        self.emitted.append((kind, data))


def coordinator() -> tuple[Coordinator, list[tuple[str, str, list[str]]]]:
    view = RoutingView("redis://127.0.0.1:1/0", "unused")  # never connected: the routes are set here
    view.config = ClusterConfig(placement_policy="load_aware")
    view.routes = {
        name: Route(name, f"http://{name}", MODEL, rack, 1.0, "H100-SXM", 2, "s1")
        for name, rack in (("a", "rack-a"), ("b", "rack-a"), ("s", "rack-b"), ("t", "rack-b"))
    }
    co = Coordinator(view, Signals(), "gw-test", {})
    for name in view.routes:
        co.watcher._update(name, {"at": 1.0, "checkpoint_budget_bytes": 10**11})
    co.fleet.rebuild()
    asked = []

    async def set_holders(flight, serving, lost, holders):
        asked.append((flight.request_id, lost, [h.name for h in holders]))
        flight.holders = tuple(h.name for h in holders)

    co._set_holders = set_holders
    return co, asked


def flight(request_id: str, node: str, holders: tuple[str, ...]) -> Flight:
    f = Flight(request_id, "acme", "standard", MODEL, 600, 200, node=node, holders=holders)
    f.generated = [7] * 40  # under way: a lost node's request is planned, not picked afresh
    return f


async def turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_the_lost_nodes_other_checkpoints_wait_until_its_own_requests_stream_again():
    co, asked = coordinator()
    mine = [flight("r1", "a", ("s",)), flight("r2", "a", ("t",))]
    elsewhere = flight("r3", "s", ("a",))  # its only checkpoint was on the node that died
    for f in (*mine, elsewhere):
        assert co.admit(f)
    co.node_lost("a", "status stream broke", 1.0)
    await turns()
    assert asked == []  # r1 and r2 wait for their moves: no node resends anything yet
    mine[0].node = "b"
    co.streams_on(mine[0])  # r1's first token from b
    await turns()
    assert asked == []  # r2 still waits
    co.finished(mine[1])  # r2 is over (it ended, or its client left)
    await turns()
    assert asked == [("r3", "a", [asked[0][2][0]])]
    assert asked[0][2][0] not in ("a", "s")  # a live holder, not the node that serves it
    assert elsewhere.holders == tuple(asked[0][2])
    co.streams_on(mine[1])  # late news changes nothing: done once
    await turns()
    assert len(asked) == 1


async def test_they_are_re_placed_anyway_when_the_moves_take_too_long(monkeypatch):
    monkeypatch.setattr(recovery, "REPLACE_HOLDERS_WITHIN_S", 0.05)
    co, asked = coordinator()
    for f in (flight("r1", "a", ("s",)), flight("r3", "s", ("a",))):
        co.admit(f)
    co.node_lost("a", "status stream broke", 1.0)
    await turns()
    assert asked == []
    await asyncio.sleep(0.1)  # r1 never streamed again (no node could take it, say)
    assert [(rid, lost) for rid, lost, _ in asked] == [("r3", "a")]


async def test_a_lost_node_that_served_nothing_has_its_checkpoints_re_placed_at_once():
    co, asked = coordinator()
    co.admit(flight("r3", "s", ("a",)))
    co.node_lost("a", "status stream broke", 1.0)
    await turns()
    assert [(rid, lost) for rid, lost, _ in asked] == [("r3", "a")]


@pytest.mark.parametrize("losses", [1, 2])
async def test_a_second_loss_of_the_same_node_is_waited_for_afresh(losses, monkeypatch):
    """A timer left from an earlier loss of the node does not re-place for the later one early."""
    monkeypatch.setattr(recovery, "REPLACE_HOLDERS_WITHIN_S", 0.05)
    co, asked = coordinator()
    co.admit(flight("r1", "a", ("s",)))
    co.admit(flight("r3", "s", ("a",)))
    co.node_lost("a", "status stream broke", 1.0)
    if losses == 2:
        co._node_back("a")
        await asyncio.sleep(0.03)
        co.admit(flight("r4", "a", ("t",)))
        co.node_lost("a", "status stream broke", 2.0)
        await asyncio.sleep(0.03)  # the first loss's timer has run out, the second's has not
        assert asked == []
    await asyncio.sleep(0.06)
    assert [(rid, lost) for rid, lost, _ in asked] == [("r3", "a")]  # once, for the loss still waited for
    assert co._replacing == {}
