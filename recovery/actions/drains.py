"""Drains approved by on-call: the request with its evidence, the approval rules, and the run.

A drain is raised by the health machine (with the canary failures, Xid events
and telemetry that made it) or by an operator. On-call sees why, the blast
radius and the plan, and approves or rejects with a reason. Only the oncall
and admin roles decide (the view checks the role); the requester may not
approve their own request; a drain that would take capacity below what the
SLOs need, or a second drain in the same pool, needs a second approver.

An approved drain runs one step at a time (`advance`, from Celery beat every
second, and at once after the approval, by recovery.reactions): cordon →
live-migrate the requests in flight, or let them complete → drained →
remediation (restart, GPU reset, hand-off to hardware repair, or a switch to
another model: one move of an approved re-placement, recovery.actions.placement)
→ a canary in half-open → back in service. Every step is a DrainStep row with its time
and cause, shown live; it is also an outbox row (the approval's advance and
the trial canary are its reactions).
"""

import datetime as dt
import logging

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from recovery import events, hot, nodeclient, roles
from recovery.actions import audit, capacity, health, incidents, live_migration, notify
from recovery.choices import (
    OPEN_DRAIN_STATES,
    RUNNING_DRAIN_STATES,
    BreakerState,
    DrainMode,
    DrainState,
    EventKind,
    Health,
    IncidentStatus,
    NodeState,
    Remediation,
)
from recovery.models import (
    CanaryResult,
    Cluster,
    Drain,
    DrainDecision,
    DrainStep,
    Node,
    XidEvent,
)
from recovery.policy import breaker as breakers
from workers import catalog

log = logging.getLogger(__name__)

REMEDIATION_NAMES = {
    Remediation.RESTART: "engine restart",
    Remediation.RESET: "GPU reset",
    Remediation.HARDWARE_REPAIR: "hardware repair",
    Remediation.SWITCH_MODEL: "switch of model",
}
MIGRATE_AGAIN_S = 10.0  # requests still on the node this long after the migration command: ask the gateways again
# A drained node that is down (its supervisor restarting it) is waited for this long before its remediation is
# called failed: a reset or reload asked of a node that is not there yet fails for nothing.
REMEDIATE_WAIT_S = 300.0


class DrainRefused(ValueError):
    """The drain cannot be raised or decided as asked; the message says why and what to do."""


def open_drain(node: Node) -> Drain | None:
    return node.drains.filter(state__in=OPEN_DRAIN_STATES).first()


# --- raising a drain ------------------------------------------------------------------------------
def evidence_for(node: Node) -> dict:
    """Why the node should be drained: its health, recent canaries, Xid events and telemetry."""
    canaries = [
        {"at": c.at.isoformat(), "passed": c.passed, "kind": c.kind, "detail": c.detail, "latency_ms": c.latency_ms}
        for c in CanaryResult.objects.filter(node=node)[:10]
    ]
    xids = [
        {
            "first_at": x.first_at.isoformat(),
            "gpu": x.gpu_index,
            "code": x.code,
            "codes": x.codes,
            "severity": x.severity,
            "meaning": x.meaning,
            "action": x.action,
        }
        for x in XidEvent.objects.filter(node=node)[:10]
    ]
    readings = hot.telemetry(node.name, 1)
    return {
        "health": node.health,
        "canary_failures": node.canary_failures,
        "breaker": node.breaker,
        "canaries": canaries,
        "xids": xids,
        "telemetry": readings[0] if readings else None,
    }


def blast_radius(node: Node) -> dict:
    """What draining `node` touches: requests in flight, KV it holds for others, its model's capacity left (the
    error budgets its objectives have left are read live: console.readmodels.drains.model_budgets)."""
    live = hot.node(node.name) or hot.NodeEntry()
    flights = [f for f in hot.gateway_flights() if f.get("node") == node.name]
    held = hot.checkpoints_held(node.name)
    now = capacity.report(model=node.model_key)  # its model's: another model's capacity does not replace it
    spare = health.spare_for(node)  # promoted at the cordon: it counts in what remains
    after = capacity.report(exclude=(node.name,), promoted=(spare.name,) if spare else (), model=node.model_key)
    return {
        "in_flight": len(flights),
        "in_flight_by_tier": {
            tier: sum(1 for f in flights if f.get("tier") == tier) for tier in sorted({f.get("tier") for f in flights})
        },
        "running_on_node": live.queue_depth,
        "kv_held_for_others": {
            "bytes": sum(v.get("bytes", 0) for v in held.values()),
            "requests": sum(v.get("requests", 0) for v in held.values()),
            "by_node": held,
        },
        "capacity_rps_now": now.capacity_rps,
        "capacity_rps_after": after.capacity_rps,
        "spare_promoted": spare.name if spare else None,
        "model": node.model_key,
        "required_rps": after.required_rps,
        "ratio_after": None if after.required_rps <= 0 else round(after.ratio, 3),
    }


def approvals_needed(node: Node, radius: dict) -> tuple[int, str]:
    """1, or 2 with the reason: capacity after the drain below the SLOs' need, or another drain open in the pool."""
    reasons = []
    ratio = radius.get("ratio_after")
    if ratio is not None and ratio < 1:
        reasons.append(
            f"capacity after the drain ({radius['capacity_rps_after']:.1f} req/s) is below the "
            f"{radius['required_rps']:.1f} req/s the SLOs need"
        )
    others = Drain.objects.filter(node__model_key=node.model_key, state__in=OPEN_DRAIN_STATES).exclude(node=node)
    if others.exists():
        reasons.append(
            f"{', '.join(f'#{d.pk} ({d.node.name})' for d in others.select_related('node'))} "
            f"already open in the {node.model_key} pool"
        )
    return (2, "; ".join(reasons)) if reasons else (1, "")


def propose(
    node: Node,
    *,
    source: str,
    reason: str,
    requested_by=None,
    mode: str = DrainMode.IMMEDIATE,
    deadline_s: int | None = None,
    remediation: str = Remediation.RESTART,
    proposed_again_of: Drain | None = None,
    switch_to: str = "",
    placement=None,
) -> Drain:
    """Raise a drain request for on-call. Refused, with the node's state, for a node already draining or down.

    A drain proposed again (`proposed_again_of`) keeps the incident of the one before it."""
    node.refresh_from_db()
    if node.state != NodeState.SERVING:
        raise DrainRefused(
            f"{node.name} is {node.get_state_display()} (since {node.state_changed_at:%H:%M:%S}): "
            "only a serving node can be drained"
        )
    existing = open_drain(node)
    if existing is not None:
        raise DrainRefused(f"{node.name} already has drain #{existing.pk}, {existing.get_state_display().lower()}")
    if mode not in DrainMode.values:
        raise DrainRefused(f"mode: {mode!r} is not a drain mode: expected one of {', '.join(DrainMode.values)}")
    if remediation not in Remediation.values:
        raise DrainRefused(
            f"remediation: {remediation!r} is not known: expected one of {', '.join(Remediation.values)}"
        )
    if remediation == Remediation.SWITCH_MODEL:
        _check_switch(node, switch_to)
    elif switch_to:
        raise DrainRefused("switch_to: only a drain with remediation switch_model switches the node's model")
    if mode == DrainMode.DEADLINE and not deadline_s:
        raise DrainRefused(
            "deadline_s: a deadline drain needs the seconds after the cordon when what is left is migrated"
        )
    if not reason.strip():
        raise DrainRefused("reason: a drain request needs a reason")
    radius = blast_radius(node)
    required, why = approvals_needed(node, radius)
    with transaction.atomic():
        drain = Drain.objects.create(
            node=node,
            mode=mode,
            deadline_s=deadline_s if mode == DrainMode.DEADLINE else None,
            remediation=remediation,
            requested_by=requested_by,
            source=source,
            reason=reason.strip(),
            evidence=evidence_for(node),
            blast_radius=radius,
            approvals_required=required,
            approvals_why=why,
            proposed_again_of=proposed_again_of,
            incident=proposed_again_of.incident if proposed_again_of else getattr(placement, "incident", None),
            switch_to=switch_to,
            placement=placement,
        )
        _step(drain, "", DrainState.PROPOSED, f"requested by {source}: {reason.strip()}", actor=source)
        audit.record(
            source,
            "drain_requested",
            f"node:{node.name}",
            reason.strip(),
            drain=drain.pk,
            mode=mode,
            remediation=remediation,
        )
        notify.send(
            "drain_requested",
            f"Drain of {node.name} needs approval",
            f"{source} asks to drain {node.name} "
            f"({drain.get_mode_display()}; then {REMEDIATION_NAMES[drain.remediation]}): "
            f"{reason.strip()}. In flight: {radius['in_flight']}; "
            f"capacity after: {radius['capacity_rps_after']:.1f} req/s"
            + (f". Needs two approvers: {why}" if required > 1 else ""),
            f"/drains/{drain.pk}/",
        )
    log.info("drain #%d of %s proposed by %s", drain.pk, node.name, source)
    return drain


def _check_switch(node: Node, model: str) -> None:
    """A switch of model must name a catalog model that is not a draft, is not the node's, and fits its GPUs."""
    target = catalog.MODELS.get(model)
    if target is None or target.is_draft:
        served = ", ".join(k for k, m in catalog.MODELS.items() if not m.is_draft)
        raise DrainRefused(f"switch_to: {model!r} is not a catalog model a node can serve: one of {served}")
    if target.key == node.model_key:
        raise DrainRefused(f"switch_to: {node.name} already serves {target.key}")
    try:
        catalog.Deployment.of(target.key, node.gpu_key, node.tp)
    except catalog.CatalogError as exc:
        raise DrainRefused(f"switch_to: {exc}") from None


def approve_for_placement(drain: Drain, who: str, placement_id: int) -> None:
    """A drain that is one move of a re-placement on-call approved as a whole: approved by those who approved it."""
    with transaction.atomic():
        _step(drain, drain.state, drain.state, f"one move of placement #{placement_id}, approved by {who}", actor=who)
        _move(drain, DrainState.APPROVED, f"approved with placement #{placement_id}", actor=who,
              approved_at=timezone.now())  # fmt: skip


def _step(drain: Drain, old: str, new: str, cause: str, *, actor: str = "system", **details) -> DrainStep:
    step = DrainStep.objects.create(
        drain=drain, old_state=old, new_state=new, cause=cause, actor=actor, details=details
    )
    transaction.on_commit(lambda: events.drain_changed(drain.pk))
    return step


def _move(drain: Drain, new: str, cause: str, *, actor: str = "system", details: dict | None = None, **fields) -> bool:
    """Claim the drain's next state with a conditional update; one step row."""
    old = drain.state
    with transaction.atomic():
        claimed = Drain.objects.filter(pk=drain.pk, state=old).update(
            state=new, state_changed_at=timezone.now(), **fields
        )
        if not claimed:
            return False
        drain.state = new
        drain.state_changed_at = timezone.now()
        for name, value in fields.items():
            setattr(drain, name, value)
        _step(drain, old, new, cause, actor=actor, **(details or {}))
        _note_on_incident(drain, f"drain #{drain.pk} of {drain.node.name}: {DrainState(new).label.lower()} ({cause})")
    log.info("drain #%d of %s: %s -> %s (%s)", drain.pk, drain.node.name, old, new, cause)
    return True


def _note_on_incident(drain: Drain, text: str) -> None:
    incident = drain.incident if drain.incident_id else None
    if incident is None or incident.status == IncidentStatus.CLOSED:
        incident = incidents.open_incident_for(drain.node)
    if incident is not None:
        incidents.add_event(incident, EventKind.DRAIN, text, node=drain.node, details={"drain": drain.pk})


# --- nodes left out of service ------------------------------------------------------------------------------------
def left_out_of_service() -> list[dict]:
    """Serving nodes that take no traffic (UNHEALTHY, breaker open, cordoned) with no drain open for them: nobody
    is deciding what happens to them. Not a node handed to hardware repair, which stays out until a person returns
    it. Each with why, and its last drain."""
    left = []
    candidates = Node.objects.filter(state=NodeState.SERVING, spare=False).exclude(drains__state__in=OPEN_DRAIN_STATES)
    for node in candidates.filter(
        Q(health__in=(Health.UNHEALTHY, Health.DRAINING)) | ~Q(breaker=BreakerState.CLOSED) | Q(cordoned=True)
    ).order_by("name"):
        last = node.drains.order_by("-created_at", "-pk").first()
        if last is not None and last.state == DrainState.HANDED_OFF:
            continue
        left.append({"node": node, "why": health.out_of_service_why(node), "last_drain": last})
    return left


def propose_again(now: dt.datetime | None = None) -> list[Drain]:
    """A drain cancelled or rejected while its node stays out of service is proposed again once the cluster's
    hold-off has passed (from Celery beat): a node must not be left out of service with nobody deciding."""
    now = now or timezone.now()
    hold_off_s = Cluster.default().drain_propose_again_s
    proposed = []
    for entry in left_out_of_service():
        node, last = entry["node"], entry["last_drain"]
        if last is None or last.state not in (DrainState.CANCELLED, DrainState.REJECTED):
            continue
        ended = last.finished_at or last.state_changed_at
        if (now - ended).total_seconds() < hold_off_s:
            continue
        first = last
        while first.proposed_again_of_id is not None:
            first = first.proposed_again_of
        how = last.steps.filter(new_state=last.state).order_by("-at").first()
        waited = (now - ended).total_seconds()
        after = f"{waited / 60:.0f} min" if waited >= 120 else f"{waited:.0f} s"
        reason = (
            f"Proposed again: {node.name} is still out of service ({', '.join(entry['why'])}) {after} after "
            f"drain #{last.pk} was {how.cause if how else last.get_state_display().lower()}. "
            f"First raised: {first.reason}"
        )
        try:
            drain = propose(
                node,
                source="health machine",
                reason=reason,
                mode=last.mode,
                deadline_s=last.deadline_s,
                remediation=last.remediation,
                proposed_again_of=last,
            )
        except (DrainRefused, IntegrityError) as exc:  # another beat proposed it meanwhile, or the node changed
            log.info("drain #%d of %s not proposed again: %s", last.pk, node.name, exc)
            continue
        proposed.append(drain)
    return proposed


# --- deciding -------------------------------------------------------------------------------------------------
DECIDE = (roles.ONCALL,)  # and admin
REQUEST = (roles.OPERATOR, roles.ONCALL)  # and admin


class NotAllowed(PermissionError):
    """The user's role may not do this; the refusal is in the audit log."""


def may_decide(drain: Drain, user, decision: str) -> None:
    """Only the oncall and admin roles decide drains: anyone else is refused, and the refusal is audited."""
    if roles.has_role(user, *DECIDE):
        return
    role = roles.role_of(user)
    refusal = f"Role {role!r} may not {decision} drains: only the oncall and admin roles decide."
    audit.record(
        user.get_username(), f"drain_{decision}_refused", f"drain:{drain.pk}", refusal, role=role, node=drain.node.name
    )
    raise NotAllowed(refusal)


def decide(drain: Drain, user, decision: str, reason: str) -> Drain:
    """An approval or a rejection by `user`, with a reason. Raises NotAllowed for a role that may not decide."""
    name = user.get_username()
    reason = reason.strip()
    if decision not in (DrainDecision.APPROVE, DrainDecision.REJECT):
        raise DrainRefused(f"decision: {decision!r} is not approve or reject")
    may_decide(drain, user, decision)
    if not reason:
        raise DrainRefused(f"reason: say why you {decision} this drain")
    with transaction.atomic():
        drain = Drain.objects.select_for_update().select_related("node").get(pk=drain.pk)
        if drain.decisions.filter(user=user).exists():
            raise DrainRefused(
                f"{name} has already decided on drain #{drain.pk}: a second approval must come from another person"
            )
        if drain.state != DrainState.PROPOSED:
            raise DrainRefused(
                f"drain #{drain.pk} is {drain.get_state_display().lower()}: it is no longer waiting for a decision"
            )
        if decision == DrainDecision.APPROVE and drain.requested_by_id == user.pk:
            raise DrainRefused(
                f"{name} requested drain #{drain.pk} and may not approve it: another on-call engineer must"
            )
        DrainDecision.objects.create(drain=drain, user=user, decision=decision, reason=reason)
        audit.record(name, f"drain_{decision}", f"drain:{drain.pk}", reason, node=drain.node.name)
        if decision == DrainDecision.REJECT:
            _move(drain, DrainState.REJECTED, f"rejected by {name}: {reason}", actor=name, finished_at=timezone.now())
            return drain
        approvals = drain.decisions.filter(decision=DrainDecision.APPROVE).count()
        if approvals < drain.approvals_required:
            _step(
                drain,
                drain.state,
                drain.state,
                f"approved by {name} ({approvals} of {drain.approvals_required}): {reason}",
                actor=name,
            )
            return drain
        who = ", ".join(
            d.user.get_username() for d in drain.decisions.filter(decision=DrainDecision.APPROVE).select_related("user")
        )
        _move(drain, DrainState.APPROVED, f"approved by {who}: {reason}", actor=name, approved_at=timezone.now())
    return drain


def cancel(drain: Drain, user, reason: str) -> None:
    """Withdraw a drain not yet running (proposed); a running one is finished by its steps.

    The requester's side: operator, oncall and admin may withdraw one. A drain the
    health machine raised for a node that is failing is on-call's to withdraw, as it
    is theirs to decide."""
    if not roles.has_role(user, *REQUEST):
        raise NotAllowed(f"Role {roles.role_of(user)!r} may not cancel drains: it needs operator, oncall or admin.")
    if drain.requested_by_id is None and not roles.has_role(user, *DECIDE):
        refusal = (
            f"Drain #{drain.pk} was raised by the {drain.source}: only the oncall and admin roles may withdraw it."
        )
        audit.record(user.get_username(), "drain_cancel_refused", f"drain:{drain.pk}", refusal, node=drain.node.name)
        raise NotAllowed(refusal)
    if not reason.strip():
        raise DrainRefused("reason: say why the drain is cancelled")
    if drain.state != DrainState.PROPOSED:
        raise DrainRefused(
            f"drain #{drain.pk} is {drain.get_state_display().lower()}: "
            "only a drain waiting for approval can be cancelled"
        )
    if _move(
        drain,
        DrainState.CANCELLED,
        f"cancelled by {user.get_username()}: {reason.strip()}",
        actor=user.get_username(),
        finished_at=timezone.now(),
    ):
        audit.record(user.get_username(), "drain_cancel", f"drain:{drain.pk}", reason.strip(), node=drain.node.name)


# --- running -----------------------------------------------------------------------------------------------------
def advance_all() -> list[str]:
    moved = []
    for drain in Drain.objects.filter(state__in=RUNNING_DRAIN_STATES).select_related("node"):
        if advance(drain):
            moved.append(f"#{drain.pk} {drain.state}")
    return moved


def advance(drain: Drain) -> bool:
    """Take the drain one step further if its condition is met; idempotent, safe to call any time."""
    node = drain.node
    node.refresh_from_db()
    actor = f"drain #{drain.pk}"
    if drain.state == DrainState.APPROVED:
        health.set_cordon(node, True, actor, f"drain #{drain.pk}: {drain.reason}")
        health.set_health(node, Health.DRAINING, f"drain #{drain.pk} approved", actor=actor)
        spare = health.promote_spare_for(node, f"{node.name} is being drained")
        return _move(
            drain,
            DrainState.CORDONED,
            f"{node.name} cordoned: no new requests reach it"
            + (f"; hot spare {spare.name} promoted in its place" if spare else ""),
            cordoned_at=timezone.now(),
        )
    if drain.state == DrainState.CORDONED:
        if drain.mode == DrainMode.IMMEDIATE:
            command = live_migration.start(node, actor, f"drain #{drain.pk}", cordon=False)
            return _move(
                drain,
                DrainState.DRAINING,
                f"every gateway asked to move {_in_flight(node)} in-flight requests off {node.name} live",
                migration_command=command,
                details={"command": command},
            )
        plan = (
            "let them finish"
            if drain.mode == DrainMode.ALLOW_COMPLETION
            else f"let them finish, migrate what is left after {drain.deadline_s} s"
        )
        return _move(drain, DrainState.DRAINING, f"{_in_flight(node)} requests in flight on {node.name}: {plan}")
    if drain.state == DrainState.DRAINING:
        left = _in_flight(node)
        if left == 0 or node.state != NodeState.SERVING:
            return _move(
                drain,
                DrainState.DRAINED,
                f"no request left on {node.name}"
                if node.state == NodeState.SERVING
                else f"{node.name} is {node.state}",
            )
        since = (timezone.now() - (drain.cordoned_at or drain.state_changed_at)).total_seconds()
        if drain.mode == DrainMode.DEADLINE and not drain.migration_command and since >= (drain.deadline_s or 0):
            command = live_migration.start(node, actor, f"drain #{drain.pk}: deadline", cordon=False)
            Drain.objects.filter(pk=drain.pk).update(migration_command=command)
            _step(
                drain,
                drain.state,
                drain.state,
                f"deadline of {drain.deadline_s} s reached: {left} requests moved live",
                command=command,
            )
            return True
        if drain.migration_command and (timezone.now() - drain.state_changed_at).total_seconds() >= MIGRATE_AGAIN_S:
            command = live_migration.start(node, actor, f"drain #{drain.pk}: {left} still there", cordon=False)
            Drain.objects.filter(pk=drain.pk).update(migration_command=command, state_changed_at=timezone.now())
            _step(
                drain,
                drain.state,
                drain.state,
                f"{left} requests still on {node.name}: gateways asked again",
                command=command,
            )
            return True
        return False
    if drain.state == DrainState.DRAINED:
        return _remediate(drain, node, actor)
    if drain.state == DrainState.REMEDIATING:
        switched = drain.remediation != Remediation.SWITCH_MODEL or node.model_key == drain.switch_to
        if switched and node.state == NodeState.SERVING and _model_state(node) == "serving":
            health.set_breaker(
                node,
                breakers.Breaker(BreakerState.HALF_OPEN, node.breaker_failures, node.breaker_opened_at, None),
                f"drain #{drain.pk}: remediation done, one trial canary",
                actor=actor,
            )
            return _move(
                drain,
                DrainState.VERIFYING,
                f"{node.name} serves again after the {REMEDIATION_NAMES[drain.remediation]}: "
                "a canary in half-open decides",
            )
        return False
    if drain.state == DrainState.VERIFYING:
        result = CanaryResult.objects.filter(node=node, at__gte=drain.state_changed_at).order_by("-at").first()
        if result is None:
            waited = (timezone.now() - drain.state_changed_at).total_seconds()
            if waited > 3 * Cluster.default().canary_timeout_s + 5:
                # The trial was lost: another (the step's reaction runs it), and the wait starts again.
                with transaction.atomic():
                    Drain.objects.filter(pk=drain.pk).update(state_changed_at=timezone.now())
                    _step(
                        drain,
                        drain.state,
                        drain.state,
                        f"no trial canary result after {waited:.0f} s: another trial",
                        trial=True,
                    )
                return True
            return False
        if result.passed:
            health.set_breaker(node, breakers.Breaker(), f"drain #{drain.pk}: trial canary passed", actor=actor)
            health.set_health(
                node,
                Health.HEALTHY,
                f"drain #{drain.pk}: canary passed after remediation",
                actor=actor,
                canary_failures=0,
            )
            health.set_cordon(node, False, actor, f"drain #{drain.pk} done: canary passed")
            serves = f" serving {node.model_key}" if drain.remediation == Remediation.SWITCH_MODEL else ""
            return _move(
                drain,
                DrainState.RETURNED,
                f"canary passed ({result.detail}): {node.name} is back in service{serves}",
                finished_at=timezone.now(),
                outcome=f"returned to service{serves}",
            )
        health.set_breaker(
            node,
            breakers.Breaker(BreakerState.OPEN, node.breaker_failures + 1, timezone.now().timestamp(), None),
            f"drain #{drain.pk}: trial canary failed",
            actor=actor,
        )
        health.set_health(
            node, Health.UNHEALTHY, f"drain #{drain.pk}: canary failed after remediation: {result.detail}", actor=actor
        )
        return _move(
            drain,
            DrainState.FAILED,
            f"canary failed after remediation ({result.kind}: {result.detail}); {node.name} stays out of service",
            finished_at=timezone.now(),
            outcome=f"canary failed: {result.detail}",
        )
    return False


def _in_flight(node: Node) -> int:
    """Requests on the node: what the gateways hold there, and what the node itself reports running or waiting."""
    on_node = (hot.node(node.name) or hot.NodeEntry()).queue_depth
    through_gateways = sum(1 for f in hot.gateway_flights() if f.get("node") == node.name)
    return max(on_node, through_gateways)


def _wait_for_node(drain: Drain, why: str) -> bool:
    """The drained node is not there to remediate (down, restarting): said once on the drain, tried again at the
    next pass, until REMEDIATE_WAIT_S after it was drained."""
    if DrainStep.objects.filter(drain=drain, details__waiting_for_node=True).exists():
        return False
    _step(
        drain,
        drain.state,
        drain.state,
        f"{why}: the {REMEDIATION_NAMES[drain.remediation]} waits for it to come back "
        f"(at most {REMEDIATE_WAIT_S:.0f} s after the drain)",
        waiting_for_node=True,
    )
    return True


def _remediate(drain: Drain, node: Node, actor: str) -> bool:
    if drain.remediation == Remediation.HARDWARE_REPAIR:
        audit.record(actor, "hardware_repair", f"node:{node.name}", drain.reason, drain=drain.pk)
        return _move(
            drain,
            DrainState.HANDED_OFF,
            f"{node.name} handed to hardware repair; it stays cordoned until a person returns it",
            finished_at=timezone.now(),
            outcome="handed to hardware repair",
        )
    waited = (timezone.now() - drain.state_changed_at).total_seconds()
    name = REMEDIATION_NAMES[drain.remediation]
    if node.state != NodeState.SERVING and waited < REMEDIATE_WAIT_S:
        return _wait_for_node(drain, f"{node.name} is {node.state}")
    if drain.remediation == Remediation.SWITCH_MODEL:
        path, body, accepted = "/agent/model", {"model": drain.switch_to}, 202
    else:
        path = "/agent/reset" if drain.remediation == Remediation.RESET else "/agent/reload"
        body, accepted = {"cold": True}, 200
    try:
        status, answer = nodeclient.call(node.address, "POST", path, body, timeout=5)
    except nodeclient.NodeUnreachable as exc:
        if waited < REMEDIATE_WAIT_S:
            return _wait_for_node(drain, f"{node.name} does not answer ({exc})")
        status, answer = 0, {"error": {"message": str(exc)}}
    if status != accepted:
        message = answer.get("error", {}).get("message", status) if isinstance(answer.get("error"), dict) else answer
        health.set_health(node, Health.UNHEALTHY, f"drain #{drain.pk}: {name} failed: {message}", actor=actor)
        return _move(
            drain,
            DrainState.FAILED,
            f"{REMEDIATION_NAMES[drain.remediation]} failed on {node.name}: {message}",
            finished_at=timezone.now(),
            outcome=f"{REMEDIATION_NAMES[drain.remediation]} failed: {message}",
        )
    if drain.remediation == Remediation.SWITCH_MODEL:
        return _move(
            drain,
            DrainState.REMEDIATING,
            f"switch of model: {node.name} leaves {answer.get('from')} and loads {drain.switch_to} cold",
            details={"answer": answer},
        )
    return _move(
        drain,
        DrainState.REMEDIATING,
        f"{REMEDIATION_NAMES[drain.remediation]}: {node.name} reloads its model "
        f"(state {answer.get('model_state')}, {answer.get('aborted', 0)} requests aborted)",
        details={"answer": answer},
    )


def _model_state(node: Node) -> str | None:
    """Asked of the node itself: a heartbeat sent before the reload could still say "serving"."""
    try:
        status, answer = nodeclient.call(node.address, "GET", "/agent/status", timeout=2)
    except nodeclient.NodeUnreachable:
        return None
    return (answer.get("load") or {}).get("model_state") if status == 200 else None
