"""Service-level objectives: the /slo/ page and one objective's /slo/<id>/ (managers, on-call, operators, admins read),
the admin's forms for objectives and corrections, and `GET /api/slo`, `GET`/`PATCH /api/slo/<id>`, all through
recovery.actions.slo."""

import datetime as dt

from django.contrib import messages
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache

from console.auth import READ_SLO, api_view, page_view
from console.readmodels import slo as slo_model
from console.views import allow
from recovery import roles
from recovery.actions import slo
from recovery.forms import SloCorrectionForm, SloObjectiveForm
from recovery.http import json_error, patch_body
from recovery.models import SloCorrection, SloObjective


def _refuse_page(request, target: str, what: str):
    """Anyone but an admin who tries to change an objective: 403, logged and audited."""
    slo.refuse_edit(request.user.get_username(), roles.role_of(request.user), target, what)
    reason = f"Only admins edit service-level objectives; your role is {roles.role_of(request.user) or 'none'}."
    return render(request, "console/forbidden.html", {"reason": reason}, status=403)


@never_cache
@page_view(*READ_SLO)
def slo_list(request):
    statuses = slo_model.all_objectives()
    context = {
        "statuses": statuses,
        "rows": slo_model.indicator_rows(statuses),
        "progress": slo_model.rollup_progress(),
        "can_edit": roles.has_role(request.user, roles.ADMIN),
        "corrections": SloCorrection.objects.all()[:50],
        "correction_form": SloCorrectionForm(),
    }
    if request.GET.get("partial") == "table":
        return render(request, "console/_slo_table.html", context)
    return render(request, "console/slo.html", context)


@never_cache
@page_view(*READ_SLO)
def slo_detail(request, objective_id: int):
    """One objective over its window: burn-down, calendar, percentile bands, burn-rate rules, each figure with its
    counts. `?partial=numbers` answers its live parts alone (static/console/slo_detail.js swaps them in)."""
    objective = get_object_or_404(SloObjective, pk=objective_id)
    status = slo_model.objective_status(objective, detail=True)
    context = {
        "s": status,
        "window_start": dt.datetime.fromisoformat(status["window_start"]),
        "as_of": dt.datetime.fromisoformat(status["now"]),
        "charts": {"burn_down": status["burn_down"], "bands": status["bands"]},
        "can_edit": roles.has_role(request.user, roles.ADMIN),
    }
    if request.GET.get("partial") == "numbers":
        return render(request, "console/_slo_detail_parts.html", context)
    return render(request, "console/slo_detail.html", context)


@never_cache
@page_view()
def slo_edit(request, objective_id: int | None = None):
    """An objective's form (admins): new, or an existing one's figures."""
    objective = get_object_or_404(SloObjective, pk=objective_id) if objective_id else None
    target = f"slo:{objective.pk}" if objective else "slo:new"
    if not roles.has_role(request.user, roles.ADMIN):
        return _refuse_page(request, target, "edit" if request.method == "POST" else "open the form of")
    if request.method == "POST":
        values = {name: request.POST.get(name, "") for name in slo.OBJECTIVE_FIELDS}
        reason = request.POST.get("reason", "")
        try:
            if objective is None:
                objective = slo.create_objective(values, request.user.get_username(), reason)
                messages.success(request, f"Objective created: {objective}.")
            else:
                changed = slo.update_objective(objective, values, request.user.get_username(), reason)
                messages.success(request, f"Saved: {', '.join(sorted(changed))}." if changed else "Nothing changed.")
        except slo.SloRefused as exc:
            form = SloObjectiveForm(request.POST, instance=objective or SloObjective())
            form.is_valid()  # the same errors, shown at their fields
            messages.error(request, "Not saved: " + "; ".join(exc.errors.values()))
            return render(request, "console/slo_edit.html", {"form": form, "objective": objective}, status=400)
        return redirect("slo")
    form = SloObjectiveForm(instance=objective)
    return render(request, "console/slo_edit.html", {"form": form, "objective": objective})


@never_cache
@page_view()
def slo_corrections(request, correction_id: int | None = None):
    """POST: mark a period excluded from the objectives, or withdraw one (admins)."""
    target = f"slo-correction:{correction_id}" if correction_id else "slo-correction:new"
    if request.method != "POST":
        return redirect("slo")
    if not roles.has_role(request.user, roles.ADMIN):
        return _refuse_page(request, target, "withdraw" if correction_id else "add")
    if correction_id:
        correction = get_object_or_404(SloCorrection, pk=correction_id)
        slo.withdraw_correction(correction, request.user.get_username(), request.POST.get("reason", ""))
        messages.success(request, "Correction withdrawn: the period counts again.")
        return redirect("slo")
    values = {name: request.POST.get(name, "") for name in SloCorrectionForm.Meta.fields}
    try:
        correction = slo.add_correction(values, request.user.get_username())
    except slo.SloRefused as exc:
        messages.error(request, "Not saved: " + "; ".join(exc.errors.values()))
        return redirect("slo")
    messages.success(request, f"Excluded from the objectives: {correction}.")
    return redirect("slo")


@api_view(*READ_SLO)
@allow("GET")
def api_slo(request):
    if request.method != "GET":
        return json_error(405, "GET the objectives; PATCH one at /api/slo/<id> (admins).")
    return JsonResponse(
        {
            "objectives": slo_model.all_objectives(),
            "profile": slo_model.slo_policy.PROFILE,
            "rollup": slo_model.rollup_progress(),
        }
    )


@api_view(*READ_SLO)
@allow("GET", "PATCH")
def api_slo_one(request, objective_id: int):
    """GET one objective's figures with its days; PATCH some of its fields (admins), validated and audited."""
    objective = SloObjective.objects.filter(pk=objective_id).first()
    if objective is None:
        return json_error(404, f"No objective {objective_id}: GET /api/slo lists them.")
    if request.method == "GET":
        return JsonResponse(slo_model.objective_status(objective, detail=True))
    if request.method != "PATCH":
        return json_error(405, 'GET the objective, or PATCH {field: value, ..., "reason": ...} (admins).')
    if not roles.has_role(request.user, roles.ADMIN):
        slo.refuse_edit(request.user.get_username(), roles.role_of(request.user), f"slo:{objective.pk}", "edit")
        return json_error(403, f"Role {roles.role_of(request.user)!r} may not edit objectives: only admins do.")
    parsed = patch_body(request)
    if isinstance(parsed, JsonResponse):
        return parsed
    body, reason = parsed
    try:
        changed = slo.update_objective(objective, body, request.user.get_username(), reason)
    except slo.SloRefused as exc:
        return json_error(400, exc.errors[exc.field], field=exc.field)
    objective.refresh_from_db()
    return JsonResponse({**slo_model.objective_status(objective), "changed": sorted(changed)})
