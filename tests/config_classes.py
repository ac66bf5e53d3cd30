"""Every decoder (causal-LM) architecture the installed transformers ships as a config class, built tiny.

The list is read at run time from transformers' auto mappings (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, the classes
``AutoModelForCausalLM`` builds), so it is 5.17's list on 5.17 and 5.24's on 5.24. Each config is the class's own
with its sizes shrunk where the class takes them (few layers, narrow widths, few experts), written as the class
writes it (``to_json_string``: no dtype unless the class sets one). Where the class refuses the shrunk sizes, the
layers alone are shrunk, then nothing: every class yields a config.
"""

from __future__ import annotations

import json
import warnings

#: sizes small enough that a model builds and runs on the CPU in well under a second, each given to a class
#: only where it has the attribute (and it is not null)
TINY_SIZES = {
    "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "vocab_size": 512, "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 8, "rotary_dim": 8,
}

#: the layers alone, for classes whose checks refuse the narrow widths
FEW_LAYERS = {"num_hidden_layers": 2}
TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")


def causal_lm_model_types() -> list[str]:
    """The model_types transformers builds a causal LM for, sorted."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(name for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if name in CONFIG_MAPPING)


def _sized(defaults, sizes: dict) -> dict:
    """The entries of ``sizes`` the config object ``defaults`` has (not null), computed properties left out."""
    return {key: value for key, value in sizes.items() if getattr(defaults, key, None) is not None
            and not isinstance(getattr(type(defaults), key, None), property)}


def _per_layer(defaults, num_layers: int) -> dict:
    """Lists of one entry per layer (layer_types and the like), cut to ``num_layers``."""
    count = getattr(defaults, "num_hidden_layers", None)
    if not isinstance(count, int) or count <= num_layers:
        return {}
    try:
        values = defaults.to_dict()
    except Exception:  # noqa: BLE001 - a class that cannot list itself keeps its lists
        return {}
    return {key: value[:num_layers] for key, value in values.items()
            if isinstance(value, list) and len(value) == count}


def _shrunk(defaults, sizes: dict, window_tokens: int | None) -> dict:
    """The sizes ``defaults`` (a config object) takes, its per-layer lists and window cut, its token ids within the
    vocabulary."""
    kwargs = _sized(defaults, sizes)
    if "num_hidden_layers" in kwargs:
        kwargs.update(_per_layer(defaults, kwargs["num_hidden_layers"]))
    if getattr(defaults, "kv_lora_rank", None):  # latent attention: head_dim is derived, K/V heads are the heads
        kwargs.pop("head_dim", None)
        if "num_key_value_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", kwargs["num_key_value_heads"])
    if window_tokens is not None and isinstance(getattr(defaults, "sliding_window", None), int):
        kwargs["sliding_window"] = window_tokens
    vocab = kwargs.get("vocab_size")
    for key in TOKEN_KEYS:  # token ids past a shrunk vocabulary break the embedding's padding_idx
        token = getattr(defaults, key, None)
        if vocab and isinstance(token, int) and token >= vocab:
            kwargs[key] = 0
    return kwargs


def _kwargs(config_class, sizes: dict, window_tokens: int | None) -> dict:
    defaults = config_class()
    kwargs = _shrunk(defaults, sizes, window_tokens)
    for name in getattr(defaults, "sub_configs", None) or {}:  # a multimodal model's text and vision towers
        sub = getattr(defaults, name, None)
        if sub is not None and hasattr(sub, "to_diff_dict"):
            kwargs[name] = {**sub.to_diff_dict(), **_shrunk(sub, sizes, window_tokens), "model_type": sub.model_type}
    return kwargs


def tiny_config(model_type: str, *, window_tokens: int | None = None, build=None, tiny_only: bool = False):
    """The class's config, shrunk as far as it (and ``build``, a callable that builds a model of it, when given)
    accepts: TINY_SIZES, else FEW_LAYERS, else the class's defaults (TINY_SIZES alone with ``tiny_only``: a
    model to run on the CPU). ``window_tokens`` replaces a sliding window the class sets (to reach it in a few
    tokens)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    last = None
    for sizes in (TINY_SIZES,) if tiny_only else (TINY_SIZES, FEW_LAYERS, {}):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = config_class(**_kwargs(config_class, sizes, window_tokens))
                if build is not None:
                    build(config)
            return config
        except Exception as error:  # noqa: BLE001 - any refusal of the sizes: try the next, larger ones
            last = error
    raise last


def written(config) -> dict:
    """config.json as the class writes it (save_pretrained's to_json_string)."""
    return json.loads(config.to_json_string())
