"""What the gateways report, read from their Redis streams by the Celery worker.

Signals (a failure symptom, a request moved, a checkpoint re-placed) become
incident timeline events as they happen; outcomes (one per finished request)
become RequestOutcome rows, the raw material of recovery times and SLA
reports. A consumer group makes each entry handled once, by one worker.
"""

import datetime as dt
import json
import logging
import os
import socket
import time

from django.db import transaction
from redis.exceptions import ResponseError

from recovery import hot, protocol
from recovery.actions import conditions, health, incidents, live_migration, slo
from recovery.choices import EventKind, IncidentStatus
from recovery.models import Incident, Node, RequestOutcome
from recovery.stores import away

log = logging.getLogger(__name__)

GROUP = "control-plane"
# An entry read this long ago and still not acknowledged: the worker that read it died (SIGKILL, OOM) or could not
# store it (the database went away mid-batch). The next call, by any worker, takes it over and handles it.
RECLAIM_IDLE_MS = 30_000


def _consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _ensure_groups(r, streams: list[str]) -> None:
    for stream in streams:
        try:
            r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


def read_since(at: float) -> bool:
    """Whether a Celery worker has read the gateways' streams since `at` (a time.time()): beat schedules, the broker
    delivers and a worker handles what the gateways report."""
    return float(hot.client().get(hot.keys().streams_read) or 0) >= at


def process(count: int = 2000) -> dict:
    """Handle what the gateways have reported since the last call."""
    r = hot.client()
    keys = hot.keys()
    _ensure_groups(r, [keys.signals, keys.outcomes])
    handled = {"signals": 0, "outcomes": 0}
    answer = _reclaim(r, [keys.signals, keys.outcomes], count)
    answer += r.xreadgroup(GROUP, _consumer(), {keys.signals: ">", keys.outcomes: ">"}, count=count) or []
    r.set(keys.streams_read, time.time())
    for stream, entries in answer:
        if stream == keys.signals:
            for entry_id, fields in entries:
                try:
                    handle_signal(fields["kind"], fields.get("gateway", "?"), json.loads(fields["data"]))
                except Exception as exc:  # noqa: BLE001 - one bad entry must not block the stream
                    if away(exc):
                        raise  # left pending: taken up again once the store is back
                    log.exception("could not handle signal %s", entry_id)
                r.xack(stream, GROUP, entry_id)
                handled["signals"] += 1
        else:
            handled["outcomes"] += _store_entries(r, stream, entries)
    for stream in {stream for stream, _ in answer}:
        _trim_processed(r, stream)
    return handled


def _reclaim(r, streams: list[str], count: int) -> list:
    """Entries another consumer (or this one, in a call that failed) read and never acknowledged, idle for
    RECLAIM_IDLE_MS: taken over (XAUTOCLAIM), in xreadgroup's shape. Without this they stayed pending for ever,
    and the outcomes among them never reached the SLA reports."""
    answer = []
    for stream in streams:
        _next, entries, *_ = r.xautoclaim(stream, GROUP, _consumer(), RECLAIM_IDLE_MS, start_id="0-0", count=count)
        entries = [(entry_id, fields) for entry_id, fields in entries if fields]  # Redis 6.2: nil for a deleted one
        if entries:
            log.warning("took over %d entries of %s left unacknowledged", len(entries), stream)
            answer.append((stream, entries))
    return answer


def _store_entries(r, stream: str, entries: list) -> int:
    """Store a batch of outcome entries and acknowledge them. A batch that fails for a reason other than a store
    being away is stored entry by entry, so that one malformed entry is logged and dropped, not the batch with it."""
    if not entries:
        return 0
    try:
        stored = store_outcomes([_outcome(fields) for _, fields in entries])
    except Exception as exc:  # noqa: BLE001 - find the bad entry below
        if away(exc):
            raise  # left pending: taken up again (by _reclaim) once the store is back
        stored = 0
        for entry_id, fields in entries:
            try:
                stored += store_outcomes([_outcome(fields)])
            except Exception as exc:  # noqa: BLE001 - a malformed outcome can never be stored: dropped, said so
                if away(exc):
                    raise
                log.exception("dropping outcome %s of %s: it cannot be stored", entry_id, stream)
            r.xack(stream, GROUP, entry_id)
        return stored
    r.xack(stream, GROUP, *[entry_id for entry_id, _ in entries])
    return stored


def _outcome(fields: dict) -> tuple[str, dict]:
    return fields.get("gateway", "?"), json.loads(fields["data"])


def _trim_processed(r, stream: str) -> None:
    """Drop the entries every consumer has acknowledged: the stream then holds only what is still to do, not the
    last MAX_OUTCOMES requests' outcomes (hundreds of MB of Redis at a few hundred requests a second)."""
    pending = r.xpending(stream, GROUP)
    if pending and pending.get("pending"):
        keep_from = pending["min"]  # delivered to a consumer that has not acknowledged it yet
    else:
        groups = {g["name"]: g for g in r.xinfo_groups(stream)}
        keep_from = groups[GROUP]["last-delivered-id"] if GROUP in groups else None
    if keep_from and keep_from != "0-0":
        r.xtrim(stream, minid=keep_from, approximate=False)


def handle_signal(kind: str, gateway: str, data: dict) -> None:
    """One gateway signal (recovery.protocol), into the incident it belongs to. UnknownSignal for a kind this control
    plane has no class for and ProtocolError for a malformed one: the stream's reader logs either as an error."""
    signal = protocol.read_signal(kind, data)
    HANDLERS[type(signal)](signal, f"gateway {gateway}", gateway)


def _symptom(signal: protocol.Symptom, source: str, gateway: str) -> None:
    incidents.confirm_failure(signal.node, signal.at, source, signal.reason or "lost")


def _request_moved(signal: protocol.RequestMoved, source: str, gateway: str) -> None:
    _on_lost_nodes_incident(signal.from_node, EventKind.REQUEST_MOVED, describe_move, signal, source)


def _request_resumed(signal: protocol.RequestResumed, source: str, gateway: str) -> None:
    """A client's stream taken over by this gateway: on the timeline of the lost gateway's incident that had the
    request in flight, if one does (a client may also reconnect while its first gateway lives: nothing to record)."""
    condition = conditions.lost_gateway_of(signal.request_id)
    if condition is None:
        log.info("%s took over %s on %s at token %d", source, signal.request_id, signal.node, signal.at_token)
        return
    with transaction.atomic():
        incidents.add_event(
            condition.incident,
            EventKind.REQUEST_RESUMED,
            f"Request {signal.request_id}'s stream taken over by gateway {gateway} from lost gateway "
            f"{condition.subject}: {signal.node} kept it running and goes on from token {signal.at_token}",
            at=signal.at,
            source=source,
            request_id=signal.request_id,
            details=signal.to_wire(),
        )


def _holder_replaced(signal: protocol.HolderReplaced, source: str, gateway: str) -> None:
    _on_lost_nodes_incident(signal.lost, EventKind.HOLDER_REPLACED, describe_replacement, signal, source)


def _on_lost_nodes_incident(name: str, kind: str, describe, signal, source: str) -> None:
    """A request's fate on the timeline of the open incident of the node it lost (none open: nothing to add)."""
    node = Node.objects.filter(name=name).first()
    incident = incidents.open_incident_for(node) if node else None
    if incident is None:
        return
    data = signal.to_wire()
    with transaction.atomic():
        incidents.add_event(
            incident,
            kind,
            describe(data),
            at=signal.at,
            source=source,
            node=node,
            request_id=signal.request_id,
            details=data,
        )


def _node_error(signal: protocol.NodeError, source: str, gateway: str) -> None:
    node = Node.objects.filter(name=signal.node).first()
    if node is not None:
        served = f"; {signal.served_by} served the same request" if signal.served_by else ""
        health.record_node_failure(
            node, f"{source}: {node.name} answered {signal.status} ({signal.answer[:120]}){served}", signal.request_key
        )


def _migration_command_done(signal: protocol.MigrationCommandDone, source: str, gateway: str) -> None:
    live_migration.record_gateway_result(gateway, signal.to_wire())


def _request_failed(signal: protocol.RequestFailed, source: str, gateway: str) -> None:
    # A request that failed on two nodes: the request's fault, counted against neither (recovery.gateway.relay);
    # several with one content key are a poison request (recovery.actions.conditions).
    conditions.request_failed(gateway, signal)
    log.warning(
        "%s: request %s failed on %s and was not retried: %s",
        source,
        signal.request_id,
        " and ".join(signal.nodes),
        signal.answer[:200],
    )


HANDLERS = {
    protocol.Symptom: _symptom,
    protocol.RequestMoved: _request_moved,
    protocol.RequestResumed: _request_resumed,
    protocol.HolderReplaced: _holder_replaced,
    protocol.NodeError: _node_error,
    protocol.MigrationCommandDone: _migration_command_done,
    protocol.RequestFailed: _request_failed,
}


# How a node resumed a moved request (workers.engine_api.ResumeInfo.method), as the dispatch plan names it.
RESUMED_AS = {"checkpoint-local": "restore", "checkpoint-fetched": "fetch", "re-prefill": "reprefill"}


def describe_move(data: dict) -> str:
    """One timeline line for a moved request that says what happened: the nodes it left and reached (and any that
    could not take it between), how the new node actually resumed it, and the plan's reason only where the plan
    is what happened; where it is not, what was planned and why it did not hold."""
    source, target = data.get("from"), data.get("to")
    line = f"{data.get('request_id')}: {source} → {target} at token {data.get('at_token')}"
    tried = [n for n in data.get("tried") or [] if n not in (source, target)]
    if tried:
        line += f" (after {', '.join(tried)} could not take it)"
    method, planned = data.get("method"), data.get("planned_method")
    restored, reprefilled = data.get("restored_tokens") or 0, data.get("reprefill_tokens") or 0
    caught_up = f", {reprefilled} re-prefilled" if reprefilled else ""
    if method == "checkpoint-local":
        what = "restored from checkpoint" + (f" ({restored} tokens{caught_up})" if restored else "")
    elif method == "checkpoint-fetched":
        what = f"KV fetched from {data.get('source') or 'a holder'}" + (
            f" ({restored} tokens{caught_up})" if restored else ""
        )
    elif method == "re-prefill":
        what = "re-prefilled" + (f" {reprefilled} tokens" if reprefilled else "")
    else:
        what = f"{planned or 'moved'} (the node did not say how it resumed)"
    if method in RESUMED_AS and planned and RESUMED_AS[method] != planned:
        plan = {
            "restore": f"restore it from {target}'s host memory",
            "fetch": "fetch its KV from a holder",
            "reprefill": "re-prefill it",
        }.get(planned, planned)
        why = f"the plan was to {plan}" + (f"; {data['resume_reason']}" if data.get("resume_reason") else "")
    else:
        why = data.get("reason") or "no reason given"
    return f"{line}, {what}, stalled {data.get('stall_ms')} ms{_stall_breakdown(data)} ({why})"


def _stall_breakdown(data: dict) -> str:
    """Where a move's stall went, as the gateway timed it (recovery.gateway.relay's stall_breakdown_ms)."""
    timing = data.get("stall_breakdown_ms")
    if not timing:
        return ""  # a signal from a gateway that did not time it
    # The node says its restore to the microsecond; a tenth of a millisecond is what a timeline needs.
    restore = f", its restore {round(timing['restore_ms'], 1):g} ms," if timing.get("restore_ms") else ""
    return (
        f": the break noticed {timing['noticed_ms']:g} ms after the last token, {data.get('to')} answered "
        f"{timing['answered_ms']:g} ms later{restore} and sent its first token {timing['first_token_ms']:g} ms after"
    )


def describe_replacement(data: dict) -> str:
    """One timeline line for a checkpoint whose holder was lost: where it went, or plainly that it went nowhere."""
    line = f"{data.get('request_id')} on {data.get('node')}: checkpoint held by {data.get('lost')}"
    holders = data.get("holders") or []
    if holders:
        resent = f", {data['blocks_resent']} blocks resent" if data.get("blocks_resent") else ""
        return f"{line} re-placed on {', '.join(holders)}{resent}"
    why = f"could not re-place it ({data['error']})" if data.get("error") else "no other node had room for it"
    return f"{line} lost; {why}: the request runs on without a checkpoint"


def store_outcomes(items: list[tuple[str, dict]]) -> int:
    """Store reported outcomes, counted into their minutes' SLO rollups in the same transaction."""
    rows = outcome_rows(items)
    slo.store_rolled_up(rows)
    return len(rows)


def outcome_rows(items: list[tuple[str, dict]]) -> list[RequestOutcome]:
    """(gateway, report) pairs → unsaved outcome rows, each tied to the incident it belongs to, if any."""
    rows = []
    for gateway, data in items:
        started = dt.datetime.fromtimestamp(data["started_at"], tz=dt.UTC)
        rows.append(
            RequestOutcome(
                request_id=data["request_id"],
                gateway=gateway,
                tenant=data.get("tenant", ""),
                tier=data.get("tier", "standard"),
                model_key=data.get("model", ""),
                node=data.get("node") or "",
                nodes=data.get("nodes") or [],
                status=data.get("status", "ok"),
                finish_reason=data.get("finish_reason") or "",
                prompt_tokens=data.get("prompt_tokens") or 0,
                completion_tokens=data.get("completion_tokens") or 0,
                ttft_ms=data.get("ttft_ms"),
                tpot_ms=data.get("tpot_ms"),
                e2e_ms=data.get("e2e_ms"),
                started_at=started,
                finished_at=started + dt.timedelta(milliseconds=data.get("e2e_ms") or 0),
                migrations=data.get("migrations") or [],
                http_status=data.get("http_status"),
                degradation_level=data.get("degradation_level"),
                tokens_lost=data.get("tokens_lost") or 0,
            )
        )
    if not rows:
        return rows
    # Requests that moved during an incident belong to it, and so do those that failed on one of its nodes while
    # it was active (the incident's failed requests, its severity).
    moved = {move.get("from") for row in rows for move in row.migrations}
    failed = any(row.status == "error" for row in rows)
    if moved or failed:
        open_by_node, active_by_node = {}, {}
        for incident in Incident.objects.exclude(status=IncidentStatus.CLOSED).prefetch_related("nodes"):
            for node in incident.nodes.all():
                open_by_node.setdefault(node.name, incident)
                if incident.status == IncidentStatus.ACTIVE:
                    active_by_node.setdefault(node.name, incident)
        for row in rows:
            for move in row.migrations:
                if move.get("from") in open_by_node:
                    row.incident = open_by_node[move["from"]]
                    break
            if row.incident is None and row.status == "error":
                touched = [name for name in [*row.nodes, row.node] if name in active_by_node]
                if touched:
                    row.incident = active_by_node[touched[0]]
    return rows
