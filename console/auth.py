"""Who may do what, and the doors that check it: pages (a session), JSON endpoints (a session or an API token).

The roles named for each kind of act are here, in one place; the admin role may do everything.
"""

import functools

from django.contrib.auth.decorators import login_required
from django.middleware.csrf import CsrfViewMiddleware
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt

from console.models import ApiToken
from recovery import roles
from recovery.actions import drains
from recovery.http import bearer_token
from recovery.http import json_error as error

ACT_ON_NODES = (roles.OPERATOR, roles.ONCALL)  # cordon, migrate, acknowledge and annotate incidents
INJECT_FAULTS = (roles.OPERATOR,)  # on a staging cluster
CLOSE_INCIDENTS = (roles.ONCALL,)
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
