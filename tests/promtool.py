"""promtool for the tests, from Debian's `prometheus` package, downloaded and unpacked, never installed.

Installing the package would start a Prometheus server; `apt-get download` fetches the .deb into a cache folder
and `dpkg-deb -x` unpacks it there, once: later runs find usr/bin/promtool in the cache. Where apt-get or dpkg-deb
is missing, or the download fails (no network, no package lists), the tests that need promtool are skipped with
the reason.
"""

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lifeline" / "promtool"
BINARY = CACHE / "root" / "usr" / "bin" / "promtool"


def promtool() -> Path:
    """The path of a working promtool, fetched on first use; skips the calling test where it cannot be had."""
    if BINARY.exists():
        return BINARY
    missing = [tool for tool in ("apt-get", "dpkg-deb") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"promtool tests need Debian's apt-get and dpkg-deb to fetch promtool; missing: {missing}")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download when several test processes start at once
        if not BINARY.exists():
            _download()
    return BINARY


def _download() -> None:
    for old in CACHE.glob("prometheus_*.deb"):
        old.unlink()
    fetched = subprocess.run(
        ["apt-get", "download", "prometheus"], cwd=CACHE, capture_output=True, text=True, timeout=300
    )
    debs = sorted(CACHE.glob("prometheus_*.deb"))
    if fetched.returncode != 0 or not debs:
        pytest.skip(
            "could not fetch promtool with `apt-get download prometheus` (run `apt-get update`, or check the "
            f"network): {(fetched.stderr or fetched.stdout).strip()[-500:]}"
        )
    unpacked = CACHE / "root.partial"
    shutil.rmtree(unpacked, ignore_errors=True)
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(unpacked)], check=True, capture_output=True, timeout=300)
    shutil.rmtree(CACHE / "root", ignore_errors=True)
    unpacked.rename(CACHE / "root")  # whole or not at all: a run killed half-way leaves no broken binary behind
    debs[-1].unlink()


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(promtool()), *args], cwd=cwd, capture_output=True, text=True, timeout=300)
