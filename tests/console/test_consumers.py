"""The cluster WebSocket: frames for state changes and load, only for users with a role."""

import uuid

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser

from console.asgi import application
from recovery.actions import nodes
from workers.protocol import Heartbeat, Load, Registration

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
async def close_thread_connections():
    # database_sync_to_async runs in one worker thread; close its connection so the
    # test database can be dropped at the end of the run.
    yield
    from django.db import connections

    await database_sync_to_async(connections.close_all)()


def communicator(user):
    # Origin must be an allowed host, as a browser on the console would send.
    ws = WebsocketCommunicator(
        application, "/ws/cluster/", headers=[(b"origin", b"http://127.0.0.1:8000"), (b"host", b"127.0.0.1:8000")]
    )
    ws.scope["user"] = user
    return ws


@database_sync_to_async
def register(name):
    reg = Registration.parse(
        {
            "name": name,
            "session": uuid.uuid4().hex,
            "address": "http://127.0.0.1:9100",
            "rack": "rack-z",
            "model": "Qwen3-32B",
            "gpu": "H100-SXM",
            "tp": 1,
            "pid": 77,
            "host": "h",
            "gpus": [{"index": 0, "uuid": "GPU-0", "name": "H100", "memory_bytes": 80 * 10**9}],
        }
    )
    nodes.register_node(reg)
    return reg


@database_sync_to_async
def heartbeat(name, session):
    return nodes.record_heartbeat(name, Heartbeat(session=session, load=Load(running=2, waiting=7)))


@database_sync_to_async
def make_user(role):
    from console.actions import set_user_role

    return set_user_role(f"ws-{role}", role, password="long-password-1")


async def test_state_change_and_load_frames():
    ws = communicator(await make_user("operator"))
    connected, _ = await ws.connect()
    assert connected
    hello = await ws.receive_json_from()
    assert hello["kind"] == "hello" and hello["now"] > 0
    reg = await register("node-ws")
    frame = await ws.receive_json_from(timeout=5)
    assert (
        frame["kind"] == "node"
        and frame["name"] == "node-ws"
        and frame["state"] == "join"
        and frame["rack"] == "rack-z"
    )
    assert 'id="node-node-ws"' in frame["html"] and 'data-state="join"' in frame["html"]
    assert 'data-count="join">1<' in frame["summary"]
    await heartbeat("node-ws", reg.session)
    frames = [await ws.receive_json_from(timeout=5) for _ in range(2)]
    kinds = {f["kind"]: f for f in frames}
    assert kinds["node"]["state"] == "serving"
    (figures,) = kinds["loads"]["nodes"]
    assert figures["name"] == "node-ws" and figures["running"] == 2 and figures["waiting"] == 7
    await ws.disconnect()


async def test_anonymous_and_roleless_users_are_turned_away(django_user_model):
    ws = communicator(AnonymousUser())
    connected, code = await ws.connect()
    assert not connected and code == 4403
    user = await database_sync_to_async(django_user_model.objects.create_user)("plain", password="long-password-1")
    ws = communicator(user)
    connected, code = await ws.connect()
    assert not connected and code == 4403


@database_sync_to_async
def incident_with_events(name):
    from recovery.actions import incidents
    from recovery.choices import EventKind
    from recovery.models import Node

    node = Node.objects.get(name=name)
    incident = incidents.note_failure(node, None, "gateway gw-1", "stream broke")
    later = [
        incidents.add_event(incident, EventKind.DETECTED, f"{name} is DOWN", node=node),
        incidents.add_event(incident, EventKind.REMOVED, f"{name} removed", node=node),
    ]
    return incident, incident.events.order_by("pk").first(), later


async def test_an_incident_page_gets_what_was_written_before_it_subscribed():
    """Events written between the page's render and its subscription (a reaction a moment late) still reach it."""
    await register("node-inc")
    incident, first, later = await incident_with_events("node-inc")
    ws = WebsocketCommunicator(
        application,
        f"/ws/incidents/{incident.pk}/?after={first.pk}",
        headers=[(b"origin", b"http://127.0.0.1:8000"), (b"host", b"127.0.0.1:8000")],
    )
    ws.scope["user"] = await make_user("oncall")
    connected, _ = await ws.connect()
    assert connected
    assert (await ws.receive_json_from())["kind"] == "hello"
    frames = [await ws.receive_json_from(timeout=5) for _ in later]
    assert [f["id"] for f in frames] == [e.pk for e in later] and all(f["kind"] == "event" for f in frames)
    assert await ws.receive_nothing(timeout=0.2)  # the page already had the first: not sent again
    await ws.disconnect()


async def test_every_page_hears_of_each_drain_change():
    """The nav's drains-waiting count and the page title follow a drain that is proposed, approved or cancelled."""
    from asgiref.sync import sync_to_async

    from recovery import events

    ws = WebsocketCommunicator(
        application, "/ws/status/", headers=[(b"origin", b"http://127.0.0.1:8000"), (b"host", b"127.0.0.1:8000")]
    )
    ws.scope["user"] = await make_user("operator")
    connected, _ = await ws.connect()
    assert connected
    assert (await ws.receive_json_from())["kind"] == "hello"
    await sync_to_async(events.drain_changed)(42)
    assert await ws.receive_json_from(timeout=5) == {"kind": "drain", "id": 42}
    await ws.disconnect()
