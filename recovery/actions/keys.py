"""Gateway API keys: a tenant and a priority tier each, and optionally the providers or regions its requests must
stay within (document 004's trusted providers, for data residency). Created, restricted and revoked here, audited,
published to every gateway."""

import re
from collections.abc import Iterable
from datetime import timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from recovery.actions import audit, routing
from recovery.choices import NodeState, Tier
from recovery.models import ApiKey, Node, RequestOutcome, key_digest

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")  # as a node registers its provider and region
USED_S = 3600  # a tenant's models: those it sent requests for within this long


class KeyRefused(ValueError):
    """The key cannot be created or changed as asked; the message names the field."""


def names(raw: str | Iterable[str], field: str) -> list[str]:
    """Provider or region names from a list or a comma-separated string, checked, deduplicated, sorted."""
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    cleaned = sorted({str(item).strip() for item in items if str(item).strip()})
    for name in cleaned:
        if not NAME.match(name):
            raise KeyRefused(
                f"{field}: {name!r} is not a name a node registers: letters, digits, '.', '_' or '-', at most 63"
            )
    return cleaned


def check_trusted_capacity(tenant: str, providers: list[str], regions: list[str]) -> None:
    """Refuse a restriction that leaves `tenant` with no capacity: no node of the fleet in the trusted providers or
    regions, or none for a model the tenant has sent requests for in the last hour."""
    if not providers and not regions:
        return
    fleet = Node.objects.exclude(state=NodeState.LEFT).filter(spare=False)
    trusted = fleet.filter(Q(provider__in=providers) | Q(region__in=regions))
    wanted = ApiKey(trusted_providers=providers, trusted_regions=regions).trust_text()
    if not trusted.exists():
        have_p = sorted(set(fleet.exclude(provider="").values_list("provider", flat=True))) or ["none said"]
        have_r = sorted(set(fleet.exclude(region="").values_list("region", flat=True))) or ["none said"]
        raise KeyRefused(
            f"trusted providers and regions: tenant {tenant} would have no capacity at all: no node of the fleet runs "
            f"at {wanted} (its nodes' providers: {', '.join(have_p)}; regions: {', '.join(have_r)}). Name one the "
            "fleet has, or register nodes there first"
        )
    since = timezone.now() - timedelta(seconds=USED_S)
    used = set(RequestOutcome.objects.filter(tenant=tenant, finished_at__gte=since).values_list("model_key", flat=True))
    left_out = sorted(used - set(trusted.values_list("model_key", flat=True)))
    if left_out:
        raise KeyRefused(
            f"trusted providers and regions: tenant {tenant} would have no capacity for {', '.join(left_out)}, which "
            f"it sent requests for in the last hour: no node of {', '.join(left_out)} runs at {wanted}"
        )


def create_api_key(
    tenant: str,
    tier: str,
    label: str = "",
    *,
    providers: str | Iterable[str] = (),
    regions: str | Iterable[str] = (),
    actor: str = "system",
    created_by=None,
) -> tuple[ApiKey, str]:
    """A new gateway key; the secret is returned once and only its digest is kept.

    A tenant restricted already (one of its active keys is) gets its new key restricted the same way unless other
    providers or regions are given: a new key never widens where a tenant's data may go by being left blank. To
    lift a tenant's restriction, `restrict_tenant` with both lists empty."""
    tenant, label = tenant.strip(), label.strip()
    if not tenant:
        raise KeyRefused("tenant: a key needs the tenant it bills to")
    if tier not in Tier.values:
        raise KeyRefused(f"tier: {tier!r} is not a tier: expected one of {', '.join(Tier.values)}")
    providers, regions = names(providers, "trusted providers"), names(regions, "trusted regions")
    if not providers and not regions:
        restricted = next(
            (k for k in ApiKey.objects.filter(tenant=tenant, revoked_at__isnull=True) if k.restricted), None
        )
        if restricted is not None:
            providers, regions = restricted.trusted_providers, restricted.trusted_regions
    check_trusted_capacity(tenant, providers, regions)
    secret = ApiKey.new_secret()
    with transaction.atomic():
        row = ApiKey.objects.create(
            tenant=tenant,
            tier=tier,
            label=label,
            prefix=secret[:12],
            digest=key_digest(secret),
            created_by=created_by,
            trusted_providers=providers,
            trusted_regions=regions,
        )
        audit.record(
            actor, "create_api_key", f"api_key:{row.prefix}", label, tenant=tenant, tier=tier, trust=row.trust_text()
        )
        transaction.on_commit(routing.publish_gateway_keys)
    return row, secret


def restrict_tenant(
    tenant: str,
    providers: str | Iterable[str],
    regions: str | Iterable[str],
    *,
    actor: str = "system",
    reason: str = "",
) -> int:
    """Restrict every active key of `tenant` to `providers` or `regions` (both empty: lift the restriction);
    the gateways apply it within a second. Returns how many keys changed."""
    tenant = tenant.strip()
    providers, regions = names(providers, "trusted providers"), names(regions, "trusted regions")
    keys = ApiKey.objects.filter(tenant=tenant, revoked_at__isnull=True)
    if not keys.exists():
        raise KeyRefused(f"tenant: {tenant!r} has no active key to restrict")
    check_trusted_capacity(tenant, providers, regions)
    with transaction.atomic():
        changed = keys.update(trusted_providers=providers, trusted_regions=regions)
        shown = ApiKey(trusted_providers=providers, trusted_regions=regions).trust_text()
        audit.record(actor, "restrict_api_keys", f"tenant:{tenant}", reason, keys=changed, trust=shown)
        transaction.on_commit(routing.publish_gateway_keys)
    return changed


def revoke_api_key(key: ApiKey, *, actor: str = "system", reason: str = "") -> bool:
    """Revoke a gateway key; every gateway refuses it within a second. False when it already was."""
    with transaction.atomic():
        revoked = ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
        if revoked:
            audit.record(actor, "revoke_api_key", f"api_key:{key.prefix}", reason, tenant=key.tenant)
            transaction.on_commit(routing.publish_gateway_keys)
    return bool(revoked)
