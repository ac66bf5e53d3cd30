"""Fuzz regressions, class: a checkpoint whose tensors disagree with themselves (a safetensors header's offsets,
dtypes, shapes and layer indices, the index against the shards) or a model folder that lacks what a command
reads. Each is refused in one line that names the tensor or file.
"""

import json
import struct
import tempfile
from pathlib import Path

import pytest

from tests.fuzz import Case, base, run_case
from tests.fuzz.adapters import adapter_files, adapter_tensors
from tests.fuzz.core import json_bytes, safetensors_bytes
from tests.fuzz.regression import INDEX, SHARD, Refusal, assert_refused, first_tensor, header_edit, json_file, \
    make_args, overlap_second_tensor


def _layer_renamed(old: str, new: str):
    """An edit of the index's weight map: every tensor under ``old`` moved under ``new``."""
    return lambda m: m.update({k.replace(old, new): m.pop(k) for k in list(m) if k.startswith(old)})


def _last_shifted(header: dict) -> None:
    """The last tensor's bytes moved 16 bytes on, past a gap."""
    last = header[max(header, key=lambda n: header[n]["data_offsets"][1])]
    last.update(data_offsets=[o + 16 for o in last["data_offsets"]])


def _extra_tensor(header: dict) -> None:
    """A tensor the index does not list, after the others."""
    end = max(e["data_offsets"][1] for e in header.values())
    header.update({"model.extra.weight": {"dtype": "BF16", "shape": [4], "data_offsets": [end, end + 8]}})


TRACE = ["trace", "--model", "ckpt", "--prompts", "prompts.txt"]

# name -> the refusal
CASES = {
    # headers (issue 16): negative offsets were accepted; TypeError in _entry; ValueError in layout._split;
    # overlaps and gaps accepted
    "header-negative-offset": Refusal(make_args(), header_edit(lambda h: h[first_tensor(h)].update(
        data_offsets=[-8, -8 + 2 * 16 * 32])), "invalid data_offsets"),
    "header-dtype-list": Refusal(make_args(), header_edit(lambda h: h[first_tensor(h)].update(dtype=[])),
                                 "unknown dtype"),
    "header-shape-bool": Refusal(make_args(), header_edit(lambda h: h[first_tensor(h)].update(shape=[True, 16])),
                                 "invalid shape"),
    "header-huge-dim": Refusal(make_args(), header_edit(lambda h: h[first_tensor(h)].update(shape=[2**70, 16])),
                               "invalid shape"),
    "header-superscript-layer-index": Refusal(make_args(), header_edit(
        lambda h: json.dumps(h).replace("model.layers.0.", "model.layers.\\u00b2.").encode(),
        index_edit=_layer_renamed("model.layers.0.", "model.layers.\u00b2.")), "layer indices are not"),
    "header-huge-layer-index": Refusal(make_args(), header_edit(
        lambda h: json.dumps(h).replace("model.layers.1.", "model.layers.99999999999.").encode(),
        index_edit=_layer_renamed("model.layers.1.", "model.layers.99999999999.")), "missing [1, 6"),
    "header-overlap": Refusal(make_args(), header_edit(overlap_second_tensor), "overlaps"),
    "header-gap": Refusal(make_args(), header_edit(_last_shifted, data_extra_bytes=16), "leaves a gap"),
    "header-tensor-not-in-index": Refusal(make_args(), header_edit(_extra_tensor, data_extra_bytes=8),
                                          "not in the index"),
    "index-misses-a-tensor": Refusal(make_args(), json_file(INDEX, lambda d: d["weight_map"].pop(
        next(iter(d["weight_map"])))), "not in the index"),
    # an adapter's layer index that is a digit but not an ASCII one (issue 25)
    "adapter-layer-superscript": Refusal(make_args("--adapter", "a=ad"), {
        **adapter_files(), "ad/adapter_model.safetensors": safetensors_bytes(
            {n.replace("layers.0.", "layers.\u00b2."): s for n, s in adapter_tensors().items()})}, "layer"),
    # a folder without tokenizer files: transformers 5 builds an empty tokenizer, and the forward crashed on the
    # prompt's zero tokens (found by issue 39's 5,000-case campaign, seed 39)
    "trace-empty-tokenizer": Refusal([*TRACE, "--device", "cpu"], {
        "prompts.txt": b"hello world\n",
        "ckpt/config.json": json_bytes({**base().moe.config, "model_type": "qwen3_moe"})}, "no tokens", moe=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_checkpoint_refused(name):
    assert_refused(name, CASES[name])


def test_shard_header_struct_prefix_of_zero_is_refused():
    args, files = make_args(), {SHARD: struct.pack("<Q", 0) + b"{}"}
    with tempfile.TemporaryDirectory() as root:
        result = run_case(Case(family="regression", mutation="zero", args=args, invalid=True, files=files), Path(root))
    assert result.verdict == "error" and "not plausible" in result.message
