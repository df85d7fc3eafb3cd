"""A scenario's runs with progress (recovery.sim.experiment): the share done after every slice of simulated time, the
same figures as a run in one go, a stop from the callback, and the latency series drawn from them (recovery.sim.series).
"""

import pytest

from recovery.sim import series
from recovery.sim.experiment import PROGRESS_SLICES, run_all
from recovery.sim.scenario import parse

SCENARIO = {
    "duration_s": 12,
    "policies": ["none", "lifeline"],
    "seeds": [1, 2],
    "fleet": [
        {"name": "a", "count": 2, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2, "rack": "rack-a"},
        {"name": "b", "count": 2, "model": "Qwen3-32B", "gpu": "H200-SXM", "tp": 2, "rack": "rack-b"},
    ],
    "workload": {"arrival": "poisson", "rate_rps": 2},
    "faults": {"per_1000_node_days": 0, "scripted": [{"at_s": 5, "kind": "crash", "target": "b-1"}]},
}


@pytest.fixture(scope="module")
def scenario():
    return parse(SCENARIO)


@pytest.fixture(scope="module")
def reported(scenario):
    heard = []
    results = run_all(scenario, progress=lambda done, policy, seed: heard.append((done, policy, seed)))
    return results, heard


def test_progress_rises_after_every_slice_of_every_simulation_to_one(scenario, reported):
    _, heard = reported
    shares = [done for done, _, _ in heard]
    assert len(heard) == 4 * 2 * (PROGRESS_SLICES + 1)  # 4 runs, each a baseline and a faulted simulation
    assert all(0 < a < b for a, b in zip(shares, shares[1:]))
    assert shares[-1] == pytest.approx(1.0)
    assert sum(1 for share in shares if 0 < share < 1) == len(shares) - 1
    under_way = list(dict.fromkeys((policy, seed) for _, policy, seed in heard))
    assert under_way == scenario.runs() == [("none", 1), ("lifeline", 1), ("none", 2), ("lifeline", 2)]
    first_run = [done for done, policy, seed in heard if (policy, seed) == ("none", 1)]
    assert first_run[-1] == pytest.approx(0.25)  # each run an equal share


def test_slices_give_the_figures_of_one_run_in_one_go(scenario, reported):
    results, _ = reported
    at_once = run_all(scenario)
    for sliced, whole in zip(results, at_once, strict=True):
        assert sliced.to_json() | {"wall_s": 0} == whole.to_json() | {"wall_s": 0}


def test_a_callback_that_raises_stops_the_run_where_it_is(scenario):
    class Stop(Exception):
        pass

    heard = []

    def stop_at_the_fifth(done, policy, seed):
        heard.append(done)
        if len(heard) == 5:
            raise Stop

    with pytest.raises(Stop):
        run_all(scenario, progress=stop_at_the_fifth)
    assert len(heard) == 5


def test_the_series_pools_each_policys_seeds_and_marks_each_fault_once(reported):
    results, _ = reported
    chart = series.by_policy(results, window_s=2.0)
    assert [line["policy"] for line in chart["policies"]] == ["none", "lifeline"]
    assert chart["starts"] == [2.0 * i for i in range(len(chart["starts"]))]
    assert chart["faults"] == [
        {"at_s": 5.0, "detected_s": results[0].metrics.faults[0].detected_s, "kind": "crash", "target": "b-1"}
    ]
    for result in results:
        windows = series.run_windows(result, 2.0)
        assert sum(w.ttft_samples for w in windows) == result.metrics.requests  # one TTFT each, at its first token
    for line in chart["policies"]:
        policy = line["policy"]
        assert len(line["ttft_s"]) == len(line["tpot_s"]) == len(chart["starts"])
        # A window's pooled mean is its seeds' samples together: their means weighted by their counts.
        runs = [series.run_windows(r, 2.0) for r in results if r.metrics.policy == policy]
        for i, mean in enumerate(line["ttft_s"]):
            mine = [run[i] for run in runs if i < len(run) and run[i].ttft_samples]
            count = sum(w.ttft_samples for w in mine)
            expected = sum(w.ttft_mean_s * w.ttft_samples for w in mine) / count if count else None
            assert mean == (None if expected is None else pytest.approx(expected))
