"""The reading both gateways share when they plan a lost node's requests (recovery.policy.recovery)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recovery.policy import dispatch, recovery
from recovery.policy.load import NodeStatus
from workers.catalog import BLOCK_TOKENS, Deployment, Placement

H100 = Deployment.of("Qwen3-32B", "H100-SXM", 2)
FAST = Deployment.of("Llama-3-8B", "H100-SXM", 8)


# --- the checkpointed prefix ------------------------------------------------------------------


def test_a_request_without_holders_has_no_checkpoint():
    assert recovery.checkpointed_estimate((), True, 4000, True) == 0


def test_before_its_first_token_only_checkpointed_prefill_chunks_count():
    assert recovery.checkpointed_estimate(("h",), False, 4000, False) == 0
    assert recovery.checkpointed_estimate(("h",), False, 4000, True) == (4000 // BLOCK_TOKENS - 1) * BLOCK_TOKENS


def test_the_last_whole_block_may_still_be_in_transit():
    assert recovery.checkpointed_estimate(("h",), True, 3 * BLOCK_TOKENS, False) == 2 * BLOCK_TOKENS
    assert recovery.checkpointed_estimate(("h",), True, 3 * BLOCK_TOKENS + 5, False) == 2 * BLOCK_TOKENS
    assert recovery.checkpointed_estimate(("h",), True, BLOCK_TOKENS - 1, False) == 0


@settings(max_examples=80, deadline=None)
@given(
    holders=st.lists(st.sampled_from("abc"), max_size=2),
    has_output=st.booleans(),
    context=st.integers(0, 200_000),
    chunks=st.booleans(),
)
def test_the_estimate_is_whole_blocks_never_the_whole_context(holders, has_output, context, chunks):
    estimate = recovery.checkpointed_estimate(holders, has_output, context, chunks)
    assert estimate % BLOCK_TOKENS == 0
    assert 0 <= estimate <= max(context - 1, 0)


# --- free blocks --------------------------------------------------------------------------------


def test_a_node_that_reports_no_free_block_is_full_not_empty():
    assert recovery.free_blocks(NodeStatus(kv_blocks_total=1000, kv_blocks_used=1000), H100) == 0
    assert recovery.free_blocks(NodeStatus(kv_blocks_total=1000, kv_blocks_used=400), H100) == 600


def test_a_node_that_has_not_said_has_its_whole_cache():
    assert recovery.free_blocks(NodeStatus(), H100) == H100.kv_blocks


def test_more_used_than_total_reads_as_full():
    assert recovery.free_blocks(NodeStatus(kv_blocks_total=10, kv_blocks_used=12), H100) == 0


def test_a_survivor_keeps_its_place_in_the_fabric():
    where = Placement("r2", "dgx-1", "nvl-a", "roce", nvlink_down=True)
    status = NodeStatus(kv_blocks_total=100, kv_blocks_used=30)
    s = recovery.survivor("w", where, 3.5, status, H100)
    assert (s.name, s.rack, s.l_hat, s.free_blocks, s.deployment) == ("w", "r2", 3.5, 70, H100)
    assert s.placement == where


# --- the plan -----------------------------------------------------------------------------------


def idle(*names: str, deployment: Deployment = H100) -> dict[str, dispatch.Survivor]:
    return {n: dispatch.Survivor(n, "r1", 0.0, 100_000, deployment) for n in names}


def test_the_plan_is_plan_recovery_with_theta_from_the_survivors():
    survivors = idle("a", "b", "c")
    survivors["a"].l_hat, survivors["b"].l_hat = 30.0, 6.0
    stranded = [dispatch.Interrupted(f"r{i}", ("a",), 256, 300) for i in range(4)]
    got = recovery.plan(stranded, survivors, {"x"}, 2.0, 512, 1.0, 1.0)
    theta = dispatch.theta_for([30.0, 6.0, 0.0], 2.0)
    assert got == dispatch.plan_recovery(stranded, survivors, {"x"}, theta, 512, 1.0, 1.0)
    assert got[0].target == "c"  # holder a (L̂ 30) is above θ (24) and the prefix short: the least loaded takes it


def test_an_infinite_theta_factor_sends_every_request_to_its_holder_even_on_an_idle_fleet():
    """DéjàVu's dispatch: θ is infinite, not NaN (∞ × a mean of 0), which theta_for would floor to 1."""
    stranded = [dispatch.Interrupted(f"r{i}", ("a",), 256, 300) for i in range(3)]
    always = recovery.plan(stranded, idle("a", "b", "c"), {"x"}, math.inf, 512, 1.0, 1.0)
    assert [(d.target, d.method) for d in always] == [("a", "restore")] * 3
    spread = recovery.plan(stranded, idle("a", "b", "c"), {"x"}, 2.0, 512, 1.0, 1.0)
    assert {d.target for d in spread} == {"a", "b", "c"}


def test_a_fetch_comes_from_the_holder_the_survivor_shares_an_nvlink_domain_with():
    """The survivor's fabric place reaches the plan: the fetch source is the holder over NVLink, not the spine."""
    context = 8192
    survivors = {
        "h1": dispatch.Survivor("h1", "r1", 90.0, 100_000, FAST),
        "h2": recovery.survivor("h2", Placement("r3", nvl_domain="nvl-a"), 80.0, NodeStatus(), FAST),
        "w": recovery.survivor("w", Placement("r2", nvl_domain="nvl-a"), 0.0, NodeStatus(), FAST),
    }
    stranded = [dispatch.Interrupted("r", ("h1", "h2"), context - BLOCK_TOKENS, context)]
    # τ above the prefix: the overloaded holder does not restore it, the least loaded survivor takes it.
    (decision,) = recovery.plan(stranded, survivors, {"x"}, 1.0, context, 1.0, 1.0)
    assert (decision.target, decision.method, decision.source) == ("w", "fetch", "h2")


def test_no_survivor_is_said_plainly():
    stranded = [dispatch.Interrupted("r", (), 0, 100)]
    with pytest.raises(dispatch.NoSurvivors, match="no surviving node"):
        recovery.plan(stranded, {}, {"x"}, 2.0, 512, 1.0, 1.0)


# --- the soonest plan (an experiment beside eq. 6) ------------------------------------------------------------


def soonest_fleet(**backlog: int) -> tuple[dict, dict]:
    """Idle H100 pairs in one rack, each with `backlog[name]` prefill tokens queued."""
    statuses = {n: NodeStatus(uncomputed_prefill_tokens=t, kv_blocks_total=10_000) for n, t in backlog.items()}
    survivors = {n: recovery.survivor(n, Placement("r1"), 0.0, s, H100) for n, s in statuses.items()}
    return survivors, statuses


def test_a_restored_request_leaves_a_holder_with_a_long_queue_for_an_idle_node():
    """Eq. 6 restores on the holder (its L̂ is 0, under any θ); the holder's 40,000 queued prefill tokens hold the
    request for seconds, an idle node is a KV transfer away."""
    survivors, statuses = soonest_fleet(h=40_000, idle=0)
    stranded = [dispatch.Interrupted("r", ("h",), 2048, 2100)]
    (eq6,) = recovery.plan(stranded, survivors, {"x"}, 2.0, 512, 1.0, 1.0)
    assert (eq6.target, eq6.method) == ("h", "restore")
    (soonest,) = recovery.plan_soonest(stranded, survivors, statuses, {"x"})
    assert (soonest.target, soonest.method, soonest.source) == ("idle", "fetch", "h")
    assert "next token soonest: fetch on idle" in soonest.reason


def test_an_idle_holder_restores_and_a_request_without_a_copy_re_prefills_where_it_is_soonest():
    survivors, statuses = soonest_fleet(h=0, busy=40_000, idle=0)
    stranded = [dispatch.Interrupted("a", ("h",), 2048, 2100), dispatch.Interrupted("b", (), 0, 2100)]
    first, second = recovery.plan_soonest(stranded, survivors, statuses, {"x"})
    assert (first.target, first.method, first.source) == ("h", "restore", "h")
    assert (second.target, second.method) == ("idle", "reprefill")  # h has a's tail queued now; busy its backlog


def test_a_soonest_plan_spreads_requests_by_the_work_it_already_gave():
    survivors, statuses = soonest_fleet(a=0, b=0, c=0)
    stranded = [dispatch.Interrupted(f"r{i}", (), 0, 4000) for i in range(3)]
    assert {d.target for d in recovery.plan_soonest(stranded, survivors, statuses, {"x"})} == {"a", "b", "c"}


def test_a_soonest_plan_with_no_survivor_says_so():
    with pytest.raises(dispatch.NoSurvivors, match="no surviving node"):
        recovery.plan_soonest([dispatch.Interrupted("r", (), 0, 100)], {}, {}, {"x"})
