"""How long the whole suite takes (issue 41): `.ci/run` from a fresh clone of the committed code, timed, its two
phases' counts and times and its slowest tests kept in benchmarks/results/suite_time.json, one entry per run.

    python -m benchmarks.suite_time --label clean          a fresh clone of HEAD, nothing else running
    python -m benchmarks.suite_time --label loaded --hog   the same with a process spinning on one core throughout
    python -m benchmarks.suite_time --label clean --from-log LOG --commit SHA   a run made by hand, from its log

A run is a run of the real suite here: every figure is measured. The README's suite-time block is rendered from
the latest runs (benchmarks/render.py).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from harness import provenance

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "suite_time.json"
SUMMARY = re.compile(r"^=+ (?P<counts>.*?) in (?P<seconds>[\d.]+)s(?: \([\d:]+\))? =+$")
DURATION = re.compile(r"^(?P<seconds>[\d.]+)s (?P<when>setup|call|teardown) +(?P<test>\S+)$")
REAL = re.compile(r"^real\s+(?P<m>\d+)m(?P<s>[\d.]+)s$")
# pytest -v under xdist: "[gw1] [ 42%] PASSED tests/...::test_x", the worker that ran each test.
RAN_ON = re.compile(r"^\[(?P<worker>gw\d+)\] \[\s*\d+%\] (?:PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (?P<test>\S+)")
KINDS = {"runs[]": "measured"}


def phase(counts: str, seconds: str) -> dict:
    found = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", counts)}
    return {"seconds": float(seconds), **found}


def parse(log: str) -> dict:
    """A `.ci/run` log (with --durations, under `time`): each phase's counts and seconds, in order (parallel, then
    process), the slowest tests of each phase, and the whole run's wall time; with -v and --durations=0, each
    process-phase worker's test time and its largest modules (`by_worker`)."""
    phases, slowest, current, ran_on, on = [], [], [], [], {}
    total_s = None
    for line in log.splitlines():
        if match := DURATION.match(line):
            current.append({"test": match["test"], "when": match["when"], "seconds": float(match["seconds"])})
        elif match := RAN_ON.match(line):
            on[match["test"]] = match["worker"]
        elif match := SUMMARY.match(line):
            phases.append(phase(match["counts"], match["seconds"]))
            slowest.append(current)
            ran_on.append(on)
            current, on = [], {}
        elif match := REAL.match(line):
            total_s = int(match["m"]) * 60 + float(match["s"])
    if len(phases) != 2 or total_s is None:
        raise ValueError(f"not a whole `time .ci/run` log: {len(phases)} phase summaries, total {total_s}")
    names = ("parallel", "process")
    run = {
        "total_s": round(total_s, 1),
        "phases": dict(zip(names, phases)),
        "slowest": {name: tests[:30] for name, tests in zip(names, slowest)},
        "green": all(not p.get("failed") and not p.get("errors") and not p.get("error") for p in phases),
    }
    if ran_on[1]:
        run["by_worker"] = by_worker(slowest[1], ran_on[1])
    return run


def by_worker(durations: list[dict], ran_on: dict[str, str], modules: int = 10) -> dict:
    """Each worker's test time (setup, call and teardown of the tests it ran) and its largest modules: whether the
    phase is bound by one worker (the stacks') while the other waits. Complete only with --durations=0."""
    workers: dict[str, dict] = {}
    for entry in durations:
        worker = ran_on.get(entry["test"], "unknown")
        module = entry["test"].split("::", 1)[0]
        figures = workers.setdefault(worker, {"test_s": 0.0, "modules": {}})
        figures["test_s"] += entry["seconds"]
        figures["modules"][module] = figures["modules"].get(module, 0.0) + entry["seconds"]
    return {
        worker: {
            "test_s": round(f["test_s"], 1),
            "largest_modules": [
                {"module": m, "seconds": round(t, 1)}
                for m, t in sorted(f["modules"].items(), key=lambda item: -item[1])[:modules]
            ],
        }
        for worker, f in sorted(workers.items())
    }


def cpu_times() -> tuple[float, float]:
    """The machine's busy and total CPU time so far (/proc/stat's first line, in clock ticks)."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


class CpuSampler(threading.Thread):
    """The machine's CPU busy fraction, every `every_s` seconds through a run: whether a phase was bound by the
    cores or by waiting (timeouts, sleeps, I/O) says which cut can shorten it."""

    def __init__(self, every_s: float = 5.0):
        super().__init__(daemon=True)
        self.every_s, self.samples, self.halt = every_s, [], threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        last = cpu_times()
        while not self.halt.wait(self.every_s):
            current = cpu_times()
            busy, total = current[0] - last[0], current[1] - last[1]
            self.samples.append((round(time.monotonic() - start, 1), round(busy / total, 3) if total else 0.0))
            last = current

    def busy(self, since_s: float | None = None, until_s: float | None = None) -> float | None:
        """The mean busy fraction of the samples taken within [since_s, until_s] seconds of the start."""
        kept = [b for t, b in self.samples if (since_s is None or t >= since_s) and (until_s is None or t <= until_s)]
        return round(sum(kept) / len(kept), 3) if kept else None


def cpu_by_phase(sampler: CpuSampler, run: dict) -> dict:
    """Mean CPU busy per phase: the parallel phase runs first, the process phase is the last of the run (the
    engine preparation and the wait for it follow it only on a cold machine)."""
    total, process = run["total_s"], run["phases"]["process"]["seconds"]
    return {
        "every_s": sampler.every_s,
        "whole_run": sampler.busy(),
        "process_phase": sampler.busy(since_s=total - process, until_s=total),
        "parallel_phase": sampler.busy(until_s=run["phases"]["parallel"]["seconds"]),
    }


def run_suite(commit: str, hog: bool, sampler: CpuSampler | None = None) -> tuple[str, float]:
    """`.ci/run` from a fresh clone of `commit` under `time`; its log. With `hog`, a process spins on one core;
    with `sampler`, the machine's CPU use is sampled through the run."""
    with tempfile.TemporaryDirectory(prefix="lifeline-suite-") as work:
        clone = Path(work) / "lifeline"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "checkout", "-q", commit], cwd=clone, check=True)
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if hog else None
        started = time.monotonic()
        if sampler is not None:
            sampler.start()
        try:
            # Every test's time and the worker that ran it (-v): each process worker's load, not only the slowest.
            env = {**os.environ, "CI": "true", "PYTEST_ADDOPTS": "--durations=0 -v"}
            done = subprocess.run(
                ["bash", "-c", "time bash .ci/run"], cwd=clone, env=env, capture_output=True, text=True
            )
        finally:
            if spinner is not None:
                spinner.kill()
            if sampler is not None:
                sampler.halt.set()
        return done.stdout + done.stderr, time.monotonic() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="clean, loaded, cold or busy (other work beside it)")
    parser.add_argument("--hog", action="store_true", help="a process spinning on one core throughout")
    parser.add_argument("--from-log", type=Path, help="a run already made, from its log")
    parser.add_argument("--commit", help="the commit a --from-log run ran (default: HEAD)")
    parser.add_argument("--started", help="when a --from-log run began (ISO 8601, UTC)")
    parser.add_argument("--note", default="", help="anything else about the run")
    args = parser.parse_args(argv)
    started = time.monotonic()
    commit = subprocess.run(
        ["git", "rev-parse", args.commit or "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    began = args.started or datetime.now(UTC).isoformat(timespec="seconds")
    sampler = None
    if args.from_log:
        log = args.from_log.read_text()
    else:
        sampler = CpuSampler()
        log, _ = run_suite(commit, args.hog, sampler)
        kept = ROOT / "var" / f"suite-time-{args.label}-{began.replace(':', '')}.log"
        kept.parent.mkdir(exist_ok=True)
        kept.write_text(log)
        print(f"the run's log: {kept}")
    entry = {"label": args.label, "commit": commit, "began": began, "hog": args.hog, "host": provenance.host()}
    entry["host_read"] = "when its log was recorded, not during the run" if args.from_log else "at the run's end"
    if args.note:
        entry["note"] = args.note
    entry.update(parse(log))
    if sampler is not None and sampler.samples:
        entry["cpu_busy"] = cpu_by_phase(sampler, entry)  # the hog's own core is counted busy
    if not args.from_log:
        entry["command"] = provenance.command_line(sys.argv)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": []}
    data["runs"].append(entry)
    data["provenance"] = provenance.record(KINDS, started)
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    total = entry["total_s"]
    print(f"{args.label}: {'green' if entry['green'] else 'RED'}, {total / 60:.1f} min at {commit[:7]}")
    return 0 if entry["green"] else 1


if __name__ == "__main__":
    sys.exit(main())
