"""scripts/bench_tp_offload.py: its table of rank plans run under transformers' tensor parallelism, on two gloo
ranks on the CPU; its one-line refusal without two GPUs; (two GPUs) every offloaded arm within 10% and bitwise."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def _run(tmp_path, *args: str, device_env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OUT=str(tmp_path), OMP_NUM_THREADS="1", **(device_env or {}))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "scripts/bench_tp_offload.py", "--folder", str(tmp_path / "ck"), *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)


def test_on_two_cpu_ranks_a_half_offloaded_rank_plan_is_bitwise_and_holds_the_planned_bytes(tmp_path):
    result = _run(tmp_path, "--device", "cpu", "--tiny", "--shape", "qwen3_moe", "--workload", "decode",
                  "--share", "0.5", device_env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| qwen3_moe")]
    assert len(rows) == 2 and all("| True |" in row for row in rows), result.stdout
    saved = json.loads((tmp_path / "bench_tp_offload.json").read_text())["rows"]
    assert {row["rank"] for row in saved} == {0, 1} and all(row["num_offloaded"] > 0 for row in saved)
    for row in saved:  # what the arena holds is the plan's, plus transformers' whole input embedding
        planned = row["planned_gpu_bytes"] - row["allocation_slack_bytes"] + row["beyond_plan_bytes"]
        assert abs(row["weights_gpu_bytes"] - planned) < 64 * 1024


def test_without_two_gpus_it_says_so_in_one_line():
    result = subprocess.run([sys.executable, "scripts/bench_tp_offload.py"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "bench_tp_offload" in lines[0] and "torchrun --nproc-per-node 2" in lines[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_run_every_offloaded_rank_within_10_percent_bitwise(tmp_path):
    result = _run(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((tmp_path / "bench_tp_offload.json").read_text())["rows"]
    assert saved and all(row["bitwise"] for row in saved)
    offloaded = [row for row in saved if row["num_offloaded"]]
    assert len(offloaded) == 8  # two shapes, two workloads, two ranks
    assert all(abs(row["step_ms"] / row["predicted_step_ms"] - 1) <= 0.10 for row in offloaded), saved
