"""Catalogs and the roofline model against REFERENCE.md's figures."""

import pytest

from workers import catalog

KIB = 1024


@pytest.mark.parametrize(
    "model,kib",
    [
        ("Llama-3-8B", 128),
        ("Llama-3-70B", 320),
        ("Qwen3-14B", 160),
        ("Qwen3-32B", 256),
        ("Mixtral-8x7B", 128),
        ("Qwen3-1.7B", 112),
        ("Llama-3.2-1B", 32),
    ],
)
def test_kv_bytes_per_token_match_the_reference(model, kib):
    assert catalog.model(model).kv_bytes_per_token == kib * KIB


def test_llama_70b_4k_request_is_1_34_gb():  # source document 000, eq. 2
    assert catalog.kv_bytes(catalog.model("Llama-3-70B"), 4096) == pytest.approx(1.34e9, rel=0.01)


def test_qwen3_8b_like_decode_on_h100_matches_the_measured_range():
    # REFERENCE.md: Qwen3-8B on one H100, concurrency 4: 7.2-7.4 ms per token (4.8 ms floor).
    # Llama-3-8B is the catalogued 8B dense model with the same shape class.
    d = catalog.Deployment.of("Llama-3-8B", "H100-SXM")
    step = d.decode_step_s(batch=4, context_tokens=4 * 600)
    assert 0.0068 < step < 0.0080
    floor = catalog.model("Llama-3-8B").weight_bytes / (3350e9)
    assert step > floor


def test_qwen3_32b_decode_on_h100_is_tens_of_milliseconds():
    step = catalog.Deployment.of("Qwen3-32B", "H100-SXM").decode_step_s(batch=8, context_tokens=8 * 1000)
    assert 0.02 < step < 0.06


def test_tensor_parallel_divides_time_and_multiplies_kv_room():
    one = catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1)
    two = catalog.Deployment.of("Qwen3-32B", "H100-SXM", 2)
    assert two.decode_step_s(4, 4000) == pytest.approx(one.decode_step_s(4, 4000) / 2, rel=0.01)
    # The all-reduces add a little over NVLink, more over PCIe (an NVLink down).
    assert one.step_s(0, 0, 4, 4000) == one.decode_step_s(4, 4000)
    nvlink = two.step_s(0, 0, 4, 4000) - two.decode_step_s(4, 4000)
    pcie = two.step_s(0, 0, 4, 4000, tp_link="pcie") - two.decode_step_s(4, 4000)
    assert 0 < nvlink < 0.1 * two.decode_step_s(4, 4000) < pcie
    memory = 80e9 * catalog.GPU_MEMORY_UTILIZATION
    assert one.kv_capacity_bytes == pytest.approx(memory - 32.8e9 * 2, abs=2)
    assert two.kv_capacity_bytes == pytest.approx(2 * memory - 32.8e9 * 2, abs=2)


def test_prefill_is_compute_bound_and_decode_memory_bound():
    d = catalog.Deployment.of("Qwen3-32B", "H100-SXM")
    prefill = d.prefill_s(1024)
    flops_time = 2 * 32.8e9 * 1024 / (989e12 * catalog.PREFILL_COMPUTE_EFFICIENCY)
    assert prefill >= flops_time
    assert prefill < flops_time * 1.2
    assert d.decode_step_s(1, 100) == pytest.approx(
        32.8e9 * 2 / (3350e9 * catalog.DECODE_BANDWIDTH_EFFICIENCY), rel=0.02
    )


def test_moe_reads_more_experts_with_bigger_batches():
    d = catalog.Deployment.of("Mixtral-8x7B", "H100-SXM", 2)
    assert d.decode_step_s(1, 100) < d.decode_step_s(16, 1600)
    assert d._weight_bytes_read(1) == pytest.approx(12.9e9 * 2, rel=0.01)
    assert d._weight_bytes_read(64) == pytest.approx(46.7e9 * 2, rel=0.01)


def test_a_model_that_does_not_fit_says_which_tp_would():
    with pytest.raises(catalog.CatalogError, match="tensor-parallel degree of at least 2"):
        catalog.Deployment.of("Llama-3-70B", "H100-SXM", 1)
    with pytest.raises(catalog.CatalogError, match="unknown GPU 'B200'"):
        catalog.Deployment.of("Llama-3-70B", "B200", 2)


def test_load_and_transfer_times():
    m = catalog.model("Qwen3-32B")
    assert catalog.load_time_s(m, disk_gbps=5.0, engine_start_s=10) == pytest.approx(65.6 / 5 + 10)
    draft = catalog.model(m.draft)
    assert catalog.load_time_s(draft) < 5 < catalog.load_time_s(m)  # the draft loads in seconds
    four_k = catalog.kv_bytes(m, 4096)
    assert catalog.kv_transfer_s(four_k, "infiniband") == pytest.approx(four_k / 50e9)
    assert (
        catalog.kv_transfer_s(four_k, "nvlink")
        < catalog.kv_transfer_s(four_k, "pcie")
        < catalog.kv_transfer_s(four_k, "mystery")
    )
    assert catalog.kv_transfer_s(four_k, "pcie", catalog.LOADED_LINK_FACTOR) == pytest.approx(
        3 * catalog.kv_transfer_s(four_k, "pcie")
    )


def test_decode_step_times_in_one_pass_are_step_s_to_the_bit():
    """The simulator's closed-form decode runs take their step times from decode_step_times; its fast path must equal
    the step-by-step one exactly, so these are step_s's own floats, dense and MoE, with and without TP."""
    checked = 0
    for model_key in catalog.MODELS:
        for gpu_key in catalog.GPUS:
            for tp in (1, 2, 4, 8):
                try:
                    d = catalog.Deployment.of(model_key, gpu_key, tp=tp)
                except catalog.CatalogError:
                    continue  # does not fit
                for batch in (0, 1, 3, 64, 255):
                    contexts = range(batch * 7, batch * 7 + 40 * max(batch, 1), max(batch, 1))
                    assert d.decode_step_times(batch, contexts) == [d.step_s(0, 0, batch, c) for c in contexts]
                    checked += 1
    assert checked > 100
