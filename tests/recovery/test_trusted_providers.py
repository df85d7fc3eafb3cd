"""Trusted providers (document 004), on the control plane: nodes register their provider and region, which reach
the registry and every gateway's routing table; API keys are restricted to providers or regions (one key, or every
key of a tenant), refused when that leaves the tenant no capacity, naming it; and the planner is told how much each
restricted tenant sends, so a plan keeps that much capacity where it trusts."""

import json
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from recovery import hot
from recovery.actions import keys, nodes, placement, routing
from recovery.choices import NodeState
from recovery.models import ApiKey, AuditEntry, Node, RequestOutcome
from workers.protocol import ProtocolError, Registration

pytestmark = pytest.mark.django_db


def registration(name, provider="", region="", model="Qwen3-32B", **extra) -> dict:
    return {
        "name": name,
        "session": uuid.uuid4().hex,
        "address": "http://127.0.0.1:9",
        "rack": extra.pop("rack", "rack-a"),
        "model": model,
        "gpu": "H100-SXM",
        "tp": 1,
        "pid": 1,
        "host": "h",
        "gpus": [{"index": 0, "uuid": f"GPU-{name}", "name": "H100", "memory_bytes": 80 * 10**9}],
        **({"provider": provider} if provider else {}),
        **({"region": region} if region else {}),
        **extra,
    }


def serve(name, provider="", region="", model="Qwen3-32B") -> Node:
    node = nodes.register_node(Registration.parse(registration(name, provider, region, model)))
    nodes.transition_node(node, NodeState.SERVING, "test")
    return node


def sent(tenant, model, count):
    now = timezone.now()
    for i in range(count):
        RequestOutcome.objects.create(
            request_id=f"{tenant}-{model}-{i}",
            gateway="gw",
            tenant=tenant,
            tier="premium",
            model_key=model,
            status="ok",
            started_at=now - timedelta(seconds=5),
            finished_at=now,
        )


def test_a_node_registers_its_provider_and_region_and_every_gateway_routes_by_them(commit):
    commit(serve, "tp-1", provider="eu-cloud", region="eu-west")
    row = Node.objects.get(name="tp-1")
    assert (row.provider, row.region) == ("eu-cloud", "eu-west")
    entry = json.loads(hot.client().hget(hot.keys().routing, "tp-1"))
    assert (entry["provider"], entry["region"]) == ("eu-cloud", "eu-west")
    # Optional, as the fabric fields are: a node that says nothing is at no named provider.
    assert Registration.parse(registration("tp-2")).provider == ""
    with pytest.raises(ProtocolError) as refused:
        Registration.parse(registration("tp-3", provider="eu cloud/1"))
    assert refused.value.field == "provider" and "not a valid name" in str(refused.value)


def test_a_restriction_that_leaves_the_tenant_no_node_is_refused_naming_the_tenant_and_what_the_fleet_has(commit):
    commit(serve, "tp-us", provider="us-cloud", region="us-east")
    with pytest.raises(keys.KeyRefused) as refused:
        keys.create_api_key("eu-bank", "premium", providers="eu-cloud")
    message = str(refused.value)
    assert "tenant eu-bank would have no capacity" in message and "provider eu-cloud" in message
    assert "us-cloud" in message and "us-east" in message  # what it could have named instead
    assert not ApiKey.objects.exists()
    with pytest.raises(keys.KeyRefused) as refused:
        keys.create_api_key("eu-bank", "premium", regions="eu west")
    assert "not a name a node registers" in str(refused.value)

    commit(serve, "tp-eu", provider="eu-cloud", region="eu-west")
    key, secret = commit(keys.create_api_key, "eu-bank", "premium", providers="eu-cloud, eu-cloud", regions="eu-west")
    assert (key.trusted_providers, key.trusted_regions) == (["eu-cloud"], ["eu-west"])
    assert key.trust_text() == "provider eu-cloud or region eu-west"
    entry = json.loads(hot.client().hget(hot.keys().gateway_keys, key.digest))
    assert (entry["providers"], entry["regions"]) == (["eu-cloud"], ["eu-west"])
    open_key, _ = commit(keys.create_api_key, "acme", "standard")
    assert "providers" not in json.loads(hot.client().hget(hot.keys().gateway_keys, open_key.digest))
    assert open_key.trust_text() == "any node"


def test_restricting_a_tenant_changes_every_key_of_it_unless_a_model_it_uses_has_no_trusted_node(commit):
    commit(serve, "tp-eu", provider="eu-cloud", region="eu-west", model="Qwen3-32B")
    commit(serve, "tp-us", provider="us-cloud", region="us-east", model="Llama-3-8B")
    first, _ = commit(keys.create_api_key, "eu-bank", "premium")
    second, _ = commit(keys.create_api_key, "eu-bank", "standard")
    other, _ = commit(keys.create_api_key, "acme", "standard")
    sent("eu-bank", "Llama-3-8B", 3)  # it uses a model that only us-cloud serves
    with pytest.raises(keys.KeyRefused) as refused:
        keys.restrict_tenant("eu-bank", "eu-cloud", "")
    assert "tenant eu-bank would have no capacity for Llama-3-8B" in str(refused.value)
    assert not ApiKey.objects.get(pk=first.pk).restricted

    RequestOutcome.objects.filter(tenant="eu-bank").delete()  # it no longer does
    assert commit(keys.restrict_tenant, "eu-bank", "eu-cloud", "", actor="admin", reason="GDPR") == 2
    assert {k.trust_text() for k in ApiKey.objects.filter(tenant="eu-bank")} == {"provider eu-cloud"}
    assert not ApiKey.objects.get(pk=other.pk).restricted
    audit = AuditEntry.objects.get(action="restrict_api_keys")
    assert (audit.actor, audit.target, audit.reason, audit.details["keys"]) == ("admin", "tenant:eu-bank", "GDPR", 2)
    assert json.loads(hot.client().hget(hot.keys().gateway_keys, second.digest))["providers"] == ["eu-cloud"]
    # A key made for the tenant now, its restriction left blank, is restricted as its others are.
    third, _ = commit(keys.create_api_key, "eu-bank", "standard")
    assert third.trust_text() == "provider eu-cloud"
    # Both lists empty lifts it.
    assert commit(keys.restrict_tenant, "eu-bank", "", "") == 3
    assert "providers" not in json.loads(hot.client().hget(hot.keys().gateway_keys, second.digest))
    with pytest.raises(keys.KeyRefused, match="'nobody' has no active key"):
        keys.restrict_tenant("nobody", "eu-cloud", "")


def test_the_planner_is_told_each_restricted_tenants_rate_and_keeps_that_much_capacity_where_it_trusts(commit):
    commit(serve, "tp-eu", provider="eu-cloud", region="eu-west")
    commit(serve, "tp-us", provider="us-cloud", region="us-east")
    commit(keys.create_api_key, "eu-bank", "premium", regions="eu-west")
    commit(keys.create_api_key, "acme", "standard")
    sent("eu-bank", "Qwen3-32B", 90)  # 0.1 req/s over the planner's 15-minute window
    sent("acme", "Qwen3-32B", 900)

    (restriction,) = placement.restrictions()["Qwen3-32B"]
    assert (restriction.tenant, restriction.rps, restriction.regions) == ("eu-bank", 0.1, frozenset({"eu-west"}))
    servers, _ = placement.live_fleet()
    assert {(s.name, s.provider, s.region) for s in servers} == {
        ("tp-eu", "eu-cloud", "eu-west"),
        ("tp-us", "us-cloud", "us-east"),
    }
    plan = placement.propose(evaluate=False)
    (demand,) = plan["demands"]
    assert demand["restrictions"] == [
        {"tenant": "eu-bank", "rps": 0.1, "providers": [], "regions": ["eu-west"]}
    ]  # JSON, as the proposal keeps it
    trusted = plan["proposed"]["trusted_rps"]["eu-bank on Qwen3-32B"]
    assert trusted >= 0.1 and trusted == plan["current"]["trusted_rps"]["eu-bank on Qwen3-32B"]
    assert not [p for p in plan["problems"] if "eu-bank" in p]


def test_routing_entries_and_keys_published_together_after_a_redis_loss_keep_the_restriction(commit):
    commit(serve, "tp-eu", provider="eu-cloud", region="eu-west")
    key, _ = commit(keys.create_api_key, "eu-bank", "premium", providers="eu-cloud")
    hot.client().delete(hot.keys().gateway_keys, hot.keys().routing)
    routing.sync_hot_state()
    assert json.loads(hot.client().hget(hot.keys().gateway_keys, key.digest))["providers"] == ["eu-cloud"]
    assert json.loads(hot.client().hget(hot.keys().routing, "tp-eu"))["provider"] == "eu-cloud"
