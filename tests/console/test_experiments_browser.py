"""Issue 13 item 8 in headless Chromium: an operator starts the Experiments page's example experiment, a real Celery
worker runs it against real Redis and the test database, the page's progress bar moves through values between 0 and
100, and the charts appear, one line per policy and the failure marked."""

import os
import signal
import subprocess
import sys
import time

import pytest
from django.db import connection

from harness import databases
from recovery.models import ExperimentRun
from tests.conftest import ROLE_PASSWORD
from tests.helpers import BASE_DIR

pytestmark = [pytest.mark.browser]


@pytest.fixture(scope="module", autouse=True)
def orm_beside_playwright():
    """Playwright's sync API keeps an event loop running in this thread, which Django takes for an async context;
    the test's own ORM calls and its database's teardown are plain synchronous code all the same."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        yield


@pytest.fixture
def celery_worker(live_server, tmp_path):
    """`celery worker`, as `manage.py serve worker` runs it, on the test's database and Redis namespace; stopped
    before the database is flushed."""
    # The test's own database on the run's PostgreSQL server (embedded or DATABASE_URL's), a socket folder's
    # ?host= kept.
    env = {**os.environ, "DATABASE_URL": databases.with_name(databases.server_url(), connection.settings_dict["NAME"])}
    argv = [sys.executable, "-m", "celery", "-A", "console", "worker", "-l", "INFO", "-c", "1", "-P", "solo"]
    argv += ["-n", f"experiments-{os.getpid()}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat"]
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(argv, cwd=BASE_DIR, env=env, stdout=out, stderr=subprocess.STDOUT)
    yield log
    worker.send_signal(signal.SIGTERM)
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def test_an_operator_starts_an_experiment_and_watches_it_run_to_its_charts(browser, live_server, cast, celery_worker):
    page = browser.new_page(viewport={"width": 1500, "height": 1000})
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(live_server.url + "/login/?next=/experiments/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", ROLE_PASSWORD.format("operator"))
    page.click("button[type=submit]")
    page.wait_for_url(live_server.url + "/experiments/")

    # The example, as the page offers it: 8 Qwen3-32B nodes and a spare, b-1 crashing at 20 s, every policy.
    assert page.locator("#experiment-policies input:checked").count() == 4
    page.click("#experiment-start")
    page.wait_for_url("**/experiments/*/")
    run = ExperimentRun.objects.get()
    assert page.url == f"{live_server.url}/experiments/{run.pk}/"
    assert run.name == "crash of b-1 at 20 s; 9 nodes, 60 s"  # left unnamed: named after what it asks

    # Every value the progress bar shows until the run ends, read as the page updates it.
    seen, status, deadline = [], None, time.monotonic() + 180
    while time.monotonic() < deadline:
        state = page.evaluate(
            """() => ({status: document.querySelector("#experiment-state").dataset.status,
                       progress: document.querySelector("#experiment-progress").value})"""
        )
        status = state["status"]
        if not seen or seen[-1] != state["progress"]:
            seen.append(state["progress"])
        if status not in ("queued", "running"):
            break
        page.wait_for_timeout(50)
    assert status == "done", (status, seen, celery_worker.read_text()[-3000:])
    assert seen[0] < 100 and seen[-1] == 100
    assert any(0 < value < 100 for value in seen), seen
    assert seen == sorted(seen)

    ttft = page.locator(f"#chart-ttft-{run.pk}")
    page.wait_for_selector(f"#chart-ttft-{run.pk}.js-plotly-plot", timeout=15_000)
    page.wait_for_selector(f"#chart-tpot-{run.pk}.js-plotly-plot", timeout=15_000)
    legend = [t.text_content() for t in ttft.locator(".legend .traces").all()]
    assert legend == ["none", "fixed", "load_aware", "lifeline"]  # one line per policy, in the order run
    assert ttft.locator(".shapelayer path").count() == 1  # the crash, a vertical line
    assert "crash b-1" in ttft.locator(".annotation").text_content()
    assert page.locator(".experiment-summary tbody tr").count() == 4
    assert "done: 4 runs in" in page.locator("#experiment-log").inner_text()
    assert errors == []
    page.close()
