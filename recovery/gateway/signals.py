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

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from recovery.keys import Keys

log = logging.getLogger(__name__)

MAX_SIGNALS = 100_000
MAX_OUTCOMES = 500_000
STREAM_RECORD_S = 3600  # a stream's record outlives any request; removed when it ends
STREAM_OVER_S = 600  # how long "it ended" is remembered for a late resume


class Signals:
    def __init__(self, redis_url: str, namespace: str, gateway: str):
        self.redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
        self.keys = Keys(namespace)
        self.gateway = gateway
        self._tasks: set[asyncio.Task] = set()

    def emit(self, kind: str, /, **data) -> None:
        data.setdefault("at", time.time())
        self._send(self.keys.signals, {"kind": kind, "gateway": self.gateway, "data": json.dumps(data)}, MAX_SIGNALS)

    def outcome(self, **data) -> None:
        self._send(self.keys.outcomes, {"gateway": self.gateway, "data": json.dumps(data)}, MAX_OUTCOMES)

    def _send(self, stream: str, fields: dict, maxlen: int) -> None:
        task = asyncio.get_running_loop().create_task(self._xadd(stream, fields, maxlen))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _xadd(self, stream: str, fields: dict, maxlen: int) -> None:
        try:
            await self.redis.xadd(stream, fields, maxlen=maxlen, approximate=True)
        except (RedisError, OSError) as exc:
            log.warning("lost a %s entry (%s): %s", stream.rsplit(":", 1)[-1], exc, fields.get("kind"))

    # --- streams another gateway may take over (Last-Event-ID) ---------------------------------------------------
    def stream_record(self, request_id: str, record: dict) -> None:
        """Where the request's stream runs now (written when its node changes), so that any gateway can take it over
        if this one dies."""
        self._call(self.redis.set(self.keys.stream(request_id), json.dumps(record), ex=STREAM_RECORD_S))

    def stream_over(self, request_id: str, how: str) -> None:
        """The request ended (`how`): a resume of it is answered 404, saying so."""
        pipe = self.redis.pipeline()
        pipe.delete(self.keys.stream(request_id))
        pipe.set(self.keys.stream_over(request_id), json.dumps({"how": how, "at": time.time()}), ex=STREAM_OVER_S)
        self._call(pipe.execute())

    async def stream_lookup(self, request_id: str) -> tuple[dict | None, dict | None]:
        """The request's stream record, or how it ended; (None, None) for a request no gateway knows."""
        record, over = await self.redis.mget(self.keys.stream(request_id), self.keys.stream_over(request_id))
        return (json.loads(record) if record else None), (json.loads(over) if over else None)

    def _call(self, awaitable) -> None:
        async def run():
            try:
                await awaitable
            except (RedisError, OSError) as exc:
                log.warning("could not record a stream for resumption: %s", exc)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def publish_inflight(self, flights: dict[str, dict]) -> None:
        """This gateway's in-flight requests, for the checkpoint page and drain plans (expires unless refreshed)."""
        key = self.keys.gateway_inflight(self.gateway)
        pipe = self.redis.pipeline()
        pipe.delete(key)
        if flights:
            pipe.hset(key, mapping={rid: json.dumps(f) for rid, f in flights.items()})
        pipe.expire(key, 5)
        pipe.zadd(self.keys.gateways, {self.gateway: time.time()})
        try:
            await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("could not publish in-flight requests: %s", exc)

    async def flush(self) -> None:
        """Wait until everything emitted so far is written (or given up)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        await self.flush()
        await self.redis.aclose()
