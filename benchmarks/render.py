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


BLOCKS: dict[str, Callable[[], str]] = {
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
