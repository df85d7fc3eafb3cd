"""Front a real engine (vLLM, SGLang, anything with the OpenAI API and vLLM-style metrics).

`python -m workers.node --engine-url http://127.0.0.1:8000 --model Qwen3-32B --gpu H100-SXM --tp 2`

The node agent proxies completions to the engine and derives its load status
from the engine's Prometheus metrics, polled every quarter second and after
each request starts and ends. What a stock engine cannot do through its API
(stream KV pages to a holder, resume from them, hand a request over, verify a
draft model's tokens, change its batch limit, reset its GPUs, inject faults)
is answered with 501 and named in `/agent/capabilities`, rather than pretended.
"""

import asyncio
import json
import logging
import re
import time

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from workers import protocol
from workers.catalog import Deployment
from workers.runtime import Identity, LoopLag

log = logging.getLogger(__name__)

OFFERS = ("openai", "events", "telemetry")
CANNOT = {
    "checkpoint": "stream KV pages to a checkpoint holder",
    "resume": "resume a request from a checkpoint at token N",
    "migrate": "hand a request over to another node at a token boundary",
    "assist": "verify a draft model's tokens (speculative assist)",
    "draft": "serve as a draft model for another node",
    "reload": "reload its model on request",
    "config": "change its batch limit on request",
    "reset": "reset its GPUs on request",
    "faults": "inject faults",
}
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>[-+0-9.eEInfa]+)")


def parse_vllm_metrics(text: str) -> dict:
    """The load figures in a vLLM-style exposition, summed over label sets."""
    wanted = {
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:kv_cache_usage_perc": "kv_usage",
        "vllm:gpu_cache_usage_perc": "kv_usage",  # vLLM before 0.10
        "vllm:generation_tokens_total": "generation_tokens",
        "vllm:prompt_tokens_total": "prompt_tokens",
    }
    figures: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match["name"] in wanted:
            key = wanted[match["name"]]
            figures[key] = figures.get(key, 0.0) + float(match["value"])
    return figures


class AdapterEngine:
    """Looks like workers.engine.Engine to the node: a model, a state, a status, a status stream."""

    def __init__(self, engine_url: str, deployment: Deployment, name: str, poll_s: float = 0.25):
        self.engine_url = engine_url.rstrip("/")
        self.deployment = deployment
        self.model = deployment.model
        self.name = name
        self.poll_s = poll_s
        self.model_state = "loading_full"  # until the engine answers /health
        self.figures: dict[str, float] = {}
        self.in_flight = 0  # requests this node has passed on and not seen end
        self.status_seq = 0
        self.busy_s = 0.0
        self.used_blocks = 0
        self.counters = {"requests_proxied": 0, "engine_errors": 0, "poll_failures": 0}
        self.last_poll_at: float | None = None
        self._subscribers: set[asyncio.Queue] = set()
        self._poke = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=5, sock_read=600))
        self._task = asyncio.get_running_loop().create_task(self._poll_loop(), name="engine-metrics")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def begin_load(self, cold: bool = True) -> None:
        pass  # the engine loads its own model; /health tells when it is ready

    async def _poll_loop(self) -> None:
        while True:
            await self._poll()
            try:
                await asyncio.wait_for(self._poke.wait(), timeout=self.poll_s)
            except TimeoutError:
                pass
            self._poke.clear()

    async def _poll(self) -> None:
        try:
            async with self.session.get(self.engine_url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as health:
                state = "serving" if health.status == 200 else "loading_full"
            async with self.session.get(self.engine_url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as response:
                figures = parse_vllm_metrics(await response.text())
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.counters["poll_failures"] += 1
            if self.model_state == "serving":
                log.warning("engine at %s stopped answering: %s", self.engine_url, exc)
            state, figures = "loading_full", {}
        changed = state != self.model_state or figures.get("running") != self.figures.get("running") or figures.get("waiting") != self.figures.get("waiting")
        now = time.monotonic()
        if self.last_poll_at is not None and figures.get("running"):
            self.busy_s += now - self.last_poll_at
        self.last_poll_at = now
        self.model_state, self.figures = state, figures
        self.used_blocks = int(figures.get("kv_usage", 0.0) * self.deployment.kv_blocks)
        if changed:
            self.publish("engine_metrics")

    def poke(self) -> None:
        """Read the engine's metrics now: a request started or ended."""
        self._poke.set()

    def status(self) -> dict:
        f = self.figures
        running = int(f["running"]) if "running" in f else None
        return {
            "seq": self.status_seq,
            "at": time.time(),
            "model_state": self.model_state,
            "load_progress": 1.0 if self.model_state == "serving" else None,
            "waiting": int(f["waiting"]) if "waiting" in f else None,
            "running": running,
            "in_flight": self.in_flight,
            # A stock engine does not export these: n/a, never zero.
            "uncomputed_prefill_tokens": None,
            "decode_batch": None,
            "decode_context_tokens": None,
            "kv_blocks_used": self.used_blocks if "kv_usage" in f else None,
            "kv_blocks_total": self.deployment.kv_blocks,
            "checkpoint_bytes_held": None,
            "checkpoint_budget_bytes": None,
            "step_ms": None,
            "decode_step_ms": None,
            "decode_step_batch": None,
            "decode_step_context_tokens": None,
            "batch_limit": None,
            "batch_factor": None,
            "source": "engine_metrics",
        }

    def subscribe(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(maxsize=256)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    def publish(self, reason: str) -> None:
        self.status_seq += 1
        status = {**self.status(), "reason": reason}
        for queue in list(self._subscribers):
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(status)


ADAPTER_KEY = web.AppKey("adapter", AdapterEngine)
IDENTITY_KEY = web.AppKey("identity", Identity)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
TELEMETRY_KEY = web.AppKey("telemetry", object)
LOOP_LAG_KEY = web.AppKey("loop_lag", LoopLag)


def _error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}}, status=status)


def _unsupported(capability: str, engine: AdapterEngine) -> web.Response:
    return _error(
        501,
        f"This node fronts an engine at {engine.engine_url} and cannot {CANNOT[capability]}: "
        f"the engine's API offers no such call. See /agent/capabilities.",
        "not_implemented",
        "lifeline" if capability in ("checkpoint", "resume") else None,
    )


async def _proxy(request: web.Request) -> web.StreamResponse:
    engine = request.app[ADAPTER_KEY]
    identity = request.app[IDENTITY_KEY]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "The body is not valid JSON.", "invalid_request_error", "body")
    if not isinstance(body, dict):
        return _error(400, "The body must be a JSON object.", "invalid_request_error", "body")
    extension = body.pop("lifeline", None) or {}
    if extension.get("resume") is not None:
        return _unsupported("resume", engine)
    if extension.get("holders"):
        return _unsupported("checkpoint", engine)
    headers = {"X-Lifeline-Node": identity.name}
    if extension.get("request_id"):
        headers["X-Request-Id"] = str(extension["request_id"])
    engine.in_flight += 1
    engine.counters["requests_proxied"] += 1
    engine.poke()
    try:
        try:
            upstream = await engine.session.post(engine.engine_url + request.path, json=body)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            engine.counters["engine_errors"] += 1
            return _error(502, f"The engine at {engine.engine_url} did not answer: {exc.__class__.__name__}.", "engine_unavailable")
        async with upstream:
            response = web.StreamResponse(status=upstream.status, headers={**headers, "Content-Type": upstream.headers.get("Content-Type", "application/json")})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    finally:
        engine.in_flight -= 1
        engine.poke()


async def _models(request: web.Request) -> web.Response:
    engine = request.app[ADAPTER_KEY]
    async with engine.session.get(engine.engine_url + "/v1/models") as upstream:
        return web.Response(status=upstream.status, body=await upstream.read(), content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    engine = request.app[ADAPTER_KEY]
    ok = engine.model_state == "serving"
    return web.json_response({"status": "ok" if ok else "engine not answering", "engine": engine.engine_url}, status=200 if ok else 503)


async def _status(request: web.Request) -> web.Response:
    engine, identity = request.app[ADAPTER_KEY], request.app[IDENTITY_KEY]
    return web.json_response({
        "name": identity.name, "session": identity.session, "pid": identity.pid, "host": identity.host, "rack": identity.rack,
        "address": identity.address, "spare": identity.spare, "model": engine.model.key, "gpu": engine.deployment.gpu.key, "tp": engine.deployment.tp,
        "engine": {"kind": "adapter", "url": engine.engine_url}, "load": engine.status(), "counters": dict(engine.counters),
        "telemetry_source": request.app[TELEMETRY_KEY].source, "loop_lag_p99_ms": request.app[LOOP_LAG_KEY].p99_ms(),
    })


async def _capabilities(request: web.Request) -> web.Response:
    return web.json_response({"engine": request.app[ADAPTER_KEY].engine_url, "offers": list(OFFERS), "cannot": CANNOT})


async def _events(request: web.Request) -> web.StreamResponse:
    engine = request.app[ADAPTER_KEY]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    queue = engine.subscribe()
    try:
        await response.write(f"event: status\ndata: {json.dumps(engine.status())}\n\n".encode())
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=15)
            except TimeoutError:
                await response.write(b": keep-alive\n\n")
                continue
            await response.write(f"event: status\ndata: {json.dumps(item)}\n\n".encode())
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        engine.unsubscribe(queue)
    return response


async def _telemetry(request: web.Request) -> web.Response:
    telemetry = request.app[TELEMETRY_KEY]
    readings = await asyncio.get_running_loop().run_in_executor(None, telemetry.read)
    return web.json_response({"source": telemetry.source, "gpus": [r.to_json() for r in readings]})


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(request.app[REGISTRY_KEY]), headers={"Content-Type": "text/plain; version=0.0.4"})


class AdapterCollector:
    def __init__(self, engine: AdapterEngine, node: str):
        self.engine = engine
        self.node = node

    def collect(self):
        status = self.engine.status()
        for name, key in (("vllm:num_requests_running", "running"), ("vllm:num_requests_waiting", "waiting")):
            if status[key] is not None:
                family = GaugeMetricFamily(name, f"{key} requests, as the engine reports them", labels=["model_name", "node"])
                family.add_metric([self.engine.model.key, self.node], status[key])
                yield family


def build_adapter_app(engine: AdapterEngine, identity: Identity, telemetry, telemetry_collector, loop_lag: LoopLag) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    registry = CollectorRegistry()
    registry.register(AdapterCollector(engine, identity.name))
    registry.register(telemetry_collector)
    app[ADAPTER_KEY], app[IDENTITY_KEY], app[REGISTRY_KEY], app[TELEMETRY_KEY], app[LOOP_LAG_KEY] = engine, identity, registry, telemetry, loop_lag
    app.router.add_post("/v1/completions", _proxy)
    app.router.add_post("/v1/chat/completions", _proxy)
    app.router.add_get("/v1/models", _models)
    app.router.add_get(protocol.HEALTH_PATH, _health)
    app.router.add_get(protocol.METRICS_PATH, _metrics)
    app.router.add_get(protocol.STATUS_PATH, _status)
    app.router.add_get(protocol.EVENTS_PATH, _events)
    app.router.add_get("/agent/telemetry", _telemetry)
    app.router.add_get("/agent/capabilities", _capabilities)
    for method, path, capability in (
        ("POST", "/agent/kv/batch", "checkpoint"), ("GET", "/agent/kv/{request_id}", "checkpoint"),
        ("POST", "/agent/requests/{request_id}/migrate", "migrate"), ("POST", "/agent/assist", "assist"),
        ("POST", "/agent/draft", "draft"), ("POST", "/agent/reload", "reload"), ("POST", "/agent/faults", "faults"),
        ("GET", "/agent/config", "config"), ("POST", "/agent/config", "config"), ("POST", "/agent/reset", "reset"),
    ):
        app.router.add_route(method, path, lambda request, c=capability: _answer_unsupported(request, c))
    return app


async def _answer_unsupported(request: web.Request, capability: str) -> web.Response:
    return _unsupported(capability, request.app[ADAPTER_KEY])

