"""python -m recovery.sim scenario.json [--policy P ...] [--seed N ...] [--window S] [--json out.json] [--per-request]

Runs every placement policy of the scenario (or those named) on every seed (or those named), each against the
same requests and faults and its own no-failure baseline, and prints one table row per run.
"""

import argparse
import json
import sys

from recovery.policy.placement import POLICIES
from recovery.sim.errors import ScenarioError
from recovery.sim.experiment import run_all, table
from recovery.sim.metrics import WINDOW_S, check_window
from recovery.sim.scenario import load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recovery.sim", description=__doc__.splitlines()[2])
    parser.add_argument("scenario", help="a scenario JSON file (recovery/sim/scenario.py describes it)")
    parser.add_argument("--policy", action="append", choices=POLICIES, help="run this policy (repeatable)")
    parser.add_argument("--seed", action="append", type=int, help="run this seed (repeatable)")
    parser.add_argument(
        "--window", type=float, default=WINDOW_S, help=f"seconds per latency window for recovery time ({WINDOW_S:g})"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the runs' figures as JSON here")
    parser.add_argument("--per-request", action="store_true", help="with --json: every request's figures too")
    parser.add_argument(
        "--step", action="store_true", help="simulate every step (the reference) instead of the fast path's decode runs"
    )
    args = parser.parse_args(argv)
    try:
        scenario = load(args.scenario)
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        check_window(args.window)
    except ValueError as exc:
        parser.error(f"--window: {exc}")
    results = run_all(
        scenario,
        tuple(args.policy) if args.policy else None,
        tuple(args.seed) if args.seed else None,
        args.window,
        fast=not args.step,
    )
    title = scenario.name or args.scenario
    print(f"{title}: {len(scenario.nodes)} nodes, {scenario.duration_s:g} s")
    print(table(results))
    for result in results:
        m = result.metrics
        if m.skipped_faults:
            print(f"  {m.policy} seed {m.seed}: {m.skipped_faults} fault(s) of a kind not simulated")
        for fault in result.metrics.faults:
            methods = ", ".join(f"{k} {v}" for k, v in fault.by_method.items()) or "none"
            moved = "moved off" if fault.kind == "sdc" else "interrupted"
            corrupt = f", {fault.possibly_corrupt} possibly corrupt" if fault.kind == "sdc" and fault.nodes else ""
            print(
                f"  {result.metrics.policy} seed {result.metrics.seed}: {fault.kind} {fault.target} at "
                f"{fault.at_s:.1f} s, out of routing at {fault.detected_s:.1f} s, {fault.interrupted} {moved} "
                f"({methods}){corrupt}, back within 10 % of the baseline at "
                + ("n/a (not within the run)" if fault.recovered_at_s is None else f"{fault.recovered_at_s:.1f} s")
            )
        for model, seconds in m.seconds_at_level.items():
            at_levels = ", ".join(f"level {level} {s:.0f} s" for level, s in seconds.items())
            print(f"  {m.policy} seed {m.seed}: {model} at {at_levels}")
        for pairing in m.assist["by_pairing"]:
            ended = "the end" if pairing["ended_s"] is None else f"{pairing['ended_s']:.1f} s"
            print(
                f"    {pairing['draft']}'s draft model assisted {pairing['survivor']} "
                f"from {pairing['started_s']:.1f} s to {ended}: {pairing['assist_steps']} steps, "
                f"{pairing['draft_proposed']} tokens drafted, "
                f"{pairing['draft_accepted']} accepted (modelled: each accepted at the draft agreement "
                f"α = {pairing['agreement']['value']:g}, an input)"
            )
        if m.shed_by_tier:
            shed = ", ".join(f"{tier} {n}" for tier, n in m.shed_by_tier.items())
            print(f"  {m.policy} seed {m.seed}: refused by a degradation level (429/503), by tier: {shed}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump([r.to_json(args.per_request) for r in results], out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
