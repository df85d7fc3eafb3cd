"""What the gateways report is stored once even when the worker that read it dies or cannot store it
(recovery.actions.streams): entries read and never acknowledged are taken over after RECLAIM_IDLE_MS, a batch that
failed because the database was away is stored when it is back, and one malformed outcome is dropped alone."""

import datetime as dt
import json
import os
import subprocess
import sys
import time

import pytest
from django.db import OperationalError
from django.utils import timezone

from recovery import hot
from recovery.actions import slo, streams
from recovery.models import RequestOutcome
from tests.helpers import BASE_DIR
from tests.recovery.test_slo_rollups import report

# A real worker process killed, then windows of 200 ms: in the process phase.
pytestmark = [pytest.mark.django_db, pytest.mark.processes]

# A worker that reads three outcomes, as the consumer does, and is SIGKILLed before it acknowledges them.
DIES_AFTER_READING = """
import os, signal, sys
import redis
r = redis.Redis.from_url(sys.argv[1], decode_responses=True)
r.xgroup_create(sys.argv[2], sys.argv[3], id="0", mkstream=True)
read = r.xreadgroup(sys.argv[3], "worker-that-dies", {sys.argv[2]: ">"}, count=3)
print(len(read[0][1]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture
def outcomes(monkeypatch):
    monkeypatch.setattr(streams, "RECLAIM_IDLE_MS", 200)
    r, keys = hot.client(), hot.keys()
    r.delete(keys.outcomes, keys.signals)
    minute = timezone.now().replace(second=0, microsecond=0) - dt.timedelta(minutes=2)
    ids = []
    for s in range(0, 60, 10):
        gateway, data = report(minute + dt.timedelta(seconds=s))
        r.xadd(keys.outcomes, {"gateway": gateway, "data": json.dumps(data)})
        ids.append(data["request_id"])
    yield r, keys.outcomes, ids
    r.delete(keys.outcomes, keys.signals)


def stored() -> list[str]:
    return sorted(RequestOutcome.objects.values_list("request_id", flat=True))


def test_outcomes_a_sigkilled_worker_read_are_stored_by_the_next_call_once(outcomes):
    r, stream, ids = outcomes
    dying = subprocess.run(
        [sys.executable, "-c", DIES_AFTER_READING, os.environ["REDIS_URL"], stream, streams.GROUP],
        cwd=BASE_DIR,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert dying.returncode == -9 and dying.stdout.strip() == "3", dying.stderr
    assert streams.process()["outcomes"] == 3  # the three it never read; its three are not idle long enough yet
    time.sleep(0.3)
    assert streams.process()["outcomes"] == 3  # taken over from the dead worker
    assert streams.process()["outcomes"] == 0
    assert stored() == sorted(ids)
    assert r.xpending(stream, streams.GROUP)["pending"] == 0


def test_a_batch_the_database_refused_is_stored_once_it_is_back(outcomes, monkeypatch):
    r, stream, ids = outcomes
    real = slo.store_rolled_up

    def away(rows):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(slo, "store_rolled_up", away)
    with pytest.raises(OperationalError):
        streams.process()
    assert stored() == [] and r.xpending(stream, streams.GROUP)["pending"] == 6
    monkeypatch.setattr(slo, "store_rolled_up", real)
    assert streams.process()["outcomes"] == 0  # not idle long enough yet: no one takes over a live batch
    time.sleep(0.3)
    assert streams.process()["outcomes"] == 6
    assert stored() == sorted(ids)
    assert r.xpending(stream, streams.GROUP)["pending"] == 0


def test_one_malformed_outcome_is_dropped_alone(outcomes, caplog):
    r, stream, ids = outcomes
    bad = r.xadd(stream, {"gateway": "gw-1", "data": json.dumps({"request_id": "no-start-time"})})
    r.xadd(stream, {"gateway": "gw-1", "data": "{not json"})
    assert streams.process()["outcomes"] == 6
    assert stored() == sorted(ids)
    assert r.xpending(stream, streams.GROUP)["pending"] == 0
    assert f"dropping outcome {bad}" in caplog.text


def test_the_control_plane_has_read_since_a_time_only_once_a_worker_has_read_the_signals(outcomes):
    """What `manage.py demo` waits for before it says the stack is up (a stack announced before its Celery worker
    had read anything left a first failure unhandled for seconds): no read, or a read older than the start, is not
    enough; a worker's read after it is."""
    hot.client().delete(hot.keys().streams_read)
    before = time.time()
    assert not streams.read_since(before)  # no worker has read the streams
    streams.process()
    assert streams.read_since(before)
    time.sleep(0.05)
    assert not streams.read_since(time.time())  # the last read is older than now
