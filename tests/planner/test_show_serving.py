"""show's serving chart (planner.views.show_serving)."""

import re

import pytest
from rich.console import Console

from planner.plan.file import read_plan
from planner.views.show_serving import chart_bar_columns, serving_chart
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
