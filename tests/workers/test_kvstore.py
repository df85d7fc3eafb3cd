"""The holder's checkpoint store: order, digests, commits, the budget and eviction."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers import catalog
from workers.checkpoint import make_page
from workers.kvstore import CheckpointStore, PageRefused

MODEL = catalog.model("Qwen3-32B")
BLOCK_BYTES = MODEL.kv_bytes_per_block  # 4 MiB accounted per 16-token page


def page(request_id, block, scale=1 / 4096):
    return make_page(request_id, block, list(range(block * 16, block * 16 + 16)), MODEL, scale)


def fill(store, request_id, blocks, commit=True):
    for b in range(blocks):
        store.put("node-a", MODEL.key, request_id, b + 1, page(request_id, b))
    if commit:
        store.commit(request_id, blocks, blocks * 16)


def test_pages_in_order_then_commit_make_a_usable_checkpoint():
    store = CheckpointStore(budget_bytes=100 * BLOCK_BYTES)
    fill(store, "r1", 3, commit=False)
    context = list(range(48)) + [999]
    assert store.usable("r1", context)[1] == 0  # nothing is usable before the commit record
    assert store.commit("r1", 3, 48) == 48
    checkpoint, restored = store.usable("r1", context)
    assert restored == 48 and checkpoint.nbytes == 3 * BLOCK_BYTES
    assert store.stats()["bytes_held"] == 3 * BLOCK_BYTES  # accounted at the real KV size
    assert len(checkpoint.pages[0].payload) == BLOCK_BYTES // 4096  # moved scaled down
    # A context that diverges inside block 1 can only use block 0.
    assert store.usable("r1", list(range(20)) + [7] * 40)[1] == 16


def test_wrong_digest_and_out_of_order_pages_are_refused_and_counted():
    store = CheckpointStore(budget_bytes=100 * BLOCK_BYTES)
    fill(store, "r1", 2)
    bad = page("r1", 2)
    bad.payload = b"x" + bad.payload[1:]
    with pytest.raises(PageRefused) as refused:
        store.put("node-a", MODEL.key, "r1", 3, bad)
    assert refused.value.reason == "digest"
    with pytest.raises(PageRefused) as refused:
        store.put("node-a", MODEL.key, "r1", 5, page("r1", 2))
    assert refused.value.reason == "order"
    assert store.counters["refused_digest"] == 1 and store.counters["refused_order"] == 1
    # The checkpoint stays at its last committed token.
    assert store.checkpoints["r1"].committed_tokens == 32
    assert store.commit("r1", 5, 80) is None  # a commit past the pages it has is ignored
    assert store.checkpoints["r1"].committed_tokens == 32


def test_budget_evicts_the_shortest_checkpointed_prefix_first():
    store = CheckpointStore(budget_bytes=6 * BLOCK_BYTES)
    fill(store, "long", 3)
    fill(store, "short", 1)
    fill(store, "mid", 2)
    # The long request grows: the shortest checkpoint makes room for it.
    store.put("node-a", MODEL.key, "long", 4, page("long", 3))
    assert set(store.checkpoints) == {"long", "mid"} and store.counters["evicted"] == 1
    store.commit("long", 4, 64)
    # Full again, and a newcomer would have the shortest prefix of all: it is refused, nothing evicted.
    with pytest.raises(PageRefused) as refused:
        store.put("node-a", MODEL.key, "newer", 1, page("newer", 0))
    assert refused.value.reason == "budget" and "newer" not in store.checkpoints
    assert store.counters["refused_budget"] == 1 and store.counters["evicted"] == 1
    assert store.bytes_held <= store.budget_bytes


def test_a_new_stream_replaces_the_old_one_and_drop_frees_memory():
    store = CheckpointStore(budget_bytes=10 * BLOCK_BYTES)
    fill(store, "r1", 3)
    store.put("node-b", MODEL.key, "r1", 1, page("r1", 0))  # seq 1 again: the request moved
    assert len(store.checkpoints["r1"].pages) == 1 and store.checkpoints["r1"].source == "node-b"
    assert store.drop("r1") and store.bytes_held == 0 and not store.drop("r1")


@given(
    st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d", "e"]), st.integers(1, 4)), max_size=40), st.integers(1, 12)
)
def test_never_over_budget(streams, budget_blocks):
    store = CheckpointStore(budget_bytes=budget_blocks * BLOCK_BYTES)
    next_block = {}
    for request_id, count in streams:
        for _ in range(count):
            block = next_block.get(request_id, 0) if request_id in store.checkpoints else 0
            try:
                store.put("n", MODEL.key, request_id, block + 1, page(request_id, block))
                next_block[request_id] = block + 1
                store.commit(request_id, block + 1, (block + 1) * 16)
            except PageRefused:
                next_block[request_id] = 0
            assert store.bytes_held <= store.budget_bytes
            assert store.bytes_held == sum(c.nbytes for c in store.checkpoints.values())


def test_a_sender_stops_only_when_no_later_page_could_be_stored():
    from workers.checkpoint import _breaks_the_stream

    store = CheckpointStore(budget_bytes=100 * BLOCK_BYTES)
    fill(store, "r1", 3, commit=False)
    refusals = []
    for seq, block in ((2, 1), (5, 4)):  # a page sent again after a retry; a page after a gap
        with pytest.raises(PageRefused) as refused:
            store.put("node-a", MODEL.key, "r1", seq, page("r1", block))
        refusals.append(
            {"request_id": "r1", "seq": seq, "reason": refused.value.reason, "expected": refused.value.expected}
        )
    assert [r["expected"] for r in refusals] == [4, 4]
    assert [_breaks_the_stream(r) for r in refusals] == [False, True]
    assert _breaks_the_stream({"request_id": "r1", "seq": 9, "reason": "budget"})
    assert not _breaks_the_stream(
        {"request_id": "r1", "seq": 9, "reason": "digest"}
    )  # only that page; a gap shows after it
