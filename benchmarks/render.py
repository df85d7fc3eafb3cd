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
    record = results(name).get("provenance") or {}
    commit = record["commit"][:7] if record.get("commit") else "an unrecorded commit"
    if record.get("dirty"):
        commit += ", with uncommitted changes"
    date = (record.get("date") or "undated")[:10]
    redone = record.get("rescored") or record.get("relabelled")
    extra = f"; rescored {redone['date'][:10]} at {redone['commit'][:7]}" if redone else ""
    return f"`benchmarks/results/{name}.json`, run {date} at {commit}{extra}"


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
    return (
        f"The suite has {sum(tests.values()):,} tests ({tests['parallel']:,} in the parallel phase, "
        f"{tests['process']:,} in the process phase). Measured on {at[0]['began'][:10]} on this "
        f"{at[0]['host']['cores']}-core machine, `.ci/run` from a fresh clone of `{commit[:7]}` (its first install "
        f"included) on PostgreSQL and Redis, the engine caches warm: " + "; ".join(shown) + f". Under 15 minutes: "
        f"{goal} (the fastest clean run {_minutes(best)}). Source: `benchmarks/results/suite_time.json` "
        f"(`python -m benchmarks.suite_time`)."
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
