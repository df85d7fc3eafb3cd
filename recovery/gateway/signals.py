"""What a gateway tells the control plane: Redis streams the Celery worker reads.

`signals`: failure symptoms, each interrupted request's fate, checkpoint
re-placements, planned-migration results, as they happen (the incident
timeline). `outcomes`: one entry per finished request (TTFT, TPOT, tokens,
migrations), for recovery detection and SLA reports. Writing never blocks
or fails a request: a lost entry is logged.
"""

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from recovery.keys import Keys
from recovery.protocol import Signal

log = logging.getLogger(__name__)

MAX_SIGNALS = 100_000
MAX_OUTCOMES = 500_000
STREAM_RECORD_S = 3600  # a stream's record outlives any request; removed when it ends
STREAM_OVER_S = 600  # how long "it ended" is remembered for a late resume


class Signals:
    """Everything a gateway writes as it serves goes through one queue, written by one task in one round trip per
    batch (a pipeline), in the order it was written: a stream's end can never land before its record, which would
    leave a finished stream resumable for an hour. (The gateway's CPU did not change measurably: benchmarks/README.md,
    "Where a request's added TTFT goes".)"""

    def __init__(self, redis_url: str, namespace: str, gateway: str):
        self.redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
        self.keys = Keys(namespace)
        self.gateway = gateway
        # (what it is, for a log line; the commands; a future resolved once they are written, or None)
        self._queue: list[tuple[str, Callable[[Pipeline], object], asyncio.Future | None]] = []
        self._writer: asyncio.Task | None = None

    def emit(self, signal: Signal) -> None:
        """Tell the control plane (recovery.protocol's signals, read back by recovery.actions.streams)."""
        fields: dict[Any, Any] = {"kind": signal.KIND, "gateway": self.gateway, "data": json.dumps(signal.to_wire())}
        self._write(
            f"a signals entry ({signal.KIND})",
            lambda pipe: pipe.xadd(self.keys.signals, fields, maxlen=MAX_SIGNALS, approximate=True),
        )

    def outcome(self, **data) -> None:
        fields: dict[Any, Any] = {"gateway": self.gateway, "data": json.dumps(data)}
        self._write(
            "an outcomes entry",
            lambda pipe: pipe.xadd(self.keys.outcomes, fields, maxlen=MAX_OUTCOMES, approximate=True),
        )

    # --- streams another gateway may take over (Last-Event-ID) ---------------------------------------------------
    def stream_record(self, request_id: str, record: dict) -> asyncio.Future:
        """Where the request's stream runs now (written when its node changes), so that any gateway can take it over
        if this one dies. Returns a future done once the batch holding it has been written (or given up)."""
        value = json.dumps(record)
        written = asyncio.get_running_loop().create_future()
        self._write(
            f"the stream record of {request_id}",
            lambda pipe: pipe.set(self.keys.stream(request_id), value, ex=STREAM_RECORD_S),
            written,
        )
        return written

    def stream_over(self, request_id: str, how: str) -> None:
        """The request ended (`how`): a resume of it is answered 404, saying so."""
        value = json.dumps({"how": how, "at": time.time()})

        def commands(pipe: Pipeline) -> None:
            pipe.delete(self.keys.stream(request_id))
            pipe.set(self.keys.stream_over(request_id), value, ex=STREAM_OVER_S)

        self._write(f"the end of stream {request_id}", commands)

    async def stream_lookup(self, request_id: str) -> tuple[dict | None, dict | None]:
        """The request's stream record, or how it ended; (None, None) for a request no gateway knows."""
        record, over = await self.redis.mget(self.keys.stream(request_id), self.keys.stream_over(request_id))
        return (json.loads(record) if record else None), (json.loads(over) if over else None)

    def _write(self, what: str, commands: Callable[[Pipeline], object], written: asyncio.Future | None = None) -> None:
        """Queue `commands` for the writer, starting it unless it runs: it takes what has queued meanwhile too."""
        self._queue.append((what, commands, written))
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        """Write the queue, a batch per round trip, in order, until it is empty. Writing never blocks or fails a
        request: a batch Redis did not take is logged, what it held named."""
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                pipe = self.redis.pipeline(transaction=False)
                for _, commands, _ in batch:
                    commands(pipe)
                try:
                    await pipe.execute()
                except (RedisError, OSError) as exc:
                    lost = ", ".join(what for what, _, _ in batch[:3]) + (
                        f" and {len(batch) - 3} more" if len(batch) > 3 else ""
                    )
                    log.warning("lost %d write(s) to the control plane (%s): %s", len(batch), exc, lost)
                finally:
                    for _, _, written in batch:
                        if written is not None and not written.done():
                            written.set_result(None)
        finally:
            self._writer = None

    async def publish_inflight(self, flights: dict[str, dict]) -> None:
        """This gateway's in-flight requests, for the checkpoint page and drain plans (expires unless refreshed)."""
        key = self.keys.gateway_inflight(self.gateway)
        pipe = self.redis.pipeline()
        pipe.delete(key)
        if flights:
            pipe.hset(key, mapping={rid: json.dumps(f) for rid, f in flights.items()})
        # Kept a minute, though read only while fresh (hot.gateway_flights): a gateway that dies leaves what it had
        # in flight for the control plane to name (recovery.actions.conditions.check_gateways).
        pipe.expire(key, 60)
        pipe.zadd(self.keys.gateways, {self.gateway: time.time()})
        try:
            await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("could not publish in-flight requests: %s", exc)

    async def flush(self) -> None:
        """Wait until everything emitted so far is written (or given up)."""
        while self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)

    async def leave(self) -> None:
        """This gateway stops cleanly: it is no longer one the control plane watches for (a lost gateway is one that
        stopped publishing without leaving)."""
        pipe = self.redis.pipeline()
        pipe.zrem(self.keys.gateways, self.gateway)
        pipe.delete(self.keys.gateway_inflight(self.gateway))
        try:
            await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("could not say this gateway leaves: %s", exc)

    async def close(self) -> None:
        await self.flush()
        await self.redis.aclose()
