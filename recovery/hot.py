"""Hot state in Redis: heartbeats and load, the routing table, gateway keys.

The database is the system of record; Redis holds what changes every second
and what the gateway reads without touching the database. Everything here can
be rebuilt from the database (`sync_hot_state`) except the latest loads,
which the next heartbeats bring back.
"""

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field

import redis
from django.conf import settings

from recovery.keys import Keys
from workers.protocol import HEARTBEAT_LOAD_FIELDS

log = logging.getLogger(__name__)


class RedisNotConfigured(RuntimeError):
    pass


_client: redis.Redis | None = None
_client_pid: int | None = None


def client() -> redis.Redis:
    """A Redis client for this process (a forked Celery child gets its own)."""
    global _client, _client_pid
    if _client is None or _client_pid != os.getpid():
        if not settings.REDIS_URL:
            raise RedisNotConfigured(
                "REDIS_URL is not set: start the embedded default with `python manage.py demo`, "
                "or set REDIS_URL=redis://host:6379/0"
            )
        _client = redis.Redis.from_url(
            settings.REDIS_URL, decode_responses=True, socket_timeout=5, health_check_interval=30
        )
        _client_pid = os.getpid()
    return _client


def keys() -> Keys:
    return Keys(settings.LIFELINE_NAMESPACE)


RESUMED_KEPT_S = 3600  # the last resumption of heartbeats matters for seconds; kept an hour

LOAD_FIELDS = (
    HEARTBEAT_LOAD_FIELDS  # what a heartbeat's load keeps in a node's entry (workers.protocol, the one status schema)
)


# --- nodes -------------------------------------------------------------------
def record_node(name: str, session: str, state: str, address: str, watch: bool, seen_now: bool = False) -> None:
    """Mirror a node's identity and state; `watch` puts it under heartbeat watch. `seen_now`: a new session has
    just registered, so its clock starts now (not at its predecessor's last beat)."""
    now = time.time()
    pipe = client().pipeline()
    pipe.hset(keys().node(name), mapping={"session": session, "state": state, "address": address})
    if watch:
        # A node just registered counts as seen now, so it has the full miss window to send its first beat; a
        # mirror of a node already watched (a resync) keeps its last beat, so a silence is not hidden.
        pipe.zadd(keys().heartbeats, {name: now}, nx=not seen_now)
    else:
        pipe.zrem(keys().heartbeats, name)
    heard = watch and seen_now  # a registration came in through the web process: the control plane hears nodes
    if heard:
        pipe.getset(keys().heartbeats_ingested, now)
    results = pipe.execute()
    if heard:
        _heard_after(results[-1], now)


def unwatch(name: str) -> None:
    client().zrem(keys().heartbeats, name)


def _int(raw: str | None) -> int | None:
    return None if raw in (None, "", "None") else int(float(raw))


def _float(raw: str | None) -> float | None:
    return None if raw in (None, "", "None") else float(raw)


@dataclass(frozen=True)
class NodeEntry:
    """A node's entry in Redis, parsed once: its identity and state as the control plane recorded them, and
    the figures of its latest heartbeat (None where it has not reported one: n/a, never a zero)."""

    session: str | None = None
    state: str | None = None
    address: str | None = None
    last_seen: float | None = None
    model_state: str | None = None
    running: int | None = None
    waiting: int | None = None
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    step_ms: float | None = None
    tokens_per_s: float | None = None
    decode_step_ms: float | None = None
    decode_step_batch: int | None = None
    decode_step_context_tokens: int | None = None
    checkpoints: dict = field(default_factory=dict)  # other nodes' KV it holds, by serving node: {bytes, requests}
    xid_seen: float = 0.0  # the newest Xid event taken from its heartbeats

    @classmethod
    def parse(cls, raw: dict[str, str]) -> "NodeEntry":
        return cls(
            session=raw.get("session"),
            state=raw.get("state"),
            address=raw.get("address"),
            last_seen=_float(raw.get("last_seen")),
            model_state=raw.get("model_state") or None,
            running=_int(raw.get("running")),
            waiting=_int(raw.get("waiting")),
            kv_blocks_used=_int(raw.get("kv_blocks_used")),
            kv_blocks_total=_int(raw.get("kv_blocks_total")),
            step_ms=_float(raw.get("step_ms")),
            tokens_per_s=_float(raw.get("tokens_per_s")),
            decode_step_ms=_float(raw.get("decode_step_ms")),
            decode_step_batch=_int(raw.get("decode_step_batch")),
            decode_step_context_tokens=_int(raw.get("decode_step_context_tokens")),
            checkpoints=json.loads(raw["checkpoints"]) if raw.get("checkpoints") else {},
            xid_seen=_float(raw.get("xid_seen")) or 0.0,
        )

    @property
    def queue_depth(self) -> int:
        """Requests on the node, running or waiting (0 while it has not said)."""
        return (self.running or 0) + (self.waiting or 0)

    @property
    def checkpoint_bytes_held(self) -> int:
        return sum(v.get("bytes", 0) for v in self.checkpoints.values())


def node(name: str) -> NodeEntry | None:
    raw = client().hgetall(keys().node(name))
    return NodeEntry.parse(raw) if raw else None


def nodes(names: list[str]) -> dict[str, NodeEntry]:
    if not names:
        return {}
    pipe = client().pipeline()
    for name in names:
        pipe.hgetall(keys().node(name))
    return {name: NodeEntry.parse(raw) for name, raw in zip(names, pipe.execute()) if raw}


def queues(names: list[str]) -> dict[str, tuple[int, int]]:
    """(running, waiting) of each node that has reported them: two fields of each entry, for counts over a fleet."""
    if not names:
        return {}
    pipe = client().pipeline(transaction=False)
    for name in names:
        pipe.hmget(keys().node(name), "running", "waiting")
    return {
        name: (_int(running) or 0, _int(waiting) or 0)
        for name, (running, waiting) in zip(names, pipe.execute())
        if running is not None
    }


TELEMETRY_KEPT = 600  # readings per node: ten minutes at one heartbeat a second
CHECKPOINTS_KEPT = 120  # checkpoint holdings per node: two minutes at one heartbeat a second


def heartbeat(
    name: str,
    now: float,
    model_state: str,
    load: dict,
    checkpoints: dict | None = None,
    gpus: list | None = None,
    taken: float | None = None,
) -> None:
    """A node's beat, sent at `now`; taken in at `taken` (now, unless said). The control plane's hearing is judged by
    when beats are taken in: a web process just restarted takes a backlog of beats in at once, each sent within an
    interval of the one before, and judged by when they were sent no gap showed, so no node's allowance ran from the
    end of the deafness (a chaos run on 2026-12-07 marked two nodes DOWN so, 6 s into a deafness the sweep had seen)."""
    taken = time.time() if taken is None else taken
    pipe = client().pipeline()
    fields = {"last_seen": now, "model_state": model_state, "checkpoints": json.dumps(checkpoints or {})}
    fields.update({f: load[f] for f in LOAD_FIELDS if f in load})
    pipe.hset(keys().node(name), mapping=fields)
    pipe.zadd(keys().heartbeats, {name: now}, xx=True)
    if gpus:
        pipe.lpush(keys().telemetry(name), json.dumps({"at": now, "gpus": gpus}))
        pipe.ltrim(keys().telemetry(name), 0, TELEMETRY_KEPT - 1)
    pipe.lpush(keys().checkpoint_history(name), json.dumps({"at": now, "checkpoints": checkpoints or {}}))
    pipe.ltrim(keys().checkpoint_history(name), 0, CHECKPOINTS_KEPT - 1)
    pipe.getset(keys().heartbeats_ingested, taken)
    _heard_after(pipe.execute()[-1], taken)


def _heard_after(previous: str | None, now: float) -> None:
    """A node was heard, taken in at `now` (a beat, a registration), the one before at `previous`: after a gap no
    listening control plane has, its deafness ended now, and each node's allowance runs from here
    (heartbeats_resumed_at). So too after none (`previous` None): Redis holds no record of hearing, having restarted
    empty, and the hot state's restore put the nodes back under watch as seen at the restore, before this first
    beat; judged from the restore, the nodes whose beats had not come yet were marked DOWN (a chaos run on
    2026-12-07: five healthy nodes, 4.3 s after a restore, 1.1 s after the sweep had logged the control plane deaf).
    On a first start the mark is harmless: no node's silence began before the first beat anyway."""
    if previous is None or now - float(previous) > deaf_after_s():
        client().set(keys().heartbeats_resumed, now, ex=RESUMED_KEPT_S)


def deaf_after_s() -> float:
    """A gap this long with no heartbeat from any node is the control plane's own deafness (its web process
    restarting, Redis away), not the fleet's silence: while it listens, every node beats once an interval, so some
    beat comes in at least that often. Shorter than a miss, so it is told before the first node's silence is."""
    return min(1.5 * settings.LIFELINE_HEARTBEAT_INTERVAL_S, settings.LIFELINE_HEARTBEAT_MISS_S)


def hot_state_present() -> bool:
    """False when Redis lost what the control plane writes (it restarted empty): the mark `publish_hot_state`
    sets is there once the whole of it was written."""
    return bool(client().exists(keys().hot_state_written))


def watched_count() -> int:
    return client().zcard(keys().heartbeats)


def heartbeats_deaf_since(now: float) -> float:
    """When the control plane found every watched node silent at once, this time round (set now if not yet)."""
    r = client()
    r.set(keys().heartbeats_deaf, now, nx=True, ex=RESUMED_KEPT_S)
    return float(r.get(keys().heartbeats_deaf) or now)


def heartbeats_heard() -> None:
    """Some node is heard again: the next fleet-wide silence starts its own allowance."""
    client().delete(keys().heartbeats_deaf)


def heartbeats_ingested_at() -> float | None:
    """When the control plane last took in a heartbeat from any node; None if Redis holds none."""
    raw = client().get(keys().heartbeats_ingested)
    return float(raw) if raw else None


def heartbeats_resumed_at() -> float:
    """When heartbeats came in again after the control plane took none for longer than a miss; 0 if never."""
    raw = client().get(keys().heartbeats_resumed)
    return float(raw) if raw else 0.0


# --- canaries -------------------------------------------------------------------
def canary_latency(name: str, ratio: float, at: float) -> None:
    """A node's latest canary answered in `ratio` × its baseline, at `at` (epoch seconds)."""
    client().hset(keys().canary_latency, name, f"{ratio:.4f} {at:.3f}")


def canary_latencies(since: float) -> dict[str, float]:
    """Each node's latest canary latency ratio (canary_latency) taken since `since`, by node name."""
    ratios = {}
    for name, raw in client().hgetall(keys().canary_latency).items():
        ratio, at = (float(x) for x in raw.split())
        if at >= since:
            ratios[name] = ratio
    return ratios


def telemetry(name: str, count: int = TELEMETRY_KEPT) -> list[dict]:
    """A node's latest GPU readings, newest first: {"at", "gpus": [...]}."""
    return [json.loads(raw) for raw in client().lrange(keys().telemetry(name), 0, count - 1)]


def checkpoints_as_of(names: list[str], at: float, fresh_s: float = 5.0) -> dict[str, dict]:
    """What each node held at `at` (epoch seconds), by its last heartbeat at or before then and at most `fresh_s`
    older: {holder: {serving node: {bytes, requests}}}, holders that held nothing left out."""
    if not names:
        return {}
    pipe = client().pipeline()
    for name in names:
        pipe.lrange(keys().checkpoint_history(name), 0, CHECKPOINTS_KEPT - 1)
    held = {}
    for name, history in zip(names, pipe.execute()):
        for raw in history:  # newest first
            entry = json.loads(raw)
            if entry["at"] <= at:
                if entry["at"] >= at - fresh_s and entry["checkpoints"]:
                    held[name] = entry["checkpoints"]
                break
    return held


def checkpoints_held(name: str) -> dict:
    """Other nodes' checkpoints `name` holds, by serving node: {node: {bytes, requests}}."""
    raw = client().hget(keys().node(name), "checkpoints")
    return json.loads(raw) if raw else {}


def silent_nodes(cutoff: float) -> list[tuple[str, float]]:
    """Watched nodes whose last heartbeat is older than `cutoff` (epoch seconds)."""
    return client().zrangebyscore(keys().heartbeats, "-inf", cutoff, withscores=True)


def newest_heartbeat() -> float | None:
    """When the most recent heartbeat of any watched node was taken."""
    newest = client().zrevrange(keys().heartbeats, 0, 0, withscores=True)
    return newest[0][1] if newest else None


def last_seen(name: str) -> float | None:
    return client().zscore(keys().heartbeats, name)


# --- routing table --------------------------------------------------------------
def _routing(pipe, entries: dict[str, dict], deployed_models: list[str] | None) -> None:
    pipe.delete(keys().routing)
    if entries:
        pipe.hset(keys().routing, mapping={name: json.dumps(entry) for name, entry in entries.items()})
    if deployed_models is not None:
        pipe.set(keys().deployed_models, json.dumps(sorted(deployed_models)))


ROUTING_LOCK_S = 10.0  # the longest a routing publish holds its lock, and waits for it


@contextlib.contextmanager
def routing_publish():
    """One control-plane process at a time reads the database for the routing table and writes it (see
    recovery.actions.routing.publish_routing). A lock not had within ROUTING_LOCK_S is gone past (said): a table
    published late is worse than one published beside another."""
    lock = client().lock(keys().routing_lock, timeout=ROUTING_LOCK_S, blocking_timeout=ROUTING_LOCK_S)
    held = lock.acquire()
    if not held:
        log.warning("publishing the routing table without its lock: not had within %.0f s", ROUTING_LOCK_S)
    try:
        yield
    finally:
        if held:
            try:
                lock.release()
            except redis.exceptions.LockError:  # held past its timeout and taken by the next: nothing to release
                pass


def publish_routing(entries: dict[str, dict], deployed_models: list[str] | None = None) -> None:
    """Replace the routing table gateways read, and tell them it changed."""
    pipe = client().pipeline()
    _routing(pipe, entries, deployed_models)
    pipe.publish(keys().routing_changed, str(time.time()))
    pipe.execute()


def publish_hot_state(
    entries: dict[str, dict], deployed_models: list[str], key_entries: dict[str, dict], config: dict
) -> None:
    """Write everything a gateway reads in one transaction, then the mark that it is whole: a gateway never reads
    a routing table without the keys that go with it (every request refused 401), and knows, when the mark
    goes, that Redis lost the hot state rather than that the fleet emptied."""
    pipe = client().pipeline()  # MULTI ... EXEC
    _routing(pipe, entries, deployed_models)
    _gateway_keys(pipe, key_entries)
    pipe.set(keys().cluster_config, json.dumps(config))
    pipe.set(keys().hot_state_written, str(time.time()))
    pipe.publish(keys().routing_changed, str(time.time()))
    pipe.execute()


def routing_table() -> dict[str, dict]:
    return {name: json.loads(raw) for name, raw in client().hgetall(keys().routing).items()}


# --- gateway keys ------------------------------------------------------------------
def publish_gateway_keys(entries: dict[str, dict]) -> None:
    """Replace the set of valid gateway keys (digest -> tenant and tier)."""
    pipe = client().pipeline()
    _gateway_keys(pipe, entries)
    pipe.publish(keys().routing_changed, str(time.time()))
    pipe.execute()


def _gateway_keys(pipe, entries: dict[str, dict]) -> None:
    pipe.delete(keys().gateway_keys)
    if entries:
        pipe.hset(keys().gateway_keys, mapping={digest: json.dumps(info) for digest, info in entries.items()})


def publish_cluster_config(config: dict) -> None:
    pipe = client().pipeline()
    pipe.set(keys().cluster_config, json.dumps(config))
    pipe.publish(keys().routing_changed, str(time.time()))
    pipe.execute()


# --- gateways ------------------------------------------------------------------------
def gateway_flights(within_s: float = 5.0) -> list[dict]:
    """Every gateway's in-flight requests, as each published them in the last few seconds."""
    r = client()
    flights = []
    for gateway in r.zrangebyscore(keys().gateways, time.time() - within_s, "+inf"):
        for request_id, raw in r.hgetall(keys().gateway_inflight(gateway)).items():
            flights.append({"request_id": request_id, "gateway": gateway, **json.loads(raw)})
    return flights
