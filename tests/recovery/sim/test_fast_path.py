"""The simulator's fast path (decode runs in closed form) against the step-by-step reference."""

import json

import pytest

from recovery.sim import bench
from recovery.sim import scenario as scenarios
from recovery.sim.bench import _largest_error, main
from recovery.sim.fleet import Simulation, prompt_ids, sampling
from recovery.sim.metrics import request_metrics, run_metrics
from workers.core import EngineCore, SamplingParams, Sequence


def sixteen_nodes(*faults: dict) -> scenarios.Scenario:
    return scenarios.parse(
        {
            "duration_s": 16,
            "fleet": [
                {"name": "a", "count": 8, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2, "rack": "rack-a"},
                {"name": "b", "count": 8, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2, "rack": "rack-b"},
            ],
            "workload": {"rate_rps": 40},
            "faults": {"per_1000_node_days": 0, "scripted": list(faults)},
        }
    )


@pytest.fixture(scope="module")
def both_paths() -> tuple[Simulation, Simulation]:
    """Sixteen nodes in two racks, one crashing and coming back, then a whole rack lost."""
    scenario = sixteen_nodes(
        {"at_s": 5.0, "kind": "crash", "target": "a-3", "repair_s": 4},
        {"at_s": 10.0, "kind": "rack", "target": "rack-b"},
    )
    reference = Simulation(scenario, "lifeline", 3).run()
    fast = Simulation(scenario, "lifeline", 3, fast=True).run()
    return reference, fast


def test_every_request_has_the_reference_s_ttft_and_tpot_at_sixteen_nodes(both_paths):
    reference, fast = both_paths
    ours = [request_metrics(f) for f in fast.flights]
    theirs = [request_metrics(f) for f in reference.flights]
    assert len(ours) == len(theirs) > 500
    assert sum(m.interrupted for m in theirs) > 20  # the faults cut streams off: recovery is compared too
    worst = _largest_error([(m.ttft_s, m.tpot_s) for m in ours], [(m.ttft_s, m.tpot_s) for m in theirs])
    assert worst <= 0.01, worst
    for a, b in zip(fast.flights, reference.flights):
        assert (a.node, a.emitted, a.methods, a.holders) == (b.node, b.emitted, b.methods, b.holders), a.request_id


def test_the_fast_path_takes_fewer_events_for_the_same_steps(both_paths):
    reference, fast = both_paths
    assert fast.steps_simulated == reference.steps_simulated
    assert fast.events_processed < 0.8 * reference.events_processed
    assert fast.now == pytest.approx(reference.now)


def test_the_run_s_figures_are_the_reference_s(both_paths):
    reference, fast = both_paths
    ours, theirs = run_metrics(fast).to_json(), run_metrics(reference).to_json()
    assert ours.pop("events") < theirs.pop("events")
    assert ours == theirs


def test_a_decode_run_cut_short_by_an_arrival_continues_step_by_step(tmp_path):
    """One node: a long request decodes alone, a second arrives mid-run and joins at the next step boundary."""
    (tmp_path / "trace.csv").write_text("arrival_timestamp,prompt_size,token_size\n0.0,300,400\n1.234,200,50\n")
    scenario = scenarios.parse(
        {
            "duration_s": 2,
            "fleet": [{"name": "a", "count": 1, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2}],
            "workload": {"trace": "trace.csv"},
            "faults": {"per_1000_node_days": 0, "scripted": []},
        },
        base_dir=tmp_path,
    )
    reference = Simulation(scenario, "lifeline", 1).run()
    fast = Simulation(scenario, "lifeline", 1, fast=True).run()
    assert [(f.first_token_s, f.last_token_s) for f in fast.flights] == [
        (f.first_token_s, f.last_token_s) for f in reference.flights
    ]
    assert fast.events_processed < reference.events_processed / 5


def test_a_core_that_counts_tokens_refuses_requests_that_could_stop_early():
    core = EngineCore(scenarios._deployment("Qwen3-32B", "H100-SXM", 2), token_ids=False)
    with pytest.raises(ValueError, match="ignore_eos"):
        core.add(Sequence("r", [1, 2, 3], SamplingParams(max_tokens=4)), 0.0)
    request = scenarios.parse(
        {
            "duration_s": 10,
            "fleet": [{"name": "a", "count": 1, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2}],
            "workload": {"rate_rps": 2},
            "faults": {"per_1000_node_days": 0, "scripted": []},
        }
    ).requests(1)[0]
    core.add(Sequence("s", prompt_ids(0, request.prompt_tokens), sampling(request)), 0.0)


def test_the_speed_benchmark_compares_both_paths_and_writes_its_figures(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "RESULTS", tmp_path / "sim_speed.json")
    main(["2", "--duration", "3", "--reference-up-to", "2"])
    out = capsys.readouterr().out
    assert "faster" in out and "largest per-request TTFT/TPOT difference 0.00%" in out
    figures = json.loads((tmp_path / "sim_speed.json").read_text())
    run = figures["runs"][0]
    assert run["nodes"] == 2 and run["largest_ttft_tpot_error"] == 0 and run["step_by_step"]["steps"] == run["steps"]


def test_a_run_collects_young_garbage_less_often_and_puts_the_setting_back():
    """Simulation.run raises the young generation's threshold while it runs (its objects make next to no cycles,
    and the default collections took a sixth to an eighth of a 1,000-node run) and restores it, a failing run too."""
    import gc

    from recovery.sim.fleet import GC_YOUNG_THRESHOLD

    before = gc.get_threshold()
    sim = Simulation(sixteen_nodes(), "lifeline", 1, fast=True)
    during = []
    arrive = sim._on_arrival

    def watched(arrival):
        during.append(gc.get_threshold()[0])
        arrive(arrival)

    sim._on_arrival = watched
    sim.run(until=1.0)
    assert during and min(during) >= GC_YOUNG_THRESHOLD > before[0]
    assert gc.get_threshold() == before

    def broken(arrival):
        raise RuntimeError("a handler failed")

    sim._on_arrival = broken
    with pytest.raises(RuntimeError):
        sim.run(until=2.0)
    assert gc.get_threshold() == before
