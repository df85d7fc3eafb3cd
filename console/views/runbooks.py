"""Runbook pages: what a Lifeline alert means and what to do, linked from each alert's runbook_url."""

from django.http import Http404
from django.shortcuts import render

from console.auth import page_view
from console.runbooks import RUNBOOKS


@page_view()
def runbook(request, alert):
    entry = RUNBOOKS.get(alert)
    if entry is None:
        raise Http404(f"No runbook for the alert {alert!r}.")
    return render(request, "console/runbook.html", {"alert": alert, "runbook": entry, "alerts": sorted(RUNBOOKS)})
