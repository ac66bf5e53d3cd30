"""Find a checkpoint's tensors (names, dtypes, shapes, bytes) from its index and shard headers only.

Three sources: a local folder (sharded with an index, or one ``model.safetensors``), a single local
``.safetensors`` file, or a Hugging Face repo id, whose files planner.source.hub fetches (or serves from the local
cache). Either way the index and shard headers are checked and merged here. Tensor data is never read.
"""

import contextlib
import gc
import hashlib
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from planner.errors import ModelInputError, shown
from planner.model.model_config import CONFIG_COUNTS, TEXT_SECTIONS
from planner.source import hub
from planner.source.safetensors_header import TensorEntry, entries_from_bytes, read_entries, read_header_bytes
from planner.source.untrusted import checked_path, load_json, read_capped

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: a shard beside the index: a plain file name (no folder, no leading dot), printable, ending .safetensors
_SHARD_NAME_RE = re.compile(r"^[^./\\][^/\\]*\.safetensors$")
MAX_INDEX_BYTES = 64 * 2**20
MAX_CONFIG_BYTES = 16 * 2**20


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """Every tensor of a checkpoint, with where it came from."""

    #: what the user passed: a path as given (relative to the working directory, or absolute) or a hub repo id
    source: str
    #: "local" or "hub"
    kind: str
    #: the hub commit the files were read at; None for local checkpoints
    revision: str | None
    #: sorted by name
    tensors: tuple[TensorEntry, ...]
    #: the parsed config.json, or None when the checkpoint has none
    config: dict | None
    num_files: int

    @property
    def total_bytes(self) -> int:
        """Bytes of every tensor in the checkpoint."""
        return sum(t.nbytes for t in self.tensors)

    def fingerprint(self) -> str:
        """A hash of every tensor's name, dtype and shape: equal for the same model however it is sharded."""
        shapes: dict[tuple[int, ...], str] = {}  # each shape written once: 92k tensors, a few dozen shapes
        lines = []
        for tensor in self.tensors:
            shape = shapes.get(tensor.shape)
            if shape is None:
                shape = shapes[tensor.shape] = ",".join(map(str, tensor.shape))
            lines.append(f"{tensor.name}\0{tensor.dtype}\0{shape}\n")
        return "sha256:" + hashlib.sha256("".join(lines).encode()).hexdigest()


def load_checkpoint(model: str, revision: str | None = None) -> Checkpoint:
    """Read a checkpoint's tensor list from a local path or a Hugging Face repo id."""
    path = checked_path(Path(model).expanduser(), ModelInputError, "--model")
    if path.exists():
        if revision is not None:
            raise ModelInputError(f"--revision applies to hub repo ids, but {model!r} is a local path; drop it")
        return _load_local(path, _display_path(path))
    if hub.looks_like_repo_id(model):
        hub.check_repo_id(model)
        return _load_hub(model, revision)
    raise ModelInputError(
        f"{model!r} is neither an existing path nor a Hugging Face repo id (org/name); check the spelling"
    )


def _display_path(path: Path) -> str:
    """The path as given: relative ones stay relative to the working directory (plans hold no machine-specific
    prefix unless the user gave one), absolute ones stay absolute."""
    return os.path.normpath(path)


def resolve_local_source(source: str, plan_path: Path) -> str:
    """Where a plan's relative checkpoint path points from here: the working directory, else the plan's folder
    or one of its parents (make ran there: plans/x.yaml made from the repository root names .cache/...).

    Absolute paths and hub ids come back as they are; a relative path found nowhere is a one-line error.
    """
    if checked_path(Path(source).expanduser(), ModelInputError, "the plan's checkpoint").is_absolute() \
            or Path(source).exists():
        return source
    for folder in Path(plan_path).resolve().parents:
        if (folder / source).exists():
            return str(folder / source)
    if hub.looks_like_repo_id(source):
        return source
    raise ModelInputError(
        f"the plan's checkpoint {source!r} is not under the working directory nor under {plan_path}'s folder or "
        "its parents; pass --model PATH"
    )


def _load_local(path: Path, source: str) -> Checkpoint:
    if path.is_file():
        if path.name.endswith(".index.json"):
            folder, index_path = path.parent, path
        elif path.suffix == ".json":  # a config.json is not a checkpoint; the tool that makes one from it is
            raise ModelInputError(f"{path} is a JSON file, not a checkpoint: point --model at the model's folder "
                                  f"(config.json and .safetensors shards), or write a header-only one from this "
                                  f"config first: offload-plan header-checkpoint {path} DIR, then --model DIR")
        else:
            return _local_single(path, source, _read_config(path.parent))
    else:
        folder, index_path = path, _find_index(path)
        if index_path is None:
            single = path / SINGLE_NAME
            if not single.exists():
                raise ModelInputError(
                    f"{path}: no {INDEX_NAME} and no {SINGLE_NAME}; point --model at a folder that has "
                    "one of them, or at a .safetensors file"
                )
            return _local_single(single, source, _read_config(path))
    weight_map = _read_weight_map(index_path)
    files = sorted(set(weight_map.values()))
    for name in files:
        if not (folder / name).exists():  # a FIFO or folder there is refused by the reader, not called missing
            raise ModelInputError(
                f"{folder}: shard {name} listed in {index_path.name} is missing; download it "
                "(for planning, its header is enough)"
            )
    # the reads on threads (a cold disk or network file system answers several at once), the parsing on this
    # one: it holds the GIL, and 8 threads parsing DeepSeek-V3's 129 headers took 2.9 s against 2.3 s serially
    with ThreadPoolExecutor(max_workers=8) as pool:
        reads = list(pool.map(lambda name: read_header_bytes(folder / name), files))
    with collector_paused():
        per_file = [entries_from_bytes(read, name) for read, name in zip(reads, files)]
        tensors = _merge_shards(weight_map, dict(zip(files, per_file)), str(index_path))
    return Checkpoint(
        source=source, kind="local", revision=None, tensors=tensors, config=_read_config(folder), num_files=len(files)
    )


@contextlib.contextmanager
def collector_paused(*, freeze: bool = False):
    """Python's cyclic garbage collector off for the block, as it was after (planning nests them).

    Parsing headers allocates millions of objects that live on (DeepSeek-V3: 92k tensors, each a dict, two lists
    and an entry), and every few thousand allocations the collector walks the ones already made, to find
    reference cycles that JSON trees and frozen entries never form: half the time of parsing DeepSeek-V3's
    129 headers went to it. Reference counting still frees everything the block drops; a cycle made inside
    waits for the next collection after it.

    ``freeze``: for a process that ends soon after (the command line's make), every object alive when the block
    ends goes to the collector's permanent generation (gc.freeze), never walked again. Else the collector, once
    enabled, finds all the block made in its youngest generation and walks it (0.4 s after make --tp 2,4), and the
    collection at the interpreter's exit walks it once more. Not in a long-lived process: a cycle that was alive
    at the freeze is never freed."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if was_enabled:
            gc.enable()


def _find_index(folder: Path) -> Path | None:
    if (folder / INDEX_NAME).exists():
        return folder / INDEX_NAME
    candidates = sorted(folder.glob("*.safetensors.index.json"))
    if len(candidates) > 1:
        names = ", ".join(c.name for c in candidates)
        raise ModelInputError(f"{folder}: several indexes ({names}); pass the one to plan as --model PATH/NAME")
    return candidates[0] if candidates else None


def _local_single(path: Path, source: str, config: dict | None) -> Checkpoint:
    entries = read_entries(path, path.name)
    return Checkpoint(
        source=source,
        kind="local",
        revision=None,
        tensors=tuple(sorted(entries, key=lambda t: t.name)),
        config=config,
        num_files=1,
    )


def _read_weight_map(index_path: Path) -> dict[str, str]:
    raw = read_capped(index_path, MAX_INDEX_BYTES, ModelInputError, "a checkpoint index")
    index = load_json(raw, f"{index_path}: cannot read the index", ModelInputError, fix="download the index again")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelInputError(f"{index_path}: the index has no weight_map; download it again")
    if not _weight_map_sound(weight_map):
        _refuse_weight_map(weight_map, index_path)
    return weight_map


def _weight_map_sound(weight_map: dict) -> bool:
    """Every name printable and every file a shard name, checked in C passes: DeepSeek-V3's index maps 92k names
    to 129 files, so each file name is matched once, not once per tensor."""
    if "" in weight_map or not all(map(str.isprintable, weight_map)):
        return False
    if set(map(type, weight_map.values())) != {str}:
        return False
    return all(file.isprintable() and _SHARD_NAME_RE.match(file) for file in set(weight_map.values()))


def _refuse_weight_map(weight_map: dict, index_path: Path) -> None:
    """The first entry of a weight_map _weight_map_sound refused, in one line."""
    for name, file in weight_map.items():
        if not name or not name.isprintable():
            raise ModelInputError(f"{index_path}: tensor name {name!r} is empty or holds control characters; "
                                  "download the index again")
        if not (isinstance(file, str) and file.isprintable() and _SHARD_NAME_RE.match(file)):
            raise ModelInputError(f"{index_path}: weight_map puts {name!r} in {shown(file)}, which is not the name "
                                  "of a .safetensors shard beside the index; download the index again")
    raise AssertionError("_weight_map_sound refused a weight_map whose entries all pass")


def _merge_shards(weight_map: dict[str, str], per_file: dict[str, list[TensorEntry]], origin: str):
    """Check that the index and the shard headers agree, and return every tensor once, sorted by name.

    They agree when the shards' tensors, named once each, map to the files the index gives them: one comparison
    of two dicts. Only where they do not is the first disagreement looked for, to name it."""
    by_name = {entry.name: entry for entries in per_file.values() for entry in entries}
    if len(by_name) != sum(map(len, per_file.values())) or \
            {name: entry.file for name, entry in by_name.items()} != weight_map:
        _refuse_merge(weight_map, per_file, origin)
    return tuple(by_name[name] for name in sorted(by_name))


def _refuse_merge(weight_map: dict[str, str], per_file: dict[str, list[TensorEntry]], origin: str) -> None:
    """The first way the index and the shard headers disagree, in one line."""
    by_name: dict[str, TensorEntry] = {}
    for file, entries in per_file.items():
        for entry in entries:
            if entry.name in by_name:
                raise ModelInputError(
                    f"{origin}: tensor {entry.name!r} is in both {by_name[entry.name].file} and {file}; "
                    "the checkpoint is inconsistent"
                )
            by_name[entry.name] = entry
    unlisted = sorted(set(by_name) - set(weight_map))
    if unlisted:
        # Refused rather than planned: the index is what loaders read, so a tensor it does not list would be
        # counted in the plan's bytes but never loaded (or the shards are from another version of the model).
        raise ModelInputError(
            f"{origin}: {len(unlisted)} tensor(s) in the shards are not in the index, e.g. {unlisted[0]!r} in "
            f"{by_name[unlisted[0]].file}; the index and shards are from different versions: download them again"
        )
    for name, file in weight_map.items():
        entry = by_name.get(name)
        if entry is None or entry.file != file:
            raise ModelInputError(
                f"{origin}: the index puts {name!r} in {file} but that shard's header does not have it; "
                "the index and shards are from different versions: download them again"
            )
    raise AssertionError("_merge_shards refused shards that agree with their index")


def _read_config(folder: Path) -> dict | None:
    config_path = folder / "config.json"
    if not config_path.exists() and not config_path.is_symlink():  # a FIFO or folder there is refused, not skipped
        return None
    raw = read_capped(config_path, MAX_CONFIG_BYTES, ModelInputError, "config.json")
    # NaN and Infinity are accepted in keys the planner does not read; the ones it reads are checked below.
    config = load_json(raw, str(config_path), ModelInputError, allow_constants=True, fix="fix or remove it")
    if not isinstance(config, dict):
        raise ModelInputError(f"{config_path}: not a JSON object; fix or remove it")
    check_config(config, str(config_path))
    return config


def config_sections(config: dict, origin: str) -> list[tuple[str, dict]]:
    """(key prefix, section) of config.json and of each language-model section it nests (text_config, ...); a
    section that is not an object is one line."""
    sections = [("", config)]
    for key in TEXT_SECTIONS:
        section = config.get(key)
        if section is not None and not isinstance(section, dict):
            raise ModelInputError(f"{origin}: {key} is {shown(section)}, not an object; fix config.json")
        if section is not None:
            sections.append((f"{key}.", section))
    return sections


def check_whole_numbers(sections: list[tuple[str, dict]], limits: dict, origin: str) -> None:
    """Each key of ``limits`` (key -> (lowest, highest)) a section gives is a whole number in its range."""
    for prefix, section in sections:
        for key, (low, high) in limits.items():
            value = section.get(key)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool)
                                          and low <= value <= high):
                raise ModelInputError(f"{origin}: {prefix}{key} is {shown(value)}; it must be a whole number from "
                                      f"{low} to {high}: fix config.json")


def check_config(config: dict, origin: str) -> None:
    """Every config.json key the planner reads has the type and range a real model's has (null: not given)."""
    sections = config_sections(config, origin)
    check_whole_numbers(sections, CONFIG_COUNTS, origin)
    for prefix, section in sections[1:]:  # the language model's figures are read from its own section
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads"):
            outer, inner = config.get(key), section.get(key)
            if outer is not None and inner is not None and outer != inner:
                raise ModelInputError(f"{origin}: {key} is {shown(outer)} but {prefix}{key} is {shown(inner)}; "
                                      "the two must agree: fix config.json")
    for prefix, section in sections:
        broken = _section_rules(section)
        if broken is not None:
            raise ModelInputError(f"{origin}: {prefix}{broken}: fix config.json")
    architectures = config.get("architectures")
    if architectures is not None and not (
            isinstance(architectures, list) and all(isinstance(a, str) and a.isprintable() for a in architectures)):
        raise ModelInputError(f"{origin}: architectures is {shown(architectures)}; it must be a list of class names "
                              "such as [\"LlamaForCausalLM\"]: fix config.json")


def _section_rules(section: dict) -> str | None:
    """Keys whose meaning hangs on their type or on another key: a flag that is not a boolean (``"no"`` would read
    as true), and layer_types that is not one type per layer."""
    tied = section.get("tie_word_embeddings")
    if tied is not None and not isinstance(tied, bool):
        return f"tie_word_embeddings is {shown(tied)}; it must be true or false"
    types, num_layers = section.get("layer_types"), section.get("num_hidden_layers")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            return f"layer_types is {shown(types)}; it must be a list of layer type names"
        if isinstance(num_layers, int) and len(types) != num_layers:
            return f"layer_types lists {len(types)} types for num_hidden_layers {num_layers}; give one per layer"
    return None


# ---- a checkpoint on the Hugging Face hub, read through planner.source.hub ----------------------------------


def _load_hub(repo_id: str, revision: str | None) -> Checkpoint:
    """Index and config through hf_hub_download (cached), shard headers from the cache or range requests.

    With HF_HUB_OFFLINE, or when the hub's host does not answer within seconds, only the local cache is read.
    """
    offline = hub.hub_unreachable()
    index_path = hub.hub_file(repo_id, INDEX_NAME, revision, required=False, offline=offline)
    if index_path is None:
        weight_map = None
        files = [SINGLE_NAME]
        anchor = hub.hub_file(repo_id, "config.json", revision, required=False, offline=offline)
        if anchor is None and offline:
            raise hub.offline_error(repo_id, "config.json", offline)
    else:
        weight_map = _read_weight_map(index_path)
        files = sorted(set(weight_map.values()))
        anchor = index_path
    commit = hub.commit_of(anchor) if anchor is not None else revision
    config_path = hub.hub_file(repo_id, "config.json", commit, required=False, offline=offline)
    per_file = hub.shard_headers(repo_id, commit, files, offline)
    origin = f"{repo_id}@{commit}"
    if weight_map is None:
        tensors = tuple(sorted(per_file[SINGLE_NAME], key=lambda t: t.name))
    else:
        tensors = _merge_shards(weight_map, per_file, origin)
    config = _read_config(config_path.parent) if config_path is not None else None
    return Checkpoint(
        source=repo_id, kind="hub", revision=commit, tensors=tensors, config=config, num_files=len(files)
    )


