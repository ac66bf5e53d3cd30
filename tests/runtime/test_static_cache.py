"""runtime.static_cache: sliding-window layers as GPU-indexed rings, sized as the planner's KV model sizes them,
decoding as a growing cache does; graphed on a GPU, bit for bit the eager all-resident model's."""

import json

import pytest
import torch

from planner.model.kv_cache import kv_cache_model
from runtime.graph import DecodeLoop
from runtime.static_cache import RingSlidingLayer, is_graph_safe, static_cache
from tests.runtime_models import save_tiny_gemma3, save_tiny_gpt_oss

CPU = torch.device("cpu")


def _mistral(folder, window: int = 8):
    """Mistral with a window: every layer slides (no layer_types in its config)."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from tests.runtime_models import save_random

    config = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=window)
    return save_random(AutoModelForCausalLM.from_config(config), folder, 0)


SAVERS = {"gemma3": save_tiny_gemma3, "gpt_oss": save_tiny_gpt_oss, "mistral": _mistral}


@pytest.fixture(scope="module", params=sorted(SAVERS))
def sliding_checkpoint(request, tmp_path_factory):
    return SAVERS[request.param](tmp_path_factory.mktemp(request.param))


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path)).eval()


def _cache_bytes(loop: DecodeLoop) -> int:
    return sum(t.numel() * t.element_size() for layer in loop.cache.layers for t in (layer.keys, layer.values))


@pytest.mark.parametrize("cache_tokens", [5, 8, 40])
def test_cache_layers_hold_what_the_planner_counts(sliding_checkpoint, cache_tokens):
    """Full layers hold the cache's length, sliding ones min(window, length): the bytes allocated are the
    planner's KV bytes for that many tokens, below, at and past the window."""
    config = json.loads((sliding_checkpoint / "config.json").read_text())
    model = _model(sliding_checkpoint)
    loop = DecodeLoop(model, batch=3, max_cache_tokens=cache_tokens, device=CPU, steps_per_call=1)
    planned = kv_cache_model(config)
    assert _cache_bytes(loop) == planned.cache_bytes(num_sequences=3, context_tokens=cache_tokens, kv_dtype="auto")
    kinds = [entry.kind for entry in planned.layers]
    assert [isinstance(layer, RingSlidingLayer) for layer in loop.cache.layers] == [k == "sliding" for k in kinds]
    assert all(is_graph_safe(layer) for layer in loop.cache.layers)
    for entry, layer in zip(planned.layers, loop.cache.layers):
        assert layer.keys.shape[2] == entry.held_tokens(cache_tokens)


def _decode(model, prompt, steps: int, cache_tokens: int):
    loop = DecodeLoop(model, batch=prompt.shape[0], max_cache_tokens=cache_tokens, device=CPU, steps_per_call=1)
    loop.prefill(prompt)
    return loop.generate(steps)


@pytest.mark.parametrize("prompt_tokens, chunk_tokens", [(3, 16384), (13, 16384), (13, 4), (20, 6)])
def test_static_decode_equals_a_growing_cache(sliding_checkpoint, prompt_tokens, chunk_tokens, monkeypatch):
    """Prompts inside and past the window, prefilled whole or in chunks that cross it, then decode steps past
    it: each step's logits equal the model's over the whole sequence (no cache) and a dynamic cache's steps."""
    import runtime.graph
    from transformers import DynamicCache

    from runtime.graph import cache_argument

    monkeypatch.setattr(runtime.graph, "PREFILL_CHUNK_TOKENS", chunk_tokens * 2)  # batch 2: chunk tokens each
    model = _model(sliding_checkpoint)
    prompt = torch.randint(0, 256, (2, prompt_tokens), generator=torch.Generator().manual_seed(1))
    steps = 12
    ids, logits = _decode(model, prompt, steps, prompt_tokens + steps)
    with torch.inference_mode():
        whole = model(input_ids=torch.cat([prompt, ids], dim=1)).logits
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt, use_cache=True, **cache_argument(model, cache))
        grown = [model(input_ids=ids[:, i:i + 1], use_cache=True, **cache_argument(model, cache)).logits[:, -1]
                 for i in range(steps)]
    for step in range(steps):
        assert torch.allclose(logits[step], whole[:, prompt_tokens + step], atol=1e-5), step
        assert torch.allclose(logits[step], grown[step], atol=1e-5), step


def test_fill_and_restore_put_the_window_back(sliding_checkpoint):
    """Steps overwrite the oldest slots of a full ring: restore_state gives them back, so the steps after it
    repeat exactly (warm-ups and captures rely on this)."""
    model = _model(sliding_checkpoint)
    loop = DecodeLoop(model, batch=2, max_cache_tokens=40, device=CPU, steps_per_call=1)
    loop.fill(20)  # past the window of 8
    saved = loop.save_state()
    first = loop.generate(5)
    loop.restore_state(saved)
    again = loop.generate(5)
    assert torch.equal(first[0], again[0]) and all(torch.equal(a, b) for a, b in zip(first[1], again[1]))


def test_a_ring_refuses_to_crop():
    layer = RingSlidingLayer(max_cache_len=10, sliding_window=4)
    assert layer.held_tokens == 4
    with pytest.raises(NotImplementedError):
        layer.crop(-1)


def test_a_window_switched_off_leaves_full_layers():
    """Qwen3's use_sliding_window false: no ring, every layer the full length."""
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, sliding_window=4, use_sliding_window=False)
    cache = static_cache(config, 16)
    assert not any(isinstance(layer, RingSlidingLayer) for layer in cache.layers)


# --- on a GPU: graphed, offloaded, bit for bit ------------------------------------------------------------------

def _gpu_decode(model, engine=None, graphed=False, steps=12):
    """3 sequences after a 20-token prompt (past the window of 8), decoded past the window again."""
    prompt = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(2)).cuda()
    loop = DecodeLoop(model, batch=3, max_cache_tokens=40, device=torch.device("cuda"), engine=engine,
                      steps_per_call=1)
    loop.prefill(prompt)
    if graphed:
        loop.capture()
    ids, logits = loop.generate(steps)
    return ids.cpu(), [out.cpu() for out in logits]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 2, 1), (2, 1, 2)])
@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graphed_sliding_decode_bitwise_equal_to_eager_resident(family, shape, dtype, tmp_path):
    """Graphed decode over rings, all-resident and offloaded at three plan shapes: ids and logits bit for bit
    the eager all-resident model's (the same cache, so the same sums)."""
    from runtime.backend import CudaBackend
    from runtime.load import build_model
    from runtime.placement import apply_plan
    from tests.runtime_models import plan_with

    saver = {"gemma3": save_tiny_gemma3, "gpt_oss": save_tiny_gpt_oss}[family]
    # six layers: the (2, 1, 2) shape offloads three, more than its prefetch step (gpt-oss's default four
    # offload two, and the pinned knobs are refused)
    path = saver(tmp_path, hidden=256, dtype=dtype, num_layers=6)
    reference = _gpu_decode(build_model(str(path), None).cuda())
    resident_graphed = _gpu_decode(build_model(str(path), None).cuda(), graphed=True)
    model = build_model(str(path), None)
    engine = apply_plan(model, plan_with(path, *shape, tokens=3, sequences=3, context=20, cuda_graph=True),
                        CudaBackend(torch.device("cuda")))
    planned = _gpu_decode(model, engine, graphed=True)
    for result in (resident_graphed, planned):
        assert torch.equal(result[0], reference[0])
        assert all(torch.equal(a, b) for a, b in zip(result[1], reference[1]))


@pytest.mark.parametrize("shape", [(2, 1, 1), (1, 1, 2)])
@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_offloaded_sliding_decode_equals_resident_on_the_cpu_stand_in(family, shape, tmp_path):
    """A plan applied through the CPU stand-in of the copy engine (graph mode: copies wrap as in a replay):
    decode past the window gives the resident model's ids and logits bit for bit."""
    from runtime.load import build_model
    from tests.runtime_models import apply_plan_on_cpu
    from tests.runtime_models import plan_with

    path = {"gemma3": save_tiny_gemma3, "gpt_oss": save_tiny_gpt_oss}[family](tmp_path)
    prompt = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(3))
    expected = _decode(build_model(str(path), None), prompt, 12, 32)
    model = build_model(str(path), None)
    engine = apply_plan_on_cpu(model, plan_with(path, *shape, tokens=2, sequences=2, context=13, cuda_graph=True))
    loop = DecodeLoop(model, batch=2, max_cache_tokens=32, device=CPU, engine=engine, steps_per_call=1)
    loop.prefill(prompt)
    engine.set_graph_mode(True)
    ids, logits = loop.generate(12)
    assert torch.equal(ids, expected[0]) and all(torch.equal(a, b) for a, b in zip(logits, expected[1]))


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_compiled_steps_trace_the_ring_as_one_graph(family, tmp_path):
    """torch.compile(fullgraph=True) takes the ring's step (slot and mask offset computed from tensors, no
    Python value read): the compiled decode gives the eager ids past the window."""
    path = {"gemma3": save_tiny_gemma3, "gpt_oss": save_tiny_gpt_oss}[family](tmp_path)
    model = _model(path)
    prompt = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(1))
    expected = _decode(model, prompt, 10, 30)
    loop = DecodeLoop(model, batch=2, max_cache_tokens=30, device=CPU, steps_per_call=1, compile_backend="aot_eager")
    loop.prefill(prompt)
    loop.warm_up()
    ids, logits = loop.generate(10)
    assert torch.equal(ids, expected[0])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(logits, expected[1]))
