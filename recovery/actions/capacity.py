"""Capacity against the SLOs, and the degradation level that follows (source document 003).

`evaluate` runs every couple of seconds (Celery beat), for each served model
on its own (ModelCapacity): it sums what the model's nodes in service can
carry within its latency objectives, from the catalog's roofline and each
node's live step time, compares it with the model's required throughput, and
moves the model's level with hysteresis. A change is written once
(DegradationChange, an outbox row), published to every gateway (which sheds
or rejects that model's requests by it) and shown on every page;
recovery.reactions then sends the level's batch limit to that model's nodes
and notes it on active incidents. One model's loss never sheds another's
traffic; the cluster's level is the worst of the models', for the banner.

A fleet that is starting is not a capacity loss. For `startup_grace_s` after
the control plane starts, and until the fleet is back to its usual size, a
node that has not served since the start is joining: its capacity is counted
as if it served, so the level does not rise for it, and a level left over
from before the start falls without its hold. A node that served since the
start and then went away is a loss at once, as ever.
"""

import dataclasses
import json
import logging
import time
from dataclasses import asdict, dataclass, field

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from recovery import events, hot, nodeclient
from recovery.actions import nodes, routing
from recovery.choices import Health, HealthChange, NodeState
from recovery.models import (
    Cluster,
    ClusterState,
    DegradationChange,
    HealthTransition,
    ModelCapacity,
    MoeDeployment,
    Node,
    NodeTransition,
)
from recovery.policy import capacity as policy
from workers import catalog

log = logging.getLogger(__name__)

# The batch limit a node is assumed to run with: vLLM's default max_num_seqs, and the emulated node's. Heartbeats
# do not carry a node's own yet; a node started with another limit is measured through its step times instead.
MAX_NUM_SEQS = 128


def slo_of(model_key: str, cluster: Cluster | None = None) -> policy.Slo:
    """The model's objective: its required throughput, and the latency its capacity is counted within."""
    return ModelCapacity.of(model_key, cluster).slo()


@dataclass
class Report:
    capacity_rps: float
    required_rps: float
    nodes: dict  # name -> {rps, batch, limited_by, slowdown}
    in_service: int
    starting: list[str] = field(default_factory=list)  # joining after a start of the control plane: not a loss
    starting_rps: float = 0.0  # what they will carry once they serve, by the catalog
    starting_until: float | None = None  # the end of the start-up grace (epoch seconds)
    model: str | None = None  # the model these figures are of; None: every model's nodes, each within its own
    # What the nodes carry within the objectives in force: at level 3 and above the latency objectives are relaxed
    # (×2), and so is what counts as capacity. The level itself follows `capacity_rps`, within the model's own
    # objectives, so that the relaxation never argues the level down (and back up: a flap).
    in_force_rps: float | None = None
    latency_factor: float = 1.0

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


def _stalled_attention_workers(now: float | None = None) -> set[str]:
    """The attention workers of every MoE deployment stalled past its grace (an expert with no live location:
    recovery.actions.moe): a step that selects that expert waits, so they carry nothing until an EW serves it."""
    now = time.time() if now is None else now
    stalled = MoeDeployment.objects.filter(details__has_key="stalled").values_list("details", "attention_workers")
    return {name for details, workers in stalled if details["stalled"].get("degrade_at", 0) <= now for name in workers}


def slowdown_of(deployment: catalog.Deployment, live: hot.NodeEntry) -> float:
    """How much slower than the model a node steps now (policy.slowdown), measured on its last decode-only step:
    a step carrying a prefill chunk is long by design. The level and the placement page both count it."""
    return policy.slowdown(
        deployment, live.decode_step_ms or 0.0, live.decode_step_batch or 0, live.decode_step_context_tokens or 0
    )


def served_models(cluster: Cluster | None = None) -> list[str]:
    """The models with an objective or a node that has not left: each has a level of its own."""
    cluster = cluster or Cluster.default()
    with_rows = ModelCapacity.objects.filter(cluster=cluster).values_list("model_key", flat=True)
    deployed = Node.objects.exclude(state=NodeState.LEFT).values_list("model_key", flat=True)
    return sorted(set(with_rows) | set(deployed))


def report(
    cluster: Cluster | None = None,
    exclude: tuple[str, ...] = (),
    promoted: tuple[str, ...] = (),
    model: str | None = None,
) -> Report:
    """What the nodes in service (weight above 0, model loaded) of `model` can carry within its objectives; `exclude`
    leaves nodes out and `promoted` counts hot spares in, to ask what would remain after a change.

    With no `model`, the whole fleet: each node counted within its own model's objectives, against the sum of the
    models' required throughputs (the same figures when the fleet serves one model)."""
    cluster = cluster or Cluster.default()
    rows = {row.model_key: row for row in ModelCapacity.objects.filter(cluster=cluster)}
    slos = {key: row.slo() for key, row in rows.items()}
    # What happened since the start is read before the nodes, and the nodes once: every transition the first
    # reading holds shows in the second, so a node that turns SERVING meanwhile is joining in both readings or in
    # service in both, never neither (a restart of the stack once counted one neither, and the level rose).
    start = _since_start(cluster)
    fleet = Node.objects.all() if start else Node.objects.exclude(state=NodeState.LEFT)  # left: back at a start
    fleet = list(fleet if model is None else fleet.filter(model_key=model))
    exclude = (*exclude, *_stalled_attention_workers())
    nodes = [n for n in fleet if n.state == NodeState.SERVING and n.name not in exclude]
    promoted = tuple(promoted) + _spares_on_their_way(nodes)
    live = hot.nodes([n.name for n in nodes])
    relaxed = {
        key: dataclasses.replace(slo, ttft_ms=slo.ttft_ms * factor, tpot_ms=slo.tpot_ms * factor)
        for key, slo in slos.items()
        if (factor := policy.EFFECTS[rows[key].degradation_level].latency_slo_factor) != 1.0
    }
    figures, total, in_force = {}, 0.0, 0.0
    for node in nodes:
        data = live.get(node.name) or hot.NodeEntry()
        if not _in_service(node, data, promoted):
            continue
        deployment = catalog.Deployment.of(node.model_key, node.gpu_key, node.tp)
        slow = slowdown_of(deployment, data)
        figure = policy.node_capacity(deployment, slos.get(node.model_key, policy.Slo()), MAX_NUM_SEQS, slow)
        figures[node.name] = {
            "rps": round(figure.rps, 3),
            "batch": figure.batch,
            "limited_by": figure.limited_by,
            "slowdown": round(slow, 3),
        }
        total += figure.rps
        if node.model_key in relaxed:
            in_force_figure = policy.node_capacity(deployment, relaxed[node.model_key], MAX_NUM_SEQS, slow)
            figures[node.name]["rps_in_force"] = round(in_force_figure.rps, 3)
            in_force += in_force_figure.rps
        else:
            in_force += figure.rps
    starting, until = _starting(start, fleet, set(figures))
    starting_rps = sum(
        policy.node_capacity(
            catalog.Deployment.of(n.model_key, n.gpu_key, n.tp), slos.get(n.model_key, policy.Slo()), MAX_NUM_SEQS
        ).rps
        for n in starting
    )
    required = (
        (slos[model].required_rps if model in slos else 0.0)
        if model is not None
        else sum(slo.required_rps for slo in slos.values())
    )
    return Report(
        round(total, 3),
        required,
        figures,
        len(figures),
        [n.name for n in starting],
        round(starting_rps, 3),
        until,
        model,
        round(in_force, 3),
        max(
            (policy.EFFECTS[rows[k].degradation_level].latency_slo_factor for k in rows if model in (None, k)),
            default=1.0,
        ),
    )


@dataclass(frozen=True)
class _Start:
    """What the start-up grace judges joining nodes by, read before the nodes themselves."""

    until: float  # the end of the grace (epoch seconds)
    served: frozenset[str]  # nodes that turned SERVING since the start
    lost: frozenset[str]  # nodes found gone since the start other than by the start-up sweep
    returning: frozenset[int]  # nodes (pk) that left as the stack stopped, expected back


def _since_start(cluster: Cluster) -> _Start | None:
    """The transitions since the control plane started, or None once the start-up grace has passed."""
    until = cluster.starting_until()
    if until is None:
        return None
    since = NodeTransition.objects.filter(at__gte=cluster.state.control_plane_started_at)
    served = since.filter(new_state=NodeState.SERVING).values_list("node__name", flat=True)
    # A node found gone since the start other than by the start-up sweep (its previous run's session, never heard
    # again) was serving when the control plane started: a loss, not a node on its way. So when beat alone restarts
    # (the control plane's start is stamped again) while the fleet serves, a node that dies in the grace still counts.
    lost = since.filter(new_state=NodeState.DOWN).exclude(actor=nodes.STARTUP).values_list("node__name", flat=True)
    returning = cluster.returning_node_ids()
    return _Start(until, frozenset(served), frozenset(lost), frozenset(returning))


def _starting(start: _Start | None, fleet: list[Node], in_service: set[str]) -> tuple[list[Node], float | None]:
    """The nodes of `fleet` joining since the control plane started (not a loss), and when the start-up grace ends.

    None once the grace has passed or the fleet is back to its usual size (every node that has not left, the
    hot spares aside, in service). A node that served since the start and is gone is not joining: it is lost.
    """
    if start is None:
        return [], None
    # The fleet's usual size: every node that has not left, and those that left as the stack stopped (expected
    # back), the hot spares aside.
    usual = [n for n in fleet if not n.spare and (n.state != NodeState.LEFT or n.pk in start.returning)]
    if all(n.name in in_service for n in usual):
        return [], None
    return [n for n in usual if n.name not in in_service and n.name not in start.served | start.lost], start.until


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
    grace; and the levels persisted from before are not trusted but evaluated afresh, without the hold that kept
    them. Returns the fleet's level."""
    cluster = Cluster.default()
    ClusterState.objects.filter(cluster=cluster).update(control_plane_started_at=timezone.now())
    ModelCapacity.objects.filter(cluster=cluster).update(degradation_better_since=None)
    level = evaluate(fresh=True)
    routing.publish_cluster_config()  # gateways learn the grace: a request no node takes yet waits for one
    return level


def beat_started(now: float | None = None) -> int | None:
    """Beat started: the control plane's start (control_plane_started), unless beat alone restarted while the control
    plane kept hearing the fleet (a heartbeat taken in within LIFELINE_HEARTBEAT_DEAF_MAX_S). Stamping that as a start
    would judge every node that died while beat was away (no sweep ran) as a session of a previous run, gone rather
    than failed, with no incident: the chaos soak caught a hung and a killed node left without one. A control plane
    away for less than its deaf allowance was deaf, not stopped; its silent nodes are judged as failures, as the
    heartbeat sweep judges them (nodes.mark_silent_nodes_down). Returns the fleet's level, None when not a start."""
    now = time.time() if now is None else now
    heard = hot.heartbeats_ingested_at()
    if heard is not None and now - heard <= settings.LIFELINE_HEARTBEAT_DEAF_MAX_S:
        log.info("beat started while the control plane heard the fleet %.1f s ago: beat alone restarted", now - heard)
        return None
    return control_plane_started()


def evaluate(now: float | None = None, *, fresh: bool = False) -> int:
    """Recompute each served model's capacity and move its degradation level; returns the fleet's (the worst).

    Each model is judged on its own nodes against its own objective: one model's loss never sheds another's
    traffic. While the fleet is starting (and on a `fresh` evaluation at a start), the joining nodes count as
    serving and a better level is taken at once: a start is not an emergency to be held for."""
    now = time.time() if now is None else now
    cluster = Cluster.default()
    rows = {row.model_key: row for row in ModelCapacity.objects.filter(cluster=cluster)}
    shown = {}
    for model in served_models(cluster):
        row = rows.get(model) or ModelCapacity.of(model, cluster)
        figures = report(cluster, model=model)
        level = _evaluate_model(cluster, row, figures, now, fresh)
        shown[model] = {**figures.to_json(), "level": level}
    client = hot.client()
    previous = client.get(hot.keys().capacity)
    fleet_level = ClusterState.objects.values_list("degradation_level", flat=True).get(cluster=cluster)
    latest_ = _summary(shown, now, fleet_level)
    client.set(hot.keys().capacity, json.dumps(latest_))
    if _banner_moves(json.loads(previous) if previous else None, latest_):
        # The banner shows the figures, not only the level: every page refreshes it when they move.
        transaction.on_commit(lambda: events.degradation_changed(latest_["level"]))
    return latest_["level"]


def _evaluate_model(cluster: Cluster, row: ModelCapacity, figures: Report, now: float, fresh: bool) -> int:
    starting = bool(figures.starting)
    if figures.required_rps <= 0:
        decision = policy.LevelDecision(0, None, row.degradation_level != 0)
    else:
        decision = policy.next_level(
            row.degradation_level,
            figures.ratio_once_started if starting else figures.ratio,
            now,
            row.degradation_better_since,
            cluster.degradation_margin,
            0.0 if starting or fresh else cluster.degradation_hold_s,
        )
    if not decision.changed:
        if decision.better_since != row.degradation_better_since:
            ModelCapacity.objects.filter(pk=row.pk).update(degradation_better_since=decision.better_since)
        return row.degradation_level
    if figures.required_rps <= 0:
        cause = f"no throughput objective is set for {row.model_key}"
    else:
        cause = (
            f"{row.model_key}: capacity {figures.capacity_rps:.1f} req/s from {figures.in_service} nodes in service "
            f"is {figures.ratio:.0%} of the required {figures.required_rps:.1f} req/s"
        )
        if starting:
            cause += (
                f"; starting: {len(figures.starting)} joining nodes counted as serving "
                f"({figures.ratio_once_started:.0%} with them)"
            )
        elif fresh:
            cause += "; evaluated afresh as the control plane started"
    set_level(row.model_key, decision.level, cause, figures)
    return decision.level


def _summary(models: dict[str, dict], now: float, level: int) -> dict:
    """The last evaluation for pages: every model's figures, and on top the figures of the worst-off model (the
    highest level, then the lowest ratio), which the banner shows first."""

    def worse(item) -> tuple:
        _, figures = item
        ratio = figures.get("ratio")
        return (-figures["level"], ratio if ratio is not None else float("inf"))

    worst = dict(sorted(models.items(), key=worse)[0][1]) if models else Report(0.0, 0.0, {}, 0).to_json()
    return {**worst, "at": now, "level": level, "model_level": worst.get("level", 0), "models": models}


def _banner_moves(shown: dict | None, latest_: dict) -> bool:
    """The banner's figures moved since the last evaluation: for any model, nodes in service, capacity or required
    by 1 % or more, or its level."""
    if shown is None or set(shown.get("models") or {}) != set(latest_["models"]):
        return True

    def moved(before, now) -> bool:
        return abs((now or 0) - (before or 0)) >= 0.01 * max(abs(before or 0), 1e-9)

    for model, figures in latest_["models"].items():
        before = shown["models"][model]
        if (
            before.get("in_service") != figures["in_service"]
            or before.get("level") != figures["level"]
            or moved(before.get("capacity_rps"), figures["capacity_rps"])
            or moved(before.get("required_rps"), figures["required_rps"])
        ):
            return True
    return False


def set_level(model_key: str, level: int, cause: str, figures: Report | None = None) -> bool:
    """Move `model_key`'s level (a conditional update: a level moved meanwhile by another evaluation wins), and the
    fleet's, the worst of the models'. Written once (DegradationChange), published to the gateways and pages."""
    cluster = Cluster.default()
    row = ModelCapacity.of(model_key, cluster)
    old = row.degradation_level
    with transaction.atomic():
        claimed = ModelCapacity.objects.filter(pk=row.pk, degradation_level=old).update(
            degradation_level=level, degradation_changed_at=timezone.now(), degradation_better_since=None
        )
        if not claimed:
            return False
        DegradationChange.objects.create(
            cluster=cluster,
            model_key=model_key,
            old_level=old,
            new_level=level,
            cause=cause,
            ratio=None if figures is None or figures.required_rps <= 0 else round(figures.ratio, 4),
            capacity_rps=figures.capacity_rps if figures else None,
            required_rps=figures.required_rps if figures else None,
            details=figures.to_json() if figures else {},
        )
        worst = max(ModelCapacity.objects.filter(cluster=cluster).values_list("degradation_level", flat=True))
        ClusterState.objects.filter(cluster=cluster).exclude(degradation_level=worst).update(
            degradation_level=worst, degradation_changed_at=timezone.now()
        )
        transaction.on_commit(lambda: _published(worst))
    log.warning("degradation level of %s %d -> %d: %s", model_key, old, level, cause)
    return True


def level_of(model_key: str) -> int:
    """The model's degradation level (0 for a model without an objective)."""
    row = ModelCapacity.objects.filter(cluster=Cluster.default(), model_key=model_key).first()
    return row.degradation_level if row else 0


def _published(level: int) -> None:
    routing.publish_cluster_config()
    events.degradation_changed(level)


def apply_batch_factor(node: Node) -> str:
    """Send the node's model's level's batch factor to it (at a level change, and when a node joins)."""
    factor = policy.EFFECTS[level_of(node.model_key)].batch_factor
    try:
        status, answer = nodeclient.call(node.address, "POST", "/agent/config", {"batch_factor": factor}, timeout=2)
    except nodeclient.NodeUnreachable as exc:
        return f"unreachable: {exc}"
    if status != 200:
        log.warning("%s refused batch factor %s: %s", node.name, factor, answer)
    return f"{status} batch_limit={answer.get('batch_limit')}"


def latest() -> dict:
    """The last evaluation, for pages: per model (`models`) capacity, required, ratio, per node, its level; on top,
    the worst-off model's figures."""
    raw = hot.client().get(hot.keys().capacity)
    return json.loads(raw) if raw else {}
