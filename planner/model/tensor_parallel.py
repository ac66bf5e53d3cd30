"""Tensor parallelism as vLLM shards a checkpoint: each rank's tensor shapes and its config. What the ranks'
all-reduces cost is planner.model.all_reduce.

The rules follow vLLM's own layers (vllm-project/vllm, ``vllm/model_executor/layers/``):

- ``linear.py`` ColumnParallelLinear and MergedColumnParallelLinear (q_proj, gate/up_proj, Mixtral's w1/w3,
  MLA's q_b_proj and kv_b_proj): the output dim splits, ``divide(output_size, tp_size)``, and so does the bias.
- ``linear.py`` QKVParallelLinear: query heads split (``divide(total_num_heads, tp_size)``); key/value heads
  split where there are at least as many as ranks, else each rank holds one head, replicated
  ``tp_size / num_kv_heads`` times (``num_kv_head_replicas``), so ``tp_size`` must then be a multiple of them.
- ``linear.py`` RowParallelLinear (o_proj, down_proj, w2): the input dim splits; the bias is whole on every rank
  (rank 0 adds it after the all-reduce).
- ``linear.py`` ReplicatedLinear and ``disable_tp=True`` layers: whole on every rank: MoE routers (``mlp.gate``,
  gpt-oss's ``router``), DeepSeek MLA's q_a_proj and kv_a_proj_with_mqa (fused as fused_qkv_a_proj); norms and
  the routing bias are plain parameters, whole everywhere.
- ``vocab_parallel_embedding.py`` VocabParallelEmbedding and ParallelLMHead: the vocabulary is padded to a
  multiple of DEFAULT_VOCAB_PADDING_SIZE (64), then divided over the ranks (``divide`` asserts it divides).
- ``fused_moe/layer.py`` FusedMoE without expert parallelism: every rank holds every expert, each expert's
  intermediate dim split (w13 column-wise, w2 row-wise), ``intermediate_size_per_partition``. With
  ``--enable-expert-parallel`` each rank instead holds num_experts / tp whole experts: the same bytes per rank
  where the experts divide evenly, but another all-to-all pattern; not planned here.
- ``quantization/utils/fp8_utils.py`` (validate_fp8_block_shape) and ``quantization/fp8.py``: a block-quantized
  FP8 weight's partition must be a whole number of blocks (128 x 128 for DeepSeek-V3); its ``weight_scale_inv``
  holds one scale per block of the rank's partition.
- ``quantization/mxfp4.py`` Mxfp4MoEMethod.create_weights: gpt-oss's MXFP4 experts pad each rank's intermediate
  partition up to a multiple of 64 on the Triton backend (vLLM's choice on an H100; Marlin pads to 128 and
  FlashInfer on Blackwell to 256), w13 and its scales and bias by rows, w2's FP4 blocks and scales by columns;
  w2's bias stays whole.
- ``models/gpt_oss.py``: the attention sinks are one per local head (``num_attention_heads // tp_size``).

A checkpoint tensor the rules do not name is refused with one line under --tp (a 1-D tensor is taken as
replicated: norms and small vectors). Pure: no torch.
"""

import copy
import functools
import math
from dataclasses import dataclass

from planner.source.checkpoint import Checkpoint
from planner.errors import ModelInputError, UsageError
from planner.model.model_config import TEXT_SECTIONS, model_config
from planner.source.safetensors_header import TensorEntry, tensor_nbytes

#: vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE: the vocabulary is padded to a multiple of this
VOCAB_PADDING = 64
#: mxfp4.py: the Triton backend's round_up(intermediate_size_per_partition, 64) for MXFP4 experts
MXFP4_PAD = 64
#: MXFP4: 32 FP4 values share one scale, two values a byte
MXFP4_BLOCK = 32
#: DeepSeek-V3's quantization_config.weight_block_size where a config leaves it out
DEFAULT_FP8_BLOCK = (128, 128)
#: far above any tensor-parallel group (a node has 8 GPUs, an NVL72 rack 72); beyond it --tp is a typo
MAX_TP_SIZE = 1024
# Module names (the part before .weight/.bias) by how vLLM splits them.
_COLUMN = {"q_proj": "QKVParallelLinear", "gate_proj": "MergedColumnParallelLinear",
           "up_proj": "MergedColumnParallelLinear", "w1": "FusedMoE (w13)", "w3": "FusedMoE (w13)",
           "q_b_proj": "ColumnParallelLinear", "kv_b_proj": "ColumnParallelLinear"}
_KV = {"k_proj": "QKVParallelLinear", "v_proj": "QKVParallelLinear"}
_ROW = {"o_proj": "RowParallelLinear", "down_proj": "RowParallelLinear", "w2": "FusedMoE (w2)"}
#: ``head``: DeepSeek's multi-token-prediction layer's shared_head.head (a ParallelLMHead)
_VOCAB = {"embed_tokens": "VocabParallelEmbedding", "lm_head": "ParallelLMHead", "head": "ParallelLMHead"}
#: ``eh_proj``: the multi-token-prediction layer's projection, a plain nn.Linear (models/deepseek_mtp.py)
_REPLICATED = {"q_a_proj", "kv_a_proj_with_mqa", "gate", "router", "eh_proj"}
#: gpt-oss's fused MXFP4 experts: param name under mlp.experts -> how it splits
_MXFP4_EXPERTS = {"gate_up_proj_blocks": "mxfp4_rows", "gate_up_proj_scales": "mxfp4_rows",
                  "gate_up_proj_bias": "mxfp4_rows", "down_proj_blocks": "mxfp4_cols",
                  "down_proj_scales": "mxfp4_cols", "down_proj_bias": "replicated"}
_SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True, kw_only=True)
class Split:
    """How one checkpoint tensor splits over the ranks."""

    #: replicated, column, row, kv, vocab, heads, experts_rows, mxfp4_rows, mxfp4_cols or scale
    kind: str
    #: the vLLM layer that holds it, for people
    engine_class: str


def split_of(name: str, ndim: int) -> Split:
    """The split of tensor ``name`` (``ndim`` dims) under vLLM's tensor parallelism; ModelInputError if unknown."""
    split = _split_or_none(name, ndim)
    if split is None:
        raise ModelInputError(f"--tp: how vLLM shards {name!r} is not modelled (offload-plan's tensor parallelism "
                              "knows the Llama, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3 and gpt-oss layers); "
                              "plan it with --tp 1")
    return split


def _split_or_none(name: str, ndim: int) -> Split | None:
    """The split of tensor ``name``, None where the rules do not name it."""
    parent, _, leaf = name.rpartition(".")
    return _split_of_parts(parent.rpartition(".")[2], leaf, ndim)


@functools.lru_cache(maxsize=4096)
def _split_of_parts(module: str, leaf: str, ndim: int) -> Split | None:
    """The split by the name's last two parts (cached: a model repeats a few dozen of them thousands of times)."""
    if leaf.endswith(_SCALE_SUFFIX):
        return Split(kind="scale", engine_class="Fp8LinearMethod (block scales)")
    if module == "experts" and leaf in _MXFP4_EXPERTS:
        return Split(kind=_MXFP4_EXPERTS[leaf], engine_class="FusedMoE (Mxfp4MoEMethod)")
    if module == "experts" and leaf == "gate_up_proj" and ndim == 3:  # transformers 5's fused [E, 2 x I, hidden]
        return Split(kind="experts_rows", engine_class="FusedMoE (w13)")
    if leaf == "sinks":
        return Split(kind="heads", engine_class="Attention sinks")
    if leaf not in ("weight", "bias"):
        module = leaf
    if module in _COLUMN:
        return Split(kind="column", engine_class=_COLUMN[module])
    if module in _KV:
        return Split(kind="kv", engine_class=_KV[module])
    if module in _ROW:
        return Split(kind="replicated" if leaf == "bias" else "row", engine_class=_ROW[module])
    if module in _VOCAB:
        return Split(kind="vocab", engine_class=_VOCAB[module])
    if module in _REPLICATED or "norm" in module or leaf == "e_score_correction_bias" or ndim <= 1:
        return Split(kind="replicated", engine_class="replicated")
    return None


@dataclass(frozen=True, kw_only=True)
class TpModel:
    """What the rules need from config.json: heads, KV heads, the FP8 block."""

    num_heads: int
    num_kv_heads: int
    fp8_block: tuple[int, int]


def tp_model(config: dict | None) -> TpModel:
    """Attention heads, KV heads and the FP8 block size from the model record of config.json."""
    record = model_config(config)
    if record is None or record.num_heads is None or record.num_heads < 1:
        raise ModelInputError("--tp: config.json has no num_attention_heads; vLLM splits attention by heads, so "
                              "tensor-parallel plans need it")
    block = record.quantization.weight_block if record.quantization else None
    return TpModel(num_heads=record.num_heads, num_kv_heads=record.num_kv_heads or record.num_heads,
                   fp8_block=block or DEFAULT_FP8_BLOCK)


def _text_section(config: dict) -> dict:
    """The language model's own section of ``config`` (not a copy: rank_config rewrites it in place)."""
    return next((config[key] for key in TEXT_SECTIONS if isinstance(config.get(key), dict)), config)


class _Refused(Exception):
    """One tensor the engine cannot split at this size: (tensor, why)."""


def _split_evenly(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise _Refused(f"{what} {size} is not a multiple of {tp}")
    return size // tp


def pad_vocab(vocab: int) -> int:
    """The vocabulary padded as VocabParallelEmbedding pads it (pad_vocab_size)."""
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


def _rank_shape(entry: TensorEntry, split: Split, model: TpModel, tp: int) -> tuple[int, ...]:
    """The shape rank 0 holds (every rank holds the same shape under these rules)."""
    shape = entry.shape
    if split.kind == "replicated" or tp == 1:
        return shape
    if split.kind == "column":
        return (_split_evenly(shape[0], tp, "output rows"), *shape[1:])
    if split.kind == "row":
        return (*shape[:-1], _split_evenly(shape[-1], tp, "input columns"))
    if split.kind == "kv":
        if model.num_kv_heads >= tp:
            _split_evenly(model.num_kv_heads, tp, "num_key_value_heads")
            return (shape[0] // tp, *shape[1:])
        if tp % model.num_kv_heads:
            raise _Refused(f"{tp} ranks are not a multiple of the {model.num_kv_heads} KV heads each is replicated to")
        return (shape[0] // model.num_kv_heads, *shape[1:])  # one whole KV head per rank
    if split.kind == "experts_rows":  # gate and up each split: [experts, 2 x intermediate / tp, hidden]
        return (shape[0], 2 * _split_evenly(shape[1] // 2, tp, "expert intermediate size"), *shape[2:])
    if split.kind == "heads":
        return (_split_evenly(shape[0], tp, "attention heads"), *shape[1:])
    if split.kind == "vocab":
        return (_split_evenly(pad_vocab(shape[0]), tp, f"vocabulary padded to {VOCAB_PADDING}s"), *shape[1:])
    if split.kind == "mxfp4_rows":  # [experts, 2 x intermediate, ...]: gate and up each split, then padded
        width = _split_evenly(shape[1] // 2, tp, "expert intermediate size")
        return (shape[0], 2 * _round_up(width, MXFP4_PAD), *shape[2:])
    if split.kind == "mxfp4_cols":  # [experts, hidden, intermediate / 32 (, 16)]: blocks of the padded partition
        width = _split_evenly(shape[2] * MXFP4_BLOCK, tp, "expert intermediate size")
        return (shape[0], shape[1], _round_up(width, MXFP4_PAD) // MXFP4_BLOCK, *shape[3:])
    raise AssertionError(split.kind)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _check_fp8_blocks(weight: TensorEntry, rank: tuple[int, ...], split: Split, block: tuple[int, int],
                      tp: int) -> None:
    """validate_fp8_block_shape: a split dim of a block-quantized weight holds whole blocks on each rank."""
    if tp == 1 or split.kind == "replicated":
        return
    block_n, block_k = block
    if split.kind in ("column", "kv") and rank[0] % block_n:
        raise _Refused(f"each rank's {rank[0]} output rows are not a whole number of {block_n}-row FP8 blocks")
    if split.kind == "row" and rank[-1] % block_k:
        raise _Refused(f"each rank's {rank[-1]} input columns are not a whole number of {block_k}-column FP8 blocks")


def _scale_shape(scale_shape: tuple[int, ...], rank_weight: tuple[int, ...] | None,
                 block: tuple[int, int]) -> tuple[int, ...]:
    """One inverse scale per FP8 block of the rank's weight (``rank_weight``: its shape on the rank; None where the
    scale has no weight beside it)."""
    if rank_weight is None or len(rank_weight) != 2:
        return scale_shape
    return (math.ceil(rank_weight[0] / block[0]), math.ceil(rank_weight[1] / block[1]))


def shard_entries(tensors: tuple[TensorEntry, ...], config: dict | None, tp: int) -> tuple[TensorEntry, ...]:
    """Every tensor as rank 0 of ``tp`` holds it (name, dtype, shape and bytes of the rank's part), in order.

    A size the engine cannot split is one ModelInputError line naming the tensor, the vLLM layer and the sizes
    that do split. Worked out once per kind of tensor (_Kinds), the first of each kind in order, so the line
    names the first tensor that does not split, as a walk over every tensor would.
    """
    check_tp_size(tp)
    try:
        return _shard_or_unsplit(tensors, config, tp)
    except _Unsplit as refused:
        raise _refusal(refused.split, tp, refused.why, tensors, config) from None


class _Unsplit(Exception):
    """A size the engine cannot split: the Split that refuses and why (the refusal's line is built once, by
    shard_entries: valid_tp_sizes asks about other sizes without building lines that would ask again)."""

    def __init__(self, split: Split, why: str):
        super().__init__(why)
        self.split, self.why = split, why


def _shard_or_unsplit(tensors: tuple[TensorEntry, ...], config: dict | None, tp: int) -> tuple[TensorEntry, ...]:
    model = tp_model(config)
    try:
        _check_heads(model, tp)
    except _Refused as why:
        raise _Unsplit(Split(kind="kv", engine_class="QKVParallelLinear"), str(why)) from None
    kinds = _kinds_of(tensors)
    out = list(tensors)
    rank_shapes: dict[tuple, tuple[int, ...]] = {}
    for key, positions in kinds.weights.items():
        split, shape, dtype, fp8 = key
        first = tensors[positions[0]]
        if split is None:
            split_of(first.name, len(shape))  # raises its one line
        rank_shape = rank_shapes[key] = _rank_shape_checked(first, split, fp8, model, tp)
        _resize(out, tensors, positions, shape, rank_shape, dtype)
    for (weight_key, shape, dtype), positions in kinds.scales.items():
        rank_weight = rank_shapes[weight_key] if weight_key is not None else None
        rank_shape = _scale_shape(shape, rank_weight, model.fp8_block) if tp > 1 else shape
        _resize(out, tensors, positions, shape, rank_shape, dtype)
    return tuple(out)


def _resize(out: list, tensors: tuple[TensorEntry, ...], positions: list[int], shape: tuple[int, ...],
            rank_shape: tuple[int, ...], dtype: str) -> None:
    """Tensors at ``positions`` (all of ``shape`` and ``dtype``) as the rank holds them, into ``out``."""
    if rank_shape == shape:
        return  # replicated: the same entries
    nbytes = tensor_nbytes(dtype, rank_shape)
    for position in positions:
        out[position] = tensors[position].resized(rank_shape, nbytes)


def _rank_shape_checked(entry: TensorEntry, split: Split, fp8: bool, model: TpModel, tp: int) -> tuple[int, ...]:
    """Rank 0's shape of ``entry``; a size the engine cannot split is its one line."""
    try:
        shape = _rank_shape(entry, split, model, tp)
        if fp8:
            _check_fp8_blocks(entry, shape, split, model.fp8_block, tp)
    except _Refused as why:
        raise _Unsplit(split, f"cannot split {entry.name}: {why}") from None
    return shape


@dataclass(frozen=True, kw_only=True)
class _Kinds:
    """A checkpoint's tensors by what decides their shape on a rank, with their positions in order of first
    appearance: DeepSeek-V3's 92k tensors are a few dozen kinds, each sized once for each GPU count."""

    #: (split or None where the rules do not name it, shape, dtype, has an FP8 scale) -> positions
    weights: dict[tuple, list[int]]
    #: FP8 inverse scales: (their weight's key in ``weights``, or None; shape, dtype) -> positions
    scales: dict[tuple, list[int]]


#: id(tensors) -> (tensors, their kinds): what does not change with the GPU count, worked out once for every size
#: make --tp 2,4 shards the checkpoint for
_KINDS: dict[int, tuple[tuple, _Kinds]] = {}


def _kinds_of(tensors: tuple[TensorEntry, ...]) -> _Kinds:
    """The tensors' kinds (cached for the last tensors asked about)."""
    cached = _KINDS.get(id(tensors))
    if cached is None or cached[0] is not tensors:
        _KINDS.clear()
        cached = _KINDS[id(tensors)] = (tensors, _group_kinds(tensors))
    return cached[1]


def _group_kinds(tensors: tuple[TensorEntry, ...]) -> _Kinds:
    scaled = {t.name.removesuffix(_SCALE_SUFFIX) for t in tensors if t.name.endswith(_SCALE_SUFFIX)}
    weights: dict[tuple, list[int]] = {}
    # grouped by the Split object's identity (the rules' cache hands out one per module name: hashing the
    # dataclass for each of 92k tensors took longer than the grouping), then keyed by the Split itself
    by_identity: dict[tuple, tuple] = {}
    key_of: dict[str, tuple] = {}  # the key of each weight an FP8 scale goes with
    scale_positions = []
    for position, tensor in enumerate(tensors):
        split = _split_or_none(tensor.name, len(tensor.shape))
        if split is not None and split.kind == "scale":
            scale_positions.append(position)
            continue
        fp8 = tensor.name in scaled
        fast_key = (id(split), tensor.shape, tensor.dtype, fp8)
        key = by_identity.get(fast_key)
        if key is None:
            key = by_identity[fast_key] = (split, tensor.shape, tensor.dtype, fp8)
        weights.setdefault(key, []).append(position)
        if fp8:
            key_of[tensor.name] = key
    scales: dict[tuple, list[int]] = {}
    for position in scale_positions:
        scale = tensors[position]
        key = (key_of.get(scale.name.removesuffix(_SCALE_SUFFIX)), scale.shape, scale.dtype)
        scales.setdefault(key, []).append(position)
    return _Kinds(weights=weights, scales=scales)


def _check_heads(model: TpModel, tp: int) -> None:
    """QKVParallelLinear: divide(total_num_heads, tp); KV heads divide over the ranks, or the ranks over them."""
    if model.num_heads % tp:
        raise _Refused(f"splits the {model.num_heads} attention heads evenly over the ranks, and {tp} does not "
                       f"divide {model.num_heads}")
    kv = model.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise _Refused(f"splits the {kv} KV heads evenly over the ranks (or replicates each to a whole number of "
                       f"ranks), and {tp} does not")


#: set while _refusal lists the sizes that split (each try of a size that does not would list them again, and
#: a checkpoint that two candidates fail recursed without end: export --tp 3 of 4 heads)
_SIZES_BEING_LISTED: list[int] = []


def _refusal(split: Split, tp: int, why: str, tensors, config) -> ModelInputError:
    if _SIZES_BEING_LISTED:  # valid_tp_sizes tries sizes itself: a refusal there only needs to fail, not list
        return ModelInputError(f"--tp {tp}: vLLM's {split.engine_class} {why}")
    _SIZES_BEING_LISTED.append(tp)
    try:
        sizes = [str(size) for size in valid_tp_sizes(tensors, config, exclude=tp)]
    finally:
        _SIZES_BEING_LISTED.pop()
    fix = (f"use --tp {', '.join(sizes[:-1])} or {sizes[-1]}" if len(sizes) > 1 else f"use --tp {sizes[0]}"
           if sizes else "no size from 2 to 16 splits it: use --tp 1")
    return ModelInputError(f"--tp {tp}: vLLM's {split.engine_class} {why}; {fix}")


def valid_tp_sizes(tensors: tuple[TensorEntry, ...], config: dict | None, *, exclude: int = 0,
                   candidates: tuple[int, ...] = (2, 4, 8, 16)) -> list[int]:
    """The candidate sizes every tensor of the checkpoint splits at (for error messages)."""
    sizes = []
    for tp in candidates:
        if tp == exclude:
            continue
        try:
            _shard_or_unsplit(tensors, config, tp)
        except (_Unsplit, ModelInputError):
            continue
        sizes.append(tp)
    return sizes


def check_tp_size(tp: int) -> None:
    """--tp is a number of GPUs: 1 to MAX_TP_SIZE."""
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= MAX_TP_SIZE:
        raise UsageError(f"--tp {tp}: the tensor-parallel size is a number of GPUs from 1 to {MAX_TP_SIZE}, e.g. "
                         "--tp 2")


@dataclass(frozen=True, kw_only=True)
class RankCheckpoint(Checkpoint):
    """One rank's shard of a checkpoint: tensors with the rank's shapes; the whole checkpoint's fingerprint (a
    plan names the checkpoint it was made from, not a file that exists nowhere)."""

    tp_size: int
    whole_fingerprint: str
    #: bytes of every tensor of the whole checkpoint
    whole_bytes: int
    #: the whole model's config.json (``config`` is the rank's)
    whole_config: dict | None

    def fingerprint(self) -> str:
        return self.whole_fingerprint


def shard_checkpoint(checkpoint: Checkpoint, tp: int) -> Checkpoint:
    """Rank 0's part of ``checkpoint`` under ``tp``-way tensor parallelism, with the config rank 0 runs (its heads,
    KV heads and intermediate sizes); the checkpoint itself at tp 1."""
    if tp == 1:
        return checkpoint
    return RankCheckpoint(
        source=checkpoint.source, kind=checkpoint.kind, revision=checkpoint.revision,
        tensors=shard_entries(checkpoint.tensors, checkpoint.config, tp), config=rank_config(checkpoint.config, tp),
        num_files=checkpoint.num_files, tp_size=tp, whole_fingerprint=_fingerprint(checkpoint),
        whole_bytes=checkpoint.total_bytes, whole_config=checkpoint.config)


_FINGERPRINTS: dict[int, tuple[tuple, str]] = {}


def _fingerprint(checkpoint: Checkpoint) -> str:
    """The whole checkpoint's fingerprint, hashed once for every GPU count make --tp 2,4 shards it for."""
    cached = _FINGERPRINTS.get(id(checkpoint.tensors))
    if cached is None or cached[0] is not checkpoint.tensors:
        _FINGERPRINTS.clear()
        cached = _FINGERPRINTS[id(checkpoint.tensors)] = (checkpoint.tensors, checkpoint.fingerprint())
    return cached[1]


#: config.json sizes that split evenly over the ranks (the MLP's and experts' widths)
_SPLIT_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
#: config.json keys of models whose per-rank cache and activations are not modelled under --tp
_STATE_KEYS = ("linear_num_value_heads", "mamba_d_state", "mamba_expand")


def rank_config(config: dict | None, tp: int) -> dict | None:
    """config.json as one rank sees the model: its query heads, its KV heads (at least one), its share of the MLP
    and expert widths and of the padded vocabulary; head_dim written out (hidden / heads is the whole model's)."""
    if config is None or tp == 1:
        return config
    out = copy.deepcopy(config)
    text = _text_section(out)
    if any(key in text for key in _STATE_KEYS):
        raise ModelInputError("--tp: the per-rank state of linear-attention and state-space layers is not modelled; "
                              "plan this model with --tp 1")
    model = tp_model(config)
    # transformers' MixtralConfig writes "head_dim": null, the release's config.json leaves it out: both mean
    # hidden / heads of the whole model
    if "kv_lora_rank" not in text and text.get("head_dim") is None and isinstance(text.get("hidden_size"), int):
        text["head_dim"] = text["hidden_size"] // model.num_heads
    text["num_attention_heads"] = model.num_heads // tp
    text["num_key_value_heads"] = max(1, model.num_kv_heads // tp)
    for key in _SPLIT_KEYS:
        if isinstance(text.get(key), int) and not isinstance(text.get(key), bool):
            text[key] = max(1, text[key] // tp)
    if isinstance(text.get("vocab_size"), int):
        text["vocab_size"] = pad_vocab(text["vocab_size"]) // tp
    return out
