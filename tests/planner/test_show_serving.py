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


@pytest.mark.parametrize("measure", [False, True], ids=["estimated", "measured"])
def test_show_states_how_close_such_plans_peaked(measure):
    """A serving plan's memory table says how far its total sat above the peaks measured of plans booked the same
    way (the estimate's margin is stated, not silent); a weights plan, whose total is not a serving peak, does not."""
    import dataclasses

    from planner.views.show import PEAK_SPREAD_ESTIMATED, PEAK_SPREAD_MEASURED, show_plan

    plan = read_plan(SERVING_PLANS[0])
    plan = dataclasses.replace(plan, inputs=dataclasses.replace(plan.inputs, measure=measure))
    console = Console(width=120, record=True)
    show_plan(plan, console)
    text = " ".join(console.export_text().split())
    low, high = PEAK_SPREAD_MEASURED if measure else PEAK_SPREAD_ESTIMATED
    assert f"with {'measured' if measure else 'estimated'} steps and captures peaked at {low:.2f}-{high:.2f}" in text
    assert ("make --measure books the captures measured" in text) is not measure
    weights = read_plan(REPO_ROOT / "plans" / "qwen3-8b-h100-sxm-40gib.yaml")
    console = Console(width=120, record=True)
    show_plan(weights, console)
    assert "steps and captures peaked" not in console.export_text()
