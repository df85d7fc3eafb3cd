"""The emulated GPU engine: continuous batching timed by the roofline model.

One asyncio task runs the step loop. Each step it schedules running decode
sequences (one token each), continues chunked prefills, and admits waiting
requests while the token budget, the batch limit and free KV blocks allow.
It then sleeps for the time the step would take on the catalogued GPU and
emits the tokens the step produced. When KV blocks run out, the most recently
admitted sequence is preempted and recomputed later, as vLLM does.

Beyond serving, the engine streams completed KV blocks to checkpoint holders,
resumes a request from a checkpoint at token N, hands a request over to
another node at a token boundary (live migration), and, paired with a
restarting node's draft model, verifies k drafted tokens per step
(speculative assist). Every token is the pure function of workers.tokens, so
none of this changes the text.
"""

import asyncio
import hashlib
import logging
import math
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workers import catalog, tokens
from workers.aio import cancel
from workers.catalog import BLOCK_TOKENS, Deployment
from workers.checkpoint import CheckpointStreamer, Peer
from workers.faults import FaultState
from workers.kvstore import CheckpointStore, Page
from workers.protocol import AssistStatus, NodeStatus

if TYPE_CHECKING:  # for the annotation only: workers.openai_schema imports this module
    from workers.openai_schema import CompletionRequest

log = logging.getLogger(__name__)

APPLY_SLICE = 32  # sequences emitted between two yields to the event loop
MAX_CATCH_UP_S = 0.25  # how far behind its model the step loop catches up rather than resets


class EngineError(Exception):
    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # number of top candidates to report, None for none
    ignore_eos: bool = False  # vLLM's sampling extra: generate on through the end-of-sequence token up to max_tokens
    top_p: float = 1.0
    top_k: int = -1  # vLLM's: -1 (or 0) for no limit
    min_p: float = 0.0  # vLLM's
    min_tokens: int = 0  # vLLM's: no end of sequence before this many output tokens

    @property
    def sampling(self) -> tokens.Sampling | None:
        """The filters and minimum length for the token function; None when there are none (the fast path)."""
        sampling = tokens.Sampling(self.temperature, self.seed, self.top_p, self.top_k, self.min_p, self.min_tokens)
        return sampling if sampling.filtered or self.min_tokens else None


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


@dataclass
class FinishEvent:
    reason: str  # "stop", "length", "abort", "migrated" or "error"
    prompt_tokens: int
    completion_tokens: int
    at: float
    detail: dict | None = None


@dataclass
class MigrationSnapshot:
    """A request stopped at a token boundary, ready to continue elsewhere."""

    request_id: str
    prompt_ids: list[int]
    generated: list[int]
    blocks: list[list[int]]  # token ids of each complete, computed KV block


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
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    generated: list[int] = field(default_factory=list)  # through an adapter, None for an id its engine did not say
    computed: int = 0  # context tokens whose KV is in the cache
    blocks: int = 0  # KV blocks held
    state: bytes = b""  # rolling hash of the context
    text: str = ""
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished: str | None = None
    preemptions: int = 0
    holders: tuple[Peer, ...] = ()
    checkpoint_prefill_chunks: bool = False
    streamed_blocks: int = 0
    resumed_with: int = 0  # output tokens it already had when it arrived (a resumed request)
    sampling: tokens.Sampling | None = None  # the token function's filters, from params
    migration: asyncio.Future | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def uncomputed(self) -> int:
        return self.context_len - self.computed

    @property
    def in_prefill(self) -> bool:
        # Decoding means only the last sampled token still has to go through the model.
        return self.uncomputed > 1 or not self.generated

    def context_block(self, block: int) -> list[int]:
        start, end = block * BLOCK_TOKENS, (block + 1) * BLOCK_TOKENS
        prompt = len(self.prompt_ids)
        if end <= prompt:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.generated)[start:end]


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
    alpha: float
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


class Engine:
    """The emulated engine: a workers.engine_api.ServingEngine with every capability (fault
    injection among them, which a node still switches on only with --enable-faults)."""

    capabilities = frozenset(
        {"checkpoint", "resume", "migrate", "assist", "draft", "reload", "config", "reset", "faults"}
    )

    def __init__(
        self,
        deployment: Deployment,
        config: EngineConfig | None = None,
        name: str = "node",
        rack: str = "",
        faults: FaultState | None = None,
        streamer: CheckpointStreamer | None = None,
        store: CheckpointStore | None = None,
    ):
        self.deployment = deployment
        self.model = deployment.model
        self.config = config or EngineConfig()
        self.name = name
        self.rack = rack
        self.faults = faults or FaultState(enabled=False, tp=deployment.tp)
        self.streamer = streamer
        self.store = store
        self.total_blocks = deployment.kv_blocks
        self.used_blocks = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.model_state = "serving"
        self.load_progress = 1.0
        # The share of max_num_seqs admitted at once, lowered to relieve a struggling node
        # (see batch_limit); EngineConfig is fixed at start, this changes while serving.
        self.batch_factor = 1.0
        self.assist: Assist | None = None
        self.step_s = 0.0  # emulated duration of the last step, before time scale and faults
        # The last decode-only step as the GPU ran it (faults included, time scale not):
        # (seconds, batch, context tokens). The control plane measures slowdown on it, as a
        # step with a prefill chunk in it is long by design, not because the GPU is slow.
        self.decode_step: tuple[float, int, int] = (0.0, 0, 0)
        self.steps = 0
        self.busy_s = 0.0  # wall seconds spent in steps, for utilization
        self.status_seq = 0
        self.counters = {
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "requests_finished": 0,
            "preemptions": 0,
            "resumed_local": 0,
            "resumed_fetched": 0,
            "resumed_reprefill": 0,
            "migrated_out": 0,
            "assist_steps": 0,
            "draft_proposed": 0,
            "draft_accepted": 0,
            "draft_tested": 0,
            "assisted_tokens": 0,
            "assisted_sequence_steps": 0,
            "drafts_served": 0,
            "step_modeled_s": 0.0,
            "step_actual_s": 0.0,
        }
        self._wake = asyncio.Event()
        self._subscribers: set[asyncio.Queue] = set()
        self._task: asyncio.Task | None = None
        self._load_task: asyncio.Task | None = None
        self._steps_since_status = 0

    def describe(self) -> dict:
        return {"kind": "emulated"}

    # --- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"engine-{self.name}")

    async def stop(self) -> None:
        await cancel(self._load_task)
        await cancel(self._task)
        self._task = None
        for seq in list(self.by_id.values()):
            self._finish(seq, "abort")

    def begin_load(self, cold: bool = True) -> None:
        """Load the model: the draft first when the family has one (seconds), then the full model."""
        draft = catalog.MODELS.get(self.model.draft) if self.model.draft else None
        if cold:
            # At once, not when the load task first runs: from here on the node refuses new work.
            self._set_model_state("loading_draft" if draft is not None else "loading_full", 0.0)
        self._load_task = asyncio.get_running_loop().create_task(self._load(cold, draft), name=f"load-{self.name}")

    async def _load(self, cold: bool, draft: catalog.Model | None) -> None:
        if not cold:
            self._set_model_state("serving", 1.0)
            return
        scale = self.config.time_scale
        if draft is not None:
            await asyncio.sleep(catalog.load_time_s(draft) * scale)
            self._set_model_state("draft_ready", 0.0)
        # The full model loads in the background; a draft-ready node can assist meanwhile.
        total = catalog.load_time_s(self.model) * scale
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < total:
            self.load_progress = elapsed / total
            await asyncio.sleep(min(0.25, total - elapsed))
        self._set_model_state("serving", 1.0)

    def _set_model_state(self, state: str, progress: float) -> None:
        log.info("%s model state: %s", self.name, state)
        self.model_state = state
        self.load_progress = progress
        self._publish(f"model_{state}")
        self._wake.set()

    def reload(self, cold: bool = True, finish: str = "abort", reason: str = "node reloading its model") -> int:
        """Drop everything in flight and load the model again (remediation, or a reset GPU)."""
        aborted = len(self.by_id)
        for seq in list(self.by_id.values()):
            self._finish(seq, finish, {"reason": reason})
        if self._load_task is not None:
            self._load_task.cancel()
        self.begin_load(cold)
        return aborted

    def reset_gpus(self) -> int:
        """A GPU reset: the GPUs' state is gone, and with it every request in flight and the loaded model.

        Injected faults end and lost GPUs come back (see FaultState.reset_gpus); the
        model then loads cold, draft first. Returns how many requests failed.
        """
        self.faults.reset_gpus()
        failed = self.reload(cold=True, finish="error", reason=f"GPU reset on node {self.name}")
        self._publish("reset")
        return failed

    # --- batch limit -------------------------------------------------------------
    @property
    def batch_limit(self) -> int:
        """Sequences admitted into the running batch at most: max(1, floor(max_num_seqs x batch_factor))."""
        # The small epsilon keeps 100 x 0.29 at 29, not the 28.999... a float product gives.
        return max(1, math.floor(self.config.max_num_seqs * self.batch_factor + 1e-9))

    def set_batch_factor(self, factor: float) -> None:
        """Change the batch limit. Running sequences continue; new ones wait while the batch is at the limit."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise EngineError(f"batch_factor must be a number in (0, 1], got {factor!r}", status=400)
        self.batch_factor = float(factor)
        self._publish("config")
        self._wake.set()

    # --- requests ----------------------------------------------------------------
    def _check_can_serve(self) -> None:
        if self.faults.gpu_lost:
            raise EngineError(
                f"node {self.name} has lost GPU {sorted(self.faults.lost_gpus)} and cannot serve", status=503
            )
        if self.model_state != "serving":
            raise EngineError(f"node {self.name} is {self.model_state.replace('_', ' ')}, not serving yet", status=503)

    async def submit_request(self, req: "CompletionRequest") -> Sequence:
        """Queue a validated request (workers.engine_api.ServingEngine)."""
        ext = req.extension
        return self.submit(
            req.prompt_ids,
            req.params,
            req.request_id,
            holders=ext.holders,
            checkpoint_prefill_chunks=ext.checkpoint_prefill_chunks,
        )

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        holders: tuple[Peer, ...] = (),
        checkpoint_prefill_chunks: bool = False,
        generated: list[int] | None = None,
        restored_tokens: int = 0,
    ) -> Sequence:
        """Queue a request. `generated` and `restored_tokens` resume one at token N."""
        self._check_can_serve()
        if not prompt_ids:
            raise EngineError("the prompt is empty", status=400)
        needed = self._blocks_for(len(prompt_ids) + params.max_tokens)
        if needed > self.total_blocks:
            # It would prefill, run out of KV, preempt itself and start over, forever: refuse it instead.
            raise EngineError(
                f"the request needs {needed} KV blocks "
                f"({len(prompt_ids)} prompt + {params.max_tokens} output tokens) and "
                f"{self.name} has {self.total_blocks}: shorten it to {self.total_blocks * BLOCK_TOKENS} tokens in all",
                status=400,
            )
        request_id = request_id or f"req-{uuid.uuid4().hex[:20]}"
        if request_id in self.by_id:
            raise EngineError(f"request id {request_id!r} is already running on this node")
        generated = list(generated or [])
        seq = Sequence(
            request_id, list(prompt_ids), params, arrival=time.monotonic(), generated=generated, holders=holders
        )
        seq.checkpoint_prefill_chunks = checkpoint_prefill_chunks
        seq.sampling = params.sampling
        seq.resumed_with = len(generated)
        seq.state = tokens.fold(tokens.initial_state(self.model.key), seq.prompt_ids + generated)
        seq.text = tokens.decode(generated)
        seq.computed = restored_tokens
        self.by_id[request_id] = seq
        if generated:
            # A resumed request has stalled once already: it goes ahead of new arrivals.
            # Its new holders get every block, the restored ones included, from the first.
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        self.counters["prompt_tokens"] += len(prompt_ids)
        self._publish("arrival", request_id)
        self._wake.set()
        return seq

    async def resume(
        self,
        req: "CompletionRequest",
        generated: list[int],
        *,
        sources: tuple[Peer, ...] = (),
        fetch: Callable[[Peer, str], Awaitable[tuple[list[Page], int]]] | None = None,
        holders: tuple[Peer, ...] = (),
        checkpoint_prefill_chunks: bool = False,
    ) -> tuple[Sequence, ResumeInfo]:
        """Continue a request whose first len(generated) output tokens the client already has.

        Restore its KV from this node's checkpoint store (time: bytes over the
        host-to-GPU link), else fetch it from a holder (time: bytes over the
        link between the nodes), else re-prefill prompt plus generated tokens.
        """
        prompt_ids, params, request_id = req.prompt_ids, req.params, req.request_id
        self._check_can_serve()
        if len(generated) >= params.max_tokens:
            raise EngineError(
                f"nothing left to generate: {len(generated)} of max_tokens={params.max_tokens} already sent", status=400
            )
        context = list(prompt_ids) + list(generated)
        per_block = self.model.kv_bytes_per_block
        info = None
        reasons = []
        if self.store is not None:
            checkpoint, restored = self.store.usable(request_id, context)
            if checkpoint is not None and restored:
                # Pages handed over by a live migration went straight to GPU memory; a holder's
                # own pages come up from host memory.
                seconds = (
                    0.0
                    if checkpoint.direct
                    else catalog.kv_transfer_s(restored // BLOCK_TOKENS * per_block, catalog.HOST_TO_GPU_LINK)
                )
                info = ResumeInfo(
                    "checkpoint-local", restored, len(context) - restored, seconds * 1000, source=checkpoint.source
                )
                self.store.drop(request_id, count=False)
            else:
                reasons.append(
                    "this node holds no pages for the request"
                    if checkpoint is None
                    else "this node's pages do not match the request's tokens"
                )
        if info is None and fetch is not None:
            for source in sources:
                try:
                    pages, committed = await fetch(source, request_id)
                except Exception as exc:  # noqa: BLE001 - a dead holder: try the next, else re-prefill
                    reasons.append(f"{source.name} unreachable ({exc.__class__.__name__})")
                    continue
                restored = _matching_prefix(pages, committed, context)
                if restored:
                    link, loaded = catalog.node_link(self.rack, source.rack)
                    seconds = catalog.kv_transfer_s(restored // BLOCK_TOKENS * per_block, link, loaded)
                    info = ResumeInfo(
                        "checkpoint-fetched", restored, len(context) - restored, seconds * 1000, source=source.name
                    )
                    break
                reasons.append(f"{source.name} holds no usable pages")
        if info is None:
            info = ResumeInfo("re-prefill", 0, len(context), 0.0, reason="; ".join(reasons) or "no checkpoint")
        if info.restore_ms:
            await asyncio.sleep(info.restore_ms / 1000 * self.config.time_scale)
        seq = self.submit(
            prompt_ids,
            params,
            request_id,
            holders=holders,
            checkpoint_prefill_chunks=checkpoint_prefill_chunks,
            generated=generated,
            restored_tokens=info.restored_tokens,
        )
        key = {
            "checkpoint-local": "resumed_local",
            "checkpoint-fetched": "resumed_fetched",
            "re-prefill": "resumed_reprefill",
        }[info.method]
        self.counters[key] += 1
        return seq, info

    def abort(self, request_id: str) -> None:
        seq = self.by_id.get(request_id)
        if seq is not None and seq.finished is None:
            self._finish(seq, "abort")

    def request_migration(self, request_id: str) -> asyncio.Future:
        """Stop `request_id` at the next token boundary; the future gets its snapshot."""
        seq = self.by_id.get(request_id)
        if seq is None or seq.finished is not None:
            raise EngineError(f"request {request_id!r} is not running on {self.name}", status=404)
        if seq.migration is None:
            seq.migration = asyncio.get_running_loop().create_future()
            if seq in self.waiting:  # not admitted yet: nothing in flight, hand it over now
                self._migrate(seq, seq.migration)
            self._wake.set()
        return seq.migration

    def set_holders(self, request_id: str, holders: tuple[Peer, ...]) -> dict:
        """Re-place a running request's checkpoint: new holders get every block so far, dropped ones let go."""
        seq = self.by_id.get(request_id)
        if seq is None or seq.finished is not None:
            raise EngineError(f"request {request_id!r} is not running on {self.name}", status=404)
        old = {h.name: h for h in seq.holders}
        new = {h.name: h for h in holders}
        added = [h for name, h in new.items() if name not in old]
        if self.streamer is not None:
            for holder in added:
                for block in range(seq.streamed_blocks):
                    self.streamer.page(holder, request_id, block, seq.context_block(block))
            for name, holder in old.items():
                if name not in new:
                    self.streamer.drop(holder, request_id)
        seq.holders = tuple(holders)
        return {
            "request_id": request_id,
            "holders": list(new),
            "added": [h.name for h in added],
            "blocks_sent": seq.streamed_blocks * len(added),
        }

    def fail_gpu(self) -> int:
        """A lost GPU breaks the whole tensor-parallel group: every request in flight fails."""
        failed = len(self.by_id)
        for seq in list(self.by_id.values()):
            self._finish(seq, "error", {"reason": f"GPU {sorted(self.faults.lost_gpus)} lost (Xid 79)"})
        return failed

    # --- speculative assist ----------------------------------------------------------
    def start_assist(self, assist: Assist) -> None:
        if self.model_state != "serving":
            raise EngineError(f"node {self.name} is {self.model_state}: only a serving node verifies drafts")
        self.assist = assist
        self._publish("assist_started")

    def stop_assist(self) -> Assist | None:
        assist, self.assist = self.assist, None
        if assist is not None:
            self._publish("assist_stopped")
        return assist

    # --- status --------------------------------------------------------------------
    def status(self) -> NodeStatus:
        decode = [s for s in self.running if not s.in_prefill]
        uncomputed_prefill = sum(s.uncomputed for s in self.running if s.in_prefill) + sum(
            s.uncomputed for s in self.waiting
        )
        store = self.store.stats() if self.store is not None else {}
        tested = self.counters["draft_tested"]
        return NodeStatus(
            seq=self.status_seq,
            at=time.time(),
            model_state=self.model_state,
            load_progress=round(self.load_progress, 3),
            waiting=len(self.waiting),
            running=len(self.running),
            uncomputed_prefill_tokens=uncomputed_prefill,
            decode_batch=len(decode),
            decode_context_tokens=sum(s.context_len for s in decode),
            kv_blocks_used=self.used_blocks,
            kv_blocks_total=self.total_blocks,
            checkpoint_bytes_held=store.get("bytes_held", 0),
            checkpoint_budget_bytes=store.get("budget_bytes", 0),
            checkpoint_requests=store.get("requests", 0),
            step_ms=round(self.step_s * 1000, 3),
            steps=self.steps,
            time_scale=self.config.time_scale,
            decode_step_ms=round(self.decode_step[0] * 1000, 3),
            decode_step_batch=self.decode_step[1],
            decode_step_context_tokens=self.decode_step[2],
            batch_limit=self.batch_limit,
            batch_factor=self.batch_factor,
            assist=None
            if self.assist is None
            else AssistStatus(
                self.assist.draft.name,
                self.assist.k,
                self.assist.alpha,
                round(self.counters["draft_accepted"] / tested, 4) if tested else None,
            ),
            in_flight=len(self.by_id),
            source="engine",
        )

    def subscribe(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(maxsize=256)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    def _publish(self, reason: str, request_id: str | None = None) -> None:
        self.status_seq += 1
        if not self._subscribers:
            return
        status = self.status().to_json()
        status["reason"] = reason
        if request_id is not None:
            # A gateway that dispatched this request settles its own account against this status.
            status["request_id"] = request_id
        for queue in list(self._subscribers):
            if queue.full():  # a slow subscriber loses old statuses, never blocks the engine
                try:
                    queue.get_nowait()
                except asyncio.QueueEmpty:
                    pass
            queue.put_nowait(status)

    def publish(self, reason: str) -> None:
        """A load-changing event from outside the step loop (a checkpoint page stored, say)."""
        self._publish(reason)

    # --- the step loop ---------------------------------------------------------------
    async def _loop(self) -> None:
        next_start = time.monotonic()
        previous = None  # (start, modeled seconds) of the step before, while busy without a break
        while True:
            if not self.running and not self.waiting or self.model_state != "serving":
                self._wake.clear()
                await self._wake.wait()
                next_start, previous = time.monotonic(), None
                continue
            plan = self._schedule()
            if plan is None:  # nothing could be scheduled (no KV room); wait for a change
                self._wake.clear()
                await self._wake.wait()
                next_start, previous = time.monotonic(), None
                continue
            drafts, verified_drafts = None, 0
            assist = self.assist
            if assist is not None and plan.decode:
                # The draft node's proposals come first, the verification step after them.
                drafts = await self._drafts(assist, plan)
                if drafts:
                    verified_drafts = len(drafts) * assist.k
                next_start = max(next_start, time.monotonic())
            began = time.monotonic()
            if previous is not None and drafts is None:
                # How long the last step really took, start to start, against the model.
                self.counters["step_actual_s"] += began - previous[0]
                self.counters["step_modeled_s"] += previous[1]
            self.step_s = self._step_time(plan, verified_drafts)
            factor = self.faults.step_factor()
            prefill_tokens, _, decode_batch, decode_context = plan.shape
            if not prefill_tokens and decode_batch and drafts is None:
                self.decode_step = (self.step_s * factor, decode_batch, decode_context)
            scaled = self.step_s * factor * self.config.time_scale
            previous = (began, scaled)
            # Deadline-based sleep: the loop's own overhead (and the timer's coarseness) does
            # not stretch the steps; a short oversleep is made up on the next one.
            next_start += scaled
            delay = next_start - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                # Late: a short debt (a slow wake-up, a busy host) is made up with back-to-back
                # steps, as the GPU would not have stopped; a long stall is not replayed.
                if -delay > MAX_CATCH_UP_S:
                    next_start = time.monotonic()
                await asyncio.sleep(0)
            self.busy_s += time.monotonic() - began
            await self._apply(plan, drafts)

    def _step_time(self, plan: "StepPlan", verified_drafts: int) -> float:
        prefill_tokens, prefill_context, decode_batch, decode_context = plan.shape
        link = "pcie" if self.faults.nvlink_down else None
        if verified_drafts:
            # Verifying k drafts costs one pass over k+1 query tokens per assisted sequence:
            # more FLOPs, the same weight bytes, so a memory-bound step grows only a little.
            decode_batch += verified_drafts
        return self.deployment.step_s(prefill_tokens, prefill_context, decode_batch, decode_context, link)

    def _blocks_for(self, tokens_: int) -> int:
        return math.ceil(tokens_ / BLOCK_TOKENS)

    def _grow(self, seq: Sequence, new_tokens: int) -> bool:
        """Reserve blocks for `new_tokens` more computed tokens of `seq`."""
        need = self._blocks_for(seq.computed + new_tokens) - seq.blocks
        if need <= 0:
            return True
        if self.used_blocks + need > self.total_blocks:
            return False
        self.used_blocks += need
        seq.blocks += need
        return True

    def _release(self, seq: Sequence) -> None:
        self.used_blocks -= seq.blocks
        seq.blocks = 0

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, requeue at the front."""
        self._release(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.counters["preemptions"] += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self._publish("preempted")

    def _schedule(self) -> "StepPlan | None":
        budget = self.config.max_batched_tokens
        work: list[tuple[Sequence, int]] = []
        reserve = 1 + (self.assist.k if self.assist is not None else 0)
        # 1. Running sequences, oldest first; preempt the newest when KV runs out.
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            want = 1 if not seq.in_prefill else min(seq.uncomputed, budget)
            if want <= 0:
                index += 1
                continue
            room = reserve if not seq.in_prefill else want
            while not self._grow(seq, room):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                break
            work.append((seq, want))
            budget -= want
            index += 1
        # 2. Admit waiting requests while the batch, the budget and free blocks allow.
        admitted = False
        while self.waiting and budget > 0 and len(self.running) < self.batch_limit:
            seq = self.waiting[0]
            chunk = min(seq.uncomputed, budget)
            if not self._grow(seq, chunk):
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.admitted_at = seq.admitted_at or time.monotonic()
            work.append((seq, chunk))
            budget -= chunk
            admitted = True
        if admitted:
            self._publish("admitted")
        if not work:
            return None
        return StepPlan(work)

    async def _drafts(self, assist: Assist, plan: "StepPlan") -> dict[str, list[int]] | None:
        """Ask the draft node for k tokens per decoding sequence; None falls back to a plain step."""
        chosen = plan.decode[: self.config.max_assisted]
        items = [
            {
                "id": s.request_id,
                "state": s.state.hex(),
                "position": len(s.generated),
                "temperature": s.params.temperature,
                "seed": s.params.seed,
                "top_p": s.params.top_p,
                "top_k": s.params.top_k,
                "min_p": s.params.min_p,
                "min_tokens": s.params.min_tokens,
            }
            for s in chosen
        ]
        try:
            proposals = await asyncio.wait_for(assist.propose(items), timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - the draft node is a helper; decoding goes on without it
            assist.failures += 1
            log.warning("draft node %s failed (%s); decoding without drafts", assist.draft.name, exc)
            if assist.failures >= 3:
                self.stop_assist()
                asyncio.get_running_loop().create_task(assist.aclose())
            return None
        assist.failures = 0
        return {s.request_id: p for s, p in zip(chosen, proposals)}

    async def _apply(self, plan: "StepPlan", drafts: dict | None) -> None:
        """Emit what the step produced, a slice of sequences at a time.

        Between slices the loop lets the streams write what they got, so a step
        of 256 sequences never holds the event loop for one long stretch.
        """
        now = time.monotonic()
        emitted = False
        prefill_done = False
        if drafts:
            self._count_assist(assist_steps=1)
        for position, (seq, count) in enumerate(plan.work):
            if position and position % APPLY_SLICE == 0:
                await asyncio.sleep(0)
            if seq.finished is not None or seq not in self.running:
                continue  # aborted or preempted while the step ran
            was_prefill = seq.in_prefill
            seq.computed += count
            if seq.computed < seq.context_len:
                prefill_done = True  # a chunk finished, more to go
                self._stream_blocks(seq)
                continue
            if was_prefill:
                prefill_done = True
            proposal = drafts.get(seq.request_id) if drafts and not was_prefill else None
            if proposal is None:
                self._emit_next(seq, now)
            else:
                self._emit_verified(seq, proposal, now)
            emitted = True
            self._stream_blocks(seq)
            if seq.migration is not None and seq.finished is None:
                self._migrate(seq, seq.migration)
        self.steps += 1
        if emitted:
            self._steps_since_status += 1
        if prefill_done:
            self._publish("prefill_chunk")
        elif emitted and self._steps_since_status >= self.config.status_every_steps:
            self._steps_since_status = 0
            self._publish("tokens")

    def _emit_verified(self, seq: Sequence, proposal: list[int], now: float) -> None:
        """Accept drafted tokens left to right while they match the target; emit them plus one."""
        state, accepted = seq.state, 0
        for offset, drafted in enumerate(proposal):
            target = tokens.next_token(
                state, len(seq.generated) + offset, seq.params.temperature, seq.params.seed, seq.sampling
            ).token_id
            if drafted != target:
                break
            accepted += 1
            state = tokens.advance(state, target)
        # Drafts after the first mismatch are never tested: alpha is accepted over tested.
        self._count_assist(
            draft_proposed=len(proposal),
            draft_accepted=accepted,
            draft_tested=accepted + (1 if accepted < len(proposal) else 0),
        )
        before = len(seq.generated)
        for _ in range(accepted + 1):
            self._emit_next(seq, now)
            if seq.finished is not None:
                break
        made = len(seq.generated) - before
        self._count_assist(assisted_tokens=made, assisted_sequence_steps=1)
        # The accepted drafts went through the model in the verification pass.
        seq.computed += made - 1

    def _count_assist(self, **figures: int) -> None:
        """Count assist figures for the engine's lifetime and for the pairing now running."""
        for key, value in figures.items():
            self.counters[key] += value
            if self.assist is not None:
                self.assist.counters[key] += value

    def _emit_next(self, seq: Sequence, now: float) -> None:
        params = seq.params
        choice = tokens.next_token(seq.state, len(seq.generated), params.temperature, params.seed, seq.sampling)
        choice = self.faults.corrupt(seq.state, len(seq.generated), choice)
        top = choice.top[: params.logprobs] if params.logprobs else ()
        if params.logprobs and params.logprobs > len(choice.top):
            top = choice.top + tokens.more_candidates(seq.state, choice, params.logprobs - len(choice.top))
        previous = seq.generated[-1] if seq.generated else None
        seq.generated.append(choice.token_id)
        seq.state = tokens.advance(seq.state, choice.token_id)
        if seq.first_token_at is None:
            seq.first_token_at = now
        self.counters["generation_tokens"] += 1
        text = tokens.piece(choice.token_id, previous)
        reason = None
        if choice.token_id == tokens.EOS and not params.ignore_eos:
            reason = "stop"
        elif params.stop:
            combined = seq.text + text
            for stop in params.stop:
                cut = combined.find(stop, max(0, len(seq.text) - len(stop) + 1))
                if cut >= 0:
                    text = combined[len(seq.text) : cut] if cut >= len(seq.text) else ""
                    reason = "stop"
                    break
        seq.text += text
        index = len(seq.generated) - 1
        seq.events.put_nowait(TokenEvent(index, choice.token_id, text, choice.logprob, top, time.time()))
        if reason is None and len(seq.generated) >= params.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(seq, reason)

    def _stream_blocks(self, seq: Sequence) -> None:
        """Hand newly completed KV blocks to the streamer, one page per holder."""
        if not seq.holders or self.streamer is None or seq.finished is not None:
            return  # a finished request's checkpoint was dropped: nothing more goes out
        if seq.in_prefill and not seq.checkpoint_prefill_chunks:
            return  # the prompt's blocks go once prefill is done, unless chunks are checkpointed
        complete = seq.computed // BLOCK_TOKENS
        for block in range(seq.streamed_blocks, complete):
            token_ids = seq.context_block(block)
            for holder in seq.holders:
                self.streamer.page(holder, seq.request_id, block, token_ids)
        if complete > seq.streamed_blocks:
            seq.streamed_blocks = complete

    def _migrate(self, seq: Sequence, migration: asyncio.Future) -> None:
        complete = seq.computed // BLOCK_TOKENS
        snapshot = MigrationSnapshot(
            seq.request_id, list(seq.prompt_ids), list(seq.generated), [seq.context_block(b) for b in range(complete)]
        )
        self.counters["migrated_out"] += 1
        self._finish(seq, "migrated", {"tokens": len(seq.generated)})
        if not migration.done():
            migration.set_result(snapshot)

    def _finish(self, seq: Sequence, reason: str, detail: dict | None = None) -> None:
        if seq.finished is not None:
            return
        seq.finished = reason
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.by_id.pop(seq.request_id, None)
        if reason in ("stop", "length"):
            self.counters["requests_finished"] += 1
        if reason != "migrated" and self.streamer is not None:
            for holder in seq.holders:  # the checkpoint is no longer needed
                self.streamer.drop(holder, seq.request_id)
        if seq.migration is not None and not seq.migration.done() and reason != "migrated":
            seq.migration.set_exception(
                EngineError(f"request {seq.request_id} ended ({reason}) before it could migrate", status=409)
            )
        seq.events.put_nowait(FinishEvent(reason, len(seq.prompt_ids), len(seq.generated), time.time(), detail))
        self._publish("finished", seq.request_id)
        self._wake.set()


def _matching_prefix(pages: list[Page], committed: int, context: list[int]) -> int:
    limit = min(committed, len(context)) // BLOCK_TOKENS * BLOCK_TOKENS
    restored = 0
    for page in pages:
        end = restored + len(page.token_ids)
        if end > limit or page.token_ids != context[restored:end]:
            break
        restored = end
    return restored


def propose_drafts(model_key: str, k: int, alpha: float, items: list[dict]) -> list[list[int]]:
    """What a draft model proposes: each drafted token agrees with the target with probability alpha.

    The draft continues from its own proposals, as a real draft model does, so
    after a disagreement the rest of its proposal is rejected at verification.
    """
    proposals = []
    for item in items:
        state = bytes.fromhex(item["state"])
        position = int(item["position"])
        sampling = tokens.Sampling(
            float(item.get("temperature", 0.0)),
            int(item.get("seed", 0)),
            float(item.get("top_p", 1.0)),
            int(item.get("top_k", -1)),
            float(item.get("min_p", 0.0)),
            int(item.get("min_tokens", 0)),
        )
        drafted = []
        for offset in range(k):
            target = tokens.next_token(state, position + offset, sampling.temperature, sampling.seed, sampling).token_id
            digest = hashlib.blake2b(
                state + (position + offset).to_bytes(8, "little"), digest_size=8, person=b"lifeline-draft"
            ).digest()
            agree = int.from_bytes(digest, "little") / 2**64 < alpha
            token = target if agree else (target + 1 + digest[0] % 7) % tokens.WORD_COUNT
            drafted.append(token)
            state = tokens.advance(state, token)
        proposals.append(drafted)
    return proposals


@dataclass
class StepPlan:
    work: list[tuple[Sequence, int]]

    @property
    def decode(self) -> list[Sequence]:
        return [seq for seq, _ in self.work if not seq.in_prefill]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(prefill tokens, prefill context before, decode batch, decode context) for the timing model."""
        prefill_tokens = prefill_context = decode_batch = decode_context = 0
        for seq, count in self.work:
            if seq.in_prefill:
                prefill_tokens += count
                prefill_context += seq.computed
            else:
                decode_batch += 1
                decode_context += seq.context_len
        return prefill_tokens, prefill_context, decode_batch, decode_context
