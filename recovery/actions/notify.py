"""Telling on-call: in the console (live), by a webhook and by e-mail.

A Notification row is written with the state change that calls for it; it is
an outbox row: once committed, recovery.reactions sends the webhook and the
e-mail from Celery, with retries, and each records how its delivery went on
the row in words on-call reads at a glance: "not configured", "sent, 200", "sent to …", "failed: <why>".

A delivery that fails every try is a dead letter: "gave up after N tries: <why>" on its channel, listed with the
others that gave up (`undelivered`) on the drains page and at /api/notifications?undelivered=1, where on-call sends it
again once the receiver is mended (`resend`, audited).
"""

import json
import logging
import smtplib
import urllib.error
import urllib.request

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.mail import send_mail
from django.db import transaction
from django.db.models import Q, QuerySet

from recovery import events, roles
from recovery.actions import audit
from recovery.models import Cluster, Notification, NotificationRule

log = logging.getLogger(__name__)


CHANNELS = ("webhook", "email")
# What each kind of notification is, in the words an on-call engineer chooses them by on their profile.
KINDS = {
    "alert": "pages from Alertmanager",
    "drain_requested": "drains waiting for approval",
    "placement_proposed": "re-placements waiting for approval",
    "cluster_breaker": "automatic cordons stopped",
    "failure": "failures found by the control plane (a gateway lost, a store away, a poison request)",
}
GAVE_UP = "gave up"


class DeliveryFailed(Exception):
    pass


class NotUndelivered(Exception):
    """A resend asked of a channel that did not give up: nothing to send again."""


def send(kind: str, title: str, body: str, url: str = "") -> Notification:
    """Write a notification; after commit it shows in every open console and goes out by webhook and e-mail."""
    notification = Notification.objects.create(kind=kind, title=title, body=body, url=url)
    transaction.on_commit(lambda: events.notification(notification.pk))
    return notification


def _record(notification: Notification, channel: str, outcome: str) -> None:
    with transaction.atomic():
        row = Notification.objects.select_for_update().get(pk=notification.pk)
        row.delivery = {**row.delivery, channel: outcome}
        row.save(update_fields=["delivery"])


def post_webhook(url: str, payload: dict, timeout: float = 5.0) -> int:
    """POST `payload` as JSON; the status, or DeliveryFailed when the receiver did not take it."""
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "User-Agent": "lifeline"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        raise DeliveryFailed(f"{url} answered {exc.code}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise DeliveryFailed(f"{url}: {getattr(exc, 'reason', exc)}") from None


def recipients(cluster: Cluster, kind: str = "") -> list[str]:
    """The team's addresses (`oncall_emails`), and each on-call engineer's and admin's whose rule takes `kind`."""
    listed = [a.strip() for a in cluster.oncall_emails.split(",") if a.strip()]
    users = (
        get_user_model()
        .objects.filter(groups__name__in=(roles.ONCALL, roles.ADMIN), is_active=True)
        .exclude(email="")
        .select_related("notification_rule")
    )
    return sorted(set(listed) | {u.email for u in users if wants(u, kind)})


def wants(user, kind: str) -> bool:
    """Whether `user`'s rule has them e-mailed about `kind` (no rule: every kind)."""
    try:
        rule = user.notification_rule
    except NotificationRule.DoesNotExist:
        return True
    return rule.email and (not rule.kinds or kind in rule.kinds)


def set_rule(user, email: bool, kinds: list[str]) -> NotificationRule:
    """One person's rule, audited. Only those e-mailed (on-call, admin) have one; ValueError names an unknown kind."""
    if not roles.has_role(user, roles.ONCALL):
        raise PermissionError(f"only on-call engineers and admins are e-mailed; {user.get_username()} is not")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"kinds: {', '.join(unknown)} unknown; the kinds are {', '.join(KINDS)}")
    with transaction.atomic():
        rule, _ = NotificationRule.objects.update_or_create(
            user=user, defaults={"email": email, "kinds": [k for k in KINDS if k in kinds]}
        )
        audit.record(user.get_username(), "notification_rule", f"user:{user.get_username()}", "", **_rule(rule))
    return rule


def _rule(rule: NotificationRule) -> dict:
    return {"email": rule.email, "kinds": rule.kinds}


def deliver(notification: Notification, channel: str) -> str:
    """Send one notification on one channel; raises DeliveryFailed for the task to retry."""
    cluster = Cluster.default()
    link = settings.LIFELINE_CONSOLE_URL + notification.url if notification.url else settings.LIFELINE_CONSOLE_URL
    if channel == "webhook":
        if not cluster.oncall_webhook_url:
            outcome = "not configured"
            _record(notification, channel, outcome)
            return outcome
        payload = {
            "kind": notification.kind,
            "title": notification.title,
            "text": f"{notification.title}\n{notification.body}\n{link}",
            "body": notification.body,
            "url": link,
            "at": notification.at.isoformat(),
            "id": notification.pk,
        }
        try:
            status = post_webhook(cluster.oncall_webhook_url, payload)
        except DeliveryFailed as exc:
            _record(notification, channel, f"failed: {exc}")
            raise
        outcome = f"sent, {status}"
    elif channel == "email":
        to = recipients(cluster, notification.kind)
        if not to:
            outcome = "not configured"
            _record(notification, channel, outcome)
            return outcome
        try:
            send_mail(
                f"[Lifeline] {notification.title}", f"{notification.body}\n\n{link}\n", settings.DEFAULT_FROM_EMAIL, to
            )
        except (OSError, smtplib.SMTPException) as exc:  # the mail server refused or is unreachable: retried
            _record(notification, channel, f"failed: {exc}")
            raise DeliveryFailed(str(exc)) from None
        outcome = f"sent to {', '.join(to)}"
    else:
        raise ValueError(f"unknown channel {channel!r}")
    _record(notification, channel, outcome)
    return outcome


def give_up(notification: Notification, channel: str, tries: int, why: str) -> str:
    """The last try failed: the channel's delivery becomes a dead letter."""
    outcome = f"{GAVE_UP} after {tries} tries: {why}"
    _record(notification, channel, outcome)
    log.warning("notification %d: %s %s", notification.pk, channel, outcome)
    return outcome


def undelivered() -> QuerySet:
    """The notifications a channel gave up on, newest first."""
    return Notification.objects.filter(
        Q(delivery__webhook__startswith=GAVE_UP) | Q(delivery__email__startswith=GAVE_UP)
    )


def resend(notification: Notification, channel: str, actor: str, reason: str = "") -> str:
    """Queue a dead letter's channel again (the caller sends it after commit): its delivery reads "queued again by
    <actor>" until the task records how it went. NotUndelivered unless that channel gave up."""
    if channel not in CHANNELS:
        raise ValueError(f"channel must be one of {', '.join(CHANNELS)}, not {channel!r}")
    with transaction.atomic():
        row = Notification.objects.select_for_update().get(pk=notification.pk)
        now = row.delivery.get(channel, "pending")
        if not now.startswith(GAVE_UP):
            raise NotUndelivered(
                f"notification {row.pk}'s {channel} delivery is {now!r}: only one that gave up is sent again"
            )
        outcome = f"queued again by {actor}"
        row.delivery = {**row.delivery, channel: outcome}
        row.save(update_fields=["delivery"])
        audit.record(actor, "notification.resend", f"notification {row.pk}", reason, channel=channel, was=now)
    return outcome
