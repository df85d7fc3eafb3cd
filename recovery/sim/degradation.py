"""Degradation levels and shedding in the simulator, as the control plane and the gateways do them.

The real control plane (recovery/actions/capacity.py `evaluate`, every 2 s by Celery beat: console/settings.py
"evaluate-capacity") sums, for each served model, what the model's nodes in service carry within its latency
objectives (`recovery.policy.capacity.node_capacity`), divides by the model's required throughput, and moves the
model's level with hysteresis (`next_level`: worse at once, better only after the ratio has cleared the better
level by `margin` for `hold_s`). The level's `EFFECTS` then act:

- the gateways answer a new request of a shed tier 429 (level 2 and up: best_effort), and every new request 503
  at level 4 (recovery/gateway/app.py); requests already admitted, and requests resumed after a fault, go on;
- each node of the model gets the level's batch factor (recovery.reactions → `apply_batch_factor` →
  the node's /agent/config → `EngineCore.batch_factor`): the running batch admits max(1, ⌊128 × factor⌋)
  sequences at most; running ones continue, new ones wait;
- at level 3 and up the latency objectives are relaxed ×2: a request finishing then is judged against the relaxed
  objectives (recovery/actions/slo.py), so each request keeps the level it finished at.

Here the same policy functions run on the simulated nodes, at evaluation events every `interval_s`. A node is in
service for the control plane unless it is a hot spare not yet promoted or the control plane has put it out (its
DOWN or UNHEALTHY verdict, `faults.detect`'s confirmed time, until its model is loaded again): a failed node the
control plane has not yet confirmed still counts, as it does in the real system. Its slowdown is 1: simulated
nodes step exactly at the roofline's times, which is what `capacity.slowdown` compares a step with. The real
control plane's start-up grace does not arise (the simulated fleet serves from the first second), and a level's
effects act at the evaluation that moves it (the real ones reach the gateways and nodes within a second or so).

Off unless the scenario sets an objective (``degradation`` in the scenario: ``required_rps`` per model, or
``required_share`` of what the model's nodes carry at the start, as the demo sets 92 %), so runs without one are
exactly what they were.
"""

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields

from recovery.policy import capacity
from recovery.policy.slo_rules import TIERS
from recovery.sim.errors import ScenarioError
from workers.catalog import Deployment

EVALUATE_EVERY_S = 2.0  # console/settings.py CELERY_BEAT_SCHEDULE "evaluate-capacity"
MARGIN = 0.05  # recovery/models.py Cluster.degradation_margin
HOLD_S = 30.0  # recovery/models.py Cluster.degradation_hold_s
MAX_NUM_SEQS = 128  # recovery/actions/capacity.py MAX_NUM_SEQS: the batch limit capacity assumes for every node
SHED_CODE, REJECT_CODE = 429, 503  # a shed tier's answer; every new request's at level 4


@dataclass(frozen=True)
class DegradationSettings:
    """The throughput objectives and the settings of the evaluation; no objective, no degradation.

    `required_rps` names a model's objective in requests per second; `required_share` sets it, for every model
    not named there, to that share of what the model's nodes in service carry at the start (spares not counted).
    The latency objectives and average request shape that capacity is counted with are recovery/models.py
    ModelCapacity's fields, with its defaults, the same for every model."""

    required_rps: Mapping[str, float] = field(default_factory=dict)
    required_share: float | None = None
    ttft_ms: float = capacity.Slo.ttft_ms
    tpot_ms: float = capacity.Slo.tpot_ms
    avg_prompt_tokens: int = capacity.Slo.avg_prompt_tokens
    avg_output_tokens: int = capacity.Slo.avg_output_tokens
    interval_s: float = EVALUATE_EVERY_S
    margin: float = MARGIN
    hold_s: float = HOLD_S

    def __post_init__(self) -> None:
        for model, rps in self.required_rps.items():
            if not _number(rps) or not 0 < rps < math.inf:
                raise ScenarioError(f"required_rps.{model}", f"{rps!r}", "requests per second above 0")
        if self.required_share is not None and (not _number(self.required_share) or not 0 < self.required_share <= 10):
            raise ScenarioError(
                "required_share", f"{self.required_share!r}", "a share of the fleet's capacity above 0 (0.92: 92 %)"
            )
        for name in ("ttft_ms", "tpot_ms", "interval_s"):
            value = getattr(self, name)
            if not _number(value) or not 0 < value < math.inf:
                raise ScenarioError(name, f"{value!r}", "a number above 0")
        for name in ("avg_prompt_tokens", "avg_output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScenarioError(name, f"{value!r}", "a whole number of tokens, at least 1")
        if not _number(self.margin) or not 0 <= self.margin < 1:
            raise ScenarioError("margin", f"{self.margin!r}", "a share from 0 to below 1 (0.05: 5 %)")
        if not _number(self.hold_s) or not 0 <= self.hold_s < math.inf:
            raise ScenarioError("hold_s", f"{self.hold_s!r}", "seconds ≥ 0")

    @property
    def enabled(self) -> bool:
        return bool(self.required_rps) or self.required_share is not None

    def slo(self, required_rps: float = 0.0) -> capacity.Slo:
        return capacity.Slo(self.ttft_ms, self.tpot_ms, required_rps, self.avg_prompt_tokens, self.avg_output_tokens)


def parse(raw: object) -> DegradationSettings:
    """The scenario's ``degradation`` object, checked (each error names its field under ``degradation``)."""
    if not isinstance(raw, dict):
        raise ScenarioError("degradation", f"is a {type(raw).__name__}", "a JSON object")
    allowed = [f.name for f in fields(DegradationSettings)]
    for key in raw:
        if key not in allowed:
            raise ScenarioError(f"degradation.{key}", "is not a field here", ", ".join(allowed))
    data = dict(raw)
    required = data.get("required_rps", {})
    if not isinstance(required, dict):
        raise ScenarioError("degradation.required_rps", f"is a {type(required).__name__}", '{"<model>": req/s, …}')
    data["required_rps"] = dict(required)
    try:
        return DegradationSettings(**data)
    except ScenarioError as exc:
        raise exc.within("degradation") from None


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


@dataclass(frozen=True)
class LevelChange:
    """One move of a model's level (the simulator's DegradationChange row), with the figures that moved it."""

    at_s: float
    model: str
    old: int
    new: int
    ratio: float
    capacity_rps: float
    required_rps: float
    in_service: int


@dataclass
class ModelLevel:
    required_rps: float
    slo: capacity.Slo
    level: int = 0
    better_since: float | None = None
    changed_at: float = 0.0
    capacity_rps: float = 0.0
    in_service: int = 0
    seconds: dict[int, float] = field(default_factory=dict)  # level -> time spent at it before `changed_at`

    @property
    def effects(self) -> capacity.Effects:
        return capacity.EFFECTS[self.level]


class Degradation:
    """Each model's level and what it refused: the control plane's evaluation and the gateways' shedding."""

    def __init__(self, settings: DegradationSettings, start: Mapping[str, Iterable[Deployment]]):
        """`start` maps each served model to the deployments of its nodes in service at the start."""
        self.settings = settings
        self.models: dict[str, ModelLevel] = {}
        self._capacity: dict[tuple[str, str, int], float] = {}  # deployment -> its rps within the model's SLO
        self.changes: list[LevelChange] = []
        self.shed: dict[tuple[str, str, int, int], int] = {}  # (model, tier, level, HTTP code) -> requests refused
        if not settings.enabled:
            return
        for model, deployments in start.items():
            if model in settings.required_rps:
                required = float(settings.required_rps[model])
            elif settings.required_share is not None:
                slo = settings.slo()
                required = settings.required_share * sum(self.node_rps(d, slo) for d in deployments)
            else:
                continue  # no objective for this model: it stays at level 0
            if required > 0:
                self.models[model] = ModelLevel(required, settings.slo(required))

    @property
    def enabled(self) -> bool:
        return bool(self.models)

    def node_rps(self, deployment: Deployment, slo: capacity.Slo) -> float:
        """What one node carries within the objectives (capacity.node_capacity; pure, so kept per deployment)."""
        key = (deployment.model.key, deployment.gpu.key, deployment.tp)
        rps = self._capacity.get(key)
        if rps is None:
            rps = self._capacity[key] = capacity.node_capacity(deployment, slo, MAX_NUM_SEQS).rps
        return rps

    def level(self, model: str) -> int:
        state = self.models.get(model)
        return 0 if state is None else state.level

    def effects(self, model: str) -> capacity.Effects:
        return capacity.EFFECTS[self.level(model)]

    def count(self, model: str, in_service: list[Deployment]) -> None:
        """The model's nodes in service now (recomputed only when they change)."""
        state = self.models.get(model)
        if state is not None:
            state.capacity_rps = sum(self.node_rps(d, state.slo) for d in in_service)
            state.in_service = len(in_service)

    def evaluate(self, now: float) -> list[LevelChange]:
        """recovery.actions.capacity._evaluate_model for every model with an objective: the levels that moved."""
        moved = []
        for model, state in self.models.items():
            ratio = state.capacity_rps / state.required_rps
            decision = capacity.next_level(
                state.level, ratio, now, state.better_since, self.settings.margin, self.settings.hold_s
            )
            state.better_since = decision.better_since
            if not decision.changed:
                continue
            change = LevelChange(
                now, model, state.level, decision.level, ratio, state.capacity_rps, state.required_rps, state.in_service
            )
            state.seconds[state.level] = state.seconds.get(state.level, 0.0) + now - state.changed_at
            state.level, state.changed_at = decision.level, now
            self.changes.append(change)
            moved.append(change)
        return moved

    def refuses(self, model: str, tier: str) -> tuple[int, int] | None:
        """The gateway's admission (recovery/gateway/app.py): (HTTP code, level) when the model's level turns a new
        request of `tier` away, counted; None when it is admitted."""
        state = self.models.get(model)
        if state is None or state.level == 0:
            return None
        effects = state.effects
        if effects.accept_new and tier not in effects.shed_tiers:
            return None
        code = REJECT_CODE if not effects.accept_new else SHED_CODE
        key = (model, tier, state.level, code)
        self.shed[key] = self.shed.get(key, 0) + 1
        return code, state.level

    def seconds_at_levels(self, end: float) -> dict[str, dict[int, float]]:
        """Per model, the time spent at each level from the start to `end`."""
        out = {}
        for model, state in self.models.items():
            seconds = dict(state.seconds)
            seconds[state.level] = seconds.get(state.level, 0.0) + max(0.0, end - state.changed_at)
            out[model] = {level: round(s, 6) for level, s in sorted(seconds.items()) if s > 0}
        return out

    def shed_by_tier(self) -> dict[str, int]:
        """Requests refused, by tier (every tier named, 0 where none was)."""
        totals = dict.fromkeys(TIERS, 0)
        for (_, tier, _, _), n in self.shed.items():
            totals[tier] = totals.get(tier, 0) + n
        return totals

    def shed_rows(self) -> list[dict]:
        """Every (model, tier, level, code) refused, with its count, in a stable order."""
        return [
            {"model": m, "tier": t, "level": lv, "code": c, "requests": n}
            for (m, t, lv, c), n in sorted(self.shed.items())
        ]
