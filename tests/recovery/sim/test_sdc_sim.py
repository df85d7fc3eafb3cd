"""Silent corruption in the simulator: the node answers on until its canaries find it, then its requests move off
live and those it served since its last good canary are named (recovery.sim.fleet, faults.detect)."""

import pytest

from recovery.sim import scenario as scenarios
from recovery.sim.faults import DetectionDefaults
from recovery.sim.fleet import Simulation, prompt_ids, sampling
from recovery.sim.metrics import run_metrics
from recovery.sim.workload import Request
from workers import catalog
from workers.core import EngineCore, Sequence, run_virtual

MODEL, GPU, TP = "Qwen3-32B", "H100-SXM", 2
D = DetectionDefaults()
RETRIES_S = (D.unhealthy_after - 1) * D.canary_retry_s  # the failed canary's two retries, 2 s apart
CANARY_MAX_S = 0.1  # one canary: a prefill of a few tokens and a decode step, well under this
FAULT_AT, REPAIR_S = 40.0, 20.0
LOAD_S = catalog.load_time_s(catalog.MODELS[MODEL])


def four_nodes(duration_s: float = 110, rate_rps: float = 9, **fault) -> scenarios.Scenario:
    sdc = {"at_s": FAULT_AT, "kind": "sdc", "target": "a-2", "repair_s": REPAIR_S, **fault}
    return scenarios.parse(
        {
            "duration_s": duration_s,
            "fleet": [{"name": "a", "count": 4, "model": MODEL, "gpu": GPU, "tp": TP}],
            "workload": {"rate_rps": rate_rps},
            "faults": {"per_1000_node_days": 0, "scripted": [sdc]},
        }
    )


class Logged(Simulation):
    """A step-by-step run that notes the node each token came from, and when."""

    def __init__(self, *args, **kwargs):
        self.tokens_from: list[tuple[str, str, float]] = []  # (request, node, time)
        super().__init__(*args, **kwargs)

    def _token(self, flight, token):
        self.tokens_from.append((flight.request_id, flight.node, self.now))
        super()._token(flight, token)


def undisturbed(index: int, request: Request) -> list[int]:
    core = EngineCore(scenarios._deployment(MODEL, GPU, TP))
    seq = Sequence(f"r{index}", prompt_ids(index, request.prompt_tokens), sampling(request))
    run_virtual(core, [(0.0, seq)])
    return seq.generated


@pytest.fixture(scope="module")
def corrupt() -> Logged:
    """a-2 corrupts its answers from 40 s on; weights are checked on the way."""
    sim = Logged(four_nodes(), "lifeline", 1)
    sim.run(until=FAULT_AT)
    (record,) = sim.fault_records
    assert record.suspicious_s is not None
    sim.run(until=record.suspicious_s - 1e-6)
    assert sim.nodes["a-2"].weight == 1.0 and sim.nodes["a-2"].routable
    sim.run(until=record.suspicious_s + 1e-6)
    assert sim.nodes["a-2"].weight == 0.5 and sim.nodes["a-2"].routable  # SUSPICIOUS: half its share
    return sim.run()


def test_it_is_found_within_a_canary_interval_of_the_fault_plus_the_retries_and_the_canary_s_run(corrupt):
    (record,) = corrupt.fault_records
    delay = record.detected_s - FAULT_AT
    assert RETRIES_S < delay <= D.canary_interval_s + RETRIES_S + CANARY_MAX_S
    assert record.suspicious_s == pytest.approx(record.detected_s - RETRIES_S)
    # The round before the first failing canary passed: a whole interval before that canary.
    assert D.canary_interval_s + RETRIES_S < record.detected_s - record.last_good_canary_s
    assert record.detected_s - record.last_good_canary_s <= D.canary_interval_s + RETRIES_S + CANARY_MAX_S
    assert record.last_good_canary_s < FAULT_AT
    (fault,) = run_metrics(corrupt).faults
    assert fault.kind == "sdc" and fault.detection_s == pytest.approx(delay)


def test_until_then_it_serves_and_from_then_on_it_serves_nothing_until_it_is_back(corrupt):
    (record,) = corrupt.fault_records
    back_at = max(record.detected_s, FAULT_AT + REPAIR_S) + LOAD_S  # reset once found, repaired, reloaded
    from_a2 = [t for _, node, t in corrupt.tokens_from if node == "a-2"]
    assert any(FAULT_AT < t < record.detected_s for t in from_a2)  # answering, wrongly
    assert not any(record.detected_s < t < back_at for t in from_a2)
    starts = [start for f in corrupt.flights for node, start, _ in f.spans if node == "a-2"]
    assert not any(record.detected_s <= start < back_at for start in starts)
    assert any(start >= back_at for start in starts)  # serving again


def test_its_requests_in_flight_move_off_at_once_and_lose_no_token(corrupt):
    (record,) = corrupt.fault_records
    moved = [f for f in corrupt.flights if any(n == "a-2" and end == record.detected_s for n, _, end in f.spans)]
    assert len(moved) == record.interrupted >= 3
    assert sum(record.by_method.values()) == record.interrupted
    assert "transfer" in record.by_method  # their KV moved live where that was faster than re-prefilling
    for flight in moved:
        assert flight.interrupted_at == [record.detected_s] and flight.methods[-1] in ("transfer", "reprefill")
        assert flight.node != "a-2" and flight.finished_at is not None
        assert flight.generated == undisturbed(flight.index, flight.request), flight.request_id
    metrics = run_metrics(corrupt)
    assert metrics.transferred == record.by_method["transfer"]


def test_the_requests_named_possibly_corrupt_are_those_it_served_since_its_last_good_canary(corrupt):
    (record,) = corrupt.fault_records
    since, until = record.last_good_canary_s, record.detected_s
    got_a_token = {rid for rid, node, t in corrupt.tokens_from if node == "a-2" and since <= t <= until}
    still_there = {f.request_id for f in corrupt.flights if f.interrupted_at == [until]}
    expected = got_a_token | still_there
    assert len(expected) > len(still_there) > 0
    assert set(record.possibly_corrupt) == expected
    assert {f.request_id for f in corrupt.flights if f.possibly_corrupt} == expected
    metrics = run_metrics(corrupt)
    assert metrics.possibly_corrupt == metrics.faults[0].possibly_corrupt == len(expected)


def test_the_detection_delay_is_drawn_per_seed_and_the_same_for_the_same_seed():
    scenario = four_nodes(duration_s=60, rate_rps=1)
    delays = []
    for seed in (1, 2, 3, 4):
        sim = Simulation(scenario, "lifeline", seed, fast=True).run()
        (record,) = sim.fault_records
        delays.append(record.detected_s - FAULT_AT)
    assert len(set(delays)) == 4
    assert all(RETRIES_S < d <= D.canary_interval_s + RETRIES_S + CANARY_MAX_S for d in delays)
    again = Simulation(scenario, "lifeline", 1, fast=True).run()
    assert again.fault_records[0].detected_s - FAULT_AT == delays[0]


def test_a_spare_takes_the_corrupt_node_s_place():
    scenario = scenarios.parse(
        {
            "duration_s": 60,
            "fleet": [{"name": "a", "count": 2, "model": MODEL, "gpu": GPU, "tp": TP, "spares": 1}],
            "workload": {"rate_rps": 2},
            "faults": {"per_1000_node_days": 0, "scripted": [{"at_s": 5.0, "kind": "sdc", "target": "a-1"}]},
        }
    )
    sim = Simulation(scenario, "lifeline", 1, fast=True).run()
    (record,) = sim.fault_records
    assert sim.nodes["a-1"].replaced_by == "a-spare-1"
    assert any(node == "a-spare-1" and start >= record.detected_s for f in sim.flights for node, start, _ in f.spans)
