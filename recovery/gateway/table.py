"""The gateway's copy of the routing table, the valid API keys and the cluster's settings (their shapes:
recovery.protocol).

Read from Redis at start, again whenever the control plane announces a change
on the pub/sub channel, and every few seconds in case an announcement was
missed. Requests read the in-memory copy only.
"""

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from recovery.keys import Keys
from recovery.protocol import ClusterConfig, ProtocolError, Route, Tenant, loads
from workers.aio import cancel

log = logging.getLogger(__name__)


@dataclass
class RoutingView:
    redis_url: str
    namespace: str
    refresh_s: float = 5.0
    routes: dict[str, Route] = field(default_factory=dict)
    tenants: dict[str, Tenant] = field(default_factory=dict)
    config: ClusterConfig = field(default_factory=ClusterConfig)
    deployed: frozenset[str] = frozenset()  # models registered nodes serve, in routing or not
    listeners: list = field(default_factory=list)  # called after every reload

    def __post_init__(self):
        self.redis = aioredis.Redis.from_url(self.redis_url, decode_responses=True)
        self.keys = Keys(self.namespace)
        self.loaded = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.hot_state_missing = False
        self.whole_seen = False  # read the mark of a whole write once: from then on its absence means a loss

    async def start(self) -> None:
        await self.reload()
        self._task = asyncio.create_task(self._follow(), name="routing-follow")

    async def close(self) -> None:
        await cancel(self._task)
        await self.redis.aclose()

    async def reload(self) -> None:
        try:
            async with self.redis.pipeline(transaction=True) as pipe:  # one snapshot, never half a write
                pipe.hgetall(self.keys.routing)
                pipe.hgetall(self.keys.gateway_keys)
                pipe.get(self.keys.cluster_config)
                pipe.get(self.keys.deployed_models)
                pipe.get(self.keys.hot_state_written)
                raw_routes, raw_keys, raw_config, raw_models, written = await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("cannot read the routing table, keeping the last copy: %s", exc)
            return
        lost = raw_config is None and raw_models is None  # the control plane always writes both
        lost = lost or (self.whole_seen and written is None)  # the mark of a whole write, gone
        if lost and self.loaded.is_set():
            # Not an empty fleet: Redis lost the hot state, restarted empty, and what is there now (a node's
            # change published before the whole was rewritten) is part of it, without the keys, say. Route on
            # the last copy until the control plane writes all of it again (recovery.tasks.restore_hot_state).
            if not self.hot_state_missing:
                log.warning("the hot state is missing from Redis (restarted?): routing on the last copy")
            self.hot_state_missing = True
            return
        self.hot_state_missing = False
        self.whole_seen = self.whole_seen or written is not None
        routes = {}
        for name, raw in raw_routes.items():
            try:
                routes[name] = Route.from_wire(name, loads(raw, f"route {name}"))
            except ProtocolError as exc:
                log.warning("ignoring a route: %s", exc)
        self.routes = routes
        tenants = {}
        for digest, raw in raw_keys.items():
            try:
                tenants[digest] = Tenant.from_wire(loads(raw, "a key entry"))
            except ProtocolError as exc:
                log.warning("ignoring a key entry: %s", exc)
        self.tenants = tenants
        try:
            self.config = ClusterConfig.from_wire(loads(raw_config, "the cluster config"))
        except ProtocolError as exc:
            log.warning("ignoring a malformed cluster config: %s", exc)
        try:
            deployed = loads(raw_models, "the deployed models") or []
            self.deployed = frozenset(str(m) for m in deployed)
        except (ProtocolError, TypeError) as exc:
            log.warning("ignoring a malformed list of deployed models: %s", exc)
        self.loaded.set()
        for listener in list(self.listeners):
            listener()

    async def _follow(self) -> None:
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(self.keys.routing_changed)
                while True:
                    await pubsub.get_message(ignore_subscribe_messages=True, timeout=self.refresh_s)
                    await self.reload()  # on a change, and every refresh_s when nothing came
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
        """The models some node in routing serves now."""
        return {route.model for route in self.routes.values()}

    def served_models(self) -> set[str]:
        """The models this cluster serves: in routing now, or on a registered node that is coming back."""
        return self.models() | self.deployed

    def candidates(self, model: str) -> list[Route]:
        return [r for r in self.routes.values() if r.model == model and r.weight > 0]
