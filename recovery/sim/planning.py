"""A placement plan judged by the simulator: every replica a simulated node, every model's workload its requests.

recovery.policy.planner decides which model each GPU serves; this module answers what that placement does to
latency, throughput and SLO attainment per model, by running it through the same discrete-event simulator as
the experiments (continuous batching, chunked prefill, KV blocks, the roofline step times of workers.catalog),
so that two placements of one fleet (the planner's, a heuristic's, a published one) are compared by one judge.
It also measures one replica's capacity within a model's objectives by simulation, for the planner to plan with
(`simulated_capacities`), as document 004's scheduler is parameterised by its simulator.

Workloads are Poisson arrivals per model with prompt and output lengths drawn from Normal distributions of the
given means (standard deviation half the mean, at least one token, clipped to the context), as document 004's
placement experiment draws them; all of it is a model input, deterministic under the seed.
"""

import math
import random
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from recovery.policy.planner import Demand, Replica, Server, roofline_capacity
from recovery.sim.fleet import Simulation
from recovery.sim.metrics import percentile, request_metrics
from recovery.sim.scenario import NodeGroup, Scenario
from recovery.sim.workload import Arrivals, Request, SyntheticWorkload, clip_to_context
from workers import catalog

LENGTH_SD_SHARE = 0.5  # a length's standard deviation, as a share of its mean (document 004 gives no figure)
DEFAULT_DURATION_S = 60.0
NOMINAL_RPS = 0.01


@dataclass(frozen=True)
class ModelFigures:
    """What one model's requests got, all simulated."""

    model: str
    replicas: int
    gpus: int
    requests: int
    finished: int
    attainment: float  # share of requests finished within both latency objectives (unserved ones count against)
    throughput_rps: float  # requests finished per second of the workload's duration
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    e2e_mean_s: float | None

    def to_json(self) -> dict:
        return asdict(self)


def requests_for(demands: Sequence[Demand], duration_s: float, seed: int | str) -> list[Request]:
    """Every model's requests over `duration_s`, merged in arrival order."""
    requests = []
    for d in demands:
        if d.rate_rps <= 0:
            continue
        arrivals = random.Random(f"{seed}:{d.model}:arrivals")
        lengths = random.Random(f"{seed}:{d.model}:lengths")
        context = catalog.model(d.model).context_tokens
        t = arrivals.expovariate(d.rate_rps)
        while t < duration_s:
            prompt = max(1, round(lengths.gauss(d.prompt_tokens, d.prompt_tokens * LENGTH_SD_SHARE)))
            output = max(1, round(lengths.gauss(d.output_tokens, d.output_tokens * LENGTH_SD_SHARE)))
            requests.append(Request(t, d.model, *clip_to_context(prompt, output, context)))
            t += arrivals.expovariate(d.rate_rps)
    requests.sort(key=lambda r: (r.arrival_s, r.model))
    return requests


def scenario_for(
    servers: Sequence[Server], assignment: Mapping[str, Sequence[Replica]], demands: Sequence[Demand], duration_s: float
) -> Scenario:
    """The simulator's fleet for a placement: one node per replica, grouped by (model, GPU, TP, rack)."""
    by_name = {s.name: s for s in servers}
    counts: dict[tuple[str, str, int, str], int] = defaultdict(int)
    for name, replicas in assignment.items():
        for r in replicas:
            counts[(r.model, by_name[name].gpu, r.tp, by_name[name].rack)] += 1
    groups = tuple(
        NodeGroup(_group_name(model, gpu, tp, rack), count, model, gpu, tp, _name(rack))
        for (model, gpu, tp, rack), count in sorted(counts.items())
    )
    served = {g.model for g in groups}
    # The requests are passed to the simulation whole (requests_for); the scenario's workloads only name the
    # models, at a nominal rate where a model has none yet.
    workloads = tuple(
        SyntheticWorkload(d.model, Arrivals("poisson", max(d.rate_rps, NOMINAL_RPS)))
        for d in demands
        if d.model in served
    ) or (SyntheticWorkload(groups[0].model, Arrivals("poisson", NOMINAL_RPS)),)
    return Scenario(duration_s, groups, workloads, policies=("none",))


def evaluate(
    servers: Sequence[Server],
    assignment: Mapping[str, Sequence[Replica]],
    demands: Sequence[Demand],
    duration_s: float = DEFAULT_DURATION_S,
    seed: int = 1,
) -> dict[str, ModelFigures]:
    """Run the placement through the simulator (no faults, checkpoints off: placement alone) and give each model's
    figures. A model with no replica gets its requests counted, none served."""
    requests = requests_for(demands, duration_s, seed)
    scenario = scenario_for(servers, assignment, demands, duration_s)
    served = set(scenario.models)
    sim = Simulation(
        scenario, "none", seed, faults=False, requests=[r for r in requests if r.model in served], fast=True
    )
    sim.run()
    by_model = defaultdict(list)
    for flight in sim.flights:
        by_model[flight.request.model].append(request_metrics(flight))
    gpus_of = {s.name: s for s in servers}
    arrived = Counter(r.model for r in requests)
    figures = {}
    for d in demands:
        metrics = by_model.get(d.model, [])
        total = arrived[d.model]
        finished = [m for m in metrics if m.e2e_s is not None]
        within = [
            m
            for m in finished
            if m.ttft_s is not None
            and m.ttft_s * 1000 <= d.ttft_ms
            and (m.tpot_s is None or m.tpot_s * 1000 <= d.tpot_ms)
        ]
        done_in_time = [m for m in finished if m.arrival_s + (m.e2e_s or 0) <= duration_s]
        replicas = [(gpus_of[name], r) for name, rs in assignment.items() for r in rs if r.model == d.model]
        ttfts = [m.ttft_s for m in finished if m.ttft_s is not None]
        tpots = [m.tpot_s for m in finished if m.tpot_s is not None]
        figures[d.model] = ModelFigures(
            model=d.model,
            replicas=len(replicas),
            gpus=sum(r.tp for _, r in replicas),
            requests=total,
            finished=len(finished),
            attainment=len(within) / total if total else 1.0,
            throughput_rps=len(done_in_time) / duration_s,
            output_tokens_per_s=sum(m.output_tokens for m in done_in_time) / duration_s,
            ttft_p50_s=percentile(ttfts, 50),
            ttft_p99_s=percentile(ttfts, 99),
            tpot_p50_s=percentile(tpots, 50),
            tpot_p99_s=percentile(tpots, 99),
            e2e_mean_s=sum(m.e2e_s or 0.0 for m in finished) / len(finished) if finished else None,
        )
    return figures


def simulated_capacity(
    demand: Demand,
    gpu: str,
    tp: int,
    target: float = 0.95,
    duration_s: float = 30.0,
    seed: int = 1,
    guess_rps: float | None = None,
) -> float:
    """The highest request rate one replica of `demand.model` on `tp` `gpu`s serves with at least `target` of its
    requests within the objectives, found by the simulator (a bisection over the rate; 0 where the model does
    not fit, or misses the objectives even when nearly idle)."""
    try:
        catalog.Deployment.of(demand.model, gpu, tp)
    except catalog.CatalogError:
        return 0.0
    server = [Server("probe", gpu, tp)]
    placement = {"probe": (Replica(demand.model, tp),)}

    def attains(rate: float) -> bool:
        probe = Demand(demand.model, rate, demand.prompt_tokens, demand.output_tokens, demand.ttft_ms, demand.tpot_ms)
        return evaluate(server, placement, [probe], duration_s, seed)[demand.model].attainment >= target

    low = 1.0 / duration_s * 4  # a handful of requests: below this the figure says nothing
    if not attains(low):
        return 0.0
    high = max(guess_rps or low * 2, low * 2)
    while attains(high):
        low, high = high, high * 2
        if high > 1e4:
            return low
    for _ in range(6):  # to within about 2 % of the bracket
        mid = math.sqrt(low * high)
        low, high = (mid, high) if attains(mid) else (low, mid)
    return low


def simulated_capacities(
    demands: Sequence[Demand], gpus: Sequence[tuple[str, int]], **kwargs
) -> dict[tuple[str, str, int], float]:
    """simulated_capacity for every (model, GPU type, TP) a planner may use on servers of these (type, GPU count)
    pairs: a table to plan with (`capacity=table_capacity(table)`)."""
    table = {}
    for d in demands:
        for gpu, count in sorted(set(gpus)):
            for tp in catalog.TP_DEGREES:
                if tp <= count and (d.model, gpu, tp) not in table:
                    guess = roofline_capacity(d, gpu, tp) or None
                    table[(d.model, gpu, tp)] = simulated_capacity(d, gpu, tp, guess_rps=guess, **kwargs)
    return table


def table_capacity(table: Mapping[tuple[str, str, int], float]):
    """A planner capacity function reading a table of (model, GPU type, TP) -> requests/s."""

    def capacity(demand: Demand, gpu: str, tp: int) -> float:
        return table.get((demand.model, gpu, tp), 0.0)

    return capacity


def _name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "x"


def _group_name(model: str, gpu: str, tp: int, rack: str) -> str:
    return _name(f"{model}.{gpu}.tp{tp}.{rack}")
