"""Read and validate safetensors headers without touching tensor data.

A safetensors file is an 8-byte little-endian header length, a JSON header, then the tensor bytes. We read
only the first two parts, and check them against the file's size so a truncated download is caught here
rather than at load time.
"""

import itertools
import math
import operator
import struct
from dataclasses import dataclass
from pathlib import Path

from planner.errors import ModelInputError, shown
from planner.source.untrusted import check_nesting, load_json, open_regular

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
    #: where the tensor's first byte lies in its file (8-byte prefix + header + its data offset), so a loader
    #: reads the data from the header parsed here instead of parsing it again; None where only the header's
    #: entries are known (a shard of a tensor-parallel rank)
    offset_bytes: int | None = None

    def resized(self, shape: tuple[int, ...], nbytes: int) -> "TensorEntry":
        """This tensor with another shape and size (as one tensor-parallel rank holds it)."""
        fields = self.__dict__.copy()
        fields["shape"], fields["nbytes"] = shape, nbytes
        return _built(fields)


def _built(fields: dict) -> TensorEntry:
    """A TensorEntry of ``fields`` (every field, checked by the caller). Built without the frozen dataclass's
    __init__, whose six object.__setattr__ calls were 40% of sharding DeepSeek-V3's 92k tensors for each GPU
    count, and a third of turning its headers into entries; the fields are the same."""
    entry = object.__new__(TensorEntry)
    entry.__dict__.update(fields)
    return entry


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this dtype and shape occupies in the file (sub-byte dtypes packed)."""
    return math.ceil(math.prod(shape) * DTYPE_BITS[dtype] / 8)


#: no real tensor has more dimensions, or a dimension this large (its element count would not fit a file)
MAX_DIMS = 16
MAX_DIM = 2**53
#: offsets are u64 in the format; Python files cannot seek past 2**63
MAX_OFFSET = 2**63


def read_header_json(path: Path) -> dict:
    """Return the parsed JSON header of one safetensors file, checking its framing against the file size."""
    return _read_header(path)[0]


def _read_header(path: Path) -> tuple[dict, int]:
    """(parsed JSON header, bytes of tensor data the file holds after it)."""
    return parse_header(*read_header_bytes(path))


def read_header_bytes(path: Path) -> tuple[Path, bytes, int]:
    """(path, the header's raw JSON bytes, bytes of tensor data after it): the file I/O alone, so callers may
    read many files on threads and parse them on one (parsing holds the GIL: threads would only contend)."""
    handle, file_size_bytes = open_regular(path, ModelInputError, "a safetensors file")
    try:
        with handle:
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
    return path, raw, file_size_bytes - HEADER_PREFIX_BYTES - header_bytes


_CORRUPT_FIX = "the file is corrupt: download it again"


def parse_header(path: Path, raw: bytes, data_bytes: int) -> tuple[dict, int]:
    """(parsed JSON header, ``data_bytes``) of bytes read by read_header_bytes."""
    header = load_json(raw, f"{path}: safetensors header", ModelInputError, fix=_CORRUPT_FIX)
    if not isinstance(header, dict):
        raise ModelInputError(f"{path}: safetensors header is not a JSON object; the file is corrupt")
    return header, data_bytes


def entries_from_header(header: dict, file: str, origin: str, data_bytes: int | None = None,
                        data_start_bytes: int | None = None) -> list[TensorEntry]:
    """Turn a parsed header into validated tensor entries; ``origin`` names the file in error messages.

    Data offsets must tile the data area exactly, as the reference implementation requires: sorted by start,
    the first begins at 0 and each begins where the previous ends. An overlap (two tensors sharing bytes) or a
    gap (bytes no tensor owns) means a corrupt or hand-edited file, which the engines would refuse at load
    time, so it is refused here, at planning time. ``data_bytes``: the bytes of tensor data the file holds
    (None where only the header is known, as for headers read from the hub): the tensors must lie within them.
    ``data_start_bytes``: where the data area begins in the file (each entry's offset_bytes counts from there).
    """
    entries, spans = [], []
    nbytes_of: dict[tuple, int] = {}  # by (dtype, shape): a checkpoint repeats a few dozen of them
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensor, span = _entry(name, entry, file, origin, data_start_bytes, nbytes_of)
        entries.append(tensor)
        spans.append((span, name))
    _check_tiling(spans, origin)
    end_offset = max((span[1] for span, _ in spans), default=0)
    if data_bytes is not None and end_offset > data_bytes:
        raise ModelInputError(
            f"{origin}: header describes {end_offset} bytes of tensor data but the file holds {data_bytes}; "
            "the file is truncated: download it again"
        )
    return entries


def _check_tiling(spans: list[tuple[tuple[int, int], str]], origin: str) -> None:
    """Offsets sorted by start must run 0, end0 = start1, end1 = start2, ...: no overlap, no gap."""
    expected_start, previous = 0, None
    for (start, end), name in sorted(spans):
        if start != expected_start:
            what = "overlaps" if start < expected_start else "leaves a gap after"
            after = f"tensor {previous!r}" if previous is not None else "the start of the data"
            raise ModelInputError(
                f"{origin}: tensor {name!r} starts at byte {start}, so it {what} {after} (which ends at "
                f"{expected_start}); the header is corrupt: download the file again"
            )
        expected_start, previous = end, name


def _entry(name: str, entry: object, file: str, origin: str, data_start_bytes: int | None,
           nbytes_of: dict[tuple, int]) -> tuple[TensorEntry, tuple[int, int]]:
    """One validated tensor and its (start, end) data offsets (``nbytes_of``: sizes already worked out)."""
    if not name or not name.isprintable():
        raise ModelInputError(f"{origin}: tensor name {name!r} is empty or holds control characters; the header "
                              "is corrupt")
    if not isinstance(entry, dict):
        raise ModelInputError(f"{origin}: tensor {name!r} is not described by an object; the header is corrupt")
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise ModelInputError(
            f"{origin}: tensor {name!r} has unknown dtype {shown(dtype)}; known: {', '.join(sorted(DTYPE_BITS))}"
        )
    shape = entry.get("shape")
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and _are_counts(shape, MAX_DIM)):
        raise ModelInputError(f"{origin}: tensor {name!r} has invalid shape {shown(shape)}; the header is corrupt")
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and _are_counts(offsets, MAX_OFFSET)
            and offsets[0] <= offsets[1]):
        raise ModelInputError(f"{origin}: tensor {name!r} has invalid data_offsets {shown(offsets)} (two byte offsets, "
                              "start <= end); the header is corrupt")
    shape = tuple(shape)  # plain ints now (no bool, which would hash as 0 or 1), so a key for the sizes
    nbytes = nbytes_of.get((dtype, shape))
    if nbytes is None:
        nbytes = nbytes_of[dtype, shape] = tensor_nbytes(dtype, shape)
    if offsets[1] - offsets[0] != nbytes:
        raise ModelInputError(
            f"{origin}: tensor {name!r} ({dtype} {list(shape)}) needs {nbytes} bytes but its data_offsets span "
            f"{offsets[1] - offsets[0]}; the header is corrupt"
        )
    offset_bytes = None if data_start_bytes is None else data_start_bytes + offsets[0]
    tensor = _built({"name": name, "dtype": dtype, "shape": shape, "nbytes": nbytes, "file": file,
                     "offset_bytes": offset_bytes})
    return tensor, (offsets[0], offsets[1])


def _are_counts(values: list, limit: int) -> bool:
    """Every value a JSON integer in [0, limit] (JSON's true and false are not counts), checked by C calls: a
    shape or offset pair is two or three numbers, and a checkpoint has hundreds of thousands of them."""
    if not values:
        return True
    return set(map(type, values)) == {int} and min(values) >= 0 and max(values) <= limit


def read_entries(path: Path, file: str) -> list[TensorEntry]:
    """Read one local safetensors file's header into tensor entries."""
    return entries_from_bytes(read_header_bytes(path), file)


def entries_from_bytes(read: tuple[Path, bytes, int], file: str) -> list[TensorEntry]:
    """Tensor entries of a header read by read_header_bytes: the same entries and the same refusals as
    parse_header then entries_from_header, most headers checked in bulk (_entries_in_bulk)."""
    path, raw, data_bytes = read
    json_origin = f"{path}: safetensors header"
    header = load_json(raw, json_origin, ModelInputError, fix=_CORRUPT_FIX, nesting_checked_by_caller=True)
    data_start_bytes = HEADER_PREFIX_BYTES + len(raw)
    entries = _entries_in_bulk(header, file, data_bytes, data_start_bytes) if isinstance(header, dict) else None
    if entries is not None:  # the tensors nest three deep: the metadata alone may nest deeper
        if "__metadata__" in header:
            check_nesting({"__metadata__": header["__metadata__"]}, json_origin, ModelInputError, _CORRUPT_FIX)
        return entries
    check_nesting(header, json_origin, ModelInputError, _CORRUPT_FIX)  # refused first, as parse_header would
    if not isinstance(header, dict):
        raise ModelInputError(f"{path}: safetensors header is not a JSON object; the file is corrupt")
    return entries_from_header(header, file, str(path), data_bytes, data_start_bytes=data_start_bytes)


def _entries_in_bulk(header: dict, file: str, data_bytes: int, data_start_bytes: int) -> list[TensorEntry] | None:
    """The header's entries where every check _entry, the tiling and the size make passes, each made over all
    tensors at once by C calls (sets of types, min and max, maps); None where any fails, for entries_from_header
    to find and name the first problem. Every entry must hold exactly dtype, shape and data_offsets, so the
    header nests three deep and only its __metadata__ needs the depth walk. DeepSeek-V3's 129 headers: 92k
    tensors in a third of the time of checking them one by one."""
    names = [name for name in header if name != "__metadata__"]
    values = [header[name] for name in names]
    if not values or "" in header or not all(map(str.isprintable, names)) or set(map(type, values)) != {dict} \
            or set(map(len, values)) != {3}:
        return None
    dtypes = [value.get("dtype") for value in values]
    shapes = [value.get("shape") for value in values]
    offsets = [value.get("data_offsets") for value in values]
    if set(map(type, dtypes)) != {str} or not set(dtypes) <= DTYPE_BITS.keys() \
            or set(map(type, shapes)) != {list} or max(map(len, shapes)) > MAX_DIMS \
            or not _all_counts(list(itertools.chain.from_iterable(shapes)), MAX_DIM) \
            or set(map(type, offsets)) != {list} or set(map(len, offsets)) != {2} \
            or not _all_counts(list(itertools.chain.from_iterable(offsets)), MAX_OFFSET):
        return None
    starts, ends = [pair[0] for pair in offsets], [pair[1] for pair in offsets]
    shapes = list(map(tuple, shapes))
    keys = list(zip(dtypes, shapes))
    nbytes_of = {key: tensor_nbytes(*key) for key in set(keys)}
    nbytes = list(map(nbytes_of.__getitem__, keys))
    if not all(map(operator.le, starts, ends)) or list(map(operator.sub, ends, starts)) != nbytes:
        return None
    spans = sorted(zip(starts, ends))
    if spans[0][0] != 0 or not all(map(operator.eq, (s for s, _ in spans[1:]), (e for _, e in spans[:-1]))) \
            or spans[-1][1] > data_bytes:
        return None
    return [_built({"name": name, "dtype": dtype, "shape": shape, "nbytes": size, "file": file,
                    "offset_bytes": data_start_bytes + start})
            for name, dtype, shape, size, start in zip(names, dtypes, shapes, nbytes, starts)]


def _all_counts(values: list, limit: int) -> bool:
    """_are_counts over a flat list that may be empty."""
    return not values or _are_counts(values, limit)
