"""The checkpoint distribution, live: the page, the partial its socket's pushes fetch, and the JSON API."""

from django.http import HttpResponse, JsonResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.views.decorators.cache import never_cache

from console.auth import api_view, page_view
from console.readmodels import checkpoints as checkpoint_model
from console.views import allow

FRAGMENT = "console/_checkpoints.html"  # one fragment: the page includes it, the partial and each push refresh it


@never_cache
@page_view()
def checkpoints(request):
    snapshot = checkpoint_model.checkpoint_snapshot()
    if request.GET.get("partial"):
        # Every open page fetches this at each push: the fragment alone, without the banner's context processors.
        return HttpResponse(render_to_string(FRAGMENT, {"snapshot": snapshot}))
    return render(request, "console/checkpoints.html", {"snapshot": snapshot})


@api_view()
@allow("GET")
def api_checkpoints(request):
    return JsonResponse(checkpoint_model.checkpoint_snapshot())
