"""Issue 11, "pages that hold a fleet": the node table, tiles that never hide a problem, the routing explanation and the
cluster's traffic series."""

import datetime as dt
import re
import time
import uuid

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from console.asgi import application
from console.readmodels import cluster as cluster_model
from recovery.actions import nodes, routing
from recovery.choices import BreakerState, Health, NodeState
from recovery.models import Node, RequestOutcome, XidEvent
from tests.console.test_console import make_node
from workers.protocol import Heartbeat, Load, Registration

pytestmark = pytest.mark.django_db


def tile(html: str, name: str) -> str:
    """The opening tag and body of one node's tile or row."""
    match = re.search(rf'<(article|tr) [^>]*id="node-{name}".*?</\1>', html, re.S)
    assert match, f"no tile or row for {name}"
    return match.group(0)


def state_badge(fragment: str) -> str:
    return re.search(r'<span class="badge badge-(\w+)" data-field="state"', fragment).group(1)


def set_node(name: str, **fields):
    Node.objects.filter(name=name).update(**fields)


def register(name: str, gpu: str, tp: int = 2, model: str = "Qwen3-32B", running: int = 0):
    reg = Registration.parse(
        {
            "name": name,
            "session": uuid.uuid4().hex,
            "address": f"http://127.0.0.1:{9000 + len(name)}",
            "rack": "rack-" + gpu.lower(),
            "model": model,
            "gpu": gpu,
            "tp": tp,
            "pid": 1,
            "host": "h",
            "gpus": [
                {"index": i, "uuid": f"GPU-{name}-{i}", "name": gpu, "memory_bytes": 80 * 10**9} for i in range(tp)
            ],
        }
    )
    nodes.register_node(reg)
    routing.sync_hot_state()
    load = Load(
        running=running, waiting=0, step_ms=10.0, decode_step_batch=running, decode_step_context_tokens=4000 * running
    )
    nodes.record_heartbeat(name, Heartbeat(session=reg.session, load=load))
    return reg


# --- tiles and rows never hide a problem ---------------------------------------------------------------------------
@pytest.mark.parametrize("view", ["tiles", "table"])
def test_an_unhealthy_node_with_an_open_breaker_is_red_not_green(client, cast, view):
    make_node("node-01")
    make_node("node-02")
    set_node("node-02", health=Health.UNHEALTHY, breaker=BreakerState.OPEN)
    client.force_login(cast["operator"])
    html = client.get(f"/cluster/?view={view}").content.decode()
    healthy, sick = tile(html, "node-01"), tile(html, "node-02")
    assert "tone-ok" in healthy and state_badge(healthy) == "green"
    assert 'data-state="serving"' in sick and "tone-bad" in sick and "tone-ok" not in sick
    assert state_badge(sick) == "red"  # the SERVING badge is not green
    assert "unhealthy" in sick and "breaker open" in sick and "weight 0: takes no traffic" in sick


@pytest.mark.parametrize(
    "fields, tone, reason",
    [
        ({"health": Health.SUSPICIOUS}, "warn", "suspicious"),
        ({"breaker": BreakerState.HALF_OPEN}, "warn", "breaker half-open"),
        ({"cordoned": True}, "warn", "weight 0: takes no traffic"),
        ({"breaker": BreakerState.OPEN}, "bad", "breaker open"),
        ({"spare": True}, "spare", "hot spare"),
    ],
)
def test_each_reason_to_look_is_shown_and_takes_the_green_away(client, cast, fields, tone, reason):
    make_node("node-01")
    set_node("node-01", **fields)
    client.force_login(cast["operator"])
    node = tile(client.get("/cluster/").content.decode(), "node-01")
    assert f"tone-{tone}" in node and reason in node
    assert state_badge(node) != "green"


def test_a_gpu_with_a_fresh_xid_is_flagged_and_an_old_one_is_not(client, cast):
    node = make_node("node-01")
    now = dt.datetime.now(tz=dt.UTC)
    old = now - dt.timedelta(seconds=cluster_model.XID_FRESH_S + 60)
    XidEvent.objects.create(
        node=node,
        gpu_index=0,
        first_at=old,
        last_at=old,
        codes={"13": 1},
        code=13,
        severity="warn",
        meaning="m",
        action="a",
    )
    client.force_login(cast["operator"])
    html = tile(client.get("/cluster/").content.decode(), "node-01")
    assert "data-xid" not in html and "tone-ok" in html
    XidEvent.objects.create(
        node=node,
        gpu_index=1,
        first_at=now,
        last_at=now,
        codes={"79": 1},
        code=79,
        severity="critical",
        meaning="GPU has fallen off the bus",
        action="reset",
    )
    for view in ("tiles", "table"):
        html = tile(client.get(f"/cluster/?view={view}").content.decode(), "node-01")
        flagged = re.search(r'<span class="gpu xid xid-critical"[^>]*>1<', html)
        assert flagged and 'data-xid="79"' in flagged.group(0), html
        assert "tone-bad" in html and "Xid 79 on GPU 1" in html and state_badge(html) == "red"


def test_the_heartbeat_age_of_a_down_node_is_stale_however_recent(client, cast):
    make_node("node-01")
    set_node("node-01", state=NodeState.DOWN)
    client.force_login(cast["operator"])
    for view in ("tiles", "table"):
        html = tile(client.get(f"/cluster/?view={view}").content.decode(), "node-01")
        report = re.search(r'<span class="report[^"]*"[^>]*>', html).group(0)
        assert "stale" in report and 'data-alive="0"' in report


# --- the table ---------------------------------------------------------------------------------------------------
def test_the_table_is_the_default_above_the_threshold_and_the_url_keeps_the_choice(client, cast, monkeypatch):
    make_node("node-01")
    make_node("node-02")
    client.force_login(cast["manager"])
    page = client.get("/cluster/").content.decode()
    assert 'data-view="tiles"' in page and 'id="node-table"' not in page
    page = client.get("/cluster/?view=table").content.decode()
    assert 'id="node-table"' in page and page.count('class="node-row') == 2
    row = tile(page, "node-01")
    for column in ("name", "state", "health", "weight", "breaker", "model", "gpu", "running", "waiting", "kv", "step"):
        assert f'data-col="{column}"' in row
    assert 'data-col="running" data-sort="4"' in row and 'data-col="kv" data-sort="25.0"' in row
    monkeypatch.setattr(cluster_model, "TABLE_VIEW_ABOVE", 1)
    assert 'id="node-table"' in client.get("/cluster/").content.decode()
    assert 'class="tiles"' in client.get("/cluster/?view=tiles").content.decode()
    assert 'id="node-table"' in client.get("/cluster/?partial=table").content.decode()


def test_an_unknown_view_is_a_400_that_names_the_field(client, cast):
    client.force_login(cast["operator"])
    response = client.get("/cluster/?view=grid")
    assert response.status_code == 400
    assert "view: &#x27;grid&#x27; is not a view of the cluster; use tiles or table." in response.content.decode()


@pytest.mark.django_db(transaction=True)
async def test_the_socket_pushes_rows_to_a_table_and_tiles_to_tiles():
    from django.db import connections

    from console.actions import set_user_role

    user = await database_sync_to_async(set_user_role)("ws-fleet", "operator", password="long-password-1")
    frames = {}
    try:
        for view in ("tiles", "table"):
            ws = WebsocketCommunicator(
                application,
                f"/ws/cluster/?view={view}",
                headers=[(b"origin", b"http://127.0.0.1:8000"), (b"host", b"127.0.0.1:8000")],
            )
            ws.scope["user"] = user
            assert (await ws.connect())[0]
            assert (await ws.receive_json_from())["kind"] == "hello"
            frames[view] = ws
        await database_sync_to_async(make_node)("node-ws", "rack-a", False)
        tile_frame = await frames["tiles"].receive_json_from(timeout=5)
        row_frame = await frames["table"].receive_json_from(timeout=5)
        assert tile_frame["html"].startswith("<article") and 'id="node-node-ws"' in tile_frame["html"]
        assert row_frame["html"].startswith("<tr") and 'id="node-node-ws"' in row_frame["html"]
        for ws in frames.values():
            await ws.disconnect()
    finally:
        await database_sync_to_async(connections.close_all)()


# --- routing -----------------------------------------------------------------------------------------------------
def test_routing_says_why_the_faster_nodes_take_the_traffic_at_low_load(client, cast):
    register("node-h200", "H200-SXM", running=3)
    register("node-h100", "H100-SXM", running=1)
    register("node-h100b", "H100-SXM")
    set_node("node-h100b", health=Health.UNHEALTHY)
    view = cluster_model.routing_view()
    (model,) = view["models"]
    text = " ".join(model["sentences"])
    fast, slow = model["groups"]
    assert fast["label"] == "H200-SXM ×2" and slow["label"] == "H100-SXM ×2"
    assert fast["idle_ms"] < slow["idle_ms"]
    assert text.startswith(
        f"At low load every Qwen3-32B request goes to the H200-SXM ×2 nodes: idle, one costs {fast['idle_ms']:g} ms"
    )
    assert "The H100-SXM ×2 nodes take traffic once a H200-SXM ×2 node runs about" in text
    assert "Now the H200-SXM ×2 nodes run 3 of the 4 requests (75 %)." in text
    assert "1 Qwen3-32B node at weight 0 takes no traffic: node-h100b." in text
    by_name = {n["name"]: n for n in model["nodes"]}
    assert set(by_name) == {"node-h200", "node-h100"}
    assert by_name["node-h200"]["cost_ms"] > fast["idle_ms"]  # its queue costs
    assert by_name["node-h200"]["l_hat_pct"] == 75.0  # L̂ = β·queue with nothing held
    client.force_login(cast["operator"])
    page = client.get("/cluster/?partial=routing").content.decode()
    assert "At low load every Qwen3-32B request goes to the H200-SXM ×2 nodes" in page
    assert 'data-routing-node="node-h200"' in page


def test_one_kind_of_node_spreads_the_load_evenly():
    register("node-a", "H200-SXM")
    register("node-b", "H200-SXM")
    (model,) = cluster_model.routing_view()["models"]
    assert model["sentences"][0].startswith("Every Qwen3-32B node in routing is H200-SXM ×2: each request goes to")


def test_each_model_shows_its_own_capacity_level_and_spares(client, cast):
    """Per-model capacity and degradation on the cluster page (issue 14): a model that lost its nodes is at its level
    beside one that serves at level 0, each against its own objective, with its hot spares."""
    from recovery.actions import capacity
    from recovery.models import ModelCapacity

    register("node-q1", "H200-SXM")
    register("node-q2", "H200-SXM")
    register("node-l1", "H200-SXM", model="Llama-3-8B")
    register("node-l2", "H200-SXM", model="Llama-3-8B")
    set_node("node-l2", spare=True)
    ModelCapacity.objects.filter(pk=ModelCapacity.of("Qwen3-32B").pk).update(required_rps=25.0)
    ModelCapacity.objects.filter(pk=ModelCapacity.of("Llama-3-8B").pk).update(required_rps=10.0)
    set_node("node-q2", state=NodeState.DOWN)
    capacity.evaluate()
    view = {m["model"]: m for m in cluster_model.routing_view()["models"]}
    qwen, llama = view["Qwen3-32B"]["capacity"], view["Llama-3-8B"]["capacity"]
    assert qwen["level"] >= 1 and qwen["in_service"] == 1 and qwen["required_rps"] == 25.0 and qwen["ratio"] < 1
    assert llama["level"] == 0 and llama["in_service"] == 1 and llama["spares"] == 1
    client.force_login(cast["operator"])
    page = client.get("/cluster/?partial=routing").content.decode()
    block = page[page.index('data-model="Qwen3-32B"') :]
    assert f'data-model-level="{qwen["level"]}"' in block[:400] and "of the 25.0 required" in block
    assert "1 hot spare" in page[page.index('data-model="Llama-3-8B"') :]


# --- the traffic series ----------------------------------------------------------------------------------------------
def outcome(finished: float, tier="standard", status="ok", ttft=100.0, tpot=20.0, tokens=50, model="Qwen3-32B"):
    at = dt.datetime.fromtimestamp(finished, tz=dt.UTC)
    return RequestOutcome(
        request_id=uuid.uuid4().hex,
        gateway="gw",
        tenant="t",
        tier=tier,
        model_key=model,
        status=status,
        completion_tokens=tokens,
        ttft_ms=ttft,
        tpot_ms=tpot,
        started_at=at,
        finished_at=at,
    )


def test_the_series_has_percentiles_tokens_and_error_shares_per_model_and_tier(client, cast):
    now = time.time()
    bucket = 10  # 15 minutes in 90 buckets
    base = (now // bucket) * bucket - 3 * bucket + 1  # inside the bucket three before the current one
    rows = [outcome(base, ttft=float(t)) for t in range(1, 100)]
    rows.append(outcome(base, status="error", ttft=None, tpot=None, tokens=0))
    rows.append(outcome(base, tier="premium", ttft=42.0))
    RequestOutcome.objects.bulk_create(rows)
    client.force_login(cast["manager"])
    data = client.get("/api/cluster/series?minutes=15").json()
    assert data["bucket_s"] == bucket and data["requests"] == 101
    assert [s["label"] for s in data["series"]] == ["Qwen3-32B · premium", "Qwen3-32B · standard"]
    standard = data["series"][1]
    i = data["t"].index(base - 1)
    assert standard["requests"][i] == 100
    assert standard["ttft_p50"][i] == 50.0 and standard["ttft_p99"][i] == 99.0
    assert standard["tpot_p50"][i] == 20.0
    assert standard["tokens_per_s"][i] == 99 * 50 / bucket
    assert standard["error_pct"][i] == 1.0 and standard["shed_pct"][i] == 0.0
    assert standard["requests"][i - 1] is None and standard["ttft_p50"][i - 1] is None  # no request: n/a, not 0
    assert data["series"][0]["ttft_p99"][i] == 42.0


def test_a_bad_window_is_a_400_that_names_the_field(client, cast):
    client.force_login(cast["manager"])
    for bad in ("7", "soon"):
        response = client.get(f"/api/cluster/series?minutes={bad}")
        assert response.status_code == 400
        assert response.json()["error"]["field"] == "minutes"
        assert response.json()["error"]["message"].startswith(f"minutes: '{bad}' is not a window")


def test_the_pushed_summary_equals_the_pages(cast):
    """The summary each node change pushes is counted without building every card; it must say what the page says."""
    make_node("node-01")
    make_node("node-02", "rack-b")
    make_node("node-03", serving=False)
    make_node("node-04")
    set_node("node-02", health=Health.SUSPICIOUS)
    set_node("node-04", spare=True)
    make_node("node-05")
    set_node("node-05", state=NodeState.DOWN)
    assert cluster_model.cluster_summary() == cluster_model.cluster_snapshot()["summary"]
