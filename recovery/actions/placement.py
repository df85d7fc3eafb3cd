"""A placement plan for the live fleet (recovery.policy.planner), judged by the simulator beside the placement it
would replace: what the Placement page and its API answer. Asking for a plan changes nothing.

The fleet comes from the registry: nodes that share a `server` are one server (its GPUs are theirs together);
a node with none is a server of its own GPUs. A model's workload is its throughput objective
(ModelCapacity.required_rps), or the arrival rate the gateways reported over the last WINDOW_S where that is
higher, so that a plan covers both what is asked now and what was promised. Capacity is counted as the degradation
level counts it (one function, recovery.policy.capacity.node_capacity): at the objective's prompt and output lengths
and latency, each server at its measured speed, so "after a rack's loss" here is what the level would see. The
measured lengths are shown beside (and where traffic runs longer than the objective, the page says so). "What if"
questions are answered on the same inputs: servers added (`add`), racks lost (`lose_racks`).
"""

import dataclasses
from collections import defaultdict
from datetime import timedelta

from django.db.models import Avg, Count
from django.utils import timezone

from recovery import hot
from recovery.actions import capacity
from recovery.choices import Health, NodeState
from recovery.models import ApiKey, Cluster, ModelCapacity, Node, RequestOutcome
from recovery.policy import planner
from recovery.policy.planner import Demand, Replica, Restriction, Server
from recovery.sim import planning
from workers import catalog

WINDOW_S = 900
MIN_MEASURED = 20  # fewer requests than this in the window: the lengths are the objective's, not measured
PLAN_TIME_LIMIT_S = 3.0
EVALUATION_S = 30.0  # simulated seconds of workload per placement judged
MAX_EVALUATED_REQUESTS = 20_000  # beyond this, the evaluation's duration shrinks (the page stays interactive)
MAX_ADDED_SERVERS = 256


class PlacementError(ValueError):
    """A what-if the planner cannot take: says which field and what is allowed."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def plannable_nodes():
    """The nodes a plan places on: serving or joining, not hot spares, not UNHEALTHY. A node that is down gives no
    capacity and a plan must not count on it; a cordoned one (a drain, a planned migration) comes back."""
    return (
        Node.objects.filter(state__in=(NodeState.JOIN, NodeState.SERVING), spare=False)
        .exclude(health=Health.UNHEALTHY)
        .select_related("rack")
        .order_by("name")
    )


def live_fleet(nodes: list[Node] | None = None) -> tuple[list[Server], dict[str, tuple[Replica, ...]]]:
    """The registry's plannable nodes (or `nodes`, read already) as servers and the replicas they run now."""
    nodes = plannable_nodes() if nodes is None else nodes
    gpus: dict[str, int] = defaultdict(int)
    kind: dict[str, tuple[str, str, str, str]] = {}
    current: dict[str, list[Replica]] = defaultdict(list)
    for node in nodes:
        server = node.server or node.name
        gpus[server] += node.tp
        kind.setdefault(server, (node.gpu_key, node.rack.name, node.provider, node.region))
        current[server].append(Replica(node.model_key, node.tp))
    # A node switches model, never its tensor-parallel degree: a server is planned at its nodes' degrees.
    servers = [
        Server(
            name,
            kind[name][0],
            gpus[name],
            kind[name][1],
            provider=kind[name][2],
            region=kind[name][3],
            tps=tuple(sorted({r.tp for r in current[name]})),
        )
        for name in sorted(gpus)
    ]
    return servers, {name: tuple(sorted(replicas)) for name, replicas in current.items()}


def live_demands(models: set[str], measured: dict[str, dict] | None = None) -> list[Demand]:
    """Each model's workload: its throughput objective, or the rate measured over the last WINDOW_S where that is
    higher; its prompt and output lengths and latency objectives are the objective's, those its degradation level
    counts capacity at, so that this page's capacities (and after a rack's loss) are the level's own. Measured
    lengths are shown beside them (sources), and where traffic runs longer than the objective, said plainly."""
    measured = _measured() if measured is None else measured
    objectives = {row.model_key: row for row in ModelCapacity.objects.filter(cluster=Cluster.default())}
    restricted = restrictions()
    demands = []
    for model in sorted(models | set(objectives)):
        if model not in catalog.MODELS:
            continue
        objective = objectives.get(model) or ModelCapacity(model_key=model)
        seen = measured.get(model)
        rate = max(objective.required_rps, (seen["count"] / WINDOW_S) if seen else 0.0)
        demands.append(
            Demand(
                model,
                round(rate, 3),
                objective.avg_prompt_tokens,
                objective.avg_output_tokens,
                objective.ttft_ms,
                objective.tpot_ms,
                restricted.get(model, ()),
            )
        )
    return demands


def restrictions() -> dict[str, tuple[Restriction, ...]]:
    """Per model, the tenants whose keys trust only some providers or regions, each with the requests per second
    it sent that model over the last WINDOW_S: the plan keeps that much capacity where they trust."""
    trust: dict[str, tuple[frozenset, frozenset]] = {}
    for key in ApiKey.objects.filter(revoked_at__isnull=True):
        if not key.restricted:
            continue
        providers, regions = trust.get(key.tenant, (frozenset(), frozenset()))
        trust[key.tenant] = (providers | set(key.trusted_providers), regions | set(key.trusted_regions))
    if not trust:
        return {}
    since = timezone.now() - timedelta(seconds=WINDOW_S)
    sent = (
        RequestOutcome.objects.filter(finished_at__gte=since, simulated=False, tenant__in=trust)
        .values("model_key", "tenant")
        .annotate(count=Count("id"))
    )
    found: dict[str, list[Restriction]] = defaultdict(list)
    for row in sent.order_by("model_key", "tenant"):
        providers, regions = trust[row["tenant"]]
        found[row["model_key"]].append(
            Restriction(row["tenant"], round(row["count"] / WINDOW_S, 3), providers, regions)
        )
    return {model: tuple(rows) for model, rows in found.items()}


def _measured() -> dict[str, dict]:
    """Per model, the requests the gateways reported over the last WINDOW_S: count, mean prompt and output."""
    since = timezone.now() - timedelta(seconds=WINDOW_S)
    return {
        row["model_key"]: row
        for row in RequestOutcome.objects.filter(finished_at__gte=since, simulated=False)
        .values("model_key")
        .annotate(count=Count("id"), prompt=Avg("prompt_tokens"), output=Avg("completion_tokens"))
    }


def _sources(demands: list[Demand], measured: dict[str, dict]) -> dict[str, str]:
    """Where each model's lengths come from, and what was measured beside them, in words for the page."""
    sources = {}
    for d in demands:
        said = (
            f"lengths from the model's objective ({d.prompt_tokens} → {d.output_tokens} tokens),"
            " as its degradation level counts them"
        )
        seen = measured.get(d.model)
        if seen and seen["count"] >= MIN_MEASURED:
            prompt, output = round(seen["prompt"] or 0), round(seen["output"] or 0)
            said += f"; measured over the last {WINDOW_S // 60} min: {prompt} → {output} ({seen['count']} requests)"
            if prompt > d.prompt_tokens or output > d.output_tokens:
                said += (
                    ", longer than the objective: this plan and the level both count more capacity than the traffic"
                    " gets; raise the objective's lengths on the Capacity page"
                )
        sources[d.model] = said
    return sources


def what_if(servers: list[Server], add: dict | None, lose_racks: list[str]) -> list[Server]:
    """The fleet with `add` ({"gpu", "count", "gpus", "rack"}) servers more and `lose_racks` taken away."""
    racks = {s.rack for s in servers}
    for rack in lose_racks:
        if rack not in racks:
            raise PlacementError("lose_racks", f"there is no rack {rack!r}: the fleet's are {', '.join(sorted(racks))}")
    fleet = [s for s in servers if s.rack not in lose_racks]
    if add:
        gpu, count, per_server, rack = add.get("gpu", ""), add.get("count"), add.get("gpus", 8), add.get("rack") or ""
        if not isinstance(gpu, str) or gpu not in catalog.GPUS:
            raise PlacementError("add.gpu", f"{gpu!r} is not a catalog GPU: one of {', '.join(catalog.GPUS)}")
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_ADDED_SERVERS:
            raise PlacementError("add.count", f"{count!r}: add between 1 and {MAX_ADDED_SERVERS} servers")
        if isinstance(per_server, bool) or per_server not in (1, 2, 4, 8):
            raise PlacementError("add.gpus", f"{per_server!r}: a server has 1, 2, 4 or 8 GPUs")
        if not isinstance(rack, str) or len(rack) > 63 or rack != rack.strip():
            raise PlacementError("add.rack", f"{rack!r}: a rack name of at most 63 characters, no spaces around it")
        rack = rack or "rack-new"
        taken = {s.name for s in fleet}
        names = (f"new-{gpu.lower()}-{i}" for i in range(1, count + len(taken) + 1))
        fleet += [Server(name, gpu, per_server, rack) for name in [n for n in names if n not in taken][:count]]
    if not fleet:
        raise PlacementError("lose_racks", "no server would be left to plan for")
    return fleet


def overview() -> dict | None:
    """The current placement and the workload, without a plan (None when no node serves)."""
    nodes = list(plannable_nodes())
    servers, current = live_fleet(nodes)
    if not servers:
        return None
    measured = _measured()
    demands = live_demands({r.model for rs in current.values() for r in rs}, measured)
    return {
        "demands": [_demand_json(d) for d in demands],
        "sources": _sources(demands, measured),
        "current": _side(servers, current, demands, measured_slowdown(nodes)),
    }


def propose(
    add: dict | None = None,
    lose_racks: list[str] | None = None,
    evaluate: bool = True,
    nodes: list[Node] | None = None,
) -> dict:
    """The planner's placement for the live fleet (or the what-if one) against the current one, as JSON."""
    nodes = list(plannable_nodes()) if nodes is None else nodes
    servers, current = live_fleet(nodes)
    if not servers:
        raise PlacementError("fleet", "the registry has no serving node yet: start some nodes, then ask again")
    slowdown = measured_slowdown(nodes)
    models = {r.model for rs in current.values() for r in rs}
    measured = _measured()
    demands = live_demands(models, measured)
    fleet = what_if(servers, add, lose_racks or [])
    names = {s.name for s in fleet}
    kept = {name: replicas for name, replicas in current.items() if name in names}
    plan = planner.plan(fleet, demands, current=kept, time_limit_s=PLAN_TIME_LIMIT_S)
    result = {
        "generated_at": timezone.now().isoformat(),
        "what_if": {"add": add or None, "lose_racks": lose_racks or []},
        "demands": [_demand_json(d) for d in demands],
        "sources": _sources(demands, measured),
        "current": _side(servers, current, demands, slowdown),
        "proposed": _side(fleet, plan.assignment, demands, slowdown),
        "moves": [
            {
                "server": m.server,
                "stop": [dataclasses.asdict(r) for r in m.stop],
                "start": [dataclasses.asdict(r) for r in m.start],
            }
            for m in plan.moves
        ],
        "cost": _cost(plan),
        "solver": {
            "status": plan.status,
            "limited_by": plan.limited_by,
            "solve_s": round(plan.solve_s, 3),
            "gap": None if plan.status == "UNCHANGED" else plan.gap,
            "time_limit_s": PLAN_TIME_LIMIT_S,
        },
        "problems": plan.problems,
    }
    if evaluate:
        duration = _evaluation_s(demands)
        result["evaluation"] = {
            "simulated_s": duration,
            "current": _figures(servers, current, demands, duration),
            "proposed": _figures(fleet, plan.assignment, demands, duration),
        }
    return result


def measured_slowdown(nodes: list[Node]) -> dict[str, float]:
    """Per server, how much slower than the model its GPUs step now (the slowest of its nodes), as the degradation
    level measures it (capacity.slowdown_of); servers at full speed are left out."""
    live = hot.nodes([n.name for n in nodes])
    slowest: dict[str, float] = {}
    for node in nodes:
        entry = live.get(node.name)
        if entry is None:
            continue
        slow = capacity.slowdown_of(catalog.Deployment.of(node.model_key, node.gpu_key, node.tp), entry)
        server = node.server or node.name
        if slow > slowest.get(server, 1.0):
            slowest[server] = slow
    return slowest


def _side(servers, assignment, demands, slowdown: dict[str, float] | None = None) -> dict:
    """One placement as the page shows it: the matrix (model × GPU type and TP: replicas, GPUs) and capacities,
    counted by the degradation level's function, a server measured slow at its measured speed."""
    table = planner.allocation_of(assignment, servers)
    measures = planner.measure(servers, demands, assignment, slowdown=slowdown)
    return {
        "servers": len(servers),
        "gpus": sum(s.gpus for s in servers),
        "racks": sorted({s.rack for s in servers}),
        "matrix": {
            model: {
                f"{gpu} TP{tp}": {"replicas": count, "gpus": count * tp} for (gpu, tp), count in sorted(cells.items())
            }
            for model, cells in sorted(table.items())
        },
        "capacity_rps": measures.capacity_rps,
        "after_rack_loss_rps": measures.after_rack_loss_rps,
        # Per restricted tenant of a model, the capacity on the providers and regions it trusts.
        "trusted_rps": measures.trusted_rps,
    }


def _demand_json(demand: Demand) -> dict:
    """A demand as JSON: its restrictions' providers and regions as sorted lists."""
    data = dataclasses.asdict(demand)
    data["restrictions"] = [
        {**r, "providers": sorted(r["providers"]), "regions": sorted(r["regions"])} for r in data["restrictions"]
    ]
    return data


def _cost(plan: planner.Plan) -> dict:
    started = [r for m in plan.moves for r in m.start]
    loads = [catalog.load_time_s(catalog.model(r.model)) for r in started]
    return {
        "servers_changed": len(plan.moves),
        "replicas_stopped": sum(len(m.stop) for m in plan.moves),
        "replicas_started": len(started),
        "gpu_minutes_loading": round(sum(load * r.tp for load, r in zip(loads, started)) / 60, 2),
        "capacity_back_s": round(max(loads, default=0.0), 1),  # the servers load side by side: the slowest one
    }


def _evaluation_s(demands: list[Demand]) -> float:
    rate = sum(d.rate_rps for d in demands)
    return EVALUATION_S if rate * EVALUATION_S <= MAX_EVALUATED_REQUESTS else max(5.0, MAX_EVALUATED_REQUESTS / rate)


def _figures(servers, assignment, demands, duration_s: float) -> dict:
    return {m: f.to_json() for m, f in planning.evaluate(servers, assignment, demands, duration_s).items()}
