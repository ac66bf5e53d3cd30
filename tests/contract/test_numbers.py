"""Numbers that read right (issue 26): rates with three significant digits, units on every diff line (no raw
floats, no None), and a serving chart that reads at 80 columns."""

import re
from dataclasses import replace

import pytest

from planner.views.diff import compare_plans, shown_value, summary_sentences
from planner.plan.file import read_plan
from tests.conftest import REPO_ROOT


@pytest.mark.parametrize("name, value, text", [
    ("budget", None, "none"), ("budget", "40GiB", "40GiB"), ("trigger", 0.5, "50.0% of GPU memory"),
    ("h2d_bytes_per_s", 211.5e9, "212 GB/s"), ("compute_efficiency", 0.1 + 0.2, "0.300"),
    ("tokens_per_step", 2048, "2,048 tokens"), ("context", 8192, "8,192 tokens"), ("sequences", 8, "8 sequences"),
    ("gpu_memory_bytes", 80 * 2**30, "80.00 GiB"), ("max_tpot_ms", 50.0, "50.00 ms"), ("cuda_graph", True, "on"),
    ("params", (), "none"), ("copy_overhead_us", 12.5, "12.5 us"), ("bf16_flops_per_s", 989e12, "989 TFLOP/s"),
])
def test_changed_values_carry_their_unit(name, value, text):
    assert shown_value(name, value) == text


def test_diff_sentences_have_no_raw_floats_or_none():
    """Inputs, workload and hardware changed at once: every changed value is said with its unit."""
    old = read_plan(REPO_ROOT / "plans" / "llama-3.1-70b-h100-sxm-40gib.yaml")
    new = replace(old, inputs=replace(old.inputs, budget=None, trigger=0.5, context=4096),
                  hardware=replace(old.hardware, h2d_bytes_per_s=old.hardware.h2d_bytes_per_s * 1.1,
                                   compute_efficiency=0.1 + 0.2),
                  workload=replace(old.workload, context_tokens=4096))
    text = " ".join(summary_sentences(compare_plans(old, new)))
    assert "None" not in text and "budget 40GiB -> none" in text and "trigger none -> 50.0% of GPU memory" in text
    assert "context_tokens 0 tokens -> 4,096 tokens" in text and "GB/s" in text
    assert not re.search(r"\d\.\d{4,}", text), text  # no float printed whole
