"""show's experts paragraph (planner.views.show_experts)."""

from types import SimpleNamespace as NS

from planner.plan.experts_section import WHOLE_LAYER, ExpertsPoint
from planner.views.show_experts import _crossover_lines


def test_show_of_a_plan_whose_steps_round_to_zero_names_the_regime_without_a_ratio():
    """A tiny model's steps round to 0 ms: the crossover line must not divide by them (the round-trip fuzz
    found `show` exiting 70 on such a weights plan with --params experts)."""
    point = ExpertsPoint(concurrency=1, regime=WHOLE_LAYER, routed_step_ms=0.0, whole_layer_step_ms=0.0,
                         num_resident=24)
    plan = NS(workload=NS(concurrency=1))
    experts = NS(points=(point,), routed_unavailable=None)
    (line,) = _crossover_lines(plan, experts)
    assert "whole layers chosen" in line and "x" not in line.split(":")[-1]
