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
