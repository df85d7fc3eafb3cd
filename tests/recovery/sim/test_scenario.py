"""A simulator scenario: read from JSON, refused before any run when it cannot run (recovery.sim.scenario)."""

import ast
import copy
import json
import subprocess
import sys

import pytest

from recovery.policy.placement import POLICIES
from recovery.sim import scenario as sc
from recovery.sim.errors import ScenarioError
from recovery.sim.faults import HOUR_S, STEPFUN_OUTAGE
from recovery.sim.workload import SyntheticWorkload, TraceWorkload
from tests.helpers import BASE_DIR

TRACE = "arrival_timestamp,prompt_size,token_size\n0.5,100,20\n1.0,9000,10\n2.0,300,30\n"

SCENARIO = {
    "name": "two racks of Llama-3-70B",
    "duration_s": 600,
    "seeds": [1, 2],
    "policies": ["none", "lifeline"],
    "fleet": [
        {"name": "a", "count": 3, "model": "Llama-3-70B", "gpu": "H100-SXM", "tp": 2, "rack": "r1", "spares": 1},
        {"name": "b", "count": 2, "model": "Llama-3-70B", "gpu": "H100-SXM", "tp": 4, "rack": "r2"},
    ],
    "workload": [
        {"arrival": "gamma", "rate_rps": 5, "cv": 2, "lengths": "splitwise-conversation"},
        {"trace": "trace.csv", "too_long": "clip"},
    ],
    "faults": {
        "per_1000_node_days": 400_000,
        "scripted": [
            {"at_s": 60, "kind": "crash", "target": "a-2", "repair_s": 120},
            {"at_s": 300, "kind": "rack", "target": "r2"},
        ],
    },
}


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "trace.csv").write_text(TRACE)
    return tmp_path


def parse(data, folder):
    return sc.parse(data, folder)


def refused(data, folder) -> ScenarioError:
    with pytest.raises(ScenarioError) as caught:
        sc.parse(data, folder)
    return caught.value


def changed(path: str, value):
    """SCENARIO with the value at `path` ("fleet.1.tp") set, or removed when value is ...."""
    data = copy.deepcopy(SCENARIO)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    key = int(last) if isinstance(node, list) else last
    if value is ...:
        del node[key]
    else:
        node[key] = value
    return data


# --- a scenario that runs ----------------------------------------------------------------------
def test_a_scenario_is_read_whole(folder):
    s = parse(SCENARIO, folder)
    assert [n.name for n in s.nodes] == ["a-1", "a-2", "a-3", "a-spare-1", "b-1", "b-2"]
    assert [n.spare for n in s.nodes] == [False, False, False, True, False, False]
    assert s.racks == ("r1", "r2") and s.models == ("Llama-3-70B",)
    assert s.nodes[0].deployment.tp == 2 and s.nodes[-1].deployment.tp == 4
    synthetic, replay = s.workloads
    assert isinstance(synthetic, SyntheticWorkload) and synthetic.arrivals.cv == 2
    assert isinstance(replay, TraceWorkload) and len(replay.rows) == 3 and replay.model == "Llama-3-70B"
    assert [(f.at_s, f.kind, f.target, f.repair_s) for f in s.scripted_faults] == [
        (60, "crash", "a-2", 120),
        (300, "rack", "r2", None),
    ]
    assert s.runs() == [("none", 1), ("lifeline", 1), ("none", 2), ("lifeline", 2)]


def test_the_defaults(folder):
    s = parse(
        {"duration_s": 60, "fleet": [{"count": 2, "model": "Llama-3-8B", "gpu": "L40S"}], "workload": {"rate_rps": 1}},
        folder,
    )
    assert [n.name for n in s.nodes] == ["g1-1", "g1-2"] and s.racks == ("rack-1",)
    assert s.policies == POLICIES and s.seeds == (1,)
    assert s.fault_rates.per_1000_node_days == 4 and s.fault_rates.rack_per_1000_rack_days == 0
    assert s.fault_rates.outage == STEPFUN_OUTAGE
    assert s.detection.heartbeat_miss_s == 3 and s.detection.unhealthy_after == 3
    (workload,) = s.workloads
    assert workload.arrivals.process == "poisson" and workload.lengths == "splitwise-conversation"


def test_a_seed_gives_every_policy_the_same_requests_and_faults(folder):
    s = parse(SCENARIO, folder)
    requests, faults = s.requests(1), s.faults(1)
    assert requests == s.requests(1) and faults == s.faults(1)
    assert requests != s.requests(2) and faults != s.faults(2)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert all(0 <= r.arrival_s < 600 for r in requests)
    # The replayed rows are there, the long one clipped to the model's context on this fleet.
    context = s.context_tokens("Llama-3-70B")
    assert context == 8192
    assert [(r.prompt_tokens, r.output_tokens) for r in requests if r.arrival_s in (0.5, 1.0, 2.0)] == [
        (100, 20),
        (8191, 1),
        (300, 30),
    ]
    assert all(r.prompt_tokens + r.output_tokens <= context for r in requests)
    # Scripted and drawn faults together, in time order.
    assert {(f.at_s, f.target) for f in faults if f.scripted} == {(60, "a-2"), (300, "r2")}
    assert any(not f.scripted for f in faults)
    assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)


def test_a_scenario_file_is_read_with_its_trace_beside_it(folder):
    (folder / "scenario.json").write_text(json.dumps(SCENARIO))
    assert len(sc.load(folder / "scenario.json").workloads) == 2


def test_the_example_in_the_modules_docstring_runs(tmp_path):
    example = sc.__doc__.split("::")[1].split("\n\n- ")[0]
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "code.csv").write_text(TRACE)
    s = sc.parse(json.loads(example), tmp_path)
    assert s.name == "two racks of Llama-3-70B" and len(s.nodes) == 9 and len(s.runs()) == 9


def test_outages_and_detection_can_be_set(folder):
    data = changed("faults.outage_median_h", 1)
    data["faults"]["outage_p90_h"] = 4
    data["detection"] = {"heartbeat_miss_s": 10, "canary_interval_s": 60}
    s = parse(data, folder)
    assert s.fault_rates.outage.median == pytest.approx(HOUR_S)
    assert s.fault_rates.outage.quantile(0.9) == pytest.approx(4 * HOUR_S)
    assert (s.detection.heartbeat_miss_s, s.detection.canary_interval_s, s.detection.canary_retry_s) == (10, 60, 2)


# --- refused before any run, naming the field, the row and what is allowed ---------------------
@pytest.mark.parametrize(
    "path,value,field,says,allows",
    [
        ("fleet.1.tp", 1, "fleet[1].tp", "does not fit on 1× H100-SXM", "2, 4, 8"),
        ("fleet.0.tp", 3, "fleet[0].tp", "is not a tensor-parallel degree", "1, 2, 4, 8"),
        ("fleet.0.gpu", "H900", "fleet[0].gpu", "'H900' is not in the catalog", "H100-SXM"),
        ("fleet.0.model", "GPT-5", "fleet[0].model", "'GPT-5' is not in the catalog", "Llama-3-70B"),
        ("fleet.0.count", 0, "fleet[0].count", "0", "a whole number from 1"),
        ("fleet.0.count", ..., "fleet[0].count", "is required", ""),
        ("fleet.0.spares", -1, "fleet[0].spares", "-1", "a whole number from 0"),
        ("fleet.0.racks", "r1", "fleet[0].racks", "is not a field here", "rack"),
        ("fleet.1.name", "a-spare", "fleet[1].name", "'a-spare-1', which fleet[0] gives one too", "own name"),
        ("fleet", [], "fleet", "is empty", "at least one"),
        ("duration_s", 0, "duration_s", "0", "seconds above 0"),
        ("duration_s", ..., "duration_s", "is required", ""),
        ("workload.0.rate_rps", -5, "workload[0].rate_rps", "-5", "above 0"),
        ("workload.0.arrival", "uniform", "workload[0].arrival", "not an arrival process", "poisson or gamma"),
        ("workload.0.lengths", "alpaca", "workload[0].lengths", "not a length distribution", "sharegpt"),
        ("workload.0.model", "Llama-3-8B", "workload[0].model", "is not served by the fleet", "Llama-3-70B"),
        ("workload.0.trace_file", "x.csv", "workload[0].trace_file", "is not a field here", "or trace"),
        ("workload.1.too_long", "truncate", "workload[1].too_long", "'truncate'", "refuse or clip"),
        ("workload.1.trace", "missing.csv", "workload[1].trace", "cannot be read", "a readable CSV file"),
        ("faults.scripted.0.target", "a-9", "faults.scripted[0].target", "no node 'a-9'", "a-1, a-2"),
        ("faults.scripted.1.target", "r3", "faults.scripted[1].target", "no rack 'r3'", "r1, r2"),
        ("faults.scripted.0.kind", "meteor", "faults.scripted[0].kind", "is not a fault", "crash, hang"),
        ("faults.scripted.0.at_s", 600, "faults.scripted[0].at_s", "after the run's end", "below 600"),
        ("faults.scripted.0.repair_s", -1, "faults.scripted[0].repair_s", "-1", "seconds above 0"),
        ("faults.per_1000_node_days", -1, "faults.per_1000_node_days", "-1", "from 0"),
        ("faults.mix", {"meteor": 1}, "faults.mix.meteor", "not a kind of node fault", "crash"),
        ("faults.outage_p90_h", 10, "faults.outage_p90_h", "not above the median", "p90 > median"),
        ("policies", ["none", "magic"], "policies[1]", "'magic' is not a placement policy", "lifeline"),
        ("policies", ["none", "none"], "policies", "['none', 'none']", "each at most once"),
        ("seeds", [1, 1], "seeds", "[1, 1]", "different"),
        ("seeds", [1.5], "seeds[0]", "1.5", "a whole number"),
        ("detection", {"heartbeat_miss_s": 0}, "detection.heartbeat_miss_s", "0", "seconds above 0"),
        ("detection", {"heartbeat": 1}, "detection.heartbeat", "is not a field here", "heartbeat_miss_s"),
        ("colour", "blue", "colour", "is not a field here", "duration_s"),
    ],
)
def test_a_scenario_that_cannot_run_is_refused(folder, path, value, field, says, allows):
    error = refused(changed(path, value), folder)
    assert error.field == field, str(error)
    assert says in error.problem, str(error)
    assert allows in error.allowed, str(error)
    assert str(error).startswith(field)


def test_a_model_too_big_for_its_gpus_is_refused_with_the_degrees_that_fit(folder):
    error = refused(changed("fleet.0.gpu", "RTX-3090"), folder)
    assert error.field == "fleet[0].tp"
    assert "141.2 GB of weights" in error.problem and "2× RTX-3090 (24 GB each" in error.problem
    assert error.allowed == "8"


def test_a_malformed_trace_row_is_refused_naming_the_workload_the_row_and_the_column(folder):
    (folder / "trace.csv").write_text(TRACE + "3.0,many,10\n")
    error = refused(SCENARIO, folder)
    assert (error.row, error.column) == (5, "prompt_size")
    assert error.field == "workload[1].trace" and error.source == str(folder / "trace.csv")
    assert "'many' is not a whole number" in str(error) and "row 5, column prompt_size" in str(error)


def test_a_trace_row_too_long_for_the_fleet_is_refused_unless_clipped(folder):
    error = refused(changed("workload.1.too_long", "refuse"), folder)
    assert (error.field, error.source, error.row) == ("workload[1].trace", str(folder / "trace.csv"), 3)
    assert "8192" in error.problem


def test_a_workload_must_name_its_model_when_the_fleet_serves_several(folder):
    data = changed("fleet.1.model", "Llama-3-8B")
    error = refused(data, folder)
    assert error.field == "workload[0].model" and "Llama-3-70B, Llama-3-8B" in error.allowed


def test_a_scenario_file_that_is_not_json_is_refused(folder):
    (folder / "bad.json").write_text("{duration_s: 60")
    with pytest.raises(ScenarioError, match="is not JSON"):
        sc.load(folder / "bad.json")


# --- the package's boundary ----------------------------------------------------------------------
SIM = BASE_DIR / "recovery" / "sim"


def test_the_simulator_imports_no_django():
    for path in SIM.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert name.split(".")[0] not in ("django", "channels", "celery", "console"), (path, name)
                assert not name.startswith(("recovery.models", "recovery.actions", "recovery.hot")), (path, name)
    modules = "".join(f"import recovery.sim.{p.stem}\n" for p in SIM.glob("*.py") if p.stem != "__init__")
    code = (
        modules + "import sys\nsys.exit(any(m.split('.')[0] in ('django', 'celery', 'channels') for m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=BASE_DIR, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0
