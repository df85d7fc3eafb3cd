"""A reaction's follow-up task outlives a broker restart: it waits for Redis, and never raises out of the commit.

The chaos soak's Redis restart found it: the reaction committed, its follow-up's
publish raised in the commit hook (Celery retries for about half a second), the
worker logged a traceback, and the follow-up was lost with its row claimed.
"""

import logging
import subprocess
import threading
import time

import pytest
import redis
from celery import Celery
from kombu.exceptions import OperationalError

from console.stack import free_port, redis_server_binary
from recovery import reactions, tasks
from recovery.models import Notification

pytestmark = pytest.mark.django_db(transaction=True)


def start_redis(port: int) -> subprocess.Popen:
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=1)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return server
        except redis.RedisError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)


def test_a_follow_up_published_while_the_broker_is_away_waits_for_it_to_come_back():
    port = free_port()
    app = Celery("broker-restart", broker=f"redis://127.0.0.1:{port}/0", set_as_current=False)

    @app.task(name="follow-up")
    def follow(value):  # pragma: no cover - only queued, never run
        return value

    started: list[subprocess.Popen] = []
    timer = threading.Timer(4.0, lambda: started.append(start_redis(port)))  # a restart: away four seconds
    timer.start()
    try:
        began = time.monotonic()
        reactions._publish(follow, (7,))
        waited = time.monotonic() - began
        assert started, "the publish returned before the broker was back: it was not queued"
        assert 3.9 < waited < reactions.PUBLISH_WAIT_S
        assert redis.Redis(port=port).llen("celery") == 1  # queued, once
    finally:
        timer.cancel()
        for server in started:
            server.terminate()
            server.wait(10)


def test_a_follow_up_the_broker_never_takes_is_logged_as_lost_and_the_other_reactions_go_on(
    monkeypatch, caplog, django_capture_on_commit_callbacks
):
    attempts = []

    def broker_away(args, **options):
        attempts.append(tuple(args))
        raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(tasks.deliver_notification, "apply_async", broker_away)
    monkeypatch.setattr(reactions, "_broker_gave_up_at", 0.0)
    monkeypatch.setattr(reactions, "PUBLISH_WAIT_S", 1.5)
    first = Notification.objects.create(kind="test", title="first")
    second = Notification.objects.create(kind="test", title="second")

    with caplog.at_level(logging.INFO, logger="recovery.reactions"):
        with django_capture_on_commit_callbacks(execute=True):
            assert reactions.process() == 2  # neither raised out of its commit

    records = [r for r in caplog.records if r.name == "recovery.reactions"]
    assert not [r for r in records if r.exc_info], "a broker outage is not a traceback"
    lost = [r.getMessage() for r in records if "not queued" in r.getMessage()]
    assert len(lost) == 6 and f"({first.pk}, 'webhook')" in lost[0] and "unreachable" in lost[0]
    # The first tried every second for the whole wait; the five after it (each notification's three channels),
    # within a wait of that, once each.
    retried = attempts.count((first.pk, "webhook"))
    assert retried >= 2 and attempts[:retried] == [(first.pk, "webhook")] * retried
    assert attempts[retried:] == [
        (first.pk, "email"),
        (first.pk, "personal"),
        (second.pk, "webhook"),
        (second.pk, "email"),
        (second.pk, "personal"),
    ]
    assert not Notification.objects.filter(reacted_at__isnull=True).exists()
