"""What the web process answers while its database or Redis is away (console.outage): a 503 with Retry-After that
names the store, JSON for the API and the nodes, a page for people; a wrong query stays a 500.

The stores are made unreachable for real: Redis by pointing REDIS_URL at a closed port, the database by pointing
the connection at one. The outage tests use a transactional database: the 503 closes a broken connection
(close_old_connections), which would end the test's own wrapping transaction."""

import json
import logging
import uuid

import pytest
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.testing import HttpCommunicator
from django.db import connection
from django.http import HttpResponse
from django.test import Client
from django.urls import include, path

from console.models import ApiToken
from console.stack import free_port
from recovery import hot
from recovery.actions import nodes
from workers.protocol import Registration

pytestmark = pytest.mark.django_db(transaction=True)


# --- Test views for what a bug looks like (the outage views are the console's own) --------------------------------
def _wrong_query(request):
    with connection.cursor() as cursor:
        cursor.execute("SELECT no_such_column FROM no_such_table")  # a real ProgrammingError: a bug, not an outage
    return HttpResponse("unreachable")


def _wrong_redis_value(request):
    hot.client().set(hot.keys().node("outage-test"), {"not": "a string"})  # a real redis DataError
    return HttpResponse("unreachable")


urlpatterns = [
    path("api/test-outage/wrong-query", _wrong_query),
    path("api/test-outage/wrong-redis-value", _wrong_redis_value),
    path("", include("console.urls")),
]


# --- Fixtures -------------------------------------------------------------------------------------------------------
@pytest.fixture
def redis_away(settings, monkeypatch):
    """Redis stops answering: REDIS_URL points at a closed port and the cached client is dropped (restored after)."""
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setattr(hot, "_client", None)
    monkeypatch.setattr(hot, "_client_pid", None)


@pytest.fixture
def database_away(monkeypatch, tmp_path):
    """The database stops answering: the connection is closed and pointed at a closed port, or for SQLite at a file
    in a directory that does not exist (restored after)."""

    def cut():
        connection.close()
        if connection.vendor == "sqlite":
            monkeypatch.setitem(connection.settings_dict, "NAME", str(tmp_path / "gone" / "lifeline.sqlite3"))
        else:
            monkeypatch.setitem(connection.settings_dict, "PORT", str(free_port()))

    yield cut
    monkeypatch.undo()
    connection.close()  # the next query reconnects to the real database


@pytest.fixture
def admin_token(cast):
    _, token = ApiToken.issue(cast["admin"])
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


def no_traceback(caplog):
    traced = [(r.name, r.getMessage()) for r in caplog.records if r.exc_info]
    assert traced == [], f"a traceback was logged for an outage: {traced}"


def assert_outage_json(response, store: str):
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    assert response["Content-Type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "store"}
    assert error["type"] == "service_unavailable" and error["store"] == store
    assert f"Lifeline's {store} is unavailable" in error["message"] and "nothing was changed" in error["message"]


def assert_outage_page(response, store: str):
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    assert response["Content-Type"].startswith("text/html")
    html = response.content.decode()
    assert 'id="error-page" data-status="503"' in html
    assert f"Lifeline&#x27;s {store} is unavailable" in html or f"Lifeline's {store} is unavailable" in html


# --- Redis away -------------------------------------------------------------------------------------------------------
def test_api_answers_503_json_naming_redis_when_it_is_away(client, admin_token, redis_away, caplog):
    caplog.set_level(logging.INFO)
    response = client.get("/api/checkpoints", **admin_token)  # reads the gateways' flights from Redis
    assert_outage_json(response, "Redis")
    no_traceback(caplog)
    warnings = [r for r in caplog.records if r.name == "console.outage"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "GET /api/checkpoints: 503, the Redis is unavailable" in warnings[0].getMessage()


def test_pages_answer_a_503_page_naming_redis_when_it_is_away(client, cast, redis_away, caplog):
    caplog.set_level(logging.INFO)
    client.force_login(cast["operator"])
    response = client.get("/checkpoints/")
    assert_outage_page(response, "Redis")
    no_traceback(caplog)


# --- Database away ----------------------------------------------------------------------------------------------------
def test_api_and_pages_answer_503_naming_the_database_when_it_is_away(client, cast, admin_token, database_away, caplog):
    client.force_login(cast["operator"])  # the session is written while the database is there
    caplog.set_level(logging.INFO)
    database_away()
    response = client.get("/api/incidents", **admin_token)  # the token itself is looked up in the database
    assert_outage_json(response, "database")
    # The page is rendered without the request: its context processors would need the database that is away.
    response = client.get("/incidents/")
    assert_outage_page(response, "database")
    no_traceback(caplog)


# --- A bug is not an outage -------------------------------------------------------------------------------------------
@pytest.mark.urls(__name__)
def test_a_wrong_query_stays_a_500_while_an_outage_is_a_503(admin_token, settings, monkeypatch, caplog):
    client = Client(raise_request_exception=False)
    response = client.get("/api/test-outage/wrong-query", **admin_token)
    assert response.status_code == 500
    response = client.get("/api/test-outage/wrong-redis-value", **admin_token)
    assert response.status_code == 500
    # Both were logged as the failures they are, with their tracebacks.
    traced = [r.exc_info[0].__name__ for r in caplog.records if r.name == "django.request" and r.exc_info]
    # SQLite reports a missing table as an OperationalError, the class an outage has too (recovery.stores.away).
    wrong_query = "OperationalError" if connection.vendor == "sqlite" else "ProgrammingError"
    assert traced == [wrong_query, "DataError"]
    # The same doors answer 503 when the store is away.
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setattr(hot, "_client", None)
    assert_outage_json(client.get("/api/test-outage/wrong-redis-value", **admin_token), "Redis")


# --- The node endpoints, answered before Django's middleware (console.asgi.NodeEndpoint) --------------------------
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


@pytest.fixture
async def close_thread_connections():
    yield
    from django.db import connections

    await database_sync_to_async(connections.close_all)()


async def test_a_heartbeat_while_redis_is_away_is_a_503_the_node_retries(
    settings, monkeypatch, caplog, close_thread_connections
):
    from console.asgi import application

    session = await register("node-outage")
    redis_url = settings.REDIS_URL
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setattr(hot, "_client", None)
    caplog.set_level(logging.INFO)
    body = json.dumps({"session": session, "model_state": "serving", "load": {"running": 1, "waiting": 0}}).encode()
    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"content-type", b"application/json"),
        (b"authorization", f"Bearer {settings.LIFELINE_NODE_TOKEN}".encode()),
    ]
    communicator = HttpCommunicator(application, "POST", "/api/nodes/node-outage/heartbeat", body=body, headers=headers)
    response = await communicator.get_response(timeout=10)
    assert response["status"] == 503
    assert (b"Retry-After", b"5") in response["headers"]
    error = json.loads(response["body"])["error"]
    assert error["type"] == "service_unavailable" and error["store"] == "Redis"
    no_traceback(caplog)
    # Redis back: nothing of the refused beat was recorded, and the node's next beat is taken.
    settings.REDIS_URL = redis_url
    monkeypatch.setattr(hot, "_client", None)
    assert await sync_to_async(lambda: hot.node("node-outage").running)() is None
    communicator = HttpCommunicator(application, "POST", "/api/nodes/node-outage/heartbeat", body=body, headers=headers)
    response = await communicator.get_response(timeout=10)
    assert response["status"] == 200
    assert await sync_to_async(lambda: hot.node("node-outage").running)() == 1
