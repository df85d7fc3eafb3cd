"""Incidents: one per failure event, and the timeline of everything that followed.

A failure symptom (a gateway saw a stream break, or heartbeats stopped) opens
an incident, or joins the one already active when it started within the
cluster's incident window. The control plane confirms it, takes the node out
of routing, and from then on every step is an event with its millisecond
timestamp and cause: each interrupted request's fate, checkpoint
re-placements, the restart, the draft model ready, speculative assist, the
full model ready, back in routing, and recovered (cluster TTFT and TPOT
back within 10% of the pre-failure baseline, source document 000). People
acknowledge, take command, write notes and close.
"""

import datetime as dt
import logging
import statistics

from django.db import transaction
from django.db.models import Avg
from django.utils import timezone

from recovery import events, hot, nodeclient, roles
from recovery.actions import audit, health, nodes
from recovery.choices import EventKind, IncidentStatus, NodeState
from recovery.models import Cluster, Incident, IncidentEvent, Node, RequestOutcome
from recovery.policy import capacity as capacity_policy
from recovery.policy import load, progressive
from workers import catalog

log = logging.getLogger(__name__)

BASELINE_S = 60.0  # the pre-failure baseline: requests that finished in this long before the first symptom
RECOVERY_WINDOW_S = 10.0  # recent requests compared with the baseline
RECOVERY_MIN_REQUESTS = 3
RECOVERY_TOLERANCE = 0.10
ASSIST_K = 4
ASSIST_ALPHA = 0.6


def _at(value: float | dt.datetime | None) -> dt.datetime:
    if value is None:
        return timezone.now()
    if isinstance(value, dt.datetime):
        return value
    return dt.datetime.fromtimestamp(value, tz=dt.UTC)


def add_event(
    incident: Incident,
    kind: str,
    description: str,
    *,
    at=None,
    source: str = "control-plane",
    node: Node | None = None,
    request_id: str = "",
    details: dict | None = None,
    actor: str = "system",
) -> IncidentEvent:
    event = IncidentEvent.objects.create(
        incident=incident,
        at=_at(at),
        kind=kind,
        source=source,
        node=node,
        request_id=request_id,
        description=description,
        details=details or {},
        actor=actor,
    )
    transaction.on_commit(lambda: events.incident_event(incident.pk, event.pk))
    return event


def open_incident_for(node: Node) -> Incident | None:
    """The newest incident not closed that involves `node`."""
    return node.incidents.exclude(status=IncidentStatus.CLOSED).order_by("-opened_at").first()


def checkpoint_distribution() -> dict:
    """Who holds whose checkpoints now: {holder: {serving node: {bytes, requests}}}, from the heartbeats."""
    names = list(Node.objects.filter(state__in=(NodeState.JOIN, NodeState.SERVING)).values_list("name", flat=True))
    try:
        live = hot.nodes(names)
    except Exception:  # noqa: BLE001 - a snapshot is a nice-to-have on the timeline
        return {}
    return {name: entry.checkpoints for name, entry in live.items() if entry.checkpoints}


def _baseline(before: dt.datetime) -> tuple[float | None, float | None]:
    figures = RequestOutcome.objects.filter(
        status="ok", finished_at__gte=before - dt.timedelta(seconds=BASELINE_S), finished_at__lt=before
    ).aggregate(ttft=Avg("ttft_ms"), tpot=Avg("tpot_ms"))
    return figures["ttft"], figures["tpot"]


@transaction.atomic
def note_failure(node: Node, at, source: str, reason: str) -> Incident:
    """A failure symptom on `node`: join the incident active within the window, or open one."""
    at = _at(at)
    cluster = Cluster.default()
    window = dt.timedelta(seconds=cluster.incident_window_s)
    incident = (
        Incident.objects.select_for_update()
        .filter(cluster=cluster, status=IncidentStatus.ACTIVE, opened_at__gte=at - window)
        .order_by("-opened_at")
        .first()
    )
    if incident is None:
        ttft, tpot = _baseline(at)
        incident = Incident.objects.create(
            cluster=cluster,
            title=f"{node.name} failed",
            opened_at=at,
            status_changed_at=at,
            baseline_ttft_ms=ttft,
            baseline_tpot_ms=tpot,
            details={"checkpoints_before": checkpoint_distribution()},
        )
        transaction.on_commit(lambda: events.incident_changed(incident.pk))
    if not incident.nodes.filter(pk=node.pk).exists():
        incident.nodes.add(node)
        names = sorted(incident.nodes.values_list("name", flat=True))
        incident.title = f"{', '.join(names)} failed"
        incident.save(update_fields=["title"])
    if not incident.events.filter(kind=EventKind.SYMPTOM, node=node).exists():
        add_event(
            incident,
            EventKind.SYMPTOM,
            f"{node.name}: {reason}",
            at=at,
            source=source,
            node=node,
            details={"reason": reason},
        )
    return incident


def confirm_failure(node_name: str, at, source: str, reason: str) -> str:
    """A gateway lost a node: check it, and take it out of routing for every gateway if it is gone."""
    node = Node.objects.filter(name=node_name).first()
    if node is None:
        return "unknown"
    incident = note_failure(node, at, source, reason)
    if node.state not in (NodeState.JOIN, NodeState.SERVING):
        return "already down"
    up, said = nodeclient.alive(node.address, timeout=0.5)
    if up:
        add_event(
            incident,
            EventKind.NOT_CONFIRMED,
            f"{node.name} {said}: left in routing, watching its heartbeats",
            node=node,
        )
        health.record_node_failure(node, f"{source} lost it ({reason}) though {said}")
        return "alive"
    nodes.transition_node(node, NodeState.DOWN, f"{source} reported it ({reason}); {said}")
    return "down"


def on_node_transition(node_id: int, old: str, new: str, cause: str, at: dt.datetime) -> None:
    """What a lifecycle step means for the incident the node is in (a reaction, once the step committed)."""
    node = Node.objects.get(pk=node_id)
    with transaction.atomic():
        if new == NodeState.DOWN:
            incident = note_failure(node, at, "control-plane", cause)
            add_event(incident, EventKind.DETECTED, f"{node.name} is DOWN: {cause}", at=at, node=node)
            add_event(
                incident,
                EventKind.REMOVED,
                f"{node.name} removed from the routing table of every gateway",
                at=at,
                node=node,
            )
            if incident.detected_at is None:
                Incident.objects.filter(pk=incident.pk).update(detected_at=at)
            return
        incident = open_incident_for(node)
        if incident is None or incident.opened_at > at:
            return  # no incident, or one that began after this step (a reaction can run a moment late)
        if new == NodeState.JOIN and old in (NodeState.DOWN, NodeState.LEFT):
            add_event(incident, EventKind.RESTART, f"{node.name} restarted: {cause}", at=at, node=node)
        elif new == NodeState.SERVING and old == NodeState.JOIN:
            add_event(incident, EventKind.FULL_MODEL_READY, f"{node.name} has its full model loaded", at=at, node=node)
            add_event(incident, EventKind.BACK_IN_ROUTING, f"{node.name} is back in routing", at=at, node=node)


def on_draft_ready(node: Node) -> bool:
    """A restarting node's draft model is up (a reaction): on its incident's timeline. True when it is in one,
    so its draft can help the most loaded survivor (Algorithm 3)."""
    incident = open_incident_for(node)
    if incident is None:
        return False
    with transaction.atomic():
        add_event(
            incident,
            EventKind.DRAFT_READY,
            f"{node.name} has its draft model up; the full model loads behind it",
            node=node,
        )
    return True


def on_spare_promoted(spare: Node, in_place_of: str) -> None:
    """A hot spare took a failed node's place (a reaction): on the failed node's incident."""
    failed = Node.objects.filter(name=in_place_of).first()
    incident = open_incident_for(failed) if failed else None
    if incident is not None:
        with transaction.atomic():
            add_event(
                incident,
                EventKind.SPARE_PROMOTED,
                f"hot spare {spare.name} promoted in place of {in_place_of}",
                node=spare,
            )


def on_degradation(old: int, new: int, cause: str, at: dt.datetime) -> None:
    """The cluster's degradation level moved (a reaction): on every active incident's timeline."""
    with transaction.atomic():
        for incident in Incident.objects.filter(status=IncidentStatus.ACTIVE):
            add_event(
                incident,
                EventKind.DEGRADATION,
                f"degradation level {old} → {new}: {capacity_policy.LEVEL_DOCS[new]} ({cause})",
                at=at,
                details={"old": old, "new": new},
            )


def start_assist(node_id: int) -> str:
    """Pair the draft-ready node with the most loaded survivor until its full model is ready."""
    draft = Node.objects.get(pk=node_id)
    incident = open_incident_for(draft)
    survivors = list(Node.objects.filter(state=NodeState.SERVING, model_key=draft.model_key).exclude(pk=draft.pk))
    live = hot.nodes([s.name for s in survivors])
    cluster = Cluster.default()
    loads = {}
    for survivor in survivors:
        entry = live.get(survivor.name) or hot.NodeEntry()
        loads[survivor.name] = load.holder_load(
            entry.checkpoint_bytes_held,
            catalog.model(survivor.model_key).kv_bytes_per_block,
            entry.queue_depth,
            cluster.alpha,
            cluster.beta,
        )
    chosen = progressive.pick_assisted(loads)
    if chosen is None:
        if incident:
            add_event(
                incident,
                EventKind.ASSIST_STARTED,
                f"no survivor to assist: {draft.name} waits for its full model",
                node=draft,
            )
        return "no survivor"
    survivor = next(s for s in survivors if s.name == chosen)
    body = {
        "draft": {"name": draft.name, "address": draft.address, "rack": draft.rack.name},
        "k": ASSIST_K,
        "alpha": ASSIST_ALPHA,
    }
    try:
        status, answer = nodeclient.call(survivor.address, "POST", "/agent/assist", body)
    except nodeclient.NodeUnreachable as exc:
        status, answer = 0, {"error": {"message": str(exc)}}
    if incident is None:
        return f"assist {status}"
    with transaction.atomic():
        if status == 200:
            hot.client().set(hot.keys().assist(draft.name), survivor.name, ex=3600)
            add_event(
                incident,
                EventKind.ASSIST_STARTED,
                f"{draft.name}'s draft model assists {survivor.name}, "
                f"the most loaded survivor (L̂ {loads[chosen]:.1f}): "
                f"k={ASSIST_K}, expected {answer.get('expected_tokens_per_step')} tokens per step",
                node=draft,
                details={"survivor": survivor.name, "l_hat": loads, **answer},
            )
        else:
            add_event(
                incident,
                EventKind.ASSIST_STARTED,
                f"assist could not start on {survivor.name}: {answer.get('error', {}).get('message', status)}",
                node=draft,
                details={"survivor": survivor.name, "status": status},
            )
    return chosen


def end_assist(node_id: int) -> str:
    """The full model is ready: the draft node stops assisting and serves on its own."""
    draft = Node.objects.get(pk=node_id)
    survivor_name = hot.client().getdel(hot.keys().assist(draft.name))
    if not survivor_name:
        return "no assist"
    survivor = Node.objects.filter(name=survivor_name).first()
    answer = {}
    if survivor is not None:
        try:
            _, answer = nodeclient.call(survivor.address, "DELETE", "/agent/assist")
        except nodeclient.NodeUnreachable as exc:
            answer = {"error": str(exc)}
    incident = open_incident_for(draft)
    if incident is not None:
        with transaction.atomic():
            acceptance = answer.get("acceptance")
            add_event(
                incident,
                EventKind.ASSIST_ENDED,
                f"{draft.name} stops assisting {survivor_name}: {answer.get('assist_steps', 0)} assisted steps, "
                f"measured acceptance {acceptance if acceptance is not None else 'n/a'}, "
                f"{answer.get('tokens_per_sequence_step') or 'n/a'} tokens per step",
                node=draft,
                details=answer,
            )
    return survivor_name


def check_recovery(now: dt.datetime | None = None) -> list[int]:
    """Active incidents whose cluster TTFT and TPOT are back within 10% of the baseline become Stable."""
    now = now or timezone.now()
    recovered = []
    for incident in Incident.objects.filter(status=IncidentStatus.ACTIVE):
        window = RequestOutcome.objects.filter(
            status="ok",
            started_at__gte=incident.opened_at,
            finished_at__gte=now - dt.timedelta(seconds=RECOVERY_WINDOW_S),
            finished_at__lte=now,
        )
        ttfts = [o.ttft_ms for o in window if o.ttft_ms is not None]
        tpots = [o.tpot_ms for o in window if o.tpot_ms is not None]
        figures = {"window_s": RECOVERY_WINDOW_S, "requests": len(ttfts)}
        quiet = not window.exists() and (now - incident.opened_at).total_seconds() >= RECOVERY_WINDOW_S
        if incident.baseline_ttft_ms and incident.baseline_tpot_ms and quiet:
            # Traffic before the failure, none since (a quiet hour): no latency to compare; recovered once every
            # node involved serves again, or the incident would stay Active until the next request.
            if incident.nodes.exclude(state=NodeState.SERVING).exists():
                continue
            why = "no request since the failure to measure latency with; every node involved serves again"
        elif incident.baseline_ttft_ms and incident.baseline_tpot_ms:
            if len(ttfts) < RECOVERY_MIN_REQUESTS or not tpots:
                continue
            ttft, tpot = statistics.mean(ttfts), statistics.mean(tpots)
            figures.update(
                ttft_ms=round(ttft, 1),
                tpot_ms=round(tpot, 2),
                baseline_ttft_ms=round(incident.baseline_ttft_ms, 1),
                baseline_tpot_ms=round(incident.baseline_tpot_ms, 2),
            )
            if ttft > incident.baseline_ttft_ms * (1 + RECOVERY_TOLERANCE) or tpot > incident.baseline_tpot_ms * (
                1 + RECOVERY_TOLERANCE
            ):
                continue
            why = (
                f"cluster TTFT {ttft:.0f} ms and TPOT {tpot:.1f} ms are back within 10% of the baseline "
                f"({incident.baseline_ttft_ms:.0f} ms, {incident.baseline_tpot_ms:.1f} ms)"
            )
        else:
            # No traffic before the failure to compare with: recovered once every node involved serves again.
            if incident.nodes.exclude(state=NodeState.SERVING).exists():
                continue
            why = "no traffic before the failure to compare with; every node involved serves again"
        with transaction.atomic():
            seconds = (now - incident.opened_at).total_seconds()
            claimed = Incident.objects.filter(pk=incident.pk, status=IncidentStatus.ACTIVE).update(
                status=IncidentStatus.STABLE, status_changed_at=now, recovered_at=now, recovery_time_s=seconds
            )
            if not claimed:
                continue
            incident.details = {**incident.details, "checkpoints_after": checkpoint_distribution(), "recovery": figures}
            incident.save(update_fields=["details"])
            add_event(incident, EventKind.RECOVERED, f"Recovered after {seconds:.1f} s: {why}", at=now, details=figures)
            add_event(incident, EventKind.STATUS, "Active → Stable", at=now)
            transaction.on_commit(lambda pk=incident.pk: events.incident_changed(pk))
        recovered.append(incident.pk)
    return recovered


# --- what people do -------------------------------------------------------------------------------
class IncidentActionError(ValueError):
    pass


@transaction.atomic
def acknowledge(incident: Incident, user) -> None:
    if incident.acknowledged_at is not None:
        raise IncidentActionError(
            f"already acknowledged by {incident.acknowledged_by} at {incident.acknowledged_at:%H:%M:%S}"
        )
    now = timezone.now()
    Incident.objects.filter(pk=incident.pk).update(acknowledged_at=now, acknowledged_by=user)
    audit.record(user.get_username(), "incident_ack", f"incident:{incident.pk}")
    add_event(
        incident,
        EventKind.ACKNOWLEDGED,
        f"Acknowledged by {user.get_username()}",
        at=now,
        source="person",
        actor=user.get_username(),
    )
    transaction.on_commit(lambda: events.incident_changed(incident.pk))


@transaction.atomic
def set_commander(incident: Incident, commander, by) -> None:
    if not roles.has_role(commander, roles.ONCALL):
        raise IncidentActionError(
            f"{commander.get_username()} is not on call: a commander must have the oncall or admin role"
        )
    Incident.objects.filter(pk=incident.pk).update(commander=commander)
    audit.record(by.get_username(), "incident_command", f"incident:{incident.pk}", commander=commander.get_username())
    add_event(
        incident,
        EventKind.COMMANDER,
        f"{commander.get_username()} is the incident commander (set by {by.get_username()})",
        source="person",
        actor=by.get_username(),
    )
    transaction.on_commit(lambda: events.incident_changed(incident.pk))


@transaction.atomic
def add_note(incident: Incident, text: str, by) -> None:
    text = text.strip()
    if not text:
        raise IncidentActionError("a note needs some text")
    Incident.objects.filter(pk=incident.pk).update(notes=(incident.notes + "\n\n" if incident.notes else "") + text)
    audit.record(by.get_username(), "incident_note", f"incident:{incident.pk}", text)
    add_event(incident, EventKind.NOTE, text, source="person", actor=by.get_username())


@transaction.atomic
def close(incident: Incident, by, reason: str) -> None:
    """Stable → Closed, by a person, with a reason."""
    if incident.status != IncidentStatus.STABLE:
        raise IncidentActionError(
            f"the incident is {incident.get_status_display()}: only a Stable incident can be closed"
        )
    if not reason.strip():
        raise IncidentActionError("closing needs a reason")
    now = timezone.now()
    claimed = Incident.objects.filter(pk=incident.pk, status=IncidentStatus.STABLE).update(
        status=IncidentStatus.CLOSED, status_changed_at=now, closed_at=now
    )
    if not claimed:
        raise IncidentActionError("someone changed the incident meanwhile: reload it")
    audit.record(by.get_username(), "incident_close", f"incident:{incident.pk}", reason.strip())
    add_event(
        incident,
        EventKind.STATUS,
        f"Stable → Closed by {by.get_username()}: {reason.strip()}",
        at=now,
        source="person",
        actor=by.get_username(),
    )
    transaction.on_commit(lambda: events.incident_changed(incident.pk))
