"""Document 000 reproduced (recovery/sim/lumen.py): the confidence interval, the CLI, the results' shape, the
ablation switches and the spares model. Every run here is a few simulated seconds of two or three nodes."""

import json
import math

import pytest

from recovery.policy import recovery as recovery_policy
from recovery.sim import lumen
from recovery.sim import scenario as scenarios
from recovery.sim.fleet import Simulation

TINY = lumen.Setup("workers4", 2, "Qwen3-32B", 2, rate_per_worker=3.0, duration_s=6.0, fault_at_s=2.0)


# --- statistics ---------------------------------------------------------------------------------------
def test_mean_ci_is_students_t_over_the_samples():
    figure = lumen.mean_ci([1.0, 2.0, 3.0])
    assert figure["mean"] == 2.0 and figure["n"] == 3 and figure["missing"] == 0
    assert figure["ci95"] == pytest.approx(4.303 * 1.0 / math.sqrt(3))


def test_mean_ci_counts_runs_that_never_recovered_and_has_no_interval_for_one_sample():
    figure = lumen.mean_ci([None, 5.0])
    assert figure == {"mean": 5.0, "ci95": None, "n": 1, "missing": 1}
    assert lumen.mean_ci([None])["mean"] is None


def test_t_quantiles_shrink_towards_the_normal():
    assert lumen.t_975(1) == 12.706 and lumen.t_975(30) == 2.042 and lumen.t_975(200) == 1.96
    with pytest.raises(ValueError):
        lumen.t_975(0)


# --- the CLI ------------------------------------------------------------------------------------------
def test_cli_refuses_an_unknown_table(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        lumen.main(["table7"], out_dir=tmp_path)
    assert exc.value.code == 2
    assert "invalid choice: 'table7'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_cli_refuses_zero_seeds(capsys, tmp_path):
    with pytest.raises(SystemExit):
        lumen.main(["workers4", "--seeds", "0"], out_dir=tmp_path)
    assert "--seeds must be at least 1" in capsys.readouterr().err


# --- a tiny run's results -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    ctx = lumen.Context(seeds=(1, 2), quick=False, jobs=1, day=False, command="python -m recovery.sim.lumen test")
    body = lumen.policy_table(TINY, ctx)
    out = tmp_path_factory.mktemp("results")
    path = lumen.write("workers4", ctx, body, 1.0, out)
    return json.loads(path.read_text())


def test_results_put_ours_beside_the_papers_with_kinds_and_command(tiny_results):
    data = tiny_results
    assert data["command"] == "python -m recovery.sim.lumen test" and data["seeds"] == [1, 2]
    assert data["differences_from_paper"] and "simulated" in data["kinds"] and "measured" not in data["kinds"]
    lumen_row = data["policies"]["load_aware"]
    assert lumen_row["ours"]["ttft_mean_s"]["kind"] == "simulated"
    assert lumen_row["ours"]["ttft_mean_s"]["n"] == 2
    assert lumen_row["paper"] == {
        "ttft_mean_s": 2.61,
        "tpot_mean_s": 0.148,
        "recovery_s": 10.0,
        "kind": "input",
        "source": lumen_row["paper"]["source"],
    }
    assert data["policies"]["lifeline"]["paper"] is None  # the paper has no Lifeline
    ratio = data["ratios"]["load_aware_vs_none"]["ttft_mean_s"]
    assert ratio["paper"] == -0.444 and (ratio["ours"] is None or ratio["ours"] > -1)
    assert set(data["ratios"]) == {
        "lifeline_vs_load_aware",
        "lifeline_vs_none",
        "load_aware_vs_none",
        "load_aware_vs_fixed",
    }
    assert len(data["verdict"]) == 2
    assert {(r["policy"], r["seed"]) for r in data["runs"]} == {(p, s) for p in lumen.POLICIES for s in (1, 2)}


def test_every_policy_of_a_seed_gets_the_same_requests_and_fault(tiny_results):
    runs = tiny_results["runs"]
    for seed in (1, 2):
        mine = [r for r in runs if r["seed"] == seed]
        assert len({r["requests"] for r in mine}) == 1
        assert {r["faults"] for r in mine} == {1}


# --- the ablation switches ------------------------------------------------------------------------------
def _most_holders(**switches) -> int:
    """The most holders any request had at any moment of a short, busy run of lifeline."""
    scenario = scenarios.parse(
        {
            "duration_s": 4,
            "fleet": [
                {"name": "a", "count": 2, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2, "rack": "r1"},
                {"name": "b", "count": 2, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2, "rack": "r2"},
            ],
            "workload": {"rate_rps": 12},
            "faults": {"per_1000_node_days": 0},
        }
    )
    sim = Simulation(scenario, "lifeline", 1, **switches)
    most, t = 0, 0.0
    while t < 12:
        t += 0.1
        sim.run(until=t)
        most = max([most, *(len(f.holders) for f in sim.in_flight.values())])
    sim.run()
    return max([most, *(len(f.holders) for f in sim.flights)])


def test_no_second_holder_means_no_request_ever_has_two():
    assert _most_holders() == 2
    assert _most_holders(second_holder=False) == 1


def test_no_load_aware_placement_puts_the_first_holder_on_the_fixed_neighbour():
    scenario = scenarios.parse(
        {
            "duration_s": 3,
            "fleet": [{"name": "a", "count": 3, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2}],
            "workload": {"rate_rps": 6},
            "faults": {"per_1000_node_days": 0},
        }
    )
    sim = Simulation(scenario, "lifeline", 1, load_aware_placement=False, second_holder=False).run()
    neighbour = {"a-1": "a-2", "a-2": "a-3", "a-3": "a-1"}
    assert all(f.holders == (neighbour[f.node],) for f in sim.flights if f.holders)


def test_a_soonest_resume_plans_with_plan_soonest_and_an_unknown_plan_is_refused(monkeypatch):
    """The same faulted run with resume="soonest": the lost node's requests are planned by plan_soonest (each
    decision says so), none lost."""
    seen = []
    original = recovery_policy.plan_soonest

    def spy(*args, **kwargs):
        decisions = original(*args, **kwargs)
        seen.extend(decisions)
        return decisions

    monkeypatch.setattr(recovery_policy, "plan_soonest", spy)
    scenario = TINY.scenario()
    sim = Simulation(scenario, "lifeline", 1, resume="soonest", fast=True).run()
    interrupted = [f for f in sim.flights if f.interrupted_at]
    assert interrupted and len(seen) == len(interrupted)
    assert all("next token soonest" in d.reason for d in seen)
    assert all(f.emitted == f.request.output_tokens for f in sim.flights)
    with pytest.raises(ValueError, match="unknown resume plan 'fastest': expected one of eq6, soonest"):
        Simulation(scenario, "lifeline", 1, resume="fastest")


def test_the_resume_experiment_pairs_each_variant_with_lumen_on_the_same_seeds():
    ctx = lumen.Context(seeds=(1, 2), quick=False, jobs=1, day=False, command="c")
    body = lumen.resume(ctx, [TINY])["workers4"]
    assert set(body["rows"]) == {"load_aware", "lifeline", "lifeline+soonest"}
    assert {(r["label"], r["seed"]) for r in body["runs"]} == {(v, s) for v in lumen.RESUME_VARIANTS for s in (1, 2)}
    paired = body["vs_load_aware"]["lifeline+soonest"]["replay_ttft_s"]
    assert paired["n"] + paired["missing"] == 2
    soonest = [r for r in body["runs"] if r["label"] == "lifeline+soonest"]
    assert all(r["restored"] + r["fetched"] + r["reprefilled"] == r["interrupted"] for r in soonest)


# --- the spares model ------------------------------------------------------------------------------------
STEADY = [(1.0, 0.999), (1.5, 0.9)]


def test_a_day_without_faults_attains_the_steady_figure():
    assert lumen._day_attainment(10, 0, [], STEADY, 50.0, 1e6) == pytest.approx(0.999)


def test_a_spare_takes_the_lost_nodes_load_and_only_the_transient_remains():
    fault = [(lumen.DAY_S / 2, math.inf)]  # half the day with one node of two out
    without = lumen._day_attainment(2, 0, fault, STEADY, 100.0, 1e6)
    with_one = lumen._day_attainment(2, 1, fault, STEADY, 100.0, 1e6)
    assert without == pytest.approx((0.999 + lumen._interpolate(STEADY, 2.0)) / 2 - 1e-4)
    assert with_one == pytest.approx(0.999 - 1e-4)


def test_a_rate_other_than_the_setups_is_written_beside_the_default_results(tmp_path):
    ctx = lumen.Context(seeds=(1,), quick=False, jobs=1, day=False, command="c", rate=10.0)
    assert lumen.write("workers8", ctx, {}, 0.0, tmp_path).name == "lumen_workers8_rate10.json"
    assert lumen.write("grid", ctx, {}, 0.0, tmp_path).name == "lumen_grid.json"
    assert lumen._rated(lumen.WORKERS8, ctx).rate_per_worker == 10.0


def test_a_fleet_run_closer_to_saturation_loses_more_to_the_same_fault():
    fault = [(lumen.DAY_S / 2, math.inf)]
    assert lumen._day_attainment(4, 0, fault, STEADY, 0.0, 1e6, load=1.2) < lumen._day_attainment(
        4, 0, fault, STEADY, 0.0, 1e6
    )


# --- a day at scale, composed from windows ----------------------------------------------------------------
def test_a_days_stretches_follow_its_failures_and_repairs():
    faults = [lumen.DayFault(100.0, "crash", 200.0, 0), lumen.DayFault(200.0, "hang", math.inf, 1)]
    pieces = lumen.stretches(faults)
    assert pieces == [(100.0, 0), (100.0, 1), (100.0, 2), (lumen.DAY_S - 300.0, 1)]
    assert sum(seconds for seconds, _ in pieces) == lumen.DAY_S


def test_drawn_days_are_the_seeds_and_count_the_nodes_already_out():
    days = {seed: lumen.draw_day(1000, seed) for seed in range(1, 6)}
    assert days == {seed: lumen.draw_day(1000, seed) for seed in range(1, 6)}
    assert 5 <= sum(map(len, days.values())) <= 40  # about 4 a day at 4 per 1,000 node-days
    for faults in days.values():
        for i, f in enumerate(faults):
            assert f.out_before == sum(1 for g in faults[:i] if g.at_s + g.outage_s > f.at_s)


STEADY_FIGURES = {0: {"ttft_mean_s": 0.2, "attainment": 0.999}, 1: {"ttft_mean_s": 0.3, "attainment": 0.99}}


def test_a_day_without_faults_is_its_steady_window():
    composed = lumen.compose_day(10, [], STEADY_FIGURES, [], rate_per_s=70.0)
    assert composed["ttft_mean_s"] == pytest.approx(0.2) and composed["attainment"] == pytest.approx(0.999)
    assert composed["requests"] == pytest.approx(70.0 * lumen.DAY_S) and composed["recovery_s"] is None


def test_a_fault_adds_its_windows_excess_over_its_baseline_and_the_capacity_it_took():
    fault = lumen.DayFault(lumen.DAY_S / 2, "crash", math.inf, 0)
    window = {
        "ttft_sum": 1000.0 * 0.25 + 40 * 5.0,  # 1,000 arrivals a little slower, and 40 replays of 5 s
        "ttft_count": 1040,
        "base_ttft_sum": 1000.0 * 0.2,
        "base_ttft_count": 1000,
        "missed": 30,
        "base_missed": 1,
        "interrupted": 40,
        "restored": 38,
        "fetched": 0,
        "reprefilled": 2,
        "replay_ttft_s": 5.0,
        "recovery_s": 0.0,
    }
    composed = lumen.compose_day(10, [fault], STEADY_FIGURES, [window], rate_per_s=1.0)
    day = lumen.DAY_S
    # The window's 1,000 requests are in the stretch at one node out too: the capacity's cost is not counted twice.
    excess = 250.0 - 1000 * (0.3 - 0.2)
    assert composed["ttft_mean_s"] == pytest.approx((day / 2 * 0.2 + day / 2 * 0.3 + excess) / (day + 40))
    assert composed["attainment"] == pytest.approx(1 - (day / 2 * 0.001 + day / 2 * 0.01 + 29 - 1000 * 0.009) / day)
    assert composed["interrupted"] == 40 and composed["replay_ttft_s"] == 5.0 and composed["node_hours_out"] == 12.0


def test_a_day_at_scale_runs_every_policy_on_the_same_drawn_faults(monkeypatch):
    """Eight nodes, a short window: one crash and one hang drawn into the day, the second with the first's node
    still out. Every policy sees both, the fault's window interrupts requests, and the checkpointing policies
    restore what stop-and-restart re-prefills."""
    day = [lumen.DayFault(3600.0, "crash", math.inf, 0), lumen.DayFault(7200.0, "hang", 3600.0, 1)]
    monkeypatch.setattr(lumen, "DAY_FLEETS", (8,))
    monkeypatch.setattr(lumen, "draw_day", lambda nodes, seed: day)
    monkeypatch.setattr(lumen, "WARM_S", 2.0)
    monkeypatch.setattr(lumen, "STEADY_S", 5.0)
    monkeypatch.setattr(lumen, "AFTER_S", {"crash": 4.0, "hang": 8.0})
    ctx = lumen.Context(seeds=(1,), quick=False, jobs=1, day=True, command="c")
    body = lumen.scale(ctx)["day-8"]
    assert set(body["windows"]) == {
        f"{p}/{w}" for p in lumen.SCALE_POLICIES for w in ("steady/0", "steady/1", "steady/2", "1/0", "1/1")
    }
    runs = {r["policy"]: r for r in body["runs"]}
    for policy, run in runs.items():
        assert run["faults"] == 2 and run["interrupted"] > 0, policy
        assert run["replay_ttft_s"] is not None and run["replay_ttft_s"] > 0
    assert runs["none"]["reprefilled"] == runs["none"]["interrupted"]
    assert runs["lifeline"]["restored"] + runs["lifeline"]["fetched"] > 0
    assert body["rows"]["lifeline"]["ttft_mean_s"]["kind"] == "modelled" and "composed" in body["kind"]
    assert any("replay TTFT" in line for line in body["verdict"])


def test_day_fleets_are_checked_and_each_size_writes_its_own_file(capsys, tmp_path):
    with pytest.raises(SystemExit):
        lumen.main(["scale", "--day", "--fleets", "256,lots"], out_dir=tmp_path)
    assert "--fleets takes node counts separated by commas, such as 256,1000; got '256,lots'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lumen.main(["scale", "--day", "--fleets", "2"], out_dir=tmp_path)
    assert "each fleet from 8 to 4096 nodes" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    ctx = lumen.Context(seeds=(1,), quick=False, jobs=1, day=True, command="c", fleets=(1000,))
    assert lumen.write("scale", ctx, {}, 0.0, tmp_path).name == "lumen_scale_day_1000.json"
