"""What the planner models of each architecture, one entry per model_type: how its layers cache (planner.model.kv_cache)
and what its forward holds at once (planner.model.activations). A new architecture is one entry here, plus a layer
builder in planner.model.kv_cache where its cache is a hybrid of attention and state layers, plus tests.

The rules are transformers' (5.17 and 5.24), read from its modeling and configuration files, as each field's
comment says. An architecture not listed gets the GENERIC entry: standard attention read from config.json alone
(heads, K/V heads, head_dim, layer_types, the window), after planner.model.kv_cache has refused, in one line, the cache
kinds its config shows it keeps otherwise (state-space, linear attention, cross-attention, indexers); tests hold
that model to transformers' own caches for every config class it ships.
"""

from dataclasses import dataclass

from planner.errors import UsageError, printable

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
    #: what the cache keeps instead, named in the refusal (cache None only), e.g. "it keeps state-space states"
    unmodelled_kind: str = ""
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
        if bool(self.unmodelled_kind) != (self.cache is None):
            raise ValueError("unmodelled_kind names what an entry without a cache keeps, and only there")
        if self.sliding_rule is not None and self.sliding_rule not in SLIDING_RULES:
            raise ValueError(f"sliding_rule must be one of {SLIDING_RULES}, not {self.sliding_rule!r}")


def _attention(rule: str, **traits: bool) -> Architecture:
    return Architecture(cache="attention", sliding_rule=rule, **traits)


#: linear-attention and state-space layers: neither the activation estimate nor (where cache is None) the KV
#: cache model covers them
_STATE_LAYERS = {"activations_modelled": False}


def _unmodelled(kind: str) -> Architecture:
    return Architecture(cache=None, unmodelled_kind=kind, **_STATE_LAYERS)


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
    **{name: _unmodelled("it keeps state-space (Mamba) states") for name in ("mamba", "mamba2", "zamba", "zamba2",
                                                                      "nemotron_h")},
    "lfm2": _unmodelled("it keeps short-convolution states beside attention"),
    # CPM-Ant prepends prompt_length learned prompt tokens to every sequence, cached with the text's, in heads
    # of dim_head (transformers' CpmAntAttention)
    "cpmant": _unmodelled("it caches learned prompt tokens (config.json's prompt_length) before each sequence"),
    # LongCat-Flash runs two MLA attentions in every decoder layer, each with its cache (LongcatFlashDecoderLayer)
    "longcat_flash": _unmodelled("it caches two attention sub-layers in every decoder layer"),
    # MiMo-V2-Flash's sliding layers build twice config.json's K/V heads (MiMoV2FlashAttention: is_swa)
    "mimo_v2_flash": _unmodelled("its sliding layers cache twice the K/V heads config.json names"),
    "xlstm": _unmodelled("it keeps xLSTM's recurrent matrix memories"),
}
#: an architecture the table does not list: standard attention as its config.json describes it (planner.model.kv_cache
#: refuses the other cache kinds such a config shows first); every layer slides where a window is set and
#: layer_types is silent (Mistral's rule), and the forward is taken to hold a mask per layer type where both are
#: present (what transformers' causal_mask_mapping builds: the larger estimate where a model builds one)
GENERIC = Architecture(cache="attention", sliding_rule="all", mask_per_layer_type=True)


def architecture(model_type: str | None) -> Architecture:
    """The entry of ``model_type`` (GENERIC where the table has none)."""
    return ARCHITECTURES.get(model_type, GENERIC) if isinstance(model_type, str) else GENERIC


def listed(model_type: str | None) -> bool:
    """Whether the table has an entry of its own for ``model_type``."""
    return isinstance(model_type, str) and model_type in ARCHITECTURES


def model_types_with(**traits) -> tuple[str, ...]:
    """The listed model types whose entry has every one of ``traits`` (e.g. ``eager_attention=True``), sorted."""
    return tuple(sorted(name for name, entry in ARCHITECTURES.items()
                        if all(getattr(entry, key) == value for key, value in traits.items())))


#: model_types whose decode step transformers' own code cannot capture in a CUDA graph, with why and the
#: transformers releases whose modeling file was read. Read from the source, not detected: the planner imports no
#: torch, and what breaks a capture (a host copy or synchronisation) shows only on a GPU.
UNCAPTURABLE_DECODE: dict[str, tuple[str, tuple[str, ...]]] = {
    # modeling_phimoe.py, PhimoeRotaryEmbedding.forward, every step: ``inv_freq, attention_scaling =
    # self.rope_init_fn(self.config)`` builds the frequencies on the CPU, then ``inv_freq.to(device=x.device,
    # ...)`` copies them to the GPU from pageable memory, which a capture refuses ("Cannot copy between CPU and
    # CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"; the H100 sweep of 2026-11-28); with
    # longrope (Phi-3.5-MoE's config) ``if ... and seq_len`` also reads ``torch.max(position_ids) + 1`` on the host
    "phimoe": ("its rotary embedding rebuilds its frequencies on the CPU and copies them to the GPU inside every "
               "step (PhimoeRotaryEmbedding.forward)", ("5.17", "5.24")),
}


def check_decode_capturable(model_type: str | None, cuda_graph: bool) -> None:
    """--cuda-graph on an architecture whose decode step transformers cannot capture (UNCAPTURABLE_DECODE): one
    line saying why and what to do, before a plan that run would refuse is written."""
    if not cuda_graph or not isinstance(model_type, str) or model_type not in UNCAPTURABLE_DECODE:
        return
    reason, versions = UNCAPTURABLE_DECODE[model_type]
    raise UsageError(f"--cuda-graph: transformers ({', '.join(versions)} read) cannot capture a "
                     f"{printable(model_type)} decode step in a CUDA graph: {reason}; make the plan without "
                     "--cuda-graph")
