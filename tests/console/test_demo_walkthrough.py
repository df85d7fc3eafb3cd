"""The README's degradation walk-through on the demo's default fleet, against the real capacity model, database and
Redis: eight Qwen3-32B nodes at tensor parallel 2 (rack-a on H100, rack-b on H200) and one H200 hot spare; the demo
sets its throughput objective once every node serves. Losing one node is covered by the spare, losing any two shows
level 1, killing any four at once shows level 2 (best-effort traffic gets 429).

The demo used to set its objective while half the fleet had joined (46.9 req/s against 110–125 available), so
killing three nodes left level 0 and the README's walk-through did not happen.
"""

import itertools

import pytest

from console.management.commands.demo import set_demo_objective
from recovery.actions import capacity, nodes
from recovery.choices import NodeState
from recovery.models import Cluster, Node
from recovery.policy import capacity as capacity_policy
from tests.recovery.test_health import configure, register

pytestmark = pytest.mark.django_db

FLEET = [(f"wt-{i + 1:02d}", "rack-a" if i < 4 else "rack-b", "H100-SXM" if i < 4 else "H200-SXM") for i in range(8)]


@pytest.fixture
def demo_fleet(commit):
    configure(degradation_hold_s=30, degradation_margin=0.05, startup_grace_s=0)
    for name, rack, gpu in FLEET:
        commit(register, name, rack=rack, gpu=gpu, tp=2)
    commit(register, "wt-spare", rack="rack-b", gpu="H200-SXM", tp=2, spare=True)


def _level_after_killing(commit, react, killed) -> int:
    for name in killed:
        commit(nodes.transition_node, Node.objects.get(name=name), NodeState.DOWN, "kill -9")
    react()  # the spare is promoted in place of the first one down
    return commit(capacity.evaluate)


def test_the_objective_is_set_from_the_whole_fleet_in_service(commit, demo_fleet):
    assert commit(capacity.evaluate) == 0
    required = commit(set_demo_objective, Cluster.default())
    full = capacity.report(model="Qwen3-32B")
    assert full.in_service == 8  # the spare is not in service, and not counted
    assert required == {"Qwen3-32B": pytest.approx(0.92 * full.capacity_rps, abs=0.05)}
    assert commit(set_demo_objective, Cluster.default()) == {}  # once set (or set by an admin) it is kept
    assert commit(capacity.evaluate) == 0


@pytest.mark.parametrize("killed", [("wt-01",), ("wt-05",)])
def test_losing_one_node_is_covered_by_the_spare(commit, react, demo_fleet, killed):
    commit(set_demo_objective, Cluster.default())
    assert _level_after_killing(commit, react, killed) == 0
    assert not Node.objects.get(name="wt-spare").spare


@pytest.mark.parametrize("killed", [("wt-01", "wt-02"), ("wt-05", "wt-06"), ("wt-01", "wt-08")])
def test_losing_any_two_shows_level_1(commit, react, demo_fleet, killed):
    commit(set_demo_objective, Cluster.default())
    assert _level_after_killing(commit, react, killed) == 1


@pytest.mark.parametrize("killed", [("wt-01", "wt-02", "wt-03", "wt-04"), ("wt-05", "wt-06", "wt-07", "wt-08")])
def test_killing_four_sheds_best_effort(commit, react, demo_fleet, killed):
    commit(set_demo_objective, Cluster.default())
    level = _level_after_killing(commit, react, killed)
    assert level == 2
    assert "best_effort" in capacity_policy.EFFECTS[level].shed_tiers


def test_every_pair_and_every_four_of_the_fleet_holds_the_walkthrough():
    """The same claim for every choice of nodes, on the capacity model alone (no processes): the README does not
    depend on which nodes the reader kills."""
    from workers.catalog import Deployment

    slo = capacity_policy.Slo()
    rps = {
        gpu: capacity_policy.node_capacity(Deployment.of("Qwen3-32B", gpu, 2), slo).rps
        for gpu in ("H100-SXM", "H200-SXM")
    }
    fleet = {name: rps[gpu] for name, _, gpu in FLEET}
    spare = rps["H200-SXM"]
    required = 0.92 * sum(fleet.values())
    for count, level in ((1, 0), (2, 1), (4, 2)):
        for killed in itertools.combinations(fleet, count):
            left = sum(v for n, v in fleet.items() if n not in killed) + spare
            assert capacity_policy.level_for(left / required) == level, (killed, left / required)
