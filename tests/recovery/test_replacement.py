"""Re-placement proposals (issue 14) against the real database, Redis, the CP-SAT planner, the simulator and real node
processes: a model short of capacity gets a proposal that switches another model's node over; on-call approves it
(two approvers when the giving model would be left short; never the one who asked); a plan for a fleet that changed
is refused at approval, saying what changed; approved, the node drains, switches model, loads it, passes a trial
canary and serves the new model, each step on the incident's timeline."""

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from recovery import reactions, tasks
from recovery.actions import capacity, drains, health, incidents, nodes, replacement
from recovery.choices import DrainState, EventKind, Health, NodeState, PlacementState
from recovery.models import AuditEntry, Drain, Incident, IncidentEvent, Node, PlacementProposal
from tests.helpers import http_json, wait_for
from tests.recovery.conftest import AGENT, FAULT
from tests.recovery.test_health import objective, register

pytestmark = pytest.mark.django_db

ENV = {"LIFELINE_AGENT_TOKEN": AGENT, "LIFELINE_FAULT_TOKEN": FAULT}
SHORT, GIVER = "Qwen3-32B", "Llama-3-8B"  # 8.0 and 29.5 req/s per H200 at the objectives' lengths (roofline)


def fleet(commit, addresses: dict[str, str] | None = None, giver_rps: float = 20.0):
    """One H200 of the short model (it must carry 14 req/s: two replicas' worth) and two of a model with room."""
    addresses = addresses or {}
    commit(register, "rp-q1", gpu="H200-SXM", model=SHORT, rack="rack-a")
    commit(register, "rp-l1", address=addresses.get("rp-l1", "http://127.0.0.1:9"), gpu="H200-SXM", model=GIVER)
    commit(
        register,
        "rp-l2",
        address=addresses.get("rp-l2", "http://127.0.0.1:9"),
        gpu="H200-SXM",
        model=GIVER,
        rack="rack-b",
    )
    objective(SHORT, required_rps=14.0)
    objective(GIVER, required_rps=giver_rps)


# --- pure parts --------------------------------------------------------------------------------------------------
def test_moves_become_switches_of_nodes_of_the_same_degree_and_the_rest_is_named():
    nodes = [
        Node(name="a", server="s1", model_key="M1", tp=2),
        Node(name="b", server="s1", model_key="M1", tp=2),
        Node(name="c", server="s2", model_key="M2", tp=1),
    ]
    result = {
        "moves": [
            {"server": "s1", "stop": [{"model": "M1", "tp": 2}], "start": [{"model": "M3", "tp": 2}]},
            {"server": "s2", "stop": [{"model": "M2", "tp": 1}], "start": [{"model": "M1", "tp": 4}]},
        ]
    }
    switches, manual = replacement.switches_for(result, nodes)
    assert switches == [{"node": "a", "from": "M1", "to": "M3", "tp": 2}]
    assert manual == ["s2: start M1 TP4 (no node there to switch)", "s2: stop M2 TP1 (no replica started in its place)"]


def test_what_changed_in_the_fleet_is_said_node_by_node():
    then = {"a": ["M1", 1], "b": ["M2", 1], "c": ["M2", 1]}
    now = {"a": ["M1", 1], "b": ["M1", 1], "d": ["M2", 1]}
    assert replacement.changes(then, now) == [
        "c is no longer in service",
        "d joined (M2 TP1)",
        "b serves M1 TP1, not M2 TP1",
    ]
    assert replacement.changes(then, dict(then)) == []


# --- proposing and deciding --------------------------------------------------------------------------------------
def test_a_model_short_of_capacity_gets_a_switch_from_a_model_with_room(commit, tokens, cast):
    fleet(commit)
    proposal = commit(replacement.propose_for_level, SHORT, 2)
    assert proposal is not None and proposal.state == PlacementState.PROPOSED and proposal.source == "control plane"
    assert [(s["from"], s["to"]) for s in proposal.switches] == [(GIVER, SHORT)]
    assert proposal.switches[0]["node"] in ("rp-l1", "rp-l2") and proposal.manual == []
    current, proposed = proposal.plan["current"]["capacity_rps"], proposal.plan["proposed"]["capacity_rps"]
    assert proposed[SHORT] > current[SHORT] and proposed[GIVER] >= 20.0  # the giver keeps what it must carry
    evaluation = proposal.plan["evaluation"]  # both placements run through the simulator
    assert evaluation["proposed"][SHORT]["attainment"] > evaluation["current"][SHORT]["attainment"]
    assert proposal.approvals_required == 1 and proposal.fleet == {
        "rp-q1": [SHORT, 1],
        "rp-l1": [GIVER, 1],
        "rp-l2": [GIVER, 1],
    }
    # One at a time: no second proposal while this one is open, and the control plane does not ask again.
    assert commit(replacement.propose_for_level, SHORT, 3) is None
    with pytest.raises(replacement.ProposalRefused, match=f"placement #{proposal.pk} is waiting for approval"):
        commit(replacement.propose, requested_by=cast["operator"], source="operator")
    # Only on-call decides, never the manager: refused and audited.
    with pytest.raises(drains.NotAllowed, match="only the oncall and admin roles decide"):
        commit(replacement.decide, proposal, cast["manager"], "approve", "looks fine")
    assert AuditEntry.objects.filter(action="placement_approve_refused", actor="manager").exists()
    with pytest.raises(replacement.ProposalRefused, match="reason: say why"):
        commit(replacement.decide, proposal, cast["oncall"], "approve", "  ")
    decided = commit(replacement.decide, proposal, cast["oncall"], "approve", "Qwen is shedding")
    assert decided.state == PlacementState.RUNNING
    with pytest.raises(replacement.ProposalRefused, match="no longer waiting for a decision"):
        commit(replacement.decide, proposal, cast["admin"], "reject", "too late")


def _traffic(model: str, prompt: int, output: int, prefix: str) -> None:
    from recovery.actions import placement
    from recovery.models import RequestOutcome

    now = timezone.now()
    RequestOutcome.objects.bulk_create(
        RequestOutcome(
            request_id=f"{prefix}-{i}",
            gateway="g",
            tenant="t",
            tier="standard",
            model_key=model,
            status="ok",
            prompt_tokens=prompt,
            completion_tokens=output,
            started_at=now,
            finished_at=now,
        )
        for i in range(placement.MIN_MEASURED)
    )


def test_the_placement_page_and_the_degradation_level_count_a_racks_loss_with_one_function(commit, tokens):
    """Issue 43.4: the page once said 147.1 req/s after a rack's loss where the level gave the surviving rack 50.6:
    the page counted capacity at the measured (short) lengths and at the model's speed, the level at the objective's
    lengths and each node's measured speed. Now both are one function on one set of inputs: a rack's loss on the page
    is what the level would count with that rack gone, a slow GPU included."""
    import time

    from recovery import hot
    from recovery.actions import placement
    from workers import catalog

    fleet(commit)  # GIVER: rp-l1 on rack-a, rp-l2 on rack-b; SHORT: rp-q1 on rack-a
    _traffic(GIVER, 100, 50, "short")  # traffic far shorter than the objective's 512 → 256
    # rp-l2's GPU steps at 2× the model (a throttled GPU), as its heartbeat says.
    deployment = catalog.Deployment.of(GIVER, "H200-SXM", 1)
    model_ms = deployment.step_s(0, 0, 8, 8 * 640) * 1000
    hot.heartbeat(
        "rp-l2",
        time.time(),
        "serving",
        {"decode_step_ms": 2 * model_ms, "decode_step_batch": 8, "decode_step_context_tokens": 8 * 640},
    )
    for answer in (placement.propose(evaluate=False), placement.overview()):
        current = answer["current"]
        whole, without_rack_a = capacity.report(model=GIVER), capacity.report(model=GIVER, exclude=("rp-l1", "rp-q1"))
        assert without_rack_a.nodes["rp-l2"]["slowdown"] == pytest.approx(2.0, abs=0.01)
        assert current["capacity_rps"][GIVER] == pytest.approx(whole.capacity_rps, abs=0.002)
        # The worst rack for GIVER is rack-a (its full-speed node): what is left is the slow node, as the level sees it.
        assert current["after_rack_loss_rps"][GIVER] == pytest.approx(without_rack_a.capacity_rps, abs=0.002)
        demand = {d["model"]: d for d in answer["demands"]}[GIVER]
        assert (demand["prompt_tokens"], demand["output_tokens"]) == (512, 256)
        # The measured lengths are shown beside, and they are shorter: no warning.
        assert answer["sources"][GIVER] == (
            "lengths from the model's objective (512 → 256 tokens), as its degradation level counts them; "
            "measured over the last 15 min: 100 → 50 (20 requests)"
        )
    # A proposal (the answer to a level's rise) reads the same figures.
    proposal = commit(replacement.propose_for_level, SHORT, 2)
    assert proposal.plan["current"]["capacity_rps"][GIVER] == pytest.approx(whole.capacity_rps, abs=0.002)
    # Traffic longer than the objective: the page says that the level and the plan both overstate capacity.
    _traffic(SHORT, 3000, 50, "long")
    assert (
        "longer than the objective: this plan and the level both count more capacity"
        in (placement.overview()["sources"][SHORT])
    )


def test_a_level_rise_of_a_model_with_no_other_model_beside_it_runs_no_planner(commit, tokens):
    commit(register, "rp-solo", gpu="H200-SXM", model=SHORT)
    objective(SHORT, required_rps=40.0)
    assert commit(replacement.propose_for_level, SHORT, 3) is None
    assert not PlacementProposal.objects.exists()


def test_a_level_rise_asks_for_a_proposal_and_a_fall_does_not(commit, tokens, monkeypatch):
    asked = []
    monkeypatch.setattr(tasks.propose_placement, "apply_async", lambda args, **options: asked.append(tuple(args)))
    fleet(commit)
    commit(capacity.set_level, SHORT, 2, "two nodes lost")
    commit(capacity.set_level, SHORT, 1, "one back")
    commit(reactions.process)
    assert asked == [(SHORT, 2)]
    # The task itself makes the proposal.
    assert PlacementProposal.objects.filter(pk=tasks.propose_placement(SHORT, 2)).exists()


def test_two_approvers_when_the_giving_model_would_be_left_short_and_never_the_asker(commit, tokens, cast):
    fleet(commit, giver_rps=30.0)  # one H200 of the giver carries 29.5: switching one leaves it short
    proposal = commit(replacement.propose, requested_by=cast["oncall"], source="oncall", reason="Qwen sheds")
    assert proposal.approvals_required == 2
    assert (
        f"{GIVER} would be left with" in proposal.approvals_why
        and "of the 30.0 it must carry" in proposal.approvals_why
    )
    with pytest.raises(replacement.ProposalRefused, match="asked for placement .* and may not approve it"):
        commit(replacement.decide, proposal, cast["oncall"], "approve", "mine")
    first = commit(replacement.decide, proposal, cast["admin"], "approve", "ok")
    assert first.state == PlacementState.PROPOSED and [d["user"] for d in first.decisions] == ["admin"]
    with pytest.raises(replacement.ProposalRefused, match="admin has already decided"):
        commit(replacement.decide, proposal, cast["admin"], "approve", "again")


def test_a_plan_for_a_fleet_that_changed_is_refused_at_approval_saying_what_changed(commit, tokens, cast):
    fleet(commit)
    proposal = commit(replacement.propose, requested_by=cast["operator"], source="operator")
    commit(register, "rp-new", gpu="H200-SXM", model=SHORT, rack="rack-b")  # a node joined
    q1 = Node.objects.get(name="rp-q1")
    commit(nodes.transition_node, q1, NodeState.DOWN, "test: it died")
    refused = commit(replacement.decide, proposal, cast["oncall"], "approve", "go")
    assert refused.state == PlacementState.REFUSED
    assert "rp-q1 is no longer in service" in refused.outcome and f"rp-new joined ({SHORT} TP1)" in refused.outcome
    assert "Ask for a new plan" in refused.outcome and not Drain.objects.exists()
    # A new plan can be asked for now.
    assert commit(replacement.propose, requested_by=cast["operator"], source="operator").state == "proposed"


def test_a_node_that_joins_while_the_planner_runs_is_a_change_the_approval_sees(commit, tokens, cast, monkeypatch):
    from recovery.policy import planner

    fleet(commit)
    solve = planner.plan

    def plan_while_a_node_joins(*args, **kwargs):
        result = solve(*args, **kwargs)
        register("rp-late", gpu="H200-SXM", model=SHORT, rack="rack-b")
        return result

    monkeypatch.setattr(planner, "plan", plan_while_a_node_joins)
    proposal = commit(replacement.propose_for_level, SHORT, 2)
    assert "rp-late" not in proposal.fleet
    refused = commit(replacement.decide, proposal, cast["oncall"], "approve", "go")
    assert refused.state == PlacementState.REFUSED and f"rp-late joined ({SHORT} TP1)" in refused.outcome


def test_a_rejected_proposal_switches_nothing(commit, tokens, cast):
    fleet(commit)
    proposal = commit(replacement.propose_for_level, SHORT, 2)
    rejected = commit(replacement.decide, proposal, cast["oncall"], "reject", "traffic is falling anyway")
    assert rejected.state == PlacementState.REJECTED and "traffic is falling anyway" in rejected.outcome
    assert not commit(replacement.advance, rejected) and not Drain.objects.exists()


# --- carrying it out -----------------------------------------------------------------------------------------------
def test_an_approved_proposal_switches_a_real_node_and_it_serves_the_new_model(node_factory, commit, cast, tokens):
    procs = {
        name: node_factory(name, "--model", GIVER, "--gpu", "H200-SXM", "--time-scale", "0.02", env=ENV)
        for name in ("rp-l1", "rp-l2")
    }
    fleet(commit, {name: p.address for name, p in procs.items()})
    commit(incidents.on_degradation, 0, 2, f"{SHORT}: capacity below the objective", timezone.now(), SHORT)
    incident = Incident.objects.get()
    proposal = commit(replacement.propose_for_level, SHORT, 2)
    assert proposal.incident is not None
    switch = proposal.switches[0]
    commit(replacement.decide, proposal, cast["oncall"], "approve", "Qwen is shedding")

    # The first switch starts: a drain of the node, approved with the proposal, to switch to the short model.
    assert commit(replacement.advance, PlacementProposal.objects.get(pk=proposal.pk))
    drain = Drain.objects.get(placement=proposal)
    assert drain.node.name == switch["node"] and drain.remediation == "switch_model" and drain.switch_to == SHORT
    assert drain.state == DrainState.APPROVED and "approved with placement" in drain.steps.last().cause
    assert not commit(replacement.advance, PlacementProposal.objects.get(pk=proposal.pk))  # one at a time

    def step():
        commit(drains.advance, Drain.objects.get(pk=drain.pk))
        return Drain.objects.get(pk=drain.pk).state

    assert step() == DrainState.CORDONED
    assert step() == DrainState.DRAINING
    assert step() == DrainState.DRAINED  # nothing in flight
    assert step() == DrainState.REMEDIATING
    # The node starts again as itself with the new model (a new listening line) and registers again, as a node does.
    proc = procs[switch["node"]]
    again = json.loads(proc.proc.stdout.readline())
    assert again["event"] == "listening" and again["name"] == switch["node"]
    assert step() == DrainState.REMEDIATING  # the registry still has it serving the old model
    wait_for(lambda: _serves(again["address"], SHORT), 30, 0.2, "the new model loaded")
    node = Node.objects.get(name=switch["node"])
    rack = node.rack.name
    commit(register, switch["node"], address=again["address"], gpu="H200-SXM", model=SHORT, rack=rack)
    assert step() == DrainState.VERIFYING
    commit(health.run_canary, Node.objects.get(pk=node.pk), trial=True)
    assert step() == DrainState.RETURNED
    node.refresh_from_db()
    assert node.model_key == SHORT and not node.cordoned and node.health == Health.HEALTHY
    assert "serving Qwen3-32B" in Drain.objects.get(pk=drain.pk).outcome

    # The proposal is done once its one switch is, and the incident's timeline tells it.
    assert commit(replacement.advance, PlacementProposal.objects.get(pk=proposal.pk))
    done = PlacementProposal.objects.get(pk=proposal.pk)
    assert done.state == PlacementState.DONE and f"{switch['node']} {GIVER} → {SHORT}" in done.outcome
    timeline = list(
        IncidentEvent.objects.filter(incident=incident, kind=EventKind.PLACEMENT).values_list("description", flat=True)
    )
    assert any("proposed" in t for t in timeline) and any("approved by oncall" in t for t in timeline)
    assert any("drains, then switches" in t for t in timeline) and any("done" in t for t in timeline)


def test_a_switch_the_node_refuses_fails_the_proposal_and_starts_no_other(commit, cast, tokens):
    fleet(commit)  # no process listens at the nodes' address: the switch cannot be asked
    proposal = commit(replacement.propose_for_level, SHORT, 2)
    commit(replacement.decide, proposal, cast["oncall"], "approve", "go")
    commit(replacement.advance, PlacementProposal.objects.get(pk=proposal.pk))
    drain = Drain.objects.get(placement=proposal)
    for _ in range(4):
        commit(drains.advance, Drain.objects.get(pk=drain.pk))
    # A node that does not answer may be restarting: its switch is waited for, then failed.
    assert Drain.objects.get(pk=drain.pk).state == DrainState.DRAINED
    long_ago = timezone.now() - timedelta(seconds=drains.REMEDIATE_WAIT_S + 1)
    commit(lambda: Drain.objects.filter(pk=drain.pk).update(state_changed_at=long_ago))
    commit(drains.advance, Drain.objects.get(pk=drain.pk))
    assert Drain.objects.get(pk=drain.pk).state == DrainState.FAILED
    assert commit(replacement.advance, PlacementProposal.objects.get(pk=proposal.pk))
    failed = PlacementProposal.objects.get(pk=proposal.pk)
    assert failed.state == PlacementState.FAILED and "switch of model failed" in failed.outcome
    assert Drain.objects.filter(placement=proposal).count() == 1


def _serves(address: str, model: str) -> bool:
    try:
        status, body = http_json(address + "/v1/models", timeout=2)
    except OSError:
        return False
    return status == 200 and [m["id"] for m in body["data"]] == [model] and http_json(address + "/health")[0] == 200


# --- the Placement page and the API ------------------------------------------------------------------------------
def test_the_page_shows_a_proposal_and_on_call_decides_it_there(client, commit, cast, tokens):
    fleet(commit)
    client.force_login(cast["operator"])
    response = client.post("/placement/proposals", {"reason": "Qwen sheds best-effort"})
    assert response.status_code == 302
    proposal = PlacementProposal.objects.get()
    page = client.get("/placement/").content.decode()
    assert f'id="proposal-{proposal.pk}"' in page and "Qwen sheds best-effort" in page
    assert f'data-switch="{proposal.switches[0]["node"]}"' in page and "Waiting for approval" in page
    assert "approve-proposal" not in page  # an operator asks; on-call decides

    client.force_login(cast["manager"])
    assert client.post("/placement/proposals", {"reason": "x"}).status_code == 403
    assert "Only the oncall and admin roles approve" in client.get("/placement/").content.decode()

    client.force_login(cast["oncall"])
    assert "approve-proposal" in client.get("/placement/").content.decode()
    response = client.post(f"/placement/proposals/{proposal.pk}/approve", {"reason": "go"}, follow=True)
    assert f"Re-placement #{proposal.pk}: running." in response.content.decode()
    assert PlacementProposal.objects.get(pk=proposal.pk).state == PlacementState.RUNNING


def test_the_api_lists_asks_for_and_decides_proposals(client, commit, cast, tokens):
    from console.models import ApiToken

    fleet(commit)
    _, operator = ApiToken.issue(cast["operator"])
    _, oncall = ApiToken.issue(cast["oncall"])
    status = client.post(
        "/api/placement/proposals",
        data={"reason": "asked"},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {operator}",
    )
    assert status.status_code == 201
    body = status.json()
    assert body["state"] == "proposed" and body["switches"][0]["to"] == SHORT and body["approvals_required"] == 1
    again = client.post(
        "/api/placement/proposals", data={}, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {operator}"
    )
    assert again.status_code == 409 and "waiting for approval" in again.json()["error"]["message"]
    listed = client.get("/api/placement/proposals", HTTP_AUTHORIZATION=f"Bearer {oncall}").json()["proposals"]
    assert [p["id"] for p in listed] == [body["id"]]
    url = f"/api/placement/proposals/{body['id']}"
    refused = client.post(
        url + "/approve",
        data={"reason": "mine"},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {operator}",
    )
    assert refused.status_code == 403
    decided = client.post(
        url + "/approve", data={"reason": "go"}, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {oncall}"
    )
    assert decided.status_code == 200 and decided.json()["state"] == "running"
    assert client.get(url, HTTP_AUTHORIZATION=f"Bearer {oncall}").json()["approvals"] == ["oncall"]
    assert client.get(url + "0", HTTP_AUTHORIZATION=f"Bearer {oncall}").status_code == 404
