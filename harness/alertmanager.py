"""Alertmanager and amtool for the tests, from Debian's `prometheus-alertmanager` package (harness/debian.py:
downloaded and unpacked, never installed, since installing it would start an Alertmanager as a system service).

Debian's build reads its notification templates from /usr/share/prometheus/alertmanager, which an unpacked
package does not fill: the server runs in a mount namespace of its own (unshare, as root) where the package's
/usr/share is laid over the machine's (a read-only overlay), so nothing is written outside the cache."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from harness import debian

PACKAGES = ["prometheus-alertmanager"]
OVERLAY = 'mount -t overlay overlay -o "lowerdir=$1:/usr/share" /usr/share && shift && exec "$@"'


def amtool() -> Path:
    """The path of amtool, fetched on first use; skips the calling test where it cannot be had."""
    return debian.tool("alertmanager", PACKAGES, "usr/bin/amtool")


def check_config(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(amtool()), "check-config", str(path)], capture_output=True, text=True, timeout=120)


def server_argv(*args: str) -> list[str]:
    """The command line that runs the Alertmanager server with `args`, its templates where it reads them; skips
    the calling test where that cannot be arranged (not root, or no unshare)."""
    binary = debian.tool("alertmanager", PACKAGES, "usr/bin/prometheus-alertmanager")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("Debian's Alertmanager reads its templates from /usr/share: running it needs root and unshare")
    share = next(p for p in binary.parents if p.name == "root") / "usr" / "share"
    return ["unshare", "--mount", "sh", "-c", OVERLAY, "sh", str(share), str(binary), *args]
