"""Doors in front of every view: the request body's size (ASGI, before Django reads it) and the log-in rate limit.

docs/security.md says why each is here.
"""

import json

from django.conf import settings
from django.contrib.auth.forms import AuthenticationForm
from django.shortcuts import render
from django.urls import reverse

from console import auth, outage
from recovery.stores import STORE_ERRORS, away


class BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """ASGI middleware: a request whose body is over settings.LIFELINE_MAX_BODY_BYTES is answered 413 with a JSON
    error, before the body is read when its Content-Length says so, and as soon as the limit is passed when it is
    streamed without one (chunked). Django would otherwise spool the whole body to a temporary file first, the node
    endpoints included, and only then refuse it."""

    def __init__(self, app, max_bytes: int | None = None):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes or settings.LIFELINE_MAX_BODY_BYTES
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                await _refuse(send, 400, "The Content-Length header is not a number of bytes.")
                return
            if int(length) > limit:
                await _refuse(send, 413, _too_large(limit))
                return
        received = 0
        started = False

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge
            return message

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await _refuse(send, 413, _too_large(limit))


def _too_large(limit: int) -> str:
    return (
        f"The request body is larger than {limit} bytes, the most any endpoint takes "
        "(LIFELINE_MAX_BODY_BYTES): send less."
    )


async def _refuse(send, status: int, message: str) -> None:
    body = json.dumps({"error": {"status": status, "message": message}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class LoginRateLimit:
    """Refuse a log-in attempt (the console's and the admin site's) for a user name and address that has failed too
    often lately: 429 with the form and a message that says for how long. Failures are counted and audited by
    console.auth's receiver of Django's user_login_failed signal, whatever door the attempt came through."""

    def __init__(self, get_response):
        self.get_response = get_response
        self.paths = None

    def __call__(self, request):
        if request.method == "POST":
            if self.paths is None:
                self.paths = {reverse("login"), reverse("admin:login")}
            if request.path in self.paths:
                username = request.POST.get("username", "")
                try:
                    wait_s = auth.login_blocked_for(username, auth.client_address(request))
                except STORE_ERRORS as exc:
                    if not away(exc):
                        raise
                    return outage.unavailable(request, exc)  # no log-in unthrottled while the counters are away
                if wait_s:
                    auth.audit_login_refused(request, username)
                    minutes = max(1, round(wait_s / 60))
                    context = {
                        "form": AuthenticationForm(request, initial={"username": username}),
                        "throttled": (
                            f"Too many failed log-ins for {username!r} from your address: try again in "
                            f"{minutes} minute{'s' if minutes != 1 else ''}, or ask an admin to reset the password."
                        ),
                        "next": request.POST.get("next", ""),
                    }
                    response = render(request, "registration/login.html", context, status=429)
                    response["Retry-After"] = str(int(wait_s))
                    return response
        return self.get_response(request)
