"""One model record: config.json parsed once, its language model resolved, defaults applied, checked against the
checkpoint's tensors.

Multimodal configs (Gemma-3, Mistral-Small-3.1, Llama-4) keep the language model's keys under ``text_config``
(``language_config`` in some); the keys they leave out take their model class's defaults, as transformers'
config classes apply them (``TEXT_DEFAULTS``). The cost model, the activation estimate, the KV cache model and the
layout read the resolved keys through ``text_config`` and the record through ``model_config``; nothing else
parses config.json.

The context limit is computed as vLLM computes the max model length (``vllm/config/model.py``,
``_get_and_verify_max_len``): the smallest of the position keys, times the rope scaling factor except where the
positions already include it (rope types ``su``/``longrope``/``llama3``, and Gemma-3, whose
``max_position_embeddings`` is the scaled length); yarn scales ``original_max_position_embeddings``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from planner.errors import ModelInputError, shown

#: sub-configs of multimodal models that hold the language model's keys
TEXT_SECTIONS = ("text_config", "language_config")
#: what transformers' text config classes set where a public config is silent, by model_type of the language
#: model (transformers/models/gemma3/configuration_gemma3.py, Gemma3TextConfig: Gemma-3-27B's public config
#: names no vocab_size and no max_position_embeddings)
TEXT_DEFAULTS = {
    "gemma3_text": MappingProxyType({"vocab_size": 262_208, "max_position_embeddings": 131_072,
                                     "sliding_window": 4096, "tie_word_embeddings": True,
                                     "num_key_value_heads": 4, "head_dim": 256}),
    # MistralConfig's window where config.json names none (Mistral-7B-v0.1's own; Nemo's states null)
    "mistral": MappingProxyType({"sliding_window": 4096}),
}
#: the keys read here and by the KV cache model and the activation estimate, and the other names config classes
#: write them under (transformers' attribute_map of GPT-2, GPT-J, BLOOM, MPT, OPT, Falcon ...): a config that
#: names only an alias gets the standard key too (the first alias that holds a value)
KEY_ALIASES = {
    "hidden_size": ("n_embd", "d_model", "n_embed"),
    "num_attention_heads": ("n_head", "n_heads", "num_heads", "attention_heads"),
    "num_hidden_layers": ("n_layer", "n_layers", "num_layers"),
    "num_key_value_heads": ("num_kv_heads", "n_head_kv", "n_kv_heads"),
    "intermediate_size": ("n_inner", "ffn_hidden_size", "ffn_dim"),
}
#: the language model's model_type where a multimodal config's text_config names none
TEXT_MODEL_TYPES = {"gemma3": "gemma3_text", "mistral3": "mistral", "llama4": "llama4_text"}
#: config keys that bound the positions a model was trained for, as vLLM reads them (the smallest wins)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_sequence_length", "max_seq_length", "seq_len")
#: rope types whose max_position_embeddings already is the extended length (vLLM does not multiply them)
_UNSCALED_ROPE_TYPES = ("su", "longrope", "llama3")
#: quantization_config methods the planner knows the release layout of
KNOWN_QUANT_METHODS = ("fp8", "mxfp4", "compressed-tensors")
#: config.json dtype names -> bytes per element, and the safetensors dtype of that name
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
#: config.json keys that give the number of routed experts, and the experts each token picks
EXPERT_COUNT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts")
#: the routed experts a token takes, by each family's name: Ernie 4.5's MoE config writes moe_k (transformers'
#: Ernie4_5_MoeConfig; ERNIE-4.5-21B-A3B: 6 of 64)
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k")

#: The one limits table of config.json: every whole-number key the planner reads, with the range a real model's
#: value lies in (wider than any model today, narrow enough that the arithmetic on them stays small and fast).
#: The counts every plan reads (CONFIG_COUNTS) are checked for every config at load (planner.source.checkpoint); the
#: sizes only some architectures' KV cache or activation estimate read are checked where they are read, with a
#: line naming the architecture. Expert counts and top-k may be 0 (a dense model, or "not given").
CONFIG_COUNTS: dict[str, tuple[int, int]] = {
    **dict.fromkeys(("hidden_size", "n_embd"), (1, 2**20)),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_key_value_heads", "head_dim"), (1, 2**16)),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers"), (1, 100_000)),
    **dict.fromkeys(EXPERT_COUNT_KEYS, (0, 2**20)),
    **dict.fromkeys(TOP_K_KEYS, (0, 2**20)),
}
CONFIG_LIMITS: dict[str, tuple[int, int]] = {
    **CONFIG_COUNTS,
    # widths and lengths in elements or tokens
    **dict.fromkeys(("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "vocab_size",
                     "sliding_window"), (1, 2**31)),
    "n_shared_experts": (1, 2**20),
    # per-head and latent dims, and the heads and groups of linear-attention and state-space layers
    **dict.fromkeys(("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "linear_num_key_heads",
                     "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "mamba_d_state",
                     "mamba_d_head", "mamba_n_heads", "mamba_n_groups"), (1, 2**16)),
    "mamba_d_ssm": (1, 2**18),
    # convolution widths and expansion factors
    **dict.fromkeys(("linear_conv_kernel_dim", "mamba_d_conv", "mamba_expand"), (1, 64)),
}


@dataclass(frozen=True, kw_only=True)
class Quantization:
    """What quantization_config says about the weights' storage format."""

    #: quant_method as written (fp8, mxfp4, compressed-tensors, ...)
    method: str
    #: FP8 block scales' block (rows, columns), e.g. (128, 128); None: per-tensor or not FP8
    weight_block: tuple[int, int] | None
    #: module name patterns left in the unquantized dtype (modules_to_not_convert / ignore)
    not_converted: tuple[str, ...]

    @property
    def known(self) -> bool:
        """Whether the planner knows this method's release layout."""
        return self.method in KNOWN_QUANT_METHODS


@dataclass(frozen=True, kw_only=True)
class ContextLimit:
    """The longest sequence the model's positions allow, and where that figure comes from."""

    max_tokens: int
    #: e.g. "max_position_embeddings 40960" or "rope_scaling yarn: original_max_position_embeddings 4096 x 32"
    source: str


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """config.json's language model, parsed once: geometry, routing, caches, dtype, quantization, context."""

    #: the language model's model_type (gemma3_text for Gemma-3), or None where the config names none
    model_type: str | None
    #: the top-level model_type (gemma3 for Gemma-3); equal to model_type for text-only configs
    outer_model_type: str | None
    #: the first class name of config.json's architectures (checked at load), None where it lists none
    architecture: str | None
    #: True where the language model sits under text_config/language_config (a vision tower beside it)
    multimodal: bool
    #: the language model's keys, defaults applied (read-only)
    text: MappingProxyType
    hidden_size: int | None
    num_layers: int | None
    num_heads: int | None
    num_kv_heads: int | None
    head_dim: int | None
    vocab_size: int | None
    #: routed experts and experts per token, 0 for a dense model (or where the config is silent)
    num_experts: int
    top_k: int
    #: the config's dtype name (torch_dtype/dtype), None where it names none
    dtype: str | None
    #: the sliding window in tokens, None where the config sets none
    sliding_window_tokens: int | None
    quantization: Quantization | None
    context: ContextLimit | None


class ConfigSizes:
    """The language model's whole-number keys, read against CONFIG_LIMITS by the KV cache model and the activation
    estimate alike: null is "not given", and each refusal is one line that begins with ``what`` (such as "KV cache
    of llama") and names the key, its value and the range."""

    def __init__(self, values: Mapping, what: str, missing_fix: str = ""):
        self.values = values
        self.what = what
        #: said after "config.json has no KEY" (e.g. "; add it to plan its KV cache")
        self.missing_fix = missing_fix

    def missing(self, key: str) -> ModelInputError:
        """The error for a key the reader needs and the config does not give."""
        return ModelInputError(f"{self.what}: config.json has no {key}{self.missing_fix}")

    def has(self, key: str) -> bool:
        return self.values.get(key) is not None

    def size(self, key: str, *, default: int | None = None, maximum: int | None = None) -> int:
        """A whole number in CONFIG_LIMITS[key] (bools and floats refused), ``default`` where the config is silent
        (else an error); ``maximum`` for a bound that depends on another key (a period of at most the layers)."""
        value = self.values.get(key)
        if value is None:
            if default is None:
                raise self.missing(key)
            return default
        low, high = CONFIG_LIMITS[key] if maximum is None else (1, maximum)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ModelInputError(f"{self.what}: config.json's {key} is {shown(value)}; expected an integer from "
                                  f"{low} to {high}")
        return value

    def count(self, key: str) -> int:
        """An optional size or count: absent, null or 0 is 0; else as ``size``."""
        value = self.values.get(key)
        return 0 if value is None or (value == 0 and not isinstance(value, bool)) else self.size(key)


def text_config(config: dict | None) -> dict:
    """The language model's part of config.json with its class's defaults applied (``TEXT_DEFAULTS``)."""
    if not config:
        return {}
    for key in TEXT_SECTIONS:
        section = config.get(key)
        if isinstance(section, dict):
            model_type = section.get("model_type") or TEXT_MODEL_TYPES.get(_name(config.get("model_type")))
            defaults = TEXT_DEFAULTS.get(_name(model_type), {})
            # top-level dtype: multimodal configs carry torch_dtype outside text_config
            outer = {k: config[k] for k in ("torch_dtype", "dtype") if config.get(k) is not None}
            resolved = {**defaults, **outer, **section}
            if model_type is not None:
                resolved["model_type"] = model_type
            return _with_standard_keys(resolved)
    defaults = TEXT_DEFAULTS.get(_name(config.get("model_type")), {})
    return _with_standard_keys({**defaults, **config} if defaults else config)


def _with_standard_keys(text: dict) -> dict:
    """``text`` with each KEY_ALIASES key that it leaves null taken from its first alias that holds a value, and
    one K/V head where the config says multi_query (GPT-BigCode; Falcon unless new_decoder_architecture, where
    num_kv_heads counts them); the same dict where there is none to add."""
    added = {key: next(text[alias] for alias in aliases if text.get(alias) is not None)
             for key, aliases in KEY_ALIASES.items()
             if text.get(key) is None and any(text.get(alias) is not None for alias in aliases)}
    if text.get("multi_query") is True and text.get("new_decoder_architecture") is not True:
        added["num_key_value_heads"] = 1  # what the attention builds, whatever num_key_value_heads says
    return {**text, **added} if added else text


def _name(value: object) -> str | None:
    """A model_type as a lookup key: a list or number (refused where it is read) finds nothing."""
    return value if isinstance(value, str) else None


def model_config(config: dict | None) -> ModelConfig | None:
    """The record of a checkpoint's config.json (None: the checkpoint has none)."""
    if not config:
        return None
    text = text_config(config)
    hidden = _first_int(text, ("hidden_size",))
    num_heads = _first_int(text, ("num_attention_heads",))
    num_experts, top_k = config_routing(text)
    window = text.get("sliding_window")
    return ModelConfig(
        model_type=text.get("model_type") if isinstance(text.get("model_type"), str) else None,
        outer_model_type=config.get("model_type") if isinstance(config.get("model_type"), str) else None,
        architecture=_architecture(config),
        multimodal=any(isinstance(config.get(key), dict) for key in TEXT_SECTIONS),
        text=MappingProxyType(dict(text)),
        hidden_size=hidden,
        num_layers=_first_int(text, ("num_hidden_layers",)),
        num_heads=num_heads,
        num_kv_heads=_first_int(text, ("num_key_value_heads",)) or num_heads,
        head_dim=_first_int(text, ("head_dim",)) or (hidden // num_heads if hidden and num_heads else None),
        vocab_size=_first_int(text, ("vocab_size",)),
        num_experts=num_experts,
        top_k=top_k,
        dtype=_dtype_name(text),
        sliding_window_tokens=window if isinstance(window, int) and not isinstance(window, bool)
        and text.get("use_sliding_window") is not False else None,
        quantization=_quantization(config),
        context=context_limit(text),
    )


def config_routing(text: dict) -> tuple[int, int]:
    """(num_experts, top_k) as a language model's config says them, 0 where it is silent: the first key of each
    list that holds an integer (planner.source.checkpoint bounds them at load)."""
    num_experts = next((text[k] for k in EXPERT_COUNT_KEYS if isinstance(text.get(k), int)), 0)
    top_k = next((text[k] for k in TOP_K_KEYS if isinstance(text.get(k), int)), 0)
    return num_experts, top_k


def _first_int(section: dict, keys: tuple[str, ...]) -> int | None:
    """The first of ``keys`` that holds a whole number (bounds are checked in planner.source.checkpoint)."""
    return next((section[k] for k in keys if isinstance(section.get(k), int) and not isinstance(section[k], bool)),
                None)


def _architecture(config: dict) -> str | None:
    names = config.get("architectures")
    return names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None


def _dtype_name(text: dict) -> str | None:
    name = text.get("torch_dtype") or text.get("dtype")
    return name if isinstance(name, str) else None


def _quantization(config: dict) -> Quantization | None:
    """quantization_config (top level, or the language model's for multimodal configs), or None."""
    section = config.get("quantization_config")
    if section is None:
        section = text_config(config).get("quantization_config")
    if section is None:
        return None
    method = section.get("quant_method") if isinstance(section, dict) else None
    if not isinstance(method, str) or not method.isprintable():
        raise ModelInputError(f"config.json's quantization_config is {shown(section)}; it must be an object with a "
                              "quant_method such as \"fp8\": fix config.json")
    block = section.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 2**16
                                          for b in block)):
        raise ModelInputError(f"config.json's quantization_config.weight_block_size is {shown(block)}; expected two "
                              "whole numbers such as [128, 128]: fix config.json")
    skipped = section.get("modules_to_not_convert") or section.get("ignore") or section.get("ignored_layers") or []
    if not (isinstance(skipped, list) and all(isinstance(name, str) for name in skipped)):
        raise ModelInputError(f"config.json's quantization_config lists {shown(skipped)} as modules not to convert; "
                              "expected a list of module names: fix config.json")
    return Quantization(method=method, weight_block=tuple(block) if block else None, not_converted=tuple(skipped))


def context_limit(text: dict) -> ContextLimit | None:
    """The max model length as vLLM derives it from the positions and rope scaling; None where none is given."""
    found = [(text[key], key) for key in POSITION_KEYS
             if isinstance(text.get(key), int) and not isinstance(text[key], bool) and text[key] > 0]
    if not found:
        return None
    tokens, key = min(found)
    source = f"{key} {tokens}"
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    if not isinstance(rope, dict):
        return ContextLimit(max_tokens=tokens, source=source)
    rope_type = rope.get("rope_type") or rope.get("type")
    factor = rope.get("factor")
    scaled = (rope_type not in _UNSCALED_ROPE_TYPES and isinstance(factor, (int, float))
              and not isinstance(factor, bool) and factor >= 1 and "gemma3" not in str(text.get("model_type")))
    if not scaled:
        return ContextLimit(max_tokens=tokens, source=source)
    original = rope.get("original_max_position_embeddings")
    if rope_type == "yarn" and isinstance(original, int) and not isinstance(original, bool) and original > 0:
        tokens, source = original, f"original_max_position_embeddings {original}"
    return ContextLimit(max_tokens=int(tokens * factor), source=f"{source} x rope_scaling {rope_type} factor "
                                                                f"{factor:g}")


def check_against_tensors(record: ModelConfig | None, *, source: str, embedding_width: int | None,
                          num_stack_layers: int | None, num_experts_present: int | None) -> None:
    """config.json against the checkpoint's tensors: a mismatch is one line naming both figures."""
    if record is None:
        return
    if record.hidden_size and embedding_width and record.hidden_size != embedding_width:
        raise ModelInputError(f"{source}: config.json's hidden_size is {record.hidden_size} but the embedding is "
                              f"{embedding_width} wide; the config is not this checkpoint's: use the model's own")
    if record.num_layers and num_stack_layers is not None and record.num_layers > num_stack_layers:
        raise ModelInputError(f"{source}: config.json says {record.num_layers} layers but the checkpoint's stack has "
                              f"{num_stack_layers}; the config is not this checkpoint's: use the model's own")
    if record.num_experts and num_experts_present and record.num_experts != num_experts_present:
        raise ModelInputError(f"{source}: config.json says {record.num_experts} experts but the checkpoint's layers "
                              f"hold {num_experts_present}; the config is not this checkpoint's: use the model's own")
