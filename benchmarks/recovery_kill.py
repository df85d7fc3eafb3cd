"""Every recovery path, provoked on purpose under steady streaming load: is any token lost, and how long is the stall?

Issue 13 (item 7): 8 emulated nodes (Qwen3-32B on one H100 each, at time-scale 1) in two racks, each rack
one DGX-like server whose GPUs share an NVLink domain, behind the gateway; 24 greedy streams, every token
checked against the pure token function. One run provokes each path the gateway has for a stream that
must move:

  local restore    SIGKILL the busiest node (restarted warm 2 s later): with the default dispatch (θ = 2×
                   the mean recovery load, τ = 512) its requests resume on their holders, from their KV
  fetch            the same with θ factor 0 for that kill (published in the cluster config like any
                   setting), so every holder counts as overloaded and eq. 6's other branch sends each
                   request to the least-loaded survivor, which fetches its KV from the holder
  KV transfer      cordon the busiest node (weight 0) and send the gateways the drain's migrate command:
                   document 003's choice moves each running request's KV to its new node when that beats
                   re-prefilling (NVLink inside a rack, InfiniBand across)
  re-prefill       the last phase, under placement policy `none` (no checkpoints): once the requests
                   placed with holders have finished, SIGKILL the node with the most requests without one
  node + holder    SIGKILL the busiest node and, at the same moment, the node holding the most of its
                   requests' checkpoints
  cold restart     at the start of each of the first --cold rounds, so its reload overlaps the rest:
                   SIGKILL the busiest node and restart it cold (draft model, paired with the most loaded
                   survivor as progressive recovery does, then the full model)

Each interrupted stream is classified by what the gateway recorded when it moved it (its
`request_moved` signal; the client's ": lifeline moved this stream" line where a signal is missing),
not by what the event meant to provoke: paths 1-4 by the method the resuming node reports
(checkpoint-local, checkpoint-fetched, re-prefill; checkpoint-local after a planned migration that
transferred the KV is the transfer); path 5 when the gateway's records show a holder of the request went
down in the same event as its node (its in-flight record named it, the plan says "failed too", or the
resuming node found it unreachable); path 6 when its node was the one restarted cold.
An event whose path was not taken after a first token is repeated, up to --retries times; a path still
not taken is reported as not provoked, with what happened instead. The results also list every move that
took another path than its event meant to provoke (`off_intent`).

Stalls are measured at the client: the gap between the last token before a move and the first after
it. The GPU work inside them (KV over a link, restore from host memory, re-prefill, the decode step)
takes the roofline model's time, which the emulated nodes sleep; the modelled share is reported beside.

    python -m benchmarks.recovery_kill [--nodes 8] [--streams 24] [--rounds 6] [--cold 2] [--reprefill-kills 2]
        [--retries 3] [--gap 6]

About 4 minutes with the defaults on a 2-core machine; tests/benchmarks/test_recovery_kill_paths.py runs a
short form (6 nodes, 12 streams, each event once) in under a minute.
"""

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import aiohttp

from benchmarks.common import percentile, save
from benchmarks.harness import WORDS, Harness, Result
from workers import catalog

MODEL, GPU = "Qwen3-32B", "H100-SXM"
PATHS = ("local_restore", "fetch", "kv_transfer", "reprefill", "node_and_holder", "cold_restart")
# The event that provokes each path: the one run again where its path was not taken.
PROVOKED_BY = {
    "local_restore": "kill",
    "fetch": "fetch",
    "kv_transfer": "drain",
    "reprefill": "reprefill",
    "node_and_holder": "pair",
    "cold_restart": "cold",
}
METHOD_PATH = {"checkpoint-local": "local_restore", "checkpoint-fetched": "fetch", "re-prefill": "reprefill"}
PLANNED_METHOD = {"restore": "checkpoint-local", "fetch": "checkpoint-fetched", "reprefill": "re-prefill"}
MOVED = re.compile(r"from (\S+) to (\S+) at token (\d+) \((.*?); (.*)\)$")
FAILED_TOO = re.compile(r"holder ([\w, -]+?) failed too")


@dataclass(frozen=True)
class Scenario:
    nodes: int = 8
    streams: int = 24
    rounds: int = 6  # each: a kill, a kill at θ factor 0, a drain, a node killed with its holder
    cold: int = 2  # kills whose node restarts cold, one at the start of each of the first rounds
    reprefill_kills: int = 2  # kills under placement `none`, the last phase
    retries: int = 3  # more events of a kind whose path was not taken
    gap_s: float = 6.0  # after each event: its streams resume and its node restarts
    steady_s: float = 8.0  # load before the first event
    turnover_s: float = 10.0  # under `none`, before its kills: the requests placed with holders finish
    restart_after_s: float = 2.0
    cold_wait_s: float = 40.0  # at the end, at most this long for a cold-restarted node to serve again
    prompt_words: tuple[int, int] = (100, 600)
    max_tokens: tuple[int, ...] = (200, 300, 400)
    seed: int = 7


@dataclass
class Event:
    kind: str  # a value of PROVOKED_BY
    nodes: list[str]  # killed or drained
    at: float  # time.time(), as the gateway's signals are stamped
    in_flight: dict = field(default_factory=dict)  # node -> requests the gateway had on it
    holders: dict = field(default_factory=dict)  # request on those nodes -> its holders, as the gateway had them
    note: str = ""

    @classmethod
    def of(cls, kind: str, nodes: list[str], flights: dict[str, dict], note: str = "") -> "Event":
        on = {rid: f for rid, f in flights.items() if f["node"] in nodes}
        return cls(
            kind,
            nodes,
            time.time(),
            {n: sum(1 for f in on.values() if f["node"] == n) for n in nodes},
            {rid: f["holders"] for rid, f in on.items()},
            note,
        )


def fabric(names: list[str], racks: dict[str, str]) -> dict[str, dict[str, str]]:
    """One DGX-like server per rack whose GPUs share an NVLink domain: KV moves over NVLink inside a rack and over
    InfiniBand (a third of it, the shared spine) across racks (workers.catalog.node_link)."""
    return {name: {"server": f"dgx-{racks[name]}", "nvl_domain": f"nvl-{racks[name]}"} for name in names}


class Cluster:
    """The harness's cluster as the scenario drives it: what the gateway has in flight, its signals, its settings."""

    def __init__(self, harness: Harness, restart_after_s: float):
        self.h = harness
        self.restart_after_s = restart_after_s
        self.events: list[Event] = []
        self.migrations: list[dict] = []  # the gateway's result of each migrate command

    def flights(self) -> dict[str, dict]:
        raw = self.h.redis.hgetall(self.h.keys.gateway_inflight("bench-gw"))
        return {rid: json.loads(value) for rid, value in raw.items()}

    def signals(self, kind: str) -> list[dict]:
        return self.h.signals(kind)

    def snapshot(self) -> tuple[dict[str, dict], set[str]]:
        """The gateway's requests in flight, and the nodes serving and not cordoned (asked of each node)."""
        return self.flights(), {n for n in self.h.serving() if n not in self.h.cordoned}

    @staticmethod
    def by_node(flights: dict[str, dict], alive: set[str], keep=lambda f: True) -> Counter:
        return Counter(f["node"] for f in flights.values() if f["node"] in alive and keep(f))

    def settings(self, **config) -> None:
        """Publish cluster settings (the placement policy, θ factor, τ) as the control plane does."""
        self.h.config.update(config)
        self.h.publish()

    async def kill(self, kind: str, names: list[str], start: str, flights: dict, note: str = "") -> Event:
        event = Event.of(kind, names, flights, note)
        for name in names:
            await self.h.kill(name, restart_after_s=self.restart_after_s, start=start)
        self.events.append(event)
        return event

    # --- the events -------------------------------------------------------------------------------
    async def event(self, kind: str) -> Event | None:
        """Provoke `kind` on the node it needs (the busiest, or the one with the most requests that suit it)."""
        flights, alive = await asyncio.to_thread(self.snapshot)  # off the loop: the clients' clocks run on it
        counts = self.by_node(flights, alive)
        if not counts:
            return None
        busiest = max(sorted(counts), key=counts.get)
        if kind == "kill":
            with_holder = self.by_node(flights, alive, lambda f: f["holders"])
            return await self.kill(
                kind, [max(sorted(counts), key=lambda n: (with_holder[n], counts[n]))], "warm", flights
            )
        if kind == "cold":
            return await self.kill(kind, [busiest], "cold", flights)
        if kind == "fetch":
            await asyncio.to_thread(self.settings, theta_factor=0.0, tau_tokens=1_000_000)
            await asyncio.sleep(0.5)  # the gateway reads the settings on the change
            event = await self.kill(kind, [busiest], "warm", flights, "θ factor 0, τ 1,000,000 for the kill")
            await asyncio.sleep(2.5)  # detected at once, planned in one pass: back to the defaults
            await asyncio.to_thread(self.settings, theta_factor=2.0, tau_tokens=512)
            return event
        if kind == "pair":
            return await self.kill_pair(flights, alive)
        if kind == "reprefill":
            bare = self.by_node(flights, alive, lambda f: not f["holders"])
            if not bare:
                return None
            name = max(sorted(bare), key=bare.get)
            return await self.kill(kind, [name], "warm", flights, f"{bare[name]} of its requests without a holder")
        if kind == "drain":
            return await self.drain(busiest, flights)
        raise ValueError(kind)

    async def kill_pair(self, flights: dict, alive: set[str]) -> Event | None:
        """The node and the holder of the most of its requests' checkpoints, at the same moment."""
        pairs = Counter(
            (f["node"], holder)
            for f in flights.values()
            if f["node"] in alive
            for holder in f["holders"]
            if holder in alive and holder != f["node"]
        )
        if not pairs:
            return None
        (node, holder), shared = max(sorted(pairs.items()), key=lambda item: item[1])
        return await self.kill("pair", [node, holder], "warm", flights, f"{holder} held {shared} of {node}'s requests")

    async def drain(self, name: str, flights: dict) -> Event:
        """Cordon `name` and have the gateway migrate its requests live (the drain's command), then uncordon it."""
        self.h.cordoned.add(name)
        await asyncio.to_thread(self.h.publish)
        await asyncio.sleep(0.3)
        event = Event.of("drain", [name], flights)
        self.events.append(event)
        command = f"bench-drain-{len(self.events)}"
        await asyncio.to_thread(
            self.h.redis.publish,
            self.h.keys.gateway_commands,
            json.dumps({"action": "migrate", "node": name, "id": command}),
        )
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            done = [
                s for s in await asyncio.to_thread(self.signals, "migration_command_done") if s["command"] == command
            ]
            if done:
                self.migrations.append(done[0])
                event.note = (
                    f"{done[0]['transfer']} transfer, {done[0]['reprefill']} re-prefill, {done[0]['failed']} failed"
                )
                break
        self.h.cordoned.discard(name)
        await asyncio.to_thread(self.h.publish)
        return event

    # --- what the gateway did --------------------------------------------------------------------
    def moves(self) -> list[dict]:
        """Every move the gateway recorded, with the paths it took."""
        return [
            {**move, "paths": paths_of(move, event_of(move, self.events))} for move in self.signals("request_moved")
        ]

    def taken(self) -> Counter:
        """Moves so far by path, those after the stream's first token only: a move before it has no stall."""
        return Counter(path for move in self.moves() if move["at_token"] for path in move["paths"])


def event_of(move: dict, events: list[Event]) -> Event | None:
    """The last event before the move that took down (or drained) the node it moved from."""
    earlier = [e for e in events if move["from"] in e.nodes and e.at <= move["at"]]
    return earlier[-1] if earlier else None


def method_path(move: dict) -> str:
    """Paths 1-4: the method the resuming node reports (the gateway's plan where it reported none). A planned
    migration that transferred the KV resumes from the pages the source handed to the target: checkpoint-local
    there (checkpoint-fetched, from its own store, where they landed while it looked); one that re-prefilled did
    not transfer, whatever was planned."""
    method = move.get("method") or PLANNED_METHOD[move["planned_method"]]
    if move["kind"] == "planned" and method != "re-prefill" and "(transfer)" in move["reason"]:
        return "kv_transfer"
    return METHOD_PATH[method]


def holder_went_too(move: dict, event: Event) -> bool:
    """The gateway's records show a holder of the request went down in its node's event: its in-flight record
    named it a holder when the event began, the recovery plan saw that holder failed, or the node resuming the
    request found it unreachable."""
    down = set(event.nodes) - {move["from"]}
    listed = set(event.holders.get(move["request_id"], ()))
    said_failed = {n.strip() for m in FAILED_TOO.finditer(move.get("reason") or "") for n in m.group(1).split(",")}
    unreachable = {n for n in down if f"{n} unreachable" in (move.get("resume_reason") or "")}
    return bool(down & (listed | said_failed | unreachable))


def paths_of(move: dict, event: Event | None) -> list[str]:
    paths = [method_path(move)]
    if event is not None and move["kind"] == "failure":
        if event.kind == "pair" and holder_went_too(move, event):
            paths.append("node_and_holder")
        if event.kind == "cold":
            paths.append("cold_restart")
    return paths


# --- the run ----------------------------------------------------------------------------------------
async def run(scenario: Scenario) -> dict:
    harness = Harness(scenario.nodes, model=MODEL, gpu=GPU, policy="lifeline", restart="warm")
    names = [f"n{i:02d}" for i in range(scenario.nodes)]
    harness.fabric = fabric(names, {n: f"rack-{i * harness.racks // scenario.nodes}" for i, n in enumerate(names)})
    cluster = Cluster(harness, scenario.restart_after_s)
    results: list[Result] = []
    seen: dict[str, list[tuple[float, str]]] = {}  # request -> (when, node) as the gateway's in-flight hash said
    rng = random.Random(scenario.seed)
    load_before = os.getloadavg()
    started = time.monotonic()
    try:
        await asyncio.to_thread(harness.start_nodes)
        await harness.start_gateway()
        stop = asyncio.Event()

        async def client(session):
            while not stop.is_set():
                prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*scenario.prompt_words)))
                results.append(await harness.request(session, prompt, rng.choice(scenario.max_tokens)))

        async def sample():
            while True:
                now = time.monotonic()
                for rid, flight in (await asyncio.to_thread(cluster.flights)).items():
                    seen.setdefault(rid, []).append((now, flight["node"]))
                await asyncio.sleep(0.5)

        async def provoke(kind: str) -> None:
            event = await cluster.event(kind)
            if event is None:
                print(f"{kind}: nothing in flight to provoke it with", flush=True)
                await asyncio.sleep(1.0)
                return
            print(f"{kind}: {', '.join(event.nodes)} ({event.note or event.in_flight})", flush=True)
            await asyncio.sleep(scenario.gap_s)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            clients = [asyncio.create_task(client(session)) for _ in range(scenario.streams)]
            sampler = asyncio.create_task(sample())
            await asyncio.sleep(scenario.steady_s)
            for i in range(max(scenario.rounds, scenario.cold)):
                if i < scenario.cold:  # a round apart, about the time its node takes to load
                    await provoke("cold")
                for kind in ("kill", "fetch", "drain", "pair") if i < scenario.rounds else ():
                    await provoke(kind)
            await top_up(cluster, scenario, provoke, ("local_restore", "fetch", "kv_transfer", "node_and_holder"))
            await top_up(cluster, scenario, provoke, ("cold_restart",))
            await asyncio.to_thread(cluster.settings, placement_policy="none")
            await asyncio.sleep(scenario.turnover_s)
            for _ in range(scenario.reprefill_kills):
                await provoke("reprefill")
            await top_up(cluster, scenario, provoke, ("reprefill",))
            await asyncio.to_thread(cluster.settings, placement_policy="lifeline")
            deadline = time.monotonic() + scenario.cold_wait_s
            while any("serving_at" not in r for r in harness.restarts) and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*clients)
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            moves = await asyncio.to_thread(cluster.moves)
    finally:
        await harness.close()
    machine = {
        "wall_s": round(time.monotonic() - started, 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    return report(scenario, harness, cluster.events, cluster.migrations, results, moves, seen, machine)


async def top_up(cluster: Cluster, scenario: Scenario, provoke, paths: tuple[str, ...]) -> None:
    """Repeat the event of each path not taken mid-stream yet, up to `retries` times."""
    for path in paths:
        for _ in range(scenario.retries):
            if (await asyncio.to_thread(cluster.taken))[path]:
                break
            await provoke(PROVOKED_BY[path])


# --- the figures ---------------------------------------------------------------------------------
def client_moves(result: Result) -> list[dict]:
    """The moves the client was told of, each with its stall: a move before the first token has none (the
    client waited for a first token, not between two)."""
    stalls = iter(result.stalls_ms)
    moves = []
    for line in result.moves:
        found = MOVED.search(line)
        if found is None:
            continue
        at_token = int(found.group(3))
        moves.append(
            {
                "request_id": result.request_id,
                "from": found.group(1),
                "to": found.group(2),
                "at_token": at_token,
                "method": found.group(4),
                "reason": found.group(5),
                "stall_ms": next(stalls, None) if at_token else None,
            }
        )
    return moves


def placement(harness: Harness, name: str) -> catalog.Placement:
    return catalog.Placement(harness.rack_of.get(name, ""), **harness.fabric.get(name, {}))


def link_between(harness: Harness, a: str, b: str) -> str:
    link, share = catalog.node_link(placement(harness, a), placement(harness, b), catalog.GPUS[GPU])
    return link if share == 1.0 else f"{link} across racks (a third: the shared spine)"


def modelled_ms(move: dict, harness: Harness, path: str) -> float:
    """The GPU-side time the roofline model gives the move: the KV over its link (from host memory, for a local
    restore) and the prefill of the context tokens the KV lacked. Queueing, the decode step and software are not
    in it."""
    deployment = catalog.Deployment.of(MODEL, GPU, 1)
    restored = move.get("restored_tokens") or 0
    kv = deployment.model.kv_bytes_per_token * restored
    seconds = 0.0
    if path == "local_restore":
        seconds = catalog.kv_transfer_s(kv, catalog.HOST_TO_GPU_LINK)
    elif path in ("kv_transfer", "fetch"):
        other = move["from"] if path == "kv_transfer" else move.get("source") or move["from"]
        link, share = catalog.node_link(placement(harness, other), placement(harness, move["to"]), catalog.GPUS[GPU])
        seconds = catalog.kv_transfer_s(kv, link, share)
    if move.get("reprefill_tokens"):
        seconds += deployment.prefill_s(move["reprefill_tokens"], restored)
    return round(seconds * 1000, 1)


def stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    return {
        "n": len(values),
        "p50": round(statistics.median(values), 1),
        "p99": round(percentile(values, 0.99), 1),
        "max": round(max(values), 1),
    }


def joined(results: list[Result], moves: list[dict], events: list[Event]) -> list[tuple[dict, Result]]:
    """Each move the client was told of, with the gateway's record of it (request and token) and its stall. Where
    the gateway's signal was lost, the client's line stands in: it says the method and the decision's reason."""
    recorded = {(m["request_id"], m["at_token"]): m for m in moves}
    wall = time.time() - time.monotonic()
    out = []
    for result in results:
        for told in client_moves(result):
            move = recorded.get((result.request_id, told["at_token"]))
            if move is None:
                planned = told["reason"].startswith("planned migration")
                move = {
                    **told,
                    "kind": "planned" if planned else "failure",
                    "method": told["method"] if told["method"] in METHOD_PATH else None,
                    "planned_method": told["method"] if told["method"] in PLANNED_METHOD else "reprefill",
                    "at": wall + (result.last_at or result.started),  # by then, at the latest
                    "signal": False,
                }
                move["paths"] = paths_of(move, event_of(move, events))
            out.append(({**move, "client_stall_ms": told["stall_ms"]}, result))
    return out


def path_figures(path: str, pairs: list[tuple[dict, Result]], events: list[Event], harness: Harness) -> dict:
    requests = {r.request_id: r for _, r in pairs}
    modelled = [modelled_ms(m, harness, method_path(m)) for m, _ in pairs]
    figures = {
        "requests": len(requests),
        "moves": len(pairs),
        "stall_ms": stats([m["client_stall_ms"] for m, _ in pairs if m["client_stall_ms"] is not None]),
        "moved_before_first_token": sum(1 for m, _ in pairs if m["client_stall_ms"] is None),
        "tokens_lost": sum(r.lost for r in requests.values()),
        "tokens_repeated_or_wrong": sum(r.repeated_or_wrong for r in requests.values()),
        "requests_with_errors": sum(1 for r in requests.values() if r.error),
        "by_method": dict(Counter(method_path(m) for m, _ in pairs)),
        "node_reported": dict(Counter(m.get("method") or "none" for m, _ in pairs)),
        "by_event": dict(Counter(e.kind if (e := event_of(m, events)) else "none" for m, _ in pairs)),
        "modelled_gpu_ms_p50": round(statistics.median(modelled), 1) if modelled else None,
    }
    if path in ("kv_transfer", "fetch"):
        ends = [(m["from"] if path == "kv_transfer" else m.get("source"), m["to"]) for m, _ in pairs]
        figures["links"] = dict(Counter(link_between(harness, a, b) for a, b in ends if a))
    return figures


def report(
    scenario: Scenario,
    harness: Harness,
    events: list[Event],
    drains: list[dict],
    results: list[Result],
    moves: list[dict],
    seen: dict,
    machine: dict,
) -> dict:
    pairs = joined(results, moves, events)
    paths = {path: path_figures(path, [p for p in pairs if path in p[0]["paths"]], events, harness) for path in PATHS}
    by_event: dict[str, dict] = {}
    for event in events:
        entry = by_event.setdefault(event.kind, {"events": 0, "moves": 0, "paths": Counter()})
        entry["events"] += 1
    for move in moves:
        event = event_of(move, events)
        if event is not None:
            by_event[event.kind]["moves"] += 1
            by_event[event.kind]["paths"].update(move["paths"])
    interrupted = [r for r in results if r.moves]
    return {
        "measured": {
            "requests": len(results),
            "interrupted_requests": len(interrupted),
            "moves": len(pairs),
            "moves_without_a_signal": sum(1 for m, _ in pairs if m.get("signal") is False),
            "tokens_lost": sum(r.lost for r in results),
            "tokens_repeated_or_wrong": sum(r.repeated_or_wrong for r in results),
            "requests_with_errors": sum(1 for r in results if r.error),
            "errors": sorted({r.error for r in results if r.error})[:5],
            "stall_ms_all_moves": stats([s for r in interrupted for s in r.stalls_ms]),
            "paths": paths,
            "not_provoked": {
                path: why_not(path, by_event, scenario) for path in PATHS if not paths[path]["stall_ms"]["n"]
            },
            "events": {kind: {**e, "paths": dict(e["paths"])} for kind, e in by_event.items()},
            "off_intent": off_intent(moves, events),
            "cold_restarts": cold_restarts(harness, seen, {r.request_id: r for r in results}),
            "drains": drains,
            "timeline": [{k: v for k, v in asdict(e).items() if k != "holders"} for e in events],
            "machine": machine,
        },
        "modelled": {
            "note": "modelled_gpu_ms_p50 (each path): the roofline's time at time-scale 1 for the KV's move (its "
            "link from the nodes' placement) and the prefill of the context tokens it lacked; the measured stall "
            "adds queueing, the next decode step, the gateway and the client",
            "cold_load_s": round(
                catalog.load_time_s(catalog.MODELS[catalog.MODELS[MODEL].draft])
                + catalog.load_time_s(catalog.MODELS[MODEL]),
                2,
            ),
        },
    }


def off_intent(moves: list[dict], events: list[Event]) -> list[dict]:
    """The moves that did not take the path their event was meant to provoke, and the gateway's reasons."""
    out = []
    for move in moves:
        event = event_of(move, events)
        if event is None or event.kind in (PROVOKED_BY[p] for p in move["paths"]):
            continue
        out.append(
            {
                "event": event.kind,
                "paths": move["paths"],
                "kind": move["kind"],
                "at_token": move["at_token"],
                "reason": move.get("reason"),
                "resume_reason": move.get("resume_reason"),
            }
        )
    return out


def why_not(path: str, by_event: dict, scenario: Scenario) -> str:
    """Why no stream took `path` after its first token: what the events meant to provoke it did instead."""
    kind = PROVOKED_BY[path]
    if kind not in by_event:
        return f"no {kind} event could be made: no node had requests in flight to provoke it with"
    took = by_event[kind]["paths"]
    instead = ", ".join(f"{p} {n}" for p, n in sorted(took.items())) or "no move at all"
    return (
        f"not taken in {by_event[kind]['events']} {kind} event(s) (up to {scenario.retries} retries included); "
        f"their moves took: {instead}"
    )


def cold_restarts(harness: Harness, seen: dict, by_request: dict[str, Result]) -> list[dict]:
    """Each cold restart: kill to draft-ready to serving (measured), the survivor its draft assisted, and the
    requests the gateway had on that survivor meanwhile (its in-flight record, sampled each half second), their
    tokens checked like every other's."""
    out = []
    for restart in harness.restarts:
        if restart["start"] != "cold":
            continue
        killed = restart["killed_at"]
        entry = {
            "node": restart["node"],
            "states": restart.get("states", []),
            "draft_ready_s": round(restart["draft_ready_at"] - killed, 2) if "draft_ready_at" in restart else None,
            "serving_s": round(restart["serving_at"] - killed, 2) if "serving_at" in restart else None,
            "assisted": restart.get("assisted"),
        }
        if restart.get("assisted") and "serving_at" in restart:
            start, end = restart["assist_at"], restart["serving_at"]
            assisted = [
                by_request[rid]
                for rid, sightings in seen.items()
                if rid in by_request and any(start <= t <= end and node == restart["assisted"] for t, node in sightings)
            ]
            entry.update(
                assisted_s=round(end - start, 2),
                requests_on_assisted_survivor=len(assisted),
                their_tokens_lost=sum(r.lost for r in assisted),
                their_tokens_repeated_or_wrong=sum(r.repeated_or_wrong for r in assisted),
            )
        out.append(entry)
    return out


def main() -> None:
    defaults = Scenario()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=defaults.nodes)
    parser.add_argument("--streams", type=int, default=defaults.streams)
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="each: kill, fetch, drain, node+holder")
    parser.add_argument("--cold", type=int, default=defaults.cold, help="kills whose node restarts cold")
    parser.add_argument("--reprefill-kills", type=int, default=defaults.reprefill_kills, help="under policy none")
    parser.add_argument(
        "--retries", type=int, default=defaults.retries, help="more of an event whose path was not taken"
    )
    parser.add_argument("--gap", type=float, default=defaults.gap_s, help="seconds after each event")
    args = parser.parse_args()
    scenario = Scenario(
        nodes=args.nodes,
        streams=args.streams,
        rounds=args.rounds,
        cold=args.cold,
        reprefill_kills=args.reprefill_kills,
        retries=args.retries,
        gap_s=args.gap,
    )
    figures = asyncio.run(run(scenario))
    save(
        "recovery_kill",
        {
            "config": {
                **asdict(scenario),
                "deployment": f"{MODEL} on 1x {GPU} each, time-scale 1",
                "fabric": "two racks, each one server whose GPUs share an NVLink domain; InfiniBand between racks",
                "placement_policy": "lifeline; `none` in the re-prefill phase",
                "restart": f"warm {scenario.restart_after_s} s after each kill; cold for the cold-restart kills",
            },
            **figures,
            "goal": {
                "tokens_lost": "0 on every path",
                "tokens_repeated_or_wrong": "0 on every path",
                "stall_ms_p99": "< 300",
            },
        },
    )


if __name__ == "__main__":
    main()
