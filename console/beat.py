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
"""

import os
from pathlib import Path

from django_celery_beat.schedulers import DatabaseScheduler

ALIVE_FILE_ENV = "LIFELINE_BEAT_ALIVE_FILE"


class Scheduler(DatabaseScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        alive = os.environ.get(ALIVE_FILE_ENV)
        self.alive_file = Path(alive) if alive else None

    def tick(self, *args, **kwargs):
        if self.alive_file is not None:
            try:
                self.alive_file.touch()
            except OSError:
                pass  # a full or read-only disk must not stop the schedule; the supervisor will see the age
        return super().tick(*args, **kwargs)
