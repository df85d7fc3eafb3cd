"""The Placement page and its API: the fleet as a matrix of models × GPU types, and on request the planner's
placement beside the current one, each judged by the simulator, with the moves it takes and what they cost.
Asking for a plan changes nothing (carrying one out goes through drains); any Lifeline role may ask."""

from django.http import JsonResponse
from django.shortcuts import render
from django.views.decorators.cache import never_cache

from console.auth import api_view, page_view
from console.views import allow
from recovery.actions import placement
from recovery.http import json_error, json_object
from workers import catalog


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
    }
    return render(request, "console/placement.html", context, status=status)


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
