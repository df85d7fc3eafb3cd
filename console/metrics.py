"""The control plane's own Prometheus metrics, in the spirit of source document 003.

Worker status per node (0 healthy … 4 dead), circuit breaker state, hot spares, nodes serving each
model, each model's degradation level and capacity ratio, canary results by check and outcome with a
counter of mismatches of their own and a latency histogram, GPU Xid events by class, checkpoint
coverage and holder balance, drains by state with the age of the oldest, each MoE deployment's expert workers
by state, unserved experts, table version, shadow coverage, tokens and balancedness. Read at scrape time from
the database and Redis into a fresh registry, so several web processes answer alike. What only
grows (canary results, Xid events) is exposed as counters counted from the database rows, so
Prometheus' rate() and increase() work on them across scrapes and web processes. Requests,
migrations and tokens lost are the gateways' own (their /metrics). The rules in prometheus/ use
these names.
"""

from collections import Counter as Tally
from collections.abc import Iterator

from django.db.models import Count, Min, Q, Sum
from django.utils import timezone
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from console.readmodels import checkpoints as checkpoint_model
from recovery.actions import capacity, moe
from recovery.choices import OPEN_DRAIN_STATES, CanaryKind, ExpertWorkerState, NodeState
from recovery.models import CanaryResult, Cluster, Drain, ModelCapacity, MoeDeployment, Node, XidEvent
from recovery.policy import breaker, health

# Document 003's four canary checks, in its order; a result says which one failed, and the ones before it passed.
CANARY_CHECKS = ("response", "tokens", "logprob", "latency")
PASS, FAIL, TIMEOUT = "pass", "fail", "timeout"
_FAILED_AT = {
    CanaryKind.NO_RESPONSE: ("response", FAIL),
    CanaryKind.TIMEOUT: ("response", TIMEOUT),
    CanaryKind.TOKEN_MISMATCH: ("tokens", FAIL),
    CanaryKind.LOGPROB: ("logprob", FAIL),
    CanaryKind.LATENCY: ("latency", FAIL),
}
# A wrong answer, not a slow or missing one: silent corruption. Its own counter, so a rule needs no label filter.
CANARY_MISMATCHES = {CanaryKind.TOKEN_MISMATCH: "tokens", CanaryKind.LOGPROB: "logprob"}
CANARY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
XID_CLASSES = (health.CRITICAL, health.WARN)


def canary_checks(kind: str, golden: bool) -> list[tuple[str, str]]:
    """(check, outcome) for each check a canary result went through. Without a golden run the tokens and the
    logprobs are not checked; after a failed check none of the later ones ran."""
    checks = [c for c in CANARY_CHECKS if golden or c not in ("tokens", "logprob")]
    failed = _FAILED_AT.get(CanaryKind(kind)) if kind != CanaryKind.OK else None
    if failed is None:
        return [(c, PASS) for c in checks]
    # A tokens or logprob failure whose golden run was deleted since still counts as that check's failure.
    before = CANARY_CHECKS[: CANARY_CHECKS.index(failed[0])]
    return [(c, PASS) for c in checks if c in before] + [failed]


class DatabaseCounters:
    """Counters and histograms counted from the rows of record at each scrape: cumulative since the rows began,
    so the same at every web process, and typed as counters, which is what rate() and increase() need."""

    def collect(self) -> Iterator[Metric]:
        nodes = list(Node.objects.exclude(state=NodeState.LEFT).values_list("name", flat=True))
        yield from self._canaries(nodes)
        yield from self._xids(nodes)

    def _canaries(self, nodes: list[str]) -> Iterator[Metric]:
        results = CounterMetricFamily(
            "lifeline_canary_results",
            "Canary checks by node, check (response, tokens, logprob, latency) and outcome (pass, fail, timeout).",
            labels=["node", "check", "outcome"],
        )
        mismatches = CounterMetricFamily(
            "lifeline_canary_mismatches",
            "Canaries that answered wrong (tokens or top logprob off the golden run): silent corruption.",
            labels=["node", "check"],
        )
        counts, wrong = Tally(), Tally({(n, check): 0 for n in nodes for check in CANARY_MISMATCHES.values()})
        rows = CanaryResult.objects.values("node__name", "kind").annotate(
            golden=Count("id", filter=Q(golden__isnull=False)), n=Count("id")
        )
        for row in rows:
            name, kind = row["node__name"], row["kind"]
            for golden, n in ((True, row["golden"]), (False, row["n"] - row["golden"])):
                for check, outcome in canary_checks(kind, golden) if n else ():
                    counts[name, check, outcome] += n
            if kind in CANARY_MISMATCHES:
                wrong[name, CANARY_MISMATCHES[kind]] += row["n"]
        for labels, n in sorted(counts.items()):
            results.add_metric(labels, n)
        for labels, n in sorted(wrong.items()):  # a zero for every node first, so increase() sees the first one
            mismatches.add_metric(labels, n)
        yield results
        yield mismatches

        latency = HistogramMetricFamily("lifeline_canary_duration_seconds", "Canary latency, by node.", labels=["node"])
        buckets = {f"le{i}": Count("id", filter=Q(latency_ms__lte=b * 1000)) for i, b in enumerate(CANARY_BUCKETS_S)}
        rows = (
            CanaryResult.objects.filter(latency_ms__isnull=False)
            .values("node__name")
            .annotate(n=Count("id"), total_ms=Sum("latency_ms"), **buckets)
            .order_by("node__name")
        )
        for row in rows:
            bounds = [(str(b), row[f"le{i}"]) for i, b in enumerate(CANARY_BUCKETS_S)] + [("+Inf", row["n"])]
            latency.add_metric([row["node__name"]], bounds, (row["total_ms"] or 0) / 1000)
        yield latency

    def _xids(self, nodes: list[str]) -> Iterator[Metric]:
        by_class = CounterMetricFamily(
            "lifeline_gpu_xid_events",
            "GPU Xid events by node and class (critical: a drain is proposed; warn: for triage).",
            labels=["node", "class"],
        )
        by_code = CounterMetricFamily(
            "lifeline_gpu_xid_codes",
            "GPU Xid events by node, GPU, Xid code and class.",
            labels=["node", "gpu", "xid", "class"],
        )
        classes = Tally({(n, c): 0 for n in nodes for c in XID_CLASSES})
        codes: Tally = Tally()
        for name, gpu, seen in XidEvent.objects.values_list("node__name", "gpu_index", "codes"):
            for code, n in seen.items():
                xid_class = health.xid_info(int(code)).severity
                classes[name, xid_class] += n
                codes[name, str(gpu), str(code), xid_class] += n
        for labels, n in sorted(classes.items()):
            by_class.add_metric(labels, n)
        for labels, n in sorted(codes.items()):
            by_code.add_metric(labels, n)
        yield by_class
        yield by_code


def render() -> bytes:
    registry = CollectorRegistry()
    status = Gauge(
        "lifeline_worker_status",
        "Node health: 0 healthy, 1 suspicious, 2 unhealthy, 3 draining, 4 dead (down or left).",
        ["node", "rack", "model"],
        registry=registry,
    )
    weight = Gauge(
        "lifeline_routing_weight", "The routing weight every gateway applies to the node.", ["node"], registry=registry
    )
    breaker_state = Gauge(
        "lifeline_circuit_breaker_state",
        "Node circuit breaker: 0 closed, 1 open, 2 half-open.",
        ["node"],
        registry=registry,
    )
    spare = Gauge("lifeline_hot_spare", "1 for a node kept as a hot spare.", ["node"], registry=registry)
    serving = Gauge(
        "lifeline_model_serving_nodes",
        "Nodes of each model that take traffic now (routing weight above 0); 0 means nobody serves it.",
        ["model"],
        registry=registry,
    )
    for node in Node.objects.select_related("rack").exclude(state=NodeState.LEFT):
        serving.labels(node.model_key).inc(1 if node.weight > 0 else 0)
        alive = node.state in (NodeState.JOIN, NodeState.SERVING)
        status.labels(node.name, node.rack.name, node.model_key).set(
            health.STATUS_CODE[node.health] if alive else health.DEAD_CODE
        )
        weight.labels(node.name).set(node.weight)
        breaker_state.labels(node.name).set(breaker.STATE_CODE[node.breaker])
        spare.labels(node.name).set(1 if node.spare else 0)

    level = Gauge(
        "lifeline_degradation_level", "A served model's degradation level, 0 to 4.", ["model"], registry=registry
    )
    cluster = Cluster.default()
    levels = dict(ModelCapacity.objects.filter(cluster=cluster).values_list("model_key", "degradation_level"))
    for model in capacity.served_models(cluster):
        level.labels(model).set(levels.get(model, 0))
    models = capacity.latest().get("models") or {}
    ratio = Gauge(
        "lifeline_capacity_ratio",
        "Capacity of a model's nodes in service over its required throughput.",
        ["model"],
        registry=registry,
    )
    rps = Gauge(
        "lifeline_capacity_rps",
        "Requests per second a model's nodes in service carry within its SLOs.",
        ["model"],
        registry=registry,
    )
    for model, figures in models.items():
        if figures.get("ratio") is not None:
            ratio.labels(model).set(figures["ratio"])
        rps.labels(model).set(figures["capacity_rps"])

    registry.register(DatabaseCounters())

    snapshot = checkpoint_model.checkpoint_snapshot()
    if snapshot["coverage"] is not None:
        Gauge(
            "lifeline_checkpoint_coverage", "Share of in-flight requests with a usable checkpoint.", registry=registry
        ).set(snapshot["coverage"])
    if snapshot["holder_balance"] is not None:
        Gauge(
            "lifeline_holder_balance",
            "Max over min recovery load across checkpoint holders (goal < 1.5).",
            registry=registry,
        ).set(snapshot["holder_balance"])
    drains = Gauge("lifeline_drains", "Drains by state.", ["state"], registry=registry)
    for row in Drain.objects.values("state").annotate(n=Count("id")):
        drains.labels(row["state"]).set(row["n"])
    oldest = Gauge(
        "lifeline_drain_oldest_age_seconds",
        "Open drains: how long the oldest one has been in its state, by state.",
        ["state"],
        registry=registry,
    )
    now = timezone.now()
    for row in (
        Drain.objects.filter(state__in=OPEN_DRAIN_STATES).values("state").annotate(since=Min("state_changed_at"))
    ):
        oldest.labels(row["state"]).set((now - row["since"]).total_seconds())
    _moe(registry)
    return generate_latest(registry)


def _moe(registry: CollectorRegistry) -> None:
    """Each mixture-of-experts deployment: its expert workers by state, the experts no serving worker holds (a step
    that needs one waits or fails), its table's version, the share of experts with a shadow, its balancedness."""
    workers = Gauge(
        "lifeline_moe_expert_workers",
        "Expert workers of each MoE deployment, by state.",
        ["deployment", "model", "state"],
        registry=registry,
    )
    unserved = Gauge(
        "lifeline_moe_experts_unserved",
        "Experts no serving expert worker holds, as primary or shadow: 0 in a whole deployment.",
        ["deployment", "model"],
        registry=registry,
    )
    version = Gauge(
        "lifeline_moe_table_version",
        "The expert routing table's version in force.",
        ["deployment", "model"],
        registry=registry,
    )
    coverage = Gauge(
        "lifeline_moe_shadow_coverage",
        "Share of the experts with a shadow copy on another expert worker.",
        ["deployment", "model"],
        registry=registry,
    )
    balance = Gauge(
        "lifeline_moe_balancedness",
        "Mean over max tokens per expert worker, last measured (1 is even).",
        ["deployment", "model"],
        registry=registry,
    )
    tokens = Counter(
        "lifeline_moe_expert_tokens",
        "Tokens the expert workers served, summed over the experts, since the deployment was registered.",
        ["deployment", "model"],
        registry=registry,
    )
    for deployment in MoeDeployment.objects.prefetch_related("ews"):
        labels = (deployment.name, deployment.model)
        states = Tally(ew.state for ew in deployment.ews.all())
        for state in ExpertWorkerState.values:
            workers.labels(*labels, state).set(states[state])
        serving = {ew.name for ew in deployment.ews.all() if ew.state == ExpertWorkerState.SERVING}
        ert = moe.table(deployment)
        unserved.labels(*labels).set(sum(1 for loc in ert.experts if not serving & set(loc.ews())))
        version.labels(*labels).set(ert.version)
        coverage.labels(*labels).set(moe.shadow_memory(deployment)["coverage"])
        tokens.labels(*labels).inc(sum(int(n) for n in deployment.details.get("tokens_per_expert", {}).values()))
        series = deployment.details.get("series", [])
        if series:
            balance.labels(*labels).set(series[-1]["balancedness"])
