"""Per-layer compute time, estimated from each layer's FLOPs and bytes and the profile's rates (roofline).

The estimate is a seam: a measured table (a later issue) replaces ``ComputeTimes`` and says so in ``source``.
FLOPs and bytes come from the tensor shapes; the model record (planner.model.model_config) supplies attention geometry
and MoE routing.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

from planner.errors import ModelInputError
from planner.model.experts import DEFAULT_TOP_K, count_experts, is_expert_param
from planner.model.fp8_cost import DEQUANTIZED, FP8_DTYPES, Fp8Compute, dequant_bytes_per_s, dequant_rate_text
from planner.model.layout import LayerInfo, ModelLayout
from planner.model.model_config import model_config
from planner.source.profile import HardwareProfile

# Bytes per cached K or V element: a bf16 KV cache.
KV_ELEMENT_BYTES = 2
#: far beyond any step or context today; beyond them a value is a typo, and the FLOP counts would mislead
MAX_STEP_TOKENS = 2**24
MAX_CONTEXT = 2**32


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one forward step processes."""

    #: tokens in one forward step: a prefill chunk, or the batch of a decode step
    tokens_per_step: int = 2048
    #: sequences those tokens belong to (1 for a prefill chunk, the batch size for decode)
    sequences_per_step: int = 1
    #: tokens already in each sequence's KV cache before the step
    context_tokens: int = 0

    def __post_init__(self):
        if self.tokens_per_step < 1 or self.sequences_per_step < 1 or self.context_tokens < 0:
            raise ValueError("tokens and sequences must be >= 1 and context >= 0")
        if max(self.tokens_per_step, self.sequences_per_step) > MAX_STEP_TOKENS or self.context_tokens > MAX_CONTEXT:
            raise ValueError(f"tokens and sequences must be at most {MAX_STEP_TOKENS} and context at most "
                             f"{MAX_CONTEXT}")
        if self.tokens_per_step % self.sequences_per_step:
            raise ValueError("tokens per step must be a multiple of sequences per step")


def is_decode_step(workload) -> bool:
    """Whether a step (a Workload, or a plan's workload section) is a decode step: one new token per sequence
    after a context."""
    return workload.context_tokens > 0 and workload.tokens_per_step == workload.sequences_per_step


@dataclass(frozen=True, kw_only=True)
class ComputeTimes:
    """Compute time of each planned layer and of the work outside the stack, for one step."""

    layer_ms: tuple[float, ...]
    #: embedding, final norm and LM head, run once per step on the compute stream
    head_ms: float
    #: how the times were obtained, recorded in the plan
    source: str


@dataclass(frozen=True, kw_only=True)
class ModelGeometry:
    """What config.json (or the shapes) say about attention and routing."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int


def geometry_from_config(config: dict | None, layout: ModelLayout) -> ModelGeometry:
    """Attention heads and MoE routing from the model record; experts counted from names when config is silent."""
    record = model_config(config)
    num_heads = (record.num_heads or 0) if record else 0
    head_dim = (record.head_dim or 0) if record else 0
    num_kv_heads = (record.num_kv_heads or 0) if record else 0
    num_experts, top_k = (record.num_experts, record.top_k) if record else (0, 0)
    num_experts = num_experts or count_experts(layout.layers[-1])
    if num_experts and not top_k:
        top_k = min(DEFAULT_TOP_K, num_experts)
    if top_k > num_experts > 0:
        raise ModelInputError(f"config.json routes each token to {top_k} experts but the model has {num_experts}; "
                              "fix num_experts_per_tok (or the expert count) in config.json")
    return ModelGeometry(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, num_experts=num_experts, top_k=top_k
    )


def _logical_params(name: str, dtype: str, shape: tuple[int, ...]) -> int:
    """Weights that take part in matmuls: 2-D and up, scales excluded; U8 'blocks' hold two FP4 values a byte."""
    if len(shape) < 2 or "scale" in name.rsplit(".", 1)[-1]:
        return 0
    count = math.prod(shape)
    if dtype in ("U8", "I8") and name.endswith("blocks"):
        return 2 * count
    return count


#: id(layer.params) -> (params, sums): the sums of each layer's params, which do not change with the workload
_SUMS_CACHE: dict[int, tuple[tuple, tuple[int, int, int, int, int, int]]] = {}
_SUMS_CACHE_SIZE = 65536


def _param_sums(layer: LayerInfo) -> tuple[int, int, int, int, int, int]:
    """(dense params, expert params, dense bytes, expert bytes, dense fp8 bytes, expert fp8 bytes) of a layer,
    computed once per layer: a
    serving search costs every layer at each concurrency, and a DeepSeek-V3 layer has 1,500 params."""
    cached = _SUMS_CACHE.get(id(layer.params))
    if cached is not None and cached[0] is layer.params:
        return cached[1]
    dense_params = expert_params = dense_bytes = expert_bytes = dense_fp8_bytes = expert_fp8_bytes = 0
    for name, dtype, shape, nbytes in layer.params:
        fp8_bytes = nbytes if dtype in FP8_DTYPES else 0
        if is_expert_param(name):
            expert_params += _logical_params(name, dtype, shape)
            expert_bytes += nbytes
            expert_fp8_bytes += fp8_bytes
        else:
            dense_params += _logical_params(name, dtype, shape)
            dense_bytes += nbytes
            dense_fp8_bytes += fp8_bytes
    sums = (dense_params, expert_params, dense_bytes, expert_bytes, dense_fp8_bytes, expert_fp8_bytes)
    if len(_SUMS_CACHE) >= _SUMS_CACHE_SIZE:
        _SUMS_CACHE.clear()
    _SUMS_CACHE[id(layer.params)] = (layer.params, sums)
    return sums


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """What one layer's step does, for roofline_ms."""

    flops: float
    #: weights, expert weights touched, a shared KV head's expanded copies and their reads, at the profile's
    #: compute efficiency, overlapping the FLOPs
    hbm_bytes: float
    #: the KV cache's own read: streamed at KV_STREAM_EFFICIENCY of the HBM rate, overlapping the FLOPs
    stream_bytes: float = 0.0
    #: passes that run before the matmuls (FP8 weights widened and scaled on run's path): added to the step
    serial_bytes: float = 0.0
    #: the matmuls run at the profile's FP8 rate
    fp8_rate: bool = False


def layer_cost(layer: LayerInfo, geometry: ModelGeometry, workload: Workload,
               kv_bytes: float | None = None, fp8: Fp8Compute = DEQUANTIZED,
               expand_kv_heads: bool = True) -> LayerCost:
    """What one layer computes and moves in one step of ``workload`` (LayerCost).

    ``kv_bytes``: the KV cache the step reads and writes in this layer, where a cache model knows it (sliding
    windows, latent attention), else from the geometry; ``fp8``: how the FP8 linears compute
    (planner.model.fp8_cost); ``expand_kv_heads``: the attention expands shared KV heads before its kernel (run's
    transformers attention: gqa_kv_traffic), where an engine's kernels read each KV head once."""
    tokens = workload.tokens_per_step
    dense_params, expert_params, dense_bytes, expert_bytes, dense_fp8, expert_fp8 = _param_sums(layer)
    active_share = geometry.top_k / geometry.num_experts if expert_params and geometry.num_experts else 1.0
    # Experts any token of the step touches: each token picks top_k of num_experts.
    touched_share = 1 - (1 - active_share) ** tokens
    flops = 2 * tokens * (dense_params + active_share * expert_params)
    tokens_per_sequence = tokens // workload.sequences_per_step
    attended = workload.context_tokens + (tokens_per_sequence + 1) / 2
    flops += 4 * tokens * attended * geometry.num_heads * geometry.head_dim
    if kv_bytes is None:
        kv_bytes = (
            workload.sequences_per_step
            * (workload.context_tokens + tokens_per_sequence)
            * 2 * geometry.num_kv_heads * geometry.head_dim * KV_ELEMENT_BYTES
        )
    kv_traffic = gqa_kv_traffic(geometry, workload) if expand_kv_heads else 1.0
    # the cache's own read streams; its expansion (kv_traffic - 1 more) is copies and a kernel's reads of them
    hbm_bytes = dense_bytes + touched_share * expert_bytes + kv_bytes * (kv_traffic - 1)
    # the FP8 weights' traffic beyond their stored byte (dequantizing paths): the matmul's wider read, and the
    # passes before it
    fp8_bytes = dense_fp8 + touched_share * expert_fp8
    hbm_bytes += (fp8.matmul_bytes_per_fp8_byte - 1) * fp8_bytes
    return LayerCost(flops=flops, hbm_bytes=hbm_bytes, stream_bytes=kv_bytes,
                     serial_bytes=(fp8.hbm_bytes_per_fp8_byte - fp8.matmul_bytes_per_fp8_byte) * fp8_bytes,
                     fp8_rate=fp8.fp8_rate and (dense_fp8 + expert_fp8) * 2 > layer.nbytes)


def gqa_kv_traffic(geometry: ModelGeometry, workload: Workload) -> float:
    """How many times a step over a cache moves each cached K and V byte: once, or, where several query heads share
    a KV head, 1 + 2 x (query heads per KV head). A step over a cache reaches transformers' sdpa (and eager)
    attention with a mask, and there each KV head is expanded to its query heads (``repeat_kv``: written, then
    read by the kernel) before the product: transformers' ``use_gqa_in_sdpa`` lets the kernel share KV heads on
    CUDA only where no mask is given. On the H100 a graphed Qwen3-MoE decode layer (32 query heads on 4 KV heads)
    at context 4096 took 0.36, 0.72, 1.16, 2.00 and 3.54 ms at 1, 4, 8, 16 and 32 sequences where OLMoE's (no
    sharing) took 0.27, 0.41, 0.54, 0.71 and 0.93 (scripts/experiments/moe_decode_rate.py). A chunk of a new
    sequence (no cache, no mask) shares KV heads in the kernel."""
    if not workload.context_tokens or geometry.num_kv_heads <= 0 or geometry.num_heads <= geometry.num_kv_heads:
        return 1.0
    return 1 + 2 * geometry.num_heads / geometry.num_kv_heads


#: the share of the HBM rate a step's plain read of its KV cache runs at (long contiguous reads, unlike the
#: weights' small-batch matrix products the profile's compute_efficiency is fitted to): on the H100 an OLMoE decode
#: layer (no shared KV heads) at 8 sequences took 0.164 ms more at context 8192 than at 512, its cache 503 MB
#: larger: 0.92 of 3.35 TB/s (scripts/experiments/moe_decode_rate.py)
KV_STREAM_EFFICIENCY = 0.9


def roofline_ms(cost: LayerCost, profile: HardwareProfile) -> float:
    """max(FLOPs / rate, bytes / bandwidth), then the serial passes' bytes: FLOPs and bytes derated by the
    profile's compute efficiency, the cache's plain read at KV_STREAM_EFFICIENCY of the bandwidth, the passes at the
    rate they reach (planner.model.fp8_cost.dequant_bytes_per_s)."""
    rate = profile.bf16_flops_per_s.value
    if cost.fp8_rate and profile.fp8_flops_per_s is not None:
        rate = profile.fp8_flops_per_s.value
    efficiency = profile.compute_efficiency.value
    bandwidth = profile.hbm_bytes_per_s.value
    overlapped = max(cost.flops / (rate * efficiency),
                     cost.hbm_bytes / (bandwidth * efficiency) + cost.stream_bytes / (bandwidth * KV_STREAM_EFFICIENCY))
    serial_s = cost.serial_bytes / dequant_bytes_per_s(profile) if cost.serial_bytes else 0.0
    return 1e3 * (overlapped + serial_s)


def _head_shape(layout: ModelLayout, checkpoint_shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """The LM head's [vocab, hidden] shape: lm_head, else the (tied) input embedding."""
    for suffix in ("lm_head.weight", "output.weight", "embed_tokens.weight", "wte.weight", "word_embeddings.weight"):
        for name in layout.non_layer_names:
            if name.endswith(suffix) and len(checkpoint_shapes.get(name, ())) == 2:
                return checkpoint_shapes[name]
    return None


def estimate_compute(
    layout: ModelLayout,
    geometry: ModelGeometry,
    workload: Workload,
    profile: HardwareProfile,
    checkpoint_shapes: dict[str, tuple[int, ...]],
    kv_bytes_of: Callable[[int, Workload], float] | None = None,
    fp8: Fp8Compute = DEQUANTIZED,
    graphed: bool = False,
    expand_kv_heads: bool = True,
) -> ComputeTimes:
    """Roofline compute time of every layer, and of the LM head for the last token of each sequence; where the
    profile holds a measured layer floor (planner.source.profile.LayerFloor), each layer's time from it.

    ``kv_bytes_of(layer_index, workload)``: KV cache bytes a layer reads and writes in one step, from a cache
    model (planner.model.kv_cache); without one, every layer caches ``num_kv_heads x head_dim`` keys and values.
    ``fp8``: how FP8 linears compute on the plan's target (planner.model.fp8_cost.fp8_compute_for).
    ``graphed``: the step is replayed from a CUDA graph (the floor a graphed layer adds, not an eager one's).
    ``expand_kv_heads``: run's attention (layer_cost); False for an engine's."""
    layer_ms = tuple(
        _floored(roofline_ms(layer_cost(layer, geometry, workload,
                                         None if kv_bytes_of is None else kv_bytes_of(i, workload), fp8,
                                         expand_kv_heads), profile),
                 layer, profile, graphed)
        for i, layer in enumerate(layout.layers)
    )
    head_ms = 0.0
    shape = _head_shape(layout, checkpoint_shapes)
    if shape is not None:
        vocab, hidden = shape
        head_flops = 2 * workload.sequences_per_step * vocab * hidden
        head_ms = roofline_ms(LayerCost(flops=head_flops, hbm_bytes=vocab * hidden * 2), profile)
    source = (
        f"estimated: roofline from layer shapes at {profile.name} datasheet rates x compute_efficiency "
        f"{profile.compute_efficiency.value:g}"
    )
    if any(dtype in FP8_DTYPES for layer in layout.layers for _, dtype, _, _ in layer.params):
        source += f"; {fp8.description}"
        if fp8.hbm_bytes_per_fp8_byte > fp8.matmul_bytes_per_fp8_byte:
            source += f", {dequant_rate_text(profile)}"
    if expand_kv_heads and gqa_kv_traffic(geometry, workload) > 1:
        source += "; each shared KV head expanded to its query heads, as run's attention does over a cache"
    floor = profile.layer_floor
    if floor is not None:
        source += (f"; with the measured layer floor ({floor.graphed_dense_ms:g} ms dense, {floor.graphed_moe_ms:g} "
                   f"ms MoE added to a graphed layer; an eager MoE layer at least {floor.eager_moe_ms:g} ms)")
    return ComputeTimes(layer_ms=layer_ms, head_ms=head_ms, source=source)


def _floored(roofline: float, layer: LayerInfo, profile: HardwareProfile, graphed: bool) -> float:
    """The layer's roofline with the profile's measured floor (the roofline alone where none is measured)."""
    if profile.layer_floor is None:
        return roofline
    moe = any(is_expert_param(name) for name, *_ in layer.params)
    return profile.layer_floor.layer_ms(roofline, moe=moe, graphed=graphed)
