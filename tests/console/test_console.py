"""The cluster page, /api/cluster, API tokens and roles."""

import io
import uuid

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from console.models import ApiToken
from recovery.actions import nodes, routing
from tests.conftest import ROLE_PASSWORD
from workers.protocol import Heartbeat, Load, Registration

pytestmark = pytest.mark.django_db


def make_node(name, rack="rack-a", serving=True):
    reg = Registration.parse(
        {
            "name": name,
            "session": uuid.uuid4().hex,
            "address": f"http://10.1.0.{len(name)}:8201",
            "rack": rack,
            "model": "Qwen3-32B",
            "gpu": "H200-SXM",
            "tp": 2,
            "pid": 1000 + len(name),
            "host": "h",
            "gpus": [
                {"index": i, "uuid": f"GPU-{name}-{i}", "name": "NVIDIA H200", "memory_bytes": 141 * 10**9}
                for i in range(2)
            ],
        }
    )
    node = nodes.register_node(reg)
    if serving:
        routing.sync_hot_state()
        nodes.record_heartbeat(
            name,
            Heartbeat(
                session=reg.session,
                load=Load(running=4, waiting=1, kv_blocks_used=50, kv_blocks_total=200, step_ms=12.5),
            ),
        )
    return node


def test_cluster_page_needs_a_login(client):
    response = client.get("/cluster/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_login_page_and_bad_password_message(client, cast):
    assert client.get("/login/").status_code == 200
    response = client.post("/login/", {"username": "operator", "password": "nope"})
    assert b"do not match" in response.content
    response = client.post("/login/", {"username": "operator", "password": ROLE_PASSWORD.format("operator")})
    assert response.status_code == 302 and response["Location"] == "/cluster/"


def test_cluster_page_shows_racks_nodes_gpus_and_load(client, cast, django_assert_max_num_queries):
    make_node("node-01", "rack-a")
    make_node("node-02", "rack-b")
    make_node("node-03", "rack-b", serving=False)
    client.force_login(cast["manager"])
    with django_assert_max_num_queries(13):  # constant in the fleet: no query per node (the banner: one for the levels)
        response = client.get("/cluster/")
    html = response.content.decode()
    assert response.status_code == 200
    assert html.index('data-rack="rack-a"') < html.index('data-rack="rack-b"')
    assert 'id="node-node-01"' in html and 'data-state="serving"' in html and 'data-state="join"' in html
    assert "GPU-node-02-1" in html  # GPUs listed per node
    assert '<dd data-field="running">4</dd>' in html
    assert '<dd data-field="running">n/a</dd>' in html  # a joining node reports no load yet: n/a, not 0
    partial = client.get("/cluster/?partial=racks").content.decode()
    assert "<html" not in partial and 'id="node-node-02"' in partial


def test_user_without_a_role_is_refused(client, django_user_model):
    user = django_user_model.objects.create_user("nobody", password="x-long-password")
    client.force_login(user)
    response = client.get("/cluster/")
    assert response.status_code == 403 and b"no Lifeline role" in response.content


def test_api_cluster_with_session_token_or_nothing(client, cast):
    make_node("node-01")
    assert client.get("/api/cluster").status_code == 401
    client.force_login(cast["operator"])
    body = client.get("/api/cluster").json()
    node = body["nodes"][0]
    assert {k: node[k] for k in ("name", "state", "rack", "model", "tp", "pid")} == {
        "name": "node-01",
        "state": "serving",
        "rack": "rack-a",
        "model": "Qwen3-32B",
        "tp": 2,
        "pid": 1007,
    }
    assert node["address"].startswith("http://") and len(node["gpus"]) == 2
    assert node["load"] == {"running": 4, "waiting": 1, "kv_used": 50, "kv_total": 200, "kv_pct": 25.0, "step_ms": 12.5}
    assert body["summary"]["by_state"]["serving"] == 1 and body["racks"][0]["name"] == "rack-a"
    client.logout()
    _, token = ApiToken.issue(cast["manager"])
    response = client.get("/api/cluster", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200 and response.json()["nodes"][0]["name"] == "node-01"
    response = client.get("/api/cluster", HTTP_AUTHORIZATION="Bearer llt_forged")
    assert response.status_code == 401 and "issue_token" in response.json()["error"]["message"]


def test_issue_token_prints_a_token_that_carries_the_users_role(client, cast):
    out = io.StringIO()
    call_command("issue_token", "oncall", stdout=out)
    token = out.getvalue().strip()
    assert token.startswith("llt_")
    user = ApiToken.authenticate(token)
    assert user.username == "oncall"
    from recovery import roles

    assert roles.role_of(user) == "oncall"
    row = ApiToken.objects.get(user=user)
    assert token not in (row.digest, row.prefix)  # only a digest is stored
    with pytest.raises(CommandError, match="no user 'ghost'"):
        call_command("issue_token", "ghost")


def test_role_checked_json_endpoint():
    # The decorator refuses a role not named, with the roles that would do.
    from django.test import RequestFactory

    from console.actions import set_user_role
    from console.auth import api_view

    @api_view("oncall")
    def approve(request):
        from django.http import JsonResponse

        return JsonResponse({"ok": True})

    factory = RequestFactory()
    request = factory.get("/x")
    request.user = set_user_role("op", "operator", password="p-long-password")
    response = approve(request)
    assert response.status_code == 403 and "needs oncall" in response.content.decode()
    request.user = set_user_role("oc", "oncall", password="p-long-password")
    assert approve(request).status_code == 200
    request.user = set_user_role("ad", "admin", password="p-long-password")
    assert approve(request).status_code == 200


def test_create_user_with_unknown_role_is_refused(cast):
    with pytest.raises(CommandError, match="unknown role 'root': expected one of operator, oncall, manager, admin"):
        call_command("create_user", "eve", "--role", "root", "--password", "x")
    out = io.StringIO()
    call_command("create_user", "ana", "--role", "oncall", "--password", "ana-password-1", stdout=out)
    assert out.getvalue().strip() == "ana: oncall"
    call_command("create_user", "ana", "--role", "manager", stdout=out)  # a role change replaces the old role
    from django.contrib.auth import get_user_model

    assert list(get_user_model().objects.get(username="ana").groups.values_list("name", flat=True)) == ["manager"]


def test_create_api_key_prints_a_key_the_gateway_will_accept(db):
    from recovery import hot
    from recovery.models import key_digest

    out = io.StringIO()
    call_command("create_api_key", "--tenant", "acme", "--tier", "premium", stdout=out)
    key = out.getvalue().strip()
    routing.publish_gateway_keys()
    assert key.startswith("llk_")
    stored = hot.client().hget(hot.keys().gateway_keys, key_digest(key))
    assert '"tenant": "acme"' in stored and '"tier": "premium"' in stored
    with pytest.raises(CommandError, match="tier: 'gold' is not a tier"):
        call_command("create_api_key", "--tenant", "acme", "--tier", "gold")


def test_healthz(client):
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json()["checks"] == {"database": "ok", "redis": "ok"}


def test_admins_create_and_revoke_gateway_keys(client, cast, django_capture_on_commit_callbacks):
    from recovery import hot
    from recovery.models import ApiKey, AuditEntry, key_digest

    client.force_login(cast["operator"])
    assert client.get("/keys/").status_code == 403
    client.force_login(cast["admin"])
    response = client.post("/keys/", {"tenant": "", "tier": "premium"})
    assert b"tenant: a key needs" in response.content
    response = client.post("/keys/", {"tenant": "acme", "tier": "platinum"})
    assert b"tier: &#x27;platinum&#x27; is not a tier" in response.content
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post("/keys/", {"tenant": "acme", "tier": "premium", "label": "chat app"})
    secret = response.context["created"]
    assert secret.startswith("llk_") and secret.encode() in response.content
    stored = hot.client().hget(hot.keys().gateway_keys, key_digest(secret))
    assert '"tier": "premium"' in stored
    key = ApiKey.objects.get(tenant="acme")
    assert secret not in client.get("/keys/").content.decode()  # shown once
    with django_capture_on_commit_callbacks(execute=True):
        client.post(f"/keys/{key.pk}/revoke")
    assert hot.client().hget(hot.keys().gateway_keys, key_digest(secret)) is None
    assert list(AuditEntry.objects.exclude(action="create_user").values_list("action", flat=True).order_by("at")) == [
        "create_api_key",
        "revoke_api_key",
    ]


def test_admins_restrict_a_tenant_to_trusted_providers_on_the_keys_page(
    client, cast, django_capture_on_commit_callbacks
):
    from recovery.actions import keys
    from recovery.models import ApiKey
    from tests.recovery.test_trusted_providers import serve

    with django_capture_on_commit_callbacks(execute=True):
        serve("kp-eu", provider="eu-cloud", region="eu-west")
    keys.create_api_key("eu-bank", "premium")
    client.force_login(cast["admin"])
    page = client.get("/keys/").content.decode()
    assert 'id="restrict-form"' in page and "any node" in page
    # A provider the fleet does not have: refused, the tenant named, nothing changed.
    response = client.post("/keys/restrict", {"tenant": "eu-bank", "providers": "us-cloud"}, follow=True)
    assert "tenant eu-bank would have no capacity at all" in response.content.decode()
    assert not ApiKey.objects.get(tenant="eu-bank").restricted
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            "/keys/restrict", {"tenant": "eu-bank", "regions": "eu-west", "reason": "residency"}, follow=True
        )
    assert "1 key(s) of eu-bank now served on region eu-west." in response.content.decode()
    assert ApiKey.objects.get(tenant="eu-bank").trusted_regions == ["eu-west"]
    # A key created with its restriction from the form.
    response = client.post("/keys/", {"tenant": "eu-insure", "tier": "standard", "providers": "eu-cloud"})
    assert response.status_code == 200 and ApiKey.objects.get(tenant="eu-insure").trusted_providers == ["eu-cloud"]
    assert "provider eu-cloud" in client.get("/keys/").content.decode()
