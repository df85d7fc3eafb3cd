"""The Experiments page against source document 000, LUMEN (issue 13, item 8: "the table against the paper"): presets
that fill the start form with the paper's setups as recovery/sim/lumen.py runs them, a finished run's table with the
paper's figures beside ours when the run is one of those setups and ratios only when it is not, that table as CSV,
and no "queued" message left on a run's page once the run is done.

The task is called directly, as its worker would call it (tests/console/test_experiments.py does the same); the
paper's figures are read from recovery.sim.lumen, as the page reads them.
"""

import csv
import io
import json
import re
import statistics

import pytest

from recovery import tasks
from recovery.actions import experiments
from recovery.models import ExperimentRun
from recovery.sim import lumen
from tests.console.test_experiments import form

pytestmark = pytest.mark.django_db

SMALL_FLEET = json.dumps([{"name": "b", "count": 2, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2}])
# Not one of the paper's setups: 2 nodes, 20 s, 2 requests/s, b-1 crashing at 8 s.
SMALL = form(name="small", fleet_json=SMALL_FLEET)


def percent(value: float) -> str:
    return f"{value * 100:+.1f} %"


def as_posted(form) -> dict:
    """The start form's fields as the page renders them: what a browser posts when nothing is changed."""
    data = {}
    for name in form.fields:
        value = form[name].value()
        data[name] = value if isinstance(value, list) else ("" if value is None else str(value))
    return data


def preset(client, key: str):
    """The Experiments page with a preset picked, as the operator."""
    response = client.get(f"/experiments/?preset={key}")
    assert response.status_code == 200, response.content.decode()
    return response


def start(client, data: dict, django_capture_on_commit_callbacks) -> ExperimentRun:
    with django_capture_on_commit_callbacks() as callbacks:
        response = client.post("/experiments/", data)
    assert response.status_code == 302, response.content.decode()
    assert len(callbacks) == 1
    return ExperimentRun.objects.latest("pk")


def finished(run: ExperimentRun) -> ExperimentRun:
    assert tasks.run_experiment(run.pk) == "done"
    return ExperimentRun.objects.get(pk=run.pk)


def cell(html: str, row: str, kind: str, figure: str) -> str:
    """The text of one cell of the table against the paper: the row (a policy or a ratio), simulated or paper."""
    row_html = re.search(rf'<tr data-row="{row}"[^>]*>(.*?)</tr>', html, re.S)
    assert row_html, f"no row {row}"
    found = re.search(rf'data-kind="{kind}" data-figure="{figure}"[^>]*>([^<]*)<', row_html.group(1))
    assert found, f"no {kind} {figure} in row {row}"
    return found.group(1)


# --- presets ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setup", [lumen.WORKERS4, lumen.WORKERS8], ids=lambda s: s.name)
def test_a_preset_fills_the_form_with_the_papers_setup_as_lumen_runs_it(
    client, cast, django_capture_on_commit_callbacks, setup
):
    client.force_login(cast["operator"])
    listed = client.get("/experiments/").content.decode()
    label = f"document 000 (LUMEN), {setup.workers} workers, {setup.model}"
    assert f'href="?preset={setup.name}"' in listed and label in listed

    response = preset(client, setup.name)
    form = response.context["form"]
    data = as_posted(form)
    assert json.loads(data["fleet_json"]) == [
        {"name": "w", "count": setup.workers, "model": setup.model, "gpu": setup.gpu, "tp": setup.tp}
    ]
    rate = setup.rate_per_worker * setup.workers
    assert float(data["rate_rps"]) == rate
    assert (data["arrival"], data["lengths"]) == ("poisson", setup.lengths)
    assert (data["fault_kind"], data["fault_target"]) == ("crash", "w-1")
    assert (float(data["fault_at_s"]), float(data["fault_repair_s"])) == (setup.fault_at_s, setup.repair_s)
    assert data["policies"] == ["none", "fixed", "load_aware", "lifeline"] == list(lumen.POLICIES)
    assert data["name"] == label and data["seeds"] == "1"
    html = response.content.decode()
    for policy in lumen.POLICIES:
        assert re.search(rf'<input type="checkbox" name="policies" value="{policy}"[^>]*checked', html)
    assert f'data-preset="{setup.name}" aria-current="true">{label}</a>' in html  # the one picked

    # Within the page's limits: as lumen.py runs it where it fits, shortened (and said so) where it does not.
    duration = float(data["duration_s"])
    requests = rate * setup.duration_s * len(lumen.POLICIES)
    if requests <= experiments.MAX_REQUEST_RUNS:
        assert duration == setup.duration_s and 'id="experiment-preset-shortened"' not in html
    else:
        assert setup.fault_at_s < duration < setup.duration_s
        assert rate * duration * len(lumen.POLICIES) <= experiments.MAX_REQUEST_RUNS
        shortened = f"Shortened to {duration:g} s of simulated time: lumen.py runs {setup.duration_s:g} s"
        assert f'<li class="shortened" id="experiment-preset-shortened">{shortened}' in html

    run = start(client, data, django_capture_on_commit_callbacks)  # accepted as it is
    assert run.scenario["fleet"] == json.loads(data["fleet_json"])
    assert run.scenario["workload"] == [{"arrival": "poisson", "rate_rps": rate, "lengths": setup.lengths}]
    assert run.scenario["faults"]["scripted"] == [
        {"at_s": setup.fault_at_s, "kind": "crash", "target": "w-1", "repair_s": setup.repair_s}
    ]
    assert run.name == label


def test_an_unknown_preset_is_said_and_the_form_is_left_as_it_was(client, cast):
    client.force_login(cast["manager"])
    response = client.get("/experiments/?preset=workers99")
    assert response.status_code == 404
    assert "There is no preset &#x27;workers99&#x27;" in response.content.decode()
    assert response.context["form"]["name"].value() is None


# --- the table against the paper --------------------------------------------------------------------------------
def test_a_paper_setup_shows_the_papers_figures_and_ratios_beside_ours(
    client, cast, django_capture_on_commit_callbacks
):
    """The 4-worker preset with two of its policies over 40 s instead of 120 s (fast enough for a test): still the
    paper's setup, its fleet, load and failure unchanged."""
    client.force_login(cast["operator"])
    data = as_posted(preset(client, "workers4").context["form"])
    data |= {"duration_s": "40", "policies": ["none", "load_aware"]}
    run = finished(start(client, data, django_capture_on_commit_callbacks))
    page = client.get(f"/experiments/{run.pk}/")
    html = page.content.decode()
    assert "Against the paper (LUMEN, document 000)" in html
    assert 'data-setup="workers4"' in html
    assert "run here for 40 s of simulated time, shorter than lumen.py's 120 s, seed 1:" in html
    assert "measured here in simulation" in html and "as published" in html

    # Our figures, measured over the failure-impact window (fault to end of arrivals) as lumen.py measures them.
    impact = run.results["impact"]
    assert (impact["start_s"], impact["end_s"]) == (30.0, 40.0)
    ours = {r["policy"]: r for r in impact["runs"]}
    assert set(ours) == {"none", "load_aware"}
    paper = lumen.PAPER_PROTOTYPE["workers4"]
    assert cell(html, "none", "simulated", "ttft_mean_s") == f"{ours['none']['ttft_mean_s']:.2f}"
    assert cell(html, "none", "paper", "ttft_mean_s") == f"{paper['none'][0]:.2f}"
    assert cell(html, "load_aware", "paper", "tpot_mean_s") == f"{paper['load_aware'][1] * 1000:.1f}"
    assert cell(html, "baseline", "paper", "ttft_mean_s") == f"{paper['baseline'][0]:.2f}"

    # LUMEN against stop-and-restart: ours beside the paper's, as printed.
    printed = lumen.PAPER_RATIOS["workers4"]["load_aware_vs_none"]
    for i, figure in enumerate(("ttft_mean_s", "tpot_mean_s", "recovery_s")):
        assert cell(html, "load_aware_vs_none", "paper", figure) == percent(printed[i])
        a, b = ours["load_aware"][figure], ours["none"][figure]
        expected = "n/a" if a is None or b is None else percent(a / b - 1)
        assert cell(html, "load_aware_vs_none", "simulated", figure) == expected
    assert 'data-row="lifeline_vs_load_aware"' not in html  # Lifeline was not run

    # The same table as CSV, linked from the results.
    assert f'href="/experiments/{run.pk}/summary.csv?against=paper"' in html
    response = client.get(f"/experiments/{run.pk}/summary.csv?against=paper")
    assert response["Content-Disposition"] == f'attachment; filename="lifeline-experiment-{run.pk}-paper.csv"'
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert list(rows[0]) == ["table", "subject", "figure", "simulated", "simulated_ci95", "paper", "paper_kind"]
    by_key = {(r["table"], r["subject"], r["figure"]): r for r in rows}
    ttft = by_key[("ratios", "load_aware_vs_none", "ttft_mean_s")]
    assert (float(ttft["paper"]), ttft["paper_kind"]) == (printed[0], "as printed")
    lumen_ttft = ours["load_aware"]["ttft_mean_s"] / ours["none"]["ttft_mean_s"] - 1
    assert float(ttft["simulated"]) == pytest.approx(lumen_ttft)
    none = by_key[("figures", "none", "tpot_mean_s")]
    assert (float(none["paper"]), none["paper_kind"]) == (paper["none"][1], "published")
    assert float(none["simulated"]) == pytest.approx(ours["none"]["tpot_mean_s"])


def test_a_run_that_is_not_a_paper_setup_has_ratios_only_and_says_the_paper_has_no_figure(
    client, cast, django_capture_on_commit_callbacks
):
    client.force_login(cast["operator"])
    run = finished(start(client, SMALL | {"seeds": "1 2"}, django_capture_on_commit_callbacks))
    html = client.get(f"/experiments/{run.pk}/").content.decode()
    assert "Against the paper (LUMEN, document 000)" in html
    assert f'id="experiment-paper-none-{run.pk}"' in html
    assert "the paper has no figure for this setup" in html
    assert 'data-kind="paper" data-figure' not in html and 'data-setup=""' in html
    # Ratios only, ours: Lifeline against stop-and-restart, the ratio of the means over the two seeds.
    impact = run.results["impact"]["runs"]
    mean = {p: statistics.fmean(r["ttft_mean_s"] for r in impact if r["policy"] == p) for p in ("none", "lifeline")}
    assert cell(html, "lifeline_vs_none", "simulated", "ttft_mean_s") == percent(mean["lifeline"] / mean["none"] - 1)
    assert " ± " in cell(html, "none", "simulated", "ttft_mean_s")  # two seeds: a 95 % CI

    response = client.get(f"/experiments/{run.pk}/summary.csv?against=paper")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert rows and all(r["paper"] == "" and r["paper_kind"] == "" for r in rows)


def test_the_papers_setup_with_another_failure_time_is_not_the_papers_setup(
    client, cast, django_capture_on_commit_callbacks
):
    client.force_login(cast["operator"])
    data = as_posted(preset(client, "workers4").context["form"])
    data |= {"duration_s": "25", "fault_at_s": "20", "policies": ["none"]}
    run = finished(start(client, data, django_capture_on_commit_callbacks))
    html = client.get(f"/experiments/{run.pk}/").content.decode()
    assert "the paper has no figure for this setup" in html
    assert 'data-setup=""' in html and 'data-kind="paper" data-figure' not in html


# --- the queued message -----------------------------------------------------------------------------------------
def test_the_queued_message_is_gone_once_the_run_is_done(client, cast, django_capture_on_commit_callbacks):
    client.force_login(cast["operator"])
    # Done before its page is first opened (a free worker is quicker than the redirect).
    run = finished(start(client, SMALL, django_capture_on_commit_callbacks))
    html = client.get(f"/experiments/{run.pk}/").content.decode()
    assert 'data-status="done"' in html
    assert f"Experiment #{run.pk} queued" not in html and 'id="experiment-queued"' not in html

    # Opened while queued: the page says so, and no longer once it is done (the partial the page polls, and a reload).
    run = start(client, SMALL, django_capture_on_commit_callbacks)
    html = client.get(f"/experiments/{run.pk}/").content.decode()
    assert 'id="experiment-queued"' in html and f"Experiment #{run.pk} queued" in html
    finished(run)
    for url in (f"/experiments/{run.pk}/?partial=body", f"/experiments/{run.pk}/"):
        html = client.get(url).content.decode()
        assert 'data-status="done"' in html
        assert f"Experiment #{run.pk} queued" not in html and 'id="experiment-queued"' not in html
