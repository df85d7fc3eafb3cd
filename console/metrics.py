"""The control plane's own Prometheus metrics, in the spirit of source document 003.

Worker status per node (0 healthy … 4 dead), circuit breaker state, hot spares, the degradation
level and capacity ratio, canary results and latency, checkpoint coverage and holder balance,
drains by state. Read at scrape time from the database and Redis into a fresh registry, so several
web processes answer alike. Migrations by method are the gateways' own (their /metrics).
"""

import datetime as dt

from django.db.models import Count
from django.utils import timezone
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from console.readmodels import checkpoints as checkpoint_model
from recovery.actions import capacity
from recovery.choices import NodeState
from recovery.models import CanaryResult, Cluster, Drain, Node
from recovery.policy import breaker, health

CANARY_WINDOW = dt.timedelta(hours=1)


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
    for node in Node.objects.select_related("rack").exclude(state=NodeState.LEFT):
        alive = node.state in (NodeState.JOIN, NodeState.SERVING)
        status.labels(node.name, node.rack.name, node.model_key).set(
            health.STATUS_CODE[node.health] if alive else health.DEAD_CODE
        )
        weight.labels(node.name).set(node.weight)
        breaker_state.labels(node.name).set(breaker.STATE_CODE[node.breaker])
        spare.labels(node.name).set(1 if node.spare else 0)

    cluster = Cluster.default()
    Gauge("lifeline_degradation_level", "The cluster's degradation level, 0 to 4.", registry=registry).set(
        cluster.degradation_level
    )
    latest = capacity.latest()
    if latest.get("ratio") is not None:
        Gauge(
            "lifeline_capacity_ratio",
            "Capacity of the nodes in service over the required throughput.",
            registry=registry,
        ).set(latest["ratio"])
    if latest:
        Gauge(
            "lifeline_capacity_rps",
            "Requests per second the nodes in service carry within the SLOs.",
            registry=registry,
        ).set(latest["capacity_rps"])

    since = timezone.now() - CANARY_WINDOW
    results = Gauge(
        "lifeline_canary_results",
        "Canary results in the last hour, by node and result.",
        ["node", "result"],
        registry=registry,
    )
    for row in CanaryResult.objects.filter(at__gte=since).values("node__name", "kind").annotate(n=Count("id")):
        results.labels(row["node__name"], row["kind"]).set(row["n"])
    last = Gauge(
        "lifeline_canary_duration_seconds", "The latest canary's latency, by node.", ["node"], registry=registry
    )
    seen = set()
    for row in (
        CanaryResult.objects.filter(at__gte=since, latency_ms__isnull=False)
        .values("node__name", "latency_ms")
        .order_by("-at")
    ):
        if row["node__name"] not in seen:
            seen.add(row["node__name"])
            last.labels(row["node__name"]).set(row["latency_ms"] / 1000)

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
    return generate_latest(registry)
