"""On-call pages and their JSON: drains and their approval, settings, the degradation history, spares, golden runs."""

import json

from django.contrib import messages
from django.http import Http404, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from console import operations, roles
from console.auth import api_view, page_view
from console.forms import DrainRequestForm, SettingsForm
from recovery.actions import capacity, drains, health, migrations
from recovery.actions.nodes import publish_cluster_config
from recovery.http import json_error
from recovery.models import Cluster, Drain, DrainDecision, Node

REQUEST_DRAINS = (roles.OPERATOR, roles.ONCALL)  # and admin
DECIDE_DRAINS = (roles.ONCALL,)  # and admin
MANAGE_SPARES = (roles.ONCALL,)  # and admin


def _drain(drain_id: int) -> Drain:
    return get_object_or_404(Drain.objects.select_related("node", "requested_by"), pk=drain_id)


def _may_decide(request, drain: Drain, decision: str) -> str | None:
    """None when the user may decide; otherwise the refusal, which is written to the audit log."""
    if roles.has_role(request.user, *DECIDE_DRAINS):
        return None
    role = roles.role_of(request.user)
    refusal = f"Role {role!r} may not {decision} drains: only the oncall and admin roles decide."
    migrations.audit(request.user.get_username(), f"drain_{decision}_refused", f"drain:{drain.pk}", refusal, role=role, node=drain.node.name)
    return refusal


# --- pages -----------------------------------------------------------------------------------------------
@never_cache
@page_view()
def drain_list(request):
    rows = operations.drain_list()
    if request.GET.get("partial") == "rows":
        return render(request, "console/_drain_rows.html", {"drains": rows})
    return render(request, "console/drains.html", {"drains": rows, "spares": operations.spare_pool(),
                                                   "notifications": operations.notifications(10)})


@never_cache
@page_view()
def drain_page(request, drain_id: int):
    drain = _drain(drain_id)
    context = {
        "drain": operations.drain_detail(drain),
        "can_decide": roles.has_role(request.user, *DECIDE_DRAINS),
        "can_cancel": roles.has_role(request.user, *REQUEST_DRAINS),
        "decided": drain.decisions.filter(user=request.user).exists(),
        "is_requester": drain.requested_by_id == request.user.pk,
    }
    if request.GET.get("partial") == "body":
        return render(request, "console/_drain_body.html", context)
    return render(request, "console/drain.html", context)


@require_POST
@page_view()
def drain_action(request, drain_id: int, action: str):
    drain = _drain(drain_id)
    reason = request.POST.get("reason", "")
    if action in (DrainDecision.APPROVE, DrainDecision.REJECT):
        refusal = _may_decide(request, drain, action)
        if refusal is not None:
            return render(request, "console/forbidden.html", {"reason": refusal}, status=403)
        try:
            drains.decide(drain, request.user, action, reason)
            messages.success(request, f"Drain #{drain.pk} {action}d.")
        except drains.DrainRefused as exc:
            messages.error(request, str(exc))
    elif action == "cancel":
        if not roles.has_role(request.user, *REQUEST_DRAINS):
            return render(request, "console/forbidden.html", {"reason": "Cancelling a drain needs the operator, oncall or admin role."}, status=403)
        try:
            drains.cancel(drain, request.user, reason)
            messages.success(request, f"Drain #{drain.pk} cancelled.")
        except drains.DrainRefused as exc:
            messages.error(request, str(exc))
    else:
        raise Http404(action)
    return redirect("drain", drain_id=drain.pk)


@require_POST
@page_view(*REQUEST_DRAINS)
def node_drain(request, name: str):
    node = get_object_or_404(Node, name=name)
    form = DrainRequestForm(request.POST)
    if not form.is_valid():
        for field, errors in form.errors.items():
            messages.error(request, f"{field}: {' '.join(errors)}")
        return redirect("node", name=name)
    try:
        drain = drains.propose(node, source=request.user.get_username(), requested_by=request.user, **form.cleaned_data)
    except drains.DrainRefused as exc:
        messages.error(request, str(exc))
        return redirect("node", name=name)
    messages.success(request, f"Drain #{drain.pk} requested: on-call has been told.")
    return redirect("drain", drain_id=drain.pk)


@require_POST
@page_view(*MANAGE_SPARES)
def node_spare(request, name: str, spare: str):
    node = get_object_or_404(Node, name=name)
    reason = request.POST.get("reason", "").strip() or ("kept as a hot spare" if spare == "on" else "put in service")
    if health.set_spare(node, spare == "on", request.user.get_username(), reason):
        migrations.audit(request.user.get_username(), "spare_on" if spare == "on" else "spare_off", f"node:{node.name}", reason)
        messages.success(request, f"{node.name} is {'a hot spare' if spare == 'on' else 'in service'}.")
    return redirect("node", name=name)


@require_POST
@page_view(roles.ADMIN)
def node_golden(request, name: str):
    node = get_object_or_404(Node, name=name)
    try:
        golden = health.record_golden([node], request.user.get_username())
    except ValueError as exc:
        messages.error(request, f"No golden run recorded: {exc}")
        return redirect("node", name=name)
    migrations.audit(request.user.get_username(), "record_golden", f"node:{node.name}", request.POST.get("reason", ""), golden=golden.pk)
    messages.success(request, f"Golden canary run for {golden.deployment} recorded from {node.name}.")
    return redirect("node", name=name)


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
    before = {name: getattr(cluster, name) for name in SettingsForm.Meta.fields}
    form = SettingsForm(request.POST or None, instance=cluster)
    if request.method == "POST":
        if form.is_valid():
            form.save()
            changed = {name: [before[name], getattr(cluster, name)] for name in SettingsForm.Meta.fields if before[name] != getattr(cluster, name)}
            if changed:
                migrations.audit(request.user.get_username(), "settings", f"cluster:{cluster.name}", request.POST.get("reason", ""), changed=changed)
                publish_cluster_config()
                messages.success(request, f"Saved: {', '.join(sorted(changed))}.")
            else:
                messages.info(request, "Nothing changed.")
            return redirect("settings")
        messages.error(request, "Not saved: " + "; ".join(e for errors in form.errors.values() for e in errors))
    return render(request, "console/settings.html", {"form": form, "cluster": cluster}, status=400 if form.errors else 200)


@never_cache
@page_view()
def degradation_page(request):
    if request.GET.get("partial") == "banner":
        return render(request, "console/_banner.html")
    return render(request, "console/degradation.html", {"history": operations.degradation_history(), "banner": operations.degradation()})


# --- JSON -------------------------------------------------------------------------------------------------------
@api_view()
def api_drains(request):
    if request.method == "GET":
        return JsonResponse({"drains": operations.drain_list()})
    if request.method != "POST":
        return json_error(405, "GET the drains, or POST {node, reason, mode, remediation} to request one.")
    if not roles.has_role(request.user, *REQUEST_DRAINS):
        return json_error(403, f"Role {roles.role_of(request.user)!r} may not request drains: it needs operator, oncall or admin.")
    try:
        body = json.loads(request.body or b"{}")
    except json.JSONDecodeError:
        return json_error(400, "The body is not valid JSON.", field="body")
    node = Node.objects.filter(name=body.get("node")).first()
    if node is None:
        return json_error(404 if body.get("node") else 400, f"node: there is no node {body.get('node')!r}.", field="node")
    form = DrainRequestForm({k: v for k, v in body.items() if k != "node"})
    if not form.is_valid():
        field, errors = next(iter(form.errors.items()))
        return json_error(400, f"{field}: {' '.join(errors)}", field=field)
    try:
        drain = drains.propose(node, source=request.user.get_username(), requested_by=request.user, **form.cleaned_data)
    except drains.DrainRefused as exc:
        return json_error(409, str(exc))
    return JsonResponse(operations.drain_detail(drain), status=201)


@api_view()
def api_drain(request, drain_id: int):
    drain = Drain.objects.select_related("node", "requested_by").filter(pk=drain_id).first()
    if drain is None:
        return json_error(404, f"There is no drain {drain_id}: list them at /api/drains.")
    return JsonResponse(operations.drain_detail(drain))


@api_view()
def api_drain_decide(request, drain_id: int, decision: str):
    if decision not in (DrainDecision.APPROVE, DrainDecision.REJECT):
        return json_error(404, f"{decision!r}: a drain is approved or rejected (POST /api/drains/<id>/approve or /reject).")
    if request.method != "POST":
        return json_error(405, f"POST {{\"reason\": ...}} to {decision}.")
    drain = Drain.objects.select_related("node").filter(pk=drain_id).first()
    if drain is None:
        return json_error(404, f"There is no drain {drain_id}.")
    refusal = _may_decide(request, drain, decision)
    if refusal is not None:
        return json_error(403, refusal)
    try:
        body = json.loads(request.body or b"{}")
        drains.decide(drain, request.user, decision, str(body.get("reason", "")))
    except json.JSONDecodeError:
        return json_error(400, "The body is not valid JSON.", field="body")
    except drains.DrainRefused as exc:
        return json_error(409, str(exc))
    drain.refresh_from_db()
    return JsonResponse(operations.drain_detail(drain))


@api_view(roles.ADMIN)
def api_settings(request):
    """GET the cluster's operating settings; PATCH some of them (admin), validated and audited as on the page."""
    cluster = Cluster.default()
    current = {name: getattr(cluster, name) for name in SettingsForm.Meta.fields}
    if request.method == "GET":
        return JsonResponse(current)
    if request.method != "PATCH":
        return json_error(405, "GET the settings, or PATCH {field: value, ..., \"reason\": ...}.")
    try:
        body = json.loads(request.body or b"{}")
    except json.JSONDecodeError:
        return json_error(400, "The body is not valid JSON.", field="body")
    reason = str(body.pop("reason", ""))
    unknown = sorted(set(body) - set(current))
    if unknown:
        return json_error(400, f"{unknown[0]}: not a setting; the settings are {', '.join(sorted(current))}", field=unknown[0])
    form = SettingsForm({**current, **body}, instance=cluster)
    if not form.is_valid():
        field, errors = next(iter(form.errors.items()))
        return json_error(400, " ".join(errors), field=field)
    form.save()
    changed = {name: [current[name], getattr(cluster, name)] for name in current if current[name] != getattr(cluster, name)}
    if changed:
        migrations.audit(request.user.get_username(), "settings", f"cluster:{cluster.name}", reason, changed=changed)
        publish_cluster_config()
    return JsonResponse({**{name: getattr(cluster, name) for name in current}, "changed": sorted(changed)})


@api_view()
def api_degradation(request):
    return JsonResponse({**operations.degradation(), "history": operations.degradation_history(), "report": capacity.report().to_json()})


@api_view()
def api_node_health(request, name: str):
    node = Node.objects.filter(name=name).first()
    if node is None:
        return json_error(404, f"There is no node {name!r}.")
    return JsonResponse(operations.node_health(node))
