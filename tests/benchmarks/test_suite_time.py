"""benchmarks.suite_time: a `.ci/run` log read into the suite's figures (issue 41), and the README's block rendered
from them (benchmarks.render)."""

import json

import pytest

from benchmarks import render, suite_time

LOG = """Sun Dec  6 21:02:25 UTC 2026
lifeline: creating .venv
============================= slowest 30 durations =============================
14.23s call     tests/benchmarks/test_move_hop.py::test_a_real_round
6.91s setup    tests/test_access_matrix.py::test_every_route
=========================== short test summary info ============================
SKIPPED [1] tests/test_security_scan.py:79: pip-audit could reach no vulnerability data
================= 1310 passed, 1 skipped in 184.85s (0:03:04) ==================
created: 2/2 workers
============================= slowest 30 durations =============================
128.29s call     tests/e2e/test_chaos_e2e.py::test_every_fault_kind_at_once_breaks_no_invariant
================== 1 failed, 292 passed in 977.31s (0:16:17) ===================
lifeline: parallel phase exit 0, process phase exit 1

real	20m53.048s
user	20m6.207s
"""


def test_a_log_gives_each_phases_counts_and_time_its_slowest_tests_and_the_whole_runs_wall_time():
    run = suite_time.parse(LOG)
    assert run["total_s"] == 1253.0
    assert run["phases"]["parallel"] == {"seconds": 184.85, "passed": 1310, "skipped": 1}
    assert run["phases"]["process"] == {"seconds": 977.31, "failed": 1, "passed": 292}
    assert run["green"] is False  # a failed test in either phase
    assert run["slowest"]["parallel"][0] == {
        "test": "tests/benchmarks/test_move_hop.py::test_a_real_round",
        "when": "call",
        "seconds": 14.23,
    }
    assert [t["seconds"] for t in run["slowest"]["process"]] == [128.29]
    assert suite_time.parse(LOG.replace("1 failed, ", ""))["green"] is True


def test_a_verbose_log_gives_each_process_workers_test_time_and_largest_modules():
    verbose = LOG.replace(
        "created: 2/2 workers\n",
        "created: 2/2 workers\n"
        "[gw0] [ 10%] PASSED tests/e2e/test_chaos_e2e.py::test_every_fault_kind_at_once_breaks_no_invariant \n"
        "[gw1] [ 20%] FAILED tests/workers/test_node_agent.py::test_health \n"
        "[gw1] [ 30%] PASSED tests/workers/test_node_agent.py::test_metrics \n",
    ).replace(
        "128.29s call     tests/e2e/test_chaos_e2e.py::test_every_fault_kind_at_once_breaks_no_invariant\n",
        "128.29s call     tests/e2e/test_chaos_e2e.py::test_every_fault_kind_at_once_breaks_no_invariant\n"
        "3.50s call     tests/workers/test_node_agent.py::test_health\n"
        "2.25s call     tests/workers/test_node_agent.py::test_metrics\n"
        "1.00s setup    tests/workers/test_node_agent.py::test_health\n",
    )
    workers = suite_time.parse(verbose)["by_worker"]
    assert workers == {
        "gw0": {
            "test_s": 128.3,
            "largest_modules": [{"module": "tests/e2e/test_chaos_e2e.py", "seconds": 128.3}],
        },
        "gw1": {
            "test_s": 6.8,
            "largest_modules": [{"module": "tests/workers/test_node_agent.py", "seconds": 6.8}],
        },
    }
    assert "by_worker" not in suite_time.parse(LOG)  # a log without -v says nothing of its workers


def test_a_log_cut_short_is_refused_saying_what_it_lacks():
    with pytest.raises(ValueError, match="1 phase summaries"):
        suite_time.parse(LOG.split("created: 2/2")[0])


def test_the_readmes_block_says_the_latest_clean_runs_and_whether_the_goal_is_met(tmp_path, monkeypatch):
    runs = []
    for label, total, commit in (("cold", 1500.0, "a" * 40), ("clean", 880.0, "b" * 40), ("clean", 920.0, "b" * 40)):
        run = suite_time.parse(LOG.replace("1 failed, ", "").replace("20m53.048s", f"{int(total // 60)}m{total % 60}s"))
        runs.append({"label": label, "commit": commit, "began": "2026-12-06T21:02:25+00:00", "hog": False, **run})
        runs[-1]["host"] = {"cores": 2}
    (tmp_path / "suite_time.json").write_text(json.dumps({"runs": runs}))
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    text = render.suite_time()
    assert "1,603 tests (1,311 in the parallel phase, 292 in the process phase)" in text
    assert "**14.7, 15.3 minutes**" in text and "2 of 2 green" in text and "`bbbbbbb`" in text
    assert "Under 15 minutes: not met (the fastest clean run 14.7)" in text  # every clean run must be under
    assert "at `aaaaaaa`: 25.0 minutes" in text


def test_the_cpu_samples_are_split_into_the_runs_phases():
    """The process phase is the run's last stretch: its mean busy fraction is of the samples taken in it."""
    sampler = suite_time.CpuSampler(every_s=5)
    sampler.samples = [(5.0, 1.0), (10.0, 0.9), (15.0, 0.4), (20.0, 0.5), (25.0, 0.6)]
    run = {"total_s": 25.0, "phases": {"parallel": {"seconds": 10.0}, "process": {"seconds": 12.0}}}
    assert suite_time.cpu_by_phase(sampler, run) == {
        "every_s": 5,
        "whole_run": 0.68,
        "process_phase": 0.5,
        "parallel_phase": 0.95,
    }
    busy, total = suite_time.cpu_times()
    assert 0 < busy < total  # /proc/stat read: some of this machine's time was idle, some not
