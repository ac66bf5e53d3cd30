"""planner.model.architectures: one entry per model_type, read by the KV cache model and the activation estimate."""

import pytest

from planner.model import architectures
from planner.model.activations import activation_shape
from planner.model.architectures import ARCHITECTURES, Architecture, architecture, model_types_with
from planner.model.kv_cache import HYBRID_LAYERS, SUPPORTED_MODEL_TYPES, attention_layer_types, kv_cache_model

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 4, "intermediate_size": 128, "vocab_size": 100,
         "torch_dtype": "bfloat16"}


def test_the_table_holds_the_sets_the_modules_listed_before():
    """The lists planner.model.kv_cache and planner.model.activations kept apart, now read from the one table."""
    assert dict(zip(model_types_with(cache="attention"),
                    (ARCHITECTURES[n].sliding_rule for n in model_types_with(cache="attention")))) == {
        "llama": "all", "mistral": "all", "mixtral": "all", "qwen2": "qwen", "qwen2_moe": "qwen", "qwen3": "qwen",
        "qwen3_moe": "qwen", "gemma": "all", "gemma2": "alternating", "gemma3": "pattern",
        "gemma3_text": "pattern", "gpt_oss": "alternating"}
    assert model_types_with(cache="latent") == ("deepseek_v2", "deepseek_v3", "kimi_k2")
    assert model_types_with(cache="hybrid") == ("falcon_h1", "jamba", "qwen3_next")
    assert model_types_with(activations_modelled=False) == tuple(sorted(
        ("qwen3_next", "jamba", "falcon_h1", "mamba", "mamba2", "zamba", "zamba2", "nemotron_h", "lfm2", "cpmant",
         "longcat_flash", "mimo_v2_flash", "xlstm")))
    assert model_types_with(eager_attention=True) == ("gpt_oss",)
    assert model_types_with(rotary_per_layer_type=True) == ("gemma3", "gemma3_text")
    assert model_types_with(mask_per_layer_type=True) == (
        "gemma2", "gemma3", "gemma3_text", "gpt_oss", "qwen2", "qwen2_moe", "qwen3")
    assert model_types_with(window_off_mask=True) == ("qwen2_moe",)
    assert SUPPORTED_MODEL_TYPES == tuple(sorted(model_types_with(cache="attention") + model_types_with(
        cache="latent") + model_types_with(cache="hybrid")))


def test_every_hybrid_entry_has_its_layer_builder():
    assert set(HYBRID_LAYERS) == set(model_types_with(cache="hybrid"))


@pytest.mark.parametrize(("fields", "words"), [
    ({"cache": "paged"}, "cache must be one of"),
    ({"cache": "attention"}, "sliding_rule is given for attention caches"),
    ({"cache": "latent", "sliding_rule": "all"}, "sliding_rule is given for attention caches"),
    ({"cache": "attention", "sliding_rule": "every_third"}, "sliding_rule must be one of"),
])
def test_an_entry_is_checked(fields, words):
    with pytest.raises(ValueError, match=words):
        Architecture(**fields)


def test_unlisted_and_odd_model_types_get_the_generic_entry():
    assert architecture("no_such_model") is architectures.GENERIC
    assert architecture(None) is architectures.GENERIC and architecture(["llama"]) is architectures.GENERIC
    assert not architectures.listed("no_such_model") and architectures.listed("llama")


@pytest.mark.parametrize(("fields", "words"), [
    ({"cache": None}, "unmodelled_kind names"),
    ({"cache": "latent", "unmodelled_kind": "states"}, "unmodelled_kind names"),
])
def test_an_unmodelled_entry_names_its_kind(fields, words):
    with pytest.raises(ValueError, match=words):
        Architecture(**fields)


def test_a_new_architecture_is_modelled_from_its_config_and_an_entry_changes_its_rule(monkeypatch):
    """An attention model the table does not list is standard attention from its config (every layer slides where
    a window is set and layer_types is silent); an entry is all it takes for another rule."""
    config = {**LLAMA, "model_type": "newlm", "architectures": ["NewLmForCausalLM"], "sliding_window": 8}
    assert [layer.kind for layer in kv_cache_model(config).layers] == ["sliding"] * 4
    assert activation_shape(config).sliding_mask_window_tokens == 0  # one kind of layer: one mask
    monkeypatch.setitem(ARCHITECTURES, "newlm", Architecture(cache="attention", sliding_rule="alternating",
                                                             mask_per_layer_type=True))
    assert attention_layer_types(config) == ("sliding_attention", "full_attention") * 2
    assert [layer.kind for layer in kv_cache_model(config).layers] == ["sliding", "full"] * 2
    assert activation_shape(config).sliding_mask_window_tokens == 8
