"""The cluster page, its JSON, and the console's own health and metrics."""

import os

import redis
from django.db import connection
from django.http import HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache

from console import metrics as control_plane_metrics
from console.auth import api_view, page_view
from console.readmodels import cluster as cluster_model
from console.views import allow
from recovery import hot
from recovery.http import json_error


def home(request):
    return redirect("cluster")


@never_cache
@page_view()
def cluster(request):
    """The cluster page: nodes as tiles (small fleets) or a table (`?view=table`, the default above
    TABLE_VIEW_ABOVE nodes), the routing explanation and the traffic charts."""
    partial = request.GET.get("partial")
    if partial == "routing":
        return render(request, "console/_routing.html", {"routing": cluster_model.routing_view()})
    snapshot = cluster_model.cluster_snapshot()
    view = request.GET.get("view") or cluster_model.default_view(len(snapshot["nodes"]))
    if view not in cluster_model.VIEWS:
        return render(
            request,
            "console/cluster.html",
            {
                "snapshot": snapshot,
                "view": cluster_model.default_view(len(snapshot["nodes"])),
                "view_error": f"view: {view!r} is not a view of the cluster; use tiles or table.",
                "routing": cluster_model.routing_view(),
            },
            status=400,
        )
    if partial == "racks":
        return render(request, "console/_racks.html", {"snapshot": snapshot})
    if partial == "table":
        return render(request, "console/_node_table.html", {"snapshot": snapshot})
    context = {"snapshot": snapshot, "view": view, "routing": cluster_model.routing_view()}
    return render(request, "console/cluster.html", context)


@api_view()
@allow("GET")
def api_cluster(request):
    return JsonResponse(cluster_model.cluster_snapshot())


@api_view()
@allow("GET")
def api_prometheus_targets(request):
    """Prometheus's HTTP service discovery of the nodes (prometheus/server/prometheus.yml's lifeline-node job): the
    fleet as it is, so a node that joins is scraped without a change to Prometheus's configuration."""
    return JsonResponse(cluster_model.scrape_targets(), safe=False)


@api_view()
@allow("GET")
def api_cluster_series(request):
    """The cluster page's charts: per model and tier, TTFT and TPOT p50/p99, tokens/s, error and shed shares."""
    raw = request.GET.get("minutes", "15")
    try:
        minutes = int(raw)
    except ValueError:
        minutes = None
    if minutes not in cluster_model.SERIES_MINUTES:
        choices = ", ".join(str(m) for m in cluster_model.SERIES_MINUTES)
        message = f"minutes: {raw!r} is not a window of the charts; use one of {choices}."
        return json_error(400, message, field="minutes")
    return JsonResponse(cluster_model.traffic_series(minutes))


@never_cache
def healthz(request):
    """Liveness for supervisors and load balancers: the database and Redis answer. `process` is the answering web
    process's pid, which tells several web processes behind one port apart (`serve --processes`)."""
    checks = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        checks["database"] = f"error: {exc}"
    try:
        hot.client().ping()
        checks["redis"] = "ok"
    except (redis.RedisError, hot.RedisNotConfigured) as exc:
        checks["redis"] = f"error: {exc}"
    ok = all(v == "ok" for v in checks.values())
    body = {"status": "ok" if ok else "degraded", "checks": checks, "process": os.getpid()}
    return JsonResponse(body, status=200 if ok else 503)


@api_view()
def metrics(request):
    """Prometheus metrics of the control plane; scrape with an API token (`authorization: credentials`)."""
    return HttpResponse(control_plane_metrics.render(), content_type="text/plain; version=0.0.4")
