"""The gateway's HTTP side: authenticate, pick a node, proxy the stream.

No database on this path: API keys and the routing table come from the
in-memory RoutingView, refreshed from Redis.
"""

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from recovery.gateway.table import RoutingView, Tenant
from recovery.policy.routing import RoundRobin
from workers import catalog

log = logging.getLogger(__name__)

RETRY_AFTER_S = 2
MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class GatewayConfig:
    redis_url: str
    namespace: str
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 60.0


VIEW_KEY = web.AppKey("view", RoutingView)
ROUTER_KEY = web.AppKey("router", RoundRobin)
SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)
CONFIG_KEY = web.AppKey("config", GatewayConfig)
METRICS_KEY = web.AppKey("metrics", object)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)

_ALIASES = {m.name: m.key for m in catalog.MODELS.values()}


def openai_error(status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return web.json_response(body, status=status, headers=headers)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("lifeline_gateway_requests", "Requests by outcome.", ["node", "status"], registry=registry)
        self.ttfb = Histogram(
            "lifeline_gateway_first_byte_seconds", "Time to the node's first byte.", registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )


def _authenticate(request: web.Request) -> Tenant | None:
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key:
        return None
    return request.app[VIEW_KEY].tenant_for(key.strip())


async def _proxy(request: web.Request, path: str) -> web.StreamResponse:
    view = request.app[VIEW_KEY]
    tenant = _authenticate(request)
    if tenant is None:
        return openai_error(401, "Missing or unknown API key: send `Authorization: Bearer <key>` with a key from `python manage.py create_api_key`.", "authentication_error")
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return openai_error(400, "The body is not valid JSON.", "invalid_request_error", "body")
    if not isinstance(body, dict):
        return openai_error(400, "The body must be a JSON object.", "invalid_request_error", "body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return openai_error(400, "model: is required", "invalid_request_error", "model")
    model = _ALIASES.get(model, model)
    body["model"] = model
    extension = body.setdefault("lifeline", {})
    if not isinstance(extension, dict):
        return openai_error(400, "lifeline: must be an object", "invalid_request_error", "lifeline")
    request_id = extension.setdefault("request_id", f"gw-{secrets.token_hex(10)}")
    if model not in view.models() and model not in catalog.MODELS:
        return openai_error(404, f"The model `{model}` does not exist: this cluster serves {', '.join(sorted(view.models())) or 'nothing right now'}.", "invalid_request_error", "model")

    payload = json.dumps(body).encode()
    tried: set[str] = set()
    router = request.app[ROUTER_KEY]
    metrics: GatewayMetrics = request.app[METRICS_KEY]
    session = request.app[SESSION_KEY]
    for _ in range(MAX_ATTEMPTS):
        routes = {r.name: r for r in view.candidates(model)}
        name = router.choose(model, list(routes), frozenset(tried))
        if name is None:
            break
        route = routes[name]
        tried.add(name)
        started = time.monotonic()
        try:
            upstream = await session.post(route.address + path, data=payload, headers={"Content-Type": "application/json"})
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("node %s unreachable for %s: %s", name, request_id, exc)
            metrics.requests.labels(name, "unreachable").inc()
            continue
        if upstream.status >= 500:
            # The node cannot take it (loading, overloaded): another node may.
            await upstream.release()
            metrics.requests.labels(name, str(upstream.status)).inc()
            continue
        metrics.ttfb.observe(time.monotonic() - started)
        return await _relay(request, upstream, route.name, request_id, metrics)
    return openai_error(
        503,
        f"No node can take a request for `{model}` right now: try again in {RETRY_AFTER_S} s.",
        "service_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


async def _relay(request: web.Request, upstream: aiohttp.ClientResponse, node: str, request_id: str, metrics: GatewayMetrics) -> web.StreamResponse:
    headers = {
        "Content-Type": upstream.headers.get("Content-Type", "application/json"),
        "X-Lifeline-Node": node,
        "X-Request-Id": request_id,
    }
    if "text/event-stream" in headers["Content-Type"]:
        headers["Cache-Control"] = "no-cache"
    response = web.StreamResponse(status=upstream.status, headers=headers)
    await response.prepare(request)
    outcome = str(upstream.status)
    try:
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionError) as exc:
        # The node broke off mid-stream. Resuming elsewhere comes with recovery dispatch;
        # until then the client gets an error event instead of a silent truncation.
        outcome = "broken"
        log.warning("node %s broke off %s mid-stream: %s", node, request_id, exc)
        error = {"error": {"message": f"node {node} failed mid-stream", "type": "node_failure", "param": None, "code": None}}
        try:
            await response.write(f"data: {json.dumps(error)}\n\n".encode())
            await response.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass
    except (ConnectionResetError, asyncio.CancelledError):
        outcome = "client_gone"
        raise
    finally:
        upstream.release()
        metrics.requests.labels(node, outcome).inc()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "/v1/completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "/v1/chat/completions")


async def models(request: web.Request) -> web.Response:
    if _authenticate(request) is None:
        return openai_error(401, "Missing or unknown API key.", "authentication_error")
    names = sorted(request.app[VIEW_KEY].models())
    return web.json_response({"object": "list", "data": [{"id": m, "object": "model", "owned_by": "lifeline"} for m in names]})


async def healthz(request: web.Request) -> web.Response:
    view = request.app[VIEW_KEY]
    return web.json_response({"status": "ok", "nodes": len(view.routes), "models": sorted(view.models())})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(request.app[REGISTRY_KEY]), headers={"Content-Type": "text/plain; version=0.0.4"})


def build_app(config: GatewayConfig) -> web.Application:
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app[CONFIG_KEY] = config
    app[ROUTER_KEY] = RoundRobin()
    registry = CollectorRegistry()
    app[REGISTRY_KEY] = registry
    app[METRICS_KEY] = GatewayMetrics(registry)

    async def lifecycle(app_: web.Application):
        view = RoutingView(config.redis_url, config.namespace)
        await view.start()
        app_[VIEW_KEY] = view
        timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s, sock_read=config.first_byte_timeout_s)
        app_[SESSION_KEY] = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        yield
        await app_[SESSION_KEY].close()
        await view.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app
