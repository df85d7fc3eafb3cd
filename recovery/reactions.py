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

import logging

from celery import shared_task
from django.db import transaction
from django.utils import timezone

from recovery import tasks
from recovery.actions import capacity, drains, health, incidents, live_migration, nodes
from recovery.choices import DrainState, Health, HealthChange, NodeState
from recovery.models import (
    DegradationChange,
    DrainStep,
    HealthTransition,
    Node,
    NodeTransition,
    Notification,
)
from recovery.policy import capacity as capacity_policy

log = logging.getLogger(__name__)

BATCH = 500  # rows of one kind per pass; the next pass takes the rest


def on_node_transition(row: NodeTransition) -> None:
    node = row.node
    if row.actor == nodes.STARTUP:
        return  # a node of the run before the control plane started, found gone: not a failure
    if row.new_state == NodeState.DOWN and not node.spare:
        health.promote_spare_for(node, f"{node.name} is DOWN: {row.cause}")
    if row.old_state:
        incidents.on_node_transition(node.pk, row.old_state, row.new_state, row.cause, row.at)
    if row.new_state == NodeState.SERVING:
        if capacity.level_of(node.model_key):
            tasks.apply_batch_factor.delay_on_commit(node.pk)  # it joins at its model's level's batch limit
        if row.old_state == NodeState.JOIN:
            tasks.end_assist.delay_on_commit(node.pk)  # its full model is ready: its draft stops assisting


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
            tasks.start_assist.delay_on_commit(node.pk)


def on_drain_step(row: DrainStep) -> None:
    if row.new_state == DrainState.APPROVED and row.old_state != DrainState.APPROVED:
        drain = row.drain
        if drain.incident_id is None:
            # The node leaves service: capacity lost like a failure's, an incident of its own (the report counts
            # it), restored when the node is back in routing or a spare serves in its place.
            incidents.open_for_fault(drain.node, f"drain #{drain.pk} approved: {drain.reason}", at=row.at, drain=drain)
        tasks.advance_drain.delay_on_commit(row.drain_id)  # at once, not at the next beat
    elif row.new_state == DrainState.VERIFYING and (row.old_state != DrainState.VERIFYING or row.details.get("trial")):
        tasks.run_canary.delay_on_commit(row.drain.node_id, True)


def on_degradation_change(row: DegradationChange) -> None:
    incidents.on_degradation(row.old_level, row.new_level, row.cause, row.at, row.model_key)
    if row.model_key and row.new_level > row.old_level and not row.simulated:
        tasks.propose_placement.delay_on_commit(row.model_key, row.new_level)
    if capacity_policy.EFFECTS[row.old_level].batch_factor != capacity_policy.EFFECTS[row.new_level].batch_factor:
        serving = Node.objects.filter(state=NodeState.SERVING)
        if row.model_key:  # the model's own nodes: another model's batch is not cut for it
            serving = serving.filter(model_key=row.model_key)
        for node_id in serving.values_list("pk", flat=True):
            tasks.apply_batch_factor.delay_on_commit(node_id)


def on_notification(row: Notification) -> None:
    tasks.deliver_notification.delay_on_commit(row.pk, "webhook")
    tasks.deliver_notification.delay_on_commit(row.pk, "email")


REACTIONS = (
    (NodeTransition, on_node_transition),
    (HealthTransition, on_health_transition),
    (DrainStep, on_drain_step),
    (DegradationChange, on_degradation_change),
    (Notification, on_notification),
)


def process() -> int:
    """Run the reaction of every committed outbox row not yet handled; returns how many were handled.

    Each row is claimed first, so two workers never react twice. A reaction that
    fails is logged and not retried: every one of them is either retried by its
    own task (a notification's delivery) or redone by the periodic work it feeds
    (drains advance every second, canaries come due, capacity is re-evaluated).
    """
    handled = 0
    for model, react in REACTIONS:
        for row_id in model.objects.filter(reacted_at__isnull=True).order_by("pk").values_list("pk", flat=True)[:BATCH]:
            if not model.objects.filter(pk=row_id, reacted_at__isnull=True).update(reacted_at=timezone.now()):
                continue  # another worker took it
            row = model.objects.get(pk=row_id)
            try:
                with transaction.atomic():
                    react(row)
            except Exception:  # noqa: BLE001 - one reaction's failure must not stop the others
                log.exception("reaction to %s #%d failed", model.__name__, row_id)
            handled += 1
    return handled


@shared_task(ignore_result=True, expires=5)
def react() -> int:
    return process()
