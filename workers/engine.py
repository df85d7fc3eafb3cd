"""The emulated GPU engine: workers.core's scheduling core, driven in real time.

One asyncio task runs the step loop. Each step it asks the core
(workers.core.EngineCore: continuous batching, chunked prefill, paged KV with
recompute preemption, the roofline step time) for a plan, sleeps for the time
the step would take on the catalogued GPU (times the time scale, and a fault's
slowdown), applies it, and hands out what it produced: tokens to each
request's stream, completed KV blocks to checkpoint holders, statuses to
subscribers, snapshots to migrations.

Beyond serving, the engine resumes a request from a checkpoint at token N,
hands a request over to another node at a token boundary (live migration),
and, paired with a restarting node's draft model, has k drafted tokens per
step verified (speculative assist). Every token is the pure function of
workers.tokens, so none of this changes the text.
"""

import asyncio
import hashlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, cast

from workers import catalog, moe, tokens
from workers.aio import cancel
from workers.catalog import BLOCK_TOKENS, Deployment
from workers.checkpoint import CheckpointStreamer, Peer
from workers.core import BlockComplete, EngineCore, EngineError, Finished, SamplingParams, StepPlan, Token
from workers.engine_api import Assist, EngineConfig, FinishEvent, ResumeInfo, Sequence, TokenEvent
from workers.faults import FaultState
from workers.kvstore import CheckpointStore, Page
from workers.openai_schema import CompletionRequest
from workers.protocol import AssistStatus, NodeStatus
from workers.status_feed import StatusFeed

if TYPE_CHECKING:
    from workers.refe import ExpertPath

log = logging.getLogger(__name__)

DELIVER_SLICE = 32  # events handed out between two yields to the event loop
MAX_CATCH_UP_S = 0.25  # how far behind its model the step loop catches up rather than resets


class Engine:
    """The emulated engine: a workers.engine_api.ServingEngine with every capability (fault
    injection among them, which a node still switches on only with --enable-faults)."""

    capabilities = frozenset(
        {
            "checkpoint",
            "resume",
            "migrate",
            "assist",
            "draft",
            "reload",
            "config",
            "reset",
            "faults",
            "tokenize",
            "switch_model",
        }
    )

    def __init__(
        self,
        deployment: Deployment,
        config: EngineConfig | None = None,
        name: str = "node",
        placement: catalog.Placement | None = None,
        faults: FaultState | None = None,
        streamer: CheckpointStreamer | None = None,
        store: CheckpointStore | None = None,
    ):
        self.deployment = deployment
        self.model = deployment.model
        self.config = config or EngineConfig()
        self.name = name
        self.placement = placement or catalog.Placement("")
        self.faults = faults or FaultState(enabled=False, tp=deployment.tp)
        self.streamer = streamer
        self.store = store
        # The sequences, the KV cache and the scheduling; this class gives them a clock and the network.
        self.core = EngineCore(
            deployment,
            self.config.max_num_seqs,
            self.config.max_batched_tokens,
            name=name,
            checkpoints=streamer is not None,
            corrupt=self.faults.corrupt,
        )
        self.model_state = "serving"
        self.load_progress = 1.0
        self.assist: Assist | None = None
        # An MoE attention worker's expert layers, on expert workers (workers.refe.ExpertPath); None: the model's
        # experts, if it has any, run here with the rest of it.
        self.experts: ExpertPath | None = None
        self.step_s = 0.0  # emulated duration of the last step, before time scale and faults
        # The last decode-only step as the GPU ran it (faults included, time scale not):
        # (seconds, batch, context tokens). The control plane measures slowdown on it, as a
        # step with a prefill chunk in it is long by design, not because the GPU is slow.
        self.decode_step: tuple[float, int, int] = (0.0, 0, 0)
        self.steps = 0
        self.busy_s = 0.0  # wall seconds spent in steps, for utilization
        self.status_seq = 0
        # One set of counters: the core's (tokens, finishes, preemptions, drafts verified) and the node's own.
        self.counters = self.core.counters
        self.counters.update(
            resumed_local=0,
            resumed_fetched=0,
            resumed_reprefill=0,
            drafts_served=0,
            step_modeled_s=0.0,
            step_actual_s=0.0,
        )
        # What the core's steps produced, handed out in order (see _deliver).
        self._outbox: deque[Token | BlockComplete | Finished] = deque()
        self._wake = asyncio.Event()
        self._feed = StatusFeed()  # the status events' subscribers
        self._task: asyncio.Task | None = None
        self._load_task: asyncio.Task | None = None
        self._steps_since_status = 0

    async def before_joining(self, wait_s: float) -> None:
        """Nothing to check: the emulated engine serves as soon as it is built."""

    def describe(self) -> dict:
        return {"kind": "emulated"}

    def fabric_placement(self) -> catalog.Placement:
        """Where this node sits in the fabric, its NVLink as the injected faults leave it."""
        return replace(self.placement, nvlink_down=self.faults.nvlink_down)

    # --- the core's state, read here as an engine's (its sequences are this module's, see submit) ---
    @property
    def waiting(self) -> deque[Sequence]:
        return cast(deque[Sequence], self.core.waiting)

    @property
    def running(self) -> list[Sequence]:
        return cast(list[Sequence], self.core.running)

    @property
    def by_id(self) -> dict[str, Sequence]:
        return cast(dict[str, Sequence], self.core.by_id)

    @property
    def used_blocks(self) -> int:
        return self.core.used_blocks

    @property
    def total_blocks(self) -> int:
        return self.core.total_blocks

    @total_blocks.setter
    def total_blocks(self, blocks: int) -> None:
        self.core.total_blocks = blocks

    # --- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"engine-{self.name}")

    async def stop(self) -> None:
        await cancel(self._load_task)
        await cancel(self._task)
        self._task = None
        self._flush()
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
        # An MoE attention worker loads only what it runs; its experts live on the expert workers.
        total = (
            catalog.load_time_s(self.model) if self.experts is None else moe.attention_worker_load_s(self.model)
        ) * scale
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
        return self.core.batch_limit

    @property
    def batch_factor(self) -> float:
        """The share of max_num_seqs admitted at once, lowered to relieve a struggling node; EngineConfig
        is fixed at start, this changes while serving."""
        return self.core.batch_factor

    def set_batch_factor(self, factor: float) -> None:
        """Change the batch limit. Running sequences continue; new ones wait while the batch is at the limit."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise EngineError(f"batch_factor must be a number in (0, 1], got {factor!r}", status=400)
        self.core.batch_factor = float(factor)
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
        seq = Sequence(
            request_id or f"req-{uuid.uuid4().hex[:20]}",
            list(prompt_ids),
            params,
            generated=list(generated or []),
            computed=restored_tokens,
            holders=holders,
            checkpoint_prefill_chunks=checkpoint_prefill_chunks,
        )
        # A resumed request's new holders get every block, the restored ones included, from the first.
        self.core.add(seq, time.monotonic())
        self._publish("arrival", seq.request_id)
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
                    link, share = catalog.node_link(self.fabric_placement(), source.placement, self.deployment.gpu)
                    seconds = catalog.kv_transfer_s(restored // BLOCK_TOKENS * per_block, link, share)
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
            seq.migrating = True
            if seq in self.waiting:  # not admitted yet: nothing in flight, hand it over now
                self._hand_out(self.core.migrate(seq))
            self._wake.set()
        return seq.migration

    def set_holders(self, request_id: str, holders: tuple[Peer, ...]) -> dict:
        """Re-place a running request's checkpoint: new holders get every block so far, dropped ones let go."""
        seq = self.by_id.get(request_id)
        if seq is None or seq.finished is not None:
            raise EngineError(f"request {request_id!r} is not running on {self.name}", status=404)
        self._flush()  # the blocks of the last step go to the holders it had
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
                self.assist.agreement,
                round(self.counters["draft_accepted"] / tested, 4) if tested else None,
            ),
            in_flight=len(self.by_id),
            source="engine",
        )

    def subscribe(self) -> asyncio.Queue:
        return self._feed.subscribe()

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._feed.unsubscribe(queue)

    def _publish(self, reason: str, request_id: str | None = None) -> None:
        self.status_seq += 1
        if reason == "finished" and request_id is not None:
            self._feed.finished(request_id)
        if not self._feed:
            return
        status = self.status().to_json()
        status["reason"] = reason
        if request_id is not None:
            # A gateway that dispatched this request settles its own account against this status.
            status["request_id"] = request_id
        self._feed.publish(status, self.by_id)  # a subscriber that lost statuses gets the request ids with it

    def publish(self, reason: str) -> None:
        """A load-changing event from outside the step loop (a checkpoint page stored, say)."""
        self._publish(reason)

    # --- the step loop ---------------------------------------------------------------
    async def _loop(self) -> None:
        next_start = time.monotonic()
        previous = None  # (start, modeled seconds) of the step before, while busy without a break
        while True:
            now, plan = time.monotonic(), None
            if self.model_state == "serving" and self.core.next_due(now) is not None:
                plan = self.core.plan(now, lookahead=self.assist.k if self.assist is not None else 0)
            if plan is None:  # idle, loading, or no KV room for anything: wait for a change
                self._wake.clear()
                await self._wake.wait()
                next_start, previous = time.monotonic(), None
                continue
            for _ in plan.preempted:
                self._publish("preempted")
            if plan.admitted:
                self._publish("admitted")
            drafts, verified_drafts = None, 0
            assist = self.assist
            if assist is not None and plan.decode:
                # The draft node's proposals come first, the verification step after them.
                drafts = await self._drafts(assist, plan)
                if drafts:
                    verified_drafts = len(drafts) * assist.k
                next_start = max(next_start, time.monotonic())
            if self.experts is not None:
                # Decoupled MoE: every layer's experts run on the expert workers, awaited here (the per-layer
                # barrier); what the GPU does here is the attention and shared weights (below).
                try:
                    await self.experts.step({seq.request_id: (seq.state, count) for seq, count in plan.work})
                except moe.MoeError as exc:
                    # An expert with no live location for longer than the bounded wait: the step's requests fail
                    # (the gateway resumes them elsewhere from their checkpoints) and the engine goes on.
                    log.warning("%s: step failed on the expert side: %s", self.name, exc)
                    for seq, _ in plan.work:  # the engine's own sequences, as the core plans them
                        self._finish(cast(Sequence, seq), "error", {"reason": f"expert side: {exc}"})
                    await self._apply(plan, None)
                    next_start, previous = time.monotonic(), None
                    continue
                next_start = max(next_start, time.monotonic())
            began = time.monotonic()
            if previous is not None and drafts is None:
                # How long the last step really took, start to start, against the model.
                self.counters["step_actual_s"] += began - previous[0]
                self.counters["step_modeled_s"] += previous[1]
            self.step_s = self.core.step_seconds(plan, verified_drafts, "pcie" if self.faults.nvlink_down else None)
            if self.experts is not None:
                self.step_s *= moe.attention_share(self.model)
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

    async def _drafts(self, assist: Assist, plan: StepPlan) -> dict[str, list[int]] | None:
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

    async def _apply(self, plan: StepPlan, drafts: dict | None) -> None:
        """The step is over: let the core move its sequences on, then hand out what came of it."""
        step = self.core.apply(plan, time.monotonic(), drafts)
        if self.assist is not None:
            self.assist.counters.update(step.assist)
        self._outbox.extend(step.events)
        await self._deliver()
        self.steps += 1
        if step.emitted:
            self._steps_since_status += 1
        if step.prefill_progress:
            self._publish("prefill_chunk")
        elif step.emitted and self._steps_since_status >= self.config.status_every_steps:
            self._steps_since_status = 0
            self._publish("tokens")

    async def _deliver(self) -> None:
        """Hand out the outbox a slice at a time.

        Between slices the loop lets the streams write what they got, so a step
        of 256 sequences never holds the event loop for one long stretch.
        """
        delivered = 0
        while self._outbox:
            self._hand_out_one(self._outbox.popleft())
            delivered += 1
            if delivered % DELIVER_SLICE == 0:
                await asyncio.sleep(0)

    def _flush(self) -> None:
        """Hand out the whole outbox now: whatever changes a request next comes after its step's events."""
        while self._outbox:
            self._hand_out_one(self._outbox.popleft())

    def _hand_out(self, event: Finished) -> None:
        self._outbox.append(event)
        self._flush()

    def _hand_out_one(self, event: Token | BlockComplete | Finished) -> None:
        seq = cast(Sequence, event.seq)
        if isinstance(event, Token):
            seq.events.put_nowait(
                TokenEvent(event.index, event.token_id, event.text, event.logprob, event.top, time.time())
            )
        elif isinstance(event, Finished):
            self._finished(seq, event)
        elif self.streamer is not None:  # a complete KV block: a page for each holder
            for holder in seq.holders:
                self.streamer.page(holder, seq.request_id, event.block, event.token_ids)

    def _finish(self, seq: Sequence, reason: str, detail: dict | None = None) -> None:
        finished = self.core.finish(seq, reason, detail)
        if finished is not None:
            self._hand_out(finished)

    def _finished(self, seq: Sequence, event: Finished) -> None:
        reason = event.reason
        if reason != "migrated" and self.streamer is not None:
            for holder in seq.holders:  # the checkpoint is no longer needed
                self.streamer.drop(holder, seq.request_id)
        if seq.migration is not None and not seq.migration.done():
            if event.snapshot is not None:
                seq.migration.set_result(event.snapshot)
            else:
                seq.migration.set_exception(
                    EngineError(f"request {seq.request_id} ended ({reason}) before it could migrate", status=409)
                )
        seq.events.put_nowait(FinishEvent(reason, len(seq.prompt_ids), len(seq.generated), time.time(), event.detail))
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


def propose_drafts(model_key: str, k: int, items: list[dict], agreement: float | None = None) -> list[list[int]]:
    """What `model_key`'s draft model proposes: its own next token, a pure function of (draft model, context), which
    agrees with the target's with the pair's modelled agreement (catalog.Model.draft_agreement; `agreement`
    overrides it for an experiment). Acceptance is then an outcome: the target counts the drafts it verifies.

    The draft continues from its own proposals, as a real draft model does, so
    after a disagreement the rest of its proposal is rejected at verification.
    """
    target_model = catalog.model(model_key)
    if target_model.draft is None:
        raise EngineError(f"{model_key} has no catalogued draft model", 400)
    share = target_model.draft_agreement if agreement is None else agreement
    person = b"draft:" + target_model.draft.encode()[:10]  # the draft model's own function of the context
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
            digest = hashlib.blake2b(state + (position + offset).to_bytes(8, "little"), digest_size=8, person=person)
            value = digest.digest()
            agree = int.from_bytes(value, "little") / 2**64 < share
            token = target if agree else (target + 1 + value[0] % 7) % tokens.WORD_COUNT
            drafted.append(token)
            state = tokens.advance(state, token)
        proposals.append(drafted)
    return proposals
