"""Single sign-on's configuration and its doors (console/sso.py); the sign-in itself, through a real provider in the
browser, is tests/browser/test_sso_browser.py."""

import os
import subprocess
import sys

import pytest

from console import env, sso
from console.stack import BASE_DIR

pytestmark = pytest.mark.django_db


def test_the_role_map_is_read_from_its_variable_and_a_bad_entry_says_what_to_write(monkeypatch):
    roles = ("operator", "oncall", "manager", "admin")
    monkeypatch.setenv("LIFELINE_OIDC_ROLE_MAP", " gpu-oncall=oncall, sre-leads=admin ,")
    assert env.mapping("LIFELINE_OIDC_ROLE_MAP", roles) == {"gpu-oncall": "oncall", "sre-leads": "admin"}
    for bad in ("gpu-oncall", "gpu-oncall=pager", "=oncall"):
        monkeypatch.setenv("LIFELINE_OIDC_ROLE_MAP", bad)
        with pytest.raises(env.ConfigError, match=r"LIFELINE_OIDC_ROLE_MAP: .* is not key=value .*expected, say"):
            env.mapping("LIFELINE_OIDC_ROLE_MAP", roles)
    monkeypatch.delenv("LIFELINE_OIDC_ROLE_MAP")
    assert env.mapping("LIFELINE_OIDC_ROLE_MAP", roles) == {}


def test_single_sign_on_half_configured_stops_the_console_at_start_naming_what_is_missing():
    environment = {**os.environ, "LIFELINE_OIDC_CLIENT_ID": "lifeline", "LIFELINE_OIDC_CLIENT_SECRET": "s"}
    run = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=BASE_DIR,
        env={**environment, "DJANGO_SETTINGS_MODULE": "console.settings"},
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0
    assert "single sign-on is half configured: set LIFELINE_OIDC_AUTHORIZATION_ENDPOINT" in run.stderr, run.stderr


def test_the_strongest_role_of_the_mapped_groups_is_given_and_unknown_groups_give_none(settings):
    settings.LIFELINE_OIDC_ROLE_CLAIM = "groups"
    settings.LIFELINE_OIDC_ROLE_MAP = {"gpu-operators": "operator", "sre-leads": "admin", "finance": "manager"}
    assert sso.mapped_roles({"groups": ["finance", "gpu-operators", "sre-leads"]}) == (
        ["finance", "gpu-operators", "sre-leads"],
        ["admin", "operator", "manager"],
    )
    assert sso.mapped_roles({"groups": "finance"}) == (["finance"], ["manager"])  # one group, as a string
    assert sso.mapped_roles({"groups": ["interns"]}) == (["interns"], [])
    assert sso.mapped_roles({}) == ([], [])


def test_with_single_sign_on_off_its_doors_are_closed_and_the_login_page_offers_only_local_accounts(client):
    assert client.get("/login/sso/").status_code == 404
    assert client.get("/login/sso/callback/?code=x&state=y").status_code == 404
    assert b"sign-in-sso" not in client.get("/login/").content


def test_with_it_on_the_login_page_offers_the_provider_and_the_first_step_goes_there_with_pkce(client, settings):
    settings.LIFELINE_OIDC, settings.LIFELINE_OIDC_PROVIDER_NAME = True, "Example Corp"
    settings.OIDC_OP_AUTHORIZATION_ENDPOINT = "https://idp.example.com/authorize"
    settings.OIDC_RP_CLIENT_ID = "lifeline"
    assert b"Sign in with Example Corp" in client.get("/login/").content
    answer = client.get("/login/sso/")
    assert answer.status_code == 302
    assert answer["Location"].startswith("https://idp.example.com/authorize?")
    assert "code_challenge_method=S256" in answer["Location"] and "client_id=lifeline" in answer["Location"]


def test_a_refusal_page_without_a_refusal_says_the_sign_in_did_not_complete(client, settings):
    settings.LIFELINE_OIDC_PROVIDER_NAME = "Example Corp"
    answer = client.get("/login/sso/refused/")
    assert answer.status_code == 403 and b"the sign-in did not complete" in answer.content
