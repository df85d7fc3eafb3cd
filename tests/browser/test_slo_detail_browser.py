"""One objective's page in headless Chromium: reached from /slo/, its burn-down and percentile bands drawn by Plotly,
its calendar of UTC days, and its numbers refreshed live without a reload."""

import pytest

from tests.helpers import http_json, log_in, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.browser]


def send(info, n: int) -> None:
    for i in range(n):
        status, body = http_json(
            info["urls"]["gateway"] + "/completions",
            data={"model": "Qwen3-32B", "prompt": f"objective {i}", "max_tokens": 4},
            headers={"Authorization": f"Bearer {info['gateway_key']}"},
            timeout=30,
        )
        assert status == 200, body


def standard(stack) -> dict | None:
    """The standard tier's objective (the demo's gateway key is standard's), once its rollups count requests."""
    status, body = stack.api("/api/slo")
    assert status == 200, body
    return next((o for o in body["objectives"] if o["tier"] == "standard" and o["counts"]["valid"]), None)


def test_the_manager_opens_an_objective_and_sees_its_charts_and_calendar(browser, demo_stack):
    info = demo_stack.info
    send(info, 5)
    objective = wait_for(lambda: standard(demo_stack), 30, 0.5, "the standard objective counting requests")
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, demo_stack, "manager")
    page.goto(info["urls"]["console"] + "slo/")
    page.click(f"#slo-objectives tr[data-objective='{objective['id']}'] a[href='/slo/{objective['id']}/']")
    page.wait_for_url(f"**/slo/{objective['id']}/")
    for chart in ("#chart-burn-down", "#chart-ttft-bands", "#chart-tpot-bands"):
        page.wait_for_selector(chart + ".js-plotly-plot .main-svg", timeout=20_000)
    assert page.locator("#chart-burn-down .xtitle").text_content() == "time (UTC)"
    assert page.locator("#chart-ttft-bands .xtitle").text_content() == "day (UTC)"
    assert "threshold 2,000 ms (p99)" in page.locator("#chart-ttft-bands").text_content()
    # The calendar: the 30-day window's 31 UTC days (the first and today in part), today counted, a day without a
    # request "no data" (never 100 %).
    days = page.locator("#slo-calendar .cal-day")
    assert days.count() == 31
    assert days.last.get_attribute("data-state") in ("met", "missed")
    empty = page.locator("#slo-calendar .cal-day[data-state='no data']")
    for i in range(empty.count()):
        assert "no data" in empty.nth(i).inner_text() and "%" not in empty.nth(i).inner_text()
    assert "SRE workbook multiwindow" in page.locator("#slo-profile").inner_text()

    # More requests: the numbers follow without a reload (the page refreshes every 15 s; rollups every 5 s).
    page.evaluate("window.__noReload = 'slo'")
    before = page.locator("#slo-indicators tr[data-indicator=availability]").inner_text()
    send(info, 3)
    wait_for(
        lambda: page.locator("#slo-indicators tr[data-indicator=availability]").inner_text() != before,
        40,
        0.5,
        "the availability figures refreshed",
    )
    assert page.evaluate("window.__noReload") == "slo", "the page reloaded"
    page.wait_for_selector("#chart-burn-down.js-plotly-plot .main-svg")  # redrawn with the refreshed data
    page.screenshot(path=str(demo_stack.var_dir / "slo-detail.png"), full_page=True)
    assert errors == []
    page.close()
