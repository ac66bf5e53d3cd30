"""check, diff and export on tiny hand-written checkpoints and the round-number test profile.

check: a fresh plan passes; an edited plan, a changed profile, a changed checkpoint, a file that is not a plan
each fail with their exit code, a diff where one applies, and the command that fixes it. diff: the JSON a bot
reads. export: flags for vLLM and SGLang, tensor parallelism, selections, P that does not divide N, and the
plans an engine cannot express.
"""

import json
import re
import shutil

import pytest
import yaml

from planner.units import format_rate
from tests.conftest import ERROR_PREFIX, TEST_GPU_FILE, invoke, make_checkpoint

MOE = {"num_experts": 4, "top_k": 2, "expert_intermediate": 32}
# Exit codes of check, written out so a change is deliberate.
OK, MODEL, PROFILE, PLAN, INFEASIBLE, STALE = 0, 2, 3, 4, 5, 8


def _make(args, output="plan.yaml", model="ckpt") -> dict:
    result = invoke(["make", "--model", model, *args, "-o", output])
    assert result.exit_code == 0, result.stderr
    return yaml.safe_load(open(output).read())


def _check(*args):
    return invoke(["check", *args], catch_exceptions=False)


def _assert_failed(result, code: int) -> str:
    """Exit code, no traceback, and the last stderr line is the one-line summary error."""
    assert result.exit_code == code, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(ERROR_PREFIX), last
    return last


def _edit(path, old: str, new: str) -> None:
    text = open(path).read()
    assert old in text
    open(path, "w").write(text.replace(old, new, 1))


@pytest.fixture
def dense(workdir, test_gpu):
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    return _make(["--gpu", test_gpu, "--budget", "500KB"])


@pytest.fixture
def own_profile(workdir):
    """A profile file the test may change: my-gpu.yaml, a copy of the test GPU."""
    shutil.copy(TEST_GPU_FILE, workdir / "my-gpu.yaml")
    return workdir / "my-gpu.yaml"


# ---- check --------------------------------------------------------------------------------------------------


def test_check_passes_on_a_fresh_plan(dense):
    result = _check("plan.yaml")
    assert result.exit_code == OK, result.stderr
    assert "ok plan.yaml" in result.stderr and "1 plan(s) up to date" in result.stderr
    assert result.stdout == ""


def test_check_fails_on_an_edited_plan_with_diff_and_fix(dense):
    _edit("plan.yaml", f"prefetch_step: {dense['offload']['prefetch_step']}\n  params",
          f"prefetch_step: {dense['offload']['prefetch_step'] + 1}\n  params")
    result = _check("plan.yaml")
    last = _assert_failed(result, STALE)
    assert "plan.yaml (stale)" in last
    assert result.stdout.startswith("--- plan.yaml\n+++ plan.yaml (regenerated)\n")
    assert f"-  prefetch_step: {dense['offload']['prefetch_step'] + 1}" in result.stdout
    assert f"+  prefetch_step: {dense['offload']['prefetch_step']}" in result.stdout
    header_command = open("plan.yaml").read().splitlines()[1].lstrip("#").strip()
    assert f"fix: {header_command}" in result.stderr


def test_check_update_rewrites_the_plan(dense):
    original = open("plan.yaml").read()
    _edit("plan.yaml", "step_ms:", "step_ms: 1.0\n  old_step_ms:")  # not even a valid plan key any more
    assert _check("plan.yaml").exit_code == PLAN  # invalid files cannot be regenerated from their inputs
    open("plan.yaml", "w").write(original.replace("tokens_per_step: 2048", "tokens_per_step: 2048 ", 1))
    result = _check("--update", "plan.yaml")
    assert result.exit_code == OK, result.stderr
    assert "updated plan.yaml" in result.stderr
    assert open("plan.yaml").read() == original
    assert _check("plan.yaml").exit_code == OK


def test_check_fails_when_the_profile_changes(workdir, own_profile):
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    _make(["--gpu", "my-gpu.yaml", "--budget", "500KB"])
    _edit(own_profile, "value: 1.0e+9", "value: 2.0e+9")  # a faster host link
    result = _check("plan.yaml")
    _assert_failed(result, STALE)
    assert "-  h2d_bytes_per_s: 1000000000.0\n+  h2d_bytes_per_s: 2000000000.0\n" in result.stdout


def test_check_fails_when_the_plan_no_longer_fits(workdir, own_profile):
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    _make(["--gpu", "my-gpu.yaml", "--budget", "500KB"])
    # 400 KB of memory less 100 MB reserve is refused by the profile itself; shrink memory and reserve together
    _edit(own_profile, "value: 1000000000\n", "value: 400000\n")
    _edit(own_profile, "value: 100000000\n", "value: 100000\n")
    result = _check("--json", "plan.yaml")
    assert result.exit_code == INFEASIBLE
    (entry,) = json.loads(result.stdout)
    kinds = [p["kind"] for p in entry["problems"]]
    assert kinds[0] == "fit" and entry["exit_code"] == INFEASIBLE
    assert "no longer fits test-gpu" in entry["problems"][0]["message"]


def test_check_fails_on_fingerprint_mismatch(dense, workdir):
    shutil.rmtree(workdir / "ckpt")
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3, intermediate=96)  # other shapes
    result = _check("--json", "plan.yaml")
    assert result.exit_code == PLAN
    (entry,) = json.loads(result.stdout)
    assert [p["kind"] for p in entry["problems"]][:1] == ["fingerprint"]
    assert "stale" in [p["kind"] for p in entry["problems"]]
    assert entry["fix_command"].startswith("offload-plan make --model ckpt")


def test_check_fails_when_the_checkpoint_is_gone(dense, workdir):
    shutil.rmtree(workdir / "ckpt")
    last = _assert_failed(_check("plan.yaml"), MODEL)
    assert "plan.yaml (model)" in last


@pytest.mark.parametrize("text", ["not: [a plan\n", "- 1\n- 2\n", "schema_version: 1\n"])
def test_check_fails_on_a_file_that_is_not_a_plan(workdir, text):
    (workdir / "bad.yaml").write_text(text)
    last = _assert_failed(_check("bad.yaml"), PLAN)
    assert "bad.yaml (invalid)" in last


def test_check_several_plans_exits_with_the_first_failure(dense, workdir):
    shutil.copy("plan.yaml", "copy.yaml")  # its header names plan.yaml: a copy is the same plan, and passes
    (workdir / "stale.yaml").write_text((workdir / "plan.yaml").read_text() + "# edited by hand\n")
    (workdir / "bad.yaml").write_text("nonsense\n")
    result = _check("plan.yaml", "copy.yaml", "stale.yaml", "bad.yaml")
    last = _assert_failed(result, STALE)
    assert "2 of 4 plan(s) fail check: stale.yaml (stale); bad.yaml (invalid)" in last
    assert "-# edited by hand" in result.stdout and "fix: offload-plan make --model ckpt" in result.stderr
    assert "-o stale.yaml" in result.stderr  # the fix writes the file checked


# ---- diff ---------------------------------------------------------------------------------------------------


def test_diff_of_two_budgets(dense, test_gpu):
    fits = _make(["--gpu", test_gpu], output="fits.yaml")
    result = invoke(["diff", "plan.yaml", "fits.yaml", "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["same_model"] is True
    assert data["inputs"]["changed"] == {"budget": {"old": "500KB", "new": None}}
    assert data["layers"]["to_gpu"] == dense["offload"]["layers"] and data["layers"]["to_host"] == []
    memory, prediction = data["memory"], data["prediction"]
    assert memory["gpu_bytes"] == {"old": dense["memory"]["gpu_bytes"], "new": fits["memory"]["gpu_bytes"],
                                   "change": fits["memory"]["gpu_bytes"] - dense["memory"]["gpu_bytes"]}
    assert memory["host_pinned_bytes"]["new"] == 0
    assert prediction["step_ms"]["old"] == dense["prediction"]["step_ms"]
    assert prediction["step_ms"]["new"] == fits["prediction"]["step_ms"]
    assert data["offload"]["num_offloaded"]["new"] == 0
    assert any("move to the GPU" in sentence for sentence in data["summary"])

    words = invoke(["diff", "plan.yaml", "fits.yaml"])
    assert words.exit_code == 0 and words.stderr == ""
    assert "faster" in words.stdout and "predicted step" in words.stdout and "G / K / P" in words.stdout


def test_diff_of_identical_plans_says_nothing_moved(dense):
    data = json.loads(invoke(["diff", "plan.yaml", "plan.yaml", "--json"]).stdout)
    assert data["layers"] == {"to_host": [], "to_gpu": [], "selection_changed": []}
    assert data["prediction"]["step_ms"]["change"] == 0
    assert "No layer moves" in " ".join(data["summary"])


def test_diff_of_different_models_and_hardware(dense, workdir, own_profile):
    make_checkpoint(workdir / "other", num_layers=8, num_shards=1, moe=MOE)
    _edit(own_profile, "name: test-gpu", "name: my-gpu")
    _make(["--gpu", "my-gpu.yaml", "--budget", "500KB", "--params", "experts"], output="moe.yaml", model="other")
    data = json.loads(invoke(["diff", "plan.yaml", "moe.yaml", "--json"]).stdout)
    assert data["same_model"] is False
    assert (data["hardware"]["old"], data["hardware"]["new"]) == ("test-gpu", "my-gpu")
    assert "hardware test-gpu -> my-gpu" in data["summary"][0]
    assert data["offload"]["params"] == {"old": [], "new": ["experts"]}
    assert "Different checkpoints" in data["summary"][0]


# ---- export -------------------------------------------------------------------------------------------------


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
    assert "is not what the engines' rule gives" in result.stderr
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


def test_grace_profiles_check_host_memory(workdir, test_gpu):
    """Pinned params must fit the host memory: from the profile (Grace superchips have one figure) or
    --host-memory, recorded in the plan and in its regenerating command."""
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    plan = _make(["--gpu", test_gpu, "--budget", "500KB", "--host-memory", "1MB"])
    assert plan["hardware"]["host_memory_bytes"] == 1_000_000 and plan["inputs"]["host_memory"] == "1MB"
    assert "--host-memory 1MB" in (workdir / "plan.yaml").read_text().splitlines()[1]
    assert _make(["--gpu", test_gpu, "--budget", "500KB"], output="free.yaml")["hardware"]["host_memory_bytes"] is None
    (workdir / "small-host.yaml").write_text(
        TEST_GPU_FILE.read_text() + "host_memory_bytes:\n  value: 50000\n  source: assumed\n  note: a tiny host\n")
    result = invoke(["make", "--model", "ckpt", "--gpu", "small-host.yaml", "--budget", "500KB"])
    assert result.exit_code == 5 and "the small-host.yaml profile allows 50000 bytes" in result.stderr


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
