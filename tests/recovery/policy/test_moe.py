"""The expert routing table (document 001, TARRAGON): the gate and the experts' answers are pure functions, the
table is refused when malformed, and every plan and change keeps every expert reachable within the EWs' memory."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recovery.policy import moe
from tests.helpers import examples
from workers import catalog
from workers.moe import (
    ExpertRoutingTable,
    MoeError,
    activation_bytes,
    balancedness,
    combine,
    expert_bytes,
    expert_output,
    gate,
)

MIXTRAL = catalog.MODELS["Mixtral-8x7B"]
QWEN_MOE = catalog.MODELS["Qwen3-30B-A3B"]
DEEPSEEK = catalog.MODELS["DeepSeek-V3"]
GB = 10**9


def ews(count: int, gb: float) -> list[moe.ExpertWorker]:
    return [moe.ExpertWorker(f"ew-{i}", int(gb * GB)) for i in range(count)]


# --- the contract between AWs and EWs -----------------------------------------------------------------------------
def test_the_catalog_sizes_experts_as_the_published_models_do():
    # Mixtral: (46.7 − 12.9) B over the 6 experts a token does not use: 5.6 B per expert, 11.3 GB in BF16.
    assert expert_bytes(MIXTRAL) == pytest.approx(11.27 * GB, rel=0.01)
    # DeepSeek-V3: 2.56 B per expert, 5.1 GB in BF16 (document 001 quotes about 2.5 GB for DeepSeek-R1 in FP8).
    assert expert_bytes(DEEPSEEK) == pytest.approx(5.11 * GB, rel=0.01)
    assert activation_bytes(MIXTRAL) == 4096 * 2 and activation_bytes(DEEPSEEK) == 7168 * 2
    with pytest.raises(MoeError, match="Qwen3-32B is not a mixture of experts"):
        expert_bytes(catalog.MODELS["Qwen3-32B"])


@given(st.binary(min_size=1, max_size=32), st.integers(0, 31))
def test_the_gate_picks_k_distinct_experts_whose_weights_sum_to_one_and_the_same_every_time(context, layer):
    chosen = gate(MIXTRAL, layer, context)
    assert len(chosen) == 2 and len({e for e, _ in chosen}) == 2
    assert all(0 <= e < 8 for e, _ in chosen) and sum(w for _, w in chosen) == pytest.approx(1.0)
    assert gate(MIXTRAL, layer, context) == chosen


def test_a_replayed_layer_gives_the_same_output_whichever_ew_answers_and_a_missing_answer_is_never_skipped():
    context = b"request-7/token-41"
    chosen = gate(MIXTRAL, 3, context)
    answers = {e: expert_output(MIXTRAL, 3, e, context) for e, _ in chosen}
    replayed = {e: expert_output(MIXTRAL, 3, e, context) for e, _ in reversed(chosen)}  # another EW, other order
    assert combine(MIXTRAL, 3, answers, chosen) == combine(MIXTRAL, 3, replayed, chosen)
    (first, _), (second, _) = chosen
    with pytest.raises(MoeError, match=f"expert {second} of layer 3 has not answered"):
        combine(MIXTRAL, 3, {first: answers[first]}, chosen)
    with pytest.raises(MoeError, match="is not a layer of Mixtral-8x7B"):
        gate(MIXTRAL, 32, context)


def test_a_table_that_is_not_for_this_model_or_loses_an_expert_is_refused_naming_the_part():
    table = moe.plan(MIXTRAL, ews(4, 40)).to_json()
    assert ExpertRoutingTable.parse(table, MIXTRAL).to_json() == table
    cases = [
        ({**table, "model": "Qwen3-32B"}, "ert.model"),
        ({**table, "version": -1}, "ert.version"),
        ({**table, "experts": table["experts"][:7]}, "ert.experts"),
        ({**table, "experts": [{"primaries": [], "shadows": []}] + table["experts"][1:]}, "ert.experts[0]"),
        ({**table, "experts": [{"primaries": ["ew-1"], "shadows": ["ew-1"]}] + table["experts"][1:]}, "ert.experts[0]"),
        ({**table, "experts": [{"primaries": "ew-1"}] + table["experts"][1:]}, "ert.experts[0].primaries"),
    ]
    for bad, field in cases:
        with pytest.raises(MoeError) as refused:
            ExpertRoutingTable.parse(bad, MIXTRAL)
        assert refused.value.field == field, (field, str(refused.value))


# --- planning ------------------------------------------------------------------------------------------------------
@settings(max_examples=examples(150), deadline=None)
@given(
    model=st.sampled_from([MIXTRAL, QWEN_MOE, DEEPSEEK]),
    count=st.integers(1, 12),
    slots=st.integers(1, 60),
    loads=st.lists(st.floats(0, 1000, allow_nan=False), min_size=0, max_size=256),
)
def test_every_plan_places_each_expert_once_within_memory_and_never_shadows_it_on_its_own_primary(
    model, count, slots, loads
):
    size = expert_bytes(model)
    workers = [moe.ExpertWorker(f"ew-{i}", size * slots + i) for i in range(count)]
    load = dict(enumerate(loads[: model.experts]))
    try:
        table = moe.plan(model, workers, load)
    except moe.ErtRefused as refused:
        assert count * slots < model.experts and "add expert workers" in str(refused)
        return
    assert count * slots >= model.experts
    for loc in table.experts:
        assert len(loc.primaries) == 1 and len(loc.shadows) <= 1
        assert not set(loc.primaries) & set(loc.shadows)
    used = moe.memory(table, model)
    for worker in workers:
        spent = used.get(worker.name, {"primaries": 0, "shadows": 0})
        assert spent["primaries"] + spent["shadows"] <= worker.memory_bytes
    # Shadows go hottest first, while memory lasts: an expert left without one had, at its turn, no EW but its
    # own primary with room, and room only shrinks, so none has room for it now either.
    for expert, loc in enumerate(table.experts):
        if not loc.shadows:
            others = [w for w in workers if w.name != loc.primaries[0]]
            spent = {w.name: sum(used.get(w.name, {}).values()) for w in others}
            assert all(w.memory_bytes - spent[w.name] < size for w in others), expert


def test_primaries_spread_the_expected_load_evenly_and_shadows_fill_residual_memory():
    # 8 Mixtral experts on 4 EWs of 40 GB (three experts' room each): two primaries and one shadow per EW.
    table = moe.plan(MIXTRAL, ews(4, 40))
    assert sorted(len(table.primaries_of(ew)) for ew in table.ews()) == [2, 2, 2, 2]
    assert moe.shadow_coverage(table) == 0.5  # the four spare slots: half the experts shadowed
    # With loads, the four hottest get the shadows.
    loads = {0: 10, 1: 900, 2: 20, 3: 800, 4: 30, 5: 700, 6: 40, 7: 600}
    table = moe.plan(MIXTRAL, ews(4, 40), loads)
    assert {e for e, loc in enumerate(table.experts) if loc.shadows} == {1, 3, 5, 7}
    # Two primaries each, a hot one paired with a cold one: 900+10, 800+20, 700+30, 600+40.
    assert sorted(sorted(table.primaries_of(ew)) for ew in table.ews()) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(moe.ErtRefused, match=r"need 90.1 GB \(11.3 GB each\); .* hold 80.0 GB: add expert workers"):
        moe.plan(MIXTRAL, ews(2, 40))


# --- changes ------------------------------------------------------------------------------------------------------
def test_losing_an_ew_promotes_its_experts_shadows_and_a_replacement_takes_them_back():
    table = moe.plan(MIXTRAL, ews(6, 40))  # 18 experts' room: every expert gets a shadow
    assert moe.shadow_coverage(table) == 1.0
    lost = "ew-0"
    served = table.primaries_of(lost)
    after = moe.after_loss(table, [lost])
    assert after.version == table.version + 1 and lost not in after.ews()
    for expert in served:
        (was_shadow,) = table.experts[expert].shadows
        assert after.experts[expert].primaries == (was_shadow,) and after.resolve(expert) == was_shadow
    back = moe.with_replacement(after, served, "ew-9")
    for expert in served:
        assert back.experts[expert].primaries == ("ew-9",)
        assert back.experts[expert].shadows == table.experts[expert].shadows  # the promoted copy is a shadow again
    assert back.version == after.version + 1


def test_a_loss_that_leaves_an_expert_nowhere_is_refused_naming_the_expert():
    table = moe.plan(MIXTRAL, ews(4, 23), shadows=False)  # two experts' room each: no shadows fit anyway
    expert = table.primaries_of("ew-2")[0]
    with pytest.raises(moe.ErtRefused) as refused:
        moe.after_loss(table, ["ew-2"])
    assert refused.value.expert == expert
    assert f"expert {expert} of Mixtral-8x7B would have no live location" in str(refused.value)


@settings(max_examples=examples(100), deadline=None)
@given(st.integers(2, 10), st.data())
def test_after_any_loss_every_expert_resolves_to_a_live_ew_or_the_loss_is_refused(count, data):
    table = moe.plan(MIXTRAL, ews(count, 60))
    lost = data.draw(st.sets(st.sampled_from(sorted(table.ews())), max_size=count - 1))
    try:
        after = moe.after_loss(table, lost)
    except moe.ErtRefused as refused:
        assert set(table.experts[refused.expert].ews()) <= lost
        return
    for expert in range(MIXTRAL.experts):
        assert after.resolve(expert) not in lost | {None}
        assert table.resolve(expert, down=lost) == after.resolve(expert)  # an AW's own failover agrees


def test_balancedness_is_eplbs_mean_over_max():
    assert balancedness({"a": 10, "b": 10}) == 1.0
    assert balancedness({"a": 30, "b": 10, "c": 20}) == pytest.approx(20 / 30)
    assert balancedness({}) is None and balancedness({"a": 0}) is None


def test_an_attention_worker_reloads_only_the_weights_it_runs():
    from workers import catalog
    from workers.moe import attention_worker_load_s

    mixtral = catalog.MODELS["Mixtral-8x7B"]
    shared_gb = mixtral.shared_params_b * catalog.BYTES_PER_PARAM
    assert attention_worker_load_s(mixtral) == pytest.approx(shared_gb / catalog.DISK_GBPS + catalog.ENGINE_START_S)
    assert attention_worker_load_s(mixtral) < catalog.load_time_s(mixtral) - 10  # not the experts' 90 GB


def test_a_replacement_for_an_ew_whose_loss_was_refused_takes_its_place_and_the_lost_ew_leaves_the_table():
    """No shadows: the loss was refused, so the table still names the lost EW. The replacement serves its experts and
    the lost EW appears nowhere (it comes back as a standby, not as a shadow of what it held)."""
    ert = moe.plan(MIXTRAL, ews(4, 200), shadows=False)
    lost = "ew-1"
    with pytest.raises(moe.ErtRefused):
        moe.after_loss(ert, {lost})
    joined = moe.with_replacement(ert, ert.primaries_of(lost), "ew-9", replacing=lost)
    assert lost not in joined.ews() and joined.version == ert.version + 1
    assert joined.primaries_of("ew-9") == ert.primaries_of(lost)
    assert all(joined.experts[e] == ert.experts[e] for e in range(MIXTRAL.experts) if e not in ert.primaries_of(lost))
    with pytest.raises(moe.ErtRefused, match="no live location"):
        moe.with_replacement(ert, ert.primaries_of(lost)[:1], "ew-9", replacing=lost)  # one expert left behind
