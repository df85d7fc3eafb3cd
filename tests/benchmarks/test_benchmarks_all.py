"""`python -m benchmarks all` (benchmarks/__main__.py): its plan holds every benchmark and every results file, runs
them one at a time in an order that keeps heavy runs apart (the LUMEN analysis after the LUMEN experiments, render
last), and `--dry-run` prints that order and runs nothing."""

import importlib
import json
import re
import subprocess
import sys

import pytest

from harness import provenance

runner = importlib.import_module("benchmarks.__main__")
BENCHMARKS = runner.BASE_DIR / "benchmarks"


def adjacent_heavy(entries) -> int:
    return sum(a.heavy and b.heavy for a, b in zip(entries, entries[1:]))


def test_the_plans_names_and_results_files_are_each_its_own():
    names = [b.name for b in runner.PLAN]
    assert len(names) == len(set(names))
    full = [name for b in runner.PLAN for name in b.outputs]
    assert len(full) == len(set(full)), "two entries write the same results file"
    for b in runner.PLAN:
        assert b.quick_note, f"{b.name}: where its quick form comes from is not said"
        assert b.quick is not None or "left out" in b.quick_note


def test_every_results_file_is_written_by_an_entry_of_the_plan_or_excluded_with_a_reason():
    written = {name for b in runner.PLAN for name in (*b.outputs, *(b.quick_outputs or ()))}
    files = sorted(p.name for p in runner.RESULTS.glob("*.json"))
    assert files
    for name in files:
        if name in runner.EXCLUDED_RESULTS:
            assert runner.EXCLUDED_RESULTS[name].strip()
            continue
        assert name in written, f"benchmarks/results/{name}: no entry of benchmarks/__main__.py's PLAN writes it"
    assert "suite_time.json" in runner.EXCLUDED_RESULTS
    assert not {b.name for b in runner.PLAN} & {"suite_time"}
    # And the other way: every file the full forms write is committed (the results folder holds the latest runs).
    assert {name for b in runner.PLAN for name in b.outputs} <= set(files)


def test_every_benchmark_module_that_saves_results_is_in_the_plan_and_every_other_module_is_named_as_not_one():
    planned = {b.module for b in runner.PLAN}
    for path in sorted(BENCHMARKS.glob("*.py")):
        stem = path.stem
        if stem == "__init__":
            continue
        module = f"benchmarks.{stem}"
        if stem not in ("common", "__main__") and re.search(r"(?<![\w.])save\(", path.read_text()):
            assert module in planned, f"{module} saves a results file and is not in PLAN"
        assert (module in planned) != (stem in runner.NOT_BENCHMARKS), f"{module}: in PLAN or NOT_BENCHMARKS, once"


def test_the_full_forms_are_the_commands_the_results_files_record():
    compared = 0
    for b in runner.PLAN:
        for name in b.outputs:
            command, _ = runner.recorded(runner.RESULTS / name)
            recorded = runner.module_args(command) if command else None
            if recorded and recorded[0] == b.module:
                assert recorded == (b.module, b.full), (name, command)
                compared += 1
    assert compared >= 15  # the lumen experiments, assist, placement, sim_validation, the simulator's speed…


@pytest.mark.parametrize("quick", [False, True])
def test_a_dry_run_prints_every_command_in_order_and_runs_nothing(monkeypatch, capsys, quick):
    def refuse(*args, **kwargs):
        raise AssertionError(f"--dry-run ran {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    assert runner.main(["all", "--dry-run", *(["--quick"] if quick else [])]) == 0
    out = capsys.readouterr().out
    entries, left = runner.select(quick)
    at = -1
    for b in entries:
        line = "python -m " + " ".join([b.module, *b.args(quick)])
        found = out.find(f"        {line}\n", at + 1)
        assert found > at, f"{b.name}'s command {line!r} missing or out of order"
        at = found
    assert re.search(r"^total ~?\d", out, re.M)
    if quick:
        assert [b.name for b, _ in left] == ["lumen_scale_day_1000"]
        assert "left out: lumen_scale_day_1000" in out
        assert "recovery.sim.lumen scale --day --fleets 1000" not in out
    else:
        assert not left and len(entries) == len(runner.PLAN)
        assert "sim_validation" in out and "(recorded)" in out


def lumen_experiments(entries):
    return [i for i, b in enumerate(entries) if b.module == "recovery.sim.lumen"]


@pytest.mark.parametrize(
    "quick, only",
    [(False, ()), (True, ()), (False, ("lumen_*", "render")), (True, ("lumen_comparisons", "lumen_grid", "chaos"))],
)
def test_the_lumen_analysis_runs_after_every_lumen_experiment_and_render_last(quick, only):
    entries, _ = runner.select(quick, only)
    names = [b.name for b in entries]
    comparisons = names.index("lumen_comparisons")
    assert lumen_experiments(entries) and all(i < comparisons for i in lumen_experiments(entries))
    if "render" in names or not only:
        assert names[-1] == "render"


@pytest.mark.parametrize("quick", [False, True])
def test_heavy_and_light_runs_alternate_so_no_two_heavy_runs_are_next_to_each_other(quick):
    entries, _ = runner.select(quick)
    assert adjacent_heavy(entries) == 0, [b.name for b in entries]
    heavy = sum(b.heavy for b in entries)
    assert heavy >= 15 and len(entries) - heavy - 1 >= heavy  # enough light runs (render aside) to go between


def test_two_heavy_runs_are_next_to_each_other_only_once_the_light_ones_are_used_up():
    heavy = [b.name for b in runner.PLAN if b.heavy]
    for light in ([], ["policies"], ["policies", "placement", "slo_rollup"]):
        entries, _ = runner.select(False, [*heavy, *light])
        assert len(entries) == len(heavy) + len(light)
        assert adjacent_heavy(entries) == len(heavy) - len(light) - 1
        assert [b.name for b in entries if b.heavy] == heavy  # PLAN's order within a kind
    entries, _ = runner.select(False, ["policies", "placement", "chaos"])
    assert [b.name for b in entries] == ["policies", "chaos", "placement"]


def test_an_unknown_name_is_refused_and_skip_leaves_an_entry_out():
    with pytest.raises(SystemExit):
        runner.select(False, ["no_such_benchmark"])
    entries, left = runner.select(False, skip=["chaos", "lumen_scale_day_*"])
    assert not {b.name for b in entries} & {"chaos", "lumen_scale_day_256", "lumen_scale_day_1000"}
    assert {b.name for b, _ in left} == {"chaos", "lumen_scale_day_256", "lumen_scale_day_1000"}


def test_a_run_goes_on_after_failures_lists_them_and_gives_a_results_file_without_provenance_its_own(
    monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr(runner, "RESULTS", tmp_path)
    monkeypatch.setattr(provenance, "host", lambda: {"name": "here"})
    monkeypatch.setattr(provenance, "code", lambda repo=None: {"commit": "abc", "dirty": False})
    monkeypatch.setenv("LIFELINE_ALL_MARKER", "passed on")
    monkeypatch.delenv("DATABASE_URL", raising=False)  # slo_report cannot run without PostgreSQL
    (tmp_path / "policies.json").write_text(json.dumps({"provenance": {"command": "before"}}))
    calls = []

    def fake(argv, cwd=None, env=None, **kwargs):
        assert argv[:2] == [sys.executable, "-m"] and cwd == runner.BASE_DIR
        assert env["LIFELINE_ALL_MARKER"] == "passed on"
        calls.append(argv[2:])
        module = argv[2]
        if module == "benchmarks.chaos":  # writes its own JSON, without a provenance record
            (tmp_path / "chaos.json").write_text(json.dumps({"seed": 7}))
        elif module == "benchmarks.policies":  # save() wrote its record: left alone
            (tmp_path / "policies.json").write_text(json.dumps({"provenance": {"command": "mine"}, "x": 1}))
        status = 3 if module == "benchmarks.render" else 0  # lumen_comparisons: exit 0 and no file written
        return subprocess.CompletedProcess(argv, status)

    monkeypatch.setattr(subprocess, "run", fake)
    status = runner.main(["all", "--only", "chaos", "policies", "slo_report", "lumen_comparisons", "render"])
    out = capsys.readouterr().out

    assert status == 1
    assert calls == [
        ["benchmarks.policies"],
        ["benchmarks.chaos", "--minutes", "30", "--gap", "45", "--clients", "6", "--seed", "7"],
        ["benchmarks.lumen_comparisons"],
        ["benchmarks.render"],
    ]
    for name in ("policies", "chaos", "lumen_comparisons", "render"):
        assert re.search(rf"start {name}: python -m ", out)
        assert re.search(rf"\] {name}: exit status \d after ", out)
    failed = [line for line in out.splitlines() if line.startswith("FAILED ")]
    assert failed == [
        "FAILED slo_report: not run, it needs DATABASE_URL=postgres://…",
        "FAILED lumen_comparisons: exit status 0 but did not write lumen_comparisons.json",
        "FAILED render: exit status 3",
    ]
    chaos = json.loads((tmp_path / "chaos.json").read_text())
    assert chaos["seed"] == 7
    assert chaos["provenance"]["command"] == "python -m benchmarks.chaos --minutes 30 --gap 45 --clients 6 --seed 7"
    assert chaos["provenance"]["commit"] == "abc" and chaos["provenance"]["wall_s"] >= 0
    assert json.loads((tmp_path / "policies.json").read_text())["provenance"] == {"command": "mine"}
    assert "provenance added to chaos.json" in out and "provenance added to policies.json" not in out
