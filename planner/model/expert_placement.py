"""Routed placements: every MoE layer routed, with as many resident experts as the budget holds, and what a
decode step fetches over the link (at the routed gather's rate, planner.model.experts.routed_fetch_bytes_per_s) and
a prefill chunk copies whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner.model.expert_prefetch import ExpertPrediction, fetch_weighted_shares, layer_shares, prefetch_shares
from planner.model.expert_routing import CpuDraw, LayerRouting, PerStepCpu
from planner.model.activations import decode_copies_pairs
from planner.model.experts import MoeGeometry, decode_gathers, routed_fetch_bytes_per_s

#: expert-bytes savings closer than this share are a tie (the lower expert id, the lower layer wins)
SAVING_DECIMALS = 12


@dataclass(frozen=True, kw_only=True)
class RoutedLayer:
    """One routed layer at one step size."""

    index: int
    resident: tuple[int, ...]
    expected_fetched_bytes: float
    hit_rate: float
    #: the fetch, after the router, on the critical path
    fetch_ms: float
    #: one expert's bytes (the fetch comes in whole experts: prefetch_layer_stall_ms)
    expert_bytes: int = 0
    #: the decode gather's time in the layer's compute, beyond the all-resident layer's (gather_ms)
    gather_ms: float = 0.0
    #: next-layer prefetch from a trace's per-expert prediction statistics: this layer's hit and ahead shares of
    #: its own non-resident experts' routed assignments (ExpertPrediction.shares); None: the placement's shares
    prefetch_hit_share: float | None = None
    prefetch_ahead_share: float | None = None
    #: expert ids computed on the host CPU (planner.search.cpu_placement; expected_fetched_bytes and fetch_ms are
    #: then the link's part alone), and the CPU path after the router, ms (0: none)
    cpu: tuple[int, ...] = ()
    cpu_ms: float = 0.0
    #: with CPU experts: the CPU path's handoff, one CPU expert's time in the step, ms, and how a step's touched
    #: experts fall on the CPU and fetched ids (planner.model.expert_routing.CpuDraw; the layer waits E[max] over it)
    cpu_handoff_ms: float = 0.0
    cpu_ms_per_expert: float = 0.0
    cpu_draw: CpuDraw | None = None
    #: a layer splitting each step's misses by their count (planner.search.cpu_per_step): its draw and table j(m);
    #: ``cpu`` then holds every non-resident id (any can go to the CPU) and cpu_draw is None
    cpu_per_step: PerStepCpu | None = None

    @property
    def expert_ms(self) -> float | None:
        """One expert's fetch time (None where the layer fetches nothing)."""
        experts = self.expert_bytes and self.expected_fetched_bytes / self.expert_bytes
        return self.fetch_ms / experts if experts else None


@dataclass(frozen=True, kw_only=True)
class RoutedPlacement:
    """Every MoE layer routed: resident experts per layer, what a step fetches, and its GPU and host bytes."""

    layers: tuple[RoutedLayer, ...]
    #: the decode gather buffer, in experts (min(tokens x top_k, E)), per slot set
    fetch_slots: int
    #: weight bytes on the GPU before the arena's slack: non-expert weights, resident experts and both buffers
    weight_bytes: int
    #: fetch_slots experts per slot set: one set, or two with prefetch (a layer reads its set while the next
    #: layer's prefetch writes the other); with CPU experts one expert more, the zero row they read as resident at
    fetch_buffer_bytes: int
    staging_buffer_bytes: int
    #: a decode step's gather of every routed pair's weights (decode_gather_bytes)
    gather_workspace_bytes: int
    #: every routed layer's experts, pinned on the host (resident ones too, as the runtime pins them)
    host_pinned_bytes: int
    #: next-layer prefetch: the share of routed, non-resident experts predicted and prefetched (the hits at the
    #: prefetch depth; None: no prefetch)
    prefetch_accuracy: float | None = None
    #: next-layer prefetch: the share of routed, non-resident experts' bytes gathered ahead (hits and wasted):
    #: depth / top_k (1.0: every rank)
    prefetch_ahead_share: float = 1.0
    #: next-layer prefetch: the ranks of each token's prediction gathered ahead (None: no prefetch, or all k)
    prefetch_depth: int | None = None

    @property
    def expected_fetched_bytes(self) -> float:
        """Expected bytes a decode step fetches over the link, all layers."""
        return math.fsum(layer.expected_fetched_bytes for layer in self.layers)

    @property
    def fetch_ms(self) -> float:
        """Time the link takes for a step's routed fetches (without prefetch, the time the step waits for them)."""
        return math.fsum(layer.fetch_ms for layer in self.layers)

    @property
    def num_resident(self) -> int:
        """Resident experts, all layers."""
        return sum(len(layer.resident) for layer in self.layers)


def fixed_routed_bytes(geometry: MoeGeometry, layer_total_bytes: tuple[int, ...], non_layer_bytes: int,
                       num_tokens: int, prefetch: bool = False) -> tuple[int, int, int, int]:
    """(weight bytes before resident experts, fetch buffer bytes, staging buffer bytes, gather workspace bytes)
    of an all-routed placement: everything but the routed experts, a fetch buffer of fetch_slots experts for
    decode (two sets with ``prefetch``), one staging buffer of num_experts experts for prefill chunks, and the
    decode step's gather of every routed pair's weights where its experts function copies them
    (decode_gather_bytes)."""
    expert_total = sum(layer.expert_bytes * geometry.num_experts for layer in geometry.layers)
    slot = geometry.max_expert_bytes
    fetch_buffer = geometry.fetch_slots(num_tokens) * slot * (2 if prefetch else 1)
    staging = geometry.num_experts * slot
    gather = decode_gather_bytes(num_tokens, geometry.top_k, geometry.num_experts, slot,
                                 copies_pairs=decode_copies_pairs(geometry.expert_dtype))
    return (non_layer_bytes + sum(layer_total_bytes) - expert_total + fetch_buffer + staging + gather, fetch_buffer,
            staging, gather)


def decode_gather_bytes(num_tokens: int, top_k: int, num_experts: int, expert_bytes: int, *,
                        copies_pairs: bool) -> int:
    """GPU bytes a routed decode step of ``num_tokens`` tokens gathers. It computes with the model's own experts
    function (runtime.routed_experts: the products then equal the all-resident model's bitwise): where that is
    transformers' batched_mm (``copies_pairs``: planner.model.activations.decode_copies_pairs), it copies each
    (token, expert) pair's weights out of the buffer into one workspace, alive for the layer's experts (on the
    H100, OLMoE at 4 sequences x top-8 = 32 pairs of 12 MiB experts held 384.2 MiB there); grouped_mm (bf16)
    reads the buffer in place: none (on the H200 on 2026-11-29, a PhiMoE serving plan at 4 sequences that booked
    1.26 GB of it peaked 1.37 GB under its prediction, an OLMoE one at 0.881 of it). A step that routes more pairs
    than num_experts runs the prefill path over the staging buffer instead: none."""
    if not copies_pairs or not decode_gathers(num_tokens, top_k, num_experts):
        return 0
    return num_tokens * top_k * expert_bytes


def gather_rate(hbm_bytes_per_s: float, compute_efficiency: float) -> float:
    """The rate a decode gather moves its bytes at: the GPU's memory at the efficiency estimates read weights at."""
    return hbm_bytes_per_s * compute_efficiency


def gather_ms(num_tokens: int, top_k: int, num_experts: int, expert_bytes: int, gather_bytes_per_s: float, *,
              copies_pairs: bool) -> float:
    """What a routed layer's decode gather adds to its compute (none where grouped_mm reads the buffer in place,
    ``copies_pairs`` False): batched_mm writes every pair's weights (decode_gather_bytes) to its workspace and
    its product reads them back, twice the gather's bytes at
    ``gather_bytes_per_s`` (the rate estimates read weights at: HBM x compute efficiency); its reads of the
    buffer stand in for the all-resident layer's own reads of the experts it touches. On the H100's conformance
    sweep (2026-11-28) routed steps at one sequence ran 6-20% slower than priced without it (Qwen2-MoE, Qwen3-MoE,
    OLMoE, DeepSeek-V2-Lite shapes: 0.06-0.22 ms a routed layer; this gives 0.09-0.14)."""
    gathered = decode_gather_bytes(num_tokens, top_k, num_experts, expert_bytes, copies_pairs=copies_pairs)
    return 2e3 * gathered / gather_bytes_per_s


def choose_resident(geometry: MoeGeometry, routing: tuple[LayerRouting, ...], num_tokens: int,
                    allowance_bytes: int) -> tuple[tuple[int, ...], ...]:
    """Resident experts per MoE layer within ``allowance_bytes``: the (layer, expert) pairs that save the most
    expected fetched bytes per step (chance touched x expert bytes), greedily. Under uniform routing every
    expert saves the same, so the layers take turns (ties go to the expert's rank in its layer, then the
    layer) and each keeps its first R ids (or R + 1)."""
    if allowance_bytes <= 0:
        return tuple(() for _ in geometry.layers)
    candidates = []
    # layers routed alike (uniform routing: equal shares) rank their experts alike: ranked once
    ranked: dict[tuple, list[tuple[float, int, int]]] = {}
    for slot, (layer, layer_routing) in enumerate(zip(geometry.layers, routing)):
        key = (layer_routing.shares, layer.expert_bytes)
        if key not in ranked:
            ranked[key] = _ranked_savings(layer_routing, num_tokens, layer.expert_bytes)
        candidates.extend((saving, rank, slot, expert) for saving, rank, expert in ranked[key])
    chosen: list[list[int]] = [[] for _ in geometry.layers]
    left = allowance_bytes
    smallest = min(layer.expert_bytes for layer in geometry.layers)
    for _, _, slot, expert in sorted(candidates):
        if left < smallest:
            break
        cost = geometry.layers[slot].expert_bytes
        if cost <= left:
            chosen[slot].append(expert)
            left -= cost
    return tuple(tuple(sorted(ids)) for ids in chosen)


def _ranked_savings(routing: LayerRouting, num_tokens: int, expert_bytes: int) -> list[tuple[float, int, int]]:
    """(-saving, rank, expert) of one layer's experts: the bytes a step saves keeping each resident (chance
    touched x expert bytes), ranked by share (ties: the lower id)."""
    touched = routing.touched(num_tokens)
    order = sorted(range(len(routing.shares)), key=lambda e: (-routing.shares[e], e))
    return [(-round(touched[expert] * expert_bytes, SAVING_DECIMALS), rank, expert)
            for rank, expert in enumerate(order)]


def routed_placement(geometry: MoeGeometry, routing: tuple[LayerRouting, ...], *, num_tokens: int,
                     layer_total_bytes: tuple[int, ...], non_layer_bytes: int, weight_limit_bytes: int,
                     h2d_bytes_per_s: float, prefetch_accuracy: float | None = None,
                     gather_bytes_per_s: float | None = None) -> RoutedPlacement | None:
    """The all-routed placement with the most resident experts whose weights fit ``weight_limit_bytes`` (before
    the arena's slack), for steps of ``num_tokens`` tokens; None when even no resident expert fits.
    ``prefetch_accuracy``: next-layer prefetch with that accuracy (two slot sets); None: none.
    ``gather_bytes_per_s``: the rate a decode step's gather runs at (gather_ms); None: not priced."""
    prefetch = prefetch_accuracy is not None
    base, fetch_buffer, staging, gather = fixed_routed_bytes(geometry, layer_total_bytes, non_layer_bytes, num_tokens,
                                                     prefetch)
    if base > weight_limit_bytes:
        return None
    resident = choose_resident(geometry, routing, num_tokens, weight_limit_bytes - base)
    rate = routed_fetch_bytes_per_s(h2d_bytes_per_s)
    rows, resident_bytes = [], 0
    for layer, layer_routing, ids in zip(geometry.layers, routing, resident):
        # chosen as the hottest by the shares: priced on steps the trace did not see
        hit_rate, fetched_experts = layer_routing.out_of_sample(ids, num_tokens)
        fetched = fetched_experts * layer.expert_bytes
        resident_bytes += len(ids) * layer.expert_bytes
        layer_gather_ms = 0.0 if gather_bytes_per_s is None else gather_ms(
            num_tokens, geometry.top_k, geometry.num_experts, layer.expert_bytes, gather_bytes_per_s,
            copies_pairs=decode_copies_pairs(geometry.expert_dtype))
        rows.append(RoutedLayer(index=layer.index, resident=ids, expected_fetched_bytes=fetched,
                                hit_rate=hit_rate, fetch_ms=1e3 * fetched / rate, expert_bytes=layer.expert_bytes,
                                gather_ms=layer_gather_ms))
    # the runtime pins every expert of a routed layer, resident ones too: the loader writes whole fused params,
    # and a prefill chunk copies the layer's experts from one place (runtime.routed_experts)
    host = sum(layer.expert_bytes * geometry.num_experts for layer in geometry.layers)
    return RoutedPlacement(layers=tuple(rows), fetch_slots=geometry.fetch_slots(num_tokens),
                           weight_bytes=base + resident_bytes, fetch_buffer_bytes=fetch_buffer,
                           staging_buffer_bytes=staging, gather_workspace_bytes=gather, host_pinned_bytes=host,
                           prefetch_accuracy=prefetch_accuracy)


def with_prefetch_depth(placement: RoutedPlacement, rank_accuracy: tuple[float, ...], depth: int,
                        predictions: dict[int, ExpertPrediction] | None = None) -> RoutedPlacement:
    """``placement`` prefetching the top ``depth`` ranks: its shares from the per-rank curve (prefetch_shares),
    and, per layer a trace's ``predictions`` cover, that layer's own shares over its non-resident experts
    (ExpertPrediction.shares); the placement's shares are then the predicted layers' fetch-weighted mean."""
    hit, ahead = prefetch_shares(rank_accuracy, depth)
    if not predictions:
        return replace(placement, prefetch_accuracy=hit, prefetch_ahead_share=ahead, prefetch_depth=depth)
    rows = []
    for row in placement.layers:
        if row.index in predictions:
            row_hit, row_ahead = predictions[row.index].shares(row.resident, depth)
            row = replace(row, prefetch_hit_share=row_hit, prefetch_ahead_share=row_ahead)
        rows.append(row)
    hit, ahead = fetch_weighted_shares(rows[1:], hit, ahead)  # the first routed layer: nothing predicts it
    return replace(placement, layers=tuple(rows), prefetch_accuracy=hit, prefetch_ahead_share=ahead,
                   prefetch_depth=depth)


def wasted_prefetch_bytes(placement: RoutedPlacement) -> float:
    """Bytes a decode step's predictions gather that the step does not route to: per predicted layer (every
    routed layer but the first), (ahead - hit) x its routed, non-resident bytes; 0 without prefetch."""
    if placement.prefetch_accuracy is None:
        return 0.0
    hit, ahead = placement.prefetch_accuracy, placement.prefetch_ahead_share
    return math.fsum((row_ahead - row_hit) * row.expected_fetched_bytes for row in placement.layers[1:]
                     for row_hit, row_ahead in (layer_shares(row, hit, ahead),))


def staged_bytes(geometry: MoeGeometry) -> dict[int, int]:
    """Per routed layer, the bytes a prefill chunk copies into the staging buffer: all num_experts of its experts
    (runtime.routed_experts copies the layer's fused params whole, in one copy from the host, resident experts
    too: the staging buffer must hold all E in order for the prefill implementation)."""
    return {layer.index: geometry.num_experts * layer.expert_bytes for layer in geometry.layers}


def non_resident_bytes(geometry: MoeGeometry, placement: RoutedPlacement) -> dict[int, int]:
    """Per routed layer, the bytes of its non-resident experts: what a prefill chunk copies whole."""
    return {layer.index: (geometry.num_experts - len(row.resident)) * layer.expert_bytes
            for layer, row in zip(geometry.layers, placement.layers)}
