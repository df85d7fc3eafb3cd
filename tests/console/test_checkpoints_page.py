"""The checkpoints page, its partial and /api/checkpoints for a known distribution, who may see them, their query
count; and its socket, which hears of a change of the distribution when it happens, not on a timer."""

import json
import time
import uuid

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser
from django.db import connection
from django.test.utils import CaptureQueriesContext

from console.asgi import application
from console.models import ApiToken
from recovery import hot
from recovery.actions import nodes
from recovery.choices import NodeState
from recovery.models import Cluster, Node
from recovery.policy import load, placement
from workers import catalog
from workers.protocol import Heartbeat, Load, Registration

MODEL = "Qwen3-32B"
PER_BLOCK = catalog.model(MODEL).kv_bytes_per_block
GATEWAY = "gw-ck"


def register(name, serving=True):
    reg = Registration.parse(
        {
            "name": name,
            "session": uuid.uuid4().hex,
            "address": "http://127.0.0.1:9",
            "rack": "rack-ck",
            "model": MODEL,
            "gpu": "H100-SXM",
            "tp": 1,
            "pid": 1,
            "host": "h",
            "gpus": [{"index": 0, "uuid": f"GPU-{name}", "name": "H100", "memory_bytes": 80 * 10**9}],
        }
    )
    node = nodes.register_node(reg)
    if serving:
        nodes.transition_node(node, NodeState.SERVING, "test")
    return node, reg


def holds(name, checkpoints, running=0, waiting=0):
    hot.heartbeat(name, time.time(), "serving", {"running": running, "waiting": waiting}, checkpoints)


def flights(**by_id):
    """This test's gateway's in-flight requests, as a gateway publishes them (recovery.gateway.signals)."""
    r, k = hot.client(), hot.keys()
    r.delete(k.gateways)
    r.delete(k.gateway_inflight(GATEWAY))
    if by_id:
        r.hset(k.gateway_inflight(GATEWAY), mapping={rid: json.dumps(f) for rid, f in by_id.items()})
    r.zadd(k.gateways, {GATEWAY: time.time()})


@pytest.fixture
def known(db):
    """ck-a and ck-b serve and hold each other's checkpoints, ck-c is joining and holds none, ck-d is DOWN; three
    requests in flight: one checkpointed on a live holder, one on the DOWN node, one too short for a page."""
    for name in ("ck-a", "ck-b", "ck-c", "ck-d"):
        register(name, serving=name != "ck-c")
    register("ck-d-spare", serving=False)  # registered, not serving yet: JOIN, shown
    nodes.transition_node(Node.objects.get(name="ck-d"), NodeState.DOWN, "test: silent")
    holds("ck-a", {"ck-b": {"bytes": 2 * PER_BLOCK, "requests": 1}}, running=3, waiting=1)
    holds("ck-b", {"ck-a": {"bytes": 6 * PER_BLOCK, "requests": 2}}, running=1)
    holds("ck-c", {})
    holds("ck-d-spare", {})
    flights(
        r1={"node": "ck-a", "holders": ["ck-b"], "context": 64},
        r2={"node": "ck-a", "holders": ["ck-d"], "context": 64},
        r3={"node": "ck-b", "holders": ["ck-a"], "context": catalog.BLOCK_TOKENS - 1},
    )
    yield
    flights()


def expected_l_hat(held_bytes, queue):
    cluster = Cluster.default()
    return round(load.holder_load(held_bytes, PER_BLOCK, queue, cluster.alpha, cluster.beta), 2)


# --- content ---------------------------------------------------------------------------------------------------
def test_the_api_reports_the_known_distribution(client, cast, known):
    client.force_login(cast["manager"])
    response = client.get("/api/checkpoints")
    assert response.status_code == 200
    data = response.json()
    assert data["nodes"] == ["ck-a", "ck-b", "ck-c", "ck-d-spare"]  # SERVING and JOIN, by name; not the DOWN one
    assert data["matrix"] == {
        "ck-a": {"ck-b": {"bytes": 2 * PER_BLOCK, "requests": 1}},
        "ck-b": {"ck-a": {"bytes": 6 * PER_BLOCK, "requests": 2}},
        "ck-c": {},
        "ck-d-spare": {},
    }
    assert data["bytes_held"] == {"ck-a": 2 * PER_BLOCK, "ck-b": 6 * PER_BLOCK, "ck-c": 0, "ck-d-spare": 0}
    a, b = expected_l_hat(2 * PER_BLOCK, 4), expected_l_hat(6 * PER_BLOCK, 1)
    assert data["l_hat"] == {"ck-a": a, "ck-b": b, "ck-c": 0.0, "ck-d-spare": 0.0}
    assert data["holders"] == ["ck-a", "ck-b"]
    assert data["holder_balance"] == pytest.approx(placement.holder_balance([a, b]))
    # r1 is covered; r2's holder is DOWN; r3 is shorter than a page, so it has nothing to restore.
    assert (data["in_flight"], data["covered"]) == (3, 1) and data["coverage"] == pytest.approx(1 / 3)
    assert data["flights_by_node"] == {"ck-a": 2, "ck-b": 1}
    assert data["policy"] == Cluster.default().placement_policy and data["policy_label"]
    assert abs(data["generated_at"] - time.time()) < 60


def test_the_page_and_its_partial_show_the_same_fragment(client, cast, known):
    client.force_login(cast["operator"])
    page = client.get("/checkpoints/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'data-socket="/ws/checkpoints/"' in html and 'data-live-partial="/checkpoints/?partial=1"' in html
    partial = client.get("/checkpoints/?partial=1")
    fragment = partial.content.decode()
    assert partial.status_code == 200 and "<html" not in fragment and 'id="live-status"' not in fragment
    assert fragment.strip() in html  # one fragment serves the page, the partial refresh and the push
    rows = [line.split('data-holder="')[1].split('"')[0] for line in fragment.splitlines() if "data-holder=" in line]
    assert rows == ["ck-a", "ck-b", "ck-c", "ck-d-spare"]  # stable order, by name
    chip = '<span class="chip" data-source="ck-a">ck-a → 2 · '
    assert chip in fragment.split('data-holder="ck-b"')[1].split("</tr>")[0]
    assert 'data-coverage="0.3333333333333333">33%<' in fragment
    balance = placement.holder_balance([expected_l_hat(2 * PER_BLOCK, 4), expected_l_hat(6 * PER_BLOCK, 1)])
    assert f'id="balance">{balance:.2f}<' in fragment
    assert fragment.count('<span class="muted">none</span>') == 2  # ck-c and ck-d-spare hold nothing


def test_nothing_in_flight_and_one_holder_show_n_a_not_a_healthy_looking_figure(client, cast, db):
    register("ck-solo")
    holds("ck-solo", {"ck-x": {"bytes": PER_BLOCK, "requests": 1}})
    flights()
    client.force_login(cast["oncall"])
    data = client.get("/api/checkpoints").json()
    assert data["coverage"] is None and data["holder_balance"] is None and data["in_flight"] == 0
    fragment = client.get("/checkpoints/?partial=1").content.decode()
    assert 'id="coverage" data-coverage="">n/a<' in fragment and 'id="balance">n/a<' in fragment


# --- who may see it --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["operator", "oncall", "manager", "admin"])
def test_every_role_sees_the_page_and_the_api(client, cast, role):
    client.force_login(cast[role])
    assert client.get("/checkpoints/").status_code == 200
    assert client.get("/api/checkpoints").status_code == 200


def test_strangers_are_turned_away(client, cast, django_user_model):
    page = client.get("/checkpoints/")
    assert page.status_code == 302 and "/login" in page["Location"]
    assert client.get("/api/checkpoints").status_code == 401
    client.force_login(django_user_model.objects.create_user("ck-plain", password="long-password-1"))
    assert client.get("/checkpoints/").status_code == 403
    assert client.get("/api/checkpoints").status_code == 403


def test_the_api_takes_a_token_and_only_reads(client, cast):
    _, token = ApiToken.issue(cast["manager"], "checkpoints test")
    response = client.get("/api/checkpoints", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200 and "matrix" in response.json()
    assert client.post("/api/checkpoints", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 405


# --- the query count does not grow with the fleet ---------------------------------------------------------------
def test_the_query_count_does_not_grow_with_the_nodes(client, cast, db):
    client.force_login(cast["operator"])
    flights()

    def queries(path):
        client.get(path)  # the session and the cluster row are read once, then as every request reads them
        with CaptureQueriesContext(connection) as captured:
            assert client.get(path).status_code == 200
        return len(captured)

    for i in range(3):
        register(f"ck-q{i}")
        holds(f"ck-q{i}", {f"ck-q{(i + 1) % 3}": {"bytes": PER_BLOCK, "requests": 1}})
    few = {path: queries(path) for path in ("/checkpoints/", "/checkpoints/?partial=1", "/api/checkpoints")}
    for i in range(3, 12):
        register(f"ck-q{i}")
        holds(f"ck-q{i}", {f"ck-q{(i + 1) % 12}": {"bytes": PER_BLOCK, "requests": 1}})
    many = {path: queries(path) for path in few}
    assert many == few
    # The session, the user and their role; the cluster and the nodes; the page adds its banner's four.
    assert few["/checkpoints/"] <= 9 and few["/checkpoints/?partial=1"] <= 5 and few["/api/checkpoints"] <= 5, few


# --- the push ----------------------------------------------------------------------------------------------------
@database_sync_to_async
def _user(role):
    from console.actions import set_user_role

    return set_user_role(f"ck-ws-{role}", role, password="long-password-1")


@database_sync_to_async
def _register(name):
    return register(name, serving=False)[1]


@database_sync_to_async
def _beat(name, session, checkpoints):
    return nodes.record_heartbeat(name, Heartbeat(session=session, load=Load(running=1), checkpoints=checkpoints))


@database_sync_to_async
def _close_connections():
    from django.db import connections

    connections.close_all()


def _socket(user):
    ws = WebsocketCommunicator(
        application, "/ws/checkpoints/", headers=[(b"origin", b"http://127.0.0.1:8000"), (b"host", b"127.0.0.1:8000")]
    )
    ws.scope["user"] = user
    return ws


async def _quiet(ws):
    """Take every frame already on its way, until none comes for a while."""
    while not await ws.receive_nothing(timeout=0.6):
        await ws.receive_json_from()


@pytest.mark.django_db(transaction=True)
async def test_a_change_of_the_distribution_reaches_the_socket_within_a_second():
    try:
        ws = _socket(await _user("operator"))
        connected, _ = await ws.connect()
        assert connected and (await ws.receive_json_from())["kind"] == "hello"
        session = (await _register("ck-push")).session
        assert await ws.receive_json_from(timeout=1) == {"kind": "checkpoints"}  # a node joined the distribution
        held = {"ck-other": {"bytes": PER_BLOCK, "requests": 1}}
        await _beat("ck-push", session, held)
        assert await ws.receive_json_from(timeout=1) == {"kind": "checkpoints"}
        await _quiet(ws)
        # The same holdings again: nothing moved, nothing is pushed (no timer either).
        await _beat("ck-push", session, held)
        await _beat("ck-push", session, dict(held))
        assert await ws.receive_nothing(timeout=1.5)
        # A new checkpoint on the holder: pushed within the console's 1 s goal.
        started = time.monotonic()
        await _beat("ck-push", session, {"ck-other": {"bytes": 2 * PER_BLOCK, "requests": 2}})
        assert await ws.receive_json_from(timeout=1) == {"kind": "checkpoints"}
        assert time.monotonic() - started < 1.0
        await _quiet(ws)
        # A burst of changes (five holders' beats in a row) is coalesced: fewer frames than changes.
        for requests in range(3, 8):
            await _beat("ck-push", session, {"ck-other": {"bytes": requests * PER_BLOCK, "requests": requests}})
        frames = [await ws.receive_json_from(timeout=1)]
        while not await ws.receive_nothing(timeout=0.6):
            frames.append(await ws.receive_json_from())
        assert set(map(json.dumps, frames)) == {json.dumps({"kind": "checkpoints"})} and len(frames) < 5
        # Everything dropped (the requests finished): pushed too.
        await _beat("ck-push", session, {})
        assert await ws.receive_json_from(timeout=1) == {"kind": "checkpoints"}
        await ws.disconnect()
    finally:
        await _close_connections()


@pytest.mark.django_db(transaction=True)
async def test_the_socket_turns_away_users_without_a_role(django_user_model):
    try:
        connected, code = await _socket(AnonymousUser()).connect()
        assert not connected and code == 4403
        user = await database_sync_to_async(django_user_model.objects.create_user)("ck-ws-plain", password="x" * 12)
        connected, code = await _socket(user).connect()
        assert not connected and code == 4403
    finally:
        await _close_connections()
