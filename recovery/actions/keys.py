"""Gateway API keys: a tenant and a priority tier each. Created and revoked here, audited, published to every
gateway."""

from django.db import transaction
from django.utils import timezone

from recovery.actions import audit, routing
from recovery.choices import Tier
from recovery.models import ApiKey, key_digest


class KeyRefused(ValueError):
    """The key cannot be created as asked; the message names the field."""


def create_api_key(
    tenant: str, tier: str, label: str = "", *, actor: str = "system", created_by=None
) -> tuple[ApiKey, str]:
    """A new gateway key; the secret is returned once and only its digest is kept."""
    tenant, label = tenant.strip(), label.strip()
    if not tenant:
        raise KeyRefused("tenant: a key needs the tenant it bills to")
    if tier not in Tier.values:
        raise KeyRefused(f"tier: {tier!r} is not a tier: expected one of {', '.join(Tier.values)}")
    secret = ApiKey.new_secret()
    with transaction.atomic():
        row = ApiKey.objects.create(
            tenant=tenant, tier=tier, label=label, prefix=secret[:12], digest=key_digest(secret), created_by=created_by
        )
        audit.record(actor, "create_api_key", f"api_key:{row.prefix}", label, tenant=tenant, tier=tier)
        transaction.on_commit(routing.publish_gateway_keys)
    return row, secret


def revoke_api_key(key: ApiKey, *, actor: str = "system", reason: str = "") -> bool:
    """Revoke a gateway key; every gateway refuses it within a second. False when it already was."""
    with transaction.atomic():
        revoked = ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
        if revoked:
            audit.record(actor, "revoke_api_key", f"api_key:{key.prefix}", reason, tenant=key.tenant)
            transaction.on_commit(routing.publish_gateway_keys)
    return bool(revoked)
