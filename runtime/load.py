"""Load a checkpoint with its plan applied: check it matches, check memory, place every weight once.

``run`` streams (stream_model): the model is built on the meta device, the plan gives every param a place
in the GPU arena or in the page-locked host arena (place_plan), and runtime.stream_load reads each tensor from
the safetensors files straight there. Host memory holds what the plan pins plus a bounded working set, never
the whole checkpoint. apply_plan does the same placement for a model already loaded on the CPU (tests and
benchmark scripts build their all-resident references that way).
"""

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from planner.source.checkpoint import Checkpoint, load_checkpoint, resolve_local_source
from planner.errors import ModelInputError, PlanError, RuntimeUnavailableError
from planner.plan.schema import Plan
from planner.units import format_bytes
from runtime.allocation import alloc_device_or_fail, host_allocation_or_fail
from runtime.backend import CpuStandIn, CudaBackend
from runtime.experts_impl import PREFILL, use_phase
from runtime.routed_experts import RoutedExperts
from runtime.routed_layers import allocate_for_plan
from planner.model.placement import align_up
from planner.search.schedule import PrefetchSchedule
from runtime.engine import (OffloadEngine, PackedParam, host_offsets, host_pieces, offloaded_layouts, pack_layout,
                            packed_bytes, view_as_param)
from runtime.checkpoint_reader import Destination, sources_of
from runtime.params import local_bytes, local_shape, local_tensor
from runtime.skeleton import LoadWork, build_skeleton, param_owners, plan_reads, set_param
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


@dataclass(frozen=True, kw_only=True)
class LoadSource:
    """The checkpoint one load reads, resolved and parsed once: the fingerprint check, the experts check, the
    skeleton, the reads and the tokenizer all take this record instead of resolving the path or parsing the
    headers and config.json again."""

    #: --model, else the plan's source, as given (for messages)
    name: str
    #: the local folder (or .safetensors file) holding the weights: the path given, or the hub snapshot
    folder: Path
    #: every tensor's header entry (with its file offset) and config.json, parsed once
    checkpoint: Checkpoint


def open_source(plan: Plan, model: str | None, plan_path: Path | None = None) -> LoadSource:
    """Resolve the checkpoint once (--model, else the plan's source: a relative path from here or from the plan's
    folder, a hub id to its local snapshot) and read its headers and config.json once."""
    name = model if model is not None else plan.model.source
    if model is None and plan_path is not None:
        name = resolve_local_source(name, plan_path)  # run works from any directory
    folder = local_weights(name, plan.model.revision)
    return LoadSource(name=name, folder=folder, checkpoint=load_checkpoint(str(folder)))


def check_fingerprint(plan: Plan, source: LoadSource) -> None:
    """The checkpoint's tensor names, dtypes and shapes must be the ones the plan was made for."""
    fingerprint = source.checkpoint.fingerprint()
    if fingerprint != plan.model.fingerprint:
        raise PlanError(
            f"plan was made for a checkpoint with fingerprint {plan.model.fingerprint[:19]}..., but {source.name} "
            f"has {fingerprint[:19]}...: regenerate the plan for this checkpoint with offload-plan make"
        )


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


def check_memlock(pinned_bytes: int, limit_bytes: int | None) -> None:
    """Fail before reading anything when the memlock limit is below what will be page-locked: the layers are
    pinned as they land, so cudaHostRegister would refuse only after the resident reads (seconds, cold)."""
    if limit_bytes is not None and limit_bytes < pinned_bytes:
        raise RuntimeUnavailableError(
            f"loading page-locks {pinned_bytes} bytes ({format_bytes(pinned_bytes)}) of host memory but the memlock "
            f"limit is {limit_bytes} bytes ({format_bytes(limit_bytes)}): raise it (ulimit -l unlimited, docker "
            "--ulimit memlock=-1) or make a plan with a larger --budget, which pins less"
        )


def memlock_limit_bytes() -> int | None:
    """The soft RLIMIT_MEMLOCK that applies to this process, or None where none does: unlimited, or the process
    holds CAP_IPC_LOCK (root usually does), which lets it lock past the limit."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or _has_ipc_lock():
        return None
    return soft


def _has_ipc_lock() -> bool:
    """CAP_IPC_LOCK (capability 14) in the effective set, from /proc/self/status."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 14 & 1)
    except (OSError, ValueError):
        pass
    return False


def check_host_memory(plan: Plan, working_set_bytes: int, available_bytes: int | None) -> None:
    """The host must hold the plan's pinned bytes plus the loading working set."""
    pinned = plan.memory.host_pinned_bytes
    needed = pinned + working_set_bytes
    if available_bytes is not None and available_bytes < needed:
        raise RuntimeUnavailableError(
            f"loading needs {needed} bytes ({format_bytes(needed)}) of host memory: {format_bytes(pinned)} the plan "
            f"pins plus {format_bytes(working_set_bytes)} of loading buffers, but {available_bytes} bytes "
            f"({format_bytes(available_bytes)}) are available; make a plan with a larger --budget (pins less)"
        )


def loading_working_set_bytes(work: LoadWork) -> int:
    """Host bytes the loader holds besides the pinned arena: the staging ring, and the converted groups in
    flight (each read, then converted: twice its bytes)."""
    largest_group = max((sum(s.num_bytes for s in group) for group in work.converted), default=0)
    return (NUM_READERS + 1) * STAGING_BYTES + CONVERSIONS_IN_FLIGHT * 2 * largest_group


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
    # its experts computed as run's loader leaves a model (runtime.experts_impl), so outputs compare bit for bit
    use_phase(model, PREFILL, torch.device("cpu"))
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


@dataclass
class Placement:
    """Where every param of a model goes under a plan: the device arena (resident params, then the slots) and
    the host allocation (offloaded params, packed layer by layer), page-locked in pieces, one per offloaded
    layer."""

    layers: list[nn.Module]
    layouts: list[list[PackedParam]]
    arena: torch.Tensor
    slots: list[torch.Tensor]
    #: None when the plan offloads nothing: nothing is pinned
    host: torch.Tensor | None
    #: canonical param name (model.named_parameters) -> its destination
    destinations: dict[str, Destination]
    #: each offloaded layer's packed bytes in ``host`` (engine.host_pieces), in offloaded order: the ranges
    #: page-locked one by one, and exactly what the engine copies per layer
    pieces: list[torch.Tensor] = field(default_factory=list)
    #: positions of the pieces page-locked and not unpinned since, in the order they were pinned
    pinned_pieces: list[int] = field(default_factory=list)
    #: the plan's routed layers' experts (runtime.routed_experts), allocated; started by finish_placement
    routed: RoutedExperts | None = None

    @property
    def host_pinned(self) -> bool:
        """Every piece with bytes is page-locked (an empty one cannot be)."""
        return all(k in self.pinned_pieces for k, piece in enumerate(self.pieces) if piece.numel() > 0)

    def pin_piece(self, backend, position: int) -> None:
        """Page-lock one offloaded layer's piece (the streaming loader calls this once its bytes are all in
        place, from its pin thread); a refusal names the plan's total, which the memlock limit is against."""
        piece = self.pieces[position]
        if piece.numel() == 0:
            return
        try:
            backend.pin(piece)
        except RuntimeUnavailableError as error:
            total_bytes = sum(p.numel() for p in self.pieces)
            raise RuntimeUnavailableError(f"{error} (the plan pins {total_bytes} bytes, {format_bytes(total_bytes)}, "
                                          f"in {len(self.pieces)} layers; this was layer {position + 1})") from None
        self.pinned_pieces.append(position)

    def pin_host(self, backend) -> None:
        """Page-lock every piece not yet page-locked."""
        for position in range(len(self.pieces)):
            if position not in self.pinned_pieces:
                self.pin_piece(backend, position)

    def release(self, backend) -> None:
        """Undo the allocations after a failed load: unpin the pieces pinned, then drop the memory."""
        while self.pinned_pieces:
            backend.unpin(self.pieces[self.pinned_pieces.pop()])
        if self.routed is not None:
            self.routed.close()
            self.routed = None
        self.host = self.arena = None
        self.slots, self.destinations, self.pieces = [], {}, []


def place_plan(model: nn.Module, plan: Plan, backend, pin: bool = True) -> Placement:
    """Allocate the arenas the plan describes and give every param its place; params are not touched, so
    this works on a model whose params are on the meta device. With ``pin`` the host allocation is
    page-locked here; without, the caller pins it, piece by piece (Placement.pin_piece), before it is used for
    copies."""
    layers = layer_stack(model, plan)
    check_selection(plan, layers)
    offloaded = plan.offload.layers
    layouts = offloaded_layouts(layers, offloaded, plan.offload.params)
    names = {id(p): name for name, p in model.named_parameters()}
    offloaded_names = []
    for index, layout in zip(offloaded, layouts):
        named = dict(layers[index].named_parameters())
        offloaded_names.append([names[id(named[item.name])] for item in layout])
    moving = {name for group in offloaded_names for name in group}
    # routed layers: their experts go to the routed allocation on the host, the rest of the layer stays resident
    routed = allocate_for_plan(plan, layers, backend)
    routed_names = {} if routed is None else {
        names[id(getattr(module, param))]: (index, param)
        for index, module in routed.modules.items() for param in routed.param_names}
    resident = [(name, p) for name, p in model.named_parameters() if name not in moving and name not in routed_names]
    resident_layout, resident_bytes = _arena_layout([p for _, p in resident])
    slot_bytes = max((packed_bytes(layout) for layout in layouts), default=0)
    num_slots = PrefetchSchedule(len(offloaded), plan.offload.prefetch_step).num_slots if offloaded else 0
    arena = alloc_device_or_fail(backend, resident_bytes + num_slots * align_up(slot_bytes))
    slots = [arena[resident_bytes + k * align_up(slot_bytes):][:slot_bytes] for k in range(num_slots)]
    layer_bytes = [packed_bytes(layout) for layout in layouts]
    host = host_allocation_or_fail(host_offsets(layer_bytes)[-1]) if offloaded else None
    pieces = host_pieces(host, layer_bytes) if offloaded else []
    on_device = backend.device.type != "cpu"
    destinations = {name: Destination(buffer=arena, item=item, on_device=on_device)
                    for (name, _), item in zip(resident, resident_layout)}
    for position, layout in enumerate(layouts):
        for name, item in zip(offloaded_names[position], layout):
            destinations[name] = Destination(buffer=pieces[position], item=item, on_device=False, piece=position)
    for name, key in routed_names.items():  # page-locked whole once loaded (RoutedExperts.start)
        destinations[name] = Destination(buffer=routed.host_allocation, item=routed.host_items[key], on_device=False)
    placement = Placement(layers=layers, layouts=layouts, arena=arena, slots=slots, host=host,
                          destinations=destinations, pieces=pieces, routed=routed)
    if pin:
        try:
            placement.pin_host(backend)
        except BaseException:  # a refusal part way: the pieces pinned before it are undone
            placement.release(backend)
            raise
    return placement


def finish_placement(model: nn.Module, plan: Plan, placement: Placement, backend) -> OffloadEngine:
    """With every param in its destination: buffers to the device, the engine over the offloaded layers."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device != backend.device:
                module._buffers[name] = buffer.to(backend.device)
    engine = OffloadEngine(layers=placement.layers, offloaded=plan.offload.layers,
                           prefetch_step=max(1, plan.offload.prefetch_step), params=plan.offload.params,
                           backend=backend, slots=placement.slots, host=placement.host,
                           replay_start_copies=plan.offload.replay_start_copies)
    engine.arena = placement.arena
    if placement.routed is not None:
        placement.routed.start()
        engine.routed_experts = placement.routed
    return engine


def apply_plan(model: nn.Module, plan: Plan, backend) -> OffloadEngine:
    """Apply a plan to a model already loaded on the CPU (tests and benchmark scripts compare against it):
    each param is copied to its place and released, one at a time. ``run`` streams from the files instead
    (stream_model)."""
    placement = place_plan(model, plan, backend)
    owners = param_owners(model)
    for name, destination in placement.destinations.items():
        view = view_as_param(destination.buffer, destination.item)
        view.copy_(local_tensor(model.get_parameter(name)))
        set_param(owners[name], view)  # the loaded copy is released here
    return finish_placement(model, plan, placement, backend)


def _arena_layout(params: list[nn.Parameter]) -> tuple[list[PackedParam], int]:
    """Aligned offsets for params packed back to back, and the bytes they span."""
    layout, offset = [], 0
    for param in params:
        num_bytes = local_bytes(param)
        layout.append(PackedParam("", offset, num_bytes, param.dtype, local_shape(param)))
        offset = align_up(offset + num_bytes)
    return layout, offset


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


def local_weights(model: str, revision: str | None) -> Path:
    """The local folder holding the weights: the path given, or the hub repo's snapshot in the local Hugging
    Face cache. Tensor data is only ever read from local files: a repo not in the cache is a one-line error
    saying how to fetch it."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    folder = cached_snapshot(model, revision, ["*.json", "*.safetensors"])
    if folder is None or not list(folder.glob("*.safetensors")):
        revision_flag = f" --revision {revision}" if revision else ""
        raise ModelInputError(
            f"the weights of {model} are not in the local Hugging Face cache; fetch them with "
            f"`hf download {model}{revision_flag}` (older hubs: `huggingface-cli download {model}{revision_flag}`), "
            "or pass a local folder with --model"
        )
    return folder


def cached_snapshot(repo_id: str, revision: str | None, allow_patterns: list[str]) -> Path | None:
    """The repo's snapshot folder in the local Hugging Face cache (never the network), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hub_errors

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True,
                                      allow_patterns=allow_patterns))
    except (hub_errors.LocalEntryNotFoundError, OSError, ValueError):
        return None


def apply_plan_on_cpu(model: nn.Module, plan: Plan, lazy_copies: bool = False) -> OffloadEngine:
    """The CPU stand-in (tests only): same schedule, executed in issue order, copies landing at once or (with
    ``lazy_copies``) only when awaited."""
    return apply_plan(model, plan, CpuStandIn(lazy_copies=lazy_copies))


def stream_on_cpu(folder: Path, plan: Plan, lazy_copies: bool = False, backend=None,
                  phases: LoadPhases | None = None) -> tuple[nn.Module, OffloadEngine]:
    """``run``'s loader on the CPU stand-in (tests only): the model streamed from its files."""
    return stream_model(Path(folder), plan, backend or CpuStandIn(lazy_copies=lazy_copies), phases=phases)
