"""Failures that last, each opening (or joining) an incident: NVLink down, a slow or thermally throttled GPU, a node
partitioned from the control plane, a poison request, a gateway's death, Redis or the database away.

A node that dies, and a node found corrupt, have their own paths (recovery.actions.incidents). These six are found by
their own evidence, each where it shows:

- NVLink down: the GPU readings its heartbeats carry report links down on a node with no Xid to say so
  (`check_nvlink`, periodic, off the heartbeat's path). Its tensor-parallel group talks over PCIe: slower, not dead.
- A slow GPU: the node's decode steps run SLOW_FACTOR times or more the model's step time for their shape
  (recovery.policy.capacity.slowdown, what the degradation level already counts) for LIFELINE_SLOW_GPU_S on end;
  a thermal throttle in its telemetry is named as the cause (`check_slow_gpus`, periodic).
- A partitioned node: marked DOWN for no heartbeat, yet the same session answers the control plane (`partitioned`,
  a reaction to the DOWN, before its incident is written). It stays out of routing (nothing it holds is coordinated
  while it is unheard); the incident says it is partitioned, not dead, and the condition clears when it registers
  again (`registered_again`, a reaction to its JOIN).
- A poison request: POISON_AFTER requests with one content key, each failed on two nodes, within POISON_WINDOW_S
  (`request_failed`, from the gateways' signals); no node is blamed for them (recovery.policy.breaker).
- A gateway's death: a gateway that published its in-flight requests within the last hour stops for
  GATEWAY_LOST_AFTER_S without saying it leaves (a clean stop removes it); the requests it had in flight are named
  (`check_gateways`, periodic).
- Redis or the database away for longer than a heartbeat interval: the store watch (`StoreWatch`, a thread of Celery
  beat, the control plane's one process of its kind) probes both every half second. A Redis outage is recorded as it
  happens (the database takes it); a database outage once the database answers again, with when it began.

Each condition is one row (recovery.models.Condition), at most one open per class and subject, on the timeline of
its incident with its runbook (console.runbooks, /runbooks/<name>/) and a severity it raises the incident to. The
incident is not Stable while a condition of it is open, and a node with an open condition is not back in routing
for its incident (recovery.actions.incidents.coverage).
"""

import datetime as dt
import json
import logging
import threading
import time
from dataclasses import dataclass

import redis
from django.conf import settings
from django.db import IntegrityError, close_old_connections, connection, transaction
from django.utils import timezone

from recovery import events, hot, nodeclient
from recovery.actions import incidents, notify
from recovery.choices import EventKind, FailureClass, IncidentStatus, NodeState
from recovery.models import Cluster, Condition, Incident, Node
from recovery.policy import capacity as capacity_policy
from recovery.policy import severity as severity_policy
from recovery.protocol import RequestFailed
from recovery.stores import STORE_ERRORS, away
from workers import catalog
from workers import telemetry as telemetry_mod
from workers.protocol import STATUS_PATH

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kind:
    """What a failure class means for its incident: the runbook that says what to do, the severity it starts at,
    and whether on-call is told at once (a notification of kind "failure")."""

    runbook: str
    severity: str
    tell_on_call: bool


KINDS = {
    FailureClass.NVLINK_DOWN: Kind("LifelineNvlinkDown", severity_policy.SEV3, False),
    FailureClass.SLOW_GPU: Kind("LifelineGpuSlow", severity_policy.SEV3, False),
    FailureClass.PARTITIONED: Kind("LifelineNodePartitioned", severity_policy.SEV3, False),
    FailureClass.POISON_REQUEST: Kind("LifelinePoisonRequest", severity_policy.SEV2, True),
    FailureClass.GATEWAY_LOST: Kind("LifelineGatewayLost", severity_policy.SEV2, True),
    FailureClass.STORE_AWAY: Kind("LifelineStoreAway", severity_policy.SEV2, True),
}

SLOW_FACTOR = 1.5  # decode steps this many times the model's, or more: slow (a PCIe fallback or a throttle shows)
SLOW_CLEAR_SHARE = 1 / 3  # back within the factor for this share of LIFELINE_SLOW_GPU_S: the condition clears
POISON_AFTER = 3  # requests with one content key, each failed on two nodes ...
POISON_WINDOW_S = 600.0  # ... within this long: a poison request
GATEWAY_LOST_AFTER_S = 5.0  # a gateway publishes every second; this long silent (and not gone cleanly) is lost
GATEWAY_FORGOTTEN_S = 3600.0  # a gateway silent longer than this is not judged any more
STORE_PROBE_S = 0.5
STORE_PROBE_TIMEOUT_S = 1.0

THERMAL_BITS = telemetry_mod.THROTTLE_SW_THERMAL | telemetry_mod.THROTTLE_HW_THERMAL


def _at(value) -> dt.datetime:
    if isinstance(value, dt.datetime):
        return value
    return dt.datetime.fromtimestamp(time.time() if value is None else value, tz=dt.UTC)


def open_condition(failure_class: str, subject: str) -> Condition | None:
    return Condition.objects.filter(failure_class=failure_class, subject=subject, cleared_at__isnull=True).first()


def _incident_for(at: dt.datetime, node: Node | None, title: str) -> Incident:
    """The active incident `node` is in, else the one active within the cluster's incident window, else a new one:
    failures close together are one incident, as for a node's loss (incidents.note_failure)."""
    if node is not None:
        joined = node.incidents.select_for_update().filter(status=IncidentStatus.ACTIVE).order_by("-opened_at").first()
        if joined is not None:
            return joined
    joined = incidents.active_within_window(Cluster.default(), at)
    if joined is not None:
        return joined
    return incidents.open_incident(title[:200], at, kind="condition")


@transaction.atomic
def begin(
    failure_class: str,
    subject: str,
    at,
    summary: str,
    *,
    node: Node | None = None,
    details: dict | None = None,
    source: str = "control-plane",
) -> Condition:
    """A lasting failure's first evidence, at `at`: its condition, on the incident it opens or joins, on that
    incident's timeline with its runbook, the incident's severity raised to the class's. While it is open, the same
    evidence again is the same condition: nothing new is written."""
    current = open_condition(failure_class, subject)
    if current is not None:
        return current
    at, kind = _at(at), KINDS[FailureClass(failure_class)]
    incident = _incident_for(at, node, f"{FailureClass(failure_class).label}: {subject[:40]}")
    try:
        with transaction.atomic():
            condition = Condition.objects.create(
                incident=incident,
                failure_class=failure_class,
                subject=subject,
                node=node,
                started_at=at,
                summary=summary,
                details=details or {},
            )
    except IntegrityError:  # another process began it meanwhile (the unique open condition)
        return open_condition(failure_class, subject)
    if node is not None and not incident.nodes.filter(pk=node.pk).exists():
        incident.nodes.add(node)
    # Recovery is judged again: what it holds now includes this.
    Incident.objects.filter(pk=incident.pk).update(recovered_at=None, capacity_restored_at=None, recovery_time_s=None)
    incidents.add_event(
        incident,
        EventKind.CONDITION,
        summary,
        at=at,
        source=source,
        node=node,
        details={
            "class": failure_class,
            "subject": subject,
            "condition": condition.pk,
            "runbook": kind.runbook,
            **(details or {}),
        },
    )
    severity = incidents.raise_severity(incident, kind.severity, f"{FailureClass(failure_class).label}: {subject}", at)
    if kind.tell_on_call:
        notify.send(
            "failure",
            f"{FailureClass(failure_class).label}: {subject}"[:200],
            f"{summary}. Incident #{incident.pk}; runbook /runbooks/{kind.runbook}/.",
            f"/incidents/{incident.pk}/",
            severity=severity,
        )
    transaction.on_commit(lambda pk=incident.pk: events.incident_changed(pk))
    return condition


@transaction.atomic
def clear(failure_class: str, subject: str, at, why: str, *, source: str = "control-plane") -> Condition | None:
    """The evidence that an open condition ended, at `at`: on its incident's timeline. The incident's recovery is
    judged again (recovery.actions.incidents.check_recovery): a condition of no node, once cleared, restores what
    it took. None when no such condition is open."""
    condition = (
        Condition.objects.select_for_update(of=("self",))
        .filter(failure_class=failure_class, subject=subject, cleared_at__isnull=True)
        .select_related("incident", "node")
        .first()
    )
    if condition is None:
        return None
    at = max(_at(at), condition.started_at)
    condition.cleared_at, condition.cleared_by = at, why
    condition.save(update_fields=["cleared_at", "cleared_by"])
    lasted = (at - condition.started_at).total_seconds()
    incidents.add_event(
        condition.incident,
        EventKind.CONDITION_CLEARED,
        f"{FailureClass(failure_class).label} cleared after {lasted:.1f} s ({subject}): {why}",
        at=at,
        source=source,
        node=condition.node,
        details={"class": failure_class, "subject": subject, "condition": condition.pk, "lasted_s": round(lasted, 3)},
    )
    incidents.note_capacity(condition.incident, timezone.now())
    transaction.on_commit(lambda pk=condition.incident_id: events.incident_changed(pk))
    return condition


# --- NVLink, from the heartbeats -------------------------------------------------------------------------------------
def links_down(gpus: list[dict]) -> dict[int, int]:
    """{GPU index: links down} of the GPUs whose heartbeat reading reports NVLink links down (a lost GPU says
    nothing)."""
    return {
        int(gpu["index"]): int(gpu["nvlink_links_down"])
        for gpu in gpus or []
        if gpu.get("nvlink_links_down") and not gpu.get("lost")
    }


def check_nvlink() -> dict[str, dict[int, int]]:
    """Every live node's latest GPU readings (its heartbeats' telemetry, kept in Redis): NVLink links down begin the
    node's condition; all up again clears it. Only a change costs the database anything: the last reading is kept
    beside the node's entry. Returns {node: links down per GPU} of the nodes with links down."""
    live = list(Node.objects.filter(state__in=(NodeState.JOIN, NodeState.SERVING)).values_list("name", flat=True))
    r, keys = hot.client(), hot.keys()
    pipe = r.pipeline()
    for name in live:
        pipe.lindex(keys.telemetry(name), 0)
        pipe.hget(keys.node(name), "nvlink_down")
    answers = pipe.execute()
    found = {}
    for name, raw, before in zip(live, answers[::2], answers[1::2], strict=True):
        gpus = (json.loads(raw).get("gpus") or []) if raw else []
        if not any(gpu.get("nvlink_links") for gpu in gpus):
            continue
        down = links_down(gpus)
        if down:
            found[name] = down
        mark = json.dumps(sorted(down.items()))
        if mark == before:
            continue
        if down:
            links = {int(gpu["index"]): gpu.get("nvlink_links") for gpu in gpus}
            where = ", ".join(f"GPU {index} ({count} of {links.get(index)} links)" for index, count in down.items())
            begin(
                FailureClass.NVLINK_DOWN,
                name,
                json.loads(raw).get("at"),
                f"{name}: NVLink down on {where}, with no Xid: its tensor-parallel group talks over PCIe, every step "
                "slower; it stays in routing",
                node=Node.objects.get(name=name),
                details={"links_down": {str(index): count for index, count in down.items()}},
            )
        else:
            clear(FailureClass.NVLINK_DOWN, name, json.loads(raw).get("at"), "every NVLink link up again")
        r.hset(keys.node(name), "nvlink_down", mark)
    return found


# --- slow GPUs, from the decode steps --------------------------------------------------------------------------------
def _thermal(name: str) -> str:
    """What the node's latest telemetry says of heat, if it throttles for it: '' otherwise."""
    readings = hot.telemetry(name, 1)
    for gpu in (readings[0].get("gpus") or []) if readings else []:
        if (gpu.get("throttle_reasons") or 0) & THERMAL_BITS:
            clock = gpu.get("sm_clock_mhz")
            top = gpu.get("sm_clock_max_mhz")
            return (
                f"thermal throttling on GPU {gpu.get('index', 0)}: {gpu.get('temperature_c')} °C, SM clock "
                f"{clock} of {top} MHz"
            )
    return ""


def check_slow_gpus(now: float | None = None) -> dict[str, float]:
    """Every serving node's last decode step against the model's (the slowdown the degradation level counts): slow
    for LIFELINE_SLOW_GPU_S on end begins its condition, within the factor for a third of that clears it. Nodes in
    front of a real engine are not judged: their step time is the engine's on its own hardware, which the catalog's
    roofline does not model here (a CPU engine steps a thousand times slower than an H100). Returns the slowdowns."""
    now = time.time() if now is None else now
    sustained = settings.LIFELINE_SLOW_GPU_S
    serving = list(Node.objects.filter(state=NodeState.SERVING, engine="emulated"))
    live = hot.nodes([n.name for n in serving])
    r, keys = hot.client(), hot.keys()
    slowdowns = {}
    for node in serving:
        entry = live.get(node.name)
        if entry is None:
            continue
        try:
            deployment = catalog.Deployment.of(node.model_key, node.gpu_key, node.tp)
        except catalog.CatalogError:
            continue
        slow = capacity_policy.slowdown(
            deployment,
            entry.decode_step_ms or 0.0,
            entry.decode_step_batch or 0,
            entry.decode_step_context_tokens or 0,
        )
        slowdowns[node.name] = slow
        key = keys.node(node.name)
        if slow >= SLOW_FACTOR:
            r.hdel(key, "fast_since")
            r.hsetnx(key, "slow_since", now)
            since = float(r.hget(key, "slow_since") or now)
            if now - since >= sustained and open_condition(FailureClass.SLOW_GPU, node.name) is None:
                model_ms = deployment.step_s(0, 0, entry.decode_step_batch or 0, entry.decode_step_context_tokens or 0)
                heat = _thermal(node.name)
                begin(
                    FailureClass.SLOW_GPU,
                    node.name,
                    since,
                    f"{node.name}: decode steps {slow:.1f}× the model's ({entry.decode_step_ms:.1f} ms against "
                    f"{model_ms * 1000:.1f} ms at batch {entry.decode_step_batch}) for {now - since:.0f} s"
                    + (f"; {heat}" if heat else ""),
                    node=node,
                    details={"slowdown": round(slow, 3), "thermal": heat, "sustained_s": round(now - since, 1)},
                )
        else:
            r.hdel(key, "slow_since")
            if open_condition(FailureClass.SLOW_GPU, node.name) is None:
                continue
            r.hsetnx(key, "fast_since", now)
            since = float(r.hget(key, "fast_since") or now)
            if now - since >= sustained * SLOW_CLEAR_SHARE:
                clear(
                    FailureClass.SLOW_GPU,
                    node.name,
                    since,
                    f"decode steps within {SLOW_FACTOR:g}× the model's for {now - since:.0f} s ({slow:.2f}× now)",
                )
                r.hdel(key, "fast_since")
    return slowdowns


# --- partitions, from the heartbeat check ----------------------------------------------------------------------------
def partitioned(node: Node, session: str, at: dt.datetime) -> Condition | None:
    """`node`'s session was marked DOWN for its silence at `at` (a reaction to that step): if the same session still
    answers the control plane (its /agent/status), the link its heartbeats take is cut, not the node, and its
    condition begins (the failure joins the same incident). A new process at the old address, or a new session
    registered since, is no partition. The condition, or None."""
    if node.session != session:
        return None  # it registered again meanwhile: whatever cut it healed before this could ask
    try:
        status, said = nodeclient.call(node.address, "GET", STATUS_PATH, timeout=0.5)
    except nodeclient.NodeUnreachable:
        return None
    if status != 200 or said.get("session") != session:
        return None
    heard = node.last_seen_at or at
    silent = (at - heard).total_seconds()
    state = (said.get("load") or {}).get("model_state") or "up"
    return begin(
        FailureClass.PARTITIONED,
        node.name,
        heard,
        f"{node.name}: no heartbeat for {silent:.1f} s, yet session {session[:8]} answers the control plane "
        f"({state}): partitioned from it, not dead. Taken out of routing all the same (its checkpoints and load go "
        "unheard); it returns when it registers again",
        node=node,
        details={"silent_s": round(silent, 3), "model_state": state, "session": session},
    )


def registered_again(name: str, at: dt.datetime) -> None:
    """A node registered a new session (a reaction to its JOIN): a partition of it, if open, has healed."""
    clear(FailureClass.PARTITIONED, name, at, "it registered again: heard")


# --- poison requests, from the gateways' signals ---------------------------------------------------------------------
def request_failed(gateway: str, signal: RequestFailed) -> Condition | None:
    """A request failed on two nodes (a gateway's signal): the POISON_AFTER-th such failure of one content within
    POISON_WINDOW_S begins its condition. The content is the client's request as sent (`content_key`, before the
    gateway draws a sampled request's seed); its failures are counted in Redis (a sorted set per key, by time)."""
    key_of_request = signal.content_key or signal.request_key or ""
    if not key_of_request:
        return None
    now = time.time()
    r, keys = hot.client(), hot.keys()
    failures = keys.poison_failures(key_of_request)
    pipe = r.pipeline()
    pipe.zadd(failures, {signal.request_id or f"{gateway}:{now}": now})
    pipe.zremrangebyscore(failures, "-inf", now - POISON_WINDOW_S)
    pipe.zcard(failures)
    pipe.expire(failures, int(POISON_WINDOW_S))
    pipe.zadd(keys.poison_last, {key_of_request: now})
    _, _, count, _, _ = pipe.execute()
    if count < POISON_AFTER:
        return None
    requests = r.zrange(failures, 0, -1)
    nodes = sorted(set(signal.nodes))
    answer = signal.answer[:200]
    return begin(
        FailureClass.POISON_REQUEST,
        key_of_request,
        float(r.zrange(failures, 0, 0, withscores=True)[0][1]),
        f"poison request: {count} requests with one content key ({key_of_request[:12]}) failed on two nodes each "
        f"within {POISON_WINDOW_S / 60:.0f} minutes, last on {' and '.join(nodes)} ({answer}); no node is blamed",
        details={"requests": requests[:50], "count": count, "nodes": nodes, "answer": answer},
        source=f"gateway {gateway}",
    )


def check_poison(now: float | None = None) -> list[str]:
    """Poison conditions with no failure for LIFELINE_POISON_QUIET_S: cleared. Returns the keys cleared."""
    now = time.time() if now is None else now
    quiet = settings.LIFELINE_POISON_QUIET_S
    r, keys = hot.client(), hot.keys()
    cleared = []
    for condition in Condition.objects.filter(failure_class=FailureClass.POISON_REQUEST, cleared_at__isnull=True):
        last = r.zscore(keys.poison_last, condition.subject)
        if last is None or now - last >= quiet:
            at = last if last is not None else now
            clear(FailureClass.POISON_REQUEST, condition.subject, at, f"no failure of it for {quiet:.0f} s")
            cleared.append(condition.subject)
    return cleared


# --- gateways, from what they publish --------------------------------------------------------------------------------
def check_gateways(now: float | None = None) -> dict[str, str]:
    """Every gateway that published within GATEWAY_FORGOTTEN_S: silent for GATEWAY_LOST_AFTER_S begins its condition,
    naming the requests it had in flight (their clients' streams broke; a client that resumes with Last-Event-ID
    goes on through another gateway); publishing again clears it. A gateway that stops cleanly removes itself
    (recovery.gateway.signals) and is not judged. Returns {gateway: "lost" or "back"} for what changed."""
    now = time.time() if now is None else now
    r, keys = hot.client(), hot.keys()
    changed = {}
    for gateway, seen in r.zrangebyscore(keys.gateways, now - GATEWAY_FORGOTTEN_S, "+inf", withscores=True):
        silent = now - seen
        lost = open_condition(FailureClass.GATEWAY_LOST, gateway)
        if silent >= GATEWAY_LOST_AFTER_S and lost is None:
            flights = r.hgetall(keys.gateway_inflight(gateway))
            on_nodes = sorted({json.loads(raw).get("node") or "?" for raw in flights.values()})
            begin(
                FailureClass.GATEWAY_LOST,
                gateway,
                seen,
                f"gateway {gateway} silent for {silent:.1f} s (it publishes every second) and did not leave cleanly: "
                f"{len(flights)} request{'s' if len(flights) != 1 else ''} in flight on it then"
                + (f" (on {', '.join(on_nodes)})" if flights else "")
                + "; their clients' streams broke, and a client that resumes goes on through another gateway",
                details={"requests": sorted(flights)[:100], "in_flight": len(flights), "silent_s": round(silent, 1)},
            )
            changed[gateway] = "lost"
        elif silent < GATEWAY_LOST_AFTER_S and lost is not None:
            clear(FailureClass.GATEWAY_LOST, gateway, seen, "it publishes again")
            changed[gateway] = "back"
    return changed


def lost_gateway_of(request_id: str) -> Condition | None:
    """The open lost-gateway condition that had `request_id` in flight when its gateway went silent, if any."""
    lost = Condition.objects.filter(failure_class=FailureClass.GATEWAY_LOST, cleared_at__isnull=True)
    return next((c for c in lost.select_related("incident") if request_id in c.details.get("requests", ())), None)


# --- Redis and the database, from a watch of its own ----------------------------------------------------------------
@dataclass
class Outage:
    since: float
    why: str
    recorded: bool = False


class StoreWatch:
    """Probes Redis and the database every STORE_PROBE_S; an outage longer than a heartbeat interval is a condition.

    Redis away: begun at once (the database takes it), cleared when Redis answers. The database away: nothing can be
    written, so it is begun and cleared together once the database answers, dated by when it went. Each probe is
    a real round trip (PING; SELECT 1) with a short timeout; two failures in a row make an outage, so one slow answer
    on a busy host does not."""

    def __init__(self, redis_url: str | None = None, probe_database=None):
        self.redis = redis.Redis.from_url(
            redis_url or settings.REDIS_URL,
            socket_timeout=STORE_PROBE_TIMEOUT_S,
            socket_connect_timeout=STORE_PROBE_TIMEOUT_S,
        )
        self.probe_database = probe_database or _select_one
        self.failed: dict[str, tuple[float, str]] = {}  # store -> (first failed probe, why), before it counts
        self.outages: dict[str, Outage] = {}
        self._stop = threading.Event()

    def probe(self) -> dict[str, str | None]:
        """{store: None if it answered, else why not}."""
        said = {}
        try:
            self.redis.ping()
            said["redis"] = None
        except redis.RedisError as exc:
            said["redis"] = _reason(exc)
        try:
            self.probe_database()
            said["database"] = None
        except STORE_ERRORS as exc:
            if not away(exc):
                raise
            close_old_connections()
            said["database"] = _reason(exc)
        return said

    def tick(self, now: float | None = None) -> dict[str, str]:
        """One probe of both stores and what follows from it. Returns {store: "away" or "back"} for what changed."""
        now = time.time() if now is None else now
        said = self.probe()
        changed = {}
        database_up = said["database"] is None
        for store, why in said.items():
            if why is not None:
                first, _ = self.failed.setdefault(store, (now, why))
                if store not in self.outages and now - first >= settings.LIFELINE_HEARTBEAT_INTERVAL_S:
                    self.outages[store] = Outage(first, why)
                    changed[store] = "away"
                continue
            self.failed.pop(store, None)
            outage = self.outages.get(store)
            if outage is not None and database_up:
                self._record(store, outage, now, back=True)
                del self.outages[store]
                changed[store] = "back"
        if database_up:
            for store, outage in self.outages.items():
                if not outage.recorded:
                    self._record(store, outage, now, back=False)
        return changed

    def _record(self, store: str, outage: Outage, now: float, *, back: bool) -> None:
        name = "Redis" if store == "redis" else "the database"
        if not outage.recorded:
            begin(
                FailureClass.STORE_AWAY,
                store,
                outage.since,
                f"{name} away ({outage.why}): while it is, "
                + (
                    "heartbeats, the gateways' signals and Celery's tasks stop, and no failure is handled"
                    if store == "redis"
                    else "no heartbeat, canary or failure is recorded"
                ),
                details={"store": store, "why": outage.why},
                source="store watch",
            )
            outage.recorded = True
        if back:
            clear(FailureClass.STORE_AWAY, store, now, f"{name} answers again", source="store watch")

    def run(self) -> None:
        while not self._stop.wait(STORE_PROBE_S):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the watch outlives any one probe's surprise
                log.exception("store watch: a probe failed unexpectedly")

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="store-watch", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()


def _select_one() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


def _reason(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [exc.__class__.__name__])[0][:200]
