"""The docs' figures, rendered from the results files, never typed (issue 42).

Every block of the Markdown between `<!-- results:NAME -->` and `<!-- /results:NAME -->` (inline, in a table's cell,
or on lines of its own around a table) is what BLOCKS[NAME] renders from `benchmarks/results/`. Each figure says its
kind (measured, simulated, modelled, input: harness.provenance.KINDS) and each block names its results file, the
commit it was run on and the date.

    python -m benchmarks.render          rewrite every block from the results
    python -m benchmarks.render --check  list the blocks that differ from the results (exit 1); the suite runs it
"""

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(r"<!-- results:(?P<name>[\w-]+) -->(?P<body>.*?)<!-- /results:(?P=name) -->", re.S)


def documents() -> list[Path]:
    """The Markdown that may hold blocks: the README, the site's pages and the benchmarks' notebook."""
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def results(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def source(name: str) -> str:
    """Where a block's figures come from: the file, and the commit and date of its run (or of its rescoring)."""
    data = results(name)
    record = data.get("provenance") or {}
    commit = record["commit"][:7] if record.get("commit") else "an unrecorded commit"
    if record.get("dirty"):
        commit += ", with uncommitted changes"
    date = _run_date(data)
    date = "on an unrecorded date" if date == "undated" else date
    how = "rescored" if record.get("rescored") else "relabelled"
    redone = record.get(how)
    extra = f"; {how} {redone['date'][:10]} at {redone['commit'][:7]}" if redone else ""
    return f"`benchmarks/results/{name}.json`, run {date} at {commit}{extra}"


def _run_date(data: dict) -> str:
    """The day a results file was run: its provenance record's, or (a file written before harness.provenance) the
    date the benchmark wrote beside its figures."""
    record = data.get("provenance") or {}
    return (record.get("date") or data.get("measured_at") or data.get("generated_at") or "undated")[:10]


def cite(name: str) -> str:
    """A short form of source() for a table's cell: the file, the day of its run and its commit."""
    data = results(name)
    record = data.get("provenance") or {}
    commit = record["commit"][:7] if record.get("commit") else "commit not recorded"
    if record.get("dirty"):
        commit += ", uncommitted changes"
    return f"`{name}.json` ({_run_date(data)}, {commit})"


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


# --- placement -------------------------------------------------------------------------------------------------


def _placement_short(name: str) -> str:
    return {"Lifeline planner": "planner", "LLMFabric (published)": "LLMFabric"}.get(name, name)


def placement_summary() -> str:
    table1 = results("placement")["table1"]
    sweep = table1["load_sweep"]
    parts = []
    for row in sweep:
        att = row["mean_attainment"]
        memp = sorted(att[k] for k in att if k.startswith("memP"))
        parts.append(
            f"at {100 * row['share_of_fleet_capacity']:.0f} % of the fleet's capacity: "
            f"planner {pct(att['Lifeline planner'])}, "
            f"LLMFabric {pct(att['LLMFabric (published)'])}, memP {pct(memp[0])}–{pct(memp[-1])} "
            f"(the planner's lead over the best other: {row['planner_lead_over_best_other']['points']:g} points)"
        )
    return (
        "share of requests within objectives, mean of the models (simulated), on one offered load set from the "
        "fleet's capacity without any placement (modelled): "
        + "; ".join(parts)
        + f". The judge is the simulator on the roofline the planner plans with. Source: {source('placement')}"
    )


def placement_table1() -> str:
    table1 = results("placement")["table1"]
    models = [d["model"] for d in table1["demands"]]
    rates = ", ".join(f"{d['model']} {d['rate_rps']:g} req/s" for d in table1["demands"])
    lines = [
        "",
        f"Offered load (modelled, {100 * table1['offered_load']['share']:.0f} % of the fleet's placement-free "
        "capacity, "
        f"{table1['rate_scale']:.3f} × the published rates): {rates}. Every figure below is simulated; "
        f"{source('placement')}.",
        "",
        "| placement | " + " | ".join(models) + " | within objectives (mean) | req/s |",
        "|---" * (len(models) + 3) + "|",
    ]
    for name, row in table1["placements"].items():
        cells = []
        for model in models:
            figures = row["models"][model]
            cells.append(
                f"{row['placement'].get(model, '—')}: {pct(figures['attainment'])}, "
                f"TTFT p99 {figures['ttft_p99_s'] * 1000:,.0f} ms"
            )
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {pct(row['mean_attainment'])} | {row['throughput_rps']:.1f} |"
        )
    lines.append("")
    return "\n".join(lines)


def placement_sweep() -> str:
    sweep = results("placement")["table1"]["load_sweep"]
    names = list(sweep[0]["mean_attainment"])
    lines = [
        "",
        "| share of the fleet's capacity (input) | "
        + " | ".join(names)
        + " | the planner's lead over the best other (points) |",
        "|---" * (len(names) + 2) + "|",
    ]
    for row in sweep:
        att = row["mean_attainment"]
        lead = row["planner_lead_over_best_other"]
        lines.append(
            f"| {100 * row['share_of_fleet_capacity']:.0f} % | "
            + " | ".join(pct(att[n]) for n in names)
            + f" | {lead['points']:g} (over {lead['best_other']}) |"
        )
    lines += ["", f"Mean attainment, simulated; {source('placement')}.", ""]
    return "\n".join(lines)


# --- sim_validation --------------------------------------------------------------------------------------------


def sim_validation_summary() -> str:
    data = results("sim_validation")
    return (
        f"{data['within_goal']} (emulated cluster measured, simulator simulated). The emulated side shares the "
        f"roofline and the node's core with the simulator: TTFT and TPOT agree partly by construction. Source: "
        f"{source('sim_validation')}"
    )


def sim_validation_table() -> str:
    data = results("sim_validation")
    from benchmarks.sim_validation import COMPARED

    header = " | ".join(
        f"{label}: emulated / simulated ({'s' if key == 'recovery_s' else 'ms'})" for key, label in COMPARED
    )
    lines = ["", f"| nodes | policy | {header} |", "|---" * (len(COMPARED) + 2) + "|"]
    for r in data["results"]:
        cells = []
        for key, _ in COMPARED:
            error, score = r["error_pct"][key], r["scoring"][key]
            said = (
                score
                if error is None or score == "both zero"
                else f"{error:+.1f} %" + (": a miss" if score == "miss" else "")
            )
            cells.append(f"{r['emulated'][key]:g} / {r['simulated'][key]:g} ({said})")
        lines.append(f"| {r['nodes']} | {r['policy']} | " + " | ".join(cells) + " |")
    lines += ["", f"{data['within_goal']}. {source('sim_validation')}.", ""]
    return "\n".join(lines)


# --- Lifeline against LUMEN: every comparison -----------------------------------------------------------------


def _signed_pct(x: float) -> str:
    return f"{100 * x:+.2f} %".replace("-", "−")


def _paired(c: dict) -> str:
    """A comparison's paired mean ± its 95 % interval (one seed: the mean alone; none: n/a)."""
    if c["mean"] is None:
        return "n/a"
    text = _signed_pct(c["mean"])
    return text if c["ci95"] is None else f"{text} ± {100 * c['ci95']:.2f} %"


def _p(p: float | None) -> str:
    if p is None:
        return "–"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def _seed_span(seeds: list[int]) -> str:
    """1, 2, 3, 5 → 1–3, 5."""
    spans: list[list[int]] = []
    for s in sorted(seeds):
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in spans) or "none"


def _short(c: dict) -> str:
    return f"{c['setup']}'s {c['figure_name']} {_paired(c)} (p {_p(c['p'])}, Holm {_p(c['p_holm'])}, {c['n']} seeds)"


def lumen_comparisons_summary() -> str:
    data = results("lumen_comparisons")
    s, by_id = data["summary"], {c["id"]: c for c in data["comparisons"]}
    held = s["held_out"]
    nominal = [by_id[x["id"]] for x in s["smallest_p"] if x["p"] <= data["alpha"]]
    before = (
        f"before the correction, {s['nominal_at_alpha']} had p below {data['alpha']:g} ({s['nominal_better']} with "
        f"Lifeline better, {s['nominal_worse']} worse)"
        + (": " + "; ".join(_short(c) for c in nominal) if nominal else "")
    )
    return (
        f"{s['K']} of {s['N']} comparisons survive Holm's correction at 5 % (Lifeline better in {s['better']}, worse "
        f"in {s['worse']}): every Lifeline-against-LUMEN comparison the lumen results hold, each setup × mean TTFT, "
        f"replay TTFT, recovery time and mean TPOT, {s['testable']} of them testable and "
        f"{s['N'] - s['distinct']['N']} repeating another's runs; {before}. Every file's seeds start at 1 and hold "
        f"the tuning seeds 1–3; on the seeds above them alone {held['K']} of {held['testable']} testable comparisons "
        f"survive (paired per-seed ratios simulated; p-values and the correction modelled). "
        f"Source: {source('lumen_comparisons')}"
    )


def lumen_comparisons_table() -> str:
    data = results("lumen_comparisons")
    s = data["summary"]
    lines = [
        "",
        "| setup | figure | Lifeline / LUMEN − 1, paired: mean ± 95 % CI | n | seeds | p | "
        "Holm p | survives | seeds above 3 only: mean ± CI (n), p, Holm p |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in data["comparisons"]:
        setup = c["setup"] + (f" (the runs of {c['same_runs_as'].split('/')[0]})" if c["same_runs_as"] else "")
        seeds = _seed_span(c["used_seeds"])
        if c["missing"]:
            seeds += f" ({c['missing']} n/a)"
        if c["overlaps_tuning_seeds"]:
            seeds += ", tuning seeds in"
        h = c["held_out"]
        held = f"{_paired(h)} ({h['n']}), {_p(h['p'])}, {_p(h['p_holm'])}"
        survives = "yes" if c["survives"] else "no" if c["p"] is not None else f"no test: {c['untestable']}"
        lines.append(
            f"| {setup} | {c['figure_name']} | {_paired(c)} | {c['n']} | {seeds} | {_p(c['p'])} | "
            f"{_p(c['p_holm'])} | {survives} | {held} |"
        )
    lines += [
        "",
        f"{s['K']} of {s['N']} survive (Lifeline better in {s['better']}, worse in {s['worse']}); of the "
        f"{s['distinct']['N']} distinct tests, {s['distinct']['K']}; of the {s['own_sections']['N']} the files' own "
        f"ratios, verdicts and resume comparisons make, {s['own_sections']['K']}. Holm's first step needs p ≤ "
        f"{data['alpha']:g} / {s['N']} = {data['alpha'] / s['N']:.5f}. Negative is Lifeline lower (better) "
        f"on every figure. Paired ratios simulated; p (two-sided one-sample t-test against 0) and Holm's adjusted p "
        f"modelled; {source('lumen_comparisons')}.",
        "",
        "The reruns on seeds that played no part in tuning (each file's recorded command with `--first-seed 101`; "
        "each replaces its file; the time is that command's last run, on the host it ran on):",
        "",
    ]
    for r in data["rerun"]:
        lines.append(f"- `{r['command']}`: seeds {r['seeds']}, about {r['estimated_s']:,.0f} s")
    total = sum(r["estimated_s"] for r in data["rerun"])
    lines += [
        "",
        f"About {total:,.0f} s ({total / 3600:.1f} h) in all, one after another (modelled from the recorded times; a "
        "day's time follows the faults its seed draws).",
        "",
    ]
    return "\n".join(lines)


# --- the suite's time -------------------------------------------------------------------------------------------


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def suite_time() -> str:
    """The latest clean runs' commit: every run made of it (clean, loaded), and the latest run with no caches."""
    runs = results("suite_time")["runs"]
    clean = [r for r in runs if r["label"] == "clean"]
    commit = clean[-1]["commit"]
    at = [r for r in runs if r["commit"] == commit]
    first = at[0]["phases"]
    tests = {name: sum(v for k, v in p.items() if k != "seconds") for name, p in first.items()}
    shown = []
    for label, what in (("clean", "nothing else running"), ("loaded", "a process spinning on one core throughout")):
        these = [r for r in at if r["label"] == label]
        if not these:
            continue
        times = ", ".join(_minutes(r["total_s"]) for r in these)
        parallel = ", ".join(_minutes(r["phases"]["parallel"]["seconds"]) for r in these)
        process = ", ".join(_minutes(r["phases"]["process"]["seconds"]) for r in these)
        green = sum(r["green"] for r in these)
        shown.append(
            f"{what}: **{times} minutes** (parallel phase {parallel}, process phase {process}), "
            f"{green} of {len(these)} green"
        )
    loaded = [r for r in runs if r["label"] == "loaded"]
    if loaded and not any(r["label"] == "loaded" for r in at):
        last = loaded[-1]
        shown.append(
            f"the latest run with a process spinning on one core throughout, at `{last['commit'][:7]}`: "
            f"{_minutes(last['total_s'])} minutes, {'green' if last['green'] else 'red'}"
        )
    warm = [r for r in runs if r["label"] != "cold"]
    shown.append(f"of every warm run recorded, {sum(r['green'] for r in warm)} of {len(warm)} green")
    cold = [r for r in runs if r["label"] == "cold"]
    if cold:
        c = cold[-1]
        shown.append(
            f"a first run on a machine with no engine caches (llama.cpp's server built and vLLM installed in the "
            f"background), at `{c['commit'][:7]}`: {_minutes(c['total_s'])} minutes, "
            f"{'green' if c['green'] else 'not green'}"
        )
    best = min(r["total_s"] for r in at if r["label"] == "clean")
    goal = "met" if max(r["total_s"] for r in at if r["label"] == "clean") < 15 * 60 else "not met"
    fastest = min((r for r in runs if r["label"] == "clean" and r["green"]), key=lambda r: r["total_s"])
    if fastest["commit"] != commit:
        best_said = (
            f"{_minutes(best)} here; the fastest recorded, {_minutes(fastest['total_s'])} at `{fastest['commit'][:7]}`"
        )
    else:
        best_said = _minutes(best)
    return (
        f"The suite has {sum(tests.values()):,} tests ({tests['parallel']:,} in the parallel phase, "
        f"{tests['process']:,} in the process phase). Measured on {at[0]['began'][:10]} on this "
        f"{at[0]['host']['cores']}-core machine, `.ci/run` from a fresh clone of `{commit[:7]}` (its first install "
        f"included) on PostgreSQL and Redis, the engine caches warm: " + "; ".join(shown) + f". Under 15 minutes: "
        f"{goal} (the fastest clean run {best_said}). Source: `benchmarks/results/suite_time.json` "
        f"(`python -m benchmarks.suite_time`)."
    )


# --- the measured table (docs/measured.md) ---------------------------------------------------------------------


def _span(values, fmt: str = "{:g}", unit: str = "") -> str:
    """The range of `values` as 'low–high' (one value when they round alike)."""
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return (low if low == high else f"{low}–{high}") + unit


def _signed(x: float, digits: int = 1) -> str:
    """A signed figure with a true minus sign: +3.8, −33.2."""
    return f"{x:+.{digits}f}".replace("-", "−")


def _nested(name: str) -> str:
    """Another block, markers and all, inside this one's text (render leaves it to this block's renderer)."""
    return f"<!-- results:{name} -->{BLOCKS[name]()}<!-- /results:{name} -->"


def _measured_node_streams() -> tuple:
    data = results("node_streams")
    run = max(data["runs"], key=lambda r: r["concurrent_streams"])
    return (
        f"one node, {run['concurrent_streams']} concurrent streams: event-loop lag p99 (`node_streams`)",
        f"{run['node_event_loop_lag_p99_ms']:.1f} ms (idle probe beside it: "
        f"{run['idle_probe_lag_p99_ms_same_window']:.1f} ms), {run['tokens_per_s_emitted']:,.0f} tokens/s",
        "measured",
        f"{data['goal']['event_loop_lag_p99_ms']} ms",
        ["node_streams"],
    )


def _measured_checkpoint_overhead() -> tuple:
    data = results("checkpoint_overhead")
    f = data["figures"]
    cpu = f["node_cpu_us_per_token_with"] / f["node_cpu_us_per_token_without"] - 1
    return (
        f"KV checkpoint streaming, {data['config']['streams']} streams: decode throughput cost (`checkpoint_overhead`)",
        f"{f['throughput_cost_pct']:.1f} % (node CPU per token {100 * cpu:+.0f} %)",
        "measured",
        f"{data['goal']['throughput_cost_pct']} %",
        ["checkpoint_overhead"],
    )


def _measured_fleet() -> tuple:
    f = results("fleet")["figures"]
    return (
        f"{f['nodes']} emulated nodes: step wall time over the model (`fleet`)",
        f"{f['step_wall_over_modeled_mean']:.4f} mean, {f['step_wall_over_modeled_max']:.4f} worst, "
        f"{f['nodes_within_10pct']} of {f['nodes']} within 10 %",
        "measured",
        "within 10 % on every node",
        ["fleet"],
    )


def _measured_restore() -> tuple:
    data = results("restore")
    f, c = data["figures"], data["config"]
    return (
        f"{c['prompt_tokens']:,}-token prompt, {c['deployment']}: restore from host memory vs re-prefill, to the "
        "first resumed token (`restore`)",
        f"{f['restore_from_local_store_ttft_s']:.2f} s vs {f['reprefill_ttft_s']:.2f} s "
        f"({f['ratio_reprefill_over_restore']:.1f}×; the model alone: {1000 * f['model_restore_s']:.0f} vs "
        f"{1000 * f['model_reprefill_s']:.0f} ms)",
        "measured; the model alone modelled (the roofline)",
        "report",
        ["restore"],
    )


def _measured_assist() -> tuple:
    data = results("assist")
    kinds = data["provenance"]["kinds"]
    runs = data["runs"]
    shown = "; ".join(
        f"{'the catalog' if r['agreement_from'] == 'catalog' else 'set'} {r['draft_agreement_modelled']:g}: "
        f"acceptance {r['acceptance_drawn']:.2f}, {r['speedup']:.2f}×"
        for r in runs
    )
    return (
        f"speculative assist, k = {runs[0]['k']}, on emulated nodes: the draft's acceptance and the survivor's "
        "speed-up, by the draft agreement (`assist`)",
        shown,
        f"draft agreement {kinds['runs[].draft_agreement_modelled']}; acceptance "
        f"{kinds['runs[].acceptance_drawn']} (drawn back); speed-up {kinds['runs[].speedup']} (the roofline's step "
        "times at it)",
        "report",
        ["assist"],
    )


_RECOVERY_PATHS = {
    "local_restore": "local restore",
    "fetch": "fetch from a holder",
    "kv_transfer": "KV transfer",
    "reprefill": "re-prefill",
    "node_and_holder": "node and holder together",
    "cold_restart": "cold restart",
}


def _measured_recovery_kill() -> tuple:
    data = results("recovery_kill")
    m, c, goal = data["measured"], data["config"], data["goal"]
    paths = []
    for key, label in _RECOVERY_PATHS.items():
        p = m["paths"][key]
        early = p["moved_before_first_token"]
        paths.append(
            f"{label} {p['stall_ms']['p50']:.0f} / {p['stall_ms']['p99']:.0f} ({p['moves']} moves"
            + (f", {early} of them before a first token" if early else "")
            + ")"
        )
    return (
        f"{c['nodes']} nodes ({c['deployment']}), {c['streams']} streams, every recovery path provoked under load "
        "and each moved stream classified by what the gateway did (`recovery_kill`): tokens lost or repeated and "
        "client-visible stall, per path",
        f"{m['tokens_lost']} lost, {m['tokens_repeated_or_wrong']} repeated or wrong ({m['requests']:,} requests, "
        f"{m['interrupted_requests']} interrupted); stall p50 / p99 ms: " + ", ".join(paths),
        "measured",
        f"lost and repeated: {goal['tokens_lost']}; stall p99 {goal['stall_ms_p99']} ms",
        ["recovery_kill"],
    )


def _measured_policies_routing() -> tuple:
    data = results("policies")
    base = data["routing_and_placement"][0]
    gateway = data["gateway_path"]
    alone = [r for r in data["routing_and_placement"] if not r["inputs_rebuilt_per_call"]]
    goal = gateway[0]["goal_p99_us"]
    events = " or ".join(str(r["status_events_per_decision"]) for r in gateway)
    through = "; ".join(
        f"{r['status_events_per_decision']} status event{'s' if r['status_events_per_decision'] > 1 else ''} per "
        f"decision: p50 {r['decision_p50_us']:.1f} µs, **p99 {r['decision_p99_us']:.1f} µs**, p99.9 "
        f"{r['decision_p999_us']:.1f} µs"
        for r in gateway
    )
    met = "met" if all(r["decision_p99_us"] < goal for r in gateway) else "not met"
    return (
        f"routing + checkpoint placement per request through the gateway's own path, {base['nodes']} nodes, "
        f"{base['in_flight']:,} in flight, {events} status events per decision (`policies`)",
        f"{through}. The upkeep a decision leaves (re-ranking the holders whose L̂ it moved, the routing bounds its "
        "search sharpened) runs once the request is on its way (`FleetState.tidy`): p50 "
        f"{_span([r['upkeep_after_p50_us'] for r in gateway], '{:.1f}', ' µs')}, p99 "
        f"{_span([r['upkeep_after_p99_us'] for r in gateway], '{:.1f}', ' µs')}. The policy functions called alone, "
        "absorbing the status events inside the timed call: "
        + ", ".join(
            f"p99 {r['decision_p99_us']:.1f} µs with {r['status_events_per_decision']} status "
            f"event{'s' if r['status_events_per_decision'] > 1 else ''} per decision"
            for r in alone
        )
        + f". This host's reference loop (`noise.loop2560`): p50 {data['noise']['loop2560_p50_us']:.1f} µs; the p99 "
        "depends on the host (earlier runs on other hosts are in `benchmarks/README.md`, not in the results)",
        "measured",
        f"< {goal} µs p99 ({met} through the gateway's path in this run)",
        ["policies"],
    )


def policies_gateway_path() -> str:
    """The routing + placement decision through the gateway's path: the inline summary docs/not-done.md uses."""
    data = results("policies")
    base, gateway = data["routing_and_placement"][0], data["gateway_path"]
    goal = gateway[0]["goal_p99_us"]
    met = "met" if all(r["decision_p99_us"] < goal for r in gateway) else "not met"
    events = " or ".join(str(r["status_events_per_decision"]) for r in gateway)
    return (
        f"p99 {_span([r['decision_p99_us'] for r in gateway], '{:.1f}', ' µs')} at {base['nodes']} nodes and "
        f"{base['in_flight']:,} in flight, {events} status events per decision (goal < {goal} µs: {met} in this run; "
        f"the decision's own upkeep runs after the request is sent; measured, {source('policies')})"
    )


def _measured_policies_recovery() -> tuple:
    r = results("policies")["recovery_dispatch"]
    return (
        f"recovery plan for {r['interrupted']:,} interrupted requests over {r['survivors']} survivors (`policies`)",
        f"{r['plan_median_ms']:.2f} ms median, {r['plan_max_ms']:.2f} ms at most ({r['methods']['restore']} to "
        f"restore, {r['methods']['reprefill']} to re-prefill)",
        "measured",
        f"< {r['goal_ms']} ms",
        ["policies"],
    )


def _measured_herd() -> tuple:
    data = results("herd")
    c = data["config"]
    on, off = data["with_dispatch_accounting"], data["without_dispatch_accounting"]
    several = data["with_dispatch_accounting_4_gateways"]
    return (
        f"bursts of {c['burst_size']} requests at once over {c['nodes']} nodes, with and without counting "
        f"dispatched-but-unconfirmed requests, and through {several['gateways']} gateway processes in turn (`herd`)",
        f"busiest node got {on['burst_max_over_mean_requests_per_node']:.1f}× vs "
        f"{off['burst_max_over_mean_requests_per_node']:.1f}× the mean; TTFT mean {on['ttft_ms_mean']:.0f} vs "
        f"{off['ttft_ms_mean']:.0f} ms ({data['ttft_mean_ratio_without_over_with']:.1f}×); through "
        f"{several['gateways']} gateways {several['burst_max_over_mean_requests_per_node']:.2f}× (TTFT "
        f"{several['ttft_ms_mean']:.0f} ms)",
        "measured",
        "report",
        ["herd"],
    )


def _added(path: dict, key: str) -> list[float]:
    return [r[key] for r in path["added"]]


def _cpu(path: dict) -> list[float]:
    return [r["cpu_ms_per_1000_tokens"] for r in path["rates"]]


def gateway_peers_summary() -> str:
    """The gateway against the routers people deploy, over direct: the inline summary docs/not-done.md uses."""
    data = results("gateway_peers")
    p, ratios = data["paths"], data["ratios_lifeline_over_peer"]
    rust = [p["vllm-router"], p["sglang-router"]]
    return (
        f"it adds {_span(_added(p['lifeline'], 'added_ttft_p99_ms'), '{:.1f}', ' ms')} to TTFT p99 and "
        f"{_span(_added(p['lifeline'], 'added_itl_p99_ms'), '{:.2f}', ' ms')} to ITL p99 over direct where "
        f"vllm-router adds ≤ {max(_added(p['vllm-router'], 'added_ttft_p99_ms')):.1f} ms to TTFT p99 and the Rust "
        f"routers ≤ {max(max(_added(r, 'added_itl_p99_ms')) for r in rust):.2f} ms to ITL p99, and spends "
        f"{1 / ratios['vllm-router']['tokens_per_s_per_core']:.1f}× vllm-router's CPU per relayed token "
        f"({ratios['litellm']['tokens_per_s_per_core']:.1f}× LiteLLM's tokens per core); measured at "
        f"{_span(data['setup']['rates'], '{:g}')} req/s on {data['setup']['nodes']} emulated nodes, "
        f"{source('gateway_peers')}"
    )


def _measured_gateway_peers() -> tuple:
    data = results("gateway_peers")
    p, s, ratios = data["paths"], data["setup"], data["ratios_lifeline_over_peer"]
    rust = {"vllm-router": p["vllm-router"], "sglang-router": p["sglang-router"]}
    life, lite = p["lifeline"], p["litellm"]
    low, high = lite["added"][0], lite["added"][-1]

    def ttft(path: dict) -> str:
        return (
            f"{_span(_added(path, 'added_ttft_p50_ms'), '{:.1f}')} / "
            f"{_span(_added(path, 'added_ttft_p99_ms'), '{:.1f}')} ms"
        )

    result = (
        "added over direct, p50 / p99: TTFT Lifeline "
        + ttft(life)
        + f", two Lifeline processes on one port (`--reuse-port`) {ttft(p['lifeline-x2'])}, "
        f"vllm-router {_span(_added(rust['vllm-router'], 'added_ttft_p50_ms'), '{:.1f}')} / "
        f"≤ {max(_added(rust['vllm-router'], 'added_ttft_p99_ms')):.1f} ms, sglang-router "
        f"{ttft(rust['sglang-router'])}, LiteLLM {low['added_ttft_p50_ms']:.0f} / {low['added_ttft_p99_ms']:.0f} ms "
        f"at {low['rate']:g} req/s and {high['added_ttft_p50_ms'] / 1000:.1f} / {high['added_ttft_p99_ms'] / 1000:.1f} "
        f"s at {high['rate']:g} (it sustains {lite['sustained_rate']:g} req/s); ITL p99 Lifeline "
        f"{_span(_added(life, 'added_itl_p99_ms'), '{:.2f}', ' ms')}, the Rust routers "
        f"≤ {max(max(_added(r, 'added_itl_p99_ms')) for r in rust.values()):.2f} ms; router CPU per 1,000 relayed "
        f"tokens Lifeline {_span(_cpu(life), '{:.0f}', ' ms')}, "
        f"vllm-router {_span(_cpu(rust['vllm-router']), '{:.0f}')}, "
        f"sglang-router {_span(_cpu(rust['sglang-router']), '{:.0f}')}, LiteLLM {_span(_cpu(lite), '{:,.0f}')}: "
        f"Lifeline relays {ratios['litellm']['tokens_per_s_per_core']:.1f}× LiteLLM's tokens per core, "
        f"{ratios['vllm-router']['tokens_per_s_per_core']:.2f}× vllm-router's"
    )
    best_rust = [min(r["added"][i]["added_ttft_p99_ms"] for r in rust.values()) for i in range(len(life["added"]))]
    close = all(a["added_ttft_p99_ms"] <= 1.5 * b for a, b in zip(life["added"], best_rust, strict=True))
    per_core = ratios["litellm"]["tokens_per_s_per_core"]
    return (
        f"the gateway beside the routers people deploy: {s['nodes']} emulated nodes (time scale {s['time_scale']:g}), "
        f"open-loop streaming chat at {_span(s['rates'], '{:g}')} req/s, {s['max_tokens']} tokens, each path in "
        "turn (`gateway_peers`)",
        result,
        "measured",
        f"TTFT/ITL p99 ≤ 1.5× the better Rust router ({'met' if close else 'not met'}: they add next to nothing over "
        f"direct here); ≥ 3× LiteLLM's tokens per core ({'met' if per_core >= 3 else 'not met'})",
        ["gateway_peers"],
    )


def _measured_canary_round() -> tuple:
    data = results("canary_round")
    checks = data["passed"] + data["failed"]
    other = data["document_003"]
    return (
        f"canary round over {data['nodes']} emulated nodes, interval {data['interval_s']} s, the demo's Celery "
        "worker (`canary_round`)",
        f"{data['round_span_max_s']:.1f} s per round at most ({100 * data['round_share_of_interval']:.0f} % of the "
        f"interval), {data['passed']} of {checks} checks passed; GPU time per canary "
        f"{data['gpu_ms_per_canary_mean']:.1f} ms by the roofline, "
        f"{float(data['gpu_share_at_interval'].rstrip('%')):.3f} % of the GPU at {data['interval_s']} s (the "
        "Dynamo-style fault-tolerance design's estimate: "
        f"{other['gpu_ms_per_canary']:g} ms, {other['gpu_share'].replace('%', ' %')}, for {other['model']})",
        "measured; GPU time modelled (the roofline); the design's estimate an input",
        f"within one interval ({'met' if data['within_one_interval'] else 'not met'})",
        ["canary_round"],
    )


def _measured_sdc_detection() -> tuple:
    d = results("sdc_detection")
    return (
        f"silent corruption (logits drifting, tokens right) injected → weight 0 at the gateway, interval "
        f"{d['interval_s']} s, {d['trials']} trials (`sdc_detection`)",
        f"median {d['out_of_routing_s_median']:.1f} s, p99 {d['out_of_routing_s_p99']:.1f} s "
        f"({d['out_of_routing_in_intervals_median']:g} and {d['out_of_routing_in_intervals_p99']:g} intervals); "
        f"weight halved after a median {d['weight_halved_s_median']:.1f} s",
        "measured",
        "report",
        ["sdc_detection"],
    )


def _measured_drain_migration() -> tuple:
    d = results("drain_migration")
    return (
        f"drain approval → zero requests on the node, {d['streams']} greedy streams migrated live to the promoted "
        "spare (`drain_migration`)",
        f"{d['approval_to_zero_requests_s']:.2f} s; {d['moved_streams']} moved, {d['tokens_lost']} tokens lost, "
        f"{d['tokens_repeated_or_wrong']} repeated; stall p50 {d['stall_ms_p50']:.0f} ms, p99 "
        f"{d['stall_ms_p99']:.0f} ms",
        "measured",
        "0 lost",
        ["drain_migration"],
    )


def _measured_sim_validation() -> tuple:
    return (
        "the simulator against the emulated cluster (real processes, the emulated engine), the busiest node killed "
        "under each policy, 4 and 8 nodes (`sim_validation`; every pair scored, the history in "
        "`benchmarks/README.md`)",
        _nested("sim-validation-summary"),
        "emulated measured, simulator simulated",
        "within 10 %",
        ["sim_validation"],
    )


def _workers4_ttft() -> str:
    """LUMEN against stop-and-restart at 4 workers, on mean TTFT: of the means, paired, and the paper's."""
    data = results("lumen_workers4")
    r = data["ratios"]["load_aware_vs_none"]["ttft_mean_s"]
    paired = r["ours_paired"]
    return (
        f"LUMEN {_signed(100 * r['ours'])} % against stop-and-restart (of the means; paired "
        f"{_signed(100 * paired['mean'])} % ± {100 * paired['ci95']:.1f} % over {paired['n']} seeds; paper "
        f"{_signed(100 * r['paper'])} %)"
    )


def _measured_lumen() -> tuple:
    data = results("lumen_workers4")
    s = results("lumen_comparisons")["summary"]
    verdict = (
        "Lifeline is not shown to beat LUMEN on the simulator, nor to lose to it"
        if s["better"] == 0 and s["worse"] == 0
        else f"Lifeline is better in {s['better']} and worse in {s['worse']} of the comparisons that survive"
    )
    return (
        f"document 000's 4-worker table on the simulator, {len(data['seeds'])} seeds (`recovery.sim.lumen workers4`, "
        f"rerun {_run_date(data)} with draft assist, the gateway's move and the deferred checkpoint re-placement "
        "modelled)",
        f"mean TTFT after a crash: {_workers4_ttft()}. Lifeline against LUMEN, on this table, the 8-worker ones, a "
        "rack lost, 256 nodes, days of 256 and 1,000 nodes, 64 nodes losing a TP group and the sensitivity rows: "
        + _nested("lumen-comparisons-summary")
        + f". {verdict}: every comparison is in [the simulator's page](simulator.md#lifeline-against-lumen-every-"
        "comparison), the setups in `benchmarks/README.md`",
        f"{data['ratios']['load_aware_vs_none']['ttft_mean_s']['ours_paired']['kind']} (the paper's figures "
        f"{data['paper_baseline']['kind']}); p-values modelled",
        f"beat LUMEN ({'met' if s['better'] > 0 and s['worse'] == 0 else 'not met'})",
        ["lumen_workers4", "lumen_comparisons"],
    )


def _measured_console_scale() -> tuple:
    data = results("console_scale")
    runs = sorted(data["runs"], key=lambda r: r["heartbeat_interval_s"])
    first, slow = runs[0], runs[-1]
    live = {p["view"]: p["live_s"] for p in first["page_load"]}
    return (
        f"event to browser at {data['nodes']} nodes, one web process, a heartbeat every "
        f"{first['heartbeat_interval_s']:g} s (the nodes' default; `console_scale`)",
        f"state change to the table row p50 {first['state_change_to_dom']['p50_ms']:.0f} ms, p99 "
        f"{first['state_change_to_dom']['p99_ms']:.0f} ms; a heartbeat's figure p50 "
        f"{first['load_to_dom']['p50_ms']:.0f} ms, p99 {first['load_to_dom']['p99_ms']:.0f} ms; "
        f"{first['heartbeats_per_s_served']:g} of {first['heartbeats_per_s_offered']:g} heartbeats/s served, round "
        f"trip {first['heartbeat_round_trip_mean_ms']:.0f} ms; page with {data['nodes']} nodes live in "
        + ", ".join(f"{s:.1f} s ({view})" for view, s in live.items())
        + f", in headless Chromium; at one beat every {slow['heartbeat_interval_s']:g} s: state change p50 "
        f"{slow['state_change_to_dom']['p50_ms']:.0f} ms, p99 {slow['state_change_to_dom']['p99_ms']:.0f} ms",
        "measured",
        "< 1 s",
        ["console_scale"],
    )


_DATABASES = {"postgresql": "PostgreSQL", "sqlite": "SQLite"}


def _measured_slo_rollup() -> tuple:
    d = results("slo_rollup")
    return (
        f"gateway outcomes stored and counted into SLO rollups, one worker process, "
        f"{_DATABASES.get(d['database'], d['database'])} (`slo_rollup`)",
        f"{d['stream_store_and_count_per_s']:,}/s",
        "measured",
        f"{d['goal_per_s']:,}/s",
        ["slo_rollup"],
    )


def _measured_slo_report() -> tuple:
    d = results("slo_report")
    return (
        f"{d['report_days']}-day SLA report, {d['scopes']} scopes (models × tiers × tenants), "
        f"{_DATABASES.get(d['database'], d['database'])} (`slo_report`)",
        f"page {d['page_median_s']:.2f} s, PDF {d['pdf_median_s']:.2f} s (medians of {d['runs']} runs, the first "
        f"cold; {d['requests_in_report']:,} requests in the report)",
        "measured",
        f"page < {d['goal_page_s']:g} s, PDF < {d['goal_pdf_s']:g} s",
        ["slo_report"],
    )


def _measured_slo_accuracy() -> tuple:
    d = results("slo_accuracy")
    return (
        f"console burn rates against promtool on the same {d['requests']:,} requests, "
        f"{', '.join(d['windows'])} (`slo_accuracy`)",
        f"equal to {d['largest_difference']:.0e}",
        "measured",
        "equal",
        ["slo_accuracy"],
    )


def _measured_placement_table1() -> tuple:
    return (
        "document 004's Table 1 setting (3 models, 32 GH200 + 24 A100), each placement run through the simulator on "
        "the same offered load (`placement`)",
        _nested("placement-summary"),
        "simulated; the offered load modelled",
        "beat memP and LLMFabric",
        ["placement"],
    )


def _measured_moe() -> tuple:
    fleet, alone = results("moe_fleet"), results("moe_fleet_no_shadows")
    failover, steady = results("moe_failover"), results("moe_fleet_steady")
    ew, aw = fleet["ew_failures"]["summary"], fleet["aw_failures"]["summary"]
    bare = alone["ew_failures_without_shadows"]["summary"]
    every = fleet["expert_side_restart"]["summary"]
    static = steady["steady"]["table_and_checkpoints_over_static_run"]
    table = fleet["steady"]["table_over_static_binding"]

    def wrong(s: dict) -> str:
        return f"{s['tokens_lost']} tokens lost, {s['tokens_repeated']} repeated, {s['tokens_different']} different"

    return (
        f"decoupled MoE, the whole system: {fleet['aws']} attention workers, {fleet['ews']} expert workers (+1 "
        f"standby) of {fleet['model']} at time scale {fleet['time_scale']}, "
        f"{ew['streams_across_failures'] // ew['failures']} greedy streams, {ew['failures']} "
        "SIGKILLs of each kind (`moe_fleet`)",
        f"stall (longest token gap a client saw) median / max: EW {ew['stall_s']['median']:.2f} / "
        f"{ew['stall_s']['max']:.2f} s, AW {aw['stall_s']['median']:.2f} / {aw['stall_s']['max']:.2f} s; "
        f"{ew['streams_across_failures'] + aw['streams_across_failures']} streams across failures: "
        f"{ew['tokens_lost'] + aw['tokens_lost']} tokens lost, {ew['tokens_repeated'] + aw['tokens_repeated']} "
        f"repeated, {ew['tokens_different'] + aw['tokens_different']} different; EW loss confirmed and table pushed "
        f"in {ew['table_healed_s_median']:.1f} s, standby joined in {ew['replacement_joined_s_median']:.1f} s "
        f"(medians); {bare['failures']} EW failures without shadows (`moe_fleet_no_shadows`): stall median "
        f"{bare['stall_s']['median']:.1f} s, max {bare['stall_s']['max']:.1f} s (the standby loads the lost "
        f"experts), {bare['streams_across_failures']} streams, {wrong(bare)}; every EW killed at once "
        f"{every['stall_s']['median']:.1f} s; restart everything {fleet['restart_everything_s_modelled']:.1f} s; a "
        f"hung EW found by the data-path probes in {failover['runs']['hung']['median_longest_stall_ms']:.1f} ms "
        f"(median longest stall, `moe_failover`); steady state with the table and checkpoints against a "
        f"static-binding stack run beside it (`moe_fleet_steady`; positive: slower): throughput "
        f"{_signed(static['throughput_pct'])} %, ITL p50 {_signed(static['itl_p50_pct'])} %, p99 "
        f"{_signed(static['itl_p99_pct'])} %; "
        f"the table over a static binding {table['extra_share_of_layer_time_pct']:.2f} % of a layer in-process",
        "measured; restart everything modelled",
        "TARRAGON: 0.3 s (EW), 0.4 s (AW) (input); 0 lost",
        ["moe_fleet", "moe_fleet_no_shadows", "moe_failover", "moe_fleet_steady"],
    )


def _measured_placement_scale() -> tuple:
    data = results("placement")
    scale = data["scale"]
    kinds = data["provenance"]["kinds"]
    return (
        f"placement plan at {' / '.join(format(r['servers'], ',') for r in scale)} servers, "
        f"{scale[0]['models']} models, "
        f"{scale[0]['gpu_types']} GPU types (`placement`)",
        ("proven optimal" if all(r["status"] == "OPTIMAL" and r["gap"] == 0 for r in scale) else "solved")
        + f" in {' / '.join(format(r['solve_s'], '.1f') for r in scale)} s",
        kinds["scale[].solve_s"],
        f"< 5 s at {scale[-1]['servers']:,}",
        ["placement"],
    )


MEASURED_ROWS: list[Callable[[], tuple]] = [
    _measured_node_streams,
    _measured_checkpoint_overhead,
    _measured_fleet,
    _measured_restore,
    _measured_assist,
    _measured_recovery_kill,
    _measured_policies_routing,
    _measured_policies_recovery,
    _measured_herd,
    _measured_gateway_peers,
    _measured_canary_round,
    _measured_sdc_detection,
    _measured_drain_migration,
    _measured_sim_validation,
    _measured_lumen,
    _measured_console_scale,
    _measured_slo_rollup,
    _measured_slo_report,
    _measured_slo_accuracy,
    _measured_placement_table1,
    _measured_moe,
    _measured_placement_scale,
]


def measured_table() -> str:
    """docs/measured.md's table: one row per benchmark, every figure read from its results file."""
    lines = ["", "| figure | result | kind | goal | source |", "| --- | --- | --- | --- | --- |"]
    for row in MEASURED_ROWS:
        figure, result, kind, goal, names = row()
        lines.append(f"| {figure} | {result} | {kind} | {goal} | {', '.join(cite(n) for n in names)} |")
    lines.append("")
    return "\n".join(lines)


# --- chaos -----------------------------------------------------------------------------------------------------


def chaos_faults() -> str:
    data = results("chaos")
    counts = data["faults_by_kind"]
    return (
        f"{len(data['faults'])} faults of {len(counts)} kinds ({_span(counts.values(), '{:d}')} of each) in "
        f"{data['minutes']:g} minutes (measured; {source('chaos')})"
    )


_CHAOS_KINDS = {
    "rack": "rack",
    "node_and_holder": "node + its holder",
    "node_kill": "kill",
    "web_restart": "web killed",
    "sdc": "sdc (drain approved and run)",
    "partition": "partition",
    "node_hang": "hang",
    "redis_pause": "Redis paused",
    "gateway_kill": "gateway killed",
    "db_restart": "database cut off",
    "nvlink_down": "NVLink down",
    "redis_restart": "Redis killed",
    "slow_gpu": "slow GPU",
    "beat_restart": "beat restarted",
    "worker_kill": "worker killed",
}


def chaos_convergence() -> str:
    data = results("chaos")
    slowest, counts = data["slowest_convergence_s_by_kind"], data["faults_by_kind"]
    unseen = data["faults_without_visible_effect"]
    lines = [
        "",
        "| kind | faults | of them with no visible effect | slowest return to whole, s |",
        "| --- | --- | --- | --- |",
    ]
    for kind in sorted(slowest, key=lambda k: -slowest[k]):
        lines.append(
            f"| {_CHAOS_KINDS.get(kind, kind)} | {counts[kind]} | {unseen.count(kind)} | {slowest[kind]:.1f} |"
        )
    lines += ["", f"Measured; {source('chaos')}.", ""]
    return "\n".join(lines)


# --- 4 workers on the simulator (benchmarks/README.md's reading of the tables) -----------------------------------


def lumen_workers4_reading() -> str:
    data = results("lumen_workers4")
    ratios = data["ratios"]
    lumen = data["policies"]["load_aware"]["ours"]

    def ratio(pair: str, figure: str) -> str:
        r = ratios[pair][figure]
        paired = r["ours_paired"]
        missing = f", {paired['missing']} n/a" if paired["missing"] else ""
        return (
            f"{_signed(100 * r['ours'])} % of the means, {_signed(100 * paired['mean'])} % ± "
            f"{100 * paired['ci95']:.1f} % paired over {paired['n']} seeds{missing}; paper "
            f"{_signed(100 * r['paper'])} %"
        )

    return (
        "With LUMEN's placement and dispatch alone, mean TTFT after a failure falls against stop-and-restart at "
        f"{data['setup']['workers']} workers ({ratio('load_aware_vs_none', 'ttft_mean_s')}) and the checkpoint saves "
        f"most interrupted requests a re-prefill ({lumen['restored']['mean']:.0f} of "
        f"{lumen['interrupted']['mean']:.0f} restored, the means over {lumen['interrupted']['n']} seeds). Against "
        f"fixed neighbour the gain is small ({ratio('load_aware_vs_fixed', 'ttft_mean_s')}). Recovery time moves "
        f"less than the paper's and less surely ({ratio('load_aware_vs_none', 'recovery_s')}). Simulated (the "
        f"paper's figures {data['paper_baseline']['kind']}); {source('lumen_workers4')}"
    )


BLOCKS: dict[str, Callable[[], str]] = {
    "suite-time": suite_time,
    "lumen-comparisons-summary": lumen_comparisons_summary,
    "lumen-comparisons-table": lumen_comparisons_table,
    "placement-summary": placement_summary,
    "placement-table1": placement_table1,
    "placement-sweep": placement_sweep,
    "sim-validation-summary": sim_validation_summary,
    "sim-validation-table": sim_validation_table,
    "measured-table": measured_table,
    "gateway-peers-summary": gateway_peers_summary,
    "policies-gateway-path": policies_gateway_path,
    "chaos-faults": chaos_faults,
    "chaos-convergence": chaos_convergence,
    "lumen-workers4-reading": lumen_workers4_reading,
}


def render(text: str) -> str:
    """`text` with every block rewritten from the results; an unknown block name is an error."""

    def one(match: re.Match) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise KeyError(f"unknown results block {name!r}: known are {', '.join(sorted(BLOCKS))}")
        body = BLOCKS[name]()
        if "\n" in body:  # a block of lines: blank lines around it, so that a table in it is a block of its own
            body = "\n\n" + body.strip("\n") + "\n\n"
        return f"<!-- results:{name} -->{body}<!-- /results:{name} -->"

    return BLOCK.sub(one, text)


def block_names(text: str) -> set[str]:
    """The names of every block in `text`, a block inside another's text (docs/measured.md's table) included."""
    names = set()
    for match in BLOCK.finditer(text):
        names |= {match["name"]} | block_names(match["body"])
    return names


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def stale() -> list[str]:
    """The blocks whose text differs from what the results render, as 'file: name'."""
    found = []
    for path in documents():
        text = path.read_text()
        for match in BLOCK.finditer(text):
            if render(match[0]) != match[0]:
                found.append(f"{_shown(path)}: {match['name']}")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="list the blocks that differ from the results")
    args = parser.parse_args(argv)
    if args.check:
        differ = stale()
        for line in differ:
            print(f"differs from the results: {line} (run: python -m benchmarks.render)")
        return 1 if differ else 0
    for path in documents():
        text = path.read_text()
        new = render(text)
        if new != text:
            path.write_text(new)
            print(f"rendered {_shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
