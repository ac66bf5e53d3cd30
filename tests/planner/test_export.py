"""export on tiny hand-written checkpoints and the round-number test profile: flags for vLLM and SGLang, tensor
parallelism, selections, P that does not divide N, and the plans an engine cannot express."""

import json
import re

import pytest

from tests.conftest import TEST_GPU_FILE, invoke, make_checkpoint
from tests.plan_cli import MOE, PLAN, cli_make as _make, replace_once as _edit


def _export(*args):
    return invoke(["export", *args])


def test_export_vllm_and_sglang_flags(dense):
    offload = dense["offload"]
    knobs = ["--offload-group-size", str(offload["group_size"]), "--offload-num-in-group",
             str(offload["num_in_group"]), "--offload-prefetch-step", str(offload["prefetch_step"])]
    vllm = _export("plan.yaml", "--to", "vllm")
    assert vllm.exit_code == 0, vllm.stderr
    assert vllm.stdout == " ".join(knobs) + "\n"
    assert "vllm 0.33.0: predicted step" in vllm.stderr
    data = json.loads(_export("plan.yaml", "--to", "vllm", "--json").stdout)
    assert data["flags"] == knobs and data["tp_size"] == 1 and data["engine_version"] == "0.33.0"
    # one GPU and the plan's own P: the restated prediction is the plan's
    assert data["prediction"]["exported"]["step_ms"] == pytest.approx(dense["prediction"]["step_ms"], abs=1e-3)
    assert data["prediction"]["exported"]["gpu_bytes"] == dense["memory"]["gpu_bytes"]


def test_export_to_sglang_of_a_family_its_prefetch_offloader_is_not_wired_for(dense):
    """SGLang 0.5.23 wires --offload-group-size only in deepseek_v2.py: a Llama plan gets --cpu-offload-gb, the
    fewest whole GiB that fit the plan's GPU weights, predicted with every offloaded byte read at use."""
    data = json.loads(_export("plan.yaml", "--to", "sglang", "--json").stdout)
    assert data["flags"] == ["--cpu-offload-gb", "1"] and data["engine_version"] == "0.5.23"
    (loss,) = data["losses"]
    assert loss.startswith("SGLang 0.5.23 cannot express a prefetched plan for LlamaForCausalLM")
    # 1 GiB holds every layer of this tiny model: each is copied inside its forward, behind no compute
    rows, hardware = dense["layers"], dense["hardware"]
    compute_ms = sum(row["compute_ms"] for row in rows) + dense["prediction"]["head_ms"]
    copy_ms = sum(hardware["copy_overhead_us"] / 1e3 + 1e3 * row["bytes"] / hardware["h2d_bytes_per_s"]
                  for row in rows)
    exported = data["prediction"]["exported"]
    assert exported["copy_bytes_per_step"] == sum(row["bytes"] for row in rows)
    assert exported["step_ms"] == pytest.approx(compute_ms + copy_ms, abs=1e-3)
    assert exported["gpu_bytes"] <= dense["memory"]["gpu_bytes"]
    exact = _export("plan.yaml", "--to", "sglang", "--exact")
    assert exact.exit_code == PLAN and "drop --exact to export --cpu-offload-gb 1" in exact.stderr


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


def test_export_tp_is_checked_as_make_checks_it(dense, test_gpu):
    """The checkpoint's 4 heads do not split over 3 ranks: make --tp 3 refuses it, and so does export --tp 3."""
    make = invoke(["make", "--model", "ckpt", "--gpu", test_gpu, "--tp", "3", "--budget", "500KB"])
    exported = _export("plan.yaml", "--to", "vllm", "--tp", "3")
    assert exported.exit_code == 6 and make.exit_code != 0
    assert "--tp 3" in exported.stderr and "4 attention heads" in exported.stderr
    assert len(exported.stderr.strip().splitlines()) == 1


def test_export_engine_version(dense):
    assert _export("plan.yaml", "--to", "vllm", "--engine-version", "0.33.0").exit_code == 0
    result = _export("plan.yaml", "--to", "vllm", "--engine-version", "0.10.0")
    assert result.exit_code == 6 and "pins vllm 0.33.0" in result.stderr


def test_export_selective_params(workdir, test_gpu):
    make_checkpoint(workdir / "ckpt", num_layers=4, num_shards=2, moe=MOE)
    _make(["--gpu", test_gpu, "--params", "experts", "--budget", "300KB"])
    assert _export("plan.yaml", "--to", "vllm").stdout.endswith("--offload-params experts\n")
    sglang = _export("plan.yaml", "--to", "sglang")
    assert sglang.stdout.startswith("--cpu-offload-gb") and "--offload-param" not in sglang.stdout


def test_export_sglang_deepseek_offloads_the_experts_it_moves(workdir, test_gpu):
    """deepseek_v2.py passes SGLang's V2 offloader its experts (w13/w2): G, K, P and no selection flag; a P that
    does not divide the offloaded layers is exported as planned (0.5.23 allocates at each copy, no slots)."""
    deepseek = {"architectures": ["DeepseekV3ForCausalLM"]}
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=2, moe=MOE, extra_config=deepseek)
    plan = _make(["--gpu", test_gpu, "--params", "experts", "--group-size", "8", "--num-in-group", "5",
                  "--prefetch-step", "2"])
    assert plan["offload"]["layers"] == [3, 4, 5, 6, 7]
    result = json.loads(_export("plan.yaml", "--to", "sglang", "--json").stdout)
    assert result["flags"] == ["--offload-group-size", "8", "--offload-num-in-group", "5",
                               "--offload-prefetch-step", "2", "--offload-mode", "cpu"]
    assert result["losses"] == [] and any("w13_weight and w2_weight" in note for note in result["notes"])
    # P ahead and the layer in use: one more than the plan's slots
    assert result["prediction"]["exported"]["num_slots"] == plan["memory"]["num_slots"] + 1
    _make(["--gpu", test_gpu, "--budget", "300KB"], output="whole.yaml")
    refused = _export("whole.yaml", "--to", "sglang")
    assert refused.exit_code == PLAN and "make the plan with --params experts" in refused.stderr


def test_export_vllm_p_that_does_not_divide_n(workdir, test_gpu):
    """vLLM 0.33.0 keeps each static slot's owner when P does not divide N (_get_next_prefetch_index): P is
    exported as planned, with nothing lost and no warning."""
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    plan = _make(["--gpu", test_gpu, "--group-size", "8", "--num-in-group", "5", "--prefetch-step", "2"])
    assert plan["offload"]["layers"] == [3, 4, 5, 6, 7]
    vllm = json.loads(_export("plan.yaml", "--to", "vllm", "--json").stdout)
    assert vllm["prefetch_step"] == 2 and vllm["losses"] == [] and vllm["warnings"] == []
    assert _export("plan.yaml", "--to", "vllm", "--explain").stdout.splitlines()[1] == \
        "vllm expresses the plan exactly: nothing lost"
    explained = _export("plan.yaml", "--to", "sglang", "--explain").stdout.splitlines()
    assert explained[0] == "--cpu-offload-gb 1" and explained[1].startswith("SGLang 0.5.23 cannot express")
    assert re.search(r"([\d,.]+) -> ([\d,.]+) tokens/s", explained[1])


def test_every_export_flag_is_one_the_pinned_version_accepts(dense):
    from planner.engines.versions import FlagSpec, engine_version, flag_problems

    for engine in ("vllm", "sglang"):
        flags = json.loads(_export("plan.yaml", "--to", engine, "--tp", "2", "--json").stdout)["flags"]
        assert flags and flag_problems(flags, engine_version(engine)) == []
    sglang = engine_version("sglang")
    assert flag_problems(["--offload-param-names", "experts"], sglang) == [
        "SGLang 0.5.23 has no flag '--offload-param-names'"]
    assert flag_problems(["--cpu-offload-gb", "1.5"], sglang) == ["SGLang 0.5.23: --cpu-offload-gb 1.5: not an int"]
    share = FlagSpec(flag="--gpu-memory-utilization", kind="float", minimum=0, minimum_exclusive=True, maximum=1,
                     source="x")
    assert share.problem(["0"]) and share.problem(["1.01"]) and share.problem(["0.9"]) is None


def test_export_refuses_a_hand_edited_layer_list(dense):
    layers = dense["offload"]["layers"]
    _edit("plan.yaml", f"layers: [{', '.join(map(str, layers))}]", f"layers: [{', '.join(map(str, layers[:-1]))}]")
    result = _export("plan.yaml", "--to", "vllm")
    assert result.exit_code == PLAN
    # the reader refuses it first: the rows' host bytes no longer add up to memory's (planner.plan.rules)
    assert "regenerate it with make" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_export_refuses_a_fused_param_segment(workdir, test_gpu):
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    made = invoke(["make", "--model", "ckpt", "--gpu", test_gpu, "--params", "q_proj", "--budget", "700KB",
                   "-o", "plan.yaml"])
    assert made.exit_code == 0 and "export will refuse" in made.stderr  # make warns; --for refuses it
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
    from planner.views.export import check_rule
    from planner.plan.file import read_plan
    from planner.search.schedule import offloaded_by_rule
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


def test_sglang_deepseek_keeps_a_rule_layer_that_moves_nothing_in_its_prefetch_order():
    """deepseek_v2.py hands OffloaderV2 every layer the rule picks; a dense one (nothing in its whitelist) still
    takes a position, so the copies run P positions ahead of a different order than vLLM's, which skips it."""
    import dataclasses

    from planner.views.export import export_plan
    from planner.views.export_prediction import predict
    from planner.plan.file import read_plan
    from planner.search.schedule import offloaded_by_rule
    from tests.conftest import GOLDEN_DIR

    plan = read_plan(GOLDEN_DIR / "moe-experts.yaml")
    offload = plan.offload
    rule = offloaded_by_rule(plan.model.num_layers, offload.group_size, offload.num_in_group)
    dense = rule[0]
    rows = tuple(dataclasses.replace(row, selected_bytes=0, offloaded_bytes=0) if row.index == dense else row
                 for row in plan.layers)
    plan = dataclasses.replace(plan, layers=rows, offload=dataclasses.replace(offload, layers=rule[1:]),
                               model=dataclasses.replace(plan.model, architecture="DeepseekV3ForCausalLM"))
    sglang = export_plan(plan, "sglang")
    expected = predict(plan, 1, offload.prefetch_step, positions=rule, live_extra=1)
    assert sglang.prediction == expected and sglang.losses == ()
    assert expected.num_slots == min(offload.prefetch_step + 1, len(rule))
    vllm = export_plan(plan, "vllm")
    assert vllm.prediction == predict(plan, 1, offload.prefetch_step)
    assert vllm.prediction.copy_bytes_per_step == sglang.prediction.copy_bytes_per_step  # BF16: no scales left
