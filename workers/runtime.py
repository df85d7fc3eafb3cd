"""Everything one node process holds, in one place for the HTTP handlers."""

import asyncio
import hashlib
import hmac
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from workers import protocol
from workers.catalog import Placement
from workers.checkpoint import CheckpointStreamer, Peer
from workers.engine_api import ServingEngine
from workers.faults import FaultState
from workers.kvstore import CheckpointStore
from workers.telemetry import EmulatedTelemetry, NvmlTelemetry


@dataclass
class Identity:
    name: str
    rack: str
    host: str
    session: str
    gpus: tuple[protocol.GpuInfo, ...]
    address: str = ""  # filled in once the server is bound
    spare: bool = False  # a hot spare: holds the model, takes no traffic until promoted
    # Its place in the fabric beyond its rack (workers.catalog.Placement); `host` above is the
    # OS's name for the machine, which emulated nodes on one machine share while standing for many.
    server: str = ""
    nvl_domain: str = ""
    network: str = "infiniband"
    provider: str = ""  # who runs the machine, and where (document 004's trusted providers)
    region: str = ""

    @property
    def pid(self) -> int:
        return os.getpid()

    @property
    def placement(self) -> Placement:
        return Placement(self.rack, self.server, self.nvl_domain, self.network)

    def peer(self) -> Peer:
        return Peer(self.name, self.address, self.rack, self.server, self.nvl_domain, self.network)


class LoopLag:
    """How late the event loop wakes up: the node's own responsiveness, sampled every 20 ms."""

    def __init__(self, interval_s: float = 0.02, keep: int = 3000):
        self.interval_s = interval_s
        self.samples: deque[float] = deque(maxlen=keep)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    async def _run(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.interval_s)
            self.samples.append(max(time.monotonic() - before - self.interval_s, 0.0))

    def p99_ms(self) -> float | None:
        if len(self.samples) < 10:
            return None
        return round(statistics.quantiles(self.samples, n=100)[98] * 1000, 3)

    def reset(self) -> None:
        self.samples.clear()


@dataclass
class NodeRuntime:
    identity: Identity
    engine: ServingEngine  # the emulated engine, or an adapter in front of a real one
    store: CheckpointStore
    streamer: CheckpointStreamer
    faults: FaultState
    telemetry: NvmlTelemetry | EmulatedTelemetry
    agent_token: str | None = None  # control endpoints: checkpoint pages, migration, assist, reload
    fault_token: str | None = None  # fault injection, when enabled
    # An experiment's override of the catalog's modelled draft agreement (None: the catalog's, for the model pair).
    draft_agreement: float | None = None
    # A gateway's request whose stream broke (its gateway died, or its client went away) is held this long,
    # still generating, for a gateway to take over (workers.agent: parked streams); 0 aborts it at once.
    park_grace_s: float = 20.0
    parked: dict = field(default_factory=dict)  # request id -> workers.agent.Parked
    streaming: set = field(default_factory=set)  # request ids whose stream is being written now
    loop_lag: LoopLag = field(default_factory=LoopLag)
    # Set by workers.node once it serves: stops the node; with switch_to set, it starts again serving that model.
    request_stop: Callable[[], None] | None = None
    switch_to: str | None = None
    busy_mark: tuple[float, float] = field(default_factory=lambda: (time.monotonic(), 0.0))
    busy_fraction: float = 0.0

    @property
    def peer_headers(self) -> dict:
        return {"Authorization": f"Bearer {self.agent_token}"} if self.agent_token else {}

    def load_for_telemetry(self) -> dict:
        """Utilization over the last half second or more, and KV bytes in use, for emulated GPU figures."""
        now, busy = time.monotonic(), self.engine.busy_s
        then, busy_then = self.busy_mark
        if now - then >= 0.5:  # several readers may ask at once: measure over a window, not between them
            self.busy_fraction = min(max((busy - busy_then) / (now - then), 0.0), 1.0)
            self.busy_mark = (now, busy)
        return {
            "busy_fraction": self.busy_fraction,
            "kv_bytes_used": self.engine.used_blocks * self.engine.model.kv_bytes_per_block,
        }


def token_matches(presented: str | None, expected: str | None) -> bool:
    if not presented or not expected:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())


# --- Node tokens ----------------------------------------------------------------------------------------------------
# A node registers and beats with a bearer token. The cluster's shared token (LIFELINE_NODE_TOKEN) lets any node speak
# for any name; a per-node token names its node, "lln.<name>.<mac>", the MAC keyed by the control plane's node token
# secret (LIFELINE_NODE_TOKEN_SECRET), so it speaks for that name only. The control plane keeps no list: it recomputes
# the MAC. Rotation: a new secret, the old one accepted beside it until every node has its new token.
NODE_TOKEN_PREFIX = "lln."


def node_token(secret: str, name: str) -> str:
    """The per-node token of `name` under `secret` (`manage.py node_token NAME` prints it)."""
    return f"{NODE_TOKEN_PREFIX}{name}.{_node_mac(secret, name)}"


def _node_mac(secret: str, name: str) -> str:
    return hmac.new(secret.encode(), b"lifeline-node:" + name.encode(), hashlib.sha256).hexdigest()


def node_token_name(presented: str | None, secrets: tuple[str | None, ...]) -> str | None:
    """The node name a per-node token speaks for, when its MAC matches one of `secrets`; else None."""
    if not presented or not presented.startswith(NODE_TOKEN_PREFIX):
        return None
    name, dot, mac = presented[len(NODE_TOKEN_PREFIX) :].rpartition(".")
    if not dot or not name:
        return None
    matched = False
    for secret in secrets:
        if secret:  # every secret is tried, so the time taken does not say which one matched
            matched |= hmac.compare_digest(mac.encode(), _node_mac(secret, name).encode())
    return name if matched else None
