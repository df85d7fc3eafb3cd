"""Experiments: start a simulator run from the page, watch it, read and download its results, compare two runs.

Operators and managers start and cancel runs; on-call reads them (console.auth). A scenario that cannot run is
refused on submit with the simulator's own message naming the field, before any row is written. `?preset=<setup>`
fills the form with one of source document 000's setups (console.readmodels.experiments.presets); a finished run's
page sets it against the paper, and `summary.csv?against=paper` downloads that table.
"""

from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from console.auth import READ_EXPERIMENTS, RUN_EXPERIMENTS, page_view
from console.forms import ExperimentForm
from console.readmodels import experiments as experiment_model
from recovery import roles, tasks
from recovery.actions import experiments
from recovery.choices import ExperimentStatus
from recovery.models import ExperimentRun
from recovery.sim.errors import ScenarioError

# A scenario field (as ScenarioError names it) → the form field it came from, the longest prefix first.
FORM_FIELD = (
    ("faults.scripted[0].repair_s", "fault_repair_s"),
    ("faults.scripted[0].target", "fault_target"),
    ("faults.scripted[0].at_s", "fault_at_s"),
    ("faults.scripted[0].kind", "fault_kind"),
    ("workload[0].rate_rps", "rate_rps"),
    ("workload[0].arrival", "arrival"),
    ("workload[0].lengths", "lengths"),
    ("workload[0].cv", "cv"),
    ("workload", "rate_rps"),
    ("duration_s", "duration_s"),
    ("policies", "policies"),
    ("seeds", "seeds"),
    ("fleet", "fleet_json"),
)


def _run(run_id: int) -> ExperimentRun:
    return get_object_or_404(ExperimentRun.objects.select_related("started_by"), pk=run_id)


def _form_field(scenario_field: str) -> str | None:
    return next((form_field for prefix, form_field in FORM_FIELD if scenario_field.startswith(prefix)), None)


def _submit(request, form: ExperimentForm) -> ExperimentRun:
    """The run the form describes, queued; ScenarioError when it cannot run."""
    data = form.cleaned_data
    source = data["fleet_source"]
    names: dict[str, str] = {}
    if source == experiments.LIVE:
        fleet, names = experiments.live_fleet()
    else:
        fleet = experiments.parse_fleet(data["fleet_json"])
    scenario = experiments.compose(
        name=data["name"],
        fleet=fleet,
        duration_s=data["duration_s"],
        workload=form.workload(),
        fault=form.fault(names),
        degradation=form.degradation(),
        policies=data["policies"],
        seeds=data["seeds"],
    )
    return experiments.submit(request.user, source, scenario, names)


@never_cache
@page_view(*READ_EXPERIMENTS)
def experiment_list(request):
    may_run = roles.has_role(request.user, *RUN_EXPERIMENTS)
    presets = experiment_model.presets()
    preset = next((p for p in presets if p["key"] == request.GET.get("preset")), None)
    form, error, status = ExperimentForm(initial=preset["initial"] if preset else None), None, 200
    if request.GET.get("preset") and preset is None:
        error, status = f"There is no preset {request.GET['preset']!r}: pick one of those below.", 404
    if request.method == "POST":
        if not may_run:
            role = roles.role_of(request.user)
            reason = f"Starting an experiment needs the {' or '.join(RUN_EXPERIMENTS)} role; yours is {role}."
            return render(request, "console/forbidden.html", {"reason": reason}, status=403)
        form = ExperimentForm(request.POST)
        if form.is_valid():
            try:
                run = _submit(request, form)
            except ScenarioError as exc:
                error, status = str(exc), 400
                field = _form_field(exc.field)
                if field:
                    form.add_error(field, error)
            else:
                # No flash message: the run's page says it is queued while it is (_experiment_body.html), and a flash
                # would stay on the page after the run is done.
                tasks.run_experiment.delay_on_commit(run.pk)
                return redirect("experiment", run_id=run.pk)
        else:
            problems = "; ".join(e for errors in form.errors.values() for e in errors)
            error, status = f"The experiment was not started: {problems}", 400
    context = {
        "form": form,
        "error": error,
        "may_run": may_run,
        "presets": presets,
        "preset": preset,
        "runs": experiment_model.run_list(),
        "limits": {
            "nodes": experiments.MAX_NODES,
            "duration_s": experiments.MAX_DURATION_S,
            "request_runs": experiments.MAX_REQUEST_RUNS,
        },
    }
    return render(request, "console/experiments.html", context, status=status)


@never_cache
@page_view(*READ_EXPERIMENTS)
def experiment_page(request, run_id: int):
    context = {
        "run": experiment_model.run_detail(_run(run_id)),
        "may_run": roles.has_role(request.user, *RUN_EXPERIMENTS),
    }
    if request.GET.get("partial") == "body":
        return render(request, "console/_experiment_body.html", context)
    return render(request, "console/experiment.html", context)


@require_POST
@page_view(*RUN_EXPERIMENTS)
def experiment_cancel(request, run_id: int):
    run = _run(run_id)
    if experiments.cancel(run, request.user):
        messages.success(request, f"Experiment #{run.pk} cancelled.")
    else:
        messages.error(request, f"Experiment #{run.pk} had ended already ({run.get_status_display().lower()}).")
    return redirect("experiment", run_id=run.pk)


CSV_TABLES = {
    "summary": experiment_model.summary_csv,
    "windows": experiment_model.windows_csv,
    "paper": experiment_model.paper_csv,
}


@page_view(*READ_EXPERIMENTS)
def experiment_csv(request, run_id: int, kind: str):
    """A finished run's table as CSV: its summary, its windows, or (summary.csv?against=paper) its table against
    document 000."""
    run = _run(run_id)
    if kind == "summary" and request.GET.get("against") == "paper":
        kind = "paper"
    if run.status != ExperimentStatus.DONE:
        return HttpResponse(
            f"Experiment #{run.pk} is {run.get_status_display().lower()}: it has results only once done.\n",
            status=409,
            content_type="text/plain; charset=utf-8",
        )
    body = CSV_TABLES[kind](run)
    response = HttpResponse(body, content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="lifeline-experiment-{run.pk}-{kind}.csv"'
    return response


@never_cache
@page_view(*READ_EXPERIMENTS)
def experiment_compare(request):
    ids = request.GET.getlist("run")
    runs = ExperimentRun.objects.select_related("started_by").filter(pk__in=[i for i in ids if i.isdigit()])
    by_id = {str(run.pk): run for run in runs}
    if len(ids) != 2 or len(set(ids)) != 2 or set(ids) - set(by_id):
        messages.error(request, "Compare needs two different runs: tick two in the list.")
        return redirect("experiments")
    return render(
        request, "console/experiment_compare.html", {"runs": [experiment_model.run_detail(by_id[i]) for i in ids]}
    )
