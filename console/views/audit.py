"""The audit log page: every audited action, filtered by who, what and when."""

from django.shortcuts import render
from django.views.decorators.cache import never_cache

from console.auth import READ_AUDIT, page_view
from console.forms import AuditFilterForm
from console.readmodels import audit as audit_model


@never_cache
@page_view(*READ_AUDIT)
def audit_log(request):
    form = AuditFilterForm(request.GET or None, actions=audit_model.actions())
    filters = form.cleaned_data if form.is_bound and form.is_valid() else {}
    return render(
        request,
        "console/audit.html",
        {
            "form": form,
            "entries": audit_model.entries(**filters) if not form.errors else [],
            "actors": audit_model.actors(),
            "limit": audit_model.LIMIT,
        },
        status=400 if form.errors else 200,
    )
