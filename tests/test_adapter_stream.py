"""The adapter stream's schedule and its predicted times (planner.adapter_stream), against hand-worked cases."""

import pytest

from planner.adapter_stream import BLOCKING, PIPELINED, schedule_stream, simulate, times_from_events


def test_blocking_cuts_a_batch_into_waves_of_slots_and_mixes_adapters():
    """Waves are consecutive requests (first come, first served) needing at most two adapters."""
    schedule = schedule_stream([["a", "b", "a", "c", "a", "d"]], 2, BLOCKING)
    assert [f.requests for f in schedule.forwards] == [(0, 2, 1), (3, 4), (5,)]
    assert [f.adapters for f in schedule.forwards] == [("a", "a", "b"), ("c", "a"), ("d",)]
    # c evicts b (not in its wave; a is), after forward 0 read it; d evicts c, the least recently used
    assert [(ld.adapter, ld.slot, ld.after_forward) for ld in schedule.loads] == [
        ("a", 0, None), ("b", 1, None), ("c", 1, 0), ("d", 1, 1)]
    assert schedule.forwards[0].row_groups() == [(0, 2, "a", 0), (2, 3, "b", 1)]
    assert [f.waits for f in schedule.forwards] == [(0, 1), (2,), (3,)]


def test_pipelined_runs_each_wave_as_a_lead_and_the_rest_mixed():
    schedule = schedule_stream([["a", "b", "c", "b"], ["d"]], 3, PIPELINED)
    assert [f.requests for f in schedule.forwards] == [(0,), (1, 3, 2), (4,)]
    assert [f.adapters for f in schedule.forwards] == [("a",), ("b", "b", "c"), ("d",)]
    assert [f.issue_loads for f in schedule.forwards] == [(0, 1, 2), (), (3,)]
    assert [f.waits for f in schedule.forwards] == [(0,), (1, 2), (3,)]
    # d evicts a, the least recently used (read by forward 0)
    assert (schedule.loads[3].slot, schedule.loads[3].after_forward) == (0, 0)


def test_pipelined_lead_covers_the_rest_of_its_wave():
    """copies 10 ms; the lead computes 30 ms, the rest 50: the rest's copies land under the lead."""
    schedule = schedule_stream([["a", "b", "c", "b"]], 4, PIPELINED)
    times = simulate(schedule, copy_ms=dict.fromkeys("abc", 10.0), compute_ms=[30.0, 50.0])
    assert times.forward_start_ms == (10.0, 40.0) and times.compute_idle_ms == 10.0
    assert times.ttft_ms == (40.0, 90.0, 90.0, 90.0) and times.first_start_ms == (10.0,)


def test_pipelined_never_issues_a_copy_before_the_forward_that_frees_its_slot():
    """One slot: the next adapter's copy waits for the current forward, so it is issued after it (issued
    before, on one copy stream, it would hold back that forward's own weight copies behind a wait on itself)."""
    schedule = schedule_stream([["a", "b", "c"]], 1, PIPELINED)
    for index, forward in enumerate(schedule.forwards):
        for load in forward.issue_loads:
            after = schedule.loads[load].after_forward
            assert after is None or after < index


def test_resident_adapters_are_not_copied_and_lru_keeps_the_batchs_own():
    schedule = schedule_stream([["a", "b"], ["b", "c"]], 2, PIPELINED)
    assert [(ld.adapter, ld.slot, ld.batch) for ld in schedule.loads] == [("a", 0, 0), ("b", 1, 0), ("c", 0, 1)]


def test_simulated_times_by_hand():
    """copy 10 ms, compute 30 ms per forward, two slots, three adapters."""
    copy_ms = {"a": 10.0, "b": 10.0, "c": 10.0}
    pipelined = simulate(schedule_stream([["a", "b", "c"]], 2, PIPELINED), copy_ms=copy_ms, compute_ms=[30.0] * 3)
    # a lands at 10; b at 20 (under forward 0); c waits for forward 0's end (40), lands at 50: on time
    assert pipelined.forward_start_ms == (10.0, 40.0, 70.0)
    assert pipelined.ttft_ms == (40.0, 70.0, 100.0) and pipelined.compute_idle_ms == 10.0
    blocking = simulate(schedule_stream([["a", "b", "c"]], 2, BLOCKING), copy_ms=copy_ms, compute_ms=[60.0, 30.0])
    # a and b land at 20, forward of two rows to 80; c (evicts a, read by forward 0) 80-90, forward to 120
    assert blocking.forward_start_ms == (20.0, 90.0) and blocking.total_ms == 120.0
    assert blocking.ttft_ms == (80.0, 80.0, 120.0) and blocking.compute_idle_ms == 30.0
    assert blocking.first_start_ms == (20.0,) and pipelined.first_start_ms == (10.0,)


def test_a_batch_arrives_when_the_last_one_ends():
    schedule = schedule_stream([["a"], ["b"]], 1, PIPELINED)
    times = simulate(schedule, copy_ms={"a": 5.0, "b": 5.0}, compute_ms=[20.0, 20.0])
    assert times.forward_start_ms == (5.0, 30.0) and times.ttft_ms == (25.0, 25.0)


def test_offloaded_weights_queue_behind_an_adapter_copy():
    """A forward whose weights need 50 ms of link, compute 20 ms: the adapter copies before it delay it."""
    schedule = schedule_stream([["a", "b"]], 2, PIPELINED)
    times = simulate(schedule, copy_ms={"a": 10.0, "b": 10.0}, compute_ms=[20.0, 20.0], weights_link_ms=[50.0, 50.0])
    # a 0-10, b 10-20, forward 0 starts 10, its weights 20-70; forward 1 starts 70, weights 70-120
    assert times.forward_end_ms == (70.0, 120.0)


def test_wrapped_weight_copies_go_before_the_next_batchs_adapter():
    """The next forward's first layers (15 of its 50 ms of link) are copied as the forward before ends, ahead of
    the next batch's adapter copy."""
    schedule = schedule_stream([["a"], ["b"]], 1, PIPELINED)
    times = simulate(schedule, copy_ms={"a": 10.0, "b": 10.0}, compute_ms=[20.0, 20.0], weights_link_ms=[50.0, 50.0],
                     wrapped_link_ms=15.0)
    # a 0-10; forward 0 from 10, its weights 10-60, then 15 wrapped to 75; b 75-85; forward 1 from 85, its
    # remaining 35 of weights 85-120
    assert times.forward_start_ms == (10.0, 85.0) and times.forward_end_ms == (60.0, 120.0)


def test_measured_times_use_the_same_figures():
    schedule = schedule_stream([["a", "b"], ["a"]], 1, BLOCKING)
    times = times_from_events(schedule, [3.0, 10.0, 20.0], [8.0, 15.0, 26.0])
    assert times.ttft_ms == (8.0, 15.0, 11.0) and times.compute_idle_ms == pytest.approx(26.0 - 16.0)


def test_lora_scaling_is_peft_s():
    from planner.adapters import lora_scaling

    config = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj"]}
    assert lora_scaling(config, "x") == 2.0
    assert lora_scaling({**config, "use_rslora": True}, "x") == 8.0
