"""One client request, from dispatch to its last token, through any number of node failures.

The gateway always streams from the node, with the token ids of each chunk,
and forwards every chunk to the client as it comes; so it knows exactly which
tokens the client has. When the node's stream breaks (or stalls, or a planned
migration ends it), the request continues on the node the coordinator chose,
resumed from exactly that token: the client sees a comment line saying from
where to where, then the next token. Non-streaming clients get the assembled
answer at the end, after the same recovery.
"""

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from recovery.gateway.coordinator import Coordinator, Flight
from recovery.policy.dispatch import Decision
from recovery.protocol import NodeError, RequestFailed, RequestMoved, RequestResumed, Route
from workers.openai_schema import CompletionRequest

log = logging.getLogger(__name__)

TOKEN_IDS = re.compile(rb'"token_ids":\[([0-9,]*)\]')
FINISH = re.compile(rb'"finish_reason":"([a-z_]+)"')
BROKEN = (
    aiohttp.ClientPayloadError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientConnectionError,
    ConnectionResetError,
)
RETRY_AFTER_S = 2
LIVENESS_CHECK_S = 0.5  # while a node is given time for a line, whether it still answers at all is looked at this often
RECORD_WAIT_S = 0.5  # the longest a stream's first token waits for its record to be written (_until_recorded)
YIELD_EVERY = 32  # lines relayed (16 events) between two turns given to the gateway's other work (`_next_line`)


def data_line(raw: bytes) -> bytes:
    """A node's `data:` line as a whole event: the line and the blank line that ends it."""
    return raw + b"\n" if raw.endswith(b"\n") else raw + b"\n\n"


class NodeHung(TimeoutError):
    """A node took a request's connection and gave no answer while its status stream went silent: its process is
    hung (its sockets still accept; nothing reads them). Waiting for its headers would wait out the whole hang."""


class UpstreamBroken(Exception):
    """The node stopped giving this request tokens: it died, hung, or failed it.

    `lost` says whether the node itself is gone (its connection broke, or it
    went silent, status stream and all), or only this request is stuck on a
    node that still answers.
    """

    def __init__(self, message: str, lost: bool = True):
        super().__init__(message)
        self.lost = lost


@dataclass(frozen=True)
class Failure:
    """A node that answered this request with a server error: whose fault it was, the next node decides."""

    node: str
    status: int
    answer: str


class ClientGone(Exception):
    pass


@dataclass
class Pace:
    """How long a request's node is given for its next line (`Relay._next_line`)."""

    timeout: float  # seconds from `asked_at`
    asked_at: float = field(default_factory=time.monotonic)  # its last line, or when it was given more time
    waiting_since: float = field(default_factory=time.monotonic)  # its last token, or when the request was sent


@dataclass(frozen=True)
class Takeover:
    """A stream a client resumes with Last-Event-ID: its node holds the request (parked since the gateway that
    relayed it went away) and the client has its first `delivered` output tokens."""

    request_id: str
    delivered: int
    node: str
    holders: tuple[str, ...] = ()


def openai_error(
    status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None, code: str | None = None
) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status, headers=headers
    )


class Relay:
    def __init__(
        self,
        coordinator: Coordinator,
        request: web.Request,
        body: dict,
        req: CompletionRequest,
        flight: Flight,
        path: str,
        request_key: str,
        client_key: str = "",
        takeover: Takeover | None = None,
    ):
        self.co = coordinator
        self.request = request
        self.body = body  # validated by workers.openai_schema, as every node validates it
        self.flight = flight
        self.path = path
        self.request_key = request_key  # the content's fingerprint: the same request sent again has the same key
        self.client_key = client_key  # the same, of the body as the client sent it: a resume must send it again
        self.takeover = takeover
        self._event_prefix = f"id: {flight.request_id}.".encode()
        self.client_stream = req.stream
        self.client_usage = req.include_usage
        self.response: web.StreamResponse | None = None
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.chunks: list[dict] = []  # for a non-streaming client
        self.nodes: list[str] = []  # every node tried, in order, including those that never took it
        self.streamed_on = ""  # the node whose stream last delivered tokens: where a move starts from
        self._migrated = False
        self._done_sent = False
        self.recorded = False  # a record of this stream is in Redis, for a takeover (Last-Event-ID)
        self._failure: Failure | None = None  # the first node that answered it with a server error
        # What has arrived of the current upstream's stream past its last whole line (`_next_line`).
        self._pending = bytearray()
        self._pending_for: aiohttp.ClientResponse | None = None
        self._lines = 0  # lines read from nodes, for the turns given to the event loop
        self._answered_at = 0.0  # when the node it was last sent to answered (its headers): for a move's stall

    # --- the loop --------------------------------------------------------------------------
    async def run(self) -> web.StreamResponse:
        flight, co = self.flight, self.co
        exclude: set[str] = set()
        decision: Decision | None = None
        broke_at: float | None = None
        reason = ""
        for _ in range(64):  # a bound, far above any real chain of failures
            flight.upstream, flight.handing_over = None, False  # no node's stream is being read now
            if self.takeover is not None:
                takeover, self.takeover = self.takeover, None
                answer = await self._attach(takeover)
                if isinstance(answer, web.StreamResponse):
                    return answer
                # The node broke the taken-over stream, or handed it over: on as from any other (the ids are known).
                broke_at = time.monotonic()
                if answer is None:
                    self._migrated = False
                    decision, reason = await co.planned_move(flight), "planned migration"
                    continue
                node, reason, lost = answer
                decision, broke_at = await self._recover(node, reason, broke_at, exclude, lost=lost)
                if decision is None:
                    return await self._give_up(reason)
                continue
            route, decision = co.route_for(flight, decision, exclude)
            if route is None and decision is None and not self._sent_any:
                route = await co.wait_for_a_node(flight, exclude)  # the fleet may be starting: nodes are joining
            if route is None:
                return await self._give_up(co.why_no_node(flight))
            payload = self._payload(route, co.assign(flight, route), decision)
            self.nodes.append(route.name)
            try:
                upstream = await self._send(route, payload)
                self._answered_at = time.monotonic()
            except BROKEN + (TimeoutError, OSError) as exc:
                co.refused(flight, route.name)
                reason = f"{route.name} unreachable ({exc.__class__.__name__})"
                decision, broke_at = await self._recover(route.name, reason, broke_at, exclude, lost=True)
                if decision is None and self._sent_any:
                    return await self._give_up(reason)
                continue  # to the decision's target, or (nothing sent yet) a fresh pick
            async with upstream:
                if upstream.status != 200:
                    co.refused(flight, route.name)
                    refusal = await upstream.read()
                    if upstream.status >= 500 and upstream.status != 503:
                        # The node failed this request but answers: the node's fault, or the request's? A second
                        # node decides. If it fails there too, the request is poison: it stops here and counts
                        # against no node. If another node serves it, the first one's breaker counts it.
                        failure = Failure(route.name, upstream.status, refusal[:200].decode(errors="replace"))
                        if self._failure is not None:
                            return await self._request_failed(self._failure, failure)
                        self._failure = failure
                    if upstream.status >= 500 or upstream.status == 409 and decision is not None:
                        # A server error, a node still loading, a duplicate after a restart: another node, then.
                        reason = f"{route.name} answered {upstream.status}"
                        decision, broke_at = await self._recover(route.name, reason, broke_at, exclude, lost=False)
                        continue
                    if self._sent_any:  # a resumed request refused: end the client's stream plainly
                        return await self._give_up(f"{route.name} refused to continue it ({upstream.status})")
                    return web.Response(
                        status=upstream.status,
                        body=refusal,
                        content_type="application/json",
                        headers={"X-Lifeline-Node": route.name, "X-Request-Id": flight.request_id},
                    )
                self._served_by(route.name)
                flight.upstream = upstream
                try:
                    await self._pump(upstream, route, decision, broke_at, reason)
                except UpstreamBroken as exc:
                    broke_at = time.monotonic()
                    reason = f"{route.name}: {exc}"
                    decision, broke_at = await self._recover(route.name, reason, broke_at, exclude, lost=exc.lost)
                    if decision is None and self._sent_any:
                        return await self._give_up(reason)
                    continue
                if self._migrated:
                    self._migrated = False
                    broke_at, reason = time.monotonic(), "planned migration"
                    decision = await co.planned_move(flight)  # once the source has handed the KV over
                    continue
                return await self._finish()
        return await self._give_up("too many failures in a row")

    async def _attach(self, takeover: Takeover) -> web.StreamResponse | tuple[str, str, bool] | None:
        """Take over a stream from the node that holds it: the node sends the ids of the tokens the client has, then
        every chunk from there. The answer when it ended; 410 when the node does not hold it (any more): the client
        sends the request again. (node, reason, lost) when the node broke it under way, None when it handed it
        over (a planned migration): the caller goes on as from any other stream."""
        flight, co = self.flight, self.co
        route = co.view.routes.get(takeover.node)
        if route is None:
            return self._cannot_resume(f"its node {takeover.node} is not in routing")
        co.adopt(flight, route, takeover.holders)
        self.nodes.append(route.name)
        payload = self._payload(route, (), None)
        payload["lifeline"] = {"request_id": flight.request_id, "return_token_ids": True, "attach": takeover.delivered}
        try:
            upstream = await self._send(route, payload)
        except BROKEN + (TimeoutError, OSError) as exc:
            co.refused(flight, route.name)
            return self._cannot_resume(f"its node {route.name} cannot be reached ({exc.__class__.__name__})")
        async with upstream:
            if upstream.status != 200:
                co.refused(flight, route.name)
                answer = (await upstream.read())[:300].decode(errors="replace")
                return self._cannot_resume(f"{route.name} answered {upstream.status}: {answer}")
            flight.upstream = upstream
            try:
                await self._pump(upstream, route, None, None, "")
            except UpstreamBroken as exc:
                if not self._sent_any:
                    return self._cannot_resume(f"{route.name}: {exc}")
                return route.name, f"{route.name}: {exc}", exc.lost
        if self._migrated:
            return None
        return await self._finish()

    async def _send(self, route: Route, payload: dict) -> aiohttp.ClientResponse:
        """The node's answer to the request (its headers; the body streams after). A live node answers at once; one
        whose status stream falls silent meanwhile (frozen) or that this gateway has lost is given up on: NodeHung.
        Without this a hung target, chosen in the seconds before its silence showed, held the request for as long
        as its hang lasted (a loaded run at 7a604f4: 30 s, then served by the hung node)."""
        sending = asyncio.ensure_future(self.co.send(route, self.path, payload))
        try:
            while True:
                done, _ = await asyncio.wait({sending}, timeout=LIVENESS_CHECK_S)
                if done:
                    return sending.result()
                if self.co.frozen(route.name) or route.name in self.co.failed:
                    raise NodeHung(f"{route.name} took the request and gave no answer; its status stream is silent")
        finally:
            if not sending.done():
                sending.cancel()

    def _cannot_resume(self, reason: str) -> web.Response:
        self.finish_reason = "error"
        log.info("request %s cannot be resumed: %s", self.flight.request_id, reason)
        return openai_error(
            410,
            f"The stream of request {self.flight.request_id} cannot be resumed ({reason}): send the request again "
            "without Last-Event-ID.",
            "invalid_request_error",
            "Last-Event-ID",
            code="stream_not_resumable",
        )

    def _served_by(self, node: str) -> None:
        """`node` took the request another node had failed with a server error: that one was at fault."""
        failure, self._failure = self._failure, None
        if failure is not None and failure.node != node:
            self.co.report(
                NodeError(
                    node=failure.node,
                    status=failure.status,
                    answer=failure.answer,
                    request_id=self.flight.request_id,
                    request_key=self.request_key,
                    served_by=node,
                )
            )

    @property
    def _sent_any(self) -> bool:
        return bool(self.flight.generated)

    async def _recover(
        self, node: str, reason: str, broke_at: float | None, exclude: set[str], *, lost: bool
    ) -> tuple[Decision | None, float]:
        """Where the request goes on (the coordinator decides), with `node` left out of this request's tries."""
        exclude.add(node)
        return await self.co.recover(self.flight, node, reason, lost=lost), broke_at or time.monotonic()

    # --- talking to the node ------------------------------------------------------------------
    def _payload(self, route: Route, holders, decision: Decision | None) -> dict:
        flight, config = self.flight, self.co.config
        lifeline = {
            "request_id": flight.request_id,
            "return_token_ids": True,
            "holders": [h.peer() for h in holders],
            "checkpoint_prefill_chunks": config.placement_policy == "lifeline" and route.holds_checkpoints,
        }
        if decision is not None:
            lifeline["resume"] = {
                "generated_token_ids": list(flight.generated),
                "sources": self.co.resume_sources(decision),
            }
        payload = {k: v for k, v in self.body.items() if k != "lifeline"}
        payload["stream"] = True
        if not self.client_stream:
            payload["stream_options"] = {"include_usage": True}
        payload["lifeline"] = lifeline
        return payload

    async def _pump(
        self,
        upstream: aiohttp.ClientResponse,
        route: Route,
        decision: Decision | None,
        broke_at: float | None,
        reason: str,
    ) -> None:
        """Forward the node's chunks until it finishes, hands the request over, or breaks."""
        flight, stall, node = self.flight, self.co.config.stall_timeout_s, route.name
        resumed = decision is not None
        # the work in front of it, with margin
        pace = Pace(timeout=stall + self.co.first_token_s(route, flight.context_tokens))
        while True:
            try:
                raw = await self._next_line(upstream, node, pace)
            except BROKEN as exc:
                if self._handed_over():
                    return
                raise UpstreamBroken(f"stream broke ({exc.__class__.__name__})") from None
            if not raw:
                if self.finish_reason is not None or self._migrated or self._handed_over():
                    return
                raise UpstreamBroken("stream ended before the request finished")
            if not raw.startswith(b"data: "):
                continue  # the blank line that ends each event: written with the event's data line, in one write
            data = raw[6:].rstrip()
            raw = data_line(raw)
            if data == b"[DONE]":
                if self.client_stream:
                    await self._write(raw)
                    self._done_sent = True  # the client has the whole answer: a hang-up from here is not a loss
                if self.finish_reason is not None:
                    return  # nothing follows: not waiting for the node's end of stream, which a hang-up may beat
                continue
            if data.startswith(b'{"error"'):
                raise UpstreamBroken(f"node failed the request: {json.loads(data)['error'].get('message')}")
            chunk = (
                json.loads(data) if (b'"lifeline"' in data or not self.client_stream or b'"usage"' in data) else None
            )
            if chunk is not None and "migrated" in chunk.get("lifeline", {}):
                self._migrated = True  # a planned migration: the stream ends here, the request continues elsewhere
                continue
            if chunk is not None and "attached" in chunk.get("lifeline", {}):
                await self._attached(node, chunk["lifeline"]["attached"])
                continue
            ids = TOKEN_IDS.search(data)
            if ids and ids.group(1):
                now = time.monotonic()
                pace.timeout, pace.waiting_since = stall, now
                if resumed and decision is not None:  # a resume is always a decision's
                    await self._announce(node, decision, broke_at, now, chunk, reason)
                    resumed = False
                if self.streamed_on != node:
                    self.streamed_on = node
                    first_record = not self.recorded
                    recorded = self._record_stream()
                    self.co.streams_on(flight)
                    if first_record and recorded is not None:
                        await self._until_recorded(recorded)
                for token in ids.group(1).split(b","):
                    flight.generated.append(int(token))
                flight.first_token_at = flight.first_token_at or now
                flight.last_token_at = now
                self.co.consider_second_holder(flight)
            finish = FINISH.search(data)
            if finish:
                self.finish_reason = finish.group(1).decode()
            if chunk is not None and chunk.get("usage") and not chunk.get("choices"):
                self.usage = chunk["usage"]
                if not self.client_usage:
                    continue
            if self.client_stream:
                if ids and ids.group(1):
                    # Each token's event has an id: the tokens the client has with it, for a resume (Last-Event-ID).
                    raw = self._event_prefix + str(len(flight.generated)).encode() + b"\n" + raw
                await self._write(raw)
            elif chunk is not None:
                self.chunks.append(chunk)

    async def _next_line(self, upstream: aiohttp.ClientResponse, node: str, pace: "Pace") -> bytes:
        """The node's next line, given `pace.timeout` since the last one, and more while its engine works.

        Lines come from this relay's own buffer of what has arrived, so a line already here (the blank line after
        each event, several events in one packet) costs no wait at all. So that a node faster than the relay
        (a burst of buffered events) cannot hold the gateway's loop for a whole reply, every YIELD_EVERY lines
        the loop gets a turn: its other streams, probes and routing go on. Only when nothing is buffered does it wait
        for more bytes (`readany`, which takes nothing when cancelled, so a timeout loses no part of a line).
        Whether the node still answers at all (its status stream) is looked at every LIVENESS_CHECK_S meanwhile:
        a node that froze is found within seconds, not after the whole allowance of a long prefill, and a request
        whose node hangs before its first token goes on elsewhere. UpstreamBroken when the node is hung (lost) or
        its engine is stuck (not lost).
        """
        if self._pending_for is not upstream:
            self._pending_for, self._pending = upstream, bytearray()
        pending, content = self._pending, upstream.content
        while True:
            end = pending.find(b"\n")
            if end >= 0:
                line = bytes(pending[: end + 1])
                del pending[: end + 1]
                pace.asked_at = time.monotonic()
                self._lines += 1
                if self._lines % YIELD_EVERY == 0:
                    await asyncio.sleep(0)
                return line
            arrived = content.read_nowait(-1)
            if arrived:
                pending += arrived
                continue
            if content.at_eof():
                line = bytes(pending)  # the stream's end: what is left of a last line without its newline, or b""
                pending.clear()
                return line
            await self._await_bytes(content, node, pace)

    async def _await_bytes(self, content: aiohttp.StreamReader, node: str, pace: "Pace") -> None:
        """Wait until the node sends more (into the pending buffer) or its stream ends, within `pace`."""
        stall = self.co.config.stall_timeout_s
        while True:
            left = pace.asked_at + pace.timeout - time.monotonic()
            try:
                async with asyncio.timeout(max(0.0, min(left, LIVENESS_CHECK_S))):
                    self._pending += await content.readany()
                return
            except TimeoutError:
                pass
            now = time.monotonic()
            waited = now - pace.waiting_since
            within = now - pace.asked_at < pace.timeout
            if not self.co.answering(node) and (not within or self.co.frozen(node)):
                raise UpstreamBroken(f"no byte for {waited:.1f} s and its status stream is silent too (hung)")
            if within:
                continue
            if self.co.working(node, pace.timeout):
                # alive and working (a long prefill, a queue, a slow GPU): not a failure
                pace.timeout, pace.asked_at = stall, now
                continue
            raise UpstreamBroken(f"no byte for {waited:.1f} s while its engine made no progress", lost=False)

    async def _attached(self, node: str, attached: dict) -> None:
        """The node took a stream over for this gateway: the ids of the tokens the client has (the rest follows)."""
        flight = self.flight
        flight.generated[:] = [int(t) for t in attached.get("generated_token_ids") or ()]
        flight.first_token_at = flight.last_token_at = time.monotonic()
        self.streamed_on = node
        self._record_stream()
        self.co.report(
            RequestResumed(
                request_id=flight.request_id, tenant=flight.tenant, node=node, at_token=len(flight.generated)
            )
        )
        if self.client_stream:
            await self._write(f": lifeline resumed this stream on {node} at token {len(flight.generated)}\n\n".encode())

    def _record_stream(self) -> asyncio.Future | None:
        """Where the stream runs now, for a gateway that takes it over if this one dies (Last-Event-ID); the future of
        its write, None for a client that does not stream."""
        flight = self.flight
        if not self.client_stream:
            return None
        self.recorded = True
        return self.co.signals.stream_record(
            flight.request_id,
            {
                "tenant": flight.tenant,
                "model": flight.model,
                "request_key": self.client_key,
                "node": flight.node,
                "holders": list(flight.holders),
                "gateway": self.co.name,
            },
        )

    async def _until_recorded(self, recorded: asyncio.Future) -> None:
        """A client's first token waits for its stream's record: a client that has a token can always resume through
        another gateway. Before, a gateway killed while the record was still queued (Redis slow on a loaded host) left
        clients with tokens and a 404 for their resume. Not for longer than RECORD_WAIT_S: the stream is served even
        when Redis does not answer (it cannot be taken over then, and the log says so)."""
        try:
            await asyncio.wait_for(asyncio.shield(recorded), RECORD_WAIT_S)
        except TimeoutError:
            log.warning(
                "the stream record of %s was not written in %.1f s: served on, not resumable through another gateway "
                "until it is",
                self.flight.request_id,
                RECORD_WAIT_S,
            )

    def _handed_over(self) -> bool:
        """This gateway ended the node's stream to move the request (coordinator.migrate_node): a planned move."""
        if not self.flight.handing_over:
            return False
        self.flight.handing_over = False
        self._migrated = True
        return True

    async def _announce(
        self, node: str, decision: Decision, broke_at: float | None, now: float, chunk: dict | None, reason: str
    ) -> None:
        """The first token after a move: tell the client (a comment line) and the control plane."""
        flight = self.flight
        actual = ((chunk or {}).get("lifeline") or {}).get("resume", {})
        # From the node that last streamed its tokens, not the last one tried: nodes that refused it or could not
        # be reached in between are named apart, so the timeline never says it moved from a node it never ran on.
        earlier = self.nodes[:-1]  # `node` is the last one tried
        previous = self.streamed_on or (earlier[-1] if earlier else "?")
        since = len(earlier) - earlier[::-1].index(previous) if previous in earlier else len(earlier)
        stall_ms = round((now - (flight.last_token_at or broke_at or now)) * 1000, 1)
        # Where the stall went: the break noticed this long after the last token, the target answering this long after
        # that (the plan, the request, the target's restore or fetch: its own restore_ms), its first token after that.
        noticed = broke_at if broke_at is not None else now
        answered = min(max(self._answered_at, noticed), now)
        timing = {
            "noticed_ms": round(max(noticed - (flight.last_token_at or noticed), 0.0) * 1000, 1),
            "answered_ms": round((answered - noticed) * 1000, 1),
            "restore_ms": actual.get("restore_ms"),
            "first_token_ms": round((now - answered) * 1000, 1),
        }
        move = {
            "from": previous,
            "to": node,
            "tried": earlier[since:],  # between the two: refused it, or could not be reached
            "at_token": len(flight.generated),
            "kind": "planned" if reason == "planned migration" else "failure",
            "planned_method": decision.method,
            "method": actual.get("method"),
            "restored_tokens": actual.get("restored_tokens"),
            "reprefill_tokens": actual.get("reprefill_tokens"),
            "source": actual.get("source"),
            "resume_reason": actual.get("reason"),
            "stall_ms": stall_ms,
            "stall_breakdown_ms": timing,
            "reason": decision.reason,
            "cause": reason,
        }
        flight.migrations.append(move)
        rest = {k: v for k, v in move.items() if k not in ("from", "to")}
        self.co.report(RequestMoved(flight.request_id, previous, node, tenant=flight.tenant, **rest))
        if self.client_stream:
            await self._write(
                f": lifeline moved this stream from {previous} to {node} at token {move['at_token']} "
                f"({move['method'] or decision.method}; {decision.reason})\n\n".encode()
            )

    # --- the client side --------------------------------------------------------------------------
    async def _write(self, data: bytes) -> None:
        try:
            if self.response is None:
                self.response = web.StreamResponse(
                    headers={
                        "Content-Type": "text/event-stream",
                        "Cache-Control": "no-cache",
                        "X-Lifeline-Node": self.flight.node,
                        "X-Request-Id": self.flight.request_id,
                    }
                )
                await self.response.prepare(self.request)  # a client gone before its headers is gone all the same
            await self.response.write(data)
        except (ConnectionResetError, RuntimeError) as exc:
            if not self._done_sent:
                raise ClientGone(str(exc)) from None

    @property
    def stream(self) -> web.StreamResponse:
        """The client's stream, once something was written to it (_write prepares it)."""
        assert self.response is not None, "a stream is written to (_write) before it is ended"
        return self.response

    async def _finish(self) -> web.StreamResponse:
        if self.client_stream:
            if self.response is None:
                await self._write(b"")
            try:
                await self.stream.write_eof()
            except ConnectionResetError:
                pass  # the client had its last event ([DONE]) and hung up first: the answer is complete
            return self.stream
        return web.json_response(
            self._assemble(),
            headers={
                "X-Lifeline-Node": self.flight.node,
                "X-Request-Id": self.flight.request_id,
                "X-Lifeline-Migrations": str(len(self.flight.migrations)),
            },
        )

    def _assemble(self) -> dict:
        """A non-streaming answer from the chunks, however many nodes they came from."""
        first = next((c for c in self.chunks if c.get("choices")), {})
        chat = first.get("object", "").startswith("chat")
        text: list[str] = []
        logprobs: dict[str, Any] | None = None
        for chunk in self.chunks:
            for choice in chunk.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "" if chat else choice.get("text") or "")
                part = choice.get("logprobs")
                if part:
                    if logprobs is None:
                        logprobs = (
                            {"content": []}
                            if chat
                            else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                        )
                    for key in logprobs:
                        logprobs[key].extend(part.get(key) or [])
        if chat and logprobs is not None:
            logprobs["refusal"] = None  # OpenAI's schema requires both: the tokens of the content and of a refusal
        body = "".join(text)
        choice = {"index": 0, "logprobs": logprobs, "finish_reason": self.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": body, "refusal": None}
        else:
            choice["text"] = body
        answer = {
            "id": self.flight.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": first.get("created", int(time.time())),
            "model": self.flight.model,
            "choices": [choice],
            "usage": self.usage
            or {
                "prompt_tokens": self.flight.prompt_tokens,
                "completion_tokens": len(self.flight.generated),
                "total_tokens": self.flight.prompt_tokens + len(self.flight.generated),
            },
        }
        if self.flight.migrations:
            answer["lifeline"] = {"migrations": self.flight.migrations}
        return answer

    async def _request_failed(self, first: Failure, second: Failure) -> web.StreamResponse:
        """Two nodes failed this request with server errors: the request's doing, not theirs. It stops here."""
        self.finish_reason = "error"
        message = (
            f"{first.node} and {second.node} both failed this request "
            f"({first.status}, then {second.status}: {second.answer[:120]}). "
            f"A request that fails on two nodes is not tried on more and counts against no node; "
            f"if it should have worked, report it with request id {self.flight.request_id}."
        )
        log.warning(
            "request %s failed on %s and %s; not retried: %s",
            self.flight.request_id,
            first.node,
            second.node,
            second.answer[:200],
        )
        self.co.report(
            RequestFailed(
                request_id=self.flight.request_id,
                request_key=self.request_key,
                content_key=self.client_key,  # the client's content, before a seed is drawn: what a poison one repeats
                nodes=[first.node, second.node],
                statuses=[first.status, second.status],
                answer=second.answer,
            )
        )
        if self.response is None and not self._sent_any:
            return openai_error(500, message, "server_error", code="request_failed_on_two_nodes")
        error = {
            "error": {"message": message, "type": "server_error", "param": None, "code": "request_failed_on_two_nodes"}
        }
        if self.client_stream:
            await self._write(f"data: {json.dumps(error)}\n\n".encode())
            await self.stream.write_eof()
            return self.stream
        return web.json_response(error, status=500)

    async def fail_stream(self, reason: str) -> web.StreamResponse:
        """End a stream already under way with an error event (its status line went out long ago)."""
        self.finish_reason = "error"
        error = {
            "error": {
                "message": f"the request could not continue: {reason}",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
        try:
            await self.stream.write(f"data: {json.dumps(error)}\n\n".encode())
            await self.stream.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass
        return self.stream

    async def _give_up(self, reason: str) -> web.StreamResponse:
        """Nothing can continue the request: 503 before anything was sent, an error event after."""
        self.finish_reason = "error"
        log.warning("request %s (%s) gives up: %s", self.flight.request_id, self.flight.model, reason)
        if self.response is None and not self._sent_any:
            return openai_error(
                503,
                f"No node can take a request for `{self.flight.model}` right now ({reason}): "
                f"try again in {RETRY_AFTER_S} s.",
                "service_unavailable",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        error = {
            "error": {
                "message": f"the request could not continue: {reason}",
                "type": "node_failure",
                "param": None,
                "code": None,
            }
        }
        if self.client_stream:
            await self._write(f"data: {json.dumps(error)}\n\n".encode())
            await self.stream.write_eof()
            return self.stream
        return web.json_response(error, status=503, headers={"Retry-After": str(RETRY_AFTER_S)})
