"""Header-only checkpoints: a config.json's real tensor names, dtypes and shapes, and no weights.

transformers builds the model on the meta device (no memory), and every parameter becomes a safetensors
entry. Shards are sparse files of their full size: planning tools see a complete checkpoint, the disk holds
only the headers (a few MB for a 141 GB Llama-3.1-70B). Used for the README's main job, the tests, and plans
of models too large to download.

The output folder is this module's own: it is built beside the target and moved into place, so a failure
leaves nothing half-written. An existing folder is replaced only when it is empty or carries the marker file
this module writes (``MARKER_NAME``) and holds nothing but the files the marker lists: a folder it did not
make (a real model folder, say) is refused, never deleted or written into.

Building the tensor list needs torch and transformers (the runtime extra); writing shards from a given
list (``write_checkpoint_folder``) needs neither.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from planner.source.checkpoint import MAX_CONFIG_BYTES, check_config, check_whole_numbers, config_sections
from planner.errors import ModelInputError, UsageError
from planner.model.model_config import CONFIG_LIMITS, SAFETENSORS_DTYPES
from planner.source.untrusted import checked_path, load_json, read_capped

#: written into every folder this module makes: what kind of checkpoint, and the files written there
MARKER_NAME = ".offload-plan-checkpoint"
HEADER_ONLY = "header-only"
DEFAULT_SHARD_BYTES = 5 * 2**30
BITS = {"BF16": 16, "F16": 16, "F32": 32, "F8_E4M3": 8, "U8": 8}

#: (name, safetensors dtype, shape)
TensorSpec = tuple[str, str, list[int]]


@dataclass(frozen=True, kw_only=True)
class HeaderCheckpoint:
    """What ``write_header_checkpoint`` wrote."""

    #: the checkpoint folder (config.json, model.safetensors.index.json, shards, marker)
    folder: Path
    num_tensors: int
    num_shards: int
    #: the tensors' bytes as the shards' headers declare them (the files' apparent size, less headers)
    tensor_bytes: int

    def __post_init__(self) -> None:
        if self.num_tensors < 0 or self.num_shards < 0 or self.tensor_bytes < 0:
            raise ValueError("HeaderCheckpoint counts and bytes must be >= 0")


def read_config(config_path: Path) -> dict:
    """config.json as a dict, or one line saying why it cannot be read."""
    if not checked_path(config_path, ModelInputError, "config").exists():
        raise ModelInputError(f"{config_path}: no such file; give the model's config.json")
    raw = read_capped(config_path, MAX_CONFIG_BYTES, ModelInputError, "config.json")
    config = load_json(raw, f"{config_path}: not a readable JSON config.json", ModelInputError, allow_constants=True,
                       fix="give the model's config.json")
    if not isinstance(config, dict):
        raise ModelInputError(f"{config_path}: config.json must hold a JSON object")
    check_config(config, str(config_path))  # make's bounds: a checkpoint make would refuse is not written
    _check_widths(config, str(config_path))
    return config


def _check_widths(config: dict, origin: str) -> None:
    """Every size of CONFIG_LIMITS the config gives, in range: make checks the widths where it reads them, and a
    header-checkpoint reads them all (a 10^13 vocabulary would be a file no file system holds)."""
    check_whole_numbers(config_sections(config, origin), CONFIG_LIMITS, origin)


def dtype_for(name: str) -> str:
    """The safetensors dtype for a config.json dtype name."""
    if name not in SAFETENSORS_DTYPES:
        raise UsageError(f"dtype {name!r} is not supported; choose one of {', '.join(SAFETENSORS_DTYPES)}")
    return SAFETENSORS_DTYPES[name]


def write_checkpoint_folder(*, config_path: Path, specs: list[TensorSpec], out_dir: Path,
                            shard_bytes: int = DEFAULT_SHARD_BYTES) -> HeaderCheckpoint:
    """config.json, the index and sparse shards of ``specs``, built beside ``out_dir`` and moved into place."""
    if shard_bytes <= 0:
        raise UsageError(f"shard size must be positive, got {shard_bytes} bytes")
    counts = {}

    def fill(staging: Path) -> None:
        shutil.copyfile(config_path, staging / "config.json")
        counts["shards"], counts["bytes"] = write_sparse_shards(specs, staging, shard_bytes)

    write_owned_folder(out_dir, kind=HEADER_ONLY, fill=fill)
    return HeaderCheckpoint(folder=out_dir, num_tensors=len(specs), num_shards=counts["shards"],
                            tensor_bytes=counts["bytes"])


def write_owned_folder(out_dir: Path, *, kind: str, fill) -> None:
    """Build a folder with ``fill(staging)`` beside ``out_dir``, mark it as ``kind``, and move it into place.

    ``out_dir`` may be missing, empty, or one this module marked before (its files are then replaced);
    anything else is refused before anything is written. The runtime's random-weight benchmark checkpoints
    are written through here too.
    """
    previous = owned_files(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        fill(staging)
        written = sorted(path.name for path in staging.iterdir())
        (staging / MARKER_NAME).write_text(json.dumps({"kind": kind, "files": written}, indent=1) + "\n")
        move_into_place(staging, out_dir, previous)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)  # the staging folder is ours: made above
        if isinstance(error, OSError):  # a shard larger than the file system allows (EFBIG), a full disk
            raise UsageError(f"cannot write the checkpoint beside {out_dir} ({error.strerror or type(error).__name__}"
                             "); check the model's sizes, free space and permissions (nothing was changed)") from None
        raise


def marker_kind(folder: Path) -> str | None:
    """The kind recorded by this module's marker in ``folder``, or None where there is no readable marker."""
    try:
        return json.loads((folder / MARKER_NAME).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def owned_files(out_dir: Path) -> list[str] | None:
    """The files a previous run wrote into ``out_dir`` (None: the folder does not exist; [] when empty).

    Refuses, in one line, anything else: a file, or a non-empty folder without this module's marker, or a
    marked folder holding files the marker does not list (someone else's since).
    """
    checked_path(out_dir, UsageError, "output folder")
    if not out_dir.exists() and not out_dir.is_symlink():
        return None
    if out_dir.is_symlink() or not out_dir.is_dir():
        raise UsageError(f"{out_dir} exists and is not a folder; choose a new folder for the checkpoint")
    present = sorted(path.name for path in out_dir.iterdir())
    if not present:
        return []
    marker = out_dir / MARKER_NAME
    if not marker.is_file():
        raise UsageError(f"{out_dir} is not empty and was not made by offload-plan; choose a new folder "
                         "(nothing there was changed)")
    listed = marker_files(marker)
    foreign = sorted(set(present) - set(listed) - {MARKER_NAME})
    if foreign:
        raise UsageError(f"{out_dir} holds files offload-plan did not write "
                         f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); move them or choose "
                         "a new folder (nothing there was changed)")
    return present


def marker_files(marker: Path) -> list[str]:
    """The file names a marker lists, or one line saying the marker is not one this module wrote."""
    try:
        files = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        files = None
    if not isinstance(files, list) or not all(isinstance(name, str) and "/" not in name for name in files):
        raise UsageError(f"{marker} is not a marker this tool wrote; choose a new folder (nothing was changed)")
    return files


def move_into_place(staging: Path, out_dir: Path, previous: list[str] | None) -> None:
    """Rename the staged folder to ``out_dir``; into an existing (empty or own) one, file by file.

    An existing folder is kept (it may be the user's, made empty for this): only the files ``owned_files``
    found there, all written by this module, are removed first.
    """
    if previous is None:
        os.replace(staging, out_dir)
        return
    for name in previous:
        (out_dir / name).unlink()
    for path in staging.iterdir():
        os.replace(path, out_dir / path.name)
    staging.rmdir()


def write_sparse_shards(specs: list[TensorSpec], folder: Path, shard_bytes: int) -> tuple[int, int]:
    """Split tensors into shards of about ``shard_bytes``, write each header and extend the file sparsely.

    Returns (number of shards, tensor bytes).
    """
    shards = split_shards(specs, shard_bytes)
    weight_map, total = {}, 0
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        total += write_shard(folder / name, shard)
        weight_map.update({spec[0]: name for spec in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return len(shards), total


def split_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive runs of tensors, each closed before it would pass ``shard_bytes`` (one tensor at least)."""
    shards, current, size = [], [], 0
    for spec in specs:
        if current and size + num_bytes(spec) > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += num_bytes(spec)
    shards.append(current)
    return shards


def num_bytes(spec: TensorSpec) -> int:
    """A tensor's bytes from its dtype and shape."""
    count = 1
    for dim in spec[2]:
        count *= dim
    return count * BITS[spec[1]] // 8


def write_shard(path: Path, shard: list[TensorSpec]) -> int:
    """One safetensors file: the real header, then a hole as long as the tensors. Returns the tensor bytes."""
    header, offset = {}, 0
    for name, dtype, shape in shard:
        size = num_bytes((name, dtype, shape))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + offset)  # sparse: no data blocks are written
    return offset
