"""/slo/<id>/ and `GET /api/slo/<id>`: one objective over its window, every figure checked against the same figure
recomputed here from the rollup rows the test writes (never through the code under test)."""

import datetime as dt
import html
import json
import math
import re
from collections import defaultdict

import pytest
from django.utils import timezone

from console.models import ApiToken
from recovery.actions import slo
from recovery.models import Cluster, SloCorrection, SloObjective, SloRollup
from recovery.policy.slo import TPOT_BOUNDS_MS, TTFT_BOUNDS_MS

pytestmark = pytest.mark.django_db

MODEL = "Qwen3-32B"  # premium: availability 99.9 %, TTFT p99 ≤ 450 ms, TPOT p99 ≤ 40 ms


def histogram(bounds, counts_by_bound: dict[float, int]) -> list[int]:
    """Counts placed in the buckets of the given upper bounds (math.inf: the overflow bucket)."""
    hist = [0] * (len(bounds) + 1)
    for bound, n in counts_by_bound.items():
        hist[len(bounds) if bound == math.inf else bounds.index(bound)] += n
    return hist


def rollup(minute, valid, good, ttft: dict, tpot: dict, simulated=0, tenant="acme"):
    ttft_hist, tpot_hist = histogram(TTFT_BOUNDS_MS, ttft), histogram(TPOT_BOUNDS_MS, tpot)
    return SloRollup.objects.create(
        minute=minute,
        model_key=MODEL,
        tier="premium",
        tenant=tenant,
        valid=valid,
        good=good,
        server_errors=valid - good,
        ttft_valid=sum(ttft_hist),
        ttft_good=sum(n for b, n in ttft.items() if b <= 450),
        tpot_valid=sum(tpot_hist),
        tpot_good=sum(n for b, n in tpot.items() if b <= 40),
        joint_good=good,
        ttft_hist=ttft_hist,
        tpot_hist=tpot_hist,
        simulated=simulated,
    )


def at(days_ago: int, hour: int, minute: int = 0) -> dt.datetime:
    day = (timezone.now() - dt.timedelta(days=days_ago)).date()
    return dt.datetime(day.year, day.month, day.day, hour, minute, tzinfo=dt.UTC)


@pytest.fixture
def objective():
    slo.ensure_objectives([(MODEL, "premium")])
    return SloObjective.objects.get(model_key=MODEL, tier="premium", tenant="")


@pytest.fixture
def rows(objective):
    """Three days with requests and one without (two days ago); a recent minute that burns the budget fast."""
    recent = timezone.now().replace(second=0, microsecond=0) - dt.timedelta(minutes=2)
    return [
        # Three days ago: 9,981 of 10,000 answered (missed 99.9 %), in two minutes of two tenants; generated history.
        rollup(at(3, 10), 6000, 5990, {300: 4990, 400: 900, 450: 100}, {30: 5990}, simulated=6000),
        rollup(
            at(3, 11, 30),
            4000,
            3991,
            {300: 3000, 450: 800, 1000: 41, math.inf: 150},
            {30: 3900, 50: 91},
            simulated=4000,
        ),
        rollup(at(3, 11, 30), 0, 0, {}, {}, tenant="globex"),
        # Yesterday: every request answered and fast (met).
        rollup(at(1, 10), 500, 500, {100: 500}, {20: 500}),
        # A couple of minutes ago: 10 of 100 failed, 100× the budget's rate over 5 m and 1 h: a page.
        rollup(recent, 100, 90, {300: 90}, {30: 90}),
    ]


def expected(rows):
    """Per-day and window figures recomputed from the rows by hand."""
    days = defaultdict(lambda: defaultdict(int))
    hists = defaultdict(lambda: {"ttft": [0] * (len(TTFT_BOUNDS_MS) + 1), "tpot": [0] * (len(TPOT_BOUNDS_MS) + 1)})
    for r in rows:
        day = r.minute.date().isoformat()
        for name in ("valid", "good", "ttft_valid", "ttft_good", "tpot_valid", "tpot_good", "simulated"):
            days[day][name] += getattr(r, name)
        for kind in ("ttft", "tpot"):
            hists[day][kind] = [a + b for a, b in zip(hists[day][kind], getattr(r, f"{kind}_hist"))]
    return days, hists


def nth_smallest_bound(bounds, hist, q) -> str:
    """The q-th percentile by listing every measurement as its bucket's bound and picking the rank-th."""
    values = [b for b, n in zip([*bounds, math.inf], hist) for _ in range(n)]
    value = values[math.ceil(len(values) * q / 100) - 1]
    return f"> {bounds[-1]:,} ms" if value == math.inf else f"{value:,} ms"


def day_row(page: str, day: str) -> str:
    return html.unescape(re.search(rf'<tr data-day="{day}">(.*?)</tr>', page, re.S).group(1))


def test_the_page_shows_the_figures_the_rows_add_up_to(client, cast, objective, rows):
    client.force_login(cast["manager"])
    response = client.get(f"/slo/{objective.pk}/")
    assert response.status_code == 200
    page = response.content.decode()
    days, hists = expected(rows)
    valid = sum(r.valid for r in rows)
    good = sum(r.good for r in rows)
    bad = valid - good
    assert (valid, good) == (10_600, 10_571)
    # The window's figures, each with its counts and formula.
    assert f"attainment = good ÷ valid = {good:,} ÷ {valid:,}" in page
    assert f"{100 * good / valid:.3f}%" in page
    assert f"1 − {bad:,} ÷ ({valid:,} × 0.001)" in page
    assert f"{100 * (1 - bad / (valid * 0.001)):.1f}%" in page
    # Each day: counts, attainment and percentiles read from the day's summed histogram.
    for day, sums in days.items():
        row = day_row(page, day)
        assert f"{sums['good']:,} ÷ {sums['valid']:,}" in row
        assert f"{100 * sums['good'] / sums['valid']:.2f}%" in row
        for kind in ("ttft", "tpot"):
            bounds = TTFT_BOUNDS_MS if kind == "ttft" else TPOT_BOUNDS_MS
            percentiles = " · ".join(nth_smallest_bound(bounds, hists[day][kind], q) for q in (50, 90, 99))
            assert percentiles in row, (day, kind, percentiles, row)
    three_days_ago = at(3, 0).date().isoformat()
    assert "9,981 ÷ 10,000" in day_row(page, three_days_ago)
    assert "> 60,000 ms" in day_row(page, three_days_ago)  # 150 of 9,981 past the last bound: so is p99
    # The calendar: the missed day red, yesterday green.
    assert re.search(rf'class="cal-day cal-red" data-day="{three_days_ago}" data-state="missed"', page)
    yesterday = at(1, 0).date().isoformat()
    if yesterday != rows[-1].minute.date().isoformat():  # the recent minute is not yesterday's (after 00:02 UTC)
        assert re.search(rf'class="cal-day cal-green" data-day="{yesterday}" data-state="met"', page)
    # The burn-rate table: 10 bad of 100 over 5 m and 1 h, 100× the rate the budget allows; the page rule fires.
    burn_5m = re.search(r'<tr data-window="5m">(.*?)</tr>', page, re.S).group(1)
    assert "100.00×" in burn_5m and "(10 ÷ 100) ÷ 0.001" in burn_5m
    assert "SRE workbook multiwindow, multi-burn-rate (30-day budget)" in page
    rule = re.search(r'<tr data-rule="page-1h">(.*?)</tr>', page, re.S).group(1)
    assert 'data-state="fires"' in rule
    assert 'id="slo-alert" data-alert="page"' in page
    # Generated history, said plainly.
    simulated = sum(r.simulated for r in rows)
    assert f"{simulated:,} of the window&#x27;s {valid:,} requests ({100 * simulated / valid:.1f}%)" in page
    assert 'id="chart-burn-down"' in page and 'id="chart-ttft-bands"' in page  # drawn in the browser


def test_a_day_without_requests_says_no_data_never_100_percent(client, cast, objective, rows):
    client.force_login(cast["operator"])
    page = client.get(f"/slo/{objective.pk}/").content.decode()
    two_days_ago = at(2, 0).date().isoformat()
    cell = re.search(rf'data-day="{two_days_ago}" data-state="([^"]+)">(.*?)</div>\s*</div>', page, re.S)
    assert cell.group(1) == "no data"
    assert "no data" in cell.group(2) and "%" not in cell.group(2)
    assert f'<tr data-day="{two_days_ago}">' not in page  # no row in the days table either


def test_an_objective_with_no_data_says_so_everywhere(client, cast, objective):
    client.force_login(cast["manager"])
    page = client.get(f"/slo/{objective.pk}/").content.decode()
    assert "attainment: no valid requests" in page and "no data in the window" in page
    assert "100.000%" not in page and "100.0%" not in page and "100.00%" not in page
    assert 'data-state="met"' not in page and 'data-state="missed"' not in page
    data = json.loads(re.search(r'<script id="slo-chart-data" type="application/json">(.*?)</script>', page).group(1))
    assert all(s["t"] == [] for s in data["burn_down"]["indicators"].values())  # no line at 100 %


def test_the_api_carries_the_same_detail(client, cast, objective, rows):
    _, token = ApiToken.issue(cast["oncall"])
    body = client.get(f"/api/slo/{objective.pk}", HTTP_AUTHORIZATION=f"Bearer {token}").json()
    days, hists = expected(rows)
    assert [d["day"] for d in body["daily"]] == sorted(days)
    for d in body["daily"]:
        assert (d["valid"], d["good"]) == (days[d["day"]]["valid"], days[d["day"]]["good"])
        assert d["ttft_hist"] == hists[d["day"]]["ttft"]
    three_days_ago = at(3, 0).date().isoformat()
    ttft = body["bands"]["ttft"]
    index = ttft["days"].index(three_days_ago)
    # 9,981 TTFTs: 7,990 in the 300 ms bucket, 900 in 400, 900 in 450, 41 in 1,000 and 150 past 60,000.
    assert (ttft["p50"][index], ttft["p90"][index], ttft["p99"][index]) == (300, 450, None)
    assert ttft["threshold_ms"] == 450 and ttft["percentile"] == 99
    # The burn-down ends where the window's budget is, starts full, and never rises.
    valid, bad = sum(r.valid for r in rows), sum(r.valid - r.good for r in rows)
    availability = body["burn_down"]["indicators"]["availability"]
    assert availability["remaining"][0] == 1.0
    assert availability["remaining"][-1] == pytest.approx(1 - bad / (valid * 0.001))
    assert availability["remaining"] == sorted(availability["remaining"], reverse=True)
    assert len(availability["t"]) == 1 + len({r.minute.replace(minute=0) for r in rows if r.valid})
    assert body["burn_down"]["ideal"]["remaining"] == [1.0, 0.0]
    assert [row["window"] for row in body["burn_table"]] == ["5m", "30m", "1h", "2h", "6h", "1d", "3d"]
    assert body["simulated"]["simulated"] == 10_000 and body["simulated"]["days"] == [three_days_ago]
    assert len(body["calendar"][0]) == 7 and any(c and c["state"] == "no data" for w in body["calendar"] for c in w)


def test_corrections_that_cover_it_are_listed_and_their_minutes_left_out(client, cast, objective, rows):
    SloCorrection.objects.create(
        start=at(3, 11), end=at(3, 12), reason="rack B firmware", model_key=MODEL, created_by="admin"
    )
    SloCorrection.objects.create(start=at(3, 11), end=at(3, 12), reason="other model", model_key="Llama-3-8B")
    client.force_login(cast["manager"])
    page = client.get(f"/slo/{objective.pk}/").content.decode()
    corrections = re.search(r'id="slo-detail-corrections">(.*?)</table>', page, re.S).group(1)
    assert "rack B firmware" in corrections and "other model" not in corrections
    assert "5,990 ÷ 6,000" in day_row(page, at(3, 0).date().isoformat())  # 11:30 is excluded


def test_slo_links_each_objective_to_its_page_and_the_partial_refreshes_the_numbers(client, cast, objective, rows):
    client.force_login(cast["manager"])
    assert f'<a href="/slo/{objective.pk}/">Qwen3-32B · Premium</a>' in client.get("/slo/").content.decode()
    partial = client.get(f"/slo/{objective.pk}/?partial=numbers").content.decode()
    assert 'id="slo-summary" data-part' in partial and 'id="slo-days" data-part' in partial
    assert 'id="slo-chart-data"' in partial and "<html" not in partial


def test_a_missing_objective_is_404(client, cast):
    client.force_login(cast["manager"])
    assert client.get("/slo/99999/").status_code == 404


@pytest.mark.parametrize("role", ["manager", "oncall", "operator", "admin"])
def test_every_reading_role_opens_it(client, cast, objective, role):
    client.force_login(cast[role])
    page = client.get(f"/slo/{objective.pk}/").content.decode()
    assert "Qwen3-32B · Premium" in page
    assert (f"/slo/{objective.pk}/edit" in page) == (role == "admin")


def test_no_role_is_refused_and_no_login_is_sent_to_log_in(client, objective, django_user_model):
    response = client.get(f"/slo/{objective.pk}/")
    assert response.status_code == 302 and "/login/" in response["Location"]
    client.force_login(django_user_model.objects.create_user("nobody", password="x"))
    assert client.get(f"/slo/{objective.pk}/").status_code == 403
    assert client.get(f"/api/slo/{objective.pk}").status_code == 403


def test_the_page_reads_a_fixed_number_of_queries(client, cast, objective, rows, django_assert_max_num_queries):
    client.force_login(cast["manager"])
    Cluster.default()  # a running system has its cluster: its one-time creation is no page's
    # Five are this page's, however many days and minutes: the objective, its corrections, the window's sums, the
    # per-day sums (histograms bucket by bucket) and the per-hour sums; the rest are every page's (session, nav, the
    # banner's levels per model).
    with django_assert_max_num_queries(12):
        assert client.get(f"/slo/{objective.pk}/").status_code == 200


def test_a_day_exactly_on_target_met_it(client, cast, objective):
    # 999 of 1,000 is 99.9 %: met, though 99.9 / 100 is a hair above 0.999 in binary.
    rollup(at(2, 10), 1000, 999, {300: 999}, {30: 999})
    client.force_login(cast["manager"])
    page = client.get(f"/slo/{objective.pk}/").content.decode()
    assert f'data-day="{at(2, 0).date().isoformat()}" data-state="met"' in page
