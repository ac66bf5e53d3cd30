"""Find the repeated block stack in a checkpoint from tensor names alone, and sum bytes per layer.

A stack is a name prefix followed by a layer index: ``model.layers.N.``, ``transformer.h.N.``,
``language_model.model.layers.N.``. The first numeric segment of a name decides which stack it belongs to, so
experts inside a layer (``mlp.experts.7.``) stay inside their layer. No per-architecture tables.
"""

import functools
import itertools
import re
from collections import defaultdict
from dataclasses import dataclass

from planner.source.checkpoint import Checkpoint
from planner.errors import ModelInputError
from planner.model.experts import is_expert_param, max_experts
from planner.model.model_config import check_against_tensors, model_config
from planner.source.safetensors_header import TensorEntry


@dataclass(frozen=True, kw_only=True)
class LayerInfo:
    """One layer of the planned stack."""

    index: int
    #: (name relative to the layer, dtype, shape, bytes), sorted by name
    params: tuple[tuple[str, str, tuple[int, ...], int], ...]

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of every param of the layer (summed once: a DeepSeek-V3 layer has 1,500 params, and the searches
        ask again and again)."""
        return sum(p[3] for p in self.params)

    def matching_bytes(self, segments: tuple[str, ...]) -> int:
        """Bytes of the params selected by ``segments`` (all params when ``segments`` is empty)."""
        if not segments:
            return self.nbytes
        return sum(p[3] for p in self.params if param_selected(p[0], segments))


@dataclass(frozen=True, kw_only=True)
class ModelLayout:
    """The planned stack's layers, and everything else in the checkpoint, counted."""

    stack: str
    #: every stack found, prefix -> number of layers, for reporting and --stack
    stacks: dict[str, int]
    #: layers a served model runs, in index order
    layers: tuple[LayerInfo, ...]
    #: layers of the stack beyond config's layer count (e.g. a multi-token-prediction layer): not loaded
    unused_layers: tuple[LayerInfo, ...]
    #: bytes outside the planned stack (embeddings, norms, head, other stacks): always resident on the GPU
    non_layer_bytes: int
    non_layer_names: tuple[str, ...]

    @property
    def unused_bytes(self) -> int:
        """Bytes of tensors a served model does not use."""
        return sum(layer.nbytes for layer in self.unused_layers)

    @property
    def layer_bytes(self) -> int:
        """Bytes of the layers that run."""
        return sum(layer.nbytes for layer in self.layers)


def param_selected(relative_name: str, segments: tuple[str, ...]) -> bool:
    """vLLM's rule: a segment matches whole dot-separated parts of the name relative to its layer.

    "experts" and "experts.w2_weight" match "mlp.experts.w2_weight"; "expert" and "w2" do not.
    """
    if not segments:
        return True
    dotted = f".{relative_name}."
    return any(f".{segment}." in dotted for segment in segments)


#: a layer index: a whole dot-separated part that is not the first or the last, in ASCII digits and canonical form
#: (int('²') fails, '٣' and '01' would alias other names' indices)
_INDEX_PART = re.compile(r"\.(0|[1-9][0-9]*)\.")


@functools.lru_cache(maxsize=2**18)
def _split(name: str) -> tuple[str, int, str] | None:
    """'model.layers.3.mlp.w' -> ('model.layers', 3, 'mlp.w'); None when the name has no index segment. The
    first index part decides (re.search: the leftmost; a '.01.' before it does not match, as it is no index)."""
    found = _INDEX_PART.search(name)
    if found is None:
        return None
    return name[:found.start()], int(found.group(1)), name[found.end():]


def find_stacks(tensors: tuple[TensorEntry, ...]) -> dict[str, dict[int, list[TensorEntry]]]:
    """Every prefix with two or more layer indices, with the tensors of each layer."""
    grouped: dict[str, dict[int, list[TensorEntry]]] = defaultdict(lambda: defaultdict(list))
    for tensor in tensors:
        split = _split(tensor.name)
        if split is not None:
            grouped[split[0]][split[1]].append(tensor)
    return {prefix: dict(layers) for prefix, layers in grouped.items() if len(layers) >= 2}


def _stack_bytes(layers: dict[int, list[TensorEntry]]) -> int:
    return sum(t.nbytes for tensors in layers.values() for t in tensors)


def config_num_layers(config: dict | None) -> int | None:
    """The number of layers config.json says the served model runs (text config for multimodal models)."""
    record = model_config(config)
    return record.num_layers if record else None


def build_layout(checkpoint: Checkpoint, stack: str | None = None) -> ModelLayout:
    """Pick the stack to plan (the largest by bytes unless ``stack`` names one) and count every tensor."""
    stacks = find_stacks(checkpoint.tensors)
    if not stacks:
        raise ModelInputError(
            f"{checkpoint.source}: no repeated layer stack found in tensor names (expected names like "
            "model.layers.0.*); this checkpoint has nothing to offload layer by layer"
        )
    chosen = stack is None
    if stack is None:
        stack = max(stacks, key=lambda prefix: (_stack_bytes(stacks[prefix]), prefix))
    elif stack not in stacks:
        raise ModelInputError(
            f"--stack {stack!r} is not a layer stack of this checkpoint; choose from {sorted(stacks)}")
    same: dict[tuple, tuple] = {}
    layers = [_layer_info(index, tensors, stack, same) for index, tensors in sorted(stacks[stack].items())]
    _check_contiguous(layers, stack)
    served = config_num_layers(checkpoint.config)
    used = [layer for layer in layers if served is None or layer.index < served]
    unused = [layer for layer in layers if served is not None and layer.index >= served]
    if not used:
        raise ModelInputError(f"config.json says {served} layers but stack {stack} has none below that index")
    # the names find_stacks grouped under the stack (each is "{stack}.{index}.{param}": _split's canonical digits)
    in_stack = {t.name for tensors in stacks[stack].values() for t in tensors}
    outside = [t for t in checkpoint.tensors if t.name not in in_stack]
    if chosen:  # a stack named with --stack (a vision tower's, say) is not the one config.json describes
        _check_config(checkpoint, layers, outside)
    return ModelLayout(
        stack=stack,
        stacks={prefix: len(layers_) for prefix, layers_ in sorted(stacks.items())},
        layers=tuple(used),
        unused_layers=tuple(unused),
        non_layer_bytes=sum(t.nbytes for t in outside),
        non_layer_names=tuple(t.name for t in outside),
    )


def _check_config(checkpoint: Checkpoint, layers: list[LayerInfo], outside: list[TensorEntry]) -> None:
    """config.json against the tensors: the embedding's width, the stack's depth, the experts present."""
    embedding = next((t for t in outside if t.name.endswith("embed_tokens.weight") and len(t.shape) == 2), None)
    moe_layers = [layer for layer in layers if any(is_expert_param(p[0]) for p in layer.params)]
    record = model_config(checkpoint.config)
    check_against_tensors(record, source=checkpoint.source,
                          embedding_width=embedding.shape[1] if embedding else None, num_stack_layers=len(layers),
                          num_experts_present=max_experts(moe_layers) if moe_layers else None)
    if record is not None:
        _check_kv_heads(record, layers, checkpoint.source)
        _check_quantization(record, checkpoint.tensors, checkpoint.source)


#: dtypes whose shapes are the weights' own (packed formats such as MXFP4's U8 blocks are not)
_UNPACKED_DTYPES = ("BF16", "F16", "F32", "F8_E4M3", "F8_E5M2")
#: what each quant_method stores its quantized weights as
_QUANT_DTYPES = {"fp8": ("F8_E4M3", "F8_E5M2"), "mxfp4": ("U8",)}


def _check_kv_heads(record, layers: list[LayerInfo], source: str) -> None:
    """config.json's KV heads x head_dim against the first k_proj's rows: the KV cache is planned from the config,
    and a config that halves its heads would plan the cache at half its size."""
    if not (record.num_kv_heads and record.head_dim):
        return
    for layer in layers:
        for name, dtype, shape, _ in layer.params:
            if name == "self_attn.k_proj.weight" and dtype in _UNPACKED_DTYPES and len(shape) == 2:
                if shape[0] != record.num_kv_heads * record.head_dim:
                    raise ModelInputError(
                        f"{source}: config.json's {record.num_kv_heads} KV heads x head_dim {record.head_dim} is "
                        f"{record.num_kv_heads * record.head_dim} rows, but layer {layer.index}'s k_proj has "
                        f"{shape[0]}; the config is not this checkpoint's: use the model's own")
                return


def _check_quantization(record, tensors, source: str) -> None:
    """quantization_config against the stored tensors: its method's dtypes are there, and FP8 block scales have
    the shape weight_block_size gives their weight."""
    quantization = record.quantization
    if quantization is None:
        return
    wanted = _QUANT_DTYPES.get(quantization.method)
    if wanted is not None and not any(t.dtype in wanted for t in tensors):
        raise ModelInputError(f"{source}: config.json's quant_method is {quantization.method} but no tensor is "
                              f"{' or '.join(wanted)}; the config is not this checkpoint's: use the model's own")
    if quantization.method != "fp8" or quantization.weight_block is None:
        return
    by_name = {t.name: t for t in tensors}
    for scale in tensors:
        weight = by_name.get(scale.name.removesuffix("_scale_inv")) if scale.name.endswith("_scale_inv") else None
        if weight is None or len(weight.shape) != 2 or len(scale.shape) != 2:
            continue
        rows, columns = quantization.weight_block
        expected = (-(-weight.shape[0] // rows), -(-weight.shape[1] // columns))
        if tuple(scale.shape) != expected:
            raise ModelInputError(f"{source}: {scale.name} is {list(scale.shape)}, but weight_block_size "
                                  f"[{rows}, {columns}] over its weight's {list(weight.shape)} gives {list(expected)}; "
                                  "fix weight_block_size in config.json")
        return


def _layer_info(index: int, tensors: list[TensorEntry], stack: str, same: dict[tuple, tuple]) -> LayerInfo:
    """A layer's params; ``same``: the params of layers seen already, so that layers alike (DeepSeek-V3's 58 MoE
    layers) share one tuple, and what is worked out per layer's params (its cost sums, its experts) is worked
    out once per kind of layer."""
    cut = len(stack) + len(str(index)) + 2
    params = tuple(sorted((t.name[cut:], t.dtype, t.shape, t.nbytes) for t in tensors))
    return LayerInfo(index=index, params=same.setdefault(params, params))


def _check_contiguous(layers: list[LayerInfo], stack: str) -> None:
    indices = [layer.index for layer in layers]
    if indices != list(range(len(indices))):
        present = set(indices)
        # The first few gaps, found lazily: an index of 10**12 must not build a range of 10**12 numbers.
        missing = list(itertools.islice((i for i in range(max(indices)) if i not in present), 5))
        raise ModelInputError(
            f"stack {stack}: layer indices are not 0..{len(indices) - 1} (missing {missing[:5]}); "
            "a shard is probably missing from the index"
        )


def layer_kinds(layers: tuple[LayerInfo, ...]) -> tuple[tuple[int, ...], ...]:
    """Layer indices grouped by identical params (names, dtypes, shapes): one group per kind of layer.

    A dense-then-MoE stack (DeepSeek's first layers) has two kinds; a uniform stack has one. Timing one
    layer of each kind times them all.
    """
    groups: dict[tuple, list[int]] = {}
    for layer in layers:
        signature = tuple((name, dtype, shape) for name, dtype, shape, _ in layer.params)
        groups.setdefault(signature, []).append(layer.index)
    return tuple(tuple(indices) for indices in sorted(groups.values()))
