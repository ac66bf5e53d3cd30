"""The tensors a model's release checkpoint ships (names, dtypes, shapes), from its config.json alone.

transformers 5 holds some tensors in memory unlike the files on the hub (MoE experts fused into 3-D params, the
multimodal prefixes renamed on load), so ``header-checkpoint`` writes the release's own layout where this module
knows the family, and a plan made from it describes the checkpoint a user downloads:

- dense llama-style (Llama, Mistral, Qwen2/3): ``model.layers.N.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``;
- Qwen3-MoE: one tensor per expert, ``mlp.experts.E.{gate,up,down}_proj.weight``, and the router ``mlp.gate``;
- Mixtral: one tensor per expert, ``block_sparse_moe.experts.E.w1/w2/w3.weight``;
- DeepSeek-V3 and Kimi-K2: MLA attention, per-expert ``mlp.experts.E.*``, DeepSeek-V3's multi-token-prediction
  layer at index ``num_hidden_layers`` (written as the release has it; the planner reports it unused);
- gpt-oss: MXFP4 experts as U8 ``*_blocks`` (two FP4 values a byte, 32 to a block) and U8 ``*_scales`` (one
  E8M0 exponent a block), bf16 elsewhere;
- Gemma-3 (multimodal): ``language_model.model.*``, the SigLIP ``vision_tower.vision_model.*`` and the
  ``multi_modal_projector``; text-only Gemma-3 configs as ``model.*``.

Quantization follows ``quantization_config``: ``fp8`` with ``weight_block_size`` gives each linear weight as
F8_E4M3 with an F32 ``weight_scale_inv`` per block (DeepSeek-V3 / Qwen3-FP8), except the modules it leaves
unconverted (``modules_to_not_convert``) and those transformers never converts (embeddings, norms, routers,
``lm_head``); ``mxfp4`` gives gpt-oss's expert blocks and scales; compressed-tensors FP8 gives an F8_E4M3
``weight`` and an F32 ``weight_scale`` (per channel, per tensor or per block, as its scheme says). Any other
method is one line, never a silent bf16.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass

from planner.errors import ModelInputError, shown
from planner.model.model_config import SAFETENSORS_DTYPES, Quantization, model_config, text_config

BF16, F16, F32, FP8, U8 = "BF16", "F16", "F32", "F8_E4M3", "U8"
MXFP4_BLOCK = 32

#: (name, safetensors dtype, shape)
TensorSpec = tuple[str, str, list[int]]


@dataclass(frozen=True, kw_only=True)
class _Format:
    """How one checkpoint's tensors are written: the float dtype, and which linear weights are quantized."""

    dtype: str
    quantization: Quantization | None
    #: compressed-tensors FP8 weight scale: "channel", "tensor" or "block"
    compressed_strategy: str | None = None

    def linear(self, name: str, out_features: int, in_features: int, *, bias: bool = False) -> list[TensorSpec]:
        """A linear layer's weight (quantized where the config quantizes this module) and its bias."""
        specs = self._weight(name, out_features, in_features)
        return specs + ([(f"{name}.bias", self.dtype, [out_features])] if bias else [])

    def plain(self, name: str, out_features: int, in_features: int, *, bias: bool = False) -> list[TensorSpec]:
        """A linear layer kept in the float dtype whatever the config quantizes (routers, MTP projections)."""
        specs = [(f"{name}.weight", self.dtype, [out_features, in_features])]
        return specs + ([(f"{name}.bias", self.dtype, [out_features])] if bias else [])

    def vector(self, name: str, size: int) -> TensorSpec:
        return (name, self.dtype, [size])

    def _weight(self, name: str, out_features: int, in_features: int) -> list[TensorSpec]:
        quant = self.quantization
        if quant is None or quant.method == "mxfp4" or _not_converted(name, quant):
            return [(f"{name}.weight", self.dtype, [out_features, in_features])]
        weight = (f"{name}.weight", FP8, [out_features, in_features])
        if quant.method == "fp8":
            rows, cols = quant.weight_block or (out_features, in_features)
            return [weight, (f"{name}.weight_scale_inv", F32, [math.ceil(out_features / rows),
                                                                math.ceil(in_features / cols)])]
        scale = {"channel": [out_features, 1], "tensor": [1]}.get(self.compressed_strategy)
        if scale is None:  # block: one scale per weight_block_size block
            rows, cols = quant.weight_block or (128, 128)
            scale = [math.ceil(out_features / rows), math.ceil(in_features / cols)]
        return [weight, (f"{name}.weight_scale", F32, scale)]


def _not_converted(name: str, quant: Quantization) -> bool:
    """Whether ``name`` (a module's full name) is one quantization_config leaves unquantized: a glob pattern
    (gpt-oss's ``model.layers.*.self_attn``) matching it or a module above it, or a plain name inside it."""
    module = name.removesuffix(".weight")
    for pattern in quant.not_converted:
        pattern = pattern.removeprefix("re:")
        if "*" in pattern and (fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*")):
            return True
        if "*" not in pattern and (module == pattern or f".{pattern}." in f".{module}."
                                   or module.startswith(pattern + ".")):
            return True
    return False


# ---- families -----------------------------------------------------------------------------------------------


def _attention_geometry(text: dict) -> tuple[int, int, int, int]:
    """(hidden, heads, kv_heads, head_dim) with the defaults llama-style configs leave implicit."""
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    return hidden, heads, text.get("num_key_value_heads") or heads, text.get("head_dim") or hidden // heads


def _attention(fmt: _Format, p: str, text: dict, *, qk_norm: bool = False) -> list[TensorSpec]:
    """Grouped-query attention: q/k/v/o projections (biases when attention_bias), Qwen3/Gemma-3's q/k norms."""
    hidden, heads, kv_heads, head_dim = _attention_geometry(text)
    bias = bool(text.get("attention_bias"))
    q, kv = heads * head_dim, kv_heads * head_dim
    specs = (fmt.linear(f"{p}self_attn.q_proj", q, hidden, bias=bias)
             + fmt.linear(f"{p}self_attn.k_proj", kv, hidden, bias=bias)
             + fmt.linear(f"{p}self_attn.v_proj", kv, hidden, bias=bias)
             + fmt.linear(f"{p}self_attn.o_proj", hidden, q, bias=bias))
    if qk_norm:
        specs += [fmt.vector(f"{p}self_attn.q_norm.weight", head_dim), fmt.vector(f"{p}self_attn.k_norm.weight",
                                                                                     head_dim)]
    return specs


def _gated_mlp(fmt: _Format, p: str, intermediate: int, hidden: int,
               names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> list[TensorSpec]:
    gate, up, down = names
    return (fmt.linear(f"{p}{gate}", intermediate, hidden) + fmt.linear(f"{p}{up}", intermediate, hidden)
            + fmt.linear(f"{p}{down}", hidden, intermediate))


def _norms(fmt: _Format, p: str, hidden: int, names=("input_layernorm", "post_attention_layernorm")) -> list:
    return [fmt.vector(f"{p}{name}.weight", hidden) for name in names]


def _dense_layer(fmt: _Format, p: str, text: dict, index: int) -> list[TensorSpec]:
    """Llama, Mistral, Qwen2 and Qwen3 decoder layers."""
    hidden = text["hidden_size"]
    return (_norms(fmt, p, hidden) + _attention(fmt, p, text, qk_norm=text["model_type"] in ("qwen3", "qwen3_moe"))
            + _gated_mlp(fmt, f"{p}mlp.", text["intermediate_size"], hidden))


def _qwen3_moe_layer(fmt: _Format, p: str, text: dict, index: int) -> list[TensorSpec]:
    """Qwen3-MoE: a router and one gate/up/down per expert; mlp_only_layers and decoder_sparse_step as the
    model class reads them (a dense MLP there)."""
    hidden, experts = text["hidden_size"], text["num_experts"]
    sparse_step = text.get("decoder_sparse_step") or 1
    if index in (text.get("mlp_only_layers") or []) or experts <= 0 or (index + 1) % sparse_step:
        return _dense_layer(fmt, p, text, index)
    specs = _norms(fmt, p, hidden) + _attention(fmt, p, text, qk_norm=True)
    specs += fmt.plain(f"{p}mlp.gate", experts, hidden)
    for e in range(experts):
        specs += _gated_mlp(fmt, f"{p}mlp.experts.{e}.", text["moe_intermediate_size"], hidden)
    return specs


def _mixtral_layer(fmt: _Format, p: str, text: dict, index: int) -> list[TensorSpec]:
    """Mixtral: a router and per-expert w1 (gate), w3 (up), w2 (down)."""
    hidden, experts = text["hidden_size"], text["num_local_experts"]
    specs = _norms(fmt, p, hidden) + _attention(fmt, p, text) + fmt.plain(f"{p}block_sparse_moe.gate", experts, hidden)
    for e in range(experts):
        specs += _gated_mlp(fmt, f"{p}block_sparse_moe.experts.{e}.", text["intermediate_size"], hidden,
                            names=("w1", "w3", "w2"))
    return specs


def _mla_attention(fmt: _Format, p: str, text: dict) -> list[TensorSpec]:
    """DeepSeek multi-head latent attention: projections (FP8 where quantized) and float latent norms."""
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    rope, nope, v_dim = text["qk_rope_head_dim"], text["qk_nope_head_dim"], text["v_head_dim"]
    q_rank, kv_rank = text["q_lora_rank"], text["kv_lora_rank"]
    a = f"{p}self_attn."
    return (fmt.linear(f"{a}q_a_proj", q_rank, hidden) + [fmt.vector(f"{a}q_a_layernorm.weight", q_rank)]
            + fmt.linear(f"{a}q_b_proj", heads * (nope + rope), q_rank)
            + fmt.linear(f"{a}kv_a_proj_with_mqa", kv_rank + rope, hidden)
            + [fmt.vector(f"{a}kv_a_layernorm.weight", kv_rank)]
            + fmt.linear(f"{a}kv_b_proj", heads * (nope + v_dim), kv_rank)
            + fmt.linear(f"{a}o_proj", hidden, heads * v_dim))


def _deepseek_moe(fmt: _Format, p: str, text: dict) -> list[TensorSpec]:
    hidden, experts, width = text["hidden_size"], text["n_routed_experts"], text["moe_intermediate_size"]
    specs = [(f"{p}mlp.gate.weight", fmt.dtype, [experts, hidden])]
    if text.get("topk_method") == "noaux_tc":
        specs.append((f"{p}mlp.gate.e_score_correction_bias", F32, [experts]))
    for e in range(experts):
        specs += _gated_mlp(fmt, f"{p}mlp.experts.{e}.", width, hidden)
    return specs + _gated_mlp(fmt, f"{p}mlp.shared_experts.", width * text["n_shared_experts"], hidden)


def _nextn_extras(fmt: _Format, p: str, text: dict) -> list[TensorSpec]:
    """What a multi-token-prediction layer adds to a MoE layer: its own embedding, norms, projection and head."""
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    return [(f"{p}embed_tokens.weight", fmt.dtype, [vocab, hidden]), fmt.vector(f"{p}enorm.weight", hidden),
            fmt.vector(f"{p}hnorm.weight", hidden), *fmt.plain(f"{p}eh_proj", hidden, 2 * hidden),
            fmt.vector(f"{p}shared_head.norm.weight", hidden), (f"{p}shared_head.head.weight", fmt.dtype,
                                                                 [vocab, hidden])]


def _deepseek_layer(fmt: _Format, p: str, text: dict, index: int) -> list[TensorSpec]:
    """DeepSeek-V3 / Kimi-K2: dense MLP below first_k_dense_replace, MoE above; MTP layers past the stack."""
    hidden = text["hidden_size"]
    specs = _norms(fmt, p, hidden) + _mla_attention(fmt, p, text)
    if index < text["first_k_dense_replace"]:
        return specs + _gated_mlp(fmt, f"{p}mlp.", text["intermediate_size"], hidden)
    specs += _deepseek_moe(fmt, p, text)
    return specs + (_nextn_extras(fmt, p, text) if index >= text["num_hidden_layers"] else [])


def _gpt_oss_layer(fmt: _Format, p: str, text: dict, index: int) -> list[TensorSpec]:
    """gpt-oss: biased attention with sinks, a biased router, experts as MXFP4 U8 blocks and scales (bf16 where
    the config is not MXFP4)."""
    hidden, heads, _, _ = _attention_geometry(text)
    experts, width = text["num_local_experts"], text["intermediate_size"]
    specs = _norms(fmt, p, hidden) + _attention(fmt, p, text) + [(f"{p}self_attn.sinks", fmt.dtype, [heads])]
    specs += fmt.plain(f"{p}mlp.router", experts, hidden, bias=True)
    mxfp4 = fmt.quantization is not None and fmt.quantization.method == "mxfp4"
    for name, out_features, in_features in (("gate_up_proj", 2 * width, hidden), ("down_proj", hidden, width)):
        e = f"{p}mlp.experts.{name}"
        if mxfp4:
            blocks = in_features // MXFP4_BLOCK
            specs += [(f"{e}_blocks", U8, [experts, out_features, blocks, MXFP4_BLOCK // 2]),
                      (f"{e}_scales", U8, [experts, out_features, blocks])]
        else:  # transformers' bf16 layout: [experts, in, out]
            specs.append((e, fmt.dtype, [experts, in_features, out_features]))
        specs.append((f"{e}_bias", fmt.dtype, [experts, out_features]))
    return specs


def _gemma3_layer(fmt: _Format, p: str, text: dict, index: int) -> list[TensorSpec]:
    """Gemma-3: four norms around attention and MLP, q/k norms."""
    hidden = text["hidden_size"]
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    return (_norms(fmt, p, hidden, norms) + _attention(fmt, p, text, qk_norm=True)
            + _gated_mlp(fmt, f"{p}mlp.", text["intermediate_size"], hidden))


def _siglip_tower(fmt: _Format, vision: dict, text_hidden: int) -> list[TensorSpec]:
    """Gemma-3's SigLIP vision tower and its projector into the language model's width (resident weights)."""
    hidden, inner = vision["hidden_size"], vision["intermediate_size"]
    patch, channels = vision["patch_size"], vision.get("num_channels", 3)
    positions = (vision["image_size"] // patch) ** 2
    v = "vision_tower.vision_model."
    specs = [(f"{v}embeddings.patch_embedding.weight", fmt.dtype, [hidden, channels, patch, patch]),
             fmt.vector(f"{v}embeddings.patch_embedding.bias", hidden),
             (f"{v}embeddings.position_embedding.weight", fmt.dtype, [positions, hidden]),
             fmt.vector(f"{v}post_layernorm.weight", hidden), fmt.vector(f"{v}post_layernorm.bias", hidden)]
    for index in range(vision["num_hidden_layers"]):
        p = f"{v}encoder.layers.{index}."
        specs += [fmt.vector(f"{p}{norm}.{part}", hidden) for norm in ("layer_norm1", "layer_norm2")
                  for part in ("weight", "bias")]
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            specs += fmt.plain(f"{p}self_attn.{proj}", hidden, hidden, bias=True)
        specs += fmt.plain(f"{p}mlp.fc1", inner, hidden, bias=True) + fmt.plain(f"{p}mlp.fc2", hidden, inner, bias=True)
    return specs + [("multi_modal_projector.mm_input_projection_weight", fmt.dtype, [hidden, text_hidden]),
                    fmt.vector("multi_modal_projector.mm_soft_emb_norm.weight", hidden)]


#: language model_type -> layer writer
LAYERS: dict[str, Callable[[_Format, str, dict, int], list[TensorSpec]]] = {
    "llama": _dense_layer, "mistral": _dense_layer, "qwen2": _dense_layer, "qwen3": _dense_layer,
    "qwen3_moe": _qwen3_moe_layer, "mixtral": _mixtral_layer, "deepseek_v3": _deepseek_layer,
    "kimi_k2": _deepseek_layer, "gpt_oss": _gpt_oss_layer, "gemma3_text": _gemma3_layer,
}
#: multimodal model_type -> the language model's prefix in the release, and the tower writer
MULTIMODAL = {"gemma3": ("language_model.model.", _siglip_tower)}


def knows(config: dict) -> bool:
    """Whether this module writes the release layout of ``config``'s family."""
    record = model_config(config)
    if record is None or record.model_type not in LAYERS:
        return False
    return not record.multimodal or record.outer_model_type in MULTIMODAL


def release_specs(config: dict, *, dtype: str | None = None) -> list[TensorSpec]:
    """(name, dtype, shape) of every tensor of the release checkpoint, sorted by name.

    ``dtype``: a config.json dtype name for the unquantized tensors (default: the config's, else bfloat16).
    """
    record = model_config(config)
    if record is None or not knows(config):
        raise ModelInputError(f"the release layout of model_type {shown(record.model_type if record else None)} is "
                              f"not known; known: {', '.join(sorted(LAYERS))}")
    fmt = _format(config, record, dtype)
    text = text_config(config)
    prefix, tower = MULTIMODAL.get(record.outer_model_type, ("model.", None)) if record.multimodal else ("model.",
                                                                                                           None)
    try:
        specs = _language_model(fmt, text, prefix, LAYERS[record.model_type])
        if tower is not None:
            specs += tower(fmt, config["vision_config"], text["hidden_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise ModelInputError(f"config.json lacks or mistypes what the {record.model_type} layout needs "
                              f"({type(error).__name__}: {shown(str(error))}); give the model's public config.json") \
            from None
    return sorted(specs)


def _format(config: dict, record, dtype: str | None) -> _Format:
    """The float dtype and quantization of the release; an unknown quantization method is one line."""
    name = dtype or record.dtype or "bfloat16"
    if name not in SAFETENSORS_DTYPES:
        raise ModelInputError(f"dtype {shown(name)} is not one header-checkpoint writes; choose one of "
                              f"{', '.join(SAFETENSORS_DTYPES)}")
    quant = record.quantization
    if quant is not None and not quant.known:
        raise ModelInputError(f"quantization_config's quant_method {shown(quant.method)} is not a layout "
                              "header-checkpoint knows (fp8, mxfp4, compressed-tensors); it writes no silent bf16 "
                              "in its place: plan from the release's own headers (--model ORG/NAME)")
    if quant is not None and quant.method == "fp8" and quant.weight_block is None:
        raise ModelInputError("quantization_config is fp8 without weight_block_size: per-tensor FP8 scales are "
                              "not a layout header-checkpoint writes; plan from the release's own headers")
    strategy = _compressed_strategy(config) if quant is not None and quant.method == "compressed-tensors" else None
    return _Format(dtype=SAFETENSORS_DTYPES[name], quantization=quant, compressed_strategy=strategy)


def _compressed_strategy(config: dict) -> str:
    """compressed-tensors: the FP8 weights' scale strategy of its one config group; other schemes are one line."""
    section = config.get("quantization_config") or text_config(config).get("quantization_config")
    groups = section.get("config_groups") if isinstance(section, dict) else None
    weights = [group.get("weights") for group in groups.values()] if isinstance(groups, dict) else []
    if len(weights) != 1 or not isinstance(weights[0], dict) or weights[0].get("num_bits") != 8 \
            or weights[0].get("type") != "float" or weights[0].get("strategy") not in ("channel", "tensor", "block"):
        raise ModelInputError("quantization_config is compressed-tensors but not one FP8 weight group with a "
                              "channel, tensor or block strategy; header-checkpoint writes only that layout: plan "
                              "from the release's own headers")
    return weights[0]["strategy"]


def _language_model(fmt: _Format, text: dict, prefix: str, layer) -> list[TensorSpec]:
    """Embedding, final norm, LM head (untied) and the layers, MTP layers past the stack included."""
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    specs = [(f"{prefix}embed_tokens.weight", fmt.dtype, [vocab, hidden]), fmt.vector(f"{prefix}norm.weight", hidden)]
    if not text.get("tie_word_embeddings"):
        head = prefix.removesuffix("model.") + "lm_head.weight"
        specs.append((head, fmt.dtype, [vocab, hidden]))
    num_layers = text["num_hidden_layers"] + (text.get("num_nextn_predict_layers") or 0)
    for index in range(num_layers):
        specs += layer(fmt, f"{prefix}layers.{index}.", text, index)
    return specs
