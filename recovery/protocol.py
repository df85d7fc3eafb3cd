"""The protocol between the control plane and its gateways, in one place: what the control plane writes to Redis for
every gateway (the routing table, the API keys, the cluster's settings) and what a gateway tells the control plane
(signals), each a versioned dataclass written and read through the same class.

The control plane builds these from the database (recovery.actions.routing, Cluster.gateway_config) and writes
`to_wire()`; a gateway reads them back with `from_wire` (recovery.gateway.table); a gateway emits a signal as a
dataclass (recovery.gateway.signals.Signals.emit) and the control plane reads it with `read_signal`
(recovery.actions.streams). Nothing else builds or parses these shapes.

Versions: each entry carries `v`. A reader takes its own version and older ones (a field added later has a
default), and refuses a newer major version with ProtocolError rather than guess at it; fields it does not know
are ignored, so a newer writer may add optional ones within a version. No Django here: the gateway imports it.
"""

import json
import time
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from workers import catalog
from workers.checkpoint import Peer

VERSION = 1


class ProtocolError(ValueError):
    """An entry this side cannot read: what is wrong with it, and which entry."""


class UnknownSignal(ProtocolError):
    """A signal of a kind the control plane does not know: a newer gateway, or a kind added without its handler."""


def _version(entry: dict, what: str) -> None:
    v = entry.get("v", 1)
    if not isinstance(v, int) or v > VERSION:
        raise ProtocolError(f"{what} is protocol version {v!r}; this side reads up to {VERSION}: upgrade it")


def _read(cls, entry: dict, what: str, **extra) -> Any:
    """`cls` from a wire dict: its fields by their wire names, a missing field without a default an error."""
    if not isinstance(entry, dict):
        raise ProtocolError(f"{what} is {type(entry).__name__}, not an object")
    _version(entry, what)
    values = dict(extra)
    for f in fields(cls):
        if f.name in values:
            continue
        wire = f.metadata.get("wire", f.name)
        if wire in entry:
            values[f.name] = entry[wire]
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ProtocolError(f"{what} has no {wire!r}")
    return cls(**values)


def _write(obj, *, skip: tuple[str, ...] = ()) -> dict:
    entry: dict[str, Any] = {"v": VERSION}
    for f in fields(obj):
        if f.name not in skip:
            value = getattr(obj, f.name)
            entry[f.metadata.get("wire", f.name)] = sorted(value) if isinstance(value, frozenset) else value
    return entry


# --- what the control plane writes ----------------------------------------------------------------------------------
ALL_CAPABILITIES = frozenset(("checkpoint", "resume", "migrate"))


@dataclass(frozen=True)
class Route:
    """A node that may take traffic now, in the routing table every gateway reads."""

    name: str
    address: str
    model: str
    rack: str = ""
    weight: float = 1.0
    gpu: str = "H100-SXM"
    tp: int = 1
    session: str = ""
    # What the node offers beyond serving (workers.engine_api.CAPABILITIES): a node without
    # "checkpoint" neither streams KV pages nor holds them; one without "resume" continues no request.
    capabilities: frozenset[str] = ALL_CAPABILITIES
    # Its place in the fabric beyond its rack, as the node registered it (workers.catalog.Placement).
    server: str = ""
    nvl_domain: str = ""
    network: str = "infiniband"
    provider: str = ""  # who runs its machine, and where: a restricted key's requests stay on the ones it trusts
    region: str = ""

    def to_wire(self) -> dict:
        return _write(self, skip=("name",))

    @classmethod
    def from_wire(cls, name: str, entry: dict) -> "Route":
        """The route named `name`; ProtocolError for one that is malformed or that the catalog cannot time."""
        what = f"route {name}"
        try:
            route = _read(cls, entry, what, name=name)
            route = cls(
                name,
                str(route.address),
                str(route.model),
                str(route.rack),
                float(route.weight),
                str(route.gpu),
                int(route.tp),
                str(route.session),
                frozenset(route.capabilities),
                str(route.server),
                str(route.nvl_domain),
                str(route.network),
                str(route.provider),
                str(route.region),
            )
            route.deployment  # noqa: B018 - a route the catalog cannot time is refused here, not on a request's path
        except (TypeError, ValueError, catalog.CatalogError) as exc:
            raise ProtocolError(f"{what}: {exc}") from None
        return route

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


@dataclass(frozen=True)
class Tenant:
    """A valid API key, by its digest in the keys' table: whose it is, its tier, and the nodes it trusts."""

    key_id: int
    tenant: str
    tier: str
    trust: Trust | None = None  # None: any node

    def to_wire(self) -> dict:
        entry = {"v": VERSION, "id": self.key_id, "tenant": self.tenant, "tier": self.tier}
        if self.trust is not None:
            entry |= {"providers": sorted(self.trust.providers), "regions": sorted(self.trust.regions)}
        return entry

    @classmethod
    def from_wire(cls, entry: dict) -> "Tenant":
        if not isinstance(entry, dict):
            raise ProtocolError(f"a key entry is {type(entry).__name__}, not an object")
        _version(entry, "a key entry")
        try:
            providers, regions = frozenset(entry.get("providers") or ()), frozenset(entry.get("regions") or ())
            trust = Trust(providers, regions) if providers or regions else None
            return cls(int(entry["id"]), str(entry["tenant"]), str(entry["tier"]), trust)
        except KeyError as exc:
            raise ProtocolError(f"a key entry has no {exc.args[0]!r}") from None


@dataclass(frozen=True)
class ModelLevel:
    """A model's degradation level and what it means at a gateway (recovery.policy.capacity.EFFECTS)."""

    level: int = 0
    shed_tiers: tuple[str, ...] = ()  # tiers answered 429 at this level
    accept_new: bool = True  # False at level 4: new requests get 503, those in flight finish


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
    models: dict[str, ModelLevel] = field(default_factory=dict)  # a model not listed is at level 0
    starting_until: float | None = None  # the control plane's start-up grace ends (epoch s): nodes are joining

    def to_wire(self) -> dict:
        entry = _write(self)
        entry["models"] = {
            model: {"level": m.level, "shed_tiers": list(m.shed_tiers), "accept_new": m.accept_new}
            for model, m in self.models.items()
        }
        return entry

    @classmethod
    def from_wire(cls, entry: dict | None) -> "ClusterConfig":
        """The settings written; the defaults when none are (a control plane that has not written them yet)."""
        if entry is None:
            return cls()
        config = _read(cls, entry, "the cluster config")
        try:
            models = {
                str(model): ModelLevel(
                    int(v.get("level", 0)), tuple(v.get("shed_tiers") or ()), bool(v.get("accept_new", True))
                )
                for model, v in (config.models or {}).items()
            }
        except (AttributeError, TypeError, ValueError) as exc:
            raise ProtocolError(f"the cluster config's models: {exc}") from None
        return cls(**{**{f.name: getattr(config, f.name) for f in fields(cls)}, "models": models})

    def level_of(self, model: str) -> ModelLevel:
        """The degradation `model`'s requests meet: its own level, never another model's."""
        return self.models.get(model, ModelLevel())


def loads(raw: str | None, what: str) -> Any:
    """JSON from Redis, or ProtocolError saying which entry was not JSON."""
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ProtocolError(f"{what} is not JSON: {exc}") from None


# --- what a gateway tells the control plane -------------------------------------------------------------------------
@dataclass(frozen=True)
class Signal:
    """A gateway's report, written to the signals stream as {kind, gateway, data}; `at` is when it happened (epoch
    s). Each kind is a subclass naming its KIND."""

    KIND: ClassVar[str] = ""

    def to_wire(self) -> dict:
        return _write(self)


@dataclass(frozen=True)
class Symptom(Signal):
    """A node failed under this gateway's requests (a broken stream, a refused connection, a stall)."""

    KIND: ClassVar[str] = "symptom"
    node: str
    reason: str
    at: float = field(default_factory=time.time)
    in_flight: int = 0


@dataclass(frozen=True)
class RequestMoved(Signal):
    """A request continued on another node: where from and to, how it resumed, and its stall."""

    KIND: ClassVar[str] = "request_moved"
    request_id: str
    from_node: str = field(metadata={"wire": "from"})
    to_node: str = field(metadata={"wire": "to"})
    at: float = field(default_factory=time.time)
    tenant: str = ""
    tried: list[str] = field(default_factory=list)  # nodes between the two that refused it or could not be reached
    at_token: int = 0
    kind: str = "failure"  # or "planned"
    planned_method: str = ""
    method: str | None = None  # as the node resumed it (workers.engine_api.ResumeInfo.method)
    restored_tokens: int | None = None
    reprefill_tokens: int | None = None
    source: str | None = None
    resume_reason: str | None = None
    stall_ms: float | None = None
    stall_breakdown_ms: dict = field(default_factory=dict)
    reason: str = ""  # the dispatch plan's
    cause: str = ""  # why it moved


@dataclass(frozen=True)
class RequestResumed(Signal):
    """A client's stream taken over by this gateway (Last-Event-ID after the one it had went away): a node kept the
    request running and goes on writing it here from the client's last token."""

    KIND: ClassVar[str] = "request_resumed"
    request_id: str
    node: str
    at_token: int
    at: float = field(default_factory=time.time)
    tenant: str = ""


@dataclass(frozen=True)
class HolderReplaced(Signal):
    """A request's checkpoint re-placed after its holder was lost; `error` where it could not be."""

    KIND: ClassVar[str] = "holder_replaced"
    request_id: str
    node: str  # the node serving the request, told about its new holders
    lost: str
    holders: list[str]
    at: float = field(default_factory=time.time)
    blocks_resent: int = 0
    error: str = ""


@dataclass(frozen=True)
class NodeError(Signal):
    """A node answered a server error to a request another node then served: that node was at fault."""

    KIND: ClassVar[str] = "node_error"
    node: str
    status: int
    answer: str
    request_id: str
    at: float = field(default_factory=time.time)
    request_key: str | None = None
    served_by: str = ""


@dataclass(frozen=True)
class MigrationCommandDone(Signal):
    """This gateway's part of a planned migration off a node: how many of its requests moved, and how."""

    KIND: ClassVar[str] = "migration_command_done"
    command: str
    node: str
    gateway: str
    at: float = field(default_factory=time.time)
    requests: int = 0
    transfer: int = 0
    reprefill: int = 0
    failed: int = 0


@dataclass(frozen=True)
class RequestFailed(Signal):
    """A request that failed on two nodes: its own fault, counted against neither; `content_key` is the client's
    content before a seed was drawn, what a poison request repeats."""

    KIND: ClassVar[str] = "request_failed"
    request_id: str
    nodes: list[str]
    statuses: list[int]
    answer: str
    at: float = field(default_factory=time.time)
    request_key: str | None = None
    content_key: str | None = None


SIGNALS: dict[str, type[Signal]] = {
    cls.KIND: cls
    for cls in (Symptom, RequestMoved, RequestResumed, HolderReplaced, NodeError, MigrationCommandDone, RequestFailed)
}


def read_signal(kind: str, data: dict) -> Signal:
    """A signal from the stream; UnknownSignal for a kind with no class here, ProtocolError for a malformed one."""
    cls = SIGNALS.get(kind)
    if cls is None:
        raise UnknownSignal(f"a signal of kind {kind!r}, which this control plane does not know: {sorted(SIGNALS)} are")
    return _read(cls, data, f"a {kind} signal")
