"""The web process answers a node's heartbeat before Django's middleware (console.asgi.NodeEndpoint), with the same
view: every answer the same as through Django's whole request handling, errors included."""

import json
import uuid

import pytest
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.testing import HttpCommunicator
from django.conf import settings
from django.test import Client

from console.asgi import application
from recovery import hot
from recovery.actions import nodes
from workers.protocol import Registration

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
async def close_thread_connections():
    yield
    from django.db import connections

    await database_sync_to_async(connections.close_all)()


@database_sync_to_async
def register(name: str) -> str:
    session = uuid.uuid4().hex
    nodes.register_node(
        Registration.parse(
            {
                "name": name,
                "session": session,
                "address": "http://127.0.0.1:9100",
                "rack": "rack-a",
                "model": "Qwen3-32B",
                "gpu": "H100-SXM",
                "tp": 1,
                "pid": 7,
                "host": "h",
                "gpus": [{"index": 0, "uuid": f"GPU-{name}", "name": "H100", "memory_bytes": 80 * 10**9}],
            }
        )
    )
    return session


async def through_asgi(path: str, body: bytes, token: str | None, host: str = "127.0.0.1:8000", method="POST"):
    headers = [(b"host", host.encode()), (b"content-type", b"application/json")]
    if token is not None:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    communicator = HttpCommunicator(application, method, path, body=body, headers=headers)
    response = await communicator.get_response(timeout=10)
    is_json = (b"Content-Type", b"application/json") in response["headers"]
    return response["status"], json.loads(response["body"]) if is_json else response["body"].decode()


@sync_to_async
def through_django(path: str, body: bytes, token: str | None, host: str = "127.0.0.1:8000", method="POST"):
    extra = {"HTTP_HOST": host}
    if token is not None:
        extra["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    client = Client()
    send = client.post if method == "POST" else client.get
    response = send(path, body, content_type="application/json", **extra) if method == "POST" else send(path, **extra)
    is_json = response.get("Content-Type") == "application/json"
    return response.status_code, response.json() if is_json else response.content.decode()


def beat(session: str, **load) -> bytes:
    return json.dumps(
        {"session": session, "model_state": "serving", "load": {"running": 4, "waiting": 1, **load}}
    ).encode()


async def test_a_heartbeat_is_answered_and_recorded_as_by_the_django_view():
    session = await register("node-a")
    token = settings.LIFELINE_NODE_TOKEN
    status, answer = await through_asgi("/api/nodes/node-a/heartbeat", beat(session), token)
    assert (status, answer) == (200, {"name": "node-a", "state": "serving"})
    entry = await sync_to_async(hot.node)("node-a")
    assert entry.state == "serving" and entry.running == 4 and entry.waiting == 1
    status, answer = await through_django("/api/nodes/node-a/heartbeat", beat(session), token)
    assert (status, answer) == (200, {"name": "node-a", "state": "serving"})


async def test_every_refusal_is_the_same_through_both_doors():
    session = await register("node-b")
    token = settings.LIFELINE_NODE_TOKEN
    cases = [
        ("wrong token", "/api/nodes/node-b/heartbeat", beat(session), "not-the-token", {}),
        ("no token", "/api/nodes/node-b/heartbeat", beat(session), None, {}),
        ("not JSON", "/api/nodes/node-b/heartbeat", b"{beat", token, {}),
        ("a bad figure", "/api/nodes/node-b/heartbeat", beat(session, running="many"), token, {}),
        ("unknown node", "/api/nodes/node-zz/heartbeat", beat(session), token, {}),
        ("another session", "/api/nodes/node-b/heartbeat", beat(uuid.uuid4().hex), token, {}),
        ("a GET", "/api/nodes/node-b/heartbeat", b"", token, {"method": "GET"}),
    ]
    seen = {}
    for what, path, body, who, extra in cases:
        asgi = await through_asgi(path, body, who, **extra)
        django = await through_django(path, body, who, **extra)
        assert asgi == django, what
        seen[what] = asgi[0]
    assert seen == {
        "wrong token": 401,
        "no token": 401,
        "not JSON": 400,
        "a bad figure": 400,
        "unknown node": 404,
        "another session": 409,
        "a GET": 405,
    }


async def test_a_host_outside_allowed_hosts_is_refused():
    session = await register("node-c")
    status, _ = await through_asgi(
        "/api/nodes/node-c/heartbeat", beat(session), settings.LIFELINE_NODE_TOKEN, host="evil.example"
    )
    assert status == 400
    entry = await sync_to_async(hot.node)("node-c")
    assert entry.running is None  # not recorded
