"""Incidents: one per failure event, and the timeline of everything that followed.

A failure symptom (a gateway saw a stream break, or heartbeats stopped) opens
an incident, or joins the one already active when it started within the
cluster's incident window. The control plane confirms it, takes the node out
of routing, and from then on every step is an event with its millisecond
timestamp and cause: each interrupted request's fate, checkpoint
re-placements, the restart, the draft model ready, speculative assist, the
full model ready, back in routing. Recovery is two facts, each with its
time: latency recovered (cluster TTFT and TPOT back within 10% of the
pre-failure baseline, source document 000) and capacity restored (every node
involved back in routing, or replaced by a hot spare in service); the
incident is Stable once both hold. Its severity (recovery.policy.severity)
rises with the capacity it took, the degradation level it reached and the
requests that failed. People acknowledge, take command, write notes and close.
"""

import datetime as dt
import logging
import statistics
import time
from dataclasses import dataclass

from django.db import transaction
from django.db.models import Avg
from django.utils import timezone

from recovery import events, hot, nodeclient, roles
from recovery.actions import audit, health, nodes
from recovery.choices import OPEN_DRAIN_STATES, AlertStatus, EventKind, Health, IncidentStatus, NodeState
from recovery.models import Cluster, Condition, Drain, Incident, IncidentEvent, Node, RequestOutcome
from recovery.policy import capacity as capacity_policy
from recovery.policy import load, progressive
from recovery.policy import severity as severity_policy
from workers import catalog

log = logging.getLogger(__name__)

BASELINE_S = 60.0  # the pre-failure baseline: requests that finished in this long before the first symptom
RECOVERY_WINDOW_S = 10.0  # recent requests compared with the baseline
RECOVERY_MIN_REQUESTS = 3
RECOVERY_TOLERANCE = 0.10
ASSIST_K = 4


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


def checkpoint_distribution(at: dt.datetime | None = None) -> dict:
    """Who holds whose checkpoints: {holder: {serving node: {bytes, requests}}}, from the heartbeats.

    Now, or as they were at `at`: each node's last heartbeat at or before then. A failure is processed a moment
    after it happened, when its requests may already have been restored and their pages dropped; the "before"
    of an incident is read as of the failure, not as of its processing."""
    try:
        if at is not None:
            return hot.checkpoints_as_of(list(Node.objects.values_list("name", flat=True)), at.timestamp())
        names = list(Node.objects.filter(state__in=(NodeState.JOIN, NodeState.SERVING)).values_list("name", flat=True))
        live = hot.nodes(names)
    except Exception:  # noqa: BLE001 - a snapshot is a nice-to-have on the timeline
        return {}
    return {name: entry.checkpoints for name, entry in live.items() if entry.checkpoints}


def _in_service(node: Node) -> bool:
    """In routing: serving, not cordoned, not a spare held back, not taken out by the health machine."""
    return (
        node.state == NodeState.SERVING
        and not node.cordoned
        and not node.spare
        and node.health in (Health.HEALTHY, Health.SUSPICIOUS)
    )


@dataclass(frozen=True)
class Coverage:
    """One reading of an incident's nodes and of the hot spares in service in their place. The nodes change state
    while it is used (a drain returns one, a fault takes it again): whatever is judged from one reading is told from
    the same, never from a second read that could contradict it."""

    nodes: list[Node]  # by name
    in_routing: dict[str, bool]  # node -> back: in routing, healthy, no drain open on it
    spares: dict[str, IncidentEvent]  # node -> the promotion of the spare in service in its place
    draining: frozenset[str] = frozenset()  # nodes with a drain open: the incident's work is not done

    @property
    def missing(self) -> list[str]:
        """The nodes neither back in routing nor replaced by a hot spare now in service."""
        return [n.name for n in self.nodes if not self.in_routing[n.name] and n.name not in self.spares]


def _back(node: Node, draining: frozenset[str], failing: frozenset[str] = frozenset()) -> bool:
    """An incident's node is back when it serves in routing, healthy, with no drain open on it and no lasting failure
    of it open (recovery.actions.conditions: a link down, a slow GPU): under suspicion (SUSPICIOUS), waiting for a
    drain, or still slow, what the incident lost is not back (an SDC incident said "capacity restored … in routing"
    at +0 ms, its node corrupt and its drain waiting)."""
    return _in_service(node) and node.health == Health.HEALTHY and node.name not in draining | failing


def coverage(incident: Incident) -> Coverage:
    nodes = list(incident.nodes.order_by("name"))
    promoted = incident.events.filter(kind=EventKind.SPARE_PROMOTED).select_related("node")
    draining = frozenset(
        Drain.objects.filter(node__in=nodes, state__in=OPEN_DRAIN_STATES).values_list("node__name", flat=True)
    )
    failing = frozenset(
        Condition.objects.filter(node__in=nodes, cleared_at__isnull=True).values_list("node__name", flat=True)
    )
    return Coverage(
        nodes,
        {node.name: _back(node, draining, failing) for node in nodes},
        {e.details.get("in_place_of"): e for e in promoted if e.node is not None and _in_service(e.node)},
        draining,
    )


def out_of_service(incident: Incident) -> list[str]:
    """The nodes of `incident` neither back in routing nor replaced by a hot spare now in service."""
    return coverage(incident).missing


def _at_failure(node: Node, at: dt.datetime) -> dt.datetime:
    """The moment `node` failed, as near as the heartbeats tell: its last one, if that came before `at` (a node
    found silent by the heartbeat check failed when it fell silent, not when it was found)."""
    try:
        last = hot.last_seen(node.name)
    except Exception:  # noqa: BLE001 - the symptom's own time will do
        return at
    return min(at, _at(last)) if last else at


def _baseline(before: dt.datetime) -> tuple[float | None, float | None]:
    figures = RequestOutcome.objects.filter(
        status="ok", finished_at__gte=before - dt.timedelta(seconds=BASELINE_S), finished_at__lt=before
    ).aggregate(ttft=Avg("ttft_ms"), tpot=Avg("tpot_ms"))
    return figures["ttft"], figures["tpot"]


@transaction.atomic
def _open(
    cluster: Cluster,
    title: str,
    at: dt.datetime,
    *,
    failed: Node | None = None,
    detected_at: dt.datetime | None = None,
    kind: str = "",
) -> Incident:
    """A new incident from `at`, with the latency baseline before it and the nodes in service when it began (the
    share of capacity it takes, its severity), the `failed` node counted among them."""
    ttft, tpot = _baseline(at)
    serving = Node.objects.filter(cluster=cluster, state=NodeState.SERVING, spare=False, cordoned=False)
    in_service = serving.count() + (failed is not None and not serving.filter(pk=failed.pk).exists())
    details = {"nodes_in_service": in_service, **({"kind": kind} if kind else {})}
    incident = Incident.objects.create(
        cluster=cluster,
        title=title,
        opened_at=at,
        status_changed_at=at,
        detected_at=detected_at,
        baseline_ttft_ms=ttft,
        baseline_tpot_ms=tpot,
        details=details,
    )
    transaction.on_commit(lambda: events.incident_changed(incident.pk))
    return incident


def open_incident(
    title: str, at: dt.datetime, *, kind: str, detected_at: dt.datetime | None = None, **details
) -> Incident:
    """A new incident of its own, joined to no failure (an alert's: recovery.actions.alerts), with `details`."""
    incident = _open(Cluster.default(), title, at, detected_at=detected_at, kind=kind)
    if details:
        merge_details(incident, **details)
    return incident


def active_within_window(cluster: Cluster, at: dt.datetime) -> Incident | None:
    """The newest active incident opened within the cluster's incident window before `at`, locked: failures that
    begin close together are one incident. Inside a transaction."""
    window = dt.timedelta(seconds=cluster.incident_window_s)
    return (
        Incident.objects.select_for_update()
        .filter(cluster=cluster, status=IncidentStatus.ACTIVE, opened_at__gte=at - window)
        .order_by("-opened_at")
        .first()
    )


@transaction.atomic
def note_failure(node: Node, at, source: str, reason: str) -> Incident:
    """A failure symptom on `node`: join the incident active within the window, or open one."""
    at = _at(at)
    cluster = Cluster.default()
    incident = active_within_window(cluster, at)
    if incident is None:
        incident = _open(cluster, f"{node.name} failed", at, failed=node)
    elif at < incident.opened_at and incident.details.get("kind") == CAPACITY_KIND:
        # The level rose before this node's failure was known: the incident began at its first symptom.
        incident.opened_at = at
        incident.save(update_fields=["opened_at"])
    if node.name not in incident.details.get("failures", {}):
        incident.nodes.add(node)
        if incident.details.get("kind") != "condition":  # opened by a lasting failure: its title says which
            names = sorted(incident.nodes.values_list("name", flat=True))
            incident.title = f"{', '.join(names)} failed"
        # The checkpoints as this node failed (one table per failed node), and a recovery to be judged again.
        failed_at = _at_failure(node, at)
        snapshot = checkpoint_distribution(at=failed_at)
        failures = {
            **incident.details.get("failures", {}),
            node.name: {"at": failed_at.timestamp(), "checkpoints": snapshot},
        }
        incident.details = {**incident.details, "failures": failures}
        incident.details.setdefault("checkpoints_before", snapshot)
        incident.recovered_at = incident.capacity_restored_at = incident.recovery_time_s = None
        incident.save(update_fields=["title", "details", "recovered_at", "capacity_restored_at", "recovery_time_s"])
    if not incident.events.filter(kind=EventKind.SYMPTOM, node=node).exists():
        add_event(
            incident,
            EventKind.SYMPTOM,
            _about(node, reason),
            at=at,
            source=source,
            node=node,
            details={"reason": reason},
        )
    return incident


def _about(node: Node, reason: str) -> str:
    """A timeline line about `node`: its name, then what was said, once ("node-05: stream broke", never
    "node-05: node-05: stream broke" when the gateway's reason names the node already)."""
    return reason if reason.startswith(node.name) else f"{node.name}: {reason}"


def confirm_failure(node_name: str, at, source: str, reason: str) -> str:
    """A gateway lost a node: check it, and take it out of routing for every gateway if it is gone."""
    node = Node.objects.filter(name=node_name).first()
    if node is None:
        return "unknown"
    incident = note_failure(node, at, source, reason)
    if node.state not in (NodeState.JOIN, NodeState.SERVING):
        return "already down"
    up, said = nodeclient.alive(node.address, timeout=0.5)
    if up is None:
        # No answer in time: hung, or only slow (a loaded host, a long pause of its process). Its heartbeats
        # tell which: one came within the deaf allowance, so its process runs and the heartbeat check judges it
        # (DOWN within a miss if it stops); none for longer, and it is gone now.
        heard = hot.last_seen(node.name)
        age = None if heard is None else time.time() - heard
        up = age is not None and age < hot.deaf_after_s()
        said += f"; its last heartbeat {age:.1f} s ago" if age is not None else "; no heartbeat on record"
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
            update_severity(incident, at)
            return
        incident = open_incident_for(node)
        if incident is None or incident.opened_at > at:
            return  # no incident, or one that began after this step (a reaction can run a moment late)
        if new == NodeState.JOIN and old in (NodeState.DOWN, NodeState.LEFT):
            add_event(incident, EventKind.RESTART, f"{node.name} restarted: {cause}", at=at, node=node)
        elif new == NodeState.SERVING and old == NodeState.JOIN:
            add_event(incident, EventKind.FULL_MODEL_READY, f"{node.name} has its full model loaded", at=at, node=node)
            add_event(incident, EventKind.BACK_IN_ROUTING, f"{node.name} is back in routing", at=at, node=node)
            note_capacity(incident, timezone.now())


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
                details={"in_place_of": in_place_of},
            )
            note_capacity(incident, timezone.now())


@transaction.atomic
def open_for_fault(
    node: Node, cause: str, *, at=None, drain: Drain | None = None, moved: dict | None = None
) -> Incident:
    """A fault that takes a node out of service while it stays up (silent corruption, a CRITICAL Xid): the incident
    it belongs to, opened or joined as for any failure, and linked both ways to the node's drain.

    For a node found corrupt, `moved` (live_migration.move_off_corrupt) names the requests it served since its last
    good canary, which may have received corrupt tokens: on the timeline and in the incident's details; the
    finished ones join the incident's requests (those in flight join it when they finish, moved off the node)."""
    at = _at(at)
    first_failure = (moved or {}).get("first_failure_at")
    symptom_at = dt.datetime.fromisoformat(first_failure) if first_failure else at
    incident = note_failure(node, symptom_at, "control-plane", cause)
    incident = Incident.objects.select_for_update().get(pk=incident.pk)
    if incident.detected_at is None:
        incident.detected_at = at
        incident.save(update_fields=["detected_at"])
    text, details = f"{node.name}: {cause}", {}
    if moved is not None:
        served = moved["finished"] + moved["in_flight"]
        listed = ", ".join(served[:20]) + (f" and {len(served) - 20} more" if len(served) > 20 else "")
        since = dt.datetime.fromisoformat(moved["since"]).strftime("%H:%M:%S.%f")[:-3]
        text += (
            f"; out of routing (weight 0) while it stays up. {len(served)} requests it served since its last good "
            f"canary ({since} UTC) may have received corrupt tokens" + (f": {listed}" if served else "")
        )
        RequestOutcome.objects.filter(request_id__in=moved["finished"], incident__isnull=True).update(incident=incident)
        suspects = {**incident.details.get("suspect_requests", {}), node.name: moved}
        incident.details = {**incident.details, "suspect_requests": suspects}
        incident.save(update_fields=["details"])
        details = {"possibly_corrupt_requests": len(served)}  # listed in the incident's details
    add_event(incident, EventKind.DETECTED, text, at=at, node=node, details=details)
    if moved is not None:
        add_event(
            incident,
            EventKind.MIGRATION,
            f"every gateway asked to move the {len(moved['in_flight'])} requests in flight on {node.name} to healthy "
            "nodes at once, live: it is out of routing, and they do not wait for the drain's approval",
            at=at,
            node=node,
            details={"command": moved.get("command"), "requests": moved["in_flight"]},
        )
    if drain is not None:
        Drain.objects.filter(pk=drain.pk).update(incident=incident)
        drain.incident = incident
        add_event(
            incident,
            EventKind.DRAIN,
            f"drain #{drain.pk} of {node.name} ({drain.get_remediation_display().lower()}): "
            f"{drain.get_state_display().lower()}",
            at=at,
            node=node,
            details={"drain": drain.pk},
        )
    transaction.on_commit(lambda: events.incident_changed(incident.pk))
    return incident


def _degradation_pending(incident: Incident, model: str = "") -> bool:
    """The incident saw `model`'s level rise and not yet fall back to 0: its fall belongs on its timeline too."""
    raised = incident.events.filter(kind=EventKind.DEGRADATION).order_by("-at", "-pk")
    for event in raised:
        details = event.details or {}
        if not model or details.get("model", model) == model:
            return details.get("new", 0) > 0
    return False


def concerns(incident: Incident, model: str) -> bool:
    """A level change of `model` belongs on the incident: it lost nodes of that model, or it is that model's
    capacity incident (one model's level is not another model's incident)."""
    if not model:
        return True
    if incident.details.get("model"):
        return incident.details["model"] == model
    return not incident.nodes.exists() or incident.nodes.filter(model_key=model).exists()


def on_degradation(old: int, new: int, cause: str, at: dt.datetime, model: str = "") -> None:
    """`model`'s degradation level moved (a reaction): on the timeline of every active incident of that model, and
    of every one not closed whose raised level has yet to fall (it may be Stable before the hysteresis lets it fall).

    A rise from level 0 that no incident explains (demand grew past capacity, nodes ran slow: no node failed) opens
    an incident of its own, since shed and slowed requests count against the objectives like any failure's; its
    capacity is restored when the level is back at 0. A node of that model that fails meanwhile joins it."""
    named = f"{model} " if model else ""
    with transaction.atomic():
        touched = False
        for incident in Incident.objects.exclude(status=IncidentStatus.CLOSED):
            if not concerns(incident, model):
                continue
            if incident.status != IncidentStatus.ACTIVE and not _degradation_pending(incident, model):
                continue
            touched = True
            add_event(
                incident,
                EventKind.DEGRADATION,
                f"{named}degradation level {old} → {new}: {capacity_policy.LEVEL_DOCS[new]} ({cause})",
                at=at,
                details={"old": old, "new": new, **({"model": model} if model else {})},
            )
            if new > old:
                update_severity(incident, at)
            elif new == 0 and incident.details.get("kind") == CAPACITY_KIND and not incident.nodes.exists():
                _capacity_back(incident, at)
        if not touched and old == 0 and new > 0:
            _open_for_capacity(new, cause, at, model)


CAPACITY_KIND = "capacity"  # an incident opened by the degradation level alone (Incident.details["kind"])


def _open_for_capacity(level: int, cause: str, at: dt.datetime, model: str = "") -> Incident:
    named = f"{model} " if model else ""
    title = f"{named}capacity below the objective: degradation level {level}"
    incident = _open(Cluster.default(), title[0].upper() + title[1:], at, detected_at=at, kind=CAPACITY_KIND)
    if model:
        merge_details(incident, model=model)
    add_event(
        incident,
        EventKind.DEGRADATION,
        f"{named}degradation level 0 → {level}: {capacity_policy.LEVEL_DOCS[level]} ({cause})",
        at=at,
        source="control-plane",
        details={"old": 0, "new": level, **({"model": model} if model else {})},
    )
    update_severity(incident, at)
    return incident


def _capacity_back(incident: Incident, at: dt.datetime) -> None:
    """A capacity incident's level is back at 0: its capacity is restored (Stable once latency has recovered too)."""
    if incident.status != IncidentStatus.ACTIVE or incident.capacity_restored_at is not None:
        return
    _restored(incident, at, "the level first rose: degradation level back to 0")


def _restored(incident: Incident, at: dt.datetime, why: str) -> None:
    """Capacity restored at `at`, once (claimed: another reaction may get there first), on the timeline as
    "Capacity restored <s> s after `why`"; Stable if latency has recovered too."""
    claimed = Incident.objects.filter(
        pk=incident.pk, status=IncidentStatus.ACTIVE, capacity_restored_at__isnull=True
    ).update(capacity_restored_at=at)
    if not claimed:
        return
    incident.capacity_restored_at = at
    seconds = (at - incident.opened_at).total_seconds()
    add_event(
        incident,
        EventKind.CAPACITY_RESTORED,
        f"Capacity restored {seconds:.1f} s after {why}",
        at=at,
        details={"seconds": round(seconds, 3)},
    )
    transaction.on_commit(lambda pk=incident.pk: events.incident_changed(pk))
    _stabilize(incident, at)


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
    # Speculation only helps a node that is decoding, and a survivor verifies one draft node's drafts at a time:
    # an idle survivor (however many checkpoints it holds) and one already assisted are not candidates.
    idle = {name for name in loads if not (live.get(name) or hot.NodeEntry()).running}
    assisted = set(_assisted_survivors())
    chosen = progressive.pick_assisted(loads, exclude=idle | assisted)
    if chosen is None:
        if incident:
            why = "no survivor is decoding" if not assisted else "every survivor decoding is already assisted"
            add_event(
                incident,
                EventKind.ASSIST_STARTED,
                f"no survivor to assist ({why}): {draft.name} waits for its full model",
                node=draft,
                details={"idle": sorted(idle), "assisted": sorted(assisted)},
            )
        return "no survivor"
    survivor = next(s for s in survivors if s.name == chosen)
    body = {
        "draft": {"name": draft.name, "address": draft.address, "rack": draft.rack.name},
        "k": ASSIST_K,
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
                f"{draft.name}'s draft model assists {survivor.name}, the most loaded survivor decoding "
                f"(L̂ {loads[chosen]:.1f}, {live[chosen].running} running): "
                f"k={ASSIST_K}, expected {answer.get('expected_tokens_per_step')} tokens per step (modelled, from the "
                f"model pair's draft agreement {answer.get('agreement')})",
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


def _assisted_survivors() -> list[str]:
    """The survivors verifying some draft node's drafts now."""
    client = hot.client()
    keys = list(client.scan_iter(hot.keys().assist("*")))
    return [name for name in client.mget(keys) if name] if keys else []


def end_assist(node_id: int) -> str:
    """The full model is ready: the draft node stops assisting and serves on its own."""
    draft = Node.objects.get(pk=node_id)
    survivor_name = hot.client().getdel(hot.keys().assist(draft.name))
    if not survivor_name:
        return "no assist"
    survivor = Node.objects.filter(name=survivor_name).first()
    status, answer = 0, {"error": {"message": f"{survivor_name} is no longer registered"}}
    if survivor is not None:
        try:
            status, answer = nodeclient.call(survivor.address, "DELETE", f"/agent/assist?draft={draft.name}")
        except nodeclient.NodeUnreachable as exc:
            answer = {"error": {"message": str(exc)}}
    incident = open_incident_for(draft)
    if incident is not None:
        if status == 200 and answer.get("stopped"):
            acceptance = answer.get("acceptance")
            text = (
                f"{draft.name} stops assisting {survivor_name}: {answer['assist_steps']} assisted steps, "
                f"measured acceptance {acceptance if acceptance is not None else 'n/a'}, "
                f"{answer.get('tokens_per_sequence_step') or 'n/a'} tokens per step"
            )
        else:  # its figures are gone with the pairing: say so rather than print another pairing's or zeros
            reason = (answer.get("error") or {}).get("message") or "it was no longer paired"
            text = f"{draft.name} stops assisting {survivor_name}; no figures for this pairing ({reason})"
        with transaction.atomic():
            add_event(incident, EventKind.ASSIST_ENDED, text, node=draft, details=answer)
    return survivor_name


def _latency_recovered(incident: Incident, now: dt.datetime) -> tuple[str, dict] | None:
    """(why, figures) when the cluster's latency is back within 10% of the incident's baseline; None if not yet."""
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
        if out_of_service(incident):
            return None
        return "no request since the failure to measure latency with; every node involved serves again", figures
    if incident.baseline_ttft_ms and incident.baseline_tpot_ms:
        if len(ttfts) < RECOVERY_MIN_REQUESTS or not tpots:
            return None
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
            return None
        why = (
            f"cluster TTFT {ttft:.0f} ms and TPOT {tpot:.1f} ms are back within 10% of the baseline "
            f"({incident.baseline_ttft_ms:.0f} ms, {incident.baseline_tpot_ms:.1f} ms)"
        )
        return why, figures
    # No traffic before the failure to compare with: recovered once every node involved serves again.
    if out_of_service(incident):
        return None
    return "no traffic before the failure to compare with; every node involved serves again", figures


def merge_details(incident: Incident, **changes) -> None:
    """Add to an incident's details as they are in the database now: another reaction may have added its own
    since `incident` was read. Inside a transaction."""
    current = Incident.objects.select_for_update().filter(pk=incident.pk).values_list("details", flat=True).first()
    incident.details = {**(current or {}), **changes}
    Incident.objects.filter(pk=incident.pk).update(details=incident.details)


def _note_latency(incident: Incident, now: dt.datetime) -> None:
    if incident.recovered_at is not None:
        return
    judged = _latency_recovered(incident, now)
    if judged is None:
        return
    why, figures = judged
    seconds = (now - incident.opened_at).total_seconds()
    claimed = Incident.objects.filter(pk=incident.pk, status=IncidentStatus.ACTIVE, recovered_at__isnull=True).update(
        recovered_at=now, recovery_time_s=seconds
    )
    if not claimed:
        return
    incident.recovered_at, incident.recovery_time_s = now, seconds
    merge_details(incident, recovery=figures)
    add_event(
        incident,
        EventKind.RECOVERED,
        f"Recovered to the baseline {seconds:.1f} s after the first symptom: {why}",
        at=now,
        details=figures,
    )
    transaction.on_commit(lambda pk=incident.pk: events.incident_changed(pk))


def note_capacity(incident: Incident, at: dt.datetime) -> None:
    """Capacity restored (every node involved back in routing, or replaced by a spare in service): its time, once,
    and Stable if latency has recovered too. Called as each node returns, and by the periodic check, at `at`
    (now)."""
    if incident.status != IncidentStatus.ACTIVE or incident.capacity_restored_at is not None:
        return
    # One reading decides and is told (a node in routing when judged, out of it and with no spare when described,
    # once killed the periodic check on a KeyError in the chaos soak).
    reading = coverage(incident)
    if not reading.nodes:
        _conditions_over(incident, at)
        return
    if reading.missing:
        return  # some node neither back nor replaced: judged again as the next one returns, or by the periodic check
    # Dated by the nodes themselves, not by when this runs (a reaction can run late, or for an earlier step): the
    # last node to return, each by the time it entered its current state and health, or its spare by its promotion.
    returned = [
        max(n.state_changed_at, n.health_changed_at) if reading.in_routing[n.name] else reading.spares[n.name].at
        for n in reading.nodes
    ]
    at = min(max([*returned, incident.opened_at]), at)
    claimed = Incident.objects.filter(
        pk=incident.pk, status=IncidentStatus.ACTIVE, capacity_restored_at__isnull=True
    ).update(capacity_restored_at=at)
    if not claimed:
        return
    incident.capacity_restored_at = at
    how = ", ".join(
        f"{node.name} in routing"
        if reading.in_routing[node.name]
        else f"hot spare {reading.spares[node.name].node.name} serves in place of {node.name}"
        for node in reading.nodes
    )
    spares = {name: event.node.name for name, event in reading.spares.items()}
    seconds = (at - incident.opened_at).total_seconds()
    add_event(
        incident,
        EventKind.CAPACITY_RESTORED,
        f"Capacity restored {seconds:.1f} s after the first symptom: {how}",
        at=at,
        details={"seconds": round(seconds, 3), "spares": spares},
    )
    transaction.on_commit(lambda pk=incident.pk: events.incident_changed(pk))
    _stabilize(incident, at)


def _conditions_over(incident: Incident, at: dt.datetime) -> None:
    """An incident of no node whose lasting failures (a gateway lost, a store away, a poison request) have all
    cleared: what it took is restored when the last cleared."""
    conditions = list(incident.conditions.all())
    if not conditions or any(c.cleared_at is None for c in conditions):
        return
    _restored(
        incident, min(max(c.cleared_at for c in conditions), at), "the first symptom: every failure of it cleared"
    )


def _stabilize(incident: Incident, now: dt.datetime) -> bool:
    """Active → Stable once latency recovered and capacity restored both hold, and no drain is open on its nodes
    (a spare may serve in a node's place while on-call has yet to decide what becomes of it)."""
    if incident.recovered_at is None or incident.capacity_restored_at is None:
        return False
    if incident.alerts.filter(status=AlertStatus.FIRING).exists():  # recovery.actions.alerts: an alert still fires
        return False
    if incident.conditions.filter(cleared_at__isnull=True).exists():  # recovery.actions.conditions: one still lasts
        return False
    if Drain.objects.filter(node__in=incident.nodes.all(), state__in=OPEN_DRAIN_STATES).exists():
        return False
    claimed = Incident.objects.filter(
        pk=incident.pk,
        status=IncidentStatus.ACTIVE,
        recovered_at__isnull=False,
        capacity_restored_at__isnull=False,
    ).update(status=IncidentStatus.STABLE, status_changed_at=now)
    if not claimed:
        return False
    incident.status = IncidentStatus.STABLE
    merge_details(incident, checkpoints_after=checkpoint_distribution())
    add_event(
        incident,
        EventKind.STATUS,
        f"Active → Stable: latency recovered {(incident.recovered_at - incident.opened_at).total_seconds():.1f} s "
        f"and capacity restored {(incident.capacity_restored_at - incident.opened_at).total_seconds():.1f} s "
        "after the first symptom",
        at=now,
    )
    transaction.on_commit(lambda pk=incident.pk: events.incident_changed(pk))
    return True


def severity_inputs(incident: Incident) -> dict:
    """What an incident's severity is judged on: the share of the nodes in service it took, the highest
    degradation level it saw, the requests that failed in it."""
    lost = set(
        incident.events.filter(kind=EventKind.DETECTED, node__isnull=False).values_list("node__name", flat=True)
    ) | set(out_of_service(incident))
    levels = [
        (e.get("new") or 0)
        for e in incident.events.filter(kind=EventKind.DEGRADATION).values_list("details", flat=True)
    ]
    in_service = max(incident.details.get("nodes_in_service") or 0, len(lost), 1)
    return {
        "capacity_lost": len(lost) / in_service,
        "peak_level": max(levels, default=0),
        "failed": incident.outcomes.filter(status="error").count(),
    }


def update_severity(incident: Incident, at: dt.datetime | None = None) -> str:
    """Raise the incident's severity to what it did (recovery.policy.severity), with why; never lowered."""
    judged, why = severity_policy.severity(**severity_inputs(incident))
    return raise_severity(incident, judged, why, at)


def raise_severity(incident: Incident, to: str, why: str, at=None) -> str:
    """The incident's severity raised to `to` (with why), never lowered; the severity it has now."""
    current = Incident.objects.filter(pk=incident.pk).values_list("severity", flat=True).first() or incident.severity
    if severity_policy.worse(to, current) == current:
        return current
    if not Incident.objects.filter(pk=incident.pk, severity=current).update(severity=to):
        return current  # raised meanwhile by another reaction
    incident.severity = to
    merge_details(incident, severity={"from": current, "to": to, "why": why, "at": _at(at).timestamp()})
    transaction.on_commit(lambda pk=incident.pk: events.incident_changed(pk))
    return to


def check_recovery(now: dt.datetime | None = None) -> list[int]:
    """For every active incident: latency recovered? capacity restored? severity? Returns the incidents that
    became Stable (both hold)."""
    now = now or timezone.now()
    stable = []
    for incident in Incident.objects.filter(status=IncidentStatus.ACTIVE):
        with transaction.atomic():
            update_severity(incident, now)
            _note_latency(incident, now)
            note_capacity(incident, now)
            if _stabilize(incident, now) or incident.status == IncidentStatus.STABLE:
                stable.append(incident.pk)
    return stable


# --- what people do -------------------------------------------------------------------------------
class IncidentActionError(ValueError):
    pass


@transaction.atomic
def acknowledge(incident: Incident, user) -> None:
    if incident.acknowledged_at is not None:
        raise IncidentActionError(
            f"already acknowledged by {incident.acknowledged_by} at {incident.acknowledged_at:%Y-%m-%d %H:%M:%S} UTC"
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
