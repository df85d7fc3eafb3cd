"""/slo/, its forms, and `GET /api/slo`, `GET`/`PATCH /api/slo/<id>`: read by every role, edited by admins only."""

import datetime as dt
import json

import pytest
from django.utils import timezone

from console.models import ApiToken
from recovery.actions import slo, streams
from recovery.models import AuditEntry, SloCorrection, SloObjective

pytestmark = pytest.mark.django_db

MODEL = "Qwen3-32B"


def traffic(errors: int, ok: int, tier="premium"):
    """Requests finished a few minutes ago, rolled up as the beat task does."""
    at = timezone.now().replace(second=0, microsecond=0) - dt.timedelta(minutes=3)
    items = [
        (
            "gw",
            {
                "request_id": f"{tier}-{i}",
                "tenant": "acme",
                "tier": tier,
                "model": MODEL,
                "status": "error" if i < errors else "ok",
                "http_status": 502 if i < errors else 200,
                "ttft_ms": None if i < errors else 300.0,
                "tpot_ms": None if i < errors else 30.0,
                "e2e_ms": 100.0,
                "started_at": (at + dt.timedelta(milliseconds=50 * i)).timestamp(),
            },
        )
        for i in range(errors + ok)
    ]
    streams.store_outcomes(items)
    slo.roll_up()
    return SloObjective.objects.get(model_key=MODEL, tier=tier, tenant="")


@pytest.mark.parametrize("role", ["manager", "oncall", "operator", "admin"])
def test_every_role_reads_the_page_with_real_numbers(client, cast, role):
    traffic(errors=2, ok=998)
    client.force_login(cast[role])
    response = client.get("/slo/")
    assert response.status_code == 200
    page = response.content.decode()
    assert "good/valid = 998/1,000" in page
    assert "99.800%" in page  # attainment
    assert "1 − 2/(1,000 × 0.001)" in page  # the budget's formula, beside it
    assert "Qwen3-32B · Premium" in page
    assert "SRE workbook" in page
    assert ('href="/slo/' in page and "/edit" in page) == (role == "admin")
    assert '<a href="/slo/" class="active">Objectives</a>' in page  # in the nav, on every page


def test_rows_are_sorted_by_budget_left_and_colour_coded(client, cast):
    traffic(errors=0, ok=500, tier="standard")
    traffic(errors=3, ok=997, tier="premium")
    client.force_login(cast["manager"])
    page = client.get("/slo/?partial=table").content.decode()
    assert page.index("Qwen3-32B · Premium") < page.index("Qwen3-32B · Standard")
    assert "badge-red" in page and "badge-green" in page


def test_no_data_says_so_with_completeness(client, cast):
    slo.ensure_objectives([(MODEL, "premium")])
    client.force_login(cast["manager"])
    page = client.get("/slo/").content.decode()
    assert "no data in the window" in page
    assert "100.000%" not in page and "100.0%" not in page


def test_a_user_without_a_role_may_not_read(client, django_user_model):
    client.force_login(django_user_model.objects.create_user("nobody", password="x"))
    assert client.get("/slo/").status_code == 403
    assert client.get("/api/slo").status_code == 403


def test_the_api_lists_objectives_and_one_with_its_days(client, cast):
    objective = traffic(errors=1, ok=99)
    _, token = ApiToken.issue(cast["manager"])
    body = client.get("/api/slo", HTTP_AUTHORIZATION=f"Bearer {token}").json()
    listed = next(o for o in body["objectives"] if o["id"] == objective.pk)
    availability = listed["indicators"][0]
    assert (availability["good"], availability["valid"], availability["attainment"]) == (99, 100, 0.99)
    assert availability["burn_rates"]["5m"] == pytest.approx(10.0)
    assert listed["joint_attainment"] == 0.99
    one = client.get(f"/api/slo/{objective.pk}", HTTP_AUTHORIZATION=f"Bearer {token}").json()
    assert one["daily"][0]["valid"] == 100 and one["thresholds"]["ttft_ms"] == 450
    assert client.get("/api/slo/99999", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 404


def test_an_admin_edits_an_objective_on_the_form_and_through_the_api(client, cast):
    objective = traffic(errors=0, ok=10)
    client.force_login(cast["admin"])
    assert client.get(f"/slo/{objective.pk}/edit").status_code == 200
    form = {
        "model_key": MODEL,
        "tier": "premium",
        "tenant": "",
        "ttft_threshold_ms": "470",
        "ttft_percentile": "99",
        "tpot_threshold_ms": "40",
        "tpot_percentile": "99",
        "availability_target": "99.9",
        "window": "rolling_28d",
        "reason": "contract",
    }
    refused = client.post(f"/slo/{objective.pk}/edit", form)
    assert refused.status_code == 400
    assert "450 ms and 500 ms" in refused.content.decode()
    assert client.post(f"/slo/{objective.pk}/edit", {**form, "ttft_threshold_ms": "500"}).status_code == 302
    objective.refresh_from_db()
    assert (objective.ttft_threshold_ms, objective.window, objective.updated_by) == (500, "rolling_28d", "admin")
    _, token = ApiToken.issue(cast["admin"])
    response = client.patch(
        f"/api/slo/{objective.pk}",
        json.dumps({"tpot_threshold_ms": 50, "reason": "api"}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )
    assert response.status_code == 200 and response.json()["changed"] == ["tpot_threshold_ms"]
    bad = client.patch(
        f"/api/slo/{objective.pk}",
        json.dumps({"tpot_threshold_ms": 45}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "tpot_threshold_ms"
    for body, says in (("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object")):
        for url in (f"/api/slo/{objective.pk}", "/api/settings"):  # one parser for both PATCH bodies
            answer = client.patch(url, body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}")
            assert answer.status_code == 400 and answer.json()["error"]["field"] == "body", (url, body)
            assert says in answer.json()["error"]["message"]
    assert AuditEntry.objects.filter(action="slo_objective_changed").count() == 2


@pytest.mark.parametrize("role", ["manager", "oncall", "operator"])
def test_a_non_admin_edit_is_refused_with_403_and_logged(client, cast, role, caplog):
    objective = traffic(errors=0, ok=10)
    client.force_login(cast[role])
    assert client.post(f"/slo/{objective.pk}/edit", {"ttft_threshold_ms": "500"}).status_code == 403
    assert client.post("/slo/corrections", {"reason": "x"}).status_code == 403
    _, token = ApiToken.issue(cast[role])
    response = client.patch(
        f"/api/slo/{objective.pk}",
        json.dumps({"ttft_threshold_ms": 500}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )
    assert response.status_code == 403
    objective.refresh_from_db()
    assert objective.ttft_threshold_ms == 450
    refusals = AuditEntry.objects.filter(action="slo_edit_refused", actor=role)
    assert refusals.count() == 3
    assert "only admins edit objectives" in caplog.text


def test_an_admin_marks_a_maintenance_window_on_the_page(client, cast):
    traffic(errors=5, ok=95)
    client.force_login(cast["admin"])
    now = timezone.now()
    response = client.post(
        "/slo/corrections",
        {
            "start": (now - dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M"),
            "end": now.strftime("%Y-%m-%dT%H:%M"),
            "reason": "rack A firmware upgrade",
            "model_key": "",
            "tier": "",
        },
    )
    assert response.status_code == 302
    correction = SloCorrection.objects.get()
    page = client.get("/slo/").content.decode()
    assert "rack A firmware upgrade" in page
    assert "no data in the window" in page  # the only traffic fell inside the excluded period
    assert AuditEntry.objects.filter(action="slo_correction_added", target=f"slo-correction:{correction.pk}").exists()
