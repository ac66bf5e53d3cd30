"""Peak activation bytes of one forward step, estimated from shapes.

The estimate follows what a transformers model allocates when run eagerly under ``torch.inference_mode`` (the
project's runtime): tensors die as soon as Python drops them, so the peak is the largest set alive at one
moment. Through every layer some tensors stay alive (the embedding output, which the model's forward holds to
the end; the layer's input, which is also its residual; the rotary tables, position ids and the masks); inside
a layer the peak falls in one of these phases, and the estimate is the largest of them plus those tensors:

- ``norm``: RMSNorm upcasts its input to float32 (two float32 copies alive while it scales).
- ``qkv``: the q/k/v projections, the q/k norms' float32 copies and rotary's temporaries
  (``q * cos``, ``rotate_half(q)`` and its product with ``sin``).
- ``attention``: rotated q, k, v, the SDPA output and its transposed copy, the boolean mask turned into an
  additive one, and where transformers repeats K/V to every query head (``repeat_kv`` before SDPA when a mask
  is present), both repeated over every attended token. A growing cache (DynamicCache) copies the layer's K,
  then V, to append the step's (``torch.cat``).
- ``mlp``: next to the post-attention residual, the gated MLP ``down(act(gate(x)) * up(x))``: act, up and
  their product alive together.
- ``moe``: router logits and float32 probabilities, the routing indices, the output accumulator, and the
  experts' work as the model's experts implementation does it: transformers 5's default ``grouped_mm`` sorts
  the (token, expert) pairs and runs them all at once (what the runtime runs, decode and prefill alike:
  PLANNED_EXPERTS_IMPLEMENTATION); ``eager`` loops over experts (bounded by every token picking one);
  ``batched_mm`` gathers every pair's expert weights (the runtime's fallback for captured decode where
  grouped_mm has no native kernel: runtime.experts_impl).
- ``logits``: after the base model has returned (its step-wide tensors freed), the LM head on the last
  token of each sequence (``logits_to_keep=1``), in the activation dtype: transformers computes no float32
  copy unless it computes a loss. Engines upcast the sampled logits to float32; pass
  ``logits_bytes_per_element=4`` to plan for that.

FlashAttention and memory-efficient SDPA keep no score matrix; their workspace is the log-sum-exp, float32,
per head and query rounded up to 32. Kernel workspaces that persist (cuBLAS's per stream) belong to the
allocator reserve, not here. Models whose attention has no SDPA path (gpt-oss: its sinks join the softmax)
run transformers' eager attention, which materialises the scores. Which layers slide, and their shorter
windows, are ignored inside a layer: the full length bounds them (the hybrid families have full layers, whose
step is the peak). But the families that mix sliding and full layers and mask them apart (Gemma 2/3, gpt-oss,
Qwen2/3 with max_window_layers: planner.model.architectures' mask_per_layer_type) build a mask per layer type before the
first
layer and hold both to the end (the sliding one spans the window's cached tokens and the step's), and Gemma-3
builds a rotary table per layer type (its local and global layers rotate with different bases): those are
step-wide too, as is the sliding mask Qwen2-MoE builds over every key with its window off (window 0, unread).
A model whose layers all attend one way (Llama, Mistral with a window) builds one mask and one table.
Linear-attention and state-space layers are not modelled.
"""

from dataclasses import dataclass

from planner.model.architectures import Architecture, architecture, listed
from planner.model.model_config import DTYPE_BYTES, ConfigSizes, ModelConfig, model_config
from planner.errors import ModelInputError, printable, shown
from planner.model.experts import DEFAULT_TOP_K
from planner.model.kv_cache import attention_layer_types
from planner.units import format_bytes

EXPERT_IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")
#: what the runtime runs a MoE model's experts through, per phase, and so what plans set memory aside for:
#: grouped_mm is capturable (no host synchronisation) and holds only the pairs' activations, where batched_mm
#: gathers every pair's weights (a 2048-token chunk of Qwen3-30B-A3B: 144 GiB)
PLANNED_EXPERTS_IMPLEMENTATION = {"decode": "grouped_mm", "prefill": "grouped_mm"}
#: where grouped_mm has no native kernel (on CUDA torch's grouped GEMM takes bf16 only): decode stays
#: capturable through batched_mm, prefill stays small through eager
EXPERTS_FALLBACK = {"decode": "batched_mm", "prefill": "eager"}


#: safetensors dtype names -> torch's (the names planned_experts_implementation takes)
_TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def decode_copies_pairs(weights_dtype: str) -> bool:
    """Whether a routed decode step of experts in ``weights_dtype`` (a safetensors name, e.g. BF16) copies every
    routed pair's weights into a workspace: batched_mm does, the decode fallback where torch's grouped GEMM has no
    kernel for the dtype (anything but bf16); grouped_mm reads the experts where they lie. The routed decode
    computes with the model's own experts function (runtime.experts_impl.decode_experts_forward)."""
    torch_name = _TORCH_DTYPES.get(weights_dtype, weights_dtype)
    return planned_experts_implementation("decode", torch_name) != "grouped_mm"


def planned_experts_implementation(phase: str, dtype: str) -> str:
    """The experts implementation a ``phase`` ("decode" or "prefill") step of weights of ``dtype`` runs."""
    if dtype == "bfloat16":
        return PLANNED_EXPERTS_IMPLEMENTATION[phase]
    return EXPERTS_FALLBACK[phase]
FP32 = 4
INDEX = 8  # int64 indices
#: small scratch allocations of the step's kernels beyond the terms above: on the H100 (torch 2.11) the peak of a
#: one-sequence decode step was 117 KiB above them, 0.7% of it; a flat MiB covers that at every size
KERNEL_SCRATCH_BYTES = 2**20
#: SDPA kernels keep a float32 log-sum-exp per head and query, queries rounded up to this block
_LSE_BLOCK = 32
#: score-sized tensors alive at once in gpt-oss's eager_attention_forward (modeling_gpt_oss.py, 5.17 and 5.24):
#: the masked logits, the logits with the sink column, and their shifted copy or its softmax
_EAGER_SCORE_COPIES = 3


@dataclass(frozen=True, kw_only=True)
class ActivationShape:
    """What config.json says about the tensors of one step."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    #: dims per query/key head (MLA: nope + rope) and per value head
    qk_head_dim: int
    v_head_dim: int
    vocab_size: int
    #: routed experts and how many each token picks (0 for a dense model)
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    #: shared experts' total intermediate size (0 without)
    shared_intermediate_size: int = 0
    #: multi-head latent attention decompresses every cached latent into per-head K and V each step
    latent_attention: bool = False
    #: MLA: the rope part of qk_head_dim (the keys assembled per head are nope + rope wide)
    qk_rope_head_dim: int = 0
    #: attention runs transformers' eager path (no SDPA kernel: gpt-oss's sinks), whose scores are materialised
    eager_attention: bool = False
    #: the weights' dtype name ("bfloat16", ...): which experts implementation runs depends on it
    dtype: str = "bfloat16"
    #: bytes per activation element
    activation_bytes: int = 2
    #: the window of the sliding layers of a model that mixes them with full-attention layers: its forward
    #: builds a sliding-window mask beside the full one and holds both through the step (0: one mask, every
    #: layer attends the same way)
    sliding_mask_window_tokens: int = 0
    #: rotary cos/sin pairs the forward builds and holds: one per layer type where the types rotate differently
    #: (Gemma-3), else 1
    num_rotary_tables: int = 1
    #: the forward also builds a sliding mask of window 0 over every key, unread (Architecture.window_off_mask)
    window_off_mask: bool = False

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "qk_head_dim", "v_head_dim",
                     "vocab_size", "activation_bytes", "num_rotary_tables"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.sliding_mask_window_tokens < 0:
            raise ValueError("sliding_mask_window_tokens must be >= 0")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError("top_k must be from 1 to num_experts")


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """One forward step: ``num_sequences`` sequences of ``tokens_per_sequence`` new tokens each."""

    num_sequences: int
    tokens_per_sequence: int
    #: tokens already cached per sequence before the step
    context_tokens: int = 0
    #: a static cache's length per sequence (attention reads all of it, masked); None: a growing cache
    static_cache_tokens: int | None = None

    def __post_init__(self):
        if self.num_sequences < 1 or self.tokens_per_sequence < 1 or self.context_tokens < 0:
            raise ValueError("num_sequences and tokens_per_sequence must be >= 1, context_tokens >= 0")
        held = self.context_tokens + self.tokens_per_sequence
        if self.static_cache_tokens is not None and self.static_cache_tokens < held:
            raise ValueError("static_cache_tokens must hold the context and the step's tokens")

    @property
    def num_tokens(self) -> int:
        """Tokens in the step, all sequences together."""
        return self.num_sequences * self.tokens_per_sequence

    @property
    def attended_tokens(self) -> int:
        """Key/value length attention reads per sequence."""
        if self.static_cache_tokens is not None:
            return self.static_cache_tokens
        return self.context_tokens + self.tokens_per_sequence

    @property
    def masked(self) -> bool:
        """Whether transformers passes SDPA a mask. It skips the mask (relying on is_causal) where that is exact:
        a one-token step over a growing cache, and a first chunk (no context); a static cache's one-token step
        keeps it (``allow_is_causal_skip`` is off for compileable caches when decoding)."""
        if self.tokens_per_sequence == 1:
            return self.static_cache_tokens is not None
        return self.context_tokens > 0

    def window_tokens(self, window_tokens: int) -> int:
        """Key/value length a sliding layer of a ``window_tokens`` window attends per sequence, which its mask
        spans: a static cache's decode step reads its whole ring (runtime.static_cache.RingSlidingLayer holds
        min(window, cache)); otherwise the window's cached tokens, then the step's (transformers'
        DynamicSlidingWindowLayer keeps one token fewer: this bounds it)."""
        if self.tokens_per_sequence == 1 and self.static_cache_tokens is not None:
            return min(window_tokens, self.static_cache_tokens)
        return min(self.context_tokens, window_tokens) + self.tokens_per_sequence

    def window_masked(self, window_tokens: int) -> bool:
        """Whether transformers passes a sliding layer a mask: where it passes a full layer one, and wherever the
        keys reach the window, which ``is_causal`` cannot express (masking_utils._ignore_causal_mask_sdpa never
        skips a local size at or below the key length): a first chunk at least a window long."""
        return self.masked or self.window_tokens(window_tokens) >= window_tokens


@dataclass(frozen=True, kw_only=True)
class ActivationPeak:
    """The estimated peak and what it is made of."""

    #: peak bytes of the step's transient tensors (weights and the KV cache excluded)
    peak_bytes: int
    #: the phase the peak falls in: norm, qkv, attention, mlp, moe, logits
    phase: str
    #: the main terms of that phase, name -> bytes, largest first (step-wide tensors included)
    terms: tuple[tuple[str, int], ...]

    @property
    def planned_bytes(self) -> int:
        """What a plan sets aside: the peak and the kernels' scratch beyond the modelled tensors."""
        return self.peak_bytes + KERNEL_SCRATCH_BYTES

    def describe(self) -> str:
        """One line for ``show``."""
        parts = ", ".join(f"{name} {format_bytes(value)}" for name, value in self.terms[:4])
        return f"{format_bytes(self.peak_bytes)} at the {self.phase} phase ({parts})"


def activation_shape(config: dict | None) -> ActivationShape:
    """Tensor dims of one step from the model record of config.json (the language model's part of multimodal
    ones): its typed routing and dtype, its architecture's entry, and its sizes read with one-line errors."""
    record = model_config(config)
    name, entry = _modelled(record, config)
    sizes = ConfigSizes(record.text, f"activation estimate of {name}")
    dtype = record.dtype or "bfloat16"
    try:
        return ActivationShape(
            **_attention_dims(sizes), **_moe_dims(sizes, record), **_step_wide_traits(sizes, entry, config),
            intermediate_size=_intermediate_size(sizes, record), vocab_size=sizes.size("vocab_size"),
            eager_attention=entry.eager_attention,
            activation_bytes=DTYPE_BYTES.get(dtype, 2), dtype=dtype if dtype in DTYPE_BYTES else "bfloat16",
        )
    except ValueError as error:  # values each in range, but not together (top-k above the experts)
        raise ModelInputError(f"activation estimate of {name}: {error}; fix config.json") from None


def _intermediate_size(sizes: ConfigSizes, record: ModelConfig) -> int:
    """The MLP's width; where an architecture the table does not list names none (GPT-2, GPT-J, CodeGen and
    BLOOM leave n_inner null), 4 x hidden_size, what their MLPs then build."""
    default = None if listed(record.model_type) else 4 * sizes.size("hidden_size")
    return sizes.size("intermediate_size", default=default)


def _modelled(record: ModelConfig | None, config: dict | None) -> tuple[str, Architecture]:
    """The architecture's printable name and its entry, or one line: no config, a model_type that is not a
    string, or linear-attention/state-space layers (not modelled)."""
    text = record.text if record is not None else {}
    if not text:
        raise ModelInputError("activation estimate: the checkpoint has no config.json; it is estimated from it")
    model_type = text.get("model_type") or (config or {}).get("model_type")
    if model_type is not None and not isinstance(model_type, str):  # a list or number would reach set lookups
        raise ModelInputError(f"activation estimate: config.json's model_type is {shown(model_type)}; expected a "
                              "string such as llama")
    name = printable(model_type or "this architecture")
    entry = architecture(model_type)
    if not entry.activations_modelled:
        raise ModelInputError(f"activation estimate of {name}: linear-attention/state-space layers are not "
                              "modelled; measure them with make --measure")
    return name, entry


def _attention_dims(sizes: ConfigSizes) -> dict:
    """Width, heads and head dims; multi-head latent attention (kv_lora_rank given) has as many K/V heads as
    query heads, each of qk_nope + qk_rope dims, and values of v_head_dim."""
    hidden = sizes.size("hidden_size")
    num_heads = sizes.size("num_attention_heads")
    dims = {"hidden_size": hidden, "num_heads": num_heads, "latent_attention": sizes.has("kv_lora_rank")}
    if dims["latent_attention"]:
        rope = sizes.size("qk_rope_head_dim")
        return {**dims, "qk_head_dim": sizes.size("qk_nope_head_dim") + rope, "v_head_dim": sizes.size("v_head_dim"),
                "num_kv_heads": num_heads, "qk_rope_head_dim": rope}
    head_dim = sizes.size("head_dim", default=hidden // num_heads)
    return {**dims, "qk_head_dim": head_dim, "v_head_dim": head_dim,
            "num_kv_heads": sizes.size("num_key_value_heads", default=num_heads), "qk_rope_head_dim": 0}


def _moe_dims(sizes: ConfigSizes, record: ModelConfig) -> dict:
    """Routed experts (the record's count and top-k, DEFAULT_TOP_K where a MoE config is silent), their width,
    and the shared experts' width (given, else routed width x shared count; both keys checked)."""
    num_experts = record.num_experts
    moe_width = 0
    if num_experts:  # the routed width, else the dense one (read only where the routed one is not given)
        moe_width = sizes.size("moe_intermediate_size") if sizes.has("moe_intermediate_size") else \
            _intermediate_size(sizes, record)
    shared_width = sizes.count("shared_expert_intermediate_size")
    num_shared = sizes.count("n_shared_experts")
    return {"num_experts": num_experts, "top_k": record.top_k or (DEFAULT_TOP_K if num_experts else 0),
            "moe_intermediate_size": moe_width, "shared_intermediate_size": shared_width or moe_width * num_shared}


def _step_wide_traits(sizes: ConfigSizes, entry: Architecture, config: dict | None) -> dict:
    """The masks and rotary tables the forward holds from its start: a sliding mask beside the full one where
    the architecture masks sliding and full layers apart and has both, a rotary pair per layer type where it
    builds them so, and Qwen2-MoE's unread window-0 mask."""
    layer_types = set(attention_layer_types(config))
    # Qwen2MoeConfig's use_sliding_window defaults to False: only true switches the window on
    window_off_mask = entry.window_off_mask and sizes.values.get("use_sliding_window") is not True
    mixed = (entry.mask_per_layer_type and {"full_attention", "sliding_attention"} <= layer_types
             and not window_off_mask)
    return {"sliding_mask_window_tokens": sizes.size("sliding_window") if mixed else 0,
            "num_rotary_tables": len(layer_types) if entry.rotary_per_layer_type and layer_types else 1,
            "window_off_mask": window_off_mask}


def _step_wide(shape: ActivationShape, step: StepShape) -> dict[str, int]:
    """Tensors alive through every layer: the embedding output (the model's forward holds it to the end), the
    layer's input (also its residual), the rotary tables and the masks (a model mixing sliding and full layers
    holds one of each)."""
    a, tokens = shape.activation_bytes, step.num_tokens
    hidden = tokens * shape.hidden_size * a
    rotary = "rotary cos/sin" if shape.num_rotary_tables == 1 else "rotary cos/sin, a pair per layer type"
    terms = {"embedding output": hidden, "layer input (residual)": hidden,
             rotary: shape.num_rotary_tables * 2 * tokens * shape.qk_head_dim * a, "position ids": 2 * tokens * INDEX}
    if step.masked:
        terms["attention mask"] = tokens * step.attended_tokens  # bool
    window = shape.sliding_mask_window_tokens
    if window and step.window_masked(window):
        terms["sliding-window mask"] = tokens * step.window_tokens(window)  # bool
    if shape.window_off_mask:
        terms["unread window-0 sliding mask"] = tokens * step.attended_tokens  # bool
    return terms


def _post_attention_residual(shape: ActivationShape, step: StepShape) -> dict[str, int]:
    """After attention the residual sum is a new tensor while the caller still holds the layer's input."""
    return {"post-attention residual": step.num_tokens * shape.hidden_size * shape.activation_bytes}


def _norm_phase(shape: ActivationShape, step: StepShape) -> dict[str, int]:
    return {**_post_attention_residual(shape, step),
            "RMSNorm float32 copies": 2 * step.num_tokens * shape.hidden_size * FP32}


def _qkv_phase(shape: ActivationShape, step: StepShape) -> dict[str, int]:
    a, tokens = shape.activation_bytes, step.num_tokens
    q = tokens * shape.num_heads * shape.qk_head_dim * a
    kv = tokens * shape.num_kv_heads * (shape.qk_head_dim + shape.v_head_dim) * a
    return {"normed input": tokens * shape.hidden_size * a, "q, k, v": q + kv,
            # q's norm holds two float32 copies; rotary then holds q * cos, rotate_half(q), its product with sin
            "q norm and rotary temporaries": max(2 * q * FP32 // a, 3 * q)}


def _attention_phase(shape: ActivationShape, step: StepShape, expand_kv_heads: bool) -> dict[str, int]:
    a, tokens, seqs = shape.activation_bytes, step.num_tokens, step.num_sequences
    q = tokens * shape.num_heads * shape.qk_head_dim * a
    out = tokens * shape.num_heads * shape.v_head_dim * a
    kv = tokens * shape.num_kv_heads * (shape.qk_head_dim + shape.v_head_dim) * a
    per_token_all_heads = shape.num_heads * (shape.qk_head_dim + shape.v_head_dim) * a
    terms = {"normed input": tokens * shape.hidden_size * a, "q, k, v": q + kv,
             "attention output and its transposed copy": 2 * out,
             "SDPA log-sum-exp": seqs * shape.num_heads * _round_up(step.tokens_per_sequence, _LSE_BLOCK) * FP32}
    grouped = shape.num_kv_heads < shape.num_heads
    if shape.eager_attention:
        # no fused kernel and no log-sum-exp: repeat_kv runs always, the scores (one sink column more) live
        del terms["SDPA log-sum-exp"]
        terms["attention scores, with the sink column (eager attention)"] = (
            _EAGER_SCORE_COPIES * seqs * shape.num_heads * step.tokens_per_sequence * (step.attended_tokens + 1) * a)
        if grouped:
            terms["K/V repeated to every head"] = seqs * step.attended_tokens * per_token_all_heads
    elif shape.latent_attention:
        # transformers (DeepseekV2Attention.expand_kv) runs kv_b_proj over every cached latent, giving per head
        # nope + v, then assembles keys of nope + rope beside it: both alive into SDPA (measured on the H100)
        nope = shape.qk_head_dim - shape.qk_rope_head_dim
        terms["latent expanded to every head (kv_b_proj output, assembled keys)"] = (
            seqs * step.attended_tokens * shape.num_heads * (nope + shape.v_head_dim + shape.qk_head_dim) * a)
        if shape.qk_head_dim != shape.v_head_dim:
            # no fused SDPA kernel took key and value widths that differ: the math kernel keeps the scores and
            # their softmax (a 2048-token chunk of DeepSeek-V2-Lite peaked 21 MiB above the estimate without them)
            terms["attention scores and probabilities (key and value widths differ)"] = (
                2 * seqs * shape.num_heads * step.tokens_per_sequence * step.attended_tokens * a)
    elif grouped and expand_kv_heads and step.masked:
        terms["K/V repeated to every head"] = seqs * step.attended_tokens * per_token_all_heads
    if step.masked:
        terms["additive mask"] = tokens * step.attended_tokens * a
    if step.static_cache_tokens is None and not shape.latent_attention:
        # torch.cat builds the grown K (then V) while the old one is alive
        terms["old K or V while the cache grows"] = seqs * step.context_tokens * shape.num_kv_heads * max(
            shape.qk_head_dim, shape.v_head_dim) * a
    return terms


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _mlp_phase(shape: ActivationShape, step: StepShape) -> dict[str, int]:
    a, tokens = shape.activation_bytes, step.num_tokens
    return {**_post_attention_residual(shape, step), "normed input": tokens * shape.hidden_size * a,
            "MLP act(gate), up, product": 3 * tokens * shape.intermediate_size * a}


def _moe_phase(shape: ActivationShape, step: StepShape, experts_implementation: str) -> dict[str, int]:
    a, tokens, hidden = shape.activation_bytes, step.num_tokens, shape.hidden_size
    experts, top_k, inter = shape.num_experts, shape.top_k, shape.moe_intermediate_size
    terms = {**_post_attention_residual(shape, step), "normed input": tokens * hidden * a,
             "router logits and float32 probabilities": tokens * experts * (a + FP32),
             "expert output accumulator": tokens * hidden * a}
    pairs = tokens * top_k  # (token, expert) pairs
    terms["routing: top-k, sorted ids, permutation"] = pairs * (3 * INDEX + FP32)
    if experts_implementation == "grouped_mm":
        # pairs sorted by expert: their inputs, gate_up, act(gate), product; later the output, weighted, unsorted
        terms["expert work of every (token, expert) pair"] = pairs * max(hidden + 4 * inter, 4 * hidden + inter) * a
    elif experts_implementation == "batched_mm":
        # the gathered gate_up and down weights of every pair are alive together for a moment
        terms["gathered expert weights (batched_mm)"] = pairs * 3 * inter * hidden * a
        terms["expert inputs and outputs (batched_mm)"] = pairs * (hidden + 2 * inter + hidden) * a
    else:
        terms["one-hot routing mask"] = tokens * top_k * (experts + 1) * INDEX
        # one expert at a time: at most every token picks it; gate_up, act, product, output, weighted output
        terms["one expert's work (all tokens routed to it)"] = tokens * (2 * inter + 2 * inter + 3 * hidden) * a
    if shape.shared_intermediate_size:
        terms["shared experts' MLP"] = 3 * tokens * shape.shared_intermediate_size * a
    return terms


def _logits_phase(shape: ActivationShape, step: StepShape, logits_bytes_per_element: int | None) -> dict[str, int]:
    per_element = logits_bytes_per_element or shape.activation_bytes
    return {"normed last hidden states": step.num_tokens * shape.hidden_size * shape.activation_bytes,
            "logits of the last token per sequence": step.num_sequences * shape.vocab_size * per_element}


def estimate_activations(
    shape: ActivationShape, step: StepShape, *, expand_kv_heads: bool = True,
    experts_implementation: str = "grouped_mm", logits_bytes_per_element: int | None = None,
) -> ActivationPeak:
    """The peak of the step's transient tensors over its phases.

    ``expand_kv_heads``: transformers' SDPA path repeats K/V to every query head whenever it passes a mask
    (true up to at least transformers 5.17; 5.23 packs the head groups of one-token decode instead); False
    for engines' paged kernels, which read the grouped heads. ``experts_implementation``: transformers'
    "grouped_mm" (its default), "eager" loop over experts, or "batched_mm" (what runtime.graph uses to capture
    MoE decode).
    """
    if experts_implementation not in EXPERT_IMPLEMENTATIONS:
        raise ValueError(f"experts_implementation must be one of {EXPERT_IMPLEMENTATIONS}")
    step_wide = _step_wide(shape, step)
    phases = {"norm": _norm_phase(shape, step), "qkv": _qkv_phase(shape, step),
              "attention": _attention_phase(shape, step, expand_kv_heads),
              "logits": _logits_phase(shape, step, logits_bytes_per_element)}
    if shape.num_experts:
        phases["moe"] = _moe_phase(shape, step, experts_implementation)
    else:
        phases["mlp"] = _mlp_phase(shape, step)
    for name in phases:
        if name != "logits":  # the base model has returned: its step-wide tensors are gone
            phases[name] = {**phases[name], **step_wide}
    phase = max(phases, key=lambda name: sum(phases[name].values()))
    terms = phases[phase]
    return ActivationPeak(peak_bytes=sum(terms.values()), phase=phase,
                          terms=tuple(sorted(terms.items(), key=lambda item: (-item[1], item[0]))))


def decode_activations(config: dict | None, *, num_sequences: int, context_tokens: int,
                       static_cache_tokens: int | None = None, **options) -> ActivationPeak:
    """Peak activations of a decode step: one new token for each of ``num_sequences`` sequences."""
    step = StepShape(num_sequences=num_sequences, tokens_per_sequence=1, context_tokens=context_tokens,
                     static_cache_tokens=static_cache_tokens)
    return estimate_activations(activation_shape(config), step, **options)


def prefill_activations(config: dict | None, *, chunk_tokens: int, context_tokens: int = 0,
                        static_cache_tokens: int | None = None, **options) -> ActivationPeak:
    """Peak activations of a prefill chunk of ``chunk_tokens`` tokens of one sequence after ``context_tokens``."""
    step = StepShape(num_sequences=1, tokens_per_sequence=chunk_tokens, context_tokens=context_tokens,
                     static_cache_tokens=static_cache_tokens)
    return estimate_activations(activation_shape(config), step, **options)
