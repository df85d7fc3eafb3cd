"""The node protocol: messages between a node agent and the control plane.

Both sides parse with these classes, so a malformed message is refused with
the same clear error wherever it arrives. Plain dataclasses and the standard
library only: the control plane imports this module, the node never imports
the control plane.
"""

import re
from dataclasses import asdict, dataclass, field

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
    "utilization_pct", "memory_used_bytes", "memory_total_bytes", "temperature_c", "power_w",
    "sm_clock_mhz", "throttle_reasons", "ecc_uncorrected_volatile",
)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class ProtocolError(ValueError):
    """A message that does not follow the protocol; `field` names what is wrong."""

    def __init__(self, field_: str, message: str):
        super().__init__(f"{field_}: {message}")
        self.field = field_
        self.message = message


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
        raise ProtocolError(field_, f"{value!r} is not a valid name: letters, digits, '.', '_' or '-', at most 63, starting with a letter or digit")
    return value


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
            version=int(data.get("version") or PROTOCOL_VERSION),
        )

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Load:
    """The load figures a heartbeat carries (a subset of the node's full status)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    step_ms: float = 0.0
    tokens_per_s: float = 0.0
    # The last decode-only step as the GPU ran it, with its shape: what slowdown is measured on.
    decode_step_ms: float = 0.0
    decode_step_batch: int = 0
    decode_step_context_tokens: int = 0

    @classmethod
    def parse(cls, data) -> "Load":
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ProtocolError("load", "must be an object")
        values = {}
        for key in ("running", "waiting", "kv_blocks_used", "kv_blocks_total", "decode_step_batch", "decode_step_context_tokens"):
            if key in data:
                value = _require(data, key, int, "load.")
                if value < 0:
                    raise ProtocolError(f"load.{key}", "must be 0 or more")
                values[key] = value
        for key in ("step_ms", "tokens_per_s", "decode_step_ms"):
            if key in data:
                values[key] = float(_require(data, key, (int, float), "load."))
        return cls(**values)


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
            raise ProtocolError("model_state", f"{model_state!r} is not known: expected one of {', '.join(MODEL_STATES)}")
        checkpoints = data.get("checkpoints") or {}
        if not isinstance(checkpoints, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("requests"), int) for v in checkpoints.values()
        ):
            raise ProtocolError("checkpoints", "must map serving node names to {bytes, requests}")
        return cls(
            session=_require(data, "session", str), model_state=model_state, load=Load.parse(data.get("load")), checkpoints=checkpoints,
            xids=_parse_xids(data.get("xids")), gpus=_parse_gpu_readings(data.get("gpus")),
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
