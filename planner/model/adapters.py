"""LoRA adapters: read PEFT adapter folders (config and safetensors header only) and plan their GPU slots.

An adapter is a PEFT folder with ``adapter_config.json`` (r, lora_alpha, target_modules,
base_model_name_or_path) and ``adapter_model.safetensors``, whose tensors are named after the base model's
params: ``base_model.model.<module>.lora_A.weight`` of shape (r, in_features) and ``...lora_B.weight`` of shape
(out_features, r) for every adapted ``<module>.weight`` of shape (out_features, in_features). Only the header is
read, through the same bounded readers as checkpoints; hub ids go through planner.source.checkpoint's hub helpers
(cache first, HF_HUB_OFFLINE honoured).

The plan keeps ``num_slots`` adapters on the GPU, each slot as large as the largest adapter (engines allocate
their LoRA buffers at the max rank for every slot), and pins every adapter in host memory: the slots hold copies,
so an evicted adapter is copied in again from the pinned pool rather than read from disk.

The wait model (a new batch whose adapters are not loaded, nothing else running), with c the copy time of one
adapter of slot size over the whole link and k = min(slots, batch sequences, adapters) the adapters missing:

- blocking: copy all k, then compute. Every request of the batch waits k*c; the compute stream idles k*c. The
  steps after that run as planned: the offloaded weights have the link to themselves again.
- pipelined: copies go in the order requests need them; request j starts as soon as its adapter has landed.
  The first adapter has the whole link (nothing runs yet): the first request waits c, and the compute stream
  idles c. The next k-1 copies share the link with the offloaded weights of the steps now running: those steps
  keep their copies' share of the link (prediction.link_busy_share), the adapters get the rest, but never less
  than MIN_ADAPTER_LINK_SHARE (else an always-busy link would never load them). So each later copy takes
  c / max(1 - link_busy_share, MIN_ADAPTER_LINK_SHARE), and the last request waits c plus k-1 of those. Where
  the weights' share is above 1 - MIN_ADAPTER_LINK_SHARE they give way: the steps during the loads stretch to
  their copies' time over the share left to them (``pipelined_step_ms``); otherwise they keep their time.
"""

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from planner.source import hub
from planner.source.checkpoint import Checkpoint
from planner.errors import ModelInputError, UsageError, shown
from planner.model.layout import ModelLayout
from planner.source.safetensors_header import TensorEntry, entries_from_header, read_entries
from planner.search.groups import copy_ms_of
from planner.source.untrusted import checked_path, load_json, read_capped

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
MAX_ADAPTER_CONFIG_BYTES = 1 * 2**20
#: PEFT's tensor names: the base param's module under base_model.model., then lora_A or lora_B
_TENSOR_RE = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][\w.-]{0,63}$")
#: element types an adapter's weights may have
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
#: ranks beyond this are not low-rank adapters (PEFT's largest published ones are 1024)
MAX_RANK = 2**16
MAX_ADAPTERS = 4096
#: the least share of the link adapter copies get while offloaded weights are copied too (see the module doc)
MIN_ADAPTER_LINK_SHARE = 0.2


@dataclass(frozen=True, kw_only=True)
class Adapter:
    """One LoRA adapter as its config and header describe it."""

    #: the name requests use (NAME of --adapter NAME=PATH)
    name: str
    #: the path or hub id as given
    source: str
    #: hub commit the files were read at; None for local folders
    revision: str | None
    rank: int
    alpha: float
    #: module names adapted (last name segments: q_proj, v_proj, ...), sorted
    target_modules: tuple[str, ...]
    #: the config's base_model_name_or_path (None when absent)
    base_model: str | None
    num_tensors: int
    #: bytes of every tensor of the adapter
    total_bytes: int
    #: bytes per decoder layer of the planned stack, index = layer
    layer_bytes: tuple[int, ...]
    #: sha256 over the tensors' names, dtypes and shapes, and the config's rank and alpha
    fingerprint: str

    def __post_init__(self):
        if not 1 <= self.rank <= MAX_RANK:
            raise ValueError(f"rank must be from 1 to {MAX_RANK}")
        if self.total_bytes < sum(self.layer_bytes) or self.num_tensors < 2:
            raise ValueError("an adapter holds at least one lora_A/lora_B pair and its layers' bytes")


def parse_adapter_option(text: str) -> tuple[str, str]:
    """``NAME=PATH`` of --adapter: a plain name (letters, digits, ``_.-``) and a folder or hub id."""
    name, equals, path = str(text).partition("=")
    if not equals or not path or not _NAME_RE.fullmatch(name):
        raise UsageError(f"--adapter {shown(text)}: give NAME=PATH, a name of letters, digits, '_', '.' or '-' "
                         "(at most 64) and a PEFT adapter folder or hub id, e.g. --adapter sql=./adapters/sql")
    return name, path


def load_adapters(options: tuple[str, ...], checkpoint: Checkpoint, layout: ModelLayout) -> tuple[Adapter, ...]:
    """Every --adapter, read and checked against the base checkpoint; names must be distinct."""
    if len(options) > MAX_ADAPTERS:
        raise UsageError(f"{len(options)} adapters: at most {MAX_ADAPTERS} are planned")
    adapters, seen = [], set()
    suffixes = linear_suffixes(checkpoint) if options else frozenset()
    for option in options:
        name, path = parse_adapter_option(option)
        if name in seen:
            raise UsageError(f"--adapter {name} is given twice; give each adapter its own name")
        seen.add(name)
        adapters.append(load_adapter(name, path, checkpoint, layout, suffixes))
    return tuple(adapters)


def linear_suffixes(checkpoint: Checkpoint) -> frozenset[str]:
    """Every dotted suffix of the base's linear (2-D) weights' module names: what a target_modules entry may be."""
    suffixes = set()
    for tensor in checkpoint.tensors:
        if tensor.name.endswith(".weight") and len(tensor.shape) == 2:
            parts = tensor.name.removesuffix(".weight").split(".")
            suffixes.update(".".join(parts[i:]) for i in range(len(parts)))
    return frozenset(suffixes)


def load_adapter(name: str, source: str, checkpoint: Checkpoint, layout: ModelLayout,
                 suffixes: frozenset[str] | None = None) -> Adapter:
    """Read one adapter (local folder or hub id) and validate it against the base model (``suffixes``: the base's
    linear_suffixes, computed once for many adapters)."""
    path = checked_path(Path(source).expanduser(), ModelInputError, f"adapter {name}:")
    if path.exists():
        if not path.is_dir():
            raise ModelInputError(f"adapter {name}: {source} is not a folder; give the PEFT folder that holds "
                                  f"{CONFIG_NAME} and {WEIGHTS_NAME}")
        config_path, weights_path, revision = path / CONFIG_NAME, path / WEIGHTS_NAME, None
        for needed in (config_path, weights_path):
            if not needed.is_file():
                raise ModelInputError(f"adapter {name}: {source} has no {needed.name}; give a PEFT adapter folder "
                                      "(save_pretrained writes both files)")
        entries = read_entries(weights_path, WEIGHTS_NAME)
    elif hub.looks_like_repo_id(source):
        from huggingface_hub.errors import HFValidationError

        try:
            config_path, entries, revision = _hub_adapter(source)
        except HFValidationError as error:
            raise ModelInputError(f"adapter {name}: {source!r} is not a valid hub repo id ({error}); check it, or "
                                  "give a local folder as ./PATH") from None
    else:
        raise ModelInputError(f"adapter {name}: {source!r} is neither an existing folder nor a hub repo id "
                              "(org/name); check the path")
    origin = f"adapter {name} ({source})"
    config = _read_config(config_path, origin)
    suffixes = linear_suffixes(checkpoint) if suffixes is None else suffixes
    return _adapter(name, source, revision, config, entries, checkpoint, layout, origin, suffixes)


def _hub_adapter(repo_id: str) -> tuple[Path, list[TensorEntry], str | None]:
    """Config through the hub cache (or a download), the header from the cache or a range request."""
    offline = hub.hub_unreachable()
    config_path = hub.hub_file(repo_id, CONFIG_NAME, None, required=False, offline=offline)
    if config_path is None:
        where = f"is not in the local Hugging Face cache and the hub is not used ({offline})" if offline \
            else "is not in that hub repository"
        raise ModelInputError(f"adapter {repo_id}: {CONFIG_NAME} {where}; give a local PEFT adapter folder, or go "
                              "online once to cache it")
    commit = hub.commit_of(config_path)
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, WEIGHTS_NAME, revision=commit)
    if isinstance(cached, str):
        return config_path, read_entries(Path(cached), WEIGHTS_NAME), commit
    if offline:
        raise ModelInputError(f"adapter {repo_id}: {WEIGHTS_NAME} is not in the local Hugging Face cache and the hub "
                              f"is not used ({offline}); give a local PEFT adapter folder, or go online once")
    return config_path, _remote_header(repo_id, commit), commit


def _remote_header(repo_id: str, commit: str | None) -> list[TensorEntry]:
    """The adapter's header over HTTP range requests (a few KB): the weights are never downloaded."""
    from huggingface_hub import HfApi

    try:
        metadata = HfApi().parse_safetensors_file_metadata(repo_id, WEIGHTS_NAME, revision=commit)
    except Exception as error:  # the hub client raises many types; all mean the same to the user
        raise ModelInputError(f"{repo_id}: cannot read {WEIGHTS_NAME}'s header from the hub "
                              f"({type(error).__name__}); retry, or download the adapter folder") from None
    header = {tensor: {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": list(info.data_offsets)}
              for tensor, info in metadata.tensors.items()}
    return entries_from_header(header, WEIGHTS_NAME, f"{repo_id}/{WEIGHTS_NAME}")


def _read_config(path: Path, origin: str) -> dict:
    raw = read_capped(path, MAX_ADAPTER_CONFIG_BYTES, ModelInputError, CONFIG_NAME)
    config = load_json(raw, f"{origin}: {CONFIG_NAME}", ModelInputError, fix="fix it or save the adapter again")
    if not isinstance(config, dict):
        raise ModelInputError(f"{origin}: {CONFIG_NAME} is not a JSON object; save the adapter again")
    return config


def read_adapter_config(folder: Path, origin: str) -> dict:
    """An adapter folder's adapter_config.json (size-capped, one-line errors)."""
    return _read_config(folder / CONFIG_NAME, origin)


def lora_scaling(config: dict, origin: str) -> float:
    """PEFT's scaling of an adapter's output: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    fields = _config_fields(config, origin)
    return fields.alpha / (fields.rank ** 0.5 if config.get("use_rslora") else fields.rank)


@dataclass(frozen=True, kw_only=True)
class _ConfigFields:
    rank: int
    alpha: float
    #: a list of module names, or a string (a regex or "all-linear"): None then
    target_modules: tuple[str, ...] | None
    base_model: str | None


def _config_fields(config: dict, origin: str) -> _ConfigFields:
    """The keys the planner reads, each checked (PEFT's LoraConfig)."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ModelInputError(f"{origin}: peft_type is {shown(peft_type)}; only LoRA adapters (LORA) are planned")
    rank = config.get("r")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and 1 <= rank <= MAX_RANK):
        raise ModelInputError(f"{origin}: r is {shown(rank)}; it must be the rank, a whole number from 1 to "
                              f"{MAX_RANK}: fix {CONFIG_NAME}")
    alpha = config.get("lora_alpha", 8)
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 < alpha <= 1e6):
        raise ModelInputError(f"{origin}: lora_alpha is {shown(alpha)}; it must be a positive number: fix "
                              f"{CONFIG_NAME}")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ModelInputError(f"{origin}: {key} gives some modules their own rank or alpha, which offload-plan "
                                  "does not plan yet; use an adapter with one rank")
    if config.get("use_dora"):
        raise ModelInputError(f"{origin}: use_dora is set; DoRA adapters (magnitude vectors) are not planned")
    targets = config.get("target_modules")
    if isinstance(targets, list) and targets and all(isinstance(t, str) and t.isprintable() and t for t in targets):
        target_tuple = tuple(sorted(set(targets)))
    elif isinstance(targets, str) and targets:
        target_tuple = None
    else:
        raise ModelInputError(f"{origin}: target_modules is {shown(targets)}; it must be a list of module names "
                              f"(e.g. [\"q_proj\", \"v_proj\"]) or a pattern: fix {CONFIG_NAME}")
    base = config.get("base_model_name_or_path")
    if base is not None and not (isinstance(base, str) and base.isprintable()):
        raise ModelInputError(f"{origin}: base_model_name_or_path is {shown(base)}; it must be a name or null")
    return _ConfigFields(rank=rank, alpha=float(alpha), target_modules=target_tuple, base_model=base)


def _adapter(name: str, source: str, revision: str | None, config: dict, entries: list[TensorEntry],
             checkpoint: Checkpoint, layout: ModelLayout, origin: str, suffixes: frozenset[str]) -> Adapter:
    fields = _config_fields(config, origin)
    base = {t.name: t for t in checkpoint.tensors}
    pairs: dict[str, dict[str, TensorEntry]] = {}
    for entry in entries:
        match = _TENSOR_RE.fullmatch(entry.name)
        if match is None:
            raise ModelInputError(f"{origin}: tensor {entry.name!r} is not a LoRA weight "
                                  "(base_model.model.<module>.lora_A.weight or lora_B.weight); save the adapter again")
        if entry.dtype not in FLOAT_DTYPES:
            raise ModelInputError(f"{origin}: tensor {entry.name!r} is {entry.dtype}; LoRA weights are "
                                  f"{', '.join(FLOAT_DTYPES)}")
        pairs.setdefault(match["module"], {})[match["which"]] = entry
    if not pairs:
        raise ModelInputError(f"{origin}: {WEIGHTS_NAME} holds no tensors; save the adapter again")
    layer_bytes = [0] * len(layout.layers)
    transformed = _layers_to_transform(config, len(layout.layers), origin)
    for module, pair in sorted(pairs.items()):
        index = _layer_of(module, layout, origin)
        _check_pair(module, pair, base, fields, origin)
        if index is not None:
            if transformed is not None and index not in transformed:
                raise ModelInputError(f"{origin}: the weights adapt {module} in layer {index}, which "
                                      f"layers_to_transform {sorted(transformed)[:8]} leaves out; the config and "
                                      "weights disagree")
            layer_bytes[index] += pair["A"].nbytes + pair["B"].nbytes
    if fields.target_modules is not None:
        _check_targets(fields.target_modules, sorted(pairs), suffixes, origin)
    modules = tuple(sorted({module.rsplit(".", 1)[-1] for module in pairs}))
    return Adapter(name=name, source=source, revision=revision, rank=fields.rank, alpha=fields.alpha,
                   target_modules=modules, base_model=fields.base_model, num_tensors=len(entries),
                   total_bytes=sum(e.nbytes for e in entries), layer_bytes=tuple(layer_bytes),
                   fingerprint=_fingerprint(entries, fields))


def _layers_to_transform(config: dict, num_layers: int, origin: str) -> frozenset[int] | None:
    """PEFT's layers_to_transform (an index or a list of them, each a layer of the stack), None where not given."""
    value = config.get("layers_to_transform")
    if value is None:
        return None
    indices = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not (isinstance(indices, list) and indices and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in indices)):
        raise ModelInputError(f"{origin}: layers_to_transform is {shown(value)}; it must be a layer index or a list "
                              f"of them, from 0 to {num_layers - 1}: fix {CONFIG_NAME}")
    return frozenset(indices)


def _targets(module: str, target: str) -> bool:
    """PEFT's matching of a target_modules entry: the module's name, or a dotted suffix of it."""
    return module == target or module.endswith("." + target)


def _check_targets(targets: tuple[str, ...], modules: list[str], suffixes: frozenset[str], origin: str) -> None:
    """Every adapted module is one target_modules names, and every target names a linear weight of the base."""
    stray = [m for m in modules if not any(_targets(m, t) for t in targets)]
    if stray:
        raise ModelInputError(f"{origin}: the weights adapt {stray[0]}, which target_modules {list(targets)} does "
                              "not name; the config and weights disagree")
    for target in targets:
        if target not in suffixes:
            raise ModelInputError(f"{origin}: target module {target!r} matches no linear weight of the base "
                                  "checkpoint: the adapter is for another model")


def _check_pair(module: str, pair: dict[str, TensorEntry], base: dict[str, TensorEntry], fields: _ConfigFields,
                origin: str) -> None:
    """lora_A (r, in) and lora_B (out, r) of a base weight (out, in) that the checkpoint has, r the config's."""
    missing = {"A", "B"} - set(pair)
    if missing:
        raise ModelInputError(f"{origin}: {module} has lora_{min(pair)} but no lora_{missing.pop()}; "
                              "the adapter file is incomplete: save it again")
    weight = base.get(f"{module}.weight")
    if weight is None:
        segment = module.rsplit(".", 1)[-1]
        raise ModelInputError(f"{origin}: adapts {module}, but the base checkpoint has no {module}.weight "
                              f"(target module {segment!r}): the adapter is for another model")
    if len(weight.shape) != 2:
        raise ModelInputError(f"{origin}: adapts {module}.weight of shape {list(weight.shape)}; LoRA adapts "
                              "two-dimensional (linear) weights")
    out_features, in_features = weight.shape
    a_shape, b_shape = pair["A"].shape, pair["B"].shape
    if a_shape != (fields.rank, in_features) or b_shape != (out_features, fields.rank):
        raise ModelInputError(f"{origin}: {module}: lora_A {list(a_shape)} and lora_B {list(b_shape)} do not "
                              f"match rank r={fields.rank} of {CONFIG_NAME} and the base weight "
                              f"[{out_features}, {in_features}] (expected [{fields.rank}, {in_features}] and "
                              f"[{out_features}, {fields.rank}]); the config and weights disagree")


def _layer_of(module: str, layout: ModelLayout, origin: str) -> int | None:
    """The planned stack's layer a module lies in, None outside the stack; layers beyond it are refused."""
    prefix = layout.stack + "."
    if not module.startswith(prefix):
        return None
    index_text = module[len(prefix):].split(".", 1)[0]
    # ASCII digits only ("²".isdigit() too, and int() refuses it), and few of them (int() of 5,000 digits raises)
    plain = index_text.isascii() and index_text.isdigit() and len(index_text) <= 9
    index = int(index_text) if plain else -1
    if not 0 <= index < len(layout.layers):
        raise ModelInputError(f"{origin}: adapts {module[:160]}, in layer {index_text[:12]} of {layout.stack}, "
                              f"which the base model runs {len(layout.layers)} of; the adapter is for another model")
    return index


def _fingerprint(entries: list[TensorEntry], fields: _ConfigFields) -> str:
    digest = hashlib.sha256(f"r={fields.rank}\0alpha={fields.alpha:g}\n".encode())
    for tensor in sorted(entries, key=lambda t: t.name):
        digest.update(f"{tensor.name}\0{tensor.dtype}\0{','.join(map(str, tensor.shape))}\n".encode())
    return "sha256:" + digest.hexdigest()


# ---- slots and waits ---------------------------------------------------------------------------------------


def slot_bytes_of(adapters: tuple[Adapter, ...]) -> int:
    """One GPU slot holds the largest adapter."""
    return max((a.total_bytes for a in adapters), default=0)


def default_slots(adapters: tuple[Adapter, ...], num_sequences: int, free_bytes: int) -> int:
    """As many slots as a batch of ``num_sequences`` can use at once (one adapter each, at most all adapters),
    fewer where ``free_bytes`` of GPU memory holds fewer; at least one."""
    wanted = min(len(adapters), max(1, num_sequences))
    slot = slot_bytes_of(adapters)
    return max(1, min(wanted, free_bytes // slot if slot else wanted))


@dataclass(frozen=True, kw_only=True)
class AdapterWaits:
    """The predicted wait of a batch whose adapters are not loaded (see the module doc)."""

    #: adapters a new batch misses: min(slots, sequences, adapters)
    num_missing: int
    #: one slot-sized adapter over the whole link
    copy_ms: float
    #: one adapter over the link's share left by the running steps' weight copies
    shared_copy_ms: float
    #: blocking: every request waits this, and the compute stream idles as long
    blocking_wait_ms: float
    #: pipelined: the first request's wait (the compute stream idles as long)
    pipelined_first_wait_ms: float
    #: pipelined: the last request's wait
    pipelined_last_wait_ms: float
    #: pipelined: a step while adapters load (the plan's step unless the weights must give up link time)
    pipelined_step_ms: float


def adapter_waits(*, slot_bytes: int, num_missing: int, h2d_bytes_per_s: float, copy_overhead_us: float,
                  step_ms: float, link_busy_share: float) -> AdapterWaits:
    """Blocking against pipelined loading of ``num_missing`` adapters on the link the offloaded weights use."""
    copy_ms = copy_ms_of(slot_bytes, h2d_bytes_per_s, copy_overhead_us)
    weights_share = min(1.0, max(0.0, link_busy_share))
    adapter_share = max(1.0 - weights_share, MIN_ADAPTER_LINK_SHARE)
    shared_copy_ms = copy_ms / adapter_share
    weights_busy_ms = weights_share * step_ms
    return AdapterWaits(
        num_missing=num_missing,
        copy_ms=copy_ms,
        shared_copy_ms=shared_copy_ms,
        blocking_wait_ms=num_missing * copy_ms,
        pipelined_first_wait_ms=copy_ms,
        pipelined_last_wait_ms=copy_ms + (num_missing - 1) * shared_copy_ms,
        pipelined_step_ms=max(step_ms, weights_busy_ms / (1.0 - MIN_ADAPTER_LINK_SHARE)),
    )


def missing_per_batch(num_slots: int, num_sequences: int, num_adapters: int) -> int:
    """A new batch misses at most one adapter per sequence, per slot, per adapter served."""
    return max(1, min(num_slots, num_sequences, num_adapters))
