"""scripts/bench_tp.py: its plan of transformers-saved checkpoints on the CPU, its one-line refusal without two GPUs,
and (two GPUs) the measured rank against the plan."""

import os
import subprocess
import sys

import pytest

from scripts import bench_tp
from tests.conftest import REPO_ROOT
from tests.planner.test_tensor_parallel import _llama_expected, _qwen3_moe_expected

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tiny(name: str, vocab_size: int = 1024) -> dict:
    """The bench's shape, shrunk to build in a second on the CPU."""
    small = dict(bench_tp.SHAPES[name], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 vocab_size=vocab_size)
    if name == "qwen3_moe":
        small.update(moe_intermediate_size=128, head_dim=32, num_experts=4, num_experts_per_tok=2)
    return small


def _save(config_values: dict, folder) -> None:
    config = transformers.AutoConfig.for_model(**{k: v for k, v in config_values.items() if k != "architectures"})
    config.architectures = config_values["architectures"]
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)


@pytest.mark.parametrize("name, expected", [("llama", _llama_expected), ("qwen3_moe", _qwen3_moe_expected)])
def test_plan_rank_of_a_transformers_checkpoint_is_vllms_sharding(tmp_path, name, expected):
    values = _tiny(name)
    _save(values, tmp_path / name)
    planned = bench_tp.plan_rank(tmp_path / name, "h100-sxm", 512)
    assert planned["num_offloaded"] == 0 and planned["step_ms"] > 0
    assert planned["weights_bytes"] == expected(values, 2)
    assert planned["transformers_extra_bytes"] == 1024 * 256 * 2 // 2  # the half of embed_tokens vLLM would not hold


def test_the_line_states_the_all_reduce_the_plan_priced():
    row = {"shape": "llama", "rank": 1, "gpu": "h100-sxm", "tokens": 2048, "measured_weights_bytes": 2 * 2**30,
           "planned_weights_bytes": 2 * 2**30, "planned_plus_whole_embedding_bytes": 2 * 2**30, "memory_error": 0.0,
           "measured_step_ms": 13.0, "predicted_step_ms": 12.5, "step_error": 0.04, "all_reduce_latency_us": 17.25,
           "all_reduce_bus_bytes_per_s": 361e9, "all_reduce_measured": True}
    line = bench_tp.report_line(row)
    assert "step 13.00 ms measured against 12.50 ms predicted (+4.0%, within 10%)" in line
    assert line.endswith("all-reduce measured: 17.2 us + bytes at 361 GB/s")
    assumed = bench_tp.report_line(dict(row, all_reduce_measured=False, step_error=0.2))
    assert "all-reduce ASSUMED" in assumed and "OFF by more than 10%" in assumed
    assert "--estimate" in bench_tp.report_line(dict(row, all_reduce_latency_us=None))


def test_without_two_gpus_it_says_so_in_one_line():
    result = subprocess.run([sys.executable, "scripts/bench_tp.py"], cwd=REPO_ROOT, capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "CUDA_VISIBLE_DEVICES": ""},
                            timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "torchrun --nproc-per-node 2" in lines[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_measure_the_rank_within_10_percent_of_the_plan(tmp_path):
    result = subprocess.run(["torchrun", "--nproc-per-node", "2", "scripts/bench_tp.py", "--folder", str(tmp_path)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if " rank " in line]
    assert len(lines) == 4, result.stdout
    assert all(line.count("within 10%") == 2 and "all-reduce measured" in line for line in lines), result.stdout
