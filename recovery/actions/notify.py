"""Telling on-call: in the console (live), by the team's webhook, by e-mail and by each person's own webhook.

A Notification row is written with the state change that calls for it; it is
an outbox row: once committed, recovery.reactions sends the webhooks and the
e-mail from Celery, with retries, and each records how its delivery went on
the row in words on-call reads at a glance: "not configured", "sent, 200", "sent to …", "failed: <why>".
Each on-call engineer's rule (their profile) says what they are told about (kinds, and the severities of the
incidents it concerns) and on which of their channels (e-mail, their own webhook).

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


CHANNELS = ("webhook", "email", "personal")  # the team's webhook, e-mail, and people's own webhooks
SEVERITIES = ("sev1", "sev2", "sev3")
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


def send(kind: str, title: str, body: str, url: str = "", severity: str = "") -> Notification:
    """Write a notification (`severity`: the incident's it is about, if any); after commit it shows in every open
    console and goes out by the team's webhook, e-mail and people's own webhooks."""
    notification = Notification.objects.create(kind=kind, title=title, body=body, url=url, severity=severity)
    transaction.on_commit(lambda: events.notification(notification.pk))
    return notification


def _record(notification: Notification, channel: str, outcome: str) -> None:
    with transaction.atomic():
        row = Notification.objects.select_for_update().get(pk=notification.pk)
        row.delivery = {**row.delivery, channel: outcome}
        row.save(update_fields=["delivery"])
    notification.delivery = row.delivery


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


def _told():
    """On-call engineers and admins, active, with their rules: the people told."""
    return (
        get_user_model()
        .objects.filter(groups__name__in=(roles.ONCALL, roles.ADMIN), is_active=True)
        .select_related("notification_rule")
        .distinct()
    )


def recipients(cluster: Cluster, kind: str = "", severity: str = "") -> list[str]:
    """The team's addresses (`oncall_emails`), and each on-call engineer's and admin's whose rule takes `kind` at
    `severity` by e-mail."""
    listed = [a.strip() for a in cluster.oncall_emails.split(",") if a.strip()]
    return sorted(set(listed) | {u.email for u in _told().exclude(email="") if wants(u, kind, severity)})


def personal_hooks(kind: str, severity: str = "") -> dict[str, str]:
    """{username: their own webhook} of each on-call engineer and admin whose rule takes `kind` at `severity`."""
    return {
        u.get_username(): u.notification_rule.webhook_url
        for u in _told().exclude(notification_rule__webhook_url="").exclude(notification_rule__isnull=True)
        if wants(u, kind, severity, channel="webhook")
    }


def wants(user, kind: str, severity: str = "", channel: str = "email") -> bool:
    """Whether `user`'s rule has them told about `kind` at `severity` on `channel` (e-mail, or their own webhook). No
    rule: e-mailed everything, no webhook. A notification about no incident (no severity) is taken by its kind."""
    try:
        rule = user.notification_rule
    except NotificationRule.DoesNotExist:
        return channel == "email"
    on = rule.email if channel == "email" else bool(rule.webhook_url)
    taken_kind = not rule.kinds or kind in rule.kinds
    taken_severity = not rule.severities or not severity or severity in rule.severities
    return on and taken_kind and taken_severity


def set_rule(
    user, email: bool, kinds: list[str], severities: list[str] = (), webhook_url: str = ""
) -> NotificationRule:
    """One person's rule, audited. Only those told (on-call, admin) have one; ValueError names an unknown kind or
    severity, or a webhook that is not an http(s) URL."""
    if not roles.has_role(user, roles.ONCALL):
        raise PermissionError(f"only on-call engineers and admins are told; {user.get_username()} is not")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"kinds: {', '.join(unknown)} unknown; the kinds are {', '.join(KINDS)}")
    unknown = sorted(set(severities) - set(SEVERITIES))
    if unknown:
        raise ValueError(f"severities: {', '.join(unknown)} unknown; the severities are {', '.join(SEVERITIES)}")
    if webhook_url and not webhook_url.startswith(("http://", "https://")):
        raise ValueError(f"webhook_url: {webhook_url!r} is not an http:// or https:// address")
    with transaction.atomic():
        rule, _ = NotificationRule.objects.update_or_create(
            user=user,
            defaults={
                "email": email,
                "kinds": [k for k in KINDS if k in kinds],
                "severities": [s for s in SEVERITIES if s in severities],
                "webhook_url": webhook_url,
            },
        )
        audit.record(user.get_username(), "notification_rule", f"user:{user.get_username()}", "", **_rule(rule))
    return rule


def _rule(rule: NotificationRule) -> dict:
    return {"email": rule.email, "kinds": rule.kinds, "severities": rule.severities, "webhook": bool(rule.webhook_url)}


def deliver(notification: Notification, channel: str) -> str:
    """Send one notification on one channel; raises DeliveryFailed for the task to retry."""
    cluster = Cluster.default()
    link = settings.LIFELINE_CONSOLE_URL + notification.url if notification.url else settings.LIFELINE_CONSOLE_URL
    if channel == "webhook":
        if not cluster.oncall_webhook_url:
            outcome = "not configured"
            _record(notification, channel, outcome)
            return outcome
        try:
            status = post_webhook(cluster.oncall_webhook_url, _payload(notification, link))
        except DeliveryFailed as exc:
            _record(notification, channel, f"failed: {exc}")
            raise
        outcome = f"sent, {status}"
    elif channel == "email":
        to = recipients(cluster, notification.kind, notification.severity)
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
    elif channel == "personal":
        return _deliver_personal(notification, link)
    else:
        raise ValueError(f"unknown channel {channel!r}")
    _record(notification, channel, outcome)
    return outcome


def _payload(notification: Notification, link: str) -> dict:
    return {
        "kind": notification.kind,
        "severity": notification.severity or None,
        "title": notification.title,
        "text": f"{notification.title}\n{notification.body}\n{link}",
        "body": notification.body,
        "url": link,
        "at": notification.at.isoformat(),
        "id": notification.pk,
    }


def _deliver_personal(notification: Notification, link: str) -> str:
    """Each person's own webhook whose rule takes it; a retry sends only to those not yet reached (each person's
    outcome is kept as delivery["personal:<username>"]). DeliveryFailed, naming them, while any is not reached."""
    hooks = personal_hooks(notification.kind, notification.severity)
    if not hooks:
        _record(notification, "personal", "not configured")
        return "not configured"
    failed = []
    for person, url in sorted(hooks.items()):
        channel = f"personal:{person}"  # each person's outcome beside the channel's
        if notification.delivery.get(channel, "").startswith("sent"):
            continue
        try:
            _record(notification, channel, f"sent, {post_webhook(url, _payload(notification, link))}")
        except DeliveryFailed as exc:
            _record(notification, channel, f"failed: {exc}")
            failed.append(f"{person} ({exc})")
    if failed:
        _record(notification, "personal", f"failed: {'; '.join(failed)}")
        raise DeliveryFailed("; ".join(failed))
    outcome = f"sent to {', '.join(sorted(hooks))}"
    _record(notification, "personal", outcome)
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
        Q(delivery__webhook__startswith=GAVE_UP)
        | Q(delivery__email__startswith=GAVE_UP)
        | Q(delivery__personal__startswith=GAVE_UP)
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
