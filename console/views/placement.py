"""The Placement page and its API: the fleet as a matrix of models × GPU types, and on request the planner's
placement beside the current one, each judged by the simulator, with the moves it takes and what they cost.
Asking for a plan changes nothing; any Lifeline role may ask. A re-placement proposal (raised by the control plane
when a model's level rises, or asked for by an operator) is decided here by on-call, and carried out as drains."""

from django.contrib import messages
from django.http import Http404, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from console.auth import DECIDE_DRAINS, REQUEST_DRAINS, api_view, page_view
from console.views import allow, refuse_nul
from recovery import roles
from recovery.actions import drains, placement, replacement
from recovery.choices import PlacementState
from recovery.http import json_error, json_object
from recovery.models import PlacementProposal
from workers import catalog

RECENT = 10  # proposals listed on the page and by the API


def proposal_json(proposal: PlacementProposal) -> dict:
    approvals = [d["user"] for d in proposal.decisions if d["decision"] == "approve"]
    return {
        "id": proposal.pk,
        "state": proposal.state,
        "state_label": proposal.get_state_display(),
        "badge": proposal.badge,
        "created_at": proposal.created_at.isoformat(),
        "source": proposal.source,
        "reason": proposal.reason,
        "model": proposal.model_key,
        "switches": proposal.switches,
        "manual": proposal.manual,
        "approvals": approvals,
        "approvals_required": proposal.approvals_required,
        "approvals_why": proposal.approvals_why,
        "decisions": proposal.decisions,
        "outcome": proposal.outcome,
        "incident": proposal.incident_id,
        "drains": [
            {"id": d.pk, "node": d.node.name, "state": d.state, "state_label": d.get_state_display(), "to": d.switch_to}
            for d in sorted(proposal.drains.all(), key=lambda d: d.created_at)
        ],
        "cost": proposal.plan.get("cost"),
        "capacity_rps": {
            "current": proposal.plan["current"]["capacity_rps"],
            "proposed": proposal.plan["proposed"]["capacity_rps"],
        },
        "evaluation": proposal.plan.get("evaluation"),
    }


def _proposals() -> list[dict]:
    return [proposal_json(p) for p in PlacementProposal.objects.prefetch_related("drains__node")[:RECENT]]


def _rows(result: dict) -> list[dict]:
    """Per model: its demand and, for the current and the proposed placement, what it runs and what it gets."""
    evaluation = result.get("evaluation") or {}
    rows = []
    for demand in result["demands"]:
        model = demand["model"]
        row = {"model": model, "demand": demand, "source": result.get("sources", {}).get(model, "")}
        for side in ("current", "proposed"):
            if side not in result:
                continue
            placed = result[side]
            row[side] = {
                "cells": placed["matrix"].get(model, {}),
                "gpus": sum(c["gpus"] for c in placed["matrix"].get(model, {}).values()),
                "capacity_rps": placed["capacity_rps"].get(model, 0.0),
                "after_rack_loss_rps": placed["after_rack_loss_rps"].get(model, 0.0),
                "figures": (evaluation.get(side) or {}).get(model),
            }
        rows.append(row)
    return rows


def _what_if(post) -> tuple[dict | None, list[str]]:
    add = None
    if post.get("add_count") and post["add_count"] != "0":
        try:
            count = int(post["add_count"])
            gpus = int(post.get("add_gpus") or 8)
        except ValueError:
            raise placement.PlacementError(
                "add.count", "the number of servers and their GPUs are whole numbers"
            ) from None
        add = {"gpu": post.get("add_gpu", ""), "count": count, "gpus": gpus, "rack": post.get("add_rack", "")}
    return add, post.getlist("lose_racks")


@never_cache
@page_view()
def placement_page(request):
    result, error, status = None, None, 200
    if request.method == "POST":
        try:
            add, lose = _what_if(request.POST)
            result = placement.propose(add=add, lose_racks=lose)
        except placement.PlacementError as exc:
            error, status = str(exc), 400
    if result is None:
        result = placement.overview()
    context = {
        "result": result,
        "rows": _rows(result) if result else [],
        "error": error,
        "proposed": bool(result and "proposed" in result),
        "gpus": list(catalog.GPUS),
        "racks": result["current"]["racks"] if result else [],
        "post": request.POST if request.method == "POST" else {},
        "proposals": _proposals(),
        "can_decide": roles.has_role(request.user, *DECIDE_DRAINS),
        "may_request": roles.has_role(request.user, *REQUEST_DRAINS),
        "me": request.user.get_username(),
    }
    return render(request, "console/placement.html", context, status=status)


@require_POST
@page_view(*REQUEST_DRAINS)
def proposal_new(request):
    try:
        proposal = replacement.propose(
            source=request.user.get_username(), requested_by=request.user, reason=request.POST.get("reason", "")
        )
        messages.success(request, f"Re-placement #{proposal.pk} proposed: on-call decides it below.")
    except (replacement.ProposalRefused, placement.PlacementError) as exc:
        messages.error(request, str(exc))
    return redirect("placement")


@require_POST
@page_view()
def proposal_action(request, proposal_id: int, action: str):
    if action not in ("approve", "reject"):
        raise Http404(action)
    proposal = get_object_or_404(PlacementProposal, pk=proposal_id)
    try:
        proposal = replacement.decide(proposal, request.user, action, request.POST.get("reason", ""))
    except drains.NotAllowed as exc:
        messages.error(request, str(exc))
        return redirect("placement")
    except replacement.ProposalRefused as exc:
        messages.error(request, str(exc))
        return redirect("placement")
    if proposal.state == PlacementState.REFUSED:
        messages.error(request, f"Re-placement #{proposal.pk} refused: {proposal.outcome}")
    else:
        messages.success(request, f"Re-placement #{proposal.pk}: {proposal.get_state_display().lower()}.")
    return redirect("placement")


@api_view()
@allow("POST")
def api_placement_plan(request):
    body = json_object(request, '{"add": {"gpu", "count", "gpus", "rack"}, "lose_racks": [...], "evaluate": true}')
    if isinstance(body, JsonResponse):
        return body
    add, lose = body.get("add"), body.get("lose_racks", [])
    if add is not None and not isinstance(add, dict):
        return json_error(400, 'add: an object such as {"gpu": "L40S", "count": 16}', field="add")
    if not isinstance(lose, list) or not all(isinstance(r, str) for r in lose):
        return json_error(400, 'lose_racks: a list of rack names, such as ["rack-a"]', field="lose_racks")
    try:
        return JsonResponse(placement.propose(add=add, lose_racks=lose, evaluate=bool(body.get("evaluate", True))))
    except placement.PlacementError as exc:
        return json_error(400, str(exc), field=exc.field)


@api_view()
@allow("GET", "POST")
def api_proposals(request):
    if request.method == "GET":
        return JsonResponse({"proposals": _proposals()})
    if not roles.has_role(request.user, *REQUEST_DRAINS):
        return json_error(
            403, f"Role {roles.role_of(request.user)!r} may not ask for re-placements: operator, oncall or admin may."
        )
    body = json_object(request, '{"reason": "..."}')
    if isinstance(body, JsonResponse):
        return body
    try:
        proposal = replacement.propose(
            source=request.user.get_username(), requested_by=request.user, reason=str(body.get("reason", ""))
        )
    except replacement.ProposalRefused as exc:
        return json_error(409, str(exc))
    except placement.PlacementError as exc:
        return json_error(400, str(exc), field=exc.field)
    return JsonResponse(proposal_json(proposal), status=201)


@api_view()
@allow("GET")
def api_proposal(request, proposal_id: int):
    proposal = PlacementProposal.objects.filter(pk=proposal_id).first()
    if proposal is None:
        return json_error(404, f"There is no re-placement {proposal_id}: list them at /api/placement/proposals.")
    return JsonResponse(proposal_json(proposal))


@api_view()
def api_proposal_decide(request, proposal_id: int, decision: str):
    if decision not in ("approve", "reject"):
        return json_error(
            404, f"{decision!r}: a re-placement is approved or rejected (POST .../approve or .../reject)."
        )
    if request.method != "POST":
        return json_error(405, f'POST {{"reason": ...}} to {decision}.')
    refused = refuse_nul(request, {})
    if refused is not None:
        return refused
    proposal = PlacementProposal.objects.filter(pk=proposal_id).first()
    if proposal is None:
        return json_error(404, f"There is no re-placement {proposal_id}.")
    body = json_object(request)
    if isinstance(body, JsonResponse):
        return body
    try:
        proposal = replacement.decide(proposal, request.user, decision, str(body.get("reason", "")))
    except drains.NotAllowed as exc:
        return json_error(403, str(exc))
    except replacement.ProposalRefused as exc:
        return json_error(409, str(exc))
    if proposal.state == PlacementState.REFUSED:
        return json_error(409, f"re-placement #{proposal.pk} refused: {proposal.outcome}")
    return JsonResponse(proposal_json(proposal))
