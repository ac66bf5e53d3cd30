"""planner.make: make's plans, end to end through the command."""

import yaml

from tests.conftest import TEST_GPU, assert_one_line_error, invoke, run


def test_budget_message_numbers_are_the_real_minimum(workdir, good_plan):
    """The bytes the infeasible message names are exactly the least any plan needs (fixed + one slot)."""
    from planner.checkpoint import load_checkpoint
    from planner.layout import build_layout

    checkpoint = load_checkpoint("ckpt")
    layout = build_layout(checkpoint)
    weights = layout.non_layer_bytes + max(layer.nbytes for layer in layout.layers)
    assert weights == 147840
    # under 1 MiB: 256-byte pads for each tensor, then 512-byte allocator rounding (planner.placement)
    needed = -(-(weights + 256 * len(checkpoint.tensors)) // 512) * 512
    assert needed == 158208  # 39 tensors
    ok = invoke(["make", "--model", "ckpt", "--gpu", TEST_GPU, "--budget", f"{needed}B", "-o", "min.yaml"])
    assert ok.exit_code == 0, ok.stderr
    plan = yaml.safe_load((workdir / "min.yaml").read_text())
    assert plan["memory"]["gpu_bytes"] == needed and plan["offload"]["layers"] == [0, 1, 2, 3]
    proc = run(["make", "--model", "ckpt", "--gpu", TEST_GPU, "--budget", f"{needed - 1}B"], workdir, in_process=True)
    assert_one_line_error(proc.returncode, proc.stderr, proc.stdout,
                          (f"need {needed} bytes", f"the budget is {needed - 1} bytes"))
