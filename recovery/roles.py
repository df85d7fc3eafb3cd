"""Roles: Django groups that decide who may do what.

operator  watches the cluster, reads incidents, injects faults on staging
oncall    everything an operator does, and approves or rejects drains
manager   reads the cluster and the SLA reports
admin     everything, plus settings, users and tokens

The control plane needs the names (whom to notify, who may decide a drain);
the console checks them at every door. Both read them here.
"""

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser

OPERATOR = "operator"
ONCALL = "oncall"
MANAGER = "manager"
ADMIN = "admin"

ROLES = (OPERATOR, ONCALL, MANAGER, ADMIN)
# When a user is in several groups, the strongest one is their role.
PRECEDENCE = (ADMIN, ONCALL, OPERATOR, MANAGER)


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
    role = next((name for name in PRECEDENCE if name in names), None)
    user._lifeline_role = role
    return role


def has_role(user, *roles: str) -> bool:
    """The admin role may do everything; any other role only what is named."""
    role = role_of(user)
    return role is not None and (role == ADMIN or role in roles)
