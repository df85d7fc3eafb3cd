"""The node protocol: messages between a node agent and the control plane.

Both sides parse with these classes, so a malformed message is refused with
the same clear error wherever it arrives. Plain dataclasses and the standard
library only: the control plane imports this module, the node never imports
the control plane.
"""

import functools
import re
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Self

from workers.catalog import NETWORKS

PROTOCOL_VERSION = 1

# Paths on the control plane.
REGISTER_PATH = "/api/nodes/register"
HEARTBEAT_PATH = "/api/nodes/{name}/heartbeat"
DEREGISTER_PATH = "/api/nodes/{name}/deregister"

# Paths on the node agent.
STATUS_PATH = "/agent/status"
EVENTS_PATH = "/agent/events"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"

MODEL_STATES = ("loading_draft", "draft_ready", "loading_full", "serving")

# What a heartbeat carries from GPU telemetry: the node's Xid events of the last
# XID_WINDOW_S seconds (at most MAX_HEARTBEAT_XIDS, the most recent), resent in every
# heartbeat while they are recent, so the control plane de-duplicates them by time;
# and one compact reading per GPU with these figures, None where the GPU cannot report one.
XID_WINDOW_S = 120.0
MAX_HEARTBEAT_XIDS = 100
HEARTBEAT_GPU_FIGURES = (
    "utilization_pct",
    "memory_used_bytes",
    "memory_total_bytes",
    "temperature_c",
    "power_w",
    "sm_clock_mhz",
    "sm_clock_max_mhz",
    "throttle_reasons",
    "ecc_uncorrected_volatile",
    "nvlink_links",
    "nvlink_links_down",  # the control plane opens an incident for links down with no Xid (recovery.actions.conditions)
)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class ProtocolError(ValueError):
    """A message that does not follow the protocol; `field` names what is wrong."""

    def __init__(self, field_: str, message: str):
        super().__init__(f"{field_}: {message}")
        self.field = field_
        self.message = message


def refuse_nul(value, where: str = "") -> None:
    """Refuse a NUL character anywhere in a parsed JSON message, naming its field: no name, session or figure of the
    protocol has one, and PostgreSQL's text cannot hold one. Walked without recursion: JSON nests deeper than the
    stack."""
    pending = [(value, where)]
    while pending:
        item, at = pending.pop()
        if isinstance(item, str):
            if "\x00" in item:
                raise ProtocolError(at or "body", "must not contain a NUL character (\\u0000)")
        elif isinstance(item, dict):
            for key, inner in item.items():
                path = f"{at}.{key}" if at else str(key)
                if "\x00" in str(key):
                    raise ProtocolError(path, "must not contain a NUL character (\\u0000)")
                pending.append((inner, path))
        elif isinstance(item, list):
            pending.extend((inner, f"{at}[{i}]") for i, inner in enumerate(item))


def _require(data: dict, key: str, kind, prefix: str = ""):
    name = f"{prefix}{key}"
    if key not in data or data[key] is None:
        raise ProtocolError(name, "is required")
    value = data[key]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ProtocolError(name, f"must be {expected}, got {type(value).__name__}")
    return value


def _name(value: str, field_: str) -> str:
    if not _NAME.match(value):
        raise ProtocolError(
            field_,
            f"{value!r} is not a valid name: "
            "letters, digits, '.', '_' or '-', at most 63, starting with a letter or digit",
        )
    return value


def _optional_name(data: dict, key: str) -> str:
    """A name the message may leave out (or send empty): "" then."""
    value = data.get(key) or ""
    if not isinstance(value, str):
        raise ProtocolError(key, f"must be a string, got {type(value).__name__}")
    return _name(value, key) if value else ""


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_bytes: int

    @classmethod
    def parse(cls, data, prefix: str) -> "GpuInfo":
        if not isinstance(data, dict):
            raise ProtocolError(prefix.rstrip("."), "must be an object")
        index = _require(data, "index", int, prefix)
        if index < 0:
            raise ProtocolError(f"{prefix}index", "must be 0 or more")
        uuid = _require(data, "uuid", str, prefix)
        name = _require(data, "name", str, prefix)
        memory = _require(data, "memory_bytes", int, prefix)
        if memory <= 0:
            raise ProtocolError(f"{prefix}memory_bytes", "must be positive")
        return cls(index, uuid, name, memory)


@dataclass(frozen=True)
class Registration:
    """A node introducing itself: sent at start and whenever the control plane forgets it."""

    name: str
    session: str  # new at every process start; lifecycle is monotone within one session
    address: str  # base URL of the node agent, e.g. http://10.0.0.7:8201
    rack: str
    model: str  # catalog key, e.g. Qwen3-32B
    gpu: str  # catalog key, e.g. H100-SXM
    tp: int
    gpus: tuple[GpuInfo, ...]
    pid: int
    host: str
    engine: str = "emulated"
    capabilities: tuple[str, ...] = ()
    # A hot spare holds the model and answers canaries, but takes no traffic until promoted.
    spare: bool = False
    # Its place in the fabric beyond its rack (workers.catalog.Placement). `host` is the OS's name
    # for the machine; `server` the machine whose PCIe bus the GPUs share, set by the operator, since
    # emulated nodes on one machine stand for many. A node from before these fields sends none of them:
    # it is alone on its server, on InfiniBand, as every node was then taken to be.
    server: str = ""
    nvl_domain: str = ""
    network: str = "infiniband"
    # Who runs the machine and where (document 004's trusted providers); blank: not said.
    provider: str = ""
    region: str = ""
    version: int = PROTOCOL_VERSION

    @classmethod
    def parse(cls, data) -> "Registration":
        if not isinstance(data, dict):
            raise ProtocolError("body", "must be a JSON object")
        name = _name(_require(data, "name", str), "name")
        session = _require(data, "session", str)
        if not 8 <= len(session) <= 64:
            raise ProtocolError("session", "must be 8 to 64 characters")
        address = _require(data, "address", str)
        if not re.match(r"^https?://[^/\s]+$", address):
            raise ProtocolError("address", f"{address!r} is not a base URL such as http://10.0.0.7:8201")
        rack = _name(_require(data, "rack", str), "rack")
        tp = _require(data, "tp", int)
        if tp not in (1, 2, 4, 8):
            raise ProtocolError("tp", f"{tp} is not a tensor-parallel degree: expected 1, 2, 4 or 8")
        raw_gpus = _require(data, "gpus", list)
        gpus = tuple(GpuInfo.parse(g, f"gpus[{i}].") for i, g in enumerate(raw_gpus))
        if len({g.index for g in gpus}) != len(gpus):
            raise ProtocolError("gpus", "two GPUs share an index")
        pid = _require(data, "pid", int)
        capabilities = data.get("capabilities") or []
        if not isinstance(capabilities, list) or not all(isinstance(c, str) for c in capabilities):
            raise ProtocolError("capabilities", "must be a list of strings")
        spare = data.get("spare")
        if spare is not None and not isinstance(spare, bool):
            raise ProtocolError("spare", f"must be bool, got {type(spare).__name__}")
        server, nvl_domain, provider, region = (
            _optional_name(data, key) for key in ("server", "nvl_domain", "provider", "region")
        )
        network = data.get("network") or "infiniband"
        if network not in NETWORKS:
            raise ProtocolError("network", f"{network!r} is not a network: expected one of {', '.join(NETWORKS)}")
        version = data.get("version") or PROTOCOL_VERSION
        if isinstance(version, bool) or not isinstance(version, int):
            raise ProtocolError("version", f"must be the protocol's version, an int, got {_type_name(version)}")
        return cls(
            name=name,
            session=session,
            address=address,
            rack=rack,
            model=_require(data, "model", str),
            gpu=_require(data, "gpu", str),
            tp=tp,
            gpus=gpus,
            pid=pid,
            host=_require(data, "host", str),
            engine=data.get("engine") or "emulated",
            capabilities=tuple(capabilities),
            spare=bool(spare),
            server=server,
            nvl_domain=nvl_domain,
            network=network,
            provider=provider,
            region=region,
            version=version,
        )

    def to_json(self) -> dict:
        return asdict(self)


# The figures of a node's status that a heartbeat must carry as numbers: the control plane
# keeps them in its hot state (recovery.hot) and shows them. `tokens_per_s` is the heartbeat's own.
HEARTBEAT_LOAD_FIELDS = (
    "running",
    "waiting",
    "kv_blocks_used",
    "kv_blocks_total",
    "step_ms",
    "tokens_per_s",
    "decode_step_ms",
    "decode_step_batch",
    "decode_step_context_tokens",
)


@dataclass(frozen=True)
class AssistStatus:
    """A serving node verifying the tokens a restarting node's draft model proposes."""

    draft: str  # the draft node's name
    k: int  # tokens drafted per step
    agreement: float  # modelled: the draft's per-token agreement with the target (the catalog's, for the pair)
    acceptance: float | None = None  # measured: accepted over tested drafts so far; None before any was tested

    @classmethod
    def parse(cls, data, prefix: str) -> "AssistStatus":
        if not isinstance(data, dict):
            raise ProtocolError(prefix.rstrip("."), f"must be an object or null, got {_type_name(data)}")
        acceptance = data.get("acceptance")
        # "alpha": the name a node before 2026-11 reported its agreement under, for a fleet upgraded node by node.
        legacy = {"agreement": data["alpha"]} if "agreement" not in data and "alpha" in data else {}
        return cls(
            draft=_require(data, "draft", str, prefix),
            k=_require(data, "k", int, prefix),
            agreement=_figure(
                _require({**data, **legacy}, "agreement", (int, float), prefix), float, f"{prefix}agreement"
            ),
            acceptance=None if acceptance is None else _figure(acceptance, float, f"{prefix}acceptance"),
        )


@dataclass
class NodeStatus:
    """A node's load status, the one schema for every engine.

    `/agent/status` sends it, `/agent/events` pushes it at every load-changing event
    (with `reason`, and `request_id` where one request changed it), a heartbeat
    carries it (`Load`), and the gateway routes on it. A figure the engine cannot
    report is None, shown as n/a and never as a healthy-looking zero. The defaults
    describe a serving node with nothing to do, which is what the gateway assumes of
    a node it has not heard from yet.

    Treat it as a value (change a copy, with dataclasses.replace). It is not frozen
    only because an engine builds one at every event and the gateway one for every
    event it reads, and a frozen dataclass takes about four times as long to build.
    """

    seq: int = 0  # counts the node's status events
    at: float = 0.0  # epoch seconds at the node when the status was taken
    model_state: str = "serving"  # one of MODEL_STATES
    load_progress: float | None = 1.0  # share of the model loaded, 0 to 1
    waiting: int | None = 0
    running: int | None = 0
    uncomputed_prefill_tokens: int | None = 0  # prefill load: prompt tokens not yet computed
    decode_batch: int | None = 0
    decode_context_tokens: int | None = 0  # decode load: the tokens the decode batch attends to
    kv_blocks_used: int | None = 0
    kv_blocks_total: int | None = 0
    checkpoint_bytes_held: int | None = 0  # other nodes' KV pages this node holds in host memory
    checkpoint_budget_bytes: int | None = 0
    checkpoint_requests: int | None = 0
    step_ms: float | None = 0.0  # the last engine step
    steps: int | None = 0  # engine steps so far: a node whose count moves is working, however slowly
    time_scale: float | None = 0.0  # the emulated engine's; a real engine runs in real time and does not say
    # The last decode-only step as the GPU ran it, with its shape: what slowdown is measured on.
    decode_step_ms: float | None = 0.0
    decode_step_batch: int | None = 0
    decode_step_context_tokens: int | None = 0
    batch_limit: int | None = 0  # sequences admitted into the running batch at most
    batch_factor: float | None = 1.0  # the share of the engine's max_num_seqs that batch_limit is
    assist: AssistStatus | None = None  # set while this node verifies a draft node's tokens
    in_flight: int | None = 0  # requests this node accepted and has not finished
    # Where the figures come from: "engine" (its own scheduler) or "engine_metrics" (a real
    # engine's Prometheus metrics, read by an adapter).
    source: str = "engine"

    def to_json(self) -> dict:
        data = dict(self.__dict__)  # the fields in order; cheaper than asdict, and a status goes out at every event
        if self.assist is not None:
            data["assist"] = asdict(self.assist)
        return data

    @classmethod
    def parse(cls, data, prefix: str = "") -> Self:
        """A status as a node sent it, checked field by field; ProtocolError names the first bad one.

        Unknown keys are ignored, so a newer node may send more. A figure left out is
        n/a, as one sent as null; seq, at, model_state and source, which cannot be n/a,
        take their defaults when left out.
        """
        if not isinstance(data, dict):
            raise ProtocolError(prefix.rstrip(".") or "status", f"must be an object, got {_type_name(data)}")
        values: dict[str, Any] = {}  # keyword arguments of the constructor, of each field's own type
        for name, kind, nullable, _ in _shape(cls):
            value = data.get(name)
            where = f"{prefix}{name}"
            if value is None:
                if nullable:
                    values[name] = None
                elif name in data:
                    raise ProtocolError(where, "must not be null: only a figure may be n/a")
            elif kind is AssistStatus:
                values[name] = AssistStatus.parse(value, f"{where}.")
            elif kind is str:
                if not isinstance(value, str):
                    raise ProtocolError(where, f"must be str, got {_type_name(value)}")
                values[name] = value
            else:
                values[name] = _figure(value, kind, where)
        if values.get("model_state", cls.model_state) not in MODEL_STATES:
            expected = ", ".join(MODEL_STATES)
            raise ProtocolError(
                f"{prefix}model_state", f"{values['model_state']!r} is not known: expected one of {expected}"
            )
        return cls(**values)

    @classmethod
    def from_event(cls, data: dict) -> "RoutingStatus":
        """The gateway's reading of a status event, for routing arithmetic: lenient where `parse` is strict.

        Unknown keys are ignored, and a figure missing or None (n/a) reads as its
        default: 0 for every count and time, so what a node cannot report adds no
        load, as the gateway has always read it (1.0 for load_progress and
        batch_factor, "serving" for model_state). Numbers may come as any JSON number
        (or a numeric string); anything else raises ProtocolError naming the field.
        `assist`, a description and not a figure, is not read.
        """
        values: dict[str, Any] = {}  # keyword arguments of the constructor, of each field's own type
        for name, kind, _, default in _shape(cls):
            raw = data.get(name)
            if raw is None or kind is AssistStatus:
                continue
            if kind is str:
                values[name] = str(raw) if raw else default
                continue
            try:
                values[name] = kind(raw)
            except (TypeError, ValueError):
                raise ProtocolError(name, f"must be a number, got {raw!r}") from None
        return typing.cast(RoutingStatus, cls(**values))


if typing.TYPE_CHECKING:

    class RoutingStatus(NodeStatus):
        """A NodeStatus as `from_event` reads it: every figure a number, none n/a.

        The gateway's routing arithmetic (recovery.policy.load) reads these figures.
        Only the type checker sees this class: at run time the name is NodeStatus
        itself, so a status read from an event costs nothing more to build or read,
        and equals one built directly.
        """

        load_progress: float
        waiting: int
        running: int
        uncomputed_prefill_tokens: int
        decode_batch: int
        decode_context_tokens: int
        kv_blocks_used: int
        kv_blocks_total: int
        checkpoint_bytes_held: int
        checkpoint_budget_bytes: int
        checkpoint_requests: int
        step_ms: float
        steps: int
        time_scale: float
        decode_step_ms: float
        decode_step_batch: int
        decode_step_context_tokens: int
        batch_limit: int
        batch_factor: float
        in_flight: int

else:
    RoutingStatus = NodeStatus


@dataclass
class Load(NodeStatus):
    """What a heartbeat carries: the node's status, and the tokens it generated per second since the last beat.

    The HEARTBEAT_LOAD_FIELDS are numbers, never null: the control plane keeps them
    in Redis, which stores no null, and control planes before this schema refuse
    one; so a node sends 0 for a figure its engine cannot report (`of`).
    """

    tokens_per_s: float = 0.0

    @classmethod
    def of(cls, status: NodeStatus, tokens_per_s: float) -> "Load":
        return cls(**{**vars(status), **_heartbeat_zeros(status)}, tokens_per_s=tokens_per_s)

    @classmethod
    def parse(cls, data, prefix: str = "load.") -> "Load":
        """A heartbeat's load; a heartbeat figure left out is 0, as older nodes send only some of them."""
        if data is None:
            return cls()
        if isinstance(data, dict):
            for name in HEARTBEAT_LOAD_FIELDS:
                if name in data and data[name] is None:
                    raise ProtocolError(f"{prefix}{name}", "is required")
        load = super().parse(data, prefix)
        zeros = _heartbeat_zeros(load)
        return replace(load, **zeros) if zeros else load


def _heartbeat_zeros(status: NodeStatus) -> dict:
    """0 (or 0.0) for each heartbeat figure the status has as n/a."""
    shape = _shape(NodeStatus)
    return {
        name: kind(0) for name, kind, _, _ in shape if name in HEARTBEAT_LOAD_FIELDS and getattr(status, name) is None
    }


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _figure(value, kind: type, where: str):
    """A count (int) or a measure (float, an int accepted): never a bool, never negative."""
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ProtocolError(where, f"must be {kind.__name__}, got {_type_name(value)}")
    if value < 0:
        raise ProtocolError(where, "must be 0 or more")
    return kind(value)


def _read_shape(cls: type) -> tuple[tuple[str, type, bool, object], ...]:
    """(name, type, may be None, default) of each field of a status class, read from its annotations."""
    shape = []
    for f in fields(cls):
        kinds = [k for k in typing.get_args(f.type) if k is not type(None)] or [f.type]
        shape.append((f.name, kinds[0], type(None) in typing.get_args(f.type), f.default))
    return tuple(shape)


# Read once per class. Declared as a plain callable because mypy does not take a class held in
# a variable (`cls`) for the Hashable that functools.cache asks of its arguments (python/mypy#11470).
_shape: Callable[[type], tuple[tuple[str, type, bool, object], ...]] = functools.cache(_read_shape)


@dataclass(frozen=True)
class Heartbeat:
    session: str
    model_state: str = "serving"
    load: Load = field(default_factory=Load)
    # Other nodes' checkpoints this node holds, by serving node: {"node-03": {"bytes": n, "requests": k}}.
    checkpoints: dict = field(default_factory=dict)
    # Recent Xid events, oldest first: [{"at": epoch seconds, "gpu": index or -1 if unknown, "code": n}].
    xids: list = field(default_factory=list)
    # One compact reading per GPU: {"index", "lost", and HEARTBEAT_GPU_FIGURES (None for n/a)}.
    gpus: list = field(default_factory=list)

    @classmethod
    def parse(cls, data) -> "Heartbeat":
        if not isinstance(data, dict):
            raise ProtocolError("body", "must be a JSON object")
        model_state = data.get("model_state") or "serving"
        if model_state not in MODEL_STATES:
            raise ProtocolError(
                "model_state", f"{model_state!r} is not known: expected one of {', '.join(MODEL_STATES)}"
            )
        checkpoints = data.get("checkpoints") or {}
        if not isinstance(checkpoints, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("requests"), int)
            for v in checkpoints.values()
        ):
            raise ProtocolError("checkpoints", "must map serving node names to {bytes, requests}")
        return cls(
            session=_require(data, "session", str),
            model_state=model_state,
            load=Load.parse(data.get("load")),
            checkpoints=checkpoints,
            xids=_parse_xids(data.get("xids")),
            gpus=_parse_gpu_readings(data.get("gpus")),
        )

    def to_json(self) -> dict:
        return asdict(self)


def _list(value, field_: str) -> list:
    """A list field older nodes leave out: absent or null is empty."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ProtocolError(field_, f"must be a list, got {type(value).__name__}")
    return value


def _parse_xids(value) -> list[dict]:
    raw = _list(value, "xids")
    if len(raw) > MAX_HEARTBEAT_XIDS:
        raise ProtocolError("xids", f"{len(raw)} events: a heartbeat carries at most {MAX_HEARTBEAT_XIDS}")
    xids = []
    for i, item in enumerate(raw):
        prefix = f"xids[{i}]."
        if not isinstance(item, dict):
            raise ProtocolError(f"xids[{i}]", "must be an object")
        at = _require(item, "at", (int, float), prefix)
        if isinstance(at, bool):
            raise ProtocolError(f"{prefix}at", "must be int or float, got bool")
        gpu = _require(item, "gpu", int, prefix)
        if gpu < -1:
            raise ProtocolError(f"{prefix}gpu", "must be a GPU index, or -1 when the GPU is unknown")
        xids.append({"at": float(at), "gpu": gpu, "code": _require(item, "code", int, prefix)})
    return xids


def _parse_gpu_readings(value) -> list[dict]:
    readings = []
    for i, item in enumerate(_list(value, "gpus")):
        prefix = f"gpus[{i}]."
        if not isinstance(item, dict):
            raise ProtocolError(f"gpus[{i}]", "must be an object")
        index = _require(item, "index", int, prefix)
        if index < 0:
            raise ProtocolError(f"{prefix}index", "must be 0 or more")
        lost = item.get("lost", False)
        if not isinstance(lost, bool):
            raise ProtocolError(f"{prefix}lost", f"must be bool, got {type(lost).__name__}")
        reading = {"index": index}
        for key in HEARTBEAT_GPU_FIGURES:
            figure = item.get(key)
            if figure is not None and (isinstance(figure, bool) or not isinstance(figure, (int, float))):
                raise ProtocolError(f"{prefix}{key}", f"must be a number or null, got {type(figure).__name__}")
            reading[key] = figure
        reading["lost"] = lost
        readings.append(reading)
    if len({r["index"] for r in readings}) != len(readings):
        raise ProtocolError("gpus", "two readings share a GPU index")
    return readings


# --- checkpoint batches: a serving node to a holder (POST /agent/kv/batch) ---------------------------------------
@dataclass(frozen=True)
class Commit:
    """A commit record: the holder's checkpoint of `request_id` is complete up to `tokens`, once it has page `seq`."""

    request_id: str
    seq: int
    tokens: int


@dataclass(frozen=True)
class KvBatch:
    """Pages, commit records and drops, in order. The pages stay raw: each is parsed on its own
    (workers.kvstore.page_from_wire), so one malformed page is refused alone; the rest of the batch is checked whole
    before anything of it is acted on, so a malformed batch changes nothing."""

    model: str
    source: str
    direct: bool
    pages: list
    commits: tuple[Commit, ...]
    drops: tuple[str, ...]

    @classmethod
    def parse(cls, data) -> "KvBatch":
        if not isinstance(data, dict):
            raise ProtocolError("body", "must be a JSON object")
        model = data.get("model")
        if not isinstance(model, str):
            raise ProtocolError("model", "must be the model's catalog key, e.g. Qwen3-32B")
        source = data.get("source")
        if source is not None and not isinstance(source, str):
            raise ProtocolError("source", "must be the serving node's name")
        direct = data.get("direct")
        if direct is not None and not isinstance(direct, bool):
            raise ProtocolError("direct", f"must be bool, got {_type_name(direct)}")
        commits = []
        for i, item in enumerate(_list(data.get("commits"), "commits")):
            if not isinstance(item, dict):
                raise ProtocolError(f"commits[{i}]", "must be an object with request_id, seq and tokens")
            request_id = _require(item, "request_id", str, f"commits[{i}].")
            seq, tokens = (_whole(item, key, f"commits[{i}].") for key in ("seq", "tokens"))
            commits.append(Commit(request_id, seq, tokens))
        drops = _list(data.get("drops"), "drops")
        for i, request_id in enumerate(drops):
            if not isinstance(request_id, str):
                raise ProtocolError(f"drops[{i}]", "must be a request id, a string")
        return cls(model, source or "?", bool(direct), _list(data.get("pages"), "pages"), tuple(commits), tuple(drops))


def _whole(data: dict, key: str, prefix: str) -> int:
    value = _require(data, key, int, prefix)
    if isinstance(value, bool) or not 0 <= value < 2**63:
        raise ProtocolError(f"{prefix}{key}", f"must be a whole number, 0 or more, not {value!r}")
    return value
