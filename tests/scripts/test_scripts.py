"""scripts/: the maintained tools' argument parsing and logic on the CPU, and the layout rules of the folder.

The GPU benchmarks themselves need CUDA; here their parsers, report writers and the shared helpers in
scripts.benchmarking run with made-up rows, so a broken script fails in CI, not on the lent GPU.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from planner.errors import UsageError
from scripts import benchmarking
from scripts import bench_decode, bench_runtime, real_checkpoints
from tests.conftest import ERROR_PREFIX, REPO_ROOT, cli_env

SCRIPTS = REPO_ROOT / "scripts"
EXPERIMENTS = SCRIPTS / "experiments"


def test_bench_parsers_default_to_out_when_set(monkeypatch):
    monkeypatch.setenv("OUT", "/tmp/lent-gpu-out")
    args = bench_runtime.parser().parse_args(["--no-accelerate"])
    assert args.out == Path("/tmp/lent-gpu-out") and args.no_accelerate
    assert args.config == Path("examples/qwen3-8b/config.json")
    monkeypatch.delenv("OUT")
    args = bench_decode.parser().parse_args(["--batches", "16", "64", "--compile"])
    assert args.out == Path("/tmp/bench-decode") and args.batches == [16, 64] and args.compile == []


@pytest.mark.parametrize(("compile_arg", "expected"), [(None, set()), ([], {1, 64}), ([64], {64})])
def test_bench_decode_compile_batches(compile_arg, expected):
    assert bench_decode.compile_batches_for([1, 64], compile_arg) == expected


def test_bench_runtime_report_writes_the_table(tmp_path, capsys):
    row = {"tokens": 2048, "share": 0.5, "offloaded": 21, "prefetch": 2, "budget_bytes": 8 * 2**30,
           "resident_ms": 69.3, "floor_ms": 147.2, "plan_ms": 149.9, "predicted_ms": 150.5, "accelerate_ms": 1431.9,
           "resident_predicted_ms": 69.3, "estimated_plan_predicted_ms": 151.0, "estimated_plan_same_layers": True,
           "weights_gpu_bytes": 8 * 2**30, "peak_gpu_bytes": 9 * 2**30, "resident_activation_bytes": 2**29,
           "stall_ms": 77.8, "link_gb_per_s": 54.8, "bitwise_equal": True}
    bench_runtime.report([row], 55.0e9, tmp_path, "NVIDIA H100 80GB HBM3")
    table = (tmp_path / "bench.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in table and "pinned H2D 55.0 GB/s" in table
    assert "| 2048 | 50% | 21/2 | 69.3 (69.3) | 147.2 | 149.9 | 1.018 | 150.5 | +0.4% |" in table
    assert json.loads((tmp_path / "bench.json").read_text())["rows"] == [row]
    assert capsys.readouterr().out.strip() == table.strip()


def test_bench_decode_report_writes_the_table(tmp_path):
    check = {"prefill_logits": True, "ids": True, "step_logits": True, "first_step_max_abs_diff": 0.0}
    row = {"batch": 64, "offloaded": 21, "prefetch": 2, "group_size": 5, "num_in_group": 3,
           "replay_start_copies": 1, "resident_graphed_ms": 77.49, "resident_eager_ms": 81.02, "floor_ms": 152.18,
           "plan_graphed_ms": 157.69, "plan_graphed_multi_step_ms": 171.99, "plan_eager_ms": 161.49,
           "predicted_ms": 158.51, "warmup_s": 0.33, "capture_s": 0.11, "bitwise": {"plan graphed": check}}
    bench_decode.report([row], 53.3e9, tmp_path, "NVIDIA H100 80GB HBM3")
    table = (tmp_path / "bench.md").read_text()
    assert "| 64 | 21 (5, 3, 2, 1) | 77.49 (81.02) | 152.18 | 157.69 | 0.965 |" in table
    assert table.rstrip().endswith("| 0.33 + 0.11 | True |")
    assert not bench_decode.all_equal(check | {"ids": False}) and not bench_decode.all_equal(None)


def test_budget_for_share():
    layout = SimpleNamespace(non_layer_bytes=1000, layer_bytes=4000)
    assert benchmarking.budget_for_share(layout, 0.25) == 2000


def test_replay_arms_follow_the_plan_split():
    plan = SimpleNamespace(offload=SimpleNamespace(replay_start_copies=1))
    names = [arm.name for arm in benchmarking.arms_for(plan, [1, 4], joined=True)]
    assert names == ["eager", "graphed x1", "graphed x4", "graphed x1 joined", "graphed x4 joined"]
    plan.offload.replay_start_copies = 0  # nothing left to the replay's start: the joined arms are the same
    assert [arm.name for arm in benchmarking.arms_for(plan, [1], joined=True)] == ["eager", "graphed x1"]
    assert benchmarking.NUM_ARM_STEPS % 4 == 0


def test_random_shards_are_written_one_tensor_at_a_time_with_the_index(tmp_path):
    """The one random-checkpoint writer: shards of at most shard_bytes (a larger tensor alone), each tensor made
    when its turn comes and written at once, an index with total_size; safetensors reads back what was made."""
    import torch
    from safetensors import safe_open

    specs = [("a.weight", "BF16", [8, 8]), ("b.scale", "F32", [3]), ("c.weight", "F8_E4M3", [16, 4]),
             ("d.big", "BF16", [40, 4]), ("e.norm", "F16", [5])]
    made = {}

    def make(name, dtype, shape):
        made[name] = torch.arange(int(torch.tensor(shape).prod())).reshape(shape).to(benchmarking.TORCH_DTYPES[dtype])
        return made[name]

    total = benchmarking.write_random_shards(tmp_path, specs, make, shard_bytes=200)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(tmp_path.glob("*.safetensors"))
    assert total == index["metadata"]["total_size"] == 128 + 12 + 64 + 320 + 10
    assert list(made) == [name for name, _, _ in specs]  # made in spec order: a seeded generator draws the same
    assert [sorted(n for n, f in index["weight_map"].items() if f == file.name) for file in files] == [
        ["a.weight", "b.scale"], ["c.weight"], ["d.big"], ["e.norm"]]
    for file in files:
        with safe_open(file, "pt") as opened:
            assert all(torch.equal(opened.get_tensor(name).view(torch.uint8), made[name].view(torch.uint8))
                       for name in opened.keys())


def test_random_checkpoint_refuses_a_foreign_folder_before_any_gpu_work(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"real weights")
    with pytest.raises(UsageError, match="not made by offload-plan"):
        benchmarking.write_random_checkpoint(REPO_ROOT / "examples/qwen3-8b/config.json", folder)
    assert (folder / "model.safetensors").read_bytes() == b"real weights"


def test_real_checkpoints_writes_marked_folders_and_refuses_others(tmp_path, capsys):
    assert real_checkpoints.main(["qwen3-8b", "--output", str(tmp_path)]) == 0
    assert (tmp_path / "qwen3-8b" / "model.safetensors.index.json").is_file()
    assert real_checkpoints.main(["qwen3-8b", "--output", str(tmp_path)]) == 0  # its own folder: rewritten
    foreign = tmp_path / "mixtral-8x7b"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    assert real_checkpoints.main(["mixtral-8x7b", "--output", str(tmp_path)]) == UsageError.exit_code
    assert real_checkpoints.main(["no-such-model"]) == UsageError.exit_code
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(line.startswith(ERROR_PREFIX) for line in errors)
    assert "plans/models/no-such-model" in errors[1]
    assert (foreign / "keep.txt").read_text() == "mine" and len(list(foreign.iterdir())) == 1


def test_real_checkpoints_runs_as_ci_runs_it(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPTS / "real_checkpoints.py"), "qwen3-8b", "--output",
                           str(tmp_path)], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote {tmp_path / 'qwen3-8b'}"


def _python_files():
    return sorted(p for p in REPO_ROOT.rglob("*.py") if ".cache" not in p.parts and ".git" not in p.parts)


def test_no_sys_path_edits_anywhere():
    edits = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                edits.append(str(path.relative_to(REPO_ROOT)))
    assert not edits, f"sys.path is edited in {sorted(set(edits))}: run scripts with PYTHONPATH=. instead"


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.py")) + sorted(EXPERIMENTS.glob("*.py")),
                         ids=lambda p: str(p.relative_to(SCRIPTS)))
def test_each_script_says_how_it_is_run(path):
    if path.name == "__init__.py" or "__main__" not in path.read_text():
        return  # a module the scripts share (scripts/benchmarking.py) is imported, not run
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    relative = path.relative_to(REPO_ROOT)
    # a script for several GPUs is launched by torchrun, one process per GPU
    assert f"PYTHONPATH=. python3 {relative}" in docstring or (
        "PYTHONPATH=. torchrun " in docstring and f" {relative}" in docstring)


def test_every_experiment_has_a_readme_line():
    readme = (EXPERIMENTS / "README.md").read_text()
    for path in EXPERIMENTS.glob("*.py"):
        if path.name != "__init__.py":
            assert f"`{path.name}`" in readme, f"{path.name} has no line in scripts/experiments/README.md"


@pytest.mark.parametrize("script", sorted(path.name for path in SCRIPTS.glob("*.py")
                                          if path.name not in ("__init__.py", "benchmarking.py")))
def test_every_script_answers_help(script):
    """A user's first command: --help prints the usage and exits 0, on a machine without a GPU (a '%' in a help
    string, or work done before the parser, fails here and not on the lent GPU)."""
    result = subprocess.run([sys.executable, str(SCRIPTS / script), "--help"], cwd=REPO_ROOT, env=cli_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage:")
