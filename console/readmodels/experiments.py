"""Experiments for the console: the list of runs, one run with its progress, log and results, and its two CSVs.

Figures the simulator could not produce (no request finished, a fault after which latency never came back within
10 % of the baseline) show as "n/a", never as a zero.
"""

import csv
import io
import json

from recovery.choices import ExperimentStatus
from recovery.models import ExperimentRun

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
    "wall_s",
)
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
                "wall_s": r["wall_s"],
            }
        )
    return rows


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
