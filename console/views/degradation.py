"""The degradation level: its page with the history, the banner's partial, and the JSON."""

from django.http import JsonResponse
from django.shortcuts import render
from django.views.decorators.cache import never_cache

from console.auth import api_view, page_view
from console.readmodels import degradation as degradation_model
from console.views import allow
from recovery.actions import capacity


@never_cache
@page_view()
def degradation_page(request):
    if request.GET.get("partial") == "banner":
        return render(request, "console/_banner.html")
    return render(
        request,
        "console/degradation.html",
        {"history": degradation_model.degradation_history(), "banner": degradation_model.degradation()},
    )


@api_view()
@allow("GET")
def api_degradation(request):
    return JsonResponse(
        {
            **degradation_model.degradation(),
            "history": degradation_model.degradation_history(),
            "report": capacity.report().to_json(),
        }
    )
