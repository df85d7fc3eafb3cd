"""How fast the simulator runs: python -m recovery.sim.bench [NODES ...] [--duration S] [--reference-up-to N]

For each fleet size, N Qwen3-32B nodes (2× H100 each) at 2.5 requests/s per node of Splitwise conversation
lengths, one crash halfway, policy lifeline, on the fast path (decode runs in closed form); and, up to
--reference-up-to nodes, the same run step by step, with the speed-up and a check that both gave every request
the same TTFT and TPOT. Each run is its own process, so its peak memory is its own. Prints events per second,
simulated seconds per wall second, steps and tokens per second and peak memory; writes
benchmarks/results/sim_speed.json. Figures, not tests: nothing is asserted about speed.

A run's simulated time ends when its last request does, long after the arrivals stop (the longest Splitwise
outputs take a minute to decode), and that tail is light work: simulated seconds per wall second over the whole
run flatter the simulator. The figure an hour is judged by is the steady state's: the wall time the run takes from
WARMUP_S to the end of the arrivals, under full load, read by running the simulation to WARMUP_S first and then
to the end of the arrivals (`Simulation.run(until=...)`, the same run). `hour_wall_min_modelled` is 3,600 s at that
rate; `--hour N` runs a whole simulated hour at N nodes, to check that model against a measurement.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from recovery.sim import scenario as scenarios
from recovery.sim.fleet import Simulation
from recovery.sim.metrics import request_metrics

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "sim_speed.json"
RATE_PER_NODE = 2.5
REFERENCE_UP_TO = 64  # nodes: the largest fleet also run step by step, by default
WARMUP_S = 10.0  # simulated seconds before the steady state is timed: the nodes' batches fill in the first few


def fleet_scenario(nodes: int, duration_s: float) -> scenarios.Scenario:
    return scenarios.parse(
        {
            "duration_s": duration_s,
            "fleet": [{"name": "a", "count": nodes, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2}],
            "workload": {"rate_rps": RATE_PER_NODE * nodes},
            "faults": {
                "per_1000_node_days": 0,
                "scripted": [{"at_s": duration_s / 2, "kind": "crash", "target": "a-1", "repair_s": 5}],
            },
        }
    )


def _timed(method: Callable, spent: list[float]) -> Callable:
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    return timed


def measure(nodes: int, duration_s: float, policy: str = "lifeline", seed: int = 1, fast: bool = True) -> dict:
    """One run in this process: its speed, and each request's (TTFT, TPOT) for comparing the two paths.

    The time spent in the gateway's own decisions (Simulation.choose and .place: recovery.policy's routing
    search and placement, and the holder ranking's upkeep a placement reads) is timed apart in the steady state:
    it is a floor no faster engine model can go below while the simulator decides as the gateway does."""
    scenario = fleet_scenario(nodes, duration_s)
    started = time.perf_counter()
    sim = Simulation(scenario, policy, seed, fast=fast)
    warm = min(WARMUP_S, duration_s / 3)
    sim.run(until=warm)
    policy_s = [0.0]
    sim.choose, sim.place = _timed(sim.choose, policy_s), _timed(sim.place, policy_s)  # type: ignore[method-assign]
    steady_from = time.perf_counter()
    sim.run(until=duration_s)
    steady_wall = time.perf_counter() - steady_from
    del sim.choose, sim.place  # the class's own methods again
    steady_requests = sum(1 for f in sim.flights if f.request.arrival_s >= warm)
    sim.run()
    wall = time.perf_counter() - started
    tokens = sum(f.emitted for f in sim.flights)
    latencies = [(m.ttft_s, m.tpot_s) for m in map(request_metrics, sim.flights)]
    return {
        "nodes": nodes,
        "path": "fast" if fast else "step",
        "requests": len(sim.flights),
        "tokens": tokens,
        "events": sim.events_processed,
        "steps": sim.steps_simulated,
        "simulated_s": sim.now,
        "wall_s": wall,
        "events_per_s": sim.events_processed / wall,
        "simulated_s_per_wall_s": sim.now / wall,
        # Under full load, from `warm` to the end of the arrivals: what an hour is judged by.
        "steady_window_s": [warm, duration_s],
        "steady_wall_s": steady_wall,
        "steady_simulated_s_per_wall_s": (duration_s - warm) / steady_wall,
        "steady_requests_per_wall_s": steady_requests / steady_wall,
        # The gateway's decisions in the steady state: per request, and their share of the wall time.
        "policy_us_per_request": policy_s[0] / steady_requests * 1e6,
        "policy_share": policy_s[0] / steady_wall,
        "steps_per_s": sim.steps_simulated / wall,
        "tokens_per_s": tokens / wall,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "interrupted": sum(1 for f in sim.flights if f.interrupted_at),
        "latencies": latencies,
    }


def _in_process(nodes: int, duration_s: float, fast: bool) -> dict:
    command = [sys.executable, "-m", "recovery.sim.bench", "--one", str(nodes), "--duration", str(duration_s)]
    out = subprocess.run(command + ([] if fast else ["--step"]), capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def _largest_error(fast: list, step: list) -> float:
    """The largest relative difference in any request's TTFT or TPOT between the two paths."""
    worst = 0.0
    for pair in zip(fast, step):
        for a, b in zip(*pair):
            if (a is None) != (b is None):
                return float("inf")
            if a is not None and b:
                worst = max(worst, abs(a - b) / b)
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recovery.sim.bench")
    parser.add_argument("nodes", nargs="*", type=int, default=[16, 64, 256, 1000])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals (default 30)")
    parser.add_argument(
        "--reference-up-to", type=int, default=REFERENCE_UP_TO, help="also run step by step up to this size"
    )
    parser.add_argument(
        "--hour",
        type=int,
        help="also run a whole simulated hour of arrivals at this many nodes (measured, not modelled)",
    )
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help=f"where to write the figures (default {RESULTS.name})"
    )
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a single run, printed as JSON
    parser.add_argument("--step", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.duration, fast=not args.step)))
        return
    rows = []
    for nodes in args.nodes:
        fast = _in_process(nodes, args.duration, True)
        row = {k: v for k, v in fast.items() if k != "latencies"}
        line = (
            f"{nodes:>5} nodes: {fast['requests']} requests, {fast['simulated_s']:.1f} simulated s in "
            f"{fast['wall_s']:.1f} wall s: {fast['simulated_s_per_wall_s']:.2f} simulated s per wall s over the run, "
            f"{fast['steady_simulated_s_per_wall_s']:.2f} in the steady state "
            f"({fast['steady_requests_per_wall_s']:,.0f} requests per wall s), "
            f"{fast['events_per_s']:,.0f} events/s, {fast['steps_per_s']:,.0f} steps/s, "
            f"{fast['tokens_per_s']:,.0f} tokens/s, peak {fast['peak_rss_mb']:.0f} MB; the gateway's decisions "
            f"{fast['policy_us_per_request']:.0f} µs per request ({fast['policy_share']:.0%} of the steady state)"
        )
        if nodes <= args.reference_up_to:
            step = _in_process(nodes, args.duration, False)
            row["step_by_step"] = {k: v for k, v in step.items() if k != "latencies"}
            row["speedup"] = step["wall_s"] / fast["wall_s"]
            row["largest_ttft_tpot_error"] = _largest_error(fast["latencies"], step["latencies"])
            line += (
                f"; step by step {step['wall_s']:.1f} wall s ({row['speedup']:.1f}× faster), largest per-request "
                f"TTFT/TPOT difference {row['largest_ttft_tpot_error']:.2%}"
            )
        # A simulated hour at the steady state's rate (modelled from the measured speed; the run itself is shorter).
        row["hour_wall_min_modelled"] = 3600 / fast["steady_simulated_s_per_wall_s"] / 60
        # Of which the gateway's decisions alone: an hour's requests at the measured cost per request.
        row["hour_policy_floor_min_modelled"] = RATE_PER_NODE * nodes * 3600 * fast["policy_us_per_request"] / 60e6
        rows.append(row)
        print(line, flush=True)
    hour = None
    if args.hour:
        run = _in_process(args.hour, 3600.0, True)
        hour = {k: v for k, v in run.items() if k != "latencies"}
        print(
            f"a simulated hour at {args.hour} nodes: {run['requests']:,} requests in {run['wall_s'] / 60:.1f} wall min "
            f"({run['steady_simulated_s_per_wall_s']:.2f} simulated s per wall s in the steady state)",
            flush=True,
        )
    result = {
        "what": "simulator speed: Qwen3-32B on 2x H100 per node, 2.5 req/s per node (Splitwise conversation), "
        "one crash halfway, policy lifeline; one process per run on one core of this machine",
        "command": "python -m recovery.sim.bench "
        + " ".join(map(str, args.nodes))
        + f" --duration {args.duration:g}"
        + (f" --hour {args.hour}" if args.hour else "")
        + (f" --reference-up-to {args.reference_up_to}" if args.reference_up_to != REFERENCE_UP_TO else "")
        + ("" if args.results == RESULTS else f" --results {args.results}"),
        "measured": "wall_s, events_per_s, simulated_s_per_wall_s (whole run, its light tail included), "
        "steady_simulated_s_per_wall_s and steady_requests_per_wall_s (full load, steady_window_s), "
        "policy_us_per_request and policy_share (Simulation.choose and .place, timed in the steady state), "
        "steps_per_s, "
        "tokens_per_s, peak_rss_mb, speedup, largest_ttft_tpot_error",
        "modelled": "hour_wall_min_modelled (3600 simulated s at the steady state's simulated s per wall s); "
        "hour_policy_floor_min_modelled (an hour's requests at the measured policy_us_per_request: the wall time "
        "the gateway's own routing and placement decisions take, whatever the engine model costs)",
        "goal": "a simulated hour of a 1,000-node fleet under load in under 10 minutes",
        "runs": rows,
        "hour_run": hour,
    }
    args.results.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
