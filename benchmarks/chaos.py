"""The chaos soak: the whole system under steady, checked traffic while a seeded fault schedule breaks its parts.

    python -m benchmarks.chaos --minutes 30 --seed 7        # on demand; the suite runs a 1-minute form

`manage.py demo` on its embedded default (its own Redis, which the soak kills and pauses; its own PostgreSQL, or
the one DATABASE_URL names, in a database of its own; the soak cuts the database off and lets it back) with two
gateways, 8 nodes in 4 racks and a hot spare. Clients stream greedy completions through both gateways with the
resuming client (`clients/resuming.py`: a killed gateway's streams continue on the other from Last-Event-ID) and
check every token against the pure token function. The faults come from a seeded schedule, printed before the
run and replayable with the same seed. The on-call part is played too: a drain the health machine proposes is
approved.

At the end the invariants are checked and the report is written to benchmarks/results/chaos.json: tokens lost
or repeated (0), requests accepted and never answered (0), every node fault followed by its incident and its
transition rows, every node back SERVING and HEALTHY, every gateway's weights equal to the control plane's, the
degradation level back at 0, memory of each long-lived process within 20 % of its value after warm-up, no
unhandled exception in any log. Exit status 1 when an invariant failed.
"""

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import redis

from benchmarks.common import BASE_DIR, issue_token
from benchmarks.harness import WORDS, expected_ids
from clients.resuming import Resumes, StreamFailed, stream
from console import database
from harness.processes import demo, http_json
from recovery.keys import Keys

RESULTS = BASE_DIR / "benchmarks" / "results" / "chaos.json"
MODEL = "Qwen3-32B"

# Every fault kind the soak knows, in the order a full schedule visits them before it repeats.
NODE_FAULTS = ("node_kill", "node_hang", "slow_gpu", "sdc", "nvlink_down", "node_and_holder", "rack", "partition")
INFRA_FAULTS = (
    "redis_restart",
    "redis_pause",
    "db_restart",
    "worker_kill",
    "beat_restart",
    "web_restart",
    "gateway_kill",
)
FAULTS = NODE_FAULTS + INFRA_FAULTS
# A node's drain steps since a time (name, epoch seconds): an sdc fault is judged by them.
DRAIN_STEPS_SINCE = (
    "SELECT count(*) FROM recovery_drainstep s JOIN recovery_drain d ON d.id = s.drain_id "
    "WHERE d.node_id = (SELECT id FROM recovery_node WHERE name = %s) AND s.at >= to_timestamp(%s)"
)
# Faults whose node(s) must get their rows: a DOWN transition and an incident event (sdc: health, drain steps).
ROW_FAULTS = {"node_kill", "node_hang", "node_and_holder", "rack", "sdc"}
HANG_S = 12.0  # how long node_hang hangs a node
# The control plane's own faults: while one lasts (and up to LIFELINE_HEARTBEAT_DEAF_MAX_S after a deafness) no node
# is judged by its heartbeats, by design (DESIGN.md: its deafness is not the fleet's death).
BLINDING = set(INFRA_FAULTS) - {"gateway_kill"}
BLIND_BEFORE_S = 10.0  # a control-plane fault this long before a hang may still blind its judgement
ON_CALL = "chaos soak on-call"
LONG_LIVED = ("web", "worker", "beat", "gateway", "gateway-2", "redis")
CONVERGE_S = 180.0
WARM_S = 60.0  # a process restarted by a fault is measured from this long after its start
MEMORY_EVERY = 10  # seconds between memory samples
PER_ITEM_KEYS = 200  # more keys of one pattern without an expiry than the fleet has nodes: made per request
STREAM_BACKLOG = 10_000  # entries a stream may hold: what is still to do, not what was handled
JUDGED_S = 120.0  # growth over a shorter stretch of a process's life is reported, not judged
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")  # the first line of a log record
# Libraries that log, with its traceback, an exception they handled and retry after: not a Lifeline failure.
HANDLED = {
    "beat's schedule read while the database was away": "django_celery_beat.schedulers: Database gave error",
    "beat's schedule written while the database was away": "django_celery_beat.schedulers: Database error while sync",
    "beat's send while Redis was away": "celery.beat: Message Error",
    "worker's broker connection lost": "consumer: Connection to broker lost",
    "worker's broker reconnect": "consumer: Cannot connect",
    # A task that finished after Redis was lost acknowledges on the closed connection's channel (console.broker): the
    # message is delivered again (acks_late; tasks are idempotent), the worker goes on.
    "worker's acknowledgement on a connection Redis dropped": "Couldn't ack",
}  # every node back SERVING and HEALTHY this long after the last fault, at most


@dataclass
class Fault:
    kind: str
    at_s: float  # planned, from the start of the fault phase
    targets: list[str] = field(default_factory=list)
    injected_wall: float | None = None
    note: str = ""
    converged_s: float | None = None  # from injection until the fleet was whole again (all serving, healthy, level 0)
    effect_seen: bool = False  # the fleet stopped being whole after it


@dataclass
class Stream:
    gateway: str
    expected: list[int]
    ids: list[int] = field(default_factory=list)
    error: str = ""
    status: int | None = None
    resumed: int = 0
    restarts: int = 0
    started_wall: float = 0.0
    ended_wall: float = 0.0

    @property
    def lost(self) -> int:
        return max(len(self.expected) - len(self.ids), 0) if not self.error else len(self.expected) - len(self.ids)

    @property
    def wrong(self) -> int:
        """Tokens repeated or different from the reference."""
        extra = max(len(self.ids) - len(self.expected), 0)
        return extra + sum(1 for a, b in zip(self.ids, self.expected) if a != b)


def touched_before(faults: list[Fault], node: str, at: float, slack_s: float = 1.0) -> bool:
    """Whether a fault targeting `node` was injected before `at` (epoch seconds; within `slack_s` of it, for the
    clocks of the database and this process)."""
    return any(node in f.targets and f.injected_wall and f.injected_wall - slack_s <= at for f in faults)


def schedule(seed: int, duration_s: float, gap_s: float, kinds: tuple[str, ...] = FAULTS) -> list[Fault]:
    """The faults, seeded: every kind once in a shuffled round, round after round, `gap_s` apart (jittered)."""
    rng = random.Random(seed)
    faults, at, round_ = [], gap_s, []
    while at < duration_s:
        if not round_:
            round_ = list(kinds)
            rng.shuffle(round_)
        faults.append(Fault(round_.pop(), round(at, 1)))
        at += gap_s * rng.uniform(0.8, 1.2)
    return faults


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.var_dir = Path(tempfile.mkdtemp(prefix="chaos-"))
        self.var_dir.chmod(0o755)  # the embedded PostgreSQL's data go in it, and its server may run as `nobody`
        self.namespace = f"chaos-{secrets.token_hex(3)}"
        env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # its own Redis: the soak restarts it
        self.created_db = False
        database_url = os.environ.get("DATABASE_URL", "")
        if database_url.startswith("postgres"):
            # The server DATABASE_URL names (its database need not exist: the test runner makes test_<name>);
            # administered through its maintenance database.
            self.pg_db = f"lifeline_chaos_{secrets.token_hex(3)}"
            self.pg_admin = with_database(database_url, "postgres")
            self._psql(f"CREATE DATABASE {self.pg_db}")
            self.created_db = True
            env["DATABASE_URL"] = with_database(database_url, self.pg_db)
        else:
            # The embedded default: the PostgreSQL the demo starts in its var folder, read and cut through its socket.
            env.pop("DATABASE_URL", None)
            self.pg_db = database.DATABASE
            self.pg_admin = database.url(database.data_dir(self.var_dir), "postgres")
        env.update(
            {
                "LIFELINE_VAR_DIR": str(self.var_dir),
                "LIFELINE_NAMESPACE": self.namespace,
                "PYTHONUNBUFFERED": "1",
                "LIFELINE_LOG_LEVEL": "WARNING",
            }
        )
        options = ["--nodes", str(args.nodes), "--spares", "1", "--racks", "4", "--restart-delay", "3"]
        options += ["--time-scale", str(args.time_scale)]
        self.env = env
        self.stack = demo(self.var_dir, env, *options, gateways=2)
        self.second_token: str | None = None  # the demo's "oncall" user, for a drain that needs two approvals
        self.streams: list[Stream] = []
        self.faults: list[Fault] = []
        self.memory: dict[tuple[str, int], dict] = {}
        self.timeline: list[tuple[float, bool, str]] = []  # (epoch, whole, why not) each second
        self.violations: list[str] = []
        self.fault_phase_started = 0.0
        self.healing: list[asyncio.Task] = []
        self.approvals = 0
        self.second_approvals = 0  # by the second engineer, for drains that need two
        self.redis_census: dict = {}

    # --- the stack ---------------------------------------------------------------------------
    def _psql(self, sql: str) -> None:
        subprocess.run(
            [psql_binary(), self.pg_admin, "-v", "ON_ERROR_STOP=1", "-qc", sql], check=True, capture_output=True
        )

    def start(self) -> None:
        self.stack.start(timeout_s=300)
        info = self.stack.info
        self.console = info["urls"]["console"].rstrip("/")
        self.gateways = [g.removesuffix("/v1") for g in info["urls"]["gateways"]]
        self.key = info["gateway_key"]
        self.redis_url = info["redis_url"]

    def pids(self) -> dict[str, int]:
        return self.stack.refresh()["pids"]

    def api(self, method: str, path: str, body=None, user: str = "admin") -> tuple[int, dict]:
        token = self.stack.info["api_token"] if user == "admin" else self.token_for(user)
        return http_json(
            self.console + path, data=body, method=method, headers={"Authorization": f"Bearer {token}"}, timeout=10
        )

    def token_for(self, user: str) -> str:
        """An API token acting as the demo's `user` (its users are named after their roles), issued once."""
        if self.second_token is None:
            self.second_token = issue_token(user, self.env, label="chaos soak")
        return self.second_token

    def cluster(self) -> dict:
        status, body = self.api("GET", "/api/cluster")
        if status != 200:
            raise RuntimeError(f"/api/cluster answered {status}")
        return body

    def nodes(self) -> dict[str, dict]:
        return {n["name"]: n for n in self.cluster()["nodes"]}

    def whole(self) -> tuple[bool, str]:
        """Every node SERVING and HEALTHY, the spare standing by, level 0, both gateways agreeing on weights."""
        try:
            body = self.cluster()
            nodes = {n["name"]: n for n in body["nodes"]}
            bad = [
                f"{n['name']} {n['state']}/{n['health']}"
                for n in nodes.values()
                if n["state"] != "serving" or n["health"] != "healthy"
            ]
            if bad:
                return False, "not serving and healthy: " + ", ".join(bad)
            status, level = self.api("GET", "/api/degradation")
            if status != 200 or level.get("level", level.get("current", {}).get("level")) not in (0, None):
                return False, f"degradation level {level.get('level')}"
            weights = self._control_plane_weights(nodes)
            for gateway in self.gateways:
                seen = http_json(gateway + "/healthz", timeout=5)[1].get("weights", {})
                if {k: float(v) for k, v in seen.items()} != weights:
                    return False, f"{gateway} weights {seen} != control plane {weights}"
            return True, ""
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            return False, f"cannot tell: {exc.__class__.__name__} {exc}"

    @staticmethod
    def _control_plane_weights(nodes: dict[str, dict]) -> dict[str, float]:
        return {name: float(n["weight"]) for name, n in nodes.items() if n["state"] == "serving"}

    # --- traffic -------------------------------------------------------------------------------
    async def client(self, session: aiohttp.ClientSession, index: int, until: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        first = self.gateways[index % len(self.gateways)]
        order = [first] + [g for g in self.gateways if g != first]
        while time.monotonic() < until:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200)))
            max_tokens = rng.randint(30, 120)
            result = Stream(first, expected_ids(MODEL, prompt, max_tokens, ignore_eos=True), started_wall=time.time())
            self.streams.append(result)
            resumes = Resumes()
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            try:
                async for chunk in stream(session, order, self.key, body, path="/v1/completions", resumes=resumes):
                    if chunk.get("choices"):
                        result.ids += chunk["choices"][0].get("token_ids") or []
            except StreamFailed as exc:
                result.error, result.status = str(exc)[:300], exc.status
                if exc.status in (429, 503):  # shed or no capacity: answered, honestly
                    result.error = f"refused {exc.status}"
                await asyncio.sleep(0.5)
            except Exception as exc:  # noqa: BLE001 - a client bug is a finding too, not a crash of the soak
                result.error = f"client {exc.__class__.__name__}: {exc}"[:300]
            result.resumed, result.restarts = resumes.count, resumes.restarts
            result.ended_wall = time.time()

    # --- faults --------------------------------------------------------------------------------
    def serving_nodes(self, exclude_spare: bool = True) -> list[str]:
        nodes = self.nodes()
        return sorted(
            name
            for name, n in nodes.items()
            if n["state"] == "serving" and n["health"] == "healthy" and not (exclude_spare and n.get("spare"))
        )

    def node_address(self, name: str) -> str:
        """From demo.json, which the supervisor keeps while the web process or the database is away."""
        return next(n["address"] for n in self.stack.refresh()["nodes"] if n["name"] == name)

    def agent_fault(self, name: str, kind: str, **params) -> None:
        status, body = http_json(
            self.node_address(name) + "/agent/faults",
            data={"kind": kind, **params},
            headers={"Authorization": f"Bearer {self.stack.info['fault_token']}"},
            timeout=5,
        )
        if status >= 300:
            raise RuntimeError(f"{name} refused the {kind} fault: {status} {body}")

    def agent_fault_on_one(self, candidates: list[str], kind: str, **params) -> str:
        """`kind` on the first of `candidates` (in a seeded order) that takes it. The console's view lags a kill by a
        few seconds: a node another fault just killed can still be listed serving, and refuses the connection."""
        refused = []
        for name in self.rng.sample(candidates, len(candidates)):
            try:
                self.agent_fault(name, kind, **params)
            except OSError as exc:  # down already (connection refused, reset, timed out): the next one
                refused.append(f"{name}: {exc}")
                continue
            return name
        raise RuntimeError(f"no node took the {kind} fault: {'; '.join(refused)}")

    def clear_faults(self, name: str) -> None:
        try:
            http_json(
                self.node_address(name) + "/agent/faults",
                method="DELETE",
                headers={"Authorization": f"Bearer {self.stack.info['fault_token']}"},
                timeout=5,
            )
        except OSError:
            pass

    def kill_group(self, child: str, signum: int = signal.SIGKILL) -> None:
        pid = self.pids()[child]
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass

    def holder_pair(self, spared: set[str] = frozenset()) -> list[str]:
        """A node serving a request and that request's first checkpoint holder, from a gateway's in-flight table,
        neither of them `spared`; two serving nodes not spared where no such pair is in flight. (A pair with a
        spared node was once taken when every pair in flight had one: the corrupt node, serving several streams,
        died before its drain and the sdc fault went unjudged.)"""
        client = redis.Redis.from_url(self.redis_url, decode_responses=True, socket_timeout=2)
        pairs = []
        for gateway in ("gateway-1", "gateway-2"):
            for raw in client.hgetall(Keys(self.namespace).gateway_inflight(gateway)).values():
                flight = json.loads(raw)
                if flight.get("node") and flight.get("holders"):
                    pair = [flight["node"], flight["holders"][0]]
                    if not spared & set(pair):
                        pairs.append(pair)
        if pairs:
            return pairs[0]
        serving = self.serving_nodes()
        return ([n for n in serving if n not in spared] or serving)[:2]

    async def serving_now(self, within_s: float = 30.0) -> list[str]:
        """The healthy serving nodes, from the console; a web process a fault is restarting is waited for."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                return await asyncio.to_thread(self.serving_nodes)
            except (OSError, RuntimeError, ValueError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1)

    async def inject(self, fault: Fault) -> None:
        kind, rng = fault.kind, self.rng
        serving = await self.serving_now() if kind in NODE_FAULTS else []
        # A corrupt node whose drain is not raised yet is left to its drain while another node can be broken: the
        # sdc fault is judged by that drain, which a node taken down first never gets.
        undrained = await asyncio.to_thread(self.undrained_corrupt) if kind in NODE_FAULTS else set()
        serving = [n for n in serving if n not in undrained] or serving
        fault.injected_wall = time.time()
        if kind in ("node_kill", "node_hang", "slow_gpu", "sdc", "nvlink_down", "partition") and not serving:
            fault.note = "skipped: no healthy serving node to break"
            return
        if kind == "node_kill":
            fault.targets = [rng.choice(serving)]
            self.kill_group(fault.targets[0])
        elif kind == "node_hang":
            fault.targets = [self.agent_fault_on_one(serving, "hang", seconds=HANG_S)]
            fault.note = f"hung {HANG_S:g} s: heartbeats stop, sockets stay open"
        elif kind == "slow_gpu":
            fault.targets = [self.agent_fault_on_one(serving, "slow", factor=4.0)]
            self.later(20, self.clear_faults, fault.targets[0])
            fault.note = "4x slower for 20 s"
        elif kind == "sdc":
            fault.targets = [self.agent_fault_on_one(serving, "sdc", rate=0.0, logprob_drift=-1.5)]
            fault.note = "log-probability drift until the drain's remediation resets the GPUs"
        elif kind == "nvlink_down":
            fault.targets = [self.agent_fault_on_one(serving, "nvlink_down")]
            self.later(20, self.clear_faults, fault.targets[0])
            fault.note = "NVLink down 20 s"
        elif kind == "partition":
            fault.targets = [self.agent_fault_on_one(serving, "partition", seconds=15.0)]
            fault.note = "no heartbeat reaches the control plane for 15 s; the node keeps serving"
        elif kind == "node_and_holder":
            fault.targets = await asyncio.to_thread(self.holder_pair, undrained)
            for name in fault.targets:
                self.kill_group(name)
        elif kind == "rack":
            nodes = await asyncio.to_thread(self.nodes)
            racks = sorted({n["rack"] for n in nodes.values() if n["state"] == "serving"})
            spared = {n["rack"] for name, n in nodes.items() if name in undrained}
            rack = rng.choice([r for r in racks if r not in spared] or racks)
            fault.targets = sorted(name for name, n in nodes.items() if n["rack"] == rack)
            fault.note = rack
            for name in fault.targets:
                self.kill_group(name)
        elif kind == "redis_restart":
            fault.targets = ["redis"]
            self.kill_group("redis")
            fault.note = "SIGKILL; the supervisor starts it again, empty, on the same port"
        elif kind == "redis_pause":
            fault.targets = ["redis"]
            self.kill_group("redis", signal.SIGSTOP)
            self.later(10, self.kill_group, "redis", signal.SIGCONT)
            fault.note = "unreachable 10 s (SIGSTOP: connections hang)"
        elif kind == "db_restart":
            fault.targets = [self.pg_db]
            self.later(0, self._db_outage, 5.0)
            fault.note = "every connection terminated and new ones refused for 5 s"
        elif kind == "worker_kill":
            fault.targets = ["worker"]
            self.kill_group("worker")
        elif kind == "beat_restart":
            fault.targets = ["beat"]
            self.kill_group("beat", signal.SIGTERM)
        elif kind == "web_restart":
            fault.targets = ["web"]
            self.kill_group("web")
        elif kind == "gateway_kill":
            fault.targets = ["gateway-2"]
            self.kill_group("gateway-2")
            fault.note = "its clients resume on gateway 1 from Last-Event-ID"

    def later(self, seconds: float, fn, *args) -> None:
        """Heal a lasting fault after `seconds`, while the schedule goes on."""

        async def heal():
            await asyncio.sleep(seconds)
            try:
                await asyncio.to_thread(fn, *args)
            except Exception as exc:  # noqa: BLE001 - a heal that failed is a finding, reported
                self.violations.append(f"could not heal {fn.__name__}{args}: {exc.__class__.__name__} {exc}")

        self.healing.append(asyncio.create_task(heal()))

    def _db_outage(self, seconds: float) -> None:
        self._psql(f"ALTER DATABASE {self.pg_db} ALLOW_CONNECTIONS false")
        self._psql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{self.pg_db}'")
        time.sleep(seconds)
        self._psql(f"ALTER DATABASE {self.pg_db} ALLOW_CONNECTIONS true")

    async def on_call(self, until: float) -> None:
        """Approve every drain the health machine proposes, as the on-call engineers would: the admin first, and a
        second engineer (the demo's oncall user) where the drain needs two approvals (capacity after it below what
        the SLOs need, or another drain open in the pool: recovery.actions.drains.approvals_needed)."""
        while time.monotonic() < until:
            await asyncio.sleep(2)
            try:
                status, body = await asyncio.to_thread(self.api, "GET", "/api/drains")
                for drain in body.get("drains", []) if status == 200 else []:
                    if drain.get("state") != "proposed":
                        continue
                    path = f"/api/drains/{drain['id']}/approve"
                    status, answer = await asyncio.to_thread(self.api, "POST", path, {"reason": ON_CALL})
                    self.approvals += status == 200
                    if status == 409 and "a second approval must come from another person" in str(answer):
                        status, _ = await asyncio.to_thread(self.api, "POST", path, {"reason": ON_CALL}, "oncall")
                        self.second_approvals += status == 200
            except (OSError, subprocess.CalledProcessError):
                pass

    # --- watching: the fleet's wholeness each second, each process's memory over its lifetime ---------------------
    async def monitor(self) -> None:
        ticks = 0
        while True:
            ok, why = await asyncio.to_thread(self.whole)
            self.timeline.append((time.time(), ok, why))
            if ticks % MEMORY_EVERY == 0:
                await asyncio.to_thread(self.sample_memory)
            ticks += 1
            await asyncio.sleep(1)

    def sample_memory(self) -> None:
        """RSS of each long-lived process (with its children) and each node. A process that was up when the fault
        phase began is warm; one started later (restarted by a fault) is measured from WARM_S after it started."""
        now = time.time()
        first_round = not self.memory
        for name, pid in self.pids().items():
            if name not in LONG_LIVED and not name.startswith("node-"):
                continue
            rss = rss_of_group(pid)
            if not rss:
                continue
            entry = self.memory.setdefault((name, pid), {"seen": now, "base": rss if first_round else None})
            if entry["base"] is None and now - entry["seen"] >= WARM_S:
                entry["base"], entry["base_at"] = rss, now
            entry.setdefault("base_at", now)
            entry["last"], entry["last_at"] = rss, now

    def memory_growth(self) -> dict[str, dict]:
        """Per process name, the largest growth over any of its lifetimes measured for at least WARM_S."""
        growth: dict[str, dict] = {}
        for (name, _), m in self.memory.items():
            if not m.get("base") or m["last_at"] - m["base_at"] < WARM_S:
                continue
            percent = round(100 * (m["last"] - m["base"]) / m["base"], 1)
            minutes = round((m["last_at"] - m["base_at"]) / 60, 1)
            judged = minutes * 60 >= JUDGED_S  # a leak shows over minutes; a restart's first minutes are refilling
            if name not in growth or (judged, percent) > (growth[name]["judged"], growth[name]["percent"]):
                growth[name] = {
                    "percent": percent,
                    "over_minutes": minutes,
                    "rss_mb": round(m["last"] / 1e6),
                    "judged": judged,
                }
        return growth

    def census(self) -> dict:
        """What Redis holds, by key pattern (ids replaced by *): how many keys, how many without an expiry, and each
        stream's length. A key made per request or per stream without an expiry, or a stream that keeps what has
        been handled, grows without bound: that is Redis's leak, whatever its RSS does while it refills after a
        restart."""
        client = redis.Redis.from_url(self.redis_url, decode_responses=True, socket_timeout=5)
        patterns: dict[str, dict] = {}
        for key in client.scan_iter(f"{self.namespace}:*", count=1000):
            pattern = ":".join("*" if re.search(r"\d", part) and len(part) > 6 else part for part in key.split(":"))
            entry = patterns.setdefault(pattern, {"keys": 0, "no_expiry": 0})
            entry["keys"] += 1
            entry["no_expiry"] += client.ttl(key) == -1
            if client.type(key) == "stream":
                entry["length"] = entry.get("length", 0) + client.xlen(key)
        for pattern, entry in patterns.items():
            if entry["no_expiry"] > PER_ITEM_KEYS:
                self.violations.append(f"Redis holds {entry['no_expiry']} keys {pattern} with no expiry")
            if entry.get("length", 0) > STREAM_BACKLOG:
                self.violations.append(f"Redis stream {pattern} holds {entry['length']} entries")
        return patterns

    def convergence(self) -> None:
        """Each fault's time to a whole fleet, from the timeline: its effect (the fleet not whole) within 20 s of
        it, then the first whole second after that; a fault the fleet absorbed without a visible change converges
        at its first whole second."""
        for fault in self.faults:
            if not fault.injected_wall:
                continue
            after = [(t, ok) for t, ok, _ in self.timeline if t >= fault.injected_wall]
            broken = next((t for t, ok in after if not ok and t <= fault.injected_wall + 20), None)
            fault.effect_seen = broken is not None
            whole = next((t for t, ok in after if ok and (broken is None or t > broken)), None)
            fault.converged_s = round(whole - fault.injected_wall, 1) if whole else None

    # --- the run -----------------------------------------------------------------------------
    async def run(self) -> dict:
        args = self.args
        started = time.monotonic()
        warm_until = started + args.warmup
        duration = args.minutes * 60
        self.faults = schedule(args.seed, duration, args.gap, tuple(args.kinds))
        print(f"fault schedule (seed {args.seed}):")
        for f in self.faults:
            print(f"  +{f.at_s:6.1f} s  {f.kind}")
        traffic_until = warm_until + duration + args.settle
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            clients = [
                asyncio.create_task(self.client(session, i, traffic_until - args.settle / 2))
                for i in range(args.clients)
            ]
            on_call = asyncio.create_task(self.on_call(traffic_until + CONVERGE_S))
            await asyncio.sleep(max(warm_until - time.monotonic(), 0))
            monitor = asyncio.create_task(self.monitor())
            self.fault_phase_started = time.monotonic()
            for fault in self.faults:
                await asyncio.sleep(max(self.fault_phase_started + fault.at_s - time.monotonic(), 0))
                print(f"  +{time.monotonic() - self.fault_phase_started:6.1f} s  injecting {fault.kind}", flush=True)
                try:
                    await self.inject(fault)
                except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported
                    fault.note = f"not injected: {exc.__class__.__name__} {exc}"
                print(f"           {fault.targets} {fault.note}", flush=True)
            await asyncio.gather(*clients, *self.healing)
            last = max((f.injected_wall or 0 for f in self.faults), default=time.time())
            whole_at = await self.wait_whole(CONVERGE_S)
            await asyncio.to_thread(self.sample_memory)
            self.redis_census = await asyncio.to_thread(self.census)
            on_call.cancel()
            monitor.cancel()
        self.convergence()
        return self.report(whole_at - last if whole_at else None)

    async def wait_whole(self, timeout_s: float) -> float | None:
        deadline, why = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            ok, why = await asyncio.to_thread(self.whole)
            if ok:
                return time.time()
            await asyncio.sleep(1)
        self.violations.append(f"the fleet was not whole {timeout_s:.0f} s after the last fault: {why}")
        return None

    # --- invariants ---------------------------------------------------------------------------
    def report(self, converged_after_last_s: float | None) -> dict:
        streams = self.streams
        done = [s for s in streams if not s.error or s.ids]
        refused = Counter(s.status for s in streams if s.error.startswith("refused"))
        # A stream whose gateway was killed (the client resumed it elsewhere) may end refused: the issue allows those,
        # counted. A stream started while Redis was away has no record to be taken over by, for one.
        failed = [s for s in streams if s.error and not s.error.startswith("refused") and not s.resumed]
        orphaned = Counter(s.error[:80] for s in streams if s.error and not s.error.startswith("refused") and s.resumed)
        lost = sum(s.lost for s in done if not s.error)
        wrong = sum(s.wrong for s in streams)
        unfinished = [s for s in streams if not s.error and len(s.ids) < len(s.expected)]
        if wrong:
            self.violations.append(f"{wrong} tokens repeated or different from the reference")
        if lost or unfinished:
            self.violations.append(f"{lost} tokens lost on {len(unfinished)} streams that ended without an error")
        if failed:
            causes = Counter(s.error.split(":")[0][:80] for s in failed)
            self.violations.append(f"{len(failed)} requests accepted and never answered: {dict(causes)}")
        try:
            rows = self.check_rows()
        except (OSError, subprocess.CalledProcessError) as exc:
            rows = {}
            self.violations.append(f"cannot count the rows: {exc}")
        self.check_logs()
        growth = self.memory_growth()
        for name, g in growth.items():
            if name == "redis":
                g["judged"] = False  # its memory is data: judged by what it holds (redis_keys), below
            if g["judged"] and g["percent"] > 20:
                self.violations.append(f"{name} memory grew {g['percent']} % in {g['over_minutes']} min after warm-up")
        by_kind: dict[str, list] = defaultdict(list)
        for f in self.faults:
            if f.converged_s is not None:
                by_kind[f.kind].append(f.converged_s)
        report = {
            "measured": True,
            "seed": self.args.seed,
            "minutes": self.args.minutes,
            "nodes": self.args.nodes,
            "spares": 1,
            "gateways": 2,
            "clients": self.args.clients,
            "database": "postgresql" if self.created_db else "postgresql (embedded)",
            "faults_by_kind": dict(Counter(f.kind for f in self.faults if not f.note.startswith(("skipped", "not")))),
            "faults_skipped": [asdict(f) for f in self.faults if f.note.startswith(("skipped", "not"))],
            "faults": [asdict(f) for f in self.faults],
            "streams_checked": len(streams),
            "tokens_checked": sum(len(s.ids) for s in streams),
            "streams_resumed_on_another_gateway": sum(1 for s in streams if s.resumed),
            "tokens_lost": lost,
            "tokens_repeated_or_wrong": wrong,
            "requests_lost": len(failed) + len(unfinished),
            "refused_by_status": {str(k): v for k, v in refused.items()},
            "killed_gateway_streams_ended_by_cause": dict(orphaned),
            "unanswered": self.unanswered(failed),
            "redis_keys": self.redis_census,
            "slowest_convergence_s_by_kind": {k: max(v) for k, v in by_kind.items()},
            "never_converged": [f.kind for f in self.faults if f.converged_s is None and f.injected_wall],
            "faults_without_visible_effect": [f.kind for f in self.faults if f.injected_wall and not f.effect_seen],
            "seconds_not_whole": sum(1 for _, ok, _ in self.timeline if not ok),
            "converged_after_last_fault_s": round(converged_after_last_s, 1) if converged_after_last_s else None,
            "rows_counted": rows,
            "drains_approved": self.approvals,
            "second_approvals": self.second_approvals,
            "memory_growth_percent": growth,
            "library_retries_logged_with_traceback": dict(self.library_retries),
            "violations": self.violations,
        }
        return report

    def unanswered(self, failed: list[Stream]) -> list[dict]:
        """When the unanswered requests were sent and given up, beside the faults injected then (wall times as
        seconds since the first fault's), and why: what a violation needs to be traced."""
        first = next((f for f in self.faults if f.injected_wall), None)
        origin = first.injected_wall - first.at_s if first and first.injected_wall else 0.0
        faults = [(f.injected_wall - origin, f.kind) for f in self.faults if f.injected_wall]
        rows = []
        for s in failed[:20]:
            sent, over = s.started_wall - origin, s.ended_wall - origin
            recent = [f"{kind} at {at:.1f}" for at, kind in faults if sent - 30 <= at <= over]
            rows.append({"sent_s": round(sent, 1), "given_up_s": round(over, 1), "faults": recent, "error": s.error})
        return rows

    def sql(self, query: str, *params) -> int:
        """One number from the stack's database, through psql."""
        rows = self.sql_rows(query, *params)
        return int(rows[0][0] or 0) if rows else 0

    def sql_rows(self, query: str, *params) -> list[list[str]]:
        """Rows of text from the stack's database, NULL as "" (as psql prints it); `epoch(column)` reads as
        seconds."""
        for value in params:
            query = query.replace("%s", "'" + str(value).replace("'", "''") + "'", 1)
        query = re.sub(r"epoch\(([\w.]+)\)", r"extract(epoch from \1)", query)
        url = with_database(self.pg_admin, self.pg_db)
        argv = [psql_binary(), url, "-Atq", "-F", "\x1f", "-c", query]
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
        return [line.split("\x1f") for line in out.splitlines()]

    def undrained_corrupt(self) -> set[str]:
        """Nodes an sdc fault corrupted that have no drain raised since."""
        corrupt = [(f.targets[0], f.injected_wall) for f in self.faults if f.kind == "sdc" and f.targets]
        try:
            return {name for name, at in corrupt if not self.sql(DRAIN_STEPS_SINCE, name, at - 1)}
        except (subprocess.CalledProcessError, OSError):  # the database is away: assume the worst
            return {name for name, _ in corrupt}

    def died_before_its_drain(self, fault: Fault, target: str) -> bool:
        """A later fault that named the sdc target took it DOWN, and no drain of it was ever raised."""
        later = [f for f in self.faults if f.injected_wall and f.injected_wall > fault.injected_wall]
        if not any(target in f.targets for f in later):
            return False
        node = "(SELECT id FROM recovery_node WHERE name = %s)"
        down = self.sql(
            f"SELECT count(*) FROM recovery_nodetransition WHERE node_id = {node} AND new_state = 'down' "
            "AND at >= to_timestamp(%s)",
            target,
            fault.injected_wall,
        )
        return down > 0 and not self.sql(DRAIN_STEPS_SINCE, target, fault.injected_wall - 1)

    def blinded(self, hang: Fault) -> bool:
        """Whether a control-plane fault was injected from BLIND_BEFORE_S before `hang` to its end."""
        begin, end = hang.injected_wall - BLIND_BEFORE_S, hang.injected_wall + HANG_S
        return any(f.kind in BLINDING and f.injected_wall and begin <= f.injected_wall <= end for f in self.faults)

    def check_rows(self) -> dict:
        """The rows every fault must have produced are there: a node that died or went silent has its DOWN
        transition, an incident event names it; silent corruption has its health transition, its drain with
        its steps, and the on-call's approval in the audit log. Counted, not sampled."""
        counted: Counter = Counter()
        for fault in self.faults:
            if not fault.targets or fault.note.startswith(("skipped", "not")):
                continue
            since = fault.injected_wall - 1
            for target in fault.targets if fault.kind in ROW_FAULTS else ():
                node = "(SELECT id FROM recovery_node WHERE name = %s)"
                checks = {
                    "node transitions": (
                        f"SELECT count(*) FROM recovery_nodetransition WHERE node_id = {node} "
                        "AND new_state = 'down' AND at >= to_timestamp(%s)"
                    ),
                    "incident events": (
                        f"SELECT count(*) FROM recovery_incidentevent WHERE node_id = {node} AND at >= to_timestamp(%s)"
                    ),
                }
                if fault.kind == "sdc" and self.died_before_its_drain(fault, target):
                    # A later fault killed the corrupt node before its drain could be raised: a node that is down
                    # cannot be drained (its restart clears the emulated corruption); its DOWN row is checked with
                    # that fault. Counted, so a run where this hides every sdc shows it.
                    counted["sdc targets killed by a later fault before their drain"] += 1
                    continue
                if fault.kind == "node_hang" and self.blinded(fault):
                    # A hang the control plane's own fault overlapped: heartbeats are not judged while it cannot hear
                    # them, and the node beats again when its hang ends, so it may never be marked DOWN (a run on
                    # 2026-12-07: a Redis pause, a worker restart and a database restart covered a 12 s hang). Its
                    # incident event (the gateways saw its streams stall) is still required; counted, so a run
                    # where this excuses every hang shows it.
                    counted["hangs a control-plane fault overlapped (judged by their incident event)"] += 1
                    checks = {"incident events": checks["incident events"]}
                if fault.kind == "sdc":
                    checks = {
                        "health transitions": (
                            f"SELECT count(*) FROM recovery_healthtransition WHERE node_id = {node} "
                            "AND new IN ('suspicious', 'unhealthy') AND at >= to_timestamp(%s)"
                        ),
                        "drain steps": DRAIN_STEPS_SINCE,
                        "incident events": checks["incident events"],
                    }
                for what, query in checks.items():
                    found = self.sql(query, target, since)
                    counted[what] += found
                    if not found:
                        self.violations.append(f"no {what[:-1]} row for {target} after {fault.kind}")
        # A node no fault touched is never marked DOWN: the control plane's own faults (its web process, Redis) must
        # not read as the fleet's (found here: a web restart took five healthy nodes DOWN, one by one). Touched
        # before the DOWN, that is: a fault injected on a node after it was marked DOWN excuses nothing (a run at
        # 7671ff6 let four of five such false DOWNs pass because a later fault happened to pick those nodes).
        injected = [f for f in self.faults if f.injected_wall]
        if injected:
            downs = self.sql_rows(
                "SELECT n.name, epoch(t.at), t.cause FROM recovery_nodetransition t "
                "JOIN recovery_node n ON n.id = t.node_id "
                "WHERE t.new_state = 'down' AND t.at >= to_timestamp(%s) ORDER BY t.at",
                injected[0].injected_wall - 1,
            )
            untouched = [row for row in downs if not touched_before(injected, row[0], float(row[1]))]
            counted["DOWN transitions of nodes no fault touched"] = len(untouched)
            if untouched:
                # Each with its cause and the faults injected in the 40 s before it: what tracing it needs.
                seen = [
                    f"{name} at {_clock(float(at))} ({cause}; after "
                    + ", ".join(
                        f"{f.kind} {'+'.join(f.targets)} at {_clock(f.injected_wall)}"
                        for f in injected
                        if float(at) - 40 <= f.injected_wall <= float(at)
                    )
                    + ")"
                    for name, at, cause in untouched
                ]
                self.violations.append(
                    f"{len(untouched)} DOWN transitions of nodes no fault touched: " + "; ".join(seen)
                )
        audit = self.sql("SELECT count(*) FROM recovery_auditentry WHERE actor = 'admin' AND reason = %s", ON_CALL)
        second = self.sql("SELECT count(*) FROM recovery_auditentry WHERE actor = 'oncall' AND reason = %s", ON_CALL)
        counted["audit lines of approvals"] = audit + second
        if audit < self.approvals or second < self.second_approvals:
            self.violations.append(
                f"{self.approvals} + {self.second_approvals} drains approved, {audit} + {second} audit lines of it"
            )
        return dict(counted)

    def check_logs(self) -> None:
        """Every traceback in every log is a violation, unless its record is one of the libraries' own retries
        (they log the exception they recovered from): those are counted in the report, by kind."""
        self.library_retries: Counter = Counter()
        for path in sorted((self.var_dir / "log").glob("*.log")):
            header = ""
            for line in path.read_text(errors="replace").splitlines():
                if RECORD.match(line):
                    header, seen = line, False
                    continue
                if not line.startswith("Traceback (most recent call last)") or seen:
                    continue
                seen = True  # one record, one finding (a chained exception prints several tracebacks)
                handled = next((label for label, pattern in HANDLED.items() if pattern in header), None)
                if handled:
                    self.library_retries[handled] += 1
                else:
                    self.violations.append(f"unhandled exception in {path.name}: {header[24:260] or line}")

    def stop(self) -> None:
        self.stack.stop(timeout_s=60)
        if self.created_db:
            try:
                self._psql(f"DROP DATABASE IF EXISTS {self.pg_db} WITH (FORCE)")
            except subprocess.CalledProcessError:
                pass


def _epoch(value) -> float:
    """A transition's time, as the API gives it: epoch seconds, or ISO 8601."""
    import datetime as dt

    if not value:
        return 0.0
    try:
        return float(value)
    except (TypeError, ValueError):
        return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def _clock(epoch: float) -> str:
    """Wall time of day, UTC, to the tenth of a second: as the stack's logs stamp their lines."""
    return time.strftime("%H:%M:%S", time.gmtime(epoch)) + f".{int(epoch * 10) % 10}"


def psql_binary() -> str:
    """psql: the one the embedded PostgreSQL's package ships (a machine need not have Debian's)."""
    return str(database.install_dir() / "bin" / "psql")


def with_database(url: str, name: str) -> str:
    """`url` (postgres://…/db?…) naming database `name` instead."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def rss_of_group(pid: int) -> int:
    """Resident memory of a process and its children (Celery's pool), in bytes."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(entry.name) == pid or int(stat[2]) == pid:  # stat[2]: its process group
                total += int(stat[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="length of the fault phase")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--gap", type=float, default=45.0, help="mean seconds between faults")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    p.add_argument("--warmup", type=float, default=20.0)
    p.add_argument("--settle", type=float, default=30.0, help="traffic after the last fault")
    p.add_argument("--time-scale", type=float, default=0.25, help="emulated GPU time multiplier")
    p.add_argument("--kinds", nargs="+", default=list(FAULTS), choices=FAULTS)
    p.add_argument("--results", default=str(RESULTS))
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    soak = Soak(args)
    print(f"starting the stack in {soak.var_dir} …", flush=True)
    soak.start()
    try:
        report = asyncio.run(soak.run())
    finally:
        soak.stop()
    report["log_dir"] = str(soak.var_dir / "log")
    Path(args.results).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("faults",)}, indent=2))
    print(f"written to {args.results}")
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
