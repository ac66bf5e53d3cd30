"""``make --measure`` of a serving plan: a step's activation peak on the local GPU, decode and prefill, measured
within the plan's GPU memory and cached beside the layer times (runtime.measure builds the model the same way:
full depth, one layer of each kind with weights, the others aliases of it).
"""

import contextlib
import gc
import hashlib
import json
from dataclasses import dataclass

import torch
from torch import nn

from planner.errors import MeasuredOutOfMemoryError, UsageError
from planner.model.cost import Workload
from planner.model.layout import ModelLayout
from planner.source.checkpoint import Checkpoint
from runtime.graph import cache_argument
from runtime.measure import (alias_module, build_measure_model, cache_key, load_cache, measured_config, measured_kinds,
                             save_cache, set_layers)


@dataclass(frozen=True, kw_only=True)
class ActivationMeasurement:
    """What one step of the workload took on the GPU beyond the weights, the KV cache and fixed buffers."""

    #: peak bytes allocated during the step above what stayed allocated after it: the step's transient tensors
    activation_bytes: int
    #: bytes allocated during the step that stay (when graphed: the cuBLAS workspaces of the warm-up and capture
    #: streams, which PyTorch allocates through its allocator and keeps)
    persistent_bytes: int
    #: the caching allocator's reserved peak during the step beyond its reserve before: for a captured step (a
    #: decode step or a prefill chunk, warm-up included) what capturing it holds at its peak, the graph's private
    #: pool, the warm-up stream's workspace and the warm-up's blocks before they were released, as run's capture
    #: holds them (runtime.graph.warm_up_and_capture)
    reserved_bytes: int


def activation_model(config: dict, kinds: tuple[tuple[int, ...], ...], stack: str, device: str = "cuda") -> nn.Module:
    """The model with one layer of each kind, renumbered 0..k-1 (random weights, in the dtype run loads it in).

    The activation peak falls inside one layer (plus step-wide tensors that do not grow with depth), so the
    other layers are left out: neither their weights nor their KV cache are allocated.
    """
    model = build_measure_model(config, kinds, stack, device)
    language = model.config.get_text_config()
    layers = model.get_submodule(stack)
    representatives = [kind[0] for kind in kinds]
    kept = [alias_module(layers[index], new_index) for new_index, index in enumerate(representatives)]
    layer_types = getattr(language, "layer_types", None)
    set_layers(model, stack, kept)
    language.num_hidden_layers = len(kept)
    if layer_types:
        language.layer_types = [layer_types[index] for index in representatives]
    return model


def _reset_peak(device: torch.device) -> tuple[int, int]:
    """Start of a measured step: (allocated, reserved) now, peak statistics reset.

    cuBLAS keeps a workspace per stream in PyTorch's allocator; a capture may free or add some. Freed here, the
    step allocates the ones it uses, they stay, and ``_measured_since`` counts them as persistent, not as
    activations, whichever streams the step runs on.
    """
    torch.cuda.synchronize(device)
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    # the freed workspaces' blocks released too: left cached, a capture would reuse them and measure less than
    # run's process grows by, which allocates its workspaces during its fill and capture (H200: 96 MiB less at 16
    # sequences of a Qwen3-8B shape)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def _measured_since(base: tuple[int, int], device: torch.device) -> ActivationMeasurement:
    torch.cuda.synchronize(device)
    after = torch.cuda.memory_allocated(device)
    return ActivationMeasurement(activation_bytes=torch.cuda.max_memory_allocated(device) - after,
                                 persistent_bytes=after - base[0],
                                 reserved_bytes=torch.cuda.max_memory_reserved(device) - base[1])


def decode_activation_peak(model: nn.Module, *, num_sequences: int, context_tokens: int, graphed: bool = False,
                           device: torch.device | None = None) -> ActivationMeasurement:
    """One decode step of ``num_sequences`` sequences over the runtime's static cache (runtime.graph.DecodeLoop),
    stood at ``context_tokens`` as run's serving bench stands it (DecodeLoop.fill), eagerly after a warm-up, or
    its CUDA-graph capture (warm-up included) and first replay. Graphed, it is measured from the cache on, as
    run's bench goes: the fill (its one-token prefill of every sequence is an eager step, released before the
    capture), then the capture, so reserved_bytes is what the larger of the two holds at its peak."""
    from runtime.graph import DecodeLoop, cache_tokens_for

    device = device or torch.device("cuda")
    context = max(1, context_tokens)  # a decode step needs one token of cache at least
    loop = DecodeLoop(model, batch=num_sequences, max_cache_tokens=cache_tokens_for(context), device=device,
                      steps_per_call=1)
    if graphed:
        base = _reset_peak(device)
        loop.fill(context)
        loop.capture()
    else:
        loop.fill(context)
        loop.warm_up()  # cuBLAS workspaces and lazy inits are persistent: not part of the step's peak
        base = _reset_peak(device)
    loop.step()
    return _measured_since(base, device)


def chunk_graph_peak(model: nn.Module, *, chunk_tokens: int,
                     device: torch.device | None = None) -> ActivationMeasurement:
    """A prefill chunk of one new sequence's ``chunk_tokens`` tokens captured in a CUDA graph and replayed once,
    as run's serving bench times a plan's graphed chunk (runtime.serving.time_prefill_chunk: prefill's experts
    implementation, runtime.graph.chunk_graph), from an allocator holding no cached blocks: its reserved_bytes is
    what the capture holds at its peak (the private pool cannot borrow the shared pool's blocks)."""
    from runtime.experts_impl import PREFILL, use_phase
    from runtime.graph import chunk_graph

    device = device or torch.device("cuda")
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (1, chunk_tokens), device=device)
    use_phase(model, PREFILL, device)
    base = _reset_peak(device)  # which releases the cached blocks
    graph = chunk_graph(model, ids)
    graph.replay()
    measured = _measured_since(base, device)
    del graph
    return measured


def prefill_activation_peak(model: nn.Module, *, chunk_tokens: int, context_tokens: int = 0,
                            device: torch.device | None = None) -> ActivationMeasurement:
    """One prefill chunk of ``chunk_tokens`` tokens of one sequence after ``context_tokens``, over a static cache
    of context + chunk + the decode room, allocated (and a chunk run to warm up) before the measured one."""
    from runtime.graph import cache_tokens_for
    from runtime.static_cache import static_cache

    device = device or torch.device("cuda")
    vocab = model.config.get_text_config().vocab_size
    # the cache the runtime serves with: sliding layers as rings of their window (runtime.static_cache)
    cache = static_cache(model.config, cache_tokens_for(context_tokens + chunk_tokens))
    ids = torch.randint(0, vocab, (1, context_tokens + chunk_tokens), device=device)

    def forward(chunk):
        return model(input_ids=chunk, use_cache=True, logits_to_keep=1, **cache_argument(model, cache))

    with torch.inference_mode():
        forward(ids[:, context_tokens:])  # allocates the cache, warms up kernels
        cache.reset()
        if context_tokens:
            forward(ids[:, :context_tokens])
        base = _reset_peak(device)
        forward(ids[:, context_tokens:])
    return _measured_since(base, device)


def measured_activation_bytes(checkpoint: Checkpoint, layout: ModelLayout, workload: Workload,
                              graphed: bool = False, limit_bytes: int | None = None) -> ActivationMeasurement:
    """The activation peak of the plan's workload on the local GPU (cached like the layer times), the process held
    to ``limit_bytes`` of GPU memory while it measures (the plan's; None: the GPU's): a step that does not fit
    them raises MeasuredOutOfMemoryError instead of allocating past them.

    A workload of one token per sequence is a decode step (DecodeLoop, as ``run`` serves it: MoE experts
    through runtime.experts_impl's decode choice); any other is a prefill chunk of ``tokens_per_step`` tokens per
    sequence. ``graphed``: the step captured in a CUDA graph, as run replays it (its reserved_bytes is what the
    capture holds); else eager.
    """
    from runtime.load import require_cuda

    require_cuda("make --measure")
    if checkpoint.config is None:
        raise UsageError("--measure builds layers from config.json, and this checkpoint has none")
    per_sequence = workload.tokens_per_step // workload.sequences_per_step
    if per_sequence != 1 and workload.sequences_per_step != 1:
        raise UsageError("--measure measures a decode step (one token per sequence) or a prefill chunk of one "
                         f"sequence, not {workload.sequences_per_step} sequences of {per_sequence} tokens")
    config = measured_config(checkpoint)
    identity = [cache_key(config, layout, workload, graphed), "activation peak v3"]
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()
    cache = load_cache()
    if key not in cache:
        model = activation_model(config, measured_kinds(layout, config), layout.stack)
        torch.cuda.empty_cache()
        # the step's own allocations (its cache, activations, graph pool) are held to the plan's GPU memory; the
        # model's weights come on top, since a checkpoint of few layers builds whole here, which the plan need not
        held_bytes = None if limit_bytes is None else torch.cuda.memory_allocated() + limit_bytes
        try:
            with held_to(held_bytes, torch.device("cuda"), f"a step of {workload.sequences_per_step} sequence(s)"):
                measured = _measure_step(model, workload, graphed)
        finally:
            del model
            gc.collect()
            torch.cuda.empty_cache()
        cache[key] = vars(measured)
        save_cache(cache)
    return ActivationMeasurement(**cache[key])


def _measure_step(model: nn.Module, workload: Workload, graphed: bool) -> ActivationMeasurement:
    if workload.tokens_per_step == workload.sequences_per_step:
        return decode_activation_peak(model, num_sequences=workload.sequences_per_step,
                                      context_tokens=workload.context_tokens, graphed=graphed)
    if graphed:
        if workload.context_tokens:
            raise UsageError("a graphed prefill chunk is measured for new sequences (no context), as run replays it")
        return chunk_graph_peak(model, chunk_tokens=workload.tokens_per_step)
    return prefill_activation_peak(model, chunk_tokens=workload.tokens_per_step,
                                   context_tokens=workload.context_tokens)


@contextlib.contextmanager
def held_to(limit_bytes: int | None, device: torch.device, what: str):
    """The process held to ``limit_bytes`` of the GPU (what CUDA holds outside the allocator counted in) inside;
    running out of them is planner.errors.MeasuredOutOfMemoryError (the caller frees the memory). None: the
    GPU's."""
    from runtime.serving import cap_gpu_memory, release_cap

    capped = limit_bytes is not None and cap_gpu_memory(limit_bytes, device) is not None
    out_of_memory = False
    try:
        yield
    except torch.OutOfMemoryError:
        out_of_memory = True  # raised below, once the failed step's frames (and tensors) are gone
    finally:
        if capped:
            release_cap(device)
    if out_of_memory:
        raise MeasuredOutOfMemoryError(f"{what} does not fit {limit_bytes} bytes of GPU memory")
