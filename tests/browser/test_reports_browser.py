"""Issue 12 item 4 in headless Chromium: a manager opens last month's SLA report, sees its charts, downloads the PDF
and the CSV through the page's links, and every figure on the page, in the PDF's text and summed from the CSV equals
the one recomputed from the raw outcomes the rollups were made of."""

import csv
import subprocess

import pytest
from django.utils import timezone

from console.readmodels import reports
from console.readmodels.slo import pct
from recovery.models import SloRollup
from tests import report_data
from tests.conftest import ROLE_PASSWORD

pytestmark = [pytest.mark.browser]

FIELDS = ("availability", "ttft_attainment", "tpot_attainment", "joint_attainment")


@pytest.fixture(scope="module", autouse=True)
def orm_beside_playwright():
    """Playwright's sync API keeps an event loop running in this thread, which Django takes for an async context;
    the test's own ORM calls and its database's teardown are plain synchronous code all the same."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        yield


def log_in(page, base: str, user) -> None:
    page.goto(base + "/login/?next=/reports/")
    page.fill("#id_username", user.username)
    page.fill("#id_password", ROLE_PASSWORD.format(user.username))
    page.click("button[type=submit]")
    page.wait_for_url(base + "/reports/")


def test_a_manager_reads_last_months_report_and_its_downloads_agree(browser, live_server, cast, tmp_path):
    reader = report_data.pdftotext()
    month = reports.last_complete("month", timezone.now())
    raw = report_data.outcomes(month.start, (0, 4, 11, 25), 120, seed=11, prefix="m")
    raw += report_data.outcomes(month.previous[0], (1,), 80, seed=12, prefix="p")
    report_data.store_and_roll_up(raw)
    assert SloRollup.objects.exists()
    expected = report_data.recompute(raw, month.start, month.end)

    page = browser.new_page(viewport={"width": 1500, "height": 1000}, accept_downloads=True)
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, live_server.url, cast["manager"])
    page.select_option("#report-form select[name=period]", "month")
    page.click("#report-form button[type=submit]")
    page.wait_for_selector("#chart-budgets.js-plotly-plot", timeout=15_000)
    assert page.locator(".js-plotly-plot").count() == 3
    assert page.locator("#report-period").inner_text() == month.label

    # The page's figures, each equal to the one recomputed from the raw outcomes.
    shown = {}
    for row in page.locator("#report-rows tbody tr").all():
        model, tier = row.get_attribute("data-scope").split("|")
        shown[(model, tier)] = {f: row.locator(f"[data-field={f}]").inner_text() for f in (*FIELDS, "requests")}
    assert set(shown) == {(m, t) for m, t, _ in expected}
    for (model, tier, _), want in expected.items():
        figures = shown[(model, tier)]
        assert figures["requests"] == f"{want['valid']:,}"  # with its thousands separators, as in the PDF
        for field in FIELDS:
            assert figures[field] == pct(want[field], 3), (model, tier, field)
    tokens_lost = page.locator("#report-migrations [data-figure=tokens_lost]").inner_text()
    assert tokens_lost == "0"

    # The PDF, downloaded through the page's link: the same figures, scope by scope, in its text.
    with page.expect_download() as download:
        page.click("#download-pdf")
    pdf = tmp_path / download.value.suggested_filename
    download.value.save_as(pdf)
    assert pdf.name == f"lifeline-sla-{month.start.date()}-to-{month.last_day}.pdf"
    text = subprocess.run([reader, "-layout", str(pdf), "-"], capture_output=True, text=True, check=True).stdout
    assert month.label in text and "Tokens lost: 0 (as it must be)" in text
    lines = text.splitlines()
    for (model, tier), figures in shown.items():
        scope = f"{model} · {reports.tier_label(tier)}"
        line = next(line for line in lines if line.strip().startswith(scope) and "%" in line)
        cells = line.split()
        assert figures["requests"] in cells, line
        for field in FIELDS:
            assert figures[field] in cells, (scope, field, line)

    # The CSV, downloaded through the page's link: its rows sum to the page's figures.
    with page.expect_download() as download:
        page.click("#download-csv")
    sheet = tmp_path / download.value.suggested_filename
    download.value.save_as(sheet)
    sums: dict[tuple, dict] = {}
    with sheet.open() as f:
        for line in csv.DictReader(f):
            s = sums.setdefault((line["model"], line["tier"]), {})
            for name in ("valid", "good", "ttft_valid", "ttft_good", "tpot_valid", "tpot_good", "joint_good"):
                s[name] = s.get(name, 0) + int(line[name])
    for key, figures in shown.items():
        s = sums[key]
        assert int(figures["requests"].replace(",", "")) == s["valid"]
        assert figures["availability"] == pct(s["good"] / s["valid"], 3)
        assert figures["ttft_attainment"] == pct(s["ttft_good"] / s["ttft_valid"], 3)
        assert figures["tpot_attainment"] == pct(s["tpot_good"] / s["tpot_valid"], 3)
        assert figures["joint_attainment"] == pct(s["joint_good"] / s["valid"], 3)
    page.screenshot(path=str(tmp_path / "reports.png"), full_page=True)
    assert errors == []
