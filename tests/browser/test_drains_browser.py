"""Drains no one can bypass (issue 11), in headless Chromium against the whole system as `manage.py demo` starts it.

Silent corruption on a node → UNHEALTHY → a drain the health machine raised, with an incident linked to it both
ways → the operator's cancel is refused on the drain page, in words → on-call's cancel works → every open page's
banner flags the node left out of service with no drain, live → after the hold-off the drain is proposed again,
naming the one cancelled.
"""

import pytest

from tests.helpers import http_json, log_in, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

SICK = "node-02"


def call(stack, method, path, body=None):
    base = stack.info["urls"]["console"].rstrip("/")
    return http_json(
        base + path, data=body, method=method, headers={"Authorization": f"Bearer {stack.info['api_token']}"}
    )


def waiting_drain(stack, exclude=()):
    drains = call(stack, "GET", "/api/drains")[1]["drains"]
    return next((d for d in drains if d["node"] == SICK and d["waiting"] and d["id"] not in exclude), None)


def test_a_drain_the_system_raised_is_on_calls_to_withdraw_and_comes_back_while_the_node_stays_out(browser, demo_stack):
    stack = demo_stack
    console = stack.info["urls"]["console"]
    fast = {
        "canary_interval_s": 5,
        "canary_retry_s": 0.5,
        "auto_cordon_max_share": 1,
        "drain_propose_again_s": 10,
        "reason": "browser test: fast canaries, a short hold-off",
    }
    assert call(stack, "PATCH", "/api/settings", fast)[0] == 200
    wait_for(
        lambda: all(
            (h := call(stack, "GET", f"/api/nodes/{n}/health")[1])["health"] == "healthy" and h["canaries"]
            for n in ("node-01", "node-02", "node-03")
        ),
        60,
        0.5,
        "every node healthy and canaried",
    )
    status, answer = call(
        stack, "POST", f"/api/nodes/{SICK}/faults", {"kind": "sdc", "rate": 0.0, "logprob_drift": -1.5, "reason": "e2e"}
    )
    assert status == 200, answer
    first = wait_for(lambda: waiting_drain(stack), 30, 0.2, "a drain proposed by the health machine")
    assert first["source"] == "health machine" and first["incident"]
    url = console + f"drains/{first['id']}/"

    contexts = {role: browser.new_context(viewport={"width": 1400, "height": 900}) for role in ("operator", "oncall")}
    try:
        pages = {role: context.new_page() for role, context in contexts.items()}
        for role, page in pages.items():
            log_in(page, stack, role)
        errors = []
        for page in pages.values():
            page.on("pageerror", lambda exc: errors.append(str(exc)))

        # The operator sees why they may not withdraw it; a cancel their browser sends anyway is refused on the
        # drain page, which still shows the drain waiting.
        operator = pages["operator"]
        operator.goto(url)
        assert operator.locator("#cancel-form").count() == 0
        assert "only the oncall and admin roles may withdraw it" in operator.locator("#cancel-not-yours").inner_text()
        operator.evaluate(
            """(action) => {
                const form = document.createElement("form");
                form.method = "post";
                form.action = action;
                const csrf = document.cookie.split("; ").find((c) => c.startsWith("csrftoken=")).split("=")[1];
                for (const [name, value] of [["csrfmiddlewaretoken", csrf], ["reason", "the fans were fine"]]) {
                    const input = document.createElement("input");
                    input.name = name;
                    input.value = value;
                    form.appendChild(input);
                }
                document.body.appendChild(form);
                form.submit();
            }""",
            url + "cancel",
        )
        operator.wait_for_selector(".message.error")
        assert "only the oncall and admin roles may withdraw it" in operator.locator(".message.error").inner_text()
        assert operator.locator("#drain-state").get_attribute("data-state") == "proposed"

        # The drain and its incident link to each other.
        operator.click("#drain-incident")
        operator.wait_for_url(f"**/incidents/{first['incident']}/")
        assert operator.locator(f"#incident-drains a[href='/drains/{first['id']}/']").count() == 1

        # The operator watches the cluster page while on-call withdraws the drain.
        operator.goto(console + "cluster/")
        operator.wait_for_selector("#live-status[data-state=live]")
        operator.evaluate("window.__noReload = 'cluster'")
        assert operator.locator(f"#banner [data-left-out='{SICK}']").count() == 0  # a drain is open for it

        oncall = pages["oncall"]
        oncall.goto(url)
        oncall.fill("#cancel-form input[name=reason]", "I will look at it myself")
        oncall.click("#cancel-form button")
        oncall.wait_for_selector(".message.success")
        assert oncall.locator("#drain-state").get_attribute("data-state") == "cancelled"

        # Left out of service with no drain: flagged on the banner, live, with a link to the node.
        flag = operator.locator(f"#banner [data-left-out='{SICK}']")
        flag.wait_for(timeout=10_000)
        assert flag.get_attribute("href") == f"/nodes/{SICK}/"
        assert f"{SICK} out of service (UNHEALTHY" in flag.text_content()
        assert f"drain #{first['id']} was cancelled" in flag.get_attribute("title")

        # After the hold-off the drain is proposed again, naming the one cancelled; the banner follows.
        again = wait_for(lambda: waiting_drain(stack, exclude=(first["id"],)), 30, 0.5, "the drain proposed again")
        assert again["reason"].startswith(f"Proposed again: {SICK} is still out of service")
        assert f"after drain #{first['id']} was cancelled by oncall: I will look at it myself" in again["reason"]
        assert again["proposed_again_of"] == first["id"] and again["incident"] == first["incident"]
        operator.wait_for_selector(f"#drains-waiting-pill[href='/drains/{again['id']}/']", timeout=10_000)
        assert flag.count() == 0
        assert operator.evaluate("window.__noReload") == "cluster", "the page reloaded"
        operator.goto(console + f"drains/{again['id']}/")
        assert operator.locator("#drain-proposed-again-of").get_attribute("href") == f"/drains/{first['id']}/"
        assert errors == []
    finally:
        for context in contexts.values():
            context.close()
