"""What the web process answers while its database or Redis is away: a 503 that says so, not a stack trace.

The database is the system of record and Redis holds the hot state; either may restart or be cut off for a
while. Nothing the web process accepted is lost by that (a request either committed or was refused); the
caller gets 503 with Retry-After and a message naming what is away, and the log gets one line, not a traceback.
"""

import logging

from django.db import close_old_connections
from django.http import HttpResponse, JsonResponse
from django.template import loader

from recovery.stores import away, store_of

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5


def unavailable(request, exc: BaseException) -> HttpResponse:
    """The 503 for `request`, which failed because a store is away: JSON for the API and the nodes, else a page."""
    close_old_connections()  # a broken connection is not reused by the next request
    store = store_of(exc)
    reason = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0][:200]
    log.warning("%s %s: 503, the %s is unavailable (%s)", request.method, request.path, store, reason)
    message = (
        f"Lifeline's {store} is unavailable right now ({reason}); nothing was changed. Try again in a few seconds."
    )
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    if _wants_json(request):
        error = {"message": message, "type": "service_unavailable", "store": store}
        return JsonResponse({"error": error}, status=503, headers=headers)
    # Rendered without the request: the context processors read the database.
    html = loader.get_template("503.html").render({"store": store, "reason": reason})
    return HttpResponse(html, status=503, headers=headers)


def _wants_json(request) -> bool:
    return request.path.startswith("/api/") or "json" in request.headers.get("Accept", "")


class StoreOutageMiddleware:
    """Turn a view's lost database or Redis connection into the 503 above."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if away(exception):
            return unavailable(request, exception)
        return None
