"""The simulator against the real emulated cluster: the same failure, the same requests, the same metrics.

For 4 and 8 nodes and each placement policy (none, fixed, load_aware, lifeline), one scenario runs twice on
the real emulated cluster (benchmarks.harness: node processes emulating Qwen3-32B on one H100-SXM each on the
roofline, a real gateway process, Redis), once with the failure and once without it for the baseline, and then
in the simulator (recovery.sim), also with and without the failure:

  - fleet: the harness's, as a simulator scenario: N nodes of Qwen3-32B, TP 1, H100-SXM, in 2 racks (the
    harness's n00, n01 … become rack-0-1, rack-0-2 …, in the same order and the same racks);
  - requests: open-loop Poisson arrivals at RATE_PER_NODE × N requests/s for KILL_AT_S + AFTER_KILL_S = 75 s (seed SEED,
    the same for every policy), prompts of 600-1,500 words (one word = one token), 100-300 output tokens
    through end-of-sequence (ignore_eos, so every request produces exactly its max_tokens). The real client
    records when it sent each request, its prompt's token count and its output length, and writes them as a
    CSV trace in splitwise-sim's format (arrival_timestamp, prompt_size, token_size); the simulator replays
    that trace, so it sees the arrival times the real gateway saw, the scheduler's lag included;
  - failure: KILL_AT_S after the start, the real cluster's busiest node (most requests in flight, the
    gateway's in-flight hash) is SIGKILLed; the harness takes it out of routing a second later, restarts it
    cold RESTART_AFTER_S after the kill (draft model, then full model; its draft does not assist a survivor, on
    either side: DRAFT_ASSIST, see there). In the simulator:
    a scripted crash of the same node at the same moment (detected when the real gateway notices its streams
    closing: faults.DetectionDefaults.stream_break_s, and each move takes the gateway's hop, fleet.MOVE_HOP_S; both
    measured by benchmarks/move_hop.py on a scenario of its own), back after RESTART_AFTER_S plus the draft's load
    time (recovery.sim's repair_s) and then the full model's load time, both from workers.catalog as the emulated
    node loads them.


Metrics, on both sides from the same code, recovery.sim.metrics.run_metrics: the real run's client-side
observations (each request's send time and the time of every token chunk it received) are put in the shape of
a Simulation (MeasuredRun: recovery.sim.fleet.Flight per request, the latency series in SERIES_S buckets, one
FaultRecord), so that:

  - mean TTFT and mean TPOT are the means over every request of first token − arrival and
    (last token − first token) / (tokens − 1);
  - interrupted-request stall: the requests in flight on the killed node (real: those the gateway moved off it;
    simulated: those on it when the gateway detected the failure), each from the kill to the first token of its
    resumed stream (real: the token the gateway's move announcement names, as tokens the node produced just
    before it died still reach the client a few ms after the kill); the mean;
  - recovery time: document 000's, from detection until every 5 s window to the end of the arrivals has mean
    TTFT and mean inter-token gap within 10 % of the no-failure run's same window (recovered_at). The real
    baseline is the real cluster's own no-failure run; the simulator's is its own run of the same trace without
    the crash.

Error = (simulated − real) / real. The goal is within 10 % on each metric; where a figure is not, the results
say which and the diagnostics beside it (the gateway and client overhead seen in the no-failure runs, how late
the real restarted node was back against the model, the machine's CPU steal and the client's event-loop lag,
how often the real cluster's own noise puts a window before the kill out of band) say why. The simulator is
not tuned to match.

Scoring (`score`, `summarise`): every (size, policy, metric) pair is scored, none dropped. A pair whose real figure
is not 0 is within the goal when |error| <= 10 %, else a miss; a real 0 against a simulated figure that is not 0
(a recovery time of 0 s against 10-40 s) has no relative error and is a miss, counted apart ("zero vs nonzero"); 0
against 0 is reported apart ("both zero") and counted neither within nor missed; a figure missing on either side
is a miss, counted apart. The summary counts every pair: "N of M pairs within 10 % of a nonzero emulated figure;
…". `--rescore PATH` recomputes the scoring and the labels of a results file from the figures it holds, without
rerunning anything.

What "real" is here (REAL_SIDE, written into the results as `real_side`): the emulated cluster, real processes (node
processes, the gateway, Redis) whose node step times come from the same roofline (workers.catalog) the simulator
uses, and recovery/sim and workers/core.py share code. Mean TTFT and mean TPOT agree partly by construction; what
this checks independently is the gateway's timing of moves, the detection of a failure and the scheduler, not GPU
timings. In the results the two sides are labelled `emulated` (kind measured: a run of the real processes here)
and `simulated` (the simulator).

Time scale: with `--time-scale S` (per size, TIME_SCALE by default) the real nodes run every emulated duration
S times slower (workers.engine's time scale: steps, model loads, restores), the arrivals, the kill and the
harness's restart are spread S times wider, and every real time is divided by S before the metrics, so both
sides are in emulated seconds. What does not scale (the gateway's and the client's own work, the network hop)
shrinks by S in the figures: that is said beside them.

    REDIS_URL=redis://127.0.0.1:6379/8 .venv/bin/python -m benchmarks.sim_validation [--nodes 4 8] [--policy P]
    ... --quick     # a smoke run: lifeline, 4 nodes, 45 s of arrivals; prints, writes nothing
    .venv/bin/python -m benchmarks.sim_validation --rescore benchmarks/results/sim_validation.json  # runs nothing
"""

import argparse
import asyncio
import csv
import json
import math
import os
import random
import re
import secrets
import shlex
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from benchmarks.common import save
from benchmarks.harness import KEY, Harness, expected_ids
from benchmarks.looplag_probe import cpu_times, steal_share
from benchmarks.policy_comparison import busiest
from harness import provenance
from recovery.policy.placement import POLICIES
from recovery.sim import scenario as sim_scenario
from recovery.sim.degradation import Degradation, DegradationSettings
from recovery.sim.experiment import run_one
from recovery.sim.faults import Fault
from recovery.sim.fleet import MOVE_HOP_S, SERIES_S, FaultRecord, Flight, Simulation
from recovery.sim.metrics import TOLERANCE, WINDOW_S, RunMetrics, run_metrics, windows
from recovery.sim.workload import Request, read_trace
from workers import catalog, tokens

MODEL, GPU, TP, RACKS = "Qwen3-32B", "H100-SXM", 1, 2
RATE_PER_NODE = 0.75  # requests/s per node: policy_comparison's 3 requests/s on 4 nodes, its calibrated load
PROMPT_WORDS = (600, 1500)
MAX_TOKENS = (100, 300)
KILL_AT_S = 20.0
AFTER_KILL_S = 55.0  # the restarted node serves again about 28 s after the kill; room to see the latency settle
RESTART_AFTER_S = 2.0
CONFIRM_AFTER_S = 1.0  # the harness takes the node out of the published routing this long after the kill
DRAIN_TIMEOUT_S = 120.0
SEED = 11
SIM_SEED = 1  # a trace replay draws nothing; the seed only names the run
GOAL = 0.10  # the issue's: within 10 % on each metric
# The restarted node's draft does not assist a survivor, on either side (the harness's `assist`, the simulator's
# `draft_assist`): the harness pairs it with the survivor most loaded by its own count, the simulator by L̂
# (progressive.pick_assisted), so the two would assist different nodes and the TPOT compared would not be the same
# thing. Before the simulator modelled assist this was moot; after it, the simulated side alone assisted and its
# mean TPOT came out 19 % below the real one's in a 45 s run (2026-11-29), an error of the harness, not the model.
DRAFT_ASSIST = False
TIME_SCALE = {4: 1.0, 8: 1.0}  # per size; see the module docstring and benchmarks/README.md
WORDS = [w for w in tokens.VOCAB if w.isalpha()]
# The kill moved by each of these (ms) in extra simulated runs: a moved request waits for the step its target is in
# when it arrives, and a prefill step of a 600-1,500-token prompt takes 100-250 ms here, so one crash's stall depends
# on where in its target's step the crash falls (the phase), which the real and the simulated runs do not share.
PHASE_OFFSETS_MS = tuple(range(-250, 251, 25))
COMPARED = (
    ("ttft_mean_ms", "mean TTFT"),
    ("tpot_mean_ms", "mean TPOT"),
    ("stall_mean_ms", "interrupted stall"),
    ("recovery_s", "recovery time"),
)


@dataclass(frozen=True)
class Setup:
    """One size's scenario; times in emulated seconds."""

    nodes: int
    rate_rps: float
    kill_at_s: float = KILL_AT_S
    after_kill_s: float = AFTER_KILL_S
    time_scale: float = 1.0
    prompt_words: tuple[int, int] = PROMPT_WORDS
    max_tokens: tuple[int, int] = MAX_TOKENS
    restart_after_s: float = RESTART_AFTER_S
    seed: int = SEED

    @property
    def duration_s(self) -> float:
        return self.kill_at_s + self.after_kill_s

    def racks(self) -> list[str]:
        """Each harness node's rack, in the harness's order (Harness.start_nodes)."""
        return [f"rack-{i * RACKS // self.nodes}" for i in range(self.nodes)]

    def sim_names(self) -> dict[str, str]:
        """Harness node name -> the simulator's name for it (a fleet group per rack)."""
        names, seen = {}, {}
        for i, rack in enumerate(self.racks()):
            seen[rack] = seen.get(rack, 0) + 1
            names[f"n{i:02d}"] = f"{rack}-{seen[rack]}"
        return names


def schedule(setup: Setup) -> list[tuple[float, str, int]]:
    """(offset s, prompt, max_tokens) of every arrival: a seeded Poisson process, the same for each policy."""
    rng = random.Random(setup.seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(setup.rate_rps)
        if t >= setup.duration_s:
            return arrivals
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*setup.prompt_words)))
        arrivals.append((t, prompt, rng.randint(*setup.max_tokens)))


# --- the real run -------------------------------------------------------------------------------
@dataclass
class Sent:
    """One request as the real client sent it and saw it: every chunk of tokens with its time."""

    prompt: str
    prompt_tokens: int
    max_tokens: int
    sent_at: float  # time.monotonic()
    node: str | None = None  # where the gateway first sent it
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, tokens in the chunk)
    ids: list[int] = field(default_factory=list)
    moves: list[str] = field(default_factory=list)
    error: str | None = None
    done: bool = False  # the stream ended with [DONE]
    resume: dict | None = None  # the resumed node's account of a move (workers.engine_api.ResumeInfo), when it moved


async def stream(session: aiohttp.ClientSession, gateway: str, prompt: str, max_tokens: int) -> Sent:
    """One greedy streamed completion through the gateway, through end-of-sequence to max_tokens. The tokens are
    checked against the pure token function after the run (analyse), to keep the client cheap while it runs."""
    sent = Sent(prompt, len(tokens.encode(prompt)), max_tokens, time.monotonic())
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "lifeline": {"request_id": f"v-{secrets.token_hex(6)}"},
    }
    try:
        async with session.post(
            gateway + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ) as response:
            sent.node = response.headers.get("X-Lifeline-Node")
            if response.status != 200:
                sent.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return sent
            async for raw in response.content:
                if raw.startswith(b": lifeline moved"):
                    sent.moves.append(raw.decode().strip())
                elif raw.startswith(b'data: {"id"'):
                    chunk = json.loads(raw[6:])
                    ids = (chunk["choices"][0].get("token_ids") or []) if chunk.get("choices") else []
                    if ids:
                        sent.chunks.append((time.monotonic(), len(ids)))
                        sent.ids += ids
                    if sent.resume is None and (chunk.get("lifeline") or {}).get("resume"):
                        sent.resume = chunk["lifeline"]["resume"]
                elif raw.startswith(b'data: {"error"'):
                    sent.error = raw.decode()[6:200]
                elif raw.startswith(b"data: [DONE]"):
                    sent.done = True
    except (aiohttp.ClientError, OSError) as exc:
        sent.error = f"{exc.__class__.__name__}: {exc}"
    return sent


async def loop_lag(samples: list[float], loads: list[float], interval_s: float = 0.1) -> None:
    """The client's own event-loop lag: how late a sleep wakes (the machine's contention, seen from the client); and
    the 1-minute load average every second."""
    while True:
        before = time.monotonic()
        await asyncio.sleep(interval_s)
        samples.append(max(time.monotonic() - before - interval_s, 0.0))
        if len(samples) % 10 == 0:
            loads.append(os.getloadavg()[0])


async def run_real(setup: Setup, policy: str, arrivals: list, kill: bool) -> dict:
    """The scenario on the real emulated cluster; times as time.monotonic() gives them (wall seconds)."""
    scale = setup.time_scale
    harness = Harness(
        setup.nodes, model=MODEL, gpu=GPU, tp=TP, racks=RACKS, policy=policy, time_scale=scale, assist=DRAFT_ASSIST
    )
    sent: list[Sent] = []
    killed: dict = {}
    lag: list[float] = []
    loads: list[float] = []
    load_before = os.getloadavg()
    try:
        await asyncio.to_thread(harness.start_nodes)
        await harness.start_gateway()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            lagging = asyncio.create_task(loop_lag(lag, loads))
            cpu_before = cpu_times()
            t0 = time.monotonic()

            async def one(prompt: str, max_tokens: int) -> None:
                sent.append(await stream(session, harness.gateway_url, prompt, max_tokens))

            async def killer() -> None:
                await asyncio.sleep(max(0.0, t0 + setup.kill_at_s * scale - time.monotonic()))
                name, in_flight = busiest(harness)
                while name is None:  # nothing in flight anywhere: wait for the next arrival
                    await asyncio.sleep(0.05)
                    name, in_flight = busiest(harness)
                killed.update(node=name, in_flight=in_flight, at_epoch=time.time())
                killed["at"] = await harness.kill(
                    name, restart_after_s=setup.restart_after_s * scale, confirm_after_s=CONFIRM_AFTER_S * scale
                )
                harness._tasks[-1].add_done_callback(
                    lambda task: killed.update(back_at=time.monotonic()) if not task.cancelled() else None
                )

            killing = asyncio.create_task(killer()) if kill else None
            tasks = []
            for offset, prompt, max_tokens in arrivals:
                await asyncio.sleep(max(0.0, t0 + offset * scale - time.monotonic()))
                tasks.append(asyncio.create_task(one(prompt, max_tokens)))
            arrivals_end = time.monotonic()
            if killing is not None:
                await killing
            done, pending = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT_S * scale)
            for task in pending:
                task.cancel()
            drained = time.monotonic()
            cpu_after = cpu_times()
            lagging.cancel()
            await asyncio.gather(lagging, return_exceptions=True)
            await asyncio.sleep(0.5)  # the gateway's signals go out after the streams end
            moves = await asyncio.to_thread(harness.signals, "request_moved")
    finally:
        await harness.close()
    total = sum(cpu_after) - sum(cpu_before)
    idle = cpu_after[3] + cpu_after[4] - cpu_before[3] - cpu_before[4]
    machine = {
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "load_average_1m_during": {
            "mean": round(statistics.mean(loads), 2) if loads else None,
            "max": round(max(loads), 2) if loads else None,
        },
        "cpu_busy_share": round(1 - idle / total, 3) if total else None,
        "cpu_steal_share": steal_share(drained - t0, cpu_before, cpu_after),
        "client_loop_lag_ms_p50": round(statistics.median(lag) * 1000, 1) if lag else None,
        "client_loop_lag_ms_p99": round(_quantile(lag, 0.99) * 1000, 1) if lag else None,
        "arrivals_late_s": round(arrivals_end - t0 - (arrivals[-1][0] * scale if arrivals else 0.0), 3),
        "wall_s": round(drained - t0, 1),
        "unfinished_requests": len(pending),
    }
    return {
        "policy": policy,
        "kill": kill,
        "t0": t0,
        "sent": sent,
        "killed": killed,
        "machine": machine,
        "moves": moves,  # the gateway's request_moved signals: each move's stall broken down
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


# --- the real run in the simulator's shape ----------------------------------------------------------
@dataclass
class MeasuredRun:
    """A real run as recovery.sim.metrics reads a Simulation (the attributes run_metrics and recovered_at use), so
    that both sides' figures come from the same code. Times are emulated seconds from the run's start."""

    scenario: sim_scenario.Scenario
    policy: str
    flights: list[Flight]
    fault_records: list[FaultRecord]
    ttft_series: dict[int, list] = field(default_factory=dict)
    gap_series: dict[int, list] = field(default_factory=dict)
    seed: int = SIM_SEED
    skipped_faults: list = field(default_factory=list)
    now: float = 0.0
    events_processed: int = 0
    # The real runs set no throughput objective: no levels, nothing shed (as a Simulation without one).
    degradation: Degradation = field(default_factory=lambda: Degradation(DegradationSettings(), {}))
    assists: list = field(default_factory=list)  # the real runs' draft pairings are not recorded as the simulator's


def _add(series: dict[int, list], at: float, total: float, count: int) -> None:
    """As Simulation._series: the sum and count of latency samples seen in each SERIES_S bucket."""
    entry = series.setdefault(int(at // SERIES_S), [0.0, 0])
    entry[0] += total
    entry[1] += count


def ordered(run: dict) -> list[Sent]:
    """The run's requests in the order they were sent: the trace's rows, and the simulator's request indices."""
    return sorted(run["sent"], key=lambda s: s.sent_at)


def write_trace(run: dict, setup: Setup, path: Path) -> Path:
    """The requests the real client sent, as a CSV trace in splitwise-sim's format, in emulated seconds."""
    with open(path, "w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(("arrival_timestamp", "prompt_size", "token_size"))
        for s in ordered(run):
            writer.writerow((f"{(s.sent_at - run['t0']) / setup.time_scale:.6f}", s.prompt_tokens, s.max_tokens))
    return path


def restart_repair_s(setup: Setup) -> float:
    """How long the killed node is out before its full model starts loading: the harness's restart delay, then the
    draft model's load (the emulated node loads the draft first, workers.engine.Engine._load)."""
    draft = catalog.MODELS[catalog.MODELS[MODEL].draft]
    return setup.restart_after_s + catalog.load_time_s(draft)


def scenario_for(setup: Setup, trace: Path, killed: dict | None, t0: float) -> sim_scenario.Scenario:
    """The harness's fleet and the trace as a simulator scenario, with the real kill as a scripted crash."""
    fleet = [
        {"name": rack, "count": setup.racks().count(rack), "model": MODEL, "gpu": GPU, "tp": TP, "rack": rack}
        for rack in dict.fromkeys(setup.racks())
    ]
    faults: dict = {"per_1000_node_days": 0}
    if killed:
        faults["scripted"] = [
            {
                "at_s": (killed["at"] - t0) / setup.time_scale,
                "kind": "crash",
                "target": setup.sim_names()[killed["node"]],
                "repair_s": restart_repair_s(setup),
            }
        ]
    # Every request the client sent is replayed, one sent a little late (the client's loop lagging) too.
    last_arrival_s = read_trace(trace)[-1].arrival_s
    return sim_scenario.parse(
        {
            "name": f"sim_validation {setup.nodes} nodes",
            "duration_s": max(setup.duration_s, last_arrival_s + 0.001),
            "fleet": fleet,
            "workload": {"trace": str(trace), "model": MODEL},
            "faults": faults,
        }
    )


MOVED = re.compile(r"at token (\d+) \(([^;)]+)")  # recovery/gateway/relay.py's move announcement


def _moved_at_token(announcement: str) -> int:
    """The index of the first token the new node sends (the tokens the client had when the stream moved)."""
    return int(MOVED.search(announcement).group(1))


RESUME_METHODS = {"checkpoint-local": "restore", "checkpoint-fetched": "fetch", "re-prefill": "reprefill"}


def _move_method(announcement: str) -> str:
    """How the moved stream resumed, in the simulator's words (workers.engine_api.ResumeInfo's method, else as said)."""
    method = MOVED.search(announcement).group(2)
    return RESUME_METHODS.get(method, method)


def break_noticed_at(move: dict) -> float:
    """When (epoch seconds) the gateway noticed the break a `request_moved` signal reports: the signal's time (the first
    resumed token) less the parts of its stall_breakdown_ms after the break."""
    timing = move["stall_breakdown_ms"]
    return move["at"] - (timing["first_token_ms"] + timing["answered_ms"]) / 1000


def real_breakdown(run: dict, killed_node: str) -> dict | None:
    """Where the real moves' stalls went, as the gateway timed them (recovery.gateway.relay's stall_breakdown_ms):
    the means of the break noticed after the kill (from the signal's time, less the parts after the break; and after
    the last token, as the gateway counts it), the target answering (the plan, the request, its restore: restore_ms
    of it), its first token after that; the moves off the killed node only."""
    moves = [
        m
        for m in run.get("moves", [])
        if m.get("from") == killed_node and m.get("kind") == "failure" and m.get("stall_breakdown_ms")
    ]
    if not moves:
        return None
    timings = [m["stall_breakdown_ms"] for m in moves]
    killed_at = run.get("killed", {}).get("at_epoch")
    return {
        "noticed_ms": None if killed_at is None else _mean_of((break_noticed_at(m) - killed_at) * 1000 for m in moves),
        "noticed_after_last_token_ms": _mean_of(t.get("noticed_ms") for t in timings),
        **{key: _mean_of(t.get(key) for t in timings) for key in ("answered_ms", "restore_ms", "first_token_ms")},
        "moves": len(timings),
    }


def simulated_breakdown(flights: list[Flight], noticed_s: float) -> dict | None:
    """The same parts in the simulator: it notices a crash `noticed_s` after it (faults.DetectionDefaults'
    stream_break_s), the target has the request after the gateway's hop (fleet.MOVE_HOP_S, for the moves of the pass)
    and its restore or fetch, and the rest is its first token."""
    parts = []
    for flight in flights:
        if not flight.interrupted_at or not flight.stalls or len(flight.spans) < 2:
            continue
        answered = flight.spans[1][1] - flight.interrupted_at[0] - noticed_s
        parts.append((answered, flight.stalls[0] - noticed_s - answered))
    if not parts:
        return None
    hop = MOVE_HOP_S[0] + MOVE_HOP_S[1] * len(parts)
    answered = _mean_of(a * 1000 for a, _ in parts)
    return {
        "noticed_ms": round(noticed_s * 1000, 1),
        "answered_ms": answered,
        "restore_ms": _mean_of(max(a - hop, 0.0) * 1000 for a, _ in parts),  # 0 for a re-prefill, not -0.0
        "first_token_ms": _mean_of(f * 1000 for _, f in parts),
        "moves": len(parts),
    }


def _mean_of(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.mean(values), 1) if values else None


def _count(values) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return dict(sorted(counts.items()))


def _token_time(times: list[tuple[float, int]], index: int) -> float | None:
    """When the client got token `index` (0-based), from (time, tokens in the chunk) of each chunk."""
    seen = 0
    for t, k in times:
        seen += k
        if seen > index:
            return t
    return None


def measured(run: dict, setup: Setup, scenario: sim_scenario.Scenario) -> MeasuredRun:
    """A real run's observations as Flights, latency series and (with a kill) one FaultRecord."""
    scale, t0 = setup.time_scale, run["t0"]
    at = lambda monotonic: (monotonic - t0) / scale  # noqa: E731
    kill_s = at(run["killed"]["at"]) if run["kill"] else None
    killed_node = run["killed"].get("node")
    out = MeasuredRun(scenario, run["policy"], [], [])
    interrupted = 0
    for i, s in enumerate(ordered(run)):
        flight = Flight(i, Request(at(s.sent_at), MODEL, s.prompt_tokens, s.max_tokens), [])
        times = [(at(t), k) for t, k in s.chunks]
        previous = None
        for t, k in times:
            if previous is None:
                flight.first_token_s = t
                _add(out.ttft_series, t, t - flight.request.arrival_s, 1)
                if k > 1:
                    _add(out.gap_series, t, 0.0, k - 1)  # tokens that came in the same chunk
            else:
                _add(out.gap_series, t, t - previous, k)
            previous = t
            out.now = max(out.now, t)
        flight.emitted = len(s.ids)
        if times:
            flight.last_token_s = times[-1][0]
        if s.done and not s.error and flight.emitted >= s.max_tokens:
            flight.finished_at = flight.last_token_s
        # Interrupted: the gateway moved it off the killed node (the requests in flight there when it noticed).
        # Its stall runs from the kill to the first token of the resumed stream, the token the move announcement
        # names: tokens the dead node produced just before the kill still reach the client a few ms after it.
        if kill_s is not None and s.node == killed_node and s.moves:
            interrupted += 1
            flight.interrupted_at = [kill_s]
            flight.methods = [_move_method(s.moves[0])]
            resumed = _token_time(times, _moved_at_token(s.moves[0]))
            if resumed is not None:
                flight.stalls = [resumed - kill_s]
        out.flights.append(flight)
    if kill_s is not None:
        fault = Fault(kill_s, "crash", setup.sim_names()[killed_node], restart_repair_s(setup), scripted=True)
        # The gateway notices a crash when the node's event stream closes: at once (recovery.sim.faults.detect).
        out.fault_records.append(FaultRecord(fault, (fault.target,), kill_s, interrupted))
    return out


# --- one size, one policy ---------------------------------------------------------------------------
def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _recovery(metrics: RunMetrics) -> float | None:
    fault = metrics.faults[0] if metrics.faults else None
    return None if fault is None or fault.recovery_s is None else round(fault.recovery_s, 1)


def figures(metrics: RunMetrics) -> dict:
    return {
        "ttft_mean_ms": ms(metrics.ttft_mean_s),
        "tpot_mean_ms": ms(metrics.tpot_mean_s),
        "stall_mean_ms": ms(metrics.stall_mean_s),
        "recovery_s": _recovery(metrics),
        "ttft_p99_ms": ms(metrics.ttft_p99_s),
        "requests": metrics.requests,
        "finished": metrics.finished,
        "interrupted": metrics.interrupted,
        "stall_max_ms": ms(metrics.stall_max_s),
    }


def error_pct(real: float | None, simulated: float | None) -> float | None:
    """(simulated − real) / real in percent; None when either is missing, or the real figure is 0 and the simulated
    one is not."""
    if real is None or simulated is None:
        return None
    if simulated == real:
        return 0.0  # 0 against 0 too: the same figure
    if real == 0:
        return None
    return round(100 * (simulated - real) / real, 1)


def compare(real: dict, simulated: dict) -> dict:
    return {key: error_pct(real[key], simulated[key]) for key, _ in COMPARED}


def difference(real: dict, simulated: dict) -> dict:
    """Simulated − real in each figure's own unit (recovery time moves in whole windows: a percentage of a few
    seconds says little)."""
    return {
        key: None if real[key] is None or simulated[key] is None else round(simulated[key] - real[key], 1)
        for key, _ in COMPARED
    }


# How a pair (one metric, emulated against simulated) is scored: every pair is one of these.
WITHIN, MISS, ZERO_VS_NONZERO, BOTH_ZERO, MISSING = "within", "miss", "zero vs nonzero", "both zero", "missing"
SCORES = (WITHIN, MISS, ZERO_VS_NONZERO, BOTH_ZERO, MISSING)
MISSES = (MISS, ZERO_VS_NONZERO, MISSING)  # BOTH_ZERO is neither within the goal nor a miss: reported apart
REAL_SIDE = (
    "The 'real' side is the emulated cluster: real processes (emulated node processes, a real gateway process, "
    "Redis) on this machine, whose node step times come from the same roofline (workers.catalog) as the "
    "simulator's; recovery/sim and workers/core.py share code. Mean TTFT and mean TPOT therefore agree partly by "
    "construction. What this checks independently is the gateway's timing of moves, the detection of a failure and "
    "the scheduler, not GPU timings: it does not show that the simulator can stand in for a real GPU cluster."
)
DERIVED = {  # figures that compare the two sides: neither measured nor simulated, arithmetic on one of each
    "results[].error_pct": "(simulated - emulated) / emulated, in %: a simulated figure against a measured one",
    "results[].difference": "simulated - emulated, in the figure's unit",
    "results[].scoring": "each pair's score (see scoring_rules)",
    "results[].within_goal": "each pair: true only when scored within",
    "results[].no_failure_runs.error_pct": "(simulated - emulated) / emulated of the no-failure runs, in %",
    "results[].kill.stall_phase_spread.error_pct_of_mean": "the emulated stall against the simulated phases' mean",
    "results[].kill.stall_phase_spread.real_rank": "share of simulated phases at or below the emulated stall",
    "results[].kill.stall_phase_spread.real_within_range": "the emulated stall within the simulated phases' range",
    "results[].real_noise.failure_impact_by_window.compared": "the two sides' window ratios against each other",
}
KINDS = {  # harness.provenance's kind of each figure (paths as benchmarks.assist writes them)
    "results[].emulated": "measured",
    "results[].simulated": "simulated",
    "results[].no_failure_runs.emulated": "measured",
    "results[].no_failure_runs.simulated": "simulated",
    "results[].kill.in_flight_at_kill_gateway": "measured",
    "results[].kill.interrupted_real": "measured",
    "results[].kill.moved_real": "measured",
    "results[].kill.recovery_paths_real": "measured",
    "results[].kill.restored_tokens_mean_real": "measured",
    "results[].kill.restore_ms_mean_real": "measured",
    "results[].kill.interrupted_simulated": "simulated",
    "results[].kill.recovery_paths_simulated": "simulated",
    "results[].kill.restored_tokens_mean_simulated": "simulated",
    "results[].kill.stall_phase_spread.stall_ms": "simulated",
    "results[].kill.stall_phase_spread.mean_ms": "simulated",
    "results[].kill.stall_phase_spread.sd_ms": "simulated",
    "results[].kill.stall_phase_spread.min_ms": "simulated",
    "results[].kill.stall_phase_spread.max_ms": "simulated",
    "results[].kill.stall_phase_spread.real_ms": "measured",
    "results[].kill.stall_breakdown_ms_mean.emulated": "measured",
    "results[].kill.stall_breakdown_ms_mean.simulated": "simulated",
    "results[].restarted_node_serving_after_kill_s.emulated": "measured",
    "results[].restarted_node_serving_after_kill_s.simulated": "modelled",
    "results[].real_noise.windows_out_of_band_before_kill_share": "measured",
    "results[].real_noise.failure_impact_by_window.emulated": "measured",
    "results[].real_noise.failure_impact_by_window.simulated": "simulated",
    "results[].real_noise.recovery_s_10s_windows.emulated": "measured",
    "results[].real_noise.recovery_s_10s_windows.simulated": "simulated",
    "results[].tokens": "measured",
    "results[].machine": "measured",
    "results[].simulator_wall_s": "measured",
    "load_average_before": "measured",
    "load_average_after": "measured",
    "wall_s": "measured",
    "config": "input",
}


def score(real: float | None, simulated: float | None) -> str:
    """One pair's score: WITHIN (real figure not 0, |error| <= GOAL), MISS (real figure not 0, off by more),
    ZERO_VS_NONZERO (real 0, simulated not: no relative error, a miss), BOTH_ZERO (reported apart, not within) or
    MISSING (a figure absent on either side: a miss)."""
    if real is None or simulated is None:
        return MISSING
    if real == 0:
        return BOTH_ZERO if simulated == 0 else ZERO_VS_NONZERO
    return WITHIN if abs(simulated - real) <= GOAL * abs(real) else MISS


def scores(real: dict, simulated: dict) -> dict[str, str]:
    return {key: score(real.get(key), simulated.get(key)) for key, _ in COMPARED}


def summarise(results: list[dict]) -> dict:
    """Every pair of every result counted by its score (from the figures, not from a stored score), and the summary
    in words; `pairs` counts every pair."""
    counts = dict.fromkeys(SCORES, 0)
    for r in results:
        for value in scores(r["emulated"], r["simulated"]).values():
            counts[value] += 1
    pairs = sum(counts.values())
    goal = f"{100 * GOAL:g} %"
    text = (
        f"{counts[WITHIN]} of {pairs} pairs within {goal} of a nonzero emulated figure; "
        f"{counts[MISS]} off by more than {goal} (misses); {counts[ZERO_VS_NONZERO]} zero vs nonzero (misses); "
        f"{counts[BOTH_ZERO]} both zero; {counts[MISSING]} missing (misses)"
    )
    return {
        "text": text,
        "pairs": pairs,
        "misses": sum(counts[s] for s in MISSES),
        **{s.replace(" ", "_"): counts[s] for s in SCORES},
    }


SCORING_RULES = (
    f"every pair scored: emulated figure not 0 and |error| <= {100 * GOAL:g} %: within; not 0 and off by more: miss; "
    "emulated 0, simulated not 0: zero vs nonzero, a miss; both 0: both zero, reported apart (neither within nor a "
    "miss); a figure missing on either side: missing, a miss"
)


def out_of_band_before_kill(faulted: MeasuredRun, baseline: MeasuredRun, kill_s: float) -> float | None:
    """The share of whole windows before the kill that the recovery test puts out of band: the real cluster's
    run-to-run noise (the simulator's faulted and baseline runs are identical before a fault: 0 there)."""
    mine = (windows(faulted.ttft_series), windows(faulted.gap_series))
    base = (windows(baseline.ttft_series), windows(baseline.gap_series))
    judged = []
    for w in range(1, int(kill_s // WINDOW_S)):  # window 0 is the warm-up
        out = any(w in m and w in b and m[w] > (1 + TOLERANCE) * b[w] for m, b in zip(mine, base))
        judged.append(out)
    return round(sum(judged) / len(judged), 2) if judged else None


def impact(faulted, baseline, kill_s: float, end_s: float) -> dict:
    """The failure's impact window by window: each WINDOW_S window's mean TTFT and mean inter-token gap over the
    no-failure run's same window, from the window of the kill to the end of the arrivals (faulted and baseline:
    a MeasuredRun or a Simulation). The recovery test asks whether these stay at or under 1.1."""
    out = {}
    for name, mine, base in (
        ("ttft", windows(faulted.ttft_series), windows(baseline.ttft_series)),
        ("gap", windows(faulted.gap_series), windows(baseline.gap_series)),
    ):
        out[name] = [
            round(mine[w] / base[w], 3) if w in mine and w in base else None
            for w in range(int(kill_s // WINDOW_S), math.ceil(end_s / WINDOW_S))
        ]
    return out


def impact_difference(real: dict, simulated: dict) -> dict:
    """Mean |simulated − real| of the windows' ratios, in percentage points, and each side's peak ratio."""
    out = {}
    for name in ("ttft", "gap"):
        pairs = [(r, s) for r, s in zip(real[name], simulated[name]) if r is not None and s is not None]
        out[name] = {
            "mean_abs_difference_points": round(100 * statistics.mean(abs(s - r) for r, s in pairs), 1)
            if pairs
            else None,
            "peak_ratio_real": max((r for r, _ in pairs), default=None),
            "peak_ratio_simulated": max((s for _, s in pairs), default=None),
        }
    return out


def check_tokens(run: dict) -> tuple[int, int]:
    """Tokens lost, and repeated or wrong, against the undisturbed greedy run."""
    lost = wrong = 0
    for s in run["sent"]:
        expected = expected_ids(MODEL, s.prompt, s.max_tokens, ignore_eos=True)
        good = sum(1 for a, b in zip(s.ids, expected) if a == b)
        lost += len(expected) - good
        wrong += max(len(s.ids) - len(expected), 0) + sum(1 for a, b in zip(s.ids, expected) if a != b)
    return lost, wrong


async def validate(setup: Setup, policy: str, workdir: Path) -> dict:
    arrivals = schedule(setup)
    faulted_run = await run_real(setup, policy, arrivals, kill=True)
    baseline_run = await run_real(setup, policy, arrivals, kill=False)
    return analyse(setup, policy, faulted_run, baseline_run, workdir)


def dump(run: dict, path: Path) -> None:
    """A real run's raw observations, beside its trace, for a second look."""
    raw = {k: v for k, v in run.items() if k != "sent"}
    raw["sent"] = [vars(s) for s in run["sent"]]
    path.write_text(json.dumps(raw) + "\n")


def simulate(scenario: sim_scenario.Scenario, policy: str):
    """The simulated side: the scenario as the real harness runs it (DRAFT_ASSIST)."""
    return run_one(scenario, policy, SIM_SEED, draft_assist=DRAFT_ASSIST)


def phase_spread(
    setup: Setup, policy: str, trace: Path, killed: dict, t0: float, real_stall_ms: float | None
) -> dict | None:
    """The simulated stall with the kill moved by each of PHASE_OFFSETS_MS, the same trace otherwise.

    One crash gives one phase: where in each target's step its moved requests arrive. A request that arrives just
    after its target began a long prefill step waits for the whole step, one that arrives just before it waits for
    none, so a single crash's mean stall moves by up to a step's length with a shift of a few ms (the phase is not
    reproduced between the real cluster and the simulator, whose steps start at other moments). The spread says how
    far the single-phase comparison can be off for that reason alone, and where the real figure falls in it."""
    stalls = []
    for offset in PHASE_OFFSETS_MS:
        shifted = {**killed, "at": killed["at"] + offset / 1000 * setup.time_scale}
        simulation = Simulation(scenario_for(setup, trace, shifted, t0), policy, SIM_SEED, draft_assist=DRAFT_ASSIST)
        stall = run_metrics(simulation.run()).stall_mean_s
        stalls.append(None if stall is None else round(stall * 1000, 1))
    seen = sorted(v for v in stalls if v is not None)
    if not seen:
        return None
    mean = statistics.mean(seen)
    spread = {
        "offsets_ms": list(PHASE_OFFSETS_MS),
        "stall_ms": stalls,
        "mean_ms": round(mean, 1),
        "sd_ms": round(statistics.pstdev(seen), 1),
        "min_ms": seen[0],
        "max_ms": seen[-1],
    }
    if real_stall_ms is not None:
        spread["real_ms"] = real_stall_ms
        spread["real_within_range"] = seen[0] <= real_stall_ms <= seen[-1]
        spread["real_rank"] = round(sum(v <= real_stall_ms for v in seen) / len(seen), 2)  # share of phases at or below
        spread["error_pct_of_mean"] = error_pct(real_stall_ms, round(mean, 1))
    return spread


def analyse(setup: Setup, policy: str, faulted_run: dict, baseline_run: dict, workdir: Path) -> dict:
    scale, killed = setup.time_scale, faulted_run["killed"]
    dump(faulted_run, workdir / f"real-{setup.nodes}-{policy}-failure.json")
    dump(baseline_run, workdir / f"real-{setup.nodes}-{policy}-no-failure.json")
    trace = write_trace(faulted_run, setup, workdir / f"trace-{setup.nodes}-{policy}.csv")
    scenario = scenario_for(setup, trace, killed, faulted_run["t0"])
    simulated = simulate(scenario, policy)

    real_faulted = measured(faulted_run, setup, scenario)
    real_baseline = measured(baseline_run, setup, scenario)
    real_metrics = run_metrics(real_faulted, real_baseline)
    real, sim = figures(real_metrics), figures(simulated.metrics)
    real_base = figures(run_metrics(real_baseline))
    sim_base = figures(run_metrics(simulated.baseline))

    kill_s = (killed["at"] - faulted_run["t0"]) / scale
    back_real = (killed["back_at"] - faulted_run["t0"]) / scale - kill_s if "back_at" in killed else None
    back_sim = restart_repair_s(setup) + catalog.load_time_s(catalog.MODELS[MODEL])
    lost, wrong = check_tokens(faulted_run)
    base_lost, base_wrong = check_tokens(baseline_run)
    sim_fault = simulated.metrics.faults[0]
    moved_sim = [f for f in simulated.simulation.flights if f.restored_tokens]
    real_impact = impact(real_faulted, real_baseline, kill_s, scenario.duration_s)
    sim_impact = impact(simulated.simulation, simulated.baseline, kill_s, scenario.duration_s)
    errors = sorted({s.error for s in faulted_run["sent"] + baseline_run["sent"] if s.error})
    return {
        "nodes": setup.nodes,
        "policy": policy,
        "emulated": real,
        "simulated": sim,
        "error_pct": compare(real, sim),
        "difference": difference(real, sim),
        "scoring": scores(real, sim),
        "within_goal": {key: score == WITHIN for key, score in scores(real, sim).items()},
        "no_failure_runs": {
            "emulated": {k: real_base[k] for k in ("ttft_mean_ms", "tpot_mean_ms", "requests", "finished")},
            "simulated": {k: sim_base[k] for k in ("ttft_mean_ms", "tpot_mean_ms", "requests", "finished")},
            "error_pct": {k: error_pct(real_base[k], sim_base[k]) for k in ("ttft_mean_ms", "tpot_mean_ms")},
        },
        "kill": {
            "node": killed["node"],
            "sim_node": setup.sim_names()[killed["node"]],
            "at_s": round(kill_s, 3),
            "in_flight_at_kill_gateway": killed["in_flight"],
            "interrupted_real": real["interrupted"],
            "interrupted_simulated": sim["interrupted"],
            "moved_real": sum(1 for s in faulted_run["sent"] if s.moves),
            "recovery_paths_real": _count(f.methods[0] for f in real_faulted.flights if f.methods),
            "recovery_paths_simulated": sim_fault.by_method,
            "restored_tokens_mean_real": _mean_of(
                s.resume.get("restored_tokens") for s in faulted_run["sent"] if s.moves and s.resume
            ),
            "restored_tokens_mean_simulated": _mean_of(f.restored_tokens[0] for f in moved_sim),
            "restore_ms_mean_real": _mean_of(
                s.resume.get("restore_ms") for s in faulted_run["sent"] if s.moves and s.resume
            ),
            "stall_phase_spread": phase_spread(setup, policy, trace, killed, faulted_run["t0"], real["stall_mean_ms"]),
            "stall_breakdown_ms_mean": {
                "emulated": real_breakdown(faulted_run, killed["node"]),
                "simulated": simulated_breakdown(simulated.simulation.flights, scenario.detection.stream_break_s),
            },
        },
        "restarted_node_serving_after_kill_s": {
            "emulated": None if back_real is None else round(back_real, 2),
            "simulated": round(back_sim, 2),
        },
        "real_noise": {
            "windows_out_of_band_before_kill_share": out_of_band_before_kill(real_faulted, real_baseline, kill_s),
            "failure_impact_by_window": {
                "windows_s": [
                    w * WINDOW_S for w in range(int(kill_s // WINDOW_S), math.ceil(scenario.duration_s / WINDOW_S))
                ],
                "emulated": real_impact,
                "simulated": sim_impact,
                "compared": impact_difference(real_impact, sim_impact),
            },
            # The same recovery test over windows twice as long: less of the real runs' noise, coarser steps.
            "recovery_s_10s_windows": {
                "emulated": _recovery(run_metrics(real_faulted, real_baseline, 2 * WINDOW_S)),
                "simulated": _recovery(run_metrics(simulated.simulation, simulated.baseline, 2 * WINDOW_S)),
            },
        },
        "tokens": {
            "lost": lost + base_lost,
            "repeated_or_wrong": wrong + base_wrong,
            "request_errors": sum(1 for s in faulted_run["sent"] + baseline_run["sent"] if s.error),
            "errors": errors[:5],
        },
        "machine": {"with_failure": faulted_run["machine"], "no_failure": baseline_run["machine"]},
        "simulator_wall_s": round(simulated.wall_s, 2),
    }


def _delta(value: float | None, reference: float | None) -> float | None:
    return None if value is None or reference is None else round(value - reference, 1)


def explain(result: dict) -> dict[str, str]:
    """For each figure off the goal, the diagnostics of this run that bear on it (benchmarks/README.md weighs them)."""
    real, sim = result["emulated"], result["simulated"]
    base = result["no_failure_runs"]
    machine = result["machine"]["with_failure"]
    noise = result["real_noise"]
    back = result["restarted_node_serving_after_kill_s"]
    load = (
        f"1-minute load average {machine['load_average_1m_during']['mean']} on average during the run, "
        f"client loop lag p99 {machine['client_loop_lag_ms_p99']} ms"
    )
    why = {}
    for key, name in COMPARED:
        scored = score(real[key], sim[key])
        if scored == BOTH_ZERO or (scored == WITHIN and not (key == "recovery_s" and real[key] != sim[key])):
            continue
        if scored == MISSING:
            sides = [side for side, figures in (("emulated", real), ("simulated", sim)) if figures[key] is None]
            why[key] = f"{name}: no figure on the {' and '.join(sides)} side"
        elif key in ("ttft_mean_ms", "tpot_mean_ms"):
            why[key] = (
                f"{name}: the no-failure runs already differ by {base['error_pct'][key]} % "
                f"({base['emulated'][key]} ms real, {base['simulated'][key]} ms simulated): the real "
                f"path's gateway hop and client, which the simulator leaves out, and this machine's contention ({load})"
                f"; the failure adds {_delta(real[key], base['emulated'][key])} ms to it on the real cluster, "
                f"{_delta(sim[key], base['simulated'][key])} ms in the simulator"
            )
        elif key == "stall_mean_ms" and result["difference"][key] > 0:
            why[key] = (
                f"{name}: the simulator's stalls are {result['difference'][key]} ms longer than the real ones"
                f"{_breakdown_text(result['kill'])}{_phase_text(result['kill'])}"
            )
        elif key == "stall_mean_ms":
            paths = result["kill"]
            why[key] = (
                f"{name}: {-result['difference'][key]} ms more per interrupted request on the real cluster "
                f"(paths real {paths['recovery_paths_real']}, simulated {paths['recovery_paths_simulated']}): "
                "the real move (the gateway noticing the broken stream, planning, a new HTTP request carrying the "
                "context to the target) took longer than the simulator's model of it (fleet.MOVE_HOP_S and "
                f"faults.DetectionDefaults.stream_break_s, measured by move_hop){_breakdown_text(paths)}"
                f"{_phase_text(paths)}; {load}"
            )
        else:
            compared = noise["failure_impact_by_window"]["compared"]
            why[key] = (
                f"{name}: counted in whole {WINDOW_S:g} s windows against the band of 10 %; the failure's peak "
                f"impact (a window's mean over the no-failure run's) is TTFT {compared['ttft']['peak_ratio_real']} "
                f"real, {compared['ttft']['peak_ratio_simulated']} simulated, gap {compared['gap']['peak_ratio_real']} "
                f"real, {compared['gap']['peak_ratio_simulated']} simulated, so single windows near 1.1 decide it; "
                "the windows' ratios differ between real and simulated by "
                f"{compared['ttft']['mean_abs_difference_points']} points (TTFT) and "
                f"{compared['gap']['mean_abs_difference_points']} points (gap) on average; "
                f"{noise['windows_out_of_band_before_kill_share']} of the real run's windows before the kill are "
                "already out of band against its own no-failure run (run-to-run noise, 0 in the simulator); with "
                f"{2 * WINDOW_S:g} s windows: real {noise['recovery_s_10s_windows']['emulated']} s, simulated "
                f"{noise['recovery_s_10s_windows']['simulated']} s; restarted node serving again "
                f"{back['emulated']} s after the kill (real) against {back['simulated']} s (modelled)"
            )
    return why


def _breakdown_text(kill: dict) -> str:
    parts = kill.get("stall_breakdown_ms_mean") or {}
    real, sim = parts.get("emulated"), parts.get("simulated")
    if not real or not sim:
        return ""
    return (
        f"; where it went, mean ms real / simulated: break noticed {real['noticed_ms']} / {sim['noticed_ms']}, "
        f"target answered {real['answered_ms']} / {sim['answered_ms']} (its restore {real['restore_ms']} / "
        f"{sim['restore_ms']}), its first token {real['first_token_ms']} / {sim['first_token_ms']} after that"
    )


def _phase_text(kill: dict) -> str:
    spread = kill.get("stall_phase_spread")
    if not spread or "real_ms" not in spread:
        return ""
    where = "within" if spread["real_within_range"] else "outside"
    return (
        f"; with the kill moved by {spread['offsets_ms'][0]} to +{spread['offsets_ms'][-1]} ms the simulated stall "
        f"ranges {spread['min_ms']}-{spread['max_ms']} ms (mean {spread['mean_ms']}, sd {spread['sd_ms']}): the real "
        f"{spread['real_ms']} ms is {where} that range, {spread['error_pct_of_mean']:+.1f} % off its mean"
    )


# --- the report -----------------------------------------------------------------------------------
SCORE_CELL = {ZERO_VS_NONZERO: "0 vs >0", BOTH_ZERO: "both 0", MISSING: "missing"}  # no relative error to show


def table(results: list[dict]) -> str:
    header = ["nodes", "policy"]
    for _, name in COMPARED:
        header += [f"{name} emulated", "simulated", "err"]
    header += ["stall, kill moved: sim mean (range)", "err"]
    rows = [header]
    for r in results:
        row = [str(r["nodes"]), r["policy"]]
        for key, _ in COMPARED:
            unit = " s" if key == "recovery_s" else " ms"
            real, sim, err = r["emulated"][key], r["simulated"][key], r["error_pct"][key]
            scored = score(real, sim)
            row += [
                "n/a" if real is None else f"{real:g}{unit}",
                "n/a" if sim is None else f"{sim:g}{unit}",
                SCORE_CELL.get(scored) or ("n/a" if err is None else f"{err:+.1f}%"),
            ]
        spread = r["kill"].get("stall_phase_spread")
        if spread:
            err = spread.get("error_pct_of_mean")
            row += [
                f"{spread['mean_ms']:g} ms ({spread['min_ms']:g}-{spread['max_ms']:g})",
                "n/a" if err is None else f"{err:+.1f}%",
            ]
        else:
            row += ["n/a", "n/a"]
        rows.append(row)
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def run_cancellable(coroutine):
    """asyncio.run, with SIGTERM cancelling the work so that every harness is closed (its finally runs)."""

    async def wrapper():
        task = asyncio.ensure_future(coroutine)
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await task

    return asyncio.run(wrapper())


async def main_async(setups: list[Setup], policies: list[str]) -> list[dict]:
    workdir = Path(tempfile.mkdtemp(prefix="sim-validation-"))
    print(f"traces and raw observations in {workdir}", flush=True)
    results = []
    for setup in setups:
        for policy in policies:
            started = time.monotonic()
            print(f"--- {setup.nodes} nodes, {policy} (load average {os.getloadavg()[0]:.2f})", flush=True)
            result = await validate(setup, policy, workdir)
            result["off_goal_why"] = explain(result)
            results.append(result)
            print(table([result]).splitlines()[1], f"({time.monotonic() - started:.0f} s)", flush=True)
            for side, parts in result["kill"]["stall_breakdown_ms_mean"].items():
                print(f"    stall breakdown, {side}: {parts}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 8], choices=(2, 4, 8))
    parser.add_argument("--policy", action="append", choices=POLICIES, help="this policy only (repeatable)")
    parser.add_argument("--time-scale", type=float, help="for every size (default: TIME_SCALE's, per size)")
    parser.add_argument("--quick", action="store_true", help="smoke run: lifeline, 4 nodes, 45 s; writes nothing")
    parser.add_argument("--json", metavar="PATH", help="also write every figure here (a --quick run's too)")
    parser.add_argument(
        "--rescore", metavar="PATH", help="score a results file again from its figures, in place; runs nothing"
    )
    args = parser.parse_args()
    if args.rescore:
        data = rescore_file(Path(args.rescore))
        print("\n".join(data["table"]))
        print(data["within_goal"])
        return
    if args.quick:
        setups = [Setup(4, RATE_PER_NODE * 4, kill_at_s=10.0, after_kill_s=35.0, time_scale=args.time_scale or 1.0)]
        policies = args.policy or ["lifeline"]
    else:
        setups = [Setup(n, RATE_PER_NODE * n, time_scale=args.time_scale or TIME_SCALE.get(n, 1.0)) for n in args.nodes]
        policies = args.policy or list(POLICIES)
    load_before = os.getloadavg()
    started = time.monotonic()
    results = run_cancellable(main_async(setups, policies))
    text = table(results)
    print()
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.quick:
        return
    save(
        "sim_validation",
        {
            "command": " ".join(
                ["REDIS_URL=" + os.environ.get("REDIS_URL", ""), ".venv/bin/python", "-m", "benchmarks.sim_validation"]
                + [shlex.quote(a) for a in sys.argv[1:]]
            ),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "wall_s": round(time.monotonic() - started),
            "config": {
                "fleet": f"N nodes of {MODEL}, TP {TP}, one {GPU} each, {RACKS} racks",
                "arrivals": (
                    f"open-loop Poisson, {RATE_PER_NODE} requests/s per node, seed {SEED}, "
                    f"for {KILL_AT_S + AFTER_KILL_S:g} s (emulated); prompts {PROMPT_WORDS[0]}-{PROMPT_WORDS[1]} "
                    f"tokens, outputs {MAX_TOKENS[0]}-{MAX_TOKENS[1]} tokens (ignore_eos)"
                ),
                "trace": "the real client's send times and lengths, replayed by the simulator (splitwise-sim CSV)",
                "failure": (
                    f"SIGKILL of the busiest node {KILL_AT_S:g} s in; cold restart {RESTART_AFTER_S:g} s later, no "
                    "draft assist; simulator: scripted crash of the same node at the same time, repair_s = restart "
                    "delay + draft load, then the full model's load"
                ),
                "time_scale": {str(s.nodes): s.time_scale for s in setups},
                "metrics": (
                    "recovery.sim.metrics.run_metrics on both sides (the real run as Flights and latency series); "
                    f"recovery time from detection, {WINDOW_S:g} s windows, within 10 % of the no-failure run"
                ),
                **CONFIG_SCORING,
            },
            **scored_fields(results),
            "results": results,
            "table": text.splitlines(),
        },
        kinds=KINDS,
    )


# --- rescoring a results file ------------------------------------------------------------------------
RELABEL = {"measured-real": "emulated", "measured-simulated": "simulated", "modelled-simulated": "simulated"}
CONFIG_SCORING = {
    "error": "(simulated - emulated) / emulated",
    "goal": f"within {100 * GOAL:g} % of a nonzero emulated figure on each metric",
}


def scored_fields(results: list[dict]) -> dict:
    """What a results file says of its scoring beside the results: what the real side is, the rules, the summary
    (every pair counted) and which fields compare the two sides."""
    summary = summarise(results)
    return {
        "real_side": REAL_SIDE,
        "scoring_rules": SCORING_RULES,
        "within_goal": summary.pop("text"),
        "scoring": summary,
        "derived": DERIVED,
    }


def relabel(node):
    """`node` with every key RELABEL names renamed (the old side labels), at any depth."""
    if isinstance(node, dict):
        return {RELABEL.get(key, key): relabel(value) for key, value in node.items()}
    if isinstance(node, list):
        return [relabel(value) for value in node]
    return node


def rescore_result(result: dict) -> dict:
    """One result with its scores and explanations recomputed from its figures; every figure kept."""
    result = relabel(result)
    pairs = scores(result["emulated"], result["simulated"])
    out = {}
    for key, value in result.items():
        if key == "scoring":
            continue
        if key == "within_goal":
            out["scoring"] = pairs
            value = {k: v == WITHIN for k, v in pairs.items()}
        out[key] = value
    out["off_goal_why"] = explain(out)
    return out


def rescore(data: dict, command: str) -> dict:
    """A results file's contents with the scoring and the labels of today, from the figures it holds (nothing
    rerun): each result's scores, within_goal and off_goal_why, the summary, the table, the real side said, the
    kinds; its provenance says it was rescored (from what summary, when, at what commit)."""
    before = data.get("within_goal")
    old = data.get("provenance") or {}
    if old.get("rescored"):
        before = old["rescored"].get("within_goal_before", before)
    data = relabel(data)
    results = [rescore_result(r) for r in data["results"]]
    recorded = {k: v for k, v in old.items() if k != "rescored"} or {
        "commit": None,
        "dirty": None,
        "date": data.get("measured_at"),
        "host": None,
        "command": data.get("command"),
        "wall_s": data.get("wall_s"),
        "unrecorded": (
            "written before harness.provenance: the run's commit and host were not recorded (its machine is in "
            "'machine'); the date is the file's measured_at"
        ),
    }
    provenance_ = {
        **recorded,
        "kinds": KINDS,
        "rescored": {
            **provenance.code(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": command,
            "what": (
                "scored again from the figures the file holds, nothing rerun, no figure changed: every pair "
                "counted (a real 0 against a simulated figure that is not 0 a miss, 0 against 0 reported apart, "
                "a missing figure a miss), where the old scoring counted 0 against 0 as within 10 % and dropped "
                "0 against nonzero from the count; the sides relabelled 'measured-real' -> 'emulated', "
                "'measured-simulated' and 'modelled-simulated' -> 'simulated'; real_side, scoring_rules, scoring, "
                "derived and the kinds added; the table and off_goal_why recomputed"
            ),
            "within_goal_before": before,
        },
    }
    out = {}
    for key, value in data.items():
        if key in ("provenance", "real_side", "scoring_rules", "within_goal", "scoring", "derived", "table"):
            continue
        if key == "config":
            value = {**value, **CONFIG_SCORING}
        if key == "results":
            out.update(scored_fields(results))
            value = results
        out[key] = value
        if key == "machine":
            out["provenance"] = provenance_
    out.setdefault("provenance", provenance_)
    out["table"] = table(results).splitlines()
    return out


def rescore_file(path: Path) -> dict:
    """Rewrite the results file at `path` in place with rescore; returns what it wrote."""
    command = provenance.command_line(["python", "-m", "benchmarks.sim_validation", "--rescore", str(path)])
    data = rescore(json.loads(path.read_text()), command)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return data


if __name__ == "__main__":
    main()
