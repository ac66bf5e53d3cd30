"""Write a header-only checkpoint from a config.json: real tensor names, dtypes and shapes, no weights.

transformers builds the model on the meta device (no memory), and every parameter becomes a safetensors
entry. Shards are sparse files of their full size: planning tools see a complete checkpoint, the disk holds
only the headers. Used for the README's demo, the tests, and plans of models too large to download.

    python scripts/header_checkpoint.py examples/llama-3.1-70b/config.json /tmp/llama-3.1-70b
"""

import argparse
import json
import shutil
import struct
from pathlib import Path

DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
BITS = {"BF16": 16, "F16": 16, "F32": 32, "F8_E4M3": 8, "U8": 8}


def tensor_specs(config_path: Path, dtype: str) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of every parameter the model has, as transformers names them in checkpoints."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_path.parent)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = set(model.state_dict().keys())
    specs = []
    for name, tensor in model.state_dict().items():
        if getattr(config, "tie_word_embeddings", False) and name == "lm_head.weight":
            continue  # tied: checkpoints store the embedding only
        specs.append((name, dtype, list(tensor.shape)))
    assert len({s[0] for s in specs}) == len(specs) <= len(names)
    return sorted(specs)


def write_sparse_shards(specs, folder: Path, shard_bytes: int) -> None:
    """Split tensors into shards of about ``shard_bytes``, write each header and extend the file sparsely."""
    shards, current, size = [], [], 0
    for spec in specs:
        nbytes = _nbytes(spec)
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(folder / name, shard)
        weight_map.update({spec[0]: name for spec in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _nbytes(spec) -> int:
    count = 1
    for dim in spec[2]:
        count *= dim
    return count * BITS[spec[1]] // 8


def _write_shard(path: Path, shard) -> int:
    header, offset = {}, 0
    for name, dtype, shape in shard:
        end = offset + _nbytes((name, dtype, shape))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + offset)  # sparse: no data blocks are written
    return offset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="a config.json")
    parser.add_argument("output", type=Path, help="folder to write (replaced)")
    parser.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: config's)")
    parser.add_argument("--shard-gib", type=float, default=5.0)
    args = parser.parse_args()
    config = json.loads(args.config.read_text())
    dtype = DTYPES[args.dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"]
    specs = tensor_specs(args.config, dtype)
    if args.output.exists():
        shutil.rmtree(args.output)
    args.output.mkdir(parents=True)
    shutil.copy(args.config, args.output / "config.json")
    write_sparse_shards(specs, args.output, int(args.shard_gib * 2**30))
    print(f"wrote {len(specs)} tensors to {args.output}")


if __name__ == "__main__":
    main()
