"""Outside tools for the tests, from Debian's packages, downloaded and unpacked, never installed.

Installing `prometheus` or `haproxy` would start a server; `apt-get download` fetches the .debs into a cache folder
and `dpkg-deb -x` unpacks them there, once: later runs find the binary in the cache. Where apt-get or dpkg-deb is
missing, or the download fails (no network, no package lists), the tests that need the tool are skipped with the
reason.
"""

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lifeline"
LIBRARIES = Path("usr/lib/x86_64-linux-gnu")


def tool(name: str, packages: list[str], binary: str) -> Path:
    """The path of `binary` (relative to the unpacked root) from `packages`, fetched on first use into
    ~/.cache/lifeline/<name>; skips the calling test where it cannot be had."""
    cache = CACHE / name
    path = cache / "root" / binary
    if path.exists():
        return path
    missing = [t for t in ("apt-get", "dpkg-deb") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{name} tests need Debian's apt-get and dpkg-deb to fetch {name}; missing: {missing}")
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download when several test processes start at once
        if not path.exists():
            _download(cache, packages)
    return path


def env(root_binary: Path) -> dict[str, str]:
    """An environment in which an unpacked binary finds the libraries unpacked beside it."""
    root = next(p for p in root_binary.parents if p.name == "root")
    return {**os.environ, "LD_LIBRARY_PATH": str(root / LIBRARIES)}


def _download(cache: Path, packages: list[str]) -> None:
    for old in cache.glob("*.deb"):
        old.unlink()
    fetched = subprocess.run(["apt-get", "download", *packages], cwd=cache, capture_output=True, text=True, timeout=300)
    debs = sorted(cache.glob("*.deb"))
    if fetched.returncode != 0 or len(debs) < len(packages):
        pytest.skip(
            f"could not fetch with `apt-get download {' '.join(packages)}` (run `apt-get update`, or check the "
            f"network): {(fetched.stderr or fetched.stdout).strip()[-500:]}"
        )
    unpacked = cache / "root.partial"
    shutil.rmtree(unpacked, ignore_errors=True)
    for deb in debs:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], check=True, capture_output=True, timeout=300)
    shutil.rmtree(cache / "root", ignore_errors=True)
    unpacked.rename(cache / "root")  # whole or not at all: a run killed half-way leaves no broken binary behind
    for deb in debs:
        deb.unlink()
