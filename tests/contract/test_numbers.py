"""Numbers that read right (issue 26): rates with three significant digits, units on every diff line (no raw
floats, no None), and a serving chart that reads at 80 columns."""

import re
from dataclasses import replace

import pytest
from rich.console import Console

from planner.compare import compare_plans, shown_value, summary_sentences
from planner.plan_file import read_plan
from planner.report import PROVENANCE_FIGURES, chart_bar_columns, serving_chart
from planner.units import format_rate
from tests.conftest import REPO_ROOT

SERVING_PLANS = sorted((REPO_ROOT / "plans").glob("*-serve-*.yaml"))


@pytest.mark.parametrize("value, text", [
    (0.578, "0.578"), (0.0012345, "0.00123"), (9.996, "10.0"), (12.34, "12.3"), (99.94, "99.9"), (99.96, "100"),
    (933.4, "933"), (1867.2, "1,867"), (0, "0"),
])
def test_rates_have_three_significant_digits(value, text):
    assert format_rate(value) == text


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


@pytest.mark.parametrize("path", SERVING_PLANS, ids=[p.stem for p in SERVING_PLANS])
def test_serving_chart_reads_at_80_columns(path):
    plan = read_plan(path)
    console = Console(width=80, record=True)
    console.print(serving_chart(plan, chart_bar_columns(80)))
    lines = console.export_text().splitlines()
    assert "…" not in "\n".join(lines), "\n".join(lines)
    assert all(len(line.rstrip()) <= 80 for line in lines)
    rows = [line for line in lines if re.match(r"^\s*[>= x]*\s*\d+\s", line)]
    assert len(rows) == len(plan.serving.points), "a row wrapped onto two lines:\n" + "\n".join(lines)
    assert chart_bar_columns(80) >= 8 and chart_bar_columns(200) == 40


def test_show_states_where_each_hardware_figure_comes_from():
    """A gb200 plan's link figure is GB300's, assumed, on a link two GPUs share: show says so (issue 26)."""
    from planner.report import provenance_table, show_plan

    plan = read_plan(REPO_ROOT / "plans" / "llama-3.1-70b-gb200-96gib.yaml")
    console = Console(width=120, record=True)
    show_plan(plan, console, layer_table=False)
    text = console.export_text()
    assert "link 211.5 GB/s (assumed: see Hardware figures below)" in text
    assert "GB300's measured pinned H2D" in text and "shared by the superchip's 2 GPUs" in text
    table = provenance_table(plan)
    assert table.row_count == sum(getattr(plan.hardware, key) is not None for key, _, _ in PROVENANCE_FIGURES)
    changed = replace(plan, hardware=replace(plan.hardware, h2d_bytes_per_s=100e9))
    console = Console(width=120, record=True)
    console.print(provenance_table(changed))
    assert "the plan's own figure: its profile now gives another" in console.export_text()
