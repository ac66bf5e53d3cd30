"""Fuzz family of LoRA adapters: config, header, flags and a plan's adapters section."""

import math
import tempfile
from pathlib import Path

import yaml

from tests.fuzz.core import (
    BASE_ARGS, Base, Case, DEEP_LEVELS, HUGE_INT, JUNK, deep_nesting, framed, header_of, json_bytes, make_case,
    make_plan_text, pick_tensor, safetensors_bytes, yaml_text, base,
)
from tests.fuzz.plans import (PLAN_COMMANDS, plan_value)


# ---- adapters -----------------------------------------------------------------------------------------------

#: the base adapter: rank 4 on q_proj and v_proj of every layer of the dense model (hidden 16)
ADAPTER_RANK = 4
ADAPTER_CONFIG = {"peft_type": "LORA", "r": ADAPTER_RANK, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                  "base_model_name_or_path": "ckpt", "task_type": "CAUSAL_LM"}
ADAPTER_ARGS = ("--adapter", "a=ad")
_ADAPTER_PLAN: list[str] = []


def adapter_tensors(rank: int = ADAPTER_RANK, modules=("q_proj", "v_proj"), num_layers: int = 6) -> dict:
    """name -> (dtype, shape) of a LoRA adapter of the dense base model: rank ``rank`` on ``modules``."""
    specs = {}
    for i in range(num_layers):
        for module in modules:
            stem = f"base_model.model.model.layers.{i}.self_attn.{module}"
            specs[f"{stem}.lora_A.weight"] = ("BF16", (rank, 16))
            specs[f"{stem}.lora_B.weight"] = ("BF16", (16, rank))
    return dict(sorted(specs.items()))


def adapter_files(config: dict | bytes | None = None, weights: bytes | None = None) -> dict:
    """The base adapter's two files under ad/ (its config and weights), either one replaced."""
    config = ADAPTER_CONFIG if config is None else config
    return {"ad/adapter_config.json": config if isinstance(config, bytes) else json_bytes(config),
            "ad/adapter_model.safetensors": weights if weights is not None else safetensors_bytes(adapter_tensors())}


def adapter_plan_text() -> str:
    """A plan made with the base adapter (built once per process, by the CLI)."""
    if not _ADAPTER_PLAN:
        partial = base()
        with tempfile.TemporaryDirectory(prefix="fuzz-adapter-") as folder:
            for relative, data in adapter_files().items():
                (Path(folder) / relative).parent.mkdir(parents=True, exist_ok=True)
                (Path(folder) / relative).write_bytes(data)
            _ADAPTER_PLAN.append(make_plan_text(partial, Path(folder), [*BASE_ARGS, "--budget", partial.budget,
                                                                   *ADAPTER_ARGS], False))
    return _ADAPTER_PLAN[0]


def _adapter_config_invalid(key: str, value) -> bool:
    """Whether ``value`` for config ``key`` makes the base adapter unreadable or inconsistent."""
    if key == "r":
        return value != ADAPTER_RANK or isinstance(value, bool)
    if key == "lora_alpha":
        return not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1e6)
    if key == "target_modules":
        if isinstance(value, str):
            return value == ""
        return not (isinstance(value, list) and value and all(isinstance(v, str) and v and v.isprintable()
                                                              for v in value)
                    and {"q_proj", "v_proj"} <= set(value))
    if key == "peft_type":
        return value != "LORA"
    if key == "base_model_name_or_path":
        return not (value is None or (isinstance(value, str) and value.isprintable()))
    if key in ("rank_pattern", "alpha_pattern", "use_dora"):
        return bool(value)
    return False


ADAPTER_CONFIG_VALUES = (*JUNK, 0, 4, 8, 2**20, float("nan"), "LORA", "IA3", ["q_proj"], ["q_proj", "v_proj", "k_proj"],
                         ["q_proj", "v_proj", "\n"], "all-linear", ".*proj", {"q_proj": 8})
ADAPTER_FLAG_VALUES = (("a", True), ("=ad", True), ("a=", True), ("a=ad=x", True), ("a b=ad", True),
                       ("a=./nope", True), ("a\n=ad", True), ("x" * 100 + "=ad", True), ("a=org/none", True),
                       ("a=ckpt", True), ("a=gpu.yaml", True), ("a=org/x..y", True), ("a=org/-x", True),
                       ("a=org/x\n", True), ("b=ad", False), ("a.1-x=ad", False))


def gen_adapters(rng, base_: Base) -> Case:
    """Mutate the adapter (config keys and bytes, header shapes, dtypes, names, framing), its flags, or the
    adapters section of a plan read by show, export, diff or check."""
    kind = rng.choice(("valid", "config_value", "config_missing", "config_raw", "no_config", "no_weights", "shape",
                       "dtype", "name", "drop_tensor", "extra_module", "truncate", "flip", "flag", "slots", "twice",
                       "plan", "plan", "plan"))
    tensors, config, extra = adapter_tensors(), dict(ADAPTER_CONFIG), list(ADAPTER_ARGS)
    invalid, files = True, None
    name = pick_tensor(rng, tensors)
    if kind == "valid":
        invalid = False
    elif kind == "config_value":
        key = rng.choice(("r", "lora_alpha", "target_modules", "peft_type", "base_model_name_or_path", "rank_pattern",
                          "use_dora", "task_type"))
        config[key] = rng.choice(ADAPTER_CONFIG_VALUES)
        invalid = _adapter_config_invalid(key, config[key])
    elif kind == "config_missing":
        key = rng.choice(sorted(ADAPTER_CONFIG))
        del config[key]
        invalid = key in ("r", "target_modules")
    elif kind == "config_raw":
        files = adapter_files(config=rng.choice((b"", b"{", b"[]", b"null", b'{"r": 4, "r": 4}', b"\xff\xfe",
                                                  deep_nesting(rng.choice(DEEP_LEVELS)).encode(),
                                                  ('{"r": ' + HUGE_INT + "}").encode(), b'{"r": NaN}')))
    elif kind in ("no_config", "no_weights"):
        files = {f"ad/{'adapter_config.json' if kind == 'no_config' else 'adapter_model.safetensors'}": None}
    elif kind == "shape":
        old = tensors[name]
        tensors[name] = (old[0], rng.choice(((old[1][1], old[1][0]), (ADAPTER_RANK + 1, 16), (16,), (16, 16, 1),
                                             (0, 16), (16, 0))))
        invalid = tensors[name][1] != old[1]
    elif kind == "dtype":
        dtype = rng.choice(("F16", "F32", "I8", "U8", "BOOL", "F8_E4M3"))
        tensors[name] = (dtype if dtype in ("F16", "F32") else "BF16", tensors[name][1])
        if dtype not in ("F16", "F32"):
            header = header_of(tensors)
            header[name]["dtype"] = dtype
            size = math.prod(tensors[name][1]) * {"I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1}[dtype]
            start = header[name]["data_offsets"][0]
            header[name]["data_offsets"] = [start, start + size]
            files = adapter_files(weights=framed(header, 10**6))
        invalid = dtype not in ("F16", "F32")
    elif kind == "name":
        new = rng.choice(("model.layers.0.self_attn.q_proj.lora_A.weight", name.replace("lora_A", "lora_C"),
                          name.replace("self_attn", "mlp"), name.replace("layers.0", "layers.99"),
                          name.replace("layers.", "layers.-"), name.replace("q_proj", "nope_proj"),
                          name + "\n", name.replace(".weight", ".bias"), "base_model.model.lm_head.lora_A.weight"))
        tensors = {(new if n == name else n): spec for n, spec in tensors.items()}
        invalid = new != name  # a replacement that finds nothing to replace leaves the name as it was
    elif kind == "drop_tensor":
        del tensors[name]
    elif kind == "extra_module":
        tensors.update(adapter_tensors(modules=("k_proj",)))
        if rng.random() < 0.5:
            config["target_modules"] = ["k_proj", "q_proj", "v_proj"]
            invalid = False
    elif kind in ("truncate", "flip"):
        whole = bytearray(safetensors_bytes(tensors))
        if kind == "truncate":
            whole = whole[:rng.randrange(0, len(whole) - 1)]
        else:
            for _ in range(rng.randint(1, 3)):
                whole[rng.randrange(8, len(whole) - 256)] = rng.randrange(256)
            invalid = False  # a flipped byte may leave valid JSON
        files = adapter_files(weights=bytes(whole))
    elif kind == "flag":
        value, invalid = rng.choice(ADAPTER_FLAG_VALUES)
        extra = ["--adapter", value]
    elif kind == "slots":
        value = rng.choice(("0", "-1", "1", "2", "x", "99999999999999999999"))
        extra += ["--adapter-slots", value]
        invalid = value != "1"
    elif kind == "twice":
        extra += ["--adapter", rng.choice(("a=ad", "b=ad"))]
        invalid = extra[-1] == "a=ad"
    elif kind == "plan":
        return _adapter_plan_case(rng)
    if files is None:
        files = adapter_files(config=config, weights=safetensors_bytes(tensors))
    return make_case("adapters", kind, invalid, {**adapter_files(), **files}, rng, extra=tuple(extra))


def _adapter_plan_case(rng) -> Case:
    """Mutate one field of a plan's adapters section and read the plan back."""
    plan = yaml.safe_load(adapter_plan_text())
    section = plan["adapters"]
    row = rng.random() < 0.4
    target = section["items"][0] if row else section
    key = rng.choice(sorted(k for k in target if k != "items"))
    mode = rng.random()
    if mode < 0.1:
        del target[key]
        invalid = True
    elif mode < 0.15:
        plan["adapters"] = rng.choice((None, [], "x", {"items": []}, {}))
        invalid = plan["adapters"] is not None
    else:
        value, invalid = plan_value(rng, target[key], key)
        if value is None:
            invalid = key != "revision"
        target[key] = value
        invalid = bool(invalid)
    return Case(family="adapters", mutation=f"plan:{key}", args=list(rng.choice(PLAN_COMMANDS)), invalid=invalid,
                files={**adapter_files(), "plan.yaml": yaml_text(plan).encode()})
