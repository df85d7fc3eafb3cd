"""The engine core on its own, and on two clocks: the real-time engine and the virtual one take the same steps."""

import asyncio
import statistics
import time
import zlib

import pytest

from workers import catalog, tokens
from workers.core import BlockComplete, EngineCore, Finished, SamplingParams, Sequence, Token, run_virtual
from workers.engine import Engine, propose_drafts
from workers.engine_api import EngineConfig, FinishEvent

DEPLOYMENT = catalog.Deployment.of("Qwen3-32B", "H100-SXM", 2)


def request(name: str, prompt_tokens: int, max_tokens: int, **sequence) -> Sequence:
    """A greedy request whose prompt is `prompt_tokens` distinct ids and whose output runs to max_tokens."""
    first = zlib.crc32(name.encode()) % 100_000 * 1000
    prompt = list(range(first, first + prompt_tokens))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Sequence(name, prompt, params, **sequence)


def reference(prompt_ids: list[int], n: int) -> list[int]:
    """The undisturbed greedy output, straight from the token function."""
    state, out = tokens.fold(tokens.initial_state(DEPLOYMENT.model.key), prompt_ids), []
    for i in range(n):
        out.append(tokens.next_token(state, i, 0.0, 0).token_id)
        state = tokens.advance(state, out[-1])
    return out


def emitted(steps, name: str) -> list[int]:
    return [e.token_id for step in steps for e in step.events if isinstance(e, Token) and e.seq.request_id == name]


def finishes(steps) -> dict[str, str]:
    return {e.seq.request_id: e.reason for step in steps for e in step.events if isinstance(e, Finished)}


# --- the core alone ----------------------------------------------------------------------------


def test_a_request_arriving_mid_decode_joins_the_running_batch_at_the_next_step():
    core = EngineCore(DEPLOYMENT)
    first, second = request("first", 40, 30), request("second", 40, 10)
    steps = run_virtual(core, [(0.0, first), (0.1, second)])
    shapes = [step.shape for step in steps]
    joined = next(i for i, step in enumerate(steps) if step.started >= 0.1)
    # Continuous batching: the newcomer's prefill rides beside the first request's decode, then both decode.
    assert shapes[joined] == (40, 0, 1, 40 + joined)
    assert shapes[joined + 1][2] == 2
    assert steps[joined - 1].ended >= 0.1 > steps[joined - 1].started
    assert finishes(steps) == {"first": "length", "second": "length"}
    assert emitted(steps, "first") == reference(first.prompt_ids, 30)
    assert emitted(steps, "second") == reference(second.prompt_ids, 10)
    assert core.used_blocks == 0 and not core.running and not core.waiting and core.next_due(9.0) is None


def test_a_long_prompt_is_prefilled_in_chunks_beside_running_decodes():
    core = EngineCore(DEPLOYMENT, max_batched_tokens=512)
    steps = run_virtual(core, [(0.0, request("short", 20, 12)), (0.0, request("long", 2000, 3))])
    prefill = [(step.shape[0], step.shape[1]) for step in steps if step.shape[0]]
    # The first step takes all of "short" (20) and the budget's rest of "long"; then what "short"'s decode leaves.
    assert prefill == [(512, 0), (511, 492), (511, 1003), (486, 1514)]
    assert [step.shape[2] for step in steps[1:4]] == [1, 1, 1]  # "short" decodes through the chunks
    assert all(step.prefill_progress for step in steps[:4])
    # Each step takes the roofline's time for its shape, and the virtual clock adds them up.
    for step in steps:
        assert step.ended - step.started == pytest.approx(DEPLOYMENT.step_s(*step.shape))
    assert steps[-1].ended == pytest.approx(sum(DEPLOYMENT.step_s(*step.shape) for step in steps))


def test_the_batch_limit_queues_requests_and_follows_the_batch_factor():
    core = EngineCore(DEPLOYMENT, max_num_seqs=4)
    core.batch_factor = 0.5
    assert core.batch_limit == 2
    seqs = [request(f"r{i}", 30, 6 + 4 * i) for i in range(4)]
    for seq in seqs:
        core.add(seq, 0.0)
    clock, batches, ended = 0.0, [], {}
    while (plan := core.plan(clock)) is not None:
        batches.append(len(plan.work))
        clock += core.step_seconds(plan)
        for event in core.apply(plan, clock).events:
            if isinstance(event, Finished):
                ended[event.seq.request_id] = clock
    assert max(batches) == 2 and len(ended) == 4
    # The third waits for a place in the batch: it comes in at the step after the first one ends.
    assert seqs[2].admitted_at == pytest.approx(ended["r0"]) and seqs[3].admitted_at == pytest.approx(ended["r1"])
    core.batch_factor = 0.01
    assert core.batch_limit == 1  # never zero: the node still serves


def test_kv_pressure_preempts_the_newest_and_recomputes_it_with_the_same_text():
    core = EngineCore(DEPLOYMENT)
    core.total_blocks = 24  # room for 384 tokens: three 100-token prompts cannot all grow to 200
    seqs = [request(f"r{i}", 100, 100) for i in range(3)]
    for seq in seqs:
        core.add(seq, 0.0)
    clock, steps, preempted = 0.0, [], []
    while (plan := core.plan(clock)) is not None:
        preempted += [seq.request_id for seq in plan.preempted]
        assert core.used_blocks <= core.total_blocks
        clock += core.step_seconds(plan)
        steps.append(core.apply(plan, clock))
    assert preempted and set(preempted) <= {"r1", "r2"}  # the newest go first; the oldest always runs
    assert core.counters["preemptions"] == len(preempted) and seqs[2].preemptions > 0
    for seq in seqs:
        assert emitted(steps, seq.request_id) == reference(seq.prompt_ids, 100)
    assert core.used_blocks == 0 and finishes(steps) == {"r0": "length", "r1": "length", "r2": "length"}


def test_finishes_free_the_kv_and_count():
    core = EngineCore(DEPLOYMENT)
    expected = tokens.decode(reference(request("stop", 8, 30).prompt_ids, 30))
    stop_word = expected.split()[4]
    stopping = request("stop", 8, 30)
    stopping.params.stop = (" " + stop_word,)
    lasting, aborted = request("length", 8, 5), request("abort", 8, 500)
    for seq in (stopping, lasting, aborted):
        core.add(seq, 0.0)
    plan = core.plan(0.0)
    core.apply(plan, 0.1)
    assert core.finish(aborted, "abort") == Finished(aborted, "abort")
    assert core.finish(aborted, "abort") is None  # once only
    steps = run_virtual(core, [], start=0.1)
    assert finishes(steps) == {"stop": "stop", "length": "length"}
    assert stopping.text == expected[: expected.index(" " + stop_word)]
    assert core.counters["requests_finished"] == 2 and core.used_blocks == 0 and core.by_id == {}


def test_each_complete_block_is_checkpointed_once_in_order():
    core = EngineCore(DEPLOYMENT, max_batched_tokens=64)
    holder = object()  # a checkpoint holder, as the driver names it
    prompt_only = request("prompt-once-prefilled", 100, 40, holders=(holder,))
    chunked = request("chunks-too", 100, 40, holders=(holder,), checkpoint_prefill_chunks=True)
    unheld = request("no-holder", 100, 40)
    steps = run_virtual(core, [(0.0, chunked), (0.0, prompt_only), (0.0, unheld)])
    pages = {}
    for index, step in enumerate(steps):
        for event in step.events:
            if isinstance(event, BlockComplete):
                pages.setdefault(event.seq.request_id, []).append((index, event.block, event.token_ids))
    assert set(pages) == {"prompt-once-prefilled", "chunks-too"}
    for seq in (prompt_only, chunked):
        # Blocks of the whole context (140 tokens: 8 full blocks), each once, in order, with its tokens.
        context = seq.prompt_ids + seq.generated
        assert [(block, ids) for _, block, ids in pages[seq.request_id]] == [
            (b, context[b * 16 : (b + 1) * 16]) for b in range(8)
        ]
    # Prefill chunks are checkpointed as they complete only when asked; otherwise once prefill is done.
    first_page = {name: pages[name][0][0] for name in pages}
    assert first_page["chunks-too"] < first_page["prompt-once-prefilled"]


def test_a_counting_core_says_a_steps_blocks_in_one_event_covering_the_same_blocks():
    """The simulator's core (token_ids=False) names a step's completed blocks of a sequence as one range: the same
    blocks, in the same steps, as a core with token ids names one event at a time."""

    def blocks_by_step(token_ids: bool) -> list[tuple[int, str, list[int]]]:
        core = EngineCore(DEPLOYMENT, max_batched_tokens=64, token_ids=token_ids)
        holder = object()
        arrivals = [
            (0.0, request("chunked", 150, 30, holders=(holder,), checkpoint_prefill_chunks=True)),
            (0.0, request("at-the-end", 100, 40, holders=(holder,))),
        ]
        out = []
        for index, step in enumerate(run_virtual(core, arrivals)):
            for event in step.events:
                if isinstance(event, BlockComplete):
                    out.append((index, event.seq.request_id, list(range(event.block, event.block + event.count))))
        return out

    counted, with_ids = blocks_by_step(False), blocks_by_step(True)
    merged: dict[tuple[int, str], list[int]] = {}
    for index, request_id, blocks in with_ids:
        assert len(blocks) == 1  # a core with token ids: one event per block, with its ids
        merged.setdefault((index, request_id), []).extend(blocks)
    assert [((i, r), b) for i, r, b in counted] == list(merged.items())
    assert any(len(blocks) > 1 for *_, blocks in counted)  # the prompt's blocks at the end of its prefill


def test_the_same_trace_takes_the_same_steps():
    def run():
        core = EngineCore(DEPLOYMENT, max_num_seqs=3, max_batched_tokens=256)
        core.total_blocks = 40
        arrivals = [(0.01 * i, request(f"r{i}", 90 + 37 * i, 20 + 11 * i)) for i in range(6)]
        steps = run_virtual(core, arrivals)
        return [(s.shape, s.started, s.ended, [(type(e).__name__, e.seq.request_id) for e in s.events]) for s in steps]

    first = run()
    assert first == run()
    assert len(first) > 20


def test_drafts_are_verified_and_the_text_does_not_change():
    core = EngineCore(DEPLOYMENT)
    seq = request("assisted", 30, 40)
    core.add(seq, 0.0)
    clock, steps = 0.0, []
    while (plan := core.plan(clock, lookahead=4)) is not None:
        items = [{"state": s.state.hex(), "position": len(s.generated)} for s in plan.decode]
        drafts = {s.request_id: p for s, p in zip(plan.decode, propose_drafts(core.model.key, 4, items, agreement=1.0))}
        clock += core.step_seconds(plan, verified_drafts=4 * len(drafts))
        steps.append(core.apply(plan, clock, drafts))
    assert emitted(steps, "assisted") == reference(seq.prompt_ids, 40)
    # A perfect draft: 1 token from prefill, then 5 a step (4 accepted plus one) to 40.
    assert len(steps) == 1 + 8 and core.counters["draft_accepted"] == core.counters["draft_tested"] == 4 * 8
    assert steps[1].assist == {
        "assist_steps": 1,
        "draft_proposed": 4,
        "draft_accepted": 4,
        "draft_tested": 4,
        "assisted_tokens": 5,
        "assisted_sequence_steps": 1,
    }


def test_a_migrating_request_stops_at_a_token_boundary_with_its_snapshot():
    core = EngineCore(DEPLOYMENT)
    seq = request("moving", 40, 100)
    core.add(seq, 0.0)
    for step in range(5):
        core.apply(core.plan(step), step + 1)
    seq.migrating = True
    result = core.apply(core.plan(5), 6)
    finished = result.events[-1]
    assert isinstance(finished, Finished) and finished.reason == "migrated" and finished.detail == {"tokens": 6}
    assert finished.snapshot.generated == reference(seq.prompt_ids, 6) and len(finished.snapshot.blocks) == 2
    assert core.used_blocks == 0 and core.counters["migrated_out"] == 1


# --- two clocks ----------------------------------------------------------------------------------

# A slower GPU than the tests' usual H100s: 60 ms decode steps, 135 ms prefill chunks. At half speed an arrival
# placed mid-step (see mid_step) is 15 ms or more from a step boundary: timer jitter on a busy host is less.
TWO_CLOCKS = catalog.Deployment.of("Qwen3-32B", "L40S", 2)
SCALE = 0.5  # the real-time run: about two seconds
# (arrival in GPU seconds, prompt tokens, output tokens): chunked prefill, mixed steps, a full batch, a queue.
TRACE = [(0.0, 700, 24), (0.15, 300, 40), (0.3, 1200, 16), (0.5, 80, 48), (0.9, 500, 30), (1.3, 150, 20)]


def two_clock_core() -> EngineCore:
    return EngineCore(TWO_CLOCKS, max_num_seqs=4, max_batched_tokens=512)


def trace_requests(trace) -> list[tuple[float, Sequence]]:
    return [(at, request(f"r{i}", prompt, output)) for i, (at, prompt, output) in enumerate(trace)]


def mid_step(trace, steps) -> list:
    """The trace with each arrival moved to the middle of the step it falls in, which changes nothing on the
    virtual clock, so that timer jitter cannot carry a real-time arrival across a step boundary."""
    moved = []
    for at, prompt, output in trace:
        step = next((s for s in steps if s.started < at < s.ended), None)
        moved.append(((step.started + step.ended) / 2 if step else at, prompt, output))
    return moved


async def run_real_time(trace) -> list:
    engine = Engine(TWO_CLOCKS, EngineConfig(time_scale=SCALE, max_num_seqs=4, max_batched_tokens=512))
    steps = []
    apply = engine.core.apply

    def recorded(plan, now, drafts=None):
        steps.append(apply(plan, now, drafts))
        return steps[-1]

    engine.core.apply = recorded
    engine.start()
    try:
        seqs, started = [], time.monotonic()
        for at, seq in trace_requests(trace):
            await asyncio.sleep(started + at * SCALE - time.monotonic())
            seqs.append(engine.submit(seq.prompt_ids, seq.params, seq.request_id))
        for seq in seqs:
            while not isinstance(await seq.events.get(), FinishEvent):
                pass
    finally:
        await engine.stop()
    return steps


async def test_the_real_time_engine_and_the_virtual_clock_take_the_same_steps():
    trace = mid_step(TRACE, run_virtual(two_clock_core(), trace_requests(TRACE)))
    virtual = run_virtual(two_clock_core(), trace_requests(trace))
    real = await run_real_time(trace)

    assert [step.shape for step in real] == [step.shape for step in virtual]
    shapes = [step.shape for step in virtual]
    assert any(p and d for p, _, d, _ in shapes) and max(d for *_, d, _ in shapes) == 4  # mixed steps, full batch
    # The trace keeps the engine busy from start to end, so each real step lasts from the end of the one
    # before (the first from its start). The step loop keeps to the model's deadlines and makes a late wake-up
    # good on the next step: one step is off by the timer's lateness (a millisecond, more on a loaded host),
    # the run as a whole is not. So the whole run is held to 5 %, not each step.
    assert all(later.started == earlier.ended for earlier, later in zip(virtual, virtual[1:]))
    ends = [real[0].started] + [step.ended for step in real]
    measured = [end - start for start, end in zip(ends, ends[1:])]
    modelled = [(step.ended - step.started) * SCALE for step in virtual]
    total_error = sum(measured) / sum(modelled) - 1
    median_error = statistics.median(abs(m / want - 1) for m, want in zip(measured, modelled))
    assert abs(total_error) < 0.05, f"{len(real)} steps: total {total_error:+.2%}, median step {median_error:.2%}"
