"""LoRA adapters served beside the model: every adapter pinned in host memory, a few GPU slots, copies into the
slots on the offload engine's copy stream (one link for both kinds of copies), and the adapters applied to the
batch's rows from the slots' fixed addresses.

The LoRA arithmetic is PEFT's, op for op, so outputs equal PEFT's: for each adapted linear layer and each
adapter's rows of the batch, ``out[rows] += lora_B(lora_A(x[rows])) * scaling`` (PEFT's LoraLayer forward and
its mixed-batch forward), with A and B in the base model's dtype (PEFT's ``autocast_adapter_dtype=False``;
vLLM and SGLang also keep LoRA weights in the model's dtype).

planner.search.adapter_stream decides which adapter goes into which slot and when; ``serve_stream`` executes it.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from planner.search.adapter_stream import StreamSchedule, StreamTimes, times_from_events
from planner.model.adapters import CONFIG_NAME, WEIGHTS_NAME, lora_scaling, read_adapter_config
from planner.errors import ModelInputError
from planner.model.placement import align_up
from runtime.engine import PackedParam, view_as_param
from runtime.allocation import alloc_device_or_fail, host_allocation_or_fail
from runtime.load_source import cached_snapshot
from runtime.checkpoint_reader import FileHandles, SourceTensor, read_exact, read_sources

_PEFT_PREFIX = "base_model.model."
#: a row range's end past any batch: the adapter applies to every row
ALL_ROWS = 2**62


@dataclass(frozen=True, kw_only=True)
class LoraPair:
    """One adapted linear layer: where its A (rank x in) and B (out x rank) lie in the adapter's bytes."""

    module: str
    a: PackedParam
    b: PackedParam


@dataclass(frozen=True, kw_only=True)
class AdapterLayout:
    """One adapter packed in the pinned pool (and, when loaded, in a slot, at the same relative offsets)."""

    name: str
    scaling: float
    #: start of the adapter's bytes in the pinned pool
    offset_bytes: int
    num_bytes: int
    pairs: tuple[LoraPair, ...]


def adapter_folder(source: str, revision: str | None = None) -> Path:
    """The local folder of an adapter: the path given, or its snapshot in the local Hugging Face cache (weights
    are read only from local files; a missing one is a one-line error saying how to fetch it)."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    folder = cached_snapshot(source, revision, [CONFIG_NAME, WEIGHTS_NAME])
    if folder is None or not (folder / WEIGHTS_NAME).is_file():
        raise ModelInputError(f"adapter {source}: not a local folder and not in the local Hugging Face cache; "
                              f"fetch it with `hf download {source}` or give a local folder")
    return folder


def read_pairs(folder: Path, origin: str, model: nn.Module) -> list[tuple[str, SourceTensor, SourceTensor]]:
    """(module, A, B) of every adapted linear layer, checked against the model's layers."""
    sources = read_sources([folder / WEIGHTS_NAME])
    modules = dict(model.named_modules())
    found: dict[str, dict[str, SourceTensor]] = {}
    for name, source in sources.items():
        stem, _, which = name.removesuffix(".weight").rpartition(".lora_")
        if not name.startswith(_PEFT_PREFIX) or which not in ("A", "B"):
            raise ModelInputError(f"{origin}: tensor {name} is not a PEFT LoRA weight (base_model.model.<module>."
                                  "lora_A/B.weight); save the adapter again with PEFT")
        found.setdefault(stem.removeprefix(_PEFT_PREFIX), {})[which] = source
    pairs = []
    for module, pair in sorted(found.items()):
        layer = modules.get(module)
        if not isinstance(layer, nn.Linear) or set(pair) != {"A", "B"}:
            raise ModelInputError(f"{origin}: {module} is not a linear layer of the model with both lora_A and "
                                  "lora_B; the adapter was trained for another base model")
        rank = pair["A"].shape[0]
        if pair["A"].shape != (rank, layer.in_features) or pair["B"].shape != (layer.out_features, rank):
            raise ModelInputError(f"{origin}: {module}'s LoRA shapes {list(pair['A'].shape)}/{list(pair['B'].shape)} "
                                  f"do not fit the layer's {layer.out_features}x{layer.in_features} weight")
        pairs.append((module, pair["A"], pair["B"]))
    return pairs


def _packed(module: str, a: SourceTensor, b: SourceTensor, offset_bytes: int, dtype: torch.dtype) -> LoraPair:
    """A then B, each at an aligned offset, in ``dtype``."""
    a_bytes, b_bytes = dtype.itemsize * math.prod(a.shape), dtype.itemsize * math.prod(b.shape)
    b_offset = align_up(offset_bytes + a_bytes)
    return LoraPair(module=module, a=PackedParam(f"{module}.lora_A", offset_bytes, a_bytes, dtype, a.shape),
                    b=PackedParam(f"{module}.lora_B", b_offset, b_bytes, dtype, b.shape))


class AdapterPool:
    """Every adapter in one pinned host allocation; ``num_slots`` GPU slots of the largest adapter's size."""

    def __init__(self, model: nn.Module, adapters: list[tuple[str, Path]], num_slots: int, backend):
        self.backend = backend
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.layouts: dict[str, AdapterLayout] = {}
        reads = []
        offset = 0
        for name, folder in adapters:
            origin = f"adapter {name} ({folder})"
            scaling = lora_scaling(read_adapter_config(folder, origin), origin)
            pairs, start = [], offset
            for module, a, b in read_pairs(folder, origin, model):
                pair = _packed(module, a, b, offset - start, self.dtype)
                pairs.append(pair)
                reads += [(a, start, pair.a), (b, start, pair.b)]
                offset = start + align_up(pair.b.offset_bytes + pair.b.num_bytes)
            self.layouts[name] = AdapterLayout(name=name, scaling=scaling, offset_bytes=start,
                                               num_bytes=offset - start, pairs=tuple(pairs))
        self.slot_bytes = max(layout.num_bytes for layout in self.layouts.values())
        # the slots first: a GPU that cannot hold them is one line, with nothing read or pinned yet
        self.slots = alloc_device_or_fail(backend, num_slots * self.slot_bytes, "adapter slots",
                                          "make the plan with fewer --adapter-slots")
        self.host = host_allocation_or_fail(offset, "the LoRA adapters", "serve fewer adapters")
        self._read_all(reads)
        backend.pin(self.host)  # after the reads: registering pages already written costs no page faults
        self.num_slots = num_slots
        self._views: dict[tuple[str, int], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}

    def _read_all(self, reads: list[tuple[SourceTensor, int, PackedParam]]) -> None:
        """Each tensor from its file into the pool (cast to the model's dtype where the file's differs)."""
        files = FileHandles()
        try:
            for source, start, item in reads:
                target = self.host[start + item.offset_bytes:][:item.num_bytes]
                if source.dtype == item.dtype:
                    read_exact(files.fd(source.path), source.offset_bytes, target, source.path)
                    continue
                raw = torch.empty(source.num_bytes, dtype=torch.uint8)
                read_exact(files.fd(source.path), source.offset_bytes, raw, source.path)
                target.view(item.dtype).copy_(raw.view(source.dtype).view(-1))
        finally:
            files.close()

    def copy(self, adapter: str, slot: int, done) -> None:
        """Copy ``adapter`` into ``slot`` on the copy stream; ``done`` is recorded when it has landed."""
        layout = self.layouts[adapter]
        destination = self.slots[slot * self.slot_bytes:][:layout.num_bytes]
        source = self.host[layout.offset_bytes:][:layout.num_bytes]
        self.backend.copy(destination, source, done, f"adapter {adapter} -> slot {slot}")

    def views(self, adapter: str, slot: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """module -> (A, B) of ``adapter`` as it lies in ``slot`` (fixed addresses: made once, reused)."""
        key = (adapter, slot)
        if key not in self._views:
            buffer = self.slots[slot * self.slot_bytes:][:self.slot_bytes]
            self._views[key] = {pair.module: (view_as_param(buffer, pair.a), view_as_param(buffer, pair.b))
                                for pair in self.layouts[adapter].pairs}
        return self._views[key]

    @property
    def host_bytes(self) -> int:
        return self.host.numel()

    def close(self) -> None:
        """Unpin the pool (after every copy from it has finished) and drop the slots."""
        if self.host is not None:
            self.backend.synchronize()
            self.backend.unpin(self.host)
        self.host = self.slots = None
        self._views = {}


class LoraHooks:
    """Forward hooks on the adapted linear layers, applying the current forward's adapters to their rows."""

    def __init__(self, model: nn.Module, modules: set[str]):
        #: (first row, end row, module -> (A, B), scaling) of each adapter's rows in the current forward
        self.groups: list[tuple[int, int, dict, float]] = []
        self._handles = [model.get_submodule(name).register_forward_hook(self._hook(name)) for name in sorted(modules)]

    def _hook(self, name: str):
        def apply(module, args, output):
            x = args[0]  # [rows, tokens, in_features]
            for first, end, views, scaling in self.groups:
                pair = views.get(name)
                if pair is not None:
                    a, b = pair
                    # PEFT: result[rows] += lora_B(lora_A(x[rows])) * scaling  (output: [rows, tokens, out])
                    output[first:end] += F.linear(F.linear(x[first:end], a), b) * scaling
            return output
        return apply

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def plan_adapter_folder(row, plan_path: Path | None = None) -> Path:
    """The local folder of one of the plan's adapters (a row of its adapters section): its source as given to
    make, from the plan's folder where relative (run works from any directory), at the revision make read."""
    from planner.source.checkpoint import resolve_local_source

    source = row.source if plan_path is None else resolve_local_source(row.source, plan_path)
    return adapter_folder(source, row.revision)


def load_pool(model: nn.Module, plan, backend, plan_path: Path | None = None) -> tuple[AdapterPool, LoraHooks]:
    """The plan's adapters (its adapters section's rows) in a pool of the plan's slots, and their hooks."""
    adapters = [(row.name, plan_adapter_folder(row, plan_path)) for row in plan.adapters.items]
    pool = AdapterPool(model, adapters, plan.adapters.num_slots, backend)
    modules = {pair.module for layout in pool.layouts.values() for pair in layout.pairs}
    return pool, LoraHooks(model, modules)


def attach_adapter(model: nn.Module, plan, backend, name: str,
                   plan_path: Path | None = None) -> tuple[AdapterPool, LoraHooks]:
    """One of the plan's adapters applied to every row of the model's forwards (run --prompt --adapter): read
    into a pinned pool of its own, copied into one GPU slot, and the hooks pointed at it. The caller removes the
    hooks and closes the pool when done."""
    row = next(row for row in plan.adapters.items if row.name == name)
    pool = AdapterPool(model, [(name, plan_adapter_folder(row, plan_path))], 1, backend)
    landed = backend.new_event(f"adapter-{name}")
    pool.copy(name, 0, landed)
    backend.compute_waits(landed)
    hooks = LoraHooks(model, {pair.module for pair in pool.layouts[name].pairs})
    # every row: a generation's batch is one request, its prompt then each new token
    hooks.groups = [(0, ALL_ROWS, pool.views(name, 0), pool.layouts[name].scaling)]
    return pool, hooks


# ---- serving a request stream -------------------------------------------------------------------------------


@dataclass
class ServedStream:
    """What a served stream measured: its times (from CUDA events) and each request's last-token logits."""

    times: StreamTimes
    #: request index -> [vocab] logits of its last prompt token
    logits: dict[int, torch.Tensor]


def serve_stream(model: nn.Module, pool: AdapterPool, hooks: LoraHooks, schedule: StreamSchedule,
                 prompts: torch.Tensor, copies: bool = True) -> ServedStream:
    """Run ``schedule`` over ``prompts`` ([requests, tokens] ids on the model's device): adapter copies on the
    copy stream in issue order, each forward waiting only for the loads the schedule names. ``copies=False``
    skips the copies and waits (the slots keep whatever they hold): the forwards' compute alone, for the
    prediction."""
    backend = pool.backend
    inputs = [prompts[list(forward.requests)] for forward in schedule.forwards]  # gathered before timing
    started = backend.new_event("stream-start", timing=True)
    loaded = [backend.new_event(f"adapter-{k}") for k in range(len(schedule.loads))]
    starts = [backend.new_event(f"forward-start-{k}", timing=True) for k in range(len(schedule.forwards))]
    ends = [backend.new_event(f"forward-end-{k}", timing=True) for k in range(len(schedule.forwards))]
    last_of_batch = schedule.last_forward_of_batch()
    outputs = []
    backend.record_on_compute(started)
    for index, forward in enumerate(schedule.forwards):
        if copies:
            for load_index in forward.issue_loads:
                _issue_load(pool, schedule.loads[load_index], loaded[load_index], ends, last_of_batch, started)
            for load_index in forward.waits:
                backend.compute_waits(loaded[load_index])
        backend.record_on_compute(starts[index])
        hooks.groups = [(first, end, pool.views(adapter, slot), pool.layouts[adapter].scaling)
                        for first, end, adapter, slot in forward.row_groups()]
        outputs.append(model(input_ids=inputs[index], use_cache=False, logits_to_keep=1).logits[:, -1])
        backend.record_on_compute(ends[index])
    hooks.groups = []
    backend.synchronize()
    start_ms = [backend.elapsed_ms(started, event) for event in starts]
    end_ms = [backend.elapsed_ms(started, event) for event in ends]
    logits = {request: rows[row] for forward, rows in zip(schedule.forwards, outputs)
              for row, request in enumerate(forward.requests)}
    return ServedStream(times=times_from_events(schedule, start_ms, end_ms), logits=logits)


def _issue_load(pool: AdapterPool, load, done, ends: list, last_of_batch: dict[int, int], started) -> None:
    """One adapter copy: after its batch arrived and after the last forward that read its slot."""
    backend = pool.backend
    arrival = ends[last_of_batch[load.batch - 1]] if load.batch > 0 else started
    backend.copy_waits(arrival)
    if load.after_forward is not None:
        backend.copy_waits(ends[load.after_forward])
    pool.copy(load.adapter, load.slot, done)
