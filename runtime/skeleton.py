"""The model a checkpoint loads into: its skeleton on the meta device, and which checkpoint tensor becomes which
model param (transformers' own conversion mapping, the functions ``from_pretrained`` uses), including the
per-expert tensors that are read straight into their range of a fused param.
"""

import contextlib
import copy
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from planner.errors import ModelInputError, shown
from runtime.checkpoint_reader import Reader, SourceTensor
from runtime.params import is_shard, repoint
from runtime.quantized import FP8_WEIGHT_DTYPES, check_runnable, compute_dtype, quantization_section, quantize_skeleton


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


def build_skeleton(folder: Path, sources: dict[str, SourceTensor], config: dict | None) -> nn.Module:
    """The transformers model for the checkpoint, params on meta, in the dtype from_pretrained(dtype="auto")
    would choose, weights tied as the config says; an FP8 block-quantized checkpoint's linears are transformers'
    FP8 modules (runtime.quantized), any other quantization one line. ``sources``: the checkpoint's tensors,
    from the headers already read (a config without a dtype takes the first floating, unquantized tensor's);
    ``config``: config.json as the planner parsed it (Checkpoint.config), not read again here."""
    from transformers import AutoModelForCausalLM

    config_folder = folder if folder.is_dir() else folder.parent
    config = transformers_config(config, config_folder)
    quantization = quantization_section(config)
    if quantization is not None:
        check_runnable(quantization, str(folder))
    dtype = _auto_dtype(config, sources)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if quantization is not None:
        quantize_skeleton(model, quantization)  # transformers' FP8 modules, weights placed as stored
    model.tie_weights()
    _load_generation_config(model, config_folder)
    return model.eval()


def transformers_config(config: dict | None, folder: Path):
    """What ``AutoConfig.from_pretrained(folder)`` returns, built from config.json's mapping already parsed: the
    class transformers' AutoConfig picks (CONFIG_MAPPING by model_type, with its one heuristic: a mistral config
    with layer_types is ministral) and its ``from_dict``, on a copy (config classes rewrite nested sections such as
    rope_scaling in place, and the planner's record keeps the mapping). Multimodal configs build their
    text_config the same way from_pretrained does. Custom code (a model_type transformers does not ship) is one
    line: run builds transformers' own classes and never runs a checkpoint's code."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if config is None:
        raise ModelInputError(f"{folder}: no config.json; run builds the model config.json describes: put the "
                              "model's own config.json beside its weights")
    mapping = copy.deepcopy(config)
    model_type = mapping.get("model_type")
    if model_type == "mistral" and "layer_types" in mapping:
        mapping["model_type"] = model_type = "ministral"  # AutoConfig.from_pretrained's heuristic, as it applies it
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ModelInputError(f"{folder}: config.json's model_type {shown(model_type)} is not one this transformers "
                              "ships; run builds transformers' own model classes: upgrade transformers, or give a "
                              "model it supports")
    return CONFIG_MAPPING[model_type].from_dict(mapping, name_or_path=str(folder))


def _auto_dtype(config, sources: dict[str, SourceTensor]) -> torch.dtype:
    """from_pretrained's dtype="auto": the config's dtype, else the first floating tensor's (of the first
    shard, in file order: safetensors writes its header in the order of the data)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    first_file = min((source.path for source in sources.values()), default=None)
    in_file_order = sorted((source.offset_bytes, source.dtype) for source in sources.values()
                           if source.path == first_file)
    return next((dtype for _, dtype in in_file_order if dtype.is_floating_point and dtype not in FP8_WEIGHT_DTYPES),
                torch.get_default_dtype())


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
    """Point every holder of one param at ``tensor`` (a view of an arena), as a new Parameter; a tensor-parallel
    rank's DTensor stays the DTensor it was, reading ``tensor`` as its shard (runtime.params)."""
    module, attribute = owners[0]
    if is_shard(module._parameters[attribute]):
        repoint(module._parameters[attribute], tensor)  # one object, whatever holds it
        return
    param = nn.Parameter(tensor, requires_grad=False)
    for module, attribute in owners:
        module._parameters[attribute] = param


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


def convert_group(model: nn.Module, reader: Reader, group: list[SourceTensor], weight_mapping: list,
                  lock: threading.Lock) -> dict[str, torch.Tensor]:
    """Read one converted group and let transformers convert it; returns the params it produced (host
    tensors), which transformers has set on the model (the caller replaces them at once)."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    state = {source.name: reader.read_tensor(source) for source in group}
    dtype = compute_dtype(model)
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
