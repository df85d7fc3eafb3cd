"""Celery beat's scheduler, with a sign of life a supervisor can read.

django-celery-beat's DatabaseScheduler, unchanged, except that every tick of
beat's loop (at least every 5 s: DEFAULT_MAX_INTERVAL) touches the file named
by LIFELINE_BEAT_ALIVE_FILE, when set. A beat that stops ticking sends no
periodic task: no heartbeat is checked, no canary runs, no drain advances, and
the control plane looks alive while it decides nothing. Its supervisor (the
demo's, console.stack; systemd or Kubernetes elsewhere, from the same file's
age) restarts a beat whose file has gone stale, with SIGKILL: a beat stuck in a
call may not run its SIGTERM handler either (seen in the chaos soak: beat went
silent after a Redis restart and a SIGTERM did not end it).

A beat that starts while its database refuses connections (restarted, or
failed over) waits for it, saying why, instead of dying in the
scheduler's first read with a traceback and a restart (seen in the chaos soak:
beat restarted by its supervisor a second before a database restart). It
touches its file while it waits: it is not stuck, and nothing can be scheduled
until the database is back.

It also runs the store watch (recovery.actions.conditions.StoreWatch): a thread that probes Redis and the database
every half second and opens an incident when either is away longer than a heartbeat interval.

SIGTERM and SIGINT end beat by unwinding its loop, whose `finally` saves the
schedule. Celery's own handler saves it inside the signal handler, on top of
whatever the loop was doing: a signal that landed during a tick's query
waited forever for the database connection that query held (the chaos soak's
beat restart: beat went silent and was killed 30 s later, the control plane
deciding nothing meanwhile).
"""

import logging
import os
import signal
import threading
import time
from pathlib import Path

from django.db import DatabaseError, connection
from django_celery_beat.schedulers import DatabaseScheduler

log = logging.getLogger(__name__)

ALIVE_FILE_ENV = "LIFELINE_BEAT_ALIVE_FILE"
DATABASE_WAIT_S = 1.0


class Scheduler(DatabaseScheduler):
    def __init__(self, *args, **kwargs):
        alive = os.environ.get(ALIVE_FILE_ENV)
        self.alive_file = Path(alive) if alive else None
        if threading.current_thread() is threading.main_thread():  # beat run on its own, not inside a worker
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, _unwind)
        wait_for_database(self.touch)
        super().__init__(*args, **kwargs)
        # Redis or the database away longer than a heartbeat interval is an incident (recovery.actions.conditions):
        # beat, the control plane's one process of its kind, watches both for the whole of its life.
        from recovery.actions import conditions

        conditions.StoreWatch().start()

    def touch(self) -> None:
        if self.alive_file is not None:
            try:
                self.alive_file.touch()
            except OSError:
                pass  # a full or read-only disk must not stop the schedule; the supervisor will see the age

    def tick(self, *args, **kwargs):
        self.touch()
        return super().tick(*args, **kwargs)


def _unwind(signum, frame) -> None:
    raise SystemExit()


def wait_for_database(alive=lambda: None) -> float:
    """Return once the database accepts a connection and a query; the seconds waited. While it refuses, log why
    (once for each reason, without a traceback: an outage is not a bug), and try again and call `alive` every
    DATABASE_WAIT_S."""
    began, said = time.monotonic(), None
    while True:
        try:
            connection.ensure_connection()
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
        except DatabaseError as exc:
            connection.close()
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if reason != said:
                log.warning("beat waits for its database: %s", reason)
                said = reason
            alive()
            time.sleep(DATABASE_WAIT_S)
            continue
        waited = time.monotonic() - began
        if said is not None:
            log.warning("beat's database is back after %.1f s; the schedule starts", waited)
        return waited
