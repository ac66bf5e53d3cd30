"""Fuzz families of the checkpoint's files: safetensors headers, the index JSON and config.json."""

import json
import struct

from planner.model.model_config import CONFIG_COUNTS
from planner.model.model_config import model_config
from tests.fuzz.core import (
    Base, Case, DEEP_LEVELS, HUGE_INT, JUNK, NASTY_TEXT, SHARDS, deep_nesting, framed, header_of, json_bytes, make_case,
    nbytes, pick_tensor, raw_splice,
)


def gen_headers(rng, base_: Base) -> Case:
    """Mutate one shard's header: fields, offsets, names, framing, JSON structure."""
    moe = rng.random() < 0.3
    model = base_.moe if moe else base_.dense
    shard = rng.choice(SHARDS)
    tensors = model.shards[shard]
    header = header_of(tensors)
    data_bytes = sum(nbytes(*s) for s in tensors.values())
    name = pick_tensor(rng, tensors)
    kind = rng.choice(("dtype", "shape", "offsets", "overlap", "gap", "name", "duplicate", "unlisted", "deep",
                       "huge_int", "not_object", "metadata", "length", "truncate", "flip", "nan", "extra_key",
                       "swap_dims", "utf8", "layer_index"))
    invalid, raw, index = True, None, None
    entry = header[name]
    if kind == "dtype":
        entry["dtype"] = rng.choice(("F17", "", "bf16", 5, None, [], "F8_E4M3", "F32", "F16"))
        invalid = entry["dtype"] != "F16"
    elif kind == "shape":
        entry["shape"] = rng.choice(([-1, 16], [1.5, 16], ["16"], [[16]], [True, 16], [2**70, 16], [10**30],
                                     None, "16", {}, [16, 17], [], [0], [2**62, 2**62, 2**62]))
    elif kind == "swap_dims":
        entry["shape"] = entry["shape"][::-1]
        invalid = False
    elif kind == "offsets":
        start, end = entry["data_offsets"]
        entry["data_offsets"] = rng.choice(([start - 8, end - 8], [end, start], [start, end + 2**64], [-end, 0],
                                            [float(start), float(end)], [str(start), end], [start, end, end], None,
                                            [start + data_bytes, end + data_bytes], [2**64, 2**64 + end - start]))
    elif kind == "overlap":
        same = [n for n in tensors if n != name and tensors[n] == tensors[name]]
        if same:
            header[rng.choice(same)]["data_offsets"] = list(entry["data_offsets"])
        else:
            start, end = entry["data_offsets"]
            entry["data_offsets"] = [max(0, start - 2), max(0, start - 2) + end - start]
    elif kind == "gap":
        last = max(header, key=lambda n: header[n]["data_offsets"][1])
        header[last]["data_offsets"] = [o + 16 for o in header[last]["data_offsets"]]
        data_bytes += 16
    elif kind == "name":
        suffix = rng.choice((*NASTY_TEXT, " ", "é", "x" * 3000, ""))
        new_name = name + suffix if suffix else ""
        header[new_name] = header.pop(name)
        index = {k if k != name else new_name: v for k, v in model.weight_map.items()}
        invalid = suffix not in (" ", "é", "x" * 3000)
    elif kind == "layer_index":
        layer_names = [n for n in tensors if n.startswith("model.layers.")]
        old = ".".join(rng.choice(layer_names).split(".")[:3]) + "."
        new = "model.layers." + rng.choice(("\u00b2", "\u0663", "01", "99999999999", "1e3", "-1", "9" * 40)) + "."
        header = {(new + n[len(old):] if n.startswith(old) else n): e for n, e in header.items()}
        index = {(new + n[len(old):] if n.startswith(old) else n): v for n, v in model.weight_map.items()}
        invalid = False
    elif kind == "duplicate":
        text = json.dumps(header)
        first = json.dumps(name) + ": " + json.dumps(entry)
        raw = text.replace(first, first + ", " + first, 1).encode()
    elif kind == "unlisted":
        header["model.extra.weight"] = {"dtype": "BF16", "shape": [4], "data_offsets": [data_bytes, data_bytes + 8]}
        data_bytes += 8
    elif kind == "deep":
        raw = raw_splice(json.dumps(header).encode(), json.dumps(entry).encode(),
                          deep_nesting(rng.choice(DEEP_LEVELS)).encode())
    elif kind == "huge_int":
        raw = raw_splice(json.dumps(header).encode(), json.dumps(entry["data_offsets"]).encode(),
                          f"[0, {HUGE_INT}]".encode())
    elif kind == "nan":
        raw = raw_splice(json.dumps(header).encode(), json.dumps(entry["data_offsets"]).encode(),
                          rng.choice((b"[NaN, 8]", b"[0, Infinity]", b"[0, 1e999]")))
    elif kind == "not_object":
        raw = rng.choice((b"[]", b"1", b'"x"', b"null", b"true"))
    elif kind == "metadata":
        header["__metadata__"] = rng.choice(({"format": "pt"}, 5, [], {"a": {"b": 1}}, None, {"a": 1}))
        invalid = False
    elif kind == "extra_key":
        entry["checksum"] = rng.choice((1, "x", None))
        invalid = False
    elif kind == "utf8":
        raw = raw_splice(json.dumps(header).encode(), name.encode(), name.encode() + rng.choice((b"\xff", b"\xc3")))
    if kind in ("length", "truncate", "flip"):
        whole = framed(header, data_bytes)
        if kind == "length":
            length = rng.choice((0, 2**63, 2**64 - 1, len(whole), len(whole) - 16, 7))
            whole = struct.pack("<Q", length) + whole[8:]
            invalid = True
        elif kind == "truncate":
            whole = whole[:rng.randrange(0, len(whole) - 1)]
        else:
            whole = bytearray(whole)
            for _ in range(rng.randint(1, 3)):
                whole[rng.randrange(8, len(whole) - data_bytes)] = rng.randrange(256)
            whole, invalid = bytes(whole), False
        files = {f"ckpt/{shard}": whole}
    else:
        files = {f"ckpt/{shard}": framed(raw if raw is not None else json_bytes(header), data_bytes)}
    if index is not None:
        files["ckpt/model.safetensors.index.json"] = json_bytes({"weight_map": index})
    return make_case("headers", kind, invalid, files, rng, moe=moe)


def gen_index(rng, base_: Base) -> Case:
    """Mutate model.safetensors.index.json: weight_map types, names, files, structure."""
    weight_map = dict(base_.dense.weight_map)
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    name = pick_tensor(rng, weight_map)
    kind = rng.choice(("file_junk", "missing_file", "traversal", "drop", "add", "rename", "map_junk", "top_junk",
                       "deep", "huge_int", "metadata", "invalid_json", "utf8", "duplicate", "empty", "flip"))
    invalid, raw = True, None
    if kind == "file_junk":
        weight_map[name] = rng.choice((5, None, [], "", "x.bin", SHARDS[0] + "\n", "a\x1b[2J.safetensors"))
    elif kind == "missing_file":
        weight_map[name] = "model-00009-of-00009.safetensors"
    elif kind == "traversal":
        weight_map[name] = rng.choice(("../" + SHARDS[0], "/" + SHARDS[0], "..", "ckpt/" + SHARDS[0]))
    elif kind == "drop":
        del weight_map[name]
    elif kind == "add":
        weight_map[rng.choice(("model.ghost.weight", "x" + rng.choice(NASTY_TEXT) + "y"))] = SHARDS[0]
    elif kind == "rename":
        weight_map[name + rng.choice(NASTY_TEXT)] = weight_map.pop(name)
    elif kind == "map_junk":
        index["weight_map"] = rng.choice(([], "x", None, {}, 5, [weight_map]))
    elif kind == "top_junk":
        raw = rng.choice((b"[]", b"1", b'"x"', b"null", json.dumps([index]).encode()))
    elif kind == "deep":
        raw = raw_splice(json_bytes(index), b'{"total_size": 1}', deep_nesting(rng.choice(DEEP_LEVELS)).encode())
    elif kind == "huge_int":
        raw = raw_splice(json_bytes(index), b'{"total_size": 1}', f'{{"total_size": {HUGE_INT}}}'.encode())
    elif kind == "metadata":
        index["metadata"] = rng.choice((None, "x", [], {"total_size": "x"}, {"total_size": -1}))
        invalid = False
    elif kind == "invalid_json":
        raw = json_bytes(index)[:-rng.randint(1, 20)]
    elif kind == "utf8":
        raw = b"\xff\xfe" + json_bytes(index)
    elif kind == "duplicate":
        pair = json.dumps(name).encode() + b": " + json.dumps(weight_map[name]).encode()
        other = json.dumps(name).encode() + b": " + json.dumps(SHARDS[1] if weight_map[name] == SHARDS[0]
                                                               else SHARDS[0]).encode()
        raw = raw_splice(json_bytes(index), pair, pair + b", " + other)
    elif kind == "empty":
        raw = b""
    elif kind == "flip":
        raw = bytearray(json_bytes(index))
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] = rng.randrange(32, 127)
        raw, invalid = bytes(raw), False
    files = {"ckpt/model.safetensors.index.json": raw if raw is not None else json_bytes(index)}
    return make_case("index", kind, invalid, files, rng)


#: config keys the planner reads, with the range a real model's value lies in: the planner's own table
CONFIG_INT_KEYS = CONFIG_COUNTS
CONFIG_VALUES = (*JUNK, 0, 1, 2, 3, 4, 8, 64, 2**31, 10**9, 2**20 + 1, float("nan"), float("inf"))


def _config_value_invalid(key: str, value, config: dict, moe: bool) -> bool:
    """Whether a config holding ``value`` at ``key`` must be refused (the fuzzer's oracle)."""
    if key == "architectures":
        return not (value is None or (isinstance(value, list) and value and isinstance(value[0], str)
                                      and value[0].isprintable()))
    if key not in CONFIG_INT_KEYS or value is None:
        return False
    low, high = CONFIG_INT_KEYS[key]
    return isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high


def _unlike_tensors(config: dict, model) -> bool:
    """Whether the model record of ``config`` disagrees with the base checkpoint's tensors (hidden size against
    the embedding's width, more layers than the stack, another expert count), which the planner refuses."""
    record = model_config(config)
    width = model.tensors["model.embed_tokens.weight"][1][1]
    num_layers = 1 + max(int(name.split(".")[2]) for name in model.tensors if name.startswith("model.layers."))
    present = model.config.get("num_experts", 0)
    return bool((record.hidden_size and record.hidden_size != width)
                or (record.num_layers and record.num_layers > num_layers)
                or (present and record.num_experts and record.num_experts != present))


def gen_config(rng, base_: Base) -> Case:
    """Mutate config.json: every key the planner reads, types and ranges, structure."""
    moe = rng.random() < 0.4
    config = dict((base_.moe if moe else base_.dense).config)
    kind = rng.choice(("value", "value", "value", "text_config", "delete", "architectures", "top_junk", "deep",
                       "huge_int", "invalid_json", "nan_word", "utf8"))
    invalid, raw = False, None
    if kind in ("value", "text_config"):
        key = rng.choice(sorted(CONFIG_INT_KEYS))
        value = rng.choice(CONFIG_VALUES)
        target = config
        if kind == "text_config":
            target = config["text_config"] = dict(config)
        target[key] = value
        invalid = _config_value_invalid(key, value, target, moe) or _unlike_tensors(config, base_.moe if moe
                                                                                    else base_.dense)
        if key in ("num_experts", "num_experts_per_tok") and moe and isinstance(value, int) and value == 0:
            invalid = False
        kind = f"{kind}:{key}"
    elif kind == "delete":
        config.pop(rng.choice(sorted(config)))
    elif kind == "architectures":
        config["architectures"] = rng.choice((None, [], "Llama", {}, {"a": 1}, [5], [None], ["A\nB"], ["A\x1b[2J"],
                                              ["LlamaForCausalLM"], 5))
        invalid = _config_value_invalid("architectures", config["architectures"], config, moe) \
            and config["architectures"] != []
    elif kind == "top_junk":
        raw, invalid = rng.choice((b"[]", b"1", b'"x"', b"null")), True
    elif kind == "deep":
        raw, invalid = raw_splice(json_bytes(config), b'"vocab_size": 32',
                                   b'"vocab_size": ' + deep_nesting(rng.choice(DEEP_LEVELS)).encode()), True
    elif kind == "huge_int":
        raw, invalid = raw_splice(json_bytes(config), b'"vocab_size": 32', f'"vocab_size": {HUGE_INT}'.encode()), True
    elif kind == "invalid_json":
        raw, invalid = json_bytes(config)[:-3], True
    elif kind == "nan_word":
        key = rng.choice(("hidden_size", "num_hidden_layers", "head_dim", "vocab_size"))
        raw = raw_splice(json_bytes(config), f'"{key}": {config[key]}'.encode(),
                          f'"{key}": {rng.choice(("NaN", "Infinity", "-Infinity"))}'.encode())
        invalid = key != "vocab_size"
    elif kind == "utf8":
        raw, invalid = b"\xff" + json_bytes(config), True
    files = {"ckpt/config.json": raw if raw is not None else json_bytes(config)}
    return make_case("config", kind, invalid, files, rng, moe=moe)
