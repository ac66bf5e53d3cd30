"""Serving plans: choose the decode concurrency and the weights' share of the GPU together.

At a decode concurrency of B sequences of up to C tokens, everything on the GPU but the weights is fixed by B:
the KV cache, the activation peak (the larger of a prefill chunk's and a decode step's), the CUDA-graph pool
that keeps a captured decode step's intermediates, and the CUDA context. What is left of the GPU is the
weights' budget, and the weight search (planner.search.groups) finds the fastest placement within it; the decode
step then yields B tokens per step time. Offloading more frees memory for more sequences, and a larger batch
makes each step long enough to hide the copies: the best B is the one with the most tokens/s, under an
optional per-token latency limit. "Offload nothing" is among the candidates wherever the whole model fits
beside the cache (the weight search returns the all-resident placement there), so the search weighs it too.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

from planner.model.cost import ComputeTimes
from planner.errors import InfeasibleError
from planner.search.groups import Choice
from planner.units import format_bytes, format_ms

#: GPU memory a process holds beyond its tensors where neither make --measure nor the profile measured it: the CUDA
#: context, the kernels CUDA loads as they are first launched, library handles (runtime.outside_memory's probe,
#: which calibrate and make --measure run, measures it on the local stack)
CUDA_CONTEXT_BYTES = 2**30
#: GPU memory the driver's mappings of page-locked host memory take, per byte registered: 8 MiB per 4 GiB registered
#: (1/512), whether huge-page advised or not, mapped into the device's address space or not, and for torch's
#: pin_memory alike (NVIDIA H200, torch 2.11 + CUDA 13, driver 580; scripts/experiments/outside_allocator_pinned.py)
PINNED_PAGE_TABLE_SHARE = 1 / 512
#: NCCL's buffers per rank with TP > 1, outside torch's allocator, measured on each of two NVLinked H200s (torch
#: 2.11, scripts/experiments/nccl_memory.py): 366 MiB when the process group binds its GPU, 474 MiB more at the
#: first collective and 2 MiB at a captured one, 842 MiB in all (NCCL_BUFFSIZE's default 4 MiB per channel and peer
#: is part of it). A make --tp plan's context figure holds it, and the engines' exports count it before their
#: start-up snapshot. A single GPU creates no communicator
NCCL_BYTES_PER_RANK = 842 * 2**20


def nccl_bytes_or_default(measured_bytes: int | None) -> int:
    """NCCL's buffers on a rank: the measured figure (a plan's hardware.nccl_bytes, a profile's or make --measure's),
    else NCCL_BYTES_PER_RANK."""
    return NCCL_BYTES_PER_RANK if measured_bytes is None else measured_bytes
#: what the allocator holds in a serving process beyond the planned tensors, booked with the activations: the cuBLAS
#: and cuBLASLt workspaces of the streams that run products (118-119 MiB allocated beyond the weights and KV cache
#: after loading, in every arm) and the rounding of a step's transient blocks into the allocator's segments (a
#: prefill chunk grew the reserve by up to 185 MB more than its planned peak, estimated or measured); the H100
#: conformance sweep of 2026-11-27, torch 2.11 + CUDA 13 (benchmarks/2026-11-27-conformance-h100.md)
RUNTIME_ALLOCATOR_BYTES = 320 * 2**20
#: cache entries run keeps past a weights-only decode plan's context (runtime.graph.DECODE_ROOM_TOKENS)
DECODE_ROOM_TOKENS = 64
#: concurrencies tried by ``--concurrency auto`` (and, clipped, by a range): powers of two and their midpoints
CONCURRENCY_GRID = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
MAX_CONCURRENCY = 4096
#: tokens/s closer than this share are a tie (the smaller concurrency wins: less memory, lower latency)
#: offloading must predict more than this share above the best all-resident point to be picked: the serving
#: benchmarks on the H100 measured predictions within -0.9% to +6.5% (dense, 2026-11-23) and -0.9% to +5.2% (MoE,
#: 2026-11-25); a gain of 0.2% (933 against 931 tokens/s) once moved 27 of 28 layers to the host
OFFLOAD_MARGIN_SHARE = 0.05
TOKENS_PER_S_TIE_SHARE = 1e-6


@dataclass(frozen=True, kw_only=True)
class OtherBytes:
    """GPU memory at one concurrency besides the weights."""

    kv_cache_bytes: int
    #: the larger of a prefill chunk's and (when not graphed) a decode step's activation peak, with the runtime's
    #: workspaces and the allocator's rounding (RUNTIME_ALLOCATOR_BYTES)
    activation_bytes: int
    #: a captured decode step's intermediates, kept in the graph's own pool (0 when not graphed)
    cuda_graph_pool_bytes: int
    #: CUDA context, library workspaces and allocator rounding: memory the process holds beyond tensors
    cuda_context_bytes: int
    #: LoRA adapters' GPU slots (planner.model.adapters; 0 without adapters)
    adapter_bytes: int = 0
    #: make --measure: a step measured within the plan's GPU memory did not fit it (or its KV cache alone does not),
    #: so nothing fits at this concurrency; the activations then stand at the whole GPU memory
    measured_out_of_memory: bool = False
    #: of activation_bytes, what a graphed prefill chunk's private pool adds over its eager peak
    #: (planner.model.memory_accounting.CHUNK_GRAPH_FACTOR): a placement whose chunk stays eager does not hold it
    chunk_graph_extra_bytes: int = 0

    def with_eager_chunk(self) -> "OtherBytes":
        """The same memory for a placement whose prefill chunk runs eagerly (routed experts)."""
        return replace(self, activation_bytes=self.activation_bytes - self.chunk_graph_extra_bytes,
                       chunk_graph_extra_bytes=0)

    @property
    def total_bytes(self) -> int:
        """All of it."""
        return (self.kv_cache_bytes + self.activation_bytes + self.cuda_graph_pool_bytes + self.cuda_context_bytes
                + self.adapter_bytes)


@dataclass(frozen=True, kw_only=True)
class ConcurrencyRange:
    """The concurrencies to consider: one (``--concurrency 64``), a range (``8..512``) or any (``auto``)."""

    low: int
    high: int

    def __post_init__(self):
        if not 1 <= self.low <= self.high <= MAX_CONCURRENCY:
            raise ValueError(f"concurrency must satisfy 1 <= low <= high <= {MAX_CONCURRENCY}")

    @property
    def fixed(self) -> bool:
        """One concurrency, not a search."""
        return self.low == self.high


@dataclass(frozen=True, kw_only=True)
class ServingPoint:
    """The best weight placement at one concurrency."""

    concurrency: int
    other: OtherBytes
    #: GPU bytes the weights may take at this concurrency
    weights_budget_bytes: int
    #: None when no placement fits the budget
    choice: Choice | None

    @property
    def step_ms(self) -> float | None:
        """Decode step time (per-token latency), or None when nothing fits."""
        return None if self.choice is None else self.choice.simulation.step_ms

    @property
    def tokens_per_s(self) -> float:
        """Decode tokens per second over all sequences (0 when nothing fits)."""
        return 0.0 if self.choice is None else 1e3 * self.concurrency / self.choice.simulation.step_ms

    @property
    def offloads(self) -> bool:
        """True when the placement moves any weights: whole layers, or a MoE model's routed experts."""
        return self.choice is not None and (bool(self.choice.offloaded) or self.choice.host_pinned_bytes > 0)

    @property
    def total_gpu_bytes(self) -> int:
        """Weights as placed plus everything else."""
        return self.other.total_bytes + (0 if self.choice is None else self.choice.gpu_bytes)


@dataclass(frozen=True, kw_only=True)
class ServingSearch:
    """Every concurrency evaluated, the pick, and the best plan that offloads nothing."""

    points: tuple[ServingPoint, ...]
    best: ServingPoint
    #: the most tokens/s with every weight resident (within the latency limit), None when it never fits
    no_offload: ServingPoint | None


def parse_concurrency(text: str) -> ConcurrencyRange:
    """``64``, ``8..512`` or ``auto`` (1 .. MAX_CONCURRENCY)."""
    text = str(text).strip().lower()
    if text == "auto":
        return ConcurrencyRange(low=1, high=MAX_CONCURRENCY)
    low_text, dots, high_text = text.partition("..")
    try:
        low = int(low_text)
        high = int(high_text) if dots else low
        return ConcurrencyRange(low=low, high=high)
    except ValueError:
        raise ValueError(f"--concurrency {text!r}: give a number of sequences (64), a range (8..512) or auto; "
                         f"each between 1 and {MAX_CONCURRENCY}") from None


def largest_fitting(low: int, high: int, fits: Callable[[int], bool]) -> int | None:
    """The largest B in [low, high] with fits(B), for fits that holds up to some B and not after; None if none."""
    if not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def candidate_concurrencies(wanted: ConcurrencyRange, *extremes: int | None) -> tuple[int, ...]:
    """The grid within the range, the range's ends, and the given extremes (largest fitting concurrencies)."""
    if wanted.fixed:
        return (wanted.low,)
    limit = max((b for b in extremes if b is not None), default=wanted.low)
    chosen = {b for b in CONCURRENCY_GRID if wanted.low <= b <= min(wanted.high, limit)}
    chosen.add(wanted.low)
    chosen.update(b for b in extremes if b is not None and wanted.low <= b <= wanted.high)
    return tuple(sorted(chosen))


def search_serving(
    *,
    wanted: ConcurrencyRange,
    gpu_memory_bytes: int,
    other_bytes_at: Callable[[int], OtherBytes],
    compute_at: Callable[[int], ComputeTimes],
    search_weights: Callable[[ComputeTimes, int, int], Choice | None],
    minimum_weight_bytes: int,
    resident_weight_bytes: int,
    weights_budget_bytes: int | None = None,
    max_tpot_ms: float | None = None,
    other_for: Callable[[int, Choice], OtherBytes] | None = None,
) -> ServingSearch:
    """The concurrency and placement with the most decode tokens/s that fit ``gpu_memory_bytes``.

    ``other_bytes_at(B)``: GPU bytes besides weights at concurrency B (grows with B); ``compute_at(B)``: layer
    times of a decode step of B sequences; ``search_weights(compute, budget, B)``: the fastest placement within
    ``budget`` GPU bytes at B sequences (a MoE model's: whole layers or routed experts), None if none fits;
    ``minimum_weight_bytes``/``resident_weight_bytes``: GPU bytes of the
    leanest placement and of all-resident weights; ``weights_budget_bytes``: a fixed share for the weights
    (``--budget``), else whatever the rest leaves; ``other_for(B, choice)``: the GPU bytes besides weights that
    ``choice`` holds at B, where a placement holds less than ``other_bytes_at(B)`` (a routed placement's eager
    prefill chunk; search_weights then gave it that room), its weights budget then the GPU's rest of it.
    """

    def budget_at(concurrency: int) -> int:
        left = gpu_memory_bytes - other_bytes_at(concurrency).total_bytes
        return left if weights_budget_bytes is None else (weights_budget_bytes if weights_budget_bytes <= left else -1)

    top = largest_fitting(wanted.low, wanted.high, lambda b: budget_at(b) >= minimum_weight_bytes)
    if top is None:
        raise InfeasibleError(_nothing_fits(wanted.low, gpu_memory_bytes, other_bytes_at(wanted.low),
                                            minimum_weight_bytes, weights_budget_bytes))
    top_resident = largest_fitting(wanted.low, top, lambda b: budget_at(b) >= resident_weight_bytes)
    points = []
    for concurrency in candidate_concurrencies(wanted, top, top_resident):
        budget = budget_at(concurrency)
        fits = budget >= minimum_weight_bytes
        choice = search_weights(compute_at(concurrency), budget, concurrency) if fits else None
        other = other_bytes_at(concurrency) if choice is None or other_for is None else other_for(concurrency, choice)
        if weights_budget_bytes is None:
            budget = gpu_memory_bytes - other.total_bytes
        points.append(ServingPoint(concurrency=concurrency, other=other, weights_budget_bytes=budget, choice=choice))
    placed = [p for p in points if p.choice is not None]
    if not placed:
        raise InfeasibleError(_nothing_fits(wanted.low, gpu_memory_bytes, other_bytes_at(wanted.low),
                                            minimum_weight_bytes, weights_budget_bytes))
    allowed = [p for p in placed if max_tpot_ms is None or p.step_ms <= max_tpot_ms]
    if not allowed:
        fastest = min(placed, key=lambda p: p.step_ms)
        raise InfeasibleError(
            f"no plan meets --max-tpot-ms {max_tpot_ms:g}: the fastest decode step that fits is "
            f"{format_ms(fastest.step_ms)} at {fastest.concurrency} sequences; raise the limit, shorten --context, "
            "or use a GPU with more memory or a faster link"
        )
    resident = [p for p in allowed if not p.offloads]
    no_offload = _best(resident) if resident else None
    return ServingSearch(points=tuple(points), best=_offload_only_past_margin(_best(allowed), no_offload),
                         no_offload=no_offload)


def _offload_only_past_margin(best: ServingPoint, no_offload: ServingPoint | None) -> ServingPoint:
    """The offloading pick only where it beats keeping every weight resident by more than OFFLOAD_MARGIN_SHARE:
    a smaller gain is inside the prediction's own error, and resident weights cost no host memory or link."""
    if no_offload is None or not best.offloads:
        return best
    return best if best.tokens_per_s > no_offload.tokens_per_s * (1 + OFFLOAD_MARGIN_SHARE) else no_offload


def _best(points: list[ServingPoint]) -> ServingPoint:
    """Most tokens/s; a near tie goes to the smaller concurrency."""
    top_tokens_per_s = max(p.tokens_per_s for p in points)
    return min((p for p in points if p.tokens_per_s >= top_tokens_per_s * (1 - TOKENS_PER_S_TIE_SHARE)),
               key=lambda p: p.concurrency)


def _nothing_fits(concurrency: int, gpu_memory_bytes: int, other: OtherBytes, minimum_weight_bytes: int,
                  weights_budget_bytes: int | None) -> str:
    if other.measured_out_of_memory:
        return (f"nothing fits {format_bytes(gpu_memory_bytes)} of GPU memory even at {concurrency} sequence(s): the "
                f"KV cache takes {format_bytes(other.kv_cache_bytes)} and a step measured on this GPU (make --measure) "
                "does not fit in what is left; shorten --context, use a smaller --chunk or --kv-dtype fp8, or give "
                "more --gpu-memory")
    weights = minimum_weight_bytes if weights_budget_bytes is None else weights_budget_bytes
    what = "the leanest weight placement" if weights_budget_bytes is None else "--budget"
    return (
        f"nothing fits {format_bytes(gpu_memory_bytes)} of GPU memory even at {concurrency} sequence(s): "
        f"{what} needs {format_bytes(weights)}, the KV cache {format_bytes(other.kv_cache_bytes)}, activations "
        f"{format_bytes(other.activation_bytes + other.cuda_graph_pool_bytes)} and the CUDA context "
        f"{format_bytes(other.cuda_context_bytes)}; shorten --context, use --kv-dtype fp8, offload more params, "
        "or use a GPU with more memory"
    )
