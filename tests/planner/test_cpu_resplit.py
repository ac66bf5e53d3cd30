"""planner.search.cpu_resplit: a plan's per-step tables made again at a multiple of its CPU price. At the plan's own
price they are its tables and its step; a slower CPU gets no more of any step's misses and a faster one no fewer,
and the step with the tables made again is never slower than the plan's tables at that rate. The host's rate
per expert computed (routed_step.host_cpu_scale) is what run compares."""

import math

import pytest

from planner.plan.file import read_plan
from planner.search.cpu_resplit import per_step_tables, resplit_at_scale
from planner.search.routed_step import cpu_rate_step_ms, host_cpu_scale
from tests.planner.test_cpu_plan import make, measured_moe, moe  # noqa: F401 - fixtures


@pytest.fixture
def auto_plan(moe):  # noqa: F811 - the fixture imported above
    make("fast.yaml", "auto.yaml")
    plan = read_plan("auto.yaml")
    assert per_step_tables(plan), "the fixture's plan splits its steps per count"
    return plan


def test_at_its_own_price_a_plan_keeps_its_tables_and_step(auto_plan):
    made = resplit_at_scale(auto_plan, 1.0)
    assert made.tables == per_step_tables(auto_plan)
    assert made.step_ms == pytest.approx(auto_plan.prediction.step_ms, abs=1e-3)
    assert made.planned_tables_step_ms == pytest.approx(made.step_ms)


@pytest.mark.parametrize("scale", [0.3, 0.6, 1.7, 3.0, 6.0])
def test_a_slower_cpu_gets_fewer_misses_and_a_faster_more(auto_plan, scale):
    planned, made = per_step_tables(auto_plan), resplit_at_scale(auto_plan, scale)
    assert made.tables.keys() == planned.keys()
    for index, take in made.tables.items():
        length = max(len(take), len(planned[index]))
        ours, theirs = (tuple(t) + (t[-1],) * (length - len(t)) for t in (take, planned[index]))
        assert all((j <= k) if scale > 1 else (j >= k) for j, k in zip(ours, theirs)), (index, take, planned[index])
        assert all(0 <= j <= m for m, j in enumerate(take))
    assert made.step_ms <= made.planned_tables_step_ms + 1e-9
    assert made.planned_tables_step_ms == pytest.approx(cpu_rate_step_ms(auto_plan, scale))


def test_a_much_slower_cpu_changes_the_tables_and_gains(auto_plan):
    made = resplit_at_scale(auto_plan, 6.0)
    assert made.tables != per_step_tables(auto_plan) and made.step_ms < made.planned_tables_step_ms


def test_plans_without_a_per_step_table_or_a_scale_above_zero_have_none(moe, auto_plan):  # noqa: F811
    make("fast.yaml", "fixed.yaml", "--cpu-experts", "fixed")
    make("fast.yaml", "off.yaml", "--cpu-experts", "off")
    for name in ("fixed.yaml", "off.yaml"):
        assert resplit_at_scale(read_plan(name), 2.0) is None
    for scale in (0.0, -1.0, math.nan):
        assert resplit_at_scale(auto_plan, scale) is None


def test_the_hosts_rate_is_counted_per_expert_computed(auto_plan):
    """Twice the price of the experts the host computed is 2x, whatever the plan expected of the routing; without a
    count, over the plan's expected CPU ms."""
    rows = auto_plan.experts.cpu_layers
    price = sum(row.cpu_ms_per_expert for row in rows) / len(rows)
    assert host_cpu_scale(auto_plan, 2 * 7.5 * price, 7.5) == pytest.approx(2.0)
    priced_ms = sum(row.cpu_ms - auto_plan.experts.cpu.handoff_ms for row in rows)
    assert host_cpu_scale(auto_plan, priced_ms) == pytest.approx(1.0)
    assert host_cpu_scale(auto_plan, 0.0, 7.5) is None
