"""Request outcomes rolled up per minute (recovery.actions.slo): counts, idempotence, late arrivals, pruning, and
objectives and corrections changed only through the audited actions."""

import datetime as dt
import json
import random
import sys
import threading
from importlib import import_module

import pytest
from django.apps import apps as django_apps
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from console.readmodels import slo as slo_model
from recovery.actions import slo, streams
from recovery.models import (
    AuditEntry,
    RequestOutcome,
    SloCorrection,
    SloDayCoverage,
    SloDayRollup,
    SloObjective,
    SloRollup,
    SloRollupState,
)
from recovery.policy import slo as slo_policy

pytestmark = pytest.mark.django_db

MODEL = "Qwen3-32B"
NOW = timezone.now().replace(microsecond=0)


@pytest.fixture(autouse=True)
def _now(monkeypatch):
    """NOW as each test starts: the figures read the windows back from the real clock, and this module may run many
    minutes after it was imported (a 5-minute window would have slid past the outcomes written "2 minutes ago")."""
    monkeypatch.setattr(sys.modules[__name__], "NOW", timezone.now().replace(microsecond=0))


ONE_MINUTE = dt.timedelta(minutes=1)


def report(at: dt.datetime, *, status="ok", ttft=300.0, tpot=30.0, tier="premium", tenant="acme", **extra) -> tuple:
    """One outcome as a gateway reports it (recovery.gateway.app._report)."""
    e2e = 1000.0
    data = {
        "request_id": f"r-{random.getrandbits(48):x}",
        "tenant": tenant,
        "tier": tier,
        "model": MODEL,
        "status": status,
        "http_status": extra.pop("http_status", 200 if status == "ok" else 502),
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "e2e_ms": e2e,
        "started_at": (at - dt.timedelta(milliseconds=e2e)).timestamp(),
        "completion_tokens": 10,
        **extra,
    }
    return ("gw-1", data)


def store(*items):
    """Outcomes that arrived some other way than the stream (rows from before an upgrade, a bulk load): stored
    without being counted, for the periodic roll-up (the stream consumer's own path is tested below)."""
    return RequestOutcome.objects.bulk_create(streams.outcome_rows(list(items)))


def test_the_stream_consumer_counts_its_outcomes_as_it_stores_them():
    minute = NOW.replace(second=0) - dt.timedelta(minutes=4)
    streams.store_outcomes([report(minute + dt.timedelta(seconds=s)) for s in range(0, 60, 20)])
    streams.store_outcomes(
        [report(minute + dt.timedelta(seconds=50), status="error", ttft=None, tpot=None), report(minute + ONE_MINUTE)]
    )
    assert not RequestOutcome.objects.filter(rolled_up=False).exists()
    assert slo.roll_up() == 0  # nothing left for the periodic run
    rows = list(SloRollup.objects.order_by("minute").values_list("minute", "valid", "good", "server_errors"))
    assert rows == [(minute, 4, 3, 1), (minute + ONE_MINUTE, 1, 1, 0)]
    assert SloRollupState.objects.get().outcomes_rolled == 5


def test_a_minute_rolls_up_to_the_counts_and_shipped_objectives_appear():
    minute = NOW.replace(second=0) - dt.timedelta(minutes=3)
    store(
        report(minute + dt.timedelta(seconds=5)),
        report(minute + dt.timedelta(seconds=10), ttft=900.0),
        report(minute + dt.timedelta(seconds=20), status="error", ttft=None, tpot=None),
        report(
            minute + dt.timedelta(seconds=30), status="shed", http_status=429, ttft=None, tpot=None, degradation_level=2
        ),
        report(minute + dt.timedelta(seconds=40), status="rejected", http_status=400, ttft=None, tpot=None),
    )
    assert slo.roll_up() == 5
    row = SloRollup.objects.get()
    assert (row.minute, row.model_key, row.tier, row.tenant) == (minute, MODEL, "premium", "acme")
    assert (row.valid, row.good, row.server_errors, row.shed, row.client_errors) == (4, 2, 1, 1, 1)
    assert row.shed_by_level == {"2": 1}
    assert (row.ttft_valid, row.ttft_good, row.joint_good) == (2, 1, 1)  # 900 ms misses premium's 450 ms
    objective = SloObjective.objects.get(model_key=MODEL, tier="premium", tenant="")
    assert (objective.ttft_threshold_ms, objective.tpot_threshold_ms) == (450, 40)
    assert "MLPerf" in objective.source
    assert AuditEntry.objects.filter(action="slo_objective_created", target=f"slo:{objective.pk}").exists()


def test_a_rerun_counts_nothing_twice_and_a_late_outcome_joins_its_minute():
    minute = NOW.replace(second=0) - dt.timedelta(minutes=10)
    store(*[report(minute + dt.timedelta(seconds=s)) for s in range(0, 60, 10)])
    assert slo.roll_up() == 6
    assert slo.roll_up() == 0  # the same run again: nothing left
    store(report(minute + dt.timedelta(seconds=59), status="error", ttft=None, tpot=None))  # arrives late
    store(report(minute + dt.timedelta(minutes=1)))
    assert slo.roll_up() == 2
    rows = list(SloRollup.objects.order_by("minute").values_list("minute", "valid", "good", "server_errors"))
    assert rows == [(minute, 7, 6, 1), (minute + dt.timedelta(minutes=1), 1, 1, 0)]
    assert sum(SloRollup.objects.get(minute=minute).ttft_hist) == 6


def test_batches_add_up_to_one_run():
    minute = NOW.replace(second=0) - dt.timedelta(minutes=5)
    store(*[report(minute + dt.timedelta(milliseconds=100 * i), ttft=100.0 + i) for i in range(25)])
    assert slo.roll_up(batch_size=4) == 25
    row = SloRollup.objects.get()
    assert (row.valid, row.good, row.ttft_valid, sum(row.ttft_hist)) == (25, 25, 25, 25)


@pytest.mark.django_db(transaction=True)
def test_two_workers_rolling_up_at_once_never_double_count():
    if connection.vendor != "postgresql":
        pytest.skip("two connections writing at once: PostgreSQL (SQLite serialises every writer anyway)")
    minute = NOW.replace(second=0) - dt.timedelta(minutes=5)
    store(*[report(minute + dt.timedelta(milliseconds=50 * i)) for i in range(400)])
    counted, errors = [], []

    def worker():
        try:
            counted.append(slo.roll_up(batch_size=50))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(counted) == 400
    assert SloRollup.objects.get().valid == 400


def test_attainment_and_budget_from_rollups_equal_the_exact_figures_from_raw_outcomes():
    rng = random.Random(12)
    start = NOW.replace(second=0) - dt.timedelta(hours=6)
    items = []
    for _ in range(1200):
        at = start + dt.timedelta(seconds=rng.uniform(0, 6 * 3600 - 61))
        status = rng.choices(["ok", "error", "shed", "rejected"], [0.97, 0.01, 0.01, 0.01])[0]
        served = status in ("ok", "error")
        items.append(
            report(
                at,
                status=status,
                http_status={"ok": 200, "error": 502, "shed": 429, "rejected": 400}[status],
                ttft=rng.lognormvariate(5.6, 0.4) if served else None,
                tpot=rng.lognormvariate(3.2, 0.3) if served else None,
                tenant=rng.choice(["acme", "globex"]),
            )
        )
    store(*items)
    slo.roll_up()
    objective = SloObjective.objects.get(model_key=MODEL, tier="premium", tenant="")
    status = slo_model.objective_status(objective)
    raw = list(RequestOutcome.objects.all())
    valid = [o for o in raw if o.status in ("ok", "error", "shed")]
    exact = {
        "availability": (sum(o.status == "ok" for o in valid), len(valid)),
        "ttft": (
            sum(o.ttft_ms <= 450 for o in valid if o.ttft_ms is not None),
            sum(o.ttft_ms is not None for o in valid),
        ),
        "tpot": (
            sum(o.tpot_ms <= 40 for o in valid if o.tpot_ms is not None),
            sum(o.tpot_ms is not None for o in valid),
        ),
    }
    for indicator in status["indicators"]:
        good, total = exact[indicator["indicator"]]
        assert (indicator["good"], indicator["valid"]) == (good, total), indicator["indicator"]
        target = indicator["target"]
        assert indicator["budget_remaining"] == pytest.approx(slo_policy.budget_remaining(good, total, target))
    joint = sum(o.status == "ok" and o.ttft_ms <= 450 and o.tpot_ms <= 40 for o in valid)
    assert status["counts"]["joint_good"] == joint
    # Percentiles from the summed histograms: within one bucket of the exact figure.
    hist = [0] * (len(slo_policy.TTFT_BOUNDS_MS) + 1)
    for row in SloRollup.objects.all():
        slo_policy.add_counts(hist, row.ttft_hist)
    ttfts = sorted(o.ttft_ms for o in valid if o.ttft_ms is not None)
    p99 = ttfts[-(-len(ttfts) * 99 // 100) - 1]
    read = slo_policy.percentile(slo_policy.TTFT_BOUNDS_MS, hist, 99)
    i = slo_policy.bucket_index(slo_policy.TTFT_BOUNDS_MS, p99)
    assert read >= p99 and read == slo_policy.TTFT_BOUNDS_MS[i]


def test_failures_burn_the_budget_and_page():
    minute = NOW.replace(second=0) - dt.timedelta(minutes=2)
    store(
        *[report(minute + dt.timedelta(milliseconds=200 * i), status="error", ttft=None, tpot=None) for i in range(30)]
    )
    store(*[report(minute + dt.timedelta(milliseconds=200 * i + 100)) for i in range(170)])
    slo.roll_up()
    status = slo_model.objective_status(SloObjective.objects.get(model_key=MODEL, tier="premium", tenant=""))
    availability = status["indicators"][0]
    assert availability["burn_rates"]["5m"] == pytest.approx((30 / 200) / 0.001)
    assert availability["alert"] == "page"
    assert availability["budget_remaining"] < 0
    with override_settings(LIFELINE_SLO_MIN_VALID_FOR_PAGE=1000):  # 200 requests: below the guard
        guarded = slo_model.objective_status(SloObjective.objects.get(model_key=MODEL, tier="premium", tenant=""))
    assert guarded["indicators"][0]["alert"] == "ticket"
    assert guarded["indicators"][0]["alert_guarded"]


def test_a_correction_excludes_its_period_and_is_audited():
    bad = NOW.replace(second=0) - dt.timedelta(hours=2)
    store(*[report(bad + dt.timedelta(seconds=i), status="error", ttft=None, tpot=None) for i in range(20)])
    store(*[report(NOW - dt.timedelta(minutes=30, seconds=i)) for i in range(20)])
    slo.roll_up()
    objective = SloObjective.objects.get(model_key=MODEL, tier="premium", tenant="")
    assert slo_model.objective_status(objective)["indicators"][0]["valid"] == 40
    with pytest.raises(slo.SloRefused, match="reason"):
        slo.add_correction({"start": bad, "end": bad + dt.timedelta(minutes=5), "reason": " "}, "admin")
    correction = slo.add_correction(
        {"start": bad, "end": bad + dt.timedelta(minutes=5), "reason": "planned maintenance", "model_key": MODEL},
        "admin",
    )
    status = slo_model.objective_status(objective)
    assert (status["indicators"][0]["good"], status["indicators"][0]["valid"]) == (20, 20)
    assert status["corrections"][0]["reason"] == "planned maintenance"
    assert AuditEntry.objects.filter(
        action="slo_correction_added", actor="admin", reason="planned maintenance"
    ).exists()
    slo.withdraw_correction(correction, "admin", "it was not maintenance")
    assert not SloCorrection.objects.exists()
    assert slo_model.objective_status(objective)["indicators"][0]["valid"] == 40
    assert AuditEntry.objects.filter(action="slo_correction_withdrawn").exists()


def test_an_objective_edit_is_validated_and_audited():
    slo.ensure_objectives([(MODEL, "standard")])
    objective = SloObjective.objects.get(model_key=MODEL, tier="standard")
    with pytest.raises(slo.SloRefused) as refused:
        slo.update_objective(objective, {"ttft_threshold_ms": 1800}, "admin")
    assert refused.value.field == "ttft_threshold_ms"
    assert "1,500 ms and 2,000 ms" in str(refused.value)
    with pytest.raises(slo.SloRefused, match="below 100"):
        slo.update_objective(objective, {"availability_target": 100}, "admin")
    changed = slo.update_objective(
        objective, {"ttft_threshold_ms": 1500, "window": "calendar_month"}, "admin", "tighter"
    )
    assert changed == {"ttft_threshold_ms": [2000, 1500], "window": ["rolling_30d", "calendar_month"]}
    entry = AuditEntry.objects.get(action="slo_objective_changed")
    assert (entry.actor, entry.reason, entry.details["changed"]["ttft_threshold_ms"]) == (
        "admin",
        "tighter",
        [2000, 1500],
    )
    assert slo.update_objective(objective, {"ttft_threshold_ms": 1500}, "admin") == {}


def test_a_tenant_objective_is_what_its_tenant_is_owed():
    slo.ensure_objectives([(MODEL, "premium")])
    slo.create_objective(
        {"model_key": MODEL, "tier": "premium", "tenant": "acme", "ttft_threshold_ms": 1000, "ttft_percentile": 99,
         "tpot_threshold_ms": 40, "tpot_percentile": 99, "availability_target": 99.9},
        "admin",
    )  # fmt: skip
    minute = NOW.replace(second=0) - dt.timedelta(minutes=4)
    store(report(minute, ttft=800.0, tenant="acme"), report(minute, ttft=800.0, tenant="globex"))
    slo.roll_up()
    assert dict(SloRollup.objects.values_list("tenant", "ttft_good")) == {"acme": 1, "globex": 0}


def test_no_data_reads_no_data_never_100_percent():
    slo.ensure_objectives([(MODEL, "premium")])
    status = slo_model.objective_status(SloObjective.objects.get())
    assert status["has_data"] is False and status["completeness"] == 0
    assert {i["attainment_text"] for i in status["indicators"]} == {"no data"}
    assert status["alert"] == "no data"


def test_pruning_keeps_what_is_not_rolled_up_and_rollups_for_13_months():
    old = (NOW - dt.timedelta(days=40)).replace(second=0, microsecond=0)  # three outcomes in one minute
    store(report(old), report(old + dt.timedelta(seconds=1)))
    slo.roll_up()
    store(report(old + dt.timedelta(seconds=2)))  # not rolled up yet: kept
    SloRollup.objects.create(model_key=MODEL, tier="premium", tenant="acme", minute=NOW - dt.timedelta(days=400))
    with override_settings(LIFELINE_OUTCOME_RETENTION_DAYS=30):
        assert slo.prune() == {"outcomes": 2, "rollups": 1}
    assert RequestOutcome.objects.count() == 1
    assert SloRollup.objects.count() == 1  # the 40-day-old minute stays
    slo.roll_up()
    with override_settings(LIFELINE_OUTCOME_RETENTION_DAYS=30):
        assert slo.prune()["outcomes"] == 1


def _minute_sums_by_day() -> dict:
    sums = {}
    for row in SloRollup.objects.all():
        key = (row.model_key, row.tier, row.tenant, row.minute.astimezone(dt.UTC).date())
        into = sums.setdefault(key, {"valid": 0, "good": 0, "shed": 0, "ttft_hist": [0] * len(row.ttft_hist)})
        into["valid"] += row.valid
        into["good"] += row.good
        into["shed"] += row.shed
        into["ttft_hist"] = [a + b for a, b in zip(into["ttft_hist"], row.ttft_hist, strict=True)]
    return sums


def _hist(row) -> dict:
    return {"ttft_hist": row.ttft_hist}


def _day_sums() -> dict:
    return {
        (d.model_key, d.tier, d.tenant, d.day): {
            "valid": d.valid,
            "good": d.good,
            "shed": d.shed,
            "ttft_hist": d.ttft_hist,
        }
        for d in SloDayRollup.objects.all()
    }


def test_each_days_sums_are_kept_with_its_minutes_and_the_minutes_covered():
    """The report reads whole days from SloDayRollup: they must equal their minutes' sums however the minutes came
    (the stream's path, the periodic one, a late outcome into a minute already stored, two days, two tenants)."""
    midnight = NOW.replace(hour=0, minute=0, second=0)
    before, after = midnight - dt.timedelta(minutes=2), midnight + dt.timedelta(minutes=3)
    streams.store_outcomes([report(before), report(before, tenant="beta"), report(after, status="error", ttft=None)])
    store(report(before + dt.timedelta(seconds=30)), report(after + dt.timedelta(minutes=1), ttft=5000.0))
    slo.roll_up()
    streams.store_outcomes(
        [report(before + dt.timedelta(seconds=50), status="shed", http_status=429, degradation_level=2)]
    )  # late, into a minute already stored
    assert _day_sums() == _minute_sums_by_day() and len(_day_sums()) == 3
    coverage = dict(SloDayCoverage.objects.values_list("day", "minutes"))
    assert coverage == {before.date(): 1, after.date(): 2}  # distinct minutes, whatever the scopes
    # The migration that created the table summed the days of the minutes already there the same way.
    expected = _day_sums()
    SloDayRollup.objects.all().delete()
    SloDayCoverage.objects.all().delete()
    import_module("recovery.migrations.0010_day_rollups").sum_days(django_apps, None)
    assert _day_sums() == expected
    assert dict(SloDayCoverage.objects.values_list("day", "minutes")) == coverage


def test_pruning_drops_days_before_the_13_months_kept():
    SloDayRollup.objects.create(
        model_key=MODEL, tier="premium", tenant="acme", day=(NOW - dt.timedelta(days=400)).date()
    )
    SloDayRollup.objects.create(
        model_key=MODEL, tier="premium", tenant="acme", day=(NOW - dt.timedelta(days=40)).date()
    )
    SloDayCoverage.objects.create(day=(NOW - dt.timedelta(days=400)).date(), minutes=5)
    slo.prune()
    assert list(SloDayRollup.objects.values_list("day", flat=True)) == [(NOW - dt.timedelta(days=40)).date()]
    assert not SloDayCoverage.objects.exists()


def test_the_consumer_trims_what_it_has_handled_and_keeps_what_it_has_not():
    """The outcomes stream holds what is still to do, not the last 500,000 requests' outcomes (a soak found Redis
    growing with every request until MAX_OUTCOMES)."""
    from recovery import hot

    r, keys = hot.client(), hot.keys()
    r.delete(keys.outcomes, keys.signals)
    minute = NOW.replace(second=0) - dt.timedelta(minutes=2)
    for s in range(0, 60, 10):
        gateway, data = report(minute + dt.timedelta(seconds=s))
        r.xadd(keys.outcomes, {"gateway": gateway, "data": json.dumps(data)})
    assert streams.process(count=4)["outcomes"] == 4
    assert r.xlen(keys.outcomes) == 3  # the two not yet read, and the last one handled (trimmed up to it)
    assert streams.process()["outcomes"] == 2
    assert r.xlen(keys.outcomes) <= 1
    assert RequestOutcome.objects.count() == 6
