"""The node lifecycle: registration, heartbeats, DOWN, LEFT (source document 004).

Every lifecycle step goes through `transition_node`, which claims the change
with a conditional update, writes the transition row (the node's timeline,
its audit log and an outbox row) and publishes after the transaction commits.
What a step means beyond the node (a spare promoted, an incident, the batch
limit of the current degradation level) is recovery.reactions' to do, once it
committed: never on the node's own request path.
"""

import datetime as dt
import logging
import time

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from recovery import events, hot
from recovery.actions import health, routing
from recovery.choices import NodeState
from recovery.models import Cluster, Gpu, Node, NodeTransition, Rack
from recovery.policy import lifecycle
from workers import catalog
from workers.protocol import Heartbeat, ProtocolError, Registration

log = logging.getLogger(__name__)


# How a DOWN for silence begins its cause (a reaction asks whether such a node is partitioned, not dead).
SILENT = "no heartbeat for"

# The actor of lifecycle steps that only tidy up after a start of the control plane (a node of the previous
# run found gone): no incident, no spare promoted (recovery.reactions).
STARTUP = "start-up"


class UnknownNode(LookupError):
    def __init__(self, name: str):
        super().__init__(f"unknown node {name!r}: it must register first (POST /api/nodes/register)")


class ClosedSession(Exception):
    """A heartbeat or registration for a session the control plane has closed."""


def _epoch(ts: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC)


def transition_node(
    node: Node,
    new_state: str,
    cause: str,
    *,
    actor: str = "system",
    new_session: str | None = None,
    now: dt.datetime | None = None,
    **fields,
) -> bool:
    """Move `node` to `new_state` if nobody else moved it first.

    Returns False (and changes nothing) when the row is no longer in the
    state and session this caller saw. Extra `fields` are saved with the
    change. Publishes the change once the surrounding transaction commits.
    """
    lifecycle.check(node.state, new_state, new_session is not None)
    now = now or timezone.now()
    updates = {"state": new_state, "state_changed_at": now, **fields}
    if new_session is not None:
        updates["session"] = new_session
    with transaction.atomic():
        claimed = Node.objects.filter(pk=node.pk, state=node.state, session=node.session).update(**updates)
        if not claimed:
            return False
        NodeTransition.objects.create(
            node=node,
            session=new_session or node.session,
            old_state=node.state,
            new_state=new_state,
            at=now,
            cause=cause,
            actor=actor,
        )
        for name, value in updates.items():
            setattr(node, name, value)
        transaction.on_commit(lambda: _published(node))
    log.info("node %s -> %s: %s", node.name, new_state, cause)
    return True


def _mirror(node: Node) -> None:
    """Redis's copy of the node's session and state written again from the database, the record."""
    hot.record_node(node.name, node.session, node.state, node.address, watch=node.state in lifecycle.ALIVE)


def _published(node: Node) -> None:
    """After a lifecycle step commits: Redis, every gateway's routing table, the browser."""
    hot.record_node(
        node.name,
        node.session,
        node.state,
        node.address,
        watch=node.state in lifecycle.ALIVE,
        seen_now=node.state == NodeState.JOIN,  # only a registration (a new session) enters JOIN
    )
    routing.publish_routing()
    events.node_changed(node.pk)
    events.checkpoints_moved()  # a node joined or left the checkpoint distribution


# --- registration and heartbeats ---------------------------------------------------
def register_node(reg: Registration) -> Node:
    """Register a node session. A known name keeps its row and history."""
    deployment = _deployment(reg)
    now = timezone.now()
    with transaction.atomic():
        cluster = Cluster.default()
        rack, _ = Rack.objects.get_or_create(cluster=cluster, name=reg.rack)
        details = {
            "rack": rack,
            "address": reg.address,
            "host": reg.host,
            "server": reg.server,
            "nvl_domain": reg.nvl_domain,
            "network": reg.network,
            "provider": reg.provider,
            "region": reg.region,
            "pid": reg.pid,
            "model_key": deployment.model.key,
            "gpu_key": deployment.gpu.key,
            "tp": reg.tp,
            "engine": reg.engine,
            "capabilities": list(reg.capabilities),
            "last_seen_at": now,
        }
        node = Node.objects.select_for_update().filter(name=reg.name).first()
        if node is None:
            node = Node.objects.create(
                cluster=cluster,
                name=reg.name,
                session=reg.session,
                state=NodeState.JOIN,
                registered_at=now,
                session_started_at=now,
                state_changed_at=now,
                spare=reg.spare,
                **details,
            )
            NodeTransition.objects.create(
                node=node,
                session=reg.session,
                old_state="",
                new_state=NodeState.JOIN,
                at=now,
                cause=f"first registration from {reg.address} (pid {reg.pid} on {reg.host})",
            )
            transaction.on_commit(lambda: _published(node))
        elif node.session == reg.session:
            if node.state not in lifecycle.ALIVE:
                raise ClosedSession(
                    f"session {reg.session[:8]} of {reg.name} was closed when the node went {node.state} "
                    f"at {node.state_changed_at:%H:%M:%S}; register again with a new session"
                )
            # The same session again (its first answer was lost): refresh the details only.
            Node.objects.filter(pk=node.pk).update(**details)
            transaction.on_commit(lambda: _published(node))
        else:
            if node.state in lifecycle.ALIVE:
                _ended_unseen(node, reg, now)
                node.refresh_from_db()
            moved = f"; address {node.address} -> {reg.address}" if node.address != reg.address else ""
            cause = (
                f"new session {reg.session[:8]} registered (pid {reg.pid} on {reg.host}), "
                f"replacing {node.session[:8]} which was {node.state}{moved}"
            )
            transition_node(
                node, NodeState.JOIN, cause, new_session=reg.session, now=now, session_started_at=now, **details
            )
        _replace_gpus(node, reg)
    node.refresh_from_db()
    return node


def _ended_unseen(node: Node, reg: Registration, now: dt.datetime) -> None:
    """A new session from a node whose last one the control plane still takes for alive: its process ended without
    being seen (it restarted faster than heartbeats could tell, or while the control plane could not hear them, the
    database away, say), and what it was serving was lost. Its DOWN is written now, with its own cause, so that the
    node's timeline, the incident and a spare see the failure a slower restart would have shown them. A session of
    the run before the control plane started is judged as mark_silent_nodes_down judges it: gone, not failed."""
    started = Cluster.default().state.control_plane_started_at
    heard = node.last_seen_at.timestamp() if node.last_seen_at else None
    if _of_a_previous_run(node, heard, started):
        cause = f"session {node.session[:8]} ended before the control plane started at {started:%H:%M:%S} UTC"
        actor = STARTUP
    else:
        cause = (
            f"session {node.session[:8]} ended unseen: a new session {reg.session[:8]} registered "
            f"(pid {reg.pid} on {reg.host}) while it was {node.state}"
        )
        actor = "system"
    transition_node(node, NodeState.DOWN, cause, actor=actor, now=now)


def _deployment(reg: Registration) -> catalog.Deployment:
    try:
        model = catalog.model(reg.model)
    except catalog.CatalogError as exc:
        raise ProtocolError("model", str(exc)) from None
    try:
        gpu = catalog.gpu(reg.gpu)
    except catalog.CatalogError as exc:
        raise ProtocolError("gpu", str(exc)) from None
    try:
        return catalog.Deployment(model, gpu, reg.tp)
    except catalog.CatalogError as exc:
        raise ProtocolError("tp", str(exc)) from None


def _replace_gpus(node: Node, reg: Registration) -> None:
    seen = set()
    for g in reg.gpus:
        Gpu.objects.update_or_create(
            node=node, index=g.index, defaults={"uuid": g.uuid, "name": g.name, "memory_bytes": g.memory_bytes}
        )
        seen.add(g.index)
    node.gpus.exclude(index__in=seen).delete()


def record_heartbeat(name: str, beat: Heartbeat) -> str:
    """Note a heartbeat; the first one that reports the model ready makes the node SERVING.

    Returns the node's state after the beat.
    """
    now = time.time()
    entry = hot.node(name)
    if entry is None or entry.session is None:
        # Redis lost the node (restarted, flushed): rebuild its entry from the database.
        node = Node.objects.filter(name=name).first()
        if node is None:
            raise UnknownNode(name)
        _mirror(node)
        entry = hot.NodeEntry(session=node.session, state=node.state)
    if entry.session != beat.session:
        raise ClosedSession(
            f"session {beat.session[:8]} is not the current session of {name} ({entry.session[:8]}): register again"
        )
    if entry.state not in lifecycle.ALIVE:
        raise ClosedSession(
            f"{name} was marked {entry.state}; its session is closed: register again with a new session"
        )
    load = beat.load
    previous_model_state = entry.model_state
    hot.heartbeat(name, now, beat.model_state, vars(load), beat.checkpoints, beat.gpus)
    if (beat.checkpoints or {}) != entry.checkpoints:
        events.checkpoints_moved()  # the checkpoint pages refresh on a change, not on a timer
    if beat.xids:
        health.ingest_xids(name, beat.xids)
    if previous_model_state != beat.model_state and previous_model_state is not None:
        node = Node.objects.filter(name=name).first()
        if node is not None:
            health.note_model_state(node, previous_model_state, beat.model_state)
    state = entry.state
    if state == NodeState.JOIN and beat.model_state == "serving":
        node = Node.objects.get(name=name)
        if node.session == beat.session and node.state == NodeState.JOIN:
            if transition_node(
                node, NodeState.SERVING, "model loaded: heartbeat reports serving", last_seen_at=_epoch(now)
            ):
                state = NodeState.SERVING
        elif node.session == beat.session:
            # Redis's mirror fell behind the database: the step's own publish was lost while Redis was away (a
            # chaos run's Redis pause), or another beat of this session took the step first. Before, the beat asked
            # for SERVING -> SERVING and got a 500, every beat until the 30 s resync.
            _mirror(node)
            if node.state not in lifecycle.ALIVE:
                raise ClosedSession(
                    f"{name} was marked {node.state}; its session is closed: register again with a new session"
                )
            state = node.state
    events.node_load(
        name,
        {
            "running": load.running,
            "waiting": load.waiting,
            "kv_used": load.kv_blocks_used,
            "kv_total": load.kv_blocks_total,
            "step_ms": load.step_ms,
            "model_state": beat.model_state,
            "at": now,
        },
    )
    return state


def deregister_node(name: str, session: str, reason: str) -> Node:
    node = Node.objects.filter(name=name).first()
    if node is None:
        raise UnknownNode(name)
    if node.session != session:
        raise ClosedSession(f"session {session[:8]} is not the current session of {name}: nothing to deregister")
    if node.state != NodeState.LEFT:
        transition_node(node, NodeState.LEFT, f"node left: {reason}", last_seen_at=timezone.now())
    return node


def mark_silent_nodes_down() -> list[str]:
    """DOWN for every JOIN or SERVING node whose heartbeats stopped longer than the allowed miss."""
    miss = settings.LIFELINE_HEARTBEAT_MISS_S
    now = time.time()
    downed = []
    started = Cluster.default().state.control_plane_started_at
    silent = hot.silent_nodes(now - miss)
    if _deaf(silent, now, started):
        return []
    for name, _ in silent:
        entry = hot.node(name)  # the session whose silence this is
        seen = hot.last_seen(name)  # re-read: a beat may have landed since the scan
        # Silence while the control plane itself took no heartbeat at all (its web process restarting, Redis away)
        # is its own deafness: each node gets a whole allowance from the moment heartbeats came in again. Read here,
        # after _deaf: the beat that ends a deafness may land between the scan and this line, and _deaf, seeing it,
        # no longer holds the judgement back (a chaos run on 2026-12-06 marked five healthy nodes DOWN so, with the
        # mark read before the scan).
        resumed = hot.heartbeats_resumed_at()
        if seen is None or not lifecycle.is_silent(max(seen, resumed), now, miss):
            continue
        node = Node.objects.filter(name=name).first()
        if node is None or node.state not in lifecycle.ALIVE:
            hot.unwatch(name)
            continue
        if entry and entry.session and node.session != entry.session:
            continue  # a new session registered since the silent one was read: it has not had time to beat
        if _of_a_previous_run(node, entry.last_seen if entry else None, started):
            # Its session ended while the control plane was down (a restart of the stack): gone, not failed.
            cause = (
                f"session {node.session[:8]} not heard since the control plane started at {started:%H:%M:%S} UTC: "
                "it ended before"
            )
            actor = STARTUP
        else:
            cause = (
                f"{SILENT} {now - seen:.1f} s (allowed {miss:g} s); last at {_epoch(seen):%H:%M:%S.%f}"[:-3] + " UTC"
            )
            actor = "system"
        if transition_node(node, NodeState.DOWN, cause, actor=actor, last_seen_at=_epoch(seen)):
            downed.append(name)
    return downed


def _deaf(silent: list[tuple[str, float]], now: float, started: dt.datetime | None) -> bool:
    """No heartbeat from any watched node (two or more) for longer than `hot.deaf_after_s()`: the control plane is
    deaf (its web process restarting, Redis just back), not the whole fleet dead. Nobody is marked DOWN for it, for at
    most LIFELINE_HEARTBEAT_DEAF_MAX_S; a fleet still silent after that is judged as usual. Judged by the newest beat
    of all, not by every node being silent: the nodes beat out of phase, so when the control plane stops hearing
    them they turn silent one by one over a heartbeat interval, and a test for all of them at once marked the first
    ones DOWN (five of eight healthy nodes, in the chaos soak's web restart). Not a fleet none of which was heard
    since the control plane started: those sessions are judged by when it started."""
    watched = hot.watched_count()
    # The newest beat the control plane took in, not the newest score under watch: a node put back under watch
    # after Redis lost it (the hot state's restore) counts as seen at the restore, which is no sign of hearing, and
    # it hid a deafness that followed (a loaded chaos run marked the three nodes that had beaten DOWN so). The
    # newest score stands in only while no beat has come since Redis lost its record of them.
    newest = (hot.heartbeats_ingested_at() or hot.newest_heartbeat()) if silent else None
    heard_since_start = newest is not None and (started is None or newest >= started.timestamp())
    unheard = newest is not None and now - newest > hot.deaf_after_s()
    if not (watched >= 2 and unheard and heard_since_start):
        hot.heartbeats_heard()
        return False
    since = hot.heartbeats_deaf_since(now)
    if now - since > settings.LIFELINE_HEARTBEAT_DEAF_MAX_S:
        return False
    log.warning(
        "no heartbeat from any of the %d watched nodes for %.1f s: the control plane is not hearing heartbeats "
        "(its web process or Redis was away), not marking any down for %.0f s more",
        watched,
        now - newest,
        settings.LIFELINE_HEARTBEAT_DEAF_MAX_S - (now - since),
    )
    return True


def _of_a_previous_run(node: Node, heard: float | None, started: dt.datetime | None) -> bool:
    """A session that began before the control plane started and has not sent a heartbeat since."""
    return lifecycle.of_a_previous_run(node.session_started_at, heard, started)


def mark_long_down_nodes_left() -> list[str]:
    """LEFT for nodes DOWN longer than LIFELINE_LEFT_AFTER_S: they are not coming back on their own."""
    after = settings.LIFELINE_LEFT_AFTER_S
    cutoff = timezone.now() - dt.timedelta(seconds=after)
    left = []
    for node in Node.objects.filter(state=NodeState.DOWN, state_changed_at__lt=cutoff):
        if transition_node(node, NodeState.LEFT, f"down for more than {after:g} s"):
            left.append(node.name)
    return left
