"""Experiments for the console: the list of runs, one run with its progress, log and results, its CSVs, the start
form's presets for source document 000's setups, and a run against the paper.

Figures the simulator could not produce (no request finished, a fault after which latency never came back within
10 % of the baseline) show as "n/a", never as a zero.

Against the paper. recovery/sim/lumen.py reproduces document 000 (LUMEN): its setups, its definitions (mean TTFT and
TPOT over the failure-impact window, recovery time) and the paper's published figures. A preset fills the start form
with one of those setups as lumen.py runs it, shortened where the console's limits ask; a finished run shows each
policy's figures measured that way (the task records them, recovery.actions.experiments), their ratios, and, when
the run's fleet, workload and failure are one of the paper's setups, the paper's figures beside them.
"""

import csv
import io
import json
import math
from dataclasses import MISSING, fields
from functools import cache

from recovery.actions import experiments as experiment_actions
from recovery.choices import ExperimentStatus
from recovery.models import ExperimentRun
from recovery.sim import lumen
from recovery.sim import scenario as sim_scenario
from recovery.sim.errors import ScenarioError
from recovery.sim.metrics import WINDOW_S

SUMMARY_COLUMNS = (
    "policy",
    "seed",
    "requests",
    "finished",
    "interrupted",
    "restored",
    "fetched",
    "reprefilled",
    "ttft_mean_ms",
    "ttft_p99_ms",
    "tpot_mean_ms",
    "tpot_p99_ms",
    "stall_mean_ms",
    "stall_max_ms",
    "recovery_s",
    "shed",
    "possibly_corrupt",
    "wall_s",
)
PAPER_COLUMNS = ("table", "subject", "figure", "simulated", "simulated_ci95", "paper", "paper_kind")
WINDOW_COLUMNS = (
    "policy",
    "seed",
    "window_start_s",
    "window_s",
    "ttft_mean_ms",
    "ttft_samples",
    "tpot_mean_ms",
    "tpot_samples",
)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _text(value, unit: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:g}{unit}" if isinstance(value, float) else f"{value}{unit}"


def run_row(run: ExperimentRun) -> dict:
    return {
        "id": run.pk,
        "name": run.name,
        "status": run.status,
        "status_label": ExperimentStatus(run.status).label,
        "badge": run.badge,
        "open": run.is_open,
        "done": run.status == ExperimentStatus.DONE,
        "progress": run.progress,
        "fleet_source": run.fleet_source,
        "started_by": run.started_by.get_username() if run.started_by else "n/a",
        "created_at": run.created_at.timestamp(),
        "started_at": run.started_at.timestamp() if run.started_at else None,
        "ended_at": run.ended_at.timestamp() if run.ended_at else None,
        "took_s": (run.ended_at - run.started_at).total_seconds() if run.started_at and run.ended_at else None,
    }


def run_list(limit: int = 200) -> list[dict]:
    """The newest runs first, without their results (a run's results can be large)."""
    runs = ExperimentRun.objects.select_related("started_by").defer("results", "log", "scenario")[:limit]
    return [run_row(run) for run in runs]


def summary(run: ExperimentRun) -> list[dict]:
    """One row per (policy, seed): the summary table and the summary CSV. Recovery time is per fault that took
    nodes out, from its detection back to within 10 % of the no-failure baseline (recovery/sim/metrics.py)."""
    rows = []
    for r in run.results.get("runs", []):
        recovery = [f["recovery_s"] for f in r["faults"] if f["nodes"]]
        rows.append(
            {
                "policy": r["policy"],
                "seed": r["seed"],
                "requests": r["requests"],
                "finished": r["finished"],
                "interrupted": r["interrupted"],
                "restored": r["restored"],
                "fetched": r["fetched"],
                "reprefilled": r["reprefilled"],
                "ttft_mean_ms": _ms(r["ttft_mean_s"]),
                "ttft_p99_ms": _ms(r["ttft_p99_s"]),
                "tpot_mean_ms": _ms(r["tpot_mean_s"]),
                "tpot_p99_ms": _ms(r["tpot_p99_s"]),
                "stall_mean_ms": _ms(r["stall_mean_s"]),
                "stall_max_ms": _ms(r["stall_max_s"]),
                "recovery_s": ";".join(_text(None if s is None else round(s, 2)) for s in recovery),
                "shed": r.get("shed", 0),  # runs recorded before degradation was simulated have none
                "possibly_corrupt": r.get("possibly_corrupt", 0),
                "wall_s": r["wall_s"],
            }
        )
    return rows


# --- document 000 ---------------------------------------------------------------------------------------------
PAPER = "document 000 (LUMEN)"
# The setups with the paper's figures (lumen.PAPER_PROTOTYPE), in the order the presets list them.
PAPER_SETUPS = {setup.name: setup for setup in (lumen.WORKERS4, lumen.WORKERS8)}
# The policies in the paper's words; lifeline is ours, not the paper's.
PAPER_NAMES = {
    "none": "stop-and-restart",
    "fixed": "fixed neighbour",
    "load_aware": "LUMEN (load-aware)",
    "lifeline": "Lifeline",
}
# What the table shows of each run: figure, its name, its unit, the scale from seconds and the digits shown.
PAPER_FIGURES = (
    ("ttft_mean_s", "Mean TTFT", "s", 1, 2),
    ("tpot_mean_s", "Mean TPOT", "ms", 1000, 1),
    ("recovery_s", "Recovery time", "s", 1, 1),
)
BASELINE = {"ttft_mean_s": "baseline_ttft_s", "tpot_mean_s": "baseline_tpot_s"}  # lumen.summarise's
# (a, b): a's figure over b's, less one. Each policy against stop-and-restart, Lifeline against LUMEN, and LUMEN
# against fixed neighbour (the paper prints LUMEN's ratios against both of its baselines).
PAPER_PAIRS = (
    ("fixed", "none"),
    ("load_aware", "none"),
    ("lifeline", "none"),
    ("lifeline", "load_aware"),
    ("load_aware", "fixed"),
)
# What makes a run one of the paper's setups (Scenario fields); its duration, policies and seeds may differ.
SETUP_FIELDS = ("fleet", "workloads", "scripted_faults", "fault_rates", "detection")
PRESET_STEP_S = WINDOW_S  # a shortened preset lasts a whole number of the windows recovery time is measured in


def _setup_label(setup: lumen.Setup) -> str:
    return f"{PAPER}, {setup.workers} workers, {setup.model}"


@cache
def _paper_scenario(name: str) -> sim_scenario.Scenario:
    return PAPER_SETUPS[name].scenario()


def _group_json(group: sim_scenario.NodeGroup) -> dict:
    """A node group as the form's fleet JSON writes it: what it names, and whatever differs from the defaults."""
    named = ("name", "count", "model", "gpu", "tp")
    return {
        f.name: getattr(group, f.name)
        for f in fields(group)
        if f.init and (f.name in named or f.default is MISSING or getattr(group, f.name) != f.default)
    }


def _preset(setup: lumen.Setup) -> dict:
    """The start form's fields for `setup` as recovery/sim/lumen.py runs it (its fleet, workload, failure and every
    policy) on one seed, shortened to the console's limit on requests where it is over; and what differs, said."""
    scenario = _paper_scenario(setup.name)
    (workload,) = scenario.workloads
    (fault,) = scenario.scripted_faults
    policies = list(lumen.POLICIES)
    rate = workload.arrivals.rate_rps
    requests = rate * scenario.duration_s * len(policies)
    duration_s = min(scenario.duration_s, experiment_actions.MAX_DURATION_S)
    if requests > experiment_actions.MAX_REQUEST_RUNS:
        longest = experiment_actions.MAX_REQUEST_RUNS / (rate * len(policies))
        duration_s = math.floor(longest / PRESET_STEP_S) * PRESET_STEP_S
    command = f"python -m recovery.sim.lumen {setup.name}"
    notes = [
        f"lumen.py's {setup.name}: {setup.workers} workers of {setup.model}, each on {setup.tp}× {setup.gpu}; "
        f"{workload.arrivals.process.capitalize()} arrivals of {workload.lengths} lengths at "
        f"{setup.rate_per_worker:g} requests/s per worker ({rate:g} in all); {fault.target} crashes at "
        f"{fault.at_s:g} s and restarts {fault.repair_s:g} s later, then reloads its model; "
        f"every policy ({', '.join(policies)}).",
        f"One seed; {command} averages several.",
    ]
    shortened = ""
    if duration_s < scenario.duration_s:
        shortened = (
            f"Shortened to {duration_s:g} s of simulated time: lumen.py runs {scenario.duration_s:g} s, and "
            f"{rate:g} requests/s × {scenario.duration_s:g} s × {len(policies)} policies is {requests:,.0f} requests, "
            f"over this page's {experiment_actions.MAX_REQUEST_RUNS:,}. The failure-impact window ends with the "
            f"run, so it is shorter too; {command} runs the whole of it."
        )
    return {
        "key": setup.name,
        "label": _setup_label(setup),
        "notes": notes,
        "shortened": shortened,  # what the page's limits changed, said; empty when nothing
        "initial": {
            "name": _setup_label(setup),
            "fleet_source": experiment_actions.DESCRIBED,
            "fleet_json": "[\n" + ",\n".join("  " + json.dumps(_group_json(g)) for g in scenario.fleet) + "\n]",
            "duration_s": f"{duration_s:g}",
            "arrival": workload.arrivals.process,
            "rate_rps": f"{rate:g}",
            "cv": None,
            "lengths": workload.lengths,
            "fault_kind": fault.kind,
            "fault_target": fault.target,
            "fault_at_s": f"{fault.at_s:g}",
            "fault_repair_s": "" if fault.repair_s is None else f"{fault.repair_s:g}",
            "policies": policies,
            "seeds": "1",
        },
    }


def presets() -> list[dict]:
    """The start form's presets: document 000's setups (PAPER_SETUPS)."""
    return [_preset(setup) for setup in PAPER_SETUPS.values()]


def paper_setup(run: ExperimentRun) -> lumen.Setup | None:
    """The paper's setup the run's fleet, workload and failure are, whatever its duration, policies and seeds; None
    when they are not one of them."""
    try:
        scenario = sim_scenario.parse(run.scenario)
    except ScenarioError:
        return None
    for name, setup in PAPER_SETUPS.items():
        paper = _paper_scenario(name)
        if all(getattr(scenario, attr) == getattr(paper, attr) for attr in SETUP_FIELDS):
            return setup
    return None


def _text_of(value: float | None, scale: float, digits: int) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.1f} %"


def _measured(figure: dict, scale: float, digits: int) -> dict:
    """One of our figures (lumen.mean_ci over the runs): its mean, with the 95 % CI when there are two seeds or
    more, and how many runs had none (a recovery time: latency never came back within 10 % of the baseline)."""
    text = _text_of(figure["mean"], scale, digits)
    if figure["mean"] is not None and figure["ci95"] is not None:
        text += f" ± {_text_of(figure['ci95'], scale, digits)}"
    if figure["missing"]:
        text += f" (not back in {figure['missing']} of {figure['n'] + figure['missing']} runs)"
    return {"value": figure["mean"], "ci95": figure["ci95"], "text": text}


def _paper_figures(figures: tuple | None) -> list[dict]:
    """A row of the paper's prototype table (lumen.PAPER_PROTOTYPE), each figure to the digits of ours."""
    cells = []
    for i, (_, _, _, scale, digits) in enumerate(PAPER_FIGURES):
        value = None if figures is None else figures[i]
        cells.append({"value": value, "text": _text_of(value, scale, digits), "kind": "published"})
    return cells


def _paper_ratio(setup: str, a: str, b: str, i: int) -> tuple[float | None, str]:
    """The paper's a over b, less one, for figure i: as it prints it (lumen.PAPER_RATIOS), else from its published
    means where it has both (lumen.PAPER_PROTOTYPE); (None, "") where it has neither (it has no Lifeline)."""
    printed = lumen.PAPER_RATIOS.get(setup, {}).get(f"{a}_vs_{b}")
    if printed is not None:
        return printed[i], "as printed"
    means = lumen.PAPER_PROTOTYPE.get(setup, {})
    if a in means and b in means and means[a][i] is not None and means[b][i]:
        return means[a][i] / means[b][i] - 1, "from the paper's means"
    return None, ""


def _row(key: str, name: str, ours: list[dict], paper: list[dict]) -> dict:
    """A row of the table against the paper: a cell per figure (PAPER_FIGURES), ours beside the paper's."""
    cells = [{"figure": figure, "ours": o, "paper": p} for (figure, *_), o, p in zip(PAPER_FIGURES, ours, paper)]
    return {"key": key, "name": name, "cells": cells}


def against_paper(run: ExperimentRun) -> dict | None:
    """The table against the paper for a finished run: per policy run, mean TTFT, mean TPOT and recovery time over
    the failure-impact window (recovery.sim.lumen's definitions; the mean over seeds) and the ratios between
    policies, with the paper's figures beside them when the run is one of its setups (paper_setup). None for a run
    stored before its task measured that window."""
    impact = run.results.get("impact")
    if impact is None:
        return None
    runs = impact["runs"]
    setup = paper_setup(run)
    published = lumen.PAPER_PROTOTYPE.get(setup.name, {}) if setup else {}
    rows = {policy: lumen.aggregate(runs, policy) for policy in dict.fromkeys(r["policy"] for r in runs)}

    figures = [
        _row(
            policy,
            PAPER_NAMES.get(policy, policy),
            [_measured(row[key], scale, digits) for key, _, _, scale, digits in PAPER_FIGURES],
            _paper_figures(published.get(policy)),
        )
        for policy, row in rows.items()
    ]
    # The no-failure baseline over the same window, stop-and-restart's as lumen.py prints it (any policy's where it
    # was not run: without a failure they serve the same requests alike); no failure, no recovery time.
    base = rows.get("none") or next(iter(rows.values()))
    baseline = [
        _measured(base[BASELINE[key]], scale, digits) if key in BASELINE else {"value": None, "ci95": None, "text": "-"}
        for key, _, _, scale, digits in PAPER_FIGURES
    ]
    figures.append(_row("baseline", "no failure", baseline, _paper_figures(published.get("baseline"))))

    ratios = []
    for a, b in PAPER_PAIRS:
        if a not in rows or b not in rows:
            continue
        ours = [lumen.ratio(rows[a], rows[b], key) for key, *_ in PAPER_FIGURES]
        theirs = [_paper_ratio(setup.name, a, b, i) if setup else (None, "") for i in range(len(PAPER_FIGURES))]
        ratios.append(
            _row(
                f"{a}_vs_{b}",
                f"{PAPER_NAMES.get(a, a)} vs {PAPER_NAMES.get(b, b)}",
                [{"value": v, "ci95": None, "text": _percent(v)} for v in ours],
                [{"value": v, "text": _percent(v), "kind": kind} for v, kind in theirs],
            )
        )

    return {
        "setup": setup.name if setup else None,
        "label": _setup_label(setup) if setup else None,
        "duration_s": run.scenario.get("duration_s"),
        "paper_duration_s": _paper_scenario(setup.name).duration_s if setup else None,
        "seeds": run.scenario.get("seeds", []),
        "start_s": impact["start_s"],
        "end_s": impact["end_s"],
        "headers": [{"key": key, "title": title, "unit": unit} for key, title, unit, _, _ in PAPER_FIGURES],
        "figures": figures,
        "ratios": ratios,
        "stop_and_restart_run": "none" in rows,
        "paper_setups": [_setup_label(s) for s in PAPER_SETUPS.values()],
        "source": f"{lumen.PAPER}, LUMEN vs. Baselines: Prototype Results",
    }


def paper_csv(run: ExperimentRun) -> str:
    """The table against the paper, one row per figure: a policy's mean (table `figures`, in seconds) or one
    policy's figure over another's less one (table `ratios`: -0.44 is 44 % lower). `simulated` is measured here,
    with its 95 % CI over seeds when there are two or more; `paper` is document 000's and `paper_kind` says how we
    have it (published; as printed; from the paper's means, where it prints no ratio); both empty where the paper
    has no figure (its setups only, and no Lifeline)."""
    table = against_paper(run)
    rows = []
    for group in ("figures", "ratios") if table else ():
        for row in table[group]:
            for cell in row["cells"]:
                ours, paper = cell["ours"], cell["paper"]
                if row["key"] == "baseline" and cell["figure"] not in BASELINE:
                    continue  # no failure, no recovery time
                rows.append(
                    {
                        "table": group,
                        "subject": row["key"],
                        "figure": cell["figure"],
                        "simulated": ours["value"],
                        "simulated_ci95": ours["ci95"],
                        "paper": paper["value"],
                        "paper_kind": "" if paper["value"] is None else paper["kind"],
                    }
                )
    return _csv(PAPER_COLUMNS, rows)


def run_detail(run: ExperimentRun) -> dict:
    rows = summary(run)
    for row in rows:
        row["cells"] = {key: _text(value) for key, value in row.items()}
        row["methods"] = f"restore {row['restored']}, fetch {row['fetched']}, re-prefill {row['reprefilled']}"
    chart = run.results.get("chart")
    return {
        **run_row(run),
        "log": run.log,
        "scenario_json": json.dumps(run.scenario, indent=2),
        "summary": rows,
        "chart": chart,
        "chart_element_id": f"experiment-chart-data-{run.pk}",
        "faults": chart["faults"] if chart else [],
        "paper": against_paper(run) if run.status == ExperimentStatus.DONE else None,
    }


def _csv(columns: tuple[str, ...], rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: "" if row[key] is None else row[key] for key in columns})
    return out.getvalue()


def summary_csv(run: ExperimentRun) -> str:
    """One row per run (policy, seed); an empty cell where a figure is n/a; recovery times `;`-separated, one per
    fault that took nodes out, empty when latency never came back within 10 % of the baseline."""
    return _csv(SUMMARY_COLUMNS, summary(run))


def windows_csv(run: ExperimentRun) -> str:
    """One row per run and window of simulated time: mean TTFT and mean inter-token gap, with their sample counts
    (an empty mean where a window has no sample)."""
    window_s = run.results.get("window_s")
    rows = []
    for series in run.results.get("windows", []):
        for w in series["rows"]:
            rows.append(
                {
                    "policy": series["policy"],
                    "seed": series["seed"],
                    "window_start_s": w["start_s"],
                    "window_s": window_s,
                    "ttft_mean_ms": _ms(w["ttft_mean_s"]),
                    "ttft_samples": w["ttft_samples"],
                    "tpot_mean_ms": _ms(w["tpot_mean_s"]),
                    "tpot_samples": w["tpot_samples"],
                }
            )
    return _csv(WINDOW_COLUMNS, rows)
