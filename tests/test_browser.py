"""The cluster page in headless Chromium: log in, watch a node go down without a reload."""

import os
import shutil
import signal
import time

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-quic",
]


def chromium_path() -> str:
    path = os.environ.get("LIFELINE_CHROMIUM") or shutil.which("chromium")
    if not path:
        pytest.fail("Chromium is not installed: `./lifeline test` installs Debian's chromium when run as root, or set LIFELINE_CHROMIUM")
    return path


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def log_in(page, stack, role):
    login = next(item for item in stack.info["logins"] if item["role"] == role)
    page.goto(stack.info["urls"]["cluster"])
    page.fill("#id_username", login["username"])
    page.fill("#id_password", login["password"])
    page.click("button[type=submit]")
    page.wait_for_selector("#live-status[data-state=live]", timeout=10_000)


def test_node_tile_changes_state_live_without_a_reload(browser, demo_stack, tmp_path):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, demo_stack, "operator")
    tile = page.locator("#node-node-02")
    assert tile.get_attribute("data-state") == "serving"
    assert page.locator(".tile").count() == 3
    page.evaluate("window.__noReload = 'still here'")
    pid = demo_stack.node("node-02")["pid"]
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    page.wait_for_selector("#node-node-02[data-state=down]", timeout=10_000)
    seen_after = time.monotonic() - killed
    assert page.evaluate("window.__noReload") == "still here", "the page reloaded"
    assert "Down" in page.locator("#node-node-02 [data-field=state]").inner_text().title()
    assert page.locator("#summary [data-count=down]").inner_text() == "1"
    assert "n/a" in page.locator("#node-node-02 [data-field=running]").inner_text()
    page.screenshot(path=str(tmp_path / "cluster-node-down.png"))
    # The supervisor restarts it: the same tile turns back to serving, still without a reload.
    page.wait_for_selector("#node-node-02[data-state=serving]", timeout=30_000)
    assert page.evaluate("window.__noReload") == "still here"
    assert errors == []
    assert seen_after < 8


def test_figures_update_and_age_ticks(browser, demo_stack):
    page = browser.new_page()
    log_in(page, demo_stack, "manager")
    report = page.locator("#node-node-03 [data-reported-at]")
    first = report.get_attribute("data-reported-at")
    page.wait_for_function(
        "first => document.querySelector('#node-node-03 [data-reported-at]').dataset.reportedAt !== first", arg=first, timeout=5_000
    )
    assert report.inner_text().endswith("s ago")
