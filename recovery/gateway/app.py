"""The gateway's HTTP side: authenticate, route, relay; and its background duties.

No database anywhere here: API keys, the routing table and the cluster's
settings come from the in-memory RoutingView, refreshed from Redis; what
happened goes back through Redis streams (recovery.gateway.signals).
"""

import asyncio
import json
import logging
import os
import socket
import time
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from redis.exceptions import RedisError

from recovery.gateway.coordinator import Coordinator, Flight
from recovery.gateway.relay import ClientGone, Relay, openai_error
from recovery.gateway.signals import Signals
from recovery.gateway.table import RoutingView, Tenant
from workers import catalog, tokens
from workers.aio import cancel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    redis_url: str
    namespace: str
    name: str = ""
    agent_token: str | None = None  # to send holders and resumes to nodes
    drain_timeout_s: float = 30.0

    @property
    def gateway_name(self) -> str:
        return self.name or f"{socket.gethostname()}-{os.getpid()}"


CONFIG_KEY = web.AppKey("config", GatewayConfig)
VIEW_KEY = web.AppKey("view", RoutingView)
COORDINATOR_KEY = web.AppKey("coordinator", Coordinator)
METRICS_KEY = web.AppKey("metrics", object)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
TASKS_KEY = web.AppKey("tasks", list)

_ALIASES = {m.name: m.key for m in catalog.MODELS.values()}
SHED_RETRY_AFTER_S = 30  # document 003's shedding answer


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("lifeline_gateway_requests", "Finished requests by outcome.", ["status", "tier"], registry=registry)
        self.migrations = Counter("lifeline_migrations", "Requests moved to another node, by method.", ["kind", "method"], registry=registry)
        self.stall = Histogram(
            "lifeline_recovery_stall_seconds", "Client-visible gap around a move: last token before to first after.", registry=registry,
            buckets=(0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5, 10),
        )
        self.shed = Counter("lifeline_gateway_shed", "Requests refused by the degradation level, by tier.", ["tier"], registry=registry)
        self.ttft = Histogram("lifeline_gateway_ttft_seconds", "Time to first token, as the client sees it.", ["tier"], registry=registry,
                              buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


def _authenticate(request: web.Request) -> Tenant | None:
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key:
        return None
    return request.app[VIEW_KEY].tenant_for(key.strip())


def _prompt_tokens(body: dict) -> int:
    """Roughly the node's count: the same tokenizer for the emulated engine."""
    if isinstance(body.get("prompt"), str):
        return len(tokens.encode(body["prompt"]))
    messages = body.get("messages")
    if isinstance(messages, list):
        text = " ".join(m.get("content") for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
        return len(tokens.encode(text)) + 3 * len(messages)
    return 0


async def _serve(request: web.Request, path: str) -> web.StreamResponse:
    view, coordinator = request.app[VIEW_KEY], request.app[COORDINATOR_KEY]
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
    if model not in view.models() and model not in catalog.MODELS:
        served = ", ".join(sorted(view.models())) or "nothing right now"
        return openai_error(404, f"The model `{model}` does not exist: this cluster serves {served}.", "invalid_request_error", "model")
    config = view.config
    if not config.accept_new:
        return openai_error(503, f"The cluster is at degradation level {config.degradation_level}: it takes no new requests while the ones "
                            f"in flight finish. Try again in {SHED_RETRY_AFTER_S} s.", "service_unavailable",
                            headers={"Retry-After": str(SHED_RETRY_AFTER_S)})
    if tenant.tier in config.shed_tiers:
        request.app[METRICS_KEY].shed.labels(tenant.tier).inc()
        return openai_error(429, f"The cluster is at degradation level {config.degradation_level} and sheds {tenant.tier} traffic to keep "
                            f"its SLOs for higher tiers. Try again in {SHED_RETRY_AFTER_S} s.", "rate_limit_exceeded",
                            headers={"Retry-After": str(SHED_RETRY_AFTER_S)})
    extension = body.get("lifeline") if isinstance(body.get("lifeline"), dict) else {}
    request_id = str(extension.get("request_id") or f"gw-{os.urandom(8).hex()}")
    if request_id in coordinator.flights:
        return openai_error(409, f"lifeline.request_id {request_id!r} is already in flight.", "invalid_request_error", "lifeline.request_id")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or (16 if path.endswith("/completions") and "prompt" in body else 512)
    flight = Flight(request_id, tenant.tenant, tenant.tier, model, _prompt_tokens(body), int(max_tokens) if isinstance(max_tokens, int) else 512)
    coordinator.flights[request_id] = flight
    relay = Relay(coordinator, request, {**body, "model": model}, flight, path)
    status = "ok"
    try:
        response = await relay.run()
        if response.status >= 400 or relay.finish_reason == "error":
            status = "error" if response.status >= 500 or relay.finish_reason == "error" else "rejected"
        return response
    except ClientGone:
        status = "client_gone"
        return relay.response
    except asyncio.CancelledError:
        status = "client_gone"
        raise
    finally:
        coordinator.flights.pop(request_id, None)
        _report(request.app, flight, relay, status)


def _report(app: web.Application, flight: Flight, relay: Relay, status: str) -> None:
    metrics: GatewayMetrics = app[METRICS_KEY]
    metrics.requests.labels(status, flight.tier).inc()
    ttft = (flight.first_token_at - flight.started) if flight.first_token_at else None
    n = len(flight.generated)
    tpot = ((flight.last_token_at - flight.first_token_at) / (n - 1)) if n > 1 and flight.first_token_at else None
    if ttft is not None:
        metrics.ttft.labels(flight.tier).observe(ttft)
    for move in flight.migrations:
        metrics.migrations.labels(move["kind"], move.get("method") or move["planned_method"]).inc()
        metrics.stall.observe(move["stall_ms"] / 1000)
    app[COORDINATOR_KEY].signals.outcome(
        request_id=flight.request_id, tenant=flight.tenant, tier=flight.tier, model=flight.model, status=status,
        node=flight.node, nodes=relay.nodes, prompt_tokens=flight.prompt_tokens, completion_tokens=n,
        ttft_ms=round(ttft * 1000, 2) if ttft is not None else None, tpot_ms=round(tpot * 1000, 3) if tpot is not None else None,
        e2e_ms=round((time.monotonic() - flight.started) * 1000, 2), finish_reason=relay.finish_reason,
        started_at=flight.started_at, migrations=flight.migrations,
    )


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "/v1/completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "/v1/chat/completions")


async def models(request: web.Request) -> web.Response:
    if _authenticate(request) is None:
        return openai_error(401, "Missing or unknown API key.", "authentication_error")
    names = sorted(request.app[VIEW_KEY].models())
    return web.json_response({"object": "list", "data": [{"id": m, "object": "model", "owned_by": "lifeline"} for m in names]})


async def healthz(request: web.Request) -> web.Response:
    view, coordinator = request.app[VIEW_KEY], request.app[COORDINATOR_KEY]
    return web.json_response({
        "status": "ok", "gateway": coordinator.name, "nodes": len(view.routes), "models": sorted(view.models()),
        "in_flight": len(coordinator.flights), "lost": sorted(coordinator.failed), "placement_policy": view.config.placement_policy,
        "degradation_level": view.config.degradation_level, "weights": {name: route.weight for name, route in sorted(view.routes.items())},
        "watching": sorted(n for n in view.routes if coordinator.watcher.connected(n)),
    })


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(request.app[REGISTRY_KEY]), headers={"Content-Type": "text/plain; version=0.0.4"})


async def _publish_inflight(app: web.Application) -> None:
    """Every second: this gateway's in-flight requests, for the control plane's pages and drains."""
    coordinator = app[COORDINATOR_KEY]
    while True:
        await coordinator.signals.publish_inflight({rid: f.summary() for rid, f in coordinator.flights.items()})
        await asyncio.sleep(1.0)


async def _follow_commands(app: web.Application) -> None:
    """Commands from the control plane, e.g. migrate every request off a node being drained."""
    coordinator, view = app[COORDINATOR_KEY], app[VIEW_KEY]
    while True:
        pubsub = view.redis.pubsub()
        try:
            await pubsub.subscribe(view.keys.gateway_commands)
            async for message in pubsub.listen():
                if message.get("type") != "message":
                    continue
                command = json.loads(message["data"])
                if command.get("action") == "migrate":
                    coordinator._spawn(coordinator.migrate_node(command["node"], command.get("id", "")))
        except asyncio.CancelledError:
            raise
        except (RedisError, OSError, ValueError) as exc:
            log.warning("command channel interrupted (%s); retrying", exc)
            await asyncio.sleep(1)
        finally:
            try:
                await pubsub.aclose()
            except (RedisError, OSError):
                pass


def build_app(config: GatewayConfig) -> web.Application:
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app[CONFIG_KEY] = config
    registry = CollectorRegistry()
    app[REGISTRY_KEY] = registry
    app[METRICS_KEY] = GatewayMetrics(registry)

    async def lifecycle(app_: web.Application):
        view = RoutingView(config.redis_url, config.namespace)
        await view.start()
        headers = {"Authorization": f"Bearer {config.agent_token}"} if config.agent_token else {}
        coordinator = Coordinator(view, Signals(config.redis_url, config.namespace, config.gateway_name), config.gateway_name, headers)
        coordinator.start()
        app_[VIEW_KEY], app_[COORDINATOR_KEY] = view, coordinator
        app_[TASKS_KEY] = [asyncio.create_task(_publish_inflight(app_)), asyncio.create_task(_follow_commands(app_))]
        yield
        for task in app_[TASKS_KEY]:
            await cancel(task)
        await coordinator.close()
        await coordinator.signals.close()
        await view.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app

