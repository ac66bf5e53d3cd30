"""The experts of a MoE checkpoint: what its config and tensors say about them (``moe_geometry``), read here and
only here (the config keys through the model record, planner.model.model_config) for the cost model, the
activation estimate and the checkpoint's config checks alike, and the routed gather's rate.

Expert-granular offloading of MoE layers is modelled by job: which experts a step touches
(planner.model.expert_routing), which to keep on the GPU and what the rest cost a step's link
(planner.model.expert_placement), and next-layer prefetch and a routed layer's wait (planner.model.expert_prefetch);
planner.search.routed_step lays a routed decode step out, planner.search.expert_choice weighs it against whole layers.

A routed layer keeps its attention, norms, router and shared experts on the GPU, and its experts in pinned host
memory except the resident ones; after its router runs, the step gathers the touched, non-resident experts into
one shared GPU fetch buffer, read by GPU threads over the host link (runtime: UVA gather, CUDA-graph
capturable). A prefill chunk copies each routed layer's non-resident experts whole, through one staging
buffer of E experts, as streaming the layer would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.errors import ModelInputError
from planner.model.model_config import model_config

if TYPE_CHECKING:
    from planner.model.layout import LayerInfo, ModelLayout

#: top-k assumed where a MoE config does not say it
DEFAULT_TOP_K = 2
#: the routed fetch's rate over the copy engine's (profile h2d_bytes_per_s): GPU threads reading pinned host
#: memory mapped into the device's address space are slower than a copy-engine copy. Measured on the H100
#: (scripts/bench_experts.py, runtime.routed_experts' Triton gather inside the captured step, Qwen3-30B-A3B):
#: 46.9 and 48.4 GB/s in-step against 52.9 GB/s pinned copy-engine H2D, 0.89-0.91 (benchmarks/2026-11-25-*)
ROUTED_FETCH_EFFICIENCY = 0.89
#: the MoE block modules whose experts transformers 5 holds as the fused params of its experts interface, which
#: the runtime route-fetches (Mixtral's block_sparse_moe is renamed to mlp on load)
ROUTED_EXPERT_MODULES = ("mlp", "block_sparse_moe")


def is_expert_param(relative_name: str) -> bool:
    """Routed-expert weights sit under an ``experts`` segment (``shared_experts`` is dense)."""
    return ".experts." in f".{relative_name}."


@dataclass(frozen=True, kw_only=True)
class MoeLayer:
    """One layer of the stack that holds routed experts."""

    index: int
    #: bytes of one routed expert (its weights, scales and biases): the layer's expert bytes / num_experts
    expert_bytes: int
    #: everything else of the layer (attention, norms, router, shared experts): resident when routed
    other_bytes: int


@dataclass(frozen=True, kw_only=True)
class MoeGeometry:
    """What a MoE checkpoint says about its experts, read once (``moe_geometry``)."""

    num_experts: int
    top_k: int
    #: layers with routed experts, in index order
    layers: tuple[MoeLayer, ...]
    #: why the runtime cannot route-fetch this model's experts (its plans stream whole layers); None: it can
    unroutable_reason: str | None
    #: unroutable only because the experts are quantized (whole experts all the same): plans price the routed
    #: regime beside whole layers, on paper, and never choose it
    priced_on_paper: bool = False
    #: the experts' weights' dtype (safetensors name; the one holding most of their bytes): which experts function
    #: a routed decode step runs (planner.model.activations.decode_copies_pairs)
    expert_dtype: str = "BF16"

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError("top_k must be from 1 to num_experts")

    @property
    def max_expert_bytes(self) -> int:
        """The largest expert: a fetch or staging buffer slot."""
        return max(layer.expert_bytes for layer in self.layers)

    def fetch_slots(self, num_tokens: int) -> int:
        """Experts a step of ``num_tokens`` tokens can touch in one layer: min(tokens x top_k, num_experts)."""
        return min(num_tokens * self.top_k, self.num_experts)

    def decode_gathers(self, num_tokens: int) -> bool:
        """decode_gathers for this model's experts."""
        return decode_gathers(num_tokens, self.top_k, self.num_experts)


def decode_gathers(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether a routed decode step of ``num_tokens`` tokens gathers its routed experts (runtime.routed_experts'
    decode path, where next-layer prefetch and CPU experts run): its tokens x top_k pairs fit the fetch slots,
    min(pairs, num_experts). A step with more pairs than experts (16 sequences of OLMoE's top-8 of 64) runs the
    staging path, as a prefill chunk does: every expert of the layer copied whole, then computed."""
    return num_tokens * top_k <= num_experts


def moe_geometry(config: dict | None, layout: ModelLayout) -> MoeGeometry | None:
    """The MoE geometry of a checkpoint: experts and top-k from config.json (counted from the tensors where it
    is silent), each MoE layer's expert bytes from its tensors; None for a dense model."""
    record = model_config(config)
    num_experts, top_k = (record.num_experts, record.top_k) if record else (0, 0)
    layers = [layer for layer in layout.layers if any(is_expert_param(p[0]) for p in layer.params)]
    if not layers:
        return None
    num_experts = num_experts or max(count_experts(layer) for layer in layers)
    if not num_experts:
        return None
    top_k = top_k or min(DEFAULT_TOP_K, num_experts)  # as planner.model.cost assumes
    if top_k > num_experts:
        raise ModelInputError(f"config.json routes each token to {top_k} experts but the model has {num_experts}; "
                              "fix num_experts_per_tok (or the expert count) in config.json")
    rows, dtype_bytes = [], {}
    for layer in layers:
        for name, dtype, _, nbytes in layer.params:
            if is_expert_param(name):
                dtype_bytes[dtype] = dtype_bytes.get(dtype, 0) + nbytes
        expert_total = sum(p[3] for p in layer.params if is_expert_param(p[0]))
        rows.append(MoeLayer(index=layer.index, expert_bytes=math.ceil(expert_total / num_experts),
                             other_bytes=layer.nbytes - expert_total))
    reason, quantized = _unroutable_reason(layers, num_experts)
    return MoeGeometry(num_experts=num_experts, top_k=top_k, layers=tuple(rows),
                       unroutable_reason=reason, priced_on_paper=quantized,
                       expert_dtype=max(dtype_bytes, key=dtype_bytes.get))


def max_experts(layers) -> int:
    """The most experts any of ``layers`` holds (count_experts), counted once per distinct set of param names and
    shapes: DeepSeek-V3's 58 MoE layers are one such set of 1,500 params, counted again for each GPU count."""
    counts: dict[tuple, int] = {}
    for layer in layers:
        key = tuple((name, shape) for name, _, shape, _ in layer.params)
        if key not in counts:
            counts[key] = count_experts(layer)
    return max(counts.values())


def count_experts(layer: LayerInfo) -> int:
    """Experts of a layer from its tensor names (``experts.7.``) or a fused tensor's leading dimension."""
    indices = set()
    for name, _, shape, _ in layer.params:
        _, found, after = f".{name}.".partition(".experts.")  # is_expert_param, and what follows the segment
        if not found:
            continue
        tail = after.partition(".")[0]
        if tail.isascii() and tail.isdigit():
            indices.add(int(tail))
        elif len(shape) == 3:
            return shape[0]
    return len(indices)


def _unroutable_reason(layers: list[LayerInfo], num_experts: int) -> tuple[str | None, bool]:
    """Why the runtime cannot route-fetch these experts (None: it can), and whether that is only because they
    are quantized. It gathers rows of the fused params of transformers 5's experts interface
    (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], biases): a checkpoint holds them fused (E
    leading rows), or one expert at a time under ``mlp.experts.N.`` (or Mixtral's ``block_sparse_moe.experts.N.``),
    which transformers 5 fuses on load. Quantized experts (MXFP4 blocks, FP8 block scales) are not gathered: their
    scales are no experts-interface params; their bytes still come in whole experts, so plans price them."""
    quantized = None
    for layer in layers:
        for name, dtype, shape, _ in layer.params:
            if not is_expert_param(name):
                continue
            where = f"layer {layer.index}'s {name}"
            module, _, tail = name.partition(".experts.")
            if module not in ROUTED_EXPERT_MODULES:
                return f"{where} lies outside mlp.experts, the MoE block of transformers 5's experts interface", False
            first = tail.split(".")[0]
            if not (first.isascii() and first.isdigit()) and (not shape or shape[0] != num_experts):
                return f"{where} has shape {list(shape)}, not one row per expert ({num_experts})", False
            if quantized is None and (dtype in ("U8", "I8") or "scale" in tail.rsplit(".", 1)[-1]
                                      or tail.endswith("_blocks")):
                quantized = (f"{where} belongs to quantized experts (FP8 block scales or MXFP4 blocks), which the "
                             "routed gather of fused experts does not move")
    return quantized, quantized is not None


def routed_fetch_bytes_per_s(h2d_bytes_per_s: float) -> float:
    """The routed gather's rate: the copy engine's derated by ROUTED_FETCH_EFFICIENCY."""
    return h2d_bytes_per_s * ROUTED_FETCH_EFFICIENCY
