"""A second checkpoint copy only from a holder's spare room: first copies of later requests keep the rest."""

from recovery.gateway.coordinator import Coordinator, Flight
from recovery.gateway.table import RoutingView
from recovery.policy.placement import SECOND_COPY_SHARE, HolderCandidate, place, second_copy_fits
from recovery.protocol import ClusterConfig, Route
from recovery.sim import scenario as scenarios
from recovery.sim.fleet import Simulation
from recovery.sim.workload import Request

GB = 10**9


def test_a_second_copy_fits_only_within_the_share_of_the_budget():
    assert second_copy_fits(0, 100 * GB, int(SECOND_COPY_SHARE * 100 * GB))
    assert not second_copy_fits(1, 100 * GB, int(SECOND_COPY_SHARE * 100 * GB))


def test_a_holder_past_the_share_takes_a_first_copy_but_no_second():
    busy = HolderCandidate("b", "rack-b", 0.0, 60 * GB, 100 * GB)  # least loaded, but its budget is 60 % full
    calm = HolderCandidate("c", "rack-b", 5.0, 10 * GB, 100 * GB)
    near = HolderCandidate("a", "rack-a", 1.0, 0, 100 * GB)
    # The busy node is still everyone's first choice for a first copy (it fits, eq. 5).
    assert place("load_aware", "s", [busy, calm, near], GB, 4000) == ("b",)
    # Lifeline's second copy for a long prefix skips it for the next node with spare room.
    assert place("lifeline", "s", [busy, calm, near], GB, 4000) == ("b", "a")
    full_near = HolderCandidate("a", "rack-a", 1.0, 55 * GB, 100 * GB)
    assert place("lifeline", "s", [busy, calm, full_near], GB, 4000) == ("b", "c")
    assert place("lifeline", "s", [busy, full_near], GB, 4000) == ("b",)  # no spare room anywhere: one copy


def route(name, rack):
    return Route(name, f"http://{name}", "Qwen3-32B", rack, 1.0, "H100-SXM", 2, "s1")


async def test_the_gateway_asks_for_a_second_holder_only_where_there_is_spare_room():
    view = RoutingView("redis://127.0.0.1:1/0", "unused")
    view.config = ClusterConfig(placement_policy="lifeline", tau_tokens=512)
    view.routes = {
        r.name: r for r in (route("s", "rack-a"), route("h", "rack-a"), route("x", "rack-b"), route("y", "rack-b"))
    }
    co = Coordinator(view, None, "gw-test", {})
    # x is the least loaded node in the other rack (L̂: y's queue is long), but x's budget is 55 % full.
    for name, held, waiting in (("s", 0, 0), ("h", 0, 0), ("x", 55 * GB, 0), ("y", 10 * GB, 50_000)):
        status = {"at": 1.0, "checkpoint_budget_bytes": 100 * GB, "checkpoint_bytes_held": held, "waiting": waiting}
        co.watcher._update(name, status)
    co.fleet.rebuild()
    asked = []

    async def set_holders(flight, serving, reason, holders):
        asked.append([h.name for h in holders])

    co._set_holders = set_holders
    flight = Flight("r1", "acme", "premium", "Qwen3-32B", 600, 400, node="s", holders=("h",))
    await co.add_second_holder(flight)
    assert co.l_hat("x") < co.l_hat("y")
    assert asked == [["h", "y"]]
    co.watcher._update("y", {"at": 2.0, "checkpoint_budget_bytes": 100 * GB, "checkpoint_bytes_held": 60 * GB})
    asked.clear()
    await co.add_second_holder(Flight("r2", "acme", "premium", "Qwen3-32B", 600, 400, node="s", holders=("h",)))
    assert asked == []  # nowhere has spare room: the request keeps its one copy


def test_the_simulator_applies_the_same_rule():
    scenario = scenarios.parse(
        {
            "duration_s": 10,
            "fleet": [
                {"name": "a", "count": 2, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2, "rack": "r1"},
                {"name": "b", "count": 2, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2, "rack": "r2"},
            ],
            "workload": {"rate_rps": 1},
            "faults": {"per_1000_node_days": 0},
        }
    )
    request = Request(arrival_s=0.0, model="Qwen3-32B", prompt_tokens=400, output_tokens=300)
    sim = Simulation(scenario, "lifeline", 1, requests=[request])
    for node in sim.nodes.values():  # every node's checkpoint budget already more than half full
        node.held_bytes = int(0.6 * node.budget_bytes)
        sim._changed(node)
    sim.run(until=4.0)
    flight = sim.flights[0]
    assert flight.context_tokens > 512 and len(flight.holders) == 1 and flight.second_asked
