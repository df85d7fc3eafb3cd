"""A scenario's runs: every policy on every seed, each against its no-failure baseline, and the table of them.

A caller that shows progress (the console's Experiments page) passes a `progress` callback: each simulation is
then advanced in PROGRESS_SLICES slices of simulated time, `Simulation.run(until=…)` one after the other (the same
events in the same order as one call), with the share done reported after each. The callback may raise to stop
the run there (the console's cancel does); the exception reaches the caller unchanged.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from recovery.sim.fleet import Simulation
from recovery.sim.metrics import WINDOW_S, RunMetrics, request_metrics, run_metrics
from recovery.sim.scenario import Scenario

PROGRESS_SLICES = 20  # per simulation: a few hundred checks for a console-sized experiment
RunProgress = Callable[[float], None]  # the share of this run done, 0 to 1
Progress = Callable[[float, str, int], None]  # the share of every run done, and the (policy, seed) under way


@dataclass
class RunResult:
    metrics: RunMetrics
    simulation: Simulation
    baseline: Simulation
    wall_s: float  # both runs, the faulted one and its baseline

    def to_json(self, per_request: bool = False) -> dict:
        data = self.metrics.to_json()
        data["wall_s"] = round(self.wall_s, 3)
        if per_request:
            data["requests_detail"] = [request_metrics(f).__dict__ for f in self.simulation.flights]
        return data


def _advance(sim: Simulation, progress: RunProgress | None, start: float, share: float) -> Simulation:
    """Run `sim` to its end; with `progress`, in slices up to the scenario's duration (then the requests still in
    flight), reporting `start` plus the part of `share` done after each."""
    if progress is None:
        return sim.run()
    horizon = sim.scenario.duration_s
    for i in range(1, PROGRESS_SLICES + 1):
        sim.run(until=horizon * i / PROGRESS_SLICES)
        progress(start + share * i / (PROGRESS_SLICES + 1))
    sim.run()
    progress(start + share)
    return sim


def run_one(
    scenario: Scenario,
    policy: str,
    seed: int,
    window_s: float = WINDOW_S,
    progress: RunProgress | None = None,
    fast: bool = True,
    **options,
) -> RunResult:
    """One policy on one seed: the scenario's faults, and the same requests without them for the baseline.
    `progress` hears the share done, the baseline being the first half. `fast` (the default) takes the simulator's
    fast path, whose figures are the step-by-step run's (Simulation's docstring); False steps every step.
    `options` go to both Simulations (a mechanism switched off, as `draft_assist=False`)."""
    started = time.perf_counter()
    requests = scenario.requests(seed)
    baseline = _advance(
        Simulation(scenario, policy, seed, faults=False, requests=requests, fast=fast, **options), progress, 0.0, 0.5
    )
    faulted = _advance(
        Simulation(scenario, policy, seed, requests=requests, fault_list=scenario.faults(seed), fast=fast, **options),
        progress,
        0.5,
        0.5,
    )
    wall = time.perf_counter() - started
    return RunResult(run_metrics(faulted, baseline, window_s), faulted, baseline, wall)


def run_all(
    scenario: Scenario,
    policies: tuple[str, ...] | None = None,
    seeds: tuple[int, ...] | None = None,
    window_s: float = WINDOW_S,
    progress: Progress | None = None,
    fast: bool = True,
) -> list[RunResult]:
    """Every (policy, seed) run, each seed's policies side by side on the same requests and faults. `progress`
    hears the share of all of them done and the run under way, each run an equal share."""
    runs = [(policy, seed) for seed in seeds or scenario.seeds for policy in policies or scenario.policies]
    results = []
    for i, (policy, seed) in enumerate(runs):
        reporter = None if progress is None else partial(_overall, progress, i, len(runs), policy, seed)
        results.append(run_one(scenario, policy, seed, window_s, reporter, fast))
    return results


def _overall(progress: Progress, index: int, count: int, policy: str, seed: int, done: float) -> None:
    progress((index + done) / count, policy, seed)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.0f}"


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


COLUMNS = (
    ("policy", 10),
    ("seed", 5),
    ("reqs", 6),
    ("done", 6),
    ("intr", 5),
    ("rest", 5),
    ("fetch", 5),
    ("repf", 5),
    ("TTFT ms mean", 12),
    ("p50", 6),
    ("p99", 7),
    ("TPOT ms mean", 12),
    ("p50", 5),
    ("p99", 5),
    ("stall ms mean", 13),
    ("max", 7),
    ("recovery s", 10),
    ("wall s", 7),
)


def table(results: list[RunResult]) -> str:
    """One row per run; recovery is each fault's time from detection back to within 10 % of the baseline."""
    lines = ["  ".join(name.rjust(width) for name, width in COLUMNS)]
    for result in results:
        m = result.metrics
        recovery = ",".join(_s(f.recovery_s) for f in m.faults if f.nodes) or "-"
        cells = (
            m.policy,
            str(m.seed),
            str(m.requests),
            str(m.finished),
            str(m.interrupted),
            str(m.restored),
            str(m.fetched),
            str(m.reprefilled),
            _ms(m.ttft_mean_s),
            _ms(m.ttft_p50_s),
            _ms(m.ttft_p99_s),
            _ms(m.tpot_mean_s),
            _ms(m.tpot_p50_s),
            _ms(m.tpot_p99_s),
            _ms(m.stall_mean_s),
            _ms(m.stall_max_s),
            recovery,
            f"{result.wall_s:.2f}",
        )
        lines.append("  ".join(cell.rjust(width) for cell, (_, width) in zip(cells, COLUMNS)))
    return "\n".join(lines)
