"""Load a checkpoint with its plan applied: check it matches, check memory, place every weight once.

``run`` streams (stream_model): the model is built on the meta device, the plan gives every param a place
in the GPU arena or in the page-locked host arena (runtime.placement), and runtime.stream_load reads each tensor
from the safetensors files straight there. Host memory holds what the plan pins plus a bounded working set,
never the whole checkpoint. The checkpoint is resolved and read once (runtime.load_source); the host's memory
and memlock limit are checked first (runtime.host_memory).
"""

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from planner.source.checkpoint import Checkpoint, load_checkpoint
from planner.errors import ModelInputError, RuntimeUnavailableError
from planner.plan.schema import Plan
from planner.units import format_bytes
from runtime.backend import CudaBackend
from runtime.experts_impl import PREFILL, use_phase
from runtime.checkpoint_reader import sources_of
from runtime.engine import OffloadEngine
from runtime.host_memory import check_host_memory, check_memlock, host_available_bytes, memlock_limit_bytes
from runtime.load_source import LoadSource, check_fingerprint, open_source
from runtime.placement import finish_placement, place_plan
from runtime.skeleton import LoadWork, build_skeleton, plan_reads
from runtime.stream_load import CONVERSIONS_IN_FLIGHT, NUM_READERS, STAGING_BYTES, LoadPhases, stream_weights

# Headroom on the GPU beyond the plan's weights: CUDA context, slot alignment, the first activations.
GPU_HEADROOM_BYTES = 1 << 30


@dataclass
class Loaded:
    """A model with its plan applied."""

    model: nn.Module
    engine: OffloadEngine
    plan: Plan
    #: GPU bytes held by weights and slots after loading (torch.cuda.memory_allocated)
    weights_gpu_bytes: int
    #: where the streamed load's time went (reads, page-locking), for benchmarks
    load_phases: LoadPhases | None = None
    #: the checkpoint it was loaded from, resolved once (the tokenizer is read from the same folder)
    source: "LoadSource | None" = None


def require_cuda(what: str = "offload-plan run") -> torch.device:
    """The local CUDA GPU, or a one-line error naming ``what`` needs it (the CPU stand-in is for tests)."""
    if not torch.cuda.is_available():
        raise RuntimeUnavailableError(
            f"{what} needs a CUDA GPU and this machine has none (or torch is a CPU build); "
            "plans can still be made (estimated) and shown here"
        )
    return torch.device("cuda", torch.cuda.current_device())


def check_experts_implementation(plan: Plan, config: dict | None, device: torch.device) -> None:
    """A MoE plan whose steps would run a fallback experts implementation (no native grouped_mm on this stack)
    that needs more activation memory than the plan set aside is refused here, before any weight is read."""
    from planner.model.activations import activation_shape
    from runtime.experts_impl import check_fallback_fits
    from runtime.graph import cache_tokens_for

    workload = plan.workload
    if config is None or plan.memory.activation_bytes is None:
        return
    try:
        if not activation_shape(config).num_experts:
            return
    except (ModelInputError, ValueError):
        return  # make planned it without this model; the plan's own activation line stands
    static_cache_tokens = cache_tokens_for(workload.context_tokens) if workload.cuda_graph else None
    check_fallback_fits(config, device, activation_bytes=plan.memory.activation_bytes,
                        num_sequences=workload.concurrency, context_tokens=workload.context_tokens,
                        chunk_tokens=workload.chunk_tokens, static_cache_tokens=static_cache_tokens)


def check_memory(plan: Plan, device: torch.device, working_set_bytes: int) -> None:
    """Fail before allocating when the GPU cannot hold the plan's total, or the host what the plan pins plus
    the loader's bounded working set (staging ring, converted tensors): never the whole checkpoint."""
    free_bytes, _ = torch.cuda.mem_get_info(device)
    needed = plan.memory.gpu_bytes + GPU_HEADROOM_BYTES
    if free_bytes < needed:
        raise RuntimeUnavailableError(
            f"the plan needs {needed} bytes ({format_bytes(needed)}) of GPU memory with headroom but "
            f"{torch.cuda.get_device_name(device)} has {free_bytes} bytes ({format_bytes(free_bytes)}) free; "
            "make a plan with a smaller --budget"
        )
    check_host_memory(plan, working_set_bytes, host_available_bytes())
    check_memlock(plan.memory.host_pinned_bytes + (NUM_READERS + 1) * STAGING_BYTES, memlock_limit_bytes())


def loading_working_set_bytes(work: LoadWork) -> int:
    """Host bytes the loader holds besides the pinned arena: the staging ring, and the converted groups in
    flight (each read, then converted: twice its bytes)."""
    largest_group = max((sum(s.num_bytes for s in group) for group in work.converted), default=0)
    return (NUM_READERS + 1) * STAGING_BYTES + CONVERSIONS_IN_FLIGHT * 2 * largest_group


def build_model(model_path: str, revision: str | None) -> nn.Module:
    """The transformers model on the CPU, weights loaded in the checkpoint's dtype."""
    from transformers import AutoModelForCausalLM

    kwargs = {"revision": revision} if revision and not os.path.exists(model_path) else {}
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto", **kwargs)
    # its experts computed as run's loader leaves a model (runtime.experts_impl), so outputs compare bit for bit
    use_phase(model, PREFILL, torch.device("cpu"))
    return model.eval()


def stream_model(folder: Path, plan: Plan, backend, on_bytes=None, check=None,
                 phases: LoadPhases | None = None,
                 checkpoint: Checkpoint | None = None) -> tuple[nn.Module, OffloadEngine]:
    """Build the model on the meta device and read each tensor from the files to where the plan puts it.

    ``check(working_set_bytes)`` runs before anything is allocated. On any failure the arenas are released
    (every piece pinned so far unpinned) before the error propagates. ``phases`` receives stream_weights'
    timing record. ``checkpoint``: the folder's headers already parsed (LoadSource); read here if None.
    """
    checkpoint = load_checkpoint(str(folder)) if checkpoint is None else checkpoint
    sources = sources_of(checkpoint, folder)
    model = build_skeleton(folder, sources, checkpoint.config)
    # forwards outside a decode loop are prefills (a decode loop switches its own steps)
    use_phase(model, PREFILL, getattr(backend, "device", torch.device("cpu")))
    work = plan_reads(model, sources)
    if check is not None:
        check(loading_working_set_bytes(work))
    placement = place_plan(model, plan, backend, pin=False)
    try:
        # Page-locking tens of GB takes seconds: each layer's piece is registered once its bytes are read
        # (its pages already faulted in by the reads), while the later layers are read.
        stream_weights(model, work, placement.destinations, backend, on_bytes,
                       pin_piece=lambda position: placement.pin_piece(backend, position), phases=phases)
        assert placement.host_pinned, "stream_weights returned with a host piece not page-locked"
        return model, finish_placement(model, plan, placement, backend)
    except BaseException:
        placement.release(backend)
        raise


def load_with_plan(plan: Plan, model: str | None = None, progress=None, source: LoadSource | None = None) -> Loaded:
    """Everything `run` needs: checks, then the model streamed from its files to where the plan puts it, on
    the local GPU. ``progress(num_bytes)`` is called from reader threads as bytes land. ``source``: the
    checkpoint already resolved and read (open_source); else ``model`` (or the plan's source) is."""
    device = require_cuda()
    source = open_source(plan, model) if source is None else source
    check_fingerprint(plan, source)
    check_experts_implementation(plan, source.checkpoint.config, device)
    backend = CudaBackend(device)
    baseline_bytes = torch.cuda.memory_allocated(device)
    phases = LoadPhases()
    built, engine = stream_model(source.folder, plan, backend, on_bytes=progress,
                                 check=lambda working_set: check_memory(plan, device, working_set), phases=phases,
                                 checkpoint=source.checkpoint)
    torch.cuda.synchronize(device)
    weights_bytes = torch.cuda.memory_allocated(device) - baseline_bytes
    return Loaded(model=built, engine=engine, plan=plan, weights_gpu_bytes=weights_bytes, load_phases=phases,
                  source=source)
