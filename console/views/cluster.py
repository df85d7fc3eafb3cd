"""The cluster page, its JSON, and the console's own health and metrics."""

import redis
from django.db import connection
from django.http import HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache

from console import metrics as control_plane_metrics
from console.auth import api_view, page_view
from console.readmodels import cluster as cluster_model
from recovery import hot


def home(request):
    return redirect("cluster")


@never_cache
@page_view()
def cluster(request):
    snapshot = cluster_model.cluster_snapshot()
    if request.GET.get("partial") == "racks":
        return render(request, "console/_racks.html", {"snapshot": snapshot})
    return render(request, "console/cluster.html", {"snapshot": snapshot})


@api_view()
def api_cluster(request):
    return JsonResponse(cluster_model.cluster_snapshot())


@never_cache
def healthz(request):
    """Liveness for supervisors and load balancers: the database and Redis answer."""
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
    return JsonResponse({"status": "ok" if ok else "degraded", "checks": checks}, status=200 if ok else 503)


@api_view()
def metrics(request):
    """Prometheus metrics of the control plane; scrape with an API token (`authorization: credentials`)."""
    return HttpResponse(control_plane_metrics.render(), content_type="text/plain; version=0.0.4")
