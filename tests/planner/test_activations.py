"""The activation estimate against the peak a real forward allocates (CPU here; the GPU twin is in
tests/runtime/test_engine_gpu.py).

The CPU peak is read from torch.profiler's memory events (profile_memory=True): every allocation and free with
its address, replayed in time order. Two CPU-only kernels allocate workspaces that their GPU counterparts do
not (oneDNN's bf16 GEMM packs its operands; the CPU flash-attention kernel keeps per-thread buffers): blocks
allocated and freed inside one of those kernels are left out and reported apart, since on the GPU cuBLAS uses
its persistent workspace and FlashAttention / memory-efficient SDPA keep only the output and log-sum-exp.
"""

import json
from pathlib import Path

import pytest

from planner.model.activations import (ActivationShape, StepShape, activation_shape, decode_activations,
                                        estimate_activations, prefill_activations)
from planner.errors import ModelInputError

REPO_ROOT = Path(__file__).resolve().parents[2]

QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "torch_dtype": "bfloat16"}
#: the bound the estimate is held to: measured <= estimate <= BOUND x measured
BOUND = 1.5


# --- pure -----------------------------------------------------------------------------------------------------


def test_qwen3_8b_decode_terms_by_hand():
    """B = 64 at context 1024 over a static cache of 1088: transformers <= 5.17 repeats K/V to all 32 heads."""
    peak = decode_activations(QWEN3_8B, num_sequences=64, context_tokens=1024, static_cache_tokens=1088)
    terms = dict(peak.terms)
    assert peak.phase == "attention"
    assert terms["K/V repeated to every head"] == 64 * 1088 * 32 * (128 + 128) * 2
    assert terms["additive mask"] == 64 * 1088 * 2 and terms["attention mask"] == 64 * 1088
    assert peak.peak_bytes == sum(terms.values())
    packed = decode_activations(QWEN3_8B, num_sequences=64, context_tokens=1024, static_cache_tokens=1088,
                                expand_kv_heads=False)
    assert packed.phase == "logits" and packed.peak_bytes == 64 * (151936 + 4096) * 2


def test_prefill_chunk_peaks_in_the_mlp():
    peak = prefill_activations(QWEN3_8B, chunk_tokens=2048)
    assert peak.phase == "mlp"
    assert dict(peak.terms)["MLP act(gate), up, product"] == 3 * 2048 * 12288 * 2
    assert peak.describe().startswith("209.03 MiB")  # 144 MiB MLP + 4 x 16 MiB hidden states + rotary + ids


def test_logits_can_be_planned_in_float32():
    bf16 = decode_activations(QWEN3_8B, num_sequences=256, context_tokens=0, expand_kv_heads=False)
    fp32 = decode_activations(QWEN3_8B, num_sequences=256, context_tokens=0, expand_kv_heads=False,
                              logits_bytes_per_element=4)
    assert fp32.peak_bytes - bf16.peak_bytes == 256 * 151936 * 2


def test_moe_batched_mm_gathers_weights():
    config = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 32,
              "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128,
              "num_experts_per_tok": 8, "moe_intermediate_size": 768}
    eager = decode_activations(config, num_sequences=64, context_tokens=0, expand_kv_heads=False)
    gathered = decode_activations(config, num_sequences=64, context_tokens=0, expand_kv_heads=False,
                                  experts_implementation="batched_mm")
    assert gathered.phase == "moe" and dict(gathered.terms)["gathered expert weights (batched_mm)"] == (
        64 * 8 * 3 * 768 * 2048 * 2)
    assert gathered.peak_bytes > 10 * eager.peak_bytes


def test_mla_shape_uses_its_head_dims():
    config = json.loads(open("plans/models/deepseek-v3/config.json").read())
    shape = activation_shape(config)
    assert (shape.qk_head_dim, shape.v_head_dim, shape.num_kv_heads, shape.latent_attention) == (192, 128, 128, True)
    assert shape.num_experts == 256 and shape.top_k == 8 and shape.shared_intermediate_size == 2048


@pytest.mark.parametrize("config, fragment", [
    ({"model_type": "qwen3_next", "hidden_size": 8}, "not modelled"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}, "no intermediate_size"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 0,
      "vocab_size": 8}, "intermediate_size is 0"),
    (None, "no config.json"),
])
def test_bad_configs_are_refused(config, fragment):
    with pytest.raises(ModelInputError, match=fragment):
        activation_shape(config)


def test_peak_grows_with_batch_and_chunk():
    shape = activation_shape(QWEN3_8B)
    decode = [estimate_activations(shape, StepShape(num_sequences=b, tokens_per_sequence=1, context_tokens=512))
              for b in (1, 4, 16, 64)]
    assert all(a.peak_bytes < b.peak_bytes for a, b in zip(decode, decode[1:]))
    with pytest.raises(ValueError):
        StepShape(num_sequences=1, tokens_per_sequence=8, context_tokens=4, static_cache_tokens=10)
    with pytest.raises(ValueError):
        ActivationShape(hidden_size=0, intermediate_size=1, num_heads=1, num_kv_heads=1, qk_head_dim=1,
                        v_head_dim=1, vocab_size=1)


# --- masks and rotary tables per layer type (issue 23) -----------------------------------------------------------

GEMMA3_TINY = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=1024, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, num_hidden_layers=6, sliding_window=64, vocab_size=512,
                   query_pre_attn_scalar=32, torch_dtype="bfloat16")
#: Qwen3 with its window switched on from layer 1: one full layer, one sliding
QWEN3_MIXED_TINY = dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=32, model_type="qwen3", num_hidden_layers=2, vocab_size=512,
                        use_sliding_window=True, sliding_window=64, max_window_layers=1, torch_dtype="bfloat16")


def _step_wide_terms(config: dict, *, tokens: int, context: int, static_extra: int | None = 16) -> dict[str, int]:
    static = None if static_extra is None else context + tokens + static_extra
    peak = prefill_activations(config, chunk_tokens=tokens, context_tokens=context, static_cache_tokens=static)
    return {name: value for name, value in peak.terms if "mask" in name and "additive" not in name
            or name.startswith("rotary")}


def test_one_layer_type_keeps_one_mask_and_one_rotary_table():
    """Llama, Qwen3 with its window off, Mistral sliding everywhere, Qwen3-MoE with max_window_layers (one mask
    for every layer, sliding): one mask, one rotary pair, as before."""
    mistral = dict(QWEN3_8B, model_type="mistral", sliding_window=4096)
    qwen3_moe = dict(QWEN3_MIXED_TINY, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=128, head_dim=128)
    for config in (dict(QWEN3_8B, model_type="llama"), dict(QWEN3_8B, sliding_window=4096), mistral, qwen3_moe):
        shape = activation_shape(config)
        assert (shape.sliding_mask_window_tokens, shape.num_rotary_tables) == (0, 1)
        assert _step_wide_terms(config, tokens=2048, context=2048) == {
            "rotary cos/sin": 2 * 2048 * 128 * 2, "attention mask": 2048 * (4096 + 16)}


def test_gemma3_holds_a_mask_and_a_rotary_table_per_layer_type():
    """Gemma-3-27B's text model: five sliding layers of 1,024 per global one. A first chunk of 2,048 needs no
    full mask (is_causal) but a sliding one (the keys reach the window); after 2,048 cached tokens the full mask
    spans the static cache and the sliding one the window's 1,024 cached tokens and the chunk's."""
    config = json.loads((REPO_ROOT / "examples/gemma-3-27b-it/config.json").read_text())
    shape = activation_shape(config)
    assert (shape.sliding_mask_window_tokens, shape.num_rotary_tables) == (1024, 2)
    pair = 2 * 2048 * 128 * 2
    assert _step_wide_terms(config, tokens=2048, context=0) == {
        "rotary cos/sin, a pair per layer type": 2 * pair, "sliding-window mask": 2048 * 2048}
    assert _step_wide_terms(config, tokens=2048, context=2048, static_extra=64) == {
        "rotary cos/sin, a pair per layer type": 2 * pair, "attention mask": 2048 * 4160,
        "sliding-window mask": 2048 * (1024 + 2048)}
    # a first chunk shorter than the window: is_causal covers both types, no mask at all
    assert _step_wide_terms(config, tokens=512, context=0) == {
        "rotary cos/sin, a pair per layer type": 2 * 512 * 128 * 4}
    # a growing cache reads the window's cached tokens too (transformers keeps one fewer: bounded)
    assert _step_wide_terms(config, tokens=16, context=300, static_extra=None)["sliding-window mask"] == 16 * 316
    # decode over the runtime's static cache: the full mask spans the cache, the sliding one the ring
    decode = dict(decode_activations(config, num_sequences=8, context_tokens=2048, static_cache_tokens=2112).terms)
    assert (decode["attention mask"], decode["sliding-window mask"]) == (8 * 2112, 8 * 1024)
    # fewer than six layers: sliding layers only, one type, one table and one mask
    five = activation_shape(dict(config, text_config=dict(config["text_config"], num_hidden_layers=5)))
    assert (five.sliding_mask_window_tokens, five.num_rotary_tables) == (0, 1)


def test_mixed_families_hold_two_masks_and_one_rotary_table():
    """gpt-oss (alternating), Gemma 2 (alternating), Qwen3 with max_window_layers: two masks, one table."""
    gpt_oss = json.loads((REPO_ROOT / "plans/models/gpt-oss-120b/config.json").read_text())
    gemma2 = dict(QWEN3_8B, model_type="gemma2", sliding_window=4096, num_hidden_layers=4)
    for config, window in ((gpt_oss, 128), (gemma2, 4096), (dict(QWEN3_MIXED_TINY, sliding_window=4096), 4096)):
        shape = activation_shape(config)
        assert (shape.sliding_mask_window_tokens, shape.num_rotary_tables) == (window, 1)
        terms = _step_wide_terms(config, tokens=2048, context=8192)
        assert terms["sliding-window mask"] == 2048 * (min(8192, window) + 2048)
        assert terms["attention mask"] == 2048 * (8192 + 2048 + 16)


def test_qwen2_moe_builds_its_sliding_mask_with_the_window_off():
    """Qwen2MoeConfig sets a switched-off window to 0, and masking_utils builds (never skips) a mask of local size
    0 over every key of the first (full) layer, which no layer reads: a first chunk holds it too."""
    qwen2_moe = dict(QWEN3_MIXED_TINY, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=128, sliding_window=4096)
    for use_sliding_window in (False, None):
        config = {key: value for key, value in qwen2_moe.items() if key != "use_sliding_window"}
        if use_sliding_window is not None:
            config["use_sliding_window"] = use_sliding_window
        shape = activation_shape(config)
        assert shape.window_off_mask and not shape.sliding_mask_window_tokens
        assert _step_wide_terms(config, tokens=2048, context=0)["unread window-0 sliding mask"] \
            == 2048 * (2048 + 16)
        assert _step_wide_terms(config, tokens=512, context=1024, static_extra=None) == {
            "rotary cos/sin": 2 * 512 * 32 * 2, "attention mask": 512 * 1536,
            "unread window-0 sliding mask": 512 * 1536}
    switched_on = activation_shape(qwen2_moe)  # use_sliding_window true, layer 0 full and layer 1 sliding
    assert not switched_on.window_off_mask and switched_on.sliding_mask_window_tokens == 4096


def test_bad_sliding_window_of_a_mixed_model_is_refused():
    with pytest.raises(ModelInputError, match="sliding_window"):
        activation_shape(dict(QWEN3_MIXED_TINY, sliding_window=0, layer_types=["full_attention",
                                                                              "sliding_attention"]))


# --- measured on the CPU ----------------------------------------------------------------------------------------


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

#: kernels whose internal blocks are CPU-only workspaces (see the module docstring)
CPU_WORKSPACE_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu")
TINY = {
    "qwen3": dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=2, head_dim=32),
    "llama": dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=4),
    "qwen3_moe": dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=384),
}
VOCAB = 4096


def transformers_expands_kv_heads() -> bool:
    """Whether the installed transformers repeats K/V to every head for a masked one-token decode step."""
    from transformers.integrations import sdpa_attention

    return not hasattr(sdpa_attention, "pack_gqa")


STEP = "measured step"


def _peak_cpu_bytes(run, trace_path) -> tuple[int, int]:
    """(peak of live tensors during the ``STEP`` record_function block that ``run()`` marks, above what stays
    allocated after it (a growing cache's new blocks are KV cache, not activations); CPU kernel workspace at its
    own peak). The whole of ``run()`` is profiled, so blocks allocated before the step and freed in it (the old
    cache a growing cache replaces) are seen."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    prof.export_chrome_trace(str(trace_path))
    events = json.loads(trace_path.read_text())["traceEvents"]
    begin, end = next((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e["name"] == STEP)
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e["name"] in CPU_WORKSPACE_OPS]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    opened: dict[int, int] = {}  # address -> index of its allocation event
    workspace: set[int] = set()  # indices of events that allocate or free a kernel workspace
    for index, event in enumerate(memory):
        address = event["args"]["Addr"]
        if event["args"]["Bytes"] > 0:
            opened[address] = index
        elif address in opened:
            start = opened.pop(address)
            if any(low <= memory[start]["ts"] and event["ts"] <= high for low, high in kernels):
                workspace.update((start, index))
    live = scratch = 0
    peak = scratch_peak = None
    for index, event in enumerate(memory):
        if event["ts"] > end:
            break
        if index in workspace:
            scratch += event["args"]["Bytes"]
        else:
            live += event["args"]["Bytes"]
        if event["ts"] >= begin:
            peak, scratch_peak = max(peak or live, live), max(scratch_peak or 0, scratch)
    return peak - live, scratch_peak


def _tiny_model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(TINY[model_type], model_type=model_type, num_hidden_layers=2, vocab_size=VOCAB,
                  torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16).eval()
    return config, model


def _measure(model, *, sequences: int, tokens: int, context: int, static: bool, tmp_path) -> tuple[int, int]:
    """Peak bytes of one forward of ``tokens`` new tokens per sequence after ``context`` cached ones."""
    from transformers import DynamicCache, StaticCache
    from runtime.graph import cache_argument

    ids = torch.randint(0, VOCAB, (sequences, context + tokens), generator=torch.Generator().manual_seed(0))

    def run():
        with torch.inference_mode():
            if static:
                cache = StaticCache(config=model.config, max_cache_len=context + tokens + 16)
                model(input_ids=ids[:, :1], use_cache=True, **cache_argument(model, cache))  # allocates the cache
                cache.reset()
            else:
                cache = DynamicCache(config=model.config)
            if context:
                model(input_ids=ids[:, :context], use_cache=True, **cache_argument(model, cache), logits_to_keep=1)
            with torch.profiler.record_function(STEP):
                model(input_ids=ids[:, context:], use_cache=True, **cache_argument(model, cache), logits_to_keep=1)

    return _peak_cpu_bytes(run, tmp_path / "trace.json")


CASES = [  # (sequences, tokens per sequence, context, static cache)
    (1, 1, 256, True), (8, 1, 256, True), (64, 1, 256, True), (256, 1, 64, True),
    (1, 128, 0, True), (1, 512, 0, True), (1, 256, 256, True), (1, 512, 0, False), (4, 64, 0, False),
    (16, 1, 256, False), (1, 128, 256, False),
]
RESULTS: list[tuple] = []


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request):
    return (request.param, *_tiny_model(request.param))


@pytest.mark.parametrize("sequences, tokens, context, static", CASES)
def test_estimate_bounds_the_cpu_peak(tiny, sequences, tokens, context, static, tmp_path):
    model_type, config, model = tiny
    measured, workspace = _measure(model, sequences=sequences, tokens=tokens, context=context, static=static,
                                   tmp_path=tmp_path)
    step = StepShape(num_sequences=sequences, tokens_per_sequence=tokens, context_tokens=context,
                     static_cache_tokens=context + tokens + 16 if static else None)
    estimate = estimate_activations(activation_shape(config), step, expand_kv_heads=transformers_expands_kv_heads())
    ratio = estimate.peak_bytes / measured
    RESULTS.append((model_type, sequences, tokens, context, static, estimate.peak_bytes, measured, workspace, ratio))
    print(f"\n{model_type} B={sequences} T={tokens} C={context} static={static}: estimate {estimate.peak_bytes} "
          f"measured {measured} (+{workspace} CPU kernel workspace) ratio {ratio:.2f}; {estimate.describe()}")
    assert 1.0 <= ratio <= BOUND, estimate.describe()


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
@pytest.mark.parametrize("sequences, tokens", [(16, 1), (1, 256)])
def test_other_experts_implementations(implementation, sequences, tokens, tmp_path):
    """transformers' expert loop (bounded by all tokens picking one expert) and the runtime's batched_mm."""
    config, model = _tiny_model("qwen3_moe")
    model.set_experts_implementation(implementation)
    measured, _ = _measure(model, sequences=sequences, tokens=tokens, context=64, static=True, tmp_path=tmp_path)
    step = StepShape(num_sequences=sequences, tokens_per_sequence=tokens, context_tokens=64,
                     static_cache_tokens=64 + tokens + 16)
    estimate = estimate_activations(activation_shape(config), step, expand_kv_heads=transformers_expands_kv_heads(),
                                    experts_implementation=implementation)
    print(f"\nqwen3_moe {implementation} B={sequences} T={tokens}: estimate {estimate.peak_bytes} measured {measured} "
          f"ratio {estimate.peak_bytes / measured:.2f}; {estimate.describe()}")
    assert 1.0 <= estimate.peak_bytes / measured <= BOUND, estimate.describe()


@pytest.mark.parametrize("sequences", [1, 16])
def test_decode_with_kv_heads_repeated(sequences, tmp_path, monkeypatch):
    """transformers up to 5.17 repeats K/V to every head for a masked one-token step (no pack_gqa): forced here
    on a newer transformers by taking its pack_gqa branch away."""
    from transformers.integrations import sdpa_attention

    if hasattr(sdpa_attention, "pack_gqa"):
        monkeypatch.setattr(sdpa_attention, "is_torchdynamo_compiling", lambda: True)
    config, model = _tiny_model("qwen3")
    measured, _ = _measure(model, sequences=sequences, tokens=1, context=256, static=True, tmp_path=tmp_path)
    step = StepShape(num_sequences=sequences, tokens_per_sequence=1, context_tokens=256, static_cache_tokens=273)
    estimate = estimate_activations(activation_shape(config), step, expand_kv_heads=True)
    print(f"\nqwen3 repeated K/V B={sequences}: estimate {estimate.peak_bytes} measured {measured} "
          f"ratio {estimate.peak_bytes / measured:.2f}; {estimate.describe()}")
    assert estimate.phase == "attention" and 1.0 <= estimate.peak_bytes / measured <= BOUND, estimate.describe()


def test_activation_model_keeps_one_layer_per_kind():
    """runtime.measure_activations' model for the activation peak: one layer of each kind, renumbered, its own cache."""
    from runtime.measure_activations import activation_model

    config = dict(model_type="gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, sliding_window=8,
                  num_local_experts=4, num_experts_per_tok=2)
    model = activation_model(config, ((0, 2), (1, 3)), "model.layers", device="cpu")
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1]
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    with torch.inference_mode():
        output = model(input_ids=torch.zeros(2, 12, dtype=torch.long), use_cache=True)
    assert len(output.past_key_values.layers) == 2 and output.past_key_values.layers[0].keys.shape[-2] == 7


def test_gpt_oss_attention_is_eager_with_its_scores():
    """gpt-oss has no SDPA path (its sinks join the softmax): K/V are repeated to every head and three
    score-sized tensors, one sink column wider, are alive; a Llama of the same shape keeps the log-sum-exp."""
    from planner.model.activations import activation_shape, prefill_activations

    shape = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=16, vocab_size=128)
    gpt_oss = dict(shape, model_type="gpt_oss", sliding_window=8, num_local_experts=4, num_experts_per_tok=2)
    assert activation_shape(gpt_oss).eager_attention and not activation_shape(dict(shape, model_type="llama"))\
        .eager_attention
    estimate = prefill_activations(gpt_oss, chunk_tokens=512, context_tokens=0, static_cache_tokens=576)
    terms = dict(estimate.terms)
    assert estimate.phase == "attention"
    assert terms["attention scores, with the sink column (eager attention)"] == 3 * 8 * 512 * 577 * 2
    assert terms["K/V repeated to every head"] == 576 * 8 * 32 * 2
    assert not any("log-sum-exp" in name for name in terms)



QWEN2_MOE_TINY = dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=512, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=64, shared_expert_intermediate_size=128, torch_dtype="bfloat16")


@pytest.mark.parametrize("name", ["gemma3", "qwen3_mixed", "qwen2_moe"])
@pytest.mark.parametrize("context", [0, 128])
def test_mixed_layer_types_live_set_at_the_mlp(name, context):
    """What a forward over the runtime's static cache holds while its last layer's MLP runs, observed tensor by
    tensor (tests.live_tensors), against the estimate: a 128-token chunk of a model whose sliding layers see 64
    tokens keeps a sliding mask beside the full one (no full one for a first chunk: is_causal) and, for Gemma-3,
    a rotary pair per layer type; a window-off Qwen2-MoE keeps its unread window-0 mask. Before issue 23 the
    estimate counted one mask and one pair. The dense models' MLP phase is their peak: it must hold the set."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from runtime.graph import cache_argument, cache_tokens_for
    from tests.live_tensors import LiveTensors
    from runtime.static_cache import static_cache

    config = {"gemma3": GEMMA3_TINY, "qwen3_mixed": QWEN3_MIXED_TINY, "qwen2_moe": QWEN2_MOE_TINY}[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16).eval()
    tokens, cache_tokens = 128, cache_tokens_for(context + 128)
    cache = static_cache(model.config, cache_tokens)
    ids = torch.randint(0, config["vocab_size"], (1, context + tokens), generator=torch.Generator().manual_seed(0))

    def forward(chunk):
        model(input_ids=chunk, use_cache=True, logits_to_keep=1, **cache_argument(model, cache))

    tracker, peaks = LiveTensors(), []
    with torch.inference_mode():
        forward(ids[:, context:])  # allocates the cache
        cache.reset()
        if context:
            forward(ids[:, :context])
        with tracker, tracker.window(model.model.layers[-1].mlp, peaks):
            forward(ids[:, context:])
    (observed, live), = peaks
    estimate = prefill_activations(config, chunk_tokens=tokens, context_tokens=context,
                                   static_cache_tokens=cache_tokens)
    masks = sorted(s.num_bytes for s in live if s.source.startswith("masking_utils.py"))
    terms = dict(estimate.terms)
    print(f"\n{name} C={context}: estimate {estimate.peak_bytes} ({estimate.phase}), live at the MLP {observed}: "
          + ", ".join(f"{s.num_bytes} {s.operator} {s.source}" for s in live))
    assert masks == sorted(value for key, value in terms.items() if key.endswith(" mask") and "additive" not in key)
    if name != "qwen2_moe":  # the MoE phase's terms are bounds, not the live set
        assert estimate.phase == "mlp" and 1.0 <= estimate.peak_bytes / observed <= 1.01, estimate.describe()
