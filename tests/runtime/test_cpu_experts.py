"""runtime.cpu_experts: a routed layer with some experts computed on the host CPU equals the all-resident layer
(transformers' batched_mm) within the stated tolerance, bit for bit where no expert is on the CPU; the CPU's rate
is measured with the threads set and fits a profile section the planner reads."""

import pytest
import torch
import yaml

from planner.source.profile import cpu_experts_to_dict, load_profile, profile_from_dict, profile_to_dict
from runtime.cpu_experts import (BF16_TOLERANCE, FP32_TOLERANCE, ExpertShape, HostExperts, compute_pairs,
                                 cpu_expert_ms, cpu_experts_profile, cpu_threads, fitted_rates,
                                 hybrid_experts_forward, measure_cpu_experts, random_experts)
from tests.runtime_models import routed_moe_model

NUM_EXPERTS = 16


@pytest.fixture(scope="module")
def layer():
    """Layer 0's MoE block of a tiny Qwen3-MoE (16 experts, top-2, hidden 64), fp32, and a batch's routing."""
    model = routed_moe_model(num_experts=NUM_EXPERTS)
    block = model.model.layers[0].mlp
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, weights, index = block.gate(hidden)
    return block.experts, hidden, index, weights


def _reference(experts, hidden, index, weights):
    from transformers.integrations.moe import batched_mm_experts_forward

    with torch.no_grad():
        return batched_mm_experts_forward(experts, hidden, index, weights)


def _hybrid(experts, hidden, index, weights, on_cpu_ids, host=None):
    on_cpu = torch.zeros(NUM_EXPERTS, dtype=torch.bool)
    on_cpu[list(on_cpu_ids)] = True
    placeholder = next(e for e in range(NUM_EXPERTS) if e not in on_cpu_ids)
    with torch.no_grad():
        return hybrid_experts_forward(experts, hidden, index, weights, host=host or HostExperts.from_module(experts),
                                      on_cpu=on_cpu, placeholder_expert=placeholder)


def _within(actual, reference, tolerance):
    return (actual.float() - reference.float()).abs().max() <= tolerance * reference.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_expert_on_the_cpu_is_batched_mm_bit_for_bit(layer, dtype):
    experts, hidden, index, weights = layer
    experts = experts.to(dtype)
    try:
        reference = _reference(experts, hidden.to(dtype), index, weights.to(dtype))
        assert torch.equal(_hybrid(experts, hidden.to(dtype), index, weights.to(dtype), ()), reference)
    finally:
        experts.float()


@pytest.mark.parametrize("on_cpu_ids", [range(0, NUM_EXPERTS, 2), range(NUM_EXPERTS - 1)])
def test_fp32_on_both_sides_is_within_the_stated_tolerance(layer, on_cpu_ids):
    experts, hidden, index, weights = layer
    assert set(index.flatten().tolist()) & set(on_cpu_ids)  # the CPU computes some of the routed pairs
    reference = _reference(experts, hidden, index, weights)
    hybrid = _hybrid(experts, hidden, index, weights, tuple(on_cpu_ids))
    assert _within(hybrid, reference, FP32_TOLERANCE)


def test_the_cpu_results_are_the_ones_combined(layer):
    experts, hidden, index, weights = layer
    cpu_ids = tuple(range(0, NUM_EXPERTS, 2))
    host = HostExperts(experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone())
    host.down[list(cpu_ids)] *= 2  # the CPU's experts, and only theirs, doubled
    doubled = _hybrid(experts, hidden, index, weights, cpu_ids, host)
    original = HostExperts.from_module(experts)
    expected = torch.zeros_like(hidden)
    for token in range(hidden.shape[0]):
        for rank in range(index.shape[1]):
            expert = index[token, rank].item()
            output = original.expert(expert, hidden[token:token + 1])[0]
            expected[token] += (2 if expert in cpu_ids else 1) * weights[token, rank] * output
    assert _within(doubled, expected, FP32_TOLERANCE)
    assert not _within(doubled, _reference(experts, hidden, index, weights), 1e-2)


def test_bf16_model_with_a_cpu_copy_is_within_the_bf16_tolerance(layer):
    experts, hidden, index, weights = layer
    experts = experts.to(torch.bfloat16)
    try:
        args = (hidden.bfloat16(), index, weights.bfloat16())
        reference = _reference(experts, *args)
        for dtype in ("fp32", "bf16"):
            hybrid = _hybrid(experts, *args, tuple(range(0, NUM_EXPERTS, 2)), HostExperts.from_module(experts, dtype))
            assert hybrid.dtype == torch.bfloat16 and _within(hybrid, reference, BF16_TOLERANCE)
    finally:
        experts.float()


def test_per_expert_tensors_give_the_fused_layout(layer):
    experts = layer[0]
    # host weights already in the copy's dtype are read where they lie (no second host copy)
    assert HostExperts.from_module(experts).down.data_ptr() == experts.down_proj.data_ptr()
    intermediate = experts.down_proj.shape[-1]
    gate = [w[:intermediate] for w in experts.gate_up_proj]
    up = [w[intermediate:] for w in experts.gate_up_proj]
    per_expert = HostExperts.from_per_expert(gate, up, list(experts.down_proj))
    fused = HostExperts.from_module(experts)
    assert torch.equal(per_expert.gate_up, fused.gate_up) and torch.equal(per_expert.down, fused.down)
    assert fused.nbytes == 3 * 64 * intermediate * NUM_EXPERTS * 4
    assert HostExperts.from_module(experts, "bf16").nbytes == fused.nbytes // 2


def test_experts_not_swiglu_are_refused(layer):
    experts = layer[0]
    experts.has_bias = True
    try:
        with pytest.raises(ValueError, match="biases"):
            HostExperts.from_module(experts)
    finally:
        experts.has_bias = False
    with pytest.raises(ValueError, match="SwiGLU"):
        HostExperts(torch.zeros(2, 6, 4), torch.zeros(2, 4, 4))
    with pytest.raises(ValueError, match="dtype"):
        HostExperts(torch.zeros(2, 6, 4), torch.zeros(2, 4, 3), "fp8")


def test_compute_pairs_equals_one_token_at_a_time():
    experts = random_experts(ExpertShape(hidden_size=32, intermediate_size=16), 4, "fp32")
    hidden = torch.randn(5, 32)
    ids = torch.tensor([2, 0, 2, 3, 2])
    out = compute_pairs(experts, hidden, ids)
    for row in range(5):
        assert torch.allclose(out[row], experts.expert(ids[row].item(), hidden[row:row + 1])[0], atol=1e-6)


# ---- the rate ------------------------------------------------------------------------------------------------------


def test_measurement_sets_and_restores_the_threads():
    before = torch.get_num_threads()
    with cpu_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    shape = ExpertShape(hidden_size=64, intermediate_size=32)
    measured = measure_cpu_experts(shape, tokens=(1, 4), num_threads=1, pool_bytes=2**18, repeats=2)
    assert measured["threads"] == 1 and torch.get_num_threads() == before
    assert set(measured["ms_per_expert_at_tokens"]) == {"bf16", "fp32"}
    assert all(set(table) == {1, 4} and min(table.values()) > 0
               for table in measured["ms_per_expert_at_tokens"].values())
    # a larger expert takes longer at one token, on the same pool bytes
    large = random_experts(ExpertShape(hidden_size=256, intermediate_size=128), 4, "fp32")
    small = random_experts(shape, 4, "fp32")
    assert cpu_expert_ms(large, 1, 1, repeats=3) > cpu_expert_ms(small, 1, 1, repeats=3)


def test_fitted_rates_recover_the_rates_of_an_exact_table():
    shape, small = ExpertShape(hidden_size=2048, intermediate_size=768), ExpertShape(hidden_size=512,
                                                                                     intermediate_size=192)
    bytes_per_s, flops_per_s, overhead_ms = 40e9, 1e12, 0.02

    def ms(expert, tokens):
        flops_ms = 1e3 * (tokens - 1) * expert.flops_per_token / flops_per_s
        return overhead_ms + 1e3 * expert.num_params * 4 / bytes_per_s + flops_ms

    table = {t: ms(shape, t) for t in (1, 2, 4, 8)}
    rates = fitted_rates(shape, table, ms(small, 1), small, 4)
    assert rates["weight_bytes_per_s"] == pytest.approx(bytes_per_s)
    assert rates["flops_per_s"] == pytest.approx(flops_per_s)
    assert rates["overhead_us"] == pytest.approx(1e3 * overhead_ms)
    # a small expert measured slower than its bytes explain (noise): no negative overhead
    assert fitted_rates(shape, table, ms(shape, 1) * 2, small, 4)["overhead_us"] == 0.0


def test_the_calibrated_section_reads_back_through_the_profile(tmp_path):
    section, tables = cpu_experts_profile(ExpertShape(hidden_size=64, intermediate_size=32), num_threads=1,
                                          tokens=(1, 2, 4), pool_bytes=2**18, repeats=2, stamp="test")
    assert section.threads == 1 and section.dtype in tables
    assert [t for t, _ in section.ms_per_expert_at_tokens] == [1, 2, 4]
    from runtime.cpu_kernel import load_kernel

    if load_kernel() is not None:  # the note times torch's path beside the kernel, at one token, both dtypes
        assert "torch's path at 1 token: bf16 " in section.note and ", fp32 " in section.note
    data = profile_to_dict(load_profile("h100-sxm"))
    data["cpu_experts"] = cpu_experts_to_dict(section)
    read = profile_from_dict(yaml.safe_load(yaml.safe_dump(data, sort_keys=False)), "calibrated.yaml")
    assert read.cpu_experts == section


def test_a_calibrated_profile_file_holds_the_section(tmp_path):
    from dataclasses import replace

    from runtime.calibrate import calibrated_yaml

    section, _ = cpu_experts_profile(ExpertShape(hidden_size=64, intermediate_size=32), num_threads=1,
                                     tokens=(1, 8), pool_bytes=2**18, repeats=2)
    profile = replace(load_profile("h100-sxm"), cpu_experts=section)
    path = tmp_path / "calibrated.yaml"
    path.write_text(calibrated_yaml(profile))
    assert load_profile(str(path)) == profile
