"""The KV cache model against what real models cache, and against the engines' published figures.

Tiny random models of every modelled family run a forward on the CPU with their default cache; every cache
tensor's bytes are summed and compared with ``KvCacheModel.cache_bytes``. Where transformers holds a different
amount than vLLM/SGLang allocate (the model follows the engines), the test computes the difference explicitly.
"""

import json
from pathlib import Path

import pytest

from planner.errors import ModelInputError
from planner.model.kv_cache import SUPPORTED_MODEL_TYPES, kv_cache_model
from tests.helpers import cache_tensors, transformers_cache_difference

REPO_ROOT = Path(__file__).resolve().parents[2]
REAL_CONFIGS = sorted([*REPO_ROOT.glob("plans/models/*/config.json"), *REPO_ROOT.glob("examples/*/config.json")])
WINDOW = 8
_ATTENTION = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
_MOE = dict(num_experts_per_tok=2)
# model_type -> config.json as an older checkpoint writes it (no layer_types: the planner derives them).
TINY_CONFIGS = {
    "llama": dict(_ATTENTION, num_hidden_layers=2),
    "mistral": dict(_ATTENTION, num_hidden_layers=2, sliding_window=WINDOW),
    "mixtral": dict(_ATTENTION | _MOE, num_hidden_layers=2, sliding_window=None, num_local_experts=4),
    "qwen2": dict(_ATTENTION, num_hidden_layers=4, sliding_window=WINDOW, use_sliding_window=True, max_window_layers=2),
    "qwen3": dict(_ATTENTION, num_hidden_layers=2, head_dim=16, sliding_window=None, use_sliding_window=False),
    "qwen3_moe": dict(_ATTENTION | _MOE, num_hidden_layers=2, head_dim=8, num_experts=4, moe_intermediate_size=32),
    "gemma2": dict(_ATTENTION, num_hidden_layers=4, head_dim=16, sliding_window=WINDOW),
    "gemma3_text": dict(_ATTENTION, num_hidden_layers=7, head_dim=16, sliding_window=WINDOW, sliding_window_pattern=3),
    "gpt_oss": dict(_ATTENTION | _MOE, num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, num_local_experts=4,
                    intermediate_size=64),
    "deepseek_v3": dict(_ATTENTION, num_hidden_layers=2, num_key_value_heads=4, moe_intermediate_size=32,
                        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1),
    "deepseek_v2": dict(_ATTENTION, num_hidden_layers=2, num_key_value_heads=4, moe_intermediate_size=32,
                        kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1),
    "qwen3_next": dict(_ATTENTION | _MOE, num_hidden_layers=4, head_dim=16, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                       linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4),
    "jamba": dict(_ATTENTION | _MOE, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, num_experts=4, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=2, mamba_dt_rank=8),
    "falcon_h1": dict(_ATTENTION, num_hidden_layers=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_n_groups=1,
                      mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8),
}


def _config(path: Path) -> dict:
    return json.loads(path.read_text())


# --- the engines' published figures and the repo's real configs ------------------------------------------------


def test_llama_3_1_70b_matches_the_engines_figure():
    """80 layers x 2 (K, V) x 8 KV heads x 128 dims x 2 bytes: vLLM/SGLang's 327,680 B per token."""
    model = kv_cache_model(_config(REPO_ROOT / "plans/models/llama-3.1-70b/config.json"))
    assert model.bytes_per_token("bf16") == 327_680
    assert model.bytes_per_token("fp8") == 163_840
    assert model.cache_bytes(num_sequences=3, context_tokens=1000, kv_dtype="bf16") == 3 * 1000 * 327_680
    assert model.describe("bf16") == "80 layers x 8 KV heads x 128 dims x K,V, bf16: 320.00 KiB per token"


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2"])
def test_mla_caches_the_latent_and_rope_parts(name):
    """(kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes x 61 layers; the MTP layer (62nd) is not counted."""
    config = _config(REPO_ROOT / f"plans/models/{name}/config.json")
    model = kv_cache_model(config)
    assert model.bytes_per_token("bf16") == (512 + 64) * 2 * 61
    assert len(model.layers) == config["num_hidden_layers"] == 61
    assert model.cache_bytes(num_sequences=2, context_tokens=4096, kv_dtype="fp8") == 2 * 4096 * 576 * 61


def test_gpt_oss_sliding_layers_hold_their_window():
    """gpt-oss-120b: 18 full layers grow, 18 sliding layers stop at 128 tokens."""
    model = kv_cache_model(_config(REPO_ROOT / "plans/models/gpt-oss-120b/config.json"))
    per_layer_token = 2 * 8 * 64 * 2
    assert model.bytes_per_token("bf16") == 18 * per_layer_token
    assert model.cache_bytes(num_sequences=1, context_tokens=100, kv_dtype="bf16") == 36 * 100 * per_layer_token
    long = model.cache_bytes(num_sequences=5, context_tokens=10_000, kv_dtype="bf16")
    assert long == 5 * (18 * 10_000 + 18 * 128) * per_layer_token
    assert model.fixed_bytes_per_sequence("bf16") == 18 * 128 * per_layer_token


def test_gemma3_multimodal_config_caches_its_language_model():
    """Gemma-3-27B's public config (text_config, Gemma3TextConfig's defaults): 62 layers, every sixth full, the
    other 52 sliding at 1,024 tokens, 16 KV heads of 128."""
    model = kv_cache_model(_config(REPO_ROOT / "examples/gemma-3-27b-it/config.json"))
    per_layer_token = 2 * 16 * 128 * 2
    assert model.bytes_per_token("bf16") == 10 * per_layer_token
    assert model.fixed_bytes_per_sequence("bf16") == 52 * 1024 * per_layer_token


@pytest.mark.parametrize("path", REAL_CONFIGS, ids=lambda p: p.parent.name)
def test_every_real_config_is_modelled(path):
    """Full-attention configs: num_hidden_layers x 2 x KV heads x head_dim (hidden / heads without head_dim)."""
    config = _config(path)
    model = kv_cache_model(config)
    assert model.describe()
    if "kv_lora_rank" in config or "layer_types" in config or "text_config" in config:
        return  # covered by the tests above (Gemma-3's in test_gemma3_multimodal_config_caches_its_language_model)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    expected = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 2
    assert model.bytes_per_token("auto") == expected
    assert model.cache_bytes(num_sequences=4, context_tokens=333, kv_dtype="bf16") == 4 * 333 * expected


def test_qwen3_next_80b_by_hand():
    """Qwen3-Next-80B-A3B's config.json: 48 layers, every 4th full attention (2 KV heads x 256), the other 36
    Gated DeltaNet: conv over 2 x 16 x 128 + 32 x 128 channels x kernel 4 (bf16), a 128 x 128 fp32 state per
    value head (32)."""
    config = dict(model_type="qwen3_next", num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                  head_dim=256, hidden_size=2048, linear_num_value_heads=32, linear_num_key_heads=16,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                  full_attention_interval=4, torch_dtype="bfloat16")
    model = kv_cache_model(config)
    per_sequence = 36 * ((2 * 16 * 128 + 32 * 128) * 4 * 2 + 32 * 128 * 128 * 4)
    assert model.bytes_per_token("bf16") == 12 * 2 * 2 * 256 * 2
    assert model.fixed_bytes_per_sequence("bf16") == per_sequence == 77_856_768
    assert model.cache_bytes(num_sequences=3, context_tokens=4096, kv_dtype="fp8") == 3 * (
        4096 * 12 * 2 * 2 * 256 + per_sequence)


def test_jamba_by_hand():
    """Jamba-v0.1: attention at layers 4, 12, 20, 28 (attn_layer_period 8, offset 4); Mamba elsewhere with
    inner 2 x 4096, conv 4, state 16."""
    config = dict(model_type="jamba", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  hidden_size=4096, attn_layer_period=8, attn_layer_offset=4, mamba_expand=2, mamba_d_state=16,
                  mamba_d_conv=4)
    model = kv_cache_model(config)
    assert [layer.layer_index for layer in model.layers if layer.kind == "full"] == [4, 12, 20, 28]
    assert model.bytes_per_token("bf16") == 4 * 2 * 8 * 128 * 2
    assert model.fixed_bytes_per_sequence("bf16") == 28 * (8192 * 4 * 2 + 8192 * 16 * 4)


def test_multimodal_config_uses_the_text_part():
    text = dict(TINY_CONFIGS["gemma3_text"], model_type="gemma3_text")
    model = kv_cache_model({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                            "text_config": text, "vision_config": {"hidden_size": 32}})
    assert [layer.kind for layer in model.layers] == ["sliding", "sliding", "full"] * 2 + ["sliding"]


# --- one-line refusals --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, fragment", [
    ({"model_type": "mamba", "num_hidden_layers": 2}, "model_type 'mamba'"),
    ({"architectures": ["FooForCausalLM"]}, "FooForCausalLM"),
    ({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 64}, "no num_hidden_layers"),
    ({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4}, "no hidden_size"),
    ({"model_type": "llama", "num_hidden_layers": True, "num_attention_heads": 4, "hidden_size": 64}, "is True"),
    ({"model_type": "llama", "num_hidden_layers": -2, "num_attention_heads": 4, "hidden_size": 64}, "is -2"),
    ({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3,
      "hidden_size": 64}, "not a multiple"),
    ({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "head_dim": 1.5},
     "head_dim is 1.5"),
    ({"model_type": "gpt_oss", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
      "layer_types": ["full_attention"]}, "layer_types"),
    ({"model_type": "gpt_oss", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
      "layer_types": ["sliding_attention", "full_attention"]}, "no sliding_window"),
    ({"model_type": "gpt_oss", "num_hidden_layers": 1, "num_attention_heads": 4, "hidden_size": 64,
      "layer_types": ["chunked_attention"]}, "'chunked_attention'"),
    ({"model_type": "deepseek_v3", "num_hidden_layers": 2, "kv_lora_rank": 512}, "no qk_rope_head_dim"),
    ({"model_type": "jamba", "num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 2},
     "attn_layer_offset"),
    (None, "no config.json"),
])
def test_bad_configs_are_refused_in_one_line(config, fragment):
    with pytest.raises(ModelInputError) as error:
        kv_cache_model(config)
    message = str(error.value)
    assert fragment in message and "\n" not in message


# --- model_types the table does not list -----------------------------------------------------------------------


def test_an_unlisted_config_is_standard_attention_under_its_own_key_names():
    """GPT-2 writes n_layer, n_head and n_embd (transformers' attribute_map): the same cache as the standard keys."""
    gpt2 = {"model_type": "gpt2", "n_layer": 3, "n_head": 4, "n_embd": 64, "n_inner": None}
    model = kv_cache_model(gpt2)
    assert [layer.kind for layer in model.layers] == ["full"] * 3
    assert model.bytes_per_token("bf16") == 3 * 2 * 4 * 16 * 2


@pytest.mark.parametrize("extra, kv_heads", [
    ({"multi_query": True}, 1),  # GPT-BigCode, Falcon-7B: one K/V head whatever the rest says
    ({"multi_query": True, "num_key_value_heads": 4}, 1),
    ({"multi_query": True, "new_decoder_architecture": True, "num_kv_heads": 2}, 2),  # Falcon-40B
    ({"num_kv_heads": 2}, 2),
])
def test_multi_query_and_other_kv_head_keys(extra, kv_heads):
    config = {"model_type": "falcon", "num_hidden_layers": 1, "num_attention_heads": 4, "hidden_size": 64, **extra}
    assert kv_cache_model(config).layers[0].num_kv_heads == kv_heads


def test_values_of_their_own_width_are_counted_apart():
    config = {"model_type": "newlm", "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_size": 64, "head_dim": 24, "v_head_dim": 8}
    model = kv_cache_model(config)
    assert model.bytes_per_token("bf16") == 2 * (24 + 8) * 2
    assert "24 K + 8 V dims" in model.describe()


def test_an_unlisted_latent_config_caches_its_latent():
    config = {"model_type": "newmla", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
              "kv_lora_rank": 32, "qk_rope_head_dim": 8}
    assert kv_cache_model(config).bytes_per_token("bf16") == 2 * (32 + 8) * 2


def test_gpt_neox_is_a_decoder_though_it_writes_is_decoder_false():
    config = {"model_type": "gpt_neox", "num_hidden_layers": 1, "num_attention_heads": 4, "hidden_size": 64,
              "is_decoder": False}
    assert kv_cache_model(config).layers[0].kind == "full"


_UNLISTED = {"model_type": "newlm", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}


@pytest.mark.parametrize("extra, shown_by", [
    ({"is_encoder_decoder": True}, "is_encoder_decoder"),
    ({"add_cross_attention": True}, "add_cross_attention"),
    ({"decoder_layers": 2}, "decoder_layers"),
    ({"state_size": 16}, "state_size"),
    ({"conv_L_cache": 3}, "conv_L_cache"),
    ({"linear_num_key_heads": 2}, "linear_num_key_heads"),
    ({"index_head_dim": 128}, "index_head_dim"),
    ({"mem_len": 512}, "mem_len"),
    ({"per_layer_config": {"1": {"head_dim": 512}}}, "per_layer_config"),
    ({"is_decoder": False, "add_cross_attention": False}, "is_decoder false"),
    ({"layer_types": ["full_attention", "linear_attention"]}, "'linear_attention'"),
])
def test_other_cache_kinds_are_refused_naming_the_kind(extra, shown_by):
    with pytest.raises(ModelInputError) as error:
        kv_cache_model(_UNLISTED | extra)
    message = str(error.value)
    assert "\n" not in message and "is not modelled" in message and shown_by in message, message


@pytest.mark.parametrize("model_type", ["mamba", "lfm2", "cpmant", "longcat_flash", "mimo_v2_flash", "xlstm"])
def test_listed_unmodelled_caches_name_their_kind(model_type):
    from planner.model.architectures import ARCHITECTURES

    with pytest.raises(ModelInputError) as error:
        kv_cache_model(_UNLISTED | {"model_type": model_type})
    assert ARCHITECTURES[model_type].unmodelled_kind in str(error.value)


def test_unknown_kv_dtype_is_refused():
    model = kv_cache_model(TINY_CONFIGS["llama"] | {"model_type": "llama"})
    with pytest.raises(ModelInputError, match="choose one of auto, bf16"):
        model.cache_bytes(num_sequences=1, context_tokens=1, kv_dtype="int4")


# --- held to what transformers caches -----------------------------------------------------------------------------


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tiny_model(model_type: str, config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf_config = AutoConfig.for_model(model_type, **config)
    return AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()


@pytest.fixture(params=sorted(TINY_CONFIGS), scope="module")
def family(request):
    model_type = request.param
    from transformers import AutoConfig

    if model_type not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    return model_type, _tiny_model(model_type, TINY_CONFIGS[model_type]), AutoConfig


def test_every_supported_family_is_held_to_transformers():
    assert set(TINY_CONFIGS) >= set(SUPPORTED_MODEL_TYPES) - {"gemma", "gemma3", "kimi_k2", "qwen2_moe"}


@pytest.mark.parametrize("config_source", ["raw", "saved"])
@pytest.mark.parametrize("num_sequences, prompt", [(1, 5), (3, 12), (2, 20)])
def test_cache_bytes_match_transformers(family, config_source, num_sequences, prompt):
    """Prefill ``prompt`` tokens (below and above the window of 8), then one decode step: every cached tensor's
    bytes equal the model's prediction, less the differences stated in ``transformers_cache_difference``.

    ``raw``: the config.json an older checkpoint writes (the planner derives layer types); ``saved``: what
    transformers' own ``save_pretrained`` writes now (with layer_types and every default spelled out)."""
    from runtime.graph import cache_argument

    model_type, model, _ = family
    config = dict(TINY_CONFIGS[model_type], model_type=model_type)
    if config_source == "saved":
        config = model.config.to_dict()
    planned = kv_cache_model(config)
    ids = torch.randint(0, 128, (num_sequences, prompt), generator=torch.Generator().manual_seed(prompt))
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        cache = out.past_key_values
        for context in (prompt, prompt + 1):
            if context > prompt:
                model(input_ids=ids[:, :1], use_cache=True, **cache_argument(model, cache))
            held = sum(t.numel() * t.element_size() for _, _, t in cache_tensors(cache))
            expected = planned.cache_bytes(num_sequences=num_sequences, context_tokens=context, kv_dtype="auto")
            assert held + transformers_cache_difference(planned, cache, num_sequences, context) == expected, (
                model_type, context, [(i, n, tuple(t.shape), t.dtype) for i, n, t in cache_tensors(cache)])


def test_state_layers_do_not_grow(family):
    model_type, model, _ = family
    planned = kv_cache_model(dict(TINY_CONFIGS[model_type], model_type=model_type))
    states = [layer for layer in planned.layers if layer.kind == "state"]
    if not states:
        pytest.skip("no state layers")
    short = planned.cache_bytes(num_sequences=1, context_tokens=1, kv_dtype="auto")
    long = planned.cache_bytes(num_sequences=1, context_tokens=1001, kv_dtype="auto")
    assert long - short == 1000 * planned.bytes_per_token("auto")
    assert "fixed state (conv bf16 + recurrent fp32), fp8:" in planned.describe("fp8")
    assert planned.fixed_bytes_per_sequence("fp8") == planned.fixed_bytes_per_sequence("bf16") > 0


def test_a_config_without_model_type_is_known_by_its_architecture():
    """Older or hand-written configs name only the class: LlamaForCausalLM is the llama family."""
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "hidden_size": 64}
    model = kv_cache_model(config)
    assert model.architecture == "llama" and model.bytes_per_token("bf16") == 2 * 2 * 2 * 16 * 2
