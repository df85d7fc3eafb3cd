"""The control plane's /metrics for each mixture-of-experts deployment (console/metrics.py), as the MoE Grafana
dashboard reads them: expert workers by state, the experts no serving worker holds, the table's version, the share
of experts with a shadow, tokens through the experts, balancedness."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from console import metrics
from recovery.actions import moe
from recovery.choices import ExpertWorkerState
from recovery.models import ExpertWorkerNode
from recovery.policy import moe as moe_policy
from workers import catalog

pytestmark = pytest.mark.django_db
MIXTRAL = catalog.MODELS["Mixtral-8x7B"]


def samples() -> dict[tuple[str, tuple], float]:
    found = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name.startswith("lifeline_moe_"):
                found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_a_deployment_exports_its_workers_by_state_and_the_experts_nobody_serving_holds():
    table = moe_policy.plan(MIXTRAL, [moe_policy.ExpertWorker(f"ew-{i}", 10**12) for i in range(3)])
    deployment = moe.register(
        "mixtral", "Mixtral-8x7B", {f"ew-{i}": f"http://127.0.0.1:{i + 1}" for i in range(3)}, [], table
    )
    deployment.details = {"tokens_per_expert": {"0": 40, "3": 2}, "series": [{"at": 1.0, "balancedness": 0.8}]}
    deployment.save(update_fields=["details"])
    labels = (("deployment", "mixtral"), ("model", "Mixtral-8x7B"))
    seen = samples()
    assert seen[("lifeline_moe_expert_workers", (*labels, ("state", "serving")))] == 3
    assert seen[("lifeline_moe_expert_workers", (*labels, ("state", "down")))] == 0  # every state, 0 included
    assert seen[("lifeline_moe_experts_unserved", labels)] == 0
    assert seen[("lifeline_moe_table_version", labels)] == table.version
    assert seen[("lifeline_moe_shadow_coverage", labels)] == moe_policy.shadow_coverage(table)
    assert seen[("lifeline_moe_expert_tokens_total", labels)] == 42  # a counter: rate() works on it
    assert seen[("lifeline_moe_balancedness", labels)] == 0.8

    # Every worker holding expert 0 goes down: that expert, and any other held only by them, is unserved.
    holders = set(table.experts[0].ews())
    ExpertWorkerNode.objects.filter(name__in=holders).update(state=ExpertWorkerState.DOWN)
    unserved = sum(1 for loc in table.experts if set(loc.ews()) <= holders)
    seen = samples()
    assert unserved >= 1 and seen[("lifeline_moe_experts_unserved", labels)] == unserved
    assert seen[("lifeline_moe_expert_workers", (*labels, ("state", "down")))] == len(holders)
