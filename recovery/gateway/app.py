"""The gateway's HTTP side: authenticate, route, relay; and its background duties.

No database anywhere here: API keys, the routing table and the cluster's
settings come from the in-memory RoutingView, refreshed from Redis; what
happened goes back through Redis streams (recovery.gateway.signals).
"""

import asyncio
import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from redis.exceptions import RedisError

from recovery.gateway.coordinator import Coordinator, Flight
from recovery.gateway.relay import ClientGone, Relay, Takeover, openai_error
from recovery.gateway.signals import Signals
from recovery.gateway.table import RoutingView
from recovery.policy import slo, slo_rules
from recovery.protocol import Tenant
from workers import catalog
from workers.aio import cancel
from workers.openai_api import json_errors, read_json
from workers.openai_schema import REQUEST_ID, ApiError, CompletionRequest, parse

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    redis_url: str
    namespace: str
    name: str = ""
    agent_token: str | None = None  # to send holders and resumes to nodes
    routing_refresh_s: float = 5.0  # re-read the routing table this often even when no change was announced

    @property
    def gateway_name(self) -> str:
        return self.name or f"{socket.gethostname()}-{os.getpid()}"


VIEW_KEY = web.AppKey("view", RoutingView)
COORDINATOR_KEY = web.AppKey("coordinator", Coordinator)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
TASKS_KEY = web.AppKey("tasks", list)
STARTED_KEY = web.AppKey("started", int)

_ALIASES = {m.name: m.key for m in catalog.MODELS.values()}
SHED_RETRY_AFTER_S = 30  # document 003's shedding answer
LARGE_BODY_BYTES = 64 * 1024  # validated in a worker thread above this
TAKEOVER_WAIT_S = 3.0  # how long a resumed stream waits for this gateway to let go of its old relay


NO_MODEL = "none"  # the model label of an answer given before the request named a model this cluster serves
# The answers the SLO rules count (prometheus/slo.yml: ok, error, shed), by the codes they come with: made present at
# 0 for every tier of every model served. Prometheus's rate() takes a series' first sample as its start: a series
# born with the first shed request would not count it, and a burst of them scraped once not at all (found by a real
# Prometheus in the suite: best effort shed 35 times, its 5-minute error ratio 0).
COUNTED_ANSWERS = (("ok", 200), ("error", 200), ("error", 500), ("error", 502), ("shed", 429), ("shed", 503))


class GatewayMetrics:
    """The gateway's /metrics; the rules in prometheus/ use these names. The latency histograms' buckets are the SLO
    rollups' bounds (recovery.policy.slo), so every objective's threshold is a bucket bound there too."""

    def __init__(self, registry: CollectorRegistry):
        self.zeroed: set[str] = set()  # the models whose counters are present (served())
        self.requests = Counter(
            "lifeline_gateway_requests",
            "Every answer the gateway gave, by outcome (ok, error, shed, rejected, client_gone), tier, HTTP status "
            "and model.",
            ["status", "tier", "code", "model"],
            registry=registry,
        )
        self.migrations = Counter(
            "lifeline_migrations",
            "Requests moved to another node, by kind (failure, planned), method, source node and target node.",
            ["kind", "method", "source", "target"],
            registry=registry,
        )
        self.tokens_lost = Counter(
            "lifeline_tokens_lost",
            "Tokens a client had received of a stream that then ended in an error: its answer was cut short and "
            "must be asked for again. Lifeline's promise is zero.",
            ["tier", "model"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "lifeline_gateway_in_flight", "Requests this gateway is relaying now.", registry=registry
        )
        self.stall = Histogram(
            "lifeline_recovery_stall_seconds",
            "Client-visible gap around a move: last token before to first after.",
            registry=registry,
            buckets=(0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5, 10),
        )
        self.shed = Counter(
            "lifeline_gateway_shed",
            "Requests refused by their model's degradation level, by tier.",
            ["model", "tier"],
            registry=registry,
        )
        self.ttft = Histogram(
            "lifeline_gateway_ttft_seconds",
            "Time to first token, as the client sees it, by tier and model.",
            ["tier", "model"],
            registry=registry,
            buckets=tuple(b / 1000 for b in slo.TTFT_BOUNDS_MS),
        )
        self.tpot = Histogram(
            "lifeline_gateway_tpot_seconds",
            "Time per output token after the first, as the client sees it, by tier and model.",
            ["tier", "model"],
            registry=registry,
            buckets=tuple(b / 1000 for b in slo.TPOT_BOUNDS_MS),
        )

    def answered(self, outcome: str, tier: str, code: int, model: str = NO_MODEL) -> None:
        self.requests.labels(outcome, tier, str(code), model).inc()

    def served(self, models: Iterable[str]) -> None:
        """Every counter a rule reads, present at 0 for each tier of `models` (COUNTED_ANSWERS), once per model."""
        for model in set(models) - self.zeroed:
            for tier in slo_rules.TIERS:
                for outcome, code in COUNTED_ANSWERS:
                    self.requests.labels(outcome, tier, str(code), model)
                self.shed.labels(model, tier)
                self.tokens_lost.labels(tier, model)
            self.zeroed.add(model)


METRICS_KEY = web.AppKey("metrics", GatewayMetrics)


def _authenticate(request: web.Request) -> Tenant | None:
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key:
        return None
    return request.app[VIEW_KEY].tenant_for(key.strip())


def _refusal(error: ApiError, headers: dict | None = None) -> web.Response:
    return web.json_response(error.to_json(), status=error.status, headers=headers)


def _validate(request: web.Request, body: dict, kind: str) -> CompletionRequest:
    """The whole request checked before anything is booked for it: the model served, then the schema the nodes use."""
    view = request.app[VIEW_KEY]
    model = body.get("model")
    if isinstance(model, str) and model:
        model = _ALIASES.get(model, model)
        if model not in view.served_models():
            served = ", ".join(sorted(view.served_models())) or "nothing right now"
            raise ApiError(
                404,
                f"The model `{model}` does not exist: this cluster serves {served}.",
                param="model",
                code="model_not_found",
            )
    context = None
    if isinstance(model, str) and model in catalog.MODELS:
        # The longest any node of the model can hold; a node that holds less refuses the rest itself.
        fits = [r.deployment.max_context_tokens for r in view.routes.values() if r.model == model]
        context = max(fits) if fits else catalog.MODELS[model].context_tokens
    return parse({**body, "model": model} if isinstance(model, str) else body, kind, context)


def request_key(body: dict) -> str:
    """A request's content, fingerprinted: the same request sent again (a client's retry) has the same key."""
    content = {k: v for k, v in body.items() if k not in ("lifeline", "stream", "stream_options")}
    return hashlib.blake2b(json.dumps(content, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()


async def _serve(request: web.Request, path: str) -> web.StreamResponse:
    """Authenticate, validate, admit, then relay; every answer, refusals included, is counted once."""
    metrics: GatewayMetrics = request.app[METRICS_KEY]
    view, coordinator = request.app[VIEW_KEY], request.app[COORDINATOR_KEY]
    tenant = _authenticate(request)
    if tenant is None:
        metrics.answered("rejected", "none", 401)
        return openai_error(
            401,
            "Missing or unknown API key: send `Authorization: Bearer <key>` "
            "with a key from `python manage.py create_api_key`.",
            "authentication_error",
        )
    try:
        body = await read_json(request)
        kind = "chat" if path.endswith("/chat/completions") else "completion"
        if (request.content_length or 0) > LARGE_BODY_BYTES:
            # Tokenizing a long prompt takes a while: off the event loop, so the streams it relays keep flowing.
            req = await asyncio.get_running_loop().run_in_executor(None, _validate, request, body, kind)
        else:
            req = _validate(request, body, kind)
    except ApiError as exc:
        metrics.answered("rejected", tenant.tier, exc.status)
        return _refusal(exc)
    client_key = request_key({**body, "model": req.model})  # before a seed is chosen for it: the client's own
    takeover = None
    if request.headers.get("Last-Event-ID") is not None:
        try:
            takeover = await _takeover(request, coordinator, tenant, req, client_key)
        except ApiError as exc:
            metrics.answered("rejected", tenant.tier, exc.status, req.model)
            return _refusal(exc)
    degraded = view.config.level_of(req.model)  # this model's level: another model's loss never sheds it
    if takeover is not None:
        pass  # a stream already under way: no level sheds what it already admitted
    elif not degraded.accept_new:
        metrics.answered("shed", tenant.tier, 503, req.model)
        _report_shed(coordinator, tenant, req, 503, degraded.level)
        return openai_error(
            503,
            f"{req.model} is at degradation level {degraded.level}: it takes no new requests while the ones "
            f"in flight finish. Try again in {SHED_RETRY_AFTER_S} s.",
            "service_unavailable",
            headers={"Retry-After": str(SHED_RETRY_AFTER_S)},
        )
    if tenant.tier in degraded.shed_tiers:
        metrics.shed.labels(req.model, tenant.tier).inc()
        metrics.answered("shed", tenant.tier, 429, req.model)
        _report_shed(coordinator, tenant, req, 429, degraded.level)
        return openai_error(
            429,
            f"{req.model} is at degradation level {degraded.level} and sheds {tenant.tier} traffic to keep "
            f"its SLOs for higher tiers. Try again in {SHED_RETRY_AFTER_S} s.",
            "rate_limit_exceeded",
            headers={"Retry-After": str(SHED_RETRY_AFTER_S)},
        )
    request_id = takeover.request_id if takeover else req.extension.request_id or f"gw-{os.urandom(8).hex()}"
    flight = Flight(
        request_id, tenant.tenant, tenant.tier, req.model, req.prompt_tokens, req.params.max_tokens, trust=tenant.trust
    )
    if takeover is not None:
        # The client came back to the gateway that relayed its stream before it noticed the client went away.
        deadline = time.monotonic() + TAKEOVER_WAIT_S
        while request_id in coordinator.flights and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    if not coordinator.admit(flight):
        metrics.answered("rejected", tenant.tier, 409, req.model)
        return openai_error(
            409,
            f"lifeline.request_id {request_id!r} is already in flight.",
            "invalid_request_error",
            "lifeline.request_id",
        )
    body = {**body, "model": req.model}
    if req.params.temperature > 0 and body.get("seed") is None:
        # A sampled request gets its seed here, so a node that continues it draws the same text.
        body["seed"] = req.params.seed
    relay = Relay(coordinator, request, body, req, flight, path, request_key(body), client_key, takeover)
    status, response = "error", None
    try:
        response = await relay.run()
        if response.status >= 500 or relay.finish_reason == "error":
            status = "error"
        elif response.status >= 400:
            status = "rejected"
        else:
            status = "ok"
        return response
    except ClientGone:
        status = "client_gone"
        response = relay.stream  # gone while being written to: its response exists
        return response
    except asyncio.CancelledError:
        status = "client_gone"
        raise
    except Exception:
        if relay.response is None:
            raise  # nothing sent yet: the error middleware answers a JSON 500
        # The stream had started: its status line is gone, so it ends with an error event instead.
        log.exception("request %s failed in the gateway mid-stream", request_id)
        response = await relay.fail_stream("the gateway failed while relaying it; its log has the traceback")
        return response
    finally:
        # Released on every path, an exception included: a flight left behind would block its request id for good.
        coordinator.finished(flight)
        if relay.recorded and status != "client_gone":  # a client gone may come back for the rest (Last-Event-ID)
            coordinator.signals.stream_over(request_id, status)
        code = response.status if response is not None else (499 if status == "client_gone" else 500)
        _report(request.app, flight, relay, status, code)


async def _takeover(
    request: web.Request, coordinator: Coordinator, tenant: Tenant, req: CompletionRequest, client_key: str
) -> Takeover:
    """A client resumes a stream with Last-Event-ID (`<request id>.<tokens it has>`, the id of the last event it
    got): the stream this or another gateway relayed, taken over where its node holds it."""
    raw = request.headers["Last-Event-ID"]
    request_id, _, count = raw.strip().rpartition(".")
    if not REQUEST_ID.match(request_id) or not count.isdigit():
        raise ApiError(
            400,
            f"Last-Event-ID {raw[:80]!r} is not an event id of this gateway's: expected "
            "<request id>.<tokens received>, "
            "the `id:` of the last event the stream delivered",
            param="Last-Event-ID",
        )
    if not req.stream:
        raise ApiError(400, "Last-Event-ID resumes a stream: send the request with stream: true", param="stream")
    try:
        record, over = await coordinator.signals.stream_lookup(request_id)
    except (RedisError, OSError) as exc:
        raise ApiError(
            503, f"cannot look the stream up right now ({exc}): try again", kind="service_unavailable"
        ) from None
    if record is None:
        known = f"it ended ({over['how']})" if over else "no gateway relays a request with that id"
        raise ApiError(404, f"request {request_id!r} cannot be resumed: {known}", param="Last-Event-ID")
    if record["tenant"] != tenant.tenant:
        log.warning("refused a resume of %s: it belongs to another tenant than %s", request_id, tenant.tenant)
        raise ApiError(
            403, f"request {request_id!r} was not sent with this API key's tenant", param="Last-Event-ID",
            kind="permission_error",
        )  # fmt: skip
    if record["request_key"] != client_key or record["model"] != req.model:
        raise ApiError(
            400,
            f"Last-Event-ID names request {request_id!r}, but this body is not that request's: resend the same body",
            param="Last-Event-ID",
        )
    return Takeover(request_id, int(count), record["node"], tuple(record.get("holders") or ()))


def _report_shed(coordinator: Coordinator, tenant: Tenant, req: CompletionRequest, code: int, level: int) -> None:
    """A request the degradation level turned away (429 or 503) is an outcome too: the incident and the cluster's
    shed rate count it, and the SLO rollups count it against its tier at the level it happened."""
    coordinator.signals.outcome(
        request_id=f"shed-{os.urandom(8).hex()}",
        tenant=tenant.tenant,
        tier=tenant.tier,
        model=req.model,
        status="shed",
        http_status=code,
        degradation_level=level,
        prompt_tokens=req.prompt_tokens,
        e2e_ms=0.0,
        started_at=time.time(),
    )


def _report(app: web.Application, flight: Flight, relay: Relay, status: str, code: int) -> None:
    metrics: GatewayMetrics = app[METRICS_KEY]
    metrics.answered(status, flight.tier, code, flight.model)
    ttft = (flight.first_token_at - flight.started) if flight.first_token_at else None
    n = len(flight.generated)
    first, last = flight.first_token_at, flight.last_token_at
    tpot = ((last - first) / (n - 1)) if n > 1 and first is not None and last is not None else None
    if ttft is not None:
        metrics.ttft.labels(flight.tier, flight.model).observe(ttft)
    if tpot is not None:
        metrics.tpot.labels(flight.tier, flight.model).observe(tpot)
    if status == "error" and n:
        metrics.tokens_lost.labels(flight.tier, flight.model).inc(n)
    for move in flight.migrations:
        method = move.get("method") or move["planned_method"]
        metrics.migrations.labels(move["kind"], method, move["from"], move["to"]).inc()
        metrics.stall.observe(move["stall_ms"] / 1000)
    app[COORDINATOR_KEY].signals.outcome(
        request_id=flight.request_id,
        tenant=flight.tenant,
        tier=flight.tier,
        model=flight.model,
        status=status,
        http_status=code,
        degradation_level=app[VIEW_KEY].config.level_of(flight.model).level,
        node=flight.node,
        nodes=relay.nodes,
        prompt_tokens=flight.prompt_tokens,
        completion_tokens=n,
        ttft_ms=round(ttft * 1000, 2) if ttft is not None else None,
        tpot_ms=round(tpot * 1000, 3) if tpot is not None else None,
        e2e_ms=round((time.monotonic() - flight.started) * 1000, 2),
        finish_reason=relay.finish_reason,
        started_at=flight.started_at,
        migrations=flight.migrations,
    )


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "/v1/completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "/v1/chat/completions")


async def models(request: web.Request) -> web.Response:
    if _authenticate(request) is None:
        return openai_error(401, "Missing or unknown API key.", "authentication_error")
    names = sorted(request.app[VIEW_KEY].served_models())
    created = request.app[STARTED_KEY]
    data = [
        {
            "id": m,
            "object": "model",
            "created": created,
            "owned_by": "lifeline",
            "root": catalog.MODELS[m].name if m in catalog.MODELS else m,
            "max_model_len": max(
                (r.deployment.max_context_tokens for r in request.app[VIEW_KEY].routes.values() if r.model == m),
                default=catalog.MODELS[m].context_tokens if m in catalog.MODELS else None,
            ),
        }
        for m in names
    ]
    return web.json_response({"object": "list", "data": data})


async def healthz(request: web.Request) -> web.Response:
    view, coordinator = request.app[VIEW_KEY], request.app[COORDINATOR_KEY]
    return web.json_response(
        {
            "status": "ok",
            "gateway": coordinator.name,
            "nodes": len(view.routes),
            "models": sorted(view.models()),
            "in_flight": len(coordinator.flights),
            "lost": sorted(coordinator.failed),
            "placement_policy": view.config.placement_policy,
            "degradation_level": view.config.degradation_level,
            "degradation_levels": {model: m.level for model, m in sorted(view.config.models.items())},
            "weights": {name: route.weight for name, route in sorted(view.routes.items())},
            "watching": sorted(n for n in view.routes if coordinator.watcher.connected(n)),
        }
    )


async def metrics(request: web.Request) -> web.Response:
    gateway_metrics: GatewayMetrics = request.app[METRICS_KEY]
    gateway_metrics.in_flight.set(len(request.app[COORDINATOR_KEY].flights))
    gateway_metrics.served(request.app[VIEW_KEY].served_models())
    return web.Response(
        body=generate_latest(request.app[REGISTRY_KEY]), headers={"Content-Type": "text/plain; version=0.0.4"}
    )


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
    app = web.Application(client_max_size=16 * 1024 * 1024, middlewares=[json_errors("gateway", log)])
    app[STARTED_KEY] = int(time.time())
    registry = CollectorRegistry()
    app[REGISTRY_KEY] = registry
    app[METRICS_KEY] = GatewayMetrics(registry)

    async def lifecycle(app_: web.Application):
        view = RoutingView(config.redis_url, config.namespace, refresh_s=config.routing_refresh_s)
        await view.start()
        headers = {"Authorization": f"Bearer {config.agent_token}"} if config.agent_token else {}
        coordinator = Coordinator(
            view, Signals(config.redis_url, config.namespace, config.gateway_name), config.gateway_name, headers
        )
        coordinator.start()
        app_[VIEW_KEY], app_[COORDINATOR_KEY] = view, coordinator
        app_[TASKS_KEY] = [asyncio.create_task(_publish_inflight(app_)), asyncio.create_task(_follow_commands(app_))]
        yield
        for task in app_[TASKS_KEY]:
            await cancel(task)
        await coordinator.close()
        await coordinator.signals.leave()
        await coordinator.signals.close()
        await view.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app
