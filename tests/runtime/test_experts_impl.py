"""runtime.experts_impl: which experts implementation each phase runs, and the one-line refusal of a plan whose
fallback would not fit what it set aside."""

import json
from pathlib import Path

import pytest
import torch

import runtime.experts_impl as experts_impl
from planner.model.activations import PLANNED_EXPERTS_IMPLEMENTATION, decode_activations, prefill_activations
from planner.errors import UsageError

CONFIG = json.loads((Path(__file__).resolve().parents[2] / "examples/qwen3-30b-a3b/config.json").read_text())
CPU = torch.device("cpu")


def test_the_planned_implementation_runs_where_grouped_mm_is_native(monkeypatch):
    monkeypatch.setattr(experts_impl, "grouped_mm_native", lambda device, dtype: True)
    assert all(experts_impl.implementation_for(phase, CPU) == PLANNED_EXPERTS_IMPLEMENTATION[phase]
               for phase in ("decode", "prefill"))


def test_without_grouped_mm_decode_stays_capturable_and_prefill_small(monkeypatch):
    monkeypatch.setattr(experts_impl, "grouped_mm_native", lambda device, dtype: False)
    assert experts_impl.implementation_for("decode", CPU) == "batched_mm"  # no host synchronisation
    assert experts_impl.implementation_for("prefill", CPU) == "eager"  # never gathers a chunk's weights


def test_a_fallback_needing_more_than_the_plan_set_aside_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(experts_impl, "grouped_mm_native", lambda device, dtype: False)
    options = dict(num_sequences=32, context_tokens=4096, chunk_tokens=2048, static_cache_tokens=4160)
    planned = max(decode_activations(CONFIG, num_sequences=32, context_tokens=4096, static_cache_tokens=4160),
                  prefill_activations(CONFIG, chunk_tokens=2048), key=lambda peak: peak.planned_bytes)
    with pytest.raises(UsageError) as error:
        experts_impl.check_fallback_fits(CONFIG, CPU, activation_bytes=planned.planned_bytes, **options)
    message = str(error.value)
    assert "\n" not in message and "decode through batched_mm" in message and len(message) <= 300
    gathered = decode_activations(CONFIG, num_sequences=32, context_tokens=4096, static_cache_tokens=4160,
                                  experts_implementation="batched_mm")
    eager = prefill_activations(CONFIG, chunk_tokens=2048, experts_implementation="eager")
    roomy = max(gathered.planned_bytes, eager.planned_bytes)
    experts_impl.check_fallback_fits(CONFIG, CPU, activation_bytes=roomy, **options)  # fits: no error


def test_native_grouped_mm_needs_nothing_checked(monkeypatch):
    monkeypatch.setattr(experts_impl, "grouped_mm_native", lambda device, dtype: True)
    experts_impl.check_fallback_fits(CONFIG, CPU, activation_bytes=1, num_sequences=32, context_tokens=4096,
                                     chunk_tokens=2048, static_cache_tokens=4160)


def test_a_decode_loop_runs_decodes_implementation_and_prefills_through_prefills(monkeypatch, tmp_path):
    """The model switches at the phase's edge: a prefill after decode steps no longer runs decode's choice."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from runtime.graph import DecodeLoop

    monkeypatch.setattr(experts_impl, "grouped_mm_native", lambda device, dtype: False)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    loop = DecodeLoop(model, batch=2, max_cache_tokens=16, device=CPU, steps_per_call=1)
    loop.prefill(torch.randint(0, 64, (2, 4)))
    assert model.config._experts_implementation == "eager"
    loop.step()
    assert model.config._experts_implementation == "batched_mm"
    assert experts_impl.use_phase(model, "prefill", CPU) == "eager"


def test_grouped_mm_on_cuda_is_native_for_bf16_only(monkeypatch):
    """torch's CUDA grouped GEMM takes bf16: an fp32 model decodes through batched_mm, capturable and exact."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        pytest.skip("this torch has no grouped GEMM at all")
    assert experts_impl.grouped_mm_native(cuda, torch.bfloat16)
    assert not experts_impl.grouped_mm_native(cuda, torch.float32)
    assert experts_impl.implementation_for("decode", cuda, torch.float32) == "batched_mm"


def test_an_fp32_plan_already_planned_its_fallbacks_so_nothing_is_refused(monkeypatch):
    """The dtype is read as the plan's estimate read it: fp32 experts were planned through batched_mm and
    eager, so a stack without grouped_mm runs what was planned (bf16 would be held to its activation line)."""
    monkeypatch.setattr(experts_impl, "grouped_mm_native", lambda device, dtype: False)
    options = dict(num_sequences=32, context_tokens=4096, chunk_tokens=2048, static_cache_tokens=4160)
    experts_impl.check_fallback_fits({**CONFIG, "torch_dtype": "float32"}, CPU, activation_bytes=1, **options)
    nested = {"model_type": "x", "text_config": {**CONFIG, "torch_dtype": "float16"}}
    experts_impl.check_fallback_fits(nested, CPU, activation_bytes=1, **options)
    with pytest.raises(UsageError):
        experts_impl.check_fallback_fits(CONFIG, CPU, activation_bytes=1, **options)
