"""The placement planner (recovery.policy.planner): every plan within the constraints (a property test over random
fleets, workloads and current placements), rack spread, trusted providers, fewest moves, fair shares when the
fleet is short, a clear answer for what cannot be placed, and an answer within its time limit."""

import dataclasses
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recovery.policy import planner
from recovery.policy.planner import Demand, PlanError, Replica, Restriction, Server
from workers import catalog

GPUS = ("H100-SXM", "A100-80GB", "L40S", "RTX-4090", "GH200")
MODELS = ("Llama-3-8B", "Qwen3-14B", "Qwen3-32B", "Llama-3-70B", "Mixtral-8x7B")


def capacity_of(assignment, servers, demand: Demand) -> float:
    by_name = {s.name: s for s in servers}
    return sum(
        planner.roofline_capacity(demand, by_name[name].gpu, r.tp)
        for name, replicas in assignment.items()
        for r in replicas
        if r.model == demand.model
    )


def assert_within_constraints(result, servers, demands, current=None):
    """What every plan must hold to, whatever the solver found."""
    by_name = {s.name: s for s in servers}
    assert set(result.assignment) == set(by_name), "every server is in the plan, and nothing else"
    for name, replicas in result.assignment.items():
        server = by_name[name]
        assert sum(r.tp for r in replicas) <= server.gpus, f"{name} holds more GPUs than it has"
        for r in replicas:
            assert r.tp in catalog.TP_DEGREES and r.tp <= server.gpus
            catalog.Deployment.of(r.model, server.gpu, r.tp)  # memory: weights and KV fit (CatalogError if not)
            if r not in Counter((current or {}).get(name, ())):
                demand = next(d for d in demands if d.model == r.model)
                assert planner.roofline_capacity(demand, server.gpu, r.tp) > 0, f"{r} on {name} serves nothing"
    for d in demands:
        assert result.capacity_rps[d.model] == pytest.approx(capacity_of(result.assignment, servers, d))
        racks = {s.rack for s in servers}
        if len(racks) > 1:
            worst = max(
                capacity_of({n: rs for n, rs in result.assignment.items() if by_name[n].rack == rack}, servers, d)
                for rack in racks
            )
            assert result.after_rack_loss_rps[d.model] == pytest.approx(result.capacity_rps[d.model] - worst)
        for r in d.restrictions:
            trusted = {n: rs for n, rs in result.assignment.items() if r.trusts(by_name[n])}
            key = planner.trust_key(r, d)
            assert result.trusted_rps[key] == pytest.approx(capacity_of(trusted, servers, d))
            if result.trusted_rps[key] < r.rps * (1 - 1e-9):
                assert any(r.tenant in p for p in result.problems), "a short trusted capacity is said"
        if d.rate_rps > 0 and result.capacity_rps[d.model] < d.rate_rps * (1 - 1e-9):
            assert any(d.model in p for p in result.problems), "a model short of capacity is said"
    # Moves are exactly the difference between the current placement and the plan.
    for move in result.moves:
        before = Counter((current or {}).get(move.server, ()))
        after = Counter(result.assignment[move.server])
        assert Counter(move.stop) == before - after and Counter(move.start) == after - before


@st.composite
def fleets(draw):
    count = draw(st.integers(1, 10))
    servers = [
        Server(
            f"s{i}",
            draw(st.sampled_from(GPUS)),
            draw(st.sampled_from((1, 2, 3, 4, 6, 8))),  # the live fleet: a server is the nodes that share it
            f"rack-{draw(st.integers(1, 3))}",
            draw(st.sampled_from(("alpha", "beta"))),
        )
        for i in range(count)
    ]
    models = draw(st.lists(st.sampled_from(MODELS), min_size=1, max_size=3, unique=True))
    demands = []
    for m in models:
        rate = draw(st.floats(0.0, 80.0, allow_nan=False))
        restricted = draw(st.one_of(st.none(), st.floats(0.0, 1.0)))
        restrictions = (Restriction("acme", rate * restricted, frozenset({"alpha"})),) if restricted else ()
        demands.append(
            Demand(m, rate, draw(st.integers(64, 2048)), draw(st.integers(16, 512)), restrictions=restrictions)
        )
    return servers, demands


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets(), st.booleans())
def test_every_plan_holds_to_capacity_memory_tp_rack_and_trust(fleet, replan):
    servers, demands = fleet
    result = planner.plan(servers, demands, time_limit_s=2)
    assert_within_constraints(result, servers, demands)
    if replan:  # a second plan from the first, with one model's demand doubled
        more = [dataclasses.replace(demands[0], rate_rps=demands[0].rate_rps * 2), *demands[1:]]
        again = planner.plan(servers, more, current=result.assignment, time_limit_s=2)
        assert_within_constraints(again, servers, more, current=result.assignment)


def test_a_plan_is_reproducible_and_replanning_it_moves_nothing():
    servers = [Server(f"s{i}", gpu, 8, f"rack-{i % 3}") for i, gpu in enumerate(("H100-SXM", "A100-80GB", "L40S") * 3)]
    demands = [Demand("Llama-3-8B", 60), Demand("Qwen3-32B", 20), Demand("Llama-3-70B", 8)]
    first = planner.plan(servers, demands)
    assert first.status == "OPTIMAL" and first.gap <= planner.GAP_LIMIT / abs(first.bound) and first.problems == []
    assert planner.plan(servers, demands).assignment == first.assignment
    again = planner.plan(servers, demands, current=first.assignment)
    assert again.moves == [] and again.assignment == first.assignment


def test_a_server_held_to_its_nodes_degree_is_planned_at_that_degree_only():
    """A live server's nodes switch model, never their tensor-parallel degree: the plan keeps to it."""
    servers = [Server(f"s{i}", "H100-SXM", 2, f"rack-{i % 2}", tps=(2,)) for i in range(4)]
    current = {"s0": (Replica("Qwen3-32B", 2),), "s1": (Replica("Qwen3-32B", 2),)}
    current |= {f"s{i}": (Replica("Llama-3-8B", 2),) for i in (2, 3)}
    plan = planner.plan(servers, [Demand("Qwen3-32B", 30), Demand("Llama-3-8B", 5)], current=current)
    assert {r.tp for rs in plan.assignment.values() for r in rs} == {2}
    assert any(m.start for m in plan.moves)  # it still moves: a Llama-3-8B node goes over to Qwen3-32B
    free = planner.plan([dataclasses.replace(s, tps=()) for s in servers], [Demand("Llama-3-8B", 60)])
    assert 1 in {r.tp for rs in free.assignment.values() for r in rs}  # unheld, the small model takes TP1


def test_replicas_spread_across_racks_so_one_rack_lost_leaves_the_demand():
    servers = [Server(f"{rack}-{i}", "H100-SXM", 8, rack) for rack in ("r1", "r2", "r3") for i in range(2)]
    demands = [Demand("Qwen3-32B", 40), Demand("Llama-3-8B", 150)]
    spread = planner.plan(servers, demands)
    for d in demands:
        assert spread.after_rack_loss_rps[d.model] >= d.rate_rps, spread.assignment
        racks = {s.rack for s in servers if any(r.model == d.model for r in spread.assignment[s.name])}
        assert len(racks) >= 2


def test_a_lost_rack_is_replanned_onto_the_survivors_with_few_moves():
    servers = [
        Server(f"{rack}-{i}", gpu, 8, rack) for rack in ("a", "b", "c") for i, gpu in enumerate(("H100-SXM",) * 3)
    ]
    current = {
        s.name: (Replica("Llama-3-70B", 8),) if s.rack == "a" else (Replica("Llama-3-8B", 4),) * 2 for s in servers
    }
    demands = [Demand("Llama-3-70B", 20, 1000, 200), Demand("Llama-3-8B", 150, 1000, 200)]
    survivors = [s for s in servers if s.rack != "a"]
    kept = {s.name: current[s.name] for s in survivors}
    assert capacity_of(kept, survivors, demands[0]) == 0  # the loss took the whole model
    # Capacity back first: only the servers that switch model move; the others keep what they run.
    result = planner.plan(survivors, demands, current=kept, move_weight=planner.REPLAN_MOVE_WEIGHT, rack_spread=False)
    assert_within_constraints(result, survivors, demands, current=kept)
    assert result.problems == []
    assert all(result.capacity_rps[d.model] >= d.rate_rps for d in demands)
    switched = [m for m in result.moves if any(r.model == "Llama-3-70B" for r in m.start)]
    assert switched and len(result.moves) == len(switched) < len(survivors)
    # With rack spread as well, the plan also survives losing one more rack, which takes more moves.
    safe = planner.plan(survivors, demands, current=kept, move_weight=planner.REPLAN_MOVE_WEIGHT)
    assert_within_constraints(safe, survivors, demands, current=kept)
    assert all(safe.after_rack_loss_rps[d.model] >= d.rate_rps for d in demands)
    assert len(safe.moves) >= len(result.moves)


def test_trusted_providers_keep_a_restricted_tenant_inside_them():
    servers = [
        Server(f"s{i}", "H100-SXM", 8, f"rack-{i}", provider="eu-cloud" if i < 2 else "us-cloud") for i in range(4)
    ]
    restriction = Restriction("hospital", 30, providers=frozenset({"eu-cloud"}))
    demands = [Demand("Qwen3-32B", 40, restrictions=(restriction,)), Demand("Llama-3-8B", 200)]
    result = planner.plan(servers, demands)
    assert_within_constraints(result, servers, demands)
    assert result.trusted_rps["hospital on Qwen3-32B"] >= 30
    # Asking for more than the trusted servers hold is said, naming the tenant; the rest is still planned.
    greedy = Restriction("hospital", 400, providers=frozenset({"eu-cloud"}))
    short = planner.plan(servers, [Demand("Qwen3-32B", 400, restrictions=(greedy,)), Demand("Llama-3-8B", 200)])
    assert any("tenant hospital" in p and "trusted" in p for p in short.problems)


def test_a_model_that_fits_nowhere_is_named_and_the_others_are_still_planned():
    servers = [Server(f"s{i}", "RTX-4090", 1) for i in range(4)]
    result = planner.plan(servers, [Demand("Llama-3-70B", 5), Demand("Llama-3-8B", 5)])
    (problem,) = [p for p in result.problems if "Llama-3-70B" in p]
    assert "fits on no available GPU type at any tensor-parallel degree" in problem and "24 GB (1x RTX-4090)" in problem
    assert result.capacity_rps["Llama-3-8B"] >= 5


def test_demand_above_the_fleet_gets_the_best_partial_plan_with_fair_shares():
    servers = [Server(f"s{i}", "H100-SXM", 8, f"rack-{i % 2}") for i in range(2)]
    demands = [Demand("Llama-3-8B", 5000), Demand("Qwen3-32B", 1000)]
    result = planner.plan(servers, demands)
    assert len([p for p in result.problems if "is above the" in p]) == 2
    shares = [result.capacity_rps[d.model] / d.rate_rps for d in demands]
    assert min(shares) > 0, "no model is given up so that the other gets more"
    assert max(shares) < 2.5 * min(shares)


def test_a_large_fleet_is_answered_within_the_limit_with_its_gap():
    gpus = (*GPUS, "H200-SXM", "H100-PCIe")
    models = (*MODELS, "Llama-2-13B", "CodeLlama-34B", "Llama-3.3-70B", "Qwen3-1.7B", "Llama-3.2-1B")
    servers = [Server(f"n{i}", gpus[i % len(gpus)], 8, f"rack-{i // 16}", f"p{i % 3}") for i in range(1000)]
    demands = [Demand(m, 900 / (k + 1)) for k, m in enumerate(models)]
    result = planner.plan(servers, demands, time_limit_s=0.2)
    assert result.limited_by in ("work", "time") and result.status in ("FEASIBLE", "UNCHANGED")
    if result.status == "FEASIBLE":
        assert 0 <= result.gap < 1
        assert_within_constraints(result, servers, demands)


@pytest.mark.parametrize(
    ("servers", "demands", "current", "message"),
    [
        ([Server("a", "H100-SXM"), Server("a", "L40S")], [Demand("Llama-3-8B", 1)], {}, "servers named twice: a"),
        ([Server("a", "B200")], [Demand("Llama-3-8B", 1)], {}, "unknown GPU 'B200'"),
        ([Server("a", "H100-SXM", 0)], [Demand("Llama-3-8B", 1)], {}, "gpus is 0"),
        ([Server("a", "H100-SXM")], [Demand("Llama-3-8B", -1)], {}, "rate_rps is -1"),
        ([Server("a", "H100-SXM")], [Demand("Llama-3-8B", 1), Demand("Llama-3-8B", 2)], {}, "two workloads"),
        ([Server("a", "H100-SXM")], [Demand("Llama-3-8B", 1)], {"b": (Replica("Llama-3-8B"),)}, "server 'b'"),
        ([Server("a", "H100-SXM", 2)], [Demand("Llama-3-8B", 1)], {"a": (Replica("Llama-3-8B", 4),)}, "than its 2"),
    ],
)
def test_bad_input_is_refused_saying_what_is_wrong(servers, demands, current, message):
    with pytest.raises((PlanError, catalog.CatalogError), match=message):
        planner.plan(servers, demands, current=current)
