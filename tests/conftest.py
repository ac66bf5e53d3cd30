"""Shared helpers for the planner tests: hand-written safetensors checkpoints, CLI runners, golden files.

Checkpoints are written byte by byte here (no transformers), so golden plans do not move when transformers
changes how it names or shards tensors. Everything is tiny: a whole checkpoint is a few hundred KB.

Regenerate the golden plans with:  UPDATE_GOLDEN=1 python -m pytest tests/contract/test_golden.py
"""

import difflib
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
DATA_DIR = TESTS_DIR / "data"
GOLDEN_DIR = TESTS_DIR / "golden"
#: the round-number profile, and the relative path plans record for it (tests run with cwd = tmp_path)
TEST_GPU_FILE = DATA_DIR / "test-gpu.yaml"
TEST_GPU = "tests/data/test-gpu.yaml"

ERROR_PREFIX = "offload-plan: error:"

# Bytes per element, written out here rather than imported, so the tests check the planner's own table.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F16": 2, "BF16": 2, "I16": 2,
               "F32": 4, "I32": 4, "F64": 8, "I64": 8}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "integration: end-to-end on real model shapes (a few seconds; runs by default and in CI)"
    )


# ---- safetensors and checkpoints ----------------------------------------------------------------------------


def nbytes_of(dtype: str, shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * DTYPE_BYTES[dtype]


def safetensors_header_bytes(tensors: dict) -> tuple[bytes, int]:
    """(8-byte length + JSON header, padded to 8), and the data size it describes."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = nbytes_of(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset


def write_safetensors(path, tensors: dict, data: bool = True) -> int:
    """Write a real safetensors file: ``tensors`` maps name -> (dtype, shape), in file order.

    data=True writes zero bytes for every tensor; data=False extends the file sparsely to its full size
    (valid, but no data blocks). Returns the number of data bytes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    head, data_bytes = safetensors_header_bytes(tensors)
    with path.open("wb") as handle:
        handle.write(head)
        if data:
            handle.write(bytes(data_bytes))
        else:
            handle.truncate(len(head) + data_bytes)
    return data_bytes


def llama_tensors(num_layers: int, hidden: int, intermediate: int, vocab: int = 256, num_heads: int = 4,
                  num_kv_heads: int | None = None, moe: dict | None = None, tie_embeddings: bool = False,
                  dtype: str = "BF16") -> dict:
    """name -> (dtype, shape) of a llama-style checkpoint (Qwen-MoE-style experts when ``moe`` is given)."""
    head_dim = hidden // num_heads
    kv = (num_kv_heads or num_heads) * head_dim
    specs = {"model.embed_tokens.weight": (dtype, (vocab, hidden)), "model.norm.weight": (dtype, (hidden,))}
    if not tie_embeddings:
        specs["lm_head.weight"] = (dtype, (vocab, hidden))
    for i in range(num_layers):
        p = f"model.layers.{i}."
        specs[p + "input_layernorm.weight"] = (dtype, (hidden,))
        specs[p + "post_attention_layernorm.weight"] = (dtype, (hidden,))
        specs[p + "self_attn.q_proj.weight"] = (dtype, (hidden, hidden))
        specs[p + "self_attn.k_proj.weight"] = (dtype, (kv, hidden))
        specs[p + "self_attn.v_proj.weight"] = (dtype, (kv, hidden))
        specs[p + "self_attn.o_proj.weight"] = (dtype, (hidden, hidden))
        if moe is None:
            specs[p + "mlp.gate_proj.weight"] = (dtype, (intermediate, hidden))
            specs[p + "mlp.up_proj.weight"] = (dtype, (intermediate, hidden))
            specs[p + "mlp.down_proj.weight"] = (dtype, (hidden, intermediate))
        else:
            width = moe.get("expert_intermediate", intermediate)
            specs[p + "mlp.gate.weight"] = (dtype, (moe["num_experts"], hidden))
            for e in range(moe["num_experts"]):
                specs[p + f"mlp.experts.{e}.gate_proj.weight"] = (dtype, (width, hidden))
                specs[p + f"mlp.experts.{e}.up_proj.weight"] = (dtype, (width, hidden))
                specs[p + f"mlp.experts.{e}.down_proj.weight"] = (dtype, (hidden, width))
    return dict(sorted(specs.items()))


@dataclass(frozen=True)
class WrittenCheckpoint:
    path: Path
    #: name -> (dtype, shape)
    tensors: dict
    #: name -> shard file name
    weight_map: dict

    @property
    def shards(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def bytes_of(self, name: str) -> int:
        return nbytes_of(*self.tensors[name])

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_of(n) for n in self.tensors)

    def layer_bytes(self, index: int) -> int:
        return sum(self.bytes_of(n) for n in self.tensors if n.startswith(f"model.layers.{index}."))

    def expert_bytes(self, index: int) -> int:
        return sum(self.bytes_of(n) for n in self.tensors if n.startswith(f"model.layers.{index}.mlp.experts."))

    @property
    def non_layer_bytes(self) -> int:
        return sum(self.bytes_of(n) for n in self.tensors if not n.startswith("model.layers."))


def make_checkpoint(folder, num_layers: int = 4, hidden: int = 64, intermediate: int = 128, vocab: int = 256,
                    num_heads: int = 4, num_kv_heads: int | None = None, num_shards: int = 2, config: bool = True,
                    moe: dict | None = None, tie_embeddings: bool = False, dtype: str = "BF16",
                    data: bool = True, extra_config: dict | None = None) -> WrittenCheckpoint:
    """Write a sharded llama-style checkpoint: shards, model.safetensors.index.json and config.json.

    moe: {"num_experts": E, "top_k": k, "expert_intermediate": I} gives every layer mlp.gate.weight and
    mlp.experts.E.{gate,up,down}_proj.weight instead of a dense MLP. Tensors are split into ``num_shards``
    contiguous runs of sorted names.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specs = llama_tensors(num_layers, hidden, intermediate, vocab, num_heads, num_kv_heads, moe, tie_embeddings,
                          dtype)
    names = list(specs)
    per_shard = -(-len(names) // num_shards)
    weight_map, total = {}, 0
    for number in range(num_shards):
        chunk = names[number * per_shard:(number + 1) * per_shard]
        shard = f"model-{number + 1:05d}-of-{num_shards:05d}.safetensors"
        total += write_safetensors(folder / shard, {n: specs[n] for n in chunk}, data=data)
        weight_map.update({n: shard for n in chunk})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if config:
        cfg = {
            "architectures": ["Qwen3MoeForCausalLM" if moe else "LlamaForCausalLM"],
            "model_type": "qwen3_moe" if moe else "llama",
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads or num_heads,
            "head_dim": hidden // num_heads,
            "num_hidden_layers": num_layers,
            "vocab_size": vocab,
            "tie_word_embeddings": tie_embeddings,
            "torch_dtype": "bfloat16",
        }
        if moe:
            cfg["num_experts"] = moe["num_experts"]
            cfg["num_experts_per_tok"] = moe["top_k"]
            cfg["moe_intermediate_size"] = moe.get("expert_intermediate", intermediate)
        cfg.update(extra_config or {})
        (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return WrittenCheckpoint(path=folder, tensors=specs, weight_map=weight_map)


def lora_tensors(base: dict, rank: int, modules=("q_proj", "v_proj"), layers=None, dtype: str = "BF16") -> dict:
    """name -> (dtype, shape) of a PEFT LoRA adapter of ``base`` (name -> (dtype, shape)): lora_A (r, in) and
    lora_B (out, r) for every layer weight whose module ends with one of ``modules``."""
    specs = {}
    for name, (_, shape) in base.items():
        module = name.removesuffix(".weight")
        parts = module.split(".")
        if len(parts) < 4 or parts[1] != "layers" or parts[-1] not in modules:
            continue
        if layers is not None and int(parts[2]) not in layers:
            continue
        out_features, in_features = shape
        specs[f"base_model.model.{module}.lora_A.weight"] = (dtype, (rank, in_features))
        specs[f"base_model.model.{module}.lora_B.weight"] = (dtype, (out_features, rank))
    return dict(sorted(specs.items()))


def make_adapter(folder, base: dict, rank: int = 8, modules=("q_proj", "v_proj"), layers=None,
                 config: dict | None = None, tensors: dict | None = None) -> dict:
    """Write a PEFT adapter folder (adapter_config.json and adapter_model.safetensors) for ``base``'s tensors;
    ``config`` overrides config keys, ``tensors`` replaces the tensor list. Returns the tensors written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specs = tensors if tensors is not None else lora_tensors(base, rank, modules, layers)
    write_safetensors(folder / "adapter_model.safetensors", specs)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules),
           "base_model_name_or_path": "ckpt", "task_type": "CAUSAL_LM"}
    cfg.update(config or {})
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return specs


# ---- running the CLI ----------------------------------------------------------------------------------------


def cli_env(**extra: str) -> dict:
    """The environment for a CLI subprocess: never the network, never tracebacks on purpose."""
    env = dict(os.environ)
    env.pop("OFFLOAD_PLAN_DEBUG", None)
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_cli(args, cwd, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m offload_plan ARGS`` in a subprocess (real stderr, real exit code, real tracebacks)."""
    return subprocess.run(
        [sys.executable, "-m", "offload_plan", *map(str, args)],
        cwd=cwd, env=env or cli_env(), capture_output=True, text=True, timeout=timeout,
    )


def invoke(args, catch_exceptions: bool = False):
    """Run the CLI in-process (fast); the working directory is the caller's. Returns click's Result."""
    from typer.testing import CliRunner

    from offload_plan.app import app

    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=catch_exceptions)


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str


def run(args, cwd, in_process: bool) -> Outcome:
    """The CLI's exit code and streams, in a subprocess or in-process (cwd must already be the working dir).

    In-process, an exception other than the CLI's own exit is re-raised: that is what a user sees as a
    traceback.
    """
    if not in_process:
        proc = run_cli(args, cwd)
        return Outcome(proc.returncode, proc.stdout, proc.stderr)
    assert Path.cwd() == Path(cwd).resolve()
    result = invoke(args, catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"uncaught {type(result.exception).__name__} (a traceback for the user)") \
            from result.exception
    return Outcome(result.exit_code, result.stdout, result.stderr)


#: the longest error line any failure may print (issue 26: a 3,000-character line listing transformers' config
#: classes is not one a person reads)
MAX_ERROR_LINE_CHARS = 300


def assert_one_line_error(returncode: int, stderr: str, stdout: str = "", contains: tuple[str, ...] = ()) -> str:
    """Non-zero exit, exactly one non-empty stderr line of at most MAX_ERROR_LINE_CHARS starting with the error
    prefix, no traceback."""
    assert returncode != 0, f"expected failure, got exit 0; stderr={stderr!r}"
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    assert lines[0].startswith(ERROR_PREFIX), lines[0]
    assert len(lines[0]) <= MAX_ERROR_LINE_CHARS, f"{len(lines[0])} characters: {lines[0]}"
    for text in contains:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"
    return lines[0]


# ---- golden files -------------------------------------------------------------------------------------------


def check_golden(name: str, text: str) -> None:
    """Compare ``text`` with tests/golden/NAME byte for byte; UPDATE_GOLDEN=1 rewrites the file instead."""
    path = GOLDEN_DIR / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode())
        return
    assert path.is_file(), f"{path} is missing; generate it with UPDATE_GOLDEN=1 python -m pytest {TESTS_DIR}"
    expected = path.read_bytes().decode()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path), "now"))
        pytest.fail(f"plan differs from golden {name} (regenerate with UPDATE_GOLDEN=1 if intended):\n{diff}")


# ---- fixtures -----------------------------------------------------------------------------------------------


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """tmp_path as the working directory, with the test profile at tests/data/test-gpu.yaml inside it."""
    target = tmp_path / TEST_GPU
    target.parent.mkdir(parents=True)
    shutil.copy(TEST_GPU_FILE, target)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def test_gpu(workdir) -> str:
    """The --gpu argument for the round-number test profile (relative to ``workdir``)."""
    return TEST_GPU



# ---- a planner-only install ---------------------------------------------------------------------------------

#: modules that need the runtime extra (torch, transformers): not collected where it is not installed, so the
#: planner's tests run in a planner-only install (pip install -e ".[test]")
RUNTIME_TEST_MODULES = ["runtime/test_engine.py", "runtime/test_engine_gpu.py",
                        "planner/test_checkpoint_transformers.py", "contract/test_llama70b.py"]
if any(importlib.util.find_spec(name) is None for name in ("torch", "transformers", "safetensors")):
    collect_ignore = RUNTIME_TEST_MODULES


@pytest.fixture
def dense(workdir, test_gpu):
    """An 8-layer checkpoint (ckpt, 3 shards) and its plan at a 500KB budget, written to plan.yaml."""
    from tests.plan_cli import cli_make

    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    return cli_make(["--gpu", test_gpu, "--budget", "500KB"])


@pytest.fixture
def own_profile(workdir):
    """A profile file the test may change: my-gpu.yaml, a copy of the test GPU."""
    shutil.copy(TEST_GPU_FILE, workdir / "my-gpu.yaml")
    return workdir / "my-gpu.yaml"


# a tiny Llama config.json, for tools that read only the config (header checkpoints)
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "src" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY_LLAMA))
    return path


@pytest.fixture
def good_plan(workdir, test_gpu) -> bytes:
    """A 4-layer checkpoint in ./ckpt and a good plan of it in ./out.yaml."""
    make_checkpoint(workdir / "ckpt", num_layers=4, num_shards=2)
    result = invoke(["make", "--model", "ckpt", "--gpu", test_gpu, "-o", "out.yaml"])
    assert result.exit_code == 0, result.stderr
    return (workdir / "out.yaml").read_bytes()


@pytest.fixture(scope="module")
def qwen3_30b(tmp_path_factory) -> Path:
    """A header-only Qwen3-30B-A3B checkpoint (fused experts, bf16) from its public config.json."""
    from runtime.header_checkpoint import write_header_checkpoint

    folder = tmp_path_factory.mktemp("q30") / "qwen3-30b-a3b"
    write_header_checkpoint(REPO_ROOT / "examples" / "qwen3-30b-a3b" / "config.json", folder)
    return folder


@pytest.fixture(autouse=True)
def release_gpu_cache(request):
    """After a GPU test, the memory its tensors left in this process's caching allocator goes back to the device,
    for later GPU tests that start a process of their own (the outside-memory probe, make --tp --measure). In a
    whole `pytest -m gpu` run on the H200 (2026-11-29) both failed with a CUDA error in their child process and
    passed alone; with this fixture they passed after all of test_engine_gpu.py (96 passed), the run that had
    preceded them. That the parent's cached memory was the cause is the likely reading, not a measured one."""
    yield
    if request.node.get_closest_marker("gpu") is None or "torch" not in sys.modules:
        return
    import gc

    torch = sys.modules["torch"]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()
