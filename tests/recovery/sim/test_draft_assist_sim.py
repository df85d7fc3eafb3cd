"""Speculative draft assist in the simulator: a restarting node's draft model helps the most loaded survivor from
draft-ready until its full model is loaded.

Acceptance is drawn at the model pair's draft agreement α, a model parameter from workers.catalog: the acceptance
these tests check is the drawing's, not a measurement of a draft model."""

import pytest

from recovery.sim import scenario as scenarios
from recovery.sim.fleet import ASSIST_K, MAX_ASSISTED, Simulation, prompt_ids, sampling
from recovery.sim.metrics import ASSIST_KIND, assist_figures, request_metrics, run_metrics
from recovery.sim.workload import Request
from workers import catalog
from workers.core import COUNTED_TOKEN, EngineCore, Sequence
from workers.engine_api import EngineConfig

MODEL = "Qwen3-32B"
CRASH_AT, REPAIR_S = 3.0, 1.0
DRAFT_READY = CRASH_AT + REPAIR_S + catalog.load_time_s(catalog.MODELS[catalog.MODELS[MODEL].draft or ""])
MODEL_READY = CRASH_AT + REPAIR_S + catalog.load_time_s(catalog.MODELS[MODEL])
SEED = 1


def three_nodes(duration_s: float = 30) -> scenarios.Scenario:
    """Three Qwen3-32B nodes at 5 requests/s each; a-1 crashes at 3 s and restarts cold after a 1 s repair."""
    return scenarios.parse(
        {
            "duration_s": duration_s,
            "fleet": [{"name": "a", "count": 3, "model": MODEL, "gpu": "H100-SXM", "tp": 2, "rack": "rack-a"}],
            "workload": {"rate_rps": 15},
            "faults": {
                "per_1000_node_days": 0,
                "scripted": [{"at_s": CRASH_AT, "kind": "crash", "target": "a-1", "repair_s": REPAIR_S}],
            },
        }
    )


@pytest.fixture(scope="module")
def both_paths() -> tuple[Simulation, Simulation]:
    scenario = three_nodes()
    return Simulation(scenario, "lifeline", SEED).run(), Simulation(scenario, "lifeline", SEED, fast=True).run()


@pytest.fixture(scope="module")
def without_assist() -> Simulation:
    return Simulation(three_nodes(), "lifeline", SEED, fast=True, draft_assist=False).run()


def test_the_defaults_are_the_real_system_s():
    assert MAX_ASSISTED == EngineConfig().max_assisted
    assert ASSIST_K == 4  # recovery.actions.incidents.ASSIST_K, the harness's and the control API's default k


def test_a_cold_restart_assists_the_most_loaded_survivor_from_draft_ready_until_its_model_is_loaded():
    sim = Simulation(three_nodes(), "lifeline", SEED, fast=True)
    sim.run(until=DRAFT_READY - 0.01)
    assert sim.assists == []
    assert all(node.assist is None for node in sim.nodes.values())
    loads = {name: sim.l_hat(name) for name in ("a-2", "a-3")}
    sim.run(until=DRAFT_READY)
    [pairing] = sim.assists
    assert (pairing.draft, pairing.started_s) == ("a-1", pytest.approx(DRAFT_READY))
    assert pairing.survivor == max(sorted(loads), key=lambda name: loads[name])
    assert pairing.agreement == catalog.MODELS[MODEL].draft_agreement  # an input, from the catalog
    survivor = sim.nodes[pairing.survivor]
    assert survivor.assist is pairing
    sim.run(until=(DRAFT_READY + MODEL_READY) / 2)
    assert survivor.assist is pairing and pairing.counters["assist_steps"] > 50
    sim.run(until=MODEL_READY + 0.5)
    assert survivor.assist is None and pairing.ended_s == pytest.approx(MODEL_READY)
    after = dict(pairing.counters)
    sim.run()
    assert dict(pairing.counters) == after  # no step was assisted once the full model was loaded
    assert sim.nodes["a-1"].routable


def test_the_assisted_survivor_s_requests_finish_sooner_than_without_assist(both_paths, without_assist):
    _, assisted = both_paths
    [pairing] = assisted.assists
    survivor = pairing.survivor

    def on_survivor_in_the_window(sim: Simulation) -> set[int]:
        return {
            f.index
            for f in sim.flights
            if any(
                node == survivor and start < MODEL_READY and (end or 1e9) > DRAFT_READY for node, start, end in f.spans
            )
        }

    both = on_survivor_in_the_window(assisted) & on_survivor_in_the_window(without_assist)
    assert len(both) > 30
    finished_with = sum(assisted.flights[i].finished_at or 1e9 for i in both)
    finished_without = sum(without_assist.flights[i].finished_at or 1e9 for i in both)
    assert finished_with < finished_without
    tpot_with = [request_metrics(assisted.flights[i]).tpot_s or 0.0 for i in both]
    tpot_without = [request_metrics(without_assist.flights[i]).tpot_s or 0.0 for i in both]
    assert sum(tpot_with) < 0.8 * sum(tpot_without)


def test_without_draft_assist_nothing_is_paired(without_assist):
    assert without_assist.assists == []
    figures = run_metrics(without_assist).assist
    assert (figures["pairings"], figures["assisted_steps"], figures["drafted_tokens"]) == (0, 0, 0)


def test_drafted_tokens_are_accepted_at_the_draft_agreement(both_paths):
    """Each drafted token is drawn accepted with probability α, left to right: over many, accepted over tested is
    close to α (a check of the drawing, not a measurement)."""
    _, sim = both_paths
    figures = assist_figures(sim)
    assert figures["kind"] == ASSIST_KIND and "modelled" in figures["kind"]
    assert figures["tested_tokens"] > 10_000
    assert figures["acceptance"] == pytest.approx(catalog.MODELS[MODEL].draft_agreement, abs=0.02)
    # k drafts per assisted sequence step, which emits its accepted drafts and one more (fewer when it finishes).
    steps = sum(p.counters["assisted_sequence_steps"] for p in sim.assists)
    assert figures["drafted_tokens"] == ASSIST_K * steps
    assert steps < figures["assisted_tokens"] <= figures["accepted_tokens"] + steps


def test_the_fast_path_is_the_step_by_step_reference_with_assist(both_paths):
    reference, fast = both_paths
    assert assist_figures(fast) == assist_figures(reference)
    assert fast.steps_simulated == reference.steps_simulated
    assert fast.now == pytest.approx(reference.now)
    assert fast.events_processed < reference.events_processed
    for a, b in zip(fast.flights, reference.flights):
        assert (a.node, a.emitted, a.methods, a.holders, a.spans) == (b.node, b.emitted, b.methods, b.holders, b.spans)
        assert (a.first_token_s, a.last_token_s, a.finished_at) == (b.first_token_s, b.last_token_s, b.finished_at)


def test_the_reference_emits_the_undisturbed_stream_with_drafts(both_paths):
    """The step-by-step run computes its tokens: the assisted requests' streams are still the pure function's."""
    reference, _ = both_paths
    [pairing] = reference.assists
    flight = next(
        f
        for f in reference.flights
        if f.finished_at is not None
        and any(node == pairing.survivor and start > DRAFT_READY for node, start, _ in f.spans)
    )
    alone = EngineCore(catalog.Deployment.of(MODEL, "H100-SXM", 2))
    seq = Sequence(flight.request_id, prompt_ids(flight.index, flight.request.prompt_tokens), sampling(flight.request))
    alone.add(seq, 0.0)
    while (plan := alone.plan(0.0)) is not None:
        alone.apply(plan, 0.0)
    assert flight.generated == seq.generated


def test_a_core_that_counts_tokens_verifies_drafts_of_the_counted_token():
    core = EngineCore(catalog.Deployment.of(MODEL, "H100-SXM", 2), token_ids=False)
    request = Request(0.0, MODEL, 16, 20)
    seq = Sequence("r0", prompt_ids(0, 16), sampling(request))
    core.add(seq, 0.0)
    core.apply(core.plan(0.0), 0.0)  # the prefill and the first token
    plan = core.plan(0.0, lookahead=ASSIST_K)
    step = core.apply(plan, 0.1, {"r0": [COUNTED_TOKEN, COUNTED_TOKEN, COUNTED_TOKEN + 1, COUNTED_TOKEN + 1]})
    assert len(seq.generated) == 1 + 3  # two drafts accepted, and the verifier's own token
    assert (step.assist["draft_accepted"], step.assist["draft_tested"], step.assist["draft_proposed"]) == (2, 3, 4)
    assert seq.computed == seq.context_len - 1
