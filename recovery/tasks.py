"""Celery tasks: adapters that take ids, re-read the rows, call an action and own retries.

No business logic here, and no enqueueing of other work from inside an
action: what follows a committed change is recovery.reactions' to start.
"""

import datetime as dt

from celery import shared_task

from recovery.actions import (
    capacity,
    conditions,
    drains,
    experiments,
    health,
    history,
    incidents,
    moe,
    nodes,
    notify,
    replacement,
    routing,
    slo,
    streams,
)
from recovery.models import Drain, Node, Notification


@shared_task(ignore_result=True)
def check_heartbeats() -> dict:
    return {"down": nodes.mark_silent_nodes_down(), "left": nodes.mark_long_down_nodes_left()}


@shared_task(ignore_result=True)
def sync_hot_state() -> None:
    routing.sync_hot_state()


@shared_task(ignore_result=True)
def restore_hot_state() -> bool:
    return routing.restore_hot_state_if_lost()


@shared_task(ignore_result=True)
def process_gateway_streams() -> dict:
    """Failure symptoms, request fates and outcomes the gateways reported."""
    return streams.process()


@shared_task(ignore_result=True)
def check_conditions() -> dict:
    return {
        "nvlink": conditions.check_nvlink(),
        "slow": conditions.check_slow_gpus(),
        "gateways": conditions.check_gateways(),
        "poison_cleared": conditions.check_poison(),
    }


@shared_task(ignore_result=True)
def check_incident_recovery() -> list[int]:
    return incidents.check_recovery()


@shared_task(ignore_result=True)
def return_spares() -> list[str]:
    return health.return_spares()


@shared_task(ignore_result=True)
def start_assist(node_id: int) -> str:
    return incidents.start_assist(node_id)


@shared_task(ignore_result=True)
def end_assist(node_id: int) -> str:
    return incidents.end_assist(node_id)


# --- health and operations (source document 003) --------------------------------------------------
@shared_task(ignore_result=True)
def schedule_canaries() -> int:
    """Every second: the nodes whose canary is due (or whose breaker allows a trial) get one, each in its own task."""
    due = health.schedule_canaries()
    for node_id, trial in due:
        run_canary.delay(node_id, trial)
    return len(due)


@shared_task(ignore_result=True, expires=60)
def run_canary(node_id: int, trial: bool = False) -> str:
    node = Node.objects.filter(pk=node_id).first()
    if node is None:
        return "no such node"
    found = ""
    deployment = moe.deployment_of(node)
    if deployment is not None:
        # An attention worker's answer is its EWs' too: they are canaried first, one EW at a time, so a corrupt EW is
        # named and drained before the AW's own canary is judged (it would take the EW's corruption for the AW's).
        found = "; ".join(a for a in moe.canary(deployment.pk) if "mismatch" in a)
    result = health.run_canary(node, trial=trial)
    return f"{node.name}: {result.kind}" + (f" (its EWs first: {found})" if found else "")


@shared_task(ignore_result=True)
def evaluate_capacity() -> int:
    return capacity.evaluate()


@shared_task(ignore_result=True, autoretry_for=(OSError,), retry_backoff=True, max_retries=3)
def apply_batch_factor(node_id: int) -> str:
    node = Node.objects.filter(pk=node_id).first()
    return capacity.apply_batch_factor(node) if node else "no such node"


@shared_task(ignore_result=True)
def advance_drains() -> list[str]:
    """Every running drain a step further, then every running re-placement (its next switch once one is done)."""
    return drains.advance_all() + replacement.advance_all()


@shared_task(ignore_result=True)
def propose_placement(model: str, level: int) -> int | None:
    """A model's level rose: a re-placement proposal when the planner finds one that helps it (seconds of CP-SAT
    and simulation, so a task of its own, not the reaction)."""
    proposal = replacement.propose_for_level(model, level)
    return proposal.pk if proposal else None


@shared_task(ignore_result=True)
def propose_drains_again() -> list[int]:
    """Drains cancelled or rejected while their node stays out of service, proposed again after the hold-off."""
    return [drain.pk for drain in drains.propose_again()]


@shared_task(ignore_result=True)
def advance_drain(drain_id: int) -> bool:
    drain = Drain.objects.select_related("node").filter(pk=drain_id).first()
    return drains.advance(drain) if drain else False


@shared_task(bind=True, ignore_result=True, max_retries=5)
def deliver_notification(self, notification_id: int, channel: str) -> str:
    notification = Notification.objects.filter(pk=notification_id).first()
    if notification is None:
        return "no such notification"
    try:
        return notify.deliver(notification, channel)
    except notify.DeliveryFailed as exc:
        if self.request.retries >= self.max_retries:  # the last try: a dead letter, for on-call to send again
            return notify.give_up(notification, channel, self.request.retries + 1, str(exc))
        raise self.retry(exc=exc, countdown=min(2**self.request.retries * 5, 300)) from None


# --- service-level objectives ----------------------------------------------------------------------------------
@shared_task(ignore_result=True)
def roll_up_outcomes() -> int:
    """Request outcomes into their minutes' SLO rollups: what the last run did not count, once."""
    return slo.roll_up()


@shared_task(ignore_result=True)
def prune_outcomes() -> dict:
    """Raw outcomes past their retention, rollups past 13 months."""
    return slo.prune()


@shared_task(ignore_result=True)
def backfill_history(until: float | None = None) -> str:
    """The demo's generated past (recovery.actions.history), one day per task: this day, then the next enqueued, so
    the worker is never held for long and a stop in between resumes at the next start. Run twice, it adds nothing."""
    run = history.claim(dt.datetime.fromtimestamp(until, tz=dt.UTC) if until else None)
    if run is None:
        return "no fleet yet"
    if not history.write_next_day(run):
        return "done" if run.finished_at else "taken by another run"
    if run.finished_at is None:
        backfill_history.delay()
    return f"day {run.days_done} of {run.days}"


# --- experiments (the console's Experiments page) --------------------------------------------------------------
@shared_task(ignore_result=True, acks_late=False)
def run_experiment(run_id: int) -> str:
    """One queued experiment, to its end. Acknowledged on receipt, not after: a run that killed its worker would
    only kill the next one too, so it is not delivered again (its row stays running, and can be cancelled)."""
    return experiments.execute(run_id)


@shared_task(ignore_result=True)
def watch_moe() -> dict:
    """Every MoE deployment's expert workers polled, its table healed and pushed (recovery.actions.moe)."""
    return moe.watch()
