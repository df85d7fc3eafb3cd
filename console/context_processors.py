"""What every page's template gets: the user's role, the degradation banner, the drains waiting for on-call."""

from console.readmodels import degradation, drains
from recovery import roles


def lifeline(request):
    user = getattr(request, "user", None)
    context = {"lifeline_role": roles.role_of(user)}
    if user is not None and user.is_authenticated:
        context["degradation"] = degradation.degradation()
        context["drains_waiting"] = drains.waiting_drains()
    return context
