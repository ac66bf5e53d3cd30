"""The one routed decode step (planner.search.routed_step): where a routed layer waits, and the three callers
(the plan's search, show, scripts/bench_experts.py) pricing the same step."""

import pytest

from planner.make.make_plan import make_plan
from planner.model.cost import ComputeTimes
from planner.model.expert_placement import (RoutedLayer, RoutedPlacement, gather_ms, gather_rate, routed_placement,
                                            with_prefetch_depth)
from planner.model.expert_routing import uniform_routing
from planner.model.experts import MoeGeometry, MoeLayer
from planner.plan.schema import Inputs, copies_pairs, routed_layer_expert_bytes
from planner.search.expert_choice import decode_simulation
from planner.search.routed_step import WAIT_AT_LAYER_SHARE, RoutedFetch, plan_fetches, routed_decode_step
from planner.views.show import resimulate


def test_a_routed_layer_waits_between_its_router_and_its_experts():
    # layers 0 and 2 resident, layer 1 routed and predicted by none: it waits for its whole fetch (2 ms), after
    # its router, before its experts, with the fetch on the link as it waits
    step = routed_decode_step((1.0, 4.0, 1.0), 0.5, (RoutedFetch(index=1, link_ms=2.0, expert_ms=None,
                                                                 hit_share=None),), num_slots=1)
    wait_start = 1.5 + WAIT_AT_LAYER_SHARE * 4.0
    assert [(i.layer, i.start_ms, i.end_ms) for i in step.compute] == [
        (-1, 0.0, 0.5), (0, 0.5, 1.5), (1, 1.5, wait_start), (1, wait_start + 2.0, 7.5), (2, 7.5, 8.5)]
    assert [(i.layer, i.start_ms, i.end_ms) for i in step.copies] == [(1, wait_start, wait_start + 2.0)]
    assert step.layer_stall_ms == (0.0, 2.0, 0.0) and step.stall_ms == 2.0 and step.step_ms == 8.5


def test_the_first_routed_layer_is_predicted_by_none():
    fetches = tuple(RoutedFetch(index=i, link_ms=1.0, expert_ms=None, hit_share=1.0) for i in range(2))
    step = routed_decode_step((3.0, 3.0), 0.0, fetches, num_slots=1)
    assert step.layer_stall_ms[0] == 1.0  # its whole fetch; the second's hides behind the first's compute
    assert step.layer_stall_ms[1] < 1.0
    # the link: the first layer's fetch as it waits, the second's prefetch from that wait (every expert
    # predicted: no misses)
    first_wait = step.compute[1].end_ms
    assert [(i.layer, i.start_ms, i.end_ms) for i in step.copies] == [(0, first_wait, first_wait + 1.0),
                                                                     (1, first_wait, first_wait + 1.0)]


def _intervals(simulation):
    return [(i.layer, i.start_ms, i.end_ms) for i in simulation.compute]


def test_the_plan_and_show_draw_the_same_step(qwen3_30b):
    """show re-draws a routed plan's step from its rows on the timeline the search priced it on: the same intervals
    and waits, up to the plan's rounding (bytes to whole numbers, shares to 4 decimals)."""
    plan = make_plan(Inputs(model=str(qwen3_30b), gpu="h100-sxm", context=4096, concurrency="1", cuda_graph=True,
                            gpu_memory="24GiB")).plan
    experts = plan.experts
    assert experts.routed_layers and experts.prefetching
    shown = resimulate(plan)
    assert shown.step_ms == pytest.approx(plan.prediction.step_ms, rel=1e-4)
    assert shown.stall_ms == pytest.approx(plan.prediction.stall_ms, rel=1e-3)
    # the placement the search priced, rebuilt from the plan's rows, on the search's own path
    rate = experts.routed_fetch_bytes_per_s
    hit, ahead = experts.prefetch_shares()
    hardware = plan.hardware
    rows = tuple(RoutedLayer(index=row.index, resident=row.resident, expected_fetched_bytes=row.expected_fetched_bytes,
                             hit_rate=row.hit_rate, fetch_ms=1e3 * row.expected_fetched_bytes / rate,
                             expert_bytes=routed_layer_expert_bytes(plan, row),
                             gather_ms=gather_ms(1, experts.top_k, experts.num_experts,
                                                 routed_layer_expert_bytes(plan, row),
                                                 gather_rate(hardware.hbm_bytes_per_s, hardware.compute_efficiency),
                                                 copies_pairs=copies_pairs(plan)),
                             prefetch_hit_share=row.prefetch_hit_share, prefetch_ahead_share=row.prefetch_ahead_share)
                 for row in experts.routed_layers)
    assert all(row.gather_ms == 0 for row in rows)  # bf16 experts: grouped_mm reads the buffer in place
    placement = RoutedPlacement(layers=rows, fetch_slots=experts.fetch_slots, weight_bytes=0, fetch_buffer_bytes=0,
                                staging_buffer_bytes=0, gather_workspace_bytes=0, host_pinned_bytes=0,
                                prefetch_accuracy=hit, prefetch_ahead_share=ahead,
                                prefetch_depth=experts.prefetch_depth)
    compute = ComputeTimes(layer_ms=tuple(row.compute_ms for row in plan.layers), head_ms=plan.prediction.head_ms,
                           source="the plan's")
    searched = decode_simulation(compute, placement)
    for mine, theirs in ((_intervals(searched), _intervals(shown)),
                         ([(i.layer, i.start_ms, i.end_ms) for i in searched.copies],
                          [(i.layer, i.start_ms, i.end_ms) for i in shown.copies])):
        assert len(mine) == len(theirs) and all(a == pytest.approx(b, rel=1e-9) for a, b in zip(mine, theirs))
    assert searched.layer_stall_ms == pytest.approx(shown.layer_stall_ms, rel=1e-9)
    assert len(plan_fetches(plan)) == len(experts.routed_layers)


def test_the_benchmark_predicts_the_step_the_planner_prices():
    from scripts.bench_experts import model_step_ms

    num_layers, expert_bytes, h2d_bytes_per_s = 4, 1000, 1e6
    geometry = MoeGeometry(num_experts=8, top_k=2, unroutable_reason=None, expert_dtype="F32",  # pairs copied
                           layers=tuple(MoeLayer(index=i, expert_bytes=expert_bytes, other_bytes=500)
                                        for i in range(num_layers)))
    base = routed_placement(geometry, uniform_routing(geometry), num_tokens=1, layer_total_bytes=(8500,) * 4,
                            non_layer_bytes=0, weight_limit_bytes=20000, h2d_bytes_per_s=h2d_bytes_per_s,
                            prefetch_accuracy=0.8)
    fetched = base.layers[0].expected_fetched_bytes
    assert fetched > 0 and all(row.expected_fetched_bytes == fetched for row in base.layers)
    for depth in (1, 2):
        placement = with_prefetch_depth(base, (0.9, 0.6), depth)
        compute = ComputeTimes(layer_ms=(0.8 / num_layers,) * num_layers, head_ms=0.0, source="test")
        planned = decode_simulation(compute, placement).step_ms
        predicted = model_step_ms(0.8, num_layers, fetched, h2d_bytes_per_s, placement.prefetch_accuracy,
                                  placement.prefetch_ahead_share, expert_bytes=expert_bytes,
                                  num_slots=placement.fetch_slots)
        assert predicted == pytest.approx(planned, rel=1e-12)


def test_a_decode_gather_is_written_and_read_back_and_only_where_it_runs():
    expert_bytes, rate = 9 * 2**20, 1.5e12
    assert gather_ms(4, 8, 128, expert_bytes, rate, copies_pairs=True) == pytest.approx(2e3 * 32 * expert_bytes / rate)
    # 256 pairs: the step runs the prefill path instead
    assert gather_ms(32, 8, 128, expert_bytes, rate, copies_pairs=True) == 0
    assert gather_ms(4, 8, 128, expert_bytes, rate, copies_pairs=False) == 0  # grouped_mm: nothing copied
