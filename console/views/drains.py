"""Drains for on-call: the list, one drain live, deciding and withdrawing, and their JSON."""

from django.contrib import messages
from django.db import transaction
from django.http import Http404, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from console.auth import DECIDE_DRAINS, REQUEST_DRAINS, api_view, page_view
from console.forms import DrainRequestForm
from console.readmodels import drains as drain_model
from console.views import allow, limit_param, refuse_nul
from recovery import roles, tasks
from recovery.actions import drains, notify
from recovery.http import json_error, json_object
from recovery.models import Drain, DrainDecision, Node, Notification

UNDELIVERED_SHOWN = 20  # dead letters on the drains page; the API lists up to MAX_NOTIFICATIONS
MAX_NOTIFICATIONS = 500


def _drain(drain_id: int) -> Drain:
    return get_object_or_404(Drain.objects.select_related("node", "requested_by"), pk=drain_id)


@never_cache
@page_view()
def drain_list(request):
    rows = drain_model.drain_list()
    if request.GET.get("partial") == "rows":
        return render(request, "console/_drain_rows.html", {"drains": rows})
    return render(
        request,
        "console/drains.html",
        {
            "drains": rows,
            "spares": drain_model.spare_pool(),
            "notifications": drain_model.notifications(10),
            "undelivered": drain_model.notifications(UNDELIVERED_SHOWN, undelivered=True),
            "can_resend": roles.has_role(request.user, *DECIDE_DRAINS),
        },
    )


@never_cache
@page_view()
def drain_page(request, drain_id: int):
    drain = _drain(drain_id)
    if request.GET.get("partial") == "body":
        return render(request, "console/_drain_body.html", _drain_context(request, drain))
    return render(request, "console/drain.html", _drain_context(request, drain))


def _drain_context(request, drain: Drain) -> dict:
    return {
        "drain": drain_model.drain_detail(drain),
        "can_decide": roles.has_role(request.user, *DECIDE_DRAINS),
        "can_cancel": roles.has_role(
            request.user, *(DECIDE_DRAINS if drain.requested_by_id is None else REQUEST_DRAINS)
        ),
        "may_request": roles.has_role(request.user, *REQUEST_DRAINS),
        "decided": drain.decisions.filter(user=request.user).exists(),
        "is_requester": drain.requested_by_id == request.user.pk,
    }


@require_POST
@page_view()
def drain_action(request, drain_id: int, action: str):
    drain = _drain(drain_id)
    reason = request.POST.get("reason", "")
    try:
        if action in (DrainDecision.APPROVE, DrainDecision.REJECT):
            drains.decide(drain, request.user, action, reason)
            messages.success(request, f"Drain #{drain.pk} {action}d.")
        elif action == "cancel":
            drains.cancel(drain, request.user, reason)
            messages.success(request, f"Drain #{drain.pk} cancelled.")
        else:
            raise Http404(action)
    except drains.NotAllowed as exc:
        # Refused where it was asked, the drain as it stands beneath (the refusal is in the audit log).
        messages.error(request, str(exc))
        return render(request, "console/drain.html", _drain_context(request, drain), status=403)
    except drains.DrainRefused as exc:
        messages.error(request, str(exc))
    return redirect("drain", drain_id=drain.pk)


def _resend(notification: Notification, channel: str, user, reason: str) -> str:
    """A dead letter's channel queued again; sent by the worker once this commits."""
    outcome = notify.resend(notification, channel, user.get_username(), reason)
    transaction.on_commit(lambda: tasks.deliver_notification.delay(notification.pk, channel))
    return outcome


@require_POST
@page_view(*DECIDE_DRAINS)
def notification_resend(request, notification_id: int):
    notification = get_object_or_404(Notification, pk=notification_id)
    channel = request.POST.get("channel", "")
    try:
        _resend(notification, channel, request.user, request.POST.get("reason", ""))
        messages.success(request, f"Notification {notification.pk}'s {channel} delivery queued again.")
    except (ValueError, notify.NotUndelivered) as exc:
        messages.error(request, str(exc))
    return redirect("drains")


# --- JSON -------------------------------------------------------------------------------------------------------


@api_view()
@allow("GET", "POST")
def api_drains(request):
    if request.method == "GET":
        return JsonResponse({"drains": drain_model.drain_list()})
    if request.method != "POST":
        return json_error(405, "GET the drains, or POST {node, reason, mode, remediation} to request one.")
    if not roles.has_role(request.user, *REQUEST_DRAINS):
        return json_error(
            403, f"Role {roles.role_of(request.user)!r} may not request drains: it needs operator, oncall or admin."
        )
    body = json_object(request)
    if isinstance(body, JsonResponse):
        return body
    if not isinstance(body.get("node"), str):
        return json_error(400, "node: the name of the node to drain is required.", field="node")
    node = Node.objects.filter(name=body["node"]).first()
    if node is None:
        return json_error(
            404 if body.get("node") else 400, f"node: there is no node {body.get('node')!r}.", field="node"
        )
    form = DrainRequestForm({k: v for k, v in body.items() if k != "node"})
    if not form.is_valid():
        field, errors = next(iter(form.errors.items()))
        return json_error(400, f"{field}: {' '.join(errors)}", field=field)
    try:
        drain = drains.propose(node, source=request.user.get_username(), requested_by=request.user, **form.cleaned_data)
    except drains.DrainRefused as exc:
        return json_error(409, str(exc))
    return JsonResponse(drain_model.drain_detail(drain), status=201)


@api_view()
@allow("GET")
def api_drain(request, drain_id: int):
    drain = Drain.objects.select_related("node", "requested_by").filter(pk=drain_id).first()
    if drain is None:
        return json_error(404, f"There is no drain {drain_id}: list them at /api/drains.")
    return JsonResponse(drain_model.drain_detail(drain))


@api_view()
def api_drain_decide(request, drain_id: int, decision: str):
    if decision not in (DrainDecision.APPROVE, DrainDecision.REJECT, "cancel"):
        return json_error(
            404,
            f"{decision!r}: a drain is approved or rejected (POST /api/drains/<id>/approve or /reject), or withdrawn "
            "while it waits (/cancel).",
        )
    if request.method != "POST":
        return json_error(405, f'POST {{"reason": ...}} to {decision}.')
    refused = refuse_nul(request, {})
    if refused is not None:
        return refused
    drain = Drain.objects.select_related("node").filter(pk=drain_id).first()
    if drain is None:
        return json_error(404, f"There is no drain {drain_id}.")
    body = json_object(request)
    if isinstance(body, JsonResponse):
        return body
    try:
        if decision == "cancel":
            drains.cancel(drain, request.user, str(body.get("reason", "")))
        else:
            drains.decide(drain, request.user, decision, str(body.get("reason", "")))
    except drains.NotAllowed as exc:
        return json_error(403, str(exc))
    except drains.DrainRefused as exc:
        return json_error(409, str(exc))
    drain.refresh_from_db()
    return JsonResponse(drain_model.drain_detail(drain))


@api_view()
@allow("GET")
def api_notifications(request):
    """The latest notifications and how each channel's delivery went; ?undelivered=1: the dead letters only."""
    limit = limit_param(request, 50, MAX_NOTIFICATIONS, "notifications")
    if isinstance(limit, JsonResponse):
        return limit
    undelivered = request.GET.get("undelivered", "0")
    if undelivered not in ("0", "1"):
        return json_error(400, f"undelivered: 1 (the dead letters only) or 0, not {undelivered!r}", param="undelivered")
    return JsonResponse({"notifications": drain_model.notifications(limit, undelivered=undelivered == "1")})


@api_view(*DECIDE_DRAINS)
@allow("POST")
def api_notification_resend(request, notification_id: int):
    """POST {"channel": "webhook" | "email", "reason"}: send a dead letter's channel again."""
    notification = Notification.objects.filter(pk=notification_id).first()
    if notification is None:
        return json_error(404, f"There is no notification {notification_id}: list them at /api/notifications.")
    body = json_object(request)
    if isinstance(body, JsonResponse):
        return body
    channel = body.get("channel")
    if channel not in notify.CHANNELS:
        return json_error(400, f"channel: one of {', '.join(notify.CHANNELS)}, not {channel!r}", field="channel")
    try:
        outcome = _resend(notification, channel, request.user, str(body.get("reason", "")))
    except notify.NotUndelivered as exc:
        return json_error(409, str(exc))
    return JsonResponse({"id": notification.pk, "channel": channel, "delivery": outcome}, status=202)
