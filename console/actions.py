"""State changes of the console: users and their roles."""

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction

from console import roles


@transaction.atomic
def set_user_role(username: str, role: str, *, email: str = "", password: str | None = None):
    """Create the user if needed and make `role` their only Lifeline role."""
    roles.check_role(role)
    user, _ = get_user_model().objects.get_or_create(username=username, defaults={"email": email})
    if password is not None:
        user.set_password(password)
    user.is_staff = role == roles.ADMIN  # admins may use Django's admin site
    user.save()
    groups = Group.objects.filter(name__in=roles.ROLES)
    user.groups.remove(*groups)
    user.groups.add(Group.objects.get(name=role))
    return user
