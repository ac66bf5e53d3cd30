"""export on tiny hand-written checkpoints and the round-number test profile: flags for vLLM and SGLang, tensor
parallelism, selections, P that does not divide N, and the plans an engine cannot express."""

import json
import re

import pytest

from planner.units import format_rate
from tests.conftest import TEST_GPU_FILE, invoke, make_checkpoint
from tests.plan_cli import MOE, PLAN, _edit, _make


def _export(*args):
    return invoke(["export", *args])


def test_export_vllm_and_sglang_flags(dense):
    offload = dense["offload"]
    knobs = ["--offload-group-size", str(offload["group_size"]), "--offload-num-in-group",
             str(offload["num_in_group"]), "--offload-prefetch-step", str(offload["prefetch_step"])]
    vllm = _export("plan.yaml", "--to", "vllm")
    assert vllm.exit_code == 0, vllm.stderr
    assert vllm.stdout == " ".join(knobs) + "\n"
    sglang = _export("plan.yaml", "--to", "sglang")
    assert sglang.stdout == " ".join(knobs + ["--offload-mode", "cpu"]) + "\n"
    data = json.loads(_export("plan.yaml", "--to", "vllm", "--json").stdout)
    assert data["flags"] == knobs and data["tp_size"] == 1
    # one GPU and the plan's own P: the restated prediction is the plan's
    assert data["prediction"]["exported"]["step_ms"] == pytest.approx(dense["prediction"]["step_ms"], abs=1e-3)
    assert data["prediction"]["exported"]["gpu_bytes"] == dense["memory"]["gpu_bytes"]


def test_export_with_tensor_parallelism(dense):
    data = json.loads(_export("plan.yaml", "--to", "vllm", "--tp", "2", "--json").stdout)
    assert data["flags"][:2] == ["--tensor-parallel-size", "2"]
    plan, exported = data["prediction"]["plan"], data["prediction"]["exported"]
    assert exported["copy_bytes_per_step"] <= plan["copy_bytes_per_step"] // 2 + len(dense["offload"]["layers"])
    assert exported["step_ms"] < plan["step_ms"]
    assert exported["host_pinned_bytes"] == -(-dense["memory"]["host_pinned_bytes"] // 2)
    assert any("TP=2" in note for note in data["notes"])
    sglang = json.loads(_export("plan.yaml", "--to", "sglang", "--tp", "4", "--json").stdout)
    assert sglang["flags"][:2] == ["--tp-size", "4"]


def test_export_selective_params(workdir, test_gpu):
    make_checkpoint(workdir / "ckpt", num_layers=4, num_shards=2, moe=MOE)
    _make(["--gpu", test_gpu, "--params", "experts", "--budget", "300KB"])
    assert _export("plan.yaml", "--to", "vllm").stdout.endswith("--offload-params experts\n")
    assert _export("plan.yaml", "--to", "sglang").stdout.endswith("--offload-param-names experts\n")


def test_export_sglang_deepseek_selects_experts_itself(workdir, test_gpu):
    deepseek = {"architectures": ["DeepseekV3ForCausalLM"]}
    make_checkpoint(workdir / "ckpt", num_layers=4, num_shards=2, moe=MOE, extra_config=deepseek)
    _make(["--gpu", test_gpu, "--params", "experts", "--budget", "300KB"])
    result = _export("plan.yaml", "--to", "sglang")
    assert result.exit_code == 0 and "--offload-param" not in result.stdout
    assert "offloads the routed experts" in result.stderr
    _make(["--gpu", test_gpu, "--budget", "300KB"], output="whole.yaml")
    result = _export("whole.yaml", "--to", "sglang")
    assert result.exit_code == PLAN and "make the plan with --params experts" in result.stderr


def test_export_p_that_does_not_divide_n(workdir, test_gpu):
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    # G=8, K=5: layers 3..7 (N=5); P=2 does not divide 5
    plan = _make(["--gpu", test_gpu, "--group-size", "8", "--num-in-group", "5", "--prefetch-step", "2"])
    assert plan["offload"]["layers"] == [3, 4, 5, 6, 7]
    sglang = json.loads(_export("plan.yaml", "--to", "sglang", "--json").stdout)
    assert sglang["prefetch_step"] == 1 and "--offload-prefetch-step" in sglang["flags"]
    assert sglang["flags"][sglang["flags"].index("--offload-prefetch-step") + 1] == "1"
    # the loss in the plan's own words: its step against P=1's, both re-simulated by the planner, in tokens/s
    (loss,) = sglang["losses"]
    step_1 = sglang["prediction"]["exported"]["step_ms"]
    assert loss.startswith("SGLang cannot express the prefetch depth P=2") and "it gets P=1" in loss
    tokens = plan["workload"]["tokens_per_step"]
    before, after = re.search(r"([\d,.]+) -> ([\d,.]+) tokens/s", loss).groups()
    assert before == format_rate(1e3 * tokens / plan["prediction"]["step_ms"])
    assert float(after.replace(",", "")) == pytest.approx(1e3 * tokens / step_1, rel=1e-3)
    assert sglang["prediction"]["exported"]["num_slots"] == 1
    flags_only = _export("plan.yaml", "--to", "sglang")
    assert flags_only.stdout.count("\n") == 1 and flags_only.stdout.startswith("--offload-group-size")
    assert "offload-plan: loss: SGLang cannot express the prefetch depth P=2" in flags_only.stderr
    explained = _export("plan.yaml", "--to", "sglang", "--explain").stdout.splitlines()
    assert explained == [flags_only.stdout.strip(), loss]
    assert _export("plan.yaml", "--to", "vllm", "--explain").stdout.splitlines()[1] == \
        "vllm expresses the plan exactly: nothing lost"
    exact = _export("plan.yaml", "--to", "sglang", "--exact")
    assert exact.exit_code == PLAN and "P=2 does not divide 5" in exact.stderr
    vllm = json.loads(_export("plan.yaml", "--to", "vllm", "--json").stdout)
    assert vllm["prefetch_step"] == 2
    assert any("PR 54975" in warning for warning in vllm["warnings"])


def test_export_refuses_a_hand_edited_layer_list(dense):
    layers = dense["offload"]["layers"]
    _edit("plan.yaml", f"layers: [{', '.join(map(str, layers))}]", f"layers: [{', '.join(map(str, layers[:-1]))}]")
    result = _export("plan.yaml", "--to", "vllm")
    assert result.exit_code == PLAN
    # the reader refuses it first: the rows' host bytes no longer add up to memory's (planner.plan_rules)
    assert "regenerate it with make" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_export_refuses_a_fused_param_segment(workdir, test_gpu):
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    _make(["--gpu", test_gpu, "--params", "q_proj", "--budget", "700KB"])
    result = _export("plan.yaml", "--to", "vllm")
    assert result.exit_code == PLAN and "fuse q_proj into qkv_proj" in result.stderr


def test_export_of_a_plan_that_offloads_nothing(workdir, test_gpu):
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    _make(["--gpu", test_gpu])
    result = _export("plan.yaml", "--to", "sglang")
    assert result.exit_code == 0 and result.stdout == ""
    assert "offloads nothing" in result.stderr


def test_export_unknown_engine(dense):
    result = _export("plan.yaml", "--to", "tgi")
    assert result.exit_code == 6 and "choose vllm or sglang" in result.stderr


def test_export_of_a_cuda_graph_plan_joins_every_step(workdir, test_gpu):
    """The engines replay one decode step per graph and join every wrapped copy at its end: the restated
    prediction models that join (never faster than the plan's), while the plan's own, restated, keeps the
    copy the plan leaves to each replay's start (layers 3-7 through one slot: layer 3's copy runs under
    layers 0-2)."""
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    # the round-number GPU with room for this batch's 2 GiB KV cache
    (workdir / "roomy.yaml").write_text(TEST_GPU_FILE.read_text().replace("value: 1000000000", "value: 4000000000", 1))
    # a long context, so layers 0-2 take longer than a copy and leaving it to the replay's start pays
    plan = _make(["--gpu", "roomy.yaml", "--tokens", "256", "--sequences", "256", "--context", "4096", "--cuda-graph",
                  "--group-size", "8", "--num-in-group", "5", "--prefetch-step", "1"])
    assert plan["offload"]["replay_start_copies"] == 1
    data = json.loads(_export("plan.yaml", "--to", "vllm", "--json").stdout)
    assert data["prediction"]["plan"]["step_ms"] == pytest.approx(plan["prediction"]["step_ms"], abs=1e-3)
    assert data["prediction"]["exported"]["step_ms"] >= data["prediction"]["plan"]["step_ms"] - 1e-9
    assert any("one decode step per CUDA graph" in note for note in data["notes"])


def test_export_rule_skips_layers_whose_row_selects_nothing():
    """The engines skip a rule layer none of whose params match; the plan row's selected_bytes says which."""
    import dataclasses

    from planner.errors import PlanError
    from planner.export import check_rule
    from planner.plan_file import read_plan
    from planner.schedule import offloaded_by_rule
    from tests.conftest import GOLDEN_DIR

    plan = read_plan(GOLDEN_DIR / "moe-experts.yaml")
    offload = plan.offload
    rule = offloaded_by_rule(plan.model.num_layers, offload.group_size, offload.num_in_group)
    assert rule == offload.layers and rule
    skipped = rule[-1]

    def without_last(selected_bytes: int):
        rows = tuple(dataclasses.replace(row, selected_bytes=selected_bytes, offloaded_bytes=0)
                     if row.index == skipped else row for row in plan.layers)
        return dataclasses.replace(plan, layers=rows, offload=dataclasses.replace(offload, layers=rule[:-1]))

    check_rule(without_last(0))  # nothing selected there: the engines skip it as the plan did
    with pytest.raises(PlanError, match="is not what the engines' rule gives"):
        check_rule(without_last(plan.layers[skipped].selected_bytes))
