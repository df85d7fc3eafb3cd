"""The routing table gateways read is never older than the last change committed, whichever processes publish it
and in whatever order their reads and writes interleave."""

import json
import threading

import pytest
from django.db import connection

from recovery import hot
from recovery.actions import routing
from recovery.models import Node
from tests.recovery.test_trusted_providers import serve

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_table_read_before_another_publishers_commit_is_never_written_after_its_publish(monkeypatch):
    """The operations e2e caught it: a spare put back in the pool (weight 0) kept its traffic. Another process had
    read the table before that change committed and wrote it after the change's own publish: gateways routed by the
    stale table until the next change or the 30 s sync."""
    node = serve("rp-01")
    assert json.loads(hot.client().hget(hot.keys().routing, "rp-01"))["weight"] == 1.0
    read, go = threading.Event(), threading.Event()
    write = hot.publish_routing

    def held_between_read_and_write(entries, deployed_models=None):
        if threading.current_thread().name == "late":
            read.set()  # its table is read, before the change below commits
            go.wait(2)  # and is written after that change's publish, unless the publishes are kept apart
        write(entries, deployed_models)

    monkeypatch.setattr(hot, "publish_routing", held_between_read_and_write)

    def late() -> None:
        try:
            routing.publish_routing()
        finally:
            connection.close()

    thread = threading.Thread(target=late, name="late")
    thread.start()
    assert read.wait(5)
    Node.objects.filter(pk=node.pk).update(spare=True)  # back in the pool (weight 0): committed (autocommit)
    routing.publish_routing()  # the change's own publish, after its commit
    go.set()
    thread.join(10)
    assert not thread.is_alive()
    assert json.loads(hot.client().hget(hot.keys().routing, "rp-01"))["weight"] == 0.0
