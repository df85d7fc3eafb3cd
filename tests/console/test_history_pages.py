"""Generated history is shown as simulated on every page that shows it: the incident list and page, a node's
incidents, the degradation history (page and API) and /slo/ (the share of the window's requests it makes up)."""

import re

import pytest
from django.utils import timezone

from recovery.actions import history
from recovery.models import Incident
from tests.recovery.test_history_backfill import demo_fleet

pytestmark = pytest.mark.django_db

BADGE = re.compile(r'<span class="badge badge-grey" data-simulated[^>]*>simulated</span>')


@pytest.fixture
def eight_days():
    """Eight days of the demo's history (nine failures, a rack's among them, which takes the level to 3), thin
    traffic."""
    demo_fleet()
    run = history.backfill(timezone.now(), days=8, rate_rps=0.02)
    assert run.finished_at is not None
    return run


def test_the_incident_list_and_page_badge_generated_incidents(client, cast, eight_days):
    simulated = list(Incident.objects.filter(simulated=True))
    assert len(simulated) >= 3
    client.force_login(cast["operator"])
    page = client.get("/incidents/").content.decode()
    rows = re.findall(r'<tr data-incident="(\d+)".*?</tr>', page, re.S)
    assert sorted(map(int, rows)) == sorted(i.pk for i in simulated)
    assert len(BADGE.findall(page)) == len(simulated)
    incident = simulated[0]
    assert BADGE.search(client.get(f"/incidents/{incident.pk}/").content.decode())
    assert BADGE.search(client.get(f"/nodes/{incident.nodes.first().name}/").content.decode())
    listed = client.get("/api/incidents").json()["incidents"]
    assert listed and all(i["simulated"] for i in listed)


def test_a_live_incident_has_no_badge(client, cast, eight_days):
    live = Incident.objects.filter(simulated=True).first()
    Incident.objects.filter(pk=live.pk).update(simulated=False)
    client.force_login(cast["operator"])
    page = client.get("/incidents/").content.decode()
    row = re.search(rf'<tr data-incident="{live.pk}".*?</tr>', page, re.S).group(0)
    assert not BADGE.search(row)
    assert not BADGE.search(client.get(f"/incidents/{live.pk}/").content.decode())


def test_the_degradation_history_badges_generated_changes(client, cast, eight_days):
    client.force_login(cast["operator"])
    page = client.get("/degradation/").content.decode()
    assert BADGE.search(page)
    api = client.get("/api/degradation").json()
    assert api["level"] == 0  # the live level: never the history's
    assert api["history"] and all(h["simulated"] for h in api["history"])


def test_slo_shows_the_share_of_the_window_that_is_generated(client, cast, eight_days):
    client.force_login(cast["manager"])
    page = client.get("/slo/").content.decode()
    shares = re.findall(r"data-simulated-share>.*?</span> (.*?) of the window&#x27;s requests are generated", page)
    assert shares and all(share == "100.0%" for share in shares)  # nothing live yet: all of it is generated


def test_a_share_of_generated_history_is_never_rounded_to_all_or_none():
    """The objectives page said "100 % … generated history" with live requests in the window."""
    from console.readmodels.slo import share_text

    assert share_text(99_999, 100_000) == "> 99.9%" and share_text(1, 100_000) == "< 0.1%"
    assert share_text(100_000, 100_000) == "100.0%" and share_text(0, 5) == "0.0%" and share_text(1, 4) == "25.0%"
