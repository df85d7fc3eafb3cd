"""The recovery policies' decision times on a 256-node fleet under 10,000 in-flight requests.

(a) one routing plus placement decision: choose_node over 256 nodes (two GPU
    kinds, a few nodes at half weight), then place("lifeline") with the same
    256 as holder candidates; p50 and p99 over 5,000 decisions (goal: p99
    under 100 µs). Between decisions, untimed, the gateway's bookkeeping runs
    as it would: the chosen node's Pending grows, the holders' L̂ and pages
    grow, a request somewhere finishes and frees its holders' pages, and nodes
    push new statuses, which confirm what was pending there. So each timed
    decision also absorbs the changes since the last one, as choose_node and
    place() keep their indexes up to date lazily. Scenarios: 1 status event per
    decision (the chosen node's own arrival event, two decisions later) and 8
    (arrivals, prefill chunks and finishes, ~10k events/s at ~1k decisions/s);
    and inputs rebuilt per call (a new mapping of new tuples, a new list of new
    HolderCandidates without the serving node), which is slower. "repeat"
    is the same decision timed again at once: nothing to absorb, the floor.
    Also: how many nodes choose_node costs exactly, the one-node-at-a-time
    definition's time on the same fleet, and the worst case for the bound
    (256 identical idle nodes, every bound tied).
    And the same through the gateway's own path: a real Coordinator (no
    network) whose FleetState is kept current by status events delivered the
    way the gateway receives them (NodeWatcher._update, untimed), timing
    Coordinator.choose + Coordinator.place, which is what a request waits on.
(b) plan_recovery for 1,000 interrupted requests over 255 survivors (one
    holder failed at the same time), goal under 50 ms: median and max.

Run: .venv/bin/python -m benchmarks.policies
"""

import dataclasses
import gc
import os
import random
import statistics
import time

from benchmarks.common import percentile, save
from benchmarks.looplag_probe import cpu_times, steal_share
from recovery.policy import dispatch, load, placement
from workers.catalog import BLOCK_TOKENS, Deployment

NODES = 256
RACKS = 16
IN_FLIGHT = 10_000
DECISIONS = 5_000
STATUS_EVENTS_PER_DECISION = (1, 8)  # the chosen node's own arrival event only; and ~10k events/s at ~1k arrivals/s
CONFIRM_AFTER = 2  # decisions (ms) until the chosen node's arrival event confirms the request
PREFILLING_SHARE = 0.12  # nodes caught mid-prefill: ~4 arrivals/s/node, one ~30 ms step each
BUDGET_BYTES = 20 * 10**9  # document 000's example: 20 GB of a 512 GB host
ALPHA, BETA = 1.0, 1.0
SEED = 7

POOL = [Deployment.of("Qwen3-32B", "H100-SXM", 2), Deployment.of("Qwen3-32B", "H200-SXM", 2)]


class Fleet:
    """256 nodes holding 10,000 in-flight requests, as the gateway sees them."""

    def __init__(self, rng: random.Random, now: float):
        self.rng = rng
        self.names = [f"node-{i:03d}" for i in range(NODES)]
        self.rack = {n: f"rack-{i % RACKS:02d}" for i, n in enumerate(self.names)}
        self.deployment = {n: POOL[i % 4 == 0] for i, n in enumerate(self.names)}  # a quarter on H200
        # in-flight requests per node: [prompt, generated, holders]
        self.requests: dict[str, list[tuple[int, int, tuple[str, ...]]]] = {n: [] for n in self.names}
        self.pages_held = {n: 0 for n in self.names}
        for _ in range(IN_FLIGHT):
            node, holder = rng.sample(self.names, 2)
            prompt, generated = self.new_request()
            self.requests[node].append((prompt, generated, (holder,)))
            self.pages_held[holder] += -(-(prompt + generated) // BLOCK_TOKENS)
        self.pending = {n: load.Pending() for n in self.names}
        self.candidates = {n: (self.status(n, now), self.pending[n], self.deployment[n], 1.0) for n in self.names}
        for n in rng.sample(self.names, 8):  # a few SUSPICIOUS nodes at half weight
            s, p, d, _ = self.candidates[n]
            self.candidates[n] = (s, p, d, 0.5)
        self.unconfirmed: list[tuple[int, str]] = []  # (decision number, node)
        self.holders = [self.holder(n) for n in self.names]
        self.slot = {n: i for i, n in enumerate(self.names)}

    def new_request(self) -> tuple[int, int]:
        prompt = min(16_000, int(self.rng.lognormvariate(6.8, 0.8)))  # median ~900 tokens
        return prompt, self.rng.randint(0, 600)

    def status(self, name: str, now: float) -> load.NodeStatus:
        """The node's status up to two steps ago; some nodes are mid-prefill on their newest request."""
        rng, reqs, dep = self.rng, self.requests[name], self.deployment[name]
        prefilling = reqs[-1:] if rng.random() < PREFILLING_SHARE else []
        decoding = reqs[:-1] if prefilling else reqs
        uncomputed = sum(rng.randint(1, r[0]) for r in prefilling)
        context = sum(r[0] + r[1] for r in decoding)
        step_s = dep.step_s(min(uncomputed, 2048), 0, len(decoding), context)
        return load.NodeStatus(
            at=now - rng.uniform(0, 2 * step_s),
            running=len(reqs),
            uncomputed_prefill_tokens=uncomputed,
            decode_batch=len(decoding),
            decode_context_tokens=context,
            step_ms=step_s * 1000,
        )

    def l_hat(self, name: str) -> float:
        return load.recovery_load(self.pages_held[name], len(self.requests[name]), ALPHA, BETA)

    def holder(self, name: str) -> placement.HolderCandidate:
        kv_block = self.deployment[name].model.kv_bytes_per_block
        return placement.HolderCandidate(
            name, self.rack[name], self.l_hat(name), self.pages_held[name] * kv_block, BUDGET_BYTES
        )

    def dispatched(self, node: str, holders: tuple[str, ...], prompt: int) -> None:
        """The gateway's bookkeeping after a decision (not timed)."""
        self.pending[node].add(prompt)
        self.requests[node].append((prompt, 0, holders))
        for h in holders:
            self.pages_held[h] += -(-prompt // BLOCK_TOKENS)
        changed = {node, *holders}
        # a request somewhere finishes, so the fleet stays at 10,000 in flight; its holders free its pages
        done = self.rng.choice(self.names)
        if self.requests[done]:
            prompt_, generated, held_by = self.requests[done].pop(self.rng.randrange(len(self.requests[done])))
            for h in held_by:
                self.pages_held[h] -= -(-(prompt_ + generated) // BLOCK_TOKENS)
            changed |= {done, *held_by}
        for n in changed:
            self.holders[self.slot[n]] = self.holder(n)

    def status_events(self, now: float, decision: int, chosen: str | None = None, per_decision: int = 8) -> None:
        """Nodes push new statuses: the chosen node's arrival event a couple of decisions later,
        and random others (chunks done, requests finished). A status confirms what was pending there."""
        if chosen is not None:
            self.unconfirmed.append((decision, chosen))
        due = [n for d, n in self.unconfirmed if d <= decision - CONFIRM_AFTER]
        self.unconfirmed = [(d, n) for d, n in self.unconfirmed if d > decision - CONFIRM_AFTER]
        for n in due + self.rng.sample(self.names, max(0, per_decision - len(due))):
            self.pending[n].requests = self.pending[n].prompt_tokens = 0
            _, p, d, w = self.candidates[n]
            self.candidates[n] = (self.status(n, now), p, d, w)


def bench_decision(events: int, rebuilt: bool = False, decisions: int = DECISIONS) -> dict:
    """`rebuilt`: the caller builds a new mapping of new tuples and a new list of new
    HolderCandidates (without the serving node) for every decision, untimed, as a gateway
    might; the policies then match entries by value instead of identity."""
    rng = random.Random(SEED)
    now = 1_700_000_000.0
    fleet = Fleet(rng, now)
    route_ns, place_ns, both_ns, again_ns, two_holders = [], [], [], [], 0
    gc.disable()  # a collection pause belongs to the process, not the policy; reported separately below
    try:
        for i in range(decisions):
            now += 0.001
            prompt = fleet.new_request()[0]
            request_bytes = prompt * POOL[0].model.kv_bytes_per_token
            candidates = {n: tuple(v) for n, v in fleet.candidates.items()} if rebuilt else fleet.candidates
            t0 = time.perf_counter_ns()
            node = load.choose_node(candidates, prompt, now)
            t1 = time.perf_counter_ns()
            if rebuilt:
                holder_list = [dataclasses.replace(h) for h in fleet.holders if h.name != node]
            else:
                holder_list = fleet.holders
            t1b = time.perf_counter_ns()
            holders = placement.place("lifeline", node, holder_list, request_bytes, prompt)
            t2 = time.perf_counter_ns()
            # the same decision again at once: nothing to absorb, caches warm (the floor)
            t3 = time.perf_counter_ns()
            load.choose_node(candidates, prompt, now)
            placement.place("lifeline", node, holder_list, request_bytes, prompt)
            again_ns.append(time.perf_counter_ns() - t3)
            route_ns.append(t1 - t0)
            place_ns.append(t2 - t1b)
            both_ns.append(t2 - t1b + t1 - t0)
            two_holders += len(holders) == 2
            fleet.dispatched(node, holders, prompt)
            fleet.status_events(now, i, node, events)
            if i % 1000 == 999:
                gc.collect()
    finally:
        gc.enable()
    us = lambda xs, q: round(percentile(xs, q) / 1000, 1)  # noqa: E731
    return {
        "nodes": NODES,
        "in_flight": IN_FLIGHT,
        "decisions": decisions,
        "status_events_per_decision": events,
        "inputs_rebuilt_per_call": rebuilt,
        "placement_policy": "lifeline",
        "share_with_two_holders": round(two_holders / decisions, 3),
        "decision_p50_us": us(both_ns, 0.5),
        "decision_p99_us": us(both_ns, 0.99),
        "decision_p999_us": us(both_ns, 0.999),
        "choose_node_p50_us": us(route_ns, 0.5),
        "choose_node_p99_us": us(route_ns, 0.99),
        "place_p50_us": us(place_ns, 0.5),
        "place_p99_us": us(place_ns, 0.99),
        "repeat_decision_p50_us": us(again_ns, 0.5),
        "repeat_decision_p99_us": us(again_ns, 0.99),
        "goal_p99_us": 100,
    }


def gateway_coordinator(fleet: Fleet, clock: list[float]):
    """A real Coordinator (no network) routing over `fleet`, on the clock `clock[0]`, its statuses all pushed."""
    from recovery.gateway.coordinator import Coordinator
    from recovery.gateway.table import RoutingView
    from recovery.protocol import ClusterConfig, Route

    view = RoutingView("redis://127.0.0.1:1/0", "bench")  # never connected: routes are set here
    view.config = ClusterConfig(placement_policy="lifeline", alpha=ALPHA, beta=BETA)
    view.routes = {
        n: Route(
            n, f"http://{n}", "Qwen3-32B", fleet.rack[n], fleet.candidates[n][3], fleet.deployment[n].gpu.key, 2, "s"
        )
        for n in fleet.names
    }
    co = Coordinator(view, None, "bench", {})
    co.fleet.clock = co.watcher.clock = lambda: clock[0]  # statuses received, and dated, on the benchmark's clock
    for n in fleet.names:
        push(co, fleet, n, clock[0])
    co.fleet.rebuild()
    return co


def push(co, fleet: Fleet, name: str, now: float) -> None:
    """A status event from `name`, delivered as the gateway's NodeWatcher receives one."""
    status = fleet.status(name, now)
    data = dataclasses.asdict(status)
    data["checkpoint_bytes_held"] = fleet.pages_held[name] * fleet.deployment[name].model.kv_bytes_per_block
    data["checkpoint_budget_bytes"] = BUDGET_BYTES
    co.watcher._update(name, data)


def bench_gateway_path(events: int, decisions: int = DECISIONS) -> dict:
    """choose + place through the gateway's Coordinator, its fleet state updated by status events."""
    import asyncio

    from recovery.gateway.coordinator import Flight

    async def run() -> dict:
        rng = random.Random(SEED)
        clock = [1_700_000_000.0]
        fleet = Fleet(rng, clock[0])
        co = gateway_coordinator(fleet, clock)
        times, upkeep, two_holders = [], [], 0
        gc.disable()
        try:
            for i in range(decisions):
                clock[0] += 0.001
                prompt = fleet.new_request()[0]
                flight = Flight(f"req-{i}", "bench", "premium", "Qwen3-32B", prompt, 0)
                t0 = time.perf_counter_ns()
                route = co.choose("Qwen3-32B", prompt)
                holders = co.place(flight, route)
                times.append(time.perf_counter_ns() - t0)
                two_holders += len(holders) == 2
                co.watcher.dispatched(route.name, flight.request_id, prompt)
                t0 = time.perf_counter_ns()
                co.fleet.tidy()  # the gateway runs it once the request is on its way (Coordinator._tidy_soon)
                upkeep.append(time.perf_counter_ns() - t0)
                fleet.dispatched(route.name, tuple(h.name for h in holders), prompt)
                fleet.unconfirmed.append((i, route.name))
                due = [n for d, n in fleet.unconfirmed if d <= i - CONFIRM_AFTER]
                fleet.unconfirmed = [(d, n) for d, n in fleet.unconfirmed if d > i - CONFIRM_AFTER]
                for n in due + rng.sample(fleet.names, max(0, events - len(due))):
                    push(co, fleet, n, clock[0])
                    co.watcher.pending_for(n).requests = co.watcher.pending_for(n).prompt_tokens = 0
                if i % 1000 == 999:
                    gc.collect()
        finally:
            gc.enable()
        return {
            "path": "gateway Coordinator.choose + Coordinator.place",
            "status_events_per_decision": events,
            "share_with_two_holders": round(two_holders / decisions, 3),
            "decision_p50_us": round(percentile(times, 0.5) / 1000, 1),
            "decision_p99_us": round(percentile(times, 0.99) / 1000, 1),
            "decision_p999_us": round(percentile(times, 0.999) / 1000, 1),
            "upkeep_after_p50_us": round(percentile(upkeep, 0.5) / 1000, 1),
            "upkeep_after_p99_us": round(percentile(upkeep, 0.99) / 1000, 1),
            "goal_p99_us": 100,
        }

    return asyncio.run(run())


def bench_nodes_costed(decisions: int = 2000) -> dict:
    """How many nodes choose_node costs exactly per decision; the bound prunes the rest."""
    rng = random.Random(SEED + 1)
    now = 1_700_000_000.0
    fleet = Fleet(rng, now)
    counts, calls = [], [0]
    original = load._Roofline.decode_step_s  # the search calls it once per node it costs

    def counting(self, batch, context):
        calls[0] += 1
        return original(self, batch, context)

    load._Roofline.decode_step_s = counting
    try:
        for i in range(decisions):
            now += 0.001
            prompt = fleet.new_request()[0]
            calls[0] = 0
            node = load.choose_node(fleet.candidates, prompt, now)
            counts.append(calls[0])
            fleet.dispatched(node, (), prompt)
            fleet.status_events(now, i, node)
    finally:
        load._Roofline.decode_step_s = original
    return {"nodes_costed_mean": round(statistics.mean(counts), 1), "nodes_costed_p99": percentile(counts, 0.99)}


def bench_plain_loop(decisions: int = 300) -> dict:
    """The one-node-at-a-time definition of choose_node on the same fleet, for comparison."""
    rng = random.Random(SEED + 2)
    now = 1_700_000_000.0
    fleet = Fleet(rng, now)
    times, agree = [], 0
    for i in range(decisions):
        now += 0.001
        prompt = fleet.new_request()[0]
        t0 = time.perf_counter_ns()
        plain = load._plain_choose_node(fleet.candidates, prompt, now)
        times.append(time.perf_counter_ns() - t0)
        agree += plain == load.choose_node(fleet.candidates, prompt, now)
        fleet.dispatched(plain, (), prompt)
        fleet.status_events(now, i, plain)
    return {
        "plain_choose_node_p50_us": round(percentile(times, 0.5) / 1000, 1),
        "plain_agrees_with_fast": f"{agree}/{decisions}",
    }


def bench_idle_identical(decisions: int = 2000) -> dict:
    """Worst case for the bound: 256 identical idle nodes, where every bound ties."""
    names = [f"node-{i:03d}" for i in range(NODES)]
    now = 1_700_000_000.0
    pending = {n: load.Pending() for n in names}
    candidates = {n: (load.NodeStatus(at=now), pending[n], POOL[0], 1.0) for n in names}
    times = []
    for i in range(decisions):
        now += 0.001
        t0 = time.perf_counter_ns()
        node = load.choose_node(candidates, 1000, now)
        times.append(time.perf_counter_ns() - t0)
        pending[node].add(1000)
        if i % 16 == 15:  # confirmations come back
            for p in pending.values():
                p.requests = p.prompt_tokens = 0
    return {
        "idle_identical_choose_node_p50_us": round(percentile(times, 0.5) / 1000, 1),
        "idle_identical_choose_node_p99_us": round(percentile(times, 0.99) / 1000, 1),
    }


def bench_recovery(repetitions: int = 30, requests: int = 1000) -> dict:
    rng = random.Random(SEED + 3)
    fleet = Fleet(rng, 1_700_000_000.0)
    failed = {"node-000"}
    second_failure = "node-001"  # a holder that fails at the same time
    survivors = {
        n: dispatch.Survivor(n, fleet.rack[n], fleet.l_hat(n), rng.randint(0, 40_000), fleet.deployment[n])
        for n in fleet.names
        if n not in failed
    }
    survivors[second_failure].alive = False
    interrupted = []
    for i in range(requests):
        prompt, generated = fleet.new_request()
        context = prompt + generated
        holders = tuple(rng.sample(fleet.names[1:], rng.choice((1, 2))))
        checkpointed = (context // BLOCK_TOKENS) * BLOCK_TOKENS if rng.random() < 0.9 else 0
        interrupted.append(dispatch.Interrupted(f"req-{i}", holders, checkpointed, context))
    theta = dispatch.theta_for([s.l_hat for s in survivors.values() if s.alive])
    times, methods = [], {}
    for _ in range(repetitions):
        t0 = time.perf_counter_ns()
        decisions = dispatch.plan_recovery(interrupted, survivors, failed, theta)
        times.append((time.perf_counter_ns() - t0) / 1e6)
    for d in decisions:
        methods[d.method] = methods.get(d.method, 0) + 1
    return {
        "interrupted": requests,
        "survivors": len(survivors),
        "theta": round(theta, 1),
        "methods": methods,
        "plan_median_ms": round(statistics.median(times), 2),
        "plan_max_ms": round(max(times), 2),
        "goal_ms": 50,
    }


def calibration(repetitions: int = 5000) -> dict:
    """The machine's own jitter: fixed loops timed like a decision, one about as long as a decision's median (2,560
    steps, ~25-50 µs here). Its p99 over its p50 is the tail the machine adds to fixed work; a decision's ratio above
    that is the decision's own (the work differs from one decision to the next)."""
    out = {}
    gc.disable()
    try:
        for steps in (256, 2560):
            times = []
            for _ in range(repetitions):
                t0 = time.perf_counter_ns()
                for _i in range(steps):
                    pass
                times.append(time.perf_counter_ns() - t0)
            p50, p99 = percentile(times, 0.5), percentile(times, 0.99)
            out[f"loop{steps}_p50_us"] = round(p50 / 1000, 1)
            out[f"loop{steps}_p99_us"] = round(p99 / 1000, 1)
            out[f"loop{steps}_p999_us"] = round(percentile(times, 0.999) / 1000, 1)
            out[f"loop{steps}_p99_over_p50"] = round(p99 / p50, 2)
    finally:
        gc.enable()
    return out


def main() -> None:
    started, cpu_before, load_before = time.monotonic(), cpu_times(), os.getloadavg()[0]
    scenarios = [bench_decision(events) for events in STATUS_EVENTS_PER_DECISION]
    scenarios.append(bench_decision(STATUS_EVENTS_PER_DECISION[0], rebuilt=True))
    result = {"routing_and_placement": scenarios}
    result["gateway_path"] = [bench_gateway_path(events) for events in STATUS_EVENTS_PER_DECISION]
    result["choose_node_search"] = {**bench_nodes_costed(), **bench_plain_loop(), **bench_idle_identical()}
    result["recovery_dispatch"] = bench_recovery()
    result["noise"] = {
        **calibration(),
        "cpu_steal_share": steal_share(time.monotonic() - started, cpu_before, cpu_times()),
        "load_average_1m_before": round(load_before, 2),
    }
    save("policies", result)


if __name__ == "__main__":
    main()
