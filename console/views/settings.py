"""The cluster's operating settings (admin): the page and `GET`/`PATCH /api/settings`, both through one action."""

from django.contrib import messages
from django.http import JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache

from console.auth import api_view, page_view
from console.views import allow
from recovery import roles
from recovery.actions import cluster_settings, health
from recovery.forms import MODEL_RANGES, SettingsForm, number
from recovery.http import json_error, patch_body
from recovery.models import Cluster, ModelCapacity


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
        models = {}
        for key, value in request.POST.items():  # model:<model>:<field>, one row per served model
            if key.startswith("model:") and key.count(":") == 2:
                _, model, name = key.split(":")
                models.setdefault(model, {})[name] = value
        if models:
            values["models"] = models
        try:
            changed = cluster_settings.update(
                cluster, values, request.user.get_username(), request.POST.get("reason", "")
            )
        except cluster_settings.SettingsRefused as exc:
            messages.error(request, "Not saved: " + "; ".join(exc.errors.values()))
            form = SettingsForm(request.POST, instance=Cluster(pk=cluster.pk))
            form.is_valid()  # the same errors, shown at their fields
            context = {"form": form, "cluster": cluster, "models": _model_rows(cluster, models, exc.errors)}
            return render(request, "console/settings.html", context, status=400)
        if changed:
            messages.success(request, f"Saved: {', '.join(sorted(changed))}.")
        else:
            messages.info(request, "Nothing changed.")
        return redirect("settings")
    context = {"form": SettingsForm(instance=cluster), "cluster": cluster, "models": _model_rows(cluster)}
    return render(request, "console/settings.html", context)


def _model_rows(cluster: Cluster, typed: dict | None = None, errors: dict | None = None) -> list[dict]:
    """Each served model's capacity objective as the form shows it: what was typed (on a refusal) or is saved,
    with the error of each field."""
    rows = []
    for model, saved in cluster_settings.current_models(cluster).items():
        fields = []
        for name in cluster_settings.MODEL_FIELDS:
            low, high, unit = MODEL_RANGES[name]
            fields.append(
                {
                    "name": name,
                    "input": f"model:{model}:{name}",
                    "label": ModelCapacity._meta.get_field(name).verbose_name,
                    "value": ((typed or {}).get(model) or {}).get(name, saved[name]),
                    "help": f"{number(low)} to {number(high)} {unit}",
                    "error": (errors or {}).get(f"models.{model}.{name}"),
                }
            )
        rows.append({"model": model, "fields": fields})
    return rows


@api_view(roles.ADMIN)
@allow("GET", "PATCH")
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
