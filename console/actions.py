"""State changes of the console: users and their roles, audited like every other change."""

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction

from recovery import roles
from recovery.actions import audit


@transaction.atomic
def set_user_role(username: str, role: str, *, email: str = "", password: str | None = None, actor: str = "system"):
    """Create the user if needed and make `role` their only Lifeline role."""
    roles.check_role(role)
    user, created = get_user_model().objects.get_or_create(username=username, defaults={"email": email})
    if password is not None:
        user.set_password(password)
    if email:
        user.email = email
    # The admin role may do everything (recovery.roles), Django's admin site included: without the superuser flag
    # it would let them in and then show "You don't have permission to view or edit anything".
    user.is_staff = user.is_superuser = role == roles.ADMIN
    user.save(update_fields=["password", "email", "is_staff", "is_superuser"])
    groups = Group.objects.filter(name__in=roles.ROLES)
    user.groups.remove(*groups)
    user.groups.add(Group.objects.get_or_create(name=role)[0])
    audit.record(actor, "create_user" if created else "set_role", f"user:{username}", role=role)
    return user
