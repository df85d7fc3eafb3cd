"""Roles: Django groups that decide who may do what.

operator  watches the cluster, reads incidents, injects faults on staging
oncall    everything an operator does, and approves or rejects drains
manager   reads the cluster and the SLA reports
admin     everything, plus settings, users and tokens
"""

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser

OPERATOR = "operator"
ONCALL = "oncall"
MANAGER = "manager"
ADMIN = "admin"

ROLES = (OPERATOR, ONCALL, MANAGER, ADMIN)
# When a user is in several groups, the strongest one is their role.
_PRECEDENCE = (ADMIN, ONCALL, OPERATOR, MANAGER)

ROLE_DESCRIPTIONS = {
    OPERATOR: "watches the cluster, reads incidents, rehearses faults",
    ONCALL: "approves or rejects drains, runs incidents",
    MANAGER: "reads SLA reports",
    ADMIN: "settings, users and tokens",
}


class UnknownRole(ValueError):
    def __init__(self, role: str):
        super().__init__(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")


def check_role(role: str) -> str:
    if role not in ROLES:
        raise UnknownRole(role)
    return role


def role_of(user: AbstractBaseUser | AnonymousUser | None) -> str | None:
    """The user's role, or None for anonymous users and users with no role."""
    if user is None or not user.is_authenticated:
        return None
    if user.is_superuser:
        return ADMIN
    cached = getattr(user, "_lifeline_role", False)
    if cached is not False:
        return cached
    names = set(user.groups.values_list("name", flat=True))
    role = next((name for name in _PRECEDENCE if name in names), None)
    user._lifeline_role = role
    return role


def has_role(user, *roles: str) -> bool:
    role = role_of(user)
    return role is not None and (role == ADMIN or role in roles)


def context_processor(request):
    """The role, and for a logged-in user the degradation banner and the drains waiting for on-call."""
    user = getattr(request, "user", None)
    context = {"lifeline_role": role_of(user)}
    if user is not None and user.is_authenticated:
        from console import operations

        context["degradation"] = operations.degradation()
        context["drains_waiting"] = operations.waiting_drains()
    return context
