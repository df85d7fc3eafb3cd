"""The simulator's gateway decides as the real one: a recorded run replayed through the gateway's Coordinator.

A simulation is recorded as the inputs its gateway's decisions read, in order:
every node status as the node published it, every dispatch, every second-holder
request, every node the gateway lost, every request finished, each with its
virtual time. The log is then fed to a real `recovery.gateway.coordinator.Coordinator`
(statuses through its node watcher, its fleet clock at the log's times, work
pending as it counts it at dispatch until the node's arrival status) and every
routing choice, every holder placement and every recovery decision must be the
simulator's, to the reason sentence with its L̂ and θ.
"""

import asyncio
from dataclasses import asdict, dataclass, field

import pytest

from recovery.gateway.coordinator import Coordinator, Flight
from recovery.gateway.table import RoutingView
from recovery.policy import dispatch, recovery
from recovery.protocol import ClusterConfig, Route
from recovery.sim import scenario as scenarios
from recovery.sim.fleet import Simulation

MODEL, GPU, TP = "Qwen3-32B", "H100-SXM", 2


# --- the log ------------------------------------------------------------------------------------------


@dataclass
class Published:
    at: float
    node: str
    status: dict
    arrival: str | None = None  # the request whose arrival this status counts (reason "arrival")


@dataclass
class Routed:
    at: float
    request_id: str
    prompt_tokens: int
    max_tokens: int
    context_tokens: int
    resumed: bool  # continued after a recovery decision (else a new request, or one no node could take)
    target: str | None = None  # decided: the node, None when no node could take it
    holders: tuple[str, ...] = ()  # decided: its checkpoint holders there


@dataclass
class SecondHolder:
    at: float
    request_id: str
    context_tokens: int
    holders: tuple[str, ...] = ()  # decided: the request's holders after it


@dataclass
class Lost:
    at: float
    node: str
    contexts: dict[str, int]  # each request on the node: prompt and generated tokens its client has
    decisions: dict[str, dispatch.Decision] = field(default_factory=dict)  # decided: where each continues
    # Decided, when the node had no request of its own to wait for: its checkpoints' new holders, in order.
    replaced: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)


@dataclass
class Served:
    at: float
    request_id: str  # a lost node's request: its first token since, from its new node


@dataclass
class Replaced:
    at: float
    node: str
    all_served: bool  # every request of the node streams again (else the time allowed ran out)
    # Decided: requests elsewhere that the node held checkpoints of, and their new holders, in order.
    replaced: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)


@dataclass
class Done:
    at: float
    request_id: str


class Recorded(Simulation):
    """A Simulation that logs what its gateway read and decided, at the points where it reads and decides."""

    def __init__(self, *args, **kwargs):
        self.log: list = []
        self._arrival: tuple[str, str] | None = None  # (node, request) while a dispatch is under way
        self._lost: Lost | Replaced | None = None
        self._finishing = False
        super().__init__(*args, **kwargs)  # each node publishes its first status

    def _publish(self, name: str, arrival: str | None = None) -> None:
        self.log.append(Published(self.now, name, asdict(self.nodes[name].status), arrival))

    def _changed(self, node):
        super()._changed(node)
        arriving = self._arrival is not None and self._arrival[0] == node.name
        self._publish(node.name, self._arrival[1] if arriving else None)

    def _flush_touched(self):
        touched = [] if self._stepping else sorted(self._touched)
        super()._flush_touched()
        for name in touched:
            self._publish(name)

    def _dispatch(self, flight, target, decision, restored):
        routed = Routed(
            self.now,
            flight.request_id,
            flight.request.prompt_tokens,
            flight.request.output_tokens,
            flight.context_tokens,
            decision is not None,
            target,
        )
        self.log.append(routed)
        self._arrival = (target, flight.request_id) if target else None
        super()._dispatch(flight, target, decision, restored)
        self._arrival = None
        routed.holders = flight.holders if target else ()

    def _consider_second_holder(self, flight):
        event = SecondHolder(self.now, flight.request_id, flight.context_tokens)
        mark, asked = len(self.log), flight.second_asked
        super()._consider_second_holder(flight)
        if flight.second_asked and not asked:
            event.holders = flight.holders
            self.log.insert(mark, event)  # before the statuses its holder change published

    def _on_detect(self, name, record, epoch):
        contexts = {f.request_id: f.context_tokens for f in self.in_flight.values() if f.node == name}
        known, mark = name in self.failed, len(self.log)
        self._lost = Lost(self.now, name, contexts)
        super()._on_detect(name, record, epoch)
        if not known and name in self.failed:
            self.log.insert(mark, self._lost)
        self._lost = None

    def _carry_out(self, flight, decision, record, hop=0.0):
        if self._lost is not None:
            self._lost.decisions[flight.request_id] = decision
        super()._carry_out(flight, decision, record, hop)

    def _set_holders(self, flight, holders):
        if self._lost is not None:
            self._lost.replaced.append((flight.request_id, tuple(holders)))
        super()._set_holders(flight, holders)

    def _served(self, request_id):
        if not self._finishing and any(request_id in waiting for waiting in self._replacing.values()):
            self.log.append(Served(self.now, request_id))
        super()._served(request_id)

    def _on_replace_due(self, lost, waiting):
        if self._replacing.get(lost) is not waiting:
            return super()._on_replace_due(lost, waiting)
        mark = len(self.log)
        self._lost = Replaced(self.now, lost, not waiting)
        super()._on_replace_due(lost, waiting)
        self.log.insert(mark, self._lost)  # before the statuses its holder changes published
        self._lost = None

    def _finished(self, flight, event):
        self.log.append(Done(self.now, flight.request_id))
        self._finishing = True
        super()._finished(flight, event)
        self._finishing = False


# --- the replay -------------------------------------------------------------------------------------------


class ReplayCoordinator(Coordinator):
    """The gateway's coordinator with its one call to a node that changes holders answered here: the serving
    node takes the holders it is told, and the change is kept in order."""

    def __init__(self, *args):
        super().__init__(*args)
        self.holder_changes: list[tuple[str, tuple[str, ...]]] = []
        self.scheduled: list[tuple[float, object, tuple]] = []  # the loop's timers, run when the log says

    def _schedule(self, delay, callback, *args):
        self.scheduled.append((delay, callback, args))

    async def _set_holders(self, flight, serving, lost, holders):
        flight.holders = tuple(h.name for h in holders)
        self.holder_changes.append((flight.request_id, flight.holders))


class _Signals:
    def emit(self, kind, **data):
        pass


def coordinator_for(sim: Simulation) -> tuple[ReplayCoordinator, list[float]]:
    """A Coordinator with the simulated fleet as its routing table and the simulation's settings as its cluster's."""
    view = RoutingView("redis://127.0.0.1:1/0", "unused")  # never connected: the routes are set here
    view.config = ClusterConfig(
        placement_policy=sim.policy,
        tau_tokens=sim.tau,
        theta_factor=sim.theta_factor,
        alpha=sim.alpha,
        beta=sim.beta,
    )
    view.routes = {
        name: Route(
            name,
            f"http://{name}",
            node.spec.deployment.model.key,
            node.spec.rack,
            1.0,
            node.spec.deployment.gpu.key,
            node.spec.deployment.tp,
            "s1",
            server=node.spec.placement.server,
            nvl_domain=node.spec.placement.nvl_domain,
            network=node.spec.placement.network,
        )
        for name, node in sorted(sim.nodes.items())
    }
    co = ReplayCoordinator(view, _Signals(), "gw-replay", {})
    clock = [0.0]
    co.fleet.clock = lambda: clock[0]
    co.watcher.clock = lambda: clock[0]  # the gateway receives each status when the simulation publishes it
    return co, clock


@dataclass
class Compared:
    routes: int = 0
    placements: int = 0
    second_holders: int = 0
    recoveries: int = 0
    replaced: int = 0
    deferred: int = 0  # re-placements once the lost node's requests streamed again
    timed_out: int = 0  # re-placements when the time allowed ran out first
    methods: dict[str, int] = field(default_factory=dict)


async def replay(sim: Recorded) -> Compared:
    co, clock = coordinator_for(sim)
    seen = Compared()
    rebuilt = False
    for event in sim.log:
        clock[0] = event.at
        if isinstance(event, Published):
            if event.node in co.failed:
                continue  # a lost node's stream has broken: nothing it says reaches the gateway
            data = dict(event.status)
            if event.arrival is not None:
                data.update(reason="arrival", request_id=event.arrival)
            co.watcher._update(event.node, data)
            continue
        if not rebuilt:  # every node has spoken once: the pools are built as a reload of the routes builds them
            co.fleet.rebuild()
            rebuilt = True
        if isinstance(event, Routed):
            flight = co.flights.get(event.request_id)
            if flight is None:
                flight = Flight(event.request_id, "acme", "standard", MODEL, event.prompt_tokens, event.max_tokens)
                assert co.admit(flight)
            flight.generated = [0] * (event.context_tokens - event.prompt_tokens)
            decision = None
            if event.resumed:
                _, planned = co._decisions[event.request_id]
                decision = planned.result()
            route, _ = co.route_for(flight, decision, {flight.node} if flight.node else set())
            assert (route.name if route else None) == event.target, event
            seen.routes += 1
            if route is not None:
                co.assign(flight, route)
                assert flight.holders == event.holders, event
                seen.placements += 1
        elif isinstance(event, SecondHolder):
            flight = co.flights[event.request_id]
            flight.generated = [0] * (event.context_tokens - flight.prompt_tokens)
            co.consider_second_holder(flight)
            await asyncio.gather(*co._tasks)
            assert flight.holders == event.holders, event
            seen.second_holders += 1
        elif isinstance(event, Lost):
            for request_id, context in event.contexts.items():
                flight = co.flights[request_id]
                flight.generated = [0] * (context - flight.prompt_tokens)
            changes = len(co.holder_changes)
            co.watcher.on_lost(event.node, "status stream broke", event.at)
            await asyncio.gather(*co._tasks)
            decisions = {rid: d.result() for rid, (node, d) in co._decisions.items() if node == event.node}
            assert decisions == event.decisions, event.node
            assert co.holder_changes[changes:] == event.replaced, event.node
            seen.recoveries += len(decisions)
            seen.replaced += len(event.replaced)
            for decision in decisions.values():
                seen.methods[decision.method] = seen.methods.get(decision.method, 0) + 1
        elif isinstance(event, Served):
            flight = co.flights[event.request_id]
            co.streams_on(flight)
        elif isinstance(event, Replaced):
            # The gateway's timer for this node: at once when all its requests were served, else the time allowed.
            delay = 0.0 if event.all_served else recovery.REPLACE_HOLDERS_WITHIN_S
            due = [
                t
                for t in co.scheduled
                if t[0] == delay and t[2][0] == event.node and co._replacing.get(event.node) is t[2][1]
            ]
            assert due, event
            co.scheduled.remove(due[0])
            changes = len(co.holder_changes)
            due[0][1](*due[0][2])
            await asyncio.gather(*co._tasks)
            assert co.holder_changes[changes:] == event.replaced, event
            seen.replaced += len(event.replaced)
            seen.deferred += event.all_served
            seen.timed_out += not event.all_served
        elif isinstance(event, Done):
            co.finished(co.flights[event.request_id])
    return seen


def two_racks(policy: str, *faults: dict) -> Recorded:
    """Six nodes in two racks, busy enough that a crash cuts off requests in prefill and in decode."""
    scenario = scenarios.parse(
        {
            "duration_s": 20,
            "fleet": [
                {"name": "a", "count": 3, "model": MODEL, "gpu": GPU, "tp": TP, "rack": "rack-a"},
                {"name": "b", "count": 3, "model": MODEL, "gpu": GPU, "tp": TP, "rack": "rack-b"},
            ],
            "workload": {"rate_rps": 16},
            "faults": {"per_1000_node_days": 0, "scripted": list(faults)},
        }
    )
    return Recorded(scenario, policy, 1).run()


@pytest.mark.parametrize("policy", ["lifeline", "load_aware"])
async def test_a_recorded_run_replays_through_the_gateway_with_every_decision_the_same(policy):
    sim = two_racks(policy, {"at_s": 10.0, "kind": "crash", "target": "a-2"})
    seen = await replay(sim)
    assert seen.routes == len(sim.flights) + seen.recoveries
    assert seen.placements == seen.routes
    assert seen.recoveries == sim.fault_records[0].interrupted > 5
    assert seen.replaced > 0  # requests elsewhere whose holder a-2 was got a new one
    assert seen.deferred == 1  # once a-2's own requests streamed again from their new nodes
    if policy == "lifeline":
        assert seen.second_holders > 0  # asked once a request's context passed τ


@pytest.mark.parametrize("policy", ["fixed", "lifeline"])
async def test_a_rack_lost_after_a_crash_replays_the_same_with_holders_lost_too(policy):
    """The rack's nodes are lost one at a time, each planned with the rest of its rack still in the plan; the
    fixed neighbour is in the same rack, so a request whose node and holder went together re-prefills."""
    sim = two_racks(
        policy, {"at_s": 8.0, "kind": "crash", "target": "a-2"}, {"at_s": 14.0, "kind": "rack", "target": "rack-b"}
    )
    seen = await replay(sim)
    assert seen.recoveries == sum(r.interrupted for r in sim.fault_records)
    assert seen.methods.get("restore", 0) > 0
    if policy == "fixed":
        assert seen.methods.get("reprefill", 0) > 0


def test_the_recorder_leaves_the_simulation_as_it_was():
    """Recording changes nothing: the recorded run's figures are the plain run's."""
    recorded = two_racks("lifeline", {"at_s": 10.0, "kind": "crash", "target": "a-2"})
    plain = Simulation(recorded.scenario, "lifeline", 1).run()
    assert [(f.node, f.holders, f.methods, f.last_token_s) for f in recorded.flights] == [
        (f.node, f.holders, f.methods, f.last_token_s) for f in plain.flights
    ]
