"""Re-placement proposals (issue 14): a placement plan turned into node switches, approved by on-call, carried out.

When a model's degradation level rises (a reaction to its DegradationChange) and the planner finds a placement
that gives it more capacity by switching nodes of other models over, the control plane proposes it; an operator
may also ask for one from the Placement page. A proposal holds the whole plan (both sides, with the simulator's
attainment per model), the switches it takes (node, from, to), the moves no switch can carry out (a tensor-parallel
degree the node does not have), and the fleet it was made against.

On-call approves it as a whole: two approvers when a model that gives nodes away would be left below what it must
carry. At the last approval the fleet is compared with the one the plan was made against; a plan for a fleet that
has changed since (a node gone, new, or serving another model) is refused with what changed. Approved, it runs one
switch at a time: a drain of the node (its requests migrate live, as every drain's), the switch of model, a cold
load, a trial canary, back in service with the new model. Each step is on the incident's timeline.
"""

import logging

from django.db import transaction
from django.utils import timezone

from recovery import roles
from recovery.actions import audit, drains, incidents, notify, placement
from recovery.choices import (
    OPEN_DRAIN_STATES,
    OPEN_PLACEMENT_STATES,
    DrainState,
    EventKind,
    IncidentStatus,
    PlacementState,
    Remediation,
)
from recovery.models import Cluster, Incident, Node, PlacementProposal

log = logging.getLogger(__name__)

SOURCE = "control plane"
FAILED_DRAINS = (DrainState.FAILED, DrainState.REJECTED, DrainState.CANCELLED, DrainState.HANDED_OFF)


class ProposalRefused(ValueError):
    """The proposal cannot be made or decided as asked; the message says why and what to do."""


def fleet_now() -> dict[str, list]:
    """{node: [model, tp]} of the nodes a plan places on: serving or joining, not spares, not out of service."""
    return {n.name: [n.model_key, n.tp] for n in placement.plannable_nodes()}


def changes(then: dict[str, list], now: dict[str, list]) -> list[str]:
    """What changed in the fleet between two fingerprints, in words."""
    said = [f"{name} is no longer in service" for name in sorted(set(then) - set(now))]
    said += [f"{name} joined ({now[name][0]} TP{now[name][1]})" for name in sorted(set(now) - set(then))]
    said += [
        f"{name} serves {now[name][0]} TP{now[name][1]}, not {then[name][0]} TP{then[name][1]}"
        for name in sorted(set(then) & set(now))
        if list(then[name]) != list(now[name])
    ]
    return said


def switches_for(result: dict, nodes: list[Node]) -> tuple[list[dict], list[str]]:
    """The plan's moves as node switches: on each server, a replica stopped and one started at the same
    tensor-parallel degree are one node that switches model. What no switch carries out is listed in words."""
    by_server: dict[str, list[Node]] = {}
    for node in nodes:
        by_server.setdefault(node.server or node.name, []).append(node)
    switches, manual = [], []
    for move in result["moves"]:
        stops = [dict(r) for r in move["stop"]]
        free = sorted(by_server.get(move["server"], []), key=lambda n: n.name)
        for start in move["start"]:
            stop = next((s for s in stops if s["tp"] == start["tp"]), None)
            node = (
                next((n for n in free if n.model_key == stop["model"] and n.tp == stop["tp"]), None) if stop else None
            )
            if node is None:
                manual.append(f"{move['server']}: start {start['model']} TP{start['tp']} (no node there to switch)")
                continue
            stops.remove(stop)
            free.remove(node)
            switches.append({"node": node.name, "from": node.model_key, "to": start["model"], "tp": node.tp})
        manual += [f"{move['server']}: stop {s['model']} TP{s['tp']} (no replica started in its place)" for s in stops]
    return switches, manual


def approvals_for(result: dict, switches: list[dict]) -> tuple[int, str]:
    """Two approvers when a model that gives nodes away would be left with less capacity than it must carry."""
    demand = {d["model"]: d["rate_rps"] for d in result["demands"]}
    after = result["proposed"]["capacity_rps"]
    short = [
        f"{model} would be left with {after.get(model, 0.0):.1f} req/s of the {demand[model]:.1f} it must carry"
        for model in sorted({s["from"] for s in switches})
        if model in demand and after.get(model, 0.0) < demand[model]
    ]
    return (2, "; ".join(short)) if short else (1, "")


def open_proposal() -> PlacementProposal | None:
    return PlacementProposal.objects.filter(state__in=OPEN_PLACEMENT_STATES).first()


def propose(model: str = "", *, source: str = SOURCE, reason: str = "", requested_by=None) -> PlacementProposal:
    """A re-placement for the live fleet, for `model` short of capacity (or the whole fleet's workload), waiting for
    on-call. Refused while another is open, and when the plan switches no node (or gives `model` nothing)."""
    existing = open_proposal()
    if existing is not None:
        raise ProposalRefused(
            f"placement #{existing.pk} is {existing.get_state_display().lower()}: decide it or let it finish first"
        )
    # The fleet is read once, before the solve: the plan and the fingerprint checked at approval are of the same
    # fleet, so a node that changes while the planner runs is a change the approval sees. At the lengths the
    # degradation level counts capacity at: the proposal answers a level's rise, and its capacities are the level's.
    nodes = list(placement.plannable_nodes())
    result = placement.propose(nodes=nodes)
    switches, manual = switches_for(result, nodes)
    if not switches:
        raise ProposalRefused(
            "the planner's placement switches no node: "
            + ("; ".join(result["problems"] + manual) or "the current placement is already the plan")
        )
    if model:
        now, then = (
            result["current"]["capacity_rps"].get(model, 0.0),
            result["proposed"]["capacity_rps"].get(model, 0.0),
        )
        if then <= now:
            raise ProposalRefused(
                f"no placement gives {model} more capacity than its {now:.1f} req/s: no other model has headroom "
                "it can give without falling short itself"
            )
    required, why = approvals_for(result, switches)
    reason = reason.strip() or (f"{model} is short of capacity" if model else "an operator asked for a re-placement")
    with transaction.atomic():
        # The plan took seconds: another proposal may have been made meanwhile (two models' levels rose at once).
        Cluster.objects.select_for_update().filter(pk=Cluster.default().pk).first()
        existing = open_proposal()
        if existing is not None:
            raise ProposalRefused(f"placement #{existing.pk} was proposed meanwhile: decide it or let it finish first")
        proposal = PlacementProposal.objects.create(
            source=source,
            requested_by=requested_by,
            reason=reason,
            model_key=model,
            plan=result,
            switches=switches,
            manual=manual,
            fleet={n.name: [n.model_key, n.tp] for n in nodes},
            approvals_required=required,
            approvals_why=why,
            incident=_incident_of(model),
        )
        moves = ", ".join(f"{s['node']} {s['from']} → {s['to']}" for s in switches)
        audit.record(source, "placement_proposed", f"placement:{proposal.pk}", reason, switches=switches)
        _on_timeline(proposal, f"re-placement #{proposal.pk} proposed ({reason}): {moves}; waiting for on-call")
        notify.send(
            "placement_proposed",
            f"Re-placement #{proposal.pk} needs approval",
            f"{source} proposes to switch {len(switches)} node(s): {moves}. {reason}."
            + (f" Needs two approvers: {why}" if required > 1 else ""),
            "/placement/",
        )
    log.info("placement #%d proposed by %s: %s", proposal.pk, source, moves)
    return proposal


def propose_for_level(model: str, level: int) -> PlacementProposal | None:
    """A model's level rose: propose a re-placement when one helps it and none is open (a reaction's task). A fleet
    serving no other model has nothing to switch over: the planner is not run for it."""
    if level < 1 or open_proposal() is not None:
        return None
    if not placement.plannable_nodes().exclude(model_key=model).exists():
        return None
    try:
        return propose(model, reason=f"{model} is at degradation level {level}")
    except (ProposalRefused, placement.PlacementError) as exc:
        log.info("no re-placement for %s at level %d: %s", model, level, exc)
        return None


def decide(proposal: PlacementProposal, user, decision: str, reason: str) -> PlacementProposal:
    """On-call's approval or rejection, with a reason. The last approval checks the fleet and starts the run."""
    name, reason = user.get_username(), reason.strip()
    if decision not in ("approve", "reject"):
        raise ProposalRefused(f"decision: {decision!r} is not approve or reject")
    if not roles.has_role(user, *drains.DECIDE):
        refusal = (
            f"Role {roles.role_of(user)!r} may not {decision} re-placements: only the oncall and admin roles decide."
        )
        audit.record(name, f"placement_{decision}_refused", f"placement:{proposal.pk}", refusal)
        raise drains.NotAllowed(refusal)
    if not reason:
        raise ProposalRefused(f"reason: say why you {decision} this re-placement")
    with transaction.atomic():
        proposal = PlacementProposal.objects.select_for_update().get(pk=proposal.pk)
        if proposal.state != PlacementState.PROPOSED:
            raise ProposalRefused(
                f"placement #{proposal.pk} is {proposal.get_state_display().lower()}: it is no longer waiting for a "
                "decision"
            )
        if any(d["user"] == name for d in proposal.decisions):
            raise ProposalRefused(
                f"{name} has already decided on placement #{proposal.pk}: a second approval must come from another "
                "person"
            )
        if decision == "approve" and proposal.requested_by_id == user.pk:
            raise ProposalRefused(f"{name} asked for placement #{proposal.pk} and may not approve it: another must")
        proposal.decisions = [
            *proposal.decisions,
            {"user": name, "decision": decision, "reason": reason, "at": timezone.now().isoformat()},
        ]
        audit.record(name, f"placement_{decision}", f"placement:{proposal.pk}", reason)
        if decision == "reject":
            _finish(proposal, PlacementState.REJECTED, f"rejected by {name}: {reason}")
            return proposal
        approvals = [d["user"] for d in proposal.decisions if d["decision"] == "approve"]
        if len(approvals) < proposal.approvals_required:
            proposal.save(update_fields=["decisions"])
            _on_timeline(proposal, f"re-placement #{proposal.pk} approved by {name} ({len(approvals)} of 2): {reason}")
            return proposal
        changed = changes(proposal.fleet, fleet_now())
        if changed:
            _finish(
                proposal,
                PlacementState.REFUSED,
                "the fleet changed since the plan was made: " + "; ".join(changed) + ". Ask for a new plan.",
            )
            return proposal
        proposal.state, proposal.state_changed_at = PlacementState.RUNNING, timezone.now()
        proposal.save(update_fields=["decisions", "state", "state_changed_at"])
        _on_timeline(
            proposal,
            f"re-placement #{proposal.pk} approved by {', '.join(approvals)}: "
            f"{len(proposal.switches)} node switch(es), one at a time",
        )
    return proposal


def advance_all() -> list[str]:
    return [f"#{p.pk} {p.state}" for p in PlacementProposal.objects.filter(state=PlacementState.RUNNING) if advance(p)]


def advance(proposal: PlacementProposal) -> bool:
    """The next switch once the one before it is done; the proposal done when every switch is. Idempotent."""
    if proposal.state != PlacementState.RUNNING:
        return False
    runs = list(proposal.drains.select_related("node"))
    if any(d.state in OPEN_DRAIN_STATES for d in runs):
        return False
    failed = next((d for d in runs if d.state in FAILED_DRAINS), None)
    if failed is not None:
        _finish(
            proposal,
            PlacementState.FAILED,
            f"the switch of {failed.node.name} to {failed.switch_to} ended {failed.get_state_display().lower()}: "
            f"{failed.outcome or f'see drain #{failed.pk}'}; the switches after it were not started",
        )
        return True
    done = {d.node.name for d in runs if d.state == DrainState.RETURNED}
    following = next((s for s in proposal.switches if s["node"] not in done), None)
    if following is None:
        _finish(proposal, PlacementState.DONE, f"{len(done)} node(s) switched: " + _moves(proposal.switches))
        return True
    node = Node.objects.filter(name=following["node"]).first()
    who = ", ".join(d["user"] for d in proposal.decisions if d["decision"] == "approve")
    try:
        if node is None or node.model_key != following["from"]:
            raise drains.DrainRefused(
                f"{following['node']} " + ("is gone" if node is None else f"serves {node.model_key} now")
            )
        with transaction.atomic():
            drain = drains.propose(
                node,
                source=f"placement #{proposal.pk}",
                reason=f"re-placement #{proposal.pk}: {node.name} switches from {following['from']} "
                f"to {following['to']}",
                remediation=Remediation.SWITCH_MODEL,
                switch_to=following["to"],
                placement=proposal,
            )
            drains.approve_for_placement(drain, who, proposal.pk)
    except drains.DrainRefused as exc:
        _finish(proposal, PlacementState.FAILED, f"the switch of {following['node']} cannot start: {exc}")
        return True
    _on_timeline(
        proposal,
        f"re-placement #{proposal.pk}: {node.name} drains, then switches from {following['from']} to "
        f"{following['to']} (drain #{drain.pk}; {len(done) + 1} of {len(proposal.switches)})",
    )
    return True


def _finish(proposal: PlacementProposal, state: str, outcome: str) -> None:
    proposal.state, proposal.state_changed_at, proposal.outcome = state, timezone.now(), outcome
    proposal.save(update_fields=["state", "state_changed_at", "outcome", "decisions"])
    audit.record("system", f"placement_{state}", f"placement:{proposal.pk}", outcome)
    _on_timeline(proposal, f"re-placement #{proposal.pk} {proposal.get_state_display().lower()}: {outcome}")
    log.info("placement #%d %s: %s", proposal.pk, state, outcome)


def _moves(switches: list[dict]) -> str:
    return ", ".join(f"{s['node']} {s['from']} → {s['to']}" for s in switches)


def _incident_of(model: str) -> Incident | None:
    """The open incident of the model's lost capacity, if there is one: the proposal's steps go on its timeline."""
    if not model:
        return None
    for incident in Incident.objects.filter(status=IncidentStatus.ACTIVE).order_by("-opened_at"):
        if incidents.concerns(incident, model):
            return incident
    return None


def _on_timeline(proposal: PlacementProposal, text: str) -> None:
    incident = proposal.incident
    if incident is not None and incident.status != IncidentStatus.CLOSED:
        incidents.add_event(incident, EventKind.PLACEMENT, text, details={"placement": proposal.pk})
