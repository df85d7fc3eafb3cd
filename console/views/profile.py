"""One's own profile: who one is, and, for those told (on-call, admin), what one is told about and how."""

from django.contrib import messages
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache

from console.auth import page_view
from console.forms import NotificationRuleForm
from recovery import roles
from recovery.actions import notify
from recovery.models import NotificationRule


@never_cache
@page_view()
def profile(request):
    user, emailed = request.user, roles.has_role(request.user, roles.ONCALL)
    rule = NotificationRule.objects.filter(user=user).first()
    if request.method == "POST":
        if not emailed:
            reason = f"Only on-call engineers and admins are e-mailed; your role is {roles.role_of(user)}."
            return render(request, "console/forbidden.html", {"reason": reason}, status=403)
        form = NotificationRuleForm(request.POST)
        if form.is_valid():
            data = form.cleaned_data
            notify.set_rule(user, data["email"], data["kinds"], data["severities"], data["webhook_url"])
            messages.success(request, "Your notification rule is saved.")
            return redirect("profile")
        status = 400
    else:
        initial = (
            {"email": rule.email, "kinds": rule.kinds, "severities": rule.severities, "webhook_url": rule.webhook_url}
            if rule
            else {"email": True, "kinds": [], "severities": []}
        )
        form, status = NotificationRuleForm(initial=initial), 200
    context = {"form": form, "emailed": emailed, "rule": rule, "kinds": notify.KINDS}
    return render(request, "console/profile.html", context, status=status)
