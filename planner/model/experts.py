"""Expert-granular offloading of MoE layers: which experts a decode step touches, which to keep on the GPU, and
what fetching only the routed, non-resident ones costs.

A MoE layer of E experts with top-k routing, at a step of B tokens (one per sequence at decode), touches expert e
with probability 1 - (1 - p_e)^B, where p_e is the share of tokens routed to e: k/E under uniform routing (so the
expected distinct experts are E(1 - (1 - k/E)^B): 8 / 29 / 82 / 126 of Qwen3-30B-A3B's 128 at B = 1 / 4 / 16 /
64), or count_e / num_tokens from a recorded routing trace (planner.source.routing_trace). Tokens of one step route
independently: the model's approximation, which a trace with correlated routing (the same expert for a whole
batch) makes pessimistic.

A routed layer keeps its attention, norms, router and shared experts on the GPU, and its experts in pinned host
memory except the resident ones; after its router runs, the step gathers the touched, non-resident experts into
one shared GPU fetch buffer, read by GPU threads over the host link (runtime: UVA gather, CUDA-graph
capturable). The fetch waits for the router, so it is on the critical path: the layer takes its compute time
plus its fetch time. With next-layer prefetch (``prefetch_layer_ms``), the previous routed layer predicts this
layer's experts and their gather overlaps one layer's compute; only the mispredicted ones are fetched after the
router. A prefill chunk copies each routed layer's non-resident experts whole, through one staging
buffer of E experts, as streaming the layer would.

The MoE geometry of a checkpoint is read here and only here (``moe_geometry``; the config keys through the model
record, planner.model.model_config), for the cost model, the activation estimate and the checkpoint's config checks
alike.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from planner.errors import ModelInputError
from planner.model.model_config import model_config
from planner.model.selection_bias import SelectionOptimism

if TYPE_CHECKING:
    from planner.model.layout import LayerInfo, ModelLayout

#: top-k assumed where a MoE config does not say it
DEFAULT_TOP_K = 2
#: the routed fetch's rate over the copy engine's (profile h2d_bytes_per_s): GPU threads reading pinned host
#: memory mapped into the device's address space are slower than a copy-engine copy. Measured on the H100
#: (scripts/bench_experts.py, runtime.routed_experts' Triton gather inside the captured step, Qwen3-30B-A3B):
#: 46.9 and 48.4 GB/s in-step against 52.9 GB/s pinned copy-engine H2D, 0.89-0.91 (benchmarks/2026-11-25-*)
ROUTED_FETCH_EFFICIENCY = 0.89
#: the share of a decode step's routed, non-resident experts that next-layer prediction prefetches (the plan's
#: experts.prefetch next_layer_router: the next routed layer's router on this layer's router input). Measured
#: 0.777 on an H100 by scripts/bench_experts.py --prefetch on (Qwen3-30B-A3B shape, 24 GiB, one sequence,
#: uniform routing, random weights, 64 greedy steps; benchmarks/2026-11-25-prefetch-h100.md). Trained routers
#: differ by model: make --prefetch-accuracy overrides it, and the plan records the figure used
PREFETCH_ACCURACY = 0.78
#: the per-rank accuracy of that prediction (rank 1: the predicting router's highest score) measured on the H100 by
#: scripts/bench_experts.py --prefetch-depth (same shape and run as above, 64 steps x 47 predicted layers;
#: benchmarks/2026-11-25-prefetch-depth-h100.md): the planner's prefetch depth is chosen from this curve where no
#: trace measured one, resampled to the router's top-k and scaled to mean PREFETCH_ACCURACY
MEASURED_RANK_ACCURACY = (0.9641, 0.9388, 0.9076, 0.8620, 0.7832, 0.7028, 0.5864, 0.4817)
#: a predicting routed layer's own cost in a decode step, beyond its fetches: the next layer's predictor (that
#: router on this layer's router input), the fetch plans and the side stream's join. Measured on the H100 by
#: scripts/bench_experts.py --machinery, every expert resident so nothing crosses the link: 19.13 ms a step with
#: prefetch against 17.79 ms all-resident (17.64 routed without prefetch), 1.34 ms over 47 predicting layers
#: (Qwen3-30B-A3B shape, one sequence, serving's kernels; benchmarks/2026-11-26-routed-machinery-h100.json)
PREFETCH_MACHINERY_MS = 0.0285
#: how much slower a decode step's compute runs while a prefetch gather reads host memory beside it (its
#: programs share the SMs and the memory system): decode-sized bf16 products took 110.9 us alone and 125.4,
#: 128.2 and 132.1 us beside a gather of 1, 2 and 4 experts on the H100 (+13% to +19%;
#: scripts/experiments/gather_contention.py, benchmarks/2026-11-26-gather-contention-h100.json)
GATHER_COMPUTE_SLOWDOWN = 0.15
#: the MoE block modules whose experts transformers 5 holds as the fused params of its experts interface, which
#: the runtime route-fetches (Mixtral's block_sparse_moe is renamed to mlp on load)
ROUTED_EXPERT_MODULES = ("mlp", "block_sparse_moe")
#: expert-bytes savings closer than this share are a tie (the lower expert id, the lower layer wins)
SAVING_DECIMALS = 12


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
    rows = []
    for layer in layers:
        expert_total = sum(p[3] for p in layer.params if is_expert_param(p[0]))
        rows.append(MoeLayer(index=layer.index, expert_bytes=math.ceil(expert_total / num_experts),
                             other_bytes=layer.nbytes - expert_total))
    reason, quantized = _unroutable_reason(layers, num_experts)
    return MoeGeometry(num_experts=num_experts, top_k=top_k, layers=tuple(rows),
                       unroutable_reason=reason, priced_on_paper=quantized)


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


# ---- routing: the chance a step touches each expert ------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LayerRouting:
    """Per expert of one layer: the share of tokens routed to it (each token picks top_k, so they sum to top_k)."""

    index: int
    shares: tuple[float, ...]
    #: the tokens a trace counted the shares over; None: shares known exactly (uniform routing)
    num_counted_tokens: int | None = None

    def touched(self, num_tokens: int) -> tuple[float, ...]:
        """Per expert, the chance a step of ``num_tokens`` independently routed tokens touches it."""
        return tuple(1 - (1 - min(p, 1.0)) ** num_tokens for p in self.shares)

    def expected_distinct(self, num_tokens: int) -> float:
        """Expected distinct experts a step of ``num_tokens`` tokens touches."""
        return math.fsum(self.touched(num_tokens))

    def hottest(self, num_resident: int) -> tuple[int, ...]:
        """The ``num_resident`` experts most tokens route to (ties: the lower id), ascending."""
        order = sorted(range(len(self.shares)), key=lambda e: (-self.shares[e], e))
        return tuple(sorted(order[:num_resident]))

    def hit_rate(self, resident: tuple[int, ...]) -> float:
        """Share of routed (token, expert) pairs that resident experts serve."""
        total = math.fsum(self.shares)
        return math.fsum(self.shares[e] for e in resident) / total if total else 0.0

    def expected_fetched(self, resident: tuple[int, ...], num_tokens: int) -> float:
        """Expected distinct experts a step touches that are not resident (each crosses the link once)."""
        kept = set(resident)
        return math.fsum(p for e, p in enumerate(self.touched(num_tokens)) if e not in kept)

    def out_of_sample(self, resident: tuple[int, ...], num_tokens: int) -> tuple[float, float]:
        """(hit rate, expected fetched experts) of the ``resident`` experts chosen as the hottest by these
        shares, on steps of ``num_tokens`` tokens the trace did not see: the counted figures less the optimism of
        choosing by the same counts (planner.model.selection_bias). Exact shares (uniform routing) need none."""
        hit, fetched = self.hit_rate(resident), self.expected_fetched(resident, num_tokens)
        if self.num_counted_tokens is None:
            return hit, fetched
        optimism = self._optimism
        hit -= optimism.hit_rate_gap(len(resident), num_tokens)
        fetched -= optimism.fetched_gap(len(resident), num_tokens)
        # a step fetches each non-resident expert at most once, however optimistic the counts were
        return min(1.0, max(0.0, hit)), min(float(len(self.shares) - len(resident)), max(0.0, fetched))

    @functools.cached_property
    def _optimism(self) -> SelectionOptimism:
        counts = tuple(round(share * self.num_counted_tokens) for share in self.shares)
        return SelectionOptimism(counts=counts, num_tokens=self.num_counted_tokens)


def uniform_routing(geometry: MoeGeometry) -> tuple[LayerRouting, ...]:
    """Every expert equally likely: p_e = top_k / num_experts in every MoE layer."""
    share = geometry.top_k / geometry.num_experts
    return tuple(LayerRouting(index=layer.index, shares=(share,) * geometry.num_experts) for layer in geometry.layers)


def expected_distinct_uniform(num_experts: int, top_k: int, num_tokens: int) -> float:
    """E(1 - (1 - k/E)^B): expected distinct experts B uniformly routed tokens touch."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


# ---- residency and the routed step ----------------------------------------------------------------------------


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
    #: next-layer prefetch from a trace's per-expert prediction statistics: this layer's hit and ahead shares of
    #: its own non-resident experts' routed assignments (ExpertPrediction.shares); None: the placement's shares
    prefetch_hit_share: float | None = None
    prefetch_ahead_share: float | None = None

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
    #: layer's prefetch writes the other)
    fetch_buffer_bytes: int
    staging_buffer_bytes: int
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


@dataclass(frozen=True, kw_only=True)
class ExpertPrediction:
    """One predicted layer's next-layer prediction, per expert and rank, from a routing trace: enough to price a
    prefetch for any resident set. Under skew the hot experts are resident and predicted well, so what a
    prefetch saves depends on the cold (non-resident) experts' predictions alone."""

    #: per expert, the tokens routed to it (the trace's counts)
    counts: tuple[int, ...]
    #: per expert, per rank: the tokens whose prediction at that rank was this expert and that the layer then
    #: routed to it
    hits: tuple[tuple[int, ...], ...]
    #: per expert, per rank: the tokens whose prediction at that rank was this expert
    predicted: tuple[tuple[int, ...], ...]

    def _cold(self, resident: tuple[int, ...]) -> list[int]:
        kept = set(resident)
        return [e for e in range(len(self.counts)) if e not in kept]

    def shares(self, resident: tuple[int, ...], depth: int) -> tuple[float, float]:
        """(hit share, ahead share) of a depth-``depth`` prefetch as shares of the non-resident experts' routed
        assignments (what prefetch_shares gives from a per-rank curve): the non-resident experts' hits at ranks
        1..depth, and their predictions there (hits and wasted: a resident expert predicted is not gathered).
        (0, 0) where no assignment routes to a non-resident expert: nothing to fetch."""
        cold = self._cold(resident)
        routed = sum(self.counts[e] for e in cold)
        if not routed:
            return 0.0, 0.0
        return (sum(sum(self.hits[e][:depth]) for e in cold) / routed,
                sum(sum(self.predicted[e][:depth]) for e in cold) / routed)

    def cold_rank_counts(self, resident: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """(per rank the non-resident experts' hits, per rank their predictions, their routed assignments)."""
        cold = self._cold(resident)
        top_k = len(self.hits[0]) if self.hits else 0
        return (tuple(sum(self.hits[e][rank] for e in cold) for rank in range(top_k)),
                tuple(sum(self.predicted[e][rank] for e in cold) for rank in range(top_k)),
                sum(self.counts[e] for e in cold))


def default_rank_accuracy(top_k: int, mean: float = PREFETCH_ACCURACY) -> tuple[float, ...]:
    """The default per-rank prediction accuracy for a top-``top_k`` router: MEASURED_RANK_ACCURACY read at each
    rank's relative position ((rank + 1/2) / k, linear between the measured ranks' positions), scaled so the
    ranks average ``mean``, clipped to [0, 1]; one rank: the mean."""
    if top_k == 1:
        return (mean,)
    measured = MEASURED_RANK_ACCURACY
    positions = [(rank + 0.5) / len(measured) for rank in range(len(measured))]

    def at(position: float) -> float:
        if position <= positions[0]:
            return measured[0]
        if position >= positions[-1]:
            return measured[-1]
        upper = next(i for i, p in enumerate(positions) if p >= position)
        share = (position - positions[upper - 1]) / (positions[upper] - positions[upper - 1])
        return measured[upper - 1] + share * (measured[upper] - measured[upper - 1])

    shape = [at((rank + 0.5) / top_k) for rank in range(top_k)]
    scale = mean * top_k / math.fsum(shape)
    return tuple(min(1.0, max(0.0, a * scale)) for a in shape)


def prefetch_shares(rank_accuracy: tuple[float, ...], depth: int) -> tuple[float, float]:
    """(hit share, ahead share) of prefetching the top ``depth`` ranks of each token's predicted k, as shares of
    the routed, non-resident experts a step fetches: the ranks' mean accuracy x depth / k of them were predicted
    right (hits), depth / k of them cross the link ahead (hits and wasted). A token's k routed experts are
    distinct, so at one sequence the shares are exact in expectation; with more, experts shared by tokens make
    them an approximation."""
    top_k = len(rank_accuracy)
    if not 0 <= depth <= top_k:
        raise ValueError(f"prefetch depth {depth} is not from 0 to top_k {top_k}")
    return math.fsum(rank_accuracy[:depth]) / top_k, depth / top_k


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


def layer_shares(row, hit: float | None, ahead: float) -> tuple[float | None, float]:
    """A routed layer's (hit, ahead) prefetch shares: its own where a trace's per-expert figures gave them
    (``row.prefetch_hit_share``, ``row.prefetch_ahead_share``: a RoutedLayer or a plan's experts.layers row), else
    the placement's ``hit`` and ``ahead`` (hit None: no prefetch, whatever the row holds)."""
    if hit is None or row.prefetch_hit_share is None:
        return hit, ahead
    return row.prefetch_hit_share, row.prefetch_ahead_share


def fetch_weighted_shares(rows, hit: float, ahead: float) -> tuple[float, float]:
    """(hit, ahead) of a step's predicted ``rows`` (every routed layer but the first) weighted by their expected
    fetched bytes, each row's own shares or ``hit`` and ``ahead`` (layer_shares); ``hit`` and ``ahead`` where the
    rows fetch nothing. One rule for the planner's placement and the plan read back."""
    weight = math.fsum(row.expected_fetched_bytes for row in rows)
    if not weight:
        return hit, ahead
    shares = [(layer_shares(row, hit, ahead), row.expected_fetched_bytes) for row in rows]
    return (math.fsum(row_hit * nbytes for (row_hit, _), nbytes in shares) / weight,
            math.fsum(row_ahead * nbytes for (_, row_ahead), nbytes in shares) / weight)


def wasted_prefetch_bytes(placement: RoutedPlacement) -> float:
    """Bytes a decode step's predictions gather that the step does not route to: per predicted layer (every
    routed layer but the first), (ahead - hit) x its routed, non-resident bytes; 0 without prefetch."""
    if placement.prefetch_accuracy is None:
        return 0.0
    hit, ahead = placement.prefetch_accuracy, placement.prefetch_ahead_share
    return math.fsum((row_ahead - row_hit) * row.expected_fetched_bytes for row in placement.layers[1:]
                     for row_hit, row_ahead in (layer_shares(row, hit, ahead),))


def routed_fetch_bytes_per_s(h2d_bytes_per_s: float) -> float:
    """The routed gather's rate: the copy engine's derated by ROUTED_FETCH_EFFICIENCY."""
    return h2d_bytes_per_s * ROUTED_FETCH_EFFICIENCY


def fixed_routed_bytes(geometry: MoeGeometry, layer_total_bytes: tuple[int, ...], non_layer_bytes: int,
                       num_tokens: int, prefetch: bool = False) -> tuple[int, int, int]:
    """(weight bytes before resident experts, fetch buffer bytes, staging buffer bytes) of an all-routed
    placement: everything but the routed experts, a fetch buffer of fetch_slots experts for decode (two sets
    with ``prefetch``), one staging buffer of num_experts experts for prefill chunks."""
    expert_total = sum(layer.expert_bytes * geometry.num_experts for layer in geometry.layers)
    slot = geometry.max_expert_bytes
    fetch_buffer = geometry.fetch_slots(num_tokens) * slot * (2 if prefetch else 1)
    staging = geometry.num_experts * slot
    return non_layer_bytes + sum(layer_total_bytes) - expert_total + fetch_buffer + staging, fetch_buffer, staging


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
                     h2d_bytes_per_s: float, prefetch_accuracy: float | None = None) -> RoutedPlacement | None:
    """The all-routed placement with the most resident experts whose weights fit ``weight_limit_bytes`` (before
    the arena's slack), for steps of ``num_tokens`` tokens; None when even no resident expert fits.
    ``prefetch_accuracy``: next-layer prefetch with that accuracy (two slot sets); None: none."""
    prefetch = prefetch_accuracy is not None
    base, fetch_buffer, staging = fixed_routed_bytes(geometry, layer_total_bytes, non_layer_bytes, num_tokens,
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
        rows.append(RoutedLayer(index=layer.index, resident=ids, expected_fetched_bytes=fetched,
                                hit_rate=hit_rate, fetch_ms=1e3 * fetched / rate, expert_bytes=layer.expert_bytes))
    # the runtime pins every expert of a routed layer, resident ones too: the loader writes whole fused params,
    # and a prefill chunk copies the layer's experts from one place (runtime.routed_experts)
    host = sum(layer.expert_bytes * geometry.num_experts for layer in geometry.layers)
    return RoutedPlacement(layers=tuple(rows), fetch_slots=geometry.fetch_slots(num_tokens),
                           weight_bytes=base + resident_bytes, fetch_buffer_bytes=fetch_buffer,
                           staging_buffer_bytes=staging, host_pinned_bytes=host, prefetch_accuracy=prefetch_accuracy)


def prefetch_layer_stall_ms(compute_ms: float, fetch_ms: float, accuracy: float | None, predicted: bool,
                            ahead_share: float = 1.0, expert_ms: float | None = None,
                            num_slots: int | None = None, compute_slowdown: float = 0.0,
                            machinery_ms: float = 0.0) -> float:
    """What a routed layer waits for its experts in a decode step. Without a prediction (no prefetch, or the
    first routed layer: nothing before it predicts it), the whole fetch, after its router. With one, the
    previous routed layer's prefetch of the predicted experts (as many as the step routes to: ``fetch_ms`` of
    link, the hits and the wasted ones alike) overlaps one layer's compute (the rest of the previous layer, this
    layer's attention and router), then the misses, (1 - accuracy) of the fetch, after the router:
    max(0, fetch - compute) + (1 - accuracy) x fetch. The misses and the next layer's prefetch share the link
    (the runtime starts that prefetch as the layer's router finishes), so a link-bound step carries, per
    predicted layer, its routed bytes and the wasted ones back to back.

    With a prefetch depth m < k (``ahead_share`` = m / k of the fetch's bytes gathered ahead, ``accuracy`` the
    hits among them as a share of the fetch: planner.model.experts.prefetch_shares): max(0, ahead x fetch - compute) +
    (1 - accuracy) x fetch. A rank whose prediction rides in the compute's shadow only helps; beyond it, a link-
    bound step pays a rank's wasted bytes in full and gains nothing from its hits (they would have crossed after
    the router anyway), so the best depth fills one layer's compute with the most accurate ranks.

    ``expert_ms`` (one expert's fetch) and ``num_slots`` (the distinct experts a step can route a layer to,
    min(tokens x k, E)): the step's fetch is a whole number N of experts, not its mean. A batch-1 step fetches 0
    to 4 experts a layer where the mean is 1.3, and the part of the prefetch beyond one layer's compute is
    convex in N, so the step waits E[max(0, ahead x N x expert - compute)], over N ~ Binomial(num_slots,
    mean / num_slots), more than the same at the mean (without them: at the mean).

    ``compute_slowdown`` s: the compute the prefetch overlaps runs (1 + s) slower (GATHER_COMPUTE_SLOWDOWN), so a
    prefetch X shorter than the compute c costs s x X, and a longer one max(X - c, s x c): a link-bound layer
    hides the slower compute behind the link. ``machinery_ms``: the predicting layer's own cost
    (PREFETCH_MACHINERY_MS). Both 0 by default: the plan passes the measured figures (planned_layer_stall_ms)."""
    if accuracy is None or not predicted:
        return fetch_ms
    if expert_ms and num_slots:
        beyond = expected_excess_ms(ahead_share * expert_ms, compute_ms, fetch_ms / expert_ms, num_slots,
                                    compute_slowdown)
    else:
        beyond = _overlap_excess_ms(ahead_share * fetch_ms, compute_ms, compute_slowdown)
    return beyond + (1 - accuracy) * fetch_ms + machinery_ms


def planned_layer_stall_ms(compute_ms: float, fetch_ms: float, accuracy: float | None, predicted: bool,
                           ahead_share: float = 1.0, expert_ms: float | None = None,
                           num_slots: int | None = None) -> float:
    """prefetch_layer_stall_ms with a prefetch's measured costs beside its bytes: the compute it slows
    (GATHER_COMPUTE_SLOWDOWN) and its machinery (PREFETCH_MACHINERY_MS). What a plan, show and the benchmarks
    price."""
    return prefetch_layer_stall_ms(compute_ms, fetch_ms, accuracy, predicted, ahead_share, expert_ms, num_slots,
                                   GATHER_COMPUTE_SLOWDOWN, PREFETCH_MACHINERY_MS)


def _overlap_excess_ms(prefetch_ms: float, compute_ms: float, compute_slowdown: float) -> float:
    """What a layer adds to its compute when a prefetch of ``prefetch_ms`` overlaps it and slows it by
    ``compute_slowdown``: s x X under the compute, max(X - c, s x c) beyond it."""
    if prefetch_ms < compute_ms:
        return compute_slowdown * prefetch_ms
    return max(prefetch_ms - compute_ms, compute_slowdown * compute_ms)


@functools.lru_cache(maxsize=4096)  # a pure function the searches call with the same layers' figures again and again
def expected_excess_ms(ms_per_expert: float, compute_ms: float, mean_experts: float, num_slots: int,
                       compute_slowdown: float = 0.0) -> float:
    """E[excess(N x ms_per_expert)] for N ~ Binomial(num_slots, mean_experts / num_slots), excess the prefetch's
    part beyond its compute window (_overlap_excess_ms; without a slowdown, max(0, X - compute))."""
    if ms_per_expert <= 0.0 or mean_experts <= 0.0:
        return 0.0
    p = min(1.0, mean_experts / num_slots)
    if p >= 1.0:
        return _overlap_excess_ms(num_slots * ms_per_expert, compute_ms, compute_slowdown)
    # without a slowdown only the counts that outlast the window cost anything
    first = 1 if compute_slowdown else math.floor(compute_ms / ms_per_expert) + 1
    if first > num_slots:
        return 0.0
    return math.fsum(pmf * _overlap_excess_ms(count * ms_per_expert, compute_ms, compute_slowdown)
                     for count, pmf in binomial_terms(num_slots, p, first))


#: binomial terms smaller than this are left out: a step's excess is at most num_slots x one expert's fetch
#: (under a second), so what they carry is below 1e-12 ms
NEGLIGIBLE_PMF = 1e-16


def binomial_terms(trials: int, p: float, lowest: int) -> list[tuple[int, float]]:
    """(count, P[N = count]) for N ~ Binomial(trials, p), counts from ``lowest`` up, those whose probability is
    not negligible: the mode's from its logarithm, its neighbours by the ratio of consecutive terms (no
    log-gamma per term, the planner's inner loop at large batches), out to where the terms vanish."""
    log_q = math.log1p(-p)
    mode = min(trials, max(lowest, math.floor((trials + 1) * p)))
    mode_pmf = math.exp(math.lgamma(trials + 1) - math.lgamma(mode + 1) - math.lgamma(trials - mode + 1)
                        + mode * math.log(p) + (trials - mode) * log_q)
    odds = p / (1 - p)
    terms = [(mode, mode_pmf)]
    pmf = mode_pmf
    for count in range(mode, trials):  # up: P[k + 1] = P[k] (n - k) / (k + 1) x p / q
        pmf *= (trials - count) / (count + 1) * odds
        if pmf < NEGLIGIBLE_PMF:
            break
        terms.append((count + 1, pmf))
    pmf = mode_pmf
    for count in range(mode, lowest, -1):  # down: P[k - 1] = P[k] k / (n - k + 1) x q / p
        pmf *= count / (trials - count + 1) / odds
        if pmf < NEGLIGIBLE_PMF:
            break
        terms.append((count - 1, pmf))
    return terms


def non_resident_bytes(geometry: MoeGeometry, placement: RoutedPlacement) -> dict[int, int]:
    """Per routed layer, the bytes of its non-resident experts: what a prefill chunk copies whole."""
    return {layer.index: (geometry.num_experts - len(row.resident)) * layer.expert_bytes
            for layer, row in zip(geometry.layers, placement.layers)}
