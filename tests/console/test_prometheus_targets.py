"""Prometheus's HTTP service discovery of the nodes (`GET /api/prometheus/targets`, prometheus/server/prometheus.yml's
lifeline-node job): every node that has not left the fleet, at its agent's address, with the labels an operator
filters by; for an API token, as the control plane's /metrics is. A real Prometheus reads it in
tests/e2e/test_operations_e2e.py."""

import pytest
from django.test import Client

from console.models import ApiToken
from recovery.actions import nodes
from tests.recovery.test_alerts import register

pytestmark = pytest.mark.django_db
URL = "/api/prometheus/targets"


def test_every_node_not_left_is_a_target_at_its_agents_address_with_its_labels(cast):
    serving = register("sd-node-1", "gpu-host-1")
    down = register("sd-node-2", "gpu-host-2")
    nodes.transition_node(down, "down", "test: missed heartbeats")
    left = register("sd-node-3", "gpu-host-3")
    nodes.transition_node(left, "down", "test")
    nodes.transition_node(left, "left", "test: decommissioned")
    for node, port in ((serving, 8301), (down, 8302), (left, 8303)):
        node.address = f"http://10.0.0.{port - 8300}:{port}"
        node.save(update_fields=["address"])
    _, token = ApiToken.issue(cast["manager"], "prometheus")
    answer = Client().get(URL, HTTP_AUTHORIZATION=f"Bearer {token}")
    assert answer.status_code == 200, answer.content
    groups = answer.json()
    assert groups == [
        {
            "targets": ["10.0.0.1:8301"],
            "labels": {
                "__scheme__": "http",
                "node": "sd-node-1",
                "rack": "rack-a",
                "model": "Qwen3-32B",
                "gpu_type": "H100-SXM",
                "engine": "emulated",
                "hostname": "gpu-host-1",
            },
        },
        {
            "targets": ["10.0.0.2:8302"],
            "labels": {
                "__scheme__": "http",
                "node": "sd-node-2",
                "rack": "rack-a",
                "model": "Qwen3-32B",
                "gpu_type": "H100-SXM",
                "engine": "emulated",
                "hostname": "gpu-host-2",
            },
        },
    ]  # the DOWN node stays (Prometheus's `up` says it is down); the one that left is gone


def test_the_targets_need_a_token_or_a_session():
    answer = Client().get(URL)
    assert answer.status_code == 401 and "Bearer <token>" in answer.json()["error"]["message"]
    answer = Client().get(URL, HTTP_AUTHORIZATION="Bearer not-a-token")
    assert answer.status_code == 401 and "issue_token" in answer.json()["error"]["message"]
