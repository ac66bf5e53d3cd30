"""Load a checkpoint with its plan applied: check it matches, check memory, build, place every weight once.

transformers builds and loads the model on the CPU (it knows each architecture's checkpoint-name
conversions, e.g. per-expert tensors fused into one). Then the offloaded layers' selected params are packed
into pinned host memory and pointed at GPU slots, and everything else moves to the GPU, layer by layer, so
host memory holds the checkpoint once.
"""

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from planner.checkpoint import load_checkpoint
from planner.errors import PlanError, RuntimeUnavailableError
from planner.plan import Plan
from planner.units import format_bytes
from runtime.backend import CpuStandIn, CudaBackend
from planner.placement import align_up
from planner.schedule import PrefetchSchedule
from runtime.engine import OffloadEngine, PackedParam, offloaded_layouts, pack_layout, packed_bytes, view_as_param

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


def require_cuda(what: str = "offload-plan run") -> torch.device:
    """The local CUDA GPU, or a one-line error naming ``what`` needs it (the CPU stand-in is for tests)."""
    if not torch.cuda.is_available():
        raise RuntimeUnavailableError(
            f"{what} needs a CUDA GPU and this machine has none (or torch is a CPU build); "
            "plans can still be made (estimated) and shown here"
        )
    return torch.device("cuda", torch.cuda.current_device())


def model_path_for(plan: Plan, model: str | None) -> str:
    """Where to load from: --model, else the plan's source (a local path or a hub repo id)."""
    return model if model is not None else plan.model.source


def check_fingerprint(plan: Plan, model: str) -> None:
    """The checkpoint's tensor names, dtypes and shapes must be the ones the plan was made for."""
    checkpoint = load_checkpoint(model, plan.model.revision if not Path(model).exists() else None)
    if checkpoint.fingerprint() != plan.model.fingerprint:
        raise PlanError(
            f"plan was made for a checkpoint with fingerprint {plan.model.fingerprint[:19]}..., but {model} has "
            f"{checkpoint.fingerprint()[:19]}...: regenerate the plan for this checkpoint with offload-plan make"
        )


def check_memory(plan: Plan, device: torch.device) -> None:
    """Fail before allocating when the GPU or the host cannot hold what the plan needs."""
    free_bytes, _ = torch.cuda.mem_get_info(device)
    needed = plan.memory.gpu_bytes + GPU_HEADROOM_BYTES
    if free_bytes < needed:
        raise RuntimeUnavailableError(
            f"the plan needs {needed} bytes ({format_bytes(needed)}) of GPU memory with headroom but "
            f"{torch.cuda.get_device_name(device)} has {free_bytes} bytes ({format_bytes(free_bytes)}) free; "
            "make a plan with a smaller --budget"
        )
    available = host_available_bytes()
    if available is not None and available < plan.model.total_bytes:
        raise RuntimeUnavailableError(
            f"loading needs {plan.model.total_bytes} bytes ({format_bytes(plan.model.total_bytes)}) of host memory "
            f"(the plan pins {format_bytes(plan.memory.host_pinned_bytes)} of it) but {available} bytes "
            f"({format_bytes(available)}) are available"
        )


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is no such file."""
    return meminfo_bytes("MemAvailable")


def meminfo_bytes(key: str) -> int | None:
    """One /proc/meminfo figure in bytes (``MemTotal``, ``MemAvailable``), or None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def build_model(model_path: str, revision: str | None) -> nn.Module:
    """The transformers model on the CPU, weights loaded in the checkpoint's dtype."""
    from transformers import AutoModelForCausalLM

    kwargs = {"revision": revision} if revision and not os.path.exists(model_path) else {}
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto", **kwargs)
    return model.eval()


def layer_stack(model: nn.Module, plan: Plan) -> list[nn.Module]:
    """The module list the plan's stack prefix names, checked against the plan's layer count."""
    try:
        stack = model.get_submodule(plan.model.stack)
    except AttributeError:
        raise PlanError(f"the model has no module {plan.model.stack!r}; the plan does not match this model") from None
    layers = list(stack)
    if len(layers) < plan.model.num_layers:
        raise PlanError(f"{plan.model.stack} has {len(layers)} layers but the plan has {plan.model.num_layers}")
    return layers[: plan.model.num_layers]


def check_selection(plan: Plan, layers: list[nn.Module]) -> None:
    """The model's params selected by the plan's segments must hold the bytes the plan moves."""
    for index in plan.offload.layers:
        packed = pack_layout(layers[index], plan.offload.params)
        moved = sum(item.num_bytes for item in packed)
        expected = plan.layers[index].offloaded_bytes
        if moved != expected:
            raise PlanError(
                f"layer {index}: the plan moves {expected} bytes but the model's params matching "
                f"{list(plan.offload.params) or 'all'} hold {moved} (transformers renames some checkpoint "
                "tensors); choose --params segments that name the same params in both, e.g. 'experts'"
            )


def apply_plan(model: nn.Module, plan: Plan, backend, on_layer_packed=None) -> OffloadEngine:
    """Offload the plan's layers and place everything else, with the slots, in one device arena.

    One allocation means one allocator rounding (planner.placement): the plan's memory.gpu_bytes bounds it.
    """
    layers = layer_stack(model, plan)
    check_selection(plan, layers)
    offloaded = plan.offload.layers
    layouts = offloaded_layouts(layers, offloaded, plan.offload.params)
    moving = set()
    for index, layout in zip(offloaded, layouts):
        named = dict(layers[index].named_parameters())
        moving.update(id(named[item.name]) for item in layout)
    resident = [p for p in model.parameters() if id(p) not in moving]
    resident_layout, resident_bytes = _arena_layout(resident)
    slot_bytes = max((packed_bytes(layout) for layout in layouts), default=0)
    num_slots = PrefetchSchedule(len(offloaded), plan.offload.prefetch_step).num_slots if offloaded else 0
    arena = backend.alloc_device(resident_bytes + num_slots * align_up(slot_bytes))
    slots = [arena[resident_bytes + k * align_up(slot_bytes):][:slot_bytes] for k in range(num_slots)]
    engine = OffloadEngine(layers=layers, offloaded=offloaded, prefetch_step=plan.offload.prefetch_step,
                           params=plan.offload.params, backend=backend, slots=slots,
                           on_layer_packed=on_layer_packed, replay_start_copies=plan.offload.replay_start_copies)
    for param, item in zip(resident, resident_layout):
        view = view_as_param(arena, item)
        view.copy_(param.data)
        param.data = view  # the loaded copy is released here, one param at a time
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device != backend.device:
                module._buffers[name] = buffer.to(backend.device)
    engine.arena = arena
    return engine


def _arena_layout(params: list[nn.Parameter]) -> tuple[list[PackedParam], int]:
    """Aligned offsets for params packed back to back, and the bytes they span."""
    layout, offset = [], 0
    for param in params:
        num_bytes = param.numel() * param.element_size()
        layout.append(PackedParam("", offset, num_bytes, param.dtype, tuple(param.shape)))
        offset = align_up(offset + num_bytes)
    return layout, offset


def load_with_plan(plan: Plan, model: str | None = None, progress=None) -> Loaded:
    """Everything `run` needs: checks, the model built and placed as the plan says, on the local GPU."""
    device = require_cuda()
    path = model_path_for(plan, model)
    check_fingerprint(plan, path)
    check_memory(plan, device)
    built = build_model(path, plan.model.revision)
    backend = CudaBackend(device)
    baseline_bytes = torch.cuda.memory_allocated(device)
    engine = apply_plan(built, plan, backend, on_layer_packed=progress)
    torch.cuda.synchronize(device)
    weights_bytes = torch.cuda.memory_allocated(device) - baseline_bytes
    return Loaded(model=built, engine=engine, plan=plan, weights_gpu_bytes=weights_bytes)


def apply_plan_on_cpu(model: nn.Module, plan: Plan, lazy_copies: bool = False) -> OffloadEngine:
    """The CPU stand-in (tests only): same schedule, executed in issue order, copies landing at once or (with
    ``lazy_copies``) only when awaited."""
    return apply_plan(model, plan, CpuStandIn(lazy_copies=lazy_copies))
