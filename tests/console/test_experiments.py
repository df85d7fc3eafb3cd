"""The Experiments page (issue 13, item 8): a scenario refused on submit naming its field, a run executed by its task
with results and progress 100, cancelled through the page, failing midway, read by role, downloaded as CSV and
compared with another.

The task is called directly here, as its worker would call it (tests/console/test_experiments_browser.py runs a real
worker); what the page enqueues is captured at the commit.
"""

import csv
import io
import json

import pytest

from recovery import tasks
from recovery.actions import experiments
from recovery.choices import ExperimentStatus, NodeState
from recovery.models import Cluster, ExperimentRun, Node, Rack
from recovery.sim import fleet as sim_fleet
from recovery.sim.errors import ScenarioError

pytestmark = pytest.mark.django_db

SMALL_FLEET = json.dumps(
    [
        {"name": "a", "count": 2, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2, "rack": "rack-a"},
        {"name": "b", "count": 2, "model": "Qwen3-32B", "gpu": "H200-SXM", "tp": 2, "rack": "rack-b"},
    ]
)


def form(**changes) -> dict:
    """A small experiment (4 nodes, 20 s, 2 requests/s, b-1 crashing at 8 s; two policies, one seed): about a
    second of simulation per policy here."""
    data = {
        "name": "b-1 crashes",
        "fleet_source": "described",
        "fleet_json": SMALL_FLEET,
        "duration_s": "20",
        "arrival": "poisson",
        "rate_rps": "2",
        "cv": "",
        "lengths": "splitwise-conversation",
        "fault_kind": "crash",
        "fault_target": "b-1",
        "fault_at_s": "8",
        "fault_repair_s": "",
        "policies": ["none", "lifeline"],
        "seeds": "1",
    }
    return data | changes


def submit(client, django_capture_on_commit_callbacks, **changes):
    """POST the form; the response, and the callbacks waiting for the commit (the task's enqueueing)."""
    with django_capture_on_commit_callbacks() as callbacks:
        response = client.post("/experiments/", form(**changes))
    return response, callbacks


@pytest.fixture
def start(client, cast, django_capture_on_commit_callbacks):
    """Start an experiment as the operator; its row, queued, and the task not yet run."""

    def run(**changes) -> ExperimentRun:
        client.force_login(cast["operator"])
        response, callbacks = submit(client, django_capture_on_commit_callbacks, **changes)
        assert response.status_code == 302, response.content.decode()
        assert len(callbacks) == 1  # run_experiment, enqueued once the row is committed
        run = ExperimentRun.objects.latest("pk")
        assert response["Location"] == f"/experiments/{run.pk}/"
        return run

    return run


def finished(run: ExperimentRun) -> ExperimentRun:
    assert tasks.run_experiment(run.pk) == "done"
    return ExperimentRun.objects.get(pk=run.pk)


# --- who may do what ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("role", "may_run"), [("operator", True), ("manager", True), ("admin", True), ("oncall", False)]
)
def test_operators_and_managers_start_experiments_on_call_reads_them(
    client, cast, django_capture_on_commit_callbacks, role, may_run
):
    client.force_login(cast[role])
    page = client.get("/experiments/")
    assert page.status_code == 200
    html = page.content.decode()
    assert '<a href="/experiments/" class="active">Experiments</a>' in html  # in the nav
    assert ('id="experiment-form"' in html) == may_run
    assert ('id="experiment-read-only"' in html) == (not may_run)
    response, callbacks = submit(client, django_capture_on_commit_callbacks)
    if may_run:
        assert response.status_code == 302 and len(callbacks) == 1
        assert ExperimentRun.objects.get().started_by == cast[role]
    else:
        assert response.status_code == 403
        assert (
            "Starting an experiment needs the operator or manager role; yours is oncall." in response.content.decode()
        )
        assert not ExperimentRun.objects.exists() and not callbacks


def test_on_call_may_not_cancel_and_a_user_without_a_role_sees_nothing(client, cast, start, django_user_model):
    run = start()
    client.force_login(cast["oncall"])
    assert client.get(f"/experiments/{run.pk}/").status_code == 200
    assert client.post(f"/experiments/{run.pk}/cancel").status_code == 403
    assert ExperimentRun.objects.get(pk=run.pk).status == ExperimentStatus.QUEUED
    client.force_login(django_user_model.objects.create_user("nobody", password="x"))
    for url in ("/experiments/", f"/experiments/{run.pk}/", f"/experiments/{run.pk}/summary.csv"):
        assert client.get(url).status_code == 403
    client.logout()
    assert client.get("/experiments/")["Location"].startswith("/login/")


# --- bad input ----------------------------------------------------------------------------------------------------
UNKNOWN_MODEL = json.dumps([{"name": "a", "count": 2, "model": "Llama-9-900B", "gpu": "H100-SXM", "tp": 2}])
DOES_NOT_FIT = json.dumps([{"name": "b", "count": 2, "model": "Llama-3-70B", "gpu": "H100-SXM", "tp": 1}])
UNKNOWN_GPU = json.dumps([{"name": "b", "count": 2, "model": "Qwen3-32B", "gpu": "TPU-v9", "tp": 2}])
TOO_MANY = json.dumps([{"name": "b", "count": 65, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2}])


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"fleet_json": UNKNOWN_MODEL}, "fleet_json", "fleet[0].model: 'Llama-9-900B' is not in the catalog; allowed:"),
        ({"fleet_json": UNKNOWN_GPU}, "fleet_json", "fleet[0].gpu: 'TPU-v9' is not in the catalog; allowed: H100-SXM"),
        (
            {"fleet_json": DOES_NOT_FIT},
            "fleet_json",
            "fleet[0].tp: Llama-3-70B (141.2 GB of weights, and room for its KV cache) does not fit on 1× H100-SXM",
        ),
        (
            {"fault_target": "c-7"},
            "fault_target",
            "faults.scripted[0].target: the fleet has no node 'c-7'; allowed: a-1",
        ),
        ({"fault_kind": "rack", "fault_target": "b-1"}, "fault_target", "the fleet has no rack 'b-1'; allowed: rack-a"),
        ({"fleet_json": '[{"name": "a", "count": 2,'}, "fleet_json", "fleet: is not JSON: Expecting property name"),
        ({"fleet_json": '{"name": "a"}'}, "fleet_json", "fleet: is a JSON dict; allowed: a JSON list of node groups"),
        ({"fleet_json": TOO_MANY}, "fleet_json", "fleet: has 65 nodes; allowed: at most 64, spares included"),
        ({"duration_s": "601"}, "duration_s", "duration_s: 601 s; allowed: at most 600 s"),
        ({"fault_at_s": "25"}, "fault_at_s", "faults.scripted[0].at_s: 25 s is after the run's end"),
        ({"rate_rps": "600"}, "rate_rps", "workload[0].rate_rps: 600 requests/s for 20 s in each of 2 runs"),
        ({"rate_rps": "fast"}, "rate_rps", "rate_rps: not a number (requests per second)"),
        ({"seeds": "1, two"}, "seeds", "seeds: '1, two' is not a list of whole numbers"),
        ({"policies": []}, "policies", "policies: pick at least one"),
        ({"arrival": "gamma", "cv": "50"}, "cv", "workload[0].cv: 50.0; allowed: a number above 0, at most 20"),
    ],
)
def test_a_scenario_that_cannot_run_is_refused_naming_the_field_and_nothing_is_queued(
    client, cast, django_capture_on_commit_callbacks, changes, field, message
):
    client.force_login(cast["manager"])
    response, callbacks = submit(client, django_capture_on_commit_callbacks, **changes)
    assert response.status_code == 400
    html = response.content.decode()
    assert message.replace("'", "&#x27;") in html
    assert response.context["form"].has_error(field)
    assert not ExperimentRun.objects.exists() and not callbacks
    assert response.context["form"]["name"].value() == "b-1 crashes"  # what was typed is kept


def test_a_trace_file_is_refused_a_page_cannot_name_a_file_on_the_workers_disk():
    scenario = experiments.compose(
        name="",
        fleet=json.loads(SMALL_FLEET),
        duration_s=20,
        workload={"trace": "/etc/passwd"},
        fault=None,
        policies=["none"],
        seeds=[1],
    )
    with pytest.raises(ScenarioError, match=r"^workload\[0\]\.trace: a trace file cannot be replayed"):
        experiments.check(scenario)


# --- a run ---------------------------------------------------------------------------------------------------------
def test_the_task_runs_every_policy_and_the_page_shows_the_results(client, start):
    run = start()
    queued = client.get(f"/experiments/{run.pk}/").content.decode()
    assert 'data-status="queued"' in queued and 'id="experiment-cancel"' in queued
    assert "queued by operator: 4 nodes, 20 s, 2 runs (none, lifeline; seeds 1)" in queued
    assert 'value="0"' in queued and "experiment-results" not in queued

    run = finished(run)
    assert run.status == ExperimentStatus.DONE and run.progress == 100
    assert run.started_at <= run.ended_at
    assert [(r["policy"], r["seed"]) for r in run.results["runs"]] == [("none", 1), ("lifeline", 1)]
    lines = run.log.splitlines()
    assert [line.split(" ", 1)[1] for line in lines[1:4]] == [
        "started",
        "running none, seed 1",
        "running lifeline, seed 1",
    ]
    assert lines[-1].split(" ", 1)[1].startswith("done: 2 runs in ")
    for r in run.results["runs"]:
        assert r["requests"] > 20 and r["finished"] == r["requests"]  # every request served, b-1's moved elsewhere
        assert [(f["kind"], f["target"], f["at_s"]) for f in r["faults"]] == [("crash", "b-1", 8.0)]
    chart = run.results["chart"]
    assert [line["policy"] for line in chart["policies"]] == ["none", "lifeline"]  # in the order run
    assert chart["faults"][0]["at_s"] == 8.0
    assert all(len(line["ttft_s"]) == len(chart["starts"]) for line in chart["policies"])

    page = client.get(f"/experiments/{run.pk}/")
    html = page.content.decode()
    assert 'data-status="done"' in html and 'value="100"' in html and 'id="experiment-cancel"' not in html
    assert f'id="experiment-chart-data-{run.pk}"' in html
    assert f'id="chart-ttft-{run.pk}"' in html and f'id="chart-tpot-{run.pk}"' in html
    assert "crash of b-1 at 8.0 s" in html
    rows = page.context["run"]["summary"]
    assert [(r["policy"], r["seed"]) for r in rows] == [("none", 1), ("lifeline", 1)]
    for row, r in zip(rows, run.results["runs"]):
        assert row["cells"]["ttft_mean_ms"] == f"{round(r['ttft_mean_s'] * 1000, 1):g}"
        assert f'data-policy="{row["policy"]}"' in html
    assert f'href="/experiments/{run.pk}/summary.csv"' in html and f'href="/experiments/{run.pk}/windows.csv"' in html
    listed = client.get("/experiments/").content.decode()
    assert f'<tr data-run="{run.pk}">' in listed and f'value="{run.pk}" aria-label="compare #{run.pk}"' in listed


def test_a_second_delivery_of_the_task_runs_nothing(start):
    run = finished(start())
    assert tasks.run_experiment(run.pk) == "not queued: cancelled before it started, or taken already"
    assert ExperimentRun.objects.get(pk=run.pk).results == run.results


def test_the_live_fleet_is_the_registrys_nodes_and_a_live_node_can_be_named(
    client, cast, django_capture_on_commit_callbacks
):
    """Two H100 nodes in rack-a, an H200 node and an H200 hot spare in rack-b; one that has left is not counted."""
    cluster = Cluster.default()
    registered = [("rack-a", "H100-SXM")] * 2 + [("rack-b", "H200-SXM")] * 3
    for i, (rack, gpu) in enumerate(registered):
        Node.objects.create(
            cluster=cluster,
            rack=Rack.objects.get_or_create(cluster=cluster, name=rack)[0],
            name=f"node-{i + 1:02d}",
            state=NodeState.LEFT if i == 4 else NodeState.SERVING,
            session="s",
            address="http://127.0.0.1:9",
            model_key="Qwen3-32B",
            gpu_key=gpu,
            tp=2,
            spare=i == 3,
        )
    client.force_login(cast["operator"])
    response, _ = submit(
        client, django_capture_on_commit_callbacks, fleet_source="live", fleet_json="", fault_target="node-03"
    )
    assert response.status_code == 302, response.content.decode()
    run = ExperimentRun.objects.get()
    assert run.fleet_source == "live"
    assert run.scenario["fleet"] == [
        {"name": "rack-a", "count": 2, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2, "rack": "rack-a", "spares": 0},
        {"name": "rack-b", "count": 1, "model": "Qwen3-32B", "gpu": "H200-SXM", "tp": 2, "rack": "rack-b", "spares": 1},
    ]
    assert run.scenario["faults"]["scripted"] == [{"at_s": 8.0, "kind": "crash", "target": "rack-b-1"}]
    assert "node-03 → rack-b-1, node-04 → rack-b-spare-1" in run.log


def test_live_nodes_sharing_an_nvlink_domain_keep_it_in_the_simulation(
    client, cast, django_capture_on_commit_callbacks
):
    """Two trays of one NVL72 and a node on its own: the simulated fleet links them as the real one is linked."""
    cluster = Cluster.default()
    rack = Rack.objects.get_or_create(cluster=cluster, name="rack-a")[0]
    for i, domain in enumerate(["nvl72-a", "nvl72-a", ""]):
        Node.objects.create(
            cluster=cluster,
            rack=rack,
            name=f"node-{i + 1:02d}",
            state=NodeState.SERVING,
            session="s",
            address="http://127.0.0.1:9",
            model_key="Qwen3-32B",
            gpu_key="H200-SXM",
            tp=2,
            nvl_domain=domain,
        )
    client.force_login(cast["operator"])
    response, _ = submit(
        client, django_capture_on_commit_callbacks, fleet_source="live", fleet_json="", fault_target="node-01"
    )
    assert response.status_code == 302, response.content.decode()
    fleet = ExperimentRun.objects.get().scenario["fleet"]
    assert [(g["count"], g.get("nvl_domain")) for g in fleet] == [(2, "nvl72-a"), (1, None)]


def test_with_no_node_registered_the_live_fleet_is_refused(client, cast, django_capture_on_commit_callbacks):
    client.force_login(cast["operator"])
    response, _ = submit(client, django_capture_on_commit_callbacks, fleet_source="live")
    assert response.status_code == 400
    assert "fleet: the registry has no nodes yet; allowed: a described fleet" in response.content.decode()


# --- cancel ----------------------------------------------------------------------------------------------------------
def test_a_queued_run_cancelled_never_runs(client, start):
    run = start()
    response = client.post(f"/experiments/{run.pk}/cancel", follow=True)
    assert f"Experiment #{run.pk} cancelled." in response.content.decode()
    assert tasks.run_experiment(run.pk).startswith("not queued")
    run = ExperimentRun.objects.get(pk=run.pk)
    assert run.status == ExperimentStatus.CANCELLED and run.ended_at and run.results == {}
    assert run.log.splitlines()[-1].endswith("cancelled by operator")


def test_a_running_run_stops_at_its_next_progress_check_once_cancelled(client, start, monkeypatch):
    """The cancel comes through the page while the simulation is under way, as a second request would."""
    run = start(policies=["none", "fixed", "lifeline"])
    advanced = []
    real_run = sim_fleet.Simulation.run

    def run_and_cancel_once(self, until=float("inf")):
        advanced.append(until)
        if len(advanced) == 30:  # the first policy's baseline done, its faulted run a third of the way
            assert client.post(f"/experiments/{run.pk}/cancel").status_code == 302
        return real_run(self, until)

    monkeypatch.setattr(sim_fleet.Simulation, "run", run_and_cancel_once)
    assert tasks.run_experiment(run.pk) == "cancelled"
    assert len(advanced) == 30  # not one slice more
    run = ExperimentRun.objects.get(pk=run.pk)
    assert run.status == ExperimentStatus.CANCELLED and run.results == {}
    assert 0 < run.progress < 34  # within the first of three policies
    assert run.log.splitlines()[-1].endswith("cancelled by operator")
    assert "running none, seed 1" in run.log and "running fixed" not in run.log


def test_a_finished_run_cannot_be_cancelled(client, start):
    run = finished(start())
    response = client.post(f"/experiments/{run.pk}/cancel", follow=True)
    assert f"Experiment #{run.pk} had ended already (done)." in response.content.decode()
    assert ExperimentRun.objects.get(pk=run.pk).status == ExperimentStatus.DONE


# --- a run that fails midway --------------------------------------------------------------------------------------
def test_a_run_that_raises_midway_is_marked_failed_with_the_error_and_nothing_else_is_touched(start, monkeypatch):
    done_before = finished(start(name="done before"))
    broken, after = start(name="breaks"), start(name="queued after")
    real_run = sim_fleet.Simulation.run
    calls = []

    def breaks_midway(self, until=float("inf")):
        calls.append(until)
        if len(calls) == 25:
            raise RuntimeError("the simulator broke")
        return real_run(self, until)

    with monkeypatch.context() as patch:
        patch.setattr(sim_fleet.Simulation, "run", breaks_midway)
        assert tasks.run_experiment(broken.pk) == "failed"
    broken = ExperimentRun.objects.get(pk=broken.pk)
    assert broken.status == ExperimentStatus.FAILED and broken.ended_at and broken.results == {}
    assert 0 < broken.progress < 100
    assert broken.log.splitlines()[-1].endswith(" failed: RuntimeError: the simulator broke")
    assert ExperimentRun.objects.get(pk=done_before.pk).results == done_before.results
    assert ExperimentRun.objects.get(pk=after.pk).status == ExperimentStatus.QUEUED
    assert finished(after).status == ExperimentStatus.DONE


# --- CSV ----------------------------------------------------------------------------------------------------------
def rows_of(response) -> list[dict]:
    assert response.status_code == 200 and response["Content-Type"] == "text/csv; charset=utf-8"
    return list(csv.DictReader(io.StringIO(response.content.decode())))


def test_the_csvs_hold_each_runs_summary_and_its_windows(client, start):
    run = finished(start(seeds="1 2"))
    summary = client.get(f"/experiments/{run.pk}/summary.csv")
    assert summary["Content-Disposition"] == f'attachment; filename="lifeline-experiment-{run.pk}-summary.csv"'
    rows = rows_of(summary)
    assert list(rows[0]) == [
        "policy", "seed", "requests", "finished", "interrupted", "restored", "fetched", "reprefilled",
        "ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p99_ms", "stall_mean_ms", "stall_max_ms",
        "recovery_s", "shed", "possibly_corrupt", "wall_s",
    ]  # fmt: skip
    by_run = {(r["policy"], int(r["seed"])): r for r in run.results["runs"]}
    assert [(r["policy"], int(r["seed"])) for r in rows] == list(by_run)
    assert len(rows) == 4
    for row in rows:
        r = by_run[(row["policy"], int(row["seed"]))]
        assert int(row["requests"]) == r["requests"] and int(row["interrupted"]) == r["interrupted"]
        assert float(row["ttft_mean_ms"]) == round(r["ttft_mean_s"] * 1000, 1)
        assert float(row["tpot_p99_ms"]) == round(r["tpot_p99_s"] * 1000, 1)
        assert row["stall_max_ms"] == ("" if r["stall_max_s"] is None else str(round(r["stall_max_s"] * 1000, 1)))

    windows = rows_of(client.get(f"/experiments/{run.pk}/windows.csv"))
    assert list(windows[0]) == [
        "policy", "seed", "window_start_s", "window_s", "ttft_mean_ms", "ttft_samples", "tpot_mean_ms", "tpot_samples",
    ]  # fmt: skip
    assert {(w["policy"], int(w["seed"])) for w in windows} == set(by_run)
    for key, r in by_run.items():
        mine = [w for w in windows if (w["policy"], int(w["seed"])) == key]
        assert [float(w["window_start_s"]) for w in mine] == [i * 1.0 for i in range(len(mine))]  # 20 s / 40: 1 s
        samples = sum(int(w["ttft_samples"]) for w in mine)
        assert samples == r["finished"] == r["requests"]  # one TTFT per request, in the window of its first token
        # The windows' means, weighted by their samples, are the run's mean TTFT (each mean rounded to 0.1 ms).
        weighted = sum(float(w["ttft_mean_ms"]) * int(w["ttft_samples"]) for w in mine if w["ttft_samples"] != "0")
        assert weighted / samples == pytest.approx(r["ttft_mean_s"] * 1000, abs=0.06)
        assert all(w["ttft_mean_ms"] == "" for w in mine if w["ttft_samples"] == "0")  # n/a, never a zero


def test_a_run_without_results_has_no_csv(client, start):
    run = start()
    response = client.get(f"/experiments/{run.pk}/summary.csv")
    assert response.status_code == 409
    assert response.content.decode() == f"Experiment #{run.pk} is queued: it has results only once done.\n"


# --- compare ------------------------------------------------------------------------------------------------------
def test_two_runs_side_by_side(client, start):
    first = finished(start(name="none against lifeline"))
    second = finished(start(name="a rack lost", fault_kind="rack", fault_target="rack-b", policies=["fixed"]))
    response = client.get(f"/experiments/compare/?run={first.pk}&run={second.pk}")
    assert response.status_code == 200
    html = response.content.decode()
    sides = response.context["runs"]
    assert [side["id"] for side in sides] == [first.pk, second.pk]
    assert [[r["policy"] for r in side["summary"]] for side in sides] == [["none", "lifeline"], ["fixed"]]
    for run in (first, second):
        assert f'<div class="compare-side" data-run="{run.pk}">' in html
        assert f'id="experiment-chart-data-{run.pk}"' in html and f'id="chart-ttft-{run.pk}"' in html
    assert "crash of b-1 at 8.0 s" in html and "rack of rack-b at 8.0 s" in html


@pytest.mark.parametrize("query", ["", "?run={pk}", "?run={pk}&run={pk}", "?run={pk}&run=999", "?run={pk}&run=x"])
def test_compare_needs_two_different_runs(client, start, query):
    response = client.get("/experiments/compare/" + query.format(pk=finished(start()).pk), follow=True)
    assert response.redirect_chain[-1][0] == "/experiments/"
    assert "Compare needs two different runs: tick two in the list." in response.content.decode()
