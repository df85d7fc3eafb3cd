"""MoE deployments (recovery.actions.moe): the page, the fragment its socket's nudges fetch, the JSON API, and the
drain of an expert worker (on-call: its experts move to their shadows first)."""

from django.contrib import messages
from django.http import Http404, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from console.auth import DECIDE_DRAINS, INJECT_FAULTS, api_view, page_view
from console.readmodels import moe as moe_model
from console.views import allow
from recovery import roles
from recovery.actions import faults, moe
from recovery.http import json_error, json_object
from recovery.models import ExpertWorkerNode, MoeDeployment

FRAGMENT = "console/_moe.html"


@never_cache
@page_view()
def moe_page(request, name: str | None = None):
    names = moe_model.deployments()
    if name is None:
        if not names:
            return render(request, "console/moe.html", {"snapshot": None, "names": names})
        return redirect("moe-deployment", name=names[0])
    snapshot = moe_model.snapshot(name)
    if snapshot is None:
        raise Http404(f"no MoE deployment named {name}")
    if request.GET.get("partial"):
        return HttpResponse(render_to_string(FRAGMENT, {"snapshot": snapshot, "can_drain": _can_drain(request)}))
    return render(request, "console/moe.html", {"snapshot": snapshot, "names": names, "can_drain": _can_drain(request)})


def _can_drain(request) -> bool:
    return roles.has_role(request.user, *DECIDE_DRAINS)


@require_POST
@page_view(*DECIDE_DRAINS)
def moe_drain(request, name: str, ew: str):
    deployment = MoeDeployment.objects.filter(name=name).first()
    if deployment is None:
        raise Http404(f"no MoE deployment named {name}")
    reason = request.POST.get("reason", "").strip()
    if not reason:
        messages.error(request, f"{ew} not drained: say why (the reason goes to the audit log).")
        return redirect("moe-deployment", name=name)
    try:
        table = moe.drain_ew(deployment, ew, request.user.get_username(), reason)
    except moe.MoeRefused as exc:
        messages.error(request, f"{ew} not drained: {exc}")
        return redirect("moe-deployment", name=name)
    messages.success(request, f"{ew} drained: its experts are served by their shadows (table v{table.version}).")
    return redirect("moe-deployment", name=name)


@api_view()
@allow("GET")
def api_moe(request, name: str):
    snapshot = moe_model.snapshot(name)
    if snapshot is None:
        return json_error(404, f"no MoE deployment named {name}: see /moe/ for those there are", field="name")
    return JsonResponse(snapshot)


@api_view(*INJECT_FAULTS)
@allow("POST")
def api_moe_fault(request, name: str, ew: str):
    """Inject a fault on one expert worker (staging: the cluster must allow fault injection): {"kind": "corrupt"}
    (silent corruption, which its canaries find), {"kind": "hang"} (found by the data path's probes), or
    {"kind": null} to clear it; with a reason, for the audit log."""
    if request.method != "POST":
        return json_error(405, 'POST a fault: {"kind": "corrupt" | "hang" | null, "reason": ...}')
    row = ExpertWorkerNode.objects.filter(deployment__name=name, name=ew).select_related("deployment").first()
    if row is None:
        return json_error(404, f"no expert worker {ew!r} in an MoE deployment named {name!r}: see /moe/", field="ew")
    body = json_object(request, '{"kind": "corrupt" | "hang" | null, "reason": ...}')
    if isinstance(body, JsonResponse):
        return body
    kind, reason = body.get("kind"), body.get("reason", "")
    if kind is not None and not isinstance(kind, str):
        return json_error(400, "kind: a string (corrupt, hang) or null to clear the fault.", field="kind")
    if not isinstance(reason, str):
        return json_error(400, "reason: must be a string.", field="reason")
    status, answer = faults.inject_ew(row, kind, request.user.get_username(), reason)
    return JsonResponse(answer, status=status)
