"""The recovery policies: load (documents 002, 000 eq. 4), checkpoint placement (000 Algorithm 1,
eq. 5), recovery dispatch (000 eq. 6, Algorithm 2, document 003's migration cost) and
progressive recovery (000 Algorithm 3, eq. 3). Pure functions, small hand-built clusters."""

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recovery.policy import dispatch, load, placement, progressive
from recovery.policy.dispatch import Interrupted, Survivor
from recovery.policy.load import NodeStatus, Pending
from recovery.policy.placement import HolderCandidate
from workers import catalog
from workers.catalog import Deployment

H100 = Deployment.of("Qwen3-32B", "H100-SXM", 2)
H200 = Deployment.of("Qwen3-32B", "H200-SXM", 2)
SMALL = Deployment.of("Llama-3-8B", "H100-SXM", 1)
MOE = Deployment.of("Mixtral-8x7B", "H100-SXM", 2)
ONE_H100 = Deployment.of("Qwen3-32B", "H100-SXM", 1)  # ~24k tokens of KV: the decode-load term weighs
TIGHT = Deployment.of("Llama-3-70B", "H100-SXM", 2)  # ~8.5k tokens of KV: the term can dominate
NOW = 1_700_000_000.0

fast = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- load: statuses, pending work, prediction ---------------------------------------------


def test_status_from_event_ignores_extra_keys_and_reads_none_as_zero():
    event = {"seq": 7, "at": NOW, "model_state": None, "waiting": None, "decode_batch": 3, "step_ms": 12.5}
    status = NodeStatus.from_event({**event, "assist": {"k": 4}, "load_progress": 1.0})
    assert status == NodeStatus(seq=7, at=NOW, decode_batch=3, step_ms=12.5)
    assert status.model_state == "serving" and status.waiting == 0
    assert NodeStatus.from_event({}) == NodeStatus()
    assert NodeStatus.from_event({"model_state": "loading_full"}).model_state == "loading_full"


def test_status_from_event_names_a_bad_field():
    with pytest.raises(ValueError, match="decode_batch"):
        NodeStatus.from_event({"decode_batch": "many"})


def test_pending_counts_dispatches_and_never_goes_below_zero():
    pending = Pending()
    pending.add(100)
    pending.add(50)
    assert pending == Pending(requests=2, prompt_tokens=150)
    pending.confirm(100)
    assert pending == Pending(requests=1, prompt_tokens=50)
    pending.confirm(500)
    pending.confirm(500)
    assert pending == Pending(0, 0)


def test_a_fresh_status_predicts_unchanged():
    status = NodeStatus(
        at=NOW, uncomputed_prefill_tokens=3000, decode_batch=10, decode_context_tokens=20_000, step_ms=30
    )
    assert load.predict(status, NOW, H100) == status
    # a status from the node's future (clock skew) is not run backwards
    assert load.predict(status, NOW - 1, H100) == dataclasses.replace(status, at=NOW - 1)


def test_a_stale_status_predicts_less_prefill_and_more_decode_context():
    status = NodeStatus(
        at=NOW, uncomputed_prefill_tokens=5000, decode_batch=10, decode_context_tokens=20_000, step_ms=30
    )
    later = load.predict(status, NOW + 0.045, H100)  # a step and a half
    assert later.at == NOW + 0.045
    assert later.uncomputed_prefill_tokens == 5000 - 3072  # 1.5 chunks of 2048
    assert (
        later.decode_context_tokens == 20_000 + 3072 + 15
    )  # the prompt tokens computed, and ten sequences 1.5 tokens each
    assert load.prefill_load(later) < load.prefill_load(status)
    assert load.decode_load(later) > load.decode_load(status)
    # prefill finishes, it does not go negative
    assert load.predict(status, NOW + 10, H100).uncomputed_prefill_tokens == 0


def test_prediction_without_a_reported_step_time_uses_the_roofline():
    status = NodeStatus(at=NOW, uncomputed_prefill_tokens=4096, decode_batch=4, decode_context_tokens=4000)
    step = H100.decode_step_s(4, 4000)
    later = load.predict(status, NOW + 2 * step, H100)
    assert later.uncomputed_prefill_tokens == 0
    assert later.decode_context_tokens == 4000 + 4096 + 8


def test_requests_prefilling_join_the_decode_batch_once_their_prefill_is_predicted_done():
    """Six requests just admitted, all still in prefill: once the window covers their prefill they
    decode, so the node never looks as idle as an empty one (it did when prefill simply vanished)."""
    busy = NodeStatus(at=NOW, running=6, uncomputed_prefill_tokens=2400, decode_batch=0)
    idle = NodeStatus(at=NOW)
    later = load.predict(busy, NOW + 0.2, H100)
    assert later.uncomputed_prefill_tokens == 0 and later.decode_batch == 6 and later.decode_context_tokens >= 2400
    nodes = {"a": (busy, Pending(), H100, 1.0), "b": (idle, Pending(), H100, 1.0)}
    assert load.routing_cost(later, Pending(), H100, 4) > load.routing_cost(
        load.predict(idle, NOW + 0.2, H100), Pending(), H100, 4
    )
    assert load.choose_node(nodes, 4, NOW + 0.2) == "b" == load._plain_choose_node(nodes, 4, NOW + 0.2)
    # still prefilling: they have not joined yet, the prefill queue carries them
    assert load.predict(busy, NOW + 0.001, H100).decode_batch == 0


def test_load_metrics_follow_document_002():
    status = NodeStatus(uncomputed_prefill_tokens=700, decode_batch=12, decode_context_tokens=9000, kv_blocks_used=900)
    assert load.prefill_load(status) == 700
    assert load.decode_load(status) == 12 + 9000


def test_routing_cost_counts_pending_work_and_compares_gpus():
    status = NodeStatus(at=NOW, decode_batch=20, decode_context_tokens=30_000, waiting=2)
    idle = load.routing_cost(status, Pending(), H100, 1000)
    load_term = H100.decode_step_s(1, 0) * (23 + 31_000) / H100.kv_capacity_tokens
    assert idle == H100.prefill_s(1000) + H100.decode_step_s(23, 31_000) + load_term
    assert load.routing_cost(status, Pending(3, 3000), H100, 1000) > idle
    # the same load costs less on faster memory
    assert load.routing_cost(status, Pending(), H200, 1000) < idle


def _idle_step_share(deployment, decode_load):
    return deployment.decode_step_s(1, 0) * decode_load / deployment.kv_capacity_tokens


def test_routing_cost_counts_document_002s_decode_load():
    """At small batches a decode step is one pass over the weights, about the same at batch 1
    and batch 7: the roofline alone barely tells a node running six long requests from an
    identical idle one. The decode load, over the node's KV capacity, does."""
    busy = NodeStatus(at=NOW, running=6, decode_batch=6, decode_context_tokens=3000)
    idle = NodeStatus(at=NOW)
    nodes = {"busy": (busy, Pending(), ONE_H100, 1.0), "idle": (idle, Pending(), ONE_H100, 1.0)}
    assert load.choose_node(nodes, 1000, NOW) == "idle"
    assert load._plain_choose_node(nodes, 1000, NOW) == "idle"
    gap = load.routing_cost(busy, Pending(), ONE_H100, 1000) - load.routing_cost(idle, Pending(), ONE_H100, 1000)
    term = _idle_step_share(ONE_H100, 3006)  # six more in the batch, 3,000 more context tokens
    roofline_gap = ONE_H100.decode_step_s(7, 4000) - ONE_H100.decode_step_s(1, 1000)
    assert gap == pytest.approx(term + roofline_gap, rel=1e-9)
    assert roofline_gap < 0.15 * term  # the roofline alone saw a tenth of the difference
    assert gap == pytest.approx(term, rel=0.15)
    # a decode load that fills the KV capacity costs one more idle step
    full = NodeStatus(at=NOW, decode_batch=1, decode_context_tokens=ONE_H100.kv_capacity_tokens - 2)
    assert load.routing_cost(full, Pending(), ONE_H100, 0) == pytest.approx(
        ONE_H100.decode_step_s(2, ONE_H100.kv_capacity_tokens - 2) + ONE_H100.decode_step_s(1, 0), rel=1e-12
    )


def test_the_decode_load_term_compares_gpus_by_the_share_of_their_own_capacity():
    """The same decode load fills a small share of a large KV cache and a large share of a small one."""
    status = NodeStatus(at=NOW, decode_batch=4, decode_context_tokens=6000)
    small_kv = load.routing_cost(status, Pending(), ONE_H100, 100)
    large_kv = load.routing_cost(status, Pending(), H100, 100)
    assert small_kv - ONE_H100.prefill_s(100) - ONE_H100.decode_step_s(5, 6100) == pytest.approx(
        _idle_step_share(ONE_H100, 6105), rel=1e-9
    )
    assert large_kv - H100.prefill_s(100) - H100.decode_step_s(5, 6100) == pytest.approx(
        _idle_step_share(H100, 6105), rel=1e-9
    )
    assert _idle_step_share(ONE_H100, 6105) > 10 * _idle_step_share(H100, 6105)


def test_dispatch_accounting_spreads_a_burst_evenly_over_identical_idle_nodes():
    nodes = {f"n{i}": (NodeStatus(at=NOW), Pending(), ONE_H100, 1.0) for i in range(4)}
    chosen = []
    for _ in range(16):
        name = load.choose_node(nodes, 800, NOW)
        assert name == load._plain_choose_node(nodes, 800, NOW)
        nodes[name][1].add(800)
        chosen.append(name)
    assert {n: chosen.count(n) for n in nodes} == {"n0": 4, "n1": 4, "n2": 4, "n3": 4}
    assert chosen == ["n0", "n1", "n2", "n3"] * 4


def test_a_node_that_is_not_serving_costs_infinity():
    for state in ("loading_draft", "draft_ready", "loading_full"):
        assert load.routing_cost(NodeStatus(model_state=state), Pending(), H100, 10) == math.inf


def _cluster(**loads):
    """Nodes on H100 by default; a value is (status kwargs, weight) or status kwargs."""
    out = {}
    for name, spec in loads.items():
        kwargs, weight = spec if isinstance(spec, tuple) else (spec, 1.0)
        deployment = kwargs.pop("deployment", H100)
        out[name] = (NodeStatus(at=NOW, **kwargs), Pending(), deployment, weight)
    return out


def test_choose_node_takes_the_least_cost():
    nodes = _cluster(
        a=dict(decode_batch=40, decode_context_tokens=60_000),
        b=dict(decode_batch=10, decode_context_tokens=10_000),
        c=dict(uncomputed_prefill_tokens=8000),
    )
    assert load.choose_node(nodes, 500, NOW) == "b"
    # an 8,000-token prefill queue delays a first token more than a busy decode batch does
    assert load.choose_node(nodes, 500, NOW, exclude={"b"}) == "a"
    assert load.choose_node(nodes, 500, NOW, exclude={"a", "b"}) == "c"


def test_choose_node_prefers_the_faster_gpu_at_equal_load():
    same = dict(decode_batch=30, decode_context_tokens=40_000)
    nodes = _cluster(a=dict(same), z=dict(same, deployment=H200))
    assert load.choose_node(nodes, 500, NOW) == "z"


def test_choose_node_predicts_stale_statuses_forward():
    # b reported a long prefill 2 s ago: it has long finished; a's prefill is current.
    nodes = {
        "a": (NodeStatus(at=NOW, uncomputed_prefill_tokens=3000, step_ms=30), Pending(), H100, 1.0),
        "b": (NodeStatus(at=NOW - 2, uncomputed_prefill_tokens=6000, step_ms=30), Pending(), H100, 1.0),
    }
    assert load.choose_node(nodes, 100, NOW) == "b"


def test_choose_node_weights_ties_exclusions_and_nothing_left():
    same = dict(decode_batch=5, decode_context_tokens=5000)
    nodes = _cluster(c=dict(same), a=dict(same), b=dict(same))
    assert load.choose_node(nodes, 100, NOW) == "a"  # ties: smallest name
    nodes = _cluster(a=(dict(same), 0.5), b=(dict(same), 1.0), c=(dict(same), 0.0))
    assert load.choose_node(nodes, 100, NOW) == "b"  # half weight: twice the cost
    assert load.choose_node(nodes, 100, NOW, exclude=["b"]) == "a"
    assert load.choose_node(nodes, 100, NOW, exclude=["a", "b"]) is None  # weight 0 is never chosen
    assert load.choose_node({}, 100, NOW) is None
    loading = _cluster(a=dict(model_state="loading_full"))
    assert load.choose_node(loading, 100, NOW) is None


def test_dispatch_time_accounting_spreads_consecutive_requests():
    """Document 002's herd effect: without counting dispatches, every request of a burst
    sees the same snapshot and lands on the same node."""
    same = dict(decode_batch=8, decode_context_tokens=8000)
    nodes = _cluster(**{f"n{i}": dict(same) for i in range(4)})
    herd = [load.choose_node(nodes, 800, NOW) for _ in range(4)]
    assert herd == ["n0"] * 4
    spread = []
    for _ in range(4):
        name = load.choose_node(nodes, 800, NOW)
        nodes[name][1].add(800)
        spread.append(name)
    assert sorted(spread) == ["n0", "n1", "n2", "n3"]
    # the node's status now includes them: confirming brings the first back
    for name in spread:
        nodes[name][1].confirm(800)
    assert load.choose_node(nodes, 800, NOW) == "n0"


def test_the_fast_path_follows_replaced_entries_of_the_same_mapping():
    nodes = _cluster(a=dict(decode_batch=1), b=dict(decode_batch=30, decode_context_tokens=30_000))
    assert load.choose_node(nodes, 100, NOW) == "a"
    status, pending, deployment, _ = nodes["a"]
    nodes["a"] = (NodeStatus(at=NOW, decode_batch=60, decode_context_tokens=90_000), pending, deployment, 1.0)
    assert load.choose_node(nodes, 100, NOW) == "b"
    nodes["b"] = (nodes["b"][0], nodes["b"][1], deployment, 0.0)
    assert load.choose_node(nodes, 100, NOW) == "a"
    del nodes["a"]
    assert load.choose_node(nodes, 100, NOW) is None


def test_a_mapping_rebuilt_for_every_call_is_answered_the_same():
    statuses = {
        "a": NodeStatus(at=NOW, decode_batch=9, decode_context_tokens=20_000),
        "b": NodeStatus(at=NOW, decode_batch=3),
    }
    pending = {"a": Pending(), "b": Pending()}

    def fresh():
        return {name: (statuses[name], pending[name], H100, 1.0) for name in ("a", "b")}

    assert load.choose_node(fresh(), 100, NOW) == "b"
    pending["b"].add(5000)  # mutated in place: the next fresh mapping carries the same object
    assert load.choose_node(fresh(), 100, NOW) == "a"
    pending["b"] = Pending()  # replaced by an equal-valued new object
    statuses["a"] = NodeStatus(at=NOW, decode_batch=90, decode_context_tokens=90_000)
    assert load.choose_node(fresh(), 100, NOW) == "b"


def test_the_fast_roofline_is_the_catalog_to_the_last_bit():
    for model in catalog.MODELS.values():
        for gpu in catalog.GPUS.values():
            for tp in catalog.TP_DEGREES:
                try:
                    deployment = Deployment(model, gpu, tp)
                except catalog.CatalogError:
                    continue
                roof = load._Roofline(deployment)
                for tokens in (0, 1, 7, 512, 2049, 100_000):
                    assert roof.prefill_s(tokens) == deployment.prefill_s(tokens)
                for batch, context in ((0, 0), (1, 0), (3, 17), (64, 100_000), (512, 3_000_000)):
                    assert roof.decode_step_s(batch, context) == deployment.decode_step_s(batch, context)


status_strategy = st.builds(
    NodeStatus,
    at=st.floats(NOW - 3, NOW + 0.01),
    model_state=st.sampled_from(["serving", "serving", "serving", "loading_full"]),
    waiting=st.integers(0, 20),
    uncomputed_prefill_tokens=st.sampled_from([0, 0, 0, 16, 700, 5000]),
    decode_batch=st.integers(0, 64),
    decode_context_tokens=st.integers(0, 200_000),
    step_ms=st.sampled_from([0.0, 0.0, 12.5, 40.0]),
)
entry_strategy = st.tuples(
    status_strategy,
    st.builds(Pending, st.integers(0, 3), st.sampled_from([0, 0, 100, 2000])),
    st.sampled_from([H100, H200, SMALL, MOE, ONE_H100, TIGHT]),
    st.sampled_from([1.0, 1.0, 0.5, 0.0, 2.0]),
)


@fast
@given(st.lists(entry_strategy, min_size=1, max_size=12), st.integers(1, 20_000), st.floats(0, 0.5))
def test_the_index_bound_is_a_lower_bound_on_the_cost(entries, prompt, dt):
    """Each node's stored bound, shifted by the prompt as the search shifts it, never exceeds
    its cost: prediction, pending work and the prompt only add to it."""
    names = [f"n{i:02d}" for i in range(len(entries))]
    index = load._Index(names, entries)
    for i, (status, pending, deployment, weight) in enumerate(entries):
        if index.where[i] is None:
            assert not weight > 0 or status.model_state != "serving"
            continue
        group, bound = index.where[i]
        roof, group_weight, slope = index.meta[group]
        assert roof.deployment is deployment and group_weight == weight
        low = roof.prefill_s(prompt) + slope * prompt + bound
        cost = load.routing_cost(load.predict(status, NOW + dt, deployment), pending, deployment, prompt)
        assert low <= cost * (1 + 1e-12)


@fast
@given(
    st.sampled_from([H100, H200, SMALL, MOE, ONE_H100, TIGHT]),
    st.integers(0, 50_000),
    st.integers(1, 20_000),
)
def test_a_prefill_queue_adds_at_least_its_floor_to_any_prompt(deployment, queued, prompt):
    roof = load._Roofline(deployment)
    assert roof.prefill_s(prompt) + roof.queue_floor(queued) <= roof.prefill_s(queued + prompt) * (1 + 1e-12)


@fast
@given(st.lists(entry_strategy, min_size=1, max_size=12), st.integers(1, 20_000), st.floats(0, 1))
def test_the_index_order_is_a_lower_bound_on_the_cost_until_the_floor_s_horizon(entries, prompt, share):
    """A node is ordered by its bound plus the floor of the prefill it still has at its horizon: never above its
    cost for a decision at any time from its status to that horizon, whatever the prompt."""
    names = [f"n{i:02d}" for i in range(len(entries))]
    index = load._Index(names, entries)
    for i, (status, pending, deployment, _weight) in enumerate(entries):
        if index.where[i] is None:
            continue
        group, bound = index.where[i]
        roof, _, slope = index.meta[group]
        horizon = index.horizon[i]
        if horizon == math.inf:
            assert index.floor[i] == 0.0
            horizon = status.at + 0.5
        else:
            assert status.at <= horizon and index.floor[i] > 0
        at = status.at + share * (horizon - status.at)
        low = roof.prefill_s(prompt) + slope * prompt + bound + index.floor[i]
        cost = load.routing_cost(load.predict(status, at, deployment), pending, deployment, prompt)
        assert low <= cost * (1 + 1e-12)


@fast
@given(
    st.dictionaries(st.sampled_from([f"n{i:02d}" for i in range(24)]), entry_strategy, max_size=24),
    st.lists(st.tuples(st.integers(0, 23), entry_strategy, st.integers(1, 4000), st.floats(0, 0.2)), max_size=8),
    st.sets(st.sampled_from([f"n{i:02d}" for i in range(24)]), max_size=3),
)
def test_choose_node_is_its_definition_through_any_sequence_of_changes(nodes, changes, exclude):
    """The bound-pruned search returns exactly what costing every node returns, and so does
    a NodeIndex told of each change one node at a time (the gateway's way)."""
    now = NOW
    index = load.NodeIndex(nodes)
    for slot, entry, prompt, dt in [(None, None, 1000, 0.0), *changes]:
        now += dt
        if slot is not None and nodes:
            name = sorted(nodes)[slot % len(nodes)]
            nodes[name] = entry if slot % 3 else (entry[0], nodes[name][1], nodes[name][2], nodes[name][3])
            nodes[name][1].add(prompt // 2)
            index.set(name, nodes[name])
        expected = load._plain_choose_node(nodes, prompt, now, exclude)
        assert load.choose_node(nodes, prompt, now, exclude) == expected
        assert index.choose(prompt, now, exclude) == expected


near_tie_strategy = st.tuples(
    st.integers(0, 2),  # more in the batch
    st.integers(0, 1),  # more waiting
    st.integers(0, 40),  # more context tokens
    st.sampled_from([0.0, 0.0, 0.001, 0.05]),  # how stale
    st.integers(0, 3),  # pending requests
    st.integers(0, 40),  # pending prompt tokens
)


@fast
@given(
    st.sampled_from([H100, H200, SMALL, MOE, ONE_H100, TIGHT]),
    st.integers(0, 8),
    st.integers(0, 50_000),
    st.sampled_from([0, 0, 700]),
    st.sampled_from([0.0, 12.5]),
    st.lists(near_tie_strategy, min_size=2, max_size=12),
    st.lists(st.tuples(st.integers(0, 11), st.integers(1, 4000)), min_size=1, max_size=6),
)
def test_choose_node_is_its_definition_among_near_ties(
    deployment, batch, context, uncomputed, step_ms, nodes, decisions
):
    """Nodes a few tokens, requests and milliseconds apart: their costs differ by about the
    decode-load term's own slopes, so a bound that overstates any of them prunes the winner."""
    candidates = {
        f"n{i:02d}": (
            NodeStatus(
                at=NOW - stale,
                waiting=more_waiting,
                uncomputed_prefill_tokens=uncomputed,
                decode_batch=batch + more_batch,
                decode_context_tokens=context + more_context,
                step_ms=step_ms,
            ),
            Pending(requests, tokens),
            deployment,
            1.0,
        )
        for i, (more_batch, more_waiting, more_context, stale, requests, tokens) in enumerate(nodes)
    }
    for slot, prompt in decisions:
        name = load.choose_node(candidates, prompt, NOW)
        assert name == load._plain_choose_node(candidates, prompt, NOW)
        candidates[sorted(candidates)[slot % len(candidates)]][1].add(prompt % 7)


def test_recovery_load_is_eq_4():
    assert load.recovery_load(pages_held=120, queue_depth=8) == 128
    assert load.recovery_load(pages_held=120, queue_depth=8, alpha=0.5, beta=2.0) == 76
    block = H100.model.kv_bytes_per_block
    assert load.pages(10 * block, block) == 10
    assert load.pages(block // 2, block) == 0.5
    with pytest.raises(ValueError):
        load.pages(1, 0)


# --- placement: Algorithm 1, eq. 5, and the baselines ----------------------------------------

GB = 10**9


def _holders(*specs, budget=10 * GB):
    """(name, rack, l_hat[, bytes_held[, alive]])"""
    out = []
    for spec in specs:
        name, rack, l_hat, *rest = spec
        held = rest[0] if rest else 0
        alive = rest[1] if len(rest) > 1 else True
        out.append(HolderCandidate(name, rack, l_hat, held, budget, alive))
    return out


def test_every_policy_is_documented_and_an_unknown_one_is_refused():
    assert set(placement.POLICY_DOCS) == set(placement.POLICIES)
    with pytest.raises(ValueError, match="none, fixed, load_aware, lifeline"):
        placement.place("random", "a", _holders(("b", "r1", 0)), 1, 1)


def test_none_never_checkpoints():
    assert placement.place("none", "a", _holders(("b", "r1", 0)), 1, 10_000) == ()


def test_fixed_takes_the_next_name_whatever_its_load_and_wraps_around():
    nodes = _holders(("n1", "r1", 0), ("n2", "r1", 99), ("n3", "r2", 0), ("n4", "r2", 0))
    assert placement.place("fixed", "n1", nodes, GB, 100) == ("n2",)
    assert placement.place("fixed", "n4", nodes, GB, 100) == ("n1",)
    assert placement.place("fixed", "n25", nodes, GB, 100) == ("n3",)  # the serving node need not be a candidate
    dead = _holders(("n1", "r1", 0), ("n2", "r1", 0, 0, False), ("n3", "r2", 0))
    assert placement.place("fixed", "n1", dead, GB, 100) == ("n3",)


def test_fixed_with_a_full_neighbour_means_no_checkpoint():
    nodes = _holders(("n1", "r1", 0), ("n2", "r1", 0, 9.5 * GB), ("n3", "r2", 0))
    assert placement.place("fixed", "n1", nodes, GB, 100) == ()
    assert placement.place("load_aware", "n1", nodes, GB, 100) == ("n3",)


def test_load_aware_takes_the_least_loaded_other_node():
    nodes = _holders(("a", "r1", 1.0), ("b", "r1", 5.0), ("c", "r2", 2.0), ("d", "r2", 2.0))
    assert placement.place("load_aware", "x", nodes, GB, 100) == ("a",)
    assert placement.place("load_aware", "a", nodes, GB, 100) == ("c",)  # never the serving node; tie: smallest name


def test_load_aware_passes_a_full_holder_to_the_next_then_to_no_checkpoint():
    nodes = _holders(("a", "r1", 1.0, 9.5 * GB), ("b", "r1", 3.0, 8 * GB), ("c", "r2", 2.0, 0, False))
    assert placement.place("load_aware", "x", nodes, GB, 100) == ("b",)  # a over budget, c dead
    assert placement.place("load_aware", "x", nodes, 3 * GB, 100) == ()  # eq. 5 everywhere: no checkpoint


def test_lifeline_adds_a_second_holder_in_another_rack_for_a_long_prefix():
    nodes = _holders(("a", "r1", 1.0), ("b", "r1", 2.0), ("c", "r2", 5.0), ("d", "r2", 4.0))
    assert placement.place("lifeline", "x", nodes, GB, 512) == ("a",)  # at tau: one copy
    assert placement.place("lifeline", "x", nodes, GB, 513) == ("a", "d")  # not b: same rack as a
    assert placement.place("load_aware", "x", nodes, GB, 5000) == ("a",)


def test_lifeline_second_holder_falls_back_to_the_same_rack_then_to_one():
    nodes = _holders(("a", "r1", 1.0), ("b", "r1", 2.0), ("c", "r2", 0.5, 9.5 * GB))
    assert placement.place("lifeline", "x", nodes, GB, 4000) == ("a", "b")
    alone = _holders(("a", "r1", 1.0), ("c", "r2", 0.5, 9.5 * GB))
    assert placement.place("lifeline", "x", alone, GB, 4000) == ("a",)
    one_rack = _holders(("a", "r1", 1.0), ("b", "r1", 3.0), ("e", "r1", 2.0))
    assert placement.place("lifeline", "x", one_rack, GB, 4000) == ("a", "e")


def test_placement_follows_replaced_entries_of_the_same_sequence():
    nodes = _holders(("a", "r1", 1.0), ("b", "r2", 2.0), ("c", "r3", 3.0))
    assert placement.place("lifeline", "x", nodes, GB, 4000) == ("a", "b")
    nodes[0] = HolderCandidate("a", "r1", 9.0, 0, 10 * GB)
    assert placement.place("lifeline", "x", nodes, GB, 4000) == ("b", "c")
    nodes[2] = HolderCandidate("c", "r3", 3.0, 0, 10 * GB, alive=False)
    assert placement.place("lifeline", "x", nodes, GB, 4000) == ("b", "a")
    nodes.pop(1)
    assert placement.place("lifeline", "x", nodes, GB, 4000) == ("a",)


def test_a_candidate_list_rebuilt_for_every_call_is_answered_the_same():
    loads = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}

    def fresh(serving):  # as a gateway might: every node but the serving one, new objects each time
        return [HolderCandidate(n, f"r-{n}", loads[n], 0, 10 * GB) for n in sorted(loads) if n != serving]

    assert placement.place("lifeline", "a", fresh("a"), GB, 4000) == ("b", "c")
    assert placement.place("lifeline", "b", fresh("b"), GB, 4000) == ("a", "c")
    loads["a"] = 9.0
    assert placement.place("lifeline", "b", fresh("b"), GB, 4000) == ("c", "d")
    assert placement.place("load_aware", "d", fresh("d"), GB, 4000) == ("b",)


def _place_by_definition(policy, serving, candidates, request_bytes, prefix_tokens, tau=512):
    """place() as the brief states it, one candidate at a time."""
    ok = [c for c in candidates if c.alive and c.name != serving and c.bytes_held + request_bytes <= c.budget_bytes]
    if policy == "none":
        return ()
    if policy == "fixed":
        alive = sorted(c.name for c in candidates if c.alive and c.name != serving)
        after = [n for n in alive if n > serving]
        neighbour = (after or alive or [None])[0]
        return (neighbour,) if neighbour in {c.name for c in ok} else ()
    ranked = sorted(ok, key=lambda c: (c.l_hat, c.name))
    if not ranked:
        return ()
    first = ranked[0]
    if policy == "load_aware" or prefix_tokens <= tau:
        return (first.name,)
    # A second copy only where it leaves room for later first copies (SECOND_COPY_SHARE of the budget).
    roomy = [c for c in ranked[1:] if c.bytes_held + request_bytes <= placement.SECOND_COPY_SHARE * c.budget_bytes]
    others = [c for c in roomy if c.rack != first.rack] or roomy
    return (first.name, others[0].name) if others else (first.name,)


holder_strategy = st.builds(
    HolderCandidate,
    name=st.sampled_from([f"n{i}" for i in range(12)]),
    rack=st.sampled_from(["r1", "r2", "r3"]),
    l_hat=st.sampled_from([0.0, 1.0, 2.0, 2.0, 7.5, 100.0]),
    bytes_held=st.integers(0, 10 * GB),
    budget_bytes=st.sampled_from([0, 5 * GB, 10 * GB]),
    alive=st.booleans(),
)


@fast
@given(
    st.lists(holder_strategy, max_size=12, unique_by=lambda c: c.name),
    st.lists(st.tuples(st.integers(0, 11), holder_strategy), max_size=6),
    st.sampled_from(placement.POLICIES),
    st.sampled_from([f"n{i}" for i in range(13)]),
    st.integers(0, 4 * GB),
    st.integers(0, 4000),
)
def test_placement_respects_budgets_never_picks_serving_or_dead_and_matches_its_definition(
    candidates, changes, policy, serving, request_bytes, prefix
):
    ranking = placement.HolderRanking(candidates)
    for slot, replacement in [(None, None), *changes]:
        if slot is not None and candidates:
            i = slot % len(candidates)
            candidates[i] = dataclasses.replace(replacement, name=candidates[i].name)
            ranking.set(candidates[i])
        holders = placement.place(policy, serving, candidates, request_bytes, prefix)
        assert placement.place(policy, serving, ranking, request_bytes, prefix) == holders
        by_name = {c.name: c for c in candidates}
        assert len(holders) == len(set(holders)) <= 2
        for name in holders:
            c = by_name[name]
            assert name != serving and c.alive and c.bytes_held + request_bytes <= c.budget_bytes
        assert holders == _place_by_definition(policy, serving, candidates, request_bytes, prefix)


def test_holder_balance_and_coverage():
    assert placement.holder_balance([3.0]) is None
    assert placement.holder_balance([]) is None
    assert placement.holder_balance([2.0, 3.0, 2.5]) == 1.5
    assert placement.holder_balance([0.0, 0.0]) == 1.0
    assert placement.holder_balance([0.0, 4.0]) == math.inf
    assert placement.coverage(0, 0) is None
    assert placement.coverage(40, 30) == 0.75


# --- dispatch: eq. 6, Algorithm 2, document 003 ------------------------------------------------


def _survivors(*specs, deployment=H100):
    """(name, rack, l_hat[, free_blocks[, alive]])"""
    out = {}
    for spec in specs:
        name, rack, l_hat, *rest = spec
        free = rest[0] if rest else 100_000
        alive = rest[1] if len(rest) > 1 else True
        out[name] = Survivor(name, rack, l_hat, free, deployment, alive)
    return out


def test_a_holder_under_theta_restores():
    survivors = _survivors(("h", "r1", 3.0), ("w", "r1", 0.0))
    [d] = dispatch.plan_recovery([Interrupted("r1", ("h",), 96, 100)], survivors, {"f"}, theta=8.0)
    assert (d.target, d.method, d.source) == ("h", "restore", "h")
    assert "holder h not overloaded (L̂ 3.0 <= θ 8.0)" in d.reason


def test_a_holder_over_theta_is_bypassed_for_a_short_prefix_and_kept_for_a_long_one():
    survivors = _survivors(("h", "r1", 20.0), ("w", "r2", 1.0))
    short, long_ = dispatch.plan_recovery(
        [Interrupted("short", ("h",), 96, 100), Interrupted("long", ("h",), 4096, 4100)],
        survivors,
        {"f"},
        theta=8.0,
        tau=512,
    )
    assert (short.target, short.method, short.source) == ("w", "reprefill", None)
    assert "overloaded" in short.reason and "re-prefill" in short.reason
    assert (long_.target, long_.method, long_.source) == ("h", "restore", "h")
    assert "exceeds τ 512" in long_.reason


def test_fetch_over_infiniband_for_a_long_context_reprefill_for_a_short_one():
    """The KV the holder has lags the client by a few tokens, so either way the target runs a
    pass over its weights; for a long context the transfer saves the prefill's compute, for a
    short one there is nothing to save."""
    survivors = _survivors(("h", "r1", 20.0), ("w", "r1", 1.0))
    [long_] = dispatch.plan_recovery([Interrupted("long", ("h",), 8000, 8005)], survivors, {"f"}, theta=8.0, tau=10_000)
    [short] = dispatch.plan_recovery([Interrupted("short", ("h",), 96, 100)], survivors, {"f"}, theta=8.0, tau=10_000)
    assert (long_.target, long_.method, long_.source) == ("w", "fetch", "h")
    assert (short.target, short.method, short.source) == ("w", "reprefill", None)
    assert "beats fetching" in short.reason


def test_fetch_needs_free_blocks_on_the_target():
    survivors = _survivors(("h", "r1", 20.0), ("w", "r1", 1.0, 10))
    [d] = dispatch.plan_recovery([Interrupted("r", ("h",), 8000, 8005)], survivors, {"f"}, theta=8.0, tau=10_000)
    assert (d.method, d.source) == ("reprefill", None)
    assert "free blocks" in d.reason


def test_a_failed_holder_passes_to_the_next_and_with_none_left_the_request_reprefills():
    survivors = _survivors(("h1", "r1", 1.0), ("h2", "r2", 2.0), ("w", "r3", 0.0))
    [d] = dispatch.plan_recovery([Interrupted("r", ("h1", "h2"), 2000, 2010)], survivors, {"f", "h1"}, theta=8.0)
    assert (d.target, d.method, d.source) == ("h2", "restore", "h2")
    assert "holder h1 failed too" in d.reason
    survivors["h2"].alive = False
    [d] = dispatch.plan_recovery([Interrupted("r", ("h1", "h2"), 2000, 2010)], survivors, {"f", "h1"}, theta=8.0)
    assert (d.target, d.method, d.source) == ("w", "reprefill", None)


def test_the_least_loaded_survivor_holding_a_copy_restores_it():
    survivors = _survivors(("h1", "r1", 20.0), ("h2", "r2", 9.0), ("w", "r3", 12.0))
    [d] = dispatch.plan_recovery([Interrupted("r", ("h1", "h2"), 96, 100)], survivors, {"f"}, theta=8.0)
    assert (d.target, d.method, d.source) == ("h2", "restore", "h2")


def test_decisions_raise_the_estimates_so_a_burst_spreads():
    survivors = _survivors(("a", "r1", 0.0), ("b", "r1", 0.0), ("c", "r2", 0.0))
    burst = [Interrupted(f"r{i}", (), 0, 160) for i in range(6)]  # 10 pages each
    decisions = dispatch.plan_recovery(burst, survivors, {"f"}, theta=8.0)
    assert [d.target for d in decisions] == ["a", "b", "c", "a", "b", "c"]
    assert all(d.method == "reprefill" for d in decisions)
    # a holder fills up past θ as it takes restores, then short requests go elsewhere
    survivors = _survivors(("h", "r1", 0.0), ("w", "r2", 5.0))
    restores = [Interrupted(f"r{i}", ("h",), 96, 100) for i in range(3)]
    decisions = dispatch.plan_recovery(restores, survivors, {"f"}, theta=8.0, alpha=1.0, beta=1.0)
    assert [d.target for d in decisions] == ["h", "h", "w"]  # L̂(h): 0 -> 8 (<= θ) -> 16 > θ; 7 pages + 1 each
    assert survivors["h"].l_hat == 0.0 and survivors["h"].free_blocks == 100_000  # the caller's objects are untouched


def test_no_survivor_raises_and_nothing_to_plan_is_empty():
    survivors = _survivors(("a", "r1", 0.0, 10, False))
    with pytest.raises(dispatch.NoSurvivors, match="no surviving node"):
        dispatch.plan_recovery([Interrupted("r", (), 0, 10)], survivors, {"b"}, theta=1.0)
    with pytest.raises(dispatch.NoSurvivors):
        dispatch.plan_recovery([Interrupted("r", (), 0, 10)], _survivors(("b", "r1", 0.0)), {"b"}, theta=1.0)
    assert dispatch.plan_recovery([], survivors, {"b"}, theta=1.0) == []


def test_theta_is_twice_the_mean_load_at_least_the_floor():
    assert dispatch.theta_for([2.0, 4.0, 6.0]) == 8.0
    assert dispatch.theta_for([2.0, 4.0], factor=3.0) == 9.0
    assert dispatch.theta_for([0.0, 0.1]) == 1.0
    assert dispatch.theta_for([], floor=2.0) == 2.0


def test_live_migration_transfers_a_long_context_and_reprefills_a_short_one():
    target = Survivor("w", "r1", 0.0, 100_000, H100)
    r1, r2 = catalog.Placement("r1"), catalog.Placement("r2")
    method, transfer_s, reprefill_s = dispatch.migration_method(8001, 8000, r1, target)
    assert method == "transfer" and transfer_s < reprefill_s
    link, share = catalog.node_link(r1, r1, H100.gpu)
    assert transfer_s > catalog.kv_transfer_s(
        8000 * H100.model.kv_bytes_per_token, link, share
    )  # plus the catch-up pass
    method, transfer_s, reprefill_s = dispatch.migration_method(100, 96, r1, target)
    assert method == "reprefill" and transfer_s >= reprefill_s
    # across racks the spine is shared (a third of InfiniBand): the transfer takes longer
    _, across_s, _ = dispatch.migration_method(8001, 8000, r2, target)
    assert across_s > dispatch.migration_method(8001, 8000, r1, target)[1]
    full = Survivor("w", "r1", 0.0, 10, H100)
    assert dispatch.migration_method(8001, 8000, r1, full)[0] == "reprefill"


def test_on_fast_compute_a_long_context_reprefills_rather_than_cross_the_spine():
    """Document 003: the crossover depends on the link. A small model on eight H100s prefills
    faster than a third of InfiniBand moves its KV."""
    target = Survivor("w", "r2", 0.0, 100_000, Deployment.of("Llama-3-8B", "H100-SXM", 8))
    assert dispatch.migration_method(8192, 8192, catalog.Placement("r1"), target)[0] == "reprefill"
    assert dispatch.migration_method(8192, 8192, catalog.Placement("r2"), target)[0] == "transfer"


interrupted_strategy = st.builds(
    Interrupted,
    request_id=st.uuids().map(str),
    holders=st.lists(st.sampled_from([f"n{i}" for i in range(8)]), max_size=2, unique=True).map(tuple),
    checkpointed_tokens=st.sampled_from([0, 16, 96, 512, 513, 4096]),
    context_tokens=st.sampled_from([1, 100, 600, 5000]),
)
survivor_strategy = st.builds(
    Survivor,
    name=st.just(""),
    rack=st.sampled_from(["r1", "r2"]),
    l_hat=st.floats(0, 50),
    free_blocks=st.sampled_from([0, 10, 100_000]),
    deployment=st.sampled_from([H100, SMALL]),
    alive=st.booleans(),
)


@fast
@given(
    st.lists(interrupted_strategy, max_size=20),
    st.dictionaries(st.sampled_from([f"n{i}" for i in range(8)]), survivor_strategy, max_size=8),
    st.sets(st.sampled_from([f"n{i}" for i in range(8)]), max_size=3),
    st.floats(0, 30),
)
def test_recovery_never_targets_a_failed_or_dead_node_and_sources_are_surviving_holders(
    interrupted, survivors, failed, theta
):
    for name, s in survivors.items():
        s.name = name
    ok = {n for n, s in survivors.items() if s.alive and n not in failed}
    if interrupted and not ok:
        with pytest.raises(dispatch.NoSurvivors):
            dispatch.plan_recovery(interrupted, survivors, failed, theta)
        return
    decisions = dispatch.plan_recovery(interrupted, survivors, failed, theta)
    assert [d.request_id for d in decisions] == [r.request_id for r in interrupted]
    for r, d in zip(interrupted, decisions):
        assert d.target in ok
        assert d.method in dispatch.METHODS and d.reason
        if d.method == "reprefill":
            assert d.source is None
        else:
            assert d.source in ok and d.source in r.holders and r.checkpointed_tokens > 0
        if d.method == "restore":
            assert d.target == d.source


# --- progressive recovery: Algorithm 3, eq. 3 ----------------------------------------------------


def test_the_most_loaded_survivor_is_assisted():
    assert progressive.pick_assisted({"a": 3.0, "b": 9.0, "c": 9.0}) == "b"
    assert progressive.pick_assisted({"a": 3.0, "b": 9.0}, exclude={"b"}) == "a"
    assert progressive.pick_assisted({}) is None
    assert progressive.pick_assisted({"a": 1.0}, exclude=["a"]) is None


def test_expected_tokens_per_step_is_eq_3():
    assert progressive.expected_tokens_per_step(1.0, 4) == 5
    assert progressive.expected_tokens_per_step(0.0, 4) == 1
    assert progressive.expected_tokens_per_step(0.6, 4) == pytest.approx(2.3056)
    assert progressive.expected_tokens_per_step(0.8, 4) == pytest.approx(3.3616)
    for bad in ((-0.1, 4), (1.1, 4), (0.5, -1)):
        with pytest.raises(ValueError):
            progressive.expected_tokens_per_step(*bad)


@given(st.floats(0, 1), st.integers(0, 16))
def test_expected_tokens_per_step_lies_between_one_and_k_plus_one(alpha, k):
    value = progressive.expected_tokens_per_step(alpha, k)
    assert 1 - 1e-9 <= value <= k + 1 + 1e-9
    assert value <= progressive.expected_tokens_per_step(alpha, k + 1) + 1e-9


def test_a_sharpening_left_for_tidy_does_not_outlive_the_status_it_was_predicted_from():
    """A search with upkeep=False leaves a busy node's sharpened bound for tidy(); if the node's next status (it
    went idle) comes first, tidy must not put back a bound predicted from the busy one: the idle node is chosen."""
    # a's status is older than b's and a little heavier: b is visited first and costs less than a predicted to now,
    # so a's bound is sharpened (b's own prediction grew too, but b is costed, not ruled out)
    busy = NodeStatus(at=NOW - 10, running=30, decode_batch=30, decode_context_tokens=30_000, step_ms=20.0)
    light = NodeStatus(at=NOW - 1, running=30, decode_batch=30, decode_context_tokens=29_000, step_ms=20.0)
    nodes = {"a": (busy, Pending(), H100, 1.0), "b": (light, Pending(), H100, 1.0)}
    index = load.NodeIndex(nodes)
    assert index.choose(1000, NOW, upkeep=False) == "b"
    assert 0 in index._index.deferred  # a's sharpening waits for tidy
    index.set("a", (NodeStatus(at=NOW), nodes["a"][1], H100, 1.0))  # a's next status: idle
    index.tidy()
    nodes["a"] = (NodeStatus(at=NOW), nodes["a"][1], H100, 1.0)
    assert load._plain_choose_node(nodes, 1000, NOW + 0.001) == "a"
    assert index.choose(1000, NOW + 0.001) == "a"


@pytest.mark.parametrize("seed", [0, 1])
def test_bounds_rebased_on_aging_statuses_keep_every_answer_the_definitions(seed):
    """A node whose status ages between decisions gets its search bound rebased at its predicted load (the
    search then skips it cheaply); the answers stay the one-node-at-a-time definition's, through the mapping and
    through a NodeIndex, with statuses seldom renewed, excluded nodes, and the clock stepping back now and then
    (a rebased bound is for later decisions only)."""
    import random

    from benchmarks.policies import Fleet

    rng = random.Random(seed)
    now = 1_700_000_000.0
    fleet = Fleet(rng, now)
    index = load.NodeIndex(fleet.candidates)
    # The gateway's way: the rebasing left for tidy(), which runs after the request is sent, here sometimes only
    # after new statuses came in (a rebase predicted from the old status must not outlive it) or not at all.
    lazy = load.NodeIndex(fleet.candidates)
    rebased = deferred = 0
    for i in range(600):
        now += rng.choice([0.001, 0.003, 0.02]) if rng.random() > 0.03 else -0.05
        prompt = fleet.new_request()[0]
        exclude = set(rng.sample(fleet.names, 3)) if rng.random() < 0.1 else ()
        plain = load._plain_choose_node(fleet.candidates, prompt, now, exclude)
        assert load.choose_node(fleet.candidates, prompt, now, exclude) == plain
        assert index.choose(prompt, now, exclude) == plain
        assert lazy.choose(prompt, now, exclude, upkeep=False) == plain
        rebased = max(rebased, len(index._index.rebased))
        deferred = max(deferred, len(lazy._index.deferred))
        if i % 3 == 0:
            lazy.tidy()
            assert not lazy._index.deferred
        fleet.dispatched(plain, (), prompt)
        before = dict(fleet.candidates)
        fleet.status_events(now, i, plain, 1)  # one status a decision: the rest age
        for name, entry in fleet.candidates.items():
            if entry is not before[name]:
                index.set(name, entry)
                lazy.set(name, entry)
        if i % 3 == 1:
            lazy.tidy()
    assert rebased > 10 and deferred > 3  # the paths under test were taken
    assert len(lazy._index.rebased) > 10  # and tidy() did rebase
