"""The checkpoint distribution, live."""

from django.http import JsonResponse
from django.shortcuts import render
from django.views.decorators.cache import never_cache

from console.auth import api_view, page_view
from console.readmodels import checkpoints as checkpoint_model


@never_cache
@page_view()
def checkpoints(request):
    snapshot = checkpoint_model.checkpoint_snapshot()
    template = "console/_checkpoints.html" if request.GET.get("partial") else "console/checkpoints.html"
    return render(request, template, {"snapshot": snapshot})


@api_view()
def api_checkpoints(request):
    return JsonResponse(checkpoint_model.checkpoint_snapshot())
