"""A start of the control plane is not an emergency (issue 18), against the real database and Redis: nodes that
join after a start are not a capacity loss, the level left from the previous run is evaluated afresh, a node of the
previous run found gone opens no incident and promotes no spare; a node that served since the start and dies is a
loss at once."""

import datetime as dt
import time

import pytest
from django.utils import timezone

from console.readmodels.degradation import degradation
from recovery import hot
from recovery.actions import capacity, incidents, nodes, routing
from recovery.choices import NodeState
from recovery.models import RETURNING_WITHIN_S, Cluster, Incident, Node, NodeTransition
from recovery.policy.capacity import node_capacity
from tests.recovery.test_health import configure, objective, register
from workers.catalog import Deployment

pytestmark = pytest.mark.django_db


def _one_node_rps() -> float:
    return node_capacity(Deployment.of("Qwen3-32B", "H100-SXM", 1), capacity.slo_of("Qwen3-32B")).rps


def _previous_run(commit, names, level):
    """A fleet that served before the stop, and the level it was left at."""
    for name in names:
        commit(register, name)
    objective(required_rps=(len(names) - 0.2) * _one_node_rps(), degradation_level=level, degradation_better_since=None)
    configure(degradation_hold_s=30, degradation_margin=0.05, startup_grace_s=120)


def _restart(commit, names):
    """The stack starts again: the control plane first, then the nodes register with new sessions (JOIN)."""
    level = commit(capacity.control_plane_started)
    for name in names:
        commit(register, name, serving=False)
    return level


def test_a_level_left_from_the_previous_run_is_evaluated_afresh_and_joining_nodes_do_not_raise_it(commit, tokens):
    names = [f"su-a-{i}" for i in range(4)]
    _previous_run(commit, names, level=4)

    assert _restart(commit, names) == 0  # at once: the level 4 of the last run is not held for 30 s
    assert commit(capacity.evaluate) == 0  # four nodes joining, none serving: not a loss
    figures = capacity.report()
    assert figures.in_service == 0 and sorted(figures.starting) == names
    assert figures.ratio == 0 and figures.ratio_once_started > 1
    change = Cluster.default().degradation_changes.latest("at")
    assert (change.old_level, change.new_level) == (4, 0) and "afresh" in change.cause

    banner = degradation()
    assert banner["level"] == 0 and banner["starting"]["nodes"] == names
    assert "not served since" in banner["starting"]["reason"]
    config = hot.client().get(hot.keys().cluster_config)
    assert '"starting_until"' in config and Cluster.default().starting_until() > time.time()


def test_a_node_that_served_since_the_start_and_dies_is_a_loss_at_once(commit, tokens):
    names = [f"su-b-{i}" for i in range(4)]
    _previous_run(commit, names, level=0)
    _restart(commit, names)
    for node in Node.objects.filter(name__in=names[:2]):
        commit(nodes.transition_node, node, NodeState.SERVING, "model loaded")
    assert commit(capacity.evaluate) == 0  # two serving, two joining

    commit(nodes.transition_node, Node.objects.get(name=names[0]), NodeState.DOWN, "killed")
    assert commit(capacity.evaluate) == 1  # three of 3.8: it served, so it is lost, grace or not
    figures = capacity.report()
    assert names[0] not in figures.starting and sorted(figures.starting) == names[2:]


def test_a_node_that_turns_serving_while_capacity_is_read_is_joining_or_serving_never_lost(commit, tokens, monkeypatch):
    """The restart e2e test once saw a level rise at a start: a node turned SERVING between the read of the nodes
    in service and the read of the transitions since the start, and was counted neither serving nor joining."""
    names = [f"su-r-{i}" for i in range(3)]
    _previous_run(commit, names, level=0)
    _restart(commit, names)
    read_live = hot.nodes

    def turning_serving(*args, **kwargs):  # read between the nodes and what the capacity is judged by
        node = Node.objects.get(name=names[0])
        if node.state == NodeState.JOIN:
            commit(nodes.transition_node, node, NodeState.SERVING, "model loaded")
        return read_live(*args, **kwargs)

    monkeypatch.setattr(hot, "nodes", turning_serving)
    figures = capacity.report(model="Qwen3-32B")
    assert figures.in_service + len(figures.starting) == 3, figures
    assert figures.ratio_once_started > 1
    monkeypatch.setattr(hot, "nodes", read_live)
    assert commit(capacity.evaluate) == 0
    assert capacity.report().in_service == 1  # the next reading sees it serving


def test_the_grace_ends_when_the_fleet_is_whole(commit, tokens):
    names = [f"su-c-{i}" for i in range(4)]
    _previous_run(commit, names, level=0)
    _restart(commit, names)
    assert capacity.report().starting
    for node in Node.objects.filter(name__in=names):
        commit(nodes.transition_node, node, NodeState.SERVING, "model loaded")
    assert capacity.report().starting == []  # the usual size: nothing joins any more
    commit(capacity.evaluate)
    assert degradation()["starting"] is None


def test_the_grace_ends_with_its_time_and_nodes_that_never_came_are_a_loss(commit, tokens):
    names = [f"su-g-{i}" for i in range(4)]
    _previous_run(commit, names, level=0)
    _restart(commit, names)
    for node in Node.objects.filter(name__in=names[2:]):
        commit(nodes.transition_node, node, NodeState.SERVING, "model loaded")
    assert commit(capacity.evaluate) == 0  # two serving, two still loading: not a loss yet
    configure(control_plane_started_at=timezone.now() - dt.timedelta(seconds=121))
    assert capacity.report().starting == []
    assert commit(capacity.evaluate) == 2  # two of 3.8 nodes: 53%
    assert degradation()["starting"] is None
    assert "starting" not in Cluster.default().degradation_changes.latest("at").cause


def test_a_node_of_the_previous_run_found_gone_opens_no_incident_and_promotes_no_spare(commit, tokens, react, settings):
    settings.LIFELINE_HEARTBEAT_MISS_S = 0.5
    gone, _ = commit(register, "su-d-gone")
    spare, _ = commit(register, "su-d-spare", spare=True)
    Node.objects.filter(pk=gone.pk).update(session_started_at=timezone.now() - dt.timedelta(minutes=5))
    time.sleep(0.05)
    commit(capacity.control_plane_started)
    for _ in range(3):  # the spare came back and beats (a gap longer than a miss would be the control plane's)
        time.sleep(0.2)
        hot.heartbeat("su-d-spare", time.time(), "serving", {})
    assert commit(nodes.mark_silent_nodes_down) == ["su-d-gone"]
    react()
    down = NodeTransition.objects.filter(node__name="su-d-gone", new_state=NodeState.DOWN).get()
    assert down.actor == nodes.STARTUP and "not heard since the control plane started" in down.cause
    spare.refresh_from_db()
    assert spare.spare and incidents.open_incident_for(gone) is None
    assert not Incident.objects.exists()


def test_a_node_heard_since_the_start_that_goes_silent_is_a_failure(commit, tokens, react, settings):
    settings.LIFELINE_HEARTBEAT_MISS_S = 0.5
    commit(capacity.control_plane_started)
    node, _ = commit(register, "su-e-node")  # registered and heard after the start
    spare, _ = commit(register, "su-e-spare", spare=True)
    for _ in range(3):  # the spare beats; the node does not
        time.sleep(0.2)
        hot.heartbeat("su-e-spare", time.time(), "serving", {})
    assert commit(nodes.mark_silent_nodes_down) == ["su-e-node"]
    react()
    down = NodeTransition.objects.filter(node=node, new_state=NodeState.DOWN).get()
    assert down.actor == "system" and "no heartbeat" in down.cause
    spare.refresh_from_db()
    assert not spare.spare and incidents.open_incident_for(node) is not None


def test_celery_beat_starting_is_the_control_plane_starting(commit, tokens):
    """In production the control plane starts with beat (exactly one runs): its start is where the grace begins."""
    from celery.signals import beat_init

    import console.celery  # noqa: F401 (connects the receiver, as the beat process does)

    hot.client().delete(hot.keys().heartbeats_ingested)  # the control plane's first start: no heartbeat taken in yet
    before = timezone.now()
    commit(beat_init.send, sender=None)
    started = Cluster.default().state.control_plane_started_at
    assert started is not None and started >= before


def test_beat_restarting_alone_while_the_fleet_is_heard_is_not_a_start_and_a_node_dead_meanwhile_is_a_failure(
    commit, tokens, react, settings
):
    """The chaos soak's beat restart: while beat was away no sweep ran, a node died, and beat's start was stamped as
    the control plane's; the dead node, last heard before it, was judged a session of a previous run (gone, actor
    startup) and no incident opened. The web process heard the fleet all along: beat alone restarted, not a start."""
    from celery.signals import beat_init

    import console.celery  # noqa: F401

    settings.LIFELINE_HEARTBEAT_MISS_S = 0.5
    commit(capacity.control_plane_started)
    configure(control_plane_started_at=timezone.now() - dt.timedelta(minutes=10))
    started = Cluster.default().state.control_plane_started_at
    node, _ = commit(register, "su-j-node")
    spare, _ = commit(register, "su-j-spare", spare=True)
    for name in ("su-j-node", "su-j-spare"):
        hot.heartbeat(name, time.time(), "serving", {})
    Node.objects.filter(pk__in=(node.pk, spare.pk)).update(session_started_at=started + dt.timedelta(minutes=1))
    # su-j-node dies; beat restarts while the spare is still heard.
    commit(beat_init.send, sender=None)
    assert Cluster.default().state.control_plane_started_at == started  # not moved: beat alone restarted
    for _ in range(3):
        time.sleep(0.2)
        hot.heartbeat("su-j-spare", time.time(), "serving", {})
    assert commit(nodes.mark_silent_nodes_down) == ["su-j-node"]
    react()
    down = NodeTransition.objects.get(node=node, new_state=NodeState.DOWN)
    assert down.actor == "system" and "no heartbeat" in down.cause
    assert incidents.open_incident_for(node) is not None


def test_beat_starting_after_the_fleet_went_unheard_longer_than_the_deaf_allowance_is_a_start(commit, tokens, settings):
    settings.LIFELINE_HEARTBEAT_DEAF_MAX_S = 5
    six_ago = time.time() - 6
    hot.heartbeat("su-k", six_ago, "serving", {}, taken=six_ago)  # the last beat taken in: 6 s ago, the web away
    before = timezone.now()
    assert capacity.beat_started() is not None
    assert Cluster.default().state.control_plane_started_at >= before
    hot.heartbeat("su-k", time.time(), "serving", {})
    later = Cluster.default().state.control_plane_started_at
    assert capacity.beat_started() is None and Cluster.default().state.control_plane_started_at == later


def test_beat_starting_while_redis_is_away_waits_for_it_instead_of_losing_the_start(commit, tokens, monkeypatch):
    """Beat restarted during a Redis outage (the chaos soak's beat restart beside a Redis pause): its start-up step
    failed once and was lost for good. It waits the outage out, as a task does, and then completes."""
    import redis
    from celery.signals import beat_init

    import console.celery

    real_evaluate, calls, waits = capacity.evaluate, [], []

    def evaluate_while_redis_is_paused(*args, **kwargs):
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise redis.exceptions.TimeoutError("Timeout reading from socket")
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(capacity, "evaluate", evaluate_while_redis_is_paused)
    monkeypatch.setattr(console.celery, "sleep", waits.append)
    hot.client().delete(hot.keys().heartbeats_ingested)
    before = timezone.now()
    results = commit(beat_init.send, sender=None)
    assert [error for _, error in results if isinstance(error, Exception)] == []  # nothing raised into Celery's log
    assert len(calls) == 3 and waits == [1, 2]  # backoff, then the start went through
    assert Cluster.default().state.control_plane_started_at >= before


def test_a_node_lost_after_beat_alone_restarts_is_a_loss_not_a_joining_node(commit, tokens, react, settings):
    """Beat restarting while the fleet serves stamps the control plane's start again: the nodes' SERVING is from
    before it. One that dies in the grace is still a loss: the level rises at once (a CI run caught it masked)."""
    names = [f"su-f-{i}" for i in range(3)]
    _previous_run(commit, names, level=0)  # serving, heard all along
    objective(required_rps=2.8 * _one_node_rps())
    for name in names:
        hot.heartbeat(name, time.time(), "serving", {})
    commit(capacity.control_plane_started)  # beat alone restarts
    assert capacity.report().starting == []
    gone = Node.objects.get(name="su-f-0")
    commit(nodes.transition_node, gone, NodeState.DOWN, "gateway reported it")
    figures = capacity.report()
    assert figures.starting == [] and figures.in_service == 2
    assert commit(capacity.evaluate) >= 1


def test_nodes_that_left_as_the_stack_stopped_are_expected_back(commit, tokens):
    """A clean stop sends every node away (deregistered: LEFT). Started again, the fleet's usual size is still the
    nodes of the last run: the first ones back are not the whole fleet, the others are joining, not lost, and their
    model is still served (a request waits, rather than hears the model does not exist). A CI run caught the level
    rising to 2 with two of three nodes back."""
    names = [f"su-h-{i}" for i in range(3)]
    _previous_run(commit, names, level=0)
    for node in Node.objects.filter(name__in=names):
        commit(nodes.deregister_node, node.name, node.session, "stopping (SIGTERM)")
    assert routing.deployed_models() == []  # stopped: nothing is coming back until the control plane starts

    commit(capacity.control_plane_started)
    assert "Qwen3-32B" in routing.deployed_models()
    for name in names[:2]:
        commit(register, name)  # two are back and serve; the third has not registered yet
    figures = capacity.report()
    assert figures.in_service == 2 and figures.starting == [names[2]]
    assert commit(capacity.evaluate) == 0

    # The grace over, a node that never came back is not waited for: not a joining node, not a served model.
    configure(control_plane_started_at=timezone.now() - dt.timedelta(seconds=121))
    assert capacity.report().starting == []
    assert commit(capacity.evaluate) == 2  # two of 2.8 nodes


def test_a_node_that_left_long_before_the_start_is_not_expected_back(commit, tokens):
    names = [f"su-i-{i}" for i in range(3)]
    _previous_run(commit, names, level=0)
    retired = Node.objects.get(name=names[2])
    commit(nodes.deregister_node, retired.name, retired.session, "decommissioned")
    NodeTransition.objects.filter(node=retired, new_state=NodeState.LEFT).update(
        at=timezone.now() - dt.timedelta(seconds=RETURNING_WITHIN_S + 60)
    )
    commit(capacity.control_plane_started)
    assert capacity.report().starting == []


def test_a_session_of_the_previous_run_gets_no_canary_until_it_is_heard_again(commit, tokens):
    """After a restart of the stack, a node whose deregistration was lost is still SERVING at its old address: a
    canary there would fail and count the restart against its health (UNHEALTHY, weight 0: a capacity loss). It is
    left to the heartbeat sweep, which judges it by when the control plane started; heard again, it is canaried."""
    from recovery.actions import health

    commit(register, "su-old")
    commit(register, "su-heard")
    time.sleep(0.01)
    commit(capacity.control_plane_started)
    due = {Node.objects.get(pk=pk).name for pk, _ in commit(health.schedule_canaries)}
    assert "su-old" not in due and "su-heard" not in due
    hot.heartbeat("su-heard", time.time(), "serving", {"running": 0, "waiting": 0})
    commit(register, "su-new")  # a new session after the start
    due = {Node.objects.get(pk=pk).name for pk, _ in commit(health.schedule_canaries)}
    assert due == {"su-heard", "su-new"}
    assert Node.objects.get(name="su-old").health == "healthy"
