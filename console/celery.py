import itertools
import logging
import os
from time import sleep

from celery import Celery
from celery.contrib.django.task import DjangoTask
from celery.exceptions import Ignore
from celery.signals import beat_init
from django.conf import settings
from django.db import close_old_connections

from recovery.stores import DATABASE_AWAY, STORE_ERRORS, away, store_of

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
log = logging.getLogger(__name__)

RETRY_BACKOFF_MAX_S = 60
RETRIES_WHILE_AWAY = 12  # about ten minutes of backoff, then the task fails for good


class Task(DjangoTask):
    """Every Lifeline task. Its database or Redis being away is an outage to wait out, not a bug to trace: a
    periodic task skips this tick (the next one does the work; they are idempotent), any other is retried with
    exponential backoff."""

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except STORE_ERRORS as exc:
            close_old_connections()  # a broken connection is not reused
            if self.request.called_directly or not away(exc):
                raise
            store = store_of(exc)
            reason = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0][:200]
            if self.name in {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}:
                log.warning("%s skipped: the %s is unavailable (%s); the next tick runs it", self.name, store, reason)
                raise Ignore() from None
            countdown = min(2**self.request.retries, RETRY_BACKOFF_MAX_S)
            log.warning("%s: the %s is unavailable (%s); retrying in %d s", self.name, store, reason, countdown)
            raise self.retry(exc=exc, countdown=countdown, max_retries=RETRIES_WHILE_AWAY) from None


app = Celery("lifeline", task_cls=Task)
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
app.autodiscover_tasks(related_name="reactions")  # recovery.reactions.react: the outbox, every second


@beat_init.connect
def _control_plane_started(sender=None, **kwargs) -> None:
    """Beat starts with the control plane (there is exactly one): nodes that have not served yet are joining,
    and the level kept from before the start is evaluated afresh (recovery.actions.capacity). Beat restarted alone,
    while the control plane kept hearing the fleet, is not a start (capacity.beat_started)."""
    # Imported here, not at the top: this module loads with the console package, before Django's apps are ready.
    from recovery.actions import capacity

    for attempt in itertools.count():
        try:
            capacity.beat_started()
            return
        except STORE_ERRORS as exc:
            # A store away while beat starts (a restart during an outage): wait it out, as every task does; beat
            # could not send a task without Redis anyway. Lost, the start would leave the grace unpublished.
            if not away(exc):
                raise
            if isinstance(exc, DATABASE_AWAY):
                close_old_connections()  # a broken connection is not reused
            wait = min(2**attempt, RETRY_BACKOFF_MAX_S)
            log.warning("beat's start-up waits: the %s is unavailable (%s); again in %d s", store_of(exc), exc, wait)
            sleep(wait)
