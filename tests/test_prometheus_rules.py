"""The Prometheus rules in prometheus/: valid (promtool check rules), every alert made to fire and to stay silent
by promtool's unit tests, each with its severity, summary, description and a runbook page the console serves, and
only metrics the control plane and the gateways export, with label values they write."""

import re
import time
import uuid
from pathlib import Path

import pytest
import yaml
from django.core.management import call_command
from django.utils.html import escape
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from console.runbooks import RUNBOOKS
from harness import promtool
from recovery import hot
from recovery.actions import conditions, nodes
from recovery.actions import slo as slo_actions
from recovery.choices import OPEN_DRAIN_STATES, CanaryKind, DrainState, FailureClass, NodeState
from recovery.gateway.app import GatewayMetrics
from recovery.models import CanaryResult, Drain, SloObjective, XidEvent
from recovery.policy import slo, slo_rules
from tests.helpers import BASE_DIR
from workers import catalog
from workers.protocol import Registration

RULES = BASE_DIR / "prometheus"
RULE_FILES = sorted(RULES.glob("*.yml"))
UNIT_TESTS = sorted((RULES / "tests").glob("*.yml"))
SEVERITIES = ("page", "ticket")


def _groups(path: Path) -> list[dict]:
    return yaml.safe_load(path.read_text())["groups"]


def _rules() -> list[dict]:
    return [rule for path in RULE_FILES for group in _groups(path) for rule in group["rules"]]


def _alerts() -> list[dict]:
    return [rule for rule in _rules() if "alert" in rule]


def test_the_rule_files_are_there():
    assert {p.name for p in RULE_FILES} >= {"objectives.yml", "slo.yml", "operational.yml"} and UNIT_TESTS
    assert len(_alerts()) >= 20


def test_promtool_finds_the_rules_valid():
    result = promtool.run("check", "rules", *[p.name for p in RULE_FILES], cwd=RULES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_shipped_prometheus_configuration_is_valid_and_scrapes_the_jobs_the_rules_read():
    """prometheus/server/prometheus.yml (run for real in the operations e2e): promtool finds it valid (its syntax: the
    secret files it names live on the Prometheus host), and its jobs are those the rules' `job` matchers name."""
    config = RULES / "server" / "prometheus.yml"
    result = promtool.run("check", "config", "--syntax-only", str(config), cwd=RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = {job["job_name"] for job in yaml.safe_load(config.read_text())["scrape_configs"]}
    assert jobs == {"lifeline-control-plane", "lifeline-gateway", "lifeline-node"}
    assert config not in RULE_FILES  # its folder keeps it out of the rule files' glob


def test_promtools_unit_tests_pass():
    result = promtool.run("test", "rules", *[p.name for p in UNIT_TESTS], cwd=RULES / "tests")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_unit_tests_make_every_alert_fire_and_stay_silent():
    fired, silent = set(), set()
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {alert["alert"] for alert in _alerts()}
    assert names - fired == set(), "alerts no unit test makes fire"
    assert names - silent == set(), "alerts no unit test checks stay silent"


def test_every_alert_has_a_severity_a_summary_a_description_and_a_runbook():
    names = [alert["alert"] for alert in _alerts()]
    assert len(names) == len(set(names)), "an alert name is used twice"
    for alert in _alerts():
        assert alert.get("labels", {}).get("severity") in SEVERITIES, alert["alert"]
        annotations = alert.get("annotations", {})
        for key in ("summary", "description", "runbook_url"):
            assert annotations.get(key, "").strip(), f"{alert['alert']} has no {key}"
        assert annotations["runbook_url"].endswith(f"/runbooks/{alert['alert']}/"), alert["alert"]


def test_recording_rules_are_named_level_metric_operation():
    for rule in _rules():
        if "record" in rule:
            assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", rule["record"]), rule["record"]


def test_the_objectives_are_the_consoles_defaults():
    """objectives.yml holds the same targets as recovery.policy.slo's defaults, for every model and tier."""
    tier_default, override = {}, {}
    for rule in _groups(RULES / "objectives.yml")[0]["rules"]:
        name, labels = rule.get("record", ""), rule.get("labels", {})
        match = re.fullmatch(r"vector\(([0-9.]+)\)", rule["expr"])
        if not match:
            continue
        kind = name.split(":")[1].removeprefix("lifeline_slo_").removesuffix("_override")
        key = (kind, labels.get("tier"))
        value = (float(match.group(1)), labels.get("le"))
        if name.startswith("tier:"):
            tier_default[key] = value
        elif name.startswith("model_tier:"):
            override[(labels["model"], *key)] = value
    for model in catalog.MODELS:
        for tier in ("premium", "standard", "best_effort"):
            want = slo.default_for(model, tier)
            expected = {
                "availability": (want.availability / 100, None),
                "ttft": (want.ttft_percentile / 100, str(want.ttft_ms / 1000)),
                "tpot": (want.tpot_percentile / 100, str(want.tpot_ms / 1000)),
            }
            for kind, value in expected.items():
                got = override.get((model, kind, tier), tier_default[(kind, tier)])
                assert got == pytest.approx(value) if value[1] is None else got == value, (model, tier, kind)


def test_each_alerts_runbook_page_answers(client, cast):
    alerts = {alert["alert"] for alert in _alerts()}
    # The failures that open incidents of their own link runbooks too (recovery.actions.conditions), one per class.
    assert set(conditions.KINDS) == set(FailureClass)
    failures = {kind.runbook for kind in conditions.KINDS.values()}
    names = alerts | failures
    assert set(RUNBOOKS) == names, "a runbook for each alert and failure class, and none for one that does not exist"
    assert client.get("/runbooks/LifelineTokensLost/").status_code == 302  # to the login page
    for role in ("manager", "oncall"):
        client.force_login(cast[role])
        for name in sorted(names):
            response = client.get(f"/runbooks/{name}/")
            assert response.status_code == 200, name
            assert escape(RUNBOOKS[name].title) in response.content.decode()
    assert client.get("/runbooks/NoSuchAlert/").status_code == 404


# --- the rules use what the code exports --------------------------------------------------------------------
SELECTOR = re.compile(r"(?<![\w:])((?:lifeline_|up\b)[a-z0-9_]*)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')


def _register(name: str) -> None:
    reg = Registration.parse(
        {
            "name": name,
            "session": uuid.uuid4().hex,
            "address": "http://127.0.0.1:9",
            "rack": "rack-p",
            "model": "Qwen3-32B",
            "gpu": "H100-SXM",
            "tp": 1,
            "pid": 1,
            "host": "h",
            "gpus": [{"index": 0, "uuid": f"GPU-{name}", "name": "H100", "memory_bytes": 80 * 10**9}],
        }
    )
    node = nodes.register_node(reg)
    nodes.transition_node(node, NodeState.SERVING, "test")
    hot.heartbeat(name, time.time(), "serving", {"running": 0, "waiting": 0})


def _exported(text: str, into: dict[str, dict[str, set[str]]]) -> None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = into.setdefault(sample.name, {})
            for key, value in sample.labels.items():
                labels.setdefault(key, set()).add(value)


def _control_plane_scrape(client, cast) -> str:
    from recovery.models import Node

    _register("prom-a")
    _register("prom-b")
    a = Node.objects.get(name="prom-a")
    for kind in CanaryKind:
        CanaryResult.objects.create(node=a, passed=kind == CanaryKind.OK, kind=kind, latency_ms=40.0)
    XidEvent.objects.create(
        node=a,
        gpu_index=0,
        first_at=a.registered_at,
        last_at=a.registered_at,
        codes={"79": 1, "13": 2},
        code=79,
        severity="critical",
        meaning="m",
        action="a",
    )
    Drain.objects.create(node=a, state=DrainState.DRAINING, source="test", reason="test")
    client.force_login(cast["manager"])
    response = client.get("/metrics")
    assert response.status_code == 200
    return response.content.decode()


def test_the_control_plane_exports_canaries_xids_and_drains_as_the_rules_read_them(client, cast):
    text = _control_plane_scrape(client, cast)
    assert "# TYPE lifeline_canary_results_total counter" in text
    assert "# TYPE lifeline_canary_duration_seconds histogram" in text
    assert 'lifeline_canary_results_total{check="tokens",node="prom-a",outcome="fail"} 1.0' in text
    assert 'lifeline_canary_results_total{check="response",node="prom-a",outcome="timeout"} 1.0' in text
    assert 'lifeline_canary_results_total{check="latency",node="prom-a",outcome="pass"} 1.0' in text
    # Mismatches on a counter of their own, with a zero for every node, so increase() sees the first one.
    assert 'lifeline_canary_mismatches_total{check="tokens",node="prom-a"} 1.0' in text
    assert 'lifeline_canary_mismatches_total{check="logprob",node="prom-a"} 1.0' in text
    assert 'lifeline_canary_mismatches_total{check="tokens",node="prom-b"} 0.0' in text
    assert 'lifeline_canary_duration_seconds_bucket{le="0.05",node="prom-a"} 6.0' in text
    assert 'lifeline_canary_duration_seconds_bucket{le="0.025",node="prom-a"} 0.0' in text
    # Xid events counted by class (79 is critical, 13 warn), not the last code seen.
    assert 'lifeline_gpu_xid_events_total{class="critical",node="prom-a"} 1.0' in text
    assert 'lifeline_gpu_xid_events_total{class="warn",node="prom-a"} 2.0' in text
    assert 'lifeline_gpu_xid_events_total{class="critical",node="prom-b"} 0.0' in text
    assert 'lifeline_gpu_xid_codes_total{class="critical",gpu="0",node="prom-a",xid="79"} 1.0' in text
    assert 'lifeline_model_serving_nodes{model="Qwen3-32B"} 2.0' in text
    assert 'lifeline_drain_oldest_age_seconds{state="draining"}' in text


def _gateway_metrics() -> str:
    """The gateway's metric definitions with a sample in each labelled family (they export nothing before)."""
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    for status in (*slo.COUNTED, *slo.NOT_COUNTED):  # every outcome the gateway reports
        metrics.answered(status, "premium", 200, "Qwen3-32B")
    metrics.migrations.labels("failure", "checkpoint-local", "node-a", "node-b").inc()
    metrics.shed.labels("Qwen3-32B", "best_effort").inc()
    metrics.ttft.labels("premium", "Qwen3-32B").observe(0.3)
    metrics.tpot.labels("premium", "Qwen3-32B").observe(0.03)
    metrics.tokens_lost.labels("premium", "Qwen3-32B").inc(0)
    return generate_latest(registry).decode()


def test_the_gateways_latency_buckets_hold_every_objectives_threshold():
    exported: dict[str, dict[str, set[str]]] = {}
    _exported(_gateway_metrics(), exported)
    for rule in _groups(RULES / "objectives.yml")[0]["rules"]:
        le = rule.get("labels", {}).get("le")
        if le is not None:
            kind = "ttft" if "ttft" in rule["record"] else "tpot"
            assert le in exported[f"lifeline_gateway_{kind}_seconds_bucket"]["le"], (rule["record"], le)


def test_the_rules_use_only_metrics_and_label_values_the_code_exports(client, cast):
    exported: dict[str, dict[str, set[str]]] = {}
    _exported(_control_plane_scrape(client, cast), exported)
    _exported(_gateway_metrics(), exported)
    # Label values a scrape of a small cluster may not show, from where the code takes them.
    exported["lifeline_drain_oldest_age_seconds"]["state"] |= {s.value for s in OPEN_DRAIN_STATES}
    # Gauges exported only while there is a figure (requests in flight, holders holding pages): from their
    # definitions, and with no labels to match.
    source = (BASE_DIR / "console" / "metrics.py").read_text()
    for name in ("lifeline_checkpoint_coverage", "lifeline_holder_balance"):
        assert f'"{name}"' in source
        exported.setdefault(name, {})
    used = 0
    for rule in _rules():
        for name, braces in SELECTOR.findall(rule["expr"]):
            if name == "up":  # Prometheus' own
                continue
            used += 1
            assert name in exported, f"{rule.get('alert') or rule.get('record')} reads {name}, which nobody exports"
            for label, op, value in MATCHER.findall(braces or ""):
                assert label in exported[name], f"{name} has no label {label}"
                if op in ("=", "=~") and re.fullmatch(r"[\w-]+(\|[\w-]+)*", value):
                    for one in value.split("|"):
                        # The mistake of document 003's DynamoSilentCorruption: a value the label never carries.
                        assert one in exported[name][label], f"{name}{{{label}={one!r}}} never occurs"
    assert used > 30


def test_the_objectives_file_is_written_from_the_shipped_defaults():
    """prometheus/objectives.yml is `manage.py slo_rules` over the defaults: nothing in it was edited by hand."""
    defaults = [slo_rules.default(model, tier) for model in catalog.MODELS for tier in slo_rules.TIERS]
    assert (RULES / "objectives.yml").read_text() == slo_rules.objectives_file(defaults)


@pytest.mark.django_db
def test_an_admins_edit_reaches_prometheus_through_slo_rules(tmp_path):
    """An objective edited on the console, written out by `manage.py slo_rules`: promtool finds the file valid with
    slo.yml and reads the new target for that model and tier, the old one for the others."""
    slo_actions.ensure_objectives([("Qwen3-32B", "premium"), ("Qwen3-32B", "standard")])
    premium = SloObjective.objects.get(model_key="Qwen3-32B", tier="premium", tenant="")
    slo_actions.update_objective(premium, {"availability_target": 99.0, "ttft_threshold_ms": 600}, actor="admin")
    call_command("slo_rules", output=str(tmp_path / "objectives.yml"))
    (tmp_path / "slo.yml").write_text((RULES / "slo.yml").read_text())
    result = promtool.run("check", "rules", "objectives.yml", "slo.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    labels = '{{model="Qwen3-32B", tier="{tier}"}}'
    (tmp_path / "edit_test.yml").write_text(
        yaml.safe_dump(
            {
                "rule_files": ["objectives.yml"],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": [
                            {
                                "series": f"lifeline_gateway_requests_total{labels.format(tier=tier)[:-1]}, "
                                'status="ok"}',
                                "values": "0+100x5",
                            }
                            for tier in ("premium", "standard")
                        ],
                        "promql_expr_test": [
                            {
                                "expr": "sum by (model, tier) (model_tier:lifeline_slo_availability:objective)",
                                "eval_time": "5m",
                                "exp_samples": [
                                    {"labels": labels.format(tier="premium"), "value": 0.99},
                                    {"labels": labels.format(tier="standard"), "value": 0.995},
                                ],
                            },
                            {
                                "expr": "sum by (model, tier, le) (model_tier:lifeline_slo_ttft:objective)",
                                "eval_time": "5m",
                                "exp_samples": [
                                    {"labels": labels.format(tier="premium")[:-1] + ', le="0.6"}', "value": 0.99},
                                    {"labels": labels.format(tier="standard")[:-1] + ', le="2.0"}', "value": 0.99},
                                ],
                            },
                        ],
                    }
                ],
            }
        )
    )
    result = promtool.run("test", "rules", "edit_test.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.django_db
def test_the_consoles_burn_rates_equal_promtools_on_the_same_requests(tmp_path):
    """The same generated requests through the console's rollups and through the gateway's counters into promtool:
    the burn rate over every window reads the same (benchmarks/slo_accuracy.py prints the figures)."""
    from benchmarks import slo_accuracy

    promtool.promtool()  # skips with the reason where promtool cannot be had
    figures = slo_accuracy.compare(minutes=125, seed=3, workdir=tmp_path)
    for window, f in figures["windows"].items():
        assert f["console"] > 1 and f["console"] == pytest.approx(f["promtool"], rel=1e-9), (window, f)


def test_every_answer_a_rule_counts_is_exported_at_zero_for_each_tier_of_a_model_served_before_any_request():
    """Prometheus's rate() starts a series at its first sample: a shed series born with a burst of sheds, scraped
    once, counts none of them (a real Prometheus in the operations e2e read an error ratio of 0 so). The gateway's
    /metrics makes them present at 0 for the models it serves."""
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    metrics.served({"Qwen3-32B"})
    text = generate_latest(registry).decode()
    for tier in ("premium", "standard", "best_effort"):
        for status, code in (("ok", 200), ("error", 500), ("shed", 429), ("shed", 503)):
            line = f'lifeline_gateway_requests_total{{code="{code}",model="Qwen3-32B",status="{status}",tier="{tier}"}}'
            assert f"{line} 0.0" in text, line
        assert f'lifeline_tokens_lost_total{{model="Qwen3-32B",tier="{tier}"}} 0.0' in text
    metrics.answered("shed", "best_effort", 429, "Qwen3-32B")
    metrics.served({"Qwen3-32B"})  # again, at the next scrape: what was counted stays
    assert 'code="429",model="Qwen3-32B",status="shed",tier="best_effort"} 1.0' in generate_latest(registry).decode()
