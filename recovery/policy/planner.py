"""Which model each GPU serves, at which tensor-parallel degree, on which node (source document 004 §3.3).

Document 004 (LLMFabric) decides per model an allocation matrix A (GPUs of each type) and a parallelism
strategy P (data-parallel replicas × tensor-parallel degree per type), with constraint programming over a
simulator's estimates, under three constraints: no GPU type over-allocated (its eq. 2), a replica's GPUs hold its
weights and KV cache (eq. 3), a type's GPUs split exactly into replicas of one TP degree each (eq. 4). Lifeline
plans the same decision for a fleet it must also keep up through failures, so the plan here also:

- puts every replica on a concrete server (a replica's GPUs lie within one server, as tensor parallelism needs);
- spreads each model across racks so that losing any one rack leaves it its demand where the fleet allows;
- keeps tenants restricted to trusted providers or regions within them, with enough capacity there;
- moves as few replicas as it can from the current placement (each move is a drain and a cold load).

The solver sees the fleet as pools of interchangeable servers (same GPU type and count, provider, region, and
rack while there are at most EXACT_POOLS such groups), so its size grows with the fleet's variety, not its node
count. Where pools span racks (large fleets), it counts a rack's loss as the loss of that rack's share of each
pool's replicas of a model plus one (the spread the assignment then makes, rounded against the plan). The pools'
replicas are put on servers largest first, each on a server that runs it now where one has room (no move), else in
the rack that has least of that model so far.

A replica's capacity (requests per second within the model's latency objectives) comes from `capacity`: the
roofline capacity model of document 003 by default (recovery.policy.capacity.node_capacity), or a table measured
by the simulator (recovery.sim.planning.simulated_capacities). The solver's objective, in order of weight: the
least share of its demand any model has capacity for (when the fleet cannot carry all of it, no model is given up
so that the others are served more), demand within capacity (SLO attainment), demand within capacity after the
worst rack's loss, the trusted providers' share; then headroom, capacity over demand up to HEADROOM (2×), the
least of it among models first (spare capacity where the tightest model needs it, which is what keeps queueing
latency down; GPUs beyond that stay free as spares); then fewer moves. The solver first reaches the objectives,
then all of it from that plan.

Nothing here imports Django: the control plane, the console and the simulator call the same function.
"""

import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from ortools.sat.python import cp_model

from recovery.policy.capacity import Slo, node_capacity
from workers import catalog

PER_MILLE = 1000
MAX_RATIO = 20 * PER_MILLE  # the most capacity over demand the solver counts
# Headroom counts up to this (2×: room for a burst of twice the rate, or for a rack's loss and then some); GPUs a
# plan does not need to get every model there stay free, as spares, rather than padding a model that has enough.
HEADROOM = 2 * PER_MILLE
DEFAULT_TIME_LIMIT_S = 5.0
# The objective's weights: each term outweighs everything below it (the terms below it are bounded in practice).
W_SERVED, W_RACK, W_TRUSTED, W_BALANCE = 100_000, 10_000, 10_000, 10
# The solver's deterministic work units per second of wall clock, measured on this machine's quiet cores (2 cores,
# one worker): a solve that stops on work stops at the same point on any machine, loaded or not.
WORK_PER_SECOND = 0.4
# A replica started or stopped, against the headroom term (W_BALANCE per per mille of a model's headroom, and as
# much again times the number of models for the least one's): at leisure a move must buy 1 % of one model's
# headroom; re-planning during an incident (REPLAN_MOVE_WEIGHT), 10 %: bring every model back within its
# objectives, otherwise leave nodes where they are.
MOVE_WEIGHT = 100
REPLAN_MOVE_WEIGHT = 1000
# A plan proven within one per mille of one model's headroom of the best, and within one move, is good enough.
GAP_LIMIT = W_BALANCE
FIRST_SHARE = 0.6  # of the limits, for the first solve (the objectives)
EXACT_POOLS = 150  # up to this many (GPU type, size, provider, region, rack) groups, the solver sees racks exactly


class PlanError(ValueError):
    """A fleet or workload the planner cannot read: says which field and what to do."""


@dataclass(frozen=True)
class Server:
    """A machine: `gpus` GPUs of one catalog type, in a rack, run by a provider in a region."""

    name: str
    gpu: str
    gpus: int = 8
    rack: str = "rack-1"
    provider: str = ""
    region: str = ""
    # The tensor-parallel degrees its replicas may take; empty: any that fits. A live server whose nodes are
    # started with a fixed degree (a node switches model, never its degree) is planned at that degree.
    tps: tuple[int, ...] = ()


@dataclass(frozen=True, order=True)
class Replica:
    """One serving node: a model on `tp` GPUs of one server."""

    model: str
    tp: int = 1


@dataclass(frozen=True)
class Restriction:
    """Tenants of a model that trust only some providers or regions (document 004's trusted providers): their
    `rps` must be served on servers whose provider or region is listed."""

    tenant: str
    rps: float
    providers: frozenset[str] = frozenset()
    regions: frozenset[str] = frozenset()

    def trusts(self, server: Server) -> bool:
        return server.provider in self.providers or server.region in self.regions


@dataclass(frozen=True)
class Demand:
    """A model's workload and its latency objectives (document 004's w_m = ⟨λ, μ_in, μ_out⟩)."""

    model: str
    rate_rps: float
    prompt_tokens: int = 512  # means
    output_tokens: int = 256
    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0
    restrictions: tuple[Restriction, ...] = ()

    @property
    def slo(self) -> Slo:
        return Slo(self.ttft_ms, self.tpot_ms, self.rate_rps, self.prompt_tokens, self.output_tokens)


Capacity = Callable[[Demand, str, int], float]  # (demand, GPU type, TP) -> requests/s one replica sustains


def roofline_capacity(demand: Demand, gpu: str, tp: int, slowdown: float = 1.0) -> float:
    """Document 003's capacity model: the requests per second one replica completes within the objectives (0
    where the model does not fit that many GPUs of that type, or misses the objectives even alone). It is the
    degradation level's own function (recovery.policy.capacity.node_capacity), `slowdown` included: a replica on
    a GPU measured slower than the model counts what the level counts for it."""
    try:
        deployment = catalog.Deployment.of(demand.model, gpu, tp)
    except catalog.CatalogError:
        return 0.0
    if deployment.max_context_tokens < demand.prompt_tokens + demand.output_tokens:
        return 0.0
    return node_capacity(deployment, demand.slo, slowdown=slowdown).rps


@dataclass(frozen=True)
class Move:
    """What changes on one server: replicas stopped (drained) and started (cold-loaded)."""

    server: str
    stop: tuple[Replica, ...]
    start: tuple[Replica, ...]


@dataclass
class Plan:
    """The planner's answer. `assignment` is every server's replicas; `problems` says, in words, every objective
    the plan cannot meet and why (an empty list: all are met)."""

    assignment: dict[str, tuple[Replica, ...]]
    capacity_rps: dict[str, float]  # per model
    after_rack_loss_rps: dict[str, float]  # per model: its capacity after the worst rack for it is lost
    trusted_rps: dict[str, float]  # per "tenant on model": capacity on the servers it trusts
    moves: list[Move]
    status: str  # OPTIMAL (proven within the gap limit), FEASIBLE (a limit came first: see gap), UNCHANGED (none)
    objective: float
    bound: float
    solve_s: float  # the whole call: building the model, solving to the limit or a proof, assigning
    found_s: float  # from the call's start to the plan's solution (the rest of solve_s went to proving it)
    limited_by: str  # "" (proven optimal), "work" (reproducible) or "time" (the wall clock: may differ when rerun)
    first_gap: float  # the objectives' own gap (the first of the two solves), relative to their bound
    problems: list[str] = field(default_factory=list)

    @property
    def gap(self) -> float:
        """The optimality gap: how far the objective may be from the best possible one, relative to that bound
        (OPTIMAL: within GAP_LIMIT, and within one move, of it, proven)."""
        if self.status == "UNCHANGED":
            return math.nan
        return max(self.first_gap, abs(self.bound - self.objective) / max(abs(self.bound), 1e-9))

    @property
    def replicas_started(self) -> int:
        return sum(len(m.start) for m in self.moves)


def allocation_of(plan_or_assignment, servers: Sequence[Server]) -> dict[str, Counter]:
    """Per model, the number of replicas per (GPU type, TP degree): document 004's allocation matrix with its
    parallelism (a_{m,n} = replicas × TP for each (GPU type, TP) pair)."""
    assignment = plan_or_assignment.assignment if isinstance(plan_or_assignment, Plan) else plan_or_assignment
    gpu_of = {s.name: s.gpu for s in servers}
    table: dict[str, Counter] = defaultdict(Counter)
    for name, replicas in assignment.items():
        for replica in replicas:
            table[replica.model][(gpu_of[name], replica.tp)] += 1
    return dict(table)


# --- Pools: interchangeable servers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Pool:
    gpu: str
    gpus: int
    provider: str
    region: str
    rack: str  # "" where the pool spans racks
    tps: tuple[int, ...]
    servers: tuple[Server, ...]

    def share(self, rack: str) -> float:
        return sum(s.rack == rack for s in self.servers) / len(self.servers)


def _pools(servers: Sequence[Server]) -> list[_Pool]:
    """Servers grouped by what the solver tells apart; by rack too while that keeps the model small (EXACT_POOLS),
    so that a rack's loss is counted exactly, not by its share."""
    by_rack = len({(s.gpu, s.gpus, s.provider, s.region, s.rack, s.tps) for s in servers}) <= EXACT_POOLS
    groups: dict[tuple[str, int, str, str, str, tuple[int, ...]], list[Server]] = defaultdict(list)
    for s in servers:
        groups[(s.gpu, s.gpus, s.provider, s.region, s.rack if by_rack else "", s.tps)].append(s)
    return [_Pool(*key, tuple(sorted(group, key=lambda s: s.name))) for key, group in sorted(groups.items())]


def _check(servers: Sequence[Server], demands: Sequence[Demand], current: Mapping[str, Iterable[Replica]]) -> None:
    names = Counter(s.name for s in servers)
    if dup := [n for n, c in names.items() if c > 1]:
        raise PlanError(f"servers named twice: {', '.join(sorted(dup)[:5])}; give every server its own name")
    for s in servers:
        catalog.gpu(s.gpu)  # CatalogError names the types there are
        if s.gpus < 1:
            raise PlanError(f"server {s.name}: gpus is {s.gpus}; a server has at least one GPU")
    models = Counter(d.model for d in demands)
    if dup := [m for m, c in models.items() if c > 1]:
        raise PlanError(f"models with two workloads: {', '.join(sorted(dup))}; give each model one workload")
    for d in demands:
        catalog.model(d.model)
        if not (d.rate_rps >= 0 and math.isfinite(d.rate_rps)):
            raise PlanError(f"{d.model}: rate_rps is {d.rate_rps}; a request rate is a finite number ≥ 0")
        if d.prompt_tokens < 1 or d.output_tokens < 1:
            raise PlanError(f"{d.model}: prompt and output lengths are at least one token")
        for r in d.restrictions:
            if r.rps < 0 or r.rps > d.rate_rps:
                raise PlanError(
                    f"{d.model}, tenant {r.tenant}: its {r.rps} req/s is not within 0 and the model's "
                    f"{d.rate_rps} req/s"
                )
    known = set(names)
    for name, replicas in current.items():
        if name not in known:
            raise PlanError(f"the current placement names server {name!r}, which the fleet does not have")
        gpus = next(s.gpus for s in servers if s.name == name)
        if sum(r.tp for r in replicas) > gpus:
            raise PlanError(f"the current placement puts more GPUs on {name} than its {gpus}")


def _tp_options(gpus: int, tps: tuple[int, ...] = ()) -> list[int]:
    return [tp for tp in catalog.TP_DEGREES if tp <= gpus and (not tps or tp in tps)]


# --- The solve --------------------------------------------------------------------------------------------------------
def plan(
    servers: Sequence[Server],
    demands: Sequence[Demand],
    current: Mapping[str, Iterable[Replica]] | None = None,
    *,
    capacity: Capacity = roofline_capacity,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    seed: int = 0,
    workers: int = 1,
    move_weight: int = MOVE_WEIGHT,
    rack_spread: bool = True,
    work_limit: float | None = None,
) -> Plan:
    """Plan the fleet's placement for `demands`, starting from `current` (server name → its replicas).

    Reproducible: the same inputs, seed and worker count give the same plan whenever the solve ends by proving
    its plan optimal or by its work limit (`work_limit`, the solver's deterministic time; by default what a
    quiet core of this machine does in `time_limit_s`), not by the wall clock: `Plan.limited_by` says which."""
    now: dict[str, tuple[Replica, ...]] = {name: tuple(replicas) for name, replicas in (current or {}).items()}
    _check(servers, demands, now)
    started = time.perf_counter()
    problems: list[str] = []
    pools = _pools(servers)
    pool_of = {s.name: i for i, p in enumerate(pools) for s in p.servers}
    racks = sorted({s.rack for s in servers})
    # Racks with the same share of every pool lose the same capacity: one constraint stands for all of them.
    rack_shares = sorted({tuple(round(p.share(rack) * PER_MILLE) for p in pools) for rack in racks})

    # Coefficients: one replica's capacity per (model, GPU type, TP), milli-requests per second.
    rps: dict[tuple[str, str, int], float] = {}
    for d in demands:
        for gpu_key, gpus, tps in sorted({(p.gpu, p.gpus, p.tps) for p in pools}):
            for tp in _tp_options(gpus, tps):
                if (d.model, gpu_key, tp) not in rps:
                    rps[(d.model, gpu_key, tp)] = capacity(d, gpu_key, tp)
    cap = {key: int(value * PER_MILLE) for key, value in rps.items()}  # the solver's integers
    for d in demands:
        if d.rate_rps > 0 and not any(v > 0 for (m, _, _), v in cap.items() if m == d.model):
            problems.append(_fits_nowhere(d, pools))

    model = cp_model.CpModel()
    n: dict[tuple[str, int, int], cp_model.IntVar] = {}  # (model, tp, pool) -> replicas
    most: dict[tuple[str, int, int], int] = {}
    current_counts: Counter = Counter()
    for name, replicas in now.items():
        for r in replicas:
            current_counts[(r.model, r.tp, pool_of[name])] += 1
    for i, p in enumerate(pools):
        for d in demands:
            kept_tps = {t for (m, t, j) in current_counts if j == i and m == d.model}
            for tp in sorted(set(_tp_options(p.gpus, p.tps)) | kept_tps):
                if cap.get((d.model, p.gpu, tp), 0) > 0 or current_counts[(d.model, tp, i)]:
                    most[(d.model, tp, i)] = len(p.servers) * (p.gpus // tp)
                    n[(d.model, tp, i)] = model.new_int_var(0, most[(d.model, tp, i)], f"n_{d.model}_{tp}_{i}")
    used = {}  # (model, tp, pool spanning racks) -> whether the pool runs any such replica (the rack bound's +1)
    for key, var in n.items():
        if not pools[key[2]].rack:
            used[key] = model.new_bool_var(f"used_{key[0]}_{key[1]}_{key[2]}")
            model.add(var <= most[key] * used[key])
    # Each pool's GPUs hold its replicas, packed server by server: replicas of TP ≥ t use at most
    # ⌊gpus/t⌋·t GPUs of each server (with power-of-two degrees this is exactly what packs).
    for i, p in enumerate(pools):
        for t in _tp_options(p.gpus):
            terms = [var * tp for (m, tp, j), var in n.items() if j == i and tp >= t]
            if terms:
                model.add(sum(terms) <= len(p.servers) * (p.gpus // t) * t)

    def capacity_expr(model_key: str, pool_filter: Callable[[_Pool], bool]) -> cp_model.LinearExprT:
        return sum(
            var * cap.get((m, pools[i].gpu, tp), 0)
            for (m, tp, i), var in n.items()
            if m == model_key and pool_filter(pools[i])
        )

    objective: list[cp_model.LinearExprT] = []
    served: dict[str, cp_model.IntVar] = {}
    headroom_terms: list[cp_model.IntVar] = []
    balance = model.new_int_var(0, HEADROOM, "balance")  # the least headroom among models
    fair = model.new_int_var(0, PER_MILLE, "fair")  # the least share of its demand any model gets capacity for
    for d in demands:
        demand_m = max(1, round(d.rate_rps * PER_MILLE))
        total = capacity_expr(d.model, lambda p: True)
        ratio = model.new_int_var(0, MAX_RATIO, f"ratio_{d.model}")  # ≤ capacity / demand, per mille
        model.add(ratio * demand_m <= total * PER_MILLE)
        served[d.model] = model.new_int_var(0, PER_MILLE, f"served_{d.model}")
        model.add(served[d.model] <= ratio)
        objective.append(W_SERVED * served[d.model])
        if d.rate_rps > 0:
            model.add(fair <= served[d.model])
            model.add(balance <= ratio)
            headroom = model.new_int_var(0, HEADROOM, f"headroom_{d.model}")
            model.add(headroom <= ratio)
            headroom_terms.append(headroom)
        if rack_spread and len(racks) > 1 and d.rate_rps > 0:
            survives = model.new_int_var(0, PER_MILLE, f"rack_{d.model}")
            for shares in rack_shares:
                # The assignment spreads a pool's n replicas over its racks, so a rack with share σ of the pool's
                # servers holds at most about nσ + 1 of them (+1 only where n > 0, and only where σ > 0).
                left = sum(
                    cap.get((m, pools[i].gpu, tp), 0)
                    * (
                        var * (PER_MILLE - shares[i])
                        - (PER_MILLE * used[(m, tp, i)] if shares[i] and not pools[i].rack else 0)
                    )
                    for (m, tp, i), var in n.items()
                    if m == d.model
                )
                model.add(survives * demand_m <= left)
            objective.append(W_RACK * survives)
        for k, restriction in enumerate(d.restrictions):
            if restriction.rps <= 0:
                continue
            trusted = model.new_int_var(0, PER_MILLE, f"trusted_{d.model}_{k}")
            inside = capacity_expr(d.model, partial(_pool_trusted, restriction))
            model.add(trusted * max(1, round(restriction.rps * PER_MILLE)) <= inside * PER_MILLE)
            objective.append(W_TRUSTED * trusted)
    objective.append(W_SERVED * len(demands) * fair)  # no model starved so that others are served more
    # The objectives themselves; what follows only chooses among plans that meet them alike.
    major: cp_model.LinearExprT = sum(objective)
    objective.append(W_BALANCE * (len(demands) * balance + sum(headroom_terms)))
    # Moves, from a placement: replicas started in a pool beyond what it runs now (each a cold load) and replicas
    # stopped (each a drain). A plan from nothing counts none: everything in it starts.
    moves = []
    for key, var in n.items():
        running = current_counts[key]
        model.add_hint(var, running)
        if running or any(now.values()):
            added = model.new_int_var(0, most[key], f"add_{key[0]}_{key[1]}_{key[2]}")
            model.add(added >= var - running)
            removed = model.new_int_var(0, running, f"remove_{key[0]}_{key[1]}_{key[2]}")
            model.add(removed >= running - var)
            moves += [added, removed]
    moved = move_weight * sum(moves)
    objective.append(-moved)

    # Two solves: the objectives first (demand served, fairly, surviving a rack, trusted), then all of it (the
    # balance and the moves too) from that plan. One solve of all of it spent its time on the balance and could
    # end with a model left in one rack; the weights keep the second from trading an objective for balance.
    found = _Found()
    work = time_limit_s * WORK_PER_SECOND if work_limit is None else work_limit
    deadline = time.perf_counter() + time_limit_s
    # From a placement, the moves count from the start: of the plans that meet the objectives alike, the nearest.
    from_placement = any(now.values())
    model.maximize(sum([major, -moved]) if from_placement else major)
    gap_limit = min(GAP_LIMIT, move_weight) if from_placement else GAP_LIMIT  # within one move of the best
    first, solver = _solve(model, found, seed, workers, work * FIRST_SHARE, time_limit_s * FIRST_SHARE, gap_limit)
    first_gap = 0.0
    limited_by = ""
    status = first
    if first in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        first_gap = abs(solver.best_objective_bound - solver.objective_value) / max(abs(solver.best_objective_bound), 1)
        if first == cp_model.FEASIBLE:
            limited_by = "time" if solver.wall_time >= time_limit_s * FIRST_SHARE * 0.98 else "work"
        model.clear_hints()
        for var in n.values():
            model.add_hint(var, solver.value(var))
        counts = {key: solver.value(var) for key, var in n.items()}
        objective_value, bound = solver.objective_value, solver.best_objective_bound
        model.maximize(sum(objective))
        left_s = max(deadline - time.perf_counter(), 0.01)
        second, solver = _solve(model, found, seed, workers, work * (1 - FIRST_SHARE), left_s, gap_limit)
        if second in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            status = second if first == cp_model.OPTIMAL else cp_model.FEASIBLE
            counts = {key: solver.value(var) for key, var in n.items()}
            objective_value, bound = solver.objective_value, solver.best_objective_bound
            if second == cp_model.FEASIBLE and not limited_by:
                limited_by = "time" if solver.wall_time >= left_s * 0.98 else "work"
        status_name = "OPTIMAL" if status == cp_model.OPTIMAL else "FEASIBLE"
    else:  # no solution within the limit: the current placement stands
        counts = dict(current_counts)
        first_gap = math.nan
        status_name, objective_value, bound = "UNCHANGED", math.nan, math.nan
        limited_by = "time"
        problems.append(f"no plan found within the {time_limit_s:g} s time limit: the current placement stands")

    assignment = _assign(pools, counts, now)
    measures = _measures(servers, demands, assignment, rps)
    result = Plan(
        assignment=assignment,
        capacity_rps=measures.capacity_rps,
        after_rack_loss_rps=measures.after_rack_loss_rps,
        trusted_rps=measures.trusted_rps,
        moves=_moves(servers, now, assignment),
        status=status_name,
        objective=objective_value,
        bound=bound,
        solve_s=time.perf_counter() - started,
        found_s=(found.at - started) if found.at else math.nan,
        first_gap=first_gap,
        limited_by=limited_by,
        problems=problems,
    )
    for d in demands:
        have = result.capacity_rps[d.model]
        if d.rate_rps > 0 and have < d.rate_rps * (1 - 1e-9) and not any(d.model in p for p in problems):
            problems.append(
                f"{d.model}: demand {d.rate_rps:g} req/s is above the {have:.1f} req/s the fleet can give it "
                "within its latency objectives beside the other models: the plan is the best partial one"
            )
        for restriction in d.restrictions:
            have = result.trusted_rps[trust_key(restriction, d)]
            if restriction.rps > 0 and have < restriction.rps * (1 - 1e-9):
                problems.append(
                    f"{d.model}, tenant {restriction.tenant}: {restriction.rps:g} req/s must stay within its "
                    f"trusted providers and regions, which can give it {have:.1f} req/s"
                )
    return result


def _pool_trusted(restriction: Restriction, pool: _Pool) -> bool:
    return restriction.trusts(pool.servers[0])  # a pool's servers share provider and region


def _solve(model, found, seed: int, workers: int, work: float, wall_s: float, gap_limit: float):
    solver = cp_model.CpSolver()
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = workers
    # Two limits: the solver's own work units (deterministic: the same inputs stop at the same point, so the plan
    # is reproducible) and the wall clock (a busy machine still answers in time, possibly with another plan).
    solver.parameters.max_deterministic_time = work
    solver.parameters.max_time_in_seconds = wall_s
    solver.parameters.absolute_gap_limit = gap_limit
    return solver.solve(model, found), solver


class _Found(cp_model.CpSolverSolutionCallback):
    """When the solver found its last (best) solution."""

    def __init__(self) -> None:
        super().__init__()
        self.at = 0.0

    def on_solution_callback(self) -> None:
        self.at = time.perf_counter()


def _fits_nowhere(d: Demand, pools: Sequence[_Pool]) -> str:
    weights_gb = catalog.model(d.model).weight_bytes / catalog.GB
    largest = max((catalog.gpu(p.gpu).memory_gb * p.gpus, p.gpu, p.gpus) for p in pools) if pools else None
    where = f"; the most memory one server has is {largest[0]:g} GB ({largest[2]}x {largest[1]})" if largest else ""
    return (
        f"{d.model} fits on no available GPU type at any tensor-parallel degree within its objectives "
        f"(TTFT {d.ttft_ms:g} ms, TPOT {d.tpot_ms:g} ms): {weights_gb:.0f} GB of weights plus its KV cache{where}"
    )


# --- Replicas onto servers --------------------------------------------------------------------------------------------
def _assign(
    pools: Sequence[_Pool], counts: Mapping[tuple[str, int, int], int], current: Mapping[str, tuple[Replica, ...]]
) -> dict[str, tuple[Replica, ...]]:
    """Put each pool's replicas on its servers: largest first, each on a server that runs that replica now if one
    has room (it stays: no move), else in the rack with the fewest GPUs of that model so far, on its fullest
    server with room (best fit keeps whole servers whole). With degrees that divide each other, a server's free
    GPUs stay a multiple of the degree being placed, so any server with room will do and this packs whatever the
    pool constraints admit."""
    assignment: dict[str, list[Replica]] = {}
    in_rack: Counter = Counter()  # (model, rack) -> GPUs
    for i, p in enumerate(pools):
        rack_of = {s.name: s.rack for s in p.servers}
        free = {s.name: s.gpus for s in p.servers}
        placed: dict[str, list[Replica]] = {s.name: [] for s in p.servers}
        unmatched = {s.name: Counter(current.get(s.name, ())) for s in p.servers}
        wanted = sorted(
            ((m, tp) for (m, tp, j), c in counts.items() if j == i for _ in range(c)), key=lambda r: (-r[1], r[0])
        )
        for m, tp in wanted:
            replica = Replica(m, tp)
            fits = [s.name for s in p.servers if free[s.name] >= tp]
            if not fits:
                raise AssertionError(f"pool {p.gpu}/{p.provider}: {replica} does not pack (a planner bug)")
            staying = [name for name in fits if unmatched[name][replica] > 0]
            if staying:
                name = staying[0]
                unmatched[name][replica] -= 1
            else:
                name = min(fits, key=lambda n: (in_rack[(m, rack_of[n])], free[n], n))
            placed[name].append(replica)
            free[name] -= tp
            in_rack[(m, rack_of[name])] += tp
        assignment.update(placed)
    return {name: tuple(sorted(replicas)) for name, replicas in sorted(assignment.items())}


def _moves(
    servers: Sequence[Server], current: Mapping[str, tuple[Replica, ...]], assignment: Mapping[str, tuple[Replica, ...]]
) -> list[Move]:
    moves = []
    for s in servers:
        before, after = Counter(current.get(s.name, ())), Counter(assignment.get(s.name, ()))
        stop, start = before - after, after - before
        if stop or start:
            moves.append(Move(s.name, tuple(sorted(stop.elements())), tuple(sorted(start.elements()))))
    return moves


@dataclass(frozen=True)
class Measures:
    """What a placement gives each model: capacity, capacity after the worst rack's loss, trusted capacity."""

    capacity_rps: dict[str, float]
    after_rack_loss_rps: dict[str, float]
    trusted_rps: dict[str, float]


def measure(
    servers: Sequence[Server],
    demands: Sequence[Demand],
    assignment: Mapping[str, Iterable[Replica]],
    capacity: Capacity = roofline_capacity,
    slowdown: Mapping[str, float] | None = None,
) -> Measures:
    """The capacities of any placement (the current one, a heuristic's), counted as a plan's are. `slowdown` (by
    server, ≥ 1) counts a server measured slower than the model at what it runs now, through roofline_capacity."""
    slowdown = slowdown or {}
    rps = {}
    gpu_of = {s.name: s.gpu for s in servers}
    for d in demands:
        for name, replicas in assignment.items():
            slow = slowdown.get(name, 1.0)
            for r in replicas:
                key = _key(d.model, gpu_of[name], r.tp, slow)
                if r.model == d.model and key not in rps:
                    rps[key] = (
                        capacity(d, gpu_of[name], r.tp)
                        if slow == 1.0
                        else roofline_capacity(d, gpu_of[name], r.tp, slowdown=slow)
                    )
    return _measures(servers, demands, assignment, rps, slowdown)


def _key(model: str, gpu: str, tp: int, slow: float) -> tuple:
    return (model, gpu, tp) if slow == 1.0 else (model, gpu, tp, slow)


def _measures(
    servers: Sequence[Server],
    demands: Sequence[Demand],
    assignment: Mapping[str, Iterable[Replica]],
    rps: Mapping,
    slowdown: Mapping[str, float] | None = None,
) -> Measures:
    slowdown = slowdown or {}
    by_name = {s.name: s for s in servers}
    replicas = [(by_name[name], r) for name, rs in assignment.items() for r in rs]
    racks = sorted({s.rack for s in servers})
    result = Measures({}, {}, {})
    for d in demands:
        mine = [
            (s, rps.get(_key(d.model, s.gpu, r.tp, slowdown.get(s.name, 1.0)), 0.0))
            for s, r in replicas
            if r.model == d.model
        ]
        total = sum(c for _, c in mine)
        result.capacity_rps[d.model] = total
        lost = max((sum(c for s, c in mine if s.rack == rack) for rack in racks), default=0.0)
        result.after_rack_loss_rps[d.model] = total - lost if len(racks) > 1 else 0.0
        for restriction in d.restrictions:
            result.trusted_rps[trust_key(restriction, d)] = sum(c for s, c in mine if restriction.trusts(s))
    return result


def trust_key(restriction: Restriction, demand: Demand) -> str:
    return f"{restriction.tenant} on {demand.model}"
