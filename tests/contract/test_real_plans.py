"""plans/ and the header-only checkpoints they are made from: real names, dtypes and sizes, and a table that
matches the files.

The whole-plan check (``offload-plan check plans/*.yaml``) runs in .ci/run; these tests pin the fixture
script's public facts and keep scripts/make_plans.py, plans/ and the plans' headers in agreement.
"""

import json
import math
import shlex

import pytest
import yaml

from scripts import make_plans, real_checkpoints
from tests.conftest import REPO_ROOT

PLANS_DIR = REPO_ROOT / "plans"


def _specs(name: str) -> dict:
    config = json.loads((real_checkpoints.MODELS_DIR / name / "config.json").read_text())
    return {spec[0]: spec[1:] for spec in real_checkpoints.tensor_specs(config)}


def _billions_of_params(specs: dict) -> float:
    """Matmul and norm params; scales excluded; U8 blocks hold two FP4 values a byte."""
    count = 0
    for name, (dtype, shape) in specs.items():
        if "scale" not in name.rsplit(".", 1)[-1]:
            count += math.prod(shape) * (2 if dtype == "U8" and name.endswith("_blocks") else 1)
    return count / 1e9


@pytest.mark.parametrize("name, billions", [("deepseek-v3", 684.5), ("kimi-k2", 1026.4), ("gpt-oss-120b", 116.8),
                                            ("mixtral-8x7b", 46.7), ("llama-3.1-70b", 70.6), ("qwen3-32b", 32.8),
                                            ("qwen3-8b", 8.2)])
def test_parameter_counts_are_the_public_ones(name, billions):
    assert _billions_of_params(_specs(name)) == pytest.approx(billions, abs=0.05)


def test_deepseek_v3_release_format():
    specs = _specs("deepseek-v3")
    assert specs["model.layers.3.mlp.experts.255.down_proj.weight"] == ("F8_E4M3", [7168, 2048])
    assert specs["model.layers.3.mlp.experts.255.down_proj.weight_scale_inv"] == ("F32", [56, 16])
    assert specs["model.layers.0.mlp.gate_proj.weight"] == ("F8_E4M3", [18432, 7168])
    assert "model.layers.2.mlp.experts.0.up_proj.weight" not in specs  # first_k_dense_replace = 3
    assert specs["model.layers.3.mlp.gate.e_score_correction_bias"] == ("F32", [256])
    assert specs["model.layers.61.eh_proj.weight"] == ("BF16", [7168, 14336])  # multi-token prediction
    assert "model.layers.62.input_layernorm.weight" not in specs


def test_gpt_oss_and_mixtral_release_formats():
    oss = _specs("gpt-oss-120b")
    assert oss["model.layers.0.mlp.experts.gate_up_proj_blocks"] == ("U8", [128, 5760, 90, 16])
    assert oss["model.layers.0.mlp.experts.down_proj_scales"] == ("U8", [128, 2880, 90])
    assert oss["model.layers.0.self_attn.sinks"] == ("BF16", [64])
    mixtral = _specs("mixtral-8x7b")
    assert mixtral["model.layers.31.block_sparse_moe.experts.7.w2.weight"] == ("BF16", [4096, 14336])


def test_written_checkpoint_is_sparse_and_its_mtp_layer_unused(tmp_path):
    from planner.source.checkpoint import load_checkpoint
    from planner.model.layout import build_layout

    folder = real_checkpoints.write_checkpoint("deepseek-v3", tmp_path)
    on_disk = sum(p.stat().st_blocks * 512 for p in folder.iterdir())
    assert on_disk < 64 * 2**20
    checkpoint = load_checkpoint(str(folder))
    layout = build_layout(checkpoint)
    assert len(layout.layers) == 61 and [layer.index for layer in layout.unused_layers] == [61]
    planned = yaml.safe_load((PLANS_DIR / "deepseek-v3-h100-sxm-64gib.yaml").read_text())
    assert checkpoint.fingerprint() == planned["model"]["fingerprint"]  # the same bytes wherever it is written


def test_deepseek_v3_does_not_fit_one_gh200s_host_memory(tmp_path):
    """689 GB of weights, a GH200's 96 GB HBM and up to 480 GB LPDDR5X: the experts left over do not fit the
    host, which make says in one line (naming both sizes) instead of writing a plan that cannot load."""
    from tests.conftest import invoke

    folder = real_checkpoints.write_checkpoint("deepseek-v3", tmp_path)
    args = ["make", "--model", str(folder), "--gpu", "gh200", "--budget", "80GB", "--params", "experts"]
    result = invoke(args)
    assert result.exit_code == 5 and "of host memory but the gh200 profile allows 480000000000 bytes" in result.stderr
    assert invoke([*args, "--host-memory", "1TB"]).exit_code == 0


def test_plans_folder_matches_the_table():
    listed = {make_plans.plan_path(model, gpu, budget) for model, gpu, budget, _ in make_plans.PLANS}
    listed |= {make_plans.serving_plan_path(model, gpu, context) for model, gpu, context, _ in make_plans.SERVING_PLANS}
    present = {f"plans/{p.name}" for p in PLANS_DIR.glob("*.yaml")}
    assert listed == present


def _header_command(path: str) -> tuple[str, list[str]]:
    """A checked-in plan's text and the words of the command its header says wrote it: offload-plan make ...
    -o PATH."""
    text = (REPO_ROOT / path).read_text()
    words = shlex.split(text.splitlines()[1].lstrip("#"))
    assert words[:2] == ["offload-plan", "make"] and words[-2:] == ["-o", path]
    return text, words


@pytest.mark.parametrize("entry", make_plans.SERVING_PLANS, ids=lambda e: make_plans.serving_plan_path(*e[:3]))
def test_each_serving_plan_header_regenerates_it(entry):
    """The serving plans' headers are make_plans' commands, and each chose its concurrency (the search ran)."""
    model, gpu, context, params = entry
    path = make_plans.serving_plan_path(model, gpu, context)
    text, words = _header_command(path)
    assert {"--concurrency", "auto", "--context", str(context), "--cuda-graph", gpu} <= set(words)
    plan = yaml.safe_load(text)
    assert plan["inputs"]["concurrency"] == "auto" and plan["workload"]["context_tokens"] == context
    assert len(plan["serving"]["points"]) > 1
    assert plan["memory"]["total_gpu_bytes"] <= plan["memory"]["gpu_memory_bytes"]


@pytest.mark.parametrize("entry", make_plans.PLANS, ids=lambda e: make_plans.plan_path(*e[:3]))
def test_each_plan_header_regenerates_it(entry):
    model, gpu, budget, params = entry
    path = make_plans.plan_path(model, gpu, budget)
    text, words = _header_command(path)
    plan = yaml.safe_load(text)
    assert plan["inputs"]["model"] == f".cache/checkpoints/{model}"
    assert (plan["inputs"]["gpu"], plan["inputs"]["budget"], tuple(plan["inputs"]["params"])) == (gpu, budget, params)
