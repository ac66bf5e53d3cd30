"""A checkpoint's safetensors files as the loader reads them: where each tensor's bytes are, and threads that
read them with preadv into host memory or, through a ring of pinned staging buffers, into device memory.

Reads use preadv, not mmap: mapped pages of the files would count in the process's resident set.
"""

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from planner.source.checkpoint import Checkpoint
from planner.errors import ModelInputError
from planner.source.safetensors_header import HEADER_PREFIX_BYTES, read_header_json
from runtime.engine import PackedParam, view_as_param


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
    """Every tensor of the files, checked against the file sizes (a truncated shard is refused before loading).
    For files the planner has not read (an adapter's weights); a model's load takes sources_of its Checkpoint."""
    sources = {}
    for path in files:
        header = read_header_json(path)  # checks every data offset lies inside the file
        raw_length = int.from_bytes(path.open("rb").read(HEADER_PREFIX_BYTES), "little")
        data_start = HEADER_PREFIX_BYTES + raw_length
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            sources[name] = source_tensor(name=name, path=path, offset_bytes=data_start + begin,
                                          num_bytes=end - begin, dtype=entry.get("dtype"), shape=entry["shape"])
    return sources


def sources_of(checkpoint: Checkpoint, folder: Path) -> dict[str, SourceTensor]:
    """Every tensor of a local checkpoint where its shard holds it, from the headers planner.source.checkpoint parsed
    and checked (tiling, sizes against the files): a load parses each header once. ``folder``: the checkpoint's
    folder, or its one .safetensors file."""
    shards = folder if folder.is_dir() else folder.parent
    sources = {}
    for entry in checkpoint.tensors:
        if entry.offset_bytes is None:
            raise ModelInputError(f"{checkpoint.source}: tensor {entry.name} has no file offset (headers read from "
                                  "the hub, not a local file); load from a local folder")
        sources[entry.name] = source_tensor(name=entry.name, path=shards / entry.file,
                                            offset_bytes=entry.offset_bytes, num_bytes=entry.nbytes,
                                            dtype=entry.dtype, shape=entry.shape)
    return sources


def source_tensor(*, name: str, path: Path, offset_bytes: int, num_bytes: int, dtype: object,
                  shape) -> SourceTensor:
    """One tensor's place in a file, its safetensors dtype one the runtime can load."""
    if dtype not in _TORCH_DTYPES:
        raise ModelInputError(f"{path}: tensor {name!r} has dtype {dtype!r}, which the runtime "
                              f"cannot load; supported: {', '.join(sorted(_TORCH_DTYPES))}")
    return SourceTensor(name=name, path=path, offset_bytes=offset_bytes, num_bytes=num_bytes,
                        dtype=_TORCH_DTYPES[dtype], shape=tuple(shape))


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
