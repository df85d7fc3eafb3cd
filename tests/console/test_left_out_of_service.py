"""Issue 11, "drains no one can bypass": a node left out of service with no drain open is flagged on the banner of
every page, naming it and linking to its page, and the banner hears of it live; a drain the health machine raised
is refused to the operator on the drain page, in words."""

import pytest
from channels.testing import WebsocketCommunicator

from recovery.actions import drains, health
from recovery.choices import Health
from recovery.models import AuditEntry, Drain
from tests.console.test_console import make_node

pytestmark = pytest.mark.django_db


def test_a_node_out_of_service_with_no_drain_is_flagged_on_the_banner(client, cast, commit):
    client.force_login(cast["operator"])
    node = make_node("node-07")
    make_node("node-08", "rack-b")
    banner = client.get("/degradation/?partial=banner").content.decode()
    assert "data-left-out" not in banner
    commit(health.set_health, node, Health.UNHEALTHY, "3 canary failures in a row")
    banner = client.get("/degradation/?partial=banner").content.decode()
    assert 'data-left-out="node-07" href="/nodes/node-07/"' in banner
    assert "node-07 out of service (UNHEALTHY), no drain" in banner and "node-08" not in banner

    drain = commit(drains.propose, node, source="health machine", reason="canaries failing")
    assert "data-left-out" not in client.get("/cluster/").content.decode()  # a drain is open: someone decides
    commit(drains.cancel, drain, cast["oncall"], "looking at it")
    page = client.get("/cluster/").content.decode()
    assert 'data-left-out="node-07"' in page and f"drain #{drain.pk} was cancelled" in page
    assert "it is proposed again at" in page
    left = client.get("/api/degradation").json()["left_out_of_service"]
    assert [(n["name"], n["why"], n["last_drain"]) for n in left] == [("node-07", "UNHEALTHY", drain.pk)]

    # Cordoned by a person, or its breaker open, with no drain: out of service too. A hot spare is not.
    node.refresh_from_db()
    commit(health.set_health, node, Health.HEALTHY, "canary passed")
    spare = make_node("node-09")
    commit(health.set_spare, spare, True, "oncall", "the pool")
    other = make_node("node-10")
    commit(health.set_cordon, other, True, "operator", "swapping a fan")
    assert [n["name"] for n in client.get("/api/degradation").json()["left_out_of_service"]] == ["node-10"]


@pytest.mark.django_db(transaction=True)
async def test_the_banner_hears_when_a_node_leaves_service_or_returns():
    from asgiref.sync import sync_to_async
    from django.db import connections

    from console.asgi import application
    from tests.console.test_consumers import make_user

    node = await sync_to_async(make_node)("node-11")
    ws = WebsocketCommunicator(
        application, "/ws/status/", headers=[(b"origin", b"http://127.0.0.1:8000"), (b"host", b"127.0.0.1:8000")]
    )
    ws.scope["user"] = await make_user("operator")
    connected, _ = await ws.connect()
    assert connected and (await ws.receive_json_from())["kind"] == "hello"
    await sync_to_async(health.set_health)(node, Health.UNHEALTHY, "3 canary failures in a row")
    assert await ws.receive_json_from(timeout=5) == {"kind": "service"}
    await ws.disconnect()
    await sync_to_async(connections.close_all)()


def test_an_operators_cancel_of_a_drain_the_system_raised_is_refused_on_the_drain_page(client, cast, commit):
    drain = commit(drains.propose, make_node("node-12"), source="health machine", reason="canaries failing")
    client.force_login(cast["operator"])
    page = client.get(f"/drains/{drain.pk}/").content.decode()
    assert 'id="cancel-form"' not in page
    assert "The health machine raised this drain: only the oncall and admin roles may withdraw it." in page
    refused = client.post(f"/drains/{drain.pk}/cancel", {"reason": "fans were fine"})
    assert refused.status_code == 403
    html = refused.content.decode()
    assert 'class="message error"' in html and "only the oncall and admin roles may withdraw it" in html
    assert 'id="drain-state" data-state="proposed"' in html  # the drain page itself, the drain still waiting
    assert Drain.objects.get(pk=drain.pk).state == "proposed"
    assert AuditEntry.objects.filter(action="drain_cancel_refused", actor="operator").exists()

    client.force_login(cast["oncall"])
    assert 'id="cancel-form"' in client.get(f"/drains/{drain.pk}/").content.decode()
    assert client.post(f"/drains/{drain.pk}/cancel", {"reason": "looking at it"}).status_code == 302
    assert Drain.objects.get(pk=drain.pk).state == "cancelled"
