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
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

from workers import core
from workers.catalog import Deployment, Model
from workers.checkpoint import Peer
from workers.core import EngineError as EngineError  # the core's, named here for every engine and its callers
from workers.core import SamplingParams as SamplingParams
from workers.kvstore import Page
from workers.openai_schema import CompletionRequest
from workers.protocol import NodeStatus


# --- what every engine shares: the request as served, its events, how a resume went ------------------------------
@dataclass
class TokenEvent:
    index: int  # position in the output, from 0
    token_id: int | None  # None where an engine behind an adapter does not say (workers.adapter)
    text: str
    logprob: float | None  # None where the engine was not asked for logprobs
    # The top candidates with their logprobs, each named by its token id, or by its text
    # where the engine names it so (a real engine's logprobs, through an adapter).
    top: tuple[tuple[int | str, float], ...]
    at: float
    token: str | None = (
        None  # the token as the engine spells it in logprobs; None: workers.tokens spells it from its id
    )
    # More tokens of the same engine chunk follow at once. An engine behind an adapter (vLLM, SGLang) may send
    # several tokens in one chunk with one text for them all: they are written to the client as one chunk too, so
    # no stream is ever cut between them (the text cannot be split by token, and a stream resumed inside such a
    # chunk would repeat or lose the part of its text that belongs to the tokens on the far side of the cut).
    more: bool = False


@dataclass
class FinishEvent:
    reason: str  # "stop", "length", "abort", "migrated" or "error"
    prompt_tokens: int
    completion_tokens: int
    at: float
    detail: dict | None = None


@dataclass
class ResumeInfo:
    method: str  # "checkpoint-local", "checkpoint-fetched" or "re-prefill"
    restored_tokens: int
    reprefill_tokens: int
    restore_ms: float
    source: str | None = None
    reason: str | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass(eq=False)
class Sequence(core.Sequence):
    """A request as the node serves it: the core's sequence, the stream its tokens go out on, and the
    future its live migration's snapshot goes to."""

    migration: asyncio.Future | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 128  # batch limit
    max_batched_tokens: int = 2048  # token budget per step (chunked prefill)
    time_scale: float = 1.0  # multiplies every emulated duration; 0.5 runs twice as fast
    status_every_steps: int = 4  # push a status after this many token-emitting steps
    max_assisted: int = 64  # decode sequences a draft node helps per step


@dataclass
class Assist:
    """This node verifies drafts proposed by a restarting node's draft model."""

    draft: Peer
    k: int
    agreement: float  # the pair's modelled per-token agreement (catalog), not a measurement
    propose: Callable[[list[dict]], Awaitable[list[list[int]]]]
    close: Callable[[], Awaitable[None]] | None = None
    since: float = field(default_factory=time.time)
    failures: int = 0
    # This pairing's own figures (steps, drafts proposed/accepted/tested, tokens): its report is about it, not
    # about every pairing since the engine started.
    counters: Counter = field(default_factory=Counter)

    async def aclose(self) -> None:
        if self.close is not None:
            await self.close()


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
    # The node serves vLLM's /tokenize with its engine's tokenizer (an adapter in front of it renders through it).
    "tokenize": Capability("tokenize a prompt as its model does (/tokenize)", ()),
    "switch_model": Capability(
        "serve another model on request: a real engine's model is set by its own command line; start the engine on "
        "the other model, and the node with its --model",
        (),
    ),
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

    async def before_joining(self, wait_s: float) -> None:
        """Before the node registers: raise (workers.adapter.EngineMismatch, say) if the engine cannot serve as the
        node needs, saying why; the node then stops rather than join. The emulated engine is ready as it is."""

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
