"""A node's page beyond its tile: health, breaker, canaries, Xid events, the health timeline, the charts."""

from django.utils import timezone

from console.readmodels.drains import drain_row
from recovery import hot
from recovery.models import CanaryResult, HealthTransition, Node, XidEvent


def node_health(node: Node) -> dict:
    """The node page's health panel: state, weight, breaker, canaries, Xid events, the health timeline."""
    canaries = list(CanaryResult.objects.filter(node=node)[:200])
    return {
        "health": node.health,
        "weight": node.weight,
        "breaker": node.breaker,
        "breaker_failures": node.breaker_failures,
        "breaker_opened_at": node.breaker_opened_at,
        "spare": node.spare,
        "canary_failures": node.canary_failures,
        "canary_baseline_ms": node.canary_baseline_ms,
        "canary_last_at": node.canary_last_at.timestamp() if node.canary_last_at else None,
        "canaries": [
            {
                "at": c.at.timestamp(),
                "passed": c.passed,
                "kind": c.kind,
                "detail": c.detail,
                "latency_ms": c.latency_ms,
                "baseline_ms": c.baseline_ms,
                "trial": c.trial,
                "gpu_ms": c.gpu_ms,
                "prompt": c.prompt_key,
            }
            for c in canaries
        ],
        "xids": [
            {
                "first_at": x.first_at.timestamp(),
                "last_at": x.last_at.timestamp(),
                "gpu": x.gpu_index,
                "code": x.code,
                "codes": x.codes,
                "count": x.count,
                "severity": x.severity,
                "meaning": x.meaning,
                "action": x.action,
                "acted": x.acted,
            }
            for x in XidEvent.objects.filter(node=node)[:50]
        ],
        "transitions": [
            {"at": t.at.timestamp(), "kind": t.kind, "old": t.old, "new": t.new, "cause": t.cause, "actor": t.actor}
            for t in HealthTransition.objects.filter(node=node)[:50]
        ],
        "drains": [
            drain_row(d)
            for d in node.drains.select_related("node", "requested_by").prefetch_related("decisions__user")[:10]
        ],
    }


def canary_series(node: Node) -> dict:
    """The canary chart: latency of each check, passed or not, and the moving baseline, for the node's current run
    (since its process registered): an earlier run's latencies belong to another process and another baseline."""
    current = CanaryResult.objects.filter(node=node, at__gte=node.session_started_at)
    rows = list(current.order_by("-at")[:300])[::-1]
    return {
        "t": [r.at.timestamp() for r in rows],
        "latency_ms": [r.latency_ms for r in rows],
        "baseline_ms": [r.baseline_ms for r in rows],
        "passed": [r.passed for r in rows],
        "kind": [r.kind for r in rows],
    }


def telemetry_series(node: Node) -> dict:
    """The telemetry charts, from the readings the heartbeats carried (newest ten minutes), per GPU."""
    readings = hot.telemetry(node.name)[::-1]
    series: dict[int, dict] = {}
    for reading in readings:
        for gpu in reading.get("gpus") or []:
            s = series.setdefault(
                gpu.get("index", 0),
                {"t": [], "utilization_pct": [], "temperature_c": [], "power_w": [], "sm_clock_mhz": []},
            )
            s["t"].append(reading["at"])
            for key in ("utilization_pct", "temperature_c", "power_w", "sm_clock_mhz"):
                s[key].append(gpu.get(key))
    return {"gpus": {str(k): v for k, v in sorted(series.items())}, "generated_at": timezone.now().timestamp()}
