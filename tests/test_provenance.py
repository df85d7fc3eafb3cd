"""harness.provenance: what a results file records about where its figures come from (issue 42)."""

import json
import subprocess
import time

import pytest

from benchmarks import common
from harness import provenance


def git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_the_record_names_the_commit_and_says_when_the_tree_differs_from_it(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git(tmp_path, "add", "a.txt")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    clean = provenance.code(tmp_path)
    assert clean == {"commit": sha, "dirty": False}
    (tmp_path / "b.txt").write_text("untracked: not the code that ran\n")
    assert provenance.code(tmp_path)["dirty"] is False
    (tmp_path / "a.txt").write_text("two\n")
    assert provenance.code(tmp_path) == {"commit": sha, "dirty": True}
    assert provenance.code(tmp_path / "b.txt") == {"commit": None, "dirty": None}  # not a checkout: said so


def test_a_record_has_the_date_host_command_wall_time_and_each_figures_kind():
    started = time.monotonic() - 2.0
    record = provenance.record(
        {"ttft_p50_ms": "measured", "stall_s": "simulated", "speedup": "modelled", "nodes": "input"},
        started,
        command=[str(provenance.BASE_DIR / "benchmarks" / "chaos.py"), "--minutes", "1"],
    )
    assert record["command"] == "python -m benchmarks.chaos --minutes 1"
    assert record["wall_s"] >= 2.0 and record["date"].endswith("+00:00")
    host = record["host"]
    assert host["cores"] >= 1 and host["cpu"] and host["reference_loop_ms"] > 0 and host["memory_gib"] > 0
    assert record["kinds"]["stall_s"] == "simulated"
    assert provenance.record(None, started)["kinds"] is None  # not labelled yet: said, never guessed


def test_a_kind_outside_the_four_is_refused_naming_the_figure():
    with pytest.raises(provenance.ProvenanceError, match="figure 'acceptance': kind 'measured-simulated' is not one"):
        provenance.check_kinds({"acceptance": "measured-simulated"})


def test_a_benchmarks_results_file_carries_its_provenance(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    path = common.save("probe", {"figure": 1.5}, kinds={"figure": "measured"})
    saved = json.loads(path.read_text())
    assert saved["figure"] == 1.5 and saved["provenance"]["kinds"] == {"figure": "measured"}
    assert saved["provenance"]["commit"] == provenance.code()["commit"]
    with pytest.raises(provenance.ProvenanceError):
        common.save("probe", {"figure": 1.5}, kinds={"figure": "measured (real hardware)"})
