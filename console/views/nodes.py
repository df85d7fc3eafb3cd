"""A node's page and what people do to a node: cordon, migrate its requests, inject a fault, ask for a drain, keep it as
a spare, record its golden canary run."""

import json

from django.contrib import messages
from django.http import Http404, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from console.auth import (
    ACT_ON_NODES,
    INJECT_FAULTS,
    MANAGE_SPARES,
    REQUEST_DRAINS,
    api_view,
    page_view,
)
from console.forms import DrainRequestForm, FaultForm
from console.readmodels import checkpoints as checkpoint_model
from console.readmodels import cluster as cluster_model
from console.readmodels import incidents as incident_model
from console.readmodels import nodes as node_model
from console.views import allow
from recovery import hot, nodeclient, roles
from recovery.actions import drains, faults, health, live_migration
from recovery.choices import DrainMode, Remediation
from recovery.http import json_error, json_object
from recovery.models import Cluster, Node, NodeTransition


def _node(name: str) -> Node:
    return get_object_or_404(Node.objects.select_related("rack"), name=name)


@never_cache
@page_view()
def node_page(request, name: str):
    node = _node(name)
    if request.GET.get("partial") == "health":
        return render(request, "console/_node_health.html", {"health": node_model.node_health(node), "node_obj": node})
    if request.GET.get("partial") == "charts":
        return JsonResponse(
            {"canaries": node_model.canary_series(node), "telemetry": node_model.telemetry_series(node)}
        )
    return _render_node_page(request, node)


def _render_node_page(
    request, node: Node, fault_form: FaultForm | None = None, status: int = 200, drain_errors: list[str] = ()
):
    """The node page; with a fault form that did not validate or a drain request refused, the errors shown at
    their form (status 400)."""
    card = cluster_model.node_card_by_id(node.pk)
    snapshot = checkpoint_model.checkpoint_snapshot()
    flights = [f for f in hot.gateway_flights() if f.get("node") == node.name]
    telemetry = None
    try:
        answer_status, telemetry = nodeclient.call(node.address, "GET", "/agent/telemetry", timeout=0.5)
        telemetry = telemetry if answer_status == 200 else None
    except nodeclient.NodeUnreachable:
        pass
    cluster = Cluster.default()
    return render(
        request,
        "console/node.html",
        {
            "node": card,
            "node_obj": node,
            "transitions": NodeTransition.objects.filter(node=node)[:50],
            "flights": flights,
            "held": snapshot["matrix"].get(node.name, {}),
            "telemetry": telemetry,
            "incidents": [incident_model.incident_row(i) for i in node.incidents.all()[:10]],
            "can_act": roles.has_role(request.user, *ACT_ON_NODES),
            "can_inject": cluster.fault_injection_enabled and roles.has_role(request.user, *INJECT_FAULTS),
            "fault_injection_enabled": cluster.fault_injection_enabled,
            "fault_form": fault_form or FaultForm(),
            "drain_errors": list(drain_errors),
            "health": node_model.node_health(node),
            "charts": json.dumps(
                {"canaries": node_model.canary_series(node), "telemetry": node_model.telemetry_series(node)}
            ),
            "can_request_drain": roles.has_role(request.user, *REQUEST_DRAINS),
            "can_manage_spares": roles.has_role(request.user, *MANAGE_SPARES),
            "can_record_golden": roles.has_role(request.user, roles.ADMIN),
            "drain_modes": DrainMode.choices,
            "remediations": Remediation.choices,
        },
        status=status,
    )


@require_POST
@page_view(*ACT_ON_NODES)
def node_action(request, name: str, action: str):
    node = _node(name)
    reason = request.POST.get("reason", "").strip()
    user = request.user.get_username()
    if action == "fault":
        if not roles.has_role(request.user, *INJECT_FAULTS):
            messages.error(request, "Injecting faults needs the operator or admin role.")
            return redirect("node", name=name)
        form = FaultForm(request.POST)
        if not form.is_valid():
            return _render_node_page(request, node, fault_form=form, status=400)
        kind = form.cleaned_data["kind"]
        status, answer = faults.inject(node, kind, form.params(), user, form.cleaned_data["reason"])
        (messages.success if status < 300 else messages.error)(
            request, f"{kind}: {answer.get('error', {}).get('message') or 'injected'}"
        )
    elif action in ("cordon", "uncordon"):
        if not reason:
            messages.error(request, f"{action.title()} needs a reason.")
        elif health.set_cordon(node, action == "cordon", user, reason):
            messages.success(request, f"{node.name} {action}ed.")
        else:
            messages.info(request, f"{node.name} was already {action}ed.")
    elif action == "migrate":
        command = live_migration.start(node, user, reason or "planned migration from the console")
        messages.success(request, f"{node.name} cordoned; moving every request off it (command {command}).")
    else:
        raise Http404(action)
    return redirect("node", name=name)


@require_POST
@page_view(*REQUEST_DRAINS)
def node_drain(request, name: str):
    node = get_object_or_404(Node, name=name)
    form = DrainRequestForm(request.POST)
    if not form.is_valid():
        errors = [f"{field}: {' '.join(errors)}" for field, errors in form.errors.items()]
        return _render_node_page(request, node, status=400, drain_errors=errors)
    try:
        drain = drains.propose(node, source=request.user.get_username(), requested_by=request.user, **form.cleaned_data)
    except drains.DrainRefused as exc:
        return _render_node_page(request, node, status=400, drain_errors=[str(exc)])
    messages.success(request, f"Drain #{drain.pk} requested: on-call has been told.")
    return redirect("drain", drain_id=drain.pk)


@require_POST
@page_view(*MANAGE_SPARES)
def node_spare(request, name: str, spare: str):
    node = get_object_or_404(Node, name=name)
    reason = request.POST.get("reason", "").strip() or ("kept as a hot spare" if spare == "on" else "put in service")
    if health.set_spare(node, spare == "on", request.user.get_username(), reason):
        messages.success(request, f"{node.name} is {'a hot spare' if spare == 'on' else 'in service'}.")
    return redirect("node", name=name)


@require_POST
@page_view(roles.ADMIN)
def node_golden(request, name: str):
    node = get_object_or_404(Node, name=name)
    try:
        golden = health.record_golden([node], request.user.get_username(), request.POST.get("reason", ""))
    except ValueError as exc:
        messages.error(request, f"No golden run recorded: {exc}")
        return redirect("node", name=name)
    messages.success(request, f"Golden canary run for {golden.deployment} recorded from {node.name}.")
    return redirect("node", name=name)


# --- JSON -------------------------------------------------------------------------------------------------
@api_view(*INJECT_FAULTS)
@allow("POST")
def api_node_fault(request, name: str):
    if request.method != "POST":
        return json_error(405, 'POST a fault: {"kind": "crash", ...}')
    node = Node.objects.filter(name=name).first()
    if node is None:
        return json_error(404, f"There is no node {name!r}.")
    body = json_object(request, '{"kind": ..., "reason": ...}')
    if isinstance(body, JsonResponse):
        return body
    kind = body.pop("kind", "")
    reason = str(body.pop("reason", ""))
    status, answer = faults.inject(node, kind, body, request.user.get_username(), reason)
    return JsonResponse(answer, status=status)


@api_view(*ACT_ON_NODES)
@allow("POST")
def api_node_migrate(request, name: str):
    if request.method != "POST":
        return json_error(405, "POST to move every request off the node.")
    node = Node.objects.filter(name=name).first()
    if node is None:
        return json_error(404, f"There is no node {name!r}.")
    body = json_object(request, '{"reason": ..., "cordon": true}')
    if isinstance(body, JsonResponse):
        return body
    reason, cordon = body.get("reason") or "planned migration", body.get("cordon", True)
    if not isinstance(reason, str):
        return json_error(400, "reason: must be a string.", field="reason")
    if not isinstance(cordon, bool):
        return json_error(400, "cordon: must be true or false.", field="cordon")
    command = live_migration.start(node, request.user.get_username(), reason, cordon=cordon)
    return JsonResponse({"command": command, "status_url": f"/api/migrations/{command}"}, status=202)


@api_view()
@allow("GET")
def api_migration(request, command: str):
    status = live_migration.status(command)
    if status is None:
        return json_error(404, f"No migration {command!r} (they are kept for an hour).")
    return JsonResponse(status)


@api_view()
@allow("GET")
def api_node_health(request, name: str):
    node = Node.objects.filter(name=name).first()
    if node is None:
        return json_error(404, f"There is no node {name!r}.")
    return JsonResponse(node_model.node_health(node))
