"""Prometheus for the tests, from Debian's `prometheus` package (harness/debian.py: downloaded and unpacked, never
installed, since installing it would start a Prometheus server; promtool comes from the same package), run with the
configuration Lifeline ships (prometheus/server/prometheus.yml) and its rule files (prometheus/*.yml)."""

import json
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from console.stack import BASE_DIR, free_port
from harness import debian
from harness.servers import Server

RULES = BASE_DIR / "prometheus"
CONFIG = RULES / "server" / "prometheus.yml"


def binary() -> Path:
    """The Prometheus server, fetched on first use; skips the calling test where it cannot be had."""
    return debian.tool("promtool", ["prometheus"], "usr/bin/prometheus")


def local_config(
    folder: Path, *, console: str, gateways: list[str], token: str, alertmanager: str | None, every_s: float = 1.0
) -> dict:
    """The shipped configuration with its addresses and secret file made local (the console and gateways as URLs,
    the console's token written in `folder`; no alerting without `alertmanager`), the repository's rule files, and
    scrapes and rule evaluations every `every_s` seconds."""
    config = yaml.safe_load(CONFIG.read_text())
    (folder / "lifeline-token").write_text(token)
    console_url = urllib.parse.urlsplit(console)
    config["global"].update(scrape_interval=f"{every_s:g}s", evaluation_interval=f"{every_s:g}s")
    config["global"]["external_labels"]["lifeline_console"] = console.rstrip("/")
    config["rule_files"] = [str(RULES / "*.yml")]
    if alertmanager is None:
        del config["alerting"]
    else:
        config["alerting"]["alertmanagers"][0]["static_configs"] = [
            {"targets": [urllib.parse.urlsplit(alertmanager).netloc]}
        ]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    control = jobs["lifeline-control-plane"]
    control["static_configs"] = [{"targets": [console_url.netloc]}]
    control["authorization"]["credentials_file"] = str(folder / "lifeline-token")
    jobs["lifeline-gateway"]["static_configs"] = [{"targets": [urllib.parse.urlsplit(g).netloc for g in gateways]}]
    discovery = jobs["lifeline-node"]["http_sd_configs"][0]
    discovery.update(url=console.rstrip("/") + "/api/prometheus/targets", refresh_interval=f"{every_s:g}s")
    discovery["authorization"]["credentials_file"] = str(folder / "lifeline-token")
    return config


def start(folder: Path, config: dict) -> Server:
    """Prometheus on a free port with `config`, its data in `folder`; ready (its rules loaded)."""
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    argv = [
        str(binary()),
        f"--config.file={path}",
        f"--storage.tsdb.path={folder / 'prometheus-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    return Server(
        "Prometheus", argv, f"http://127.0.0.1:{port}", folder / "prometheus.log", debian.env(binary())
    ).start()


def api(server: Server, path: str, **params) -> object:
    """Prometheus's HTTP API (`/api/v1/<path>`): its `data`, or AssertionError with its error."""
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"{server.url}/api/v1/{path}{query}", timeout=10) as answer:
        body = json.loads(answer.read())
    if body.get("status") != "success":
        raise AssertionError(f"Prometheus's {path}: {body}")
    return body["data"]


def firing(server: Server, name: str) -> list[dict]:
    """The alerts named `name` Prometheus has firing now (not pending)."""
    return [a for a in api(server, "alerts")["alerts"] if a["labels"]["alertname"] == name and a["state"] == "firing"]


def dashboard_gaps(server: Server, board: Path, since: float, rate_window: str = "4s") -> list[str]:
    """The panels of a Grafana dashboard's JSON whose queries, as Grafana sends them (every model; `rate_window` for
    $__rate_interval, four scrape intervals), return no series over [since, now]: "<dashboard> / <panel>: <query>"."""
    from console import dashboards

    empty = []
    for title, expr in dashboards.queries(json.loads(board.read_text())):
        query = expr.replace("$model", ".*").replace("$__rate_interval", rate_window)
        found = api(server, "query_range", query=query, start=since, end=time.time(), step=2)
        if not found["result"]:
            empty.append(f"{board.stem} / {title}: {query}")
    return empty
