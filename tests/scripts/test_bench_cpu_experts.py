"""scripts/bench_cpu_experts.py on the CPU: the tiny shape's CPU table per dtype, the assumed link, the verdict
and the planner's split written to the JSON and the table; the GPU host runs the real shapes."""

import json
import os
import subprocess
import sys
from pathlib import Path

from planner.search.cpu_experts import CPU_PATH_OVERLAPS_LINK

REPO = Path(__file__).resolve().parents[2]


def test_tiny_shape_writes_the_cpu_table_link_and_verdict(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_cpu_experts.py"), "--tokens", "1", "4",
                           "--threads", "1", "--repeats", "2", "--pool-mib", "1", "--link-gb-per-s", "0.001",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "bench_cpu_experts.json").read_text())
    (row,) = result["rows"]
    assert row["shape"] == "tiny" and row["threads"] == 1 and row["expert_bytes"] == 2 * 3 * 64 * 32
    assert set(row["cpu_ms_per_expert"]) == {"bf16", "fp32"}
    assert all(set(table) == {"1", "4"} for table in row["cpu_ms_per_expert"].values())
    # 1 MB/s: the link takes 12 ms an expert, far slower than any CPU at a 64 x 32 expert, so the CPU takes some
    assert not row["link"]["measured"] and row["link"]["copy_ms_per_expert"] == 12.288
    assert row["verdict"]["1"]["within_factor"] and row["split"]["declined"] is None
    # after the link (as measured on the H100: CPU_PATH_OVERLAPS_LINK) the CPU takes every miss or none; beside
    # it, a balanced share
    split, missed = row["split"]["cpu_experts"], row["split"]["missed"]
    assert 0 < split < missed if CPU_PATH_OVERLAPS_LINK else split == missed
    assert row["split"]["stall_ms"] < row["split"]["fetch_only_stall_ms"]
    assert "| tiny |" in proc.stdout and "on the CPU, stall" in proc.stdout


def test_bad_counts_are_refused_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_cpu_experts.py"), "--tokens", "0",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "--tokens" in proc.stderr
