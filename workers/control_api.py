"""The node agent's control endpoints, all behind a bearer token.

Checkpoint pages from other nodes (`/agent/kv/...`), live migration of a
request, speculative assist (as verifier or as draft), reload, the batch
limit, GPU reset, and fault injection (a separate token, and only when the
node was started with it). Each needs a capability of the engine
(workers.engine_api.CAPABILITIES); where the engine does not offer it, the
endpoint answers 501 (`lacking`) before anything else, so a handler reads its
engine as one offering that capability (engine_api.MigrateEngine and the like).
"""

import asyncio
import functools
import logging
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import cast

import aiohttp
from aiohttp import web

from workers import catalog
from workers import faults as faults_
from workers.catalog import BLOCK_TOKENS
from workers.checkpoint import Peer
from workers.engine import propose_drafts
from workers.engine_api import (
    CAPABILITIES,
    Assist,
    AssistEngine,
    CheckpointEngine,
    ConfigEngine,
    DraftEngine,
    EngineError,
    FaultsEngine,
    MigrateEngine,
    ReloadEngine,
    ResetEngine,
    ServingEngine,
)
from workers.kvstore import PageRefused, page_from_wire
from workers.moe import ExpertRoutingTable, MoeError
from workers.openai_api import error_response, read_json
from workers.openai_schema import ApiError
from workers.protocol import KvBatch, ProtocolError
from workers.runtime import NodeRuntime, token_matches

log = logging.getLogger(__name__)

RUNTIME_KEY = web.AppKey("runtime", NodeRuntime)


def error(status: int, message: str, field: str | None = None, **extra) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error" if status == 400 else "control_error",
            "param": field,
        }
    }
    body.update(extra)
    return web.json_response(body, status=status)


def lacking(engine: ServingEngine, capability: str, param: str | None = None) -> ApiError:
    """The one answer to a call on a capability the engine does not offer: 501, in OpenAI's shape."""
    described = engine.describe()
    engine_ = described["kind"] + (f" at {described['url']}" if described.get("url") else "")
    return ApiError(
        501,
        f"This node's engine ({engine_}) cannot {CAPABILITIES[capability].does}: it does not offer `{capability}`. "
        f"See /agent/capabilities for what it offers.",
        param=param,
        kind="not_implemented",
    )


def require(engine: ServingEngine, capability: str, param: str | None = None) -> None:
    if capability not in engine.capabilities:
        raise lacking(engine, capability, param)


def offered(capability: str, handler):
    """An endpoint that needs `capability` of the engine: 501 without it, before the token is asked for."""

    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        engine = request.app[RUNTIME_KEY].engine
        if capability not in engine.capabilities:
            return error_response(lacking(engine, capability))
        return await handler(request)

    return wrapper


def _bearer(request: web.Request) -> str | None:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def agent_control(handler):
    """Endpoints other nodes and the control plane call, with the agent token."""

    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        runtime = request.app[RUNTIME_KEY]
        if not runtime.agent_token:
            return error(503, "Control endpoints are off on this node: start it with LIFELINE_AGENT_TOKEN set.")
        if not token_matches(_bearer(request), runtime.agent_token):
            return error(401, "The agent token is missing or wrong: send `Authorization: Bearer <agent token>`.")
        return await handler(request, runtime)

    return wrapper


async def _body(request: web.Request) -> dict:
    """The JSON object a control call sends; not JSON, or not an object, is a 400 naming the body."""
    return await read_json(request)


# --- checkpoint pages: this node as a holder -------------------------------------------
@agent_control
async def kv_batch(request: web.Request, runtime: NodeRuntime) -> web.Response:
    """Pages, commit records and drops from a serving node, in order."""
    try:
        batch = KvBatch.parse(await _body(request))
    except ProtocolError as exc:
        return error(400, str(exc), exc.field)
    if batch.model != runtime.engine.model.key:
        return error(
            400,
            f"model: this node serves {runtime.engine.model.key}; it cannot hold pages of {batch.model!r}",
            "model",
        )
    store = runtime.store
    accepted, refused = 0, []
    for i, data in enumerate(batch.pages):
        try:
            request_id, seq, page = page_from_wire(data, f"pages[{i}]")
            store.put(batch.source, batch.model, request_id, seq, page, direct=batch.direct)
            accepted += 1
        except PageRefused as exc:
            log.warning("refused a page from %s: %s", batch.source, exc)
            refused.append(
                {
                    "request_id": request_id,
                    "seq": seq,
                    "reason": exc.reason,
                    "message": str(exc),
                    "expected": exc.expected,
                }
            )
        except ProtocolError as exc:
            store.counters["refused_malformed"] = store.counters.get("refused_malformed", 0) + 1
            known = data if isinstance(data, dict) else {}
            refused.append(
                {
                    "request_id": known.get("request_id"),
                    "seq": known.get("seq"),
                    "reason": "malformed",
                    "message": str(exc),
                    "field": exc.field,
                }
            )
    committed = {}
    for commit in batch.commits:
        tokens_ = store.commit(commit.request_id, commit.seq, commit.tokens)
        if tokens_ is not None:
            committed[commit.request_id] = tokens_
    for request_id in batch.drops:
        store.drop(request_id)
    if accepted or batch.drops:
        runtime.engine.publish("checkpoint")
    return web.json_response({"accepted": accepted, "refused": refused, "committed": committed})


@agent_control
async def kv_get(request: web.Request, runtime: NodeRuntime) -> web.Response:
    request_id = request.match_info["request_id"]
    checkpoint = runtime.store.checkpoints.get(request_id)
    if checkpoint is None:
        return error(404, f"no checkpoint of {request_id} on {runtime.identity.name}")
    pages = [page.to_wire(request_id, i + 1) for i, page in enumerate(checkpoint.pages)]
    return web.json_response({**checkpoint.summary(), "pages": pages})


@agent_control
async def kv_drop(request: web.Request, runtime: NodeRuntime) -> web.Response:
    request_id = request.match_info["request_id"]
    dropped = runtime.store.drop(request_id)
    if dropped:
        runtime.engine.publish("checkpoint")
    return web.json_response({"request_id": request_id, "dropped": dropped})


@agent_control
async def kv_list(request: web.Request, runtime: NodeRuntime) -> web.Response:
    store = runtime.store
    return web.json_response({"stats": store.stats(), "checkpoints": [c.summary() for c in store.checkpoints.values()]})


# --- live migration: this node hands a request over ----------------------------------------
@agent_control
async def migrate(request: web.Request, runtime: NodeRuntime) -> web.Response:
    """Stop a request at a token boundary and hand its KV blocks to `target`.

    The caller then resumes it on the target with the generated token ids this
    returns; the target finds the pages in its store.
    """
    body = await _body(request)
    try:
        target = Peer.parse(body.get("target"), "target")
    except ValueError as exc:
        field, _, message = str(exc).partition(": ")
        return error(400, message, field)
    request_id = request.match_info["request_id"]
    engine = cast(MigrateEngine, runtime.engine)
    try:
        snapshot = await engine.request_migration(request_id)
    except EngineError as exc:
        return error(exc.status, str(exc))
    blocks = snapshot.blocks
    nbytes = len(blocks) * engine.model.kv_bytes_per_block
    # This end's NVLink as the injected faults leave it: a node whose NVLink is down hands over by PCIe or the network.
    here = replace(runtime.identity.placement, nvlink_down=runtime.faults.nvlink_down)
    link, share = catalog.node_link(here, target.placement, engine.deployment.gpu)
    seconds = catalog.kv_transfer_s(nbytes, link, share)
    answer = {
        "request_id": request_id,
        "source": runtime.identity.name,
        "target": target.name,
        "generated_token_ids": snapshot.generated,
        "tokens": len(snapshot.generated),
        "blocks": len(blocks),
        "kv_tokens": len(blocks) * BLOCK_TOKENS,
        "bytes": nbytes,
        "link": link,
        "transfer_ms": round(seconds * 1000, 3),
    }
    try:
        await runtime.streamer.push_all(target, request_id, blocks, direct=True)
        await asyncio.sleep(seconds * engine.config.time_scale)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        # The request is stopped either way; the caller re-prefills it elsewhere from these tokens.
        return error(
            502,
            f"could not hand the KV blocks to {target.name}: {exc}",
            "target",
            **{"lifeline": {"migrated": {**answer, "blocks": 0, "bytes": 0}}},
        )
    return web.json_response(answer)


@agent_control
async def set_holders(request: web.Request, runtime: NodeRuntime) -> web.Response:
    """Point a running request's checkpoint at new holders (one failed, or a second is wanted)."""
    body = await _body(request)
    raw = body.get("holders")
    if not isinstance(raw, list) or len(raw) > 2:
        return error(400, "must be a list of at most two holders", "holders")
    try:
        holders = tuple(Peer.parse(h, f"holders[{i}]") for i, h in enumerate(raw))
    except ValueError as exc:
        field, _, message = str(exc).partition(": ")
        return error(400, message, field)
    engine = cast(CheckpointEngine, runtime.engine)
    try:
        return web.json_response(engine.set_holders(request.match_info["request_id"], holders))
    except EngineError as exc:
        return error(exc.status, str(exc))


# --- speculative assist --------------------------------------------------------------------------
@agent_control
async def assist_start(request: web.Request, runtime: NodeRuntime) -> web.Response:
    """Pair this serving node with a draft-ready node: verify its k drafts per step."""
    body = await _body(request)
    try:
        draft = Peer.parse(body.get("draft"), "draft")
    except ValueError as exc:
        field, _, message = str(exc).partition(": ")
        return error(400, message, field)
    k = body.get("k", 4)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
        return error(400, "must be an integer from 1 to 16", "k")
    if "alpha" in body:
        return error(
            400,
            "is not taken: acceptance is an outcome of the drafts verified; the draft's agreement with the target "
            "is the catalog's for the model pair (or the nodes' --draft-agreement, for an experiment)",
            "alpha",
        )
    engine = cast(AssistEngine, runtime.engine)
    if engine.model.draft is None:
        return error(409, f"{engine.model.key} has no catalogued draft model to verify")
    agreement = _agreement(runtime, engine.model)
    session = aiohttp.ClientSession(headers=runtime.peer_headers, timeout=aiohttp.ClientTimeout(total=2))
    url = draft.address + "/agent/draft"
    model = engine.model.key

    async def propose(items: list[dict]) -> list[list[int]]:
        async with session.post(url, json={"model": model, "k": k, "items": items}) as response:
            answer = await response.json(content_type=None)
            if response.status != 200:
                raise RuntimeError(f"draft node answered {response.status}: {answer.get('error', {}).get('message')}")
            return answer["drafts"]

    old = engine.stop_assist()
    if old is not None:
        await old.aclose()
    try:
        engine.start_assist(Assist(draft, k, agreement, propose, close=session.close))
    except EngineError as exc:
        await session.close()
        return error(exc.status, str(exc))
    expected = expected_tokens_per_step(agreement, k)
    return web.json_response(
        {
            "draft": draft.name,
            "k": k,
            "agreement": agreement,  # modelled (catalog), as is the expectation from it
            "expected_tokens_per_step": round(expected, 3),
        }
    )


def _agreement(runtime: NodeRuntime, model: catalog.Model) -> float:
    """The pair's modelled per-token agreement: the catalog's, or the node's experiment override."""
    return model.draft_agreement if runtime.draft_agreement is None else runtime.draft_agreement


@agent_control
async def assist_stop(request: web.Request, runtime: NodeRuntime) -> web.Response:
    """End the pairing, with its own figures. `?draft=NAME` ends it only if NAME is the draft being verified:
    a draft node that finished loading must not end the pairing another draft node started since."""
    engine = cast(AssistEngine, runtime.engine)
    current = engine.assist
    wanted = request.query.get("draft")
    if current is None:
        return web.json_response({"stopped": False, "draft": None, **assist_report({})})
    if wanted and current.draft.name != wanted:
        return error(409, f"this node verifies {current.draft.name}'s drafts, not {wanted}'s", "draft")
    assist = engine.stop_assist()
    if assist is not None:
        await assist.aclose()
    return web.json_response({"stopped": True, "draft": current.draft.name, **assist_report(current.counters)})


def assist_report(counters: Mapping[str, int]) -> dict:
    """One pairing's measured acceptance (accepted over tested drafts) and tokens per assisted step."""
    counters = Counter(counters)
    tested, steps = counters["draft_tested"], counters["assist_steps"]
    return {
        "assist_steps": steps,
        "draft_proposed": counters["draft_proposed"],
        "draft_accepted": counters["draft_accepted"],
        "acceptance": round(counters["draft_accepted"] / tested, 4) if tested else None,
        "tokens_per_sequence_step": round(counters["assisted_tokens"] / counters["assisted_sequence_steps"], 3)
        if counters["assisted_sequence_steps"]
        else None,
    }


DRAFT_FIGURES = {"temperature": float, "seed": int, "top_p": float, "top_k": int, "min_p": float, "min_tokens": int}


def _draft_items_refusal(items) -> tuple[str, str] | None:
    """(field, why) for the first sequence a verifier sent that a draft model cannot continue, or None."""
    if not isinstance(items, list):
        return "items", "must be a list of sequences: {state, position, and their sampling figures}"
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            return f"items[{i}]", "must be an object: {state, position, ...}"
        state = item.get("state")
        try:
            bytes.fromhex(state if isinstance(state, str) else "?")
        except ValueError:
            return f"items[{i}].state", "must be the sequence's state, in hex"
        position = item.get("position")
        if not isinstance(position, int) or isinstance(position, bool) or not 0 <= position < 2**62:
            return f"items[{i}].position", "must be the sequence's position, a whole number"
        for key, kind in DRAFT_FIGURES.items():
            value = item.get(key)
            if value is None:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or (kind is int and isinstance(value, float))
            ):
                return f"items[{i}].{key}", f"must be {'an integer' if kind is int else 'a number'}"
            if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > 2**62:
                return f"items[{i}].{key}", "must be a finite number"
    return None


@agent_control
async def draft(request: web.Request, runtime: NodeRuntime) -> web.Response:
    """As a restarting node with only its draft model loaded: propose k tokens per sequence."""
    engine = cast(DraftEngine, runtime.engine)
    draft_key = engine.model.draft
    if engine.model_state != "draft_ready" or draft_key is None:  # a model without a draft never is draft-ready
        return error(409, f"{runtime.identity.name} is {engine.model_state}: only a draft-ready node proposes drafts")
    body = await _body(request)
    if body.get("model") != engine.model.key:
        return error(400, f"model: this node drafts for {engine.model.key}, not {body.get('model')!r}", "model")
    items = body.get("items") or []
    k = body.get("k", 4)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
        return error(400, "must be an integer from 1 to 16", "k")
    refusal = _draft_items_refusal(items)
    if refusal is not None:
        return error(400, refusal[1], refusal[0])
    drafted = propose_drafts(engine.model.key, k, items, _agreement(runtime, engine.model))
    # The draft model runs k decode steps over the batch on this node's GPU.
    draft_model = catalog.model(draft_key)
    deployment = catalog.Deployment(draft_model, engine.deployment.gpu, 1)
    context = sum(int(i.get("position", 0)) for i in items) + 512 * len(items)
    seconds = sum(deployment.decode_step_s(len(items), context + j * len(items)) for j in range(k))
    await asyncio.sleep(seconds * engine.config.time_scale)
    engine.counters["drafts_served"] += len(items)
    return web.json_response({"drafts": drafted, "draft_ms": round(seconds * 1000, 3)})


@agent_control
async def reload(request: web.Request, runtime: NodeRuntime) -> web.Response:
    body = await _body(request) if request.can_read_body else {}
    engine = cast(ReloadEngine, runtime.engine)
    aborted = engine.reload(cold=bool(body.get("cold", True)))
    return web.json_response({"reloading": True, "aborted": aborted, "model_state": engine.model_state})


@agent_control
async def switch_model(request: web.Request, runtime: NodeRuntime) -> web.Response:
    """Serve another model (a placement plan's move): the node, drained first, leaves the control plane and starts
    again as the same node with `model` on the same GPUs, loading it cold (its draft first where it has one), as a
    `vllm serve` restarted with another model would. 202 once it is on its way; 409 while requests are in flight."""
    body = await _body(request)
    engine = runtime.engine
    model = body.get("model")
    if not isinstance(model, str) or model not in catalog.MODELS or catalog.MODELS[model].is_draft:
        served = ", ".join(k for k, m in catalog.MODELS.items() if not m.is_draft)
        return error(400, f"model: {model!r} is not a catalog model this node can serve: one of {served}", "model")
    if model == engine.model.key:
        return error(409, f"the node already serves {model}", "model")
    try:
        catalog.Deployment.of(model, engine.deployment.gpu.key, engine.deployment.tp)
    except catalog.CatalogError as exc:
        return error(400, f"model: {exc}", "model")
    status = engine.status()
    busy = (status.running or 0) + (status.waiting or 0) + len(runtime.parked)
    if busy:
        return error(409, f"{busy} requests are in flight here: drain the node first (they migrate), then switch")
    if runtime.request_stop is None:
        return error(503, "the node is not serving yet")
    log.warning("%s: switching from %s to %s", runtime.identity.name, engine.model.key, model)
    runtime.switch_to = model
    runtime.request_stop()
    return web.json_response({"switching": True, "from": engine.model.key, "model": model}, status=202)


@agent_control
async def reset(request: web.Request, runtime: NodeRuntime) -> web.Response:
    """Reset the GPUs (remediation, so the agent token, with or without fault injection).

    Lasting faults end, lost GPUs come back, volatile ECC counts restart; every
    request in flight fails, and the model loads cold as after a restart.
    """
    failed = cast(ResetEngine, runtime.engine).reset_gpus()
    log.warning("%s: GPUs reset; %d requests in flight failed, the model loads again", runtime.identity.name, failed)
    return web.json_response({"reset": True, "aborted": failed, "model_state": runtime.engine.model_state})


# --- batch limit ----------------------------------------------------------------------------------
def _config(engine: ConfigEngine) -> dict:
    return {
        "batch_factor": engine.batch_factor,
        "batch_limit": engine.batch_limit,
        "max_num_seqs": engine.config.max_num_seqs,
    }


@agent_control
async def config_get(request: web.Request, runtime: NodeRuntime) -> web.Response:
    return web.json_response(_config(cast(ConfigEngine, runtime.engine)))


@agent_control
async def config_set(request: web.Request, runtime: NodeRuntime) -> web.Response:
    """Lower (or restore) the batch limit: the share `batch_factor` of max_num_seqs, at least one."""
    body = await _body(request)
    if body.get("batch_factor") is None:
        return error(
            400,
            "batch_factor is required: a number in (0, 1], the share of max_num_seqs to admit at once",
            "batch_factor",
        )
    engine = cast(ConfigEngine, runtime.engine)
    try:
        engine.set_batch_factor(body["batch_factor"])
    except EngineError as exc:
        return error(exc.status, str(exc), "batch_factor")
    config = _config(engine)
    log.info(
        "%s: batch limit now %d of %d (factor %s)",
        runtime.identity.name,
        config["batch_limit"],
        config["max_num_seqs"],
        config["batch_factor"],
    )
    return web.json_response(config)


# --- fault injection ------------------------------------------------------------------------------
def fault_control(handler):
    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        runtime = request.app[RUNTIME_KEY]
        if not runtime.faults.enabled:
            return error(
                403,
                f"Fault injection is off on {runtime.identity.name}: "
                "start the node with --enable-faults (staging only).",
            )
        if not token_matches(_bearer(request), runtime.fault_token):
            return error(401, "The fault token is missing or wrong: send `Authorization: Bearer <fault token>`.")
        return await handler(request, runtime)

    return wrapper


@fault_control
async def faults_get(request: web.Request, runtime: NodeRuntime) -> web.Response:
    return web.json_response(runtime.faults.to_json())


@fault_control
async def faults_inject(request: web.Request, runtime: NodeRuntime) -> web.Response:
    body = await _body(request)
    kind = body.pop("kind", None)
    try:
        fault = runtime.faults.inject(kind, body)
    except faults_.FaultError as exc:
        return error(400, str(exc), exc.field)
    log.warning("fault injected on %s: %s %s", runtime.identity.name, fault.kind, fault.params)
    if fault.kind in ("crash", "hang"):
        # Answer first, then act: the caller learns the fault landed.
        asyncio.get_running_loop().call_later(0.05, faults_.act, fault)
        return web.json_response({"fault": fault.to_json()}, status=202)
    if runtime.faults.gpu_lost:
        failed = cast(FaultsEngine, runtime.engine).fail_gpu()
        log.error("%s lost GPU %s: %d requests failed", runtime.identity.name, sorted(runtime.faults.lost_gpus), failed)
    runtime.engine.publish(f"fault_{fault.kind}")
    return web.json_response({"fault": fault.to_json(), "faults": runtime.faults.to_json()})


@fault_control
async def faults_clear(request: web.Request, runtime: NodeRuntime) -> web.Response:
    kind = request.query.get("kind")
    if kind is not None and kind not in faults_.KINDS:
        return error(400, f"{kind!r} is not a fault: expected one of {', '.join(faults_.KINDS)}", "kind")
    runtime.faults.clear(kind)
    runtime.engine.publish("fault_cleared")
    return web.json_response(runtime.faults.to_json())


@agent_control
async def ert_set(request: web.Request, runtime: NodeRuntime) -> web.Response:
    """An MoE attention worker's new expert routing table, from the control plane (document 001 §4.2): `ert`, and
    the `addresses` of EWs it names anew (a provisioned replacement). An older or equal version is refused (409),
    a malformed one (400, naming the part)."""
    path = getattr(runtime.engine, "experts", None)
    if path is None:
        return error(404, "this node is not an MoE attention worker: it has no expert routing table")
    body = await _body(request)
    addresses = body.get("addresses") or {}
    if not isinstance(addresses, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v.startswith(("http://", "https://"))
        for k, v in addresses.items()
    ):
        return error(400, "addresses: must map EW names to base URLs such as http://10.0.0.9:8300", "addresses")
    try:
        table = ExpertRoutingTable.parse(body.get("ert"), runtime.engine.model)
    except MoeError as exc:
        return error(400, str(exc), exc.field)
    unknown = sorted(table.ews() - set(path.addresses) - set(addresses))
    if unknown:
        return error(400, f"addresses: the table names EWs with no address: {', '.join(unknown)}", "addresses")
    if not path.update(table, addresses):
        return error(409, f"version {table.version} is not newer than this worker's {path.ert.version}", "ert.version")
    return web.json_response({"version": table.version, "down": sorted(path.refe.down)})


# Every control endpoint, with the engine capability it needs.
ROUTES = (
    ("POST", "/agent/kv/batch", kv_batch, "checkpoint"),
    ("GET", "/agent/kv", kv_list, "checkpoint"),
    ("GET", "/agent/kv/{request_id}", kv_get, "checkpoint"),
    ("DELETE", "/agent/kv/{request_id}", kv_drop, "checkpoint"),
    ("POST", "/agent/requests/{request_id}/migrate", migrate, "migrate"),
    ("POST", "/agent/requests/{request_id}/holders", set_holders, "checkpoint"),
    ("POST", "/agent/assist", assist_start, "assist"),
    ("DELETE", "/agent/assist", assist_stop, "assist"),
    ("POST", "/agent/draft", draft, "draft"),
    ("POST", "/agent/reload", reload, "reload"),
    ("POST", "/agent/model", switch_model, "switch_model"),
    ("POST", "/agent/reset", reset, "reset"),
    ("GET", "/agent/config", config_get, "config"),
    ("POST", "/agent/config", config_set, "config"),
    ("POST", "/agent/ert", ert_set, "config"),
    ("GET", "/agent/faults", faults_get, "faults"),
    ("POST", "/agent/faults", faults_inject, "faults"),
    ("DELETE", "/agent/faults", faults_clear, "faults"),
)


def add_routes(app: web.Application) -> None:
    for method, path, handler, capability in ROUTES:
        if method == "GET":
            app.router.add_get(path, offered(capability, handler))  # and HEAD, as aiohttp does for a GET
        else:
            app.router.add_route(method, path, offered(capability, handler))


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Source document 000, eq. 3: E[tokens per step] = (1 - alpha^(k+1)) / (1 - alpha)."""
    return (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else float(k + 1)
