"""The emulated engine's scheduling core: one step at a time, on whatever clock drives it.

EngineCore holds the sequences and the paged KV cache and plans each step as
vLLM's scheduler does: running sequences first, oldest first (one token each
for decode, the next chunk for a prefill), then waiting requests while the
token budget (chunked prefill), the batch limit and free KV blocks allow.
When KV blocks run out, the most recently admitted sequence is preempted and
recomputed later. A step takes the time the roofline of workers.catalog gives
for its shape. Applying a step emits its tokens (the pure function of
workers.tokens, checked against a draft model's proposals when there are
some), the KV blocks it completed for checkpoint holders, and finishes.

The core has no clock and no event loop: time is an argument. workers.engine
drives it in real time on the asyncio loop, sleeping each step's duration
times its time scale; run_virtual drives it on a virtual clock that jumps from
step to step, for tests and the simulator. Both get the same steps.
"""

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from workers import tokens
from workers.catalog import BLOCK_TOKENS, Deployment

COUNTED_TOKEN = 0  # the id of every token an EngineCore with token_ids=False emits


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


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it (workers.engine adds the stream its tokens go out on)."""

    request_id: str
    prompt_ids: list[int] | range  # a range where the ids are consecutive (the simulator's: 36 bytes less per token)
    params: SamplingParams
    arrival: float = 0.0  # set by EngineCore.add
    generated: list[int] = field(default_factory=list)  # through an adapter, None for an id its engine did not say
    computed: int = 0  # context tokens whose KV is in the cache (a resumed request: the restored ones)
    blocks: int = 0  # KV blocks held
    state: bytes = b""  # rolling hash of the context
    text: str = ""
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished: str | None = None
    preemptions: int = 0
    holders: tuple = ()  # checkpoint holders (workers.checkpoint.Peer): blocks are checkpointed only with some
    checkpoint_prefill_chunks: bool = False
    streamed_blocks: int = 0  # complete KV blocks handed to the holders so far
    resumed_with: int = 0  # output tokens it already had when it arrived (a resumed request)
    sampling: tokens.Sampling | None = None  # the token function's filters, from params
    migrating: bool = False  # stop at the next token boundary and hand over (live migration)

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def uncomputed(self) -> int:
        return len(self.prompt_ids) + len(self.generated) - self.computed

    @property
    def in_prefill(self) -> bool:
        # Decoding means only the last sampled token still has to go through the model. (uncomputed > 1, spelled
        # out: the scheduler and the simulator ask this of every sequence at every step.)
        return len(self.prompt_ids) + len(self.generated) - self.computed > 1 or not self.generated

    def context_block(self, block: int) -> list[int]:
        start, end = block * BLOCK_TOKENS, (block + 1) * BLOCK_TOKENS
        prompt = len(self.prompt_ids)
        if end <= prompt:
            return list(self.prompt_ids[start:end])
        if start >= prompt:
            return self.generated[start - prompt : end - prompt]
        return [*self.prompt_ids[start:], *self.generated[: end - prompt]]


@dataclass
class MigrationSnapshot:
    """A request stopped at a token boundary, ready to continue elsewhere."""

    request_id: str
    prompt_ids: list[int]
    generated: list[int]
    blocks: list[list[int]]  # token ids of each complete, computed KV block


@dataclass
class StepPlan:
    """What one step computes, as the scheduler decided it at `started`."""

    work: list[tuple[Sequence, int]]  # each scheduled sequence and the tokens it computes this step
    started: float = 0.0
    admitted: list[Sequence] = field(default_factory=list)  # waiting requests this step took into the batch
    preempted: list[Sequence] = field(default_factory=list)  # running ones it sent back to wait, KV dropped
    # (prefill tokens, prefill context before, decode batch, decode context) for the timing model,
    # taken when the plan is made: applying the step moves its sequences on.
    shape: tuple[int, int, int, int] = field(init=False)

    def __post_init__(self):
        prefill_tokens = prefill_context = decode_batch = decode_context = 0
        for seq, count in self.work:
            if seq.in_prefill:
                prefill_tokens += count
                prefill_context += seq.computed
            else:
                decode_batch += 1
                decode_context += seq.context_len
        self.shape = (prefill_tokens, prefill_context, decode_batch, decode_context)

    @property
    def decode(self) -> list[Sequence]:
        return [seq for seq, _ in self.work if not seq.in_prefill]


# --- what applying a step produces, in order -------------------------------------------------


@dataclass
class Token:
    seq: Sequence
    index: int  # position in the output, from 0
    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[int, float], ...]  # the candidates asked for (params.logprobs), most likely first


@dataclass
class BlockComplete:
    """A KV block of a checkpointed sequence is complete: one page for each of its holders."""

    seq: Sequence
    block: int
    token_ids: list[int]  # empty from a core that counts tokens (token_ids False): its ids are placeholders
    count: int = 1  # blocks block .. block + count - 1: a core that counts tokens says a prefill's blocks in one event


@dataclass
class Finished:
    seq: Sequence
    reason: str  # "stop", "length", "abort", "migrated" or "error"
    detail: dict | None = None
    snapshot: MigrationSnapshot | None = None  # for "migrated"


@dataclass
class StepResult:
    shape: tuple[int, int, int, int]  # the plan's
    started: float
    ended: float
    events: list[Token | BlockComplete | Finished] = field(default_factory=list)
    emitted: bool = False  # some sequence produced a token
    prefill_progress: bool = False  # some prefill chunk was computed
    assist: Counter = field(default_factory=Counter)  # speculative verification's figures for this step


class EngineCore:
    """The scheduler, the KV block pool and the token function of one emulated node, with no clock.

    A driver loops: plan(now) a step, wait step_seconds(plan) on its clock,
    apply(plan, now) it and hand the events on; next_due(now) says whether
    another step is due.
    """

    def __init__(
        self,
        deployment: Deployment,
        max_num_seqs: int = 128,
        max_batched_tokens: int = 2048,
        *,
        name: str = "node",
        checkpoints: bool = True,
        corrupt: Callable[[bytes, int, tokens.Choice], tokens.Choice] | None = None,
        token_ids: bool = True,
    ):
        self.deployment = deployment
        self.model = deployment.model
        self.max_num_seqs = max_num_seqs  # batch limit
        self.max_batched_tokens = max_batched_tokens  # token budget per step (chunked prefill)
        self.name = name
        self.checkpoints = checkpoints  # whether completed blocks go to holders (the node streams checkpoints)
        self.corrupt = corrupt  # fault injection: silent data corruption of a chosen token (workers.faults)
        # False: tokens are counted, not computed (each is COUNTED_TOKEN, no text): the simulator's fast path,
        # where a fleet's timing is wanted and hashing every context token would cost most of the run.
        self.token_ids = token_ids
        self.total_blocks = deployment.kv_blocks
        self.used_blocks = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        # The share of max_num_seqs admitted at once, lowered to relieve a struggling node.
        self.batch_factor = 1.0
        self.counters: dict[str, float] = {
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "requests_finished": 0,
            "preemptions": 0,
            "migrated_out": 0,
            "assist_steps": 0,
            "draft_proposed": 0,
            "draft_accepted": 0,
            "draft_tested": 0,
            "assisted_tokens": 0,
            "assisted_sequence_steps": 0,
        }

    @property
    def batch_limit(self) -> int:
        """Sequences admitted into the running batch at most: max(1, floor(max_num_seqs x batch_factor))."""
        # The small epsilon keeps 100 x 0.29 at 29, not the 28.999... a float product gives.
        return max(1, math.floor(self.max_num_seqs * self.batch_factor + 1e-9))

    def blocks_for(self, tokens_: int) -> int:
        return math.ceil(tokens_ / BLOCK_TOKENS)

    # --- requests ------------------------------------------------------------------------
    def add(self, seq: Sequence, now: float) -> None:
        """Queue a request that arrived at `now`.

        A resumed request comes with the output it already has (seq.generated)
        and the context tokens whose KV was restored (seq.computed); it has
        stalled once already, so it goes ahead of new arrivals.
        """
        if not seq.prompt_ids:
            raise EngineError("the prompt is empty", status=400)
        needed = self.blocks_for(len(seq.prompt_ids) + seq.params.max_tokens)
        if needed > self.total_blocks:
            # It would prefill, run out of KV, preempt itself and start over, forever: refuse it instead.
            raise EngineError(
                f"the request needs {needed} KV blocks "
                f"({len(seq.prompt_ids)} prompt + {seq.params.max_tokens} output tokens) and "
                f"{self.name} has {self.total_blocks}: shorten it to {self.total_blocks * BLOCK_TOKENS} tokens in all",
                status=400,
            )
        if seq.request_id in self.by_id:
            raise EngineError(f"request id {seq.request_id!r} is already running on this node")
        if not self.token_ids and not (seq.params.ignore_eos and not seq.params.stop):
            raise ValueError("a core that counts tokens runs each request to max_tokens: set ignore_eos, no stop")
        seq.arrival = now
        seq.sampling = seq.params.sampling
        seq.resumed_with = len(seq.generated)
        if self.token_ids:
            seq.state = tokens.fold(tokens.initial_state(self.model.key), [*seq.prompt_ids, *seq.generated])
            seq.text = tokens.decode(seq.generated)
        self.by_id[seq.request_id] = seq
        if seq.generated:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        self.counters["prompt_tokens"] += len(seq.prompt_ids)

    def finish(self, seq: Sequence, reason: str, detail: dict | None = None) -> Finished | None:
        """End `seq` (aborted, failed) and free its KV; None if it had ended already."""
        if seq.finished is not None:
            return None
        return self._end(seq, reason, detail)

    def migrate(self, seq: Sequence) -> Finished:
        """Stop `seq` at this token boundary for a live migration; the snapshot rides on its finish."""
        complete = seq.computed // BLOCK_TOKENS
        snapshot = MigrationSnapshot(
            seq.request_id, list(seq.prompt_ids), list(seq.generated), [seq.context_block(b) for b in range(complete)]
        )
        self.counters["migrated_out"] += 1
        return self._end(seq, "migrated", {"tokens": len(seq.generated)}, snapshot)

    def _end(
        self, seq: Sequence, reason: str, detail: dict | None = None, snapshot: MigrationSnapshot | None = None
    ) -> Finished:
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
        return Finished(seq, reason, detail, snapshot)

    # --- steps ---------------------------------------------------------------------------
    def next_due(self, now: float) -> float | None:
        """When the next step is due: `now` while any sequence runs or waits (a GPU with work does not
        idle between steps), None when there is nothing to do until a request arrives."""
        return now if self.running or self.waiting else None

    def plan(self, now: float, lookahead: int = 0) -> StepPlan | None:
        """Schedule the step that starts at `now`; None when nothing can run.

        `lookahead` reserves KV room for that many drafted tokens per decoding
        sequence (speculative verification). Planning takes KV blocks, admits
        and preempts: apply the plan before planning again.
        """
        budget = self.max_batched_tokens
        work: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        reserve = 1 + lookahead
        # 1. Running sequences, oldest first; preempt the newest when KV runs out.
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            prefilling = seq.in_prefill
            want = min(seq.uncomputed, budget) if prefilling else 1
            if want <= 0:
                index += 1
                continue
            room = want if prefilling else reserve
            while not self._grow(seq, room):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                break
            work.append((seq, want))
            budget -= want
            index += 1
        # 2. Admit waiting requests while the batch, the budget and free blocks allow.
        admitted: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.batch_limit:
            seq = self.waiting[0]
            chunk = min(seq.uncomputed, budget)
            if not self._grow(seq, chunk):
                break
            self.waiting.popleft()
            self.running.append(seq)
            if seq.admitted_at is None:
                seq.admitted_at = now
            work.append((seq, chunk))
            budget -= chunk
            admitted.append(seq)
        if not work:
            return None
        return StepPlan(work, now, admitted, preempted)

    def step_seconds(self, plan: StepPlan, verified_drafts: int = 0, tp_link: str | None = None) -> float:
        """The step's time on the GPU, from the roofline (a driver applies its time scale and slowdowns).

        `verified_drafts` drafted tokens are checked in the same pass; `tp_link`
        is the tensor-parallel group's link when it is not the GPU's own (an NVLink down).
        """
        prefill_tokens, prefill_context, decode_batch, decode_context = plan.shape
        # Verifying k drafts costs one pass over k+1 query tokens per assisted sequence:
        # more FLOPs, the same weight bytes, so a memory-bound step grows only a little.
        decode_batch += verified_drafts
        return self.deployment.step_s(prefill_tokens, prefill_context, decode_batch, decode_context, tp_link)

    def apply(self, plan: StepPlan, now: float, drafts: dict[str, list[int]] | None = None) -> StepResult:
        """The step planned at plan.started ends at `now`: move its sequences on and say what came out.

        `drafts` maps request ids to the tokens a draft model proposed for
        them; those are verified, and the accepted ones emitted with one more.
        """
        result = StepResult(plan.shape, plan.started, now)
        if drafts:
            self._count_assist(result, assist_steps=1)
        for seq, count in plan.work:
            if seq.finished is not None:
                continue  # aborted or failed while the step ran
            was_prefill = seq.in_prefill
            seq.computed += count
            if seq.computed < len(seq.prompt_ids) + len(seq.generated):  # context_len, at every sequence's step
                result.prefill_progress = True  # a chunk finished, more to go
                self._complete_blocks(seq, result)
                continue
            if was_prefill:
                result.prefill_progress = True
            proposal = drafts.get(seq.request_id) if drafts and not was_prefill else None
            if proposal is None:
                self._emit_next(seq, now, result)
            else:
                self._emit_verified(seq, proposal, now, result)
            result.emitted = True
            self._complete_blocks(seq, result)
            if seq.migrating and seq.finished is None:
                result.events.append(self.migrate(seq))
        return result

    # --- inside a step -------------------------------------------------------------------
    def _emit_verified(self, seq: Sequence, proposal: list[int], now: float, result: StepResult) -> None:
        """Accept drafted tokens left to right while they match the target; emit them plus one."""
        state, accepted = seq.state, 0
        for offset, drafted in enumerate(proposal):
            if not self.token_ids:
                target = COUNTED_TOKEN  # a core that counts tokens has every one COUNTED_TOKEN
            else:
                target = tokens.next_token(
                    state, len(seq.generated) + offset, seq.params.temperature, seq.params.seed, seq.sampling
                ).token_id
            if drafted != target:
                break
            accepted += 1
            state = tokens.advance(state, target)
        # Drafts after the first mismatch are never tested: alpha is accepted over tested.
        self._count_assist(
            result,
            draft_proposed=len(proposal),
            draft_accepted=accepted,
            draft_tested=accepted + (1 if accepted < len(proposal) else 0),
        )
        before = len(seq.generated)
        for _ in range(accepted + 1):
            self._emit_next(seq, now, result)
            if seq.finished is not None:
                break
        made = len(seq.generated) - before
        self._count_assist(result, assisted_tokens=made, assisted_sequence_steps=1)
        # The accepted drafts went through the model in the verification pass.
        seq.computed += made - 1

    def _count_assist(self, result: StepResult, **figures: int) -> None:
        for key, value in figures.items():
            self.counters[key] += value
            result.assist[key] += value

    def _emit_next(self, seq: Sequence, now: float, result: StepResult) -> None:
        params = seq.params
        if not self.token_ids:
            seq.generated.append(COUNTED_TOKEN)
            if seq.first_token_at is None:
                seq.first_token_at = now
            self.counters["generation_tokens"] += 1
            result.events.append(Token(seq, len(seq.generated) - 1, COUNTED_TOKEN, "", 0.0, ()))
            if len(seq.generated) >= params.max_tokens:
                result.events.append(self._end(seq, "length"))
            return
        choice = tokens.next_token(seq.state, len(seq.generated), params.temperature, params.seed, seq.sampling)
        if self.corrupt is not None:
            choice = self.corrupt(seq.state, len(seq.generated), choice)
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
        result.events.append(Token(seq, len(seq.generated) - 1, choice.token_id, text, choice.logprob, top))
        if reason is None and len(seq.generated) >= params.max_tokens:
            reason = "length"
        if reason is not None:
            result.events.append(self._end(seq, reason))

    def _complete_blocks(self, seq: Sequence, result: StepResult) -> None:
        """Note the KV blocks `seq` completed, one event each, for its checkpoint holders."""
        if not seq.holders or not self.checkpoints or seq.finished is not None:
            return  # a finished request's checkpoint was dropped: nothing more goes out
        if seq.in_prefill and not seq.checkpoint_prefill_chunks:
            return  # the prompt's blocks go once prefill is done, unless chunks are checkpointed
        complete = seq.computed // BLOCK_TOKENS
        if complete <= seq.streamed_blocks:
            return
        if self.token_ids:
            blocks = range(seq.streamed_blocks, complete)
            result.events += [BlockComplete(seq, block, seq.context_block(block)) for block in blocks]
        else:
            # A core that counts tokens has no ids to give, so a prefill's hundred blocks are one event (its driver,
            # the simulator, reads how many completed).
            result.events.append(BlockComplete(seq, seq.streamed_blocks, [], complete - seq.streamed_blocks))
        seq.streamed_blocks = complete

    # --- the KV block pool ---------------------------------------------------------------
    def _grow(self, seq: Sequence, new_tokens: int) -> bool:
        """Reserve blocks for `new_tokens` more computed tokens of `seq`."""
        need = self.blocks_for(seq.computed + new_tokens) - seq.blocks
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


def run_virtual(
    core: EngineCore, arrivals: Iterable[tuple[float, Sequence]], start: float = 0.0, tp_link: str | None = None
) -> list[StepResult]:
    """Drive `core` on a virtual clock until every request has finished; return its steps in order.

    `arrivals` are (time, sequence) pairs. Each step takes its roofline time
    and no wall time at all; a request that arrives while a step runs joins at
    the next, as on the real-time engine, and an idle core waits for the next
    arrival.
    """
    pending = deque(sorted(arrivals, key=lambda arrival: arrival[0]))
    clock = start
    steps: list[StepResult] = []
    while True:
        while pending and pending[0][0] <= clock:
            at, seq = pending.popleft()
            core.add(seq, at)
        plan = core.plan(clock) if core.next_due(clock) is not None else None
        if plan is None:
            if not pending:
                return steps
            clock = max(clock, pending[0][0])
            continue
        clock += core.step_seconds(plan, tp_link=tp_link)
        steps.append(core.apply(plan, clock))
