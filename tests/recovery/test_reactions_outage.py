"""A reaction is not lost. One cut short by the database going away rolls back with its claim and the next pass reacts
to the row again, once (the chaos soak found the loss: a health transition's reaction, a spare promotion or an
incident opening, raised when the database restarted after its row's claim had committed, and nothing redid it). One
that raises for another reason is tried again with backoff, and after its last try on-call is told what did not
happen."""

import logging

import pytest
from django.db import OperationalError
from django.utils import timezone

from recovery import reactions
from recovery.models import Cluster, Node, NodeTransition, Notification, Rack, ReactionFailure

pytestmark = pytest.mark.django_db


@pytest.fixture
def reacted(monkeypatch):
    """The notifications reacted to, in order; `fail` holds the exception the next reaction raises, if any."""
    seen: list[int] = []
    fail: list[Exception] = []

    def on_notification(row):
        if fail:
            raise fail.pop()
        seen.append(row.pk)

    monkeypatch.setattr(reactions, "REACTIONS", ((Notification, on_notification),))
    return seen, fail


def test_a_reaction_cut_short_by_the_database_going_away_is_reacted_to_once_it_is_back(reacted):
    seen, fail = reacted
    row = Notification.objects.create(kind="test", title="spare to promote")
    fail.append(OperationalError("terminating connection due to administrator command"))
    with pytest.raises(OperationalError):
        reactions.process()  # the store is away: the pass stops, as the worker's task does
    row.refresh_from_db()
    assert row.reacted_at is None  # not claimed for good
    assert reactions.process() == 1
    row.refresh_from_db()
    assert seen == [row.pk] and row.reacted_at is not None
    assert reactions.process() == 0  # and only once


def test_a_reaction_that_raises_is_rolled_back_and_tried_again_after_a_backoff_until_it_runs(reacted, caplog):
    seen, fail = reacted
    bad = Notification.objects.create(kind="test", title="a row it needs is not there yet")
    good = Notification.objects.create(kind="test", title="next")
    fail.append(ValueError("not yet"))
    with caplog.at_level(logging.ERROR, logger="recovery.reactions"):
        assert reactions.process() == 2  # the other reactions go on
    assert seen == [good.pk]
    assert any(f"Notification #{bad.pk} failed (try 1)" in r.getMessage() and r.exc_info for r in caplog.records)
    bad.refresh_from_db()
    failure = ReactionFailure.objects.get(outbox="Notification", row_id=bad.pk)
    assert bad.reacted_at is None and failure.tries == 1 and failure.error == "ValueError: not yet"
    assert reactions.process() == 0  # not before its backoff (1 s)
    _due(failure)
    assert reactions.process() == 1
    bad.refresh_from_db()
    assert seen == [good.pk, bad.pk] and bad.reacted_at is not None
    assert not ReactionFailure.objects.exists()  # ran: nothing left to say
    assert reactions.process() == 0


def test_a_reaction_that_raises_on_every_try_is_given_up_and_on_call_is_told_what_did_not_happen(monkeypatch):
    cluster = Cluster.default()
    rack = Rack.objects.create(cluster=cluster, name="rack-a")
    node = Node.objects.create(cluster=cluster, rack=rack, name="gpu-7", address="http://127.0.0.1:1")
    row = NodeTransition.objects.create(node=node, session="s", old_state="SERVING", new_state="DOWN", cause="gone")

    def broken(row):
        raise RuntimeError("spare pool query failed")

    monkeypatch.setattr(reactions, "REACTIONS", ((NodeTransition, broken), (Notification, lambda row: None)))
    waits = []
    for _ in range(len(reactions.RETRY_S)):
        reactions.process()
        failure = ReactionFailure.objects.get(outbox="NodeTransition", row_id=row.pk)
        waits.append(round((failure.next_try_at - timezone.now()).total_seconds()))
        _due(failure)
    assert waits == list(reactions.RETRY_S)  # 1, 2, 4, 8, 16 s apart
    assert not Notification.objects.exists()  # nobody is told while it may still run
    reactions.process()  # the last try
    row.refresh_from_db()
    failure = ReactionFailure.objects.get(outbox="NodeTransition", row_id=row.pk)
    assert row.reacted_at is not None and failure.gave_up_at is not None and failure.tries == 6
    [told] = Notification.objects.all()
    assert told.kind == "failure" and told.severity == "sev2" and told.url == "/nodes/gpu-7/"
    assert f"NodeTransition #{row.pk}" in told.title and "a spare for a node gone DOWN" in told.body
    assert "RuntimeError: spare pool query failed" in told.body and "did not happen" in told.body
    reactions.process()
    assert ReactionFailure.objects.get().tries == 6  # given up: not tried again


def _due(failure: ReactionFailure) -> None:
    ReactionFailure.objects.filter(pk=failure.pk).update(next_try_at=timezone.now())
