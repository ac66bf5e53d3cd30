"""The activation estimate against the GPU's own peak: a Qwen3-8B-shaped model cut to 2 layers, bf16.

Each case measures ``torch.cuda.max_memory_allocated`` during one step minus what is allocated after it
(weights, the static KV cache, the decode loop's buffers, and what the step allocates for good: cuBLAS
workspaces of new streams when graphed, listed as "kept"; runtime.measure_activations.ActivationMeasurement): decode
steps of B = 1, 16, 64, 256 sequences at context 1024 over the runtime's static cache, eagerly and captured
in a CUDA graph, and prefill chunks of 2048 tokens. The estimate must bound the measured peak and
stay within BOUND of it. The CUDA context (memory the driver holds outside PyTorch's allocator) is measured
too. A table is printed last, and written to $OUT/activations_gpu.json when OUT is set.

Run on the device:  PYTHONPATH=. python3 -m pytest -q -s tests/planner/test_activations_gpu.py
"""

import json
import os
from pathlib import Path

import pytest
import torch

from planner.model.activations import decode_activations, prefill_activations

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO_ROOT = Path(__file__).resolve().parents[2]
CONTEXT_TOKENS = 1024
CHUNK_TOKENS = 2048
#: measured <= estimate <= BOUND x measured
BOUND = 1.5
ROWS: list[dict] = []


def _expands_kv_heads() -> bool:
    from transformers.integrations import sdpa_attention

    return not hasattr(sdpa_attention, "pack_gqa")  # later versions pack one-token GQA decode instead


@pytest.fixture(scope="module")
def qwen3_8b_two_layers():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((REPO_ROOT / "examples/qwen3-8b/config.json").read_text())
    config["num_hidden_layers"] = 2
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16).eval()
    yield config, model
    del model
    torch.cuda.empty_cache()


def _record(case: str, estimate, measured) -> float:
    # what a plan sets aside: the modelled peak and a flat MiB of kernel scratch (KERNEL_SCRATCH_BYTES)
    ratio = estimate.planned_bytes / max(1, measured.activation_bytes)
    ROWS.append({"case": case, "estimate_bytes": estimate.planned_bytes, "measured_bytes": measured.activation_bytes,
                 "persistent_bytes": measured.persistent_bytes, "reserved_bytes": measured.reserved_bytes,
                 "ratio": round(ratio, 3), "phase": estimate.phase})
    print(f"\n{case}: estimate {estimate.peak_bytes / 2**20:.1f} MiB, measured {measured.activation_bytes / 2**20:.1f} "
          f"MiB, ratio {ratio:.2f}; {estimate.describe()}")
    return ratio


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("num_sequences", [1, 16, 64, 256])
def test_decode_step_peak(qwen3_8b_two_layers, num_sequences, graphed):
    from runtime.graph import cache_tokens_for
    from runtime.measure_activations import decode_activation_peak

    config, model = qwen3_8b_two_layers
    torch.cuda.empty_cache()
    measured = decode_activation_peak(model, num_sequences=num_sequences, context_tokens=CONTEXT_TOKENS,
                                      graphed=graphed)
    estimate = decode_activations(config, num_sequences=num_sequences, context_tokens=CONTEXT_TOKENS,
                                  static_cache_tokens=cache_tokens_for(CONTEXT_TOKENS),
                                  expand_kv_heads=_expands_kv_heads())
    ratio = _record(f"decode B={num_sequences} C={CONTEXT_TOKENS} {'graphed' if graphed else 'eager'}", estimate,
                    measured)
    assert 1.0 <= ratio <= BOUND, estimate.describe()


@pytest.mark.parametrize("context_tokens", [0, CHUNK_TOKENS])
def test_prefill_chunk_peak(qwen3_8b_two_layers, context_tokens):
    from runtime.graph import cache_tokens_for
    from runtime.measure_activations import prefill_activation_peak

    config, model = qwen3_8b_two_layers
    torch.cuda.empty_cache()
    measured = prefill_activation_peak(model, chunk_tokens=CHUNK_TOKENS, context_tokens=context_tokens)
    estimate = prefill_activations(config, chunk_tokens=CHUNK_TOKENS, context_tokens=context_tokens,
                                   static_cache_tokens=cache_tokens_for(context_tokens + CHUNK_TOKENS),
                                   expand_kv_heads=_expands_kv_heads())
    ratio = _record(f"prefill chunk {CHUNK_TOKENS} after {context_tokens}", estimate, measured)
    assert 1.0 <= ratio <= BOUND, estimate.describe()


#: MoE shapes cut to two layers (DeepSeek-V2-Lite's first is dense, its second MoE with shared experts and MLA)
MOE_SHAPES = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite")


def _gpu_model(config: dict):
    """The model of ``config`` with seeded random weights, bf16 on the GPU, its experts (if any) running the
    prefill implementation, as run's loader leaves them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from runtime.experts_impl import PREFILL, use_phase

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16).eval()
    use_phase(model, PREFILL, torch.device("cuda"))
    return model


@pytest.fixture(scope="module", params=MOE_SHAPES)
def moe_two_layers(request):
    """A MoE model of a public shape, two layers, bf16 on the GPU, its experts as run's loader leaves them."""
    config = json.loads((REPO_ROOT / "examples" / request.param / "config.json").read_text())
    config["num_hidden_layers"] = 2
    model = _gpu_model(config)
    yield request.param, config, model
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("num_sequences", [1, 16, 64])
def test_moe_decode_step_peak(moe_two_layers, num_sequences):
    """Captured decode, experts through the implementation run's decode loop picks (runtime.experts_impl)."""
    from runtime.experts_impl import DECODE, implementation_for
    from runtime.graph import cache_tokens_for
    from runtime.measure_activations import decode_activation_peak

    name, config, model = moe_two_layers
    torch.cuda.empty_cache()
    measured = decode_activation_peak(model, num_sequences=num_sequences, context_tokens=CONTEXT_TOKENS,
                                      graphed=True)
    implementation = implementation_for(DECODE, torch.device("cuda"))
    estimate = decode_activations(config, num_sequences=num_sequences, context_tokens=CONTEXT_TOKENS,
                                  static_cache_tokens=cache_tokens_for(CONTEXT_TOKENS),
                                  expand_kv_heads=_expands_kv_heads(), experts_implementation=implementation)
    ratio = _record(f"{name} decode B={num_sequences} {implementation}", estimate, measured)
    assert 1.0 <= ratio <= BOUND, estimate.describe()


def test_moe_prefill_chunk_peak(moe_two_layers):
    """A 2048-token chunk: the allocation that ran a serving plan out of memory through batched_mm."""
    from runtime.experts_impl import PREFILL, implementation_for
    from runtime.graph import cache_tokens_for
    from runtime.measure_activations import prefill_activation_peak

    name, config, model = moe_two_layers
    torch.cuda.empty_cache()
    measured = prefill_activation_peak(model, chunk_tokens=CHUNK_TOKENS, context_tokens=0)
    implementation = implementation_for(PREFILL, torch.device("cuda"))
    estimate = prefill_activations(config, chunk_tokens=CHUNK_TOKENS, context_tokens=0,
                                   static_cache_tokens=cache_tokens_for(CHUNK_TOKENS),
                                   expand_kv_heads=_expands_kv_heads(), experts_implementation=implementation)
    ratio = _record(f"{name} prefill {CHUNK_TOKENS} {implementation}", estimate, measured)
    assert 1.0 <= ratio <= BOUND, estimate.describe()


#: sliding-window shapes (issue 23): Gemma-3-27B's language model at 6 layers (five sliding of 1,024 tokens, one
#: global), gpt-oss at 2 layers (one sliding of 128, one full; eager attention with sinks, 32 bf16 experts)
SLIDING_CONTEXT_TOKENS = 2048  # past both windows


def _sliding_config(name: str) -> dict:
    if name == "gemma3":
        release = json.loads((REPO_ROOT / "examples/gemma-3-27b-it/config.json").read_text())
        return dict(release["text_config"], model_type="gemma3_text", num_hidden_layers=6, torch_dtype="bfloat16")
    config = json.loads((REPO_ROOT / "plans/models/gpt-oss-120b/config.json").read_text())
    for key in ("quantization_config", "layer_types"):
        config.pop(key)
    return dict(config, num_hidden_layers=2, num_local_experts=32)


@pytest.fixture(scope="module", params=["gemma3", "gpt_oss"])
def sliding_model(request):
    """A sliding-window model, bf16 on the GPU, experts (gpt-oss) as run's loader leaves them."""
    config = _sliding_config(request.param)
    model = _gpu_model(config)
    yield request.param, config, model
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("num_sequences", [1, 16, 64])
def test_sliding_decode_step_peak(sliding_model, num_sequences, graphed):
    """Decode over the runtime's cache (sliding layers as rings of their window): the full layer's step is the
    peak, and the estimate (windows ignored) holds it."""
    from runtime.experts_impl import DECODE, implementation_for
    from runtime.graph import cache_tokens_for
    from runtime.measure_activations import decode_activation_peak

    name, config, model = sliding_model
    torch.cuda.empty_cache()
    measured = decode_activation_peak(model, num_sequences=num_sequences, context_tokens=SLIDING_CONTEXT_TOKENS,
                                      graphed=graphed)
    estimate = decode_activations(config, num_sequences=num_sequences, context_tokens=SLIDING_CONTEXT_TOKENS,
                                  static_cache_tokens=cache_tokens_for(SLIDING_CONTEXT_TOKENS),
                                  expand_kv_heads=_expands_kv_heads(),
                                  experts_implementation=implementation_for(DECODE, torch.device("cuda")))
    ratio = _record(f"{name} decode B={num_sequences} C={SLIDING_CONTEXT_TOKENS} {'graphed' if graphed else 'eager'}",
                    estimate, measured)
    assert 1.0 <= ratio <= BOUND, estimate.describe()


@pytest.mark.parametrize("context_tokens", [0, SLIDING_CONTEXT_TOKENS])
def test_sliding_prefill_chunk_peak(sliding_model, context_tokens):
    from runtime.experts_impl import PREFILL, implementation_for
    from runtime.graph import cache_tokens_for
    from runtime.measure_activations import prefill_activation_peak

    name, config, model = sliding_model
    torch.cuda.empty_cache()
    measured = prefill_activation_peak(model, chunk_tokens=CHUNK_TOKENS, context_tokens=context_tokens)
    estimate = prefill_activations(config, chunk_tokens=CHUNK_TOKENS, context_tokens=context_tokens,
                                   static_cache_tokens=cache_tokens_for(context_tokens + CHUNK_TOKENS),
                                   expand_kv_heads=_expands_kv_heads(),
                                   experts_implementation=implementation_for(PREFILL, torch.device("cuda")))
    ratio = _record(f"{name} prefill {CHUNK_TOKENS} after {context_tokens}", estimate, measured)
    assert 1.0 <= ratio <= BOUND, estimate.describe()


#: how far a measured capture may stand above the phase it books: cuBLAS's workspaces (32 MiB a stream with
#: CUBLAS_WORKSPACE_CONFIG=:4096:8), which the measurement frees and counts again
OVERBOOK_BYTES = 64 * 2**20


@pytest.mark.parametrize("num_sequences", [1, 16])
def test_measured_captures_hold_runs_phases(qwen3_8b_two_layers, num_sequences):
    """make --measure books a graphed decode step's pool and a graphed chunk at what their captures measured
    (issue 36). Run's serving bench then grows its reserve by at most that from its cache through the fill and
    capture, and in its chunk phase, and by no less than that less OVERBOOK_BYTES (the measurement frees cuBLAS's
    workspaces first, so it counts the ones run's process may hold already): the booking is the phases' size, not
    a bound far above it."""
    from runtime.graph import DecodeLoop, cache_tokens_for, chunk_graph
    from runtime.measure_activations import chunk_graph_peak, decode_activation_peak

    _, model = qwen3_8b_two_layers
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    decode = decode_activation_peak(model, num_sequences=num_sequences, context_tokens=CONTEXT_TOKENS, graphed=True)
    torch.cuda.empty_cache()
    chunk = chunk_graph_peak(model, chunk_tokens=CHUNK_TOKENS)
    torch.cuda.empty_cache()
    # run's order (runtime.serving.serve_and_time): cache, fill, capture, then the chunk beside the held graph, in
    # a process that has not yet run a matmul (no cuBLAS workspace)
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    loop = DecodeLoop(model, batch=num_sequences, max_cache_tokens=cache_tokens_for(CONTEXT_TOKENS), device=device,
                      steps_per_call=1)
    torch.cuda.reset_peak_memory_stats(device)
    before_capture = torch.cuda.memory_reserved(device)
    loop.fill(CONTEXT_TOKENS)
    loop.capture()
    loop.step()
    capture_growth = torch.cuda.max_memory_reserved(device) - before_capture
    torch.cuda.reset_peak_memory_stats(device)
    before_chunk = torch.cuda.memory_reserved(device)
    ids = torch.randint(0, model.config.vocab_size, (1, CHUNK_TOKENS), device=device)
    graph = chunk_graph(model, ids)
    graph.replay()
    torch.cuda.synchronize(device)
    chunk_growth = torch.cuda.max_memory_reserved(device) - before_chunk
    del graph, loop
    print(f"\nB={num_sequences}: capture grew {capture_growth / 2**20:.0f} MiB, measured "
          f"{decode.reserved_bytes / 2**20:.0f}; chunk grew {chunk_growth / 2**20:.0f} MiB, measured "
          f"{chunk.reserved_bytes / 2**20:.0f}")
    assert decode.reserved_bytes - OVERBOOK_BYTES <= capture_growth <= decode.reserved_bytes
    assert chunk.reserved_bytes - OVERBOOK_BYTES <= chunk_growth <= chunk.reserved_bytes


def test_cuda_context_and_table(qwen3_8b_two_layers):
    """Memory the process holds outside the allocator (CUDA context, module images, library handles); then the
    table of every case above."""
    import transformers

    torch.cuda.synchronize()
    free_bytes, total_bytes = torch.cuda.mem_get_info()
    context_bytes = total_bytes - free_bytes - torch.cuda.memory_reserved()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"K/V repeated to every head: {_expands_kv_heads()}")
    print(f"CUDA context and libraries outside the allocator: {context_bytes / 2**20:.0f} MiB "
          f"(GPU used {(total_bytes - free_bytes) / 2**20:.0f} MiB, allocator reserved "
          f"{torch.cuda.memory_reserved() / 2**20:.0f} MiB)")
    print(f"{'case':<34} {'estimate MiB':>12} {'measured MiB':>12} {'ratio':>6} {'kept MiB':>8} "
          f"{'reserved MiB':>12}  phase")
    for row in ROWS:
        print(f"{row['case']:<34} {row['estimate_bytes'] / 2**20:>12.1f} {row['measured_bytes'] / 2**20:>12.1f} "
              f"{row['ratio']:>6.2f} {row['persistent_bytes'] / 2**20:>8.1f} {row['reserved_bytes'] / 2**20:>12.1f}  "
              f"{row['phase']}")
    if os.environ.get("OUT"):
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "transformers": transformers.__version__, "cuda_context_bytes": context_bytes, "cases": ROWS}
        (Path(os.environ["OUT"]) / "activations_gpu.json").write_text(json.dumps(result, indent=1))
    assert 0 < context_bytes < 4 * 2**30
