"""What follows a committed change: the reactions to transition rows, run in one place, above every action.

A state change writes its transition row (a node's lifecycle step, a health
or breaker or spare change, a drain step, a degradation change, a
notification) in the same transaction as the change; each such row is an
outbox entry (`reacted_at` empty). `process`, run by Celery beat every second,
claims each new row with a conditional update and runs its reaction once:
promote a hot spare for a node gone DOWN or UNHEALTHY, propose the drain the
health machine asked for, write the incident timeline, start or end
speculative assist, send the degradation level's batch limit to the nodes,
advance an approved drain, run a drain's trial canary, deliver a
notification. Actions never call up into each other for these; so a
heartbeat, a canary or a page that changes a node does only that, and what
follows happens here, off every request's path, where it can be read in one
place.
"""

import datetime
import logging
import time

from celery import shared_task
from django.db import transaction
from django.urls import reverse
from django.utils import timezone
from kombu.exceptions import OperationalError

from recovery import tasks
from recovery.actions import capacity, conditions, drains, health, incidents, live_migration, nodes, notify
from recovery.choices import DrainState, Health, HealthChange, NodeState
from recovery.models import (
    DegradationChange,
    DrainStep,
    HealthTransition,
    Node,
    NodeTransition,
    Notification,
    ReactionFailure,
)
from recovery.policy import capacity as capacity_policy
from recovery.stores import away

log = logging.getLogger(__name__)

BATCH = 500  # rows of one kind per pass; the next pass takes the rest
RETRY_S = (1, 2, 4, 8, 16)  # a reaction that raised is tried again after each of these; after the last, given up
# What each kind of row's reaction does, in the words of the notification that says one did not run.
WHAT_IT_DOES = {
    "NodeTransition": "a spare for a node gone DOWN, the incident's timeline, the batch limit",
    "HealthTransition": "a spare and a drain for an unhealthy node, an incident for corruption or an Xid",
    "DrainStep": "the drain's next step, its incident, its trial canary",
    "DegradationChange": "the level's incident, the re-placement proposal, the batch limit on every node",
    "Notification": "the notification's delivery",
}
# A follow-up task is published after its reaction commits. The broker (Redis) may be restarting right then: the
# publish tries again every second for this long (a supervised Redis is back in a second or two).
PUBLISH_WAIT_S = 30.0
_broker_gave_up_at = 0.0  # when a publish last waited PUBLISH_WAIT_S in vain: the next ones then try once


def follow_up(task, *args) -> None:
    """Queue `task(*args)` once the reaction's transaction commits, riding out a broker restart.

    Celery's own publish retries for about two seconds and then raises out of
    the commit; the reaction's row is already claimed, so its follow-up would be
    lost with a traceback. Here the publish waits for the broker, and if it stays
    away past the wait, says what was not queued (the periodic work redoes most
    of it: drains advance every second, canaries and capacity come due).
    """
    transaction.on_commit(lambda: _publish(task, args))


def _publish(task, args: tuple) -> None:
    global _broker_gave_up_at
    patient = time.monotonic() - _broker_gave_up_at > PUBLISH_WAIT_S
    deadline = time.monotonic() + (PUBLISH_WAIT_S if patient else 0.0)
    while True:
        try:
            task.apply_async(args)
            return
        except OperationalError as exc:  # Celery's own retries (about two seconds) found no broker
            if time.monotonic() >= deadline:
                if patient:
                    _broker_gave_up_at = time.monotonic()
                log.error("%s%r not queued: the broker is unreachable (%s)", task.name, args, exc)
                return
            time.sleep(1.0)


def on_node_transition(row: NodeTransition) -> None:
    node = row.node
    if row.actor == nodes.STARTUP:
        return  # a node of the run before the control plane started, found gone: not a failure
    if row.new_state == NodeState.DOWN and not node.spare:
        health.promote_spare_for(node, f"{node.name} is DOWN: {row.cause}")
    if row.new_state == NodeState.DOWN and row.cause.startswith(nodes.SILENT):
        conditions.partitioned(node, row.session, row.at)  # silent, yet it answers: its incident says so
    elif row.new_state == NodeState.JOIN and row.old_state in (NodeState.DOWN, NodeState.LEFT):
        conditions.registered_again(node.name, row.at)
    if row.old_state:
        incidents.on_node_transition(node.pk, row.old_state, row.new_state, row.cause, row.at)
    if row.new_state == NodeState.SERVING:
        if capacity.level_of(node.model_key):
            follow_up(tasks.apply_batch_factor, node.pk)  # it joins at its model's level's batch limit
        if row.old_state == NodeState.JOIN:
            follow_up(tasks.end_assist, node.pk)  # its full model is ready: its draft stops assisting


def on_health_transition(row: HealthTransition) -> None:
    node = row.node
    if (
        row.kind == HealthChange.HEALTH
        and row.new in (Health.UNHEALTHY, Health.SUSPICIOUS)
        and row.details.get("drain")
    ):
        # The health machine took the node out (or would have, but for the cluster breaker): a spare in
        # its place, and a drain for on-call with the evidence and the remediation it calls for.
        if row.new == Health.UNHEALTHY:
            health.promote_spare_for(node, f"{node.name} became UNHEALTHY")
        drain = drains.open_drain(node)
        if drain is None:
            try:
                drain = drains.propose(
                    node, source="health machine", reason=row.cause, remediation=row.details["drain"]
                )
            except drains.DrainRefused as exc:
                log.info("no drain proposed for %s: %s", node.name, exc)
        if row.details.get("corrupt") or row.details.get("xid_event"):
            # Silent corruption or a CRITICAL Xid: an incident, linked to the drain. A corrupt node out of routing
            # also sends its requests in flight elsewhere now; those it served may carry corrupt tokens.
            moved = None
            if row.details.get("corrupt") and row.new == Health.UNHEALTHY:
                moved = live_migration.move_off_corrupt(node, row.cause, row.at)
            incidents.open_for_fault(node, row.cause, at=row.at, drain=drain, moved=moved)
    elif row.kind == HealthChange.SPARE and row.new == "False" and row.details.get("in_place_of"):
        incidents.on_spare_promoted(node, row.details["in_place_of"])
    elif row.kind == HealthChange.MODEL and row.new == "draft_ready":
        if incidents.on_draft_ready(node):
            follow_up(tasks.start_assist, node.pk)


def on_drain_step(row: DrainStep) -> None:
    if row.new_state == DrainState.APPROVED and row.old_state != DrainState.APPROVED:
        drain = row.drain
        if drain.incident_id is None:
            # The node leaves service: capacity lost like a failure's, an incident of its own (the report counts
            # it), restored when the node is back in routing or a spare serves in its place.
            incidents.open_for_fault(drain.node, f"drain #{drain.pk} approved: {drain.reason}", at=row.at, drain=drain)
        follow_up(tasks.advance_drain, row.drain_id)  # at once, not at the next beat
    elif row.new_state == DrainState.VERIFYING and (row.old_state != DrainState.VERIFYING or row.details.get("trial")):
        follow_up(tasks.run_canary, row.drain.node_id, True)


def on_degradation_change(row: DegradationChange) -> None:
    incidents.on_degradation(row.old_level, row.new_level, row.cause, row.at, row.model_key)
    if row.model_key and row.new_level > row.old_level and not row.simulated:
        follow_up(tasks.propose_placement, row.model_key, row.new_level)
    if capacity_policy.EFFECTS[row.old_level].batch_factor != capacity_policy.EFFECTS[row.new_level].batch_factor:
        serving = Node.objects.filter(state=NodeState.SERVING)
        if row.model_key:  # the model's own nodes: another model's batch is not cut for it
            serving = serving.filter(model_key=row.model_key)
        for node_id in serving.values_list("pk", flat=True):
            follow_up(tasks.apply_batch_factor, node_id)


def on_notification(row: Notification) -> None:
    for channel in notify.CHANNELS:
        follow_up(tasks.deliver_notification, row.pk, channel)


REACTIONS = (
    (NodeTransition, on_node_transition),
    (HealthTransition, on_health_transition),
    (DrainStep, on_drain_step),
    (DegradationChange, on_degradation_change),
    (Notification, on_notification),
)


def process() -> int:
    """Run the reaction of every committed outbox row not yet handled; returns how many were tried.

    Each row is claimed and reacted to in one transaction (SELECT … FOR UPDATE SKIP LOCKED): two workers never react
    twice, and a reaction cut short by a store going away (the database restarting, Redis gone) is rolled back with
    its claim, so the next call reacts to the row again; before, the claim was committed first and such a reaction
    was lost for good (the chaos soak found a spare promotion lost so). A reaction that raises for any other reason
    is rolled back too and tried again after RETRY_S (1, 2, 4, 8, 16 s: a row it needs not yet visible, a lock, a
    bug a deploy fixes); after the last try the row counts as handled and on-call is told what did not happen. Rows
    left unclaimed by a worker that died are simply found again: every pass reads every row not yet handled.
    """
    handled = 0
    now = timezone.now()
    for model, react in REACTIONS:
        waiting = set(
            ReactionFailure.objects.filter(outbox=model.__name__, next_try_at__gt=now).values_list("row_id", flat=True)
        )
        rows = model.objects.filter(reacted_at__isnull=True).order_by("pk").values_list("pk", flat=True)
        for row_id in rows[:BATCH]:
            if row_id in waiting:
                continue
            try:
                with transaction.atomic():
                    row = model.objects.select_for_update(skip_locked=True).filter(pk=row_id, reacted_at=None).first()
                    if row is None:
                        continue  # another worker has it, or had it
                    react(row)  # its follow-up tasks are queued once this commits (follow_up)
                    model.objects.filter(pk=row_id).update(reacted_at=timezone.now())
                    ReactionFailure.objects.filter(outbox=model.__name__, row_id=row_id).delete()
            except Exception as exc:  # noqa: BLE001 - one reaction's failure must not stop the others
                if away(exc):
                    raise  # the row stays unclaimed: reacted to once the store is back
                _failed(model, row_id, exc)
            handled += 1
    return handled


def _failed(model, row_id: int, exc: Exception) -> None:
    """A reaction raised (and was rolled back): count the try, and either set when to try again or give up."""
    name, now = model.__name__, timezone.now()
    with transaction.atomic():
        failure, _ = ReactionFailure.objects.select_for_update().get_or_create(
            outbox=name, row_id=row_id, defaults={"error": ""}
        )
        failure.tries += 1
        failure.error = f"{exc.__class__.__name__}: {exc}"[:2000]
        if failure.tries <= len(RETRY_S):
            failure.next_try_at = now + datetime.timedelta(seconds=RETRY_S[failure.tries - 1])
            failure.save()
            log.exception("reaction to %s #%d failed (try %d); tried again at %s", name, row_id, failure.tries,
                          failure.next_try_at.isoformat(timespec="seconds"))  # fmt: skip
            return
        failure.gave_up_at, failure.next_try_at = now, None
        failure.save()
        model.objects.filter(pk=row_id, reacted_at=None).update(reacted_at=now)
        log.exception("reaction to %s #%d failed %d times: given up", name, row_id, failure.tries)
        if model is not Notification:  # a notification's own reaction failing is not told by another one
            notify.send(
                "failure",
                f"A reaction did not run: {name} #{row_id}",
                f"The control plane's reaction to {name} #{row_id} ({WHAT_IT_DOES[name]}) raised on each of "
                f"{failure.tries} tries over {(now - failure.first_at).total_seconds():.0f} s and was given up: what "
                f"it would have done did not happen. The last error: {failure.error}. Do by hand what it calls for; "
                "admins see every failed reaction under Reaction failures in the admin.",
                url=_page_of(model, row_id),
                severity="sev2",
            )


def _page_of(model, row_id: int) -> str:
    """The console page where a person sees what the row was about."""
    row = model.objects.filter(pk=row_id).first()
    if isinstance(row, (NodeTransition, HealthTransition)):
        return reverse("node", args=[row.node.name])
    if isinstance(row, DrainStep):
        return reverse("drain", args=[row.drain_id])
    return reverse("degradation")


@shared_task(ignore_result=True, expires=5)
def react() -> int:
    return process()
