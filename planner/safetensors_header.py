"""Read and validate safetensors headers without touching tensor data.

A safetensors file is an 8-byte little-endian header length, a JSON header, then the tensor bytes. We read
only the first two parts, and check them against the file's size so a truncated download is caught here
rather than at load time.
"""

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from planner.errors import ModelInputError

# Bits per element of every dtype the safetensors format defines (sub-byte types are packed).
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}
# The format's own limit: headers above 100 MB are rejected by the reference implementation too.
MAX_HEADER_BYTES = 100_000_000
HEADER_PREFIX_BYTES = 8


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """One tensor as a safetensors header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    #: shard file name, relative to the checkpoint folder
    file: str


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this dtype and shape occupies in the file (sub-byte dtypes packed)."""
    return math.ceil(math.prod(shape) * DTYPE_BITS[dtype] / 8)


def read_header_json(path: Path) -> dict:
    """Return the parsed JSON header of one safetensors file, checking its framing against the file size."""
    try:
        file_size_bytes = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(HEADER_PREFIX_BYTES)
            if len(prefix) < HEADER_PREFIX_BYTES:
                raise ModelInputError(
                    f"{path}: file is {file_size_bytes} bytes, too short for a safetensors header; "
                    "the download is truncated: download it again"
                )
            (header_bytes,) = struct.unpack("<Q", prefix)
            if header_bytes == 0 or header_bytes > MAX_HEADER_BYTES:
                raise ModelInputError(
                    f"{path}: header length {header_bytes} is not plausible; this is not a safetensors "
                    "file or it is corrupt: download it again"
                )
            raw = handle.read(header_bytes)
    except OSError as error:
        raise ModelInputError(f"{path}: cannot read ({error.strerror}); check the path and permissions") from None
    if len(raw) < header_bytes:
        raise ModelInputError(
            f"{path}: header says {header_bytes} bytes but the file ends after {len(raw)}; "
            "the file is truncated: download it again"
        )
    header = _parse_json(raw, path)
    _check_data_extent(header, path, file_size_bytes - HEADER_PREFIX_BYTES - header_bytes)
    return header


def _parse_json(raw: bytes, path: Path) -> dict:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelInputError(
            f"{path}: safetensors header is not valid JSON ({error}); the file is corrupt: download it again"
        ) from None
    if not isinstance(header, dict):
        raise ModelInputError(f"{path}: safetensors header is not a JSON object; the file is corrupt")
    return header


def _check_data_extent(header: dict, path: Path, data_bytes: int) -> None:
    """The tensors' data offsets must lie inside the file: catches truncated shards without reading data."""
    end_offset = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ModelInputError(f"{path}: tensor {name!r} has no valid data_offsets; the file is corrupt")
        end_offset = max(end_offset, offsets[1])
    if end_offset > data_bytes:
        raise ModelInputError(
            f"{path}: header describes {end_offset} bytes of tensor data but the file holds {data_bytes}; "
            "the file is truncated: download it again"
        )


def entries_from_header(header: dict, file: str, origin: str) -> list[TensorEntry]:
    """Turn a parsed header into validated tensor entries; ``origin`` names the file in error messages."""
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        entries.append(_entry(name, entry, file, origin))
    return entries


def _entry(name: str, entry: object, file: str, origin: str) -> TensorEntry:
    if not isinstance(entry, dict):
        raise ModelInputError(f"{origin}: tensor {name!r} is not described by an object; the header is corrupt")
    dtype = entry.get("dtype")
    if dtype not in DTYPE_BITS:
        raise ModelInputError(
            f"{origin}: tensor {name!r} has unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BITS))}"
        )
    shape = entry.get("shape")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ModelInputError(f"{origin}: tensor {name!r} has invalid shape {shape!r}; the header is corrupt")
    nbytes = tensor_nbytes(dtype, tuple(shape))
    offsets = entry.get("data_offsets")
    if isinstance(offsets, list) and len(offsets) == 2 and offsets[1] - offsets[0] != nbytes:
        raise ModelInputError(
            f"{origin}: tensor {name!r} ({dtype} {shape}) needs {nbytes} bytes but its data_offsets span "
            f"{offsets[1] - offsets[0]}; the header is corrupt"
        )
    return TensorEntry(name=name, dtype=dtype, shape=tuple(shape), nbytes=nbytes, file=file)


def read_entries(path: Path, file: str) -> list[TensorEntry]:
    """Read one local safetensors file's header into tensor entries."""
    return entries_from_header(read_header_json(path), file, str(path))
