"""What every page's template gets: the user's role and what it may open, the degradation banner, the drains waiting
for on-call."""

from django.conf import settings

from console.auth import READ_AUDIT
from console.readmodels import degradation, drains
from recovery import roles


def lifeline(request):
    user = getattr(request, "user", None)
    context = {"lifeline_role": roles.role_of(user)}
    if settings.LIFELINE_OIDC:
        context["sso_provider"] = settings.LIFELINE_OIDC_PROVIDER_NAME
    if user is not None and user.is_authenticated:
        context["can_read_audit"] = roles.has_role(user, *READ_AUDIT)
        context["degradation"] = degradation.degradation()
        waiting = drains.waiting_drains()
        context["drains_waiting"] = len(waiting)
        context["drain_waiting_first"] = waiting[0] if waiting else None
    return context
