"""benchmarks.sim_validation: the real run's requests replay in the simulator as they were sent, both sides' figures
come from the same metrics code, and the pipeline runs end to end on a tiny real cluster."""

import asyncio
import copy
import json

import pytest

from benchmarks import sim_validation as sv
from benchmarks.common import RESULTS
from harness import provenance
from recovery.sim.experiment import run_one
from recovery.sim.faults import DETECTION
from recovery.sim.fleet import MOVE_HOP_S
from recovery.sim.metrics import run_metrics
from workers import catalog, tokens

T0 = 1000.0  # a run's start, as time.monotonic() gave it


def sent(prompt: str, max_tokens: int, at: float, node: str, chunk_times: list[float] = ()) -> sv.Sent:
    request = sv.Sent(prompt, len(tokens.encode(prompt)), max_tokens, T0 + at, node=node, done=True)
    request.chunks = [(T0 + t, 1) for t in chunk_times]
    request.ids = [0] * len(chunk_times)
    return request


def run(requests: list[sv.Sent], kill_node: str | None = None, kill_at: float = 0.0) -> dict:
    killed = {"node": kill_node, "at": T0 + kill_at, "in_flight": 1} if kill_node else {}
    return {"policy": "lifeline", "kill": bool(kill_node), "t0": T0, "sent": requests, "killed": killed}


@pytest.mark.parametrize("time_scale", [1.0, 2.0])
def test_the_trace_replays_the_requests_the_real_client_sent(tmp_path, time_scale):
    setup = sv.Setup(4, 3.0, kill_at_s=2.0, after_kill_s=3.0, time_scale=time_scale)
    arrivals = sv.schedule(setup)
    assert arrivals, "the schedule sends something"
    # Sent out of order on purpose: the trace and the simulator's indices follow the send times.
    requests = [
        sent(prompt, max_tokens, offset * time_scale + 0.003, f"n{i % 4:02d}")
        for i, (offset, prompt, max_tokens) in enumerate(arrivals)
    ][::-1]
    real = run(requests, "n02", kill_at=2.0 * time_scale)

    trace = sv.write_trace(real, setup, tmp_path / "trace.csv")
    scenario = sv.scenario_for(setup, trace, real["killed"], T0)
    replayed = scenario.requests(sv.SIM_SEED)

    expected = sorted(requests, key=lambda s: s.sent_at)
    assert [r.arrival_s for r in replayed] == pytest.approx([(s.sent_at - T0) / time_scale for s in expected], abs=1e-6)
    assert [(r.prompt_tokens, r.output_tokens) for r in replayed] == [(s.prompt_tokens, s.max_tokens) for s in expected]
    assert [r.prompt_tokens for r in replayed] == [len(p.split()) for _, p, _ in sorted(arrivals)]
    # The harness's fleet: same count, same racks, in the same order; the same node killed at the same moment.
    assert [(n.name, n.rack) for n in scenario.nodes] == [
        ("rack-0-1", "rack-0"),
        ("rack-0-2", "rack-0"),
        ("rack-1-1", "rack-1"),
        ("rack-1-2", "rack-1"),
    ]
    assert {n.deployment for n in scenario.nodes} == {catalog.Deployment.of(sv.MODEL, sv.GPU, sv.TP)}
    (fault,) = scenario.faults(sv.SIM_SEED)
    assert (fault.kind, fault.target, fault.at_s) == ("crash", "rack-1-1", pytest.approx(2.0))
    draft = catalog.MODELS[catalog.MODELS[sv.MODEL].draft]
    assert fault.repair_s == pytest.approx(sv.RESTART_AFTER_S + catalog.load_time_s(draft))


def test_the_simulated_side_runs_as_the_harness_does_without_draft_assist(tmp_path):
    """The harness restarts the killed node without its draft assisting a survivor; the simulated side must too, or
    it compares an assisted TPOT with an unassisted one (it did: −19 % in a 45 s run)."""
    setup = sv.Setup(4, 3.0, kill_at_s=2.0, after_kill_s=20.0)
    requests = [
        sent(prompt, max_tokens, offset + 0.003, f"n{i % 4:02d}")
        for i, (offset, prompt, max_tokens) in enumerate(sv.schedule(setup))
    ]
    real = run(requests, "n00", kill_at=2.0)
    scenario = sv.scenario_for(setup, sv.write_trace(real, setup, tmp_path / "trace.csv"), real["killed"], T0)

    # The scenario is one where the simulator's default would pair the restarting node's draft with a survivor.
    assert run_one(scenario, "lifeline", sv.SIM_SEED).simulation.assists, "the default assists here"
    assert sv.DRAFT_ASSIST is False
    simulated = sv.simulate(scenario, "lifeline")
    assert simulated.simulation.assists == [] and simulated.baseline.assists == []


def test_error_is_the_simulated_figure_against_the_real_one():
    assert sv.error_pct(200.0, 220.0) == 10.0
    assert sv.error_pct(200.0, 150.0) == -25.0
    assert sv.error_pct(None, 1.0) is None
    assert sv.error_pct(1.0, None) is None
    assert sv.error_pct(0.0, 1.0) is None  # no relative error against nothing
    assert sv.error_pct(0.0, 0.0) == 0.0  # the same figure (a recovery time of 0 on both sides)
    real = {"ttft_mean_ms": 100.0, "tpot_mean_ms": 40.0, "stall_mean_ms": None, "recovery_s": 10.0}
    simulated = {"ttft_mean_ms": 95.0, "tpot_mean_ms": 44.0, "stall_mean_ms": 50.0, "recovery_s": 10.0}
    assert sv.compare(real, simulated) == {
        "ttft_mean_ms": -5.0,
        "tpot_mean_ms": 10.0,
        "stall_mean_ms": None,
        "recovery_s": 0.0,
    }
    assert sv.difference(real, simulated) == {
        "ttft_mean_ms": -5.0,
        "tpot_mean_ms": 4.0,
        "stall_mean_ms": None,
        "recovery_s": 0.0,
    }


def test_a_real_run_is_measured_by_the_simulators_metrics(tmp_path):
    """TTFT, TPOT, the interrupted request's stall and the recovery time of a run whose token times are known."""
    setup = sv.Setup(2, 1.0, kill_at_s=10.0, after_kill_s=20.0)
    steady = [t / 10 for t in range(0, 11)]  # 11 tokens, 0.1 s apart
    prompt = " ".join(sv.WORDS[:20])
    baseline = run(
        [
            sent(prompt, 11, 1.0, "n00", [1.2 + t for t in steady]),
            sent(prompt, 11, 9.0, "n01", [9.2 + t for t in steady]),
        ]
    )
    # The second request was on n01 when it died at 9.5 s: its next token came 0.8 s later, then it went on.
    moved = [9.2, 9.3, 9.4, 10.3, 10.4, 10.5, 10.6, 10.7, 10.8, 10.9, 11.0]
    faulted = run(
        [sent(prompt, 11, 1.0, "n00", [1.2 + t for t in steady]), sent(prompt, 11, 9.0, "n01", moved)], "n01", 9.5
    )
    faulted["sent"][1].moves = [": lifeline moved this stream from n01 to n00 at token 3 (restore; holder)"]

    trace = sv.write_trace(faulted, setup, tmp_path / "trace.csv")
    scenario = sv.scenario_for(setup, trace, faulted["killed"], T0)
    real = sv.measured(faulted, setup, scenario)
    metrics = run_metrics(real, sv.measured(baseline, setup, scenario))

    assert metrics.requests == metrics.finished == 2
    assert metrics.ttft_mean_s == pytest.approx(0.2)
    assert metrics.tpot_mean_s == pytest.approx((0.1 + (11.0 - 9.2) / 10) / 2)
    assert metrics.interrupted == 1
    assert metrics.stall_mean_s == pytest.approx(10.3 - 9.5)
    (fault,) = metrics.faults
    assert (fault.target, fault.detected_s) == ("rack-1-1", pytest.approx(9.5))
    # The stall's gap puts the window [10, 15)'s mean gap at twice the baseline's: out of band; every later window
    # is within, so the cluster has recovered at 15 s, 15 − 9.5 s after the detection.
    assert fault.recovery_s == pytest.approx(15.0 - 9.5)

    # The simulator's own run of the same scenario comes out in the same shape.
    simulated = run_one(scenario, "lifeline", sv.SIM_SEED).metrics
    assert simulated.requests == 2 and simulated.faults[0].target == "rack-1-1"


@pytest.mark.e2e
def test_a_tiny_real_run_goes_through_the_whole_pipeline(tmp_path):
    """Two real nodes behind the real gateway for a few seconds, one killed: every figure on both sides."""
    setup = sv.Setup(
        2, 3.0, kill_at_s=2.0, after_kill_s=2.5, prompt_words=(40, 80), max_tokens=(20, 40), restart_after_s=60.0
    )
    result = asyncio.run(sv.validate(setup, "lifeline", tmp_path))

    real, simulated = result["emulated"], result["simulated"]
    assert real["requests"] == simulated["requests"] == len(sv.schedule(setup))
    assert result["tokens"] == {"lost": 0, "repeated_or_wrong": 0, "request_errors": 0, "errors": []}
    for side in (real, simulated):
        assert side["ttft_mean_ms"] > 0 and side["tpot_mean_ms"] > 0
    assert set(result["error_pct"]) == {key for key, _ in sv.COMPARED}
    assert result["error_pct"]["ttft_mean_ms"] is not None and result["error_pct"]["tpot_mean_ms"] is not None
    assert result["scoring"] == sv.scores(real, simulated)
    assert result["within_goal"] == {key: score == sv.WITHIN for key, score in result["scoring"].items()}
    assert result["kill"]["sim_node"] in {"rack-0-1", "rack-1-1"}
    # Where the stalls went: each real move off the killed node timed by the gateway, each simulated one by the model.
    kill = result["kill"]
    breakdown = kill["stall_breakdown_ms_mean"]
    assert kill["moved_real"] >= 1, "the busiest node had requests in flight when it was killed"
    real_parts, sim_parts = breakdown["emulated"], breakdown["simulated"]
    assert real_parts["moves"] == kill["moved_real"]
    assert sim_parts["moves"] == kill["interrupted_simulated"]
    assert set(sim_parts) == {"noticed_ms", "answered_ms", "restore_ms", "first_token_ms", "moves"}
    assert set(real_parts) == set(sim_parts) | {"noticed_after_last_token_ms"}
    for parts in (real_parts, sim_parts):
        assert parts["answered_ms"] >= 0 and parts["first_token_ms"] > 0
        assert 0 < parts["noticed_ms"] < 1000  # from the SIGKILL, on both sides
    # The simulator's move: the measured break and hop (benchmarks/move_hop.py), then its restore.
    hop_ms = (MOVE_HOP_S[0] + MOVE_HOP_S[1] * sim_parts["moves"]) * 1000
    assert sim_parts["noticed_ms"] == round(DETECTION.stream_break_s * 1000, 1)
    assert sim_parts["answered_ms"] == pytest.approx(hop_ms + sim_parts["restore_ms"], abs=0.2)
    assert result["machine"]["with_failure"]["load_average_before"]
    spread = kill["stall_phase_spread"]  # the same stall with the simulated kill moved
    assert spread["real_ms"] == real["stall_mean_ms"]
    assert spread["stall_ms"][sv.PHASE_OFFSETS_MS.index(0)] == simulated["stall_mean_ms"]
    assert f"{spread['mean_ms']:g} ms ({spread['min_ms']:g}-{spread['max_ms']:g})" in sv.table([result])
    off_goal = sv.explain(result)  # a sentence per figure off the goal, naming it
    assert set(off_goal) <= {key for key, _ in sv.COMPARED}
    assert all(text.startswith(dict(sv.COMPARED)[key]) for key, text in off_goal.items())


def test_the_stalls_phase_spread_moves_the_kill_and_says_where_the_real_stall_falls(tmp_path):
    """One crash's stall depends on where in its targets' steps the moved requests arrive: the spread re-runs the
    simulated side with the kill moved by each offset, and the unmoved run is the one compared."""
    setup = sv.Setup(4, sv.RATE_PER_NODE * 4, kill_at_s=10.0, after_kill_s=5.0)
    requests = [sent(prompt, max_tokens, offset + 0.003, "n00") for offset, prompt, max_tokens in sv.schedule(setup)]
    real = run(requests, "n01", kill_at=10.0)
    trace = sv.write_trace(real, setup, tmp_path / "trace.csv")
    scenario = sv.scenario_for(setup, trace, real["killed"], T0)
    unmoved = sv.simulate(scenario, "fixed").metrics.stall_mean_s
    assert unmoved is not None, "the crash interrupts requests"

    spread = sv.phase_spread(setup, "fixed", trace, real["killed"], T0, real_stall_ms=100.0)

    assert spread["offsets_ms"] == list(sv.PHASE_OFFSETS_MS)
    assert len(spread["stall_ms"]) == len(sv.PHASE_OFFSETS_MS)
    assert spread["stall_ms"][sv.PHASE_OFFSETS_MS.index(0)] == pytest.approx(unmoved * 1000, abs=0.05)
    assert spread["min_ms"] <= spread["mean_ms"] <= spread["max_ms"]
    assert spread["max_ms"] - spread["min_ms"] > 10, "a shift of a few ms moves the stall by much more"
    below = sum(v <= 100.0 for v in spread["stall_ms"] if v is not None)
    assert spread["real_rank"] == pytest.approx(below / len(sv.PHASE_OFFSETS_MS), abs=0.01)
    assert spread["real_within_range"] == (spread["min_ms"] <= 100.0 <= spread["max_ms"])
    assert spread["error_pct_of_mean"] == sv.error_pct(100.0, spread["mean_ms"])


# --- scoring: every pair counted --------------------------------------------------------------------------------
def test_every_pair_is_scored_and_none_is_hidden():
    # A nonzero real figure: within the goal at |error| <= 10 %, else a miss (a simulated 0 included).
    assert sv.score(200.0, 220.0) == sv.score(200.0, 180.0) == sv.score(200.0, 200.0) == sv.WITHIN
    assert sv.score(200.0, 220.5) == sv.score(200.0, 179.0) == sv.score(200.0, 0.0) == sv.MISS
    # A real 0 against a simulated figure that is not 0: no relative error, and a miss, counted apart.
    assert sv.score(0.0, 10.0) == sv.ZERO_VS_NONZERO
    # 0 against 0: reported apart, never within the goal.
    assert sv.score(0.0, 0.0) == sv.BOTH_ZERO
    # A figure missing on either side: a miss, counted apart.
    assert sv.score(None, 10.0) == sv.score(10.0, None) == sv.score(None, None) == sv.MISSING
    assert set(sv.MISSES) == {sv.MISS, sv.ZERO_VS_NONZERO, sv.MISSING}


def test_the_summary_counts_every_pair():
    real = {"ttft_mean_ms": 100.0, "tpot_mean_ms": 40.0, "stall_mean_ms": 50.0, "recovery_s": 0.0}
    results = [
        {"emulated": real, "simulated": {**real, "ttft_mean_ms": 105.0, "stall_mean_ms": 80.0, "recovery_s": 0.0}},
        {"emulated": real, "simulated": {**real, "tpot_mean_ms": None, "recovery_s": 40.0}},
    ]
    summary = sv.summarise(results)
    assert summary["pairs"] == 8  # 2 results x 4 metrics: none dropped
    assert (summary["within"], summary["miss"], summary["zero_vs_nonzero"], summary["both_zero"]) == (4, 1, 1, 1)
    assert summary["missing"] == 1 and summary["misses"] == 3
    assert summary["text"] == (
        "4 of 8 pairs within 10 % of a nonzero emulated figure; 1 off by more than 10 % (misses); "
        "1 zero vs nonzero (misses); 1 both zero; 1 missing (misses)"
    )


def test_a_missing_figure_is_said_to_be_missing():
    result = copy.deepcopy(committed()["results"][0])
    result["simulated"]["stall_mean_ms"] = None
    assert sv.explain(result)["stall_mean_ms"] == "interrupted stall: no figure on the simulated side"


def committed() -> dict:
    return json.loads((RESULTS / "sim_validation.json").read_text())


def labelled_as_before(node):
    """A rescored file's contents with the old side labels and no scores: what the benchmark wrote before."""
    if isinstance(node, dict):
        old = {"emulated": "measured-real", "simulated": "measured-simulated"}
        return {old.get(k, k): labelled_as_before(v) for k, v in node.items() if k != "scoring"}
    if isinstance(node, list):
        return [labelled_as_before(v) for v in node]
    return node


def test_the_committed_results_count_every_pair_and_say_what_the_real_side_is():
    data = committed()
    results = data["results"]
    summary = data["scoring"]
    assert summary["pairs"] == len(results) * len(sv.COMPARED)  # M counts every pair in the results
    assert data["within_goal"].startswith(f"{summary['within']} of {summary['pairs']} pairs within 10 %")
    assert {**summary, "text": data["within_goal"]} == sv.summarise(results)
    for r in results:
        assert r["scoring"] == sv.scores(r["emulated"], r["simulated"])
        assert r["within_goal"] == {key: score == sv.WITHIN for key, score in r["scoring"].items()}
    text = json.dumps({k: v for k, v in data.items() if k != "provenance"})  # the provenance names the old labels
    assert "measured-real" not in text and "measured-simulated" not in text and "modelled-simulated" not in text
    assert "emulated cluster" in data["real_side"] and "not GPU timings" in data["real_side"]
    assert provenance.check_kinds(data["provenance"]["kinds"])["results[].emulated"] == "measured"
    assert data["provenance"]["kinds"]["results[].simulated"] == "simulated"
    rescored = data["provenance"]["rescored"]
    assert rescored["within_goal_before"] == "22 of 28 figures" and rescored["commit"] and rescored["date"]
    assert data["table"] == sv.table(results).splitlines()


def test_rescoring_keeps_every_figure_and_relabels_the_sides():
    data = committed()
    before = labelled_as_before(data)
    before.pop("provenance")
    for key in ("real_side", "scoring_rules", "derived"):
        before.pop(key)
    before["within_goal"] = "22 of 28 figures"
    for r in before["results"]:  # the old scoring: 0 against 0 within the goal
        r["within_goal"] = {
            k: v or r["measured-real"][k] == r["measured-simulated"][k] == 0 for k, v in r["within_goal"].items()
        }

    again = sv.rescore(before, "python -m benchmarks.sim_validation --rescore x")

    assert again["results"] == data["results"]
    assert {k: v for k, v in again.items() if k != "provenance"} == {k: v for k, v in data.items() if k != "provenance"}
    assert again["provenance"]["rescored"]["within_goal_before"] == "22 of 28 figures"
    assert again["provenance"]["kinds"] == sv.KINDS
    # Rescoring a rescored file changes nothing but the date of the rescoring.
    twice = sv.rescore(again, "python -m benchmarks.sim_validation --rescore x")
    assert twice["results"] == again["results"] and twice["within_goal"] == again["within_goal"]
    assert twice["provenance"]["rescored"]["within_goal_before"] == "22 of 28 figures"
