"""Issue 11, "time and recovery that mean what they say", in headless Chromium: a node killed under load, and what
a person then reads on the incidents list and the incident's page, in a browser whose own time zone is not UTC."""

import datetime as dt
import json
import os
import re
import signal
import threading
import urllib.request

import pytest

from tests.helpers import http_json, log_in, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

LIST_TIME = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d UTC$")
TIMELINE_TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} UTC")


def test_an_incident_reads_true_in_utc_with_two_recovery_figures_counts_and_list_filters(browser, demo_stack):
    info = demo_stack.info
    console = info["urls"]["console"]
    stop = threading.Event()

    def send():  # streams in flight on every node, so the killed one has requests to move
        while not stop.is_set():
            http_json(
                info["urls"]["gateway"] + "/chat/completions",
                data={"model": "Qwen3-32B", "messages": [{"role": "user", "content": "load"}], "max_tokens": 400},
                headers={"Authorization": f"Bearer {info['gateway_key']}"},
                timeout=30,
            )

    # A viewer in New York: every time the console shows must still be UTC, charts included.
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, timezone_id="America/New_York")
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, demo_stack, "oncall")
    senders = [threading.Thread(target=send, daemon=True) for _ in range(6)]
    for sender in senders:
        sender.start()
    try:
        # A stream of our own, mid-flight: the node the gateway says serves it is the victim, so at least one request
        # is moved off it (a node picked by its heartbeat's running count could have finished them by the kill).
        body = {"model": "Qwen3-32B", "messages": [{"role": "user", "content": "moved"}], "max_tokens": 300}
        request = urllib.request.Request(
            info["urls"]["gateway"] + "/chat/completions",
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Authorization": f"Bearer {info['gateway_key']}", "Content-Type": "application/json"},
        )
        ours = urllib.request.urlopen(request, timeout=60)
        victim = ours.headers["X-Lifeline-Node"]
        for _ in range(3):  # tokens are flowing from it
            ours.readline()
        earlier = {i["id"] for i in demo_stack.api("/api/incidents")[1]["incidents"]}  # of the stack's other users
        os.kill(demo_stack.node(victim)["pid"], signal.SIGKILL)
        rest = ours.read().decode()  # the stream goes on elsewhere to its end
        assert "[DONE]" in rest and '"error"' not in rest
        incident = wait_for(
            lambda: next(
                (
                    i
                    for i in demo_stack.api("/api/incidents")[1]["incidents"]
                    if victim in i["nodes"] and i["id"] not in earlier
                ),
                None,
            ),
            10,
            0.1,
            "the incident",
        )
        page.wait_for_timeout(1500)  # the moved requests finish on the survivors
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=30)

    # The list: a date in UTC, a severity, and filters that answer.
    page.goto(console + "incidents/")
    row = page.locator(f'#incident-rows tr[data-incident="{incident["id"]}"]')
    assert LIST_TIME.match(row.locator("[data-field=opened]").inner_text())
    severity = row.get_attribute("data-severity")
    assert severity in ("sev1", "sev2", "sev3") and severity.upper() in row.inner_text()
    page.select_option("#incident-filters select[name=severity]", severity)
    page.click("#incident-filters button[type=submit]")
    page.wait_for_selector(f'#incident-rows tr[data-incident="{incident["id"]}"]')
    assert f"severity={severity}" in page.url
    assert int(page.locator('#incident-totals [data-total="incidents"]').inner_text()) >= 1
    page.select_option("#incident-filters select[name=status]", "closed")
    page.click("#incident-filters button[type=submit]")
    page.wait_for_selector("#incident-rows td.empty")
    assert "No incident matches these filters" in page.locator("#incident-rows").inner_text()
    answer = page.goto(console + "incidents/?status=burning")
    assert answer.status == 400
    said = page.locator("#incident-filter-errors").inner_text()
    assert "status: burning is not one of active, stable, closed" in said

    # The incident: two recovery figures, as they come; counts; times in UTC; the chart's axis in UTC.
    page.goto(console + f"incidents/{incident['id']}/")
    page.wait_for_selector("#live-status[data-state=live]")
    assert TIMELINE_TIME.fullmatch(page.locator("#incident-opened").inner_text())
    assert "Latency recovered" in page.locator("#facts").inner_text()
    page.wait_for_selector("#capacity-restored:has-text('after')", timeout=40_000)  # restarted, in routing
    page.wait_for_selector("#latency-recovered:has-text('after')", timeout=30_000)
    page.wait_for_selector("#incident-status[data-status=stable]", timeout=10_000)
    # A request moved off the victim is counted when its gateway reports it, after it finishes on a survivor.
    detail = wait_for(
        lambda: (d := demo_stack.api(f"/api/incidents/{incident['id']}")[1])["figures"]["moved"] >= 1 and d,
        30,
        0.2,
        f"a request moved off {victim} counted in the incident",
    )
    page.reload()
    page.wait_for_selector("#live-status[data-state=live]")
    capacity = page.locator("#capacity-restored").inner_text()
    assert f"after {detail['capacity_time_s']:.1f} s" in capacity and TIMELINE_TIME.search(capacity)
    assert f"after {detail['recovery_time_s']:.1f} s" in page.locator("#latency-recovered").inner_text()
    assert detail["capacity_time_s"] >= 3  # the node's restart: not the latency figure, which can come first
    figures = detail["figures"]
    assert figures["moved"] >= 1, f"no request was moved off {victim}"
    shown = {k: int(page.locator(f'#incident-requests [data-count="{k}"]').inner_text()) for k in ("moved", "failed")}
    assert shown == {"moved": figures["moved"], "failed": figures["failed"]}
    assert re.fullmatch(r"p50 \d+ ms · p99 \d+ ms", page.locator("#incident-stall").inner_text())
    assert all(TIMELINE_TIME.fullmatch(t) for t in page.locator("#events tr td:first-child").all_inner_texts())
    assert "Capacity restored" in page.locator("#events").inner_text()
    page.wait_for_selector("#latency-chart .xtitle")
    assert page.locator("#latency-chart .xtitle").text_content() == "time (UTC)"  # SVG: text, not inner text
    opened = dt.datetime.fromtimestamp(detail["opened_at"], tz=dt.UTC)
    ticks = [t for t in page.locator("#latency-chart .xtick text").all_text_contents() if re.match(r"\d\d:\d\d", t)]
    hours = {int(t[:2]) for t in ticks}
    assert ticks and hours <= {opened.hour, (opened.hour + 1) % 24, (opened.hour - 1) % 24}, (ticks, opened)
    assert errors == []
    context.close()
