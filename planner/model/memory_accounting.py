"""GPU and host memory besides the weights: the KV cache, activations, CUDA graph pool and context, the adapters'
slots and pool, and the checks that a plan's total fits the GPU and its pinned bytes the host."""

import math
from dataclasses import dataclass, replace

from planner.model.adapters import slot_bytes_of
from planner.model.cost import Workload
from planner.errors import InfeasibleError, MeasuredOutOfMemoryError
from planner.make.inputs import workload_of
from planner.make.model_record import Model
from planner.plan.schema import Inputs
from planner.search.groups import Choice
from planner.search.serving import (CUDA_CONTEXT_BYTES, DECODE_ROOM_TOKENS, PINNED_PAGE_TABLE_SHARE,
                                    RUNTIME_ALLOCATOR_BYTES, OtherBytes, nccl_bytes_or_default)
from planner.units import format_bytes

#: a captured decode step's pool over its activation peak (planner.model.activations, per layer: the step's tensors
#: die layer by layer and the pool reuses their blocks within the capture). The H100 conformance sweeps of 2026-11-28
#: (benchmarks/2026-11-28-conformance-*h100.json, torch 2.11, transformers 5.17) bound the pool from above: run's
#: capture starts from the cache alone (its warm-up's blocks released), so the pool and the warm-up stream's
#: workspace fit within the fill step's reserved growth plus the capture's: 0.99-1.02x the estimated step at 4 and 7
#: sequences of Mistral (32 / 8 heads), Mixtral, Qwen3-MoE and DeepSeek-V2-Lite shapes, 1.16-1.28x for Qwen3-FP8
#: and Gemma-3. The 1.75 booked before over-booked Mistral's 7 sequences by 510 MB (peak 0.860 of predicted).
GRAPH_POOL_FACTOR = 1.25
#: what every capture adds beside the step's tensors: the cuBLAS workspace of the warm-up stream the capture runs
#: on (32 MiB with CUBLAS_WORKSPACE_CONFIG=:4096:8, runtime.graph.warm_up_stream) and the private pool's own
#: segments, which cannot borrow the shared pool's (2 MiB small-block segments, a 20 MiB one for 1-10 MB blocks):
#: those sweeps' capture grew the reserved peak by 36-38 MiB at one sequence and 56-58 MiB for MoE steps at 4-15
#: sequences (Qwen2-MoE, OLMoE), whose pools the activation estimate puts at 2-7 MB
GRAPH_CAPTURE_BYTES = 58 * 2**20
#: a prefill chunk replayed from a CUDA graph (Model.chunk_graphed) over its eager activation peak: its capture
#: allocates in a private pool that cannot borrow the shared pool's segments, which the eager chunk reuses from the
#: cache fill's, and it keeps every segment the capture's allocation order needed. The H200 sweep of 2026-11-28
#: (benchmarks/2026-11-28-conformance-h200.md) read the chunk phase's reserved peak 3-268 MiB over the plans that
#: booked the eager peak, up to 0.84x the chunk's own activations (Qwen3-FP8's dequantized weights, DeepSeek-V2-Lite's
#: grouped_mm experts), and one Gemma-3 plan ran out of memory there at its cap
CHUNK_GRAPH_FACTOR = 2.0


def serving_other_bytes(model: Model, concurrency: int, gpu_memory_bytes: int | None = None) -> OtherBytes:
    """GPU memory besides the weights when serving ``concurrency`` sequences of up to --context tokens: their KV
    cache, the activation peak (a prefill chunk's, or an eager decode step's when larger), a graphed decode
    step's pool, and the CUDA context. The decode step is the last one, over a full static cache. With
    --measure, steps are measured within ``gpu_memory_bytes`` (the plan's GPU), and not at all where the KV cache
    alone overflows it: a measurement never allocates past the GPU memory the plan is made for."""
    inputs = model.inputs
    # run's static cache keeps room past the context for the steps it times; engines allocate the context alone
    cache_tokens = inputs.context + DECODE_ROOM_TOKENS
    kv_bytes = model.kv.cache_bytes(num_sequences=concurrency, context_tokens=cache_tokens, kv_dtype=inputs.kv_dtype)
    measured = model.measured_activations and gpu_memory_bytes is not None
    try:
        if measured and kv_bytes + outside_allocator_bytes(model) > gpu_memory_bytes:
            raise MeasuredOutOfMemoryError("the KV cache alone")  # nothing to measure: it cannot fit
        decode = workload_of(concurrency, concurrency, inputs.context)
        chunk = workload_of(inputs.chunk, 1, 0)
        decode_bytes = model.activations(decode, static_cache_tokens=cache_tokens, limit_bytes=gpu_memory_bytes)
        chunk_bytes = model.activations(chunk, limit_bytes=gpu_memory_bytes)
        captures = MeasuredCaptures(
            decode_bytes=model.graph_reserve(decode, gpu_memory_bytes) if inputs.cuda_graph else None,
            chunk_bytes=model.graph_reserve(chunk, gpu_memory_bytes) if model.chunk_graphed else None)
    except MeasuredOutOfMemoryError:
        if not measured:
            raise
        return replace(other_bytes(model, kv_bytes, gpu_memory_bytes, gpu_memory_bytes, inputs.cuda_graph,
                                   model.chunk_graphed), measured_out_of_memory=True)
    other = other_bytes(model, kv_bytes, decode_bytes, chunk_bytes, inputs.cuda_graph, model.chunk_graphed,
                        captures)
    # the adapters' slots are GPU memory at every concurrency: one per sequence by default, so they grow with it
    return replace(other, adapter_bytes=model.adapter_slots(concurrency) * slot_bytes_of(model.adapters))


@dataclass(frozen=True)
class MeasuredCaptures:
    """make --measure's CUDA-graph captures (Model.graph_reserve): what capturing the decode step and the prefill
    chunk held at their peaks, in bytes (None: not graphed, or not measured)."""

    decode_bytes: int | None = None
    chunk_bytes: int | None = None


def other_bytes(model: Model, kv_bytes: int, decode_bytes: int, chunk_bytes: int, graphed: bool,
                chunk_graphed: bool = False, captures: MeasuredCaptures = MeasuredCaptures()) -> OtherBytes:
    """The KV cache, the larger activation peak (an eager decode step's or a prefill chunk's, or where a serving
    plan's chunk is graphed, ``chunk_graphed``, its capture's) with the runtime's workspaces and allocator
    rounding, a graphed decode step's pool and what is held outside the allocator. A capture is booked as
    ``captures`` measured it, else from the eager peak (CHUNK_GRAPH_FACTOR, graph_pool_bytes). The graphed chunk's
    share (``chunk_graph_extra_bytes``) is what a routed placement, whose chunk stays eager
    (planner.make.assemble), does not hold (OtherBytes.with_eager_chunk). A weights plan's step is never a graphed
    chunk (make refuses --cuda-graph for a prefill step)."""
    eager_bytes = max(chunk_bytes, 0 if graphed else decode_bytes)
    transient_bytes = eager_bytes
    if chunk_graphed:
        captured = captures.chunk_bytes
        transient_bytes = max(math.ceil(CHUNK_GRAPH_FACTOR * chunk_bytes) if captured is None else captured,
                              eager_bytes)
    pool_bytes = 0
    if graphed:
        pool_bytes = graph_pool_bytes(decode_bytes) if captures.decode_bytes is None else captures.decode_bytes
    return OtherBytes(kv_cache_bytes=kv_bytes, activation_bytes=transient_bytes + RUNTIME_ALLOCATOR_BYTES,
                      cuda_graph_pool_bytes=pool_bytes, cuda_context_bytes=outside_allocator_bytes(model),
                      chunk_graph_extra_bytes=transient_bytes - eager_bytes)


def graph_pool_bytes(decode_bytes: int) -> int:
    """What a captured decode step whose eager activation peak is ``decode_bytes`` holds beyond the allocator's
    other blocks: its pool (GRAPH_POOL_FACTOR) and the capture's fixed cost (GRAPH_CAPTURE_BYTES)."""
    return math.ceil(GRAPH_POOL_FACTOR * decode_bytes) + GRAPH_CAPTURE_BYTES


def outside_allocator_bytes(model: Model) -> int:
    """GPU memory the process holds outside torch's allocator: the CUDA context, loaded kernels and library state
    (make --measure's figure, else the profile's, else CUDA_CONTEXT_BYTES), the driver's mappings of the host
    memory the plan may page-lock (booked for every byte of the checkpoint: what a placement pins is chosen
    after this is set aside), and NCCL's buffers on a tensor-parallel rank (nccl_bytes_per_rank)."""
    context = model.profile.cuda_context_bytes
    context_bytes = CUDA_CONTEXT_BYTES if context is None else int(context.value)
    page_tables = math.ceil(model.checkpoint.total_bytes * PINNED_PAGE_TABLE_SHARE)
    return context_bytes + page_tables + (nccl_bytes_per_rank(model) if model.inputs.tp > 1 else 0)


def nccl_bytes_per_rank(model: Model) -> int:
    """What NCCL holds outside torch's allocator on a tensor-parallel rank: measured_nccl_bytes, else
    NCCL_BYTES_PER_RANK (measured on two H200s by scripts/experiments/nccl_memory.py)."""
    return nccl_bytes_or_default(measured_nccl_bytes(model))


def measured_nccl_bytes(model: Model) -> int | None:
    """NCCL's buffers on a rank as measured on the local GPUs: by make --tp N --measure beside the all-reduce's
    timing (N ranks, what the plan runs), else the profile's figure (calibrate's); None: not measured."""
    link = model.all_reduce_link if model.inputs.tp > 1 else None
    if link is not None and link.nccl_bytes is not None:
        return link.nccl_bytes
    figure = model.profile.nccl_bytes
    return None if figure is None else int(figure.value)


def weights_plan_other_bytes(model: Model, workload: Workload) -> OtherBytes | None:
    """A weights-only plan's other GPU memory, its one step run as the runtime runs it (a decode plan over a
    static cache with run's room, a prefill without one); None when the KV cache is not modelled."""
    if model.kv is None:
        return None
    tokens_per_sequence = workload.tokens_per_step // workload.sequences_per_step
    # a decode plan (one token per sequence after a context) runs over run's static cache; any other step is a
    # prefill (a chunk after a context included) over a cache that grows to hold it
    decode = workload.context_tokens > 0 and tokens_per_sequence == 1
    cache_tokens = workload.context_tokens + (DECODE_ROOM_TOKENS if decode else tokens_per_sequence)
    step_bytes = model.activations(workload, static_cache_tokens=cache_tokens if decode else None)
    kv_bytes = model.kv.cache_bytes(num_sequences=workload.sequences_per_step, context_tokens=cache_tokens,
                                    kv_dtype=model.inputs.kv_dtype)
    return other_bytes(model, kv_bytes, step_bytes, 0 if decode else step_bytes, model.inputs.cuda_graph and decode)


def whole_gpu_budget(model: Model, workload: Workload, other: OtherBytes | None, gpu_memory: int) -> int:
    """With no --budget or --trigger: the ``gpu_memory`` the workload's KV cache, activations and CUDA context
    (``other``) leave the weights (the profile's memory less its reserve where the KV cache is not modelled)."""
    if other is None:
        return model.profile.weight_limit_bytes
    budget = gpu_memory - other.total_bytes
    if budget <= 0:
        raise InfeasibleError(
            f"the KV cache and activations of {workload.sequences_per_step} sequence(s) at context "
            f"{workload.context_tokens} need {format_bytes(other.total_bytes)}, all of the GPU's memory; plan fewer "
            "sequences or a shorter context")
    return budget


def check_gpu_total(choice: Choice, other: OtherBytes, workload: Workload, gpu_memory: int) -> None:
    """The weights with the KV cache, adapter slots, activations and CUDA context must fit the GPU."""
    if choice.gpu_bytes + other.total_bytes <= gpu_memory:
        return
    adapters = f"the adapter slots ({format_bytes(other.adapter_bytes)}) " if other.adapter_bytes else ""
    raise InfeasibleError(
        f"the weights ({format_bytes(choice.gpu_bytes)}) with the KV cache ({format_bytes(other.kv_cache_bytes)}) "
        f"{adapters}and activations "
        f"({format_bytes(other.activation_bytes + other.cuda_graph_pool_bytes)}) of "
        f"{workload.sequences_per_step} sequence(s) at context {workload.context_tokens} and the CUDA context need "
        f"{format_bytes(choice.gpu_bytes + other.total_bytes)}, more than the {format_bytes(gpu_memory)} of GPU "
        "memory; lower --budget, or give --concurrency to let the planner divide the GPU"
    )


def check_adapter_slots(model: Model, num_slots: int, free_bytes: int, unchecked: bool) -> None:
    """The adapters' slots must fit the GPU memory the weights leave (the caller checks it with the KV cache)."""
    need = num_slots * slot_bytes_of(model.adapters)
    if need and need > free_bytes:
        what = "the budget and the KV cache, activations and CUDA context leave" if not unchecked \
            else "the budget leaves"
        raise InfeasibleError(
            f"{num_slots} adapter slot(s) of {format_bytes(slot_bytes_of(model.adapters))} need {format_bytes(need)}, "
            f"more than the {format_bytes(max(0, free_bytes))} of GPU memory {what}; give fewer --adapter-slots or a "
            "smaller --budget"
        )


def adapter_host_bytes(model: Model) -> int:
    """Every adapter is pinned in host memory (the slots hold copies)."""
    return sum(adapter.total_bytes for adapter in model.adapters)


class HostLimit:
    """The host memory a plan's placements must pin within (None: not checked)."""

    def __init__(self, limit_bytes: int | None, extra_bytes: int):
        self.limit_bytes = limit_bytes
        #: pinned besides the weights (the adapters' pool)
        self.extra_bytes = extra_bytes
        #: pinned bytes of the placements refused for the host
        self.refused_pinned_bytes: list[int] = []

    def within(self, choice: Choice | None) -> Choice | None:
        """``choice``, or None where it pins more than the host holds: the concurrency then does not fit, and the
        search moves to one that keeps more on the GPU (auto never fails where a narrower range succeeds)."""
        if choice is None or self.limit_bytes is None:
            return choice
        pinned = choice.host_pinned_bytes + self.extra_bytes
        if pinned > self.limit_bytes:
            self.refused_pinned_bytes.append(pinned)
            return None
        return choice

    def check(self, choice: Choice, inputs: Inputs, warnings: list[str]) -> None:
        """The chosen placement (with the adapters' pool) must pin within the host; where the host is not
        known, one warning says how much it pins."""
        pinned = choice.host_pinned_bytes + self.extra_bytes
        check_host_memory(pinned, self.limit_bytes, inputs)
        if self.limit_bytes is None and choice.host_pinned_bytes:
            warnings.append(_host_not_checked(pinned))


def _host_not_checked(pinned_bytes: int) -> str:
    """The one line that says host memory was not checked (no --host-memory, no platform figure)."""
    return (f"host memory not checked: the plan pins {format_bytes(pinned_bytes)}; give --host-memory (or a "
            "profile with host_memory_bytes) to hold it to the host it runs on")


def check_host_memory(pinned_bytes: int, host_limit: int | None, inputs: Inputs) -> None:
    """The offloaded params must fit in the host memory they are pinned in."""
    if host_limit is None or pinned_bytes <= host_limit:
        return
    where = "--host-memory" if inputs.host_memory is not None else f"the {inputs.gpu} profile"
    raise InfeasibleError(
        f"the plan pins {pinned_bytes} bytes ({format_bytes(pinned_bytes)}) of host memory but {where} allows "
        f"{host_limit} bytes ({format_bytes(host_limit)}); keep more on the GPU (raise --budget), offload fewer "
        "params, split the model over more GPUs, or give --host-memory for a host with more"
    )
