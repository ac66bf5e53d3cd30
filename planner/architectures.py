"""What the planner models of each architecture, one entry per model_type: how its layers cache (planner.kv_cache)
and what its forward holds at once (planner.activations). A new architecture is one entry here, plus a layer
builder in planner.kv_cache where its cache is a hybrid of attention and state layers, plus tests.

The rules are transformers' (5.17 and 5.24), read from its modeling and configuration files, as each field's
comment says; an architecture not listed is refused in one line by the KV cache model, because a wrong guess
would silently oversubscribe the GPU.
"""

from dataclasses import dataclass

#: how the layers of an architecture cache: K/V per head, MLA's compressed latent, or attention beside
#: linear-attention/state-space layers
CACHES = ("attention", "latent", "hybrid")
#: where an attention architecture's sliding layers lie when config.json has no layer_types (its transformers
#: config class's rule): every layer where a window is set, from max_window_layers on (Qwen2/3), every other
#: layer (Gemma 2, gpt-oss), all but every sliding_window_pattern-th (Gemma 3)
SLIDING_RULES = ("all", "qwen", "alternating", "pattern")


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """One model_type's modelled traits."""

    #: one of CACHES, or None where the KV cache model does not model it (refused in one line)
    cache: str | None
    #: an attention architecture's rule for its sliding layers (one of SLIDING_RULES)
    sliding_rule: str | None = None
    #: False for linear-attention/state-space layers, which the activation estimate does not model
    activations_modelled: bool = True
    #: no SDPA path in transformers (GptOssPreTrainedModel._supports_sdpa is False: its attention sinks join the
    #: softmax), so it runs eager_attention_forward and holds score-sized tensors
    eager_attention: bool = False
    #: the forward builds a mask per layer type (causal_mask_mapping: a full one and a sliding one), both held to
    #: its end: Gemma 2/3, gpt-oss and Qwen2-MoE always, Qwen2/3 where a layer slides. Mistral, Mixtral and
    #: Qwen3-MoE build one mask for every layer, sliding where the config has a window.
    mask_per_layer_type: bool = False
    #: the forward builds a rotary cos/sin pair per layer type present (Gemma3TextModel.forward: ``for layer_type
    #: in set(self.config.layer_types)``; local layers rotate with base 10,000, global ones with 1,000,000)
    rotary_per_layer_type: bool = False
    #: the forward builds the sliding mask even with the window off: Qwen2MoeConfig then sets sliding_window to 0,
    #: a local size no key length is below, so masking_utils never skips it and it spans every key of the (full)
    #: first layer; nothing reads it (every layer is full attention)
    window_off_mask: bool = False

    def __post_init__(self) -> None:
        if self.cache is not None and self.cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES} or None, not {self.cache!r}")
        if (self.cache == "attention") != (self.sliding_rule is not None):
            raise ValueError("sliding_rule is given for attention caches and for them only")
        if self.sliding_rule is not None and self.sliding_rule not in SLIDING_RULES:
            raise ValueError(f"sliding_rule must be one of {SLIDING_RULES}, not {self.sliding_rule!r}")


def _attention(rule: str, **traits: bool) -> Architecture:
    return Architecture(cache="attention", sliding_rule=rule, **traits)


#: linear-attention and state-space layers: neither the activation estimate nor (where cache is None) the KV
#: cache model covers them
_STATE_LAYERS = {"activations_modelled": False}

ARCHITECTURES: dict[str, Architecture] = {
    "llama": _attention("all"),
    "mistral": _attention("all"),
    "mixtral": _attention("all"),
    "gemma": _attention("all"),
    "qwen2": _attention("qwen", mask_per_layer_type=True),
    "qwen2_moe": _attention("qwen", mask_per_layer_type=True, window_off_mask=True),
    "qwen3": _attention("qwen", mask_per_layer_type=True),
    "qwen3_moe": _attention("qwen"),
    "gemma2": _attention("alternating", mask_per_layer_type=True),
    "gemma3": _attention("pattern", mask_per_layer_type=True, rotary_per_layer_type=True),
    "gemma3_text": _attention("pattern", mask_per_layer_type=True, rotary_per_layer_type=True),
    "gpt_oss": _attention("alternating", mask_per_layer_type=True, eager_attention=True),
    "deepseek_v2": Architecture(cache="latent"),
    "deepseek_v3": Architecture(cache="latent"),
    "kimi_k2": Architecture(cache="latent"),
    "qwen3_next": Architecture(cache="hybrid", **_STATE_LAYERS),
    "jamba": Architecture(cache="hybrid", **_STATE_LAYERS),
    "falcon_h1": Architecture(cache="hybrid", **_STATE_LAYERS),
    **{name: Architecture(cache=None, **_STATE_LAYERS)
       for name in ("mamba", "mamba2", "zamba", "zamba2", "nemotron_h", "lfm2")},
}
#: an architecture the table does not list: nothing known about its cache, its activations estimated as a plain
#: attention model's
UNLISTED = Architecture(cache=None)


def architecture(model_type: str | None) -> Architecture:
    """The entry of ``model_type`` (UNLISTED where the table has none)."""
    return ARCHITECTURES.get(model_type, UNLISTED) if isinstance(model_type, str) else UNLISTED


def model_types_with(**traits) -> tuple[str, ...]:
    """The listed model types whose entry has every one of ``traits`` (e.g. ``eager_attention=True``), sorted."""
    return tuple(sorted(name for name, entry in ARCHITECTURES.items()
                        if all(getattr(entry, key) == value for key, value in traits.items())))
