"""scripts/bench_adapters.py --tiny: the H100 benchmark's logic end to end on the CPU stand-in (make with
adapters, load, serve blocking and pipelined, compare with PEFT)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

REPO = Path(__file__).resolve().parent.parent


def test_tiny_bench_serves_both_modes_equal_to_peft(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUT": str(tmp_path / "out"), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_adapters.py"), "--tiny", "--work-dir",
                           str(tmp_path / "work")], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "out" / "bench_adapters.json").read_text())
    assert [row["label"] for row in results["plans"]] == ["resident", "half offloaded"]
    assert results["plans"][1]["num_offloaded"] == 2
    for row in results["plans"]:
        assert {mode["mode"] for mode in row["bench"]["modes"]} == {"blocking", "pipelined"}
        assert all(check["bitwise_equal"] for check in row["peft"].values())
        assert all(mode["num_copies"] >= 8 for mode in row["bench"]["modes"])  # more adapters than slots
