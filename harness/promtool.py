"""promtool for the tests, from Debian's `prometheus` package (harness/debian.py: downloaded and unpacked, never
installed, since installing it would start a Prometheus server)."""

import subprocess
from pathlib import Path

from harness import debian


def promtool() -> Path:
    """The path of a working promtool, fetched on first use; skips the calling test where it cannot be had."""
    return debian.tool("promtool", ["prometheus"], "usr/bin/promtool")


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(promtool()), *args], cwd=cwd, capture_output=True, text=True, timeout=300)
