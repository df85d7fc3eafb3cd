"""python -m recovery.sim.lumen [table1|workers4|…|scale|spares|resume|all] [--seeds N] [--first-seed S]
[--quick] [--rate R] [--jobs J] [--day [--fleets N,N]]

Source document 000 (LUMEN) reproduced on the simulator, then Lifeline's policy beside it: every policy in the
same run on several seeds, each seed giving every policy the same requests and the same faults, each run against
its own no-failure baseline; the mean over seeds with a 95 % confidence interval (Student's t over seeds); the
paper's figures beside ours; the results in benchmarks/results/lumen_<name>.json.

The seeds are S, S+1, …, S+N-1 (``--first-seed S``, default 1). Lifeline's constants and the changes tried and not
kept were chosen on seeds 1-3 (benchmarks/README.md; issue 42), so ``--first-seed 101`` evaluates on seeds that
played no part in tuning; it writes the same results file as the default, which it replaces.

Experiments
-----------
- ``table1``: stop-and-restart with 25 % of the workers crashed at once, at 4, 8, 16, 32 and 64 workers:
  uninterrupted TTFT and replay TTFT beside document 000's Table 1.
- ``workers4`` and ``workers8``: document 000's prototype tables, 4 workers of Qwen3-32B and 8 of Qwen3-14B, one
  worker crashed at steady state: mean TTFT, mean TPOT and recovery time of stop-and-restart (``none``), fixed
  neighbour (``fixed``), LUMEN (``load_aware``) and Lifeline (``lifeline``), with the ratios beside the paper's.
  ``--rate R`` runs them at R requests/s per worker instead (written to ``lumen_<name>_rate<R>.json``).
- ``rack8``: not one of document 000's setups: the 8-worker fleet in four racks of two, rack-1 lost whole, every
  policy: a request whose only checkpoint copy sat in the same rack loses it, the failure a second holder is for.
- ``ablations``: Lifeline on the 4-worker setup with one mechanism taken away at a time (Simulation's switches).
- ``grid``: Lifeline on the 4-worker setup over θ (theta_factor) × τ.
- ``sensitivity``: the 4-worker setup with the checkpoint link at NVLink, rack-leaf InfiniBand (the default) and
  spine InfiniBand bandwidth; an 8-worker fleet with faults drawn from the rate, at ×0.5, ×1 and ×2 of it.
- ``scale``: faults drawn from the rate on a large fleet. ``--day`` gives days of 256 and 1,000 nodes at 4 faults
  per 1,000 node-days (``--fleets`` picks the sizes, one day per seed), each composed from simulated windows: one
  per drawn fault, with the nodes the day already had out, and one per count of nodes out (``day_at_scale``); a
  whole day is 600 million requests at 1,000 nodes, days of this machine's core per policy. Without it, 256 nodes
  over a short window whose rate is raised so the window holds a day's expected faults.
- ``spares``: hot spares against SLO attainment and GPU-hours per fleet (see `spares`).
- ``resume``: an experiment, not the gateway's policy: eq. 6's dispatch of a lost node's requests against
  resuming each where its next token comes soonest (recovery.policy.recovery.plan_soonest), on the 4- and
  8-worker setups and on 64 nodes losing a TP group.

What a figure is
----------------
Every figure written carries ``kind``: ``simulated`` (a simulator run produced it), ``modelled`` (arithmetic on
simulated figures and drawn fault timelines, no run behind it as such) or ``input`` (the paper's figures, and
the setups we chose). Every JSON records the command that made it, the seeds, and what was scaled down.

Definitions, per run (document 000's where it gives one)
--------------------------------------------------------
- failure-impact window: from the fault to the end of the arrivals, the same for every policy (the paper's
  window ends where each policy recovers, which would average each policy over a different set of requests);
- mean TTFT: over the requests arriving in the window, plus each interrupted request's replay TTFT (from the
  fault to its first token after it resumes): a user whose stream broke waits for a first token again;
- uninterrupted TTFT: the requests arriving in the window that no fault cut off; replay TTFT: the interrupted
  ones' wait as above (document 000's Table 1 columns);
- mean TPOT: the per-request mean gap between tokens, over the same requests;
- recovery time: recovery.sim.metrics's, from detection until latency is back within 10 % of the no-failure
  baseline (document 000's definition); a run that never gets back has none, and the count of those is reported;
- attainment: the share of all requests whose TTFT (and replay TTFT) is within the model's standard-tier TTFT
  objective and whose TPOT is within its TPOT objective (recovery.policy.slo.default_for: MLPerf Inference's
  server scenario, 2,000 ms and 200 ms for a large model, 2,000 ms and 100 ms up to 15 B).
"""

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from recovery.policy.slo import default_for
from recovery.sim.faults import DAY_S, FAULTS_PER_1000_NODE_DAYS, FaultRates
from recovery.sim.fleet import ASSIST_K, MAX_ASSISTED, Simulation
from recovery.sim.metrics import ASSIST_KIND, request_metrics, run_metrics
from recovery.sim.scenario import Scenario, parse
from workers import catalog

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
EXPERIMENTS = (
    "table1",
    "workers4",
    "workers8",
    "rack8",
    "ablations",
    "grid",
    "sensitivity",
    "scale",
    "spares",
    "resume",
)
POLICIES = ("none", "fixed", "load_aware", "lifeline")
PAPER = "document 000 (LUMEN review), Experimental Results"

# Student's t, two-sided 95 %, by degrees of freedom; past 30 the normal's 1.96 is within 2 %.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
T_975_30 = 2.042


def t_975(df: int) -> float:
    if df < 1:
        raise ValueError("a confidence interval needs at least two samples")
    if df <= len(T_975):
        return T_975[df - 1]
    return T_975_30 if df <= 30 else 1.96


def mean_ci(values: Sequence[float | None]) -> dict:
    """Mean and the half-width of its 95 % confidence interval (t over the samples); samples that are None (no recovery
    time: the run had no fault, or never got back within 10 % of its baseline) are left out and counted."""
    present = [v for v in values if v is not None]
    out: dict = {"mean": None, "ci95": None, "n": len(present), "missing": len(values) - len(present)}
    if present:
        out["mean"] = statistics.fmean(present)
    if len(present) > 1:
        out["ci95"] = t_975(len(present) - 1) * statistics.stdev(present) / math.sqrt(len(present))
    return out


# --- the setups ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """One of document 000's setups as the catalog can hold it: `failed` workers crash together at `fault_at_s`,
    come back after `repair_s` (a pod restart) plus the model's load time; arrivals stop at `duration_s`.

    Document 000 names the model and the worker count, not the GPU, the tensor-parallel degree or the load. We
    chose H100-SXM (the catalog's most common serving GPU), the smallest TP that holds the model with room for
    KV, and a per-worker rate that loads the fleet near saturation (document 000's baseline TTFT of 1.16 s and
    TPOT of 139 ms are a loaded fleet's), then did not change them to match the paper's figures."""

    name: str
    workers: int
    model: str
    tp: int
    rate_per_worker: float
    gpu: str = "H100-SXM"
    duration_s: float = 120.0
    fault_at_s: float = 30.0
    failed: int = 1
    repair_s: float | None = 5.0  # None: out for the rest of the run
    lengths: str = "splitwise-conversation"
    fabric: dict = field(default_factory=dict)  # scenario fleet fields: rack layout, nvl_domain
    racks: int = 0  # above 0: the workers spread over this many racks, and the fault takes rack-1 whole
    fault_kind: str = "crash"  # what the `failed` workers suffer (recovery.sim.faults.NODE_KINDS)

    def scenario(self, fault_rate: float = 0.0, spares: int = 0) -> Scenario:
        group = {"name": "w", "count": self.workers, "model": self.model, "gpu": self.gpu, "tp": self.tp}
        group.update(self.fabric)
        if spares:
            group["spares"] = spares
        scripted = [
            {"at_s": self.fault_at_s, "kind": self.fault_kind, "target": f"w-{i}", "repair_s": self.repair_s}
            for i in range(1, self.failed + 1)
        ]
        fleet = [group]
        if self.racks:
            per_rack = self.workers // self.racks
            fleet = [
                group | {"name": f"r{k}", "count": per_rack, "rack": f"rack-{k}"} for k in range(1, self.racks + 1)
            ]
            scripted = [{"at_s": self.fault_at_s, "kind": "rack", "target": "rack-1", "repair_s": self.repair_s}]
        return parse(
            {
                "name": self.name,
                "duration_s": self.duration_s,
                "fleet": fleet,
                "workload": {
                    "arrival": "poisson",
                    "rate_rps": self.rate_per_worker * self.workers,
                    "lengths": self.lengths,
                },
                "faults": {"per_1000_node_days": fault_rate, "scripted": scripted},
            }
        )

    def describe(self) -> dict:
        d = catalog.Deployment.of(self.model, self.gpu, self.tp)
        return {
            **asdict(self),
            "reload_s": None if self.repair_s is None else round(self.repair_s + catalog.load_time_s(d.model), 1),
            "kind": "input (our choice where document 000 is silent)",
        }


# Requests/s per worker. A Qwen3-32B worker on 2× H100 saturates at about 9 req/s of these lengths (its
# no-failure TTFT is 0.3 s at 6, 0.8 s at 8, and grows without bound at 10); at 7, a quarter of the fleet lost
# puts the survivors at 9.3, just past saturation, as document 000's "each surviving worker absorbs ~33 % extra
# load" overloads them. Qwen3-14B on one H100 has about the same step time and KV room: the same rate. (At 8 the
# survivors never got back within 10 % of the baseline within 60 s: benchmarks/README.md.)
RATE_32B = 7.0
RATE_14B = 7.0
WORKERS4 = Setup("workers4", 4, "Qwen3-32B", 2, RATE_32B)
WORKERS8 = Setup("workers8", 8, "Qwen3-14B", 1, RATE_14B)
# Not in document 000, whose failures are single workers: the failure Lifeline's second holder is for. Eight
# workers in four racks of two, rack-1 lost whole: a request whose only copy sat on its rack neighbour loses it.
RACK8 = Setup("rack8", 8, "Qwen3-14B", 1, RATE_14B, racks=4)
TABLE1_SIZES = (4, 8, 16, 32, 64)

# --- the paper's figures (inputs) ---------------------------------------------------------------------
PAPER_TABLE1 = {  # workers: (uninterrupted TTFT s, ±, replay TTFT s, ±), document 000 Table 1
    4: (4.1, 0.2, 25.6, 7.1),
    8: (3.8, 1.1, 24.0, 1.4),
    16: (3.5, 1.2, 27.1, 1.7),
    32: (3.5, 0.7, 29.4, 2.9),
    64: (3.6, 0.1, 27.8, 0.7),
}
# policy: (mean TTFT s, mean TPOT s, recovery time s); "~" figures as printed
PAPER_PROTOTYPE: dict[str, dict[str, tuple[float, float, float | None]]] = {
    "workers4": {
        "none": (4.69, 0.2246, 20.0),
        "fixed": (2.80, 0.167, 13.0),
        "load_aware": (2.61, 0.148, 10.0),
        "baseline": (1.16, 0.1389, None),  # the same cluster without the failure (Motivation)
    },
    "workers8": {"none": (3.9, 0.210, 25.0), "fixed": (2.9, 0.167, 18.0), "load_aware": (2.7, 0.152, 9.0)},
}
# As printed: LUMEN vs stop-and-restart, LUMEN vs fixed (TTFT, TPOT, recovery).
PAPER_RATIOS: dict[str, dict[str, tuple[float, float, float]]] = {
    "workers4": {"load_aware_vs_none": (-0.444, -0.159, -0.50), "load_aware_vs_fixed": (-0.071, -0.070, -0.349)},
    "workers8": {"load_aware_vs_none": (-0.296, -0.071, -0.641), "load_aware_vs_fixed": (-0.159, -0.042, -0.639)},
}
DIFFERENCES = [
    "Workload: Poisson arrivals of Splitwise conversation lengths generated from the trace's published statistics "
    "(recovery/sim/workload.py); document 000 replays Splitwise-Conv and ShareGPT traces at a load it does not state.",
    "Hardware model: a roofline of H100-SXM (workers/catalog.py; GPU and TP are our choice, document 000 names "
    "neither), not SGLang on real GPUs: no kernel overheads, no scheduler jitter.",
    "Detection: a crash leaves routing 9 ms after it, when the gateway notices the node's streams break, each move "
    "then takes the gateway's hop (both measured by benchmarks/move_hop.py), and it is confirmed 2-4 s later "
    "(recovery/sim/faults.py); document 000 says detection takes under 1 s with heartbeats.",
    "Reload: weights at 5 GB/s plus a 10 s engine start (catalog.load_time_s) after a 5 s restart; document 000 "
    "quotes minutes for a 32B model from NVMe, yet recovery times of 10-25 s.",
    "Draft assist (document 000's mechanism 3, speculation-assisted progressive recovery) is modelled as the real "
    "system does it (recovery/sim/fleet.py): the restarting node's draft model is ready within its full model's "
    "load, assists the most loaded survivor decoding with k = 4 drafts per sequence, and each draft is accepted at "
    "random with probability α = the model pair's draft agreement in workers/catalog.py (0.7 for Qwen3-32B with "
    "Qwen3-1.7B), a MODEL PARAMETER, not a measured acceptance; document 000 does not give its own. Every policy "
    "has it, stop-and-restart included, unless the no_draft_assist ablation takes it away.",
    "Failure-impact window: the same for every policy (fault to end of arrivals), not each policy's own.",
    "Table 1's 25 % of the workers crash at the same moment; document 000 does not say whether its failures are "
    "simultaneous.",
    "Replay TTFT: from the fault to the interrupted request's next token; document 000 does not define where its "
    "replay TTFT starts.",
]


# --- one run and its figures ----------------------------------------------------------------------------
def _in(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarise(faulted: Simulation, baseline: Simulation, window: tuple[float, float]) -> dict:
    """One run's figures (module docstring) from the faulted run and its no-failure baseline."""
    start, end = window
    objective = default_for(faulted.scenario.fleet[0].model, "standard")
    ttft_limit, tpot_limit = objective.ttft_ms / 1000, objective.tpot_ms / 1000
    rows = [request_metrics(f) for f in faulted.flights]
    arrived = [r for r in rows if start <= r.arrival_s < end]
    interrupted = [r for r in rows if r.interrupted]
    replay = [r.stall_s for r in interrupted if r.stall_s is not None]
    window_ttft = [r.ttft_s for r in arrived if r.ttft_s is not None and not r.interrupted] + replay
    window_tpot = [r.tpot_s for r in {id(r): r for r in arrived + interrupted}.values() if r.tpot_s is not None]
    base_rows = [request_metrics(f) for f in baseline.flights]
    base_arrived = [r for r in base_rows if start <= r.arrival_s < end]

    def met(r) -> bool:
        ttft = math.inf if r.ttft_s is None else max(r.ttft_s, r.stall_s or 0.0)
        return ttft <= ttft_limit and (r.tpot_s is None or r.tpot_s <= tpot_limit) and r.emitted == r.output_tokens

    metrics = run_metrics(faulted, baseline)
    recoveries = [f.recovery_s for f in metrics.faults if f.nodes]
    return {
        "ttft_mean_s": _in(window_ttft),
        "tpot_mean_s": _in(window_tpot),
        "recovery_s": _in([r for r in recoveries if r is not None]) if all(r is not None for r in recoveries) else None,
        "uninterrupted_ttft_s": _in([r.ttft_s for r in arrived if r.ttft_s is not None and not r.interrupted]),
        "replay_ttft_s": _in(replay),
        "baseline_ttft_s": _in([r.ttft_s for r in base_arrived if r.ttft_s is not None]),
        "baseline_tpot_s": _in([r.tpot_s for r in base_arrived if r.tpot_s is not None]),
        "attainment": sum(map(met, rows)) / len(rows) if rows else None,
        "baseline_attainment": sum(map(met, base_rows)) / len(base_rows) if base_rows else None,
        "faults": len(recoveries),
        "unrecovered_faults": sum(1 for r in recoveries if r is None),
        "interrupted": len(interrupted),
        "restored": metrics.restored,
        "fetched": metrics.fetched,
        "reprefilled": metrics.reprefilled,
        "requests": len(rows),
        "two_holders": sum(1 for f in faulted.flights if len(f.holders) > 1),
        "assisted_steps": metrics.assist["assisted_steps"],
        "drafted_tokens": metrics.assist["drafted_tokens"],
        "accepted_tokens": metrics.assist["accepted_tokens"],
    }


FIGURES = (
    "ttft_mean_s",
    "tpot_mean_s",
    "recovery_s",
    "uninterrupted_ttft_s",
    "replay_ttft_s",
    "baseline_ttft_s",
    "baseline_tpot_s",
    "attainment",
    "baseline_attainment",
    "interrupted",
    "restored",
    "fetched",
    "reprefilled",
    "faults",
    "unrecovered_faults",
    "requests",
    "assisted_steps",
    "drafted_tokens",
    "accepted_tokens",
)
# Draft assist's figures are outcomes of acceptance drawn at the model pair's draft agreement α (an input).
MODELLED_FIGURES = {
    "assisted_steps": ASSIST_KIND,
    "drafted_tokens": ASSIST_KIND,
    "accepted_tokens": ASSIST_KIND,
}


@dataclass(frozen=True)
class Job:
    """One (variant, seed) run: picklable, so runs can go to other processes."""

    label: str
    scenario: Scenario
    policy: str
    seed: int
    window: tuple[float, float]
    options: tuple[tuple[str, Any], ...] = ()  # Simulation keyword arguments


def _simulate(job: Job) -> tuple[Simulation, Simulation]:
    """The faulted run and its no-failure baseline on the same requests; a job without a fault runs once (its
    faulted run would be its baseline again, step for step).

    On the simulator's fast path (decode steps in closed form between the events that change a batch), which
    tests/recovery/sim hold to the step-by-step reference: a 4-worker run of 40 s gave the same figures both ways
    here, 3.3 times faster."""
    scenario, options = job.scenario, {"fast": True, **dict[str, Any](job.options)}
    requests = scenario.requests(job.seed)
    baseline = Simulation(scenario, job.policy, job.seed, faults=False, requests=requests, **options).run()
    faults = scenario.faults(job.seed)
    if not faults:
        return baseline, baseline
    faulted = Simulation(scenario, job.policy, job.seed, requests=requests, fault_list=faults, **options).run()
    return faulted, baseline


def run_job(job: Job, sums: bool = False) -> dict:
    """The faulted run and its baseline, summarised (with `sums`, also what a day adds up: `_sums`); the wall time
    of both."""
    started = time.perf_counter()
    faulted, baseline = _simulate(job)
    figures = {"label": job.label, "policy": job.policy, "seed": job.seed, **summarise(faulted, baseline, job.window)}
    if sums:
        figures.update(_sums(faulted, baseline, job.window))
    return {**figures, "wall_s": time.perf_counter() - started}


def run_jobs(jobs: list[Job], processes: int, runner: Callable[[Job], dict] = run_job) -> list[dict]:
    """Every job, in order; across `processes` processes when above 1 (each run is independent)."""
    if processes <= 1:
        return [_announce(runner(job)) for job in jobs]
    with ProcessPoolExecutor(processes) as pool:
        return [_announce(r) for r in pool.map(runner, jobs)]


def _announce(result: dict) -> dict:
    print(f"  ran {result['label']} seed {result['seed']} in {result['wall_s']:.1f} s", file=sys.stderr, flush=True)
    return result


def aggregate(runs: list[dict], label: str) -> dict:
    """Mean and 95 % CI over seeds of each figure of `label`'s runs, simulated but for draft assist's (modelled)."""
    mine = [r for r in runs if r["label"] == label]
    return {
        name: {**mean_ci([r[name] for r in mine]), "kind": MODELLED_FIGURES.get(name, "simulated")} for name in FIGURES
    }


def ratio(a: dict, b: dict, name: str) -> float | None:
    """a's mean over b's, less one: -0.44 is 44 % lower."""
    x, y = a[name]["mean"], b[name]["mean"]
    return None if x is None or y is None or y == 0 else x / y - 1


# --- printing ----------------------------------------------------------------------------------------
def _fmt(figure: dict, scale: float = 1.0, digits: int = 2) -> str:
    if figure["mean"] is None:
        return "n/a" + (f" ({figure['missing']} runs)" if figure.get("missing") else "")
    text = f"{figure['mean'] * scale:.{digits}f}"
    if figure["ci95"] is not None:
        text += f" ±{figure['ci95'] * scale:.{digits}f}"
    if figure.get("missing"):
        text += f" ({figure['missing']} n/a)"
    return text


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.1f} %"


def _paper(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def print_table(header: Sequence[object], rows: Sequence[Sequence[object]]) -> None:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).rjust(w) for cell, w in zip(row, widths)))


# --- experiments ---------------------------------------------------------------------------------------
@dataclass
class Context:
    seeds: tuple[int, ...]
    quick: bool
    jobs: int
    day: bool
    command: str
    rate: float | None = None  # --rate: requests/s per worker for the prototype tables
    fleets: tuple[int, ...] = ()  # --fleets: scale --day's fleet sizes (default DAY_FLEETS)


RATED = ("workers4", "workers8", "rack8")


def _rated(setup: Setup, ctx: Context) -> Setup:
    return setup if ctx.rate is None else replace(setup, rate_per_worker=ctx.rate)


def _window(setup: Setup) -> tuple[float, float]:
    return (setup.fault_at_s, setup.duration_s)


def _quick(setup: Setup, ctx: Context) -> Setup:
    """--quick: a shorter run, the fault a third of the way in as always."""
    return replace(setup, duration_s=30.0, fault_at_s=10.0) if ctx.quick else setup


def policy_table(setup: Setup, ctx: Context) -> dict:
    """document 000's prototype table for `setup`: every policy on every seed, with the paper's figures."""
    setup = _quick(setup, ctx)
    scenario = setup.scenario()
    jobs = [Job(p, scenario, p, seed, _window(setup)) for seed in ctx.seeds for p in POLICIES]
    runs = run_jobs(jobs, ctx.jobs)
    rows = {p: aggregate(runs, p) for p in POLICIES}
    paper = PAPER_PROTOTYPE.get(setup.name, {})
    ratios: dict[str, dict[str, dict[str, Any]]] = {}
    for a, b in (("lifeline", "load_aware"), ("lifeline", "none"), ("load_aware", "none"), ("load_aware", "fixed")):
        key = f"{a}_vs_{b}"
        printed = PAPER_RATIOS.get(setup.name, {}).get(key)
        ratios[key] = {
            name: {
                "ours": ratio(rows[a], rows[b], name),
                "ours_paired": paired(runs, a, b, name),
                "paper": None if printed is None else printed[i],
                "kind": "simulated (ours: ratio of the means; ours_paired: per seed); paper's as printed (input)",
            }
            for i, name in enumerate(("ttft_mean_s", "tpot_mean_s", "recovery_s"))
        }
    verdict = _verdict(runs, setup.name)
    print(
        f"\n{setup.name}: {setup.workers} × {setup.model} on {setup.tp}× {setup.gpu}, "
        f"{setup.rate_per_worker:g} req/s per worker, "
        + (f"rack-1 of {setup.racks} lost" if setup.racks else f"{setup.failed} worker(s) crashed")
        + f" at {setup.fault_at_s:g} s, "
        f"seeds {list(ctx.seeds)}"
    )
    header = ("policy", "TTFT s", "paper", "TPOT ms", "paper", "recovery s", "paper", "attain.", "intr", "restored")
    table = []
    for p in POLICIES:
        r, pp = rows[p], paper.get(p, (None, None, None))
        table.append(
            (
                p,
                _fmt(r["ttft_mean_s"]),
                _paper(pp[0]),
                _fmt(r["tpot_mean_s"], 1000, 0),
                _paper(pp[1], 1000, 0),
                _fmt(r["recovery_s"], 1, 1),
                _paper(pp[2], 1, 0),
                _fmt(r["attainment"], 100, 1),
                f"{r['interrupted']['mean']:.0f}",
                f"{r['restored']['mean']:.0f}",
            )
        )
    print_table(header, table)
    base = rows["none"]
    print(
        f"no-failure baseline (same window): TTFT {_fmt(base['baseline_ttft_s'])} s, TPOT "
        f"{_fmt(base['baseline_tpot_s'], 1000, 0)} ms"
        + (f"; paper {paper['baseline'][0]} s, {paper['baseline'][1] * 1000:.1f} ms" if "baseline" in paper else "")
    )
    for key, figures in ratios.items():
        parts = [
            f"{name.split('_')[0]} {_pct(v['ours'])} (paired {_fmt(v['ours_paired'], 100, 1)} %)"
            + ("" if v["paper"] is None else f" [paper {_pct(v['paper'])}]")
            for name, v in figures.items()
        ]
        print(f"  {key}: " + ", ".join(parts))
    for line in verdict:
        print(f"  {line}")
    return {
        "setup": setup.describe(),
        "policies": {p: {"ours": rows[p], "paper": _paper_row(paper.get(p))} for p in POLICIES},
        "paper_baseline": _paper_row(paper.get("baseline")),
        "ratios": ratios,
        "verdict": verdict,
        "runs": runs,
    }


def _paper_row(row: tuple | None) -> dict | None:
    if row is None:
        return None
    ttft, tpot, recovery = row
    return {
        "ttft_mean_s": ttft,
        "tpot_mean_s": tpot,
        "recovery_s": recovery,
        "kind": "input",
        "source": f"{PAPER}, LUMEN vs. Baselines: Prototype Results",
    }


def paired(runs: list[dict], a: str, b: str, name: str) -> dict:
    """a's figure over b's, less one, seed by seed (the same requests and faults), with its mean and 95 % CI: the
    seeds' spread in absolute level, which widens each policy's own interval, cancels out of a paired ratio."""
    by_seed = {(r["label"], r["seed"]): r[name] for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    return {**mean_ci([_seed_ratio(by_seed.get((a, s)), by_seed.get((b, s))) for s in seeds]), "kind": "simulated"}


def _seed_ratio(x: float | None, y: float | None) -> float | None:
    """x / y − 1; 0 when both are 0 (a 256-node fleet back at once under both policies); None when either is
    missing or only y is 0."""
    if x is None or y is None:
        return None
    if y == 0:
        return 0.0 if x == 0 else None
    return x / y - 1


def _verdict(runs: list[dict], where: str) -> list[str]:
    """Whether Lifeline beats LUMEN on mean TTFT and recovery time here, by the paired ratio over seeds and its CI."""
    lines = []
    for name, what in (("ttft_mean_s", "mean TTFT"), ("recovery_s", "recovery time")):
        r = paired(runs, "lifeline", "load_aware", name)
        if r["mean"] is None:
            lines.append(f"{where}: {what}: not comparable (no seed where both got back within the run)")
            continue
        ci = r["ci95"]
        sure = ci is not None and abs(r["mean"]) > ci
        hedge = "one seed, no CI" if ci is None else "within the 95 % CI"
        if abs(r["mean"]) < 0.0005:
            word = "ties"
        elif r["mean"] < 0:
            word = "beats" if sure else f"is lower than ({hedge})"
        else:
            word = "does NOT beat (worse beyond the 95 % CI)" if sure else f"does NOT beat (worse, {hedge})"
        spread = "" if ci is None else f" ± {ci * 100:.1f} %"
        lines.append(
            f"{where}: Lifeline {word} LUMEN on {what}: {r['mean'] * 100:+.1f} %{spread} paired over {r['n']} seeds"
        )
    return lines


def table1(ctx: Context) -> dict:
    """Stop-and-restart at 25 % failures, by cluster size, beside Table 1."""
    sizes = (4, 8, 16) if ctx.quick else TABLE1_SIZES
    seeds_for = {}
    jobs = []
    for n in sizes:
        # Larger fleets get fewer seeds and a shorter run: a 64-worker run takes minutes on this machine.
        seeds = ctx.seeds if n <= 16 else ctx.seeds[:1]
        setup = _quick(replace(WORKERS4, name=f"table1-{n}", workers=n, failed=n // 4), ctx)
        if n > 16 and not ctx.quick:
            setup = replace(setup, duration_s=60.0, fault_at_s=20.0)
        seeds_for[n] = (list(seeds), setup.describe())
        jobs += [Job(str(n), setup.scenario(), "none", seed, _window(setup)) for seed in seeds]
    runs = run_jobs(jobs, ctx.jobs)
    rows = {}
    print(
        f"\ntable1: stop-and-restart, 25 % of the workers crashed at once ({WORKERS4.model} on {WORKERS4.tp}× "
        f"{WORKERS4.gpu}, {WORKERS4.rate_per_worker:g} req/s per worker)"
    )
    header = ("workers", "seeds", "uninterrupted TTFT s", "paper", "replay TTFT s", "paper", "baseline TTFT s")
    table = []
    for n in sizes:
        agg = aggregate(runs, str(n))
        u, ue, rp, rpe = PAPER_TABLE1[n]
        rows[n] = {
            "ours": agg,
            "paper": {
                "uninterrupted_ttft_s": u,
                "uninterrupted_ci": ue,
                "replay_ttft_s": rp,
                "replay_ci": rpe,
                "kind": "input",
                "source": f"{PAPER}, Table 1",
            },
            "seeds": seeds_for[n][0],
            "setup": seeds_for[n][1],
        }
        table.append(
            (
                n,
                len(seeds_for[n][0]),
                _fmt(agg["uninterrupted_ttft_s"]),
                f"{u} ±{ue}",
                _fmt(agg["replay_ttft_s"]),
                f"{rp} ±{rpe}",
                _fmt(agg["baseline_ttft_s"]),
            )
        )
    print_table(header, table)
    return {"sizes": rows, "runs": runs}


ABLATIONS = {
    "lifeline": {},
    "no_load_aware_placement": {"load_aware_placement": False},
    "no_locality_dispatch": {"locality_dispatch": False},
    "no_second_holder": {"second_holder": False},
    "no_prefill_chunk_checkpoints": {"prefill_chunk_checkpoints": False},
    "no_draft_assist": {"draft_assist": False},
}
NOT_MODELLED: dict[str, str] = {}  # ablations the simulator cannot run (none since draft assist is modelled)


def ablations(ctx: Context) -> dict:
    """Lifeline less one mechanism at a time, and LUMEN, on the 4-worker setup (the 8-worker one would take twice
    the time on this machine)."""
    setup = _quick(WORKERS4, ctx)
    scenario = setup.scenario()
    jobs = [
        Job(name, scenario, "lifeline", seed, _window(setup), tuple(opts.items()))
        for seed in ctx.seeds
        for name, opts in ABLATIONS.items()
    ]
    jobs += [Job("load_aware (LUMEN)", scenario, "load_aware", seed, _window(setup)) for seed in ctx.seeds]
    runs = run_jobs(jobs, ctx.jobs)
    labels = [*ABLATIONS, "load_aware (LUMEN)"]
    rows = {label: aggregate(runs, label) for label in labels}
    print(f"\nablations: Lifeline on {setup.name} with one mechanism taken away ({setup.workers} × {setup.model})")
    header = (
        "variant",
        "TTFT s",
        "vs lifeline",
        "TPOT ms",
        "recovery s",
        "vs lifeline",
        "restored",
        "reprefilled",
        "drafts accepted*",
    )
    table = [
        (
            label,
            _fmt(r["ttft_mean_s"]),
            _pct(ratio(r, rows["lifeline"], "ttft_mean_s")),
            _fmt(r["tpot_mean_s"], 1000, 0),
            _fmt(r["recovery_s"], 1, 1),
            _pct(ratio(r, rows["lifeline"], "recovery_s")),
            f"{r['restored']['mean']:.1f}",
            f"{r['reprefilled']['mean']:.1f}",
            f"{r['accepted_tokens']['mean']:.0f} / {r['drafted_tokens']['mean']:.0f}",
        )
        for label, r in rows.items()
    ]
    print_table(header, table)
    model = catalog.model(setup.model)
    agreement = {
        "value": model.draft_agreement,
        "kind": f"input: workers.catalog's draft agreement of {model.key} with its draft {model.draft}, a model "
        "parameter, not measured",
    }
    print(
        f"  * modelled, not measured: drafted tokens each accepted at random with probability α = "
        f"{model.draft_agreement:g} ({agreement['kind']}), k = {ASSIST_K} per sequence"
    )
    for name, why in NOT_MODELLED.items():
        print(f"  {name}: not modelled ({why})")
    return {
        "setup": setup.describe(),
        "draft_assist": {"agreement": agreement, "k": ASSIST_K, "max_assisted": MAX_ASSISTED},
        "variants": {k: {"switches": ABLATIONS.get(k, {"policy": "load_aware"}), "ours": v} for k, v in rows.items()},
        "not_modelled": NOT_MODELLED,
        "runs": runs,
    }


THETA_FACTORS = (1.0, 2.0, 4.0)
TAUS = (128, 512, 2048)


def grid(ctx: Context) -> dict:
    setup = _quick(WORKERS4, ctx)
    scenario = setup.scenario()
    jobs = [
        Job(
            f"theta_factor={th:g} tau={tau}",
            scenario,
            "lifeline",
            seed,
            _window(setup),
            (("theta_factor", th), ("tau", tau)),
        )
        for seed in ctx.seeds
        for th in THETA_FACTORS
        for tau in TAUS
    ]
    runs = run_jobs(jobs, ctx.jobs)
    cells = {}
    print(
        f"\ngrid: Lifeline on {setup.name}, θ = theta_factor × normal queue depth, τ in tokens; "
        "mean TTFT s / recovery s"
    )
    header = ("theta_factor", *(f"tau={tau}" for tau in TAUS))
    table = []
    for th in THETA_FACTORS:
        line = [f"{th:g}"]
        for tau in TAUS:
            label = f"theta_factor={th:g} tau={tau}"
            cells[label] = aggregate(runs, label)
            line.append(f"{_fmt(cells[label]['ttft_mean_s'])} / {_fmt(cells[label]['recovery_s'], 1, 1)}")
        table.append(line)
    print_table(header, table)
    return {"setup": setup.describe(), "cells": cells, "runs": runs}


FABRICS: dict[str, dict[str, str] | str] = {
    # The checkpoint's link, through the scenario's fabric (workers.catalog.node_link): every worker in one
    # NVLink domain; each in its own server of one rack (InfiniBand through the leaf, the default); each in its
    # own rack (InfiniBand through the shared spine, a third of it).
    "nvlink_900GBps": {"rack": "rack-1", "nvl_domain": "nvl-1"},
    "leaf_infiniband_50GBps": {},
    "spine_infiniband_16.7GBps": "own-racks",
}
RATE_SCALES = (0.5, 1.0, 2.0)
SENSITIVITY_WORKERS = 8
SENSITIVITY_FAULTS = 2.0  # expected faults in the window at ×1 of the rate (the rate is raised to get them)


def sensitivity(ctx: Context) -> dict:
    """Checkpoint bandwidth (fabric layouts) on the 4-worker setup; the fault rate on an 8-worker fleet."""
    setup = _quick(WORKERS4, ctx)
    jobs = []
    for name, fabric in FABRICS.items():
        scenario = _own_racks(setup) if isinstance(fabric, str) else replace(setup, fabric=fabric).scenario()
        jobs += [
            Job(f"{name}/{p}", scenario, p, seed, _window(setup))
            for seed in ctx.seeds
            for p in ("load_aware", "lifeline")
        ]
    fleet = _quick(
        replace(WORKERS4, name="rate", workers=SENSITIVITY_WORKERS, failed=0, duration_s=60.0, fault_at_s=0.0), ctx
    )
    compress = SENSITIVITY_FAULTS / (FAULTS_PER_1000_NODE_DAYS / 1000 * fleet.workers * fleet.duration_s / DAY_S)
    for scale in RATE_SCALES:
        scenario = fleet.scenario(fault_rate=FAULTS_PER_1000_NODE_DAYS * compress * scale)
        jobs += [
            Job(f"rate×{scale:g}/{p}", scenario, p, seed, (0.0, fleet.duration_s))
            for seed in ctx.seeds
            for p in ("load_aware", "lifeline")
        ]
    runs = run_jobs(jobs, ctx.jobs)
    labels = list(dict.fromkeys(r["label"] for r in runs))
    rows = {label: aggregate(runs, label) for label in labels}
    print(
        f"\nsensitivity: checkpoint link bandwidth (4 workers) and fault rate ({SENSITIVITY_WORKERS} workers, "
        "whole-run figures)"
    )
    header = ("variant", "TTFT s", "TPOT ms", "recovery s", "attain. %", "faults", "restored", "reprefilled")
    print_table(
        header,
        [
            (
                label,
                _fmt(r["ttft_mean_s"]),
                _fmt(r["tpot_mean_s"], 1000, 0),
                _fmt(r["recovery_s"], 1, 1),
                _fmt(r["attainment"], 100, 1),
                f"{r['faults']['mean']:.1f}",
                f"{r['restored']['mean']:.1f}",
                f"{r['reprefilled']['mean']:.1f}",
            )
            for label, r in rows.items()
        ],
    )
    return {
        "bandwidth_setup": setup.describe(),
        "fabrics": {k: v if v != "own-racks" else "every worker in its own rack" for k, v in FABRICS.items()},
        "rate_setup": fleet.describe(),
        "rate": {
            "base_per_1000_node_days": FAULTS_PER_1000_NODE_DAYS,
            "compression": compress,
            "kind": "modelled: the rate is raised ×compression so that the window holds "
            f"{SENSITIVITY_FAULTS:g} expected faults at ×1; outages are StepFun's (longer than the window)",
        },
        "rows": rows,
        "runs": runs,
    }


def _own_racks(setup: Setup) -> Scenario:
    """`setup` with each worker in its own rack: every checkpoint crosses the spine."""
    base = setup.scenario()
    groups = [replace(base.fleet[0], name=f"w{i}", count=1, rack=f"rack-{i}") for i in range(1, setup.workers + 1)]
    faults = tuple(replace(f, target=f"w{f.target.split('-')[1]}-1") for f in base.scripted_faults)
    return replace(base, fleet=tuple(groups), scripted_faults=faults)


SCALE_POLICIES = ("none", "load_aware", "lifeline")


def scale(ctx: Context) -> dict:
    """Faults drawn from the rate on a large fleet: with --day, days of 256 and 1,000 nodes composed from simulated
    windows (`day_at_scale`); else a short window holding a day's expected faults (modelled, clearly labelled)."""
    if ctx.day:
        return day_at_scale(ctx)
    n, window = (32, 10.0) if ctx.quick else (256, 10.0)
    fleet = replace(WORKERS4, name=f"scale-{n}", workers=n, failed=0, duration_s=window, fault_at_s=0.0)
    compress = DAY_S / window
    rate = FAULTS_PER_1000_NODE_DAYS * compress
    kind = (
        f"modelled: {window:g} s window, the rate raised ×{compress:g} so it holds a day's expected "
        f"faults ({FAULTS_PER_1000_NODE_DAYS * n / 1000:g}); --day composes whole days of 256 and 1,000 nodes "
        "from simulated windows instead"
    )
    scenario = fleet.scenario(fault_rate=rate)
    jobs = [Job(p, scenario, p, seed, (0.0, fleet.duration_s)) for seed in ctx.seeds for p in SCALE_POLICIES]
    runs = run_jobs(jobs, ctx.jobs)
    rows = {p: aggregate(runs, p) for p in SCALE_POLICIES}
    print(f"\nscale: {fleet.workers} workers, {fleet.duration_s:g} s, faults at {rate:g} per 1,000 node-days ({kind})")
    print_table(
        ("policy", "TTFT s", "TPOT ms", "recovery s", "attain. %", "faults", "interrupted"),
        [
            (
                p,
                _fmt(r["ttft_mean_s"]),
                _fmt(r["tpot_mean_s"], 1000, 0),
                _fmt(r["recovery_s"], 1, 1),
                _fmt(r["attainment"], 100, 2),
                f"{r['faults']['mean']:.1f}",
                f"{r['interrupted']['mean']:.1f}",
            )
            for p, r in rows.items()
        ],
    )
    return {
        fleet.name: {
            "setup": fleet.describe(),
            "per_1000_node_days": rate,
            "kind": kind,
            "rows": rows,
            "verdict": _verdict(runs, fleet.name),
            "runs": runs,
        }
    }


# --- a day at scale, composed from simulated windows -----------------------------------------------------
DAY_FLEETS = (256, 1000)
WARM_S = 5.0  # a window's arrivals before its fault: the batches fill (figures are over arrivals from here on)
# A window's arrivals after its fault: past the fault's detection (a crash 9 ms, a hang the 3 s heartbeat miss, a
# corruption up to a canary round of 30 s and its retries: recovery.sim.faults.DetectionDefaults) and the moves.
AFTER_S = {"crash": 10.0, "gpu_lost": 10.0, "hang": 15.0, "sdc": 45.0}
STEADY_S = 15.0  # a steady window's arrivals (no fault), its figures over those from WARM_S on


@dataclass(frozen=True)
class DayFault:
    """One fault of a drawn day, and how many of the fleet's nodes were already out when it struck."""

    at_s: float
    kind: str
    outage_s: float
    out_before: int


def draw_day(nodes: int, seed: int) -> list[DayFault]:
    """A day of faults on `nodes` nodes at the rate (recovery.sim.faults.FaultRates: 4 per 1,000 node-days, the
    Meta Llama 3 mix of kinds, StepFun's outages), each with the count of nodes still out when it struck."""
    drawn = FaultRates().draw([f"n-{i}" for i in range(nodes)], (), DAY_S, f"day:{seed}")
    return [
        DayFault(f.at_s, f.kind, f.repair_s or math.inf, sum(1 for g in drawn[:i] if g.back_at_s > f.at_s))
        for i, f in enumerate(drawn)
    ]


def stretches(faults: Sequence[DayFault]) -> list[tuple[float, int]]:
    """The day cut where a node fails or comes back: (seconds, nodes out) of each stretch, in order."""
    changes = sorted(
        [(f.at_s, 1) for f in faults] + [(f.at_s + f.outage_s, -1) for f in faults if f.at_s + f.outage_s < DAY_S]
    )
    out, last, pieces = 0, 0.0, []
    for at, step in [*changes, (DAY_S, 0)]:
        if at > last:
            pieces.append((at - last, out))
        out, last = out + step, at
    return pieces


def _window_setup(nodes: int, out: int, fault: DayFault | None) -> Setup:
    """The fleet with `out` nodes already out, carrying the whole fleet's load, and `fault` (if any) at WARM_S."""
    serving = nodes - out
    base = replace(
        WORKERS4,
        name=f"day-{nodes}",
        workers=serving,
        rate_per_worker=WORKERS4.rate_per_worker * nodes / serving,
        fault_at_s=WARM_S,
    )
    if fault is None:
        return replace(base, failed=0, duration_s=STEADY_S)
    # The outage outlasts the window (StepFun's median is 22 h): the node does not come back within it.
    repair = None if math.isinf(fault.outage_s) else fault.outage_s  # None: out for the rest of the run
    return replace(base, duration_s=WARM_S + AFTER_S[fault.kind], fault_kind=fault.kind, repair_s=repair)


def _sums(faulted: Simulation, baseline: Simulation, window: tuple[float, float]) -> dict:
    """What a window adds to a day: the TTFT samples as summarise counts them (arrivals in the window that no fault
    cut off, and every interrupted request's replay) and the SLO misses of the faulted run, beside the baseline's
    (the same requests, no fault): arrivals in the window and all misses."""
    start, end = window
    objective = default_for(faulted.scenario.fleet[0].model, "standard")
    ttft_limit, tpot_limit = objective.ttft_ms / 1000, objective.tpot_ms / 1000

    def missed(r) -> bool:
        ttft = math.inf if r.ttft_s is None else max(r.ttft_s, r.stall_s or 0.0)
        return not (
            ttft <= ttft_limit and (r.tpot_s is None or r.tpot_s <= tpot_limit) and r.emitted == r.output_tokens
        )

    rows = [request_metrics(f) for f in faulted.flights]
    base = [request_metrics(f) for f in baseline.flights]
    samples = [r.ttft_s for r in rows if start <= r.arrival_s < end and r.ttft_s is not None and not r.interrupted]
    samples += [r.stall_s for r in rows if r.interrupted and r.stall_s is not None]
    base_samples = [r.ttft_s for r in base if start <= r.arrival_s < end and r.ttft_s is not None]
    return {
        "ttft_sum": sum(samples),
        "ttft_count": len(samples),
        "base_ttft_sum": sum(base_samples),
        "base_ttft_count": len(base_samples),
        "missed": sum(map(missed, rows)),
        "base_missed": sum(map(missed, base)),
    }


def compose_day(
    nodes: int, faults: Sequence[DayFault], steady: dict[int, dict], windows: Sequence[dict], rate_per_s: float
) -> dict:
    """One day's figures from its simulated windows (modelled: arithmetic on simulated runs, nothing ran a day).

    Each stretch between changes carries rate × seconds requests at the steady figures simulated with as many nodes
    out (`steady[out]`: ttft_mean_s and attainment of a no-fault window); each fault adds what its window simulated
    beyond that window's own no-fault baseline on the same requests (TTFT samples, the interrupted requests'
    replays among them, and SLO misses). Per-fault figures (interruptions, replay TTFT, recovery time, how each
    request was recovered) are the windows' own, summed or averaged over the day's faults."""
    requests = ttft_sum = missed = 0.0
    for seconds, out in stretches(faults):
        count = rate_per_s * seconds
        requests += count
        ttft_sum += count * steady[out]["ttft_mean_s"]
        missed += count * (1 - steady[out]["attainment"])
    samples = requests
    for w, fault in zip(windows, faults, strict=True):
        ttft_sum += w["ttft_sum"] - w["base_ttft_sum"]
        samples += w["ttft_count"] - w["base_ttft_count"]
        missed += w["missed"] - w["base_missed"]
        # The window's requests after the fault are in the stretch that begins with it too, at the steady figures
        # of one node more out: what that node's loss costs them is in the window's excess already.
        before, after = steady.get(fault.out_before), steady.get(fault.out_before + 1)
        if before and after:
            ttft_sum -= w["base_ttft_count"] * (after["ttft_mean_s"] - before["ttft_mean_s"])
            missed -= w["base_ttft_count"] * (before["attainment"] - after["attainment"])
    interrupted = sum(w["interrupted"] for w in windows)
    replays = [(w["replay_ttft_s"], w["interrupted"]) for w in windows if w["replay_ttft_s"] is not None]
    recoveries = [w["recovery_s"] for w in windows]
    return {
        "ttft_mean_s": ttft_sum / samples,
        "attainment": max(0.0, 1 - missed / requests),
        "requests": requests,
        "faults": len(faults),
        "node_hours_out": sum(out * seconds for seconds, out in stretches(faults)) / 3600,
        "interrupted": interrupted,
        "restored": sum(w["restored"] for w in windows),
        "fetched": sum(w["fetched"] for w in windows),
        "reprefilled": sum(w["reprefilled"] for w in windows),
        "replay_ttft_s": sum(r * k for r, k in replays) / sum(k for _, k in replays) if replays else None,
        "recovery_s": statistics.fmean(recoveries) if recoveries and None not in recoveries else None,
        "unrecovered_faults": sum(1 for r in recoveries if r is None),
    }


DAY_FIGURES = (
    "ttft_mean_s",
    "attainment",
    "faults",
    "node_hours_out",
    "interrupted",
    "restored",
    "fetched",
    "reprefilled",
    "replay_ttft_s",
    "recovery_s",
    "unrecovered_faults",
    "requests",
)


def day_at_scale(ctx: Context) -> dict:
    """256 and 1,000 nodes over simulated days at the rate, one day per seed, every policy on the same days.

    A day of a 1,000-node fleet is 600 million requests, two days of this machine's core for each policy; what a
    day holds that matters to recovery is a handful of faults. So each drawn fault is run as a window of its own
    (the fleet with the nodes already out that the day had out then, carrying the whole fleet's load, the fault
    WARM_S in, arrivals until its detection and moves are long past), each count of nodes out that the days reach
    as a no-fault window, and every policy on the same windows and requests; `compose_day` adds them up. The
    windows are simulated; the day is modelled from them, and is labelled so."""
    fleets = ctx.fleets or ((32,) if ctx.quick else DAY_FLEETS)
    out: dict = {}
    for nodes in fleets:
        days = {seed: draw_day(nodes, seed) for seed in ctx.seeds}
        outs = sorted({o for faults in days.values() for _, o in stretches(faults)})
        jobs = []
        for p in SCALE_POLICIES:
            for o in outs:
                setup = _window_setup(nodes, o, None)
                # The steady windows' requests: the first seed's (seed 1 by default; --first-seed moves them too).
                steady_seed = ctx.seeds[0]
                jobs.append(Job(f"{p}/steady/{o}", setup.scenario(), p, steady_seed, (WARM_S, setup.duration_s)))
            for seed, faults in days.items():
                for i, f in enumerate(faults):
                    setup = _window_setup(nodes, f.out_before, f)
                    # Each fault's window its own draw of requests: two faults of a kind with as many nodes out
                    # would otherwise be the same run twice.
                    window_seed = seed * 1000 + i
                    jobs.append(Job(f"{p}/{seed}/{i}", setup.scenario(), p, window_seed, (WARM_S, setup.duration_s)))
        windows = dict(zip((j.label for j in jobs), run_jobs(jobs, ctx.jobs, partial(run_job, sums=True))))
        rate_per_s = WORKERS4.rate_per_worker * nodes
        runs = []
        for p in SCALE_POLICIES:
            steady = {o: windows[f"{p}/steady/{o}"] for o in outs}
            for seed, faults in days.items():
                mine = [windows[f"{p}/{seed}/{i}"] for i in range(len(faults))]
                runs.append(
                    {"label": p, "policy": p, "seed": seed, **compose_day(nodes, faults, steady, mine, rate_per_s)}
                )
        rows = {
            p: {
                name: {**mean_ci([r[name] for r in runs if r["label"] == p]), "kind": "modelled"}
                for name in DAY_FIGURES
            }
            for p in SCALE_POLICIES
        }
        print(
            f"\nscale --day: {nodes} nodes, {len(days)} days, {FAULTS_PER_1000_NODE_DAYS:g} faults per 1,000 node-days"
        )
        print_table(
            ("policy", "TTFT s", "attain. %", "faults", "interrupted", "replay TTFT s", "recovery s", "re-prefilled"),
            [
                (
                    p,
                    _fmt(r["ttft_mean_s"], 1, 4),
                    _fmt(r["attainment"], 100, 4),
                    f"{r['faults']['mean']:.1f}",
                    f"{r['interrupted']['mean']:.1f}",
                    _fmt(r["replay_ttft_s"], 1, 3),
                    _fmt(r["recovery_s"], 1, 1),
                    f"{r['reprefilled']['mean']:.1f}",
                )
                for p, r in rows.items()
            ],
        )
        out[f"day-{nodes}"] = {
            "setup": replace(WORKERS4, name=f"day-{nodes}", workers=nodes).describe(),
            "per_1000_node_days": FAULTS_PER_1000_NODE_DAYS,
            "kind": (
                "modelled: each day composed from simulated windows (compose_day); "
                "the windows' own figures are simulated"
            ),
            "window": {"warm_s": WARM_S, "after_s": AFTER_S, "steady_s": STEADY_S},
            "days": {seed: [asdict(f) for f in faults] for seed, faults in days.items()},
            "rows": rows,
            "verdict": _verdict(runs, f"day-{nodes}") + _replay_verdict(runs, f"day-{nodes}"),
            "runs": runs,
            "windows": windows,
        }
    return out


def _replay_verdict(runs: list[dict], where: str) -> list[str]:
    """Where a day's mean TTFT cannot tell the policies apart, the interrupted requests' wait can."""
    r = paired(runs, "lifeline", "load_aware", "replay_ttft_s")
    if r["mean"] is None:
        return [f"{where}: replay TTFT: not comparable (no day with an interrupted request)"]
    ci = r["ci95"]
    spread = "" if ci is None else f" ± {ci * 100:.1f} %"
    hedge = "one day, no CI" if ci is None else "" if abs(r["mean"]) > ci else "within the 95 % CI"
    return [
        f"{where}: Lifeline's replay TTFT against LUMEN's: {r['mean'] * 100:+.1f} %{spread} paired over {r['n']} days "
        f"({'worse' if r['mean'] > 0 else 'better'}{', ' + hedge if hedge else ''})"
    ]


# --- resuming where the next token comes soonest (an experiment) ---------------------------------------
RESUME_VARIANTS = {  # label: (policy, Simulation options)
    "load_aware": ("load_aware", ()),
    "lifeline": ("lifeline", ()),
    "lifeline+soonest": ("lifeline", (("resume", "soonest"),)),
}


def resume(ctx: Context, setups: Sequence[Setup] = ()) -> dict:
    """Eq. 6 against recovery.plan_soonest (each lost request resumed where its next token comes soonest by the
    routing cost), on document 000's two setups and on a 64-node fleet losing a TP group: mean TTFT, recovery time
    and the interrupted requests' replay TTFT, each paired against LUMEN's seed by seed."""
    window64 = replace(_window_setup(64, 0, DayFault(0.0, "gpu_lost", math.inf, 0)), name="gpu-lost-64")
    out: dict = {}
    for setup in setups or (_quick(WORKERS4, ctx), _quick(WORKERS8, ctx), window64):
        scenario = setup.scenario()
        jobs = [
            Job(label, scenario, policy, seed, _window(setup), options)
            for seed in ctx.seeds
            for label, (policy, options) in RESUME_VARIANTS.items()
        ]
        runs = run_jobs(jobs, ctx.jobs)
        rows = {label: aggregate(runs, label) for label in RESUME_VARIANTS}
        against = {
            label: {
                name: paired(runs, label, "load_aware", name) for name in ("ttft_mean_s", "recovery_s", "replay_ttft_s")
            }
            for label in ("lifeline", "lifeline+soonest")
        }
        print(f"\nresume: {setup.name}, {setup.workers} workers, seeds {list(ctx.seeds)}")
        print_table(
            ("variant", "TTFT s", "recovery s", "replay TTFT s", "restored", "fetched", "re-prefilled"),
            [
                (
                    label,
                    _fmt(r["ttft_mean_s"]),
                    _fmt(r["recovery_s"], 1, 1),
                    _fmt(r["replay_ttft_s"], 1, 3),
                    f"{r['restored']['mean']:.1f}",
                    f"{r['fetched']['mean']:.1f}",
                    f"{r['reprefilled']['mean']:.1f}",
                )
                for label, r in rows.items()
            ],
        )
        for label, figures in against.items():
            print(f"  {label} vs load_aware: " + ", ".join(f"{k} {_fmt(v, 100, 1)} %" for k, v in figures.items()))
        out[setup.name] = {"setup": setup.describe(), "rows": rows, "vs_load_aware": against, "runs": runs}
    return out


# --- spares -------------------------------------------------------------------------------------------
SPARE_FLEETS = (16, 64, 256, 1000)
PROBE_WORKERS = 8
LOAD_STEPS = (1.0, 1.05, 1.15, 1.33, 1.6)  # per-worker load relative to the setup's rate, for A(load)
# The fleets' own loads: the setup's 7 req/s per worker (78 % of saturation), and ×1.15 of it (90 %).
NOMINAL_LOADS = (1.0, 1.15)
DAYS = 400  # fault timelines drawn per fleet
SLO_TARGET = 0.99  # share of requests within their objectives: the objectives are p99s


def spares(ctx: Context) -> dict:
    """Hot spares against a day's SLO attainment and GPU-hours, per fleet and per nominal load.

    A day of a 1,000-node fleet cannot be simulated here, so the curve is modelled from simulated pieces:
    - A(x): attainment of a PROBE_WORKERS-worker fleet with no faults at x × the setup's per-worker rate
      (simulated), linear between the simulated loads: a fleet of N at nominal load m with f nodes out and no spare
      in their place runs at m × N / (N − f) per worker, and is taken to attain what the probe does at that load;
    - the transient of one crash at load x: requests missing their objective in the probe's faulted run and not in
      its baseline (simulated with Lifeline), linear between the simulated loads, once per fault, spare or not. On
      the probe a crash loses an eighth of the fleet, more than one node of a larger fleet: an upper bound there;
    - the faults of a day: drawn DAYS times from recovery.sim.faults.FaultRates (4 per 1,000 node-days, StepFun
      outages); each spare takes the place of a node that is out until that node is back (spares taken not to
      fail themselves).
    The day's attainment is then the time-weighted A over the day, less the transients, over a day's requests."""
    probe = replace(WORKERS4, name="spares-probe", workers=PROBE_WORKERS, duration_s=60.0, fault_at_s=20.0)
    probe = _quick(probe, ctx)
    loads = (1.0, 1.33) if ctx.quick else LOAD_STEPS
    jobs = [
        Job(
            f"load×{x:g}",
            replace(probe, rate_per_worker=probe.rate_per_worker * x).scenario(),
            "lifeline",
            seed,
            _window(probe),
        )
        for seed in ctx.seeds
        for x in loads
    ]
    runs = run_jobs(jobs, ctx.jobs)
    attain = {x: aggregate(runs, f"load×{x:g}") for x in loads}
    steady = [(x, attain[x]["baseline_attainment"]["mean"]) for x in loads]  # the no-fault run of each load
    transient = [
        (x, max(0.0, a["baseline_attainment"]["mean"] - a["attainment"]["mean"]) * a["requests"]["mean"])
        for x, a in attain.items()
    ]
    d = catalog.Deployment.of(probe.model, probe.gpu, probe.tp)
    fleets = (16, 64) if ctx.quick else SPARE_FLEETS
    curves = {}
    print(
        f"\nspares: {probe.model} on {probe.tp}× {probe.gpu}, {probe.rate_per_worker:g} req/s per worker at ×1; "
        f"A(load) simulated on {PROBE_WORKERS} workers: " + ", ".join(f"×{x:g} {a * 100:.2f} %" for x, a in steady)
    )
    print("  one crash costs, beyond the baseline's misses: " + ", ".join(f"×{x:g} {m:.0f}" for x, m in transient))
    for n in fleets:
        days = _days(n, DAYS // 4 if ctx.quick else DAYS)
        faults_per_day = statistics.fmean(len(f) for f in days)
        for load in NOMINAL_LOADS:
            per_day = probe.rate_per_worker * load * n * DAY_S
            missed = _interpolate(transient, load)
            curve: list[dict[str, Any]] = []
            for s in range(0, _max_spares(n) + 1):
                daily = sorted(_day_attainment(n, s, faults, steady, missed, per_day, load) for faults in days)
                curve.append(
                    {
                        "spares": s,
                        "attainment_mean": statistics.fmean(daily),
                        "attainment_p5_day": daily[len(daily) // 20],
                        "gpu_hours_per_day": (n + s) * d.tp * 24,
                        "spare_gpu_hours_per_day": s * d.tp * 24,
                        "kind": "modelled (from simulated A(load) and transients, and drawn fault days)",
                    }
                )
            enough = next((c["spares"] for c in curve if c["attainment_p5_day"] >= SLO_TARGET), None)
            curves[f"{n} nodes at ×{load:g}"] = {
                "nodes": n,
                "load": load,
                "rate_per_worker": probe.rate_per_worker * load,
                "faults_per_day_mean": faults_per_day,
                "missed_requests_per_fault": missed,
                "curve": curve,
                "spares_for_slo": enough,
                "slo_target": SLO_TARGET,
            }
            print(
                f"  {n} nodes at ×{load:g} ({faults_per_day:.2f} faults a day): "
                + "; ".join(
                    f"{c['spares']}: {c['attainment_mean'] * 100:.3f} % mean, "
                    f"{c['attainment_p5_day'] * 100:.3f} % worst 5 %, {c['gpu_hours_per_day']:,} GPU-h"
                    for c in curve
                )
                + f" -> spares for ≥ {SLO_TARGET:.0%} on 95 % of days: "
                + ("more than tried" if enough is None else str(enough))
            )
    objective = default_for(probe.model, "standard")
    return {
        "probe": probe.describe(),
        "objective": {**asdict(objective), "kind": "input (recovery.policy.slo.default_for, standard tier)"},
        "attainment_by_load": {f"{x:g}": attain[x]["baseline_attainment"] for x in loads},
        "missed_requests_per_fault_by_load": {
            f"{x:g}": {"value": m, "kind": "simulated (probe fleet, Lifeline)"} for x, m in transient
        },
        "nominal_loads": {"values": NOMINAL_LOADS, "kind": "input (× the setup's per-worker rate)"},
        "fleets": curves,
        "method": spares.__doc__,
        "runs": runs,
    }


def _max_spares(nodes: int) -> int:
    return max(3, math.ceil(nodes * 0.01) + 2)


def _days(nodes: int, count: int) -> list[list[tuple[float, float]]]:
    """`count` days of (fault time, outage) on `nodes` nodes at the rate, each day its own seed."""
    names = [f"n-{i}" for i in range(nodes)]
    rates = FaultRates()
    return [
        [(f.at_s, f.repair_s or math.inf) for f in rates.draw(names, (), DAY_S, f"spares:{day}")]
        for day in range(count)
    ]


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """A figure at load x from (load, figure) points, linear between them; past either end, the end's."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, a0), (x1, a1) in zip(points, points[1:]):
        if x <= x1:
            return a0 + (a1 - a0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def _day_attainment(
    nodes: int,
    spares_: int,
    faults: list[tuple[float, float]],
    steady: list[tuple[float, float]],
    missed_per_fault: float,
    per_day: float,
    load: float = 1.0,
) -> float:
    """One day's attainment at nominal `load`: each stretch between changes at the load its serving nodes carry."""
    changes = sorted([(at, +1) for at, _ in faults] + [(at + out, -1) for at, out in faults if at + out < DAY_S])
    out, last, total = 0, 0.0, 0.0
    for at, step in [*changes, (DAY_S, 0)]:
        serving = nodes - max(0, out - spares_)
        total += (at - last) * (_interpolate(steady, load * nodes / serving) if serving > 0 else 0.0)
        out, last = out + step, at
    return max(0.0, total / DAY_S - missed_per_fault * len(faults) / per_day)


# --- the CLI --------------------------------------------------------------------------------------------
RUNNERS: dict[str, Callable[[Context], dict]] = {
    "table1": table1,
    "workers4": lambda ctx: policy_table(_rated(WORKERS4, ctx), ctx),
    "workers8": lambda ctx: policy_table(_rated(WORKERS8, ctx), ctx),
    "rack8": lambda ctx: policy_table(_rated(RACK8, ctx), ctx),
    "ablations": ablations,
    "grid": grid,
    "sensitivity": sensitivity,
    "scale": scale,
    "spares": spares,
    "resume": resume,
}


def write(name: str, ctx: Context, body: dict, wall_s: float, out_dir: Path = RESULTS) -> Path:
    data = {
        "experiment": name,
        "command": ctx.command,
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seeds": list(ctx.seeds),
        "quick": ctx.quick,
        "wall_s": round(wall_s, 1),
        "kinds": {
            "simulated": "produced by the simulator runs of this command",
            "modelled": "arithmetic on simulated figures and drawn fault timelines",
            "input": "document 000's figures, and the setups we chose where it is silent",
        },
        "differences_from_paper": DIFFERENCES,
        "definitions": __doc__.split("Definitions, per run")[1].split("\n", 2)[2].strip(),
        **body,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if ctx.rate is None or name not in RATED else f"_rate{ctx.rate:g}"
    if name == "scale" and ctx.day:  # each fleet size's days in a file of their own: they take hours
        suffix = "_day_" + "_".join(map(str, ctx.fleets or DAY_FLEETS))
    path = out_dir / f"lumen_{name}{suffix}.json"
    path.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None, out_dir: Path = RESULTS) -> int:
    parser = argparse.ArgumentParser(prog="python -m recovery.sim.lumen", description="Document 000 reproduced.")
    parser.add_argument("experiment", choices=(*EXPERIMENTS, "all"))
    parser.add_argument("--seeds", type=int, default=3, help="seeds per variant (default 3)")
    parser.add_argument(
        "--first-seed",
        type=int,
        default=1,
        help="the first seed: seeds S..S+N-1 (default 1; constants were tuned on seeds 1-3, so 101 evaluates apart "
        "from them)",
    )
    parser.add_argument("--quick", action="store_true", help="short runs and fewer sizes: a smoke test")
    parser.add_argument("--jobs", type=int, default=1, help="processes to run seeds in (default 1)")
    parser.add_argument(
        "--day", action="store_true", help="scale: days of 256 and 1,000 nodes composed from simulated windows (slow)"
    )
    parser.add_argument("--fleets", help="scale --day: fleet sizes, comma-separated (default 256,1000)")
    parser.add_argument(
        "--rate",
        type=float,
        help="workers4, workers8: requests/s per worker instead of the setup's (results in lumen_<name>_rate<R>.json)",
    )
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if args.first_seed < 1:
        parser.error("--first-seed must be at least 1")
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    if args.rate is not None and not 0 < args.rate <= 1000:
        parser.error("--rate must be above 0 and at most 1000 requests/s per worker")
    try:
        fleets = tuple(int(n) for n in args.fleets.split(",")) if args.fleets else ()
    except ValueError:
        parser.error(f"--fleets takes node counts separated by commas, such as 256,1000; got {args.fleets!r}")
    if any(not 8 <= n <= 4096 for n in fleets):
        parser.error(f"--fleets: each fleet from 8 to 4096 nodes; got {args.fleets!r}")
    ctx = Context(
        tuple(range(args.first_seed, args.first_seed + args.seeds)),
        args.quick,
        args.jobs,
        args.day,
        f"python -m recovery.sim.lumen {argv_text}",
        args.rate,
        fleets,
    )
    for name in EXPERIMENTS if args.experiment == "all" else (args.experiment,):
        started = time.perf_counter()
        body = RUNNERS[name](ctx)
        path = write(name, ctx, body, time.perf_counter() - started, out_dir)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
