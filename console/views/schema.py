"""`/api/schema`: the OpenAPI 3 documents of the console's JSON API and of the other HTTP surfaces (console.openapi)."""

from django.http import JsonResponse
from django.views.decorators.cache import cache_control

from console import openapi
from console.views import allow
from recovery.http import json_error


@cache_control(max_age=300, public=True)
@allow("GET")
def api_schema(request):
    """Anonymous, as a document of an API is: it names no secret and no figure of the fleet."""
    surface = request.GET.get("surface") or "console"
    if surface not in openapi.SURFACES:
        return json_error(
            400,
            f"surface: {surface!r} is not a document here; use one of {', '.join(openapi.SURFACES)}.",
            field="surface",
        )
    return JsonResponse(openapi.surface(surface))
