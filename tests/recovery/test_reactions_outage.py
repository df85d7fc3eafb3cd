"""A reaction cut short by the database going away is not lost: its claim rolls back with it and the next pass reacts
to the row again, once. The chaos soak found the loss: a health transition's reaction (a spare promotion, an incident
opening) raised when the database restarted, after its row's claim had committed, and nothing ever redid it."""

import logging

import pytest
from django.db import OperationalError

from recovery import reactions
from recovery.models import Notification

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


def test_a_reaction_that_fails_for_another_reason_is_logged_and_not_retried_for_ever(reacted, caplog):
    seen, fail = reacted
    bad = Notification.objects.create(kind="test", title="a bug")
    good = Notification.objects.create(kind="test", title="next")
    fail.append(ValueError("a bug in the reaction"))
    with caplog.at_level(logging.ERROR, logger="recovery.reactions"):
        assert reactions.process() == 2  # the other reactions go on
    assert seen == [good.pk]
    assert any(f"Notification #{bad.pk} failed" in r.getMessage() and r.exc_info for r in caplog.records)
    bad.refresh_from_db()
    assert bad.reacted_at is not None
    assert reactions.process() == 0
