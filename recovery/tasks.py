"""Celery tasks: adapters that call the actions and own retries."""

from celery import shared_task

from recovery import actions, events
from recovery.actions import incidents, streams


@shared_task(ignore_result=True)
def check_heartbeats() -> dict:
    return {"down": actions.mark_silent_nodes_down(), "left": actions.mark_long_down_nodes_left()}


@shared_task(ignore_result=True)
def sync_hot_state() -> None:
    actions.sync_hot_state()


@shared_task(ignore_result=True)
def process_gateway_streams() -> dict:
    """Failure symptoms, request fates and outcomes the gateways reported."""
    return streams.process()


@shared_task(ignore_result=True)
def check_incident_recovery() -> list[int]:
    return incidents.check_recovery()


@shared_task(ignore_result=True)
def start_assist(node_id: int) -> str:
    return incidents.start_assist(node_id)


@shared_task(ignore_result=True)
def end_assist(node_id: int) -> str:
    return incidents.end_assist(node_id)


@shared_task(ignore_result=True)
def publish_checkpoints() -> None:
    """Nudge the checkpoint pages: the distribution moves with every heartbeat."""
    events.checkpoints_changed()
