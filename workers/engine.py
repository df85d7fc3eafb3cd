"""The emulated GPU engine: continuous batching timed by the roofline model.

One asyncio task runs the step loop. Each step it schedules running decode
sequences (one token each), continues chunked prefills, and admits waiting
requests while the token budget, the batch limit and free KV blocks allow.
It then sleeps for the time the step would take on the catalogued GPU and
emits the tokens the step produced. When KV blocks run out, the most recently
admitted sequence is preempted and recomputed later, as vLLM does.
"""

import asyncio
import logging
import math
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from workers import tokens
from workers.aio import cancel
from workers.catalog import BLOCK_TOKENS, Deployment

log = logging.getLogger(__name__)


class EngineError(Exception):
    pass


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # number of top candidates to report, None for none


@dataclass
class TokenEvent:
    index: int  # position in the output, from 0
    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[int, float], ...]
    at: float


@dataclass
class FinishEvent:
    reason: str  # "stop", "length" or "abort"
    prompt_tokens: int
    completion_tokens: int
    at: float


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    generated: list[int] = field(default_factory=list)
    computed: int = 0  # context tokens whose KV is in the cache
    blocks: int = 0  # KV blocks held
    state: bytes = b""  # rolling hash of the context
    text: str = ""
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished: str | None = None
    preemptions: int = 0
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


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 128  # batch limit
    max_batched_tokens: int = 2048  # token budget per step (chunked prefill)
    time_scale: float = 1.0  # multiplies every emulated duration; 0.5 runs twice as fast
    status_every_steps: int = 4  # push a status after this many token-emitting steps


class Engine:
    def __init__(self, deployment: Deployment, config: EngineConfig | None = None, name: str = "node"):
        self.deployment = deployment
        self.model = deployment.model
        self.config = config or EngineConfig()
        self.name = name
        self.total_blocks = deployment.kv_blocks
        self.used_blocks = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.model_state = "serving"
        self.step_s = 0.0  # emulated duration of the last step, before time scale
        self.steps = 0
        self.status_seq = 0
        self.counters = {
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "requests_finished": 0,
            "preemptions": 0,
        }
        self._wake = asyncio.Event()
        self._subscribers: set[asyncio.Queue] = set()
        self._task: asyncio.Task | None = None
        self._steps_since_status = 0

    # --- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"engine-{self.name}")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
        for seq in list(self.by_id.values()):
            self._finish(seq, "abort")

    # --- requests ----------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        if not prompt_ids:
            raise EngineError("the prompt is empty")
        request_id = request_id or f"req-{uuid.uuid4().hex[:20]}"
        if request_id in self.by_id:
            raise EngineError(f"request id {request_id!r} is already running on this node")
        seq = Sequence(request_id, list(prompt_ids), params, arrival=time.monotonic())
        seq.state = tokens.fold(tokens.initial_state(self.model.key), seq.prompt_ids)
        self.by_id[request_id] = seq
        self.waiting.append(seq)
        self.counters["prompt_tokens"] += len(prompt_ids)
        self._publish("arrival")
        self._wake.set()
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.by_id.get(request_id)
        if seq is not None and seq.finished is None:
            self._finish(seq, "abort")
            self._publish("finished")

    # --- status --------------------------------------------------------------------
    def status(self) -> dict:
        decode = [s for s in self.running if not s.in_prefill]
        uncomputed_prefill = sum(s.uncomputed for s in self.running if s.in_prefill) + sum(
            s.uncomputed for s in self.waiting
        )
        return {
            "seq": self.status_seq,
            "at": time.time(),
            "model_state": self.model_state,
            "waiting": len(self.waiting),
            "running": len(self.running),
            "uncomputed_prefill_tokens": uncomputed_prefill,
            "decode_batch": len(decode),
            "decode_context_tokens": sum(s.context_len for s in decode),
            "kv_blocks_used": self.used_blocks,
            "kv_blocks_total": self.total_blocks,
            "step_ms": round(self.step_s * 1000, 3),
        }

    def subscribe(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(maxsize=256)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    def _publish(self, reason: str) -> None:
        self.status_seq += 1
        if not self._subscribers:
            return
        status = self.status()
        status["reason"] = reason
        for queue in list(self._subscribers):
            if queue.full():  # a slow subscriber loses old statuses, never blocks the engine
                try:
                    queue.get_nowait()
                except asyncio.QueueEmpty:
                    pass
            queue.put_nowait(status)

    # --- the step loop ---------------------------------------------------------------
    async def _loop(self) -> None:
        next_start = time.monotonic()
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                next_start = time.monotonic()
            plan = self._schedule()
            if plan is None:  # nothing could be scheduled (no KV room); wait for a change
                self._wake.clear()
                await self._wake.wait()
                next_start = time.monotonic()
                continue
            self.step_s = self.deployment.step_s(*plan.shape)
            # Deadline-based sleep: the loop's own overhead does not stretch the step.
            next_start += self.step_s * self.config.time_scale
            delay = next_start - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                next_start = time.monotonic()
                await asyncio.sleep(0)
            self._apply(plan)

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
        # 1. Running sequences, oldest first; preempt the newest when KV runs out.
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            want = 1 if not seq.in_prefill else min(seq.uncomputed, budget)
            if want <= 0:
                index += 1
                continue
            while not self._grow(seq, want):
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
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
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

    def _apply(self, plan: "StepPlan") -> None:
        now = time.monotonic()
        emitted = False
        prefill_done = False
        for seq, count in plan.work:
            if seq.finished is not None or seq not in self.running:
                continue  # aborted or preempted while the step ran
            was_prefill = seq.in_prefill
            seq.computed += count
            if seq.computed < seq.context_len:
                prefill_done = True  # a chunk finished, more to go
                continue
            if was_prefill:
                prefill_done = True
            self._emit_next(seq, now)
            emitted = True
        self.steps += 1
        if emitted:
            self._steps_since_status += 1
        if prefill_done:
            self._publish("prefill_chunk")
        elif emitted and self._steps_since_status >= self.config.status_every_steps:
            self._steps_since_status = 0
            self._publish("tokens")

    def _emit_next(self, seq: Sequence, now: float) -> None:
        params = seq.params
        choice = tokens.next_token(seq.state, len(seq.generated), params.temperature, params.seed)
        previous = seq.generated[-1] if seq.generated else None
        seq.generated.append(choice.token_id)
        seq.state = tokens.advance(seq.state, choice.token_id)
        if seq.first_token_at is None:
            seq.first_token_at = now
        self.counters["generation_tokens"] += 1
        text = tokens.piece(choice.token_id, previous)
        reason = None
        if choice.token_id == tokens.EOS:
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
        top = choice.top[: params.logprobs] if params.logprobs else ()
        seq.events.put_nowait(TokenEvent(index, choice.token_id, text, choice.logprob, top, time.time()))
        if reason is None and len(seq.generated) >= params.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
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
        if reason != "abort":
            self.counters["requests_finished"] += 1
        seq.events.put_nowait(FinishEvent(reason, len(seq.prompt_ids), len(seq.generated), time.time()))
        self._publish("finished")
        self._wake.set()


@dataclass
class StepPlan:
    work: list[tuple[Sequence, int]]

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
