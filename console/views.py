import json

import redis
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.db import connection
from django.http import Http404, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from console import incidents as shapes
from console import operations, presenters, roles
from console.auth import api_view, page_view
from recovery import hot, nodeclient
from recovery import actions
from recovery.actions import incidents, migrations
from recovery.http import json_error
from recovery.choices import DrainMode, Remediation
from recovery.models import Cluster, Incident, Node, NodeTransition
from workers import faults as fault_kinds

ACT_ON_NODES = (roles.OPERATOR, roles.ONCALL)  # and admin
INJECT_FAULTS = (roles.OPERATOR,)  # and admin
CLOSE_INCIDENTS = (roles.ONCALL,)  # and admin


def home(request):
    return redirect("cluster")


@never_cache
@page_view()
def cluster(request):
    snapshot = presenters.cluster_snapshot()
    if request.GET.get("partial") == "racks":
        return render(request, "console/_racks.html", {"snapshot": snapshot})
    return render(request, "console/cluster.html", {"snapshot": snapshot})


@api_view()
def api_cluster(request):
    return JsonResponse(presenters.cluster_snapshot())


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
    from django.http import HttpResponse

    from console.metrics import render

    return HttpResponse(render(), content_type="text/plain; version=0.0.4")


# --- incidents ------------------------------------------------------------------------------------
def _incident(incident_id: int) -> Incident:
    return get_object_or_404(Incident.objects.select_related("acknowledged_by", "commander").prefetch_related("nodes"), pk=incident_id)


@never_cache
@page_view()
def incident_list(request):
    rows = shapes.incident_list()
    if request.GET.get("partial") == "rows":
        return render(request, "console/_incident_rows.html", {"incidents": rows})
    return render(request, "console/incidents.html", {"incidents": rows})


@never_cache
@page_view()
def incident_page(request, incident_id: int):
    incident = _incident(incident_id)
    if request.GET.get("partial") == "chart":
        return JsonResponse(shapes.latency_series(incident))
    if request.GET.get("partial") == "facts":
        return render(request, "console/_incident_facts.html", {"incident": shapes.incident_row(incident)})
    detail = shapes.incident_detail(incident)
    users = get_user_model().objects.filter(groups__name__in=(roles.ONCALL, roles.ADMIN)).distinct().order_by("username")
    return render(request, "console/incident.html", {
        "incident": detail,
        "chart": json.dumps(shapes.latency_series(incident)),
        "can_act": roles.has_role(request.user, *ACT_ON_NODES),
        "can_close": roles.has_role(request.user, *CLOSE_INCIDENTS),
        "commanders": users,
    })


@require_POST
@page_view(*ACT_ON_NODES)
def incident_action(request, incident_id: int, action: str):
    incident = _incident(incident_id)
    try:
        if action == "ack":
            incidents.acknowledge(incident, request.user)
        elif action == "command":
            commander = get_object_or_404(get_user_model(), username=request.POST.get("commander") or request.user.username)
            if not roles.has_role(commander, roles.ONCALL):
                raise incidents.IncidentActionError(f"{commander.username} is not on call: a commander must have the oncall or admin role")
            incidents.set_commander(incident, commander, request.user)
        elif action == "note":
            incidents.add_note(incident, request.POST.get("text", ""), request.user)
        elif action == "close":
            if not roles.has_role(request.user, *CLOSE_INCIDENTS):
                messages.error(request, "Closing an incident needs the oncall or admin role.")
                return redirect("incident", incident_id=incident_id)
            incidents.close(incident, request.user, request.POST.get("reason", ""))
        else:
            raise Http404(action)
        migrations.audit(request.user.username, f"incident_{action}", f"incident:{incident.pk}", request.POST.get("reason", "") or request.POST.get("text", ""))
    except incidents.IncidentActionError as exc:
        messages.error(request, str(exc))
    return redirect("incident", incident_id=incident_id)


@api_view()
def api_incidents(request):
    return JsonResponse({"incidents": shapes.incident_list(int(request.GET.get("limit", 100)))})


@api_view()
def api_incident(request, incident_id: int):
    incident = Incident.objects.filter(pk=incident_id).first()
    if incident is None:
        return json_error(404, f"There is no incident {incident_id}: list them at /api/incidents.")
    return JsonResponse(shapes.incident_detail(incident))


# --- checkpoints --------------------------------------------------------------------------------------
@never_cache
@page_view()
def checkpoints(request):
    snapshot = shapes.checkpoint_snapshot()
    template = "console/_checkpoints.html" if request.GET.get("partial") else "console/checkpoints.html"
    return render(request, template, {"snapshot": snapshot})


@api_view()
def api_checkpoints(request):
    return JsonResponse(shapes.checkpoint_snapshot())


# --- nodes --------------------------------------------------------------------------------------------
def _node(name: str) -> Node:
    return get_object_or_404(Node.objects.select_related("rack"), name=name)


@never_cache
@page_view()
def node_page(request, name: str):
    node = _node(name)
    if request.GET.get("partial") == "health":
        return render(request, "console/_node_health.html", {"health": operations.node_health(node), "node_obj": node})
    if request.GET.get("partial") == "charts":
        return JsonResponse({"canaries": operations.canary_series(node), "telemetry": operations.telemetry_series(node)})
    card = presenters.node_card_by_id(node.pk)
    snapshot = shapes.checkpoint_snapshot()
    flights = [f for f in hot.gateway_flights() if f.get("node") == name]
    telemetry = None
    try:
        status, telemetry = nodeclient.call(node.address, "GET", "/agent/telemetry", timeout=0.5)
        telemetry = telemetry if status == 200 else None
    except nodeclient.NodeUnreachable:
        pass
    cluster = Cluster.default()
    return render(request, "console/node.html", {
        "node": card,
        "node_obj": node,
        "transitions": NodeTransition.objects.filter(node=node)[:50],
        "flights": flights,
        "held": snapshot["matrix"].get(name, {}),
        "telemetry": telemetry,
        "incidents": [shapes.incident_row(i) for i in node.incidents.all()[:10]],
        "can_act": roles.has_role(request.user, *ACT_ON_NODES),
        "can_inject": cluster.fault_injection_enabled and roles.has_role(request.user, *INJECT_FAULTS),
        "fault_injection_enabled": cluster.fault_injection_enabled,
        "fault_kinds": fault_kinds.KINDS,
        "health": operations.node_health(node),
        "charts": json.dumps({"canaries": operations.canary_series(node), "telemetry": operations.telemetry_series(node)}),
        "can_request_drain": roles.has_role(request.user, roles.OPERATOR, roles.ONCALL),
        "can_manage_spares": roles.has_role(request.user, roles.ONCALL),
        "can_record_golden": roles.has_role(request.user, roles.ADMIN),
        "drain_modes": DrainMode.choices,
        "remediations": Remediation.choices,
    })


def _inject(node: Node, kind: str, params: dict, actor: str, reason: str) -> tuple[int, dict]:
    """A fault on a staging node, from the console: only where enabled, always audited."""
    from django.conf import settings

    if not Cluster.default().fault_injection_enabled:
        return 403, {"error": {"message": "Fault injection is off for this cluster (a staging setting an admin turns on)."}}
    if kind not in fault_kinds.KINDS:
        return 400, {"error": {"message": f"kind: {kind!r} is not a fault: expected one of {', '.join(fault_kinds.KINDS)}", "field": "kind"}}
    migrations.audit(actor, "inject_fault", f"node:{node.name}", reason, kind=kind, params=params)
    try:
        return nodeclient.call(node.address, "POST", "/agent/faults", {"kind": kind, **params}, timeout=3, token=settings.LIFELINE_FAULT_TOKEN or "")
    except nodeclient.NodeUnreachable as exc:
        return 502, {"error": {"message": f"{node.name} did not answer: {exc}"}}


@require_POST
@page_view(*ACT_ON_NODES)
def node_action(request, name: str, action: str):
    node = _node(name)
    reason = request.POST.get("reason", "").strip()
    if action == "fault":
        if not roles.has_role(request.user, *INJECT_FAULTS):
            messages.error(request, "Injecting faults needs the operator or admin role.")
            return redirect("node", name=name)
        params = {}
        for key in ("factor", "rate", "code", "seconds", "target_c"):
            if request.POST.get(key):
                params[key] = float(request.POST[key]) if "." in request.POST[key] or key != "code" else int(request.POST[key])
        if request.POST.get("kind") == "poison":
            params["match"] = request.POST.get("match", "")  # "" fails every request: a broken engine
        status, answer = _inject(node, request.POST.get("kind", ""), params, request.user.username, reason)
        (messages.success if status < 300 else messages.error)(request, f"{request.POST.get('kind')}: {answer.get('error', {}).get('message') or 'injected'}")
    elif action in ("cordon", "uncordon"):
        if not reason:
            messages.error(request, f"{action.title()} needs a reason.")
        elif migrations.set_cordon(node, action == "cordon", request.user.username, reason):
            messages.success(request, f"{node.name} {action}ed.")
        else:
            messages.info(request, f"{node.name} was already {action}ed.")
    elif action == "migrate":
        command = migrations.migrate_node(node, request.user.username, reason or "planned migration from the console")
        messages.success(request, f"Moving every request off {node.name} (command {command}).")
    else:
        raise Http404(action)
    return redirect("node", name=name)


@api_view(*INJECT_FAULTS)
def api_node_fault(request, name: str):
    if request.method != "POST":
        return json_error(405, "POST a fault: {\"kind\": \"crash\", ...}")
    node = Node.objects.filter(name=name).first()
    if node is None:
        return json_error(404, f"There is no node {name!r}.")
    try:
        body = json.loads(request.body or b"{}")
    except json.JSONDecodeError:
        return json_error(400, "The body is not valid JSON.", field="body")
    kind = body.pop("kind", "")
    reason = str(body.pop("reason", ""))
    status, answer = _inject(node, kind, body, request.user.username, reason)
    return JsonResponse(answer, status=status)


@api_view(*ACT_ON_NODES)
def api_node_migrate(request, name: str):
    if request.method != "POST":
        return json_error(405, "POST to move every request off the node.")
    node = Node.objects.filter(name=name).first()
    if node is None:
        return json_error(404, f"There is no node {name!r}.")
    body = json.loads(request.body or b"{}") if request.body else {}
    if body.get("cordon", True):
        migrations.set_cordon(node, True, request.user.username, body.get("reason") or "planned migration")
    command = migrations.migrate_node(node, request.user.username, body.get("reason") or "planned migration")
    return JsonResponse({"command": command, "status_url": f"/api/migrations/{command}"}, status=202)


@api_view()
def api_migration(request, command: str):
    status = migrations.migration_status(command)
    if status is None:
        return json_error(404, f"No migration {command!r} (they are kept for an hour).")
    return JsonResponse(status)


# --- gateway API keys ----------------------------------------------------------------------------------
@never_cache
@page_view()
def api_keys(request):
    """Gateway keys: a tenant and a priority tier each. Admins create and revoke them."""
    from recovery.choices import Tier
    from recovery.models import ApiKey

    if not roles.has_role(request.user, roles.ADMIN):
        return render(request, "console/forbidden.html", {"reason": "Gateway keys are an admin's to manage."}, status=403)
    created = None
    if request.method == "POST":
        tenant, tier, label = request.POST.get("tenant", "").strip(), request.POST.get("tier", ""), request.POST.get("label", "").strip()
        if not tenant:
            messages.error(request, "tenant: a key needs the tenant it bills to.")
        elif tier not in Tier.values:
            messages.error(request, f"tier: {tier!r} is not a tier: expected one of {', '.join(Tier.values)}.")
        else:
            row, created = actions.create_api_key(tenant, tier, label, created_by=request.user)
            migrations.audit(request.user.username, "create_api_key", f"api_key:{row.prefix}", label, tenant=tenant, tier=tier)
    keys = ApiKey.objects.select_related("created_by").order_by("revoked_at", "tenant", "-created_at")
    return render(request, "console/keys.html", {"keys": keys, "created": created, "tiers": Tier.choices})


@require_POST
@page_view(roles.ADMIN)
def revoke_key(request, key_id: int):
    from recovery.models import ApiKey

    key = get_object_or_404(ApiKey, pk=key_id)
    if actions.revoke_api_key(key):
        migrations.audit(request.user.username, "revoke_api_key", f"api_key:{key.prefix}", request.POST.get("reason", ""), tenant=key.tenant)
        messages.success(request, f"Key {key.prefix}… of {key.tenant} revoked: the gateways refuse it from now on.")
    else:
        messages.info(request, f"Key {key.prefix}… was already revoked.")
    return redirect("keys")
