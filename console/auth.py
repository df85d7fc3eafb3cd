"""Who may do what, and the doors that check it: pages (a session), JSON endpoints (a session or an API token).

The roles named for each kind of act are here, in one place; the admin role may do everything.
"""

import functools
import hashlib
import time

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.core.cache import cache
from django.dispatch import receiver
from django.middleware.csrf import CsrfViewMiddleware
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt

from console.models import ApiToken
from recovery import roles
from recovery.actions import audit, drains
from recovery.http import bearer_token
from recovery.http import json_error as error

ACT_ON_NODES = (roles.OPERATOR, roles.ONCALL)  # cordon, migrate, acknowledge and annotate incidents
INJECT_FAULTS = (roles.OPERATOR,)  # on a staging cluster
CLOSE_INCIDENTS = (roles.ONCALL,)
RECEIVE_ALERTS = (roles.OPERATOR, roles.ONCALL)  # Alertmanager's webhook, with the API token of such a user
REQUEST_DRAINS = drains.REQUEST
DECIDE_DRAINS = drains.DECIDE
MANAGE_SPARES = (roles.ONCALL,)
READ_AUDIT = (roles.ONCALL, roles.MANAGER)  # who did what: on-call while on duty, managers after
READ_SLO = (roles.MANAGER, roles.ONCALL, roles.OPERATOR)  # objectives and budgets; only admins edit them
# Experiments: operators rehearse failures, managers plan capacity; on-call reads them (its hands are on the fleet).
RUN_EXPERIMENTS = (roles.OPERATOR, roles.MANAGER)
READ_EXPERIMENTS = (roles.OPERATOR, roles.MANAGER, roles.ONCALL)


def api_view(*allowed_roles: str):
    """A JSON endpoint open to a logged-in session or an API token.

    With no roles named, any user with a Lifeline role may call it; otherwise
    only those roles (and admin). Token requests skip CSRF: they carry no cookie.
    """

    def decorator(view):
        @csrf_exempt
        @functools.wraps(view)
        def wrapper(request, *args, **kwargs):
            token = bearer_token(request)
            if token is not None:
                user = ApiToken.authenticate(token)
                if user is None:
                    return error(
                        401,
                        "The API token is unknown or revoked: make a new one with `python manage.py issue_token USER`.",
                    )
                request.user = user
            elif not request.user.is_authenticated:
                return error(401, "Authentication required: log in, or send `Authorization: Bearer <token>`.")
            elif request.method not in ("GET", "HEAD", "OPTIONS"):
                # A session request that changes state must pass the CSRF check.
                reason = CsrfViewMiddleware(lambda r: None).process_view(request, None, (), {})
                if reason is not None:
                    return error(403, "CSRF check failed: send the csrftoken cookie's value in X-CSRFToken.")
            role = roles.role_of(request.user)
            if role is None:
                return error(
                    403,
                    f"User {request.user.get_username()!r} has no Lifeline role: "
                    f"an admin must give them one of {', '.join(roles.ROLES)}.",
                )
            if allowed_roles and not roles.has_role(request.user, *allowed_roles):
                return error(403, f"Role {role!r} may not do this: it needs {' or '.join(allowed_roles)}.")
            return view(request, *args, **kwargs)

        return wrapper

    return decorator


def page_view(*allowed_roles: str):
    """A console page: login required, then a role (any role when none is named)."""

    def decorator(view):
        @login_required
        @functools.wraps(view)
        def wrapper(request, *args, **kwargs):
            if not roles.has_role(request.user, *(allowed_roles or roles.ROLES)):
                role = roles.role_of(request.user)
                reason = (
                    f"Your account has no Lifeline role. An admin must give it one of: {', '.join(roles.ROLES)}."
                    if role is None
                    else f"This page needs the {' or '.join(allowed_roles)} role; yours is {role}."
                )
                return render(request, "console/forbidden.html", {"reason": reason}, status=403)
            return view(request, *args, **kwargs)

        return wrapper

    return decorator


# --- Log-in failures: counted per user name and address, audited, and refused past the limit -------------------------


def client_address(request) -> str:
    """The caller's address: behind the TLS proxy (settings.SECURE_PROXY_SSL_HEADER set) the last hop the proxy added
    to X-Forwarded-For, since REMOTE_ADDR is the proxy's; otherwise REMOTE_ADDR."""
    if getattr(settings, "SECURE_PROXY_SSL_HEADER", None):
        forwarded = [hop.strip() for hop in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if hop.strip()]
        if forwarded:
            return forwarded[-1][:64]
    return request.META.get("REMOTE_ADDR", "")[:64]


def _failures_key(username: str, address: str) -> str:
    # Hashed: the user name is what the caller typed, of any length and any characters.
    return "login-failures:" + hashlib.sha256(f"{username.strip().lower()}\0{address}".encode()).hexdigest()


def login_blocked_for(username: str, address: str) -> float:
    """Seconds until this user name may try again from this address; 0 when it may now."""
    entry = cache.get(_failures_key(username, address))
    if not entry or entry["count"] < settings.LIFELINE_LOGIN_MAX_FAILURES:
        return 0.0
    return max(entry["until"] - time.time(), 0.0)


def _count_failure(username: str, address: str) -> int:
    key, window = _failures_key(username, address), settings.LIFELINE_LOGIN_WINDOW_S
    entry = cache.get(key) or {"count": 0}
    # The window restarts with each failure: a patient guesser stays locked out, not one try per window.
    entry = {"count": entry["count"] + 1, "until": time.time() + window}
    cache.set(key, entry, timeout=window)
    return entry["count"]


@receiver(user_login_failed, dispatch_uid="lifeline-login-failed")
def record_login_failure(sender, credentials, request=None, **kwargs):
    """Every failed log-in, through the console's form or the admin site's, is counted and audited."""
    username = str(credentials.get("username", ""))[:150]
    address = client_address(request) if request is not None else ""
    failures = _count_failure(username, address)
    audit.record(username or "anonymous", "login_failed", f"user:{username}"[:200], address=address, failures=failures)


@receiver(user_logged_in, dispatch_uid="lifeline-logged-in")
def forget_login_failures(sender, request=None, user=None, **kwargs):
    if request is not None and user is not None:
        cache.delete(_failures_key(user.get_username(), client_address(request)))


def audit_login_refused(request, username: str) -> None:
    audit.record(
        username[:150] or "anonymous",
        "login_throttled",
        f"user:{username}"[:200],
        address=client_address(request),
    )
