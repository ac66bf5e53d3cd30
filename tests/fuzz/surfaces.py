"""Fuzz families of the surfaces issues 22-28 added (issue 39): tensor parallel (make --tp, with the round trip
through every reader), trace's flags and output, header-checkpoint's config, and every writer's output pointed
at one of its inputs.
"""

from tests.fuzz.adapters import ADAPTER_ARGS, adapter_files
from tests.fuzz.core import BASE_ARGS, GUARD_NAME, Base, Case, json_bytes, yaml_text
from tests.fuzz.roundtrip import READERS

#: a GPU link, which make --tp prices its all-reduces over
LINK = {"value": 4.5e11, "source": "assumed", "note": "a test link"}


def _linked_profile(base_: Base) -> bytes:
    return yaml_text(dict(base_.profile, gpu_link_bytes_per_s=LINK)).encode()


# ---- tensor parallel ------------------------------------------------------------------------------------------

#: --tp values: (text, invalid for the base models' 4 heads and 4 KV heads)
TP_VALUES = (("1", False), ("2", False), ("4", False), ("2,4", False), ("1,2", False), ("3", True), ("8", True),
             ("16", True), ("17", True), ("0", True), ("-1", True), ("x", True), ("2,3", False), ("", True),
             ("1025", True), ("2,2", True), ("9" * 30, True), ("4,2", False))
#: config edits under --tp: (name, edit, invalid at any size above 1)
TP_CONFIGS = (("1 head", {"num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 16}, True),
              ("5 heads", {"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": 16}, True),
              ("no heads", {"num_attention_heads": None, "num_key_value_heads": None}, True))


def gen_tp(rng, base_: Base) -> Case:
    """make --tp N (or N,M) on the dense or MoE model, the profile with or without a GPU link, the config's heads
    edited; a plan written must pass every reader."""
    moe = rng.random() < 0.4
    value, invalid = rng.choice(TP_VALUES)
    files = {"gpu.yaml": _linked_profile(base_)}
    mutation = f"--tp {value[:12]}"
    if rng.random() < 0.1:
        files = {}
        invalid = invalid or value not in ("1", "1,1")
        mutation += " without a GPU link"
    if rng.random() < 0.15 and value != "1":  # (a config without heads planned at --tp 1 writes kv_dtype auto,
        # which another change handles: planner/model/kv_cache.py)
        name, edit, bad = rng.choice(TP_CONFIGS)
        config = {key: val for key, val in {**(base_.moe if moe else base_.dense).config, **edit}.items()
                  if val is not None}
        files["ckpt/config.json"] = json_bytes(config)
        invalid = invalid or (bad and value not in ("1",))
        mutation += f" {name}"
    # always a budget or a serving target: make's default budget against check is another change's
    flags = rng.choice((["--budget", base_.budget], ["--context", "64", "--concurrency", rng.choice(("4", "auto"))],
                        ["--tokens", "1", "--context", "64", "--budget", "61440B"], ["--budget", "1MB"]))
    sizes = [part for part in value.split(",")]
    several = len(sizes) > 1
    args = [*BASE_ARGS, *flags, "--tp", value, "-o", "new.yaml"]
    written = f"new.tp{sizes[0]}.yaml" if several else "new.yaml"
    return Case(family="tp", mutation=mutation, args=args, invalid=invalid, files=files, moe=moe,
                then=_tp_readers(written, sizes[0], several))


def _tp_readers(written: str, size: str, several: bool) -> tuple:
    """Every reader of the plan of ``size`` GPUs: export at that size (a rank's plan exports only so), check only
    a plan written to -o's own path (it regenerates PATH, not PATH.tpN.yaml)."""
    readers = []
    for reader in READERS:
        reader = [part.replace("new.yaml", written) for part in reader]
        if reader[0] == "check" and several:
            continue
        if reader[0] == "export" and "--tp" in reader:
            reader = reader[:reader.index("--tp")] + (["--tp", size] if size != "1" else [])
        readers.append(reader)
    return tuple(readers)


# ---- trace ----------------------------------------------------------------------------------------------------

TRACE = ["trace", "--model", "ckpt", "--prompts", "prompts.txt"]
DEVICES = ("cpu", "cuda", "cuda:0", "cuda:7", "meta", "mps", "CPU", "-1", "", "cuda:x", "cpu:0", "\x1b[2J", "x" * 300)
TRACE_OUTPUTS = ("t.yaml", "missing/dir/t.yaml", "ckpt", "prompts.txt", "ckpt/config.json", GUARD_NAME, "gpu.yaml",
                 "x" * 300 + ".yaml", ".")
TRACE_CONFIGS = (("no model_type", {}), ("model_type", {"model_type": "qwen3_moe"}),
                 ("model_type list", {"model_type": ["qwen3_moe"]}),
                 ("kv heads half", {"model_type": "qwen3_moe", "num_key_value_heads": 2}),
                 ("fp8 without fp8 tensors", {"model_type": "qwen3_moe",
                                              "quantization_config": {"quant_method": "fp8"}}),
                 ("mxfp4", {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}))


def gen_trace_cli(rng, base_: Base) -> Case:
    """trace with --device, -o and --decode-tokens at and past their edges, over the MoE model's config edited
    (it has no tokenizer: every case is refused, before the model loads)."""
    args, names = list(TRACE), []
    if rng.random() < 0.7:
        device = rng.choice(DEVICES)
        args += ["--device", device]
        names.append(f"--device {device[:10]!r}")
    if rng.random() < 0.6:
        output = rng.choice(TRACE_OUTPUTS)
        args += ["-o", output]
        names.append(f"-o {output[:20]}")
    if rng.random() < 0.2:
        tokens = rng.choice(("0", "1", "-1", "65536", "65537", "x"))
        args += ["--decode-tokens", tokens]
        names.append(f"--decode-tokens {tokens}")
    files = {"prompts.txt": rng.choice((b"hello world\n", b"", b"\n\n", b"\xff\xfe"))}
    if rng.random() < 0.5:
        name, edit = rng.choice(TRACE_CONFIGS)
        files["ckpt/config.json"] = json_bytes({**base_.moe.config, **edit})
        names.append(name)
    return Case(family="trace_cli", mutation=", ".join(names) or "plain", args=args, invalid=True, files=files,
                moe=True)


# ---- header-checkpoint ----------------------------------------------------------------------------------------

#: config edits: (name, edit, invalid); sizes at and past make's bounds (planner.model.model_config.CONFIG_LIMITS)
HC_EDITS = (
    ("valid", {}, False), ("text_config string", {"text_config": "x"}, True),
    ("text_config list", {"text_config": [1]}, True), ("vocab 10^13", {"vocab_size": 10**13}, True),
    ("vocab 2^31+1", {"vocab_size": 2**31 + 1}, True), ("hidden 2^31", {"hidden_size": 2**31}, True),
    ("hidden 2^20+1", {"hidden_size": 2**20 + 1}, True), ("layers 1e6", {"num_hidden_layers": 1_000_000}, True),
    ("layers 100001", {"num_hidden_layers": 100_001}, True), ("layers 0", {"num_hidden_layers": 0}, True),
    ("layers -1", {"num_hidden_layers": -1}, True), ("heads 0", {"num_attention_heads": 0}, True),
    ("head_dim -4", {"head_dim": -4}, True), ("kv heads 0", {"num_key_value_heads": 0}, True),
    ("tie no", {"tie_word_embeddings": "no"}, True), ("tie 1", {"tie_word_embeddings": 1}, True),
    ("tie true", {"tie_word_embeddings": True}, False), ("layer_types long", {"layer_types": ["full_attention"] * 7},
                                                         True),
    ("layer_types short", {"layer_types": ["full_attention"] * 5}, True),
    ("layer_types six", {"layer_types": ["full_attention"] * 6}, False),
    ("intermediate 2^31+1", {"intermediate_size": 2**31 + 1}, True),
    ("unknown quantized", {"model_type": "x" * 200, "quantization_config": {"quant_method": "awq"}}, True),
    ("no model_type", {"model_type": None}, True), ("layers true", {"num_hidden_layers": True}, True),
    ("text_config layers disagree", {"text_config": {"num_hidden_layers": 5}}, True),
)


def gen_header_checkpoint(rng, base_: Base) -> Case:
    """header-checkpoint of the dense model's config (made a llama) with one key at or past make's bounds; a
    checkpoint written must be one make plans, and its plan must pass every reader."""
    name, edit, invalid = rng.choice(HC_EDITS)
    config = {key: value for key, value in {**base_.dense.config, "model_type": "llama", **edit}.items()
              if value is not None}
    output = rng.choice(("hc", "hc", "new/hc", "ckpt", "missing/dir/hc", "gpu.yaml"))
    invalid = invalid or output in ("ckpt", "gpu.yaml")  # a folder it did not write, a file
    then = ((*BASE_ARGS[:2], output, *BASE_ARGS[3:], "--budget", "1MB", "-o", "new.yaml"),
            *(tuple(reader) for reader in READERS if reader[0] not in ("diff",)))
    return Case(family="header_checkpoint", mutation=f"{name} -> {output}", invalid=invalid,
                args=["header-checkpoint", "config.json", output], files={"config.json": json_bytes(config)},
                then=tuple(list(command) for command in then))


# ---- outputs that are inputs ----------------------------------------------------------------------------------

#: (name, args, extra files) of a writer whose output is one of its inputs
OUTPUT_CASES = (
    ("make -o config", [*BASE_ARGS, "-o", "ckpt/config.json"], {}),
    ("make -o shard", [*BASE_ARGS, "-o", "ckpt/model-00002-of-00002.safetensors"], {}),
    ("make -o index", [*BASE_ARGS, "-o", "ckpt/model.safetensors.index.json"], {}),
    ("make -o profile", [*BASE_ARGS, "-o", "gpu.yaml"], {}),
    ("make -o ./profile", [*BASE_ARGS, "-o", "./gpu.yaml"], {}),
    ("make -o trace", [*BASE_ARGS, "--context", "64", "--concurrency", "4", "--routing-trace", "plan.yaml", "-o",
                       "plan.yaml"], {}),
    ("make -o adapter config", [*BASE_ARGS, *ADAPTER_ARGS, "-o", "ad/adapter_config.json"], adapter_files()),
    ("make -o adapter weights", [*BASE_ARGS, *ADAPTER_ARGS, "-o", "ad/adapter_model.safetensors"], adapter_files()),
    ("make --tp -o profile", ["make", "-m", "ckpt", "-g", "p.tp4.yaml", "--tp", "2,4", "-o", "p.yaml"], None),
    ("make -o link to profile", [*BASE_ARGS, "-o", "link.yaml"], {"link.yaml": "link-to:gpu.yaml"}),
    ("trace -o prompts", [*TRACE, "-o", "prompts.txt"], {"prompts.txt": b"hello\n"}),
    ("trace -o config", [*TRACE, "-o", "ckpt/config.json"], {"prompts.txt": b"hello\n"}),
    ("header-checkpoint into the checkpoint", ["header-checkpoint", "ckpt/config.json", "ckpt"], {}),
    ("header-checkpoint over the profile", ["header-checkpoint", "ckpt/config.json", "gpu.yaml"], {}),
)


def gen_outputs(rng, base_: Base) -> Case:
    """Every command that writes, pointed at one of its own inputs: refused in one line, every input kept."""
    name, args, extra = rng.choice(OUTPUT_CASES)
    files, special = {}, {}
    for relative, data in (extra or {}).items():
        if isinstance(data, str) and data.startswith("link-to:"):
            special[relative] = data
        else:
            files[relative] = data
    if extra is None:
        files["p.tp4.yaml"] = _linked_profile(base_)
    return Case(family="outputs", mutation=name, args=list(args), invalid=True, files=files,
                moe=name.startswith("trace"), special=special)

