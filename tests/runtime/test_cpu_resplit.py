"""runtime.cpu_resplit and RoutedExperts.set_cpu_take on the CPU: tables written in place split the next steps by
them (none of a step's misses on the CPU, or all), the all-resident tokens either way; a bad table is one line; the
re-splitter measures the host's rate per window from the host steps' counters, re-splits past the tolerance only,
and skips windows that measure nothing. Tables written between replays of a captured step: test_cpu_handoff_gpu."""

import copy
from types import SimpleNamespace as NS

import pytest
import torch

from planner.errors import PlanError
from planner.plan.file import read_plan
from planner.search.cpu_resplit import per_step_tables, resplit_at_scale
from runtime import cpu_resplit
from runtime.backend import CpuStandIn
from runtime.cpu_resplit import (RESPLIT_MIN_EXPERTS, RESPLIT_TOLERANCE, CpuResplitter, resplit_enabled,
                                 resplitter_for)
from runtime.routed_layers import apply_routed_experts
from tests.planner.test_cpu_plan import make, measured_moe, moe  # noqa: F401 - fixtures
from tests.runtime.test_cpu_handoff import NUM_EXPERTS, SPLIT_CPU, SPLIT_TAKE, _reference_and_routed, _within
from tests.runtime.test_routed_experts import ROUTED, _greedy
from tests.runtime_models import routed_moe_model

NONE_TAKE = {index: (0,) for index in ROUTED}
#: every miss to the CPU, past the most a step can have (entries beyond E are never read)
ALL_TAKE = {index: tuple(range(NUM_EXPERTS + 5)) for index in ROUTED}


@pytest.fixture(scope="module")
def model():
    return routed_moe_model(num_experts=NUM_EXPERTS)


@pytest.mark.parametrize("tables, on_cpu", [(NONE_TAKE, False), (ALL_TAKE, True)], ids=["none", "all"])
def test_tables_written_in_place_split_the_next_steps(model, tables, on_cpu):
    batch, num_steps = 2, 6
    _, (ids, logits, _), routed_model, routed = _reference_and_routed(model, batch, num_steps, cpu=SPLIT_CPU,
                                                                      cpu_take=SPLIT_TAKE)
    try:
        routed.set_cpu_take(tables)
        assert all(routed.tables[index].cpu_split.take.numel() == NUM_EXPERTS + 1 for index in ROUTED)
        assert routed.cpu_take == {index: tuple(float(j) for j in take) for index, take in tables.items()}
        routed.reset_counters()
        routed_ids, routed_logits, _ = _greedy(routed_model, batch, num_steps)
        assert torch.equal(routed_ids, ids) and all(_within(a, b, 1e-5) for a, b in zip(routed_logits, logits))
        stats, fetched = routed.cpu_stats(), routed.fetched_bytes()
        assert (stats["experts_cpu"] > 0 and fetched == 0) if on_cpu else (stats["experts_cpu"] == 0 and fetched > 0)
    finally:
        routed.close()


@pytest.mark.parametrize("tables, wrong", [
    ({0: (0, 2)}, "cpu_take\\[1\\]"),
    ({0: (0, 0.5)}, "whole experts"),
    ({0: ()}, "does not split"),
])
def test_a_bad_table_written_in_place_is_one_line(model, tables, wrong):
    routed = apply_routed_experts(copy.deepcopy(model), ROUTED, 4, CpuStandIn(), cpu=SPLIT_CPU, cpu_take=SPLIT_TAKE)
    try:
        with pytest.raises(PlanError, match=wrong) as error:
            routed.set_cpu_take(tables)
        assert "\n" not in str(error.value)
    finally:
        routed.close()


def test_a_layer_with_fixed_cpu_ids_cannot_take_a_table(model):
    routed = apply_routed_experts(copy.deepcopy(model), ROUTED, 4, CpuStandIn(), cpu={0: (2, 3)})
    try:
        with pytest.raises(PlanError, match="does not split its misses") as error:
            routed.set_cpu_take({0: (0, 1)})
        assert "\n" not in str(error.value)
    finally:
        routed.close()


class FakeRouted:
    """The re-splitter's view of RoutedExperts: host steps' counters as a test sets them, tables as written."""

    def __init__(self, plan):
        self.cpu_take = {index: tuple(float(j) for j in take) for index, take in per_step_tables(plan).items()}
        self.work: dict = {}
        self.cpu_experts = NS(work_by_layer=lambda: dict(self.work))
        self.written: list[dict] = []

    def set_cpu_take(self, tables):
        self.written.append(tables)
        self.cpu_take.update({index: tuple(float(j) for j in take) for index, take in tables.items()})

    def add(self, experts_per_layer: int, scale: float, plan) -> None:
        """One window's work: each CPU layer computed ``experts_per_layer`` experts at ``scale`` x its price."""
        for row in plan.experts.cpu_layers:
            experts, seconds = self.work.get(row.index, (0, 0.0))
            self.work[row.index] = (experts + experts_per_layer,
                                    seconds + experts_per_layer * scale * row.cpu_ms_per_expert / 1e3)


@pytest.fixture
def auto_plan(moe):  # noqa: F811 - the fixture imported above
    make("fast.yaml", "auto.yaml")
    return read_plan("auto.yaml")


def _windows(resplitter, routed, plan, scales, experts_per_layer=4):
    """Run one window per scale (the first after a restart only sets the baseline), returning the events."""
    events = []
    for scale in scales:
        routed.add(experts_per_layer, scale, plan)
        events.append(resplitter.observe(resplitter.window_steps))
    return events


def test_the_resplitter_measures_each_window_and_resplits_past_the_tolerance(auto_plan):
    routed = FakeRouted(auto_plan)
    resplitter = CpuResplitter(auto_plan, routed, window_steps=4)
    assert resplitter.observe(3) is None and routed.written == []  # within the first window
    within = 1 + RESPLIT_TOLERANCE / 2
    events = _windows(resplitter, routed, auto_plan, [1.0, within, 6.0, 6.0 * within])
    assert events[:2] == [None, None] and events[3] is None  # baseline, then within the tolerance twice
    event = events[2]
    assert event.scale == pytest.approx(6.0) and event.previous_scale == 1.0 and resplitter.scale == event.scale
    made = resplit_at_scale(auto_plan, event.scale)
    assert event.step_ms == pytest.approx(made.step_ms) and event.step_ms < event.planned_tables_step_ms
    assert routed.written == [{index: made.tables[index] for index in event.changed_layers}] and event.changed_layers
    assert resplitter.measured == pytest.approx([within, 6.0, 6.0 * within])


def test_windows_with_few_cpu_experts_are_measured_together(auto_plan):
    """A window with fewer than RESPLIT_MIN_EXPERTS experts measures nothing alone: the windows after it join it until
    they hold as many, then the rate over all of them counts."""
    routed = FakeRouted(auto_plan)
    resplitter = CpuResplitter(auto_plan, routed, window_steps=1)
    layers = len(auto_plan.experts.cpu_layers)
    needed = -(-RESPLIT_MIN_EXPERTS // layers)  # windows of one expert a layer
    events = _windows(resplitter, routed, auto_plan, [1.0] + [5.0] * needed, experts_per_layer=1)
    assert events[:needed] == [None] * needed and events[-1] is not None and events[-1].scale == pytest.approx(5.0)
    assert resplitter.measured[:-1] == [None] * (needed - 1) and resplitter.measured[-1] == pytest.approx(5.0)


def test_counters_reset_under_a_window_start_a_new_baseline(auto_plan):
    """Counters that went back (run --bench's start_counting resets them) measure nothing and start the next window."""
    routed = FakeRouted(auto_plan)
    resplitter = CpuResplitter(auto_plan, routed, window_steps=1)
    _windows(resplitter, routed, auto_plan, [1.0, 1.0], experts_per_layer=8)
    routed.work = {}  # reset, then fewer experts than before it
    routed.add(2, 5.0, auto_plan)
    assert resplitter.observe(1) is None and resplitter.measured == [pytest.approx(1.0)] and routed.written == []
    routed.add(8, 5.0, auto_plan)
    event = resplitter.observe(1)
    assert event is not None and event.scale == pytest.approx(5.0) and routed.written
    # a reset whose experts caught up by the next reading is still seen by its seconds
    routed.work = {index: (experts, 0.0) for index, (experts, _) in routed.work.items()}
    routed.add(1, 5.0, auto_plan)
    assert resplitter.observe(1) is None and len(routed.written) == 1


def test_the_resplitter_is_made_only_where_it_can_work(auto_plan, monkeypatch):
    routed = NS(cpu_experts=object())
    assert isinstance(resplitter_for(auto_plan, routed), CpuResplitter)
    assert resplitter_for(auto_plan, NS(cpu_experts=None)) is None and resplitter_for(auto_plan, None) is None
    monkeypatch.setenv("OFFLOAD_PLAN_CPU_RESPLIT", "off")
    assert resplitter_for(auto_plan, routed) is None and not resplit_enabled()
    monkeypatch.setenv("OFFLOAD_PLAN_CPU_RESPLIT", "sometimes")
    with pytest.raises(PlanError, match="OFFLOAD_PLAN_CPU_RESPLIT") as error:
        resplitter_for(auto_plan, routed)
    assert "\n" not in str(error.value)


def test_a_fixed_ids_plan_has_no_resplitter(moe):  # noqa: F811
    make("fast.yaml", "fixed.yaml", "--cpu-experts", "fixed")
    assert resplitter_for(read_plan("fixed.yaml"), NS(cpu_experts=object())) is None


def test_settle_runs_windows_and_puts_the_cache_back():
    """settle: the re-splitter restarted, RESPLIT_SETTLE_WINDOWS windows of steps, the loop's state put back."""
    calls = []
    resplitter = NS(window_steps=16, restart=lambda: calls.append("restart"))
    loop = NS(resplit=resplitter, save_state=lambda: "saved", timed_steps=lambda n: calls.append(n),
              restore_state=lambda saved: calls.append(saved))
    cpu_resplit.settle(loop)
    assert calls == ["restart", cpu_resplit.RESPLIT_SETTLE_WINDOWS * 16, "saved"]
    cpu_resplit.settle(NS(resplit=None))  # nothing to do
