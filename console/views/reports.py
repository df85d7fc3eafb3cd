"""SLA reports: the /reports/ page (managers, on-call, operators, admins read) and `GET /api/reports` in JSON, CSV or
PDF, all from the one dict console.readmodels.reports.report() returns."""

from urllib.parse import urlencode

from django.http import HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.cache import never_cache

from console import exports
from console.auth import READ_SLO, api_view, page_view
from console.readmodels import reports
from console.views import allow
from recovery.http import json_error

FORMATS = {"json": "application/json", "csv": "text/csv; charset=utf-8", "pdf": "application/pdf"}
TENANT_VALUES = {"": False, "0": False, "1": True}


def _by_tenant(params) -> bool:
    value = (params.get("tenant") or "").strip()
    if value not in TENANT_VALUES:
        raise reports.ReportRefused("tenant", f"tenant must be 1 (a row per tenant) or 0 (per tier), not {value!r}.")
    return TENANT_VALUES[value]


def _allowed(now) -> dict:
    first, last = reports.allowed_range(now)
    return {"periods": list(reports.PERIODS), "first_day": first.isoformat(), "last_day": last.isoformat()}


def _choices(now) -> list[dict]:
    """The periods offered: the last complete week, month and quarter, named with their dates, and custom dates."""
    labels = {kind: reports.last_complete(kind, now).label for kind in ("week", "month", "quarter")}
    choices = [{"value": kind, "label": label[0].upper() + label[1:]} for kind, label in labels.items()]
    return [*choices, {"value": "custom", "label": reports.PERIOD_LABELS["custom"]}]


@never_cache
@page_view(*READ_SLO)
def report_page(request):
    now = timezone.now()
    context = {
        "choices": _choices(now),
        "allowed": _allowed(now),
        "asked": {name: request.GET.get(name, "") for name in ("period", "start", "end", "tenant")},
    }
    context["asked"]["period"] = context["asked"]["period"] or "month"
    try:
        period = reports.parse_period(request.GET, now)
        by_tenant = _by_tenant(request.GET)
    except reports.ReportRefused as exc:
        return render(request, "console/reports.html", {**context, "error": str(exc), "field": exc.field}, status=400)
    data = reports.report(period, by_tenant, now)
    query = period.query(**({"tenant": "1"} if by_tenant else {}))
    context |= {
        "report": data,
        "downloads": {fmt: "/api/reports?" + urlencode({**query, "format": fmt}) for fmt in FORMATS},
    }
    if period.kind == "custom":
        context["asked"] |= {"start": period.start.date().isoformat(), "end": period.last_day.isoformat()}
    return render(request, "console/reports.html", context)


@api_view(*READ_SLO)
@allow("GET")
def api_reports(request):
    """`GET /api/reports?period=week|month|quarter|custom&start=&end=&tenant=1&format=json|csv|pdf`."""
    if request.method != "GET":
        return json_error(405, "GET a report: /api/reports?period=week|month|quarter|custom&format=json|csv|pdf.")
    now = timezone.now()
    fmt = (request.GET.get("format") or "json").strip()
    if fmt not in FORMATS:
        return json_error(
            400, f"format must be one of {', '.join(FORMATS)}, not {fmt!r}.", field="format", allowed=list(FORMATS)
        )
    try:
        period = reports.parse_period(request.GET, now)
        by_tenant = _by_tenant(request.GET)
    except reports.ReportRefused as exc:
        return json_error(400, str(exc), field=exc.field, allowed=_allowed(now))
    data = reports.report(period, by_tenant, now)
    if fmt == "json":
        return JsonResponse(data)
    body = exports.report_csv(data) if fmt == "csv" else exports.report_pdf(data)
    response = HttpResponse(body, content_type=FORMATS[fmt])
    response["Content-Disposition"] = f'attachment; filename="{exports.filename(data, fmt)}"'
    return response
