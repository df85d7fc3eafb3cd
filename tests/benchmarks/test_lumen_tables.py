"""benchmarks.lumen_tables: the README's document 000 tables come from the results files, figure for figure."""

import json

import pytest

from benchmarks import lumen_tables as lt


def test_a_figure_is_its_mean_and_interval_with_the_runs_that_gave_none_counted_apart():
    assert lt.stat({"mean": 1.2345, "ci95": 0.5, "n": 3, "missing": 0}) == "1.23 ± 0.50"
    assert lt.stat({"mean": 0.071, "ci95": 0.008, "n": 3, "missing": 0}, 1000, 0) == "71 ± 8"
    assert lt.stat({"mean": 60.0, "ci95": None, "n": 1, "missing": 2}, digits=1) == "60.0 (2 n/a)"
    assert lt.stat({"mean": None, "ci95": None, "n": 0, "missing": 3}) == "n/a (3 runs)"
    assert lt.stat(None) == "n/a"


@pytest.mark.parametrize("name", sorted(lt.RENDER))
def test_every_results_file_renders(name):
    # benchmarks/README.md shows every one of these tables: its results file is committed beside it.
    assert (lt.RESULTS / f"lumen_{name}.json").exists(), f"benchmarks/results/lumen_{name}.json is missing"
    text = lt.render(name)
    data = json.loads((lt.RESULTS / f"lumen_{name}.json").read_text())
    assert data["command"] in text
    assert text.count("\n|---|") >= 1


def test_a_policy_tables_rows_are_the_results_figures(tmp_path):
    entry = {"mean": 1.5, "ci95": 0.25, "n": 2, "missing": 0, "kind": "measured"}
    ours = {
        key: entry
        for key in ("ttft_mean_s", "tpot_mean_s", "recovery_s", "attainment", "baseline_ttft_s", "baseline_tpot_s")
    }
    ours |= {k: {"mean": v, "ci95": 0, "n": 2, "missing": 0} for k, v in (("interrupted", 10.0), ("restored", 6.0),
             ("fetched", 1.0), ("reprefilled", 3.0))}  # fmt: skip
    ratio = {"ours": -0.125, "ours_paired": {"mean": -0.1, "ci95": 0.05, "n": 2, "missing": 0}, "paper": -0.3}
    data = {
        "command": "python -m recovery.sim.lumen workers4 --seeds 2",
        "wall_s": 12.3,
        "generated_at": "2026-11-29T10:00:00Z",
        "policies": {"load_aware": {"ours": ours, "paper": {"ttft_mean_s": 2.61}}, "lifeline": {"ours": ours}},
        "ratios": {"lifeline_vs_load_aware": {m: ratio for m in ("ttft_mean_s", "tpot_mean_s", "recovery_s")}},
        "verdict": ["workers4: Lifeline ties LUMEN"],
    }
    (tmp_path / "lumen_workers4.json").write_text(json.dumps(data))

    lines = lt.render("workers4", tmp_path).splitlines()

    assert lines[0] == "`python -m recovery.sim.lumen workers4 --seeds 2` (12 s; 2026-11-29)"
    assert (
        "| load_aware | 1.50 ± 0.25 | 2.61 | 1500 ± 250 | – | 1.5 ± 0.2 | – | 150.0 ± 25.0 | 10 | 6 / 1 / 3 |" in lines
    )
    assert lines[-3].startswith("| lifeline vs load_aware | -12.5 %; paired -10.0 ± 5.0 % (paper -30.0 %) |")
    assert lines[-1] == "- workers4: Lifeline ties LUMEN"


def _kinds(node):
    """The kind of every figure (a dict with a mean or a value) and of every section that states one; a fault's
    `kind` (crash, sdc…) is not a figure's."""
    if isinstance(node, dict):
        kind = node.get("kind")
        if isinstance(kind, str) and ({"mean", "value"} & node.keys() or " " in kind):
            yield kind
        for value in node.values():
            yield from _kinds(value)
    elif isinstance(node, list):
        for value in node:
            yield from _kinds(value)


@pytest.mark.parametrize("path", sorted(lt.RESULTS.glob("lumen_*.json")), ids=lambda p: p.stem)
def test_the_simulators_figures_are_labelled_simulated_never_measured(path):
    """Issue 42: every figure of these files was produced by the simulator (or is arithmetic on its figures, or an
    input); none was measured on the real processes, so none says so."""
    data = json.loads(path.read_text())
    kinds = set(_kinds(data)) | set(((data.get("provenance") or {}).get("kinds") or {}).values())
    assert kinds and not any("measured" in kind for kind in kinds), kinds
    assert all(kind.split(" ")[0].rstrip(":") in ("simulated", "modelled", "input") for kind in kinds), kinds
    assert "measured" not in data.get("kinds", {})
