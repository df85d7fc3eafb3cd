"""The README's tables of document 000's setups, rendered from `benchmarks/results/lumen_*.json`.

    python -m benchmarks.lumen_tables [workers4 workers8 workers8_rate9 ... ]   # default: every results file

Prints Markdown for `benchmarks/README.md`: the figures exactly as `python -m recovery.sim.lumen` wrote them (means
over seeds ± the 95 % interval, `(k n/a)` for runs that did not get back within 10 % of their baseline), so the
tables there can be regenerated instead of copied by hand.
"""

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
POLICY_TABLES = ("workers4", "workers8", "workers8_rate9", "workers8_rate10", "rack8")
DAY_TABLES = ("scale_day_256", "scale_day_1000")
RATIOS = ("lifeline_vs_load_aware", "lifeline_vs_none", "load_aware_vs_none", "load_aware_vs_fixed")


def stat(entry: dict | None, scale: float = 1.0, digits: int = 2) -> str:
    """`mean ± ci95` (a single run: the mean alone), runs that gave no figure counted apart."""
    if not entry or entry.get("mean") is None:
        missing = (entry or {}).get("missing", 0)
        return f"n/a ({missing} runs)" if missing else "n/a"
    text = f"{entry['mean'] * scale:.{digits}f}"
    if entry.get("ci95") is not None:
        text += f" ± {entry['ci95'] * scale:.{digits}f}"
    if entry.get("missing"):
        text += f" ({entry['missing']} n/a)"
    return text


def mean(entry: dict | None, scale: float = 1.0, digits: int = 0) -> str:
    return "–" if not entry or entry.get("mean") is None else f"{entry['mean'] * scale:.{digits}f}"


def paths(ours: dict, digits: int = 0) -> str:
    return " / ".join(mean(ours.get(k), digits=digits) for k in ("restored", "fetched", "reprefilled"))


def paper(value: float | None, scale: float = 1.0, fmt: str = ".2f") -> str:
    return "–" if value is None else format(value * scale, fmt)


def row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def header(*names) -> list[str]:
    return [row(names), "|" + "---|" * len(names)]


def command_line(data: dict) -> str:
    return f"`{data['command']}` ({data['wall_s']:.0f} s; {data['generated_at'][:10]})"


def ratio_cell(entry: dict) -> str:
    ours = "n/a" if entry.get("ours") is None else f"{entry['ours'] * 100:+.1f} %"
    paired = stat(entry.get("ours_paired"), 100, 1)
    text = f"{ours}; paired {paired} %"
    if entry.get("paper") is not None:
        text += f" (paper {entry['paper'] * 100:+.1f} %)"
    return text


def policy_table(data: dict) -> list[str]:
    out = [command_line(data), ""]
    out += header(
        "policy", "mean TTFT s", "paper", "mean TPOT ms", "paper", "recovery s", "paper", "attainment %",
        "interrupted", "restored / fetched / re-prefilled",
    )  # fmt: skip
    for name, entry in data["policies"].items():
        ours, theirs = entry["ours"], entry.get("paper") or {}
        out.append(
            row(
                [
                    name,
                    stat(ours["ttft_mean_s"]),
                    paper(theirs.get("ttft_mean_s")),
                    stat(ours["tpot_mean_s"], 1000, 0),
                    paper(theirs.get("tpot_mean_s"), 1000, ".0f"),
                    stat(ours["recovery_s"], digits=1),
                    paper(theirs.get("recovery_s"), fmt="g"),
                    stat(ours["attainment"], 100, 1),
                    mean(ours["interrupted"]),
                    paths(ours),
                ]
            )
        )
    base = data["policies"]["lifeline"]["ours"]
    out += [
        "",
        f"No-failure baseline, same window: TTFT {stat(base['baseline_ttft_s'])} s, "
        f"TPOT {stat(base['baseline_tpot_s'], 1000, 0)} ms",
        "",
    ]
    out += header("ratio (of the means; paired per seed ± 95 % CI)", "mean TTFT", "mean TPOT", "recovery time")
    for key in RATIOS:
        ratio = data["ratios"].get(key)
        if ratio:
            cells = [ratio_cell(ratio[m]) for m in ("ttft_mean_s", "tpot_mean_s", "recovery_s")]
            out.append(row([key.replace("_vs_", " vs "), *cells]))
    out += [""] + [f"- {line}" for line in data.get("verdict", [])]
    return out


def table1(data: dict) -> list[str]:
    out = [command_line(data), ""]
    out += header(
        "workers", "seeds", "run / fault s", "uninterrupted TTFT s", "paper", "replay TTFT s", "paper",
        "no-failure TTFT s", "interrupted",
    )  # fmt: skip
    for workers, size in data["sizes"].items():
        ours, theirs, setup = size["ours"], size["paper"], size["setup"]
        out.append(
            row(
                [
                    workers,
                    len(size["seeds"]),
                    f"{setup['duration_s']:g} / {setup['fault_at_s']:g}",
                    stat(ours["uninterrupted_ttft_s"]),
                    f"{theirs['uninterrupted_ttft_s']} ± {theirs['uninterrupted_ci']}",
                    stat(ours["replay_ttft_s"]),
                    f"{theirs['replay_ttft_s']} ± {theirs['replay_ci']}",
                    stat(ours["baseline_ttft_s"]),
                    mean(ours["interrupted"]),
                ]
            )
        )
    return out


def ablations(data: dict) -> list[str]:
    out = [command_line(data), ""]
    out += header(
        "variant", "mean TTFT s", "vs Lifeline", "mean TPOT ms", "recovery s", "vs Lifeline",
        "restored / fetched / re-prefilled", "drafts accepted / drafted / steps assisted (modelled)",
    )  # fmt: skip
    reference = data["variants"]["lifeline"]["ours"]

    def versus(ours: dict, key: str) -> str:
        a, b = ours[key].get("mean"), reference[key].get("mean")
        return "n/a" if a is None or not b else f"{(a / b - 1) * 100:+.1f} %"

    for name, variant in data["variants"].items():
        ours = variant["ours"]
        drafts = " / ".join(mean(ours.get(k)) for k in ("accepted_tokens", "drafted_tokens", "assisted_steps"))
        out.append(
            row(
                [
                    name,
                    stat(ours["ttft_mean_s"]),
                    versus(ours, "ttft_mean_s"),
                    stat(ours["tpot_mean_s"], 1000, 0),
                    stat(ours["recovery_s"], digits=1),
                    versus(ours, "recovery_s"),
                    paths(ours, 1),
                    drafts,
                ]
            )
        )
    return out


def grid(data: dict) -> list[str]:
    cells = data["cells"]
    thetas = sorted({key.split()[0].split("=")[1] for key in cells}, key=float)
    taus = sorted({key.split()[1].split("=")[1] for key in cells}, key=float)
    out = [command_line(data) + ": mean TTFT s / recovery s", ""]
    out += header("θ factor \\ τ", *taus)
    for theta in thetas:
        values = []
        for tau in taus:
            cell = cells[f"theta_factor={theta} tau={tau}"]
            values.append(f"{stat(cell['ttft_mean_s'])} / {stat(cell['recovery_s'], digits=1)}")
        out.append(row([theta, *values]))
    return out


def outcome(ours: dict, attainment_digits: int) -> list[str]:
    """Mean TTFT, mean TPOT, recovery time, attainment and faults of a run with drawn faults."""
    return [
        stat(ours["ttft_mean_s"]),
        stat(ours["tpot_mean_s"], 1000, 0),
        stat(ours["recovery_s"], digits=1),
        stat(ours["attainment"], 100, attainment_digits),
        mean(ours["faults"], digits=1),
    ]


def sensitivity(data: dict) -> list[str]:
    out = [command_line(data), ""]
    out += header(
        "variant / policy", "mean TTFT s", "mean TPOT ms", "recovery s", "attainment %", "faults",
        "restored / fetched / re-prefilled",
    )  # fmt: skip
    for name, ours in data["rows"].items():
        out.append(row([name, *outcome(ours, 1), paths(ours, 1)]))
    return out


def scale(data: dict) -> list[str]:
    out = [command_line(data)]
    for name, size in data.items():
        if not name.startswith("scale-"):
            continue
        out += ["", f"{name}: {size['kind']}", ""]
        out += header("policy", "mean TTFT s", "mean TPOT ms", "recovery s", "attainment %", "faults", "interrupted")
        for policy, ours in size["rows"].items():
            out.append(row([policy, *outcome(ours, 2), mean(ours["interrupted"])]))
        out += [f"- {line}" for line in size.get("verdict", [])]
    return out


def day(data: dict) -> list[str]:
    """`scale --day`: each fleet's days (composed from windows, modelled), then each drawn fault's window (measured)."""
    out = [command_line(data)]
    for name, size in data.items():
        if not name.startswith("day-"):
            continue
        out += ["", f"{name}: {size['kind']}", ""]
        if size.get("caveat"):
            out += [f"Caveat: {size['caveat']}", ""]
        out += header(
            "policy", "mean TTFT s", "attainment %", "faults", "node-hours out", "interrupted", "replay TTFT s",
            "recovery s", "restored / fetched / re-prefilled",
        )  # fmt: skip
        for policy, ours in size["rows"].items():
            out.append(
                row(
                    [
                        policy,
                        stat(ours["ttft_mean_s"], digits=4),
                        stat(ours["attainment"], 100, 4),
                        mean(ours["faults"], digits=1),
                        mean(ours["node_hours_out"], digits=1),
                        mean(ours["interrupted"], digits=1),
                        stat(ours["replay_ttft_s"], digits=3),
                        stat(ours["recovery_s"], digits=1),
                        paths(ours, 1),
                    ]
                )
            )
        out += [f"- {line}" for line in size.get("verdict", [])]
        policies = list(size["rows"])
        out += ["", "Each fault's window (measured): interrupted, and their replay TTFT in s, per policy", ""]
        out += header("day", "at h", "kind", "nodes out before", *(f"{p}: interrupted / replay s" for p in policies))
        for seed, faults in size["days"].items():
            for i, fault in enumerate(faults):
                cells = []
                for p in policies:
                    w = size["windows"][f"{p}/{seed}/{i}"]
                    replay = "–" if w["replay_ttft_s"] is None else f"{w['replay_ttft_s']:.3f}"
                    cells.append(f"{w['interrupted']} / {replay}")
                out.append(row([seed, f"{fault['at_s'] / 3600:.1f}", fault["kind"], fault["out_before"], *cells]))
    return out


def resume(data: dict) -> list[str]:
    """`resume`: eq. 6 against plan_soonest, each variant paired with LUMEN (load_aware) seed by seed."""
    out = [command_line(data)]
    for name, size in data.items():
        if not isinstance(size, dict) or "vs_load_aware" not in size:
            continue
        out += ["", f"{name}: {size['setup']['workers']} workers", ""]
        out += header(
            "variant", "mean TTFT s", "recovery s", "replay TTFT s", "restored / fetched / re-prefilled",
            "vs LUMEN, paired: TTFT %", "recovery %", "replay TTFT %",
        )  # fmt: skip
        for label, ours in size["rows"].items():
            vs = size["vs_load_aware"].get(label, {})
            cells = [stat(vs.get(k), 100, 1) if vs else "–" for k in ("ttft_mean_s", "recovery_s", "replay_ttft_s")]
            out.append(
                row(
                    [
                        label,
                        stat(ours["ttft_mean_s"], digits=3),
                        stat(ours["recovery_s"], digits=1),
                        stat(ours["replay_ttft_s"], digits=3),
                        paths(ours, 1),
                        *cells,
                    ]
                )
            )
    return out


def spares(data: dict) -> list[str]:
    loads = data["attainment_by_load"]
    missed = data["missed_requests_per_fault_by_load"]
    probe = data["probe"]["workers"]
    out = [
        command_line(data),
        "",
        f"Measured on {probe} workers: no-fault attainment by load "
        + ", ".join(f"×{x} {loads[x]['mean'] * 100:.2f} %" for x in loads)
        + "; requests one crash costs beyond the baseline's misses "
        + ", ".join(f"×{x} {missed[x]['value']:.0f}" for x in missed)
        + ".",
        "",
    ]
    counts = sorted(set.intersection(*({p["spares"] for p in fleet["curve"]} for fleet in data["fleets"].values())))
    names = [f"{n} spare{'s' if n != 1 else ''}" for n in counts]
    names[0] += ": mean / worst 5 % days"
    target = next(iter(data["fleets"].values()))["slo_target"]
    enough = f"spares for ≥ {target * 100:g} % on 95 % of days"
    out += header("nodes", "load per worker", "faults/day", *names, enough, "GPU-hours/day")
    for fleet in data["fleets"].values():
        curve = {point["spares"]: point for point in fleet["curve"]}
        cells = [f"{curve[n]['attainment_mean'] * 100:.3f} / {curve[n]['attainment_p5_day'] * 100:.3f}" for n in counts]
        spare_cost = curve[1]["spare_gpu_hours_per_day"] if 1 in curve else 0
        out.append(
            row(
                [
                    fleet["nodes"],
                    f"×{fleet['load']:g} ({fleet['rate_per_worker']:.2f} req/s)",
                    f"{fleet['faults_per_day_mean']:.2f}",
                    *cells,
                    fleet["spares_for_slo"],
                    f"{curve[0]['gpu_hours_per_day']:,} + {spare_cost} per spare",
                ]
            )
        )
    return out


RENDER = {"table1": table1, "ablations": ablations, "grid": grid, "sensitivity": sensitivity, "scale": scale}
RENDER |= {"spares": spares} | {name: policy_table for name in POLICY_TABLES}
RENDER |= {name: day for name in DAY_TABLES}
RENDER["resume"] = resume


def render(name: str, results: Path = RESULTS) -> str:
    data = json.loads((results / f"lumen_{name}.json").read_text())
    return "\n".join(RENDER[name](data))


def main(argv: list[str] | None = None) -> int:
    names = (sys.argv[1:] if argv is None else argv) or [n for n in RENDER if (RESULTS / f"lumen_{n}.json").exists()]
    unknown = [n for n in names if n not in RENDER]
    if unknown:
        print(f"no table for {', '.join(unknown)}: expected one of {', '.join(RENDER)}", file=sys.stderr)
        return 2
    for name in names:
        print(f"<!-- {name} -->\n{render(name)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
