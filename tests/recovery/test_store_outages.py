"""Infrastructure faults handled by design, against the real Redis and database: a control plane that was deaf does
not mark its fleet DOWN, a gateway keeps routing when Redis restarts empty, the control plane writes the hot state
back within a second, and Celery tasks wait out a store that is away instead of failing with a traceback."""

import logging
import os
import secrets
import time
import uuid

import pytest
import redis
from celery.exceptions import Retry
from django.conf import settings as django_settings

from console.celery import Task, app
from console.stack import free_port
from recovery import hot, tasks
from recovery.actions import keys as key_actions
from recovery.actions import nodes, routing
from recovery.choices import NodeState
from recovery.gateway.table import RoutingView
from recovery.models import Node, NodeTransition
from workers.protocol import Heartbeat, Load, Registration


# --- Fixtures and helpers -----------------------------------------------------------------------------------------
@pytest.fixture
def namespace(settings):
    """Redis keys of this test's own, so that deleting them all is a Redis restart no other test sees."""
    settings.LIFELINE_NAMESPACE = f"{os.environ['LIFELINE_NAMESPACE']}-outage-{secrets.token_hex(3)}"
    yield settings.LIFELINE_NAMESPACE
    wipe(settings.LIFELINE_NAMESPACE)


def wipe(namespace: str) -> int:
    """What a Redis that restarted empty holds of the namespace: nothing."""
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    doomed = list(client.scan_iter(match=namespace + ":*", count=500))
    if doomed:
        client.delete(*doomed)
    return len(doomed)


@pytest.fixture
def redis_away(settings, monkeypatch):
    """Redis stops answering: REDIS_URL points at a closed port and the cached client is dropped (restored after)."""
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setattr(hot, "_client", None)
    monkeypatch.setattr(hot, "_client_pid", None)


def serving_node(name: str, rack: str = "rack-a") -> Node:
    """A node registered and made SERVING by its first heartbeat, as the node endpoints do it."""
    registration = Registration.parse(
        {
            "name": name,
            "session": uuid.uuid4().hex,
            "address": f"http://127.0.0.1:{9100 + len(name)}",
            "rack": rack,
            "model": "Qwen3-32B",
            "gpu": "H100-SXM",
            "tp": 1,
            "pid": 4242,
            "host": "h",
            "gpus": [{"index": 0, "uuid": f"GPU-{name}", "name": "H100", "memory_bytes": 80 * 10**9}],
        }
    )
    nodes.register_node(registration)
    nodes.record_heartbeat(name, Heartbeat(session=registration.session, load=Load(running=1, waiting=0)))
    node = Node.objects.get(name=name)
    assert node.state == NodeState.SERVING
    return node


def beat(name: str, at: float) -> None:
    """A beat sent and taken in at `at`."""
    hot.heartbeat(name, at, "serving", {"running": 1, "waiting": 0}, taken=at)


def forget_heartbeat_history() -> None:
    """Start the control plane's record of when it last took a heartbeat afresh (the setup's beats set it)."""
    hot.client().delete(hot.keys().heartbeats_ingested, hot.keys().heartbeats_resumed)


def last_heard(ago: float, names=("node-a", "node-b")) -> float:
    """`names` SERVING, each last heard `ago` seconds before now, and nothing heard since; returns now."""
    for name in names:
        serving_node(name)
    forget_heartbeat_history()
    now = time.time()
    for name in names:
        beat(name, now - ago)
    return now


# --- 2. Silence of the control plane's own making -----------------------------------------------------------------
@pytest.mark.django_db
def test_a_node_silent_only_while_the_control_plane_was_deaf_gets_a_whole_allowance(namespace, settings):
    settings.LIFELINE_HEARTBEAT_MISS_S = 3.0
    now = last_heard(10)
    # Then nothing came in for 10 s (the web process restarted, Redis was away); node-a is heard first.
    beat("node-a", now)
    assert now <= hot.heartbeats_resumed_at() <= time.time()  # when it was taken in
    assert float(hot.client().get(hot.keys().heartbeats_ingested)) == now
    # node-b's last beat is 10 s old, but heartbeats only came in again just now: it has its allowance from then.
    assert nodes.mark_silent_nodes_down() == []
    assert Node.objects.get(name="node-b").state == NodeState.SERVING

    # The resumption was more than an allowance ago and node-b said nothing since: that silence is its own.
    hot.client().set(hot.keys().heartbeats_resumed, time.time() - 3.0 - 1.0)
    beat("node-a", time.time())  # the fleet beats on (no gap: the resumption stays where it was)
    assert hot.heartbeats_resumed_at() < time.time() - 3.0
    assert nodes.mark_silent_nodes_down() == ["node-b"]
    node_b = Node.objects.get(name="node-b")
    assert node_b.state == NodeState.DOWN
    last = NodeTransition.objects.filter(node=node_b).order_by("-at", "-id").first()
    assert (last.old_state, last.new_state, last.actor) == (NodeState.SERVING, NodeState.DOWN, "system")
    assert last.cause.startswith("no heartbeat for 1") and "(allowed 3 s)" in last.cause
    assert Node.objects.get(name="node-a").state == NodeState.SERVING


@pytest.mark.django_db
def test_after_a_deafness_the_allowance_runs_from_when_beats_are_taken_in_not_from_their_start(namespace, settings):
    """The chaos run at 56d49ac (2026-12-07): after a web restart and an empty Redis, the web just started took beats
    in seconds after they came; the first one taken in ended the deafness, and the allowance ran from when that beat
    had started, so three nodes whose beats were still waiting in the web were marked DOWN 3 s later."""
    settings.LIFELINE_HEARTBEAT_MISS_S = 3.0
    settings.LIFELINE_HEARTBEAT_INTERVAL_S = 1.0
    now = last_heard(6.0)
    hot.heartbeat("node-a", now - 3.2, "serving", {"running": 1, "waiting": 0})  # sent 3.2 s ago, taken in now
    assert hot.heartbeats_resumed_at() >= now
    assert nodes.mark_silent_nodes_down() == []  # node-b's beat may wait in the same queue
    assert Node.objects.get(name="node-b").state == NodeState.SERVING


@pytest.mark.django_db
def test_a_backlog_of_beats_taken_in_at_once_after_a_deafness_gives_every_node_its_allowance(namespace, settings):
    """The chaos runs at 56d49ac and 829d875 (2026-12-07): after a web restart and an empty Redis, the new web
    process took in at once beats sent over the seconds before, each within an interval of the one before: judged
    by when they were sent, no gap showed, no resumption was marked, and the nodes whose beats were still on their
    way were marked DOWN 6 s into a deafness the sweep had logged."""
    settings.LIFELINE_HEARTBEAT_MISS_S = 3.0
    settings.LIFELINE_HEARTBEAT_INTERVAL_S = 1.0
    now = last_heard(6.0)
    for ago in (4.8, 3.6, 2.4, 1.2, 0.1):  # node-a's backlog, sent 1.2 s apart, all taken in now
        hot.heartbeat("node-a", now - ago, "serving", {"running": 1, "waiting": 0})
    assert hot.heartbeats_resumed_at() >= now
    assert nodes.mark_silent_nodes_down() == []  # node-b's beats may be in the same backlog
    assert Node.objects.get(name="node-b").state == NodeState.SERVING


@pytest.mark.django_db
def test_the_first_beat_after_redis_restarted_empty_gives_every_node_restored_under_watch_its_allowance(
    namespace, settings
):
    """A chaos run on 2026-12-07 (a web restart, then Redis restarted empty): the hot state's restore put the nodes
    back under watch as seen at the restore; the first beat after it found no record of hearing in Redis, marked no
    resumption, and 1.1 s after the sweep had logged the control plane deaf it marked the five nodes whose beats had
    not come yet DOWN, 4.3 s after the restore."""
    settings.LIFELINE_HEARTBEAT_MISS_S = 3.0
    settings.LIFELINE_HEARTBEAT_INTERVAL_S = 1.0
    for name in ("node-a", "node-b", "node-c"):
        serving_node(name)
    wipe(namespace)  # Redis restarted empty
    now = time.time()
    hot.client().zadd(hot.keys().heartbeats, {n: now - 4.3 for n in ("node-a", "node-b", "node-c")})  # the restore
    beat("node-a", now - 0.1)  # the first beat taken in since
    assert nodes.mark_silent_nodes_down() == []  # node-b's and node-c's beats may be on their way
    assert set(Node.objects.values_list("state", flat=True)) == {NodeState.SERVING}
    assert hot.heartbeats_resumed_at() == pytest.approx(now - 0.1)  # their allowance runs from that first beat


@pytest.mark.django_db
def test_the_beat_that_ends_a_deafness_landing_during_the_judgement_gives_every_node_its_allowance(
    namespace, settings, monkeypatch
):
    """The race a chaos run hit (2026-12-06): the control plane was deaf for 5 s (a web restart, then Redis
    restarted); the judgement scanned the silent nodes, and before it asked whether the control plane was deaf the
    first beat after the gap landed. Seeing that beat it was no longer deaf, and with the resumption read before the
    beat, it marked every node not yet heard again DOWN."""
    settings.LIFELINE_HEARTBEAT_MISS_S = 3.0
    settings.LIFELINE_HEARTBEAT_INTERVAL_S = 1.0
    last_heard(5.1)
    scan = hot.silent_nodes

    def scan_then_a_beat_lands(since):
        found = scan(since)
        beat("node-a", time.time())  # the first beat after the gap: it ends the deafness
        return found

    monkeypatch.setattr(hot, "silent_nodes", scan_then_a_beat_lands)
    assert nodes.mark_silent_nodes_down() == []
    assert Node.objects.get(name="node-b").state == NodeState.SERVING  # its allowance runs from the resumption


@pytest.mark.django_db
def test_a_fleet_turning_silent_one_node_at_a_time_while_the_control_plane_is_deaf_is_not_marked_down(
    namespace, settings
):
    """The nodes beat out of phase: when the control plane stops hearing them (its web process restarting) they
    turn silent one by one over an interval. Seen in the chaos soak: five of eight healthy nodes marked DOWN, the
    model's degradation level raised to 3, before the rest were silent too."""
    settings.LIFELINE_HEARTBEAT_MISS_S = 3.0
    settings.LIFELINE_HEARTBEAT_INTERVAL_S = 1.0
    names = [f"node-{i}" for i in range(8)]
    for name in names:
        serving_node(name)
    forget_heartbeat_history()
    now = time.time()
    for i, name in enumerate(names):  # the last beat each node got in, spread over the interval before the web died
        beat(name, now - 3.5 + i / 8)
    silent = hot.silent_nodes(now - 3.0)
    assert 0 < len(silent) < len(names)  # some silent past a miss already, the others not yet
    assert nodes.mark_silent_nodes_down() == []
    assert set(Node.objects.filter(name__in=names).values_list("state", flat=True)) == {NodeState.SERVING}

    # The control plane hears node-7 again; more than a miss after that, the nodes it has not heard since are down.
    beat("node-7", time.time())
    assert hot.heartbeats_resumed_at() > now  # a gap no listening control plane has: its deafness ended
    hot.client().set(hot.keys().heartbeats_resumed, time.time() - 4.0)
    downed = nodes.mark_silent_nodes_down()  # those silent past a miss by now: node-0 to node-3 at least
    assert set(names[:4]) <= set(downed) <= set(names[:7]), downed


@pytest.mark.django_db
def test_nodes_put_back_under_watch_after_redis_lost_them_do_not_hide_a_deafness_that_follows(namespace, settings):
    """The loaded suite run's chaos test (2026-12-07): Redis restarted empty, three nodes' beats reached it, then the
    web process (restarted too, on a host with a CPU hog) took no heartbeat for 4.3 s. The hot state's restore had put
    the other nodes back under watch as seen at the restore; the newest of those scores read as a beat, the control
    plane was judged to hear the fleet, and the three nodes that had beaten were marked DOWN."""
    settings.LIFELINE_HEARTBEAT_MISS_S = 3.0
    settings.LIFELINE_HEARTBEAT_INTERVAL_S = 1.0
    names = [f"node-{i}" for i in range(4)]
    for name in names:
        serving_node(name)
    wipe(namespace)  # Redis restarted empty
    now = time.time()
    for node in Node.objects.filter(name__in=names[:2]):  # two beats reach it (record_heartbeat's rebuild), 4.3 s ago
        hot.record_node(node.name, node.session, node.state, node.address, watch=True)
        beat(node.name, now - 4.3)
    routing.sync_hot_state()  # the restore: the other two under watch again, as seen now
    assert {name for name, _ in hot.silent_nodes(time.time() - 3.0)} == set(names[:2])
    assert nodes.mark_silent_nodes_down() == []  # no beat taken in for 4.3 s: the control plane is deaf
    assert set(Node.objects.filter(name__in=names).values_list("state", flat=True)) == {NodeState.SERVING}

    # Once it hears a node again, a node it does not hear within a miss is down as usual.
    beat("node-2", time.time())
    hot.client().set(hot.keys().heartbeats_resumed, time.time() - 4.0)
    assert set(nodes.mark_silent_nodes_down()) == set(names[:2])


@pytest.mark.django_db
def test_a_registration_that_ends_a_deafness_starts_every_nodes_allowance_as_a_beat_does(namespace, settings):
    """A registration is the control plane hearing a node too: it counts as the last beat taken in (the deafness
    check reads that), and when it is the first thing heard after a gap, the gap's silence is forgiven from it."""
    settings.LIFELINE_HEARTBEAT_MISS_S = 3.0
    settings.LIFELINE_HEARTBEAT_INTERVAL_S = 1.0
    now = last_heard(5.1)
    serving_node("node-c")  # its registration is the first the control plane hears for 5 s
    assert hot.heartbeats_resumed_at() >= now
    assert nodes.mark_silent_nodes_down() == []  # node-a and node-b: their allowance runs from the registration


@pytest.mark.django_db
def test_a_beat_finding_redis_behind_the_database_writes_the_mirror_again_instead_of_failing(namespace):
    """The same run: a node's JOIN -> SERVING committed while Redis was paused, so the step's publish never reached
    Redis; every later beat read JOIN there, asked the database for SERVING -> SERVING and got a 500."""
    node = serving_node("node-a")
    hot.client().hset(hot.keys().node("node-a"), "state", NodeState.JOIN)  # the publish that was lost
    state = nodes.record_heartbeat("node-a", Heartbeat(session=node.session, load=Load(running=1, waiting=0)))
    assert state == NodeState.SERVING and hot.node("node-a").state == NodeState.SERVING
    assert NodeTransition.objects.filter(node=node, new_state=NodeState.SERVING).count() == 1

    # Marked DOWN meanwhile (the database says so, Redis still says JOIN): its session is closed, as ever.
    Node.objects.filter(pk=node.pk).update(state=NodeState.DOWN)
    hot.client().hset(hot.keys().node("node-a"), "state", NodeState.JOIN)
    with pytest.raises(nodes.ClosedSession, match="register again"):
        nodes.record_heartbeat("node-a", Heartbeat(session=node.session, load=Load(running=1, waiting=0)))
    assert hot.node("node-a").state == NodeState.DOWN


@pytest.mark.django_db
def test_one_node_silent_while_the_rest_of_the_fleet_beats_is_down_at_once(namespace, settings):
    settings.LIFELINE_HEARTBEAT_MISS_S = 3.0
    now = last_heard(10)
    for ago in range(9, -1, -1):  # node-a every second, node-b never again: the control plane was listening
        beat("node-a", now - ago)
    # The first beat Redis holds marks a resumption (node-b's allowance runs from it, 10 s ago); no gap after it.
    assert hot.heartbeats_resumed_at() == pytest.approx(now - 10)
    assert nodes.mark_silent_nodes_down() == ["node-b"]
    assert Node.objects.get(name="node-b").state == NodeState.DOWN
    assert Node.objects.get(name="node-a").state == NodeState.SERVING


# --- 3. A gateway keeps routing when Redis restarts empty -----------------------------------------------------------
ROUTE = {"address": "http://127.0.0.1:9101", "model": "Qwen3-32B", "rack": "rack-a", "gpu": "H100-SXM", "tp": 1}


async def test_the_gateway_routes_on_its_last_copy_while_redis_has_lost_the_hot_state(namespace, caplog):
    hot.publish_cluster_config({"tau_tokens": 777})
    hot.publish_gateway_keys({"digest-1": {"id": 1, "tenant": "acme", "tier": "standard"}})
    hot.publish_routing({"node-a": ROUTE}, deployed_models=["Qwen3-32B"])
    view = RoutingView(os.environ["REDIS_URL"], namespace)
    try:
        await view.reload()
        assert set(view.routes) == {"node-a"} and view.config.tau_tokens == 777
        assert view.hot_state_missing is False

        assert wipe(namespace) > 0  # Redis restarted empty
        caplog.set_level(logging.WARNING, logger="recovery.gateway.table")
        await view.reload()
        await view.reload()
        assert view.hot_state_missing is True
        assert set(view.routes) == {"node-a"} and view.routes["node-a"].address == ROUTE["address"]
        assert set(view.tenants) == {"digest-1"} and view.config.tau_tokens == 777
        assert view.deployed == frozenset({"Qwen3-32B"})
        said = [r.getMessage() for r in caplog.records if r.name == "recovery.gateway.table"]
        assert len(said) == 1 and "hot state is missing" in said[0]  # said once, not at every reload

        # The control plane writes it back: an empty fleet this time, which the gateway follows.
        hot.publish_cluster_config({"tau_tokens": 512})
        hot.publish_routing({}, deployed_models=[])
        await view.reload()
        assert view.hot_state_missing is False
        assert view.routes == {} and view.deployed == frozenset() and view.config.tau_tokens == 512
    finally:
        await view.close()


async def test_a_part_of_the_hot_state_written_before_the_whole_is_not_read_as_the_fleet(namespace):
    """After Redis restarted empty, a node's change may publish the routing table before the control plane
    rewrites the whole (keys, settings): a gateway reading that part alone refused every key with a 401 (the
    chaos soak found it). It keeps its last copy until the mark of a whole write is back."""
    hot.publish_hot_state(
        {"node-a": ROUTE},
        ["Qwen3-32B"],
        {"digest-1": {"id": 1, "tenant": "acme", "tier": "standard"}},
        {"tau_tokens": 777},
    )
    view = RoutingView(os.environ["REDIS_URL"], namespace)
    try:
        await view.reload()
        assert set(view.tenants) == {"digest-1"} and view.hot_state_missing is False and hot.hot_state_present()

        wipe(namespace)
        hot.publish_routing({"node-a": ROUTE, "node-b": {**ROUTE, "address": "http://127.0.0.1:9102"}}, ["Qwen3-32B"])
        hot.publish_cluster_config({"tau_tokens": 512})  # a level change, say: still not the whole
        assert not hot.hot_state_present()
        await view.reload()
        assert view.hot_state_missing is True
        assert set(view.tenants) == {"digest-1"} and set(view.routes) == {"node-a"} and view.config.tau_tokens == 777

        two = {"node-a": ROUTE, "node-b": {**ROUTE, "address": "http://127.0.0.1:9102"}}
        hot.publish_hot_state(
            two, ["Qwen3-32B"], {"digest-2": {"id": 2, "tenant": "acme", "tier": "standard"}}, {"tau_tokens": 512}
        )
        await view.reload()
        assert view.hot_state_missing is False
        assert set(view.tenants) == {"digest-2"} and set(view.routes) == {"node-a", "node-b"}
        assert view.config.tau_tokens == 512
    finally:
        await view.close()


@pytest.mark.django_db
def test_the_control_plane_rewrites_the_hot_state_in_one_transaction(namespace):
    """Every part in one MULTI/EXEC: a gateway reading between two parts would route without the keys."""
    serving_node("node-a")
    key_actions.create_api_key("acme", "standard", "outage test")
    wipe(namespace)
    # MONITOR shows every client of this Redis, the other test processes' too (a CI run read another's block): the
    # blocks are kept per connection, and only those that write this test's keys are looked at.
    blocks, open_blocks = [], {}
    with hot.client().monitor() as monitor:
        routing.sync_hot_state()
        for command in monitor.listen():
            client, text = (command.get("client_address"), command.get("client_port")), command["command"]
            word = text.split()[0].upper()
            if word == "MULTI":
                open_blocks[client] = []
            elif word == "EXEC" and client in open_blocks:
                block = open_blocks.pop(client)
                if any(namespace in written for _, written in block):
                    blocks.append([w for w, _ in block])
                    if "PUBLISH" in blocks[-1]:
                        break
            elif client in open_blocks:
                open_blocks[client].append((word, text))
    block = blocks[-1]  # the first block with a PUBLISH: the one that tells the gateways
    for written in ("HSET", "SET", "PUBLISH"):
        assert written in block, block
    assert block.count("HSET") == 2 and block.count("SET") == 3  # routing and keys; models, config, the mark


async def test_an_empty_fleet_published_by_the_control_plane_clears_the_routes(namespace):
    hot.publish_cluster_config({"tau_tokens": 512})
    hot.publish_routing({"node-a": ROUTE}, deployed_models=["Qwen3-32B"])
    view = RoutingView(os.environ["REDIS_URL"], namespace)
    try:
        await view.reload()
        assert set(view.routes) == {"node-a"}
        hot.publish_routing({}, deployed_models=[])  # every node left: the keys are there, the table empty
        await view.reload()
        assert view.routes == {} and view.hot_state_missing is False
        # A gateway that starts on an empty Redis has no copy to keep: it loads the nothing there is.
        wipe(namespace)
        fresh = RoutingView(os.environ["REDIS_URL"], namespace)
        try:
            await fresh.reload()
            assert fresh.loaded.is_set() and fresh.routes == {} and fresh.hot_state_missing is False
        finally:
            await fresh.close()
    finally:
        await view.close()


# --- 4. The control plane writes the hot state back ---------------------------------------------------------------
@pytest.mark.django_db
def test_the_hot_state_lost_by_redis_is_written_back_from_the_database_once(namespace):
    serving_node("node-a")
    key, _ = key_actions.create_api_key("acme", "standard", "outage test")
    routing.sync_hot_state()
    assert routing.restore_hot_state_if_lost() is False  # nothing lost: nothing written

    assert wipe(namespace) > 0  # Redis restarted empty
    assert hot.routing_table() == {} and not hot.hot_state_present()
    assert tasks.restore_hot_state.apply().get() is True  # the beat task, every second
    assert set(hot.routing_table()) == {"node-a"}
    assert hot.routing_table()["node-a"]["address"] == Node.objects.get(name="node-a").address
    assert set(hot.client().hgetall(hot.keys().gateway_keys)) == {key.digest}
    assert hot.client().get(hot.keys().cluster_config) is not None
    assert hot.client().get(hot.keys().deployed_models) == '["Qwen3-32B"]'
    assert hot.node("node-a").session == Node.objects.get(name="node-a").session

    assert routing.restore_hot_state_if_lost() is False  # written back once, not at every tick
    assert "restore-hot-state" in django_settings.CELERY_BEAT_SCHEDULE
    entry = django_settings.CELERY_BEAT_SCHEDULE["restore-hot-state"]
    assert entry["task"] == tasks.restore_hot_state.name and entry["schedule"] <= 1.0


# --- 5. Celery tasks wait out a store that is away -----------------------------------------------------------------
@app.task(name="tests.store_outages.read_redis", shared=False)
def read_redis() -> str:
    """Not periodic: what an action queued for later looks like."""
    return hot.client().get(hot.keys().cluster_config)


@app.task(name="tests.store_outages.wrong_redis_value", shared=False)
def wrong_redis_value() -> None:
    hot.client().set(hot.keys().node("outage-test"), {"not": "a string"})  # a real redis DataError: a bug


def warnings_of(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "console.celery"]


def test_every_lifeline_task_is_of_the_outage_aware_class():
    assert isinstance(tasks.restore_hot_state, Task) and isinstance(read_redis, Task)


# The outage paths close broken database connections, which would end a test's wrapping transaction.
@pytest.mark.django_db(transaction=True)
def test_a_periodic_task_whose_store_is_away_skips_its_tick_with_one_line(redis_away, caplog):
    caplog.set_level(logging.INFO)
    assert tasks.restore_hot_state.name in {e["task"] for e in django_settings.CELERY_BEAT_SCHEDULE.values()}
    result = tasks.restore_hot_state.apply()
    assert result.state == "IGNORED"
    said = warnings_of(caplog)
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    message = said[0].getMessage()
    assert message.startswith("recovery.tasks.restore_hot_state skipped: the Redis is unavailable (Error ")
    assert message.endswith("); the next tick runs it")
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []  # no traceback


@pytest.mark.django_db(transaction=True)
def test_a_queued_task_whose_store_is_away_is_retried_with_backoff_then_fails(redis_away, caplog):
    caplog.set_level(logging.INFO)
    # Retried (apply() runs the retries at once, eagerly), with the countdown doubling up to the cap.
    result = read_redis.apply()
    said = [r.getMessage() for r in warnings_of(caplog)]
    assert all("tests.store_outages.read_redis: the Redis is unavailable" in m for m in said)
    countdowns = [int(m.rsplit("retrying in ", 1)[1].split()[0]) for m in said]
    assert countdowns == [1, 2, 4, 8, 16, 32, 60, 60, 60, 60, 60, 60, 60]  # 12 retries, then it fails for good
    assert result.state == "FAILURE" and isinstance(result.result, redis.ConnectionError)


@pytest.mark.django_db(transaction=True)
def test_one_retry_is_a_celery_retry_with_the_countdown_of_its_attempt(redis_away):
    for retries, countdown in ((0, 1), (3, 8), (7, 60)):
        read_redis.push_request(called_directly=False, retries=retries, is_eager=True, id=f"try-{retries}")
        try:
            with pytest.raises(Retry) as raised:
                read_redis()
        finally:
            read_redis.pop_request()
        assert raised.value.when == countdown
        assert isinstance(raised.value.exc, redis.ConnectionError)


@pytest.mark.django_db(transaction=True)
def test_a_task_called_directly_while_its_store_is_away_raises(redis_away):
    with pytest.raises(redis.ConnectionError):
        tasks.restore_hot_state()
    with pytest.raises(redis.ConnectionError):
        read_redis()


@pytest.mark.django_db(transaction=True)
def test_a_failure_that_is_not_an_outage_still_fails(caplog, settings, monkeypatch):
    caplog.set_level(logging.INFO)
    result = wrong_redis_value.apply()
    assert result.state == "FAILURE" and isinstance(result.result, redis.DataError)
    assert warnings_of(caplog) == []  # neither skipped nor retried
    # The same task with its store away waits it out instead.
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setattr(hot, "_client", None)
    monkeypatch.setattr(hot, "_client_pid", None)
    wrong_redis_value.push_request(called_directly=False, retries=0, is_eager=True, id="away")
    try:
        with pytest.raises(Retry):
            wrong_redis_value()
    finally:
        wrong_redis_value.pop_request()
