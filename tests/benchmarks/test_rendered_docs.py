"""benchmarks.render: the docs' figures are the results files' (issue 42): a block that differs from what its results
file renders fails here, and the blocks render what the file says."""

import json

import pytest

from benchmarks import render


def test_every_results_block_in_the_docs_is_what_its_results_file_renders():
    assert render.stale() == [], "run: python -m benchmarks.render"
    names = set().union(*(render.block_names(path.read_text()) for path in render.documents()))
    assert names == set(render.BLOCKS), "every renderer is used somewhere, every block has a renderer"


def test_a_hand_edited_figure_inside_a_block_is_caught(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    text = render.render("Placement: <!-- results:placement-summary --><!-- /results:placement-summary -->.")
    assert "LLMFabric 74.9 %" in text  # benchmarks/results/placement.json's figure at 90 % of the fleet's capacity
    page.write_text(text.replace("LLMFabric 74.9 %", "LLMFabric 70.0 %"))
    monkeypatch.setattr(render, "documents", lambda: [page])
    assert render.stale() == [f"{page}: placement-summary"]
    assert render.main(["--check"]) == 1
    render.main([])
    assert render.stale() == [] and "LLMFabric 74.9 %" in page.read_text()


def test_the_blocks_render_the_results_figures_with_their_kind(monkeypatch, tmp_path):
    data = json.loads((render.RESULTS / "sim_validation.json").read_text())
    data["within_goal"] = "1 of 32 pairs within 10 % (a test's figure)"
    data["results"][0]["emulated"]["ttft_mean_ms"] = 999.5
    (tmp_path / "sim_validation.json").write_text(json.dumps(data))
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    table = render.sim_validation_table()
    assert "999.5 / 162.2" in table and "1 of 32 pairs" in table
    summary = render.sim_validation_summary()
    assert "measured" in summary and "simulated" in summary and "sim_validation.json" in summary


def test_an_unknown_block_name_is_an_error_that_names_the_known_ones():
    with pytest.raises(KeyError, match="placement-summary"):
        render.render("<!-- results:no-such-table --><!-- /results:no-such-table -->")


def test_the_measured_table_renders_each_row_from_its_results_file(monkeypatch, tmp_path):
    for path in render.RESULTS.glob("*.json"):
        (tmp_path / path.name).write_text(path.read_text())
    data = json.loads((tmp_path / "policies.json").read_text())
    data["recovery_dispatch"]["plan_median_ms"] = 4.75
    (tmp_path / "policies.json").write_text(json.dumps(data))
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    table = render.measured_table()
    assert "4.75 ms median" in table and "`policies.json` (2026-11-30, commit not recorded)" in table
    assert "<!-- results:placement-summary -->" in table  # a block inside the table, rendered with it
    assert "3,196" not in table and "55.8 s" not in table  # figures no results file holds
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith(("| figure", "| ---"))]
    assert len(rows) == len(render.MEASURED_ROWS) and all(line.count(" | ") == 4 for line in rows)


def test_the_chaos_and_lumen_blocks_read_their_files():
    chaos = json.loads((render.RESULTS / "chaos.json").read_text())
    assert render.chaos_faults().startswith(f"{len(chaos['faults'])} faults of {len(chaos['faults_by_kind'])} kinds")
    assert "48 of 67 restored" in render.lumen_workers4_reading()  # lumen_workers4.json's means over 10 seeds
