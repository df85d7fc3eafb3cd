"""Issue 11, "the console tells the truth at a glance": what on-call reads in the pages, the node page's forms and
charts, the audit log, the error pages, the admin site for the admin role."""

import http.server
import threading

import pytest
from django.core import mail

from recovery.actions import drains, notify
from recovery.models import Cluster, Notification
from tests.console.test_console import make_node

pytestmark = pytest.mark.django_db


def configure(**fields):
    Cluster.objects.filter(pk=Cluster.default().pk).update(**fields)


class _Hook(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


# --- on-call that notices ----------------------------------------------------------------------------------------
def test_the_drains_waiting_show_in_the_nav_the_title_and_a_pill_that_opens_the_drain(client, cast, commit):
    client.force_login(cast["oncall"])
    page = client.get("/cluster/").content.decode()
    assert "<title>Cluster" in page and 'id="drains-waiting"' in page and 'id="drains-waiting-pill"' not in page
    first = commit(drains.propose, make_node("node-01"), source="health machine", reason="canaries failing")
    page = client.get("/cluster/").content.decode()
    assert "<title>(1) Cluster" in page
    assert f'id="drains-waiting-pill" href="/drains/{first.pk}/"' in page  # the drain itself, not /degradation/
    assert 'data-drains-waiting="1"' in page  # what the live refresh reads for the nav and the title
    commit(drains.propose, make_node("node-02", "rack-b"), source="health machine", reason="Xid 79")
    banner = client.get("/degradation/?partial=banner").content.decode()
    assert 'data-drains-waiting="2"' in banner and 'id="drains-waiting-pill" href="/drains/"' in banner


def test_notification_delivery_reads_plainly(client, cast, commit):
    node = make_node("node-01")
    commit(drains.propose, node, source="health machine", reason="canaries failing")
    notification = Notification.objects.get(kind="drain_requested")
    client.force_login(cast["oncall"])
    assert client.get("/drains/").content.decode().count(">pending<") == 3  # not sent yet, on any channel
    assert notify.deliver(notification, "webhook") == "not configured"
    assert notify.deliver(notification, "email") == "not configured"
    assert notify.deliver(notification, "personal") == "not configured"  # nobody has a webhook of their own
    html = client.get("/drains/").content.decode()
    assert html.count(">not configured<") == 3 and ">…<" not in html

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        configure(oncall_webhook_url=f"http://127.0.0.1:{server.server_port}/hook", oncall_emails="pager@example.com")
        assert notify.deliver(notification, "webhook") == "sent, 200"
    finally:
        server.shutdown()
        server.server_close()
    assert notify.deliver(notification, "email") == "sent to pager@example.com" and len(mail.outbox) == 1
    html = client.get("/drains/").content.decode()
    assert ">sent, 200<" in html and ">sent to pager@example.com<" in html

    configure(oncall_webhook_url=f"http://127.0.0.1:{server.server_port}/hook")  # nobody listens there now
    with pytest.raises(notify.DeliveryFailed):
        notify.deliver(notification, "webhook")
    notification.refresh_from_db()
    assert notification.delivery["webhook"].startswith("failed: http://127.0.0.1:")
    assert ">failed: http://127.0.0.1:" in client.get("/drains/").content.decode()


def test_the_demo_writes_on_call_mail_to_var_mail(commit, settings, tmp_path):
    """The demo's users have addresses, so a drain request is written to var/mail/ by Django's file backend."""
    from console.management.commands.demo import Command

    settings.EMAIL_BACKEND = "django.core.mail.backends.filebased.EmailBackend"
    settings.EMAIL_FILE_PATH = tmp_path / "mail"
    Command()._demo_users({})
    commit(drains.propose, make_node("node-01"), source="health machine", reason="canaries failing")
    outcome = notify.deliver(Notification.objects.get(kind="drain_requested"), "email")
    assert outcome == "sent to admin@lifeline.localhost, oncall@lifeline.localhost"
    (written,) = (tmp_path / "mail").iterdir()
    assert "node-01" in written.read_text()


# --- the node page -----------------------------------------------------------------------------------------------
def test_a_bad_figure_in_the_fault_form_is_named_on_the_page(client, cast):
    make_node("node-01")
    configure(fault_injection_enabled=True)
    client.force_login(cast["operator"])
    response = client.post("/nodes/node-01/fault", {"kind": "slow", "factor": "twice", "reason": "rehearsal"})
    html = response.content.decode()
    assert response.status_code == 400
    assert '<li data-field="factor">factor: not a number' in html
    assert 'value="twice" aria-invalid="true"' in html  # what was typed stays, marked
    assert "lifeline.css" in html and 'id="fault-form"' in html  # the node page itself, styled
    response = client.post("/nodes/node-01/fault", {"kind": "meteor", "reason": "rehearsal"})
    assert response.status_code == 400 and '<li data-field="kind">' in response.content.decode()


def test_throttling_reads_as_a_state_not_a_bitmask():
    from console.templatetags.lifeline import throttle

    assert throttle(None) == "n/a" and throttle(0) == "none" and throttle(1) == "idle"
    assert throttle(0x20 | 0x40) == "thermal (software), thermal (hardware)"
    assert throttle(0x100) == "other (0x100)"


def test_the_canary_chart_shows_the_current_run_only(client, cast):
    import datetime as dt

    from django.utils import timezone

    from recovery.models import CanaryResult, Node

    node = make_node("node-01")
    before = timezone.now() - dt.timedelta(hours=1)
    CanaryResult.objects.create(node=node, at=before, passed=False, kind="latency_spike", latency_ms=900.0)
    CanaryResult.objects.create(node=node, passed=True, kind="ok", latency_ms=31.0)
    client.force_login(cast["manager"])
    charts = client.get("/nodes/node-01/?partial=charts").json()
    assert charts["canaries"]["latency_ms"] == [31.0]
    assert Node.objects.get(pk=node.pk).session_started_at > before


# --- the rest ----------------------------------------------------------------------------------------------------
def test_the_admin_role_can_use_the_django_admin(client, cast):
    from console.actions import set_user_role

    client.force_login(cast["admin"])
    index = client.get("/admin/").content.decode()
    assert "have permission" not in index and "/admin/recovery/cluster/" in index
    assert client.get("/admin/recovery/cluster/").status_code == 200
    set_user_role("admin", "operator")  # a role taken away takes the admin site with it
    assert client.get("/admin/").status_code == 302


def test_the_placement_policy_is_on_the_consoles_settings_page(client, cast):
    client.force_login(cast["admin"])
    assert 'name="placement_policy"' in client.get("/settings/").content.decode()


def test_the_audit_log_page_filters_by_actor_action_and_time(client, cast):
    import datetime as dt

    from django.utils import timezone

    from recovery.actions import audit
    from recovery.models import AuditEntry

    old = audit.record("ana", "inject_fault", "node:node-01", "rehearsal", kind="slow")
    AuditEntry.objects.filter(pk=old.pk).update(at=timezone.now() - dt.timedelta(days=2))
    audit.record("ana", "cordon", "node:node-02", "fan noise")
    audit.record("system", "cordon", "node:node-03", "canaries failing")

    client.force_login(cast["operator"])
    assert 'href="/audit/"' not in client.get("/cluster/").content.decode()
    assert client.get("/audit/").status_code == 403
    client.force_login(cast["manager"])
    assert 'href="/audit/"' in client.get("/cluster/").content.decode()

    def targets(**query):
        response = client.get("/audit/", query)
        assert response.status_code == 200
        return [t for t in ("node:node-01", "node:node-02", "node:node-03") if t in response.content.decode()]

    assert targets() == ["node:node-01", "node:node-02", "node:node-03"]
    assert targets(actor="ANA") == ["node:node-01", "node:node-02"]
    assert targets(action="cordon") == ["node:node-02", "node:node-03"]
    yesterday = (timezone.now() - dt.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    assert targets(since=yesterday) == ["node:node-02", "node:node-03"]
    assert targets(until=yesterday) == ["node:node-01"]
    response = client.get("/audit/", {"since": "last tuesday"})
    assert response.status_code == 400 and '<li data-field="since">since: ' in response.content.decode()


def test_not_found_and_server_error_pages_wear_the_consoles_look(client, cast, rf):
    from django.views.defaults import server_error

    client.force_login(cast["operator"])
    response = client.get("/nodes/node-99/")
    html = response.content.decode()
    assert response.status_code == 404 and 'data-status="404"' in html
    assert "lifeline.css" in html and 'href="/cluster/"' in html and "/nodes/node-99/" in html
    response = server_error(rf.get("/cluster/"))  # no request context: it may not touch the database
    html = response.content.decode()
    assert response.status_code == 500 and 'data-status="500"' in html and "lifeline.css" in html
