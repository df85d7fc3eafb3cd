"""The one engine interface: what the node agent needs from any engine behind it.

The agent (workers.agent, with the control endpoints of workers.control_api)
is one HTTP face for every engine: the emulated GPU engine
(workers.engine.Engine) and the adapter in front of a real one
(workers.adapter.AdapterEngine). It calls an engine through `ServingEngine`,
and beyond it only the members of a capability the engine declares in its
`capabilities`; for a capability an engine does not declare, the agent answers
501 without calling it (workers.control_api.lacking).
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import NamedTuple, Protocol, runtime_checkable

from workers.catalog import Deployment, Model
from workers.checkpoint import Peer
from workers.engine import Assist, EngineConfig, ResumeInfo, Sequence
from workers.kvstore import Page
from workers.openai_schema import CompletionRequest
from workers.protocol import NodeStatus


class Capability(NamedTuple):
    does: str  # what it lets a node do; the agent's 501 says the engine "cannot <does>"
    members: tuple[str, ...]  # what an engine offering it has beyond ServingEngine


CAPABILITIES: dict[str, Capability] = {
    "checkpoint": Capability("stream KV pages to a checkpoint holder, or hold another node's", ("set_holders",)),
    "resume": Capability("resume a request from a checkpoint at token N", ("resume",)),
    "migrate": Capability("hand a request over to another node at a token boundary", ("request_migration", "config")),
    "assist": Capability("verify a draft model's tokens (speculative assist)", ("start_assist", "stop_assist")),
    "draft": Capability("serve as a draft model for another node", ("config",)),
    "reload": Capability("reload its model on request", ("reload",)),
    "config": Capability(
        "change its batch limit on request", ("batch_factor", "batch_limit", "set_batch_factor", "config")
    ),
    "reset": Capability("reset its GPUs on request", ("reset_gpus",)),
    "faults": Capability("inject faults", ("fail_gpu",)),
}


@runtime_checkable
class ServingEngine(Protocol):
    """What the node agent calls on every engine."""

    model: Model
    deployment: Deployment
    model_state: str  # one of workers.protocol.MODEL_STATES
    counters: dict[str, float]  # sent in /agent/status; vLLM's names where one exists
    busy_s: float  # seconds spent working, for the emulated GPUs' utilization

    @property
    def capabilities(self) -> frozenset[str]:
        """The keys of CAPABILITIES it offers."""

    @property
    def used_blocks(self) -> int:
        """KV blocks in use, for the emulated GPUs' memory."""

    def describe(self) -> dict:
        """What the engine is, for /agent/status and /agent/capabilities: {"kind": "emulated"}, say."""

    def start(self) -> None:
        """Start its background work; called inside the running event loop."""

    async def stop(self) -> None:
        """Stop; every request in flight ends."""

    def begin_load(self, cold: bool = True) -> None:
        """Load the model (cold: the draft first, where there is one), or serve at once (warm)."""

    async def submit_request(self, req: CompletionRequest) -> Sequence:
        """Start a validated request: its `events` get a TokenEvent per token, then one FinishEvent.

        A refusal raises before anything runs: EngineError, or an ApiError that a
        real engine answered in OpenAI's shape.
        """

    def abort(self, request_id: str) -> None:
        """Stop a request whose client went away; a FinishEvent("abort") ends its events."""

    def status(self) -> NodeStatus: ...

    def subscribe(self) -> asyncio.Queue:
        """Status events: NodeStatus JSON with `reason` (and `request_id`), the oldest dropped when the queue is
        full."""

    def unsubscribe(self, queue: asyncio.Queue) -> None: ...

    def publish(self, reason: str) -> None:
        """Push a status for a load-changing event outside the engine (a checkpoint page stored, a fault)."""


# --- an engine offering a capability: ServingEngine and the capability's members -------------------
# The agent calls these members only once it has checked that the engine offers the capability
# (control_api.offered, control_api.require); the handler then reads its engine as one of these.


class CheckpointEngine(ServingEngine, Protocol):
    def set_holders(self, request_id: str, holders: tuple[Peer, ...]) -> dict: ...


class ResumeEngine(ServingEngine, Protocol):
    async def resume(
        self,
        req: CompletionRequest,
        generated: list[int],
        *,
        sources: tuple[Peer, ...] = (),
        fetch: Callable[[Peer, str], Awaitable[tuple[list[Page], int]]] | None = None,
        holders: tuple[Peer, ...] = (),
        checkpoint_prefill_chunks: bool = False,
    ) -> tuple[Sequence, ResumeInfo]: ...


class MigrateEngine(ServingEngine, Protocol):
    config: EngineConfig

    def request_migration(self, request_id: str) -> asyncio.Future: ...


class AssistEngine(ServingEngine, Protocol):
    assist: Assist | None  # the pairing now running, if any

    def start_assist(self, assist: Assist) -> None: ...

    def stop_assist(self) -> Assist | None: ...


class DraftEngine(ServingEngine, Protocol):
    config: EngineConfig


class ReloadEngine(ServingEngine, Protocol):
    def reload(self, cold: bool = True) -> int: ...


class ConfigEngine(ServingEngine, Protocol):
    batch_factor: float
    config: EngineConfig

    @property
    def batch_limit(self) -> int: ...

    def set_batch_factor(self, factor: float) -> None: ...


class ResetEngine(ServingEngine, Protocol):
    def reset_gpus(self) -> int: ...


class FaultsEngine(ServingEngine, Protocol):
    def fail_gpu(self) -> int: ...
