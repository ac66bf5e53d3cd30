"""config.json's one limits table (planner.model.model_config.CONFIG_LIMITS): the KV cache model and the activation
estimate refuse a key beyond the same bound, each in one line naming the range; every key they read is listed."""


import pytest

from planner.model.activations import activation_shape
from planner.source.checkpoint import check_config
from planner.errors import ModelInputError
from planner.model.kv_cache import kv_cache_model
from planner.model.model_config import CONFIG_COUNTS, CONFIG_LIMITS
from tests.conftest import REPO_ROOT

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100,
         "torch_dtype": "bfloat16"}
FAMILIES = {
    "llama": LLAMA,
    "deepseek_v3": {**LLAMA, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                    "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4,
                    "q_lora_rank": 8},
    "gemma2": {**LLAMA, "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "sliding_window": 32,
               "head_dim": 16},
}


def _refusal(read, config: dict) -> str:
    with pytest.raises(ModelInputError) as error:
        read(config)
    return str(error.value)


@pytest.mark.parametrize(("family", "key", "readers"), [
    ("llama", "num_key_value_heads", (kv_cache_model, activation_shape)),
    ("llama", "head_dim", (kv_cache_model, activation_shape)),
    ("deepseek_v3", "qk_rope_head_dim", (kv_cache_model, activation_shape)),
    ("gemma2", "sliding_window", (kv_cache_model, activation_shape)),
    ("deepseek_v3", "kv_lora_rank", (kv_cache_model,)),  # the estimate asks only whether it is there
])
def test_kv_cache_and_activations_refuse_a_key_at_the_same_bound(family, key, readers):
    low, high = CONFIG_LIMITS[key]
    config = {**FAMILIES[family], key: high + 1}
    for read in readers:
        message = _refusal(read, config)
        assert f"{key} is {high + 1}" in message and f"to {high}" in message and "\n" not in message


@pytest.mark.parametrize(("family", "key"), [
    ("llama", "vocab_size"), ("llama", "intermediate_size"), ("deepseek_v3", "v_head_dim"),
    ("deepseek_v3", "qk_nope_head_dim"),
])
def test_activation_sizes_are_bounded_by_the_table(family, key):
    """Before the one table these had no upper bound in the activation estimate (the KV cache's 65,536 for the
    latent dims, the estimate's none)."""
    low, high = CONFIG_LIMITS[key]
    activation_shape({**FAMILIES[family], key: high})  # at the bound: read
    message = _refusal(activation_shape, {**FAMILIES[family], key: high + 1})
    assert f"expected an integer from {low} to {high}" in message


@pytest.mark.parametrize("value", [0, None])
def test_shared_experts_absent_or_zero_read_as_none(value):
    config = {**LLAMA, "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 16, "n_shared_experts": value}
    assert activation_shape(config).shared_intermediate_size == 0
    assert "n_shared_experts is -1" in _refusal(activation_shape, {**config, "n_shared_experts": -1})


def test_load_checks_the_counts_of_the_table():
    assert CONFIG_COUNTS.items() <= CONFIG_LIMITS.items()
    for key, (low, high) in CONFIG_COUNTS.items():
        check_config({**LLAMA, key: high}, "cfg")
        with pytest.raises(ModelInputError, match=f"{key} is {high + 1}; it must be a whole number from {low}"):
            check_config({**LLAMA, key: high + 1}, "cfg")


def test_only_the_model_record_reads_the_dtype_the_sections_and_the_routing_keys():
    """The dtype names and their byte sizes, the multimodal sections and the routing keys are read in
    planner.model.model_config alone (the dtype tables were written out in four planner modules)."""
    words = ('"torch_dtype"', '"text_config"', '"language_config"', '"num_experts_per_tok"', '"bfloat16": 2',
             '"bfloat16": "BF16"')
    planner = REPO_ROOT / "planner"
    found = {f"{path.name}: {word}" for path in planner.rglob("*.py") if path.name != "model_config.py"
             for word in words if word in path.read_text()}
    assert not found


def test_both_readers_take_null_as_not_given_and_echo_a_long_value_cut():
    """One reader (planner.model.model_config.ConfigSizes): a null head_dim is hidden / heads in both (the estimate
    refused it as missing), and a 10,000-element list is echoed cut (the KV cache wrote its repr whole)."""
    config = {**LLAMA, "head_dim": None}
    assert kv_cache_model(config).layers[0].head_dim == activation_shape(config).qk_head_dim == 16
    for read in (kv_cache_model, activation_shape):
        message = _refusal(read, {**LLAMA, "num_key_value_heads": list(range(10_000))})
        assert "num_key_value_heads is [0, 1," in message and len(message) < 300
