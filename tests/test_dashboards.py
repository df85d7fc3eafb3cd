"""Lifeline's Grafana dashboards (console/dashboards.py, generated with grafanalib into prometheus/grafana/): the
committed JSON is what the code makes, every panel's query is PromQL promtool accepts, and each dashboard chooses its
Prometheus and its models by variables. Every query returning series from a real Prometheus scraping a stack is
checked in tests/e2e/test_operations_e2e.py."""

import json

import pytest
import yaml
from django.core.management import CommandError, call_command

from console import dashboards
from harness import promtool

# What Grafana puts in a query's place before Prometheus sees it: every model, and a rate window (Grafana's
# $__rate_interval is four scrape intervals at least).
GRAFANA = {"$model": ".*", "$__rate_interval": "1m"}


def grafana_query(expr: str) -> str:
    for variable, value in GRAFANA.items():
        expr = expr.replace(variable, value)
    return expr


def test_the_committed_dashboards_are_what_the_code_makes(tmp_path):
    call_command("dashboards", "--check")  # the repository's files
    call_command("dashboards", "--output", str(tmp_path))
    (tmp_path / "lifeline-slo.json").write_text("{}")
    with pytest.raises(CommandError, match="lifeline-slo.json in .* are not what console/dashboards.py makes"):
        call_command("dashboards", "--check", "--output", str(tmp_path))


def test_every_panel_query_is_promql_promtool_accepts(tmp_path):
    rules = []
    for name, text in dashboards.rendered().items():
        for title, expr in dashboards.queries(json.loads(text)):
            assert "$" not in grafana_query(expr), (name, title, expr)  # only the variables Grafana fills
            rules.append({"record": f"dashboard:query{len(rules)}", "expr": grafana_query(expr)})
    assert len(rules) >= 30
    (tmp_path / "queries.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    checked = promtool.run("check", "rules", "queries.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_each_dashboard_chooses_its_prometheus_and_models_and_links_the_others():
    for name, text in dashboards.rendered().items():
        board = json.loads(text)
        assert board["uid"] == name.removesuffix(".json") and "lifeline" in board["tags"]
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        assert variables["model"]["query"] == "label_values(lifeline_model_serving_nodes, model)"
        assert variables["model"]["includeAll"] and variables["model"]["allValue"] == ".*"
        panels = [p for p in board["panels"] if p["type"] != "row"]
        assert panels and all(p["datasource"] == "${datasource}" and p["description"] for p in panels), name
        assert board["links"][0]["tags"] == ["lifeline"]
