"""recovery.sim.planning: a placement judged by the simulator, per model; and one replica's capacity within its
objectives measured by simulation, for the planner to plan with."""

import statistics

import pytest

from recovery.policy import planner
from recovery.policy.planner import Demand, Replica, Server
from recovery.sim import planning

SERVERS = [Server("h1", "H100-SXM", 8, "rack-1"), Server("a1", "A100-80GB", 8, "rack-2")]


def test_requests_follow_the_rates_and_mean_lengths_and_repeat_under_a_seed():
    demands = [Demand("Llama-3-8B", 20, 800, 100), Demand("Qwen3-32B", 5, 300, 400)]
    requests = planning.requests_for(demands, 200, seed=3)
    assert requests == planning.requests_for(demands, 200, seed=3)
    assert requests != planning.requests_for(demands, 200, seed=4)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    for d in demands:
        mine = [r for r in requests if r.model == d.model]
        assert len(mine) == pytest.approx(d.rate_rps * 200, rel=0.1)
        assert statistics.mean(r.prompt_tokens for r in mine) == pytest.approx(d.prompt_tokens, rel=0.05)
        assert statistics.mean(r.output_tokens for r in mine) == pytest.approx(d.output_tokens, rel=0.05)


def test_an_ample_placement_attains_its_objectives_and_a_starved_one_does_not():
    demands = [Demand("Llama-3-8B", 4, 512, 64), Demand("Qwen3-32B", 6, 512, 64), Demand("Llama-3-70B", 1, 512, 64)]
    assignment = {"h1": (Replica("Llama-3-8B", 4),), "a1": (Replica("Qwen3-32B", 1),)}
    figures = planning.evaluate(SERVERS, assignment, demands, duration_s=30)
    ample, starved, missing = (figures[d.model] for d in demands)
    assert ample.replicas == 1 and ample.gpus == 4 and starved.replicas == 1 and starved.gpus == 1
    assert ample.finished == ample.requests > 0 and ample.attainment >= 0.95
    assert ample.ttft_p99_s < 2.0 and ample.tpot_p99_s < 0.1
    # Qwen3-32B at 6 req/s on one A100: its queue grows far past the TTFT objective.
    assert starved.attainment < ample.attainment and starved.ttft_p99_s > 2.0
    # A model with no replica: its requests are counted, none served.
    assert missing.replicas == 0 and missing.requests > 0 and missing.finished == 0 and missing.attainment == 0


def test_simulated_capacity_is_the_rate_the_replica_serves_within_its_objectives():
    demand = Demand("Llama-3-8B", 1, 512, 64)
    rate = planning.simulated_capacity(demand, "L40S", 1, duration_s=20)
    assert rate > 0
    server, placement = [Server("probe", "L40S", 1)], {"probe": (Replica("Llama-3-8B", 1),)}

    def attainment(rps: float) -> float:
        probe = Demand("Llama-3-8B", rps, 512, 64)
        return planning.evaluate(server, placement, [probe], 20, seed=1)["Llama-3-8B"].attainment

    assert attainment(rate) >= 0.95
    assert attainment(rate * 2) < 0.95
    # The roofline capacity model is the planner's default; the simulated figure is of the same order.
    assert 0.3 < rate / planner.roofline_capacity(demand, "L40S", 1) < 3
    # A model that does not fit has none.
    assert planning.simulated_capacity(Demand("Llama-3-70B", 1), "L40S", 1) == 0


def test_the_planner_plans_with_a_simulated_capacity_table():
    demands = [Demand("Llama-3-8B", 30, 512, 64)]
    table = planning.simulated_capacities(demands, [("L40S", 2)], duration_s=15)
    assert set(table) == {("Llama-3-8B", "L40S", 1), ("Llama-3-8B", "L40S", 2)}
    servers = [Server(f"s{i}", "L40S", 2, f"rack-{i}") for i in range(3)]
    result = planner.plan(servers, demands, capacity=planning.table_capacity(table))
    assert result.capacity_rps["Llama-3-8B"] == pytest.approx(
        sum(table[("Llama-3-8B", "L40S", r.tp)] for rs in result.assignment.values() for r in rs)
    )


def test_a_model_with_no_traffic_yet_is_evaluated_as_such():
    demands = [Demand("Llama-3-8B", 0.0), Demand("Qwen3-32B", 2.0, 256, 32)]
    assignment = {"h1": (Replica("Llama-3-8B", 4), Replica("Qwen3-32B", 4)), "a1": ()}
    figures = planning.evaluate(SERVERS, assignment, demands, duration_s=10)
    assert figures["Llama-3-8B"].requests == 0 and figures["Llama-3-8B"].attainment == 1.0
    assert figures["Qwen3-32B"].requests > 0 and figures["Qwen3-32B"].attainment == 1.0
    idle = planning.evaluate(SERVERS, assignment, [Demand("Llama-3-8B", 0.0)], duration_s=10)
    assert idle["Llama-3-8B"].requests == 0
