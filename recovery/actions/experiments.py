"""Experiments from the console: a simulator scenario (recovery/sim/scenario.py) checked whole, recorded as an
ExperimentRun row, run by a Celery task with its progress and log on the row, and cancelled by a conditional update
that the run sees at its next progress check.

Limits. The console runs experiments on the control plane's own Celery workers, so it takes only what finishes in
about a minute or two on one core; `python -m recovery.sim` runs anything larger. A scenario is refused, naming the
field, when it has more than MAX_NODES nodes (spares included), lasts more than MAX_DURATION_S of simulated time,
or asks for more than MAX_REQUEST_RUNS requests summed over its runs (its workloads' rate × duration × policies ×
seeds); a trace file is refused too, since a path typed into a page would name a file on the worker's disk. The
page's default (8 nodes, 60 s, 24 requests/s, four policies, one seed) runs in about 20 seconds here.

A run's simulations advance in slices (recovery.sim.experiment.PROGRESS_SLICES each); after every slice the task
writes the percentage done and the log with an UPDATE conditional on the row still running. A cancel sets the row
cancelled, so that update changes nothing and the run stops there; a run that raises is marked failed with its
traceback's last line in the log, and nothing else is touched.
"""

import json
import logging
import traceback

from django.db.models import Value
from django.db.models.functions import Concat
from django.utils import timezone

from recovery.choices import EXPERIMENT_OPEN, ExperimentStatus, NodeState
from recovery.models import ExperimentRun, Node
from recovery.sim import lumen, series
from recovery.sim import scenario as sim_scenario
from recovery.sim.errors import ScenarioError
from recovery.sim.experiment import run_all
from recovery.sim.fleet import SERIES_S

log = logging.getLogger(__name__)

MAX_NODES = 64
MAX_DURATION_S = 600.0
MAX_REQUEST_RUNS = 20_000
CHART_WINDOWS = 40  # points per line on the charts: a window of duration / 40 seconds, 1 s at least
LIVE = "live"
DESCRIBED = "described"
FLEET_SOURCES = (LIVE, DESCRIBED)
LARGER = "python -m recovery.sim runs larger experiments"


class Cancelled(Exception):
    """The row was cancelled while the run was under way: it stops at the progress check that found out."""


# --- the scenario ----------------------------------------------------------------------------------------------
def live_fleet() -> tuple[list[dict], dict[str, str]]:
    """The registry's nodes (those that have not left) as scenario node groups, one per rack and deployment; and
    each live node's name → its name in the simulation (``<group>-<i>``, ``<group>-spare-<i>`` for hot spares).

    Raises ScenarioError on `fleet` when no node is registered."""
    nodes = Node.objects.exclude(state=NodeState.LEFT).select_related("rack").order_by("rack__name", "name")
    groups: dict[tuple, dict] = {}
    members: dict[tuple, list[Node]] = {}
    for node in nodes:
        # Nodes that share a server or an NVLink domain are linked faster than the rack's network: kept apart.
        fabric = {"server": node.server, "nvl_domain": node.nvl_domain, "network": node.network}
        key = (node.rack.name, node.model_key, node.gpu_key, node.tp, *fabric.values())
        if key not in groups:
            in_rack = sum(1 for k in groups if k[0] == node.rack.name)
            name = node.rack.name if in_rack == 0 else f"{node.rack.name}-{in_rack + 1}"
            groups[key] = {"name": name, "count": 0, "model": node.model_key, "gpu": node.gpu_key, "tp": node.tp}
            groups[key] |= {"rack": node.rack.name, "spares": 0}
            groups[key] |= {k: v for k, v in fabric.items() if v and (k, v) != ("network", "infiniband")}
            members[key] = []
        groups[key]["spares" if node.spare else "count"] += 1
        members[key].append(node)
    if not groups:
        raise ScenarioError("fleet", "the registry has no nodes yet", "a described fleet, or start some nodes")
    names = {}
    for key, group in groups.items():
        serving = [n for n in members[key] if not n.spare]
        spares = [n for n in members[key] if n.spare]
        if not serving:  # a rack and deployment with spares only: one of them stands in as the serving node
            serving, spares = spares[:1], spares[1:]
            group["count"], group["spares"] = 1, len(spares)
        names |= {n.name: f"{group['name']}-{i}" for i, n in enumerate(serving, 1)}
        names |= {n.name: f"{group['name']}-spare-{i}" for i, n in enumerate(spares, 1)}
    return list(groups.values()), names


def parse_fleet(text: str) -> list:
    """A described fleet: the JSON list of node groups a scenario's `fleet` holds."""
    try:
        fleet = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScenarioError(
            "fleet", f"is not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}", "a JSON list of node groups"
        ) from None
    if not isinstance(fleet, list):
        raise ScenarioError("fleet", f"is a JSON {type(fleet).__name__}", "a JSON list of node groups")
    return fleet


def check(data: dict) -> sim_scenario.Scenario:
    """The scenario parsed whole (recovery.sim.scenario.parse), and held to the console's limits."""
    workloads = data.get("workload") if isinstance(data, dict) else None
    for i, workload in enumerate(workloads if isinstance(workloads, list) else [workloads]):
        if isinstance(workload, dict) and "trace" in workload:
            raise ScenarioError(
                f"workload[{i}].trace", "a trace file cannot be replayed from the console", f"arrivals; {LARGER}"
            )
    scenario = sim_scenario.parse(data)
    if len(scenario.nodes) > MAX_NODES:
        raise ScenarioError(
            "fleet", f"has {len(scenario.nodes)} nodes", f"at most {MAX_NODES}, spares included; {LARGER}"
        )
    if scenario.duration_s > MAX_DURATION_S:
        raise ScenarioError("duration_s", f"{scenario.duration_s:g} s", f"at most {MAX_DURATION_S:g} s; {LARGER}")
    runs = len(scenario.runs())
    rate = sum(w.arrivals.rate_rps for w in scenario.workloads)  # synthetic only: traces are refused above
    if rate * scenario.duration_s * runs > MAX_REQUEST_RUNS:
        raise ScenarioError(
            "workload[0].rate_rps" if len(scenario.workloads) == 1 else "workload",
            f"{rate:g} requests/s for {scenario.duration_s:g} s in each of {runs} runs (policies × seeds) is about "
            f"{rate * scenario.duration_s * runs:,.0f} requests",
            f"at most {MAX_REQUEST_RUNS:,} in all: a lower rate, a shorter duration, fewer policies or seeds; {LARGER}",
        )
    return scenario


def compose(
    *,
    name: str,
    fleet: list,
    duration_s: float,
    workload: dict,
    fault: dict | None,
    policies: list[str],
    seeds: list[int],
    degradation: dict | None = None,
) -> dict:
    """The scenario dict the page's fields describe: one synthetic workload, at most one scripted fault, and no
    drawn faults (the page asks what one named failure does); degradation levels and shedding when an objective
    is given."""
    faults = {"per_1000_node_days": 0, "scripted": [fault] if fault else []}
    scenario = {
        "name": name,
        "duration_s": duration_s,
        "seeds": seeds,
        "policies": policies,
        "fleet": fleet,
        "workload": [workload],
        "faults": faults,
    }
    if degradation:
        scenario["degradation"] = degradation
    return scenario


def submit(user, fleet_source: str, data: dict, names: dict[str, str] | None = None) -> ExperimentRun:
    """Check the scenario whole and write its row, queued; the caller enqueues the task after the commit.
    Raises ScenarioError, naming the field, and writes nothing, when the scenario cannot run."""
    scenario = check(data)
    seeds = ", ".join(map(str, scenario.seeds))
    lines = [
        f"queued by {user.get_username()}: {len(scenario.nodes)} nodes, {scenario.duration_s:g} s, "
        f"{len(scenario.runs())} runs ({', '.join(scenario.policies)}; seeds {seeds})"
    ]
    if names:
        lines.append("live fleet, simulated as: " + ", ".join(f"{live} → {sim}" for live, sim in names.items()))
    return ExperimentRun.objects.create(
        name=scenario.name or _describe(scenario),
        started_by=user,
        fleet_source=fleet_source,
        scenario=data,
        log="\n".join(_stamped(line) for line in lines),
    )


def _describe(scenario: sim_scenario.Scenario) -> str:
    """A name for a run left unnamed: its failures and its size."""
    faults = [f"{f.kind} of {f.target} at {f.at_s:g} s" for f in scenario.scripted_faults] or ["no failure"]
    return f"{', '.join(faults)}; {len(scenario.nodes)} nodes, {scenario.duration_s:g} s"


def cancel(run: ExperimentRun, user) -> bool:
    """Mark a queued or running run cancelled; False when it had ended already. A running task stops at its next
    progress check."""
    changed = ExperimentRun.objects.filter(pk=run.pk, status__in=EXPERIMENT_OPEN).update(
        status=ExperimentStatus.CANCELLED,
        ended_at=timezone.now(),
        log=Concat("log", Value("\n" + _stamped(f"cancelled by {user.get_username()}"))),
    )
    return bool(changed)


# --- the run ----------------------------------------------------------------------------------------------------
def _stamped(line: str) -> str:
    return f"{timezone.now():%H:%M:%S} {line}"


class _Row:
    """The running row as the task writes it: progress and the whole log at each check, only while it is running."""

    def __init__(self, run: ExperimentRun):
        self.pk = run.pk
        self.lines = run.log.splitlines()
        self.under_way: tuple[str, int] | None = None

    def say(self, line: str) -> None:
        self.lines.append(_stamped(line))

    def save(self, status: str = ExperimentStatus.RUNNING, **fields) -> None:
        fields |= {"log": "\n".join(self.lines)}
        if status != ExperimentStatus.RUNNING:
            fields |= {"status": status, "ended_at": timezone.now()}
        if not ExperimentRun.objects.filter(pk=self.pk, status=ExperimentStatus.RUNNING).update(**fields):
            raise Cancelled

    def progress(self, done: float, policy: str, seed: int) -> None:
        if (policy, seed) != self.under_way:
            self.under_way = (policy, seed)
            self.say(f"running {policy}, seed {seed}")
        self.save(progress=min(99, int(done * 100)))  # 100 only with the results


def execute(run_id: int) -> str:
    """Run a queued experiment to its end: claim it (a second delivery of the task finds it taken), run every
    policy on every seed, and store the results; or stop when cancelled, or mark it failed."""
    claimed = ExperimentRun.objects.filter(pk=run_id, status=ExperimentStatus.QUEUED).update(
        status=ExperimentStatus.RUNNING, started_at=timezone.now()
    )
    if not claimed:
        return "not queued: cancelled before it started, or taken already"
    run = ExperimentRun.objects.get(pk=run_id)
    row = _Row(run)
    try:
        row.say("started")
        row.save()
        scenario = sim_scenario.parse(run.scenario)
        results = run_all(scenario, progress=row.progress)
        row.say(f"done: {len(results)} runs in {sum(r.wall_s for r in results):.1f} s")
        row.save(ExperimentStatus.DONE, progress=100, results=_results(scenario, results))
    except Cancelled:
        return "cancelled"
    except Exception as exc:
        log.exception("experiment #%s failed", run_id)
        row.say("failed: " + traceback.format_exception_only(exc)[-1].strip())
        try:
            row.save(ExperimentStatus.FAILED)
        except Cancelled:
            return "cancelled"
        return "failed"
    return "done"


def _impact_window(scenario: sim_scenario.Scenario) -> tuple[float, float]:
    """Document 000's failure-impact window as recovery.sim.lumen measures it: from the fault to the end of the
    arrivals, the same for every policy; the whole run when nothing fails."""
    start = min((f.at_s for f in scenario.scripted_faults), default=0.0)
    return (start, scenario.duration_s)


def _results(scenario: sim_scenario.Scenario, results: list) -> dict:
    # A whole number of the simulator's latency buckets (recovery.sim.metrics.check_window).
    window_s = max(1.0, round(scenario.duration_s / CHART_WINDOWS / SERIES_S) * SERIES_S)
    start_s, end_s = _impact_window(scenario)
    return {
        "window_s": window_s,
        "runs": [r.to_json() for r in results],
        "windows": [
            {"policy": r.metrics.policy, "seed": r.metrics.seed, "rows": series.windows_json(r, window_s)}
            for r in results
        ],
        "chart": series.by_policy(results, window_s),
        # Each run measured as recovery.sim.lumen measures document 000's setups, for the page's table against the
        # paper: labelled by policy, as lumen.aggregate expects.
        "impact": {
            "start_s": start_s,
            "end_s": end_s,
            "runs": [
                {
                    "label": r.metrics.policy,
                    "policy": r.metrics.policy,
                    "seed": r.metrics.seed,
                    **lumen.summarise(r.simulation, r.baseline, (start_s, end_s)),
                }
                for r in results
            ],
        },
    }
