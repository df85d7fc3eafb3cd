"""The placement planner (recovery.policy.planner), measured: document 004's Table 1 setting, its solve time at
scale, and re-planning after a rack is lost. Writes benchmarks/results/placement.json.

1. Table 1 (document 004, LLMFabric): Llama-2-13B, CodeLlama-34B and Llama-3.3-70B at 110 : 185.5 : 221 req/s on
   the fleet its two placements use (32 GH200 in servers of 4, 24 A100-80GB in servers of 8; two racks). The
   placements, each run through the same simulator (recovery.sim.planning.evaluate: Poisson arrivals, Normal
   lengths, 60 s): the planner's; memP, the memory-proportional heuristic the paper compares with (GPUs in
   proportion to rate × parameters, the largest model taking the fastest GPUs first); and LLMFabric's published
   placement (Table 1, "Ours"); and the planner again with each replica's capacity measured by the simulator (a
   bisection over short single-replica runs, recovery.sim.planning.simulated_capacities) instead of the roofline
   capacity model. Neither published row gives tensor-parallel degrees: each (model, GPU type) runs
   at the degree the capacity model rates best per GPU among those that divide its GPU count.

   The offered load, the same for every placement and set before any placement is made (`offered_load`): the
   published rates are far above what 56 GPUs serve under the catalog's roofline (Llama-3.3-70B alone at 221 req/s
   would need well over a hundred GH200), so they are scaled by one factor, keeping their ratio, to
   FLEET_LOAD_SHARE of the fleet's capacity computed without any placement: each model's per-GPU capacity (document
   003's roofline capacity model on the catalog's deployments, recovery.policy.capacity.node_capacity, at the TP
   degree best per GPU that fits a server) averaged over the fleet's GPUs, and the published ratio scaled until
   its GPU-seconds per second fill every GPU of the fleet (as if every GPU served each model's share of the work;
   no placement, no integer replicas). The factor, the per-GPU capacities and the fleet's capacity are in the
   results. The same comparison is repeated at each of LOAD_SWEEP's shares of that capacity ("load_sweep"), as the
   ranking depends on how close to capacity the fleet runs.

   Before this (LOAD_SHARE = 0.9, now FLEET_LOAD_SHARE with another reference), the load was 0.9 of the most the
   planner's own placement carried by the planner's own capacity model: the planner's placement was sized for the
   load before the run, with 10 % headroom by its own measure, and the other placements were judged on a load
   chosen for it, so "planner 100 % vs LLMFabric 85.5 % / memP 66 %" was favoured by construction.

   The judge, for every placement, is recovery.sim.planning.evaluate: the simulator (its figures are simulated),
   whose step times are workers.catalog's roofline, the same roofline the planner's default capacity model is
   built on. The planner placed against a model of its judge and the other placements did not: that bias remains
   and the results say so ("judge"); the planner with simulated capacities plans with capacities this same
   simulator measured.
2. Solve time at 64, 256 and 1,000 servers, 10 models, 7 GPU types, 3 providers, racks of 16: the whole call's
   time, when its plan was found, status and optimality gap (goal: a good plan within 5 s at 1,000).
3. Re-planning after a rack is lost: three models on three racks; each model's simulated attainment before the
   loss, after it with the placement as it is, and after the planner's re-placement (which keeps what it can:
   its moves are counted), and the modelled time until capacity is back (the slowest cold load among the moves).

Every latency, throughput and attainment figure is simulated (a model of the fleet, not a measurement of one);
solve times are measured on this machine.
"""

import argparse
import dataclasses
import time
from collections import Counter

from benchmarks.common import save
from recovery.policy import planner
from recovery.policy.planner import Demand, Replica, Server
from recovery.sim import planning
from workers import catalog

# --- 1. Table 1 ---------------------------------------------------------------------------
TABLE1_DEMANDS = (  # published rates; mean lengths within the paper's ranges (600-1,170 in, 64-530 out)
    Demand("Llama-2-13B", 110.0, prompt_tokens=600, output_tokens=64),
    Demand("CodeLlama-34B", 185.5, prompt_tokens=1170, output_tokens=200),
    Demand("Llama-3.3-70B", 221.0, prompt_tokens=850, output_tokens=530),
)
PUBLISHED = {  # document 004, Table 1: GPUs per model and type
    "memP (published)": {
        "Llama-2-13B": {"A100-80GB": 4},
        "CodeLlama-34B": {"A100-80GB": 16},
        "Llama-3.3-70B": {"GH200": 32, "A100-80GB": 4},
    },
    "LLMFabric (published)": {
        "Llama-2-13B": {"A100-80GB": 6},
        "CodeLlama-34B": {"GH200": 16, "A100-80GB": 10},
        "Llama-3.3-70B": {"GH200": 16, "A100-80GB": 8},
    },
}
# The offered load: this share of the fleet's placement-free capacity (fleet_capacity). It was LOAD_SHARE = 0.9 of what
# the planner's own placement carried by its own capacity model, a load set by the planner under test; the share is
# kept, its reference is not.
FLEET_LOAD_SHARE = 0.9
LOAD_SWEEP = (0.6, 0.75, FLEET_LOAD_SHARE)  # the comparison again at these shares of the same capacity


def table1_fleet() -> list[Server]:
    gh = [Server(f"gh-{i}", "GH200", 4, f"rack-{i % 2 + 1}") for i in range(8)]
    a100 = [Server(f"a100-{i}", "A100-80GB", 8, f"rack-{i % 2 + 1}") for i in range(3)]
    return gh + a100


def best_tp(demand: Demand, gpu: str, count: int, server_gpus: int) -> int:
    """The degree the capacity model rates best per GPU among those dividing `count` that fit a server."""
    options = [tp for tp in catalog.TP_DEGREES if count % tp == 0 and tp <= server_gpus]
    return max(options, key=lambda tp: (planner.roofline_capacity(demand, gpu, tp) / tp, -tp))


def place_allocation(servers: list[Server], allocation: dict, demands) -> dict[str, tuple[Replica, ...]]:
    """GPUs per (model, type) as replicas on concrete servers: largest replicas first, first fit."""
    by_model = {d.model: d for d in demands}
    free = {s.name: s.gpus for s in servers}
    placed: dict[str, list[Replica]] = {s.name: [] for s in servers}
    wanted = []
    for model, per_type in allocation.items():
        for gpu, count in per_type.items():
            gpus_per_server = max(s.gpus for s in servers if s.gpu == gpu)
            tp = best_tp(by_model[model], gpu, count, gpus_per_server)
            wanted += [(tp, model, gpu)] * (count // tp)
    for tp, model, gpu in sorted(wanted, reverse=True):
        server = next(s for s in servers if s.gpu == gpu and free[s.name] >= tp)
        placed[server.name].append(Replica(model, tp))
        free[server.name] -= tp
    return {name: tuple(sorted(rs)) for name, rs in placed.items()}


def mem_p(servers: list[Server], demands) -> dict:
    """memP (document 004 §5, after HexGen): GPUs in proportion to rate × parameters; the largest model first
    takes the fastest GPU type, then the next."""
    total = sum(s.gpus for s in servers)
    weight = {d.model: d.rate_rps * catalog.model(d.model).params_b for d in demands}
    left = Counter()
    for s in servers:
        left[s.gpu] += s.gpus
    speed = sorted(left, key=lambda g: -catalog.gpu(g).hbm_gbps)
    allocation: dict[str, dict[str, int]] = {}
    for d in sorted(demands, key=lambda d: -catalog.model(d.model).params_b):
        want = max(1, round(total * weight[d.model] / sum(weight.values())))
        per_type: dict[str, int] = {}
        for gpu in speed:
            smallest = min(tp for tp in catalog.TP_DEGREES if planner.roofline_capacity(d, gpu, tp) > 0)
            take = min(want, left[gpu]) // smallest * smallest
            if take:
                per_type[gpu] = take
                left[gpu] -= take
                want -= take
        allocation[d.model] = per_type
    return allocation


def allocation_text(assignment, servers) -> dict:
    table = planner.allocation_of(assignment, servers)
    return {m: " + ".join(f"{c * tp}x{gpu} (TP{tp})" for (gpu, tp), c in sorted(v.items())) for m, v in table.items()}


def per_gpu_capacity(demand: Demand, gpu: str, server_gpus: int) -> float:
    """Requests/s one GPU of type `gpu` serves of `demand` (the roofline capacity model's replica capacity over its
    TP degree), at the degree best per GPU among those that fit a server of `server_gpus`; 0 where none fits."""
    return max(
        (planner.roofline_capacity(demand, gpu, tp) / tp for tp in catalog.TP_DEGREES if tp <= server_gpus),
        default=0.0,
    )


def fleet_capacity(servers: list[Server], demands=TABLE1_DEMANDS) -> dict:
    """What the whole fleet carries at `demands`' ratio with no placement: each model's per-GPU capacity averaged
    over the fleet's GPUs, and the factor on `demands`' rates at which their GPU-seconds per second fill every GPU
    (sum over models of rate × factor / per-GPU capacity = the fleet's GPUs)."""
    gpus = sum(s.gpus for s in servers)
    per_gpu = {d.model: sum(per_gpu_capacity(d, s.gpu, s.gpus) * s.gpus for s in servers) / gpus for d in demands}
    return {
        "fleet_gpus": gpus,
        "per_gpu_rps_fleet_mean": per_gpu,
        "scale": gpus / sum(d.rate_rps / per_gpu[d.model] for d in demands),
    }


def offered_load(servers: list[Server], demands=TABLE1_DEMANDS, share: float = FLEET_LOAD_SHARE) -> list[Demand]:
    """The load every placement is judged on: `demands` at their ratio, scaled to `share` of fleet_capacity. It takes
    no placement and makes none: the same for the planner's placement and every other."""
    scale = fleet_capacity(servers, demands)["scale"] * share
    return [dataclasses.replace(d, rate_rps=round(d.rate_rps * scale, 2)) for d in demands]


OFFERED_LOAD_HOW = (
    "the published rates (110 : 185.5 : 221 req/s) scaled by one factor to a share of the fleet's capacity computed "
    "without any placement: each model's per-GPU capacity (the roofline capacity model, recovery.policy.capacity."
    "node_capacity, at the TP degree best per GPU that fits a server) averaged over the fleet's GPUs, and the factor "
    "at which the models' GPU-seconds per second fill every GPU; the same load for every placement"
)
OLD_LOAD_BIAS = (
    "before (LOAD_SHARE = 0.9, rate scale 0.178 of the published rates) the load was 0.9 of the most the planner's own "
    "placement carried by the planner's own capacity model: the planner's placement was sized for it before the run "
    "(10 % headroom by its own measure), the other placements judged on a load chosen for it; the results then were "
    "planner 100 %, LLMFabric (published) 85.5 %, memP (ours) 66.2 %, memP (published) 66.8 % mean attainment"
)
JUDGE = (
    "recovery.sim.planning.evaluate, for every placement: the simulator (kind simulated; Poisson arrivals, Normal "
    "lengths), whose step times are workers.catalog's roofline, the same roofline the planner's default capacity "
    "model (recovery.policy.capacity.node_capacity) is built on, and the offered load is set with that capacity "
    "model too. The planner placed against a model of its judge and the other placements did not: the "
    "comparison's remaining bias. 'Lifeline planner, simulated capacities' plans with capacities this same "
    "simulator measured"
)


def judged(servers, placements: dict, demands, duration_s: float) -> dict:
    rows = {}
    for name, assignment in placements.items():
        figures = planning.evaluate(servers, assignment, demands, duration_s)
        rows[name] = {
            "placement": allocation_text(assignment, servers),
            "models": {m: f.to_json() for m, f in figures.items()},
            "mean_attainment": sum(f.attainment for f in figures.values()) / len(figures),
            "throughput_rps": sum(f.throughput_rps for f in figures.values()),
        }
    return rows


def planner_lead(mean_attainment: dict[str, float]) -> dict:
    """The planner's mean attainment over the best of the placements that are not the planner's, in percentage
    points (0 or less: no advantage at that load)."""
    others = {name: a for name, a in mean_attainment.items() if not name.startswith("Lifeline planner")}
    best = max(others, key=others.get)
    return {"best_other": best, "points": round(100 * (mean_attainment["Lifeline planner"] - others[best]), 1)}


def table1(duration_s: float, shares=LOAD_SWEEP) -> dict:
    servers = table1_fleet()
    fleet = fleet_capacity(servers)
    # Each replica's capacity measured by the simulator, for the planner to plan with instead of the roofline model:
    # it depends on the lengths and objectives, not the rates, so one table serves every load.
    started = time.perf_counter()
    table = planning.simulated_capacities(TABLE1_DEMANDS, sorted({(s.gpu, s.gpus) for s in servers}), duration_s=30)
    measured_s = time.perf_counter() - started
    sweep = {}
    for share in sorted(set(shares) | {FLEET_LOAD_SHARE}):
        demands = offered_load(servers, share=share)  # before, and whatever, any placement
        ours = planner.plan(servers, demands, rack_spread=False)
        simulated = planner.plan(servers, demands, rack_spread=False, capacity=planning.table_capacity(table))
        placements = {
            "Lifeline planner": ours.assignment,
            "Lifeline planner, simulated capacities": simulated.assignment,
            "memP (ours)": place_allocation(servers, mem_p(servers, demands), demands),
            **{name: place_allocation(servers, alloc, demands) for name, alloc in PUBLISHED.items()},
        }
        sweep[share] = {
            "share": share,
            "rate_scale": fleet["scale"] * share,
            "demands": demands,
            "planner": {
                "status": ours.status,
                "solve_s": ours.solve_s,
                "gap": ours.gap,
                # The planner's own capacity model's view of its placement at this load (a diagnostic: it set nothing).
                "least_capacity_over_demand_modelled": min(ours.capacity_rps[d.model] / d.rate_rps for d in demands),
            },
            "placements": judged(servers, placements, demands, duration_s),
        }
    headline = sweep[FLEET_LOAD_SHARE]
    return {
        "offered_load": {
            "how": OFFERED_LOAD_HOW,
            "share": FLEET_LOAD_SHARE,
            "fleet_capacity_scale": fleet["scale"],
            "fleet_gpus": fleet["fleet_gpus"],
            "per_gpu_rps_fleet_mean": fleet["per_gpu_rps_fleet_mean"],
            "old_setup_bias": OLD_LOAD_BIAS,
        },
        "judge": JUDGE,
        "rate_scale": headline["rate_scale"],
        "demands": [dataclasses.asdict(d) for d in headline["demands"]],
        "planner": headline["planner"],
        "simulated_capacities": {
            "measured_in_s": measured_s,
            "replica_rps": {f"{m} on {g} TP{tp}": rps for (m, g, tp), rps in sorted(table.items())},
            "roofline_rps": {
                f"{d.model} on {g} TP{tp}": planner.roofline_capacity(d, g, tp)
                for d in TABLE1_DEMANDS
                for (m, g, tp) in sorted(table)
                if m == d.model
            },
        },
        "placements": headline["placements"],
        "load_sweep": [
            {
                "share_of_fleet_capacity": row["share"],
                "rate_scale": row["rate_scale"],
                "rates_rps": {d.model: d.rate_rps for d in row["demands"]},
                "planner_least_capacity_over_demand_modelled": row["planner"]["least_capacity_over_demand_modelled"],
                "mean_attainment": {name: r["mean_attainment"] for name, r in row["placements"].items()},
                "planner_lead_over_best_other": planner_lead(
                    {name: r["mean_attainment"] for name, r in row["placements"].items()}
                ),
                "attainment": {
                    name: {m: f["attainment"] for m, f in r["models"].items()} for name, r in row["placements"].items()
                },
            }
            for row in sweep.values()
        ],
    }


# --- 2. Solve time at scale ---------------------------------------------------------------------------
SCALE_GPUS = ("H100-SXM", "H200-SXM", "GH200", "A100-80GB", "L40S", "RTX-4090", "H100-PCIe")
SCALE_MODELS = (
    "Llama-3-8B",
    "Llama-3-70B",
    "Qwen3-14B",
    "Qwen3-32B",
    "Mixtral-8x7B",
    "Llama-2-13B",
    "CodeLlama-34B",
    "Llama-3.3-70B",
    "Qwen3-1.7B",
    "Llama-3.2-1B",
)


def scale_fleet(servers: int) -> tuple[list[Server], list[Demand]]:
    fleet = [
        Server(f"n{i:04d}", SCALE_GPUS[i % len(SCALE_GPUS)], 8, f"rack-{i // 16:03d}", f"provider-{i % 3}")
        for i in range(servers)
    ]
    # Zipf-like demand (document 004 §6: a few hot models, a long tail), about a third of the fleet's capacity.
    demands = [Demand(m, round(servers * 0.9 / (k + 1), 2)) for k, m in enumerate(SCALE_MODELS)]
    return fleet, demands


def solve_at_scale(sizes, time_limit_s: float) -> list[dict]:
    rows = []
    for size in sizes:
        fleet, demands = scale_fleet(size)
        result = planner.plan(fleet, demands, time_limit_s=time_limit_s)
        least = min(result.capacity_rps[d.model] / d.rate_rps for d in demands)
        after = min(result.after_rack_loss_rps[d.model] / d.rate_rps for d in demands)
        rows.append(
            {
                "servers": size,
                "gpus": size * 8,
                "models": len(demands),
                "gpu_types": len(SCALE_GPUS),
                "status": result.status,
                "solve_s": result.solve_s,
                "found_s": result.found_s,
                "gap": result.gap,
                "least_capacity_over_demand": least,
                "least_after_rack_loss_over_demand": after,
                "problems": result.problems,
            }
        )
        print(
            f"{size:5d} servers: {result.status} in {result.solve_s:.2f} s (plan found at {result.found_s:.2f} s), "
            f"gap {result.gap:.2e}; least capacity/demand {least:.2f}, after a rack's loss {after:.2f}"
        )
    return rows


# --- 3. Re-planning after a rack is lost ----------------------------------------------------------------------------
REPLAN_DEMANDS = (
    Demand("Llama-3-70B", 16.0, 1000, 200),
    Demand("Qwen3-32B", 50.0, 1000, 200),
    Demand("Llama-3-8B", 120.0, 1000, 200),
)


def replan_fleet() -> tuple[list[Server], dict[str, tuple[Replica, ...]]]:
    """Three racks of two 8-GPU H100 servers and one 8-GPU A100 server, placed by hand as a fleet often grows:
    Llama-3-70B all in rack-a, the other two models in racks b and c."""
    servers = [
        Server(f"{rack}-{i}", gpu, 8, rack)
        for rack in ("rack-a", "rack-b", "rack-c")
        for i, gpu in enumerate(("H100-SXM", "H100-SXM", "A100-80GB"))
    ]
    current = {}
    for s in servers:
        if s.rack == "rack-a":
            current[s.name] = (Replica("Llama-3-70B", 8),)
        elif s.name.endswith("-1"):
            current[s.name] = (Replica("Llama-3-8B", 4),) * 2
        else:
            current[s.name] = (Replica("Qwen3-32B", 4),) * 2
    return servers, current


def replan(duration_s: float) -> dict:
    servers, current = replan_fleet()
    survivors = [s for s in servers if s.rack != "rack-a"]
    kept = {s.name: current[s.name] for s in survivors}
    after = planner.plan(survivors, REPLAN_DEMANDS, current=kept, move_weight=planner.REPLAN_MOVE_WEIGHT)
    load_s = max((catalog.load_time_s(catalog.model(r.model)) for m in after.moves for r in m.start), default=0.0)
    spread = planner.plan(servers, REPLAN_DEMANDS)  # what the planner would have placed, rack spread and all
    spread_kept = {s.name: spread.assignment[s.name] for s in survivors}

    def attainment(fleet, assignment) -> dict:
        return {m: f.attainment for m, f in planning.evaluate(fleet, assignment, REPLAN_DEMANDS, duration_s).items()}

    return {
        "demands": [dataclasses.asdict(d) for d in REPLAN_DEMANDS],
        "placement_before": allocation_text(current, servers),
        "placement_after": allocation_text(after.assignment, survivors),
        "attainment": {
            "before the loss": attainment(servers, current),
            "after the loss, not re-planned": attainment(survivors, kept),
            "after the approved re-placement": attainment(survivors, after.assignment),
            "placed by the planner from the start, after the loss, not re-planned": attainment(survivors, spread_kept),
        },
        "moves": [dataclasses.asdict(m) for m in after.moves],
        "replicas_started": after.replicas_started,
        "capacity_back_s_modelled": load_s,
        "problems": after.problems,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1000")
    parser.add_argument("--duration", type=float, default=60.0, help="simulated seconds of workload per evaluation")
    parser.add_argument("--time-limit", type=float, default=planner.DEFAULT_TIME_LIMIT_S)
    args = parser.parse_args()
    started = time.perf_counter()
    result = {
        "table1": table1(args.duration),
        "scale": solve_at_scale([int(s) for s in args.sizes.split(",")], args.time_limit),
        "replan": replan(args.duration),
    }
    for row in result["table1"]["load_sweep"]:
        shares = ", ".join(f"{name} {a:.1%}" for name, a in row["mean_attainment"].items())
        lead = row["planner_lead_over_best_other"]
        print(
            f"load {row['share_of_fleet_capacity']:.0%} of the fleet's capacity: {shares}; the planner's lead over "
            f"{lead['best_other']}: {lead['points']:+.1f} points"
        )
    for name, row in result["table1"]["placements"].items():
        models = ", ".join(
            f"{m} {f['attainment']:.0%} ({f['throughput_rps']:.1f} req/s, TTFT p99 "
            f"{(f['ttft_p99_s'] or 0) * 1000:.0f} ms)"
            for m, f in row["models"].items()
        )
        print(f"{name:24s} mean attainment {row['mean_attainment']:.1%}: {models}")
    result["wall_s"] = time.perf_counter() - started
    save("placement", result, kinds=KINDS)


KINDS = {  # harness.provenance's kind of each figure
    "table1.offered_load.share": "input",
    "table1.offered_load.fleet_capacity_scale": "modelled",
    "table1.offered_load.per_gpu_rps_fleet_mean": "modelled",
    "table1.rate_scale": "modelled",
    "table1.demands": "modelled",
    "table1.planner.solve_s": "measured",
    "table1.planner.least_capacity_over_demand_modelled": "modelled",
    "table1.simulated_capacities.measured_in_s": "measured",
    "table1.simulated_capacities.replica_rps": "simulated",
    "table1.simulated_capacities.roofline_rps": "modelled",
    "table1.placements.*.models": "simulated",
    "table1.placements.*.mean_attainment": "simulated",
    "table1.placements.*.throughput_rps": "simulated",
    "table1.load_sweep[].rate_scale": "modelled",
    "table1.load_sweep[].rates_rps": "modelled",
    "table1.load_sweep[].planner_least_capacity_over_demand_modelled": "modelled",
    "table1.load_sweep[].mean_attainment": "simulated",
    "table1.load_sweep[].attainment": "simulated",
    "table1.load_sweep[].planner_lead_over_best_other.points": "simulated",
    "scale[].solve_s": "measured",
    "scale[].found_s": "measured",
    "scale[].gap": "measured",
    "scale[].least_capacity_over_demand": "modelled",
    "scale[].least_after_rack_loss_over_demand": "modelled",
    "replan.attainment": "simulated",
    "replan.capacity_back_s_modelled": "modelled",
    "wall_s": "measured",
}


if __name__ == "__main__":
    main()
