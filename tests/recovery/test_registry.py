"""Node registry and lifecycle against the real database and Redis."""

import time
import uuid

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings

from recovery import hot
from recovery.actions import nodes
from recovery.events import CLUSTER_GROUP
from recovery.models import Node, NodeTransition

pytestmark = pytest.mark.django_db


def registration(name="node-x", session=None, address="http://127.0.0.1:9001", rack="rack-a", **extra):
    body = {
        "name": name,
        "session": session or uuid.uuid4().hex,
        "address": address,
        "rack": rack,
        "model": "Qwen3-32B",
        "gpu": "H100-SXM",
        "tp": 2,
        "pid": 4242,
        "host": "gpu-host-7",
        "gpus": [
            {"index": i, "uuid": f"GPU-{name}-{i}", "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 10**9}
            for i in range(2)
        ],
    }
    body.update(extra)
    return body


@pytest.fixture
def node_api(client):
    """The node endpoints, on a control plane that watches no node and has taken no heartbeat yet: what other tests
    left in the suite's Redis would read as its own deafness (nodes watched whose beats are seconds old: a fleet
    none of which was heard lately; a beat taken seconds before this test's first: heartbeats resuming after a
    gap, which gives every node a whole allowance from then), and it marks nobody DOWN for either."""
    keys = hot.keys()
    hot.client().delete(keys.heartbeats, keys.heartbeats_ingested, keys.heartbeats_resumed, keys.heartbeats_deaf)
    headers = {"HTTP_AUTHORIZATION": f"Bearer {settings.LIFELINE_NODE_TOKEN}"}

    def post(path, body, **kw):
        return client.post(path, body, content_type="application/json", **{**headers, **kw})

    return post


def beat(node_api, name, session, model_state="serving", **load):
    return node_api(
        f"/api/nodes/{name}/heartbeat",
        {"session": session, "model_state": model_state, "load": {"running": 1, "waiting": 0, **load}},
    )


def test_register_then_heartbeat_makes_the_node_serving(node_api, django_capture_on_commit_callbacks):
    body = registration()
    with django_capture_on_commit_callbacks(execute=True):
        response = node_api("/api/nodes/register", body)
    assert response.status_code == 200, response.json()
    assert (
        response.json()["state"] == "join"
        and response.json()["heartbeat_interval_s"] == settings.LIFELINE_HEARTBEAT_INTERVAL_S
    )
    node = Node.objects.get(name="node-x")
    assert [g.uuid for g in node.gpus.all()] == ["GPU-node-x-0", "GPU-node-x-1"]
    assert node.rack.name == "rack-a" and node.pid == 4242 and node.tp == 2

    with django_capture_on_commit_callbacks(execute=True):
        response = beat(node_api, "node-x", body["session"], model_state="loading_full")
    assert response.json()["state"] == "join"  # still loading
    with django_capture_on_commit_callbacks(execute=True):
        response = beat(node_api, "node-x", body["session"], running=3, waiting=2)
    assert response.json()["state"] == "serving"
    assert hot.node("node-x").running == 3
    assert "node-x" in hot.routing_table()
    steps = list(NodeTransition.objects.filter(node=node).order_by("at").values_list("old_state", "new_state", "actor"))
    assert steps == [("", "join", "system"), ("join", "serving", "system")]


def test_registering_again_with_one_name_replaces_the_address_and_keeps_history(
    node_api, django_capture_on_commit_callbacks
):
    first = registration(address="http://10.0.0.1:8201")
    with django_capture_on_commit_callbacks(execute=True):
        node_api("/api/nodes/register", first)
    with django_capture_on_commit_callbacks(execute=True):
        beat(node_api, "node-x", first["session"])
    second = registration(address="http://10.0.0.2:8201")
    with django_capture_on_commit_callbacks(execute=True):
        response = node_api("/api/nodes/register", second)
    assert response.status_code == 200 and response.json()["state"] == "join"
    node = Node.objects.get(name="node-x")
    assert node.address == "http://10.0.0.2:8201" and node.session == second["session"]
    assert Node.objects.count() == 1
    transitions = list(node.transitions.order_by("at"))
    # The old session, still serving when the new one came, ended unseen: its DOWN first (see the test below).
    assert [t.new_state for t in transitions] == ["join", "serving", "down", "join"]
    assert "address http://10.0.0.1:8201 -> http://10.0.0.2:8201" in transitions[-1].cause
    # The old session is closed: its heartbeats are refused, so a stale process cannot pose as the node.
    response = beat(node_api, "node-x", first["session"])
    assert response.status_code == 409 and "register again" in response.json()["error"]["message"]


def test_heartbeat_from_an_unknown_node_is_refused_clearly(node_api):
    response = beat(node_api, "ghost", uuid.uuid4().hex)
    assert response.status_code == 404
    assert (
        response.json()["error"]["message"] == "unknown node 'ghost': it must register first (POST /api/nodes/register)"
    )


@pytest.mark.parametrize(
    "change,field",
    [
        ({"tp": 3}, "tp"),
        ({"gpus": [{"index": 0}]}, "gpus[0].uuid"),
        ({"address": "10.0.0.1"}, "address"),
        ({"model": "GPT-5"}, "model"),
        ({"name": "bad name!"}, "name"),
        ({"gpu": "RTX-4090", "model": "Llama-3-70B", "tp": 1}, "tp"),
    ],
)
def test_bad_registrations_name_the_field(node_api, change, field):
    response = node_api("/api/nodes/register", registration(**change))
    assert response.status_code == 400
    assert response.json()["error"]["field"] == field


def test_node_endpoints_need_the_node_token(client):
    response = client.post("/api/nodes/register", registration(), content_type="application/json")
    assert response.status_code == 401 and "LIFELINE_NODE_TOKEN" in response.json()["error"]["message"]
    response = client.post(
        "/api/nodes/register", registration(), content_type="application/json", HTTP_AUTHORIZATION="Bearer wrong"
    )
    assert response.status_code == 401
    response = client.post(
        "/api/nodes/register",
        "{not json",
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {settings.LIFELINE_NODE_TOKEN}",
    )
    assert response.status_code == 400


def test_a_session_registered_while_the_sweep_runs_is_not_marked_down_for_its_predecessors_silence(
    node_api, django_capture_on_commit_callbacks, monkeypatch
):
    """The sweep read the old session's silence from Redis; the node registered a new session before the sweep
    reached the database. Seen in a restart of the stack: the new session was marked DOWN 100 ms after it
    registered, for the 8.6 s its predecessor had been silent."""
    old = registration()
    with django_capture_on_commit_callbacks(execute=True):
        node_api("/api/nodes/register", old)
    with django_capture_on_commit_callbacks(execute=True):
        beat(node_api, "node-x", old["session"])
    hot.client().zadd(hot.keys().heartbeats, {"node-x": time.time() - 8.6})
    stale = time.time() - 8.6
    real_last_seen = hot.last_seen

    def read_then_register(name):  # the sweep's last read from Redis, then the node's new registration lands
        with django_capture_on_commit_callbacks(execute=True):
            node_api("/api/nodes/register", registration())
        monkeypatch.setattr(hot, "last_seen", real_last_seen)
        return stale

    monkeypatch.setattr(hot, "last_seen", read_then_register)
    assert nodes.mark_silent_nodes_down() == []
    assert Node.objects.get(name="node-x").state == "join"


def test_silent_node_goes_down_then_left_and_a_new_session_rejoins(
    node_api, django_capture_on_commit_callbacks, settings
):
    body = registration()
    with django_capture_on_commit_callbacks(execute=True):
        node_api("/api/nodes/register", body)
    with django_capture_on_commit_callbacks(execute=True):
        beat(node_api, "node-x", body["session"])
    assert nodes.mark_silent_nodes_down() == []
    # Pretend the last heartbeat was 3.5 s ago, and the control plane's hearing began before it (its first beat, the
    # registration, marked when hearing resumed: that mark is older too).
    hot.client().zadd(hot.keys().heartbeats, {"node-x": time.time() - 3.5})
    hot.client().set(hot.keys().heartbeats_resumed, time.time() - 3.6)
    with django_capture_on_commit_callbacks(execute=True):
        assert nodes.mark_silent_nodes_down() == ["node-x"]
    node = Node.objects.get(name="node-x")
    assert node.state == "down"
    down = node.transitions.latest("at")
    assert down.cause.startswith("no heartbeat for 3.") and "(allowed 3 s)" in down.cause
    assert "node-x" not in hot.routing_table()
    assert nodes.mark_silent_nodes_down() == []  # idempotent: nothing is marked twice
    # Its session is closed; heartbeats from it are refused until it registers again.
    assert beat(node_api, "node-x", body["session"]).status_code == 409
    settings.LIFELINE_LEFT_AFTER_S = 0
    with django_capture_on_commit_callbacks(execute=True):
        assert nodes.mark_long_down_nodes_left() == ["node-x"]
    assert Node.objects.get(name="node-x").state == "left"
    again = registration()
    with django_capture_on_commit_callbacks(execute=True):
        node_api("/api/nodes/register", again)
    with django_capture_on_commit_callbacks(execute=True):
        assert beat(node_api, "node-x", again["session"]).json()["state"] == "serving"
    states = list(Node.objects.get(name="node-x").transitions.order_by("at").values_list("new_state", flat=True))
    assert states == ["join", "serving", "down", "left", "join", "serving"]


def test_graceful_leave(node_api, django_capture_on_commit_callbacks):
    body = registration()
    with django_capture_on_commit_callbacks(execute=True):
        node_api("/api/nodes/register", body)
        response = node_api("/api/nodes/node-x/deregister", {"session": body["session"], "reason": "maintenance"})
    assert response.json()["state"] == "left"
    assert Node.objects.get(name="node-x").transitions.latest("at").cause == "node left: maintenance"


def test_transition_is_claimed_once(django_capture_on_commit_callbacks):
    from workers.protocol import Registration

    node = nodes.register_node(Registration.parse(registration()))
    stale_copy = Node.objects.get(pk=node.pk)
    assert nodes.transition_node(node, "serving", "first")
    # A second actor still holding the old state loses the race and writes nothing.
    assert not nodes.transition_node(stale_copy, "serving", "second")
    assert NodeTransition.objects.filter(node=node, new_state="serving").count() == 1


def test_state_change_is_published_to_the_browser_after_commit(node_api, django_capture_on_commit_callbacks):
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(CLUSTER_GROUP, channel)
    body = registration()
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        node_api("/api/nodes/register", body)
    assert callbacks, "publishing waits for the commit"
    for callback in callbacks:
        callback()
    message = async_to_sync(layer.receive)(channel)
    assert message == {"type": "node.changed", "id": Node.objects.get(name="node-x").pk}
    beat(node_api, "node-x", body["session"], running=5)
    message = async_to_sync(layer.receive)(channel)  # the figures, with every node's, within a quarter second
    assert message["type"] == "node.loads" and message["nodes"][0]["name"] == "node-x"
    assert message["nodes"][0]["running"] == 5
    async_to_sync(layer.group_discard)(CLUSTER_GROUP, channel)


def test_a_node_back_with_a_new_session_before_its_death_was_seen_has_that_death_recorded(
    node_api, django_capture_on_commit_callbacks
):
    """Killed and restarted faster than heartbeats tell (or while the control plane could not hear them): the new
    session's registration writes the old one's DOWN first, so the timeline, the incident and a spare see the failure.
    The chaos soak found a node killed beside its holder, back while the database restarted, with no DOWN at all."""
    first = registration()
    with django_capture_on_commit_callbacks(execute=True):
        node_api("/api/nodes/register", first)
    with django_capture_on_commit_callbacks(execute=True):
        beat(node_api, "node-x", first["session"])
    assert Node.objects.get(name="node-x").state == "serving"
    second = registration(pid=4343)
    with django_capture_on_commit_callbacks(execute=True):
        assert node_api("/api/nodes/register", second).status_code == 200
    rows = list(NodeTransition.objects.filter(node__name="node-x").order_by("pk"))
    assert [(r.old_state, r.new_state, r.actor) for r in rows] == [
        ("", "join", "system"),
        ("join", "serving", "system"),
        ("serving", "down", "system"),
        ("down", "join", "system"),
    ]
    assert rows[2].session == first["session"] and "ended unseen" in rows[2].cause and "pid 4343" in rows[2].cause
    assert Node.objects.get(name="node-x").session == second["session"]


def test_a_node_of_the_run_before_the_control_plane_started_is_recorded_gone_not_failed(
    node_api, django_capture_on_commit_callbacks
):
    """A restart of the whole stack: the old session began, and was last heard, before the control plane started."""
    from django.utils import timezone

    from recovery.models import Cluster, ClusterState

    first = registration()
    with django_capture_on_commit_callbacks(execute=True):
        node_api("/api/nodes/register", first)
    with django_capture_on_commit_callbacks(execute=True):
        beat(node_api, "node-x", first["session"])
    Node.objects.filter(name="node-x").update(last_seen_at=timezone.now())
    ClusterState.objects.filter(cluster=Cluster.default()).update(control_plane_started_at=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        node_api("/api/nodes/register", registration())
    down = NodeTransition.objects.get(node__name="node-x", new_state="down")
    assert down.actor == nodes.STARTUP and "ended before the control plane started" in down.cause
