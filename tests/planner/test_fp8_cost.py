"""The cost model's FP8 compute (planner.model.fp8_cost, issue 23): run dequantizes FP8 linears each step (9 HBM bytes
per FP8 weight at the bf16 rate); an engine's FP8 kernel reads the byte once at the FP8 rate. Pure planner."""

import pytest

from planner.model.cost import Workload, layer_cost, roofline_ms
from planner.model.fp8_cost import DEQUANTIZED, NATIVE, Fp8Compute, fp8_compute_for
from planner.model.layout import LayerInfo
from planner.source.profile import load_profile

HIDDEN, INNER = 4096, 12288


def _layer(dtype: str, nbytes_per_weight: int) -> LayerInfo:
    """One Qwen3-8B-shaped MLP (gate, up, down) in ``dtype``."""
    params = []
    for name, shape in (("gate_proj", (INNER, HIDDEN)), ("up_proj", (INNER, HIDDEN)), ("down_proj", (HIDDEN, INNER))):
        params.append((f"model.layers.0.mlp.{name}.weight", dtype, shape, shape[0] * shape[1] * nbytes_per_weight))
        if dtype == "F8_E4M3":
            scales = (shape[0] // 128, shape[1] // 128)
            params.append((f"model.layers.0.mlp.{name}.weight_scale_inv", "F32", scales, 4 * scales[0] * scales[1]))
    return LayerInfo(index=0, params=tuple(params))


def _geometry():
    from planner.model.cost import ModelGeometry

    return ModelGeometry(num_heads=32, num_kv_heads=8, head_dim=128, num_experts=0, top_k=0)


def test_run_pays_the_dequantized_traffic_and_the_bf16_rate():
    decode = Workload(tokens_per_step=1, sequences_per_step=1, context_tokens=0)
    weights = 3 * HIDDEN * INNER
    fp8 = _layer("F8_E4M3", 1)
    cost = layer_cost(fp8, _geometry(), decode, kv_bytes=0, fp8=DEQUANTIZED)
    assert not cost.fp8_rate
    scale_bytes = fp8.nbytes - weights
    # the matmul reads the widened weight (2 bytes); the widening and the scaling (7 bytes) run before it
    assert cost.hbm_bytes == pytest.approx(2 * weights + scale_bytes)
    assert cost.serial_bytes == pytest.approx(7 * weights)
    native = layer_cost(fp8, _geometry(), decode, kv_bytes=0, fp8=NATIVE)
    assert native.fp8_rate and native.hbm_bytes == pytest.approx(weights + scale_bytes) and native.serial_bytes == 0
    bf16 = layer_cost(_layer("BF16", 2), _geometry(), decode, kv_bytes=0)
    # decode on run's FP8 path: ~4.5x the bf16 bytes
    assert cost.flops == bf16.flops and cost.hbm_bytes + cost.serial_bytes > 4 * bf16.hbm_bytes


def test_prefill_of_the_dequantized_path_runs_at_the_bf16_rate_after_its_passes():
    """The passes before the matmul run at the profile's measured dequantizing rate, else at FP8_DEQUANT_HBM_SHARE
    of its HBM rate (on the H100 they reached 0.23-0.28 of it, not the derated matmul read's 0.574)."""
    from dataclasses import replace

    from planner.model.fp8_cost import FP8_DEQUANT_HBM_SHARE, dequant_bytes_per_s
    from planner.source.profile import Figure

    profile = load_profile("h100-sxm")
    prefill = Workload(tokens_per_step=8192)
    fp8 = layer_cost(_layer("F8_E4M3", 1), _geometry(), prefill, kv_bytes=0)
    fp8_ms = roofline_ms(fp8, profile)
    bf16_ms = roofline_ms(layer_cost(_layer("BF16", 2), _geometry(), prefill, kv_bytes=0), profile)
    native_ms = roofline_ms(layer_cost(_layer("F8_E4M3", 1), _geometry(), prefill, kv_bytes=0, fp8=NATIVE), profile)
    passes_ms = 1e3 * fp8.serial_bytes / (profile.hbm_bytes_per_s.value * FP8_DEQUANT_HBM_SHARE)
    assert passes_ms > 0 and fp8_ms == pytest.approx(bf16_ms + passes_ms) and native_ms < 0.6 * bf16_ms
    measured = replace(profile, fp8_dequant_bytes_per_s=Figure(value=1e12, source="measured", note="test"))
    assert dequant_bytes_per_s(measured) == 1e12
    assert roofline_ms(fp8, measured) == pytest.approx(bf16_ms + 1e3 * fp8.serial_bytes / 1e12)


def test_the_target_chooses_the_path():
    assert fp8_compute_for(None) is DEQUANTIZED
    assert fp8_compute_for("vllm") is NATIVE and fp8_compute_for("sglang") is NATIVE
    # FP8 routed experts: run refuses them, so an engine's rate prices them whatever the target
    assert fp8_compute_for(None, fp8_experts=True).fp8_rate and fp8_compute_for("vllm", fp8_experts=True) is NATIVE


def test_fp8_experts_are_found_by_name_and_dtype():
    from planner.model.fp8_cost import has_fp8_experts
    from planner.source.safetensors_header import TensorEntry

    def entry(name, dtype):
        return TensorEntry(name=name, dtype=dtype, shape=(2, 2), nbytes=4, file="a.safetensors")

    dense = [entry("model.layers.0.mlp.down_proj.weight", "F8_E4M3"),
             entry("model.layers.0.mlp.shared_experts.down_proj.weight", "F8_E4M3"),
             entry("model.layers.0.mlp.experts.0.down_proj.weight", "BF16")]
    assert not has_fp8_experts(dense)
    assert has_fp8_experts(dense + [entry("model.layers.1.mlp.experts.7.up_proj.weight", "F8_E4M3")])
    with pytest.raises(ValueError, match="hbm_bytes_per_fp8_byte"):
        Fp8Compute(hbm_bytes_per_fp8_byte=0.5, fp8_rate=True, description="")
