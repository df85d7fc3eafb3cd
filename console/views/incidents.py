"""Incidents: the list, one incident's live timeline, and what people do with it."""

import datetime as dt
import json

from django.contrib import messages
from django.contrib.auth import get_user_model
from django.http import Http404, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from console.auth import ACT_ON_NODES, CLOSE_INCIDENTS, RECEIVE_ALERTS, api_view, page_view
from console.forms import IncidentFilterForm
from console.readmodels import incidents as incident_model
from console.views import allow, limit_param
from recovery import roles
from recovery.actions import alerts, incidents
from recovery.http import json_error, json_object
from recovery.models import Incident

MAX_LIMIT = 1000  # incidents in one answer


def _incident(incident_id: int) -> Incident:
    return get_object_or_404(
        Incident.objects.select_related("acknowledged_by", "commander").prefetch_related("nodes"), pk=incident_id
    )


def _in_utc(filters: dict) -> dict:
    """The time filters in UTC, as the database compares them (an offset such as -18:57 is not one PostgreSQL takes);
    OverflowError names a time that leaves the years 1 to 9999 on the way."""
    for name in ("since", "until"):
        if name in filters:
            try:
                filters[name] = filters[name].astimezone(dt.UTC)
            except OverflowError:
                raise OverflowError(name) from None
    return filters


@never_cache
@page_view()
def incident_list(request):
    """The incidents, newest first, filtered by status, severity, node and time (GET), with their totals; a bad
    filter is a 400 that names it."""
    form = IncidentFilterForm(request.GET or None)
    valid = form.is_valid() if form.is_bound else True
    filters = {k: v for k, v in form.cleaned_data.items() if v} if form.is_bound and valid else {}
    try:
        filters = _in_utc(filters)
    except OverflowError as exc:
        form.add_error(exc.args[0], f"{exc.args[0]}: not a time the database holds (years 1 to 9999, in UTC)")
        valid, filters = False, {}
    query = request.GET.copy()
    query["partial"] = "rows"  # the live refresh keeps the filters
    context = {
        "form": form,
        "incidents": incident_model.incident_list(**filters) if valid else [],
        "totals": incident_model.totals(**filters) if valid else None,
        "filtered": bool(filters),
        "partial_url": f"{request.path}?{query.urlencode()}",
        "limit": 100,
    }
    status = 200 if valid else 400
    if request.GET.get("partial") == "rows":
        return render(request, "console/_incident_list.html", context, status=status)
    return render(request, "console/incidents.html", context, status=status)


@never_cache
@page_view()
def incident_page(request, incident_id: int):
    incident = _incident(incident_id)
    if request.GET.get("partial") == "chart":
        return JsonResponse(incident_model.latency_series(incident))
    if request.GET.get("partial") == "facts":
        return render(request, "console/_incident_facts.html", {"incident": incident_model.incident_facts(incident)})
    detail = incident_model.incident_detail(incident)
    users = (
        get_user_model().objects.filter(groups__name__in=(roles.ONCALL, roles.ADMIN)).distinct().order_by("username")
    )
    return render(
        request,
        "console/incident.html",
        {
            "incident": detail,
            "chart": json.dumps(incident_model.latency_series(incident)),
            "can_act": roles.has_role(request.user, *ACT_ON_NODES),
            "can_close": roles.has_role(request.user, *CLOSE_INCIDENTS),
            "commanders": users,
        },
    )


@require_POST
@page_view(*ACT_ON_NODES)
def incident_action(request, incident_id: int, action: str):
    incident = _incident(incident_id)
    try:
        if action == "ack":
            incidents.acknowledge(incident, request.user)
        elif action == "command":
            commander = get_object_or_404(
                get_user_model(), username=request.POST.get("commander") or request.user.username
            )
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
    except incidents.IncidentActionError as exc:
        messages.error(request, str(exc))
    return redirect("incident", incident_id=incident_id)


@api_view()
@allow("GET")
def api_incidents(request):
    """The incidents list as JSON, with the page's filters (status, severity, node, since, until) and totals."""
    limit = limit_param(request, 100, MAX_LIMIT, "incidents")
    if isinstance(limit, JsonResponse):
        return limit
    form = IncidentFilterForm(request.GET)
    if not form.is_valid():
        field, errors = next(iter(form.errors.items()))
        return json_error(400, errors[0], param=field)
    filters = {k: v for k, v in form.cleaned_data.items() if v}
    try:
        filters = _in_utc(filters)
    except OverflowError as exc:
        return json_error(
            400, f"{exc.args[0]}: not a time the database holds (years 1 to 9999, in UTC)", param=exc.args[0]
        )
    return JsonResponse(
        {"incidents": incident_model.incident_list(limit, **filters), "totals": incident_model.totals(**filters)}
    )


@api_view()
@allow("GET")
def api_incident(request, incident_id: int):
    incident = Incident.objects.filter(pk=incident_id).first()
    if incident is None:
        return json_error(404, f"There is no incident {incident_id}: list them at /api/incidents.")
    return JsonResponse(incident_model.incident_detail(incident))


@api_view(*RECEIVE_ALERTS)
@allow("POST")
def api_alertmanager(request):
    """Alertmanager's webhook receiver (recovery.actions.alerts): its alerts become incidents and their events. A
    notification Lifeline cannot take is a 400 naming the field (Alertmanager logs it and does not retry)."""
    body = json_object(request, "Alertmanager's webhook notification (version 4)")
    if isinstance(body, JsonResponse):
        return body
    try:
        done = alerts.receive(body)
    except alerts.BadNotification as exc:
        return json_error(400, f"{exc}.", field=exc.field)
    return JsonResponse(done)
