"""Shared pieces of the benchmarks: real node processes, a streaming load, results files."""

import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

from harness import provenance

BASE_DIR = Path(__file__).resolve().parent.parent
RESULTS = BASE_DIR / "benchmarks" / "results"
STARTED = time.monotonic()  # this process's start, near enough: the wall time a results file records
AGENT_TOKEN = "benchmark-agent-token"
HEAD = {"Authorization": f"Bearer {AGENT_TOKEN}"}


class Node:
    def __init__(self, name: str, *extra: str):
        env = {
            **os.environ,
            "LIFELINE_AGENT_TOKEN": AGENT_TOKEN,
            "PYTHONUNBUFFERED": "1",
            "LIFELINE_LOG_LEVEL": "WARNING",
        }
        start = [] if "--start" in extra else ["--start", "warm"]
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workers.node", "--name", name, "--port", "0", *start, *extra],
            cwd=BASE_DIR,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.address = json.loads(self.proc.stdout.readline())["address"]

    def status(self) -> dict:
        with urllib.request.urlopen(self.address + "/agent/status", timeout=10) as response:
            return json.loads(response.read())

    def peer(self, rack: str = "rack-a") -> dict:
        return {"name": self.name, "address": self.address, "rack": rack}

    def stop(self, signum=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def stream_once(session: aiohttp.ClientSession, address: str, body: dict, headers: dict | None = None) -> dict:
    """One streamed request; counts chunks without parsing them (the client must stay cheap)."""
    started = time.monotonic()
    first = None
    tokens = 0
    async with session.post(
        address + "/v1/completions", json={**body, "stream": True}, headers=headers or {}
    ) as response:
        response.raise_for_status()
        async for raw in response.content:
            if raw.startswith(b'data: {"id"') and b'"finish_reason":null' in raw:
                tokens += 1
                first = first or time.monotonic()
    return {"ttft_s": (first or time.monotonic()) - started, "tokens": tokens, "elapsed_s": time.monotonic() - started}


async def closed_loop(
    address: str, concurrency: int, duration_s: float, body: dict, headers: dict | None = None
) -> dict:
    """`concurrency` clients, each sending its next request as soon as the last ends.

    Every request gets its own id and a prompt of its own (a numbered first
    word), so no two produce the same text.
    """
    deadline = time.monotonic() + duration_s
    done = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def client(i: int):
            n = 0
            while time.monotonic() < deadline:
                payload = {
                    **body,
                    "prompt": f"r{i}x{n} {body['prompt']}",
                    "lifeline": {"request_id": f"c{i}-{n}", **body.get("lifeline", {})},
                }
                done.append(await stream_once(session, address, payload, headers))
                n += 1

        await asyncio.gather(*(client(i) for i in range(concurrency)))
    return {"requests": len(done), "tokens": sum(d["tokens"] for d in done)}


def machine() -> dict:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile by rank (the value below which a share q of the sorted values lie); None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def save(name: str, result: dict, kinds: dict[str, str] | None = None) -> Path:
    """Write benchmarks/results/<name>.json with its provenance (harness.provenance): the commit, date, host,
    command and wall time of this process, and `kinds` (figure → measured, simulated, modelled or input)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": name,
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine(),
        "provenance": provenance.record(kinds, STARTED),
        **result,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return path


def scratch_database(prefix: str, postgres_only: str = "") -> tuple[str, callable]:
    """A database of the benchmark's own next to DATABASE_URL's PostgreSQL one (or a SQLite file without one; or exit
    with `postgres_only` as the reason), and the function that drops it."""
    import secrets
    import tempfile

    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        if postgres_only:
            sys.exit(postgres_only)
        return f"sqlite:///{os.path.join(tempfile.mkdtemp(prefix=prefix), 'bench.sqlite3')}", lambda: None
    from harness import databases

    name = f"lifeline_bench_{prefix}_{secrets.token_hex(4)}"
    created = databases.create(url, name)
    return created, lambda: databases.drop(url, name)


def issue_token(username: str, env: dict[str, str], label: str = "benchmark") -> str:
    """An API token acting as the demo's `username` (its users are named after their roles), from manage.py."""
    command = [sys.executable, "manage.py", "issue_token", username, "--label", label]
    return subprocess.run(command, cwd=BASE_DIR, env=env, capture_output=True, text=True, check=True).stdout.strip()
