"""The gateway's copy of the routing table, the valid API keys and the cluster's settings.

Read from Redis at start, again whenever the control plane announces a change
on the pub/sub channel, and every few seconds in case an announcement was
missed. Requests read the in-memory copy only.
"""

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from recovery.keys import Keys
from workers import catalog
from workers.aio import cancel
from workers.checkpoint import Peer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    name: str
    address: str
    model: str
    rack: str
    weight: float
    gpu: str = "H100-SXM"
    tp: int = 1
    session: str = ""
    # What the node offers beyond serving (workers.engine_api.CAPABILITIES): a node without
    # "checkpoint" neither streams KV pages nor holds them; one without "resume" continues no request.
    capabilities: frozenset[str] = frozenset(("checkpoint", "resume", "migrate"))
    # Its place in the fabric beyond its rack, as the node registered it (workers.catalog.Placement).
    server: str = ""
    nvl_domain: str = ""
    network: str = "infiniband"
    provider: str = ""  # who runs its machine, and where: a restricted key's requests stay on the ones it trusts
    region: str = ""

    @property
    def placement(self) -> catalog.Placement:
        return catalog.Placement(self.rack, self.server, self.nvl_domain, self.network)

    @property
    def holds_checkpoints(self) -> bool:
        return "checkpoint" in self.capabilities

    @property
    def resumes(self) -> bool:
        return "resume" in self.capabilities

    @property
    def migrates(self) -> bool:
        return "migrate" in self.capabilities

    @property
    def deployment(self) -> catalog.Deployment:
        return _deployment(self.model, self.gpu, self.tp)

    def peer(self) -> dict:
        """The node as a workers.checkpoint.Peer: what another node needs to reach it and time the link."""
        return Peer(self.name, self.address, self.rack, self.server, self.nvl_domain, self.network).to_json()


_deployments: dict[tuple[str, str, int], catalog.Deployment] = {}


def _deployment(model: str, gpu: str, tp: int) -> catalog.Deployment:
    key = (model, gpu, tp)
    if key not in _deployments:
        _deployments[key] = catalog.Deployment.of(model, gpu, tp)
    return _deployments[key]


@dataclass(frozen=True)
class Trust:
    """The providers and regions a restricted API key trusts (document 004): its requests run, and keep their
    checkpoints, only on a node of one of the providers or in one of the regions."""

    providers: frozenset[str] = frozenset()
    regions: frozenset[str] = frozenset()

    def trusts(self, route: Route) -> bool:
        return route.provider in self.providers or route.region in self.regions

    def __str__(self) -> str:
        parts = [f"provider {', '.join(sorted(self.providers))}"] if self.providers else []
        parts += [f"region {', '.join(sorted(self.regions))}"] if self.regions else []
        return " or ".join(parts)

    @classmethod
    def of(cls, entry: dict) -> "Trust | None":
        providers, regions = frozenset(entry.get("providers") or ()), frozenset(entry.get("regions") or ())
        return cls(providers, regions) if providers or regions else None


@dataclass(frozen=True)
class Tenant:
    key_id: int
    tenant: str
    tier: str
    trust: Trust | None = None  # None: any node


@dataclass(frozen=True)
class ClusterConfig:
    """How this cluster recovers; set in the console, published by the control plane."""

    placement_policy: str = "lifeline"
    tau_tokens: int = 512  # a checkpointed prefix above this is worth restoring on a busy holder
    theta_factor: float = 2.0  # a holder is overloaded above this many times the mean recovery load
    alpha: float = 1.0  # weight of checkpoint pages held in the recovery load
    beta: float = 1.0  # weight of queue depth in the recovery load
    stall_timeout_s: float = 5.0  # no byte from a node for this long: it is treated as failed
    dispatch_accounting: bool = True  # count a request on its node at dispatch (document 002)
    # Degradation (document 003), set by the control plane's capacity evaluation for each model on its own.
    degradation_level: int = 0  # the fleet's: the worst model's, for status pages
    models: dict[str, "ModelLevel"] = field(default_factory=dict)  # a model not listed is at level 0
    starting_until: float | None = None  # the control plane's start-up grace ends (epoch s): nodes are joining

    @classmethod
    def parse(cls, raw: str | None) -> "ClusterConfig":
        if not raw:
            return cls()
        data = json.loads(raw)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        known["models"] = {
            model: ModelLevel(int(v.get("level", 0)), tuple(v.get("shed_tiers") or ()), bool(v.get("accept_new", True)))
            for model, v in (known.get("models") or {}).items()
        }
        return cls(**known)

    def level_of(self, model: str) -> "ModelLevel":
        """The degradation `model`'s requests meet: its own level, never another model's."""
        return self.models.get(model, ModelLevel())


@dataclass(frozen=True)
class ModelLevel:
    level: int = 0
    shed_tiers: tuple[str, ...] = ()  # tiers answered 429 at this level
    accept_new: bool = True  # False at level 4: new requests get 503, those in flight finish


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
            entry = json.loads(raw)
            try:
                routes[name] = Route(
                    name,
                    entry["address"],
                    entry["model"],
                    entry.get("rack", ""),
                    float(entry.get("weight", 1.0)),
                    entry.get("gpu", "H100-SXM"),
                    int(entry.get("tp", 1)),
                    entry.get("session", ""),
                    frozenset(entry["capabilities"]) if "capabilities" in entry else Route.capabilities,
                    entry.get("server", ""),
                    entry.get("nvl_domain", ""),
                    entry.get("network", "infiniband"),
                    entry.get("provider", ""),
                    entry.get("region", ""),
                )
                routes[name].deployment  # noqa: B018 - refuse a route the catalog cannot time
            except (KeyError, ValueError, catalog.CatalogError) as exc:
                log.warning("ignoring route %s: %s", name, exc)
                routes.pop(name, None)
        self.routes = routes
        self.tenants = {
            d: Tenant(i["id"], i["tenant"], i["tier"], Trust.of(i))
            for d, i in ((d, json.loads(v)) for d, v in raw_keys.items())
        }
        try:
            self.config = ClusterConfig.parse(raw_config)
        except (ValueError, TypeError) as exc:
            log.warning("ignoring a malformed cluster config: %s", exc)
        try:
            self.deployed = frozenset(json.loads(raw_models)) if raw_models else frozenset()
        except (ValueError, TypeError) as exc:
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
