"""Celery tasks: adapters that call the actions and own retries."""

from celery import shared_task

from recovery import actions


@shared_task(ignore_result=True)
def check_heartbeats() -> dict:
    return {"down": actions.mark_silent_nodes_down(), "left": actions.mark_long_down_nodes_left()}


@shared_task(ignore_result=True)
def sync_hot_state() -> None:
    actions.sync_hot_state()
