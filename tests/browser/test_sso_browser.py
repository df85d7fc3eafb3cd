"""Single sign-on (issue 48 item 4) in headless Chromium, against a real OpenID Connect provider in a process of its
own (django-oauth-toolkit, tests/oidc_provider): an on-call engineer signs in through the provider and gets the role
their group maps to, signs out of Lifeline and of the provider; a user whose groups map to no role is refused with a
page that says why; a provider user named like a local account does not take it over; the local account still logs
in with its password (break-glass)."""

import sqlite3
import subprocess
import sys

import pytest
from django.contrib.auth.models import User

from console.stack import BASE_DIR, free_port
from recovery.models import AuditEntry
from tests.conftest import ROLE_PASSWORD

pytestmark = [pytest.mark.browser]

CLIENT_ID, CLIENT_SECRET = "lifeline-console", "a-client-secret-for-the-test"
ROLE_MAP = {"gpu-oncall": "oncall", "gpu-operators": "operator", "sre-leads": "admin"}


@pytest.fixture(scope="module", autouse=True)
def orm_beside_playwright():
    """Playwright's sync API keeps an event loop running in this thread, which Django takes for an async context."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        yield


@pytest.fixture(scope="module")
def provider(live_server, tmp_path_factory):
    """The identity provider, serving on its own port; its users: alice (gpu-oncall), bob (interns), dana
    (gpu-operators and sre-leads) and oncall (gpu-oncall: the name of a local account)."""
    port, data = free_port(), tmp_path_factory.mktemp("idp")
    argv = [sys.executable, "-m", "tests.oidc_provider.serve", "--data", str(data)]
    argv += ["--port", str(port), "--client-id", CLIENT_ID, "--client-secret", CLIENT_SECRET]
    argv += ["--redirect-uri", f"{live_server.url}/login/sso/callback/"]
    argv += ["--logout-redirect-uri", f"{live_server.url}/login/"]
    for user in ("alice:alice-pw:gpu-oncall", "bob:bob-pw:interns", "dana:dana-pw:gpu-operators,sre-leads"):
        argv += ["--user", user]
    argv += ["--user", "oncall:oncall-pw:gpu-oncall"]
    process = subprocess.Popen(argv, cwd=BASE_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("ready "), f"the provider did not start: {line!r} {process.stderr.read()[-3000:]}"
        yield {"issuer": line.split()[1], "database": data / "provider.sqlite3"}
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def sso(settings, provider):
    """The console configured for the provider, as LIFELINE_OIDC_* would configure it."""
    issuer = provider["issuer"]
    settings.LIFELINE_OIDC = True
    settings.LIFELINE_OIDC_PROVIDER_NAME = "Example Corp"
    settings.OIDC_OP_AUTHORIZATION_ENDPOINT = f"{issuer}/authorize/"
    settings.OIDC_OP_TOKEN_ENDPOINT = f"{issuer}/token/"
    settings.OIDC_OP_USER_ENDPOINT = f"{issuer}/userinfo/"
    settings.OIDC_OP_JWKS_ENDPOINT = f"{issuer}/.well-known/jwks.json"
    settings.LIFELINE_OIDC_LOGOUT_ENDPOINT = f"{issuer}/logout/"
    settings.OIDC_RP_CLIENT_ID, settings.OIDC_RP_CLIENT_SECRET = CLIENT_ID, CLIENT_SECRET
    settings.OIDC_RP_SCOPES = "openid email profile groups"
    settings.LIFELINE_OIDC_ROLE_MAP = ROLE_MAP
    return provider


def sign_in(page, base: str, name: str, password: str) -> None:
    """From the console's login page, through the provider's."""
    page.goto(base + "/login/")
    page.click("#sign-in-sso")
    page.wait_for_selector("#idp-username")
    page.fill("#idp-username", name)
    page.fill("#idp-password", password)
    page.click("#idp-submit")


def test_an_engineer_signs_in_with_the_providers_group_as_role_and_signs_out_of_both(browser, live_server, sso):
    page = browser.new_page()
    page.goto(live_server.url + "/login/")
    assert page.locator("#sign-in-sso").inner_text() == "Sign in with Example Corp"
    sign_in(page, live_server.url, "alice", "alice-pw")
    page.wait_for_url(live_server.url + "/cluster/")
    assert "alice" in page.locator("header").inner_text()
    alice = User.objects.get(username="alice")
    assert [g.name for g in alice.groups.all()] == ["oncall"]
    assert not alice.has_usable_password() and alice.email == "alice@example.com"
    assert AuditEntry.objects.filter(actor="alice", action="sso_login").exists()
    page.goto(live_server.url + "/drains/")  # an on-call page: the role works
    assert page.locator("h1").first.inner_text() != "Not allowed"

    page.click("header button:has-text('Log out')")
    page.wait_for_url(live_server.url + "/login/")  # through the provider's end of session, back to ours
    page.goto(live_server.url + "/cluster/")
    assert page.url.startswith(live_server.url + "/login/")  # out of Lifeline
    page.click("#sign-in-sso")
    page.wait_for_selector("#idp-username")  # and out of the provider: it asks for the password again

    # Her group taken away at the provider: at her next sign-in, her role here goes with it.
    with sqlite3.connect(sso["database"]) as idp:
        idp.execute("DELETE FROM auth_user_groups WHERE user_id = (SELECT id FROM auth_user WHERE username='alice')")
    sign_in(page, live_server.url, "alice", "alice-pw")
    page.wait_for_selector("#sso-refused")
    assert "none of your groups at the identity provider (none sent)" in page.locator("#sso-refused").inner_text()
    assert not User.objects.get(username="alice").groups.exists()
    page.close()


def test_groups_that_give_no_role_are_refused_saying_why(browser, live_server, sso):
    page = browser.new_page()
    sign_in(page, live_server.url, "bob", "bob-pw")
    page.wait_for_selector("#sso-refused")
    said = page.locator("#sso-refused").inner_text()
    assert "interns" in said and "gpu-oncall → oncall" in said, said
    assert not User.objects.filter(username="bob").exists()  # nothing kept of a refused sign-in
    assert AuditEntry.objects.filter(action="sso_refused", target="user:bob").exists()
    page.goto(live_server.url + "/cluster/")
    assert page.url.startswith(live_server.url + "/login/")
    page.close()


def test_the_strongest_mapped_group_wins_and_a_local_accounts_name_is_not_taken_over(browser, live_server, sso, cast):
    page = browser.new_page()
    sign_in(page, live_server.url, "dana", "dana-pw")
    page.wait_for_url(live_server.url + "/cluster/")
    assert [g.name for g in User.objects.get(username="dana").groups.all()] == ["admin"]  # sre-leads over operators
    page.close()

    page = browser.new_page()
    sign_in(page, live_server.url, "oncall", "oncall-pw")  # the provider's "oncall", not the local one
    page.wait_for_selector("#sso-refused")
    assert "a local account named 'oncall' exists" in page.locator("#sso-refused").inner_text()
    page.goto(live_server.url + "/login/")  # break-glass: the local account, its password
    page.fill("#id_username", "oncall")
    page.fill("#id_password", ROLE_PASSWORD.format("oncall"))
    page.click("button[type=submit]")
    page.wait_for_url(live_server.url + "/cluster/")
    page.close()
