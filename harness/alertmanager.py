"""Alertmanager and amtool for the tests, from Debian's `prometheus-alertmanager` package (harness/debian.py:
downloaded and unpacked, never installed, since installing it would start an Alertmanager as a system service).

Debian's build reads its notification templates from /usr/share/prometheus/alertmanager, which an unpacked
package does not fill: the server runs in a mount namespace of its own (unshare, as root) where the package's
/usr/share is laid over the machine's (a read-only overlay), so nothing is written outside the cache."""

import json
import os
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from console.stack import BASE_DIR, free_port
from harness import debian
from harness.servers import Server

PACKAGES = ["prometheus-alertmanager"]
OVERLAY = 'mount -t overlay overlay -o "lowerdir=$1:/usr/share" /usr/share && shift && exec "$@"'
CONFIG = BASE_DIR / "prometheus" / "alertmanager" / "alertmanager.yml"


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


def local_config(folder: Path, console: str, outside: str, token: str) -> dict:
    """The shipped configuration with its addresses and secret files made local (Lifeline's receiver at `console`,
    PagerDuty's and Slack's at `outside`), and its waits made short; the secrets written in `folder`."""
    config = yaml.safe_load(CONFIG.read_text())
    secrets = {"lifeline-token": token, "pagerduty-serving": "routing-serving", "pagerduty-moe": "routing-moe"}
    secrets["slack-serving"] = f"{outside}/slack/serving"
    for name, value in secrets.items():
        (folder / name).write_text(value)
    config["route"].update(group_wait="1s", group_interval="1s")
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = console.rstrip("/") + "/api/alerts/alertmanager"
            auth = hook["http_config"]["authorization"]
            auth["credentials_file"] = str(folder / "lifeline-token")
        for pager in receiver.get("pagerduty_configs", []):
            pager["routing_key_file"] = str(folder / pager["routing_key_file"].rsplit("/", 1)[1])
            pager["url"] = outside + "/v2/enqueue"
        for chat in receiver.get("slack_configs", []):
            chat["api_url_file"] = str(folder / chat["api_url_file"].rsplit("/", 1)[1])
    return config


def start(folder: Path, config: dict) -> Server:
    """Debian's Alertmanager on a free port with `config`, alone (no cluster peers), its files in `folder`; ready."""
    path = folder / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    argv = server_argv(
        f"--config.file={path}",
        f"--storage.path={folder / 'alertmanager-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",  # alone: no gossip with peers
    )
    return Server("Alertmanager", argv, f"http://127.0.0.1:{port}", folder / "alertmanager.log").start()


class StandIns:
    """PagerDuty's Events API v2 (`/v2/enqueue`), Slack's webhook and an on-call webhook, on one local server that
    records what each path was sent (`received`, by path) and answers as each service does."""

    def __init__(self):
        received: dict[str, list] = {}
        self.received = received

        class Recorder(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                received.setdefault(self.path, []).append(body)
                pagerduty = self.path.startswith("/v2")
                answer = b'{"status": "success", "dedup_key": "x"}' if pagerduty else b"ok"
                self.send_response(202 if pagerduty else 200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> "StandIns":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
