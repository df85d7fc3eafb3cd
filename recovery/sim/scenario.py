"""One experiment: the fleet, its workload and faults, the policies to compare, the seeds and the duration.

A scenario is read from a dict (a JSON file) and checked whole before any run: a model that does not fit its
GPUs at that tensor-parallel degree, an unknown model or GPU, a scripted fault on a node or rack the fleet does
not have, a trace with a malformed row, an unknown field: each is refused with a ScenarioError that names the
field (``fleet[2].tp``, ``faults.scripted[0].target``), the row of a file, and what is allowed.

::

    {
      "name": "two racks of Llama-3-70B",
      "duration_s": 3600,
      "seeds": [1, 2, 3],
      "policies": ["none", "fixed", "lifeline"],
      "fleet": [
        {"name": "a", "count": 4, "model": "Llama-3-70B", "gpu": "H100-SXM", "tp": 2, "rack": "r1", "spares": 1},
        {"name": "b", "count": 4, "model": "Llama-3-70B", "gpu": "H100-SXM", "tp": 2, "rack": "r2"}
      ],
      "workload": [
        {"arrival": "gamma", "rate_rps": 12, "cv": 2, "lengths": "splitwise-conversation"},
        {"trace": "traces/code.csv", "too_long": "clip"}
      ],
      "faults": {
        "per_1000_node_days": 4,
        "scripted": [
          {"at_s": 600, "kind": "crash", "target": "a-2", "repair_s": 120},
          {"at_s": 1800, "kind": "rack", "target": "r2"}
        ]
      },
      "degradation": {"required_share": 0.92}
    }

- ``fleet``: groups of identical nodes. A group's nodes are named ``<name>-1`` … ``<name>-<count>`` and its hot
  spares ``<name>-spare-1`` …; a group without a name is ``g<position>`` (``g1`` first). ``tp`` defaults to 1,
  ``rack`` to ``rack-1``, ``spares`` to 0.
- ``workload``: one object or a list. Synthetic: ``arrival`` (poisson or gamma, default poisson), ``rate_rps``,
  ``cv`` (gamma), ``lengths`` (recovery.sim.workload.LENGTHS, default splitwise-conversation). Replayed:
  ``trace`` (a CSV path, relative to the scenario file) and ``too_long`` (refuse or clip). ``model`` may be left
  out when the fleet serves one model. Lengths are clipped to the shortest context among the model's nodes.
  ``tiers`` (either kind): the tier mix as weights, ``{"premium": 1, "standard": 1, "best_effort": 1}`` by default
  (recovery.sim.workload).
- ``faults``: ``per_1000_node_days`` (default 4), ``rack_per_1000_rack_days`` (default 0), ``mix`` (kind →
  weight, default Meta's), ``outage_median_h`` and ``outage_p90_h`` (default StepFun's 22 and 341), and
  ``scripted``: ``at_s``, ``kind``, ``target`` and ``repair_s`` (left out: out for the rest of the run).
- ``detection``: any of recovery.sim.faults.DetectionDefaults' fields, to try other settings than the shipped ones.
- ``degradation``: the throughput objectives that degradation levels follow (recovery.sim.degradation), off when
  left out: ``required_rps`` (model → requests/s) and/or ``required_share`` (every other model's objective as that
  share of what its nodes carry at the start, 0.92 as the demo sets it); ``ttft_ms``, ``tpot_ms``,
  ``avg_prompt_tokens``, ``avg_output_tokens`` (what capacity is counted within, ModelCapacity's defaults);
  ``interval_s`` (2, the beat's), ``margin`` (0.05) and ``hold_s`` (30), the cluster's hysteresis.
- ``policies``: checkpoint placement policies (recovery.policy.placement.POLICIES), default all of them;
  ``seeds``: default [1]. Every policy runs once per seed, and a seed gives every policy the same requests and
  the same faults.
"""

import heapq
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from recovery.policy.placement import POLICIES
from recovery.sim import degradation as degradation_settings
from recovery.sim.degradation import DegradationSettings
from recovery.sim.distributions import LogNormal
from recovery.sim.errors import ScenarioError
from recovery.sim.faults import (
    HOUR_S,
    META_LLAMA3_MIX,
    OUTAGE_MEDIAN_H,
    OUTAGE_P90_H,
    DetectionDefaults,
    Fault,
    FaultRates,
)
from recovery.sim.workload import (
    DEFAULT_TIER_MIX,
    Arrivals,
    Request,
    SyntheticWorkload,
    TraceWorkload,
    Workload,
    read_trace,
    tier_mix,
)
from workers import catalog

MAX_DURATION_S = 366 * 86400.0
MAX_NODES_PER_GROUP = 100_000
DURATION_ALLOWED = "seconds above 0, at most 366 days"


@dataclass(frozen=True)
class NodeGroup:
    """Identical nodes: `count` of them, each `model` on `tp` of `gpu`, in `rack`, with `spares` hot spares.

    Their place in the fabric beyond the rack (workers.catalog.Placement) is the group's: `server`
    when they share one machine's PCIe bus, `nvl_domain` when their GPUs share an NVLink domain
    (groups naming the same one share it: an NVL36x2 domain spans two racks), `network` between
    servers, and `nvlink_down` for a group whose NVLink has failed. Left out: each node alone on its
    server and on InfiniBand, as every simulated node was before the fabric was modelled.
    """

    name: str
    count: int
    model: str
    gpu: str
    tp: int = 1
    rack: str = "rack-1"
    spares: int = 0
    server: str = ""
    nvl_domain: str = ""
    network: str = "infiniband"
    nvlink_down: bool = False
    deployment: catalog.Deployment = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_name(self.name, "name")
        _check_name(self.rack, "rack")
        _check_int(self.count, "count", 1, MAX_NODES_PER_GROUP)
        _check_int(self.spares, "spares", 0, MAX_NODES_PER_GROUP)
        object.__setattr__(self, "deployment", _deployment(self.model, self.gpu, self.tp))
        for key in ("server", "nvl_domain"):
            if getattr(self, key) != "":
                _check_name(getattr(self, key), key)
        if self.network not in catalog.NETWORKS:
            raise ScenarioError("network", f"{self.network!r} is not a network", ", ".join(catalog.NETWORKS))
        if not isinstance(self.nvlink_down, bool):
            raise ScenarioError("nvlink_down", f"{self.nvlink_down!r}", "true or false")
        if self.nvl_domain and self.deployment.gpu.link == "pcie":
            with_nvlink = ", ".join(key for key, gpu in catalog.GPUS.items() if gpu.link != "pcie")
            raise ScenarioError(
                "nvl_domain",
                f"{self.nvl_domain!r}: the {self.gpu} connects over PCIe only and belongs to no NVLink domain",
                f"none, or a GPU with NVLink: {with_nvlink}",
            )

    def node_names(self) -> list[tuple[str, bool]]:
        """(name, is a spare) of each node, serving nodes first."""
        return [(f"{self.name}-{i}", False) for i in range(1, self.count + 1)] + [
            (f"{self.name}-spare-{i}", True) for i in range(1, self.spares + 1)
        ]


def _deployment(model_key: str, gpu_key: str, tp: int) -> catalog.Deployment:
    """The catalog's deployment, or the field that makes it impossible and what would do."""
    if model_key not in catalog.MODELS:
        raise ScenarioError("model", f"{model_key!r} is not in the catalog", ", ".join(catalog.MODELS))
    if gpu_key not in catalog.GPUS:
        raise ScenarioError("gpu", f"{gpu_key!r} is not in the catalog", ", ".join(catalog.GPUS))
    if isinstance(tp, bool) or tp not in catalog.TP_DEGREES:
        raise ScenarioError("tp", f"{tp!r} is not a tensor-parallel degree", ", ".join(map(str, catalog.TP_DEGREES)))
    fits = [degree for degree in catalog.TP_DEGREES if _fits(model_key, gpu_key, degree)]
    if tp not in fits:
        model, gpu = catalog.MODELS[model_key], catalog.GPUS[gpu_key]
        raise ScenarioError(
            "tp",
            f"{model.key} ({model.weight_bytes / catalog.GB:.1f} GB of weights, and room for its KV cache) does not "
            f"fit on {tp}× {gpu.key} ({gpu.memory_gb:g} GB each, {catalog.GPU_MEMORY_UTILIZATION:.0%} of it usable)",
            ", ".join(map(str, fits))
            if fits
            else f"none: not even {max(catalog.TP_DEGREES)} of them hold it; a GPU with more memory",
        )
    return catalog.Deployment.of(model_key, gpu_key, tp)


@dataclass(frozen=True)
class SimNode:
    name: str
    group: str
    rack: str
    deployment: catalog.Deployment
    spare: bool
    placement: catalog.Placement  # where it sits in the fabric, its rack included


@dataclass(frozen=True)
class Scenario:
    duration_s: float
    fleet: tuple[NodeGroup, ...]
    workloads: tuple[Workload, ...]
    fault_rates: FaultRates = field(default_factory=FaultRates)
    scripted_faults: tuple[Fault, ...] = ()
    detection: DetectionDefaults = field(default_factory=DetectionDefaults)
    policies: tuple[str, ...] = POLICIES
    seeds: tuple[int, ...] = (1,)
    name: str = ""
    degradation: DegradationSettings = field(default_factory=DegradationSettings)

    def __post_init__(self) -> None:
        _check_number(self.duration_s, "duration_s", 0, MAX_DURATION_S, DURATION_ALLOWED)
        if not self.fleet:
            raise ScenarioError("fleet", "has no nodes", "a list of node groups")
        named: dict[str, int] = {}  # node name -> the group that names it
        for i, group in enumerate(self.fleet):
            for name, _ in group.node_names():
                if name in named:
                    raise ScenarioError(
                        f"fleet[{i}].name",
                        f"gives a node the name {name!r}, which fleet[{named[name]}] gives one too",
                        "group names that give every node its own name",
                    )
                named[name] = i
        if not self.workloads:
            raise ScenarioError("workload", "has no requests", "a workload object, or a list of them")
        served = self.models
        for i, workload in enumerate(self.workloads):
            if workload.model not in served:
                raise ScenarioError(
                    f"workload[{i}].model", f"{workload.model!r} is not served by the fleet", _served(served)
                )
            if isinstance(workload, TraceWorkload):
                workload.check(self.duration_s, self.context_tokens(workload.model), f"workload[{i}].trace")
        for model in self.degradation.required_rps:
            if model not in served:
                raise ScenarioError(f"degradation.required_rps.{model}", "is not served by the fleet", _served(served))
        nodes, racks = {n.name for n in self.nodes}, set(self.racks)
        for i, fault in enumerate(self.scripted_faults):
            where = f"faults.scripted[{i}]"
            if fault.at_s >= self.duration_s:
                raise ScenarioError(
                    f"{where}.at_s", f"{fault.at_s:g} s is after the run's end", f"below {self.duration_s:g}"
                )
            if fault.kind == "rack" and fault.target not in racks:
                raise ScenarioError(f"{where}.target", f"the fleet has no rack {fault.target!r}", _some(sorted(racks)))
            if fault.kind != "rack" and fault.target not in nodes:
                raise ScenarioError(f"{where}.target", f"the fleet has no node {fault.target!r}", _some(sorted(nodes)))
        if not self.policies or len(set(self.policies)) != len(self.policies):
            raise ScenarioError("policies", f"{list(self.policies)}", f"each at most once, of {', '.join(POLICIES)}")
        for i, policy in enumerate(self.policies):
            if policy not in POLICIES:
                raise ScenarioError(f"policies[{i}]", f"{policy!r} is not a placement policy", ", ".join(POLICIES))
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ScenarioError("seeds", f"{list(self.seeds)}", "a list of different whole numbers")
        for i, seed in enumerate(self.seeds):
            _check_int(seed, f"seeds[{i}]", 0, 2**63)

    # --- the fleet ---------------------------------------------------------------------------
    @cached_property
    def nodes(self) -> tuple[SimNode, ...]:
        return tuple(
            SimNode(
                name,
                g.name,
                g.rack,
                g.deployment,
                spare,
                catalog.Placement(g.rack, g.server, g.nvl_domain, g.network, g.nvlink_down),
            )
            for g in self.fleet
            for name, spare in g.node_names()
        )

    @property
    def racks(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(g.rack for g in self.fleet))

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(g.model for g in self.fleet))

    def context_tokens(self, model: str) -> int:
        """The longest request every node of `model` can hold, spares included (any may get any request)."""
        return min(n.deployment.max_context_tokens for n in self.nodes if n.deployment.model.key == model)

    # --- the inputs of one run -----------------------------------------------------------------
    def runs(self) -> list[tuple[str, int]]:
        """(policy, seed) of every run, each seed's runs side by side."""
        return [(policy, seed) for seed in self.seeds for policy in self.policies]

    def requests(self, seed: int) -> list[Request]:
        """Every workload's requests in arrival order; the same for every policy."""
        return list(self.arrivals(seed))

    def arrivals(self, seed: int) -> Iterator[Request]:
        """`requests`, one at a time as they are drawn: an hour of a large fleet is millions of them. Each workload's
        come in arrival order; merged, ties keep the workloads' order."""
        streams = [
            workload.stream(self.duration_s, f"{seed}:workload[{i}]", self.context_tokens(workload.model))
            for i, workload in enumerate(self.workloads)
        ]
        return heapq.merge(*streams, key=_arrival_s)

    def faults(self, seed: int) -> list[Fault]:
        """The scripted faults and those drawn for this seed, in time order; the same for every policy."""
        drawn = self.fault_rates.draw([n.name for n in self.nodes], self.racks, self.duration_s, seed)
        return sorted([*self.scripted_faults, *drawn], key=lambda f: f.at_s)


def _arrival_s(request: Request) -> float:
    return request.arrival_s


def _served(models: Sequence[str]) -> str:
    return f"a model the fleet serves: {', '.join(models)}"


# --- reading a scenario ----------------------------------------------------------------------------
def load(path: str | Path) -> Scenario:
    """A scenario from a JSON file; a trace's relative path is taken from the file's folder."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ScenarioError(str(path), f"cannot be read: {exc.strerror or exc}", "a readable JSON file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ScenarioError(str(path), f"is not JSON: {exc}", "a JSON object") from None
    return parse(data, path.parent)


def parse(data: Any, base_dir: str | Path = ".") -> Scenario:
    """A scenario from a dict as JSON gives it, checked whole."""
    top = _object(data, "scenario")
    _only(
        top, "", ("name", "duration_s", "seeds", "policies", "fleet", "workload", "faults", "detection", "degradation")
    )
    duration_s = _check_number(_required(top, "duration_s", ""), "duration_s", 0, MAX_DURATION_S, DURATION_ALLOWED)
    fleet = tuple(_group(item, f"fleet[{i}]", i) for i, item in enumerate(_list(_required(top, "fleet", ""), "fleet")))
    if not fleet:
        raise ScenarioError("fleet", "is empty", "at least one node group")
    models = tuple(dict.fromkeys(g.model for g in fleet))
    raw = _required(top, "workload", "")
    items = raw if isinstance(raw, list) else [raw]
    workloads = tuple(_workload(item, f"workload[{i}]", models, Path(base_dir)) for i, item in enumerate(items))
    rates, scripted = _faults(top.get("faults", {}))
    detection = _detection(top.get("detection", {}))
    policies = tuple(
        _str(p, f"policies[{i}]") for i, p in enumerate(_list(top.get("policies", list(POLICIES)), "policies"))
    )
    seeds = tuple(_check_int(s, f"seeds[{i}]", 0, 2**63) for i, s in enumerate(_list(top.get("seeds", [1]), "seeds")))
    return Scenario(
        duration_s=float(duration_s),
        fleet=fleet,
        workloads=workloads,
        fault_rates=rates,
        scripted_faults=scripted,
        detection=detection,
        policies=policies,
        seeds=seeds,
        name=_str(top.get("name", ""), "name", empty=True),
        degradation=degradation_settings.parse(top.get("degradation", {})),
    )


def _group(item: Any, where: str, index: int) -> NodeGroup:
    data = _object(item, where)
    _only(
        data,
        where,
        ("name", "count", "model", "gpu", "tp", "rack", "spares", "server", "nvl_domain", "network", "nvlink_down"),
    )
    try:
        return NodeGroup(
            name=_str(data.get("name", f"g{index + 1}"), "name"),
            count=_required(data, "count", ""),
            model=_str(_required(data, "model", ""), "model"),
            gpu=_str(_required(data, "gpu", ""), "gpu"),
            tp=data.get("tp", 1),
            rack=_str(data.get("rack", "rack-1"), "rack"),
            spares=data.get("spares", 0),
            server=data.get("server", ""),
            nvl_domain=data.get("nvl_domain", ""),
            network=data.get("network", "infiniband"),
            nvlink_down=data.get("nvlink_down", False),
        )
    except ScenarioError as exc:
        raise exc.within(where) from None


def _workload(item: Any, where: str, models: tuple[str, ...], base_dir: Path) -> Workload:
    data = _object(item, where)
    if "model" in data:
        model = _str(data["model"], f"{where}.model")
    elif len(models) == 1:
        model = models[0]
    else:
        raise ScenarioError(f"{where}.model", "is required: the fleet serves more than one model", _served(models))
    tiers = tier_mix(data["tiers"], f"{where}.tiers") if "tiers" in data else DEFAULT_TIER_MIX
    if "trace" in data:
        _only(data, where, ("model", "trace", "too_long", "tiers"))
        path = base_dir / _str(data["trace"], f"{where}.trace")
        rows = read_trace(path, f"{where}.trace")
        try:
            return TraceWorkload(model, str(path), rows, _str(data.get("too_long", "refuse"), "too_long"), tiers)
        except ScenarioError as exc:
            raise exc.within(where) from None
    _only(
        data,
        where,
        ("model", "arrival", "rate_rps", "cv", "lengths", "tiers"),
        hint="or trace and too_long for a replay",
    )
    try:
        arrivals = Arrivals(
            _str(data.get("arrival", "poisson"), "arrival"), _required(data, "rate_rps", ""), data.get("cv", 1.0)
        )
        lengths = _str(data.get("lengths", "splitwise-conversation"), "lengths")
        return SyntheticWorkload(model, arrivals, lengths, tiers)
    except ScenarioError as exc:
        raise exc.within(where) from None


def _faults(raw: Any) -> tuple[FaultRates, tuple[Fault, ...]]:
    data = _object(raw, "faults")
    keys = ("per_1000_node_days", "rack_per_1000_rack_days", "mix", "outage_median_h", "outage_p90_h", "scripted")
    _only(data, "faults", keys)
    median_h = _check_number(data.get("outage_median_h", OUTAGE_MEDIAN_H), "faults.outage_median_h")
    p90_h = _check_number(data.get("outage_p90_h", OUTAGE_P90_H), "faults.outage_p90_h")
    if not p90_h > median_h:
        raise ScenarioError(
            "faults.outage_p90_h", f"{p90_h:g} h is not above the median {median_h:g} h", "p90 > median"
        )
    mix = _object(data.get("mix", dict(META_LLAMA3_MIX)), "faults.mix")
    try:
        rates = FaultRates(
            per_1000_node_days=data.get("per_1000_node_days", FaultRates.per_1000_node_days),
            rack_per_1000_rack_days=data.get("rack_per_1000_rack_days", 0.0),
            mix=mix,
            outage=LogNormal.from_median_p90(median_h * HOUR_S, p90_h * HOUR_S),
        )
    except ScenarioError as exc:
        raise exc.within("faults") from None
    scripted = []
    for i, item in enumerate(_list(data.get("scripted", []), "faults.scripted")):
        where = f"faults.scripted[{i}]"
        fault = _object(item, where)
        _only(fault, where, ("at_s", "kind", "target", "repair_s"))
        try:
            scripted.append(
                Fault(
                    at_s=_required(fault, "at_s", ""),
                    kind=_str(_required(fault, "kind", ""), "kind"),
                    target=_str(_required(fault, "target", ""), "target"),
                    repair_s=fault.get("repair_s"),
                    scripted=True,
                )
            )
        except ScenarioError as exc:
            raise exc.within(where) from None
    return rates, tuple(scripted)


def _detection(raw: Any) -> DetectionDefaults:
    data = _object(raw, "detection")
    _only(data, "detection", tuple(f.name for f in fields(DetectionDefaults)))
    try:
        return DetectionDefaults(**data)
    except ScenarioError as exc:
        raise exc.within("detection") from None


# --- small checks, each naming its field ---------------------------------------------------------
def _fits(model: str, gpu: str, tp: int) -> bool:
    try:
        catalog.Deployment.of(model, gpu, tp)
    except catalog.CatalogError:
        return False
    return True


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ScenarioError(where, f"is a {type(value).__name__}", "a JSON object")
    return value


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise ScenarioError(where, f"is a {type(value).__name__}", "a JSON list")
    return value


def _only(data: Mapping, where: str, allowed: Sequence[str], hint: str = "") -> None:
    for key in data:
        if key not in allowed:
            field_ = f"{where}.{key}" if where else str(key)
            raise ScenarioError(field_, "is not a field here", ", ".join(allowed) + (f" ({hint})" if hint else ""))


def _required(data: Mapping, key: str, where: str) -> Any:
    if key not in data:
        raise ScenarioError(f"{where}.{key}" if where else key, "is required", "see recovery/sim/scenario.py")
    return data[key]


def _str(value: Any, where: str, empty: bool = False) -> str:
    if not isinstance(value, str) or not (empty or value.strip()):
        raise ScenarioError(where, f"{value!r}", "a string" if empty else "a string, not empty")
    return value


def _check_name(value: Any, where: str) -> None:
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        raise ScenarioError(where, f"{value!r}", "a name, not empty, without spaces around it")


def _check_int(value: Any, where: str, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ScenarioError(where, f"{value!r}", f"a whole number from {minimum} to {maximum}")
    return value


def _check_number(
    value: Any, where: str, above: float = 0, maximum: float = math.inf, allowed: str = "a number above 0"
) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and above < value <= maximum
    if not ok or not math.isfinite(value):
        raise ScenarioError(where, f"{value!r}", allowed)
    return float(value)


def _some(names: Sequence[str], at_most: int = 12) -> str:
    """A list of allowed names, shortened when long."""
    shown = ", ".join(names[:at_most])
    return shown + (f" … ({len(names)} in all)" if len(names) > at_most else "")
