"""benchmarks.lumen_comparisons (issue 42): every Lifeline-against-LUMEN comparison of the lumen results, each paired
per seed and tested, Holm's correction over the whole family, the seeds each used against the tuning seeds 1-3,
and recovery.sim.lumen's --first-seed for the reruns on other seeds. Reads JSON only: no simulation runs here."""

import json
import math
import shlex

import pytest

from benchmarks import lumen_comparisons as lc
from benchmarks import render
from recovery.sim import lumen


@pytest.fixture(scope="module")
def files():
    return lc.load_files()


@pytest.fixture(scope="module")
def analysis():
    return lc.analyse()


# --- Student's t ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t, df", [(2.262, 9), (2.776, 4), (12.706, 1), (2.042, 30)])
def test_the_two_sided_p_of_the_tables_95_percent_quantiles_is_five_percent(t, df):
    assert lc.t_two_sided_p(t, df) == pytest.approx(0.05, abs=5e-4)
    assert lc.t_two_sided_p(-t, df) == lc.t_two_sided_p(t, df)


def test_the_t_distribution_at_its_ends_and_against_the_normal():
    assert lc.t_two_sided_p(0.0, 5) == 1.0
    assert lc.t_two_sided_p(math.inf, 5) == 0.0
    assert lc.t_two_sided_p(1.96, 100_000) == pytest.approx(0.05, abs=2e-4)  # the normal's 1.96
    assert lc.t_two_sided_p(1.0, 1) == pytest.approx(0.5)  # Cauchy: P(|T| > 1) = 1/2
    assert lc.t_two_sided_p(4.604, 4) == pytest.approx(0.01, abs=2e-4)  # the 99.5 % quantile at df 4
    assert lc.betai(1.0, 1.0, 0.3) == pytest.approx(0.3) and lc.betai(2.5, 2.5, 0.5) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        lc.t_two_sided_p(1.0, 0)


def test_the_95_percent_quantile_is_recovery_sim_lumens_table():
    for df, t in enumerate(lumen.T_975, start=1):
        assert lc.t_quantile_975(df) == pytest.approx(t, abs=1e-3), df


def test_a_one_sample_test_of_a_mean_against_zero():
    out = lc.one_sample([1.0, 2.0, 3.0])
    assert out["mean"] == 2.0 and out["df"] == 2 and out["t"] == pytest.approx(2 * math.sqrt(3))
    assert out["ci95"] == pytest.approx(4.303 / math.sqrt(3), abs=1e-3)
    assert out["p"] == pytest.approx(lc.t_two_sided_p(2 * math.sqrt(3), 2))
    assert lc.one_sample([0.2])["p"] is None and lc.one_sample([])["mean"] is None  # no test under two seeds
    assert lc.one_sample([0.0, 0.0])["p"] == 1.0 and lc.one_sample([0.1, 0.1])["p"] == 0.0  # no spread at all


# --- Holm -------------------------------------------------------------------------------------------------------
def test_holm_on_a_hand_example():
    out = lc.holm([0.01, 0.04, 0.03], 0.05)
    # sorted 0.01, 0.03, 0.04: ×3 = 0.03, ×2 = 0.06, ×1 = 0.04 → the running maximum 0.06
    assert [o["p_holm"] for o in out] == pytest.approx([0.03, 0.06, 0.06])
    assert [o["survives"] for o in out] == [True, False, False]


def test_holm_steps_down_where_bonferroni_would_stop_and_counts_untested_comparisons():
    out = lc.holm([0.012, 0.02, 0.04], 0.05)  # Bonferroni: 0.036, 0.06, 0.12; Holm: 0.036, 0.04, 0.04
    assert [o["p_holm"] for o in out] == pytest.approx([0.036, 0.04, 0.04])
    assert all(o["survives"] for o in out)
    out = lc.holm([0.02, None], 0.05)  # a comparison without a test still counts in m
    assert out[0] == {"p_holm": pytest.approx(0.04), "survives": True} and out[1] == {"p_holm": None, "survives": False}
    assert lc.holm([0.6, 0.9]) == [{"p_holm": 1.0, "survives": False}, {"p_holm": 1.0, "survives": False}]


# --- pairing ----------------------------------------------------------------------------------------------------
def test_a_comparison_is_paired_seed_by_seed():
    runs = [
        {"label": "lifeline", "policy": "lifeline", "seed": 1, "ttft_mean_s": 1.0},
        {"label": "lifeline", "policy": "lifeline", "seed": 2, "ttft_mean_s": 4.0},
        {"label": "lifeline", "policy": "lifeline", "seed": 3, "ttft_mean_s": 9.0},  # LUMEN has no seed 3
        {"label": "load_aware", "policy": "load_aware", "seed": 2, "ttft_mean_s": 4.0},
        {"label": "load_aware", "policy": "load_aware", "seed": 1, "ttft_mean_s": 2.0},
    ]
    out = lc.paired(runs, "lifeline", "load_aware", "ttft_mean_s")
    # seed 1: 1/2 − 1 = −0.5, seed 2: 0; not the ratio of the means (−1/6), not the runs in file order (+0.125)
    assert out["seeds"] == [1, 2] and [r["ratio"] for r in out["per_seed"]] == [-0.5, 0.0]
    assert out["mean"] == pytest.approx(-0.25) and out["n"] == 2


def test_a_figure_missing_on_a_seed_leaves_that_seed_out_and_both_zero_is_a_tie():
    runs = [
        {"label": "lifeline", "policy": "lifeline", "seed": s, "recovery_s": v} for s, v in ((1, None), (2, 0.0))
    ] + [{"label": "load_aware", "policy": "load_aware", "seed": s, "recovery_s": v} for s, v in ((1, 5.0), (2, 0.0))]
    out = lc.paired(runs, "lifeline", "load_aware", "recovery_s")
    assert out["used_seeds"] == [2] and out["missing"] == 1 and out["mean"] == 0.0 and out["p"] is None


def test_the_paired_means_are_the_ones_recovery_sim_lumen_stored(files, analysis):
    """The family's pairing is recovery.sim.lumen's own: every paired ratio a file stored, recomputed here."""
    by_id = {c["id"]: c for c in analysis["comparisons"]}
    checked = 0
    for stem, data in files.items():
        for key, section in lc.sections(data):
            stored = {
                ("lifeline", f): v["ours_paired"]
                for f, v in section.get("ratios", {}).get("lifeline_vs_load_aware", {}).items()
            }
            for label, figures in section.get("vs_load_aware", {}).items():
                stored |= {(label, f): v for f, v in figures.items()}
            for (label, figure), value in stored.items():
                c = by_id["/".join(x for x in (stem, key, label, figure) if x)]
                assert c["n"] == value["n"] and c["missing"] == value["missing"]
                if value["mean"] is None:
                    assert c["mean"] is None
                else:
                    assert c["mean"] == pytest.approx(value["mean"], abs=1e-12)
                    assert c["ci95"] == pytest.approx(value["ci95"], rel=1e-3)  # lumen's t to 3 decimals
                checked += 1
    assert checked == 5 * 3 + 3 * 2 * 3  # five policy tables × 3 figures; resume's 3 setups × 2 variants × 3


# --- the family -------------------------------------------------------------------------------------------------
def _independent_family(files: dict) -> set[tuple[str, str, str, str]]:
    """Every (file, section, Lifeline label, figure) counted afresh: each dict holding runs, each lifeline label
    there that is not an ablation, paired with load_aware runs in the same place, each figure its runs carry."""
    found = set()
    for stem, data in files.items():
        places = [("", data)] if "runs" in data else [(k, v) for k, v in data.items() if isinstance(v, dict)]
        for key, place in places:
            runs = place.get("runs") or []
            lumen_prefixes = {r["label"][: -len("load_aware")] for r in runs if r["policy"] == "load_aware"}
            lumen_prefixes |= {"" for r in runs if r["label"] == "load_aware (LUMEN)"}
            switched = {k for k, v in place.get("variants", {}).items() if v["switches"]}
            for r in runs:
                if r["policy"] != "lifeline" or r["label"] in switched:
                    continue
                prefix = r["label"][: r["label"].rfind("/") + 1]
                if prefix not in lumen_prefixes:
                    continue
                for figure in ("ttft_mean_s", "replay_ttft_s", "recovery_s", "tpot_mean_s"):
                    if figure in r:
                        found.add((stem, key, r["label"], figure))
    return found


def test_every_lifeline_against_lumen_comparison_of_the_lumen_files_is_in_the_family(files, analysis):
    family = {
        (c["file"].split("/")[-1][:-5], c["section"] or "", c["lifeline_label"], c["figure"])
        for c in analysis["comparisons"]
    }
    expected = _independent_family(files)
    assert family == expected and len(analysis["comparisons"]) == len(expected)
    assert analysis["summary"]["N"] == len(expected)
    # what the files' own ratios, verdicts and resume sections compare is all in it
    stems = {stem for stem, _, _, _ in expected}
    assert {"lumen_workers4", "lumen_resume", "lumen_scale_day_256", "lumen_sensitivity"} <= stems
    assert {"lumen_grid", "lumen_table1", "lumen_spares"}.isdisjoint(stems)  # no LUMEN runs in them
    for stem, data in files.items():
        for key, section in lc.sections(data):
            for line in section.get("verdict") or []:
                figure = next(f for f, name in lc.FIGURES.items() if name in line)
                assert (stem, key, "lifeline", figure) in expected, line
    assert not any(label.startswith("no_") for _, _, label, _ in expected)  # the ablated variants are not Lifeline


def test_the_results_file_is_this_analysis_of_the_lumen_files(analysis):
    saved = json.loads((lc.RESULTS / f"{lc.NAME}.json").read_text())
    assert [c["id"] for c in saved["comparisons"]] == [c["id"] for c in analysis["comparisons"]]
    for mine, theirs in zip(saved["comparisons"], analysis["comparisons"]):
        assert (mine["p"], mine["p_holm"], mine["survives"]) == (theirs["p"], theirs["p_holm"], theirs["survives"])
    assert saved["summary"] == analysis["summary"] and saved["headline"] == analysis["headline"]
    assert saved["provenance"]["command"] == "python -m benchmarks.lumen_comparisons"
    assert saved["provenance"]["kinds"]["comparisons[].p_holm"] == "modelled"
    assert saved["provenance"]["kinds"]["comparisons[].mean"] == "simulated"


def test_the_correction_runs_over_the_whole_family_and_the_count_says_who_survives(analysis):
    family, summary = analysis["comparisons"], analysis["summary"]
    adjusted = lc.holm([c["p"] for c in family])
    assert [c["p_holm"] for c in family] == [a["p_holm"] for a in adjusted]
    assert summary["K"] == sum(c["survives"] for c in family)
    assert summary["better"] + summary["worse"] == summary["K"]
    assert summary["testable"] == sum(c["p"] is not None for c in family)
    # the smallest p is held to α / N, every comparison of every file counting in N
    first = min((c for c in family if c["p"] is not None), key=lambda c: c["p"])
    assert first["p_holm"] == pytest.approx(min(1.0, first["p"] * summary["N"]))
    assert first["survives"] == (first["p"] <= 0.05 / summary["N"])
    assert summary["smallest_p"][0]["id"] == first["id"]


def test_each_comparison_says_its_seeds_and_whether_tuning_seeds_are_among_them(analysis):
    for c in analysis["comparisons"]:
        assert c["overlaps_tuning_seeds"] == bool(set(c["used_seeds"]) & {1, 2, 3})
        assert c["held_out"]["seeds"] == [s for s in c["seeds"] if s > 3]
    runs = [
        {"label": p, "policy": p, "seed": s, "ttft_mean_s": float(s)}
        for p in ("lifeline", "load_aware")
        for s in (4, 5)
    ]
    family = lc.comparisons({"lumen_x": {"runs": runs}})
    assert family[0]["overlaps_tuning_seeds"] is False and family[0]["held_out"]["n"] == 2


def test_variants_pair_with_their_own_lumen_run_and_ablations_are_left_out():
    section = {
        "runs": [
            {"label": label, "policy": label.rsplit("/", 1)[-1].split(" ")[0], "seed": 1}
            for label in ("a/lifeline", "a/load_aware", "b/lifeline", "b/load_aware")
        ]
    }
    assert lc.pairs(section) == [("a/lifeline", "a/load_aware"), ("b/lifeline", "b/load_aware")]
    ablations = {
        "runs": [
            {"label": "lifeline", "policy": "lifeline", "seed": 1},
            {"label": "no_second_holder", "policy": "lifeline", "seed": 1},
            {"label": "load_aware (LUMEN)", "policy": "load_aware", "seed": 1},
        ],
        "variants": {"lifeline": {"switches": {}}, "no_second_holder": {"switches": {"second_holder": False}}},
    }
    assert lc.pairs(ablations) == [("lifeline", "load_aware (LUMEN)")]
    assert lc.pairs({"runs": [{"label": "x", "policy": "lifeline", "seed": 1}]}) == []  # no LUMEN: no comparison


def test_the_same_runs_under_another_experiments_name_are_marked(analysis):
    same = {c["id"]: c["same_runs_as"] for c in analysis["comparisons"] if c["same_runs_as"]}
    assert same["lumen_ablations/lifeline/ttft_mean_s"] == "lumen_workers4/lifeline/ttft_mean_s"
    assert same["lumen_sensitivity/leaf_infiniband_50GBps/lifeline/ttft_mean_s"] == (
        "lumen_workers4/lifeline/ttft_mean_s"
    )
    # two setups that both never got back within the run are not the same runs
    assert "lumen_workers8_rate10/lifeline/recovery_s" not in same
    assert analysis["summary"]["distinct"]["N"] == len(analysis["comparisons"]) - len(same)


# --- the reruns on seeds apart from the tuning seeds ------------------------------------------------------------
def test_first_seed_moves_every_seed_and_the_default_is_unchanged(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setitem(lumen.RUNNERS, "workers4", lambda ctx: seen.append(ctx) or {})
    lumen.main(["workers4"], out_dir=tmp_path)
    lumen.main(["workers4", "--seeds", "3", "--first-seed", "101"], out_dir=tmp_path)
    assert [c.seeds for c in seen] == [(1, 2, 3), (101, 102, 103)]
    written = json.loads((tmp_path / "lumen_workers4.json").read_text())
    assert written["seeds"] == [101, 102, 103] and written["command"].endswith("--first-seed 101")


def test_first_seed_below_one_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit):
        lumen.main(["workers4", "--first-seed", "0"], out_dir=tmp_path)
    assert "--first-seed must be at least 1" in capsys.readouterr().err


def test_a_days_steady_windows_take_the_first_seed_too(monkeypatch):
    """A day's no-fault windows ran on seed 1 whatever the days' seeds; with --first-seed 101 no run may."""
    jobs = []

    class Stop(Exception):
        pass

    def capture(batch, processes, runner=None):
        jobs.extend(batch)
        raise Stop

    monkeypatch.setattr(lumen, "run_jobs", capture)
    monkeypatch.setattr(lumen, "draw_day", lambda nodes, seed: [lumen.DayFault(3600.0, "crash", math.inf, 0)])
    ctx = lumen.Context(seeds=(101, 102), quick=False, jobs=1, day=True, command="c", fleets=(8,))
    with pytest.raises(Stop):
        lumen.scale(ctx)
    steady = {j.seed for j in jobs if "/steady/" in j.label}
    assert steady == {101} and {j.seed for j in jobs} == {101, 101_000, 102_000}


def test_each_rerun_is_its_files_command_on_seeds_from_101(files, analysis, monkeypatch, tmp_path):
    seen = {}
    for name in lumen.RUNNERS:
        monkeypatch.setitem(lumen.RUNNERS, name, lambda ctx, name=name: seen.setdefault(name, ctx) and {})
    reruns = analysis["rerun"]
    assert {r["file"] for r in reruns} == {c["file"] for c in analysis["comparisons"]}
    for r in reruns:
        data = files[r["file"].split("/")[-1][:-5]]
        assert r["command"] == f"{data['command']} --first-seed 101" and r["estimated_s"] == data["wall_s"]
        args = shlex.split(r["command"])
        assert args[:3] == ["python", "-m", "recovery.sim.lumen"]
        seen.clear()
        lumen.main(args[3:], out_dir=tmp_path)
        (ctx,) = seen.values()
        assert ctx.seeds == tuple(range(101, 101 + len(data["seeds"])))
        assert not set(ctx.seeds) & set(lc.TUNING_SEEDS)


# --- the docs -----------------------------------------------------------------------------------------------------
def test_the_table_has_a_row_per_comparison_and_the_summary_counts_them(analysis):
    table = render.lumen_comparisons_table()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| setup")]
    assert len(rows) == analysis["summary"]["N"]
    assert "--first-seed 101" in table and "lumen_comparisons.json" in table
    summary = render.lumen_comparisons_summary()
    s = analysis["summary"]
    assert summary.startswith(f"{s['K']} of {s['N']} comparisons survive Holm's correction at 5 %")
    assert "simulated" in summary and "modelled" in summary and "lumen_comparisons.json" in summary
    assert "\n" not in summary and "|" not in summary  # it sits in a table's cell


def test_the_summary_says_what_the_results_file_says(monkeypatch, tmp_path):
    data = json.loads((lc.RESULTS / f"{lc.NAME}.json").read_text())
    data["summary"] |= {"K": 1, "better": 1, "worse": 0}
    (tmp_path / f"{lc.NAME}.json").write_text(json.dumps(data))
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    assert render.lumen_comparisons_summary().startswith(
        f"1 of {data['summary']['N']} comparisons survive Holm's correction at 5 % (Lifeline better in 1, worse in 0)"
    )
