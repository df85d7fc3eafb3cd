"""Where a results file's figures come from: the one record every benchmark writes beside its figures.

A figure is only as good as what can be said about it: the code it ran (the commit, and whether the tree held
changes besides), when, on what host (its CPU, cores, memory and a reference-loop time, so that two hosts can be
compared), the exact command and how long it took, and for each figure its kind:

- ``measured``: a run of the real processes here;
- ``simulated``: the simulator (recovery.sim);
- ``modelled``: arithmetic on inputs, the roofline included;
- ``input``: a parameter the run was given.
"""

import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

KINDS = ("measured", "simulated", "modelled", "input")
BASE_DIR = Path(__file__).resolve().parent.parent
REFERENCE_LOOP_N = 1_000_000


class ProvenanceError(ValueError):
    pass


def reference_loop_ms(n: int = REFERENCE_LOOP_N, repeats: int = 3) -> float:
    """The best of `repeats` times of a fixed pure-Python loop, in ms: one core's speed, to set two hosts side by
    side (the same loop took so long here and so long there)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        total = 0
        for i in range(n):
            total += i * i
        best = min(best, time.perf_counter() - started)
    return round(best * 1000, 1)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def host() -> dict:
    """The machine a run ran on."""
    return {
        "name": platform.node(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "reference_loop_ms": reference_loop_ms(),
    }


def code(repo: Path = BASE_DIR) -> dict:
    """The commit the code is at and whether the tracked files differ from it (`dirty`); both None outside a git
    checkout (an unpacked archive, say)."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": sha, "dirty": bool(changes)}


def check_kinds(kinds: Mapping[str, str]) -> dict[str, str]:
    """`kinds` (figure → kind), each kind one of KINDS; the error names the figure and what is allowed."""
    for figure, kind in kinds.items():
        if kind not in KINDS:
            raise ProvenanceError(f"figure {figure!r}: kind {kind!r} is not one of {', '.join(KINDS)}")
    return dict(kinds)


def command_line(argv: Sequence[str], repo: Path = BASE_DIR) -> str:
    """`argv` as a command to type again from the repository's root: a module run with ``-m`` (its argv[0] is the
    file) written back as ``python -m package.module``."""
    argv = list(argv)
    if argv and argv[0].endswith(".py"):
        path = Path(argv[0]).resolve()
        if path.is_relative_to(repo):
            module = ".".join(path.relative_to(repo).with_suffix("").parts)
            argv[:1] = ["python", "-m", module]
    return shlex.join(argv)


def record(
    kinds: Mapping[str, str] | None,
    started: float,
    command: Sequence[str] | None = None,
    repo: Path = BASE_DIR,
) -> dict:
    """The provenance of a run that began at `started` (time.monotonic()) and ends now: code, date (UTC), host,
    command (this process's argv unless given), wall time, and each figure's kind (None: not labelled yet)."""
    return {
        **code(repo),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": host(),
        "command": command_line(sys.argv if command is None else command, repo),
        "wall_s": round(time.monotonic() - started, 1),
        "kinds": None if kinds is None else check_kinds(kinds),
    }
