"""The simulator's fabric: scenario groups say where their nodes sit, and checkpoint pages take that link's time."""

import pytest

from recovery.sim import scenario as scenarios
from recovery.sim.fleet import Simulation
from recovery.sim.workload import Request
from workers import catalog

MODEL, GPU, TP = "Qwen3-32B", "H100-SXM", 2
LONG = Request(arrival_s=0.0, model=MODEL, prompt_tokens=6000, output_tokens=300)
PER_BLOCK = catalog.model(MODEL).kv_bytes_per_block


def group(name: str, count: int = 1, **fabric) -> dict:
    return {"name": name, "count": count, "model": MODEL, "gpu": GPU, "tp": TP, **fabric}


def make(*groups: dict) -> scenarios.Scenario:
    return scenarios.parse(
        {
            "duration_s": 30,
            "fleet": list(groups),
            "workload": {"rate_rps": 1},
            "faults": {"per_1000_node_days": 0},
        }
    )


def test_a_scenario_without_fabric_fields_places_each_node_alone_on_infiniband():
    node = make(group("a", 2)).nodes[0]
    assert node.placement == catalog.Placement("rack-1")


def test_a_group_places_its_nodes_in_the_fabric():
    nodes = make(
        group("a", 2, rack="r1", server="dgx-1", nvl_domain="dgx-1-nvl", network="roce", nvlink_down=True)
    ).nodes
    assert {n.placement for n in nodes} == {catalog.Placement("r1", "dgx-1", "dgx-1-nvl", "roce", True)}


@pytest.mark.parametrize(
    "fabric, field, allowed",
    [
        ({"network": "ethernet"}, "fleet[0].network", "infiniband, roce"),
        ({"server": " dgx-1"}, "fleet[0].server", "a name"),
        ({"nvl_domain": 72}, "fleet[0].nvl_domain", "a name"),
        ({"nvlink_down": "yes"}, "fleet[0].nvlink_down", "true or false"),
        ({"gpu": "L40S", "model": "Llama-3-8B", "nvl_domain": "d1"}, "fleet[0].nvl_domain", "a GPU with NVLink"),
        ({"nvl_domains": "d1"}, "fleet[0].nvl_domains", ""),
    ],
)
def test_a_bad_fabric_field_is_refused_by_name(fabric, field, allowed):
    with pytest.raises(scenarios.ScenarioError) as refused:
        make({**group("a"), **fabric})
    assert refused.value.field == field and allowed in str(refused.value)


def page_gaps(*groups: dict) -> tuple[str, list[float]]:
    """The serving node and the gaps between the prompt's pages reaching its holder: queued on the serving node's
    link after prefill, one page's transfer time apart."""
    sim = Simulation(make(*groups), "fixed", 1, requests=[LONG], fault_list=[]).run(until=1.5)
    flight = sim.flights[0]
    (arrivals,) = flight.pages.values()
    return flight.node, [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]


@pytest.mark.parametrize(
    "groups, link, share",
    [
        ((group("a", 2),), "infiniband", 1.0),  # one rack, as before
        ((group("a", rack="r1"), group("b", rack="r2")), "infiniband", catalog.LOADED_LINK_FACTOR),  # the spine
        ((group("a", 2, nvl_domain="nvl72-a"),), "nvlink", 1.0),
        ((group("a", rack="r1", nvl_domain="nvl36x2"), group("b", rack="r2", nvl_domain="nvl36x2")), "nvlink", 1.0),
        ((group("a", 2, server="dgx-1", nvl_domain="dgx-1-nvl", nvlink_down=True),), "pcie", 1.0),
    ],
)
def test_checkpoint_pages_take_the_links_time(groups, link, share):
    _, gaps = page_gaps(*groups)
    assert len(gaps) > 100
    assert min(gaps) == pytest.approx(catalog.kv_transfer_s(PER_BLOCK, link, share), rel=1e-6)
