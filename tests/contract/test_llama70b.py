"""Llama-3.1-70B shapes on an H100 with a 40 GiB budget: a header-only checkpoint of the real tensor list.

scripts/header_checkpoint.py writes sparse shards (about 8 s with transformers' import); make reads headers only.
Marked ``integration``: it runs by default and in CI.
"""

import os
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO_ROOT, cli_env, invoke

pytestmark = pytest.mark.integration

LAYER_BYTES = 1_711_308_800  # (2 x 8192^2 + 2 x 1024 x 8192 + 3 x 28672 x 8192 + 2 x 8192) x 2 bytes
NON_LAYER_BYTES = 4_202_708_992  # (2 x 128256 x 8192 + 8192) x 2: embedding, LM head, final norm
H100_H2D_BYTES_PER_S = 55e9


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama70b") / "llama-3.1-70b"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "header_checkpoint.py"),
         str(REPO_ROOT / "examples" / "llama-3.1-70b" / "config.json"), str(folder)],
        capture_output=True, text=True, env=cli_env(), timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return folder


@pytest.fixture(scope="module")
def plan70b(llama70b):
    here = os.getcwd()
    os.chdir(llama70b.parent)
    try:
        result = invoke(["make", "--model", llama70b.name, "--gpu", "h100-sxm", "--budget", "40GiB", "-o", "plan.yaml"])
    finally:
        os.chdir(here)
    assert result.exit_code == 0, result.stderr
    return yaml.safe_load((llama70b.parent / "plan.yaml").read_text())


def test_header_checkpoint_is_sparse_and_complete(llama70b):
    shards = sorted(llama70b.glob("*.safetensors"))
    assert len(shards) >= 20
    apparent = sum(p.stat().st_size for p in shards)
    assert apparent > 80 * LAYER_BYTES
    on_disk = sum(p.stat().st_blocks * 512 for p in shards)
    assert on_disk < 64 * 2**20, "shards should be sparse: headers only"


def test_llama70b_bytes(plan70b):
    model = plan70b["model"]
    assert model["num_layers"] == 80 and model["stack"] == "model.layers"
    assert model["architecture"] == "LlamaForCausalLM"
    assert all(row["bytes"] == LAYER_BYTES for row in plan70b["layers"])
    assert model["layer_bytes"] == 80 * LAYER_BYTES
    assert model["non_layer_bytes"] == NON_LAYER_BYTES
    assert model["total_bytes"] == 80 * LAYER_BYTES + NON_LAYER_BYTES == model["dtype_bytes"]["BF16"]
    assert model["num_tensors"] == 80 * 9 + 3


def test_llama70b_plan_on_h100_with_40gib(plan70b):
    offload, memory, prediction = plan70b["offload"], plan70b["memory"], plan70b["prediction"]
    assert len(offload["layers"]) == 60
    assert memory["budget_bytes"] == 40 * 2**30
    assert memory["gpu_bytes"] <= 40 * 2**30
    # weights on the GPU: 20 resident layers, the P slots and everything outside the stack
    weights = NON_LAYER_BYTES + (80 - 60 + offload["prefetch_step"]) * LAYER_BYTES
    # 723 tensors: one 256-byte pad each, then the 2 MiB allocator granule (planner.model.placement)
    assert memory["gpu_bytes"] == -(-(weights + 256 * 723) // 2**21) * 2**21
    assert memory["allocation_slack_bytes"] == memory["gpu_bytes"] - weights
    assert memory["host_pinned_bytes"] == 60 * LAYER_BYTES

    link_floor_ms = prediction["copy_bytes_per_step"] / H100_H2D_BYTES_PER_S * 1e3
    assert prediction["copy_bytes_per_step"] == 60 * LAYER_BYTES
    assert prediction["link_floor_ms"] == pytest.approx(link_floor_ms, abs=1e-4)
    assert prediction["step_ms"] >= link_floor_ms
    assert prediction["step_ms"] >= prediction["resident_step_ms"]

    # vLLM's rule: layer i is offloaded when i % G >= G - K
    g, k = offload["group_size"], offload["num_in_group"]
    assert offload["layers"] == [i for i in range(80) if i % g >= g - k]
    assert 1 <= offload["prefetch_step"] < 60
