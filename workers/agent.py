"""The node agent: the HTTP face of one serving node.

Serves the OpenAI API from the engine, `/health`, Prometheus `/metrics` under
vLLM's names, the status endpoint and the status event stream.
"""

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from workers import protocol
from workers.engine import Engine, EngineError, FinishEvent, TokenEvent
from workers.openai_api import ApiError, ChunkWriter, parse, read_json, sse

log = logging.getLogger(__name__)


@dataclass
class Identity:
    name: str
    rack: str
    host: str
    session: str
    gpus: tuple[protocol.GpuInfo, ...]
    address: str = ""  # filled in once the server is bound

    @property
    def pid(self) -> int:
        return os.getpid()


ENGINE_KEY = web.AppKey("engine", Engine)
IDENTITY_KEY = web.AppKey("identity", Identity)
METRICS_KEY = web.AppKey("metrics", object)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)


class EngineCollector:
    """Reads the engine's live figures at scrape time, under vLLM's metric names."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        engine = self.engine
        label = [engine.model.key]
        status = engine.status()

        def gauge(name, doc, value):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name, doc, value):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", status["running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.", status["waiting"])
        total = status["kv_blocks_total"] or 1
        yield gauge("vllm:kv_cache_usage_perc", "Share of KV-cache blocks in use (1 = full).", status["kv_blocks_used"] / total)
        yield counter("vllm:prompt_tokens", "Prompt tokens received.", engine.counters["prompt_tokens"])
        yield counter("vllm:generation_tokens", "Tokens generated.", engine.counters["generation_tokens"])
        yield counter("vllm:num_preemptions", "Sequences preempted for lack of KV blocks.", engine.counters["preemptions"])
        yield gauge("lifeline:step_seconds", "Emulated duration of the last engine step.", status["step_ms"] / 1000)
        yield gauge("lifeline:uncomputed_prefill_tokens", "Prompt tokens not yet computed (prefill load).", status["uncomputed_prefill_tokens"])
        yield gauge("lifeline:decode_batch_size", "Sequences in the decode batch.", status["decode_batch"])
        yield gauge("lifeline:decode_context_tokens", "Sum of sequence lengths in the decode batch.", status["decode_context_tokens"])


class RequestMetrics:
    def __init__(self, registry: CollectorRegistry, model_key: str):
        self.model = model_key
        latency_buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", ["model_name"], registry=registry, buckets=latency_buckets)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens.", ["model_name"], registry=registry,
            buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1),
        )
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency.", ["model_name"], registry=registry, buckets=latency_buckets)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time waiting for admission.", ["model_name"], registry=registry, buckets=latency_buckets)


def _served_names(engine: Engine) -> set[str]:
    return {engine.model.key, engine.model.name}


async def _run_request(request: web.Request, kind: str) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    identity = request.app[IDENTITY_KEY]
    metrics: RequestMetrics = request.app[METRICS_KEY]
    headers = {"X-Lifeline-Node": identity.name}
    try:
        if engine.model_state != "serving":
            raise ApiError(503, f"Node {identity.name} is {engine.model_state}, not serving yet.", kind="service_unavailable")
        body = await read_json(request)
        req = parse(body, kind, _served_names(engine), engine.model.key)
        seq = engine.submit(req.prompt_ids, req.params, req.request_id)
    except ApiError as exc:
        return exc.response(headers)
    except EngineError as exc:
        return ApiError(409, str(exc), param="lifeline.request_id").response(headers)
    headers["X-Request-Id"] = req.request_id
    writer = ChunkWriter(req, engine.model.key)
    last_at = None
    try:
        if req.stream:
            response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            first = True
            while True:
                event = await seq.events.get()
                if isinstance(event, TokenEvent):
                    last_at = _observe_token(metrics, seq, event, last_at)
                    await response.write(sse(writer.token_chunk(event, first)))
                    first = False
                    continue
                await response.write(sse(writer.finish_chunk(event)))
                if req.include_usage:
                    await response.write(sse(writer.usage_chunk(event)))
                await response.write(sse("[DONE]"))
                _observe_finish(metrics, seq, event)
                break
            await response.write_eof()
            return response
        events = []
        while True:
            event = await seq.events.get()
            if isinstance(event, TokenEvent):
                last_at = _observe_token(metrics, seq, event, last_at)
                events.append(event)
            else:
                _observe_finish(metrics, seq, event)
                return web.json_response(writer.whole(events, event), headers=headers)
    finally:
        if seq.finished is None:  # the client went away: free the batch slot and the KV
            engine.abort(seq.request_id)


def _observe_token(metrics: RequestMetrics, seq, event: TokenEvent, last_at: float | None) -> float:
    if event.index == 0 and seq.first_token_at is not None:
        metrics.ttft.labels(metrics.model).observe(seq.first_token_at - seq.arrival)
    elif last_at is not None:
        metrics.itl.labels(metrics.model).observe(event.at - last_at)
    return event.at


def _observe_finish(metrics: RequestMetrics, seq, event: FinishEvent) -> None:
    metrics.e2e.labels(metrics.model).observe(time.monotonic() - seq.arrival)
    if seq.admitted_at is not None:
        metrics.queue.labels(metrics.model).observe(seq.admitted_at - seq.arrival)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _run_request(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _run_request(request, "chat")


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    created = int(time.time())
    data = [{"id": engine.model.key, "object": "model", "created": created, "owned_by": "lifeline", "root": engine.model.name}]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    ok = engine.model_state == "serving"
    return web.json_response({"status": "ok" if ok else engine.model_state}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    return web.Response(body=generate_latest(registry), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def status_document(engine: Engine, identity: Identity) -> dict:
    return {
        "name": identity.name,
        "session": identity.session,
        "pid": identity.pid,
        "host": identity.host,
        "rack": identity.rack,
        "address": identity.address,
        "model": engine.model.key,
        "gpu": engine.deployment.gpu.key,
        "tp": engine.deployment.tp,
        "time_scale": engine.config.time_scale,
        "load": engine.status(),
        "counters": dict(engine.counters),
    }


async def status(request: web.Request) -> web.Response:
    return web.json_response(status_document(request.app[ENGINE_KEY], request.app[IDENTITY_KEY]))


async def events(request: web.Request) -> web.StreamResponse:
    """Server-sent events: one load status per load-changing event in the engine."""
    engine = request.app[ENGINE_KEY]
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


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status >= 400 and request.path.startswith("/v1/"):
            return ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}", kind="invalid_request_error").response()
        raise


def build_app(engine: Engine, identity: Identity) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=16 * 1024 * 1024)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    app[REGISTRY_KEY] = registry
    app[METRICS_KEY] = RequestMetrics(registry, engine.model.key)
    app[ENGINE_KEY] = engine
    app[IDENTITY_KEY] = identity
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get(protocol.HEALTH_PATH, health)
    app.router.add_get(protocol.METRICS_PATH, metrics)
    app.router.add_get(protocol.STATUS_PATH, status)
    app.router.add_get(protocol.EVENTS_PATH, events)
    return app
