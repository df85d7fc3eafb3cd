"""The demo's generated past: thirty days made by recovery.policy.history, stored here, marked simulated everywhere.

Idempotent and resumable. The first run claims the one HistoryBackfill row, which fixes the window (the 30 days
before live data begins, so live and generated minutes never share a row) and what the history is made from (the
seed, the fleet, the gateway keys' tenants and tiers, the rates). Each day is then written in one transaction, under
the SLO roll-up's lock, that first advances `days_done` by a conditional update: a second run, a re-delivered task
or a demo started again finds the day taken and writes nothing, and a run cut short resumes at the next day.

A day's requests are generated in memory a minute at a time and counted into per-minute rollups by the roll-up's own
MinuteRollup.add, against the thresholds each tier is owed (relaxed at level 3, as recovery.actions.slo does), and
stored by the roll-up's _store: 30 days of rows one by one would take minutes. The requests of each incident's span
(its chart, and its moved, shed and failed requests) are kept one by one too, as RequestOutcome rows counted already;
the incident, its timeline and the level changes are written with the day its failure began.

Nothing generated is read as the live state: the incidents are closed, the level changes are outbox rows already
handled (reacted_at set, so recovery.reactions never acts on them), and the live level lives on the cluster row.
"""

import datetime as dt
import itertools
import logging
import time

from django.db import transaction
from django.db.models import Min
from django.utils import timezone

from recovery.actions import capacity, slo, streams
from recovery.choices import EventKind, IncidentStatus, NodeState, Tier
from recovery.models import (
    ApiKey,
    Cluster,
    DegradationChange,
    HistoryBackfill,
    Incident,
    IncidentEvent,
    Node,
    RequestOutcome,
    SloRollup,
)
from recovery.policy import capacity as capacity_policy
from recovery.policy import history as policy
from recovery.policy import slo as slo_policy
from workers import catalog

log = logging.getLogger(__name__)

SEED = 20240601  # one seed: the same fleet and keys always get the same past
SOURCE = "generated history"


def backfill(until: dt.datetime | None = None, **options) -> HistoryBackfill | None:
    """The whole history at once (claim, then every day left); see write_next_day for one day at a time."""
    run = claim(until, **options)
    while run is not None and write_next_day(run):
        pass
    return run


def claim(
    until: dt.datetime | None = None,
    *,
    seed: int = SEED,
    days: int = policy.HISTORY_DAYS,
    rate_rps: float = policy.HISTORY_RATE_RPS,
) -> HistoryBackfill | None:
    """The history's row: the one claimed before, or a new one ending where live data begins (at `until` at the
    latest). None when there is no fleet to make a history of."""
    run = HistoryBackfill.objects.first()
    if run is not None:
        return run
    end = _live_begins(until or timezone.now())
    inputs = _inputs(seed, end - dt.timedelta(days=days), days, rate_rps)
    if inputs is None:
        log.info("no generated history: no node has registered yet")
        return None
    run, _ = HistoryBackfill.objects.get_or_create(
        pk=1,
        defaults={
            "window_start": end - dt.timedelta(days=days),
            "window_end": end,
            "days": days,
            "inputs": inputs.to_json(),
        },
    )
    return run


def write_next_day(run: HistoryBackfill) -> bool:
    """Generate and store the next day not yet written; False when every day is (or another run took this one)."""
    run.refresh_from_db()
    if run.days_done >= run.days:
        return False
    began = time.monotonic()
    day = run.days_done
    history = policy.History(policy.Inputs.from_json(run.inputs))
    day_start = history.inputs.start + day * policy.DAY_S
    day_end = day_start + policy.DAY_S
    slo.ensure_objectives({(history.inputs.model_key, tier) for _, tier in history.inputs.scopes})
    counter = _Counter(history.inputs.model_key, slo._owed_targets())
    for t0 in range(int(day_start), int(day_end), 60):
        # A failure's requests are counted with the failure, in the day it began.
        counter.add(t0, [o for o in history.minute(t0) if o.fault is None])
    faults = history.faults_in(day_start, day_end)
    kept = {fault.index: _kept_outcomes(history, fault) for fault in faults}
    for outcomes in kept.values():
        for t0, in_minute in itertools.groupby(outcomes, key=lambda o: o.at // 60 * 60):
            counter.add(t0, list(in_minute))
    with transaction.atomic():
        slo._lock_progress()  # _store's writes are the roll-up's: one writer at a time
        if not HistoryBackfill.objects.filter(pk=run.pk, days_done=day).update(days_done=day + 1):
            return False  # another run wrote this day
        slo._store(counter.minutes)
        written = _write_failures(history, faults, kept)
        changes = _write_level_changes(history.changes_in(day_start, day_end), history.inputs.model_key)
        run.refresh_from_db()
        summary = dict(run.summary)
        for name, value in {**counter.totals, **written, "degradation_changes": changes}.items():
            summary[name] = summary.get(name, 0) + value
        if run.days_done >= run.days:
            window = SloRollup.objects.filter(minute__gte=run.window_start, minute__lt=run.window_end)
            summary["rollups"] = window.count()
            run.finished_at = timezone.now()
        run.summary = summary
        run.work_s += time.monotonic() - began
        run.save(update_fields=["summary", "work_s", "finished_at"])
    if run.finished_at:
        log.info(
            "generated history: %d days, %s requests, %s incidents in %.1f s of work (%.1f s from the claim)",
            run.days,
            f"{summary.get('requests', 0):,}",
            summary.get("incidents", 0),
            run.work_s,
            (run.finished_at - run.started_at).total_seconds(),
        )
    return True


# --- what the history is made from ---------------------------------------------------------------------------------
def _live_begins(until: dt.datetime) -> dt.datetime:
    """The minute live data begins: its first outcome or rollup, or `until`, whichever is first."""
    firsts = [
        until,
        RequestOutcome.objects.filter(simulated=False).aggregate(first=Min("finished_at"))["first"],
        SloRollup.objects.aggregate(first=Min("minute"))["first"],  # none generated yet: every one is live
    ]
    return min(t for t in firsts if t is not None).replace(second=0, microsecond=0)


def _inputs(seed: int, start: dt.datetime, days: int, rate_rps: float) -> policy.Inputs | None:
    """The fleet as it registered (each node's capacity by the live model), the throughput objective, and the
    tenants and tiers of the gateway keys the traffic uses."""
    cluster = Cluster.default()
    nodes = list(Node.objects.exclude(state=NodeState.LEFT).select_related("rack").order_by("name"))
    if not nodes:
        return None
    # The history is of the fleet's main model (the demo serves one): its nodes, its objective, its level.
    models = [n.model_key for n in nodes if not n.spare] or [n.model_key for n in nodes]
    model_key = max(set(models), key=models.count)
    nodes = [n for n in nodes if n.model_key == model_key]
    slo_now = capacity.slo_of(model_key, cluster)
    specs = tuple(
        policy.NodeSpec(
            n.name,
            n.rack.name,
            n.model_key,
            n.gpu_key,
            n.tp,
            capacity_policy.node_capacity(
                catalog.Deployment.of(n.model_key, n.gpu_key, n.tp), slo_now, capacity.MAX_NUM_SEQS
            ).rps,
            n.spare,
        )
        for n in nodes
    )
    scopes = sorted(set(ApiKey.objects.filter(revoked_at__isnull=True).values_list("tenant", "tier")))
    return policy.Inputs(
        seed=seed,
        start=start.timestamp(),
        days=days,
        nodes=specs,
        required_rps=slo_now.required_rps,
        scopes=tuple(scopes) or tuple((tier, tier) for tier in Tier.values),
        model_key=model_key,
        rate_rps=rate_rps,
        margin=cluster.degradation_margin,
        hold_s=cluster.degradation_hold_s,
    )


# --- requests into rollups -----------------------------------------------------------------------------------------
class _Counter:
    """Generated outcomes counted into their minutes as recovery.actions.slo counts a gateway's."""

    def __init__(self, model_key: str, owed: dict[tuple[str, str, str], slo_policy.Targets]):
        self.model_key = model_key
        self.owed = owed
        self.minutes: dict[tuple[str, str, str, dt.datetime], slo_policy.MinuteRollup] = {}
        self.totals = {"requests": 0, "shed": 0, "failed": 0, "moved": 0}
        self._targets: dict[tuple[str, str, int], slo_policy.Targets] = {}

    def targets(self, tenant: str, tier: str, level: int) -> slo_policy.Targets:
        key = (tenant, tier, level)
        if key not in self._targets:
            owed = self.owed.get((self.model_key, tier, tenant)) or self.owed[(self.model_key, tier, "")]
            factor = capacity_policy.EFFECTS[level].latency_slo_factor  # level 3 relaxes the latency objectives
            self._targets[key] = slo_policy.Targets(owed.ttft_ms * factor, owed.tpot_ms * factor)
        return self._targets[key]

    def add(self, minute_start: float, outcomes: list[policy.Outcome]) -> None:
        """Count outcomes that finished in the minute starting at `minute_start`."""
        stamp = dt.datetime.fromtimestamp(minute_start, tz=dt.UTC)
        totals = self.totals
        for o in outcomes:
            key = (self.model_key, o.tier, o.tenant, stamp)
            minute = self.minutes.get(key)
            if minute is None:
                minute = self.minutes[key] = slo_policy.MinuteRollup()
            minute.add(
                o.status,
                o.http_status,
                o.ttft_ms,
                o.tpot_ms,
                self.targets(o.tenant, o.tier, o.level),
                level=o.level,
                migrated=o.move is not None,
                tokens_lost=0,  # the product's guarantee: a moved request loses no token
                completion_tokens=o.completion_tokens,
                simulated=True,
            )
            if o.status == "shed":
                totals["shed"] += 1
            elif o.status == "error":
                totals["failed"] += 1
            elif o.move is not None:
                totals["moved"] += 1
        totals["requests"] += len(outcomes)


def _kept_outcomes(history: policy.History, fault: policy.Fault) -> list[policy.Outcome]:
    """The requests of a failure's kept span that belong to it (within the history's window)."""
    start, end = fault.kept
    first = max(start, history.inputs.start) // 60 * 60
    last = min(end, history.inputs.end)
    return [
        o
        for t0 in range(int(first), int(last), 60)
        for o in history.minute(t0)
        if o.fault == fault.index and start <= o.at < end
    ]


# --- incidents and level changes -----------------------------------------------------------------------------------
def _at(epoch: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch, tz=dt.UTC)


def _write_failures(
    history: policy.History, faults: list[policy.Fault], kept: dict[int, list[policy.Outcome]]
) -> dict[str, int]:
    """Each failure as a closed incident marked simulated, with its timeline and its requests one by one."""
    cluster = Cluster.default()
    nodes = {n.name: n for n in Node.objects.filter(name__in={name for f in faults for name in f.nodes})}
    written = {"incidents": 0, "kept_outcomes": 0}
    for fault in faults:
        outcomes = kept[fault.index]
        failed = sum(o.status == "error" for o in outcomes)
        severity, why = fault.severity(failed)
        before = [o for o in outcomes if fault.failed_at - 60 <= o.at < fault.failed_at and o.status == "ok"]
        cause = fault.cause.label + (f" (Xid {fault.cause.xid})" if fault.cause.xid else "")
        incident = Incident.objects.create(
            cluster=cluster,
            title=fault.title,
            status=IncidentStatus.CLOSED,
            status_changed_at=_at(fault.closed_at),
            opened_at=_at(fault.failed_at),
            detected_at=_at(fault.detected_at),
            recovered_at=_at(fault.recovered_at),
            capacity_restored_at=_at(fault.capacity_restored_at),
            closed_at=_at(fault.closed_at),
            severity=severity,
            baseline_ttft_ms=sum(o.ttft_ms for o in before) / len(before) if before else None,
            baseline_tpot_ms=sum(o.tpot_ms for o in before) / len(before) if before else None,
            recovery_time_s=fault.recovered_at - fault.failed_at,
            notes=f"Generated history, not a real failure: {cause}.",
            details={
                "nodes_in_service": fault.in_service,
                "severity": {"from": "sev3", "to": severity, "why": why, "at": fault.detected_at},
                "simulated": {
                    "cause": fault.cause.label,
                    "xid": fault.cause.xid,
                    "scope": fault.cause.scope,
                    "spare": fault.spare,
                    "back_in_routing_at": fault.back_at,
                    "peak_level": fault.peak_level,
                },
            },
            simulated=True,
        )
        incident.nodes.add(*[nodes[name] for name in fault.nodes if name in nodes])
        IncidentEvent.objects.bulk_create(_timeline(history, incident, fault, cause, outcomes, nodes))
        RequestOutcome.objects.bulk_create(
            _outcome_rows(incident, fault, outcomes, history.inputs.model_key), batch_size=1000
        )
        written["incidents"] += 1
        written["kept_outcomes"] += len(outcomes)
    return written


def _timeline(
    history: policy.History,
    incident: Incident,
    fault: policy.Fault,
    cause: str,
    outcomes: list[policy.Outcome],
    nodes: dict[str, Node],
) -> list[IncidentEvent]:
    """The incident's timeline as the live control plane writes it: symptom, detection, out of routing, the spare,
    each moved request, the level's changes, back in routing, latency recovered, capacity restored, closed."""

    def event(at: float, kind: str, description: str, node: str | None = None, **extra) -> IncidentEvent:
        return IncidentEvent(
            incident=incident,
            at=_at(at),
            kind=kind,
            source=SOURCE,
            node=nodes.get(node) if node else None,
            description=description,
            **extra,
        )

    events = []
    for name in fault.nodes:
        events.append(event(fault.failed_at, EventKind.SYMPTOM, f"{name}: {cause}", name, details={"reason": cause}))
        events.append(event(fault.detected_at, EventKind.DETECTED, f"{name} is DOWN: {cause}", name))
        events.append(
            event(fault.detected_at, EventKind.REMOVED, f"{name} removed from the routing table of every gateway", name)
        )
    if fault.spare:
        events.append(
            event(
                fault.detected_at + policy.PROMOTE_S,
                EventKind.SPARE_PROMOTED,
                f"hot spare {fault.spare} promoted in place of {fault.nodes[0]}",
                fault.spare,
                details={"in_place_of": fault.nodes[0]},
            )
        )
    for i, o in enumerate(outcomes):
        if o.move is not None:
            request_id = _request_id(fault, i)
            data = {**o.move, "request_id": request_id}
            moved_at = min(o.at, fault.detected_at + o.move["stall_ms"] / 1000)
            events.append(
                event(
                    moved_at,
                    EventKind.REQUEST_MOVED,
                    streams.describe_move(data),
                    o.move["from"],
                    request_id=request_id,
                    details=data,
                )
            )
    for change in history.changes_in(fault.failed_at, fault.ended_at + history.inputs.hold_s + 60):
        events.append(
            event(
                change.at,
                EventKind.DEGRADATION,
                f"degradation level {change.old} → {change.new}: {capacity_policy.LEVEL_DOCS[change.new]} "
                f"({change.cause})",
                details={"old": change.old, "new": change.new},
            )
        )
    for name in fault.nodes:
        if name != fault.spare:
            events.append(event(fault.back_at, EventKind.BACK_IN_ROUTING, f"{name} is back in routing", name))
    events.append(
        event(
            fault.recovered_at,
            EventKind.RECOVERED,
            f"latency recovered {fault.recovered_at - fault.failed_at:.1f} s after the first symptom",
        )
    )
    events.append(
        event(
            fault.capacity_restored_at,
            EventKind.CAPACITY_RESTORED,
            f"capacity restored {fault.capacity_restored_at - fault.failed_at:.1f} s after the first symptom",
        )
    )
    events.append(event(fault.closed_at, EventKind.STATUS, "closed (generated history)", details={"new": "closed"}))
    return events


def _request_id(fault: policy.Fault, i: int) -> str:
    return f"sim-{fault.index}-{i}"


def _outcome_rows(
    incident: Incident, fault: policy.Fault, outcomes: list[policy.Outcome], model_key: str
) -> list[RequestOutcome]:
    """The failure's requests one by one, already counted in their minutes (rolled_up), the moved and the failed
    ones tied to its incident."""
    rows = []
    for i, o in enumerate(outcomes):
        e2e_ms = 0.0 if o.ttft_ms is None else o.ttft_ms + (o.tpot_ms or 0) * max(o.completion_tokens - 1, 0)
        node = o.move["to"] if o.move else (fault.serving_lost[0] if o.status == "error" else "")
        rows.append(
            RequestOutcome(
                request_id=_request_id(fault, i),
                gateway=SOURCE,
                tenant=o.tenant,
                tier=o.tier,
                model_key=model_key,
                node=node,
                nodes=[o.move["from"], o.move["to"]] if o.move else ([node] if node else []),
                status=o.status,
                finish_reason="length" if o.status == "ok" else "",
                prompt_tokens=o.prompt_tokens,
                completion_tokens=o.completion_tokens,
                ttft_ms=o.ttft_ms,
                tpot_ms=o.tpot_ms,
                e2e_ms=e2e_ms,
                started_at=_at(o.at - e2e_ms / 1000),
                finished_at=_at(o.at),
                migrations=[o.move] if o.move else [],
                incident=incident if o.move or o.status == "error" else None,
                http_status=o.http_status,
                degradation_level=o.level,
                tokens_lost=0,
                simulated=True,
                rolled_up=True,
            )
        )
    return rows


def _write_level_changes(changes: list[policy.LevelChange], model_key: str) -> int:
    cluster = Cluster.default()
    DegradationChange.objects.bulk_create(
        [
            DegradationChange(
                cluster=cluster,
                model_key=model_key,
                at=_at(c.at),
                old_level=c.old,
                new_level=c.new,
                ratio=c.ratio,
                capacity_rps=c.capacity_rps,
                required_rps=c.required_rps,
                cause=c.cause,
                simulated=True,
                reacted_at=_at(c.at),  # handled: recovery.reactions never acts on the past
            )
            for c in changes
        ]
    )
    return len(changes)
