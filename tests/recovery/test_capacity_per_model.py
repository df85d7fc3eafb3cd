"""Capacity and degradation per model (issue 12): a fleet serving Qwen3-32B and Llama-3-8B loses Qwen3-32B nodes;
Qwen3-32B's level rises, sheds and slows Qwen3-32B's traffic only, and Llama-3-8B's stays at 0."""

import json

import pytest

from console.readmodels.degradation import degradation
from recovery import hot, tasks
from recovery.actions import capacity, cluster_settings, drains, nodes
from recovery.choices import NodeState
from recovery.models import AuditEntry, Cluster, DegradationChange, Incident, ModelCapacity, Node
from recovery.policy.capacity import node_capacity
from tests.recovery.test_health import configure, objective, register
from workers.catalog import Deployment

pytestmark = pytest.mark.django_db

QWEN, LLAMA = "Qwen3-32B", "Llama-3-8B"


@pytest.fixture
def two_models(commit, tokens):
    """Four Qwen3-32B nodes and two Llama-3-8B nodes, each model with an objective its nodes meet (95 %)."""
    for i in range(4):
        commit(register, f"pm-q{i}", rack="rack-a" if i % 2 else "rack-b")
    for i in range(2):
        commit(register, f"pm-l{i}", rack="rack-c", model=LLAMA)
    qwen = node_capacity(Deployment.of(QWEN, "H100-SXM", 1), capacity.slo_of(QWEN)).rps
    llama = node_capacity(Deployment.of(LLAMA, "H100-SXM", 1), capacity.slo_of(LLAMA)).rps
    objective(QWEN, required_rps=3.8 * qwen)
    objective(LLAMA, required_rps=1.9 * llama)
    configure(degradation_hold_s=30, degradation_margin=0.05, startup_grace_s=0)
    assert commit(capacity.evaluate, 1000.0) == 0


def kill(commit, *names):
    for name in names:
        commit(nodes.transition_node, Node.objects.get(name=name), NodeState.DOWN, "kill -9")


def test_one_models_loss_raises_its_own_level_and_not_the_other_models(commit, two_models):
    kill(commit, "pm-q0", "pm-q1")  # two of four Qwen3-32B nodes: 53 % of its objective
    assert commit(capacity.evaluate, 1001.0) == 2  # the fleet's level: the worst model's
    assert ModelCapacity.of(QWEN).degradation_level == 2
    assert ModelCapacity.of(LLAMA).degradation_level == 0
    assert Cluster.default().state.degradation_level == 2
    change = DegradationChange.objects.get()
    assert change.model_key == QWEN and change.cause.startswith(f"{QWEN}: capacity")

    # What every gateway reads: Qwen3-32B sheds best effort; Llama-3-8B is not listed as degraded.
    config = json.loads(hot.client().get(hot.keys().cluster_config))
    assert config["models"][QWEN] == {"level": 2, "shed_tiers": ["best_effort"], "accept_new": True}
    assert config["models"][LLAMA] == {"level": 0, "shed_tiers": [], "accept_new": True}

    # The banner and the pages: both models, each with its own figures.
    banner = degradation()
    levels = {m["model"]: m["level"] for m in banner["models"]}
    assert levels == {QWEN: 2, LLAMA: 0} and banner["level"] == 2 and banner["model"] == QWEN
    by_model = {m["model"]: m for m in banner["models"]}
    assert by_model[QWEN]["capacity"]["in_service"] == 2 and by_model[LLAMA]["capacity"]["in_service"] == 2
    assert banner["capacity"]["model"] == QWEN  # the figures on top are the worst-off model's

    # Llama-3-8B losing one of two nodes is its own loss, judged on its own: 53 % of its objective.
    kill(commit, "pm-l0")
    assert commit(capacity.evaluate, 1002.0) == 2
    assert ModelCapacity.of(LLAMA).degradation_level == 2 and ModelCapacity.of(QWEN).degradation_level == 2


def test_a_level_change_cuts_the_batch_of_that_models_nodes_only(commit, react, two_models, monkeypatch):
    react()  # the nodes' joining, handled at level 0
    sent = []
    monkeypatch.setattr(tasks.apply_batch_factor, "apply_async", lambda args, **options: sent.append(args[0]))
    kill(commit, "pm-q0")  # three of four: 79 %, level 1 (batch ×0.75)
    assert commit(capacity.evaluate, 1001.0) == 1
    react()
    told = set(Node.objects.filter(pk__in=sent).values_list("name", flat=True))
    assert told == {"pm-q1", "pm-q2", "pm-q3"}  # Qwen3-32B's nodes serving; never a Llama-3-8B node


def test_a_capacity_incident_is_the_models_and_another_models_failure_is_not_on_it(commit, react, two_models):
    # Demand grows past Qwen3-32B's capacity, no node failed: an incident of its own, named for the model.
    objective(QWEN, required_rps=ModelCapacity.of(QWEN).required_rps * 1.5)
    assert commit(capacity.evaluate, 1001.0) >= 1
    react()
    incident = Incident.objects.get()
    assert incident.title.startswith(f"{QWEN} capacity below the objective")
    assert incident.details["model"] == QWEN
    # Llama-3-8B then moves on its own: not on Qwen3-32B's capacity incident.
    objective(LLAMA, required_rps=ModelCapacity.of(LLAMA).required_rps * 1.5)
    commit(capacity.evaluate, 1002.0)
    react()
    events = [e.details for e in incident.events.filter(kind="degradation")]
    assert events and all(e.get("model") == QWEN for e in events)
    llama_incident = Incident.objects.exclude(pk=incident.pk).get()
    assert llama_incident.details["model"] == LLAMA


def test_a_drain_is_weighed_against_its_own_models_capacity(commit, two_models):
    llama = Node.objects.get(name="pm-l0")
    radius = drains.blast_radius(llama)
    assert radius["model"] == LLAMA
    llama_required = ModelCapacity.of(LLAMA).required_rps
    assert radius["required_rps"] == llama_required
    assert radius["ratio_after"] == pytest.approx(radius["capacity_rps_after"] / llama_required, abs=1e-3)
    assert radius["ratio_after"] < 1  # one of two Llama-3-8B nodes: below its objective, whatever Qwen3-32B has
    assert drains.approvals_needed(llama, radius)[0] == 2


def test_objectives_per_model_by_api_validated_and_audited(client, cast, commit, two_models):
    client.force_login(cast["admin"])
    answer = client.get("/api/settings").json()
    assert set(answer["models"]) == {QWEN, LLAMA} and answer["models"][LLAMA]["required_rps"] > 0
    bad = client.patch(
        "/api/settings", {"models": {LLAMA: {"tpot_ms": 0}}, "reason": "x"}, content_type="application/json"
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["field"] == f"models.{LLAMA}.tpot_ms" and "tpot_ms must be between" in bad.text
    unknown = client.patch("/api/settings", {"models": {"GPT-9": {"required_rps": 1}}}, content_type="application/json")
    assert unknown.status_code == 400 and "not a catalogued model" in unknown.json()["error"]["message"]
    both = client.patch(  # all or nothing: a bad model field leaves the good cluster field unsaved
        "/api/settings",
        {"degradation_hold_s": 9, "models": {LLAMA: {"required_rps": -1}}},
        content_type="application/json",
    )
    assert both.status_code == 400 and Cluster.default().degradation_hold_s == 30
    ok = commit(
        client.patch,
        "/api/settings",
        {"models": {LLAMA: {"required_rps": 12.5, "tpot_ms": 50}}, "reason": "8B interactive"},
        content_type="application/json",
    )
    assert ok.status_code == 200
    assert ok.json()["changed"] == [f"models.{LLAMA}.required_rps", f"models.{LLAMA}.tpot_ms"]
    row = ModelCapacity.of(LLAMA)
    assert (row.required_rps, row.tpot_ms) == (12.5, 50)
    entry = AuditEntry.objects.get(target=f"model:{LLAMA}")
    assert entry.reason == "8B interactive" and entry.details["changed"]["tpot_ms"] == [100.0, 50.0]
    with pytest.raises(cluster_settings.SettingsRefused):
        cluster_settings.update(Cluster.default(), {"models": [1, 2]}, "test")


def test_the_degradation_page_and_banner_show_each_model(client, cast, commit, two_models):
    kill(commit, "pm-q0", "pm-q1")
    commit(capacity.evaluate, 1001.0)
    client.force_login(cast["manager"])
    page = client.get("/degradation/").content.decode()
    assert f'<tr data-model="{QWEN}" data-level="2">' in page and f'<tr data-model="{LLAMA}" data-level="0">' in page
    assert f'data-model-level="{QWEN}" data-level="2"' in page  # the banner's chip for each model
    assert f"{QWEN} capacity" in page


def test_at_level_3_capacity_is_counted_within_the_relaxed_objectives_and_that_does_not_argue_the_level_down(
    commit, two_models
):
    # A tight TPOT objective for Llama-3-8B, which bounds its batch (at 20 ms, ×2, the batch limit does).
    objective(LLAMA, tpot_ms=10)
    one = node_capacity(Deployment.of(LLAMA, "H100-SXM", 1), capacity.slo_of(LLAMA))
    assert one.limited_by == "tpot"
    objective(LLAMA, required_rps=7 * one.rps)  # its two nodes: 29 % of the objective, level 3
    assert commit(capacity.evaluate, 1001.0) == 3
    figures = capacity.report(model=LLAMA)
    assert figures.latency_factor == 2.0
    assert figures.in_force_rps > figures.capacity_rps * 1.2  # a larger batch meets the doubled TPOT
    assert sum(n["rps_in_force"] for n in figures.nodes.values()) == pytest.approx(figures.in_force_rps, abs=1e-2)
    # The level follows the model's own objectives: long past the hold, the relaxation alone (which would read
    # about 38 %, level 2) does not lower it.
    assert commit(capacity.evaluate, 1100.0) == 3
    assert capacity.report(model=QWEN).latency_factor == 1.0  # Qwen3-32B's objectives are its own, not relaxed
    latest = capacity.latest()["models"][LLAMA]
    assert latest["in_force_rps"] == figures.in_force_rps and latest["level"] == 3


def test_a_drains_page_shows_the_budgets_its_models_objectives_have_left(client, cast, commit, two_models):
    """The budgets on a drain are its model's objectives' (every indicator, from the rollups as on /slo/), not a
    fleet-wide availability figure: Llama-3-8B's failures spend Llama-3-8B's budget, and Qwen3-32B's is untouched."""
    from django.utils import timezone

    from console.readmodels.slo import objective_status
    from recovery.actions import slo
    from recovery.models import RequestOutcome, SloObjective
    from tests.report_data import store_and_roll_up

    slo.ensure_objectives({(QWEN, "premium"), (LLAMA, "premium")})
    now = timezone.now()
    store_and_roll_up(
        [
            RequestOutcome(
                request_id=f"db-{i}",
                gateway="gw-test",
                tenant="acme",
                tier="premium",
                model_key=LLAMA,
                node="pm-l0",
                status="error" if i < 3 else "ok",
                http_status=502 if i < 3 else 200,
                ttft_ms=None if i < 3 else 100.0,
                tpot_ms=None if i < 3 else 10.0,
                e2e_ms=1000.0,
                completion_tokens=0 if i < 3 else 50,
                started_at=now - timezone.timedelta(minutes=5, seconds=1),
                finished_at=now - timezone.timedelta(minutes=5),
            )
            for i in range(1000)
        ]
    )
    drain = commit(drains.propose, Node.objects.get(name="pm-l0"), source="operator", reason="test")
    client.force_login(cast["oncall"])
    page = client.get(f"/drains/{drain.pk}/").content.decode()
    llama = SloObjective.objects.get(model_key=LLAMA, tier="premium", tenant="")
    availability = next(i for i in objective_status(llama)["indicators"] if i["indicator"] == "availability")
    assert availability["budget_remaining"] < 1  # 3 failed of 1,000 against 99.9 %: budget spent
    row = f'<tr data-objective="{llama.pk}" data-indicator="availability">'
    assert row in page and availability["budget_text"] in page.split(row, 1)[1].split("</tr>", 1)[0]
    qwen = SloObjective.objects.get(model_key=QWEN, tier="premium", tenant="")
    assert f'data-objective="{qwen.pk}"' not in page  # another model's objectives are not this drain's
