"""The node agent: the HTTP face of one serving node, the same for every engine.

Serves the OpenAI API from the engine (any workers.engine_api.ServingEngine),
`/health`, Prometheus `/metrics` under vLLM's and DCGM's names, the status
endpoint and the status event stream, and what the node offers at
`/agent/capabilities`. The token-protected control endpoints are in
workers.control_api; a call on a capability the engine does not offer is
answered 501 there (`control_api.lacking`).
"""

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import cast

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from workers import control_api, protocol
from workers.checkpoint import fetch_checkpoint
from workers.engine_api import CAPABILITIES, EngineError, FinishEvent, ResumeEngine, Sequence, ServingEngine, TokenEvent
from workers.openai_api import ChunkWriter, error_response, json_errors, read_json, sse
from workers.openai_schema import ApiError, CompletionRequest, parse
from workers.runtime import Identity, NodeRuntime, token_matches

log = logging.getLogger(__name__)

RUNTIME_KEY = control_api.RUNTIME_KEY
# A quiet status stream still says something this often: a gateway tells a working node
# (busy with a long prefill, say) from a frozen one by it.
KEEPALIVE_S = 1.0
LARGE_BODY_BYTES = 64 * 1024  # requests validated in a worker thread above this
# How a request ends other than with its answer; "stop" and "length" (and a real engine's
# "tool_calls" or "content_filter", through an adapter) end it with one.
ABNORMAL_ENDS = ("migrated", "abort", "error")
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)

__all__ = ["Identity", "build_app", "offered_capabilities", "status_document"]


class EngineCollector:
    """Reads the engine's live figures at scrape time, under vLLM's metric names.

    A figure the engine cannot report (None in its status, absent from its
    counters) is left out: absence is n/a, a zero would lie.
    """

    def __init__(self, engine: ServingEngine, node: str):
        self.engine = engine
        self.node = node

    def collect(self):
        engine = self.engine
        label = [engine.model.key, self.node]
        status = engine.status()

        def family(kind, name, doc, value):
            if value is None:
                return
            metric = kind(name, doc, labels=["model_name", "node"])
            metric.add_metric(label, value)
            yield metric

        def gauge(name, doc, value):
            return family(GaugeMetricFamily, name, doc, value)

        def counter(name, doc, key):
            return family(CounterMetricFamily, name, doc, engine.counters.get(key))

        yield from gauge("vllm:num_requests_running", "Requests in the running batch.", status.running)
        yield from gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.", status.waiting)
        if status.kv_blocks_used is not None:
            total = status.kv_blocks_total or 1
            yield from gauge(
                "vllm:kv_cache_usage_perc", "Share of KV-cache blocks in use (1 = full).", status.kv_blocks_used / total
            )
        yield from counter("vllm:prompt_tokens", "Prompt tokens received.", "prompt_tokens")
        yield from counter("vllm:generation_tokens", "Tokens generated.", "generation_tokens")
        yield from counter("vllm:num_preemptions", "Sequences preempted for lack of KV blocks.", "preemptions")
        yield from gauge(
            "lifeline_batch_limit", "Sequences admitted into the running batch at most.", status.batch_limit
        )
        step_s = None if status.step_ms is None else status.step_ms / 1000
        yield from gauge("lifeline_step_seconds", "Emulated duration of the last engine step.", step_s)
        yield from gauge(
            "lifeline_uncomputed_prefill_tokens",
            "Prompt tokens not yet computed (prefill load).",
            status.uncomputed_prefill_tokens,
        )
        yield from gauge("lifeline_decode_batch_size", "Sequences in the decode batch.", status.decode_batch)
        yield from gauge(
            "lifeline_decode_context_tokens",
            "Sum of sequence lengths in the decode batch.",
            status.decode_context_tokens,
        )
        yield from gauge(
            "lifeline_checkpoint_bytes_held", "Other nodes' KV pages held in host memory.", status.checkpoint_bytes_held
        )
        yield from gauge(
            "lifeline_checkpoint_budget_bytes", "Host-memory budget for checkpoints.", status.checkpoint_budget_bytes
        )
        yield from gauge(
            "lifeline_model_ready",
            "1 when the full model serves, 0 while loading.",
            1 if status.model_state == "serving" else 0,
        )
        yield from counter(
            "lifeline_draft_tokens_proposed", "Drafted tokens verified here (speculative assist).", "draft_proposed"
        )
        yield from counter("lifeline_draft_tokens_accepted", "Drafted tokens accepted here.", "draft_accepted")


class RequestMetrics:
    def __init__(self, registry: CollectorRegistry, model_key: str, node: str):
        self.model = model_key
        latency_buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        labels = ["model_name", "node"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            registry=registry,
            buckets=latency_buckets,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between tokens.",
            labels,
            registry=registry,
            buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1),
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Request latency.", labels, registry=registry, buckets=latency_buckets
        )
        self.queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Time waiting for admission.",
            labels,
            registry=registry,
            buckets=latency_buckets,
        )
        self.refused = Counter(
            "lifeline_requests_refused",
            "Requests refused before the engine saw them, by HTTP status.",
            ["node", "status"],
            registry=registry,
        )
        self.node = node
        # One labelled child each, looked up once: observe() runs for every token.
        self.ttft_child, self.itl_child = self.ttft.labels(model_key, node), self.itl.labels(model_key, node)
        self.e2e_child, self.queue_child = self.e2e.labels(model_key, node), self.queue.labels(model_key, node)

    def token(self, seq: Sequence, event: TokenEvent, last_at: float | None) -> float:
        if event.index == seq.resumed_with and seq.first_token_at is not None:
            self.ttft_child.observe(seq.first_token_at - seq.arrival)
        elif last_at is not None:
            self.itl_child.observe(event.at - last_at)
        return event.at

    def finish(self, seq: Sequence) -> None:
        self.e2e_child.observe(time.monotonic() - seq.arrival)
        if seq.admitted_at is not None:
            self.queue_child.observe(seq.admitted_at - seq.arrival)


METRICS_KEY = web.AppKey("metrics", RequestMetrics)


def _served_names(engine: ServingEngine) -> set[str]:
    return {engine.model.key, engine.model.name}


def _bearer(request: web.Request) -> str | None:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


async def _start(request: web.Request, runtime: NodeRuntime, req: CompletionRequest):
    """Submit a new request, or resume one from its checkpoint at token N."""
    engine = runtime.engine
    ext = req.extension
    if ext.resume is not None:
        control_api.require(engine, "resume", param="lifeline")
    if ext.holders or ext.checkpoint_prefill_chunks:
        control_api.require(engine, "checkpoint", param="lifeline")
    privileged = ext.holders or ext.resume is not None or ext.checkpoint_prefill_chunks
    if privileged and not token_matches(_bearer(request), runtime.agent_token):
        raise ApiError(
            401,
            "lifeline.holders and lifeline.resume need the agent token: send `Authorization: Bearer <agent token>`.",
            param="lifeline",
            kind="authentication_error",
        )
    poison = runtime.faults.poisoned_by(req.prompt_ids)
    if poison is not None:
        # An injected query of death: the engine fails on this input, as a real one with such a bug would.
        raise EngineError(f"engine failure on this request (injected poison fault matching {poison!r})", status=500)
    if ext.resume is None:
        return await engine.submit_request(req), None

    async def fetch(holder, request_id):
        return await fetch_checkpoint(holder, request_id, runtime.peer_headers)

    return await cast(ResumeEngine, engine).resume(  # it offers "resume": required above
        req,
        ext.resume.generated,
        sources=ext.resume.sources,
        fetch=fetch,
        holders=ext.holders,
        checkpoint_prefill_chunks=ext.checkpoint_prefill_chunks,
    )


async def _run_request(request: web.Request, kind: str) -> web.StreamResponse:
    runtime = request.app[RUNTIME_KEY]
    engine = runtime.engine
    metrics: RequestMetrics = request.app[METRICS_KEY]
    headers = {"X-Lifeline-Node": runtime.identity.name}
    try:
        body = await read_json(request)
        model = body.get("model")
        if isinstance(model, str) and model and model not in _served_names(engine):
            raise ApiError(
                404,
                f"The model `{model}` does not exist on this node: it serves {engine.model.key}.",
                param="model",
                code="model_not_found",
            )
        if (request.content_length or 0) > LARGE_BODY_BYTES:
            # Tokenizing a long prompt takes a while: off the event loop, so the engine's steps and streams keep time.
            req = await asyncio.get_running_loop().run_in_executor(
                None, parse, body, kind, engine.deployment.max_context_tokens
            )
        else:
            req = parse(body, kind, engine.deployment.max_context_tokens)
        if req.extension.attach is not None:
            return await _attach(request, runtime, req)
        seq, resume = await _start(request, runtime, req)
    except ApiError as exc:
        metrics.refused.labels(metrics.node, str(exc.status)).inc()
        return error_response(exc, headers)
    except EngineError as exc:
        kind_ = {503: "service_unavailable", 502: "engine_unavailable", 500: "server_error"}.get(
            exc.status, "invalid_request_error"
        )
        metrics.refused.labels(metrics.node, str(exc.status)).inc()
        return error_response(
            ApiError(exc.status, str(exc), param="lifeline.request_id" if exc.status == 409 else None, kind=kind_),
            headers,
        )
    headers["X-Request-Id"] = req.request_id
    if resume is not None:
        headers["X-Lifeline-Resume"] = resume.method
    writer = ChunkWriter(req, engine.model.key)
    writer.offset = len(seq.text)
    if req.stream and seq.resumed_with:
        writer.resumed(seq.generated[: seq.resumed_with])
    extension = {"resume": resume.to_json()} if resume is not None else None
    last_at = None
    backlog: deque[tuple[int, int, bytes]] = deque(maxlen=PARK_BACKLOG)
    try:
        if req.stream:
            response = web.StreamResponse(
                headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            # A resumed stream continues one the client already has: no role chunk.
            try:
                await response.prepare(request)
                runtime.streaming.add(seq.request_id)
                await _relay_events(response, seq, writer, req, metrics, backlog, seq.resumed_with > 0, extension)
            except ConnectionResetError:  # the gateway went away (killed, or moved the request on): before the
                # stream's headers (while a resume fetched its pages, say) or mid-stream
                log.info("the reader of %s went away at %d tokens", seq.request_id, len(seq.generated))
            return response
        events = []
        while True:
            event = await seq.events.get()
            if isinstance(event, TokenEvent):
                last_at = metrics.token(seq, event, last_at)
                events.append(event)
                continue
            metrics.finish(seq)
            if event.reason not in ABNORMAL_ENDS:
                whole = writer.whole(events, event)
                if extension:
                    whole["lifeline"] = extension
                return web.json_response(whole, headers=headers)
            return _abnormal_end(seq, event, headers)
    finally:
        runtime.streaming.discard(seq.request_id)
        if seq.finished is None:  # the client went away: hold the request for a gateway, or free its slot and KV
            _park_or_abort(runtime, seq, writer, req, backlog)


# --- streams held for a gateway that takes them over ----------------------------------------------------------------
PARK_BACKLOG = 4096  # the last chunks written to a stream, replayed from where its client's tokens end
LET_GO_S = 3.0  # how long a takeover waits for the handler of a broken stream to notice


@dataclass(eq=False)
class Parked:
    """A gateway's request whose stream broke while it ran: it goes on generating into its queue, and the chunks
    already written (some of which the client may never have got) are kept, for a gateway that takes it over with
    `lifeline.attach` (a client reconnecting with Last-Event-ID to any gateway). Aborted when the hold expires."""

    seq: Sequence
    writer: ChunkWriter
    req: CompletionRequest
    backlog: deque
    expiry: asyncio.TimerHandle


def _park_or_abort(
    runtime: NodeRuntime, seq: Sequence, writer: ChunkWriter, req: CompletionRequest, backlog: deque
) -> None:
    engine, ext = runtime.engine, req.extension
    if not (req.stream and ext.request_id and ext.return_token_ids and runtime.park_grace_s > 0):
        engine.abort(seq.request_id)  # a plain client's: nobody can take it over
        return

    def expire() -> None:
        if runtime.parked.get(seq.request_id) is parked:
            del runtime.parked[seq.request_id]
            if seq.finished is None:
                log.info("request %s: no gateway took it over in %.0f s; aborted", seq.request_id, runtime.park_grace_s)
                engine.abort(seq.request_id)

    log.info("request %s: its stream broke at token %d; held %g s for a gateway to take it over",
             seq.request_id, backlog[-1][1] if backlog else 0, runtime.park_grace_s)  # fmt: skip
    expiry = asyncio.get_running_loop().call_later(runtime.park_grace_s, expire)
    parked = Parked(seq, writer, req, backlog, expiry)
    runtime.parked[seq.request_id] = parked


async def _relay_events(
    response: web.StreamResponse,
    seq: Sequence,
    writer: ChunkWriter,
    req: CompletionRequest,
    metrics: "RequestMetrics",
    backlog: deque,
    role_sent: bool,
    extension: dict | None = None,
) -> None:
    """Write the request's events as they come, each chunk kept in `backlog` (by the output indexes of its first
    token and of the token after its last) before it goes out, until it ends. The tokens an engine sent in one chunk
    go out in one (TokenEvent.more)."""
    first, last_at = True, None
    while True:
        event = await seq.events.get()
        if isinstance(event, TokenEvent):
            group = [event]
            while group[-1].more and not seq.events.empty():  # queued together by the adapter
                group.append(seq.events.get_nowait())
            for token in group:
                last_at = metrics.token(seq, token, last_at)
            chunk = writer.tokens_sse(group, not role_sent, extension if first else None)
            backlog.append((group[0].index, group[-1].index + 1, chunk))
            await response.write(chunk)
            first, role_sent = False, True
            continue
        await _stream_end(response, writer, req, event, extension if first else None)
        metrics.finish(seq)
        return


async def _attach(request: web.Request, runtime: NodeRuntime, req: CompletionRequest) -> web.StreamResponse:
    """A gateway takes over a parked stream: the ids of the tokens its client has, then every chunk from there
    (those written to the gateway that went away first, then the rest as they are made)."""
    metrics: RequestMetrics = request.app[METRICS_KEY]
    headers = {"X-Lifeline-Node": runtime.identity.name, "X-Request-Id": req.request_id}
    if not token_matches(_bearer(request), runtime.agent_token):
        return error_response(
            ApiError(401, "lifeline.attach needs the agent token", param="lifeline", kind="authentication_error"),
            headers,
        )
    delivered = req.extension.attach or 0  # set: this is an attach
    # A gateway that died leaves its stream's handler here writing into a closed connection until a write fails
    # (a token or two): a takeover that comes sooner waits for it to let go.
    deadline = time.monotonic() + LET_GO_S
    while req.request_id not in runtime.parked and req.request_id in runtime.streaming and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    parked: Parked | None = runtime.parked.get(req.request_id)
    if parked is None:
        return error_response(
            ApiError(
                404,
                f"request {req.request_id!r} is not held on this node: it finished, it was never here, no gateway took "
                f"it over within {runtime.park_grace_s:g} s, or the node restarted",
                param="lifeline.attach",
                code="request_not_held",
            ),
            headers,
        )
    seq, backlog = parked.seq, parked.backlog
    written = backlog[-1][1] if backlog else seq.resumed_with  # output tokens written to the stream that broke
    oldest = backlog[0][0] if backlog else written
    if delivered > written or (delivered < oldest and delivered < written):
        reason = "more output tokens than this node has written" if delivered > written else "too far behind"
        return error_response(
            ApiError(
                409,
                f"lifeline.attach: the client has {delivered} output tokens; this node wrote {written} and keeps the "
                f"chunks from token {oldest} on ({reason})",
                param="lifeline.attach",
            ),
            headers,
        )
    inside = next(((start, end) for start, end, _chunk in backlog if start < delivered < end), None)
    if inside is not None:  # a client is given whole chunks: a count inside one is not what a gateway relayed
        return error_response(
            ApiError(
                409,
                f"lifeline.attach: the client has {delivered} output tokens, inside the chunk of tokens "
                f"{inside[0]}-{inside[1] - 1} that this node wrote as one; attach at a chunk's end",
                param="lifeline.attach",
            ),
            headers,
        )
    del runtime.parked[req.request_id]
    parked.expiry.cancel()
    response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await response.prepare(request)
        attached = {"attached": {"generated_token_ids": list(seq.generated[:delivered]), "written": written}}
        await response.write(sse({"lifeline": attached}))
        for start, _end, chunk in list(backlog):
            if start >= delivered:
                await response.write(chunk)
        role_sent = bool(backlog) or delivered > 0 or seq.resumed_with > 0
        runtime.streaming.add(seq.request_id)
        await _relay_events(response, seq, parked.writer, parked.req, metrics, backlog, role_sent)
        return response
    except ConnectionResetError:  # this gateway went away too: parked again, for the next
        log.info("the reader of %s went away mid-stream at %d tokens", seq.request_id, len(seq.generated))
        return response
    finally:
        runtime.streaming.discard(seq.request_id)
        if seq.finished is None:
            _park_or_abort(runtime, seq, parked.writer, parked.req, backlog)


async def _stream_end(
    response: web.StreamResponse,
    writer: ChunkWriter,
    req: CompletionRequest,
    event: FinishEvent,
    extension: dict | None,
) -> None:
    if event.reason == "migrated":
        # Handed over at a token boundary: the gateway continues the stream on the target.
        chunk = writer.finish_chunk(None)
        chunk["lifeline"] = {"migrated": event.detail or {}}
        await response.write(sse(chunk))
        await response.write_eof()
        return
    if event.reason in ("abort", "error"):
        reason = (event.detail or {}).get("reason", "the request was aborted")
        await response.write(sse({"error": {"message": reason, "type": "node_failure", "param": None, "code": None}}))
        await response.write_eof()
        return
    chunk = writer.finish_chunk(event.reason)
    if extension:
        chunk["lifeline"] = extension
    await response.write(sse(chunk))
    if req.include_usage:
        await response.write(sse(writer.usage_chunk(event)))
    await response.write(sse("[DONE]"))
    await response.write_eof()


def _abnormal_end(seq: Sequence, event: FinishEvent, headers: dict) -> web.Response:
    if event.reason == "migrated":
        detail = {**(event.detail or {}), "generated_token_ids": list(seq.generated)}
        error = {
            "message": "The request moved to another node mid-way.",
            "type": "migrated",
            "param": None,
            "code": None,
        }
        return web.json_response({"error": error, "lifeline": {"migrated": detail}}, status=409, headers=headers)
    reason = (event.detail or {}).get("reason", "the request was aborted")
    return error_response(ApiError(503 if event.reason == "error" else 409, reason, kind="node_failure"), headers)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _run_request(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _run_request(request, "chat")


async def models(request: web.Request) -> web.Response:
    engine = request.app[RUNTIME_KEY].engine
    created = int(time.time())
    data = [
        {
            "id": engine.model.key,
            "object": "model",
            "created": created,
            "owned_by": "lifeline",
            "root": engine.model.name,
            "max_model_len": engine.deployment.max_context_tokens,
        }
    ]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME_KEY]
    engine = runtime.engine
    if runtime.faults.gpu_lost:
        return web.json_response({"status": "gpu_lost", "gpus": sorted(runtime.faults.lost_gpus)}, status=503)
    ok = engine.model_state == "serving"
    return web.json_response({"status": "ok" if ok else engine.model_state}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=generate_latest(request.app[REGISTRY_KEY]),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


def status_document(runtime: NodeRuntime) -> dict:
    engine, identity = runtime.engine, runtime.identity
    load = engine.status()
    return {
        "name": identity.name,
        "session": identity.session,
        "pid": identity.pid,
        "host": identity.host,
        "rack": identity.rack,
        "server": identity.server,
        "nvl_domain": identity.nvl_domain,
        "network": identity.network,
        "provider": identity.provider,
        "region": identity.region,
        "address": identity.address,
        "spare": identity.spare,
        "model": engine.model.key,
        "gpu": engine.deployment.gpu.key,
        "tp": engine.deployment.tp,
        "engine": engine.describe(),
        "time_scale": load.time_scale,
        "load": load.to_json(),
        "counters": {**engine.counters, "steps": load.steps},
        "checkpoints": runtime.store.stats(),
        "streaming": runtime.streamer.stats(),
        "faults": runtime.faults.to_json(),
        "telemetry_source": getattr(runtime.telemetry, "source", None),
        "loop_lag_p99_ms": runtime.loop_lag.p99_ms(),
    }


async def status(request: web.Request) -> web.Response:
    return web.json_response(status_document(request.app[RUNTIME_KEY]))


def offered_capabilities(runtime: NodeRuntime) -> list[str]:
    """What the node offers, as it registers: the agent's own services and its engine's capabilities."""
    engine = runtime.engine
    offered = [
        "openai",
        "events",
        *(c for c in CAPABILITIES if c in engine.capabilities and c != "faults"),
        "telemetry",
    ]
    if "faults" in engine.capabilities and runtime.faults.enabled:
        offered.append("faults")  # switched on per node, for staging (--enable-faults)
    return offered


async def capabilities(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME_KEY]
    engine = runtime.engine
    cannot = {name: capability.does for name, capability in CAPABILITIES.items() if name not in engine.capabilities}
    return web.json_response({"engine": engine.describe(), "offers": offered_capabilities(runtime), "cannot": cannot})


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize, for the emulated engine's tokenizer: a prompt, or chat messages as the chat is templated.

    An adapter in front of this node (as in front of vLLM) renders and tokenizes through it.
    """
    engine = request.app[RUNTIME_KEY].engine
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object with a `prompt` or `messages`.", param="body")
    if "messages" in body:
        ids = parse({"model": engine.model.key, "messages": body["messages"]}, "chat").prompt_ids
    else:
        ids = parse({"model": engine.model.key, "prompt": body.get("prompt")}, "completion").prompt_ids
    max_len = engine.deployment.max_context_tokens
    return web.json_response({"count": len(ids), "max_model_len": max_len, "tokens": ids})


async def telemetry(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME_KEY]
    readings = await asyncio.get_running_loop().run_in_executor(None, runtime.telemetry.read)
    return web.json_response({"source": runtime.telemetry.source, "gpus": [r.to_json() for r in readings]})


async def events(request: web.Request) -> web.StreamResponse:
    """Server-sent events: one load status per load-changing event in the engine."""
    engine = request.app[RUNTIME_KEY].engine
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    queue = engine.subscribe()
    try:
        await response.prepare(request)  # a reader gone before the headers (a gateway killed) is one gone later
        await response.write(f"event: status\ndata: {json.dumps(engine.status().to_json())}\n\n".encode())
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=KEEPALIVE_S)
            except TimeoutError:
                await response.write(b": keep-alive\n\n")
                continue
            await response.write(f"event: status\ndata: {json.dumps(item)}\n\n".encode())
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        engine.unsubscribe(queue)
    return response


def build_app(runtime: NodeRuntime, telemetry_collector=None) -> web.Application:
    app = web.Application(middlewares=[json_errors("node", log)], client_max_size=64 * 1024 * 1024)
    registry = CollectorRegistry()
    registry.register(EngineCollector(runtime.engine, runtime.identity.name))
    if telemetry_collector is not None:
        registry.register(telemetry_collector)
    app[REGISTRY_KEY] = registry
    app[METRICS_KEY] = RequestMetrics(registry, runtime.engine.model.key, runtime.identity.name)
    app[RUNTIME_KEY] = runtime
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get(protocol.HEALTH_PATH, health)
    app.router.add_get(protocol.METRICS_PATH, metrics)
    app.router.add_get(protocol.STATUS_PATH, status)
    app.router.add_get(protocol.EVENTS_PATH, events)
    app.router.add_get("/agent/telemetry", telemetry)
    app.router.add_get("/agent/capabilities", capabilities)
    if "tokenize" in runtime.engine.capabilities:
        app.router.add_post("/tokenize", tokenize)
    control_api.add_routes(app)
    return app
