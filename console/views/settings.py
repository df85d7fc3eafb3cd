"""The cluster's operating settings (admin): the page and `GET`/`PATCH /api/settings`, both through one action."""

from django.contrib import messages
from django.http import JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache

from console.auth import api_view, page_view
from recovery import roles
from recovery.actions import cluster_settings, health
from recovery.forms import SettingsForm
from recovery.http import json_error, patch_body
from recovery.models import Cluster


@never_cache
@page_view(roles.ADMIN)
def settings_page(request):
    cluster = Cluster.default()
    if request.method == "POST" and request.POST.get("action") == "reset-breaker":
        try:
            health.reset_cluster_breaker(cluster, request.user, request.POST.get("reason", ""))
            messages.success(request, "Cluster breaker reset: automatic cordons resume.")
        except ValueError as exc:
            messages.error(request, str(exc))
        return redirect("settings")
    if request.method == "POST":
        values = {name: request.POST.get(name, "") for name in cluster_settings.FIELDS}
        try:
            changed = cluster_settings.update(
                cluster, values, request.user.get_username(), request.POST.get("reason", "")
            )
        except cluster_settings.SettingsRefused as exc:
            messages.error(request, "Not saved: " + "; ".join(exc.errors.values()))
            form = SettingsForm(request.POST, instance=Cluster(pk=cluster.pk))
            form.is_valid()  # the same errors, shown at their fields
            return render(request, "console/settings.html", {"form": form, "cluster": cluster}, status=400)
        if changed:
            messages.success(request, f"Saved: {', '.join(sorted(changed))}.")
        else:
            messages.info(request, "Nothing changed.")
        return redirect("settings")
    return render(request, "console/settings.html", {"form": SettingsForm(instance=cluster), "cluster": cluster})


@api_view(roles.ADMIN)
def api_settings(request):
    """GET the cluster's operating settings; PATCH some of them (admin), validated and audited as on the page."""
    cluster = Cluster.default()
    if request.method == "GET":
        return JsonResponse(cluster_settings.current(cluster))
    if request.method != "PATCH":
        return json_error(405, 'GET the settings, or PATCH {field: value, ..., "reason": ...}.')
    parsed = patch_body(request)
    if isinstance(parsed, JsonResponse):
        return parsed
    body, reason = parsed
    try:
        changed = cluster_settings.update(cluster, body, request.user.get_username(), reason)
    except cluster_settings.SettingsRefused as exc:
        return json_error(400, exc.errors[exc.field], field=exc.field)
    return JsonResponse({**cluster_settings.current(cluster), "changed": sorted(changed)})
