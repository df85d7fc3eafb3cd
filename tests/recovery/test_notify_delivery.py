"""On-call's notifications reaching people (issue 48.6): e-mail through a real SMTP server (aiosmtpd, on a socket of
its own), a mail server that refuses, and a webhook that fails every try becoming a dead letter that on-call sends
again from the drains page or the API, audited."""

import http.server
import json
import threading

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import Envelope

from console.stack import free_port
from recovery import tasks
from recovery.actions import notify
from recovery.models import AuditEntry, Cluster, Notification

pytestmark = pytest.mark.django_db


class Mailbox:
    """An aiosmtpd handler: keeps what it is sent; refuses every recipient with `refuse` when set."""

    def __init__(self, refuse: str = ""):
        self.refuse = refuse
        self.received: list[Envelope] = []

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):  # noqa: N802
        if self.refuse:
            return self.refuse
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):  # noqa: N802
        self.received.append(envelope)
        return "250 Message accepted for delivery"


@pytest.fixture
def smtp(settings):
    """A real SMTP server on 127.0.0.1; Django sends through it with its SMTP backend."""
    servers = []

    def start(handler: Mailbox) -> Mailbox:
        port = free_port()
        controller = Controller(handler, hostname="127.0.0.1", port=port)
        controller.start()
        servers.append(controller)
        settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
        settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_USE_TLS = "127.0.0.1", port, False
        settings.EMAIL_HOST_USER = settings.EMAIL_HOST_PASSWORD = ""
        return handler

    yield start
    for controller in servers:
        controller.stop()


def configure(**fields):
    Cluster.objects.filter(pk=Cluster.default().pk).update(**fields)


def notification(title: str = "node-07 is UNHEALTHY: canaries failing") -> Notification:
    return Notification.objects.create(kind="health", title=title, body="Its drain waits for approval.", url="/drains/")


def test_e_mail_goes_through_a_real_smtp_server(smtp, settings):
    mailbox = smtp(Mailbox())
    configure(oncall_emails="pager@example.com, second@example.com")
    note = notification()
    assert notify.deliver(note, "email") == "sent to pager@example.com, second@example.com"
    [envelope] = mailbox.received
    assert sorted(envelope.rcpt_tos) == ["pager@example.com", "second@example.com"]
    assert envelope.mail_from == settings.DEFAULT_FROM_EMAIL
    text = envelope.content.decode()
    assert "Subject: [Lifeline] node-07 is UNHEALTHY: canaries failing" in text
    assert "Its drain waits for approval." in text and settings.LIFELINE_CONSOLE_URL + "/drains/" in text
    note.refresh_from_db()
    assert note.delivery["email"] == "sent to pager@example.com, second@example.com"


def test_a_mail_server_that_refuses_is_a_failed_try_that_says_why(smtp):
    smtp(Mailbox(refuse="550 5.1.1 mailbox unavailable"))
    configure(oncall_emails="pager@example.com")
    note = notification()
    with pytest.raises(notify.DeliveryFailed, match="550"):
        notify.deliver(note, "email")
    note.refresh_from_db()
    assert note.delivery["email"].startswith("failed:") and "mailbox unavailable" in note.delivery["email"]


class _Hook(http.server.BaseHTTPRequestHandler):
    """A webhook receiver answering `status` (503: broken; 204: mended), keeping what it is sent."""

    status = 503
    received: list = []

    def do_POST(self):  # noqa: N802
        _Hook.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(_Hook.status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def hook():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Hook.status, _Hook.received = 503, []
    configure(oncall_webhook_url=f"http://127.0.0.1:{server.server_port}/hook")
    yield _Hook
    server.shutdown()


def test_a_webhook_that_fails_every_try_is_a_dead_letter_on_call_sends_again(client, cast, monkeypatch, commit, hook):
    note = notification()
    # Every try answered 503: retried (run eagerly here, each retry at once), then given up after the sixth.
    last = tasks.deliver_notification.apply(args=(note.pk, "webhook"))
    assert last.state == "SUCCESS" and last.result.startswith("gave up after 6 tries:"), last.result
    assert len(hook.received) == 6 and {r["id"] for r in hook.received} == {note.pk}
    note.refresh_from_db()
    assert note.delivery["webhook"].endswith("answered 503")

    # On-call reads it in the API and on the drains page.
    client.force_login(cast["oncall"])
    listed = client.get("/api/notifications?undelivered=1").json()["notifications"]
    assert [(n["id"], n["gave_up"]) for n in listed] == [(note.pk, ["webhook"])]
    assert client.get("/api/notifications?undelivered=yes").status_code == 400
    page = client.get("/drains/").content.decode()
    assert f'data-notification="{note.pk}" data-channel="webhook"' in page and "Send again" in page

    # Only on-call and admins send it again, only a channel that gave up, and it is audited.
    client.force_login(cast["operator"])
    refused = client.post(f"/api/notifications/{note.pk}/resend", {"channel": "webhook"}, "application/json")
    assert refused.status_code == 403
    assert 'data-channel="webhook"' in client.get("/drains/").content.decode()
    assert "Send again" not in client.get("/drains/").content.decode()
    client.force_login(cast["oncall"])
    answer = client.post(f"/api/notifications/{note.pk}/resend", {"channel": "email"}, "application/json")
    assert answer.status_code == 409 and "only one that gave up" in answer.json()["error"]["message"]
    answer = client.post(f"/api/notifications/{note.pk}/resend", {"channel": "sms"}, "application/json")
    assert answer.status_code == 400 and answer.json()["error"]["field"] == "channel"

    queued = []
    monkeypatch.setattr(tasks.deliver_notification, "delay", lambda *args: queued.append(args))
    hook.status = 204  # the receiver mended
    body = {"channel": "webhook", "reason": "receiver back"}
    answer = commit(client.post, f"/api/notifications/{note.pk}/resend", body, "application/json")
    assert answer.status_code == 202 and answer.json()["delivery"] == "queued again by oncall"
    assert queued == [(note.pk, "webhook")]  # sent by the worker once the resend committed
    assert list(notify.undelivered()) == []
    entry = AuditEntry.objects.get(action="notification.resend")
    assert (entry.actor, entry.target, entry.reason) == ("oncall", f"notification {note.pk}", "receiver back")
    assert entry.details["was"].startswith("gave up after 6 tries")
    assert tasks.deliver_notification.apply(args=queued[0]).result == "sent, 204"
    assert len(hook.received) == 7 and hook.received[-1]["title"] == note.title

    # The page's button does the same: a second dead letter (nothing listens now), sent again from /drains/.
    configure(oncall_webhook_url=f"http://127.0.0.1:{free_port()}/hook")
    other = notification("node-02 is DOWN")
    assert "Connection refused" in tasks.deliver_notification.apply(args=(other.pk, "webhook")).result
    response = commit(client.post, f"/notifications/{other.pk}/resend", {"channel": "webhook"})
    assert response.status_code == 302 and response["Location"] == "/drains/"
    other.refresh_from_db()
    assert other.delivery["webhook"] == "queued again by oncall" and queued[-1] == (other.pk, "webhook")


def test_each_on_call_chooses_what_they_are_e_mailed_about_on_their_profile(client, cast, smtp):
    mailbox = smtp(Mailbox())
    configure(oncall_emails="team@example.com")
    second = type(cast["oncall"]).objects.create_user("second", "second@example.com", "x-correct-horse")
    from console.actions import set_user_role

    set_user_role("second", "oncall")
    for user in (cast["oncall"], cast["admin"]):
        user.email = f"{user.username}@example.com"
        user.save()

    # On-call keeps only the pages; the second on-call engineer turns e-mail off; the admin keeps the default (all).
    client.force_login(cast["oncall"])
    page = client.get("/profile/").content.decode()
    assert 'id="rule-now"' in page and "e-mail about everything" in page
    assert client.post("/profile/", {"email": "on", "kinds": ["alert"]}).status_code == 302
    assert "e-mail about pages from Alertmanager" in client.get("/profile/").content.decode()
    answer = client.post("/profile/", {"email": "on", "kinds": ["sms"]})
    assert answer.status_code == 400 and "kinds: sms is not a kind of notification" in answer.content.decode()
    client.force_login(second)
    assert client.post("/profile/", {}).status_code == 302  # nothing ticked, e-mail unticked: no e-mail
    client.force_login(cast["operator"])
    assert "Only on-call engineers and admins are e-mailed" in client.get("/profile/").content.decode()
    assert client.post("/profile/", {"email": "on"}).status_code == 403
    entry = AuditEntry.objects.filter(action="notification_rule", actor="oncall").latest("at")
    assert entry.details == {"email": True, "kinds": ["alert"], "severities": [], "webhook": False}

    drain = notification("Drain of node-03 needs approval")
    drain.kind = "drain_requested"
    drain.save()
    page = notification("Alert: node-03 Xid 79")
    page.kind = "alert"
    page.save()
    assert notify.deliver(drain, "email") == "sent to admin@example.com, team@example.com"
    assert notify.deliver(page, "email") == "sent to admin@example.com, oncall@example.com, team@example.com"
    assert [sorted(e.rcpt_tos) for e in mailbox.received] == [
        ["admin@example.com", "team@example.com"],
        ["admin@example.com", "oncall@example.com", "team@example.com"],
    ]


def test_each_on_call_chooses_the_severities_and_a_webhook_of_their_own_and_an_unreached_one_is_tried_again(
    client, cast, smtp
):
    """Which severities, which channel: on-call takes SEV1 only, by e-mail and by a webhook of their own; the admin
    takes everything by e-mail and a webhook that is down. A SEV2 failure reaches the admin alone; a SEV1 reaches
    both; the admin's dead webhook is tried again alone (on-call's is not sent twice), then given up, and sent again
    from the dead letters once it is mended."""
    mailbox = smtp(Mailbox())
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Hook.status, _Hook.received = 204, []
    mine = f"http://127.0.0.1:{server.server_port}/oncall"
    dead = f"http://127.0.0.1:{free_port()}/admin"
    for user in (cast["oncall"], cast["admin"]):
        user.email = f"{user.username}@example.com"
        user.save()
    try:
        client.force_login(cast["oncall"])
        form = {"email": "on", "webhook_url": mine, "severities": ["sev1"]}
        assert client.post("/profile/", form).status_code == 302
        page = client.get("/profile/").content.decode()
        assert "e-mail and your webhook about everything, incidents of SEV1 only" in page
        answer = client.post("/profile/", {"email": "on", "severities": ["sev9"]})
        assert answer.status_code == 400 and "severities: sev9 is not a severity" in answer.content.decode()
        answer = client.post("/profile/", {"email": "on", "webhook_url": "ftp://example.com/x"})
        refused = "webhook_url: enter an http:// or https:// address"
        assert answer.status_code == 400 and refused in answer.content.decode()
        notify.set_rule(cast["admin"], True, [], [], dead)

        sev2 = notify.send("failure", "Gateway lost: gw-2", "Its streams broke.", "/incidents/7/", severity="sev2")
        assert notify.deliver(sev2, "email") == "sent to admin@example.com"
        with pytest.raises(notify.DeliveryFailed, match="admin"):
            notify.deliver(sev2, "personal")  # the admin's is down; on-call's rule does not take SEV2
        assert _Hook.received == []

        sev1 = notify.send("failure", "Redis away", "Nothing moves.", "/incidents/8/", severity="sev1")
        assert notify.deliver(sev1, "email") == "sent to admin@example.com, oncall@example.com"
        last = tasks.deliver_notification.apply(args=(sev1.pk, "personal"))  # retried eagerly, then given up
        assert last.result.startswith("gave up after 6 tries: admin"), last.result
        [received] = _Hook.received  # on-call's own webhook: once, not again with each retry of the admin's
        assert (received["severity"], received["title"], received["kind"]) == ("sev1", "Redis away", "failure")
        sev1.refresh_from_db()
        assert sev1.delivery["personal:oncall"] == "sent, 204" and sev1.delivery["personal:admin"].startswith("failed")
        assert sev1 in notify.undelivered()
        approval = notify.send("drain_requested", "Drain of node-03 needs approval", "")  # no incident, no severity
        assert notify.deliver(approval, "email") == "sent to admin@example.com, oncall@example.com"
        assert [sorted(e.rcpt_tos) for e in mailbox.received][-1] == ["admin@example.com", "oncall@example.com"]

        # The admin's receiver mended: on-call sends the dead letter again; only the admin's is sent.
        notify.set_rule(cast["admin"], True, [], [], mine.replace("oncall", "admin"))
        notify.resend(sev1, "personal", "oncall", "receiver back")
        assert notify.deliver(sev1, "personal") == "sent to admin, oncall"
        assert [r["title"] for r in _Hook.received] == ["Redis away", "Redis away"]
    finally:
        server.shutdown()
