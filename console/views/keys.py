"""Gateway API keys (admin): create and revoke, through the same action as `manage.py create_api_key`."""

from django.contrib import messages
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from console.auth import page_view
from recovery import roles
from recovery.actions import keys
from recovery.choices import Tier
from recovery.models import ApiKey


@never_cache
@page_view(roles.ADMIN)
def api_keys(request):
    """Gateway keys: a tenant and a priority tier each."""
    created, status = None, 200
    if request.method == "POST":
        try:
            _, created = keys.create_api_key(
                request.POST.get("tenant", ""),
                request.POST.get("tier", ""),
                request.POST.get("label", ""),
                providers=request.POST.get("providers", ""),
                regions=request.POST.get("regions", ""),
                actor=request.user.get_username(),
                created_by=request.user,
            )
        except keys.KeyRefused as exc:
            messages.error(request, f"{exc}.")
            status = 400  # the form is shown again with what was wrong, as every console form answers bad input
    rows = ApiKey.objects.select_related("created_by").order_by("revoked_at", "tenant", "-created_at")
    context = {"keys": rows, "created": created, "tiers": Tier.choices}
    return render(request, "console/keys.html", context, status=status)


@require_POST
@page_view(roles.ADMIN)
def restrict_keys(request):
    """Restrict every active key of a tenant to trusted providers or regions (data residency), or lift it."""
    tenant = request.POST.get("tenant", "")
    try:
        changed = keys.restrict_tenant(
            tenant,
            request.POST.get("providers", ""),
            request.POST.get("regions", ""),
            actor=request.user.get_username(),
            reason=request.POST.get("reason", ""),
        )
    except keys.KeyRefused as exc:
        messages.error(request, f"{exc}.")
    else:
        shown = ApiKey.objects.filter(tenant=tenant.strip(), revoked_at__isnull=True).first().trust_text()
        messages.success(request, f"{changed} key(s) of {tenant.strip()} now served on {shown}.")
    return redirect("keys")


@require_POST
@page_view(roles.ADMIN)
def revoke_key(request, key_id: int):
    key = get_object_or_404(ApiKey, pk=key_id)
    if keys.revoke_api_key(key, actor=request.user.get_username(), reason=request.POST.get("reason", "")):
        messages.success(request, f"Key {key.prefix}… of {key.tenant} revoked: the gateways refuse it from now on.")
    else:
        messages.info(request, f"Key {key.prefix}… was already revoked.")
    return redirect("keys")
