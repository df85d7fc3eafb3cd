"""Node health: canary results, circuit breakers, Xid events, cordons, hot spares (source document 003).

Every change of a node's health, breaker, cordon or spare status goes through
`_change`, which claims it with a conditional update, writes a
HealthTransition row (the node's health timeline, its audit log and an
outbox row) and, after the transaction commits, republishes the routing table
(weights reach every gateway through Redis pub/sub) and tells the browser.
What follows a change (a spare promoted for a node gone UNHEALTHY, a drain
proposed, an incident event) is recovery.reactions' to do, once it committed.
"""

import datetime as dt
import logging
import random
import time

from django.db import transaction
from django.utils import timezone

from recovery import canary, events, hot
from recovery.actions import audit, notify, routing
from recovery.choices import (
    OPEN_DRAIN_STATES,
    BreakerState,
    CanaryKind,
    Health,
    HealthChange,
    NodeState,
    Remediation,
)
from recovery.models import (
    CanaryGolden,
    CanaryResult,
    Cluster,
    ClusterState,
    Drain,
    HealthTransition,
    Node,
    RequestOutcome,
    XidEvent,
)
from recovery.policy import breaker as breakers
from recovery.policy import health as policy
from recovery.policy import lifecycle
from workers import catalog
from workers import tokens as vocabulary

log = logging.getLogger(__name__)


def _change(
    node: Node, kind: str, field: str, new, cause: str, *, actor: str = "system", details: dict | None = None, **also
) -> bool:
    """Set `field` to `new` if nobody changed it first; one transition row; publish after commit."""
    old = getattr(node, field)
    if old == new:
        return False
    with transaction.atomic():
        claimed = Node.objects.filter(pk=node.pk, **{field: old}).update(**{field: new}, **also)
        if not claimed:
            return False
        HealthTransition.objects.create(
            node=node, kind=kind, old=str(old), new=str(new), cause=cause, actor=actor, details=details or {}
        )
        setattr(node, field, new)
        for name, value in also.items():
            setattr(node, name, value)
        transaction.on_commit(lambda: _published(node.pk))
    log.info("node %s %s: %s -> %s (%s)", node.name, kind, old, new, cause)
    return True


def _published(node_id: int) -> None:
    routing.publish_routing()
    events.node_changed(node_id)
    events.service_changed()  # the banner names the nodes left out of service with no drain


def set_health(node: Node, new: str, cause: str, *, actor: str = "system", details: dict | None = None, **also) -> bool:
    return _change(
        node,
        HealthChange.HEALTH,
        "health",
        new,
        cause,
        actor=actor,
        details=details,
        health_changed_at=timezone.now(),
        **also,
    )


def set_breaker(node: Node, state: breakers.Breaker, cause: str, *, actor: str = "system") -> bool:
    """Save a node's breaker; a change of its state is a transition, a count alone is not."""
    fields = {
        "breaker_failures": state.failures,
        "breaker_opened_at": state.opened_at,
        "breaker_trial_at": state.trial_at,
    }
    if state.state == node.breaker:
        Node.objects.filter(pk=node.pk).update(**fields)
        for name, value in fields.items():
            setattr(node, name, value)
        return False
    return _change(node, HealthChange.BREAKER, "breaker", state.state, cause, actor=actor, **fields)


def set_cordon(node: Node, cordoned: bool, actor: str, reason: str) -> bool:
    """Cordon (no new requests) or uncordon a node; False when it already was."""
    node.refresh_from_db(fields=["cordoned"])  # decide on the row as it is, not on what the caller read
    with transaction.atomic():
        if not _change(node, HealthChange.CORDON, "cordoned", cordoned, reason, actor=actor):
            return False
        audit.record(actor, "cordon" if cordoned else "uncordon", f"node:{node.name}", reason)
    return True


def note_model_state(node: Node, old: str | None, new: str) -> HealthTransition:
    """The node's model load moved (from its heartbeats): loading_draft → draft_ready → loading_full → serving."""
    return HealthTransition.objects.create(
        node=node, kind=HealthChange.MODEL, old=old or "", new=new, cause=f"heartbeat reports {new}"
    )


def breaker_of(node: Node) -> breakers.Breaker:
    return breakers.Breaker(node.breaker, node.breaker_failures, node.breaker_opened_at, node.breaker_trial_at)


# --- automatic cordons and the cluster breaker -----------------------------------------------------------
def _take_out(node: Node, cluster: Cluster, cause: str, details: dict, remediation: str) -> bool:
    """The health machine wants `node` UNHEALTHY (weight 0): an automatic cordon, unless the cluster
    breaker stops it. Returns whether the node went UNHEALTHY.

    Either way a drain is wanted: the transition's details say so, with the remediation
    the evidence calls for, and recovery.reactions proposes it (and promotes a spare)."""
    details = {**details, "drain": remediation}
    if cluster.state.auto_cordon_breaker_open:
        _keep_suspicious(
            node, f"{cause}; automatic cordons are stopped by the cluster breaker, so it keeps weight 0.5", details
        )
        return False
    window_start = timezone.now() - dt.timedelta(seconds=cluster.auto_cordon_window_s)
    # The share is of the fleet: a node cordoned again in the window (back, then sick again) is no more of it.
    recent = set(
        HealthTransition.objects.filter(
            kind=HealthChange.HEALTH, new=Health.UNHEALTHY, actor="system", at__gte=window_start
        ).values_list("node_id", flat=True)
    )
    fleet = Node.objects.filter(state=NodeState.SERVING).count()
    if node.pk not in recent and breakers.cluster_breaker_trips(len(recent), fleet, cluster.auto_cordon_max_share):
        allowed = breakers.auto_cordons_allowed(fleet, cluster.auto_cordon_max_share)
        why = (
            f"{len(recent)} node{'s' if len(recent) != 1 else ''} cordoned automatically in the last "
            f"{cluster.auto_cordon_window_s} s; "
            f"one more ({node.name}) would pass the "
            f"{allowed} allowed ({cluster.auto_cordon_max_share:.0%} of {fleet} nodes)"
        )
        open_cluster_breaker(cluster, why)
        _keep_suspicious(node, f"{cause}; not cordoned: the cluster breaker opened ({why})", details)
        return False
    set_health(node, Health.UNHEALTHY, cause, details=details)
    return True


def _keep_suspicious(node: Node, cause: str, details: dict) -> None:
    """SUSPICIOUS, not UNHEALTHY: a row either way, since its reaction (the drain for a person) is still due."""
    if not set_health(node, Health.SUSPICIOUS, cause, details=details):
        HealthTransition.objects.create(
            node=node, kind=HealthChange.HEALTH, old=node.health, new=node.health, cause=cause, details=details
        )


def open_cluster_breaker(cluster: Cluster, why: str) -> None:
    with transaction.atomic():
        opened = ClusterState.objects.filter(cluster=cluster, auto_cordon_breaker_open=False).update(
            auto_cordon_breaker_open=True, auto_cordon_breaker_changed_at=timezone.now(), auto_cordon_breaker_reason=why
        )
        if opened:
            cluster.state.auto_cordon_breaker_open = True
            audit.record("system", "cluster_breaker_open", f"cluster:{cluster.name}", why)
            notify.send(
                "cluster_breaker",
                "Automatic cordons stopped",
                f"The cluster breaker opened: {why}. An admin resets it on the settings page.",
                "/settings/",
            )


def reset_cluster_breaker(cluster: Cluster, user, reason: str) -> None:
    if not reason.strip():
        raise ValueError("reason: resetting the cluster breaker needs a reason")
    with transaction.atomic():
        ClusterState.objects.filter(cluster=cluster).update(
            auto_cordon_breaker_open=False,
            auto_cordon_breaker_changed_at=timezone.now(),
            auto_cordon_breaker_reason=reason.strip(),
        )
        audit.record(user.get_username(), "cluster_breaker_reset", f"cluster:{cluster.name}", reason.strip())


# --- canaries ---------------------------------------------------------------------------------------
def golden_for(node: Node) -> CanaryGolden | None:
    return CanaryGolden.objects.filter(model_key=node.model_key, gpu_key=node.gpu_key, tp=node.tp, active=True).first()


def _run_prompts(node: Node, timeout: float) -> list[dict]:
    prompts = []
    for prompt in canary.PROMPTS:
        reply = canary.ask(node.address, node.model_key, prompt, timeout)
        prompts.append(
            {
                **prompt,
                "tokens": [
                    {"id": i, "top_logprob": lp} for i, lp in zip(reply.answer.token_ids, reply.answer.top_logprobs)
                ],
                "texts": list(reply.texts),
            }
        )
    return prompts


def record_golden(nodes: list[Node], by: str, reason: str = "", *, unless_recorded: bool = False) -> CanaryGolden:
    """Record the golden run of the nodes' deployment: each canary prompt on each node, which must agree.

    An admin records from one node they know to be good; the control plane
    records by itself from two nodes that agree, `unless_recorded` meanwhile
    (two canary tasks find none at once: one records, the other takes it).
    Raises ValueError when they disagree or a node gives no answer.
    """
    first = nodes[0]
    if any((n.model_key, n.gpu_key, n.tp) != (first.model_key, first.gpu_key, first.tp) for n in nodes):
        raise ValueError("the nodes serve different deployments")
    timeout = Cluster.default().canary_timeout_s
    runs = []
    for node in nodes:
        try:
            runs.append(_run_prompts(node, timeout))
        except canary.CanaryFailed as exc:
            raise ValueError(f"{node.name} gave no canary answer: {exc.detail}") from None
    for other, node in zip(runs[1:], nodes[1:]):
        for a, b in zip(runs[0], other):
            if [t["id"] for t in a["tokens"]] != [t["id"] for t in b["tokens"]] or any(
                abs((x["top_logprob"] or 0) - (y["top_logprob"] or 0)) > 1e-3 for x, y in zip(a["tokens"], b["tokens"])
            ):
                raise ValueError(f"{first.name} and {node.name} disagree on {a['key']!r}: no golden run recorded")
    with transaction.atomic():
        Cluster.objects.select_for_update().filter(pk=Cluster.default().pk).first()  # one recorder at a time
        if unless_recorded and (existing := golden_for(first)) is not None:
            return existing
        CanaryGolden.objects.filter(model_key=first.model_key, gpu_key=first.gpu_key, tp=first.tp, active=True).update(
            active=False
        )
        golden = CanaryGolden.objects.create(
            model_key=first.model_key,
            gpu_key=first.gpu_key,
            tp=first.tp,
            prompts=runs[0],
            recorded_from=", ".join(n.name for n in nodes),
            recorded_by=by,
        )
        audit.record(
            by,
            "record_golden",
            f"deployment:{golden.deployment}",
            reason,
            golden=golden.pk,
            nodes=[n.name for n in nodes],
        )
    log.info("golden canary run for %s recorded from %s by %s", golden.deployment, golden.recorded_from, by)
    return golden


def _auto_golden(node: Node) -> CanaryGolden | None:
    """No golden run for this deployment yet: record one from two healthy nodes that agree, if there are two."""
    peers = list(
        Node.objects.filter(
            state=NodeState.SERVING, health=Health.HEALTHY, model_key=node.model_key, gpu_key=node.gpu_key, tp=node.tp
        ).order_by("name")[:2]
    )
    if len(peers) < 2:
        return None
    try:
        return record_golden(peers, "system (two nodes agreed)", unless_recorded=True)
    except ValueError as exc:
        log.warning("no golden canary run for %s on %s: %s", node.model_key, node.gpu_key, exc)
        return None
    except Exception:  # noqa: BLE001 - two nodes racing to record: the other one won
        return golden_for(node)


def canary_gpu_ms(node: Node, prompt: dict, tokens: int) -> float | None:
    """GPU time one canary costs, as document 003 accounts it: the prefill pass and one decode step per further
    token."""
    try:
        deployment = catalog.Deployment.of(node.model_key, node.gpu_key, node.tp)
    except catalog.CatalogError:
        return None
    prompt_tokens = len(vocabulary.encode(prompt["prompt"]))
    seconds = deployment.prefill_s(prompt_tokens) + sum(
        deployment.decode_step_s(1, prompt_tokens + i) for i in range(1, max(tokens, 1))
    )
    return round(seconds * 1000, 3)


def run_canary(node: Node, *, trial: bool = False) -> CanaryResult:
    """One canary on `node`, judged against its deployment's golden run, then recorded."""
    cluster = Cluster.default()
    golden = golden_for(node) or _auto_golden(node)
    prompt = pick_prompt(node, golden.prompts if golden else canary.PROMPTS)
    answer, failure = None, None
    try:
        reply = canary.ask(node.address, node.model_key, prompt, cluster.canary_timeout_s)
        answer = reply.answer
    except canary.CanaryFailed as exc:
        failure = f"{exc.kind}: {exc.detail}"
    expected = [policy.GoldenToken(t["id"], t["top_logprob"]) for t in prompt["tokens"]] if golden else None
    fleet = fleet_slowdown(node)
    verdict = policy.judge_canary(
        expected,
        answer,
        prompt_baseline(node, prompt) if latency_judged(node, cluster) else None,
        logprob_tolerance=cluster.canary_logprob_tolerance,
        latency_factor=cluster.canary_latency_factor,
        failure=failure,
        fleet_factor=fleet,
    )
    return record_canary(
        node,
        verdict,
        answer.latency_ms if answer else None,
        golden=golden,
        prompt=prompt,
        trial=trial,
        cluster=cluster,
        fleet_factor=fleet,
    )


def pick_prompt(node: Node, prompts: list[dict]) -> dict:
    """The canary's prompt: one this node has no baseline for yet (so that each is learnt in its first canaries),
    else any, at random (a node cannot learn which prompt comes next)."""
    unlearnt = [p for p in prompts if p.get("key") not in (node.canary_baselines or {})]
    return unlearnt[0] if unlearnt else random.choice(prompts)


def fleet_slowdown(node: Node) -> float:
    """How much slower than their baselines the other serving nodes' canaries answered lately
    (policy.fleet_slowdown)."""
    ratios = hot.canary_latencies(time.time() - policy.PEERS_WITHIN_S)
    peers = Node.objects.filter(state=NodeState.SERVING, name__in=list(ratios)).exclude(pk=node.pk)
    return policy.fleet_slowdown([ratios[name] for name in peers.values_list("name", flat=True)])


def prompt_baseline(node: Node, prompt: dict | None) -> float | None:
    """The baseline a canary with `prompt` is judged against: that prompt's own moving average on this node (a
    one-token answer and an eight-token one take different times), None until the node has answered it well."""
    return (node.canary_baselines or {}).get((prompt or {}).get("key", "")) or None


def latency_judged(node: Node, cluster: Cluster) -> bool:
    """Whether a canary's latency is judged at all: not during the control plane's start-up grace (a host starting
    its whole fleet is slow for every node), and not before the node's baseline is learnt from BASELINE_SAMPLES
    passing answers (its first canaries, on a cold engine, teach the baseline; so does each prompt's first)."""
    if not node.canary_baseline_ms or cluster.starting_until() is not None:
        return False
    learnt = CanaryResult.objects.filter(node=node, passed=True, latency_ms__isnull=False)[: policy.BASELINE_SAMPLES]
    return learnt.count() >= policy.BASELINE_SAMPLES


@transaction.atomic
def record_canary(
    node: Node,
    verdict: policy.Verdict,
    latency_ms: float | None,
    *,
    golden: CanaryGolden | None = None,
    prompt: dict | None = None,
    trial: bool = False,
    cluster: Cluster | None = None,
    fleet_factor: float = 1.0,
) -> CanaryResult:
    """Store a canary result and move the node's health and breaker by it, all or nothing. A passing answer teaches
    the baselines at the fleet's usual pace: its latency over `fleet_factor`, the fleet's slowness it was judged
    with, so that a host's busy minute does not become what its nodes are expected to take."""
    cluster = cluster or Cluster.default()
    node.refresh_from_db()
    tokens = len(prompt.get("tokens") or []) if prompt else 0
    result = CanaryResult.objects.create(
        node=node,
        golden=golden,
        prompt_key=(prompt or {}).get("key", ""),
        passed=verdict.passed,
        kind=verdict.kind,
        detail=verdict.detail,
        latency_ms=latency_ms,
        baseline_ms=prompt_baseline(node, prompt) or node.canary_baseline_ms,
        trial=trial,
        gpu_ms=canary_gpu_ms(node, prompt, tokens or prompt.get("max_tokens", 1)) if prompt else None,
    )
    # A drain proposed or under way holds its node: a canary pass never puts it back into service.
    held = node.health == Health.UNHEALTHY and Drain.objects.filter(node=node, state__in=OPEN_DRAIN_STATES).exists()
    step = policy.after_canary(
        node.health,
        node.canary_failures,
        verdict.passed,
        cluster.suspicious_after,
        cluster.unhealthy_after,
        breaker=node.breaker,
        held=held,
    )
    baselines = dict(node.canary_baselines or {})
    baseline, judged_by = node.canary_baseline_ms, result.baseline_ms
    if verdict.passed and latency_ms and step.state == Health.HEALTHY:
        usual = latency_ms / max(1.0, fleet_factor)
        baseline = policy.next_baseline(node.canary_baseline_ms, usual)
        if prompt and prompt.get("key"):
            baselines[prompt["key"]] = round(policy.next_baseline(baselines.get(prompt["key"]), usual), 3)
    if latency_ms and judged_by:
        # What this node's canaries take now against its own baseline: the others' canaries are judged by it.
        transaction.on_commit(
            lambda ratio=latency_ms / judged_by, name=node.name: hot.canary_latency(name, ratio, time.time())
        )
    Node.objects.filter(pk=node.pk).update(
        canary_failures=step.failures, canary_baseline_ms=baseline, canary_baselines=baselines
    )
    node.canary_failures, node.canary_baseline_ms, node.canary_baselines = step.failures, baseline, baselines
    evidence = {"canary": result.pk, "kind": verdict.kind, "detail": verdict.detail, "failures": step.failures}
    # The breaker counts the node's failures; a pass closes it only as the half-open trial, or resets its count.
    now = time.time()
    current = breaker_of(node)
    after = current.on_success() if verdict.passed else current.on_failure(now, cluster.breaker_threshold)
    cause = f"canary {verdict.kind}: {verdict.detail}"
    if step.half_open:
        # An UNHEALTHY node answers well again: it returns only through the breaker's half-open trial.
        after = after.to_half_open()
        breaker_cause = f"{cause}: {node.name} is UNHEALTHY, so the pass alone does not return it; one trial canary"
    elif not verdict.passed:
        breaker_cause = f"{cause} ({after.failures} consecutive failures)"
    elif current.state == BreakerState.HALF_OPEN:
        breaker_cause = f"{cause}: trial passed"
        if held:
            breaker_cause += f"; {node.name} stays UNHEALTHY, its drain holds it"
    else:
        breaker_cause = cause
    set_breaker(node, after, breaker_cause)
    if step.state == Health.UNHEALTHY and node.health != Health.UNHEALTHY:
        why = f"{step.failures} canary failures in a row; last: {verdict.kind} ({verdict.detail})"
        # Wrong answers point at the GPU (silent corruption): reset it. A slow or silent node: restart the engine.
        wrong = verdict.kind in (CanaryKind.TOKEN_MISMATCH, CanaryKind.LOGPROB)
        if wrong:
            # Found corrupt: its requests in flight leave at once and those it served are named (a reaction).
            evidence["corrupt"] = True
        # UNHEALTHY, or only SUSPICIOUS when the cluster breaker stops automatic cordons; a drain is proposed either
        # way.
        _take_out(node, cluster, why, evidence, Remediation.RESET if wrong else Remediation.RESTART)
    elif step.state != node.health:
        if node.health == Health.UNHEALTHY:
            cause = f"{cause}: half-open trial passed, the breaker closed"
        set_health(node, step.state, cause, details=evidence)
    transaction.on_commit(lambda: events.node_canary(node.pk, result.pk))
    return result


def served_since_last_good_canary(node: Node, until: dt.datetime) -> dict:
    """The requests `node` served since its last passing canary, up to `until` (when it was found corrupt): each
    may have received corrupt tokens. Finished ones from the gateways' outcomes, the rest from what they hold in
    flight now."""
    last_good = CanaryResult.objects.filter(node=node, passed=True, at__lte=until).order_by("-at").first()
    since = last_good.at if last_good else node.session_started_at
    first_failure = (
        CanaryResult.objects.filter(node=node, passed=False, at__gt=since, at__lte=until).order_by("at").first()
    )
    finished = [
        request_id
        for request_id, served_by, moved_through in RequestOutcome.objects.filter(
            finished_at__gte=since, started_at__lte=until
        )
        .order_by("started_at")
        .values_list("request_id", "node", "nodes")
        if served_by == node.name or node.name in (moved_through or [])
    ]
    in_flight = sorted(f["request_id"] for f in hot.gateway_flights() if f.get("node") == node.name)
    return {
        "node": node.name,
        "since": since.isoformat(),
        "last_good_canary": last_good.pk if last_good else None,
        "first_failure_at": first_failure.at.isoformat() if first_failure else None,
        "until": until.isoformat(),
        "finished": finished,
        "in_flight": [r for r in in_flight if r not in finished],
    }


def out_of_service_why(node: Node) -> list[str]:
    """Why a serving node takes no traffic (routing weight 0), in words; empty while it takes some. A hot spare
    waiting for its turn is not out of service."""
    if node.state != NodeState.SERVING or node.spare:
        return []
    why = []
    if node.health in (Health.UNHEALTHY, Health.DRAINING):
        why.append(node.get_health_display().upper())
    if node.breaker != BreakerState.CLOSED:
        why.append(f"breaker {node.get_breaker_display().lower()}")
    if node.cordoned:
        why.append("cordoned")
    return why


def record_node_failure(node: Node, cause: str, request_key: str | None = None) -> str:
    """A failure of the node reported from outside the canaries (a gateway's 5xx or a stall).

    With the failed request's fingerprint, the breaker counts it only when it is
    the node's fault (`breaker.blame`): not when the same request failed on
    another node too, and once for a request that fails here again. Returns
    the verdict.
    """
    if request_key:
        r, k = hot.client(), hot.keys()
        pipe = r.pipeline()
        pipe.sadd(k.request_failures(request_key), node.name)
        pipe.expire(k.request_failures(request_key), breakers.BLAME_WINDOW_S)
        pipe.smembers(k.request_failures(request_key))
        pipe.sismember(k.node_failures(node.name), request_key)
        _, _, failed_on, counted_here = pipe.execute()
        verdict = breakers.blame(node.name, failed_on, bool(counted_here))
        if verdict != breakers.NODE:
            log.info(
                "not counted against %s's breaker (%s): %s",
                node.name,
                "the same request failed on " + ", ".join(sorted(failed_on - {node.name}))
                if verdict == breakers.REQUEST
                else "that request already counted here",
                cause,
            )
            return verdict
        pipe = r.pipeline()
        pipe.sadd(k.node_failures(node.name), request_key)
        pipe.expire(k.node_failures(node.name), breakers.BLAME_WINDOW_S)
        pipe.execute()
    cluster = Cluster.default()
    after = breaker_of(node).on_failure(time.time(), cluster.breaker_threshold)
    set_breaker(node, after, f"{cause} ({after.failures} consecutive failures)")
    return breakers.NODE


def schedule_canaries(now: float | None = None) -> list[tuple[int, bool]]:
    """The nodes due for a canary now, each claimed so that no other scheduler takes it: (node id, trial)."""
    now = time.time() if now is None else now
    cluster = Cluster.default()
    started = cluster.state.control_plane_started_at
    due = []
    for node in Node.objects.filter(state=NodeState.SERVING).exclude(health=Health.DRAINING):
        if started is not None and node.session_started_at and node.session_started_at < started:
            # A session of the stack's previous run not heard since the control plane started: its process is
            # gone or about to register again (new session, new address). The heartbeat sweep judges it by when
            # the control plane started; a canary to its old address would count a restart as failures.
            if lifecycle.of_a_previous_run(node.session_started_at, hot.last_seen(node.name), started):
                continue
        trial = False
        if node.breaker != BreakerState.CLOSED:
            allowed, after = breaker_of(node).allow(now, cluster.breaker_open_s)
            if not allowed:
                continue
            set_breaker(node, after, f"open for {cluster.breaker_open_s:g} s: one trial canary")
            trial = True
        else:
            interval = cluster.canary_retry_s if node.canary_failures else cluster.canary_interval_s
            last = node.canary_last_at.timestamp() if node.canary_last_at else None
            if last is not None and now - last < interval:
                continue
        stamp = dt.datetime.fromtimestamp(now, tz=dt.UTC)
        if Node.objects.filter(pk=node.pk, canary_last_at=node.canary_last_at).update(canary_last_at=stamp):
            due.append((node.pk, trial))
    return due


# --- Xid events from heartbeats ------------------------------------------------------------------------
def ingest_xids(name: str, xids: list[dict]) -> list[XidEvent]:
    """New Xid events a heartbeat carried: bursts per GPU become one event each; a CRITICAL one
    makes the node UNHEALTHY at once and proposes a drain; WARN ones are shown, not acted on."""
    seen = (hot.node(name) or hot.NodeEntry()).xid_seen
    fresh = [x for x in xids if x["at"] > seen]
    if not fresh:
        return []
    node = Node.objects.filter(name=name).first()
    if node is None:
        return []
    seen = max(seen, node.xid_seen_until)
    fresh = [(x["at"], x["gpu"], x["code"]) for x in fresh if x["at"] > seen]
    if not fresh:
        return []
    cluster = Cluster.default()
    window = cluster.xid_burst_window_s
    touched = []
    with transaction.atomic():
        for burst in policy.group_xids(fresh, window):
            first_at = dt.datetime.fromtimestamp(burst.first_at, tz=dt.UTC)
            row = (
                XidEvent.objects.select_for_update()
                .filter(node=node, gpu_index=burst.gpu, last_at__gte=first_at - dt.timedelta(seconds=window))
                .order_by("-last_at")
                .first()
            )
            codes = {str(c): n for c, n in burst.codes.items()}
            if row is not None:
                for code, count in row.codes.items():
                    codes[code] = codes.get(code, 0) + count
                merged = policy.XidBurst(
                    burst.gpu, row.first_at.timestamp(), burst.last_at, {int(c): n for c, n in codes.items()}
                )
            else:
                merged = burst
            info = policy.xid_info(merged.worst)
            fields = dict(
                last_at=dt.datetime.fromtimestamp(merged.last_at, tz=dt.UTC),
                codes=codes,
                code=merged.worst,
                severity=merged.severity,
                meaning=info.meaning,
                action=info.action,
            )
            if row is None:
                row = XidEvent.objects.create(node=node, gpu_index=burst.gpu, first_at=first_at, **fields)
            else:
                for key, value in fields.items():
                    setattr(row, key, value)
                row.save(update_fields=list(fields))
            touched.append(row)
        newest = max(at for at, _, _ in fresh)
        Node.objects.filter(pk=node.pk, xid_seen_until__lt=newest).update(xid_seen_until=newest)
        hot.client().hset(hot.keys().node(name), "xid_seen", newest)
        for row in touched:
            if row.severity == policy.CRITICAL and not row.acted and node.state == NodeState.SERVING:
                XidEvent.objects.filter(pk=row.pk).update(acted=True)
                row.acted = True
                cause = f"CRITICAL Xid {row.code} on GPU {row.gpu_index} ({row.meaning}): {row.action}"
                if node.health not in (Health.UNHEALTHY, Health.DRAINING):
                    _take_out(node, cluster, cause, {"xid_event": row.pk, "codes": row.codes}, Remediation.RESET)
        transaction.on_commit(lambda: events.node_changed(node.pk))
    return touched


# --- hot spares ----------------------------------------------------------------------------------------------
def set_spare(node: Node, spare: bool, actor: str, reason: str, details: dict | None = None) -> bool:
    """Keep `node` as a hot spare (no traffic, canaries only) or put it in service; a person's change is audited."""
    with transaction.atomic():
        if not _change(node, HealthChange.SPARE, "spare", spare, reason, actor=actor, details=details):
            return False
        if actor != "system":
            audit.record(actor, "spare_on" if spare else "spare_off", f"node:{node.name}", reason)
    return True


def spare_for(node: Node) -> Node | None:
    """The hot spare that would stand in for `node`: healthy, serving the same model, the same rack first."""
    spares = Node.objects.filter(
        spare=True, state=NodeState.SERVING, model_key=node.model_key, health=Health.HEALTHY
    ).exclude(pk=node.pk)
    return min(spares, key=lambda s: (s.rack_id != node.rack_id, s.name), default=None)


def _serves_again(node: Node) -> bool:
    """In routing as before its failure: serving, healthy, not cordoned, not a spare, no drain open on it."""
    return (
        node.state == NodeState.SERVING
        and node.health == Health.HEALTHY
        and not node.cordoned
        and not node.spare
        and not node.drains.filter(state__in=OPEN_DRAIN_STATES).exists()
    )


def standing_in() -> dict[Node, str]:
    """The hot spares the system put in service in another node's place, and still there: {spare: that node's
    name}, by each one's last spare change (a person's change is theirs: never undone here)."""
    rows = HealthTransition.objects.filter(
        kind=HealthChange.SPARE, node__spare=False, details__has_key="in_place_of"
    ).select_related("node")
    out = {}
    for row in rows:  # newest first
        if row.node in out:
            continue
        last = HealthTransition.objects.filter(node=row.node, kind=HealthChange.SPARE).first()
        if last is not None and last.pk == row.pk and row.actor == "system" and row.new == "False":
            out[row.node] = row.details["in_place_of"]
    return out


def return_spares() -> list[str]:
    """The fleet back to its configured shape: a promoted hot spare goes back to the pool once the node it stood in
    for serves again (a kill, then a restart, left the demo with one spare fewer for good). Where another node of its
    model is still out with no spare in its place, the spare stands in for that one instead. Returns the spares
    returned to the pool."""
    returned = []
    spares = standing_in()
    covered = set(spares.values())
    for spare, name in sorted(spares.items(), key=lambda item: item[0].name):
        node = Node.objects.filter(name=name).first()
        if node is not None and not _serves_again(node):
            continue
        why = f"{name} serves again" if node is not None else f"{name} is no longer in the fleet"
        uncovered = (
            Node.objects.filter(model_key=spare.model_key, spare=False)
            .exclude(state__in=(NodeState.LEFT,))
            .exclude(pk=spare.pk)
            .exclude(name__in=covered)
            .order_by("name")
        )
        out = next(
            (
                n
                for n in uncovered
                if not n.cordoned and (n.state != NodeState.SERVING or n.health in (Health.UNHEALTHY, Health.DRAINING))
            ),
            None,
        )
        if out is not None:
            HealthTransition.objects.create(
                node=spare,
                kind=HealthChange.SPARE,
                old="False",
                new="False",
                cause=f"stands in for {out.name} now: {why}",
                actor="system",
                details={"in_place_of": out.name, "was_in_place_of": name},
            )
            covered.add(out.name)
            log.info("hot spare %s stands in for %s now (%s)", spare.name, out.name, why)
            continue
        if set_spare(spare, True, "system", f"back to the pool: {why}", details={"returned_for": name}):
            returned.append(spare.name)
    return returned


def promote_spare_for(node: Node, cause: str) -> Node | None:
    """A node of this model left service: put a hot spare of the same model in its place at once."""
    spare = spare_for(node)
    if spare is None or not set_spare(
        spare, False, "system", f"promoted in place of {node.name}: {cause}", details={"in_place_of": node.name}
    ):
        return None
    return spare
