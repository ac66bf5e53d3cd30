"""How many bytes a serving KV cache holds, per architecture, read from config.json.

Every decoder layer keeps one or two cache entries:

- ``full``: grouped-query attention, K and V of every token (2 x num_key_value_heads x head_dim elements).
- ``sliding``: the same, but at most ``sliding_window`` tokens per sequence. vLLM's ``SlidingWindowSpec``
  and SGLang's SWA pool keep the window (transformers' ``DynamicSlidingWindowLayer`` keeps window - 1).
- ``latent``: multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) caches one compressed latent of
  ``kv_lora_rank`` plus the shared rope key of ``qk_rope_head_dim`` per token, no K/V split (vLLM's
  ``MLAAttentionSpec``, SGLang's ``MLATokenToKVPool``, transformers >= 5.2 ``DeepseekV3Attention``).
- ``state``: linear attention or a state-space layer (Qwen3-Next's Gated DeltaNet, Mamba in Jamba, Mamba-2 in
  Falcon-H1): a convolution state of ``conv_kernel`` columns in the activation dtype plus a recurrent (SSM)
  state in float32, fixed per sequence whatever the context. float32 is what transformers keeps and SGLang's
  default ``--mamba-ssm-dtype``; vLLM's ``--mamba-ssm-cache-dtype auto`` keeps the model dtype, so there the
  model overstates the recurrent state by 2x. ``--kv-cache-dtype`` does not apply to these states.

Layers past ``num_hidden_layers`` (multi-token-prediction heads) are not served by default and not counted.
A model_type planner.model.architectures does not list is modelled from its config.json alone: standard attention
(``full`` and ``sliding`` entries from its heads, K/V heads, head_dim, layer_types and window), or ``latent`` where
it names ``kv_lora_rank``. Before that, the cache kinds its config shows it keeps otherwise are refused in one line
that names the kind (``other_cache_kind``): state-space and recurrent states, linear attention, cross-attention,
sparse-attention indexers, layer types other than full and sliding attention. A wrong guess here would silently
oversubscribe the GPU, so tests hold the model to transformers' own caches for every config class it ships.
"""

from dataclasses import dataclass, replace

from planner.model.architectures import architecture, listed, model_types_with
from planner.model.model_config import ConfigSizes, model_config
from planner.errors import ModelInputError, printable, shown
from planner.units import format_bytes

#: bytes per element of the cache dtypes ``--kv-dtype`` takes ("auto" is the checkpoint's activation dtype)
KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
KV_DTYPES = ("auto", *KV_DTYPE_BYTES)
#: config.json's torch_dtype/dtype -> the name used here
_CONFIG_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
#: safetensors dtypes of unquantized floating weights -> config.json's name for them
_TENSOR_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
#: activation dtype when neither config.json nor the headers name one (no floating weights at all)
DEFAULT_ACTIVATION_DTYPE = "bf16"
RECURRENT_STATE_BYTES = 4  # float32
KINDS = ("full", "sliding", "latent", "state")


@dataclass(frozen=True, kw_only=True)
class CacheLayer:
    """One cache entry of one decoder layer (a hybrid layer such as Falcon-H1's has two)."""

    #: index of the decoder layer, 0-based
    layer_index: int
    #: "full", "sliding", "latent" or "state"
    kind: str
    #: K/V heads of a full or sliding layer
    num_kv_heads: int = 0
    #: dims per K/V head of a full or sliding layer
    head_dim: int = 0
    #: dims per V head where they differ from the K heads' (config.json's v_head_dim; 0: head_dim)
    value_head_dim: int = 0
    #: elements per token of a latent layer: kv_lora_rank + qk_rope_head_dim
    latent_dims: int = 0
    #: tokens a sliding layer holds at most per sequence
    window_tokens: int = 0
    #: elements per sequence of a state layer's convolution state (activation dtype)
    conv_state_elements: int = 0
    #: elements per sequence of a state layer's recurrent/SSM state (float32)
    recurrent_state_elements: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {self.kind!r}")
        if self.layer_index < 0:
            raise ValueError("layer_index must be >= 0")
        if self.value_head_dim < 0:
            raise ValueError("value_head_dim must be >= 0")
        if self.kind in ("full", "sliding") and (self.num_kv_heads < 1 or self.head_dim < 1):
            raise ValueError(f"a {self.kind} layer needs num_kv_heads and head_dim >= 1")
        if self.kind == "sliding" and self.window_tokens < 1:
            raise ValueError("a sliding layer needs window_tokens >= 1")
        if self.kind == "latent" and self.latent_dims < 1:
            raise ValueError("a latent layer needs latent_dims >= 1")
        if self.kind == "state" and self.conv_state_elements + self.recurrent_state_elements < 1:
            raise ValueError("a state layer needs a conv or recurrent state")

    @property
    def elements_per_token(self) -> int:
        """Cached elements per token per sequence (0 for a fixed state)."""
        if self.kind in ("full", "sliding"):
            return self.num_kv_heads * (self.head_dim + (self.value_head_dim or self.head_dim))  # K and V
        return self.latent_dims

    def held_tokens(self, context_tokens: int) -> int:
        """Tokens of one sequence this entry holds at ``context_tokens``."""
        if self.kind == "state":
            return 0
        if self.kind == "sliding":
            return min(context_tokens, self.window_tokens)
        return context_tokens

    def state_bytes(self, activation_bytes: int) -> int:
        """Fixed bytes per sequence (state layers only)."""
        return self.conv_state_elements * activation_bytes + self.recurrent_state_elements * RECURRENT_STATE_BYTES


@dataclass(frozen=True, kw_only=True)
class KvCacheModel:
    """The serving cache of one model: what every layer keeps per token and per sequence."""

    #: model_type (or architecture) the entries were built for
    architecture: str
    #: one or two entries per served decoder layer, in layer order
    layers: tuple[CacheLayer, ...]
    #: the checkpoint's activation dtype, what ``kv_dtype="auto"`` means and what conv states are kept in
    activation_dtype: str = DEFAULT_ACTIVATION_DTYPE

    def __post_init__(self):
        if not self.layers:
            raise ValueError("a KV cache model needs at least one layer")
        if self.activation_dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"activation_dtype must be one of {tuple(KV_DTYPE_BYTES)}, not {self.activation_dtype!r}")

    def element_bytes(self, kv_dtype: str) -> int:
        """Bytes per cached K/V/latent element for ``kv_dtype``."""
        if kv_dtype == "auto":
            kv_dtype = self.activation_dtype
        if kv_dtype not in KV_DTYPE_BYTES:
            raise ModelInputError(f"unknown KV cache dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
        return KV_DTYPE_BYTES[kv_dtype]

    def cache_bytes(self, *, num_sequences: int, context_tokens: int, kv_dtype: str,
                    layer_index: int | None = None) -> int:
        """Bytes of the cache for ``num_sequences`` sequences of ``context_tokens`` tokens each; of one decoder
        layer's entries with ``layer_index`` (what a step reads and writes there), else of every layer."""
        if num_sequences < 0 or context_tokens < 0:
            raise ValueError("num_sequences and context_tokens must be >= 0")
        element = self.element_bytes(kv_dtype)
        activation = KV_DTYPE_BYTES[self.activation_dtype]
        per_sequence = sum(layer.held_tokens(context_tokens) * layer.elements_per_token * element
                           + layer.state_bytes(activation) for layer in self.layers
                           if layer_index is None or layer.layer_index == layer_index)
        return num_sequences * per_sequence

    def bytes_per_token(self, kv_dtype: str) -> int:
        """Bytes one more token of context adds per sequence, past every sliding window."""
        element = self.element_bytes(kv_dtype)
        return sum(layer.elements_per_token * element for layer in self.layers if layer.kind in ("full", "latent"))

    def fixed_bytes_per_sequence(self, kv_dtype: str) -> int:
        """Bytes per sequence that do not grow past the windows: full sliding windows and fixed states."""
        element = self.element_bytes(kv_dtype)
        activation = KV_DTYPE_BYTES[self.activation_dtype]
        return sum(layer.window_tokens * layer.elements_per_token * element + layer.state_bytes(activation)
                   for layer in self.layers if layer.kind in ("sliding", "state"))

    def describe(self, kv_dtype: str = "auto") -> str:
        """One line for ``show``: what a token and a sequence cost, and why."""
        dtype = self.activation_dtype if kv_dtype == "auto" else kv_dtype
        parts = [_describe_group(self._of_kind(kind), self.activation_dtype) for kind in KINDS if self._of_kind(kind)]
        totals = f"{format_bytes(self.bytes_per_token(kv_dtype))} per token"
        fixed = self.fixed_bytes_per_sequence(kv_dtype)
        if fixed:
            totals += f" + {format_bytes(fixed)} per sequence"
        return f"{'; '.join(parts)}, {dtype}: {totals}"

    def _of_kind(self, kind: str) -> list[CacheLayer]:
        return [layer for layer in self.layers if layer.kind == kind]


def _describe_group(layers: list[CacheLayer], activation_dtype: str) -> str:
    first, count = layers[0], len(layers)
    if first.kind == "latent":
        return f"{count} layers x latent {first.latent_dims} dims (kv_lora_rank + rope)"
    if first.kind == "state":
        return f"{count} layers x fixed state (conv {activation_dtype} + recurrent fp32)"
    shape = f"{first.num_kv_heads} KV heads x {first.head_dim} dims x K,V"
    if first.value_head_dim and first.value_head_dim != first.head_dim:
        shape = f"{first.num_kv_heads} KV heads x {first.head_dim} K + {first.value_head_dim} V dims"
    if any(layer.elements_per_token != first.elements_per_token for layer in layers):
        shape = "mixed heads x K,V"
    if first.kind == "sliding":
        return f"{count} sliding layers (window {first.window_tokens}) x {shape}"
    return f"{count} layers x {shape}"


def weights_dtype(tensors) -> str | None:
    """The config.json dtype name from_pretrained's ``dtype="auto"`` takes where config.json names none (as
    runtime.skeleton does): the first unquantized floating tensor of the first shard, in file order; None where
    there is none."""
    floating = [t for t in tensors if t.dtype in _TENSOR_DTYPES]
    if not floating:
        return None
    first_file = min(t.file for t in floating)
    first = min((t for t in floating if t.file == first_file),
                key=lambda t: (t.offset_bytes is None, t.offset_bytes or 0, t.name))
    return _TENSOR_DTYPES[first.dtype]


def with_weights_dtype(config: dict | None, tensors) -> dict | None:
    """config.json with the weights' dtype (``weights_dtype``) where it names none, so that the KV cache model, the
    activation estimate and the plan's ``workload.kv_dtype`` read the dtype the model runs in; else as given."""
    if not config or model_config(config).dtype in _CONFIG_DTYPES:
        return config
    dtype = weights_dtype(tensors)
    return config if dtype is None else {**config, "dtype": dtype}


def activation_dtype(config: dict | None) -> str:
    """The activation dtype (bf16, fp16, fp32) of config.json's dtype, DEFAULT_ACTIVATION_DTYPE where it names
    none; what ``--kv-dtype auto`` resolves to."""
    record = model_config(config)
    return _CONFIG_DTYPES.get(record.dtype if record else None, DEFAULT_ACTIVATION_DTYPE)


# --- reading config.json -------------------------------------------------------------------------------------


class _Config:
    """The model record's language model (planner.model.model_config), its keys read with one-line errors that name
    the architecture; the record's typed fields (model type, architecture, dtype) where it has them."""

    def __init__(self, config: dict):
        record = model_config(config)
        self.values = record.text
        raw_type = self.values.get("model_type") or config.get("model_type")
        if raw_type is not None and not isinstance(raw_type, str):  # the record drops it; a list is unhashable
            raise ModelInputError(f"KV cache: config.json's model_type is {shown(raw_type)}; expected a string "
                                  "such as llama")
        self.model_type = record.model_type or record.outer_model_type or _model_type_of(record.architecture)
        self.name = printable(self.model_type or record.architecture or "unknown architecture")
        self.dtype = record.dtype
        self.sizes = ConfigSizes(self.values, f"KV cache of {self.name}", "; add it to plan its KV cache")

    def missing(self, what: str) -> ModelInputError:
        return self.sizes.missing(what)

    def has(self, key: str) -> bool:
        return self.sizes.has(key)

    def int(self, key: str, *, maximum: int | None = None, default: int | None = None) -> int:
        """planner.model.model_config.ConfigSizes.size: in CONFIG_LIMITS' range, or at most ``maximum``."""
        return self.sizes.size(key, default=default, maximum=maximum)

    def num_layers(self) -> int:
        return self.int("num_hidden_layers")

    def activation_dtype(self) -> str:
        return _CONFIG_DTYPES.get(self.dtype, DEFAULT_ACTIVATION_DTYPE)


def _model_type_of(architecture: str | None) -> str | None:
    """A config without model_type: the family its architecture class names (LlamaForCausalLM -> llama)."""
    if architecture is None:
        return None
    stem = architecture
    for suffix in ("ForCausalLM", "ForConditionalGeneration", "Model"):
        stem = stem.removesuffix(suffix)
    by_plain_name = {name.replace("_", ""): name for name in SUPPORTED_MODEL_TYPES}
    return by_plain_name.get(stem.lower())


def _attention_shape(cfg: _Config) -> tuple[int, int]:
    """(num_key_value_heads, head_dim) of grouped-query attention; head_dim defaults to hidden / heads."""
    num_heads = cfg.int("num_attention_heads")
    num_kv_heads = cfg.int("num_key_value_heads", default=num_heads)
    if num_heads % num_kv_heads:
        raise ModelInputError(f"KV cache of {cfg.name}: num_attention_heads {num_heads} is not a multiple of "
                              f"num_key_value_heads {num_kv_heads}; fix config.json")
    if cfg.has("head_dim"):
        return num_kv_heads, cfg.int("head_dim")
    hidden = cfg.int("hidden_size")
    if hidden % num_heads:
        raise ModelInputError(f"KV cache of {cfg.name}: config.json has no head_dim and hidden_size {hidden} is not "
                              f"a multiple of num_attention_heads {num_heads}; add head_dim")
    return num_kv_heads, hidden // num_heads


def _sliding_window(cfg: _Config) -> int | None:
    """The window in tokens, or None where config.json sets none (Mixtral, later Mistral configs)."""
    if cfg.values.get("use_sliding_window") is False:  # Qwen2/Qwen3 switch the window off this way
        return None
    return cfg.int("sliding_window") if cfg.has("sliding_window") else None


def _explicit_layer_types(cfg: _Config, num_layers: int) -> list[str] | None:
    types = cfg.values.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) < num_layers or not all(isinstance(t, str) for t in types):
        raise ModelInputError(f"KV cache of {cfg.name}: config.json's layer_types must list a type for each of "
                              f"its {num_layers} layers")
    return types[:num_layers]


def _attention_layer_types(cfg: _Config, num_layers: int, rule: str) -> list[str]:
    """'full_attention' or 'sliding_attention' per layer, as transformers' config classes derive them."""
    explicit = _explicit_layer_types(cfg, num_layers)
    if explicit is not None:
        return explicit
    window = _sliding_window(cfg)
    if window is None:
        return ["full_attention"] * num_layers
    if rule == "alternating":  # Gemma 2, gpt-oss: even layers slide
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if rule == "pattern":  # Gemma 3: every sliding_window_pattern-th layer is global (transformers' default 6)
        period = cfg.int("sliding_window_pattern", maximum=num_layers + 1, default=6)
        return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)]
    if rule == "qwen":  # layers from max_window_layers on slide
        first = cfg.values.get("max_window_layers", 0)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ModelInputError(f"KV cache of {cfg.name}: config.json's max_window_layers is {first!r}; "
                                  "expected an integer >= 0")
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return ["sliding_attention"] * num_layers  # Mistral-7B-v0.1: every layer slides


def attention_layer_types(config: dict | None) -> tuple[str, ...]:
    """Each decoder layer's attention type ("full_attention", "sliding_attention") for a config of the attention
    families, as transformers' config classes derive them; () for the other families (latent attention, linear
    attention hybrids), architectures not modelled and configs without num_hidden_layers."""
    if not config:
        return ()
    cfg = _Config(config)
    rule = architecture(cfg.model_type).sliding_rule
    if rule is None or not cfg.has("num_hidden_layers"):
        return ()
    return tuple(_attention_layer_types(cfg, cfg.num_layers(), rule))


def _attention_entry(cfg: _Config, index: int, layer_type: str) -> CacheLayer:
    num_kv_heads, head_dim = _attention_shape(cfg)
    if layer_type == "full_attention":
        return CacheLayer(layer_index=index, kind="full", num_kv_heads=num_kv_heads, head_dim=head_dim)
    if layer_type == "sliding_attention":
        window = _sliding_window(cfg)
        if window is None:
            raise cfg.missing(f"sliding_window (layer {index} is a sliding_attention layer)")
        return CacheLayer(layer_index=index, kind="sliding", num_kv_heads=num_kv_heads, head_dim=head_dim,
                          window_tokens=window)
    raise ModelInputError(f"KV cache of {cfg.name}: layer {index} has layer type {layer_type!r}, which is not "
                          "modelled; known: full_attention, sliding_attention")


def _attention_layers(cfg: _Config, rule: str) -> list[CacheLayer]:
    num_layers = cfg.num_layers()
    types = _attention_layer_types(cfg, num_layers, rule)
    return [_attention_entry(cfg, i, t) for i, t in enumerate(types)]


def _latent_layers(cfg: _Config) -> list[CacheLayer]:
    """MLA: the latent and the rope key per token per layer (the MTP layers past num_hidden_layers excluded)."""
    dims = cfg.int("kv_lora_rank") + cfg.int("qk_rope_head_dim")
    return [CacheLayer(layer_index=i, kind="latent", latent_dims=dims) for i in range(cfg.num_layers())]


def _gated_deltanet_state(cfg: _Config, index: int) -> CacheLayer:
    """Qwen3-Next's Gated DeltaNet: conv over q, k, v channels; one k x v matrix per value head."""
    key_dim = cfg.int("linear_num_key_heads") * cfg.int("linear_key_head_dim")
    num_value_heads = cfg.int("linear_num_value_heads")
    value_dim = num_value_heads * cfg.int("linear_value_head_dim")
    conv = (2 * key_dim + value_dim) * cfg.int("linear_conv_kernel_dim")
    recurrent = num_value_heads * cfg.int("linear_key_head_dim") * cfg.int("linear_value_head_dim")
    return CacheLayer(layer_index=index, kind="state", conv_state_elements=conv, recurrent_state_elements=recurrent)


def _qwen3_next_layers(cfg: _Config) -> list[CacheLayer]:
    num_layers = cfg.num_layers()
    types = _explicit_layer_types(cfg, num_layers)
    if types is None:  # transformers' Qwen3NextConfig: every full_attention_interval-th layer is full attention
        interval = cfg.int("full_attention_interval", maximum=num_layers + 1, default=4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    return [_gated_deltanet_state(cfg, i) if t == "linear_attention" else _attention_entry(cfg, i, t)
            for i, t in enumerate(types)]


def _jamba_layers(cfg: _Config) -> list[CacheLayer]:
    """Jamba: Mamba layers except every attn_layer_period-th (from attn_layer_offset); Mamba-1 state."""
    num_layers = cfg.num_layers()
    period = cfg.int("attn_layer_period", maximum=num_layers + 1)
    offset = cfg.values.get("attn_layer_offset")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
        raise ModelInputError(f"KV cache of {cfg.name}: config.json's attn_layer_offset is {offset!r}; expected "
                              f"an integer from 0 to attn_layer_period - 1 ({period - 1})")
    inner = cfg.int("mamba_expand") * cfg.int("hidden_size")
    conv = inner * cfg.int("mamba_d_conv")
    recurrent = inner * cfg.int("mamba_d_state")
    return [_attention_entry(cfg, i, "full_attention") if i % period == offset else
            CacheLayer(layer_index=i, kind="state", conv_state_elements=conv, recurrent_state_elements=recurrent)
            for i in range(num_layers)]


def _falcon_h1_layers(cfg: _Config) -> list[CacheLayer]:
    """Falcon-H1: every layer runs attention and Mamba-2 side by side, so it keeps K/V and a state."""
    hidden = cfg.int("hidden_size")
    inner = cfg.int("mamba_d_ssm", default=cfg.int("mamba_expand") * hidden)
    num_heads = cfg.int("mamba_n_heads")
    head_dim = cfg.values.get("mamba_d_head")
    head_dim = inner // num_heads if head_dim in (None, "auto") else cfg.int("mamba_d_head")
    d_state = cfg.int("mamba_d_state")
    conv = (inner + 2 * cfg.int("mamba_n_groups") * d_state) * cfg.int("mamba_d_conv")
    recurrent = num_heads * head_dim * d_state
    entries = []
    for i in range(cfg.num_layers()):
        entries.append(_attention_entry(cfg, i, "full_attention"))
        entries.append(CacheLayer(layer_index=i, kind="state", conv_state_elements=conv,
                                  recurrent_state_elements=recurrent))
    return entries


#: the layers of each hybrid architecture (planner.model.architectures' cache "hybrid")
HYBRID_LAYERS = {"qwen3_next": _qwen3_next_layers, "jamba": _jamba_layers, "falcon_h1": _falcon_h1_layers}
SUPPORTED_MODEL_TYPES = tuple(sorted(set(model_types_with()) - set(model_types_with(cache=None))))
#: layer types of config.json's layer_types that keep K/V per token (every other type keeps something else)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
#: config keys that show a cache other than per-token K/V, and the kind each shows (first match named)
OTHER_CACHE_KEYS = (
    (("is_encoder_decoder", "add_cross_attention", "cross_attention_layers", "encoder_layers", "decoder_layers"),
     "it caches cross-attention to an encoder's output"),
    (("state_size", "ssm_state_size", "mamba_d_state", "mamba_expand", "time_step_rank", "conv_kernel",
      "conv_L_cache", "attention_hidden_size", "hybrid_override_pattern", "layers_block_type", "block_types",
      "attn_layer_period"), "it keeps state-space or recurrent states"),
    (("linear_num_key_heads", "linear_conv_kernel_dim", "linear_attn_config"), "it keeps linear-attention states"),
    (("index_head_dim", "index_n_heads", "index_topk"), "it caches a sparse-attention indexer's keys too"),
    (("mem_len",), "it keeps Transformer-XL memories instead of a KV cache"),
    # Gemma-4: the full-attention layers' head_dim is twice the sliding ones' (per_layer_config overrides)
    (("per_layer_config",), "its layers' attention shapes differ per layer"),
)


def other_cache_kind(values) -> str | None:
    """What config.json (the language model's keys) shows a model caches besides, or instead of, per-token K/V
    of standard or latent attention: a phrase naming the kind and the key that shows it; None where nothing
    does. BERT and the encoders built like it write both of their decoder switches, ``is_decoder`` and
    ``add_cross_attention``: with is_decoder false such a model caches nothing as a causal LM (GPT-NeoX writes
    is_decoder false alone and caches as any decoder)."""
    for keys, kind in OTHER_CACHE_KEYS:
        shown_by = next((key for key in keys if values.get(key) not in (None, False, 0, [], {})), None)
        if shown_by is not None:
            return f"{kind} (config.json's {shown_by})"
    if values.get("is_decoder") is False and "add_cross_attention" in values:  # BERT's switches, both written
        return "an encoder (config.json's is_decoder false) caches nothing as a causal LM"
    types = values.get("layer_types")
    if isinstance(types, list):
        others = sorted({str(t) for t in types} - set(ATTENTION_LAYER_TYPES))
        if others:
            return f"layer types {', '.join(map(repr, others[:3]))} (config.json's layer_types) keep other states"
    return None


def _not_modelled(cfg: _Config, kind: str) -> ModelInputError:
    return ModelInputError(f"KV cache of {cfg.name} (model_type {cfg.model_type!r}) is not modelled: {kind}; plan "
                           "the weights only (drop --concurrency)")


def _unlisted_layers(cfg: _Config) -> list[CacheLayer]:
    """A model_type planner.model.architectures does not list: standard attention, or latent attention where
    kv_lora_rank is given, read from config.json; other cache kinds refused in one line that names them."""
    kind = other_cache_kind(cfg.values)
    if kind is not None:
        raise _not_modelled(cfg, kind)
    if cfg.has("kv_lora_rank"):
        return _latent_layers(cfg)
    layers = _attention_layers(cfg, architecture(cfg.model_type).sliding_rule)
    if cfg.has("v_head_dim"):  # values narrower (or wider) than keys
        layers = [replace(layer, value_head_dim=cfg.int("v_head_dim")) for layer in layers]
    return layers


def kv_cache_model(config: dict | None) -> KvCacheModel:
    """The cache model of a checkpoint from its config.json (the language model's part of multimodal ones)."""
    if not config:
        raise ModelInputError("KV cache: the checkpoint has no config.json; the KV cache is planned from it")
    cfg = _Config(config)
    entry = architecture(cfg.model_type)
    if not listed(cfg.model_type):
        layers = _unlisted_layers(cfg)
    elif entry.cache == "attention":
        layers = _attention_layers(cfg, entry.sliding_rule)
    elif entry.cache == "latent":
        layers = _latent_layers(cfg)
    elif entry.cache == "hybrid":
        layers = HYBRID_LAYERS[cfg.model_type](cfg)
    else:
        raise _not_modelled(cfg, entry.unmodelled_kind)
    return KvCacheModel(architecture=cfg.name, layers=tuple(layers), activation_dtype=cfg.activation_dtype())
