"""planner.make.make_plan: make's plans, end to end through the command."""

import json

import yaml

from tests.conftest import TEST_GPU, assert_one_line_error, invoke, make_checkpoint, run


def test_budget_message_numbers_are_the_real_minimum(workdir, good_plan):
    """The bytes the infeasible message names are exactly the least any plan needs (fixed + one slot)."""
    from planner.source.checkpoint import load_checkpoint
    from planner.model.layout import build_layout

    checkpoint = load_checkpoint("ckpt")
    layout = build_layout(checkpoint)
    weights = layout.non_layer_bytes + max(layer.nbytes for layer in layout.layers)
    assert weights == 147840
    # under 1 MiB: 256-byte pads for each tensor, then 512-byte allocator rounding (planner.model.placement)
    needed = -(-(weights + 256 * len(checkpoint.tensors)) // 512) * 512
    assert needed == 158208  # 39 tensors
    ok = invoke(["make", "--model", "ckpt", "--gpu", TEST_GPU, "--budget", f"{needed}B", "-o", "min.yaml"])
    assert ok.exit_code == 0, ok.stderr
    plan = yaml.safe_load((workdir / "min.yaml").read_text())
    assert plan["memory"]["gpu_bytes"] == needed and plan["offload"]["layers"] == [0, 1, 2, 3]
    proc = run(["make", "--model", "ckpt", "--gpu", TEST_GPU, "--budget", f"{needed - 1}B"], workdir, in_process=True)
    assert_one_line_error(proc.returncode, proc.stderr, proc.stdout,
                          (f"need {needed} bytes", f"the budget is {needed - 1} bytes"))


def _without_dtype(folder, **changes) -> None:
    """config.json as transformers' config classes write it: no torch_dtype/dtype (GPT-2, Phi-3, OLMo-2 ...)."""
    path = folder / "config.json"
    config = {key: value for key, value in json.loads(path.read_text()).items() if key not in ("torch_dtype", "dtype")}
    path.write_text(json.dumps(config | changes))


def test_a_config_without_dtype_plans_in_the_weights_dtype(workdir):
    """The plan's workload.kv_dtype is concrete: the headers' dtype where config.json names none, so every reader
    takes the plan (it recorded "auto" before, which show, export, check and diff refuse)."""
    make_checkpoint(workdir / "ckpt", num_layers=2, dtype="F32")
    _without_dtype(workdir / "ckpt")
    for name, args in (("plain.yaml", []), ("serve.yaml", ["--concurrency", "2", "--context", "64"])):
        result = invoke(["make", "--model", "ckpt", "--gpu", TEST_GPU, *args, "-o", name])
        assert result.exit_code == 0, result.stderr
        plan = yaml.safe_load((workdir / name).read_text())
        assert plan["workload"]["kv_dtype"] == "fp32"
        for command in (["show", name], ["check", name], ["export", name, "--to", "vllm"],
                        ["export", name, "--to", "sglang"]):
            result = invoke(command)
            assert result.exit_code == 0, (command, result.stderr)
    bf16 = invoke(["make", "--model", "ckpt", "--gpu", TEST_GPU, "--kv-dtype", "bf16", "-o", "bf16.yaml"])
    assert bf16.exit_code == 0 and invoke(["diff", "plain.yaml", "bf16.yaml"]).exit_code == 0


def test_an_unmodelled_cache_still_records_a_concrete_dtype(workdir):
    """A plain plan of an architecture whose cache is refused keeps the weights and a concrete kv_dtype."""
    make_checkpoint(workdir / "ckpt", num_layers=2)
    _without_dtype(workdir / "ckpt", model_type="mamba", architectures=["MambaForCausalLM"])
    result = invoke(["make", "--model", "ckpt", "--gpu", TEST_GPU, "-o", "plan.yaml"])
    assert result.exit_code == 0, result.stderr
    assert yaml.safe_load((workdir / "plan.yaml").read_text())["workload"]["kv_dtype"] == "bf16"
    for command in (["show", "plan.yaml"], ["check", "plan.yaml"], ["diff", "plan.yaml", "plan.yaml"]):
        assert invoke(command).exit_code == 0, command
