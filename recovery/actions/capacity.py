"""Capacity against the SLOs, and the degradation level that follows (source document 003).

`evaluate` runs every couple of seconds (Celery beat): it sums what the
nodes in service can carry within the latency objectives, from the catalog's
roofline and each node's live step time, compares it with the required
throughput, and moves the level with hysteresis. A change is written once
(DegradationChange, an outbox row), published to every gateway (which sheds
or rejects by it) and shown on every page; recovery.reactions then sends the
level's batch limit to the nodes and notes it on active incidents.

A fleet that is starting is not a capacity loss. For `startup_grace_s` after
the control plane starts, and until the fleet is back to its usual size, a
node that has not served since the start is joining: its capacity is counted
as if it served, so the level does not rise for it, and a level left over
from before the start falls without its hold. A node that served since the
start and then went away is a loss at once, as ever.
"""

import json
import logging
import time
from dataclasses import asdict, dataclass, field

from django.db import transaction
from django.utils import timezone

from recovery import events, hot, nodeclient
from recovery.actions import routing
from recovery.choices import Health, HealthChange, NodeState
from recovery.models import Cluster, DegradationChange, HealthTransition, Node, NodeTransition
from recovery.policy import capacity as policy
from workers import catalog

log = logging.getLogger(__name__)

# The batch limit a node is assumed to run with: vLLM's default max_num_seqs, and the emulated node's. Heartbeats
# do not carry a node's own yet; a node started with another limit is measured through its step times instead.
MAX_NUM_SEQS = 128


def slo_of(cluster: Cluster) -> policy.Slo:
    return policy.Slo(
        cluster.slo_ttft_ms,
        cluster.slo_tpot_ms,
        cluster.slo_required_rps,
        cluster.slo_avg_prompt_tokens,
        cluster.slo_avg_output_tokens,
    )


@dataclass
class Report:
    capacity_rps: float
    required_rps: float
    nodes: dict  # name -> {rps, batch, limited_by, slowdown}
    in_service: int
    starting: list[str] = field(default_factory=list)  # joining after a start of the control plane: not a loss
    starting_rps: float = 0.0  # what they will carry once they serve, by the catalog
    starting_until: float | None = None  # the end of the start-up grace (epoch seconds)

    @property
    def ratio(self) -> float:
        return self.capacity_rps / self.required_rps if self.required_rps > 0 else float("inf")

    @property
    def ratio_once_started(self) -> float:
        """The ratio the level follows while the fleet is starting: the joining nodes counted as serving."""
        return (self.capacity_rps + self.starting_rps) / self.required_rps if self.required_rps > 0 else float("inf")

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "ratio": None if self.required_rps <= 0 else round(self.ratio, 4),
            "ratio_once_started": None
            if self.required_rps <= 0 or not self.starting
            else round(self.ratio_once_started, 4),
        }


def _in_service(node: Node, live: hot.NodeEntry, promoted: tuple[str, ...] = ()) -> bool:
    weight = 1.0 if node.name in promoted else node.weight
    return weight > 0 and (live.model_state or "serving") == "serving"


def report(cluster: Cluster | None = None, exclude: tuple[str, ...] = (), promoted: tuple[str, ...] = ()) -> Report:
    """What the nodes in service (weight above 0, model loaded) can carry within the SLOs; `exclude`
    leaves nodes out and `promoted` counts hot spares in, to ask what would remain after a change."""
    cluster = cluster or Cluster.default()
    slo = slo_of(cluster)
    nodes = [n for n in Node.objects.filter(state=NodeState.SERVING) if n.name not in exclude]
    promoted = tuple(promoted) + _spares_on_their_way(nodes)
    live = hot.nodes([n.name for n in nodes])
    figures, total = {}, 0.0
    for node in nodes:
        data = live.get(node.name) or hot.NodeEntry()
        if not _in_service(node, data, promoted):
            continue
        deployment = catalog.Deployment.of(node.model_key, node.gpu_key, node.tp)
        # Measured on the last decode-only step: a step carrying a prefill chunk is long by design.
        slow = policy.slowdown(
            deployment, data.decode_step_ms or 0.0, data.decode_step_batch or 0, data.decode_step_context_tokens or 0
        )
        figure = policy.node_capacity(deployment, slo, MAX_NUM_SEQS, slow)
        figures[node.name] = {
            "rps": round(figure.rps, 3),
            "batch": figure.batch,
            "limited_by": figure.limited_by,
            "slowdown": round(slow, 3),
        }
        total += figure.rps
    starting, until = _starting(cluster, set(figures))
    starting_rps = sum(
        policy.node_capacity(catalog.Deployment.of(n.model_key, n.gpu_key, n.tp), slo, MAX_NUM_SEQS, 1.0).rps
        for n in starting
    )
    return Report(
        round(total, 3),
        slo.required_rps,
        figures,
        len(figures),
        [n.name for n in starting],
        round(starting_rps, 3),
        until,
    )


def _starting(cluster: Cluster, in_service: set[str]) -> tuple[list[Node], float | None]:
    """The nodes joining since the control plane started (not a loss), and when the start-up grace ends.

    None once the grace has passed or the fleet is back to its usual size (every node that has not left, the
    hot spares aside, in service). A node that served since the start and is gone is not joining: it is lost.
    """
    until = cluster.starting_until()
    if until is None:
        return [], None
    started = cluster.control_plane_started_at
    fleet = list(Node.objects.exclude(state=NodeState.LEFT).filter(spare=False))
    if all(n.name in in_service for n in fleet):
        return [], None
    served = set(
        NodeTransition.objects.filter(new_state=NodeState.SERVING, at__gte=started).values_list("node__name", flat=True)
    )
    return [n for n in fleet if n.name not in in_service and n.name not in served], until


def _spares_on_their_way(nodes: list[Node]) -> tuple[str, ...]:
    """The hot spares a pending reaction is about to promote: a node of their model just went DOWN or
    UNHEALTHY, and recovery.reactions puts a spare in its place within a second. Counted now, so the level
    does not jump for the moment between the two."""
    pending = [
        row.node
        for row in NodeTransition.objects.filter(
            reacted_at__isnull=True, new_state=NodeState.DOWN, node__spare=False
        ).select_related("node")
    ]
    pending += [
        row.node
        for row in HealthTransition.objects.filter(
            reacted_at__isnull=True, kind=HealthChange.HEALTH, new=Health.UNHEALTHY
        ).select_related("node")
    ]
    spares = sorted((n for n in nodes if n.spare and n.health == Health.HEALTHY), key=lambda n: n.name)
    chosen: list[str] = []
    for gone in pending:
        spare = next((s for s in spares if s.model_key == gone.model_key and s.name not in chosen), None)
        if spare is not None:
            chosen.append(spare.name)
    return tuple(chosen)


def control_plane_started() -> int:
    """The control plane (re)started: nodes that have not served since are joining, not lost, for the start-up
    grace; and the level persisted from before is not trusted but evaluated afresh, without the hold that kept it.
    Returns the level."""
    Cluster.objects.filter(pk=Cluster.default().pk).update(
        control_plane_started_at=timezone.now(), degradation_better_since=None
    )
    level = evaluate(fresh=True)
    routing.publish_cluster_config()  # gateways learn the grace: a request no node takes yet waits for one
    return level


def evaluate(now: float | None = None, *, fresh: bool = False) -> int:
    """Recompute the capacity and move the degradation level; returns the level.

    While the fleet is starting (and on a `fresh` evaluation at a start), the joining nodes count as serving
    and a better level is taken at once: a start is not an emergency to be held for."""
    now = time.time() if now is None else now
    cluster = Cluster.default()
    figures = report(cluster)
    starting = bool(figures.starting)
    client = hot.client()
    previous = client.get(hot.keys().capacity)
    client.set(hot.keys().capacity, json.dumps({**figures.to_json(), "at": now, "level": cluster.degradation_level}))
    if _banner_moves(json.loads(previous) if previous else None, figures):
        # The banner shows the figures, not only the level: every page refreshes it when they move.
        transaction.on_commit(lambda: events.degradation_changed(cluster.degradation_level))
    if figures.required_rps <= 0:
        decision = policy.LevelDecision(0, None, cluster.degradation_level != 0)
    else:
        decision = policy.next_level(
            cluster.degradation_level,
            figures.ratio_once_started if starting else figures.ratio,
            now,
            cluster.degradation_better_since,
            cluster.degradation_margin,
            0.0 if starting or fresh else cluster.degradation_hold_s,
        )
    if not decision.changed:
        if decision.better_since != cluster.degradation_better_since:
            Cluster.objects.filter(pk=cluster.pk).update(degradation_better_since=decision.better_since)
        return cluster.degradation_level
    if figures.required_rps <= 0:
        cause = "no throughput objective is set"
    else:
        cause = (
            f"capacity {figures.capacity_rps:.1f} req/s from {figures.in_service} nodes in service is "
            f"{figures.ratio:.0%} of the required {figures.required_rps:.1f} req/s"
        )
        if starting:
            cause += (
                f"; starting: {len(figures.starting)} joining nodes counted as serving "
                f"({figures.ratio_once_started:.0%} with them)"
            )
        elif fresh:
            cause += "; evaluated afresh as the control plane started"
    set_level(cluster, decision.level, cause, figures)
    return decision.level


def _banner_moves(shown: dict | None, figures: Report) -> bool:
    """The banner's figures moved since the last evaluation: nodes in service, capacity or required by 1 % or more."""
    if shown is None:
        return True

    def moved(before, now) -> bool:
        return abs((now or 0) - (before or 0)) >= 0.01 * max(abs(before or 0), 1e-9)

    return (
        shown.get("in_service") != figures.in_service
        or moved(shown.get("capacity_rps"), figures.capacity_rps)
        or moved(shown.get("required_rps"), figures.required_rps)
    )


def set_level(cluster: Cluster, level: int, cause: str, figures: Report | None = None) -> bool:
    old = cluster.degradation_level
    with transaction.atomic():
        claimed = Cluster.objects.filter(pk=cluster.pk, degradation_level=old).update(
            degradation_level=level, degradation_changed_at=timezone.now(), degradation_better_since=None
        )
        if not claimed:
            return False
        DegradationChange.objects.create(
            cluster=cluster,
            old_level=old,
            new_level=level,
            cause=cause,
            ratio=None if figures is None or figures.required_rps <= 0 else round(figures.ratio, 4),
            capacity_rps=figures.capacity_rps if figures else None,
            required_rps=figures.required_rps if figures else None,
            details=figures.to_json() if figures else {},
        )
        cluster.degradation_level = level
        transaction.on_commit(lambda: _published(level))
    log.warning("degradation level %d -> %d: %s", old, level, cause)
    return True


def _published(level: int) -> None:
    routing.publish_cluster_config()
    events.degradation_changed(level)


def apply_batch_factor(node: Node) -> str:
    """Send the level's batch factor to a node (at a level change, and when a node joins)."""
    factor = policy.EFFECTS[Cluster.default().degradation_level].batch_factor
    try:
        status, answer = nodeclient.call(node.address, "POST", "/agent/config", {"batch_factor": factor}, timeout=2)
    except nodeclient.NodeUnreachable as exc:
        return f"unreachable: {exc}"
    if status != 200:
        log.warning("%s refused batch factor %s: %s", node.name, factor, answer)
    return f"{status} batch_limit={answer.get('batch_limit')}"


def latest() -> dict:
    """The last evaluation, for pages: capacity, required, ratio, per node."""
    raw = hot.client().get(hot.keys().capacity)
    return json.loads(raw) if raw else {}
