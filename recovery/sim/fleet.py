"""The simulated fleet: one virtual clock, a heap of events, a node per EngineCore and a gateway on the policies.

Events, in time order (ties in the order they were pushed): a request arrives; a node's step ends; a fault hits; the
gateway learns of it (`faults.detect`'s routing_s); a resumed request reaches its new node (after the gateway's hop,
MOVE_HOP_S, and the KV restore or fetch time); a node is back (repair, then the model load of
`workers.catalog.load_time_s`); the control plane evaluates capacity (with a throughput objective only); a corrupt
node fails a canary. Every node is a `workers.core.EngineCore` for its catalog deployment, stepped one planned step
at a time for `step_seconds(plan)`, exactly as `run_virtual` drives one node.


The gateway makes the real gateway's decisions with the same policy functions, fed the way
recovery/gateway/coordinator.py and fleet.py feed them:

- routing: `load.NodeIndex.choose` over (status, Pending, deployment, weight) per node, the failed nodes
  excluded; the node's status is rebuilt (as `workers.engine.Engine.status` builds it) at every load-changing
  event, with zero network latency, so a dispatch is confirmed at once;
- holders: `placement.place(policy, serving, HolderRanking, request_bytes, prefix_tokens, tau)` with each
  candidate's L̂ from `load.holder_load` (checkpoint bytes held, queue depth, and the pages placed in the last
  RECENT_S seconds), budget ρ = 5 % of host memory (twice the GPUs' memory), as workers/node.py defaults;
- recovery: `dispatch.plan_recovery` over every request of the lost node in one pass, θ from
  `dispatch.theta_for`, the checkpointed prefix as the gateway estimates it (`checkpointed_estimate`, the
  coordinator's `_checkpointed_estimate`). What is restored is what the holder really has: the pages
  (BlockComplete events) streamed to it whose transfer over the serving node's link ended before the fault.

A resumed request keeps the tokens its client already has (`Sequence.generated`) and continues from the
context, so its stream is the undisturbed one: no token lost, none repeated.

Degradation (recovery.sim.degradation, with a throughput objective in the scenario): every `interval_s` the
control plane's `capacity.next_level` over the nodes in service; a new request of a shed tier is refused 429
(every new one 503 at level 4) and never dispatched; each node of the model gets the level's batch factor
(`EngineCore.batch_factor`, as the node's /agent/config sets it); each request keeps the level it finished at.

Silent corruption (sdc): the node serves on, its answers wrong, until its canaries find it (`faults.detect`, each
canary taking its own roofline time): SUSPICIOUS halves its routing weight; UNHEALTHY puts it at weight 0, names
every request it had since its last good canary (possibly corrupt), moves those in flight off live at once
(transfer of their KV or re-prefill, `dispatch.migration_method`), promotes a spare, and resets the node. Token
ids are not corrupted: a moved request's stream is still the undisturbed one, which is what lets the tests hold
the migration to "no token lost, none repeated".

Speculative draft assist (progressive recovery, `draft_assist`): a node restarting cold (after its repair) loads its
model's catalogued draft model first; from draft-ready (`workers.catalog.load_time_s` of the draft after the repair)
until its full model is loaded, it assists the most loaded survivor of its model that is decoding and not assisted
already (`progressive.pick_assisted` on L̂, as recovery.actions.incidents picks it). The survivor plans its steps
with room for ASSIST_K drafted tokens per decoding sequence (`EngineCore.plan(lookahead=...)`), has ASSIST_K drafts
verified for each of its first MAX_ASSISTED decoding sequences, takes `step_seconds(plan, verified_drafts)` for the
step, and emits the accepted drafts plus one (`EngineCore.apply(plan, now, drafts)`), as workers.engine does. The
tokens are not computed on the fast path, so how many drafts are accepted is drawn: each drafted token left to right
with probability α, the model pair's draft agreement (`workers.catalog.Model.draft_agreement`, a MODEL PARAMETER,
an input), from the pairing's own seeded generator; the step-by-step run draws the same and hands the core drafts
that match the target's tokens that far and no further. A node is stepped one step at a time while it is assisted.
The figures of each pairing (assisted steps, drafted, tested and accepted tokens) are outcomes of those draws at α:
modelled, never a measured acceptance. The full model's load time is the simulator's as before (`load_time_s` of the
model after the repair) with the draft ready within it; the real node loads the draft and then the full model, one
after the other, which would add the draft's load to every cold restart, with or without assist.
"""

import gc
import heapq
import math
import random
import zlib
from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from itertools import accumulate

from recovery.canary import PROMPTS as CANARY_PROMPTS
from recovery.policy import dispatch, load, placement, progressive, recovery
from recovery.policy import health as health_policy
from recovery.sim.degradation import Degradation, LevelChange
from recovery.sim.faults import Fault, detect
from recovery.sim.scenario import Scenario, SimNode
from recovery.sim.workload import Request
from workers import catalog
from workers import tokens as vocabulary
from workers.core import COUNTED_TOKEN, BlockComplete, EngineCore, Finished, SamplingParams, Sequence, StepPlan, Token
from workers.protocol import RoutingStatus  # NodeStatus at run time, every figure a number for the type checker

RECENT_S = 2.0  # recovery/gateway/fleet.py RECENT_S: a placement counts in the holder's L̂ this long
CHECKPOINT_BUDGET = 0.05  # workers/node.py --checkpoint-budget default: share of host memory
HOST_MEMORY_PER_GPU_MEMORY = 2  # workers/node.py: host memory defaults to twice the GPUs' memory
DEFAULT_TAU = 512  # recovery/gateway/table.py ClusterConfig.tau_tokens
DEFAULT_THETA_FACTOR = 2.0  # ClusterConfig.theta_factor
UNMODELLED_KINDS: tuple[str, ...] = ()  # fault kinds drawn but not played out (none since sdc is modelled)
SUSPICIOUS_WEIGHT = health_policy.routing_weight(health_policy.SUSPICIOUS)  # 0.5: one failed canary
SERIES_S = 0.5  # latency over time is kept in buckets this wide; recovery-time windows are multiples of it
MAX_RUN = 256  # fast path: decode steps advanced in one event at most (a longer run is two)
MIN_RUN = 2  # fast path: shorter runs go step by step
_PLACEHOLDERS = [COUNTED_TOKEN] * MAX_RUN  # fast path: the tokens of a decode run, counted, not computed
GC_YOUNG_THRESHOLD = 50_000  # allocations between young garbage collections while a run goes on (Simulation.run)
# Draft assist: drafted tokens per sequence a survivor verifies (recovery.actions.incidents.ASSIST_K, the k that
# benchmarks/harness.py and workers/control_api.py default to), for at most MAX_ASSISTED decoding sequences a step
# (workers.engine_api.EngineConfig.max_assisted).
ASSIST_K = 4
MAX_ASSISTED = 64
# A failure's move beyond the KV restore: from the gateway noticing the break to the target's answer, less the
# target's own restore (the plan, the resume request, both processes' handling of it and of the other moves), for
# each of n requests moved in one pass: MOVE_HOP_S[0] + MOVE_HOP_S[1]·n seconds. Measured on the real gateway and
# emulated nodes of this repository, on a scenario of its own (benchmarks/move_hop.py, hop_ms_by_at_once,
# 2026-11-29), not fitted to the validation it is checked by (benchmarks/sim_validation.py).
MOVE_HOP_S = (0.00373, 0.00108)  # 3.73 ms + 1.08 ms per move, residual sd 2.5 ms over 82 moves


def prompt_ids(index: int, length: int) -> range:
    """Request `index`'s prompt: distinct token ids, a pure function of the index (no two requests share a prefix).
    A range, not a list: a list of 1,500 ids takes 54 KB (an int object per id), which was the simulator's memory
    at 1,000 nodes (4.2 GB for 75,000 requests)."""
    first = zlib.crc32(f"request-{index}".encode()) % 100_000 * 1000
    return range(first, first + length)


def sampling(request: Request) -> SamplingParams:
    """Greedy, generating through end-of-sequence: the output is exactly request.output_tokens long."""
    return SamplingParams(max_tokens=request.output_tokens, temperature=0.0, ignore_eos=True)


@dataclass(slots=True)
class Flight:
    """One request as the simulated gateway holds it, and its figures. (Slots: a run keeps every request's, and
    without them each would carry a dictionary of its two dozen fields, about 1 KB.)"""

    index: int
    request: Request
    prompt_ids: range
    node: str = ""
    holders: tuple[str, ...] = ()
    generated: list[int] = field(default_factory=list)  # the tokens its client has, in order (fast: placeholders)
    token_times: list[float] = field(default_factory=list)  # every token's time (step-by-step runs only)
    emitted: int = 0  # tokens its client has
    first_token_s: float | None = None
    last_token_s: float | None = None
    seq: Sequence | None = None
    pages: dict[str, list[float]] = field(default_factory=dict)  # holder -> arrival time of each page, in order
    refused: set[str] = field(default_factory=set)  # holders that ran out of budget for it
    interrupted_at: list[float] = field(default_factory=list)  # each fault that cut it off
    stalls: list[float] = field(default_factory=list)  # from each fault to its next token
    methods: list[str] = field(default_factory=list)  # how it recovered each time
    restored_tokens: list[int] = field(default_factory=list)
    waiting_since: float | None = None  # fault time while it waits for its next token
    second_asked: bool = False
    blocks_sent: int = 0  # BlockComplete events of its current Sequence so far
    finished_at: float | None = None
    shed: tuple[int, int] | None = None  # (HTTP code, level) when its model's degradation level refused it
    level: int = 0  # its model's degradation level when it finished (level 3 relaxes its latency objectives)
    spans: list[list] = field(default_factory=list)  # [node, from, until or None] of each node that had it
    possibly_corrupt: bool = False  # served by a node found corrupt, since that node's last good canary

    @property
    def context_tokens(self) -> int:
        return self.request.prompt_tokens + len(self.generated)

    @property
    def request_id(self) -> str:
        return f"r{self.index}"


def _arrival_s(flight: Flight) -> float:
    return flight.request.arrival_s


@dataclass
class Assist:
    """A restarting node's draft model paired with a survivor that verifies its drafts (workers.engine_api.Assist), from
    the draft node's draft-ready until its full model is loaded, or until the survivor fails."""

    draft: str  # the restarting node
    survivor: str
    agreement: float  # α, the model pair's draft agreement from the catalog: an input, not a measurement
    rng: random.Random  # draws each drafted token's acceptance; its own per pairing, so runs are deterministic
    started_s: float
    ended_s: float | None = None
    # workers.core.StepResult.assist's figures summed over the pairing (assist_steps, draft_proposed,
    # draft_accepted, draft_tested, assisted_tokens, assisted_sequence_steps): outcomes of the draws at α, modelled.
    counters: Counter = field(default_factory=Counter)


@dataclass
class NodeState:
    spec: SimNode
    core: EngineCore
    budget_bytes: int
    alive: bool = True  # stepping
    routable: bool = True  # in the gateway's routing (not lost, not a standby spare, model loaded)
    standby: bool = False  # a hot spare not yet promoted
    epoch: int = 0  # bumps at a fault: a step planned before it never ends
    busy: bool = False
    steps: int = 0
    step_s: float = 0.0  # the last step's, as a status reports it
    held_bytes: int = 0  # other nodes' checkpoint pages in this node's host memory
    held_requests: int = 0
    link_free_at: float = 0.0  # the serving node's outgoing link, pages queue on it
    pending: load.Pending = field(default_factory=load.Pending)
    status: RoutingStatus = field(default_factory=RoutingStatus)
    plan: StepPlan | None = None
    replaced_by: str | None = None
    run: "DecodeRun | None" = None  # fast path: the pure decode steps it is advancing in closed form
    undetected: bool = False  # failed, and the gateway has not noticed yet
    loaded_early: bool = False  # back before the gateway noticed it had gone: it rejoins once noticed
    weight: float = 1.0  # its routing weight while routable: SUSPICIOUS_WEIGHT after a failed canary
    down: bool = False  # the control plane's DOWN or UNHEALTHY verdict, until its model is loaded again
    session_s: float = 0.0  # when it last started serving: its canaries count from then
    corrupt_since: float | None = None  # silent corruption: answering wrongly since then, not found yet
    assist: Assist | None = None  # the draft node whose drafts it verifies, while one assists it
    step_drafts: tuple[Assist, dict[str, list[int]]] | None = None  # the drafts of the step under way, if any
    page_costs: dict[str, tuple[int, float]] = field(default_factory=dict)  # holder -> (page bytes, link seconds)

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class FaultRecord:
    fault: Fault
    nodes: tuple[str, ...]
    detected_s: float  # when the gateway took the (first) node out of routing
    interrupted: int = 0
    by_method: dict[str, int] = field(default_factory=dict)
    # Silent corruption: the first failed canary's verdict (weight 0.5), the last good canary, and the requests
    # the node served from then until it was found (recovery.actions.health.served_since_last_good_canary).
    suspicious_s: float | None = None
    last_good_canary_s: float | None = None
    possibly_corrupt: tuple[str, ...] = ()


@dataclass
class DecodeRun:
    """Steps of one node that only decode (the fast path): nothing joins, leaves, preempts or checkpoints a prefill,
    so every step gives each sequence one token and its times follow from the batch's shape alone.

    `ends[i]` is when step i ends; step 0's plan (`first`) was made by the core as any other step's; a later step i
    decodes the same sequences with `i` more context tokens each. Its checkpoint pages are events of their own at
    their steps' ends (holders' L̂ is read between them), valid for its first `valid` steps."""

    first: StepPlan
    seqs: list[Sequence]
    ends: list[float]
    token: int  # the simulation's run counter when this run began: a run cut short never ends
    valid: int = 0  # steps that happen as a run (all of them, or those before it was cut short)
    pages: list[tuple[int, list[tuple[int, int]]]] = field(default_factory=list)  # (step, [(position, blocks)])
    pages_order: int = 0  # the event order of the first page event; the k-th has pages_order + k

    def __post_init__(self):
        self.valid = len(self.ends)


RESUME_PLANS = ("eq6", "soonest")


class Simulation:
    """One run: a policy, a seed, the scenario's requests and (unless `faults` is False) its faults.

    `fast` advances a node's pure decode steps in closed form (DecodeRun) instead of one event per step; the
    decisions and the times are the step-by-step run's (tests/recovery/sim/test_fast_path.py holds it to that),
    but token ids are not computed on those steps and per-token times are not kept (each request keeps its first
    and last token's time and its count; latency over time is kept in SERIES_S buckets either way).
    """

    def __init__(
        self,
        scenario: Scenario,
        policy: str,
        seed: int,
        *,
        faults: bool = True,
        requests: list[Request] | None = None,
        fault_list: list[Fault] | None = None,
        tau: int = DEFAULT_TAU,
        theta_factor: float = DEFAULT_THETA_FACTOR,
        alpha: float = 1.0,
        beta: float = 1.0,
        max_num_seqs: int = 128,
        max_batched_tokens: int = 2048,
        load_aware_placement: bool = True,
        locality_dispatch: bool = True,
        second_holder: bool = True,
        prefill_chunk_checkpoints: bool = True,
        draft_assist: bool = True,
        fast: bool = False,
        resume: str = "eq6",
    ):
        """The five switches after `max_batched_tokens` take one of Lifeline's mechanisms away at a time, for the
        ablations of recovery/sim/lumen.py: `load_aware_placement` False places the first holder as the fixed
        neighbour; `locality_dispatch` False sends every interrupted request to its holder whatever the holder's
        load (θ infinite, DéjàVu's dispatch); `second_holder` False never gives a request a second holder;
        `prefill_chunk_checkpoints` False streams no page before the first token; `draft_assist` False has a
        restarting node load its model without assisting a survivor with its draft model meanwhile.

        `resume` is how a lost node's requests are dispatched: "eq6", document 000's eq. 6 as the gateway does it
        (recovery.plan), or "soonest", where each one's next token comes soonest by the routing cost
        (recovery.plan_soonest, an experiment the gateway does not run)."""
        if resume not in RESUME_PLANS:
            raise ValueError(f"unknown resume plan {resume!r}: expected one of {', '.join(RESUME_PLANS)}")
        self.resume = resume
        if policy not in placement.POLICIES:
            raise ValueError(f"unknown placement policy {policy!r}: expected one of {', '.join(placement.POLICIES)}")
        self.scenario, self.policy, self.seed = scenario, policy, seed
        self.tau, self.theta_factor, self.alpha, self.beta = tau, theta_factor, alpha, beta
        self.load_aware_placement, self.locality_dispatch = load_aware_placement, locality_dispatch
        self.second_holder, self.prefill_chunk_checkpoints = second_holder, prefill_chunk_checkpoints
        self.draft_assist = draft_assist
        self.assists: list[Assist] = []  # every pairing of a draft node with a survivor, in the order they began
        self.faults = (fault_list if fault_list is not None else scenario.faults(seed)) if faults else []
        self.fast = fast
        self.now = 0.0
        self.events_processed = 0
        self.steps_simulated = 0
        self._runs = 0
        # Latency over time, for recovery time: SERIES_S bucket -> [sum, count] of TTFT at each first token and of
        # the gap before each later token, where a client sees them.
        self.ttft_series: dict[int, list] = {}
        self.gap_series: dict[int, list] = {}
        self._heap: list = []
        self._started = False
        self._order = 0
        self.nodes: dict[str, NodeState] = {}
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        serving_at_start = [n for n in scenario.nodes if not n.spare]
        self.degradation = Degradation(
            scenario.degradation,
            {m: [n.deployment for n in serving_at_start if n.deployment.model.key == m] for m in scenario.models},
        )
        self._capacity_stale = True  # a node joined or left service since the last evaluation
        for spec in scenario.nodes:
            d = spec.deployment
            host = HOST_MEMORY_PER_GPU_MEMORY * d.gpu.memory_gb * d.tp * 1e9
            node = NodeState(spec, self._new_core(spec), int(host * CHECKPOINT_BUDGET))
            if spec.spare:
                node.routable, node.standby = False, True
            self.nodes[spec.name] = node
        self.failed: dict[str, float] = {}  # the gateway's: node -> when it lost it
        # A lost node's requests not yet streaming again: its other checkpoints wait for them (Coordinator's).
        self._replacing: dict[str, set[str]] = {}
        # Every request's Flight, by index. Requests given are all there from the start; those the run draws from
        # the scenario (`Scenario.arrivals`) are drawn as they arrive, and their Flights added then, in arrival
        # order, which is their index order: an hour of a large fleet is millions of requests, and the event heap
        # need not hold an arrival for each.
        self.flights: list[Flight]
        self._arrivals: Iterator[Flight]
        if requests is not None:
            self.flights = [Flight(i, r, prompt_ids(i, r.prompt_tokens)) for i, r in enumerate(requests)]
            self._arrivals = iter(sorted(self.flights, key=_arrival_s))  # stable: ties in index order
        else:
            self.flights = []
            self._arrivals = map(self._new_flight, scenario.arrivals(seed))
        self._next_arrival: Flight | None = None
        self.in_flight: dict[str, Flight] = {}
        self.waiting_for_node: list[tuple[Flight, str]] = []  # (flight, why) when no node could take it
        self.fault_records: list[FaultRecord] = []
        self.skipped_faults: list[Fault] = []  # kinds not modelled yet (UNMODELLED_KINDS)
        self._touched: set[str] = set()  # holders whose checkpoint figures changed during a step
        self._stale_holders: set[str] = set()  # nodes whose holder candidate changed since the ranking was read
        self._stepping = False
        self._recent: deque[tuple[float, str, float]] = deque()  # (when, holder, pages), FleetState's recent placements
        self._recent_pages: dict[str, float] = {}
        self.pools: dict[str, tuple[load.NodeIndex, placement.HolderRanking]] = {}
        for model in scenario.models:
            names = sorted(n for n, s in self.nodes.items() if s.spec.deployment.model.key == model)
            self.pools[model] = (
                load.NodeIndex({n: self._entry(self.nodes[n]) for n in names}),
                placement.HolderRanking([self._holder(self.nodes[n]) for n in names]),
            )
        for node in self.nodes.values():
            self._changed(node)  # each node's first status, as a node publishes one when its stream opens

    # --- the event loop ---------------------------------------------------------------------
    def _new_flight(self, request: Request) -> Flight:
        flight = Flight(len(self.flights), request, prompt_ids(len(self.flights), request.prompt_tokens))
        self.flights.append(flight)
        return flight

    def _push(self, at: float, kind: str, *payload) -> None:
        self._order += 1
        heapq.heappush(self._heap, (at, self._order, kind, payload))

    def _push_ordered(self, at: float, order: int, kind: str, *payload) -> None:
        """An event with a place in the order taken earlier (`_order` advanced past it then)."""
        heapq.heappush(self._heap, (at, order, kind, payload))

    def _new_core(self, spec: SimNode) -> EngineCore:
        """A node's engine as it starts: empty, with its model's degradation level's batch factor (the control plane
        sends it to a node that joins, recovery.actions.capacity.apply_batch_factor)."""
        core = EngineCore(
            spec.deployment, self.max_num_seqs, self.max_batched_tokens, name=spec.name, token_ids=not self.fast
        )
        core.batch_factor = self.degradation.effects(spec.deployment.model.key).batch_factor
        return core

    def run(self, until: float = math.inf) -> "Simulation":
        """Process events up to `until` (all of them by default: every request finished, or stranded with no node
        left); a later call goes on from there."""
        if not self._started:
            self._started = True
            self._next_arrival = next(self._arrivals, None)
            for i, fault in enumerate(self.faults):
                if fault.kind in UNMODELLED_KINDS:
                    self.skipped_faults.append(fault)
                else:
                    self._push(fault.at_s, "fault", i, fault)
            if self.degradation.enabled:
                self._push(0.0, "capacity")
        handlers: dict[str, Callable[..., None]] = {
            "step": self._on_step,
            "fault": self._on_fault,
            "detect": self._on_detect,
            "confirmed": self._on_confirmed,
            "resume": self._on_resume,
            "run": self._on_run_end,
            "pages": self._on_pages,
            "repair": self._on_repair,
            "loaded": self._on_loaded,
            "draft_ready": self._on_draft_ready,
            "capacity": self._on_capacity,
            "suspicious": self._on_suspicious,
            "corrupt": self._on_corrupt_found,
            "replace": self._on_replace_due,
        }
        threshold = gc.get_threshold()
        # A run allocates and frees events and steps by the million and makes next to no garbage cycles: Python's
        # default (a young collection every 700 allocations, each older one walking every live object) took a sixth
        # to an eighth of a 1,000-node run's wall time (benchmarks/README.md, Simulator speed). Fewer collections
        # while it runs.
        gc.set_threshold(max(threshold[0], GC_YOUNG_THRESHOLD), *threshold[1:])
        try:
            self._loop(until, handlers)
        finally:
            gc.set_threshold(*threshold)
        return self

    def _loop(self, until: float, handlers: dict[str, Callable[..., None]]) -> None:
        # Arrivals come from their own stream, merged with the heap: at a tie the arrival goes first, as it would
        # from the heap, where every arrival was pushed before any other event.
        heap = self._heap
        while True:
            arrival = self._next_arrival
            if arrival is not None and (not heap or arrival.request.arrival_s <= heap[0][0]):
                if arrival.request.arrival_s > until:
                    break
                self.now = arrival.request.arrival_s
                self.events_processed += 1
                self._next_arrival = next(self._arrivals, None)
                self._on_arrival(arrival)
            elif heap and heap[0][0] <= until:
                at, _, kind, payload = heapq.heappop(heap)
                self.now = at
                self.events_processed += 1
                handlers[kind](*payload)
            else:
                break

    # --- the gateway: routing and placement ----------------------------------------------------
    def _entry(self, node: NodeState) -> tuple:
        weight = node.weight if node.routable else 0.0
        return (node.status, node.pending, node.spec.deployment, weight)

    def l_hat(self, name: str) -> float:
        return self._l_hat(self.nodes[name])

    def _l_hat(self, node: NodeState) -> float:
        status = node.status
        return load.holder_load(
            status.checkpoint_bytes_held,
            node.spec.deployment.model.kv_bytes_per_block,
            status.running + status.waiting,
            self.alpha,
            self.beta,
            self._recent_pages.get(node.spec.name, 0.0),
        )

    def _holder(self, node: NodeState) -> placement.HolderCandidate:
        name = node.spec.name
        return placement.HolderCandidate(
            name=name,
            rack=node.spec.rack,
            l_hat=self._l_hat(node),
            bytes_held=node.status.checkpoint_bytes_held,
            budget_bytes=node.budget_bytes,
            alive=node.routable and name not in self.failed,
        )

    def _changed(self, node: NodeState) -> None:
        """A load-changing event on `node`: its status as workers.engine builds it, and the gateway's entries."""
        core = node.core
        # workers.engine.Engine.status's figures, in one pass over the batch.
        uncomputed = decode_batch = decode_context = 0
        for seq in core.running:
            if seq.in_prefill:
                uncomputed += seq.uncomputed
            else:
                decode_batch += 1
                decode_context += seq.context_len
        for seq in core.waiting:
            uncomputed += seq.uncomputed
        node.status = RoutingStatus(
            at=self.now,
            model_state="serving" if node.routable else "loading",
            waiting=len(core.waiting),
            running=len(core.running),
            uncomputed_prefill_tokens=uncomputed,
            decode_batch=decode_batch,
            decode_context_tokens=decode_context,
            kv_blocks_used=core.used_blocks,
            kv_blocks_total=core.total_blocks,
            checkpoint_bytes_held=node.held_bytes,
            checkpoint_budget_bytes=node.budget_bytes,
            checkpoint_requests=node.held_requests,
            step_ms=round(node.step_s * 1000, 3),  # as the engine reports it
            steps=node.steps,
            batch_limit=core.batch_limit,
            in_flight=len(core.by_id),
        )
        self._refresh(node)

    def _refresh(self, node: NodeState) -> None:
        nodes, _ = self.pools[node.spec.deployment.model.key]
        nodes.set(node.name, self._entry(node))
        self._stale_holders.add(node.name)

    def _refresh_holder(self, node: NodeState) -> None:
        """Only `node`'s L̂ or checkpoint figures changed: its holder candidate, not its routing entry (the routing
        cost reads no checkpoint figure, and its status object is the one the routing index already holds).

        The candidate is rebuilt when a placement next reads the ranking (`_ranking`), not now: a holder's pages
        move its L̂ at nearly every step, and a ranking is read about once per request. The ranking is ordered by
        (L̂, name), a total order, so re-ranking only the latest candidate of each node gives the same order as
        re-ranking at every change; every figure a candidate is built from changes only where this is called."""
        self._stale_holders.add(node.name)

    def _ranking(self, model: str) -> placement.HolderRanking:
        """The pool's holder ranking, brought up to date with the candidates that changed since it was last read."""
        if self._stale_holders:
            for name in self._stale_holders:
                node = self.nodes[name]
                self.pools[node.spec.deployment.model.key][1].set(self._holder(node))
            self._stale_holders.clear()
        return self.pools[model][1]

    def expire(self) -> None:
        """FleetState.expire: placements older than RECENT_S stop counting in their holder's L̂."""
        while self._recent and self.now - self._recent[0][0] >= RECENT_S:
            _, name, pages = self._recent.popleft()
            left = self._recent_pages.get(name, 0.0) - pages
            if left <= 1e-9:
                self._recent_pages.pop(name, None)
            else:
                self._recent_pages[name] = left
            self._refresh_holder(self.nodes[name])

    def choose(self, model: str, prompt_tokens: int, exclude: Collection[str] = ()) -> str | None:
        """The real gateway's routing decision (FleetState.choose): the failed nodes left out."""
        nodes, _ = self.pools[model]
        return nodes.choose(prompt_tokens, self.now, set(exclude) | set(self.failed))

    def place(self, flight: Flight, serving: str) -> tuple[str, ...]:
        """The checkpoint holders (Coordinator.place → FleetState.place) and their recent pages (FleetState.placed)."""
        self.expire()
        model = flight.request.model
        ranking = self._ranking(model)
        deployment = self.nodes[serving].spec.deployment
        tokens = flight.request.prompt_tokens + flight.request.output_tokens
        chosen = placement.place(
            self.policy if self.load_aware_placement else "fixed",
            serving,
            ranking,  # type: ignore[arg-type]  # place() takes a HolderRanking too, as the gateway passes it
            request_bytes=tokens * deployment.model.kv_bytes_per_token,
            prefix_tokens=flight.request.prompt_tokens,
            tau=self.tau,
        )
        if not self.second_holder:
            chosen = chosen[:1]
        pages = math.ceil(tokens / catalog.BLOCK_TOKENS)
        for name in chosen:
            self._recent.append((self.now, name, pages))
            self._recent_pages[name] = self._recent_pages.get(name, 0.0) + pages
            self._refresh_holder(self.nodes[name])
        return chosen

    def _on_arrival(self, flight: Flight) -> None:
        refused = self.degradation.refuses(flight.request.model, flight.request.tier)
        if refused is not None:
            flight.shed = refused  # 429 for a shed tier, 503 for every new request at level 4: never dispatched
            return
        self._dispatch(flight, self.choose(flight.request.model, flight.request.prompt_tokens), None, 0)

    def _dispatch(self, flight: Flight, target: str | None, decision: dispatch.Decision | None, restored: int) -> None:
        """Start (or continue) `flight` on `target` with `restored` KV tokens already there."""
        if target is None:
            self.waiting_for_node.append((flight, "no node can take it"))
            return
        node = self.nodes[target]
        self._settle(node)
        flight.node = target
        flight.spans.append([target, self.now, None])
        flight.holders = self.place(flight, target)
        flight.pages = {h: [] for h in flight.holders}
        flight.refused = set()
        flight.blocks_sent = 0
        node.pending.add(flight.context_tokens)
        seq = Sequence(
            flight.request_id,
            flight.prompt_ids,
            sampling(flight.request),
            generated=list(flight.generated),
            computed=restored,
            holders=flight.holders,
            checkpoint_prefill_chunks=self.policy == "lifeline" and self.prefill_chunk_checkpoints,
        )
        flight.seq = seq
        self.in_flight[flight.request_id] = flight
        node.core.add(seq, self.now)
        node.pending.confirm(flight.context_tokens)  # the node's arrival event, with no network delay
        self._changed(node)
        self._wake(node)

    # --- nodes stepping ------------------------------------------------------------------------
    def _wake(self, node: NodeState) -> None:
        if node.busy or not node.alive or node.core.next_due(self.now) is None:
            return
        assist = node.assist
        # An assisted node keeps KV room for the drafts it will verify (workers.engine plans with lookahead k).
        plan = node.core.plan(self.now, lookahead=ASSIST_K if assist is not None else 0)
        if plan is None:
            return
        node.busy, node.plan = True, plan
        verified = 0
        if assist is not None:
            drafts = self._drafts(node.core, assist, plan)
            if drafts:
                node.step_drafts = (assist, drafts)
                verified = len(drafts) * ASSIST_K
        end = self.now + node.core.step_seconds(plan, verified)
        # An assisted node goes step by step: its steps' lengths depend on the drafts accepted.
        run = self._decode_run(node, plan, end) if self.fast and assist is None else None
        if run is None:
            self._push(end, "step", node.name, node.epoch)
            return
        node.run = run
        # Blocks complete when a sequence's computed tokens reach a boundary: first at step `at`, then every block.
        pages: list[tuple[int, int, int]] = []  # (step, position in the batch, blocks)
        if node.core.checkpoints:
            for position, seq in enumerate(run.seqs):
                if not seq.holders:
                    continue
                streamed = seq.streamed_blocks
                at = max(0, (streamed + 1) * catalog.BLOCK_TOKENS - seq.computed - 1)
                while at < len(run.ends):
                    complete = (seq.computed + at + 1) // catalog.BLOCK_TOKENS
                    pages.append((at, position, complete - streamed))
                    streamed = complete
                    at += catalog.BLOCK_TOKENS
        by_step: dict[int, list[tuple[int, int]]] = {}
        for at, position, blocks in sorted(pages):
            by_step.setdefault(at, []).append((position, blocks))
        # One event per step that completes blocks, in step order; each pushed when the one before it is handled
        # (a run is mostly cut short by the next arrival, and the events of its later steps would only be popped to
        # be ignored), with the place in the event order it would have had pushed now (ties break the same way).
        run.pages = list(by_step.items())
        if run.pages:
            run.pages_order = self._order + 1
            self._order += len(run.pages)
            self._push_ordered(run.ends[run.pages[0][0]], run.pages_order, "pages", node.name, run, 0)
        self._push(run.ends[-1], "run", node.name, run.token)

    def _decode_run(self, node: NodeState, plan: StepPlan, end: float) -> DecodeRun | None:
        """The pure decode steps from `plan` on, when there are at least MIN_RUN: the plan admits, preempts and
        prefills nothing, every sequence had its last token when the plan began, and the run stops before the
        step where a sequence finishes, where a second holder would be asked for, or where the next step would
        need more KV blocks than are free (the scheduler would preempt); those steps go step by step."""
        if plan.admitted or plan.preempted or plan.shape[0]:
            return None
        seqs = [seq for seq, _ in plan.work]
        limit = MAX_RUN
        residues = [0] * catalog.BLOCK_TOKENS  # sequences by computed tokens modulo the block size
        for seq in seqs:
            flight = self.in_flight[seq.request_id]
            if flight.last_token_s != plan.started or flight.waiting_since is not None:
                return None
            limit = min(limit, seq.params.max_tokens - len(seq.generated) - 1)
            if self._may_ask_second_holder(flight):
                limit = min(limit, self.tau - flight.context_tokens)
            residues[seq.computed % catalog.BLOCK_TOKENS] += 1
        if limit < MIN_RUN:
            return None
        core = node.core
        free = core.total_blocks - core.used_blocks  # after step 0's plan took its blocks
        batch, context = len(seqs), plan.shape[3]
        steps = 1
        for i in range(1, limit):
            # Step i's plan takes a block for each sequence whose computed tokens reach a block boundary.
            free -= residues[-i % catalog.BLOCK_TOKENS]
            if free < 0:
                break
            steps += 1
        if steps < MIN_RUN:
            return None
        # Step i decodes over context + i·batch tokens; each ends when the one before it did plus its own time.
        times = core.deployment.decode_step_times(batch, range(context + batch, context + steps * batch, batch))
        ends = list(accumulate(times, initial=end))
        self._runs += 1
        return DecodeRun(plan, seqs, ends, self._runs)

    def _settle(self, node: NodeState) -> None:
        """Bring `node`'s decode run up to now, before something changes it: the steps that ended are applied, and
        the one under way becomes an ordinary step, planned as the step-by-step run planned it."""
        run = node.run
        if run is None:
            return
        done = bisect_right(run.ends, self.now)
        if done == len(run.ends):
            return  # it ends now: its own event applies it
        node.run = None
        run.valid = done  # its pages of later steps never go out: those steps are ordinary ones now
        plan: StepPlan | None = run.first
        if done:
            self._apply_run(node, run, done)
            plan = node.core.plan(run.ends[done - 1])
            assert plan is not None and plan.shape[0] == 0, "the step under way in a decode run decodes"
        node.plan = plan
        self._push(run.ends[done], "step", node.name, node.epoch)

    def _on_pages(self, name: str, run: DecodeRun, index: int) -> None:
        """The `index`-th step of a decode run that completed KV blocks, (position in the batch, blocks) in batch
        order: a page each to the sequence's holders, as _on_step sends a step's BlockComplete events. Then the next
        such step's event, unless the run was cut short before it."""
        step, completed = run.pages[index]
        if step >= run.valid:
            return  # cut short (_settle) or the node failed: the later steps are ordinary ones, or never happen
        serving = self.nodes[name]
        for position, blocks in completed:
            seq = run.seqs[position]
            seq.streamed_blocks += blocks
            self._page(serving, self.in_flight[seq.request_id], blocks)
        self._flush_touched()
        if index + 1 < len(run.pages):
            at = run.ends[run.pages[index + 1][0]]
            self._push_ordered(at, run.pages_order + index + 1, "pages", name, run, index + 1)

    def _on_run_end(self, name: str, token: int) -> None:
        node = self.nodes[name]
        run = node.run
        if run is None or run.token != token:
            return  # cut short (_settle) or the node failed
        node.run = None
        self._apply_run(node, run, len(run.ends))
        node.busy, node.plan = False, None
        self._wake(node)

    def _apply_run(self, node: NodeState, run: DecodeRun, steps: int) -> None:
        """The first `steps` steps of `run`, in closed form: what EngineCore.apply and _on_step would have done
        one step at a time (tokens counted, KV blocks taken, latency recorded; the pages went out as events)."""
        core, ends = node.core, run.ends
        batch = len(run.seqs)
        started = run.first.started
        for i in range(steps):
            self._series(self.gap_series, ends[i], batch * (ends[i] - started), batch)
            started = ends[i]
        for seq in run.seqs:
            flight = self.in_flight[seq.request_id]
            seq.computed += steps
            seq.generated += _PLACEHOLDERS[:steps]
            flight.generated += _PLACEHOLDERS[:steps]
            flight.emitted += steps
            flight.last_token_s = ends[steps - 1]
            need = core.blocks_for(seq.computed) - seq.blocks
            if need > 0:
                core.used_blocks += need
                seq.blocks += need
        assert core.used_blocks <= core.total_blocks, "a decode run took more KV blocks than were free"
        core.counters["generation_tokens"] += batch * steps
        node.steps += steps
        node.step_s = ends[steps - 1] - (ends[steps - 2] if steps > 1 else run.first.started)
        self.steps_simulated += steps

    def _on_step(self, name: str, epoch: int) -> None:
        node = self.nodes[name]
        if epoch != node.epoch:
            return  # the node failed while the step ran: nothing of it came out
        plan = node.plan
        assert plan is not None, "a step ends only after it was planned"
        node.busy = False
        node.steps += 1
        self.steps_simulated += 1
        node.step_s = self.now - plan.started
        node.plan = None
        if node.step_drafts is not None:
            pairing, drafts = node.step_drafts
            node.step_drafts = None
            result = node.core.apply(plan, self.now, drafts)
            pairing.counters.update(result.assist)
        else:
            result = node.core.apply(plan, self.now)
        # The gateway's view of the node changes when its batch does; a step that only decoded moves its
        # context on, which the real gateway sees at the node's next load message (every 250 ms at most).
        changed = bool(plan.admitted or plan.preempted or plan.shape[0])
        self._stepping = True
        # A sequence's BlockComplete events come one after another: they are paged out together, in the same order.
        blocks_of: Sequence | None = None
        blocks = 0
        for event in result.events:
            if blocks_of is not None:
                if isinstance(event, BlockComplete) and event.seq is blocks_of:
                    blocks += event.count
                    continue
                self._page(node, self.in_flight[blocks_of.request_id], blocks)
                blocks_of = None
            if isinstance(event, Token):
                self._token(self.in_flight[event.seq.request_id], event)
            elif isinstance(event, BlockComplete):
                blocks_of, blocks = event.seq, event.count
            elif isinstance(event, Finished):
                self._finished(self.in_flight[event.seq.request_id], event)
                changed = True
        if blocks_of is not None:
            self._page(node, self.in_flight[blocks_of.request_id], blocks)
        self._stepping = False
        self._flush_touched()
        if changed:
            self._changed(node)
        self._wake(node)

    def _token(self, flight: Flight, token: Token) -> None:
        assert token.index == len(flight.generated), "a token out of order reached the client"
        flight.generated.append(token.token_id)
        now = self.now
        if flight.first_token_s is None:
            flight.first_token_s = now
            self._series(self.ttft_series, now, now - flight.request.arrival_s, 1)
        else:
            assert flight.last_token_s is not None
            self._series(self.gap_series, now, now - flight.last_token_s, 1)
        flight.last_token_s = now
        flight.emitted += 1
        if not self.fast:
            flight.token_times.append(now)
        if flight.waiting_since is not None:
            flight.stalls.append(now - flight.waiting_since)
            flight.waiting_since = None
        if self._replacing:  # its first token since its node was lost, if it was
            self._served(flight.request_id)
        self._consider_second_holder(flight)

    @staticmethod
    def _series(series: dict[int, list], at: float, total: float, count: int) -> None:
        entry = series.get(bucket := int(at // SERIES_S))
        if entry is None:
            series[bucket] = [total, count]
        else:
            entry[0] += total
            entry[1] += count

    def _may_ask_second_holder(self, flight: Flight) -> bool:
        """Whether the token that takes `flight`'s context past τ would ask for a second holder."""
        return (
            self.policy == "lifeline"
            and self.second_holder
            and len(flight.holders) == 1
            and not flight.second_asked
            and flight.seq is not None
            and flight.seq.finished is None
        )

    def _consider_second_holder(self, flight: Flight) -> None:
        """Coordinator.consider_second_holder and add_second_holder: once a request's context passes τ under
        lifeline, a second holder, the least loaded routable node in another rack than the first (any other when
        there is none), asked once per request."""
        if len(flight.holders) != 1 or flight.context_tokens <= self.tau or not self._may_ask_second_holder(flight):
            return  # (the holder count first: most requests have two from the start, and this runs at every token)
        flight.second_asked = True
        first = flight.holders[0]
        request = flight.request
        request_bytes = (request.prompt_tokens + request.output_tokens) * self.nodes[
            flight.node
        ].spec.deployment.model.kv_bytes_per_token
        # The gateway's choice (min over the routable nodes with room, in (L̂, name) order, another rack first),
        # read from the pool's ranking, which holds every node's L̂, room and liveness as the gateway sees them:
        # the first in order that qualifies, not a pass over the whole fleet per request.
        ranking = self._ranking(request.model)
        first_rack = self.nodes[first].spec.rack
        second = same_rack = None
        for candidate in ranking.with_second_room(request_bytes):
            if not candidate.alive or candidate.name in (flight.node, first):
                continue
            if candidate.rack != first_rack:
                second = candidate.name
                break
            same_rack = same_rack or candidate.name
        second = second or same_rack
        if second is None:
            return
        self._set_holders(flight, (first, second))

    def _page(self, serving: NodeState, flight: Flight, blocks: int = 1) -> None:
        """`blocks` completed KV blocks of `flight`: a page each to every holder, queued on the serving node's link."""
        flight.blocks_sent += blocks
        self._send(serving, flight, flight.holders, blocks)

    def _send(self, serving: NodeState, flight: Flight, holders: tuple[str, ...], pages: int = 1) -> None:
        """The holders' next `pages` pages of `flight`, a page to every holder before the next page, each queued on
        the serving node's link and arriving when its transfer ends; none to a holder whose budget is spent
        (workers.kvstore refuses the page, and every later page of the request), nor to a dead one (lost).

        A prefill completes a hundred blocks at once: each holder's figures are looked up once for all of them, and
        when every holder has room for all of them their arrival times are summed in one pass, one page after the
        other as the link serves them (the same additions in the same order)."""
        refused, now = flight.refused, self.now
        queues = []  # (holder, its state, its page arrivals, page bytes, link seconds)
        for holder in holders:
            h = self.nodes[holder]
            if holder in refused or not h.alive:
                continue
            per_block, seconds = serving.page_costs.get(holder) or self._page_cost(serving, h)
            queues.append((holder, h, flight.pages.setdefault(holder, []), per_block, seconds))
        if not queues or pages <= 0:
            return
        if all(h.held_bytes + pages * per_block <= h.budget_bytes for _, h, _, per_block, _ in queues):
            # A page arrives when the link is done with the one before it: after the first, the link is busy.
            start = max(now, serving.link_free_at)
            times = list(accumulate([seconds for *_, seconds in queues] * pages, initial=start))
            serving.link_free_at = times[-1]
            for lane, (holder, h, arrivals, per_block, _) in enumerate(queues):
                if not arrivals:
                    h.held_requests += 1
                arrivals += times[1 + lane :: len(queues)]
                h.held_bytes += pages * per_block
                self._touched.add(holder)
            return
        for _ in range(pages):
            for holder, h, arrivals, per_block, seconds in queues:
                if holder in refused:
                    continue
                if h.held_bytes + per_block > h.budget_bytes:
                    refused.add(holder)
                    continue
                serving.link_free_at = max(now, serving.link_free_at) + seconds
                if not arrivals:
                    h.held_requests += 1
                arrivals.append(serving.link_free_at)
                h.held_bytes += per_block
                self._touched.add(holder)

    def _page_cost(self, serving: NodeState, holder: NodeState) -> tuple[int, float]:
        """A page's bytes and its time on the link from `serving` to `holder` (fixed for a pair: computed once)."""
        cost = serving.page_costs.get(holder.name)
        if cost is None:
            per_block = serving.spec.deployment.model.kv_bytes_per_block
            link, share = catalog.node_link(serving.spec.placement, holder.spec.placement, serving.spec.deployment.gpu)
            cost = serving.page_costs[holder.name] = (per_block, catalog.kv_transfer_s(per_block, link, share))
        return cost

    def _set_holders(self, flight: Flight, holders: tuple[str, ...]) -> None:
        """workers.engine.Engine.set_holders: added holders get every block so far, dropped ones let go."""
        serving = self.nodes[flight.node]
        self._settle(serving)  # every block so far: those of its decode run's finished steps too
        seq = flight.seq
        assert seq is not None, "only a running request changes holders"
        for holder in [h for h in flight.holders if h not in holders]:
            self._drop_pages(flight, holder)
        added = [h for h in holders if h not in flight.holders]
        flight.holders = seq.holders = tuple(holders)
        for holder in added:
            flight.pages[holder] = []
            flight.refused.discard(holder)
            self._send(serving, flight, (holder,), flight.blocks_sent)
        self._flush_touched()

    def _drop_pages(self, flight: Flight, holder: str) -> None:
        pages = flight.pages.pop(holder, None)
        if pages:
            h = self.nodes[holder]
            h.held_bytes -= h.spec.deployment.model.kv_bytes_per_block * len(pages)
            h.held_requests -= 1
            self._touched.add(holder)

    def _flush_touched(self) -> None:
        """Holders whose checkpoint figures changed: their status says so (the rest of it is as it was)."""
        if not self._stepping:
            for holder in self._touched:
                node = self.nodes[holder]
                node.status.checkpoint_bytes_held = node.held_bytes
                node.status.checkpoint_requests = node.held_requests
            self._stale_holders |= self._touched
            self._touched.clear()

    def _drop_checkpoint(self, flight: Flight) -> None:
        for holder in list(flight.pages):
            self._drop_pages(flight, holder)
        self._flush_touched()

    def _finished(self, flight: Flight, event: Finished) -> None:
        flight.finished_at = self.now
        flight.spans[-1][2] = self.now
        flight.level = self.degradation.level(flight.request.model)
        self.in_flight.pop(flight.request_id, None)
        self._drop_checkpoint(flight)
        if self._replacing:
            self._served(flight.request_id)
        if self.fast:
            flight.generated, flight.seq = [], None  # counted in `emitted`; a long run would hold every token

    # --- faults ---------------------------------------------------------------------------------
    def _targets(self, fault: Fault) -> list[str]:
        if fault.kind == "rack":
            return [n for n, s in self.nodes.items() if s.spec.rack == fault.target]
        return [fault.target]

    def _settle_all(self) -> None:
        for node in self.nodes.values():
            self._settle(node)

    def _on_fault(self, index: int, fault: Fault) -> None:
        if fault.kind == "sdc":
            self._corrupt(index, fault)  # nothing changes yet: the node answers on, wrongly
            return
        self._settle_all()
        names = [n for n in self._targets(fault) if self.nodes[n].alive and not self.nodes[n].standby]
        record = FaultRecord(fault, tuple(names), math.inf)
        self.fault_records.append(record)
        for name in names:
            node = self.nodes[name]
            node.alive, node.undetected = False, True
            node.epoch += 1  # the step under way never ends
            node.busy, node.run = False, None
            self._stop_assisting(node)
            # Its host memory is gone: the checkpoints it held are lost.
            for flight in self.in_flight.values():
                if flight.pages.get(name):
                    flight.pages[name] = []
            node.held_bytes, node.held_requests = 0, 0
            rng = random.Random(f"{self.seed}:detect:{name}:{index}")
            found = detect(fault.kind, rng, self.scenario.detection)
            record.detected_s = min(record.detected_s, fault.at_s + found.routing_s)
            self._push(fault.at_s + found.routing_s, "detect", name, record, node.epoch)
            self._push(fault.at_s + max(found.routing_s, found.confirmed_s), "confirmed", name, node.epoch)
            if fault.repair_s is not None:
                self._push(fault.back_at_s, "repair", name, node.epoch)

    def _on_detect(self, name: str, record: FaultRecord, epoch: int) -> None:
        """The gateway loses `name` (Coordinator.node_lost): out of routing, its requests planned in one pass."""
        node = self.nodes[name]
        if epoch != node.epoch or name in self.failed:
            return
        self._settle_all()
        self.failed[name] = self.now
        node.routable, node.undetected = False, False
        self._refresh(node)
        stranded = [f for f in self.in_flight.values() if f.node == name and f.seq is not None]
        for flight in stranded:
            flight.interrupted_at.append(record.fault.at_s)
            if flight.waiting_since is None:
                flight.waiting_since = record.fault.at_s
        # Its engine and KV cache are gone.
        node.core = self._new_core(node.spec)
        node.pending = load.Pending()
        self._changed(node)
        record.interrupted += len(stranded)
        self._plan(stranded, record)
        waiting = {f.request_id for f in self.in_flight.values() if f.node == name}
        if waiting:
            self._replacing[name] = waiting
            self._push(self.now + recovery.REPLACE_HOLDERS_WITHIN_S, "replace", name, waiting)
        else:
            self._replace_holders(name)
        if node.loaded_early:
            node.loaded_early = False
            self._on_loaded(name, epoch)

    def _served(self, request_id: str) -> None:
        """Coordinator._served: once every request of a lost node streams again or is over, its checkpoints are
        re-placed, after the event under way (the gateway's next loop turn)."""
        for lost, waiting in list(self._replacing.items()):
            if request_id in waiting:
                waiting.discard(request_id)
                if not waiting:
                    self._push(self.now, "replace", lost, waiting)

    def _on_replace_due(self, lost: str, waiting: set[str]) -> None:
        if self._replacing.get(lost) is waiting:
            del self._replacing[lost]
            self._settle_all()
            self._replace_holders(lost)

    def _replace_holders(self, lost: str) -> None:
        """Coordinator._replace_holders: requests running elsewhere that had `lost` as a holder get a new one,
        and their serving node resends every block to it.

        Every new holder is chosen before any block is resent, as the gateway chooses them all before its calls
        to the serving nodes go out: no choice sees the pages resent for another request, which the gateway
        hears of only from the holders' later statuses (tests/recovery/sim/test_replay.py)."""
        changes = []
        for flight in list(self.in_flight.values()):
            if lost not in flight.holders or flight.seq is None or flight.node == lost:
                continue
            keep = [h for h in flight.holders if h != lost and h not in self.failed and self.nodes[h].routable]
            fresh = [h for h in self.place(flight, flight.node) if h not in keep]
            wanted = 2 if len(flight.holders) > 1 else 1
            changes.append((flight, tuple((keep + fresh)[:wanted])))
        for flight, holders in changes:
            self._set_holders(flight, holders)

    def _on_confirmed(self, name: str, epoch: int) -> None:
        """The control plane's DOWN or UNHEALTHY: out of service for capacity, and a hot spare of the node's group
        is promoted."""
        node = self.nodes[name]
        if epoch == node.epoch:
            if not node.alive:
                node.down = True
                self._capacity_stale = True
            self._promote_spare(node)

    def _plan(self, stranded: list[Flight], record: FaultRecord | None) -> None:
        """Coordinator._plan: survivors with their L̂ and free blocks, θ, then plan_recovery in one pass."""
        by_model: dict[str, list[Flight]] = {}
        for flight in stranded:
            by_model.setdefault(flight.request.model, []).append(flight)
        for model, flights in by_model.items():
            survivors = {
                name: recovery.survivor(name, node.spec.placement, self.l_hat(name), node.status, node.spec.deployment)
                for name, node in sorted(self.nodes.items())
                if node.spec.deployment.model.key == model and node.routable and name not in self.failed
            }
            interrupted = [
                dispatch.Interrupted(
                    request_id=f.request_id,
                    holders=f.holders,
                    checkpointed_tokens=self.checkpointed_estimate(f),
                    context_tokens=f.context_tokens,
                )
                for f in flights
            ]
            theta_factor = self.theta_factor if self.locality_dispatch else math.inf
            try:
                if self.resume == "soonest":
                    statuses = {name: self.nodes[name].status for name in survivors}
                    decisions = recovery.plan_soonest(interrupted, survivors, statuses, set(self.failed))
                else:
                    decisions = recovery.plan(
                        interrupted, survivors, set(self.failed), theta_factor, self.tau, self.alpha, self.beta
                    )
            except dispatch.NoSurvivors:
                for flight in flights:
                    self._leave(flight)
                    self.waiting_for_node.append((flight, "no survivor"))
                continue
            hop = MOVE_HOP_S[0] + MOVE_HOP_S[1] * len(stranded)
            for flight, decision in zip(flights, decisions):
                self._leave(flight)
                self._carry_out(flight, decision, record, hop)

    def checkpointed_estimate(self, flight: Flight) -> int:
        """Coordinator._checkpointed_estimate: recovery.checkpointed_estimate, with prefill chunks checkpointed
        under lifeline unless that mechanism is ablated."""
        chunks = self.policy == "lifeline" and self.prefill_chunk_checkpoints
        return recovery.checkpointed_estimate(flight.holders, bool(flight.generated), flight.context_tokens, chunks)

    def received_tokens(self, flight: Flight, holder: str, at: float) -> int:
        """KV tokens `holder` really has of `flight`: its pages that arrived by `at`, within the client's context."""
        pages = bisect_right(flight.pages.get(holder, []), at)
        # At least the last context token is left to compute: the step that continues it emits the next token.
        limit = (flight.context_tokens - 1) // catalog.BLOCK_TOKENS
        return min(pages, limit) * catalog.BLOCK_TOKENS

    def _leave(self, flight: Flight) -> None:
        """The request is off its node: its old checkpoints stay readable until it resumes (their pages are kept)."""
        flight.seq = None
        flight.spans[-1][2] = self.now

    def _carry_out(
        self, flight: Flight, decision: dispatch.Decision, record: FaultRecord | None, hop: float = 0.0
    ) -> None:
        """The move planned for `flight`: it reaches its target after the gateway's hop and the KV restore or fetch."""
        fault_at = record.fault.at_s if record else self.now
        restored, delay, method = 0, hop, decision.method
        if method in ("restore", "fetch") and decision.source is not None:
            restored = self.received_tokens(flight, decision.source, fault_at)
            per_block = self.nodes[decision.target].spec.deployment.model.kv_bytes_per_block
            size = restored // catalog.BLOCK_TOKENS * per_block
            if method == "restore":
                delay += catalog.kv_transfer_s(size, catalog.HOST_TO_GPU_LINK)
            else:
                target = self.nodes[decision.target].spec
                link, share = catalog.node_link(
                    self.nodes[decision.source].spec.placement, target.placement, target.deployment.gpu
                )
                delay += catalog.kv_transfer_s(size, link, share)
            if restored == 0:
                method = "reprefill"  # the holder had no page of it yet (workers.engine.resume falls back)
        flight.methods.append(method)
        flight.restored_tokens.append(restored)
        if record is not None:
            record.by_method[method] = record.by_method.get(method, 0) + 1
        self._push(self.now + delay, "resume", flight, decision, restored)

    def _on_resume(self, flight: Flight, decision: dispatch.Decision, restored: int) -> None:
        """Coordinator.route_for: the planned target, or whoever is least loaded if it left routing meanwhile."""
        target: str | None = decision.target
        if target in self.failed or not self.nodes[decision.target].routable:
            target, restored = self.choose(flight.request.model, flight.context_tokens), 0
            flight.methods[-1] = "reprefill"
            flight.restored_tokens[-1] = 0
        self._drop_checkpoint(flight)
        self._dispatch(flight, target, decision, restored)

    def _promote_spare(self, lost: NodeState) -> None:
        """A hot spare of the lost node's group takes its place at once (its model is loaded)."""
        for name, node in sorted(self.nodes.items()):
            if node.standby and node.spec.group == lost.spec.group and node.alive:
                node.standby, node.routable = False, True
                lost.replaced_by = name
                self._capacity_stale = True
                self._changed(node)
                self._retry_waiting()
                return

    # --- degradation levels (recovery.sim.degradation) -------------------------------------------
    def _in_service(self, node: NodeState) -> bool:
        """In service for the control plane's capacity: not a hot spare waiting, not DOWN or UNHEALTHY."""
        return not node.standby and not node.down

    def _on_capacity(self) -> None:
        """recovery.actions.capacity.evaluate at its beat: each model's capacity against its objective, its level
        moved with hysteresis, the new level's effects applied."""
        if self._capacity_stale:
            for model in self.degradation.models:
                serving = [
                    n.spec.deployment
                    for n in self.nodes.values()
                    if n.spec.deployment.model.key == model and self._in_service(n)
                ]
                self.degradation.count(model, serving)
            self._capacity_stale = False
        for change in self.degradation.evaluate(self.now):
            self._apply_level(change)
        # Every beat while the run goes on: until the arrivals end, then while requests are in flight.
        later = self.now + self.scenario.degradation.interval_s
        if later < self.scenario.duration_s or (self.in_flight and (self._heap or self._next_arrival is not None)):
            self._push(later, "capacity")

    def _apply_level(self, change: LevelChange) -> None:
        """The level's batch factor to each node of the model (recovery.reactions.on_degradation_change): running
        sequences go on, new ones wait while the batch is at its new limit (workers.engine.set_batch_factor)."""
        factor = self.degradation.effects(change.model).batch_factor
        for _, node in sorted(self.nodes.items()):
            if node.spec.deployment.model.key != change.model or node.core.batch_factor == factor:
                continue
            self._settle(node)  # the step under way was planned with the old limit
            node.core.batch_factor = factor
            self._changed(node)  # the node publishes its new batch limit
            self._wake(node)

    # --- silent corruption --------------------------------------------------------------------------
    def _corrupt(self, index: int, fault: Fault) -> None:
        """`fault.target` answers wrongly from now on, until its canaries find it: SUSPICIOUS (weight 0.5) at the
        first failed canary's verdict, UNHEALTHY (weight 0) at the unhealthy_after-th (faults.detect)."""
        node = self.nodes[fault.target]
        if not node.alive or node.standby or node.corrupt_since is not None:
            self.fault_records.append(FaultRecord(fault, (), math.inf))  # nothing serving there to corrupt
            return
        name = fault.target
        canary_s = self._canary_s(node, random.Random(f"{self.seed}:canary:{name}:{index}"))
        found = detect("sdc", random.Random(f"{self.seed}:detect:{name}:{index}"), self.scenario.detection, canary_s)
        assert found.first_canary_s is not None and found.suspicious_s is not None
        record = FaultRecord(fault, (name,), fault.at_s + found.routing_s)
        # The canary round before the first failing one passed; a node that joined since had none before.
        previous = fault.at_s + found.first_canary_s - self.scenario.detection.canary_interval_s
        record.last_good_canary_s = max(previous, node.session_s)
        self.fault_records.append(record)
        node.corrupt_since = fault.at_s
        if found.suspicious_s < found.routing_s:
            record.suspicious_s = fault.at_s + found.suspicious_s
            self._push(record.suspicious_s, "suspicious", name, node.epoch)
        self._push(record.detected_s, "corrupt", name, record, node.epoch)

    @staticmethod
    def _canary_s(node: NodeState, rng: random.Random) -> float:
        """One canary's run time on `node`: one of document 003's prompts (recovery.canary.PROMPTS, chosen as
        recovery.actions.health.run_canary chooses), its prefill pass and a decode step per further token, as
        recovery.actions.health.canary_gpu_ms counts it."""
        prompt = rng.choice(CANARY_PROMPTS)
        deployment = node.spec.deployment
        tokens = len(vocabulary.encode(str(prompt["prompt"])))
        max_tokens = int(prompt["max_tokens"])  # type: ignore[call-overload]  # PROMPTS mixes str and int values
        decode = sum(deployment.decode_step_s(1, tokens + i) for i in range(1, max(max_tokens, 1)))
        return deployment.prefill_s(tokens) + decode

    def _on_suspicious(self, name: str, epoch: int) -> None:
        node = self.nodes[name]
        if epoch == node.epoch and node.routable:
            node.weight = SUSPICIOUS_WEIGHT
            self._refresh(node)

    def _on_corrupt_found(self, name: str, record: FaultRecord, epoch: int) -> None:
        """UNHEALTHY with wrong answers (recovery.actions.health.record_canary, then recovery.reactions): weight 0,
        the requests it served since its last good canary named, those in flight moved off live at once
        (recovery.actions.live_migration.move_off_corrupt), a hot spare promoted; then the node is reset (its
        engine, KV cache and the checkpoints it held are gone) and out until its repair and model load."""
        node = self.nodes[name]
        if epoch != node.epoch:
            record.nodes = ()  # another fault took it out first, and that fault's recovery moved its requests
            record.detected_s = math.inf
            return
        self._settle_all()
        since = record.last_good_canary_s
        assert since is not None
        named = [f for f in self.flights if self._served_between(f, name, since, self.now)]
        for flight in named:
            flight.possibly_corrupt = True
        record.possibly_corrupt = tuple(f.request_id for f in named)
        self.failed[name] = self.now
        node.routable, node.weight, node.down, node.corrupt_since = False, 1.0, True, None
        self._capacity_stale = True
        self._refresh(node)
        moving = [f for f in self.in_flight.values() if f.node == name and f.seq is not None]
        record.interrupted = len(moving)
        for flight in moving:
            self._move_off(flight, node, record)
        # The reset: as after a crash, but nothing is left on it to recover.
        node.alive = False
        node.epoch += 1
        node.busy, node.run, node.plan = False, None, None
        self._stop_assisting(node)
        for flight in self.in_flight.values():
            if flight.pages.get(name):
                flight.pages[name] = []
        node.held_bytes, node.held_requests = 0, 0
        node.core, node.pending = self._new_core(node.spec), load.Pending()
        self._changed(node)
        self._replace_holders(name)
        self._promote_spare(node)
        if record.fault.repair_s is not None:
            self._push(max(self.now, record.fault.back_at_s), "repair", name, node.epoch)

    @staticmethod
    def _served_between(flight: Flight, name: str, since: float, until: float) -> bool:
        """Whether `name` had `flight` at any moment from `since` to `until`."""
        return any(n == name and start <= until and (end is None or end >= since) for n, start, end in flight.spans)

    def _move_off(self, flight: Flight, source: NodeState, record: FaultRecord) -> None:
        """Coordinator.migrate_node for one request: the least-loaded other node, its KV moved when that is faster
        than re-prefilling and the target has room (dispatch.migration_method), else re-prefilled there. The request
        stops at the token its client last got."""
        seq = flight.seq
        assert seq is not None
        context = flight.context_tokens
        target = self.choose(flight.request.model, context, (source.name,))
        computed = seq.computed
        self._leave(flight)
        flight.interrupted_at.append(self.now)
        if flight.waiting_since is None:
            flight.waiting_since = self.now
        method, restored, delay = "reprefill", 0, 0.0
        if target is not None:
            to = self.nodes[target]
            survivor = recovery.survivor(target, to.spec.placement, self.l_hat(target), to.status, to.spec.deployment)
            planned, _, _ = dispatch.migration_method(context, context, source.spec.placement, survivor)
            # Whole blocks of what it computed, the last context token left for the step that continues it.
            restored = min(computed, context - 1) // catalog.BLOCK_TOKENS * catalog.BLOCK_TOKENS
            if planned == "transfer" and restored > 0:
                method = "transfer"
                link, share = catalog.node_link(source.spec.placement, to.spec.placement, to.spec.deployment.gpu)
                size = restored // catalog.BLOCK_TOKENS * to.spec.deployment.model.kv_bytes_per_block
                delay = catalog.kv_transfer_s(size, link, share)
            else:
                restored = 0
        flight.methods.append(method)
        flight.restored_tokens.append(restored)
        record.by_method[method] = record.by_method.get(method, 0) + 1
        if target is None:
            self.waiting_for_node.append((flight, "no node can take it"))
            return
        decision = dispatch.Decision(
            flight.request_id,
            target,
            "fetch" if method == "transfer" else "reprefill",
            source.name if method == "transfer" else None,
            f"moved off {source.name}, found corrupt: {method}",
        )
        self._push(self.now + delay, "resume", flight, decision, restored)

    def _on_repair(self, name: str, epoch: int) -> None:
        """The node restarts cold: its model loads, its draft model (when the family has one) ready first."""
        node = self.nodes[name]
        if epoch != node.epoch:
            return
        model = node.spec.deployment.model
        self._push(self.now + catalog.load_time_s(model), "loaded", name, epoch)
        if self.draft_assist and model.draft is not None:
            self._push(self.now + catalog.load_time_s(catalog.MODELS[model.draft]), "draft_ready", name, epoch)

    # --- speculative draft assist (progressive recovery) ---------------------------------------
    def _on_draft_ready(self, name: str, epoch: int) -> None:
        """recovery.actions.incidents.start_assist at the node's draft_ready: the most loaded survivor of its model
        (progressive.pick_assisted on L̂) among those decoding and not assisted already; none, and the node waits for
        its full model."""
        node = self.nodes[name]
        if epoch != node.epoch:
            return
        model = node.spec.deployment.model
        loads = {
            other: self.l_hat(other)
            for other, s in sorted(self.nodes.items())
            if other != name
            and s.spec.deployment.model.key == model.key
            and s.alive
            and s.routable
            and other not in self.failed
            and s.assist is None
            and s.core.running
        }
        chosen = progressive.pick_assisted(loads)
        if chosen is None:
            return
        survivor = self.nodes[chosen]
        self._settle(survivor)  # the step under way was planned without drafts; the next ones have them
        pairing = Assist(
            name, chosen, model.draft_agreement, random.Random(f"{self.seed}:draft:{name}:{epoch}"), self.now
        )
        self.assists.append(pairing)
        survivor.assist = pairing

    def _stop_assisting(self, node: NodeState) -> None:
        """`node` verifies no more drafts (it failed): its pairing ends; its draft node goes on loading."""
        if node.assist is not None:
            node.assist.ended_s = self.now
            node.assist = None
        node.step_drafts = None

    def _end_assist(self, draft: str) -> None:
        """The draft node's full model is loaded: the survivor it assisted decodes on its own again (harness and
        control plane unpair them); a step already planned with drafts verifies them."""
        for pairing in self.assists:
            if pairing.draft == draft and pairing.ended_s is None:
                pairing.ended_s = self.now
                survivor = self.nodes[pairing.survivor]
                if survivor.assist is pairing:
                    survivor.assist = None

    def _drafts(self, core: EngineCore, pairing: Assist, plan: StepPlan) -> dict[str, list[int]]:
        """ASSIST_K drafted tokens for each of the first MAX_ASSISTED decoding sequences of `plan`
        (workers.engine.Engine._drafts). How many the survivor accepts is drawn: each drafted token, left to right,
        with probability α (the pair's draft agreement); the proposal then matches the target's tokens exactly that
        far, so EngineCore.apply verifies and accepts as many, whether it computes tokens or counts them."""
        drafts = {}
        for seq in plan.decode[:MAX_ASSISTED]:
            accepted = 0
            while accepted < ASSIST_K and pairing.rng.random() < pairing.agreement:
                accepted += 1
            drafts[seq.request_id] = self._proposal(core, seq, accepted)
        return drafts

    @staticmethod
    def _proposal(core: EngineCore, seq: Sequence, accepted: int) -> list[int]:
        """ASSIST_K tokens of which the first `accepted` are the target's next tokens and the one after is not."""
        if not core.token_ids:
            # A core that counts tokens has every one COUNTED_TOKEN: any other id is a draft it rejects.
            return [COUNTED_TOKEN] * accepted + [COUNTED_TOKEN + 1] * (ASSIST_K - accepted)
        proposal: list[int] = []
        state = seq.state
        params = seq.params
        while len(proposal) < ASSIST_K:
            position = len(seq.generated) + len(proposal)
            target = vocabulary.next_token(state, position, params.temperature, params.seed, seq.sampling).token_id
            if len(proposal) == accepted:
                return proposal + [target + 1] * (ASSIST_K - accepted)  # never tested past the first rejected
            proposal.append(target)
            state = vocabulary.advance(state, target)
        return proposal

    def _on_loaded(self, name: str, epoch: int) -> None:
        node = self.nodes[name]
        if epoch != node.epoch:
            return
        self._end_assist(name)  # its model state is serving now, noticed or not
        if node.undetected:
            node.loaded_early = True
            return
        node.alive = True
        node.down, node.weight, node.session_s, node.corrupt_since = False, 1.0, self.now, None
        self._capacity_stale = True
        self.failed.pop(name, None)
        if node.replaced_by is not None:
            node.standby, node.replaced_by = True, None  # a spare serves in its place: it is the spare now
        else:
            node.routable = True
        self._changed(node)
        self._retry_waiting()

    def _retry_waiting(self) -> None:
        waiting, self.waiting_for_node = self.waiting_for_node, []
        for flight, _ in waiting:
            target = self.choose(flight.request.model, flight.context_tokens)
            if flight.generated or flight.interrupted_at:
                if flight.methods:
                    flight.methods[-1] = "reprefill"
                else:
                    flight.methods.append("reprefill")
                    flight.restored_tokens.append(0)
                self._drop_checkpoint(flight)
            self._dispatch(flight, target, None, 0)
