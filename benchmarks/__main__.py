"""Every benchmark rerun by one command (issue 42, item 2).

    python -m benchmarks all [--quick] [--only NAME ...] [--skip NAME ...] [--dry-run]

PLAN lists every benchmark: the module it runs, the arguments of its full form (those its results file records, or
the module's defaults where the file records none), the arguments of its quick form (the module's own `--quick`
where it has one, else smaller arguments chosen from its options), the results files each form writes, what it
needs from outside this repository, and whether it is heavy (it starts real processes: nodes, gateways, a whole
stack) or light (the simulator, arithmetic, one process).

`all` runs them one at a time, each as `python -m <module> <arguments>` from the repository's root with this
environment, in an order that keeps heavy runs apart: heavy and light alternate as far as the counts allow, the
analysis over the LUMEN results (lumen_comparisons) comes after every LUMEN experiment, and render (the documents'
figures from the results) comes last. It prints each run's start, wall time and exit status, goes on after a
failure, and exits 1 at the end listing the failures (a run that could not start for want of what it needs counts
as one). A results file written without a provenance record (chaos and recovery.sim.bench write their own JSON)
gets one (harness.provenance: commit, date, host, this command, its wall time) as soon as its run ends.
`--dry-run` prints the plan in its order, with the time each run took when its results file records that very
command, else an estimate, and runs nothing.

`--quick` runs the smaller forms. They write the same results files as the full forms (with their smaller figures)
and render then writes those figures into the documents: a quick run is a rehearsal, not one to commit
(`git checkout -- benchmarks/results README.md benchmarks/README.md docs` puts the committed ones back).
"""

import argparse
import fnmatch
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
RESULTS = BASE_DIR / "benchmarks" / "results"

HARNESS_REDIS = "REDIS_URL: its Redis when set, else one of its own"
OWN_STACK = "its own embedded PostgreSQL and Redis (manage.py demo); REDIS_URL and DATABASE_URL are not used"


@dataclass(frozen=True)
class Bench:
    name: str
    module: str
    full: tuple[str, ...]  # the full form's arguments, as its results file records them (or the module's defaults)
    quick: tuple[str, ...] | None  # the quick form's arguments; None: left out of --quick (quick_note says why)
    outputs: tuple[str, ...]  # the results files the full form writes, under benchmarks/results/
    heavy: bool  # starts real processes (nodes, gateways, a stack); light: the simulator, arithmetic, one process
    estimate_s: float  # the full form's time, where no results file records it for these very arguments
    quick_estimate_s: float = 0.0
    quick_outputs: tuple[str, ...] | None = None  # None: the same files as the full form; (): it writes none
    quick_note: str = ""  # where the quick form comes from
    needs: tuple[str, ...] = ()  # what it needs from outside (environment, tools, the network)
    requires: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (variable, prefixes): not run unless one matches

    def args(self, quick: bool) -> tuple[str, ...] | None:
        return self.quick if quick else self.full

    def writes(self, quick: bool) -> tuple[str, ...]:
        if quick and self.quick_outputs is not None:
            return self.quick_outputs
        return self.outputs

    def command(self, quick: bool) -> list[str]:
        """The command as one types it again from the repository's root (harness.provenance's form)."""
        return ["python", "-m", self.module, *(self.args(quick) or ())]

    def missing(self, env) -> str | None:
        """What this environment lacks for the run, or None."""
        for variable, prefixes in self.requires:
            if not env.get(variable, "").startswith(prefixes):
                return f"needs {variable}={prefixes[0]}…"
        return None


def _lumen(
    name: str, full: str, estimate_s: float, quick: str | None = None, quick_estimate_s: float = 60.0, **extra
) -> Bench:
    """A LUMEN experiment of recovery.sim.lumen (the simulator): its quick form is the module's own --quick with 2
    seeds (the fewest a confidence interval takes), at the full form's --jobs."""
    args = tuple(full.split())
    if quick is None:
        rate = ("--rate", args[args.index("--rate") + 1]) if "--rate" in args else ()
        jobs = ("--jobs", args[args.index("--jobs") + 1]) if "--jobs" in args else ()
        quick_args: tuple[str, ...] | None = (args[0], *rate, "--quick", "--seeds", "2", *jobs)
        note = "the module's --quick (shorter runs, fewer sizes), 2 seeds"
    else:
        quick_args = tuple(quick.split()) or None  # "": left out of --quick
        note = extra.pop("quick_note")
    return Bench(
        name=f"lumen_{name}",
        module="recovery.sim.lumen",
        full=args,
        quick=quick_args,
        outputs=(f"lumen_{name}.json",),
        heavy=False,
        estimate_s=estimate_s,
        quick_estimate_s=quick_estimate_s,
        quick_note=note,
        **extra,
    )


def _bench(name: str, full: str, quick: str | None, heavy: bool, estimate_s: float, quick_estimate_s: float, **kw):
    return Bench(
        name=name,
        module=kw.pop("module", f"benchmarks.{name}"),
        full=tuple(shlex.split(full)),
        quick=None if quick is None else tuple(shlex.split(quick)),
        outputs=kw.pop("outputs", (f"{name}.json",)),
        heavy=heavy,
        estimate_s=estimate_s,
        quick_estimate_s=quick_estimate_s,
        **kw,
    )


CHOSEN = "arguments chosen here from its options"

# The order within each kind is the order the runs take (see `order`): heavy runs from the short to the long
# soaks; light runs with the LUMEN experiments before their analysis. Estimates (seconds) are readings of the
# arguments (durations, counts, the docstrings' times) where no results file records the run's wall time.
PLAN: tuple[Bench, ...] = (
    # --- heavy: real node processes, gateways, whole stacks ---------------------------------------------------------
    _bench("node_streams", "", "--streams 64 --seconds 5", True, 90, 25, quick_note=CHOSEN),
    _bench("checkpoint_overhead", "", "--streams 16 --seconds 5 --rounds 1", True, 120, 30, quick_note=CHOSEN),
    _bench("fleet", "", "--nodes 8 --seconds 10", True, 90, 30, quick_note=CHOSEN),
    _bench("restore", "", "--repeats 1", True, 40, 20, quick_note=CHOSEN),
    _bench("assist", "--seconds 8", "--seconds 2", True, 90, 45, quick_note=CHOSEN),
    _bench("herd", "", "--bursts 3 --gateways 2", True, 240, 60, quick_note=CHOSEN, needs=(HARNESS_REDIS,)),
    _bench(
        "recovery_kill",
        "",
        "--nodes 6 --streams 12 --rounds 1 --cold 1 --reprefill-kills 1 --retries 1 --gap 3",
        True,
        240,
        100,
        quick_note=CHOSEN + " (the suite's short form's sizes)",
        needs=(HARNESS_REDIS,),
    ),
    _bench("move_hop", "", "--moves 1 2 --rounds 1", True, 360, 60, quick_note=CHOSEN, needs=(HARNESS_REDIS,)),
    _bench(
        "drain_migration", "", "--streams 10 --max-tokens 300", True, 180, 90, quick_note=CHOSEN, needs=(OWN_STACK,)
    ),
    _bench("sdc_detection", "", "--rounds 1 --per-round 2", True, 360, 120, quick_note=CHOSEN, needs=(OWN_STACK,)),
    _bench(
        "canary_round", "", "--nodes 16 --interval 15 --rounds 1", True, 300, 120, quick_note=CHOSEN, needs=(OWN_STACK,)
    ),
    _bench(
        "console_scale",
        "",
        "--nodes 32 --changes 15 --loads 10 --heartbeat-interval 1",
        True,
        300,
        60,
        quick_note=CHOSEN,
        needs=(
            "its own embedded Redis and a SQLite file",
            "headless Chromium (LIFELINE_CHROMIUM or chromium on PATH) and playwright",
        ),
    ),
    _bench(
        "real_engine",
        "",
        "--kills 2 --streams 3 --duration 10",
        True,
        240,
        90,
        quick_note=CHOSEN,
        needs=(
            HARNESS_REDIS,
            "llama-server, built once per machine from llama-cpp-python's sdist (PyPI; cmake, g++; ~8 min on 2 cores)",
        ),
    ),
    _bench(
        "gateway_peers",
        "--rates 8,16,32,64 --seconds 10",
        "--rates 8 --seconds 3 --paths direct,lifeline --aiperf-rate 0",
        True,
        600,
        45,
        quick_note=CHOSEN + " (Lifeline's own paths only: no peer installed)",
        needs=(
            HARNESS_REDIS,
            "the peers (vllm-router, sglang-router, litellm[proxy], aiperf) installed from PyPI into "
            "~/.cache/lifeline/peers on first use; a peer that cannot be had is skipped with the reason",
        ),
    ),
    _bench("moe_failover", "", "--trials 1", True, 300, 90, quick_note=CHOSEN),
    _bench(
        "moe_fleet_steady",
        "--failures 0",
        "--failures 0 --aws 2 --ews 4 --streams 4 --steady-s 5 --no-static-baseline",
        True,
        300,
        120,
        module="benchmarks.moe_fleet",
        quick_note=CHOSEN,
        needs=(OWN_STACK,),
    ),
    _bench(
        "moe_fleet",
        "",
        "--aws 2 --ews 4 --failures 2 --streams 4 --steady-s 5 --settle-s 4 --no-static-baseline",
        True,
        1200,
        240,
        quick_note=CHOSEN,
        needs=(OWN_STACK,),
    ),
    _bench(
        "moe_fleet_no_shadows",
        "--no-shadows",
        "--no-shadows --aws 2 --ews 4 --failures 2 --streams 4 --settle-s 4",
        True,
        500,
        180,
        module="benchmarks.moe_fleet",
        quick_note=CHOSEN,
        needs=(OWN_STACK,),
    ),
    _bench(
        "policy_comparison",
        "",
        "--calibrate --calibrate-seconds 15",
        True,
        600,
        40,
        quick_outputs=(),
        quick_note="the module's --calibrate (one policy, no failure), shortened: prints, writes no results file",
        needs=(HARNESS_REDIS,),
    ),
    _bench(
        "sim_validation",
        "",
        "--quick",
        True,
        1500,
        150,
        quick_outputs=(),
        quick_note="the module's --quick (lifeline, 4 nodes, 45 s): prints, writes no results file",
        needs=(HARNESS_REDIS,),
    ),
    _bench(
        "chaos",
        "--minutes 30 --gap 45 --clients 6 --seed 7",
        "--minutes 1 --gap 4 --clients 6 --warmup 6 --settle 10 --seed 11",
        True,
        2000,
        180,
        quick_note="the suite's short form (tests/e2e/test_chaos_e2e.py)",
        needs=(
            "its own Redis; DATABASE_URL's PostgreSQL when it names one (a database of its own), else the embedded one",
        ),
    ),
    # --- light: the simulator, arithmetic, one process --------------------------------------------------------------
    _bench(
        "policies",
        "",
        "",
        False,
        60,
        60,
        quick_note="no options: the quick form is the full one (in-process, a minute)",
    ),
    _bench("placement", "", "--sizes 64 --duration 15", False, 160, 40, quick_note=CHOSEN),
    _bench(
        "sim_speed",
        "16 64 256 1000 --duration 30 --hour 64",
        "16 64 --duration 10",
        False,
        420,  # its runs' own wall times sum to 402 s
        15,
        module="recovery.sim.bench",
        quick_note=CHOSEN,
    ),
    _bench(
        "sim_policy_floor",
        "64 256 1000 --duration 30 --reference-up-to 0 --results benchmarks/results/sim_policy_floor.json",
        "64 --duration 10 --reference-up-to 0 --results benchmarks/results/sim_policy_floor.json",
        False,
        120,  # its runs' own wall times sum to 108 s
        10,
        module="recovery.sim.bench",
        quick_note=CHOSEN,
    ),
    _bench(
        "slo_rollup",
        "--outcomes 50000",
        "--outcomes 10000",
        False,
        60,
        20,
        quick_note=CHOSEN,
        needs=("DATABASE_URL: PostgreSQL when it names one (the recorded run's), else a SQLite file",),
    ),
    _bench(
        "slo_accuracy",
        "",
        "--minutes 90",
        False,
        60,
        30,
        quick_note=CHOSEN,
        needs=("a SQLite file of its own", "promtool (Debian's prometheus package, downloaded on first use)"),
    ),
    _bench(
        "slo_report",
        "",
        "--days 2 --runs 1",
        False,
        360,
        40,
        quick_note=CHOSEN,
        needs=("DATABASE_URL=postgres://… (PostgreSQL; a scratch database beside it)",),
        requires=(("DATABASE_URL", ("postgres://", "postgresql://")),),
    ),
    _lumen("table1", "table1 --seeds 10 --jobs 2", 158),
    _lumen("workers4", "workers4 --seeds 10 --jobs 2", 103),
    _lumen("workers8", "workers8 --seeds 10 --jobs 2", 192),
    _lumen("workers8_rate9", "workers8 --rate 9 --seeds 10 --jobs 1", 434),
    _lumen("workers8_rate10", "workers8 --rate 10 --seeds 10 --jobs 1", 688),
    _lumen("rack8", "rack8 --seeds 10 --jobs 2", 185),
    _lumen("ablations", "ablations --seeds 10 --jobs 2", 182),
    _lumen("grid", "grid --seeds 10 --jobs 2", 162),
    _lumen("sensitivity", "sensitivity --seeds 10 --jobs 2", 217),
    _lumen("spares", "spares --seeds 10 --jobs 2", 142),
    _lumen("resume", "resume --seeds 5", 494, quick_estimate_s=90),
    _lumen("scale", "scale --seeds 10 --jobs 2", 418, quick_estimate_s=90),
    _lumen(
        "scale_day_256",
        "scale --day --fleets 256 --seeds 5 --jobs 2",
        1045,
        quick="scale --day --fleets 32 --seeds 2 --jobs 2",
        quick_outputs=("lumen_scale_day_32.json",),
        quick_note=CHOSEN + ": days of 32 nodes (written to lumen_scale_day_32.json)",
    ),
    _lumen(
        "scale_day_1000",
        "scale --day --fleets 1000 --seeds 1 --jobs 2",
        6688,
        quick="",
        quick_note="left out of --quick: a day of 1,000 nodes takes hours; scale_day_256's quick form runs the same "
        "code on 32 nodes",
    ),
    _bench(
        "lumen_comparisons",
        "",
        "",
        False,
        1,
        1,
        quick_note="no options: the quick form is the full one (an analysis of the lumen_*.json there are)",
    ),
    _bench(
        "render",
        "",
        "",
        False,
        5,
        5,
        outputs=(),
        quick_note="no options: the quick form is the full one",
    ),
)

# Not in `all`: results files no entry of PLAN writes, and modules of benchmarks/ that are not benchmarks.
EXCLUDED_RESULTS = {
    "suite_time.json": "the test suite's own timing (python -m benchmarks.suite_time, from a .ci/run log or a run of "
    "the whole suite): not a benchmark of the product, and a run of `all` would measure a machine busy with it",
}
NOT_BENCHMARKS = {
    "__main__": "this runner",
    "common": "shared pieces: nodes, a streaming load, save() with provenance",
    "harness": "the recovery benchmarks' cluster: nodes, a gateway, Redis",
    "opsstack": "the operations benchmarks' whole stack (manage.py demo)",
    "looplag_probe": "a probe run beside node_streams and policies (the machine's own wake-up lag)",
    "lumen_tables": "prints the README's LUMEN tables from the lumen results as Markdown; writes nothing",
    "suite_time": EXCLUDED_RESULTS["suite_time.json"],
}
LUMEN_ANALYSIS = "lumen_comparisons"
LAST = "render"


def by_name() -> dict[str, Bench]:
    return {b.name: b for b in PLAN}


def order(entries) -> list[Bench]:
    """The entries in the order they run: heavy and light alternately, starting with whichever kind has more (so
    two heavy runs are next to each other only once the light ones are used up), each kind in PLAN's order (which
    puts the LUMEN analysis after every LUMEN experiment), and render last."""
    entries = list(entries)
    last = [b for b in entries if b.name == LAST]
    heavy = [b for b in entries if b.heavy and b.name != LAST]
    light = [b for b in entries if not b.heavy and b.name != LAST]
    first, second = (light, heavy) if len(light) >= len(heavy) else (heavy, light)
    out: list[Bench] = []
    for i in range(len(first)):
        out.append(first[i])
        if i < len(second):
            out.append(second[i])
    return out + last


def select(quick: bool, only=(), skip=()) -> tuple[list[Bench], list[tuple[Bench, str]]]:
    """The entries to run, in order, and those left out with the reason."""
    names = list(by_name())
    for pattern in [*only, *skip]:
        if not fnmatch.filter(names, pattern):
            raise SystemExit(f"no benchmark named {pattern!r}: one of {', '.join(names)}")
    chosen, left = [], []
    for b in PLAN:
        if only and not any(fnmatch.fnmatchcase(b.name, p) for p in only):
            continue
        if any(fnmatch.fnmatchcase(b.name, p) for p in skip):
            left.append((b, "--skip"))
        elif quick and b.quick is None:
            left.append((b, b.quick_note))
        else:
            chosen.append(b)
    return order(chosen), left


def recorded(path: Path) -> tuple[str | None, float | None]:
    """The command and wall time a results file records (its provenance, or the top level of an older file)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, None
    if not isinstance(data, dict):
        return None, None
    prov = data.get("provenance") if isinstance(data.get("provenance"), dict) else {}
    command = prov.get("command") or data.get("command")
    wall = prov.get("wall_s", data.get("wall_s"))
    return (command if isinstance(command, str) else None), (wall if isinstance(wall, int | float) else None)


def module_args(command: str) -> tuple[str, tuple[str, ...]] | None:
    """(module, arguments) of a recorded `[VAR=… ][python] -m module args` command; None for any other shape."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    if "-m" not in words or words.index("-m") + 1 >= len(words):
        return None
    at = words.index("-m")
    return words[at + 1], tuple(words[at + 2 :])


def estimate(bench: Bench, quick: bool, results: Path | None = None) -> tuple[float, bool]:
    """Seconds the form takes and whether that is recorded: the wall time its results file records when that file
    was made by these very arguments, else the plan's estimate."""
    results = RESULTS if results is None else results
    for name in bench.writes(quick):
        command, wall = recorded(results / name)
        if command and wall is not None and module_args(command) == (bench.module, bench.args(quick)):
            return float(wall), True
    return (bench.quick_estimate_s if quick else bench.estimate_s), False


def duration(seconds: float) -> str:
    if seconds < 0.5:
        return "<1 s"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def show(command: list[str]) -> str:
    return shlex.join(command)


def dry_run(entries: list[Bench], left: list[tuple[Bench, str]], quick: bool, env) -> int:
    form = "quick" if quick else "full"
    print(f"python -m benchmarks all{' --quick' if quick else ''}: {len(entries)} runs ({form} forms), one at a time,")
    print("in this order (H: heavy, starts processes; L: light); nothing is run (--dry-run)")
    total = recorded_total = 0.0
    for i, b in enumerate(entries, 1):
        seconds, is_recorded = estimate(b, quick)
        total += seconds
        recorded_total += seconds if is_recorded else 0
        basis = "recorded" if is_recorded else "estimate"
        writes = ", ".join(b.writes(quick)) or "no results file"
        about = duration(seconds) if seconds < 0.5 else f"~{duration(seconds)}"
        print(f"{i:3d} {'H' if b.heavy else 'L'} {b.name:22s} {about} ({basis}); writes {writes}")
        print(f"        {show(b.command(quick))}")
        for need in b.needs:
            print(f"        needs: {need}")
        missing = b.missing(env)
        if missing:
            print(f"        not runnable in this environment: {missing}")
    print(f"total ~{duration(total)} ({duration(recorded_total)} of it as recorded in the results files)")
    for b, why in left:
        print(f"left out: {b.name} ({why})")
    if quick:
        print("--quick writes its smaller figures over benchmarks/results/ and render puts them in the documents")
    return 0


def stamp(paths: list[Path], command: list[str], started: float) -> list[Path]:
    """Give each results file without a provenance record one: these runs' commit, date, host, command and wall."""
    from harness import provenance

    done = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "provenance" not in data:
            record = provenance.record(None, started, command=command)
            path.write_text(json.dumps({"provenance": record, **data}, indent=2) + "\n")
            done.append(path)
    return done


def run(entries: list[Bench], left: list[tuple[Bench, str]], quick: bool, env) -> int:
    failures: list[str] = []
    n = len(entries)
    if quick:
        print("--quick: smaller forms, written over benchmarks/results/ (not to commit)", flush=True)
    began = time.monotonic()
    for i, b in enumerate(entries, 1):
        command = b.command(quick)
        missing = b.missing(env)
        if missing:
            print(f"[{i}/{n}] {b.name}: not run, it {missing}", flush=True)
            failures.append(f"{b.name}: not run, it {missing}")
            continue
        print(f"[{i}/{n}] {time.strftime('%H:%M:%S')} start {b.name}: {show(command)}", flush=True)
        outputs = [RESULTS / name for name in b.writes(quick)]
        since, started = time.time() - 1.0, time.monotonic()
        try:
            status = subprocess.run([sys.executable, "-m", b.module, *b.args(quick)], cwd=BASE_DIR, env=env).returncode
        except KeyboardInterrupt:
            print(f"[{i}/{n}] {b.name}: interrupted after {duration(time.monotonic() - started)}", flush=True)
            failures.append(f"{b.name}: interrupted")
            break
        except OSError as exc:
            status, why = None, f"could not start: {exc}"
        else:
            why = f"exit status {status}"
        wall = time.monotonic() - started
        written = [p for p in outputs if p.exists() and p.stat().st_mtime >= since]
        stamped = stamp(written, command, started)
        unwritten = [p.name for p in outputs if p not in written]
        print(f"[{i}/{n}] {b.name}: exit status {status} after {duration(wall)}", flush=True)
        for path in stamped:
            print(f"        provenance added to {path.name}", flush=True)
        if status != 0:
            failures.append(f"{b.name}: {why}")
        elif unwritten:
            failures.append(f"{b.name}: exit status 0 but did not write {', '.join(unwritten)}")
    print(f"{n} runs in {duration(time.monotonic() - began)}; {len(failures)} failed", flush=True)
    for b, why in left:
        print(f"left out: {b.name} ({why})")
    for failure in failures:
        print(f"FAILED {failure}")
    return 1 if failures else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    commands = p.add_subparsers(dest="command", required=True)
    everything = commands.add_parser("all", help="rerun every benchmark, one at a time")
    everything.add_argument("--quick", action="store_true", help="the smaller forms")
    everything.add_argument("--only", nargs="+", default=[], metavar="NAME", help="these only (shell patterns too)")
    everything.add_argument("--skip", nargs="+", default=[], metavar="NAME", help="all but these")
    everything.add_argument("--dry-run", action="store_true", help="print the plan in its order; run nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    entries, left = select(args.quick, args.only, args.skip)
    env = dict(os.environ)
    if args.dry_run:
        return dry_run(entries, left, args.quick, env)
    return run(entries, left, args.quick, env)


if __name__ == "__main__":
    sys.exit(main())
