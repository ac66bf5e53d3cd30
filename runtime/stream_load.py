"""Stream a checkpoint's tensors from its safetensors files straight to where a plan puts them.

The model's skeleton is built with its parameters on the meta device (buffers, e.g. rotary tables, are
computed as transformers computes them). transformers' own conversion mapping (``get_model_conversion_mapping``
and ``rename_source_key``, the functions ``from_pretrained`` uses) says which model param each checkpoint
tensor becomes. A tensor that is only renamed is read once, with ``os.preadv``, into its destination:
offloaded params into the host arena at their packed offsets, resident ones through a ring of pinned staging
buffers into the device arena. Tensors that transformers converts (per-expert tensors fused into one, split
projections) are read into host memory one target at a time, converted by transformers' own
``convert_and_load_state_dict_in_model`` and copied to their destination, so the host's working set stays
bounded by the ring plus a few converted params.

The host arena is page-locked piece by piece, one piece per offloaded layer, each once all its bytes are in
place: the readers fault its pages in while they read (in parallel), and a pin thread registers each filled
piece while the later pieces are read. Registering pages already populated is much cheaper than having one
thread fault in and zero the whole arena before any read into it may start.

Reads use preadv, not mmap: mapped pages of the files would count in the process's resident set.
"""

import contextlib
import math
import os
import queue
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from planner.errors import ModelInputError
from planner.safetensors_header import HEADER_PREFIX_BYTES, read_header_json
from runtime.engine import PackedParam, view_as_param

#: bytes of one staging buffer; the ring holds one per reader thread plus one, so reads overlap uploads (large
#: enough for full-speed NVMe reads, small enough that the ring stays a few hundred MB of host memory)
STAGING_BYTES = 32 << 20
#: reader threads: enough to keep an NVMe queue busy, few enough not to thrash a 2-core CI box
NUM_READERS = min(8, max(2, os.cpu_count() or 2))
#: converted groups read or converting at once (conversions run one at a time; one more is read meanwhile)
CONVERSIONS_IN_FLIGHT = 2
#: one preadv call reads at most this many bytes (Linux caps a single read at about 2 GiB)
MAX_READ_BYTES = 1 << 30

_TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True, kw_only=True)
class SourceTensor:
    """One tensor's bytes in a safetensors file."""

    name: str
    path: Path
    #: absolute offset of the tensor's first byte in the file
    offset_bytes: int
    num_bytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self):
        if self.offset_bytes < 0 or self.num_bytes < 0:
            raise ValueError(f"{self.name}: negative offset or size")


@dataclass(frozen=True, kw_only=True)
class Destination:
    """Where one model param's bytes go: a uint8 buffer and the param's place in it."""

    buffer: torch.Tensor
    item: PackedParam
    #: the buffer is device memory: bytes go through a pinned staging buffer
    on_device: bool
    #: the host piece (offloaded position) the buffer is, page-locked once all its params are in place; None
    #: for resident params
    piece: int | None = None


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a local checkpoint folder (or the one file given)."""
    if folder.is_file():
        return [folder]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelInputError(f"{folder}: no .safetensors files; point --model at the checkpoint folder")
    return files


def read_sources(files: list[Path]) -> dict[str, SourceTensor]:
    """Every tensor of the files, checked against the file sizes (a truncated shard is refused before loading)."""
    sources = {}
    for path in files:
        header = read_header_json(path)  # checks every data offset lies inside the file
        raw_length = int.from_bytes(path.open("rb").read(HEADER_PREFIX_BYTES), "little")
        data_start = HEADER_PREFIX_BYTES + raw_length
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry.get("dtype") not in _TORCH_DTYPES:
                raise ModelInputError(f"{path}: tensor {name!r} has dtype {entry.get('dtype')!r}, which the runtime "
                                      f"cannot load; supported: {', '.join(sorted(_TORCH_DTYPES))}")
            begin, end = entry["data_offsets"]
            sources[name] = SourceTensor(name=name, path=path, offset_bytes=data_start + begin,
                                         num_bytes=end - begin, dtype=_TORCH_DTYPES[entry["dtype"]],
                                         shape=tuple(entry["shape"]))
    return sources


# ---- the skeleton ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def params_on_meta():
    """Parameters created inside are on the meta device (no memory); buffers are computed as usual, so
    non-persistent ones (rotary inverse frequencies) hold the values transformers would give them."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_skeleton(folder: Path, files: list[Path]) -> nn.Module:
    """The transformers model for the checkpoint, params on meta, in the dtype from_pretrained(dtype="auto")
    would choose, weights tied as the config says."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_folder = folder if folder.is_dir() else folder.parent
    config = AutoConfig.from_pretrained(config_folder)
    if getattr(config, "quantization_config", None):
        raise ModelInputError(f"{folder}: config.json has a quantization_config; run's loader places bf16/fp16/fp32 "
                              "weights as stored and does not apply transformers' quantizers: use an unquantized "
                              "checkpoint")
    dtype = _auto_dtype(config, files)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    _load_generation_config(model, config_folder)
    return model.eval()


def _auto_dtype(config, files: list[Path]) -> torch.dtype:
    """from_pretrained's dtype="auto": the config's dtype, else the first floating tensor's."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    for source in read_sources(files[:1]).values():
        if source.dtype.is_floating_point:
            return source.dtype
    return torch.get_default_dtype()


def _load_generation_config(model, folder: Path) -> None:
    """generation_config.json, as from_pretrained reads it (generate's defaults)."""
    if not (folder / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    with contextlib.suppress(OSError, ValueError):
        model.generation_config = GenerationConfig.from_pretrained(folder)


def param_owners(model: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """Each param's canonical name (model.named_parameters) -> every (module, attribute) holding it (tied
    weights have several)."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    owners: dict[str, list] = {name: [] for name in canonical.values()}
    for module in model.modules():
        for attribute, param in module._parameters.items():
            if param is not None:
                owners[canonical[id(param)]].append((module, attribute))
    return owners


def set_param(owners: list[tuple[nn.Module, str]], tensor: torch.Tensor) -> None:
    """Point every holder of one param at ``tensor`` (a view of an arena), as a new Parameter."""
    param = nn.Parameter(tensor, requires_grad=False)
    for module, attribute in owners:
        module._parameters[attribute] = param


# ---- checkpoint names to model params ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LoadWork:
    """What to read: tensors that map one to one onto a param, and groups transformers converts."""

    #: (source, canonical param name)
    direct: list[tuple[SourceTensor, str]]
    #: sources converted together into one or more params (e.g. every expert's gate and up projections)
    converted: list[list[SourceTensor]]
    weight_mapping: list
    #: (source, buffer name): persistent buffers the checkpoint holds (small; loaded as from_pretrained does)
    buffers: tuple = ()
    #: the canonical name of a param each converted group produces (its layer orders the group's read)
    converted_targets: tuple = ()
    #: (source, canonical param name, byte offset in the param): tensors that transformers would stack or
    #: concatenate into a fused param (the hub's one tensor per expert), each a contiguous range of that param,
    #: read straight into place with no host copy
    sliced: tuple = ()


def plan_reads(model: nn.Module, sources: dict[str, SourceTensor]) -> LoadWork:
    """Map every checkpoint tensor to its param with transformers' own renamings and converters."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    meta_state = model.state_dict()
    canonical = {name: name for name, _ in model.named_parameters()}
    canonical.update(_tied_aliases(model))
    buffer_names = {name for name, _ in model.named_buffers()}
    direct, groups, patterns, buffers = [], {}, {}, []
    for name in sorted(sources):
        target, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, meta_state)
        if target not in meta_state and name in meta_state:
            target, pattern = name, None
        if target in buffer_names and pattern is None:
            buffers.append((sources[name], target))
            continue
        if target not in meta_state or target not in canonical:
            continue  # a key the model does not have: from_pretrained ignores it too
        if pattern is None:
            direct.append((sources[name], canonical[target]))
        else:
            groups.setdefault(target, []).append(sources[name])
            patterns[name] = pattern
    sliced, converted = [], {}
    for target, group in groups.items():
        meta = meta_state[target]
        offsets = fused_offsets(group, patterns, _converter_of(patterns[group[0].name], converters),
                                tuple(meta.shape), meta.element_size())
        if offsets is None:
            converted[target] = group
        else:
            sliced += [(source, canonical[target], offsets[source.name]) for source in group]
    return LoadWork(direct=direct, converted=list(converted.values()), weight_mapping=mapping,
                    buffers=tuple(buffers), converted_targets=tuple(canonical[target] for target in converted),
                    sliced=tuple(sliced))


def _converter_of(pattern: str, converters: list):
    return next((c for c in converters if pattern in c.source_patterns), None)


def fused_offsets(group: list[SourceTensor], patterns: dict[str, str], converter, target_shape: tuple[int, ...],
                  element_bytes: int) -> dict[str, int] | None:
    """Where each per-expert tensor of ``group`` lies in the fused param, as a byte offset, when transformers'
    conversion is a stack over experts (``MergeModulelist(dim=0)``), optionally followed by a concatenation of
    the stacked projections along dim 1 (``Concatenate(dim=1)``, gate then up): expert ``e`` of source pattern
    ``j`` (of P) is then the contiguous range starting at element ``(e * P + j) * numel``. None for any other
    conversion, or a group that does not tile the param exactly (transformers converts it then)."""
    operations = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(converter, "operations", ())]
    if operations not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
        return None
    source_patterns = list(converter.source_patterns)
    shapes = {source.shape for source in group}
    if len(shapes) != 1 or (len(operations) == 1 and len(source_patterns) != 1):
        return None
    (shape,) = shapes
    numel = math.prod(shape)
    located = {}
    for source in group:
        expert = _expert_index(source.name, patterns[source.name])
        if expert is None:
            return None
        located[source.name] = (expert * len(source_patterns) + source_patterns.index(patterns[source.name]))
    num_experts, leftover = divmod(len(group), len(source_patterns))
    expected = (num_experts, len(source_patterns) * shape[0], *shape[1:]) if shape else None
    if leftover or expected != target_shape or sorted(located.values()) != list(range(len(group))):
        return None
    return {name: index * numel * element_bytes for name, index in located.items()}


def _expert_index(name: str, pattern: str) -> int | None:
    """The number that stands for ``*`` in ``pattern`` within ``name`` (the expert's index), or None."""
    head, star, tail = pattern.partition("*")
    if not star:
        return None
    match = re.search(re.escape(head) + r"(\d+)" + re.escape(tail) + "$", name)
    return int(match.group(1)) if match else None


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """Every name of a param held under several names -> its canonical name."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    return {name: canonical[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


# ---- reading -----------------------------------------------------------------------------------------------


def read_exact(fd: int, offset_bytes: int, target: torch.Tensor, path: Path) -> None:
    """Fill the uint8 CPU tensor ``target`` from the file at ``offset_bytes``; a short read is a truncated
    file (replaced or cut since the headers were read)."""
    view = memoryview(target.numpy()).cast("B")
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:done + MAX_READ_BYTES]], offset_bytes + done)
        if count == 0:
            raise ModelInputError(f"{path}: the file ended {len(view) - done} bytes early while loading; it was "
                                  "truncated or replaced after the plan was checked: download it again")
        done += count


class FileHandles:
    """One read-only descriptor per file, shared by the reader threads (preadv has no shared offset)."""

    def __init__(self):
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._fds:
                try:
                    self._fds[path] = os.open(path, os.O_RDONLY)
                except OSError as error:
                    raise ModelInputError(f"{path}: cannot open ({error.strerror}) while loading") from None
            return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class StagingRing:
    """Pinned host buffers that device-bound bytes pass through: a reader takes one, fills it, starts the
    upload and gives it back; the next taker waits for that upload before writing into it."""

    def __init__(self, backend, num_buffers: int, buffer_bytes: int):
        self.backend = backend
        self.allocation = torch.empty(num_buffers * buffer_bytes, dtype=torch.uint8)
        backend.pin(self.allocation)
        self.buffer_bytes = buffer_bytes
        self._free = [(self.allocation[k * buffer_bytes:(k + 1) * buffer_bytes], None) for k in range(num_buffers)]
        self._available = threading.Semaphore(num_buffers)
        self._lock = threading.Lock()

    def take(self):
        self._available.acquire()
        with self._lock:
            buffer, pending = self._free.pop()
        self.backend.wait_upload(pending)
        return buffer

    def give_back(self, buffer, pending) -> None:
        with self._lock:
            self._free.append((buffer, pending))
        self._available.release()

    def close(self) -> None:
        """Wait for every upload, then unpin."""
        for _, pending in self._free:
            self.backend.wait_upload(pending)
        self.backend.unpin(self.allocation)
        self.allocation = None


class Reader:
    """Moves bytes from files to destinations with a pool of threads."""

    def __init__(self, backend, ring: StagingRing | None, on_bytes=None):
        self.backend = backend
        self.ring = ring
        self.files = FileHandles()
        self.on_bytes = on_bytes or (lambda num_bytes: None)

    def to_destination(self, source: SourceTensor, destination: Destination, param_dtype: torch.dtype) -> None:
        """Read one tensor straight into its destination (through the ring for device memory)."""
        if source.dtype != param_dtype:  # transformers casts to the param's dtype; so do we, once
            self.place_tensor(self.read_tensor(source).to(param_dtype), destination)
            return
        fd = self.files.fd(source.path)
        target = destination.buffer[destination.item.offset_bytes:][:source.num_bytes]
        if not destination.on_device:
            read_exact(fd, source.offset_bytes, target, source.path)
            self.on_bytes(source.num_bytes)
            return
        for start in range(0, source.num_bytes, self.ring.buffer_bytes):
            length = min(self.ring.buffer_bytes, source.num_bytes - start)
            buffer = self.ring.take()
            staging = buffer[:length]
            pending = None
            try:
                read_exact(fd, source.offset_bytes + start, staging, source.path)
                pending = self.backend.upload(target[start:start + length], staging)
            finally:
                # the whole buffer goes back: given back as the slice, a tensor's short last piece shrank the
                # ring's buffer for good, and a later full piece into it was cut short (seen under load)
                self.ring.give_back(buffer, pending)
            self.on_bytes(length)

    def read_tensor(self, source: SourceTensor) -> torch.Tensor:
        """One tensor into fresh host memory (for conversions)."""
        raw = torch.empty(source.num_bytes, dtype=torch.uint8)
        read_exact(self.files.fd(source.path), source.offset_bytes, raw, source.path)
        return raw.view(source.dtype).view(source.shape)

    def place_tensor(self, tensor: torch.Tensor, destination: Destination) -> None:
        """Copy a host tensor (a converted param) to its destination, synchronously."""
        view_as_param(destination.buffer, destination.item).copy_(tensor)

    def close(self) -> None:
        self.files.close()


def convert_group(model: nn.Module, reader: Reader, group: list[SourceTensor], weight_mapping: list,
                  lock: threading.Lock) -> dict[str, torch.Tensor]:
    """Read one converted group and let transformers convert it; returns the params it produced (host
    tensors), which transformers has set on the model (the caller replaces them at once)."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    state = {source.name: reader.read_tensor(source) for source in group}
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    with lock:  # transformers sets params on the model: one group at a time
        before = {name for name, p in model.named_parameters() if p.device.type == "meta"}
        config = LoadStateDictConfig(device_map={"": "cpu"}, dtype=dtype, weight_mapping=weight_mapping)
        with _quiet_transformers():
            convert_and_load_state_dict_in_model(model, state, config)
        produced = {name: p.data for name, p in model.named_parameters() if name in before and p.device.type != "meta"}
    for source in group:
        reader.on_bytes(source.num_bytes)
    return produced


@contextlib.contextmanager
def _quiet_transformers():
    """transformers draws a progress bar per call; ours is the one the user sees."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


@dataclass
class LoadPhases:
    """Where a streamed load's time went: seconds from the start of stream_weights until each phase ended
    (None: not reached, or nothing of that kind in this plan)."""

    #: the last resident param (device-bound) was read and its upload issued (uploads are synchronized by
    #: streamed_s)
    device_reads_done_s: float | None = None
    #: the last offloaded param (host-bound) landed in the host arena
    host_reads_done_s: float | None = None
    #: the last host piece was page-locked
    last_pin_done_s: float | None = None
    #: seconds the pin thread spent inside page-locking calls
    pin_busy_s: float = 0.0
    num_pieces_pinned: int = 0
    #: stream_weights returned: every byte in place, uploads synchronized, every piece page-locked
    streamed_s: float | None = None


def stream_weights(model: nn.Module, work: LoadWork, destinations: dict[str, Destination], backend,
                   on_bytes=None, num_readers: int = NUM_READERS, pin_piece=None,
                   phases: LoadPhases | None = None) -> None:
    """Fill every destination from the files: direct tensors by reader threads, converted groups too, with
    their conversions one at a time. Returns when every byte is in place (uploads synchronized) and, with
    ``pin_piece``, every host piece page-locked; every param then points at its destination.

    ``pin_piece(k)`` page-locks host piece k (Destination.piece); it runs in a thread of its own as soon as
    all of piece k's params have landed, while later pieces are read. A failure of it stops the readers.
    ``phases``, if given, receives the times at which the reads and the pins ended."""
    phases = phases if phases is not None else LoadPhases()
    start_s = time.perf_counter()
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    owners = param_owners(model)
    _check_destinations(work, destinations)
    needs_ring = any(d.on_device for d in destinations.values())
    ring = StagingRing(backend, num_readers + 1, STAGING_BYTES) if needs_ring else None
    has_pieces = any(d.piece is not None for d in destinations.values())
    # after the ring: a ring refused leaves no pin thread running
    pinner = PiecePinner(pin_piece if has_pieces else None, phases, start_s)
    landings = Landings(destinations, pinner, phases, start_s)
    reader = Reader(backend, ring, on_bytes)
    lock = threading.Lock()
    in_flight = threading.Semaphore(CONVERSIONS_IN_FLIGHT)
    filled = {name for _, name in work.direct} | {name for _, name, _ in work.sliced}
    slices_left = SliceCounter(work.sliced)

    def load_direct(source, name):
        pinner.check()  # a refused page-lock stops the reads still queued
        reader.to_destination(source, destinations[name], dtypes[name])
        landings.landed(name)

    def load_slice(source, name, offset_bytes):
        pinner.check()
        reader.to_destination(source, slice_destination(destinations[name], source, offset_bytes, dtypes[name]),
                              dtypes[name])
        if slices_left.landed(name):
            landings.landed(name)

    def load_group(group):
        pinner.check()
        with in_flight:  # bounds the host working set (load.loading_working_set_bytes)
            for name, tensor in convert_group(model, reader, group, work.weight_mapping, lock).items():
                reader.place_tensor(tensor, destinations[name])
                filled.add(name)
                with lock:  # drop transformers' host copy now
                    set_param(owners[name], view_as_param(destinations[name].buffer, destinations[name].item))
                landings.landed(name)

    try:
        for source, name in work.buffers:
            _load_buffer(model, name, reader.read_tensor(source))
        with ThreadPoolExecutor(max_workers=num_readers, thread_name_prefix="offload-plan-read") as pool:
            loaders = {"direct": load_direct, "slice": load_slice}
            futures = [pool.submit(loaders[kind], *task) if kind in loaders else pool.submit(load_group, task)
                       for kind, task in read_order(work, destinations)]
            _wait_all(futures)
        backend.synchronize()
        _check_filled(destinations, filled)
        pinner.finish()  # the last pieces' page-locking; raises a refusal
    finally:
        pinner.stop()  # never unpin (release) while a pin is running
        if ring is not None:
            ring.close()
        reader.close()
    assert pin_piece is None or landings.all_handed(), "a host piece was never handed to the pin thread"
    for name, destination in destinations.items():
        set_param(owners[name], view_as_param(destination.buffer, destination.item))
    phases.streamed_s = time.perf_counter() - start_s


class SliceCounter:
    """Counts the slices of each fused param still to land (reader threads call ``landed``)."""

    def __init__(self, sliced):
        self._left: dict[str, int] = {}
        for _, name, _ in sliced:
            self._left[name] = self._left.get(name, 0) + 1
        self._lock = threading.Lock()

    def landed(self, name: str) -> bool:
        """One slice of ``name`` is in place; True when it was the last."""
        with self._lock:
            self._left[name] -= 1
            return self._left[name] == 0


def slice_destination(destination: Destination, source: SourceTensor, offset_bytes: int,
                      param_dtype: torch.dtype) -> Destination:
    """The part of a fused param's destination that one per-expert tensor fills."""
    num_bytes = math.prod(source.shape) * param_dtype.itemsize
    item = PackedParam(destination.item.name, destination.item.offset_bytes + offset_bytes, num_bytes, param_dtype,
                       source.shape)
    return Destination(buffer=destination.buffer, item=item, on_device=destination.on_device,
                       piece=destination.piece)


def read_order(work: LoadWork, destinations: dict[str, Destination]) -> list[tuple[str, object]]:
    """("direct", (source, name)) and ("group", sources) in the order they are read: device-bound first, then
    host piece by piece in layer order, largest first within each. Pieces fill one after another, so each can
    be page-locked while the later ones are read."""
    def piece_of(name: str) -> int:
        destination = destinations.get(name)
        return -1 if destination is None or destination.piece is None else destination.piece

    tasks = [((piece_of(name), -source.num_bytes), ("direct", (source, name))) for source, name in work.direct]
    tasks += [((piece_of(name), -source.num_bytes), ("slice", (source, name, offset)))
              for source, name, offset in work.sliced]
    targets = work.converted_targets or ("",) * len(work.converted)
    tasks += [((piece_of(target), -sum(s.num_bytes for s in group)), ("group", group))
              for group, target in zip(work.converted, targets)]
    return [task for _, task in sorted(tasks, key=lambda pair: pair[0])]


def _check_filled(destinations: dict[str, Destination], filled: set[str]) -> None:
    """Every param must have had a tensor in the checkpoint."""
    missing = sorted(set(destinations) - filled)
    if missing:
        raise ModelInputError(f"the checkpoint has no tensor for {len(missing)} of the model's params (first: "
                              f"{missing[0]}); it does not match its config.json")


def _load_buffer(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """A persistent buffer from the checkpoint, in the buffer's dtype (from_pretrained replaces it too)."""
    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name)
    current = module._buffers[attribute]
    if tuple(tensor.shape) != tuple(current.shape):
        raise ModelInputError(f"the checkpoint's {name} has shape {list(tensor.shape)} but the model expects "
                              f"{list(current.shape)}; the checkpoint does not match its config.json")
    module._buffers[attribute] = tensor.to(current.dtype)


def _check_destinations(work: LoadWork, destinations: dict[str, Destination]) -> None:
    """Each direct tensor must fill its param exactly: a shard replaced since the plan was checked could hold
    another shape."""
    for source, name in work.direct:
        item = destinations[name].item
        if source.shape != item.shape:
            raise ModelInputError(f"{source.path}: tensor {source.name} has shape {list(source.shape)} but the model "
                                  f"expects {list(item.shape)}; the checkpoint changed since the plan was made: "
                                  "regenerate the plan with offload-plan make")


class Landings:
    """Counts params into their places: a host piece goes to the pin thread when its last param has landed,
    and the phase record keeps the time of the last device-bound and host-bound landing."""

    def __init__(self, destinations: dict[str, Destination], pinner, phases: LoadPhases, start_s: float):
        self._destinations = destinations
        self._pinner = pinner
        self._phases = phases
        self._start_s = start_s
        #: piece -> names of its params not landed yet; a piece leaves when handed to the pin thread
        self._waiting: dict[int, set[str]] = {}
        for name, destination in destinations.items():
            if destination.piece is not None:
                self._waiting.setdefault(destination.piece, set()).add(name)
        self._lock = threading.Lock()

    def landed(self, name: str) -> None:
        """``name``'s bytes are all in place (called from reader threads)."""
        piece = self._destinations[name].piece
        elapsed_s = time.perf_counter() - self._start_s
        with self._lock:
            field = "device_reads_done_s" if piece is None else "host_reads_done_s"
            setattr(self._phases, field, max(elapsed_s, getattr(self._phases, field) or 0.0))
            waiting = self._waiting.get(piece)
            if waiting is None:
                return
            waiting.discard(name)
            if not waiting:
                del self._waiting[piece]
                self._pinner.submit(piece)

    def all_handed(self) -> bool:
        return not self._waiting


class PiecePinner:
    """Page-locks host pieces in a thread of its own, in the order they fill. Its failure (a memlock refusal)
    is raised to the readers by check(), so the load stops within the reads in flight, and by finish()."""

    def __init__(self, pin_piece, phases: LoadPhases, start_s: float):
        self._pin_piece = pin_piece
        self._phases = phases
        self._start_s = start_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = None
        if pin_piece is not None:
            self._thread = threading.Thread(target=self._run, name="offload-plan-pin", daemon=True)
            self._thread.start()

    def submit(self, piece: int) -> None:
        if self._thread is not None:
            self._queue.put(piece)

    def _run(self) -> None:
        while (piece := self._queue.get()) is not None:
            if self._error is not None or self._stopping:
                continue  # after a failure (ours or a reader's), nothing more gets pinned
            began_s = time.perf_counter()
            try:
                self._pin_piece(piece)
            except BaseException as error:  # handed to the readers, raised in the caller's thread
                self._error = error
                continue
            ended_s = time.perf_counter()
            self._phases.pin_busy_s += ended_s - began_s
            self._phases.num_pieces_pinned += 1
            self._phases.last_pin_done_s = ended_s - self._start_s

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """After the reads: wait for the pieces queued, then raise a failure."""
        self._join()
        self.check()

    def stop(self) -> None:
        """Skip the pieces not yet pinned and wait for the one being pinned (the caller releases after)."""
        self._stopping = True
        self._join()

    def _join(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


def _wait_all(futures) -> None:
    """Wait for every read; the first failure cancels what has not started and is raised."""
    for future in futures:
        error = future.exception()
        if error is not None:
            for other in futures:
                other.cancel()
            raise error
