import os

import django
from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIHandler, ASGIRequest

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
django.setup(set_prefix=False)  # before anything that imports models


class SyncChainASGIHandler(ASGIHandler):
    """Django's ASGI handler, with the middleware chain and the view run as under WSGI: in one thread, in one hop
    from the event loop per request.

    In its async mode Django runs each middleware's process_request and process_response (MiddlewareMixin: every
    middleware of ours) in a thread hop of its own, and WhiteNoise, sync only, adds two: about fifteen hops between
    the event loop and a thread per request, which cost more than the heartbeat view itself (benchmarks/README.md,
    `console_scale`). Every view here is sync, so it runs in the same thread as before; an async one would be run
    by async_to_sync."""

    def load_middleware(self, is_async=False):
        super().load_middleware(is_async=False)

    async def get_response_async(self, request):
        return await sync_to_async(self.get_response, thread_sensitive=True)(request)


django_asgi_app = SyncChainASGIHandler()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.db import database_sync_to_async  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.core.exceptions import RequestAborted  # noqa: E402
from django.core.handlers.exception import convert_exception_to_response  # noqa: E402
from django.urls import path, re_path  # noqa: E402
from django.utils.log import log_response  # noqa: E402

from console import outage  # noqa: E402
from console.middleware import BodySizeLimit  # noqa: E402
from console.routing import websocket_urlpatterns  # noqa: E402
from recovery import urls as node_urls  # noqa: E402
from recovery import views as node_views  # noqa: E402
from recovery.stores import STORE_ERRORS, away  # noqa: E402


class NodeEndpoint:
    """POST /api/nodes/<name>/heartbeat, what every node sends every second, answered by its Django view
    (recovery.views.heartbeat) without the pages' middleware and request signals: no session, CSRF, messages or
    static files for a machine with a bearer token, and no thread of its own per request. At 256 heartbeats a second
    this is what lets one web process keep up (benchmarks/README.md, `console_scale`). Registration and
    deregistration go the same way: a fleet that starts or stops at once sends them all together, and a thread (and
    a database connection) for each ran PostgreSQL out of connections at 67 nodes.

    The view runs in database_sync_to_async's one thread, which closes stale database connections before and after
    as the request signals do. Anything but a POST goes to Django."""

    def __init__(self, django_app: ASGIHandler, view):
        self.django_app = django_app

        @convert_exception_to_response  # the 400 of a bad Host or body, the logged 500 of a failure: Django's answers
        def answer(request):
            request.get_host()  # a Host outside ALLOWED_HOSTS is refused, as CommonMiddleware refuses it
            try:
                return view(request, **request.scope["url_route"]["kwargs"])
            except STORE_ERRORS as exc:
                if not away(exc):
                    raise
                return outage.unavailable(request, exc)  # the node retries its beat; nothing to trace

        self.answer = answer

    async def __call__(self, scope, receive, send):
        if scope["method"] != "POST":
            await self.django_app(scope, receive, send)
            return
        try:
            body_file = await self.django_app.read_body(receive)
        except RequestAborted:
            return
        try:
            response = await self._respond(ASGIRequest(scope, body_file))
            await self.django_app.send_response(response, send)
        finally:
            body_file.close()

    @database_sync_to_async
    def _respond(self, request):
        response = self.answer(request)
        if response.status_code >= 400:
            log_response("%s: %s", response.reason_phrase, request.path, response=response, request=request)
        return response


application = ProtocolTypeRouter(
    {
        # A body over LIFELINE_MAX_BODY_BYTES is refused (413) before anything reads it (docs/security.md).
        "http": BodySizeLimit(
            URLRouter(
                [
                    path(node_urls.HEARTBEAT, NodeEndpoint(django_asgi_app, node_views.heartbeat)),
                    path(node_urls.REGISTER, NodeEndpoint(django_asgi_app, node_views.register)),
                    path(node_urls.DEREGISTER, NodeEndpoint(django_asgi_app, node_views.deregister)),
                    re_path(r"", django_asgi_app),
                ]
            )
        ),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
