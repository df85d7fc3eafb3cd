"""The Experiments page asks the simulator what degradation does (a throughput objective: levels and shedding, as the
live control plane sets them) and what silent corruption does (found by canaries): both in the run's table and CSV."""

import csv
import io

import pytest

from tests.console.test_experiments import finished, form, start  # noqa: F401 (the fixture)

pytestmark = pytest.mark.django_db


def test_an_objective_above_what_the_fleet_carries_sheds_and_the_table_says_how_many(client, start):  # noqa: F811
    run = finished(start(objective_percent="160", rate_rps="6", policies=["lifeline"]))
    assert run.scenario["degradation"] == {"required_share": 1.6}
    page = client.get(f"/experiments/{run.pk}/").content.decode()
    assert 'data-field="shed"' in page
    rows = list(csv.DictReader(io.StringIO(client.get(f"/experiments/{run.pk}/summary.csv").content.decode())))
    assert int(rows[0]["shed"]) > 0  # 160 %: level 3 or more at once, best effort refused

    calm = finished(start(objective_percent="", rate_rps="6", policies=["lifeline"]))
    assert "degradation" not in calm.scenario
    rows = list(csv.DictReader(io.StringIO(client.get(f"/experiments/{calm.pk}/summary.csv").content.decode())))
    assert rows[0]["shed"] == "0"


def test_silent_corruption_is_a_failure_the_page_offers(client, start):  # noqa: F811
    run = finished(start(fault_kind="sdc", fault_at_s="2", duration_s="60", rate_rps="4", policies=["lifeline"]))
    assert run.scenario["faults"]["scripted"][0]["kind"] == "sdc"
    rows = list(csv.DictReader(io.StringIO(client.get(f"/experiments/{run.pk}/summary.csv").content.decode())))
    assert int(rows[0]["possibly_corrupt"]) > 0


def test_an_objective_out_of_range_is_refused_naming_the_field(client, cast):
    client.force_login(cast["operator"])
    response = client.post("/experiments/", form(objective_percent="0"))
    assert response.status_code == 400 and "objective_percent" in response.content.decode()
