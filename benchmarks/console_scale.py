"""Event to browser at fleet scale: the cluster page in headless Chromium with 256 nodes reporting.

The console's part of the system, run for real: the web process (daphne, the control plane's node endpoints, the
Channels consumers) on its own Redis and database, and a fleet of fake nodes that speak the node protocol to the
control plane's real endpoints (register, heartbeat every second with changing load, deregister), as many as asked,
without an engine behind them. The gateway and Celery are not on the path from a node's state change to the browser,
and are not started.

Measured, with the page showing the node table:
- state change to DOM: from the moment a node's deregistration, registration or first serving heartbeat is sent to
  the moment its row in the browser shows the new state (LEFT, JOIN, SERVING), p50/p99 over many changes;
- load to DOM: a heartbeat's figure (running requests) to the row's cell, while every other node keeps beating;
- page load with all the nodes: the server's render, the browser's load event, and the page live (socket open).

    python -m benchmarks.console_scale [--nodes 256] [--changes 150]
"""

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import aiohttp

from benchmarks.common import BASE_DIR, percentile, save
from console.stack import Child, Supervisor, free_port, start_embedded_redis, wait_http

MODELS = (("Qwen3-32B", "H200-SXM", 2), ("Qwen3-32B", "H100-SXM", 2), ("Llama-3-8B", "H100-SXM", 1))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


class FakeFleet:
    """`count` nodes that register and heartbeat against a control plane's real node endpoints, with changing load,
    from one background thread (asyncio). The caller changes a node's state with `deregister`, `register` and
    `beat`, which return once the control plane answered."""

    def __init__(
        self,
        console_url: str,
        node_token: str,
        count: int,
        prefix: str = "fleet",
        interval_s: float = 1.0,
        model_state: str = "serving",
    ):
        self.url = console_url.rstrip("/")
        self.model_state = model_state  # "serving" makes a node SERVING; "loading_full" keeps it joining
        self.headers = {"Authorization": f"Bearer {node_token}"}
        self.names = [f"{prefix}-{i:03d}" for i in range(count)]
        self.interval_s = interval_s
        self.sessions: dict[str, str] = {}
        self.beating: set[str] = set()
        self.in_flight: dict[str, int] = {}  # beats sent and not yet answered, by node
        self.beats = 0
        self.beat_s = 0.0  # summed time of the heartbeats' round trips
        self.errors: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-fleet", daemon=True)
        self._session: aiohttp.ClientSession | None = None
        self._task = None

    def _run(self, coroutine, timeout_s: float = 60):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def start(self) -> "FakeFleet":
        self._thread.start()
        self._run(self._open())
        self._run(self._each(self._register), timeout_s=300)
        self._run(self._each(lambda name: self._beat(name, self.model_state)), timeout_s=300)
        self.beating.update(self.names)
        self._task = asyncio.run_coroutine_threadsafe(self._beat_forever(), self._loop)
        return self

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._run(self._each(self._deregister))
        self._run(self._session.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # --- what a test or the benchmark does to one node -------------------------------------------------------------
    def deregister(self, name: str) -> dict:
        return self._run(self._deregister(name))

    def register(self, name: str) -> dict:
        return self._run(self._register(name))

    def beat(
        self, name: str, model_state: str | None = None, xids: list | None = None, resume: bool = True, **load
    ) -> dict:
        """One heartbeat now (with `xids`: Xid events, as NVML reports them); with `resume` the node beats on its own
        from then on, else it stays held (its figures stay as sent, until the control plane misses its beats)."""
        answer = self._run(self._beat(name, model_state or self.model_state, xids, **load))
        if resume:
            self.beating.add(name)
        return answer

    def hold(self, name: str) -> None:
        """Stop the node's own beats (until the next `beat`), so that a figure sent now is not replaced at once;
        returns once none of its own is on its way (the browser is sent the latest figures of each quarter second,
        so a beat of its own answered after the figure would hide it)."""
        self.beating.discard(name)
        self._run(self._answered(name))

    def resume(self, name: str) -> None:
        self.beating.add(name)

    # --- the protocol ------------------------------------------------------------------------------------------------
    async def _open(self):
        connector = aiohttp.TCPConnector(limit=32)
        self._session = aiohttp.ClientSession(connector=connector, headers=self.headers)

    async def _each(self, call, concurrency: int = 16):
        gate = asyncio.Semaphore(concurrency)

        async def one(name):
            async with gate:
                await call(name)

        await asyncio.gather(*(one(name) for name in self.names))

    async def _post(self, path: str, body: dict) -> dict:
        async with self._session.post(self.url + path, json=body) as response:
            answer = await response.json()
            if response.status != 200:
                self.errors.append(f"{path}: {response.status} {answer}")
            return answer

    async def _register(self, name: str) -> dict:
        i = self.names.index(name)
        model, gpu, tp = MODELS[i % len(MODELS)]
        session = uuid.uuid4().hex
        self.sessions[name] = session
        body = {
            "name": name,
            "session": session,
            "address": f"http://127.0.0.1:{20000 + i}",  # nobody listens: nothing but the control plane is asked
            "rack": f"rack-{i // 32:02d}",
            "model": model,
            "gpu": gpu,
            "tp": tp,
            "pid": 100000 + i,
            "host": "fake-fleet",
            "gpus": [
                {"index": g, "uuid": f"GPU-{name}-{g}", "name": gpu, "memory_bytes": 80 * 10**9} for g in range(tp)
            ],
        }
        return await self._post("/api/nodes/register", body)

    async def _deregister(self, name: str) -> dict:
        self.beating.discard(name)
        return await self._post(
            f"/api/nodes/{name}/deregister", {"session": self.sessions[name], "reason": "fake fleet: stopping"}
        )

    async def _answered(self, name: str) -> None:
        while self.in_flight.get(name):
            await asyncio.sleep(0.005)

    async def _beat(self, name: str, model_state: str, xids: list | None = None, **load) -> dict:
        running = random.randint(0, 12)
        figures = {
            "running": running,
            "waiting": random.randint(0, 4),
            "kv_blocks_used": random.randint(0, 2000),
            "kv_blocks_total": 2000,
            "step_ms": round(random.uniform(8, 40), 1),
            "tokens_per_s": round(random.uniform(0, 900), 1),
            "decode_step_batch": running,
            "decode_step_context_tokens": running * random.randint(500, 3000),
            **load,
        }
        started = time.monotonic()
        self.in_flight[name] = self.in_flight.get(name, 0) + 1
        try:
            answer = await self._post(
                f"/api/nodes/{name}/heartbeat",
                {"session": self.sessions[name], "model_state": model_state, "load": figures, "xids": xids or []},
            )
        finally:
            self.in_flight[name] -= 1
        self.beats += 1
        self.beat_s += time.monotonic() - started
        return answer

    async def _beat_forever(self):
        """Each beating node once per interval, spread over it as real nodes' beats are."""
        while True:
            started = time.monotonic()
            names = [n for n in self.names if n in self.beating]
            gap = self.interval_s / max(len(names), 1)
            pending = []
            for k, name in enumerate(names):
                if name in self.beating:  # not stopped or held meanwhile
                    pending.append(asyncio.ensure_future(self._beat(name, self.model_state)))
                await asyncio.sleep(max(0.0, started + (k + 1) * gap - time.monotonic()))
            await asyncio.gather(*pending, return_exceptions=True)
            await asyncio.sleep(max(0.0, started + self.interval_s - time.monotonic()))  # also when none beats


# --- the web process -----------------------------------------------------------------------------------------------
class ConsoleStack:
    """daphne serving the console on its own Redis and SQLite database, with one operator."""

    def __init__(self):
        self.var_dir = Path(tempfile.mkdtemp(prefix="bench-console-"))
        self.supervisor = Supervisor(self.var_dir / "log")
        self.password = secrets.token_urlsafe(12)
        self.node_token = secrets.token_urlsafe(16)

    def start(self) -> "ConsoleStack":
        redis_url = start_embedded_redis(self.supervisor, self.var_dir / "redis")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.env = {
            **{k: v for k, v in os.environ.items() if k not in ("DATABASE_URL",)},
            "DJANGO_SETTINGS_MODULE": "console.settings",
            "DATABASE_URL": f"sqlite:///{self.var_dir / 'lifeline.sqlite3'}",
            "REDIS_URL": redis_url,
            "LIFELINE_VAR_DIR": str(self.var_dir),
            "LIFELINE_NAMESPACE": f"bench-console-{secrets.token_hex(3)}",
            "LIFELINE_NODE_TOKEN": self.node_token,
            "LIFELINE_LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
        }
        manage = [sys.executable, "manage.py"]
        subprocess.run([*manage, "migrate", "-v", "0"], cwd=BASE_DIR, env=self.env, check=True)
        subprocess.run(
            [*manage, "create_user", "bench", "--role", "operator", f"--password={self.password}"],
            cwd=BASE_DIR,
            env=self.env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        argv = [
            sys.executable,
            "-m",
            "daphne",
            "-b",
            "127.0.0.1",
            "-p",
            str(port),
            "-v",
            "0",
            "console.asgi:application",
        ]
        web = self.supervisor.spawn(Child("web", argv, self.env))
        wait_http(self.url + "/healthz", 60, web, self.supervisor)
        return self

    def stop(self) -> None:
        self.supervisor.stop()
        shutil.rmtree(self.var_dir, ignore_errors=True)


def log_in(page, url: str, password: str) -> None:
    page.goto(url + "/cluster/")
    page.fill("#id_username", "bench")
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    page.wait_for_selector("#live-status[data-state=live]", timeout=30_000)


# Records, in the page, when each row shows a new state or a marked figure: the page's own clock (Date.now, the
# machine's clock, as the sender's time.time()) at the DOM change, before the next paint.
OBSERVE = """() => {
  window.__seen = [];
  const body = document.querySelector('#node-table tbody');
  new MutationObserver((mutations) => {
    const t = Date.now();
    for (const m of mutations) {
      for (const n of m.addedNodes) {
        if (n.nodeType === 1 && n.dataset && n.dataset.node) window.__seen.push([n.dataset.node, n.dataset.state, t]);
      }
      if (m.target.dataset && m.target.dataset.field === 'running' && m.target.textContent.length >= 4) {
        window.__seen.push([m.target.closest('[data-node]').dataset.node, 'running:' + m.target.textContent, t]);
      }
    }
  }).observe(body, { childList: true, subtree: true });
}"""

SEEN = """([name, what, after]) => (window.__seen || []).find((s) => s[0] === name && s[1] === what && s[2] >= after)"""


def shown_after(page, name: str, what: str, sent_ms: float, timeout_ms: float = 60_000) -> float:
    """Milliseconds from `sent_ms` (epoch) until the page showed `what` for `name`."""
    try:
        handle = page.wait_for_function(SEEN, arg=[name, what, sent_ms - 1], timeout=timeout_ms, polling=20)
    except Exception as exc:
        row = page.locator(f"#node-{name}")
        shown = row.evaluate("el => el.outerHTML") if row.count() else "no row"
        seen = page.evaluate("window.__seen.slice(-5)")
        raise RuntimeError(f"{name} did not show {what}; last seen {seen}; {shown}") from exc
    return handle.json_value()[2] - sent_ms


def page_load(browser, url: str, password: str, view: str, count: int) -> dict:
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    page = context.new_page()
    log_in(page, url, password)
    started = time.monotonic()
    page.goto(f"{url}/cluster/?view={view}", wait_until="load")
    loaded = time.monotonic() - started
    page.wait_for_selector("#live-status[data-state=live]", timeout=30_000)
    live = time.monotonic() - started
    shown = page.locator("[data-node]").count()
    timing = page.evaluate("() => performance.getEntriesByType('navigation')[0].toJSON()")
    context.close()
    return {
        "view": view,
        "nodes_shown": shown,
        "nodes": count,
        "server_response_ms": round(timing["responseEnd"] - timing["requestStart"], 1),
        "dom_content_loaded_ms": round(timing["domContentLoadedEventEnd"], 1),
        "load_event_ms": round(timing["loadEventEnd"], 1),
        "goto_load_s": round(loaded, 3),
        "live_s": round(live, 3),
    }


def summarize(values: list[float]) -> dict:
    return {
        "count": len(values),
        "p50_ms": round(percentile(values, 0.5), 1) if values else None,
        "p90_ms": round(percentile(values, 0.9), 1) if values else None,
        "p99_ms": round(percentile(values, 0.99), 1) if values else None,
        "max_ms": round(max(values), 1) if values else None,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--changes", type=int, default=90, help="state changes measured (deregister, register, serve)")
    parser.add_argument("--loads", type=int, default=60, help="load figures measured")
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        nargs="+",
        default=[1.0, 4.0],
        help="seconds between a node's heartbeats; one run each (1 s is the nodes' default)",
    )
    args = parser.parse_args(argv)
    runs = []
    for interval in args.heartbeat_interval:
        try:
            runs.append(measure(args.nodes, interval, args.changes, args.loads))
        except Exception as exc:  # noqa: BLE001 - a web process that cannot keep up is a result too
            runs.append({"nodes": args.nodes, "heartbeat_interval_s": interval, "failed": str(exc).splitlines()[0]})
        print(json.dumps(runs[-1], indent=2), flush=True)
    result = {
        "nodes": args.nodes,
        "runs": runs,
        "path": "node HTTP request (a heartbeat straight to its view: console.asgi.NodeEndpoint) -> control plane "
        "action -> Redis channel layer (a state change at once; every node's latest load figures in one message "
        "per 250 ms: recovery.events.LoadPublisher) -> Channels consumer -> WebSocket -> cluster.js (batched per "
        "animation frame) -> DOM; one web process (daphne), embedded Redis, SQLite; no gateway, no Celery (not on "
        "this path)",
        "load_average_at_end": os.getloadavg(),
    }
    save("console_scale", result)
    return result


def measure(nodes: int, interval_s: float, changes_wanted: int, loads_wanted: int) -> dict:
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("LIFELINE_CHROMIUM") or shutil.which("chromium")
    stack = ConsoleStack().start()
    fleet = None
    try:
        registered = time.monotonic()
        fleet = FakeFleet(stack.url, stack.node_token, nodes, interval_s=interval_s).start()
        registered = time.monotonic() - registered
        time.sleep(3)  # a few rounds of heartbeats: the steady state of a fleet reporting
        beats_before, beat_s_before, started = fleet.beats, fleet.beat_s, time.monotonic()
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            loads = [page_load(browser, stack.url, stack.password, view, nodes) for view in ("table", "tiles")]
            context = browser.new_context(viewport={"width": 1600, "height": 1000})
            page = context.new_page()
            log_in(page, stack.url, stack.password)
            page.goto(stack.url + "/cluster/?view=table")
            page.wait_for_selector("#live-status[data-state=live]", timeout=30_000)
            page.evaluate(OBSERVE)
            changes = {"left": [], "join": [], "serving": []}
            rng = random.Random(7)
            for _ in range(changes_wanted // 3):
                name = rng.choice(fleet.names)
                sent = time.time() * 1000
                fleet.deregister(name)
                changes["left"].append(shown_after(page, name, "left", sent))
                sent = time.time() * 1000
                fleet.register(name)
                changes["join"].append(shown_after(page, name, "join", sent))
                sent = time.time() * 1000
                fleet.beat(name, "serving")
                changes["serving"].append(shown_after(page, name, "serving", sent))
                time.sleep(rng.uniform(0.05, 0.3))
            figures = []
            for i in range(loads_wanted):
                name = rng.choice([n for n in fleet.names if n in fleet.beating])
                marker = 1000 + i  # four digits: told apart from the fleet's own figures (0 to 12)
                fleet.hold(name)  # and a beat of its own already on its way has landed
                sent = time.time() * 1000
                # Held until shown: the browser is sent each node's latest figures four times a second, so a beat of
                # its own in the same quarter second would replace the marked figure before it is drawn.
                fleet.beat(name, "serving", resume=False, running=marker)
                figures.append(shown_after(page, name, f"running:{marker}", sent))
                fleet.resume(name)
                time.sleep(rng.uniform(0.02, 0.2))
            context.close()
            browser.close()
        elapsed = time.monotonic() - started
        beats = fleet.beats - beats_before
        all_changes = [v for values in changes.values() for v in values]
        return {
            "nodes": nodes,
            "heartbeat_interval_s": interval_s,
            "heartbeats_per_s_offered": round(nodes / interval_s, 1),
            "heartbeats_per_s_served": round(beats / elapsed, 1),
            "heartbeat_round_trip_mean_ms": round(1000 * (fleet.beat_s - beat_s_before) / max(beats, 1), 1),
            "fleet_registered_s": round(registered, 2),
            "protocol_errors": fleet.errors[:5],
            "state_change_to_dom": summarize(all_changes),
            "state_change_to_dom_by_state": {state: summarize(values) for state, values in changes.items()},
            "load_to_dom": summarize(figures),
            "page_load": loads,
            "chromium": subprocess.run([chromium, "--version"], capture_output=True, text=True).stdout.strip(),
        }
    finally:
        if fleet is not None:
            try:
                fleet.stop()
            except Exception as exc:  # noqa: BLE001 - the stack stops regardless
                print(f"fleet stop: {exc}", file=sys.stderr)
        stack.stop()


if __name__ == "__main__":
    main()
