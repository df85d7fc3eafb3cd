"""The cluster page in headless Chromium: log in, watch a node go down without a reload."""

import os
import signal
import threading
import time

import pytest

from tests.helpers import http_json, log_in

pytestmark = [pytest.mark.e2e, pytest.mark.browser]


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
        "first => document.querySelector('#node-node-03 [data-reported-at]').dataset.reportedAt !== first",
        arg=first,
        timeout=5_000,
    )
    assert report.inner_text().endswith("s ago")


def test_incident_timeline_grows_live_while_a_node_is_killed(browser, demo_stack):
    from tests.helpers import wait_for

    # Start from a quiet cluster: no incident still recovering from another test's kill.
    wait_for(
        lambda: all(i["status"] != "active" for i in demo_stack.api("/api/incidents")[1]["incidents"]),
        30,
        0.2,
        "no active incident",
    )
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, demo_stack, "oncall")
    page.goto(demo_stack.info["urls"]["console"] + "incidents/")
    page.wait_for_selector("#live-status[data-state=live]")
    page.evaluate("window.__noReload = 'list'")
    os.kill(demo_stack.node("node-03")["pid"], signal.SIGKILL)
    # The new incident appears in the list without a reload.
    row = "#incident-rows tr[data-status=active]:has-text('node-03')"
    page.wait_for_selector(row, timeout=10_000)
    assert page.evaluate("window.__noReload") == "list"
    page.locator(row + " a").first.click()  # found again at the click: the list may have been refreshed since
    page.wait_for_selector("#live-status[data-state=live]")
    page.wait_for_selector("#events tr[data-kind=detected]", timeout=10_000)
    assert page.locator("#events tr[data-kind=symptom]").count() == 1
    page.evaluate("window.__noReload = 'incident'")
    # The node is restarted by the demo's supervisor: its return arrives event by event, live.
    for kind in ("restart", "draft_ready", "full_model_ready", "back_in_routing"):
        page.wait_for_selector(f"#events tr[data-kind={kind}]", timeout=40_000)
    assert page.evaluate("window.__noReload") == "incident", "the page reloaded"
    times = [float(t) for t in page.eval_on_selector_all("#events tr", "rows => rows.map(r => r.dataset.at)")]
    assert times == sorted(times)  # rows stand in time order, however late each one was written
    page.wait_for_selector("#incident-status[data-status=stable]", timeout=20_000)
    assert "Recovered" in page.locator("#events").inner_text()
    assert errors == []


def test_a_live_refresh_keeps_the_reason_being_typed(browser, demo_stack):
    """The drain page refreshes at every step; what an approver is typing, and where, survives it."""
    from tests.helpers import wait_for

    console = demo_stack.info["urls"]["console"]
    contexts = {role: browser.new_context() for role in ("operator", "oncall", "admin")}
    pages = {role: context.new_page() for role, context in contexts.items()}
    for role, page in pages.items():
        log_in(page, demo_stack, role)

    def post(role, path, form):
        page = pages[role]
        csrf = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
        answer = page.request.post(
            console + path, form=form, headers={"X-CSRFToken": csrf, "Referer": console}, max_redirects=0
        )
        assert answer.status == 302, (answer.status, answer.text()[:500])
        return answer.headers["location"]

    def drain_of(node):
        return wait_for(
            lambda: next(
                (d for d in demo_stack.api("/api/drains")[1]["drains"] if d["node"] == node and d["waiting"]), None
            ),
            5,
            0.1,
            f"a drain of {node}",
        )

    try:
        # Two drains in one pool: the second needs two approvers.
        post(
            "operator",
            "nodes/node-01/drain",
            {"reason": "fan noise", "mode": "allow_completion", "remediation": "restart"},
        )
        post(
            "operator",
            "nodes/node-02/drain",
            {"reason": "ECC errors climbing", "mode": "allow_completion", "remediation": "restart"},
        )
        first, second = drain_of("node-01"), drain_of("node-02")
        assert second["approvals_required"] == 2
        page = pages["admin"]
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        # The page's sockets, so the test can deliver a frame exactly when it wants one.
        page.add_init_script(
            "window.__sockets = []; const Native = window.WebSocket; window.WebSocket = class extends Native {"
            " constructor(...a) { super(...a); window.__sockets.push(this); } };"
        )
        page.goto(console + f"drains/{second['id']}/")
        page.wait_for_selector("#live-status[data-state=live]")
        page.evaluate("window.__noReload = 'drain'")
        field = page.locator("#approve-form input[name=reason]")
        field.type("the node's ECC count doubled in an hour")
        page.evaluate("document.querySelector('#approve-form input[name=reason]').setSelectionRange(9, 13)")
        # On-call approves first, elsewhere: a step, so the admin's page refreshes while the reason is in the box.
        post("oncall", f"drains/{second['id']}/approve", {"reason": "first of two"})
        page.wait_for_function("() => document.querySelector('.facts').innerText.includes('1 of 2')", timeout=10_000)
        assert page.evaluate("window.__noReload") == "drain", "the page reloaded"
        assert field.input_value() == "the node's ECC count doubled in an hour"
        assert page.evaluate(
            "[document.activeElement.name, document.activeElement.selectionStart, document.activeElement.selectionEnd]"
        ) == ["reason", 9, 13]
        assert page.locator("#reject-form input[name=reason]").input_value() == ""  # what was not typed in stays empty
        # A frame arrives while the approver is pressing the button: the fragment is not swapped under the press
        # (the click would land on a button that is gone, and the decision be lost); it completes and submits.
        button = page.locator("#approve-form button")
        button.evaluate("b => { b.dataset.pressed = 'before the frame'; }")
        box = button.bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.down()
        page.evaluate("window.__sockets.forEach((s) => s.onmessage({ data: '{}' }))")
        page.wait_for_timeout(1000)  # past the refresh's 300 ms delay and its fetch
        assert page.evaluate("document.querySelector('#approve-form button').dataset.pressed") == "before the frame"
        # The reason typed before the refresh is the one submitted.
        page.mouse.up()
        page.wait_for_selector("#drain-state:not([data-state=proposed])", timeout=10_000)
        decisions = demo_stack.api(f"/api/drains/{second['id']}")[1]["decisions"]
        assert [d["reason"] for d in decisions] == ["first of two", "the node's ECC count doubled in an hour"]
        assert errors == []
        post("operator", f"drains/{first['id']}/cancel", {"reason": "the fans were fine"})
    finally:
        for context in contexts.values():
            context.close()


def test_the_checkpoint_page_goes_live(browser, demo_stack):
    """It has no `data-live-into`: the live script used to look for an empty selector, throw, and freeze the page."""
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, demo_stack, "operator")
    page.goto(demo_stack.info["urls"]["console"] + "checkpoints/")
    page.wait_for_selector("#live-status[data-state=live]", timeout=10_000)
    assert errors == []
    page.close()


def test_drains_waiting_show_live_in_the_nav_the_title_and_the_banner(browser, demo_stack):
    """On-call sees a drain arrive on whatever page is open: the nav's count, "(1) " in the tab's title, and a
    banner pill that opens the drain; all without a reload, and gone again when the drain is withdrawn."""
    from tests.helpers import wait_for

    console = demo_stack.info["urls"]["console"]
    contexts = {role: browser.new_context(viewport={"width": 1400, "height": 900}) for role in ("operator", "oncall")}
    pages = {role: context.new_page() for role, context in contexts.items()}
    try:
        for role, page in pages.items():
            log_in(page, demo_stack, role)
        page = pages["oncall"]
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.add_init_script(
            "window.__sockets = []; const Native = window.WebSocket; window.WebSocket = class extends Native {"
            " constructor(...a) { super(...a); window.__sockets.push(this); } };"
        )
        page.goto(console + "cluster/")
        page.wait_for_function("window.__sockets.some((s) => s.url.endsWith('/ws/status/') && s.readyState === 1)")
        page.evaluate("window.__noReload = 'cluster'")
        assert not page.title().startswith("(") and page.locator("#drains-waiting").is_hidden()

        operator = pages["operator"]
        csrf = next(c["value"] for c in operator.context.cookies() if c["name"] == "csrftoken")
        headers = {"X-CSRFToken": csrf, "Referer": console}
        form = {"reason": "fan noise", "mode": "allow_completion", "remediation": "restart"}
        assert operator.request.post(console + "nodes/node-01/drain", form=form, headers=headers).ok
        drain = wait_for(
            lambda: next((d for d in demo_stack.api("/api/drains")[1]["drains"] if d["waiting"]), None), 5, 0.1, "drain"
        )
        page.wait_for_function("document.title.startsWith('(1) Cluster')", timeout=10_000)
        assert page.locator("#drains-waiting").inner_text() == "1" and page.locator("#drains-waiting").is_visible()
        assert page.locator("#drains-waiting-pill").get_attribute("href") == f"/drains/{drain['id']}/"
        assert page.evaluate("window.__noReload") == "cluster", "the page reloaded"

        # On-call is told by e-mail, written to var/mail/ by the demo; the drains page says how each channel went.
        wait_for(lambda: list((demo_stack.var_dir / "mail").glob("*")), 20, 0.2, "an e-mail in var/mail/")
        drains_page = pages["operator"]

        def webhook_delivery():
            drains_page.goto(console + "drains/")
            return drains_page.locator("td[data-channel=webhook]").first.inner_text() == "not configured"

        wait_for(webhook_delivery, 10, 0.5, "the webhook's delivery on the drains page")

        page.locator("#drains-waiting-pill").click()
        page.wait_for_url(f"**/drains/{drain['id']}/")
        page.evaluate("window.__noReload = 'drain'")
        assert operator.request.post(
            console + f"drains/{drain['id']}/cancel", form={"reason": "the fans were fine"}, headers=headers
        ).ok
        page.wait_for_function("!document.title.startsWith('(')", timeout=10_000)
        assert page.locator("#drains-waiting").is_hidden() and page.evaluate("window.__noReload") == "drain"
        assert errors == []
    finally:
        for context in contexts.values():
            context.close()


def test_the_node_page_at_1000_px(browser, demo_stack):
    """The drain form fits on the screen; the charts keep fixed scales; throttling reads in words; a bad figure in
    the fault form is named at the form."""
    import re

    from tests.helpers import wait_for

    wait_for(
        lambda: (
            next(n for n in demo_stack.api("/api/cluster")[1]["nodes"] if n["name"] == "node-01")["state"] == "serving"
        ),
        40,
        0.2,
        "node-01 serving",
    )
    page = browser.new_page(viewport={"width": 1000, "height": 800})
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, demo_stack, "operator")
    page.goto(demo_stack.info["urls"]["console"] + "nodes/node-01/")
    assert page.evaluate("document.documentElement.scrollWidth") <= 1000
    box = page.locator("#request-drain button[type=submit]").bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 1000

    page.wait_for_function("document.getElementById('telemetry-chart')._fullLayout", timeout=10_000)
    low, high = page.evaluate("document.getElementById('telemetry-chart')._fullLayout.yaxis2.range")
    assert low <= 20 and high >= 100  # degrees: 45.0 → 45.1 °C is a hair, not the chart's full height
    low, high = page.evaluate("document.getElementById('canary-chart')._fullLayout.yaxis.range")
    assert low == 0 and high >= 50
    throttle = page.locator("[data-field=throttle]").first.inner_text()
    assert not re.fullmatch(r"\d+", throttle), throttle  # "idle", "none", "thermal (hardware)": never a raw bitmask

    page.select_option("#fault-form select[name=kind]", "slow")
    page.fill("#fault-form input[name=factor]", "twice")
    page.fill("#fault-form input[name=reason]", "rehearsal")
    with page.expect_response(lambda r: r.url.endswith("/nodes/node-01/fault")) as answer:
        page.click("#fault-form button[type=submit]")
    assert answer.value.status == 400
    assert "factor: not a number" in page.locator("#fault-errors").inner_text()
    assert errors == []
    page.close()


def test_the_summary_counts_what_the_tiles_show_under_load(browser, demo_stack):
    """Last in this module: its traffic would become the latency baseline of the incident test's kill."""
    page = browser.new_page()
    log_in(page, demo_stack, "manager")
    # The summary's Running and Waiting are what the tiles below it show, as their load changes.
    sums = """() => {
        const total = (f) => Array.from(document.querySelectorAll('.tile [data-field="' + f + '"]'))
            .map((el) => parseInt(el.textContent, 10)).filter((v) => !Number.isNaN(v)).reduce((a, b) => a + b, 0);
        const card = (f) => parseInt(document.querySelector('#summary [data-count="' + f + '"]').textContent, 10);
        return [total("running"), card("running"), total("waiting"), card("waiting")];
    }"""
    info = demo_stack.info
    stop = threading.Event()

    def send():  # load, so the tiles' figures move between node state changes
        while not stop.is_set():
            http_json(
                info["urls"]["gateway"] + "/chat/completions",
                data={"model": "Qwen3-32B", "messages": [{"role": "user", "content": "load"}], "max_tokens": 400},
                headers={"Authorization": f"Bearer {info['gateway_key']}"},
                timeout=30,
            )

    senders = [threading.Thread(target=send, daemon=True) for _ in range(4)]
    for sender in senders:
        sender.start()
    try:
        page.wait_for_function(f"() => ({sums})()[0] > 0", timeout=10_000)
        for _ in range(5):
            tiles_running, card_running, tiles_waiting, card_waiting = page.evaluate(sums)
            assert (card_running, card_waiting) == (tiles_running, tiles_waiting)
            page.wait_for_timeout(300)
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=30)


CONSOLE_PAGES = ("cluster/", "checkpoints/", "degradation/", "drains/", "incidents/", "audit/", "settings/", "keys/")


@pytest.mark.parametrize("width", [1400, 1000])
def test_every_page_fits_and_its_banner_says_what_the_api_says(browser, demo_stack, width):
    """The operator's and on-call's pages at a desktop and a small laptop width: nothing runs off the right edge, no
    script error, and the banner's level and capacity are /api/degradation's, on every page."""
    from tests.helpers import wait_for

    console = demo_stack.info["urls"]["console"]
    page = browser.new_page(viewport={"width": width, "height": 900})
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, demo_stack, "admin")
    for path in CONSOLE_PAGES + ("nodes/node-01/",):
        response = page.goto(console + path)
        assert response.status == 200, path
        if page.locator("#live-status").count():
            page.wait_for_selector("#live-status[data-state=live]", timeout=10_000)
        overflow = page.evaluate("document.documentElement.scrollWidth")
        assert overflow <= width, f"{path} is {overflow} px wide at {width} px"

        def banner_matches():
            api = demo_stack.api("/api/degradation")[1]
            banner = page.locator("#banner")
            if banner.locator("[data-level]").get_attribute("data-level") != str(api["level"]):
                return False
            capacity = api["capacity"]
            if not capacity.get("ratio"):
                return True
            text = banner.inner_text()
            return f"capacity {capacity['capacity_rps']:.1f} of {capacity['required_rps']:.1f}" in text

        wait_for(banner_matches, 10, 0.3, f"the banner on {path} to say what /api/degradation says")
    assert errors == []
    page.close()


def test_no_bad_input_anywhere_gets_a_server_error(browser, demo_stack):
    """Every form and filter a person can reach, given what a person mistypes: a 4xx that names what was wrong,
    never a 500."""
    console = demo_stack.info["urls"]["console"]
    page = browser.new_page()
    log_in(page, demo_stack, "admin")
    csrf = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
    headers = {"X-CSRFToken": csrf, "Referer": console}
    tried = [
        ("post", "settings/", {"canary_interval_s": "often", "reason": "x"}, 400, "canary"),
        ("post", "keys/", {"tenant": "acme", "tier": "gold", "label": "x"}, 400, "tier"),
        ("post", "nodes/node-01/drain", {"reason": "x", "mode": "sideways", "remediation": "restart"}, 400, "mode"),
        ("post", "nodes/node-01/fault", {"kind": "slow", "factor": "twice", "reason": "x"}, 400, "factor"),
        ("post", "nodes/node-01/fault", {"kind": "meteor", "reason": "x"}, 400, "kind"),
        ("post", "nodes/no-such-node/cordon", {"reason": "x"}, 404, "no-such-node"),
        ("post", "incidents/999999/note", {"text": "x"}, 404, "999999"),
        ("post", "drains/999999/approve", {"reason": "x"}, 404, "999999"),
        ("get", "audit/?since=yesterday", None, 400, "since"),
        ("get", "nodes/no-such-node/", None, 404, "no-such-node"),
    ]
    seen = []
    for method, path, form, expected, named in tried:
        if method == "post":
            answer = page.request.post(console + path, form=form, headers=headers, max_redirects=0)
        else:
            answer = page.request.get(console + path)
        seen.append((path, answer.status))
        assert answer.status == expected, (path, form, answer.status, answer.text()[:300])
        assert named in answer.text(), (path, "the answer does not name what was wrong")
    assert all(status < 500 for _, status in seen), seen
    page.close()
