"""The cluster: each node's tile (database and its latest load in Redis) and the summary above them.

One function per shape, used by the page, the JSON API and the WebSocket
push alike, so all three always agree.
"""

import datetime as dt
import logging
import time
from collections import Counter
from urllib.parse import urlsplit

import redis
from django.conf import settings
from django.db.models import Count, OuterRef, Subquery

from console.readmodels.degradation import LEVEL_BADGE
from recovery import hot
from recovery.actions import capacity
from recovery.choices import (
    BREAKER_BADGE,
    HEALTH_BADGE,
    NODE_STATE_BADGE,
    BreakerState,
    Health,
    NodeState,
)
from recovery.models import Cluster, ModelCapacity, Node, NodeTransition, RequestOutcome, XidEvent
from recovery.policy import health as health_policy
from recovery.policy import lifecycle, load
from workers import catalog

log = logging.getLogger(__name__)

MODEL_STATE_LABELS = {
    "loading_draft": "loading draft model",
    "draft_ready": "draft ready, loading full model",
    "loading_full": "loading model",
    "serving": "serving",
}


# An Xid event this recent marks its GPU on the tile and in the table: the telemetry window the node page charts.
XID_FRESH_S = 600
# Above this many nodes the cluster page opens on the table, below it on the tiles (`?view=` overrides).
TABLE_VIEW_ABOVE = 48
VIEWS = ("tiles", "table")


def default_view(node_count: int) -> str:
    return "table" if node_count > TABLE_VIEW_ABOVE else "tiles"


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _hot_nodes(names: list[str]) -> tuple[dict[str, hot.NodeEntry], bool]:
    try:
        return hot.nodes(names), True
    except (redis.RedisError, hot.RedisNotConfigured) as exc:
        log.warning("live load unavailable: %s", exc)
        return {}, False


def _fresh_xids(node_ids: list[int]) -> dict[int, dict[int, dict]]:
    """The newest Xid event of the last XID_FRESH_S on each GPU, by node id and GPU index (-1: GPU unknown)."""
    since = dt.datetime.now(tz=dt.UTC) - dt.timedelta(seconds=XID_FRESH_S)
    fresh: dict[int, dict[int, dict]] = {}
    rows = XidEvent.objects.filter(node_id__in=node_ids, last_at__gte=since).order_by("last_at")
    for x in rows.only("node_id", "gpu_index", "code", "severity", "meaning", "last_at"):
        fresh.setdefault(x.node_id, {})[x.gpu_index] = {
            "code": x.code,
            "severity": x.severity,
            "meaning": x.meaning,
            "at": x.last_at.timestamp(),
        }
    return fresh


def attention(node: Node, xids: dict[int, dict]) -> tuple[str, list[str]]:
    """How a live node's tile is coloured, and why. "ok" (green) only for a node that is healthy, in routing at full
    weight with its breaker closed and no fresh Xid; "bad" (red) for one that is broken (UNHEALTHY, breaker open, a
    CRITICAL Xid) or out of routing for no planned reason; "warn" (amber) for the rest; "spare" for a healthy hot
    spare, out of routing on purpose. A tile never looks healthy while any of these says otherwise."""
    bad, warn = [], []
    if node.health == Health.UNHEALTHY:
        bad.append("unhealthy")
    elif node.health == Health.SUSPICIOUS:
        warn.append("suspicious")
    elif node.health == Health.DRAINING:
        warn.append("draining")
    if node.breaker == BreakerState.OPEN:
        bad.append("breaker open")
    elif node.breaker == BreakerState.HALF_OPEN:
        warn.append("breaker half-open")
    if node.cordoned:
        warn.append("cordoned")
    for gpu, x in sorted(xids.items()):
        where = f"GPU {gpu}" if gpu >= 0 else "an unknown GPU"
        (bad if x["severity"] == health_policy.CRITICAL else warn).append(f"Xid {x['code']} on {where}")
    if node.state == NodeState.SERVING:
        weight = node.weight
        if weight <= 0:
            if node.spare and not bad and not warn:
                return "spare", ["hot spare: out of routing until it is needed"]
            (warn if warn and not bad else bad).append("weight 0: takes no traffic")
        elif weight < 1:
            warn.append(f"weight {weight:g}: gets less traffic")
    tone = "bad" if bad else "warn" if warn else "ok"
    return tone, bad + warn


def node_card(node: Node, live: hot.NodeEntry | None, xids: dict[int, dict] | None = None) -> dict:
    """Everything a node tile shows. Figures a node does not report are None ("n/a")."""
    xids = xids or {}
    gpu = catalog.GPUS.get(node.gpu_key)
    alive = node.state in lifecycle.ALIVE
    live = live or hot.NodeEntry()
    last_seen = live.last_seen
    if last_seen is None and node.last_seen_at is not None:
        last_seen = node.last_seen_at.timestamp()
    load = None
    if alive and live.running is not None:
        kv_used, kv_total = live.kv_blocks_used, live.kv_blocks_total
        load = {
            "running": live.running,
            "waiting": live.waiting,
            "kv_used": kv_used,
            "kv_total": kv_total,
            "kv_pct": round(100 * kv_used / kv_total, 1) if kv_used is not None and kv_total else None,
            "step_ms": _round(live.step_ms),
        }
    gpus = [
        {
            "index": g.index,
            "uuid": g.uuid,
            "name": g.name,
            "memory_gb": round(g.memory_bytes / 1e9),
            "xid": xids.get(g.index),
        }
        for g in node.gpus.all()
    ]
    tone, problems = attention(node, xids) if alive else (None, [])
    badge = NODE_STATE_BADGE[NodeState(node.state)]
    if tone in ("bad", "warn", "spare"):
        # A SERVING badge is green only when nothing below it says otherwise.
        badge = {"bad": "red", "warn": "amber", "spare": "blue"}[tone]
    return {
        "id": node.pk,
        "name": node.name,
        "state": node.state,
        "state_label": NodeState(node.state).label,
        "badge": badge,
        "tone": tone,
        "problems": problems,
        "alive": alive,
        "state_changed_at": node.state_changed_at.timestamp(),
        "state_cause": getattr(node, "state_cause", None),
        "rack": node.rack.name,
        "address": node.address,
        "host": node.host,
        "pid": node.pid,
        "session": node.session,
        "model": node.model_key,
        "model_state": live.model_state if alive else None,
        "model_state_label": MODEL_STATE_LABELS.get(live.model_state, live.model_state) if alive else None,
        "gpu": node.gpu_key,
        "gpu_name": gpu.name if gpu else node.gpu_key,
        "tp": node.tp,
        "engine": node.engine,
        "gpus": gpus,
        "xid_unknown_gpu": xids.get(-1),
        "load": load,
        "last_report_at": last_seen,
        "health": node.health,
        "health_label": Health(node.health).label,
        "health_badge": HEALTH_BADGE[Health(node.health)],
        "weight": node.weight,
        "breaker": node.breaker,
        "breaker_label": BreakerState(node.breaker).label,
        "breaker_badge": BREAKER_BADGE[BreakerState(node.breaker)],
        "spare": node.spare,
        "cordoned": node.cordoned,
    }


def _nodes():
    latest_cause = NodeTransition.objects.filter(node=OuterRef("pk")).order_by("-at", "-id").values("cause")[:1]
    return (
        Node.objects.select_related("rack")
        .prefetch_related("gpus")
        .annotate(state_cause=Subquery(latest_cause))
        .order_by("rack__name", "name")
    )


def summary(cards: list[dict]) -> dict:
    counts = {state.value: 0 for state in NodeState}
    for card in cards:
        counts[card["state"]] += 1
    loads = [c["load"] for c in cards if c["load"]]
    return {
        "nodes": len(cards),
        "by_state": counts,
        "spares": sum(1 for c in cards if c["spare"] and c["state"] == NodeState.SERVING),
        "in_service": sum(1 for c in cards if c["weight"] > 0),
        "gpus": sum(len(c["gpus"]) for c in cards if c["state"] in lifecycle.ALIVE),
        "running": sum(load["running"] or 0 for load in loads),
        "waiting": sum(load["waiting"] or 0 for load in loads),
    }


def _cards(nodes: list[Node]) -> tuple[list[dict], dict[str, hot.NodeEntry], bool]:
    live, live_ok = _hot_nodes([n.name for n in nodes])
    xids = _fresh_xids([n.pk for n in nodes])
    return [node_card(n, live.get(n.name), xids.get(n.pk)) for n in nodes], live, live_ok


def cluster_snapshot() -> dict:
    nodes = list(_nodes())
    cards, _, live_ok = _cards(nodes)
    racks: dict[str, list[dict]] = {}
    for card in cards:
        racks.setdefault(card["rack"], []).append(card)
    return {
        "cluster": settings.LIFELINE_CLUSTER_NAME,
        "generated_at": time.time(),
        "live": live_ok,
        "heartbeat_miss_s": settings.LIFELINE_HEARTBEAT_MISS_S,
        "summary": summary(cards),
        "racks": [{"name": name, "nodes": rack_cards} for name, rack_cards in racks.items()],
        "nodes": cards,
    }


def node_card_by_id(node_id: int) -> dict | None:
    node = _nodes().filter(pk=node_id).first()
    if node is None:
        return None
    cards, _, _ = _cards([node])
    return cards[0]


def cluster_summary() -> dict:
    """`summary` of every node's card, without building the cards: each node change pushes it to every open cluster
    page, so at hundreds of nodes it reads only the columns the summary counts."""
    rows = list(
        Node.objects.annotate(gpu_count=Count("gpus")).values_list(
            "name", "state", "health", "cordoned", "spare", "breaker", "gpu_count"
        )
    )
    try:
        queues = hot.queues([row[0] for row in rows])
    except (redis.RedisError, hot.RedisNotConfigured) as exc:
        log.warning("live load unavailable: %s", exc)
        queues = {}
    counts = {state.value: 0 for state in NodeState}
    result = {"nodes": len(rows), "by_state": counts, "spares": 0, "in_service": 0, "gpus": 0, "running": 0}
    result["waiting"] = 0
    for name, state, health, cordoned, spare, breaker, gpu_count in rows:
        counts[state] += 1
        alive = state in lifecycle.ALIVE
        serving = state == NodeState.SERVING
        result["spares"] += spare and serving
        weight = health_policy.routing_weight(health, cordoned=cordoned, spare=spare, breaker=breaker) if serving else 0
        result["in_service"] += weight > 0
        if alive:
            result["gpus"] += gpu_count
            running, waiting = queues.get(name, (0, 0))
            result["running"] += running
            result["waiting"] += waiting
    return result


# --- why traffic goes where it goes ---------------------------------------------------------------------------
MAX_QUEUE_SEARCHED = 4096


def _live_status(entry: hot.NodeEntry | None, now: float) -> load.NodeStatus:
    """A node's load as its last heartbeat told it, in the shape the routing policy reads. The gateway routes on
    every status event, so its figures are fresher than these; the arithmetic is the same."""
    entry = entry or hot.NodeEntry()
    running = entry.running or 0
    return load.NodeStatus(
        at=now,
        model_state=entry.model_state or "serving",
        running=running,
        waiting=entry.waiting or 0,
        decode_batch=entry.decode_step_batch or running,
        decode_context_tokens=entry.decode_step_context_tokens or 0,
        step_ms=entry.step_ms or 0.0,
    )


def _queue_to_reach(deployment: catalog.Deployment, weight: float, cost_s: float, prompt: int, per_request: int):
    """How many requests a node must have running before its routing cost passes `cost_s`: until then every request
    goes to it rather than to a node that costs `cost_s` idle. None if not within MAX_QUEUE_SEARCHED."""
    low, high = 0, MAX_QUEUE_SEARCHED
    if _cost_with(deployment, high, prompt, per_request) / weight <= cost_s:
        return None
    while low < high:  # the cost grows with the queue: the first queue length whose cost passes cost_s
        middle = (low + high) // 2
        if _cost_with(deployment, middle, prompt, per_request) / weight > cost_s:
            high = middle
        else:
            low = middle + 1
    return low


def _cost_with(deployment: catalog.Deployment, queued: int, prompt: int, per_request: int) -> float:
    status = load.NodeStatus(running=queued, decode_batch=queued, decode_context_tokens=queued * per_request)
    return load.routing_cost(status, load.Pending(), deployment, prompt)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or seconds == load.INF else round(seconds * 1000, 2)


def routing_view() -> dict:
    """Why the gateways send traffic where they do, per model: each node's routing weight and its routing cost now
    (the seconds a new request of the average prompt would wait for its prefill and one decode step, over the weight:
    the figure every gateway minimises), its share of the pool's recovery load L̂ (where checkpoints go), and a
    sentence derived from the same arithmetic (recovery.policy.load.routing_cost)."""
    cluster = Cluster.default()
    shapes = {row.model_key: row for row in ModelCapacity.objects.filter(cluster=cluster)}
    now = time.time()
    nodes = list(Node.objects.filter(state=NodeState.SERVING).order_by("name"))
    live, _ = _hot_nodes([n.name for n in nodes])
    models, prompts = [], set()
    levels = _model_capacities(shapes, Counter(n.model_key for n in nodes if n.spare))
    for model_key in sorted({n.model_key for n in nodes} | set(levels)):
        shape = shapes.get(model_key) or ModelCapacity(model_key=model_key)  # the model's average request
        prompt = shape.avg_prompt_tokens
        per_request = prompt + shape.avg_output_tokens // 2  # tokens a running request attends to, on average
        prompts.add(prompt)
        rows, out = [], []
        for node in (n for n in nodes if n.model_key == model_key):
            weight = node.weight
            if weight <= 0:
                out.append(node.name)
                continue
            try:
                deployment = catalog.Deployment.of(node.model_key, node.gpu_key, node.tp)
            except catalog.CatalogError:
                continue  # the gateway cannot time it either (tables refuse such a route)
            entry = live.get(node.name) or hot.NodeEntry()
            rows.append(
                {
                    "name": node.name,
                    "gpu": node.gpu_key,
                    "tp": node.tp,
                    "weight": weight,
                    "running": entry.running,
                    "waiting": entry.waiting,
                    "deployment": deployment,
                    "idle_s": load.routing_cost(load.NodeStatus(), load.Pending(), deployment, prompt) / weight,
                    "cost_s": load.routing_cost(_live_status(entry, now), load.Pending(), deployment, prompt) / weight,
                    "l_hat": load.holder_load(
                        entry.checkpoint_bytes_held,
                        deployment.model.kv_bytes_per_block,
                        entry.queue_depth,
                        cluster.alpha,
                        cluster.beta,
                    ),
                }
            )
        models.append({**_model_routing(model_key, rows, out, prompt, per_request), "capacity": levels.get(model_key)})
    prompt_tokens = prompts.pop() if len(prompts) == 1 else None  # one figure when every model's is the same
    return {"at": now, "prompt_tokens": prompt_tokens, "models": models}


def _model_capacities(rows: dict[str, ModelCapacity], spares: Counter) -> dict[str, dict]:
    """Each served model's capacity against its objective, as the last evaluation found it, its degradation level and
    its hot spares: per model, since a model's loss sheds only its own traffic."""
    try:
        figures = capacity.latest().get("models") or {}
    except (redis.RedisError, hot.RedisNotConfigured):
        figures = {}
    out = {}
    for model_key in sorted(set(figures) | {k for k, r in rows.items() if r.required_rps > 0}):
        row, seen = rows.get(model_key), figures.get(model_key) or {}
        level = row.degradation_level if row else 0
        out[model_key] = {
            "level": level,
            "badge": LEVEL_BADGE[level],
            "capacity_rps": seen.get("capacity_rps"),
            "required_rps": row.required_rps if row else 0.0,
            "ratio": seen.get("ratio"),
            "in_service": seen.get("in_service"),
            "spares": spares.get(model_key, 0),
        }
    return out


def _model_routing(model_key: str, rows: list[dict], out: list[str], prompt: int, per_request: int) -> dict:
    groups: dict[tuple[str, int, float], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["gpu"], row["tp"], row["weight"]), []).append(row)
    ranked = sorted(groups.items(), key=lambda item: (min(r["idle_s"] for r in item[1]), item[0]))
    running_total = sum(r["running"] or 0 for r in rows)
    l_hat_total = sum(r["l_hat"] for r in rows)
    summary = []
    for (gpu, tp, weight), members in ranked:
        running = sum(r["running"] or 0 for r in members)
        summary.append(
            {
                "label": f"{gpu} ×{tp}" + (f" at weight {weight:g}" if weight != 1 else ""),
                "nodes": len(members),
                "idle_ms": _ms(min(r["idle_s"] for r in members)),
                "cost_ms": _ms(min(r["cost_s"] for r in members)),
                "running": running,
                "running_pct": round(100 * running / running_total, 1) if running_total else None,
            }
        )
    sentences = []
    if not rows:
        sentences.append(f"No {model_key} node takes traffic now.")
    elif len(ranked) == 1:
        sentences.append(
            f"Every {model_key} node in routing is {summary[0]['label']}: each request goes to the one that costs "
            f"least now (the shortest queue), so the load spreads evenly."
        )
    else:
        fast, second = summary[0], summary[1]
        fast_members = ranked[0][1]
        queue = _queue_to_reach(
            fast_members[0]["deployment"], ranked[0][0][2], min(r["idle_s"] for r in ranked[1][1]), prompt, per_request
        )
        sentences.append(
            f"At low load every {model_key} request goes to the {fast['label']} nodes: idle, one costs "
            f"{fast['idle_ms']:g} ms for a {prompt}-token prompt (its prefill and one decode step), against "
            f"{second['idle_ms']:g} ms on {second['label']}."
        )
        if queue is not None:
            sentences.append(
                f"The {second['label']} nodes take traffic once a {fast['label']} node runs about {queue} requests "
                f"(its cost then passes {second['idle_ms']:g} ms); others follow as their queues grow."
            )
        if running_total:
            sentences.append(
                f"Now the {fast['label']} nodes run {fast['running']} of the {running_total} requests "
                f"({fast['running_pct']:g} %)."
            )
    if out:
        sentences.append(
            f"{len(out)} {model_key} node{'s' if len(out) != 1 else ''} at weight 0 take{'s' if len(out) == 1 else ''} "
            f"no traffic: {', '.join(out[:8])}{' …' if len(out) > 8 else ''}."
        )
    return {
        "model": model_key,
        "prompt_tokens": prompt,
        "sentences": sentences,
        "groups": summary,
        "nodes": [
            {
                "name": r["name"],
                "gpu": f"{r['gpu']} ×{r['tp']}",
                "weight": r["weight"],
                "running": r["running"],
                "waiting": r["waiting"],
                "cost_ms": _ms(r["cost_s"]),
                "l_hat": round(r["l_hat"], 1),
                "l_hat_pct": round(100 * r["l_hat"] / l_hat_total, 1) if l_hat_total else None,
            }
            for r in sorted(rows, key=lambda r: (r["cost_s"], r["name"]))
        ],
        "out_of_routing": out,
    }


# --- the cluster's traffic over time ------------------------------------------------------------------------------
SERIES_MINUTES = (5, 15, 60, 180)
SERIES_POINTS = 90  # buckets per chart, whatever the window
SERIES_MAX_ROWS = 200_000  # newest outcomes read; the SLA reports' rollups are the place for long windows


def _percentile(ordered: list[float], q: float) -> float | None:
    """Nearest rank, as benchmarks.common.percentile; `ordered` sorted."""
    if not ordered:
        return None
    return round(ordered[min(int(q * len(ordered)), len(ordered) - 1)], 1)


def traffic_series(minutes: int = 15, now: float | None = None) -> dict:
    """TTFT and TPOT p50/p99, tokens per second, error and shed shares per time bucket, per model and tier, from the
    outcomes the gateways reported (RequestOutcome). A bucket without requests is None (n/a), never a zero."""
    now = time.time() if now is None else now
    bucket_s = max(1, round(minutes * 60 / SERIES_POINTS))
    start = now - minutes * 60
    first = int(start // bucket_s)
    count = int(now // bucket_s) - first + 1
    rows = list(
        RequestOutcome.objects.filter(finished_at__gte=dt.datetime.fromtimestamp(start, tz=dt.UTC))
        .order_by("-finished_at")
        .values_list("model_key", "tier", "status", "ttft_ms", "tpot_ms", "completion_tokens", "finished_at")[
            :SERIES_MAX_ROWS
        ]
    )
    buckets: dict[tuple[str, str], list[dict]] = {}
    for model_key, tier, status, ttft, tpot, tokens, finished in rows:
        index = int(finished.timestamp() // bucket_s) - first
        if not 0 <= index < count:
            continue
        series = buckets.setdefault((model_key, tier), [None] * count)
        b = series[index]
        if b is None:
            b = series[index] = {"n": 0, "ttft": [], "tpot": [], "tokens": 0, "error": 0, "shed": 0}
        b["n"] += 1
        b["tokens"] += tokens or 0
        b["error"] += status == "error"
        b["shed"] += status == "shed"
        if ttft is not None:
            b["ttft"].append(ttft)
        if tpot is not None:
            b["tpot"].append(tpot)
    out = []
    for (model_key, tier), series in sorted(buckets.items()):
        figures = {key: [] for key in ("requests", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")}
        figures.update({"tokens_per_s": [], "error_pct": [], "shed_pct": []})
        for b in series:
            if b is None:
                for values in figures.values():
                    values.append(None)
                continue
            ttft, tpot = sorted(b["ttft"]), sorted(b["tpot"])
            figures["requests"].append(b["n"])
            figures["ttft_p50"].append(_percentile(ttft, 0.5))
            figures["ttft_p99"].append(_percentile(ttft, 0.99))
            figures["tpot_p50"].append(_percentile(tpot, 0.5))
            figures["tpot_p99"].append(_percentile(tpot, 0.99))
            figures["tokens_per_s"].append(round(b["tokens"] / bucket_s, 1))
            figures["error_pct"].append(round(100 * b["error"] / b["n"], 2))
            figures["shed_pct"].append(round(100 * b["shed"] / b["n"], 2))
        out.append({"model": model_key, "tier": tier, "label": f"{model_key} · {tier}", **figures})
    return {
        "generated_at": now,
        "minutes": minutes,
        "bucket_s": bucket_s,
        "t": [(first + i) * bucket_s for i in range(count)],
        "series": out,
        "requests": len(rows),
        "truncated": len(rows) == SERIES_MAX_ROWS,
    }


def scrape_targets() -> list[dict]:
    """Prometheus's HTTP service discovery (http_sd_configs): one target group per node that has not left, its
    agent's address (which serves /metrics) and the labels an operator filters by. A node that is DOWN stays listed,
    so Prometheus's `up` says so; one that LEFT the fleet is dropped."""
    groups = []
    for node in Node.objects.exclude(state=NodeState.LEFT).select_related("rack").order_by("name"):
        address = urlsplit(node.address)
        if not address.hostname or not address.port:
            continue  # registered without a reachable agent address: nothing to scrape
        labels = {
            "__scheme__": address.scheme or "http",
            "node": node.name,
            "rack": node.rack.name,
            "model": node.model_key,
            "gpu_type": node.gpu_key,  # not `gpu`: DCGM's series name the GPU index so
            "engine": node.engine,
        }
        if node.host:
            labels["hostname"] = node.host
        groups.append({"targets": [address.netloc], "labels": labels})
    return groups
