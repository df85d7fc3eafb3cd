"""The gateway's copy of the routing table and of the valid API keys.

Read from Redis at start, again whenever the control plane announces a change
on the pub/sub channel, and every few seconds in case an announcement was
missed. Requests read the in-memory copy only.
"""

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from recovery.keys import Keys
from workers.aio import cancel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    name: str
    address: str
    model: str
    rack: str
    weight: float


@dataclass(frozen=True)
class Tenant:
    key_id: int
    tenant: str
    tier: str


class RoutingView:
    def __init__(self, redis_url: str, namespace: str, refresh_s: float = 5.0):
        self.redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
        self.keys = Keys(namespace)
        self.refresh_s = refresh_s
        self.routes: dict[str, Route] = {}
        self.tenants: dict[str, Tenant] = {}
        self.loaded = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.reload()
        self._task = asyncio.create_task(self._follow(), name="routing-follow")

    async def close(self) -> None:
        await cancel(self._task)
        await self.redis.aclose()

    async def reload(self) -> None:
        try:
            raw_routes, raw_keys = await asyncio.gather(
                self.redis.hgetall(self.keys.routing), self.redis.hgetall(self.keys.gateway_keys)
            )
        except (RedisError, OSError) as exc:
            log.warning("cannot read the routing table, keeping the last copy: %s", exc)
            return
        routes = {}
        for name, raw in raw_routes.items():
            entry = json.loads(raw)
            routes[name] = Route(name, entry["address"], entry["model"], entry.get("rack", ""), float(entry.get("weight", 1.0)))
        self.routes = routes
        self.tenants = {digest: Tenant(info["id"], info["tenant"], info["tier"]) for digest, info in ((d, json.loads(v)) for d, v in raw_keys.items())}
        self.loaded.set()

    async def _follow(self) -> None:
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(self.keys.routing_changed)
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=self.refresh_s)
                    await self.reload()  # on a change, and every refresh_s when nothing came
                    if message is None:
                        continue
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.warning("routing updates interrupted (%s); retrying", exc)
                await asyncio.sleep(1)
            finally:
                try:
                    await pubsub.aclose()
                except (RedisError, OSError):
                    pass

    def tenant_for(self, key: str) -> Tenant | None:
        return self.tenants.get(hashlib.sha256(key.encode()).hexdigest())

    def models(self) -> set[str]:
        return {route.model for route in self.routes.values()}

    def candidates(self, model: str) -> list[Route]:
        return [r for r in self.routes.values() if r.model == model and r.weight > 0]
