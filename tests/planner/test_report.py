"""planner.report: what show prints, the serving chart and where each hardware figure comes from."""

import re
from dataclasses import replace

import pytest
from rich.console import Console

from planner.plan_file import read_plan
from planner.report import PROVENANCE_FIGURES, chart_bar_columns, serving_chart
from tests.conftest import REPO_ROOT

SERVING_PLANS = sorted((REPO_ROOT / "plans").glob("*-serve-*.yaml"))


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
