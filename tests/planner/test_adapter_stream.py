"""The adapter stream's schedule and its predicted times (planner.search.adapter_stream), against hand-worked cases."""

import pytest

from planner.search.adapter_stream import (BLOCKING, PIPELINED, WeightsOnLink, pure_compute_ms, schedule_stream,
                                            simulate, times_from_events)


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


def test_no_forward_runs_more_requests_than_the_plans_step():
    """max_requests 1 (a plan of one sequence a step): the waves stay as they were, each cut into forwards of one
    request. Blocking: the wave's first forward waits for all its copies. Pipelined: each forward waits for its
    own adapter's copy, the copies still issued before the lead."""
    blocking = schedule_stream([["a", "b", "a", "c", "a", "d"]], 2, BLOCKING, max_requests=1)
    assert [f.requests for f in blocking.forwards] == [(0,), (2,), (1,), (3,), (4,), (5,)]
    assert [f.waits for f in blocking.forwards] == [(0, 1), (), (), (2,), (), (3,)]
    assert [f.issue_loads for f in blocking.forwards] == [(0, 1), (), (), (2,), (), (3,)]
    pipelined = schedule_stream([["a", "b", "c", "b"], ["d"]], 3, PIPELINED, max_requests=2)
    assert [f.requests for f in pipelined.forwards] == [(0,), (1, 3), (2,), (4,)]
    assert [f.issue_loads for f in pipelined.forwards] == [(0, 1, 2), (), (), (3,)]
    assert [f.waits for f in pipelined.forwards] == [(0,), (1,), (2,), (3,)]
    # a bound at or past the wave's size is the unbounded schedule
    assert schedule_stream([["a", "b", "c", "b"]], 4, PIPELINED, max_requests=4) == \
        schedule_stream([["a", "b", "c", "b"]], 4, PIPELINED)
    with pytest.raises(ValueError):
        schedule_stream([["a"]], 1, BLOCKING, max_requests=0)


def test_a_plans_mode_is_chosen_on_forwards_of_its_own_step():
    """choose_mode prices the stream run --bench serves: forwards of at most the plan's sequences."""
    from planner.search.adapter_stream import choose_mode

    copy_ms = {name: 10.0 for name in "abcdefgh"}
    one = choose_mode(copy_ms=copy_ms, num_slots=4, request_ms=30.0, weights=None, max_requests=1)
    wide = choose_mode(copy_ms=copy_ms, num_slots=4, request_ms=30.0, weights=None)
    # forwards of one request each compute as much in all, but their copies hide behind more of them
    assert one.blocking_total_ms <= wide.blocking_total_ms and one.pipelined_total_ms <= wide.pipelined_total_ms


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


#: two layers, both offloaded, one slot: layer 1's copy is issued after layer 0 ends, layer 0's (for the next
#: forward) after layer 1 ends, as runtime.engine issues them; 10 ms each
TWO_LAYERS = WeightsOnLink(num_layers=2, offloaded=(0, 1), prefetch_step=1, copy_ms=(10.0, 10.0))


def test_offloaded_weights_queue_behind_an_adapter_copy():
    """The lead forward's weight copies are enqueued after the wave's adapter copies: one FIFO stream."""
    schedule = schedule_stream([["a", "b"]], 2, PIPELINED)
    times = simulate(schedule, copy_ms={"a": 5.0, "b": 20.0}, compute_ms=[20.0, 20.0], weights=TWO_LAYERS)
    # a 0-5, b 5-25; forward 0 from 5: layer 0 5-15, layer 1's copy behind b 25-35, layer 1 35-45, layer 0's
    # copy 45-55; forward 1 from 45: layer 0 55-65, layer 1's copy 65-75, layer 1 75-85
    assert times.forward_start_ms == (5.0, 45.0) and times.forward_end_ms == (45.0, 85.0)


def test_wrapped_weight_copies_go_before_the_next_batchs_adapter():
    """The next forward's first layer is copied as the forward before ends, ahead of the next batch's adapter:
    the batch's first start is that copy and its own adapter's."""
    schedule = schedule_stream([["a"], ["b"]], 1, PIPELINED)
    times = simulate(schedule, copy_ms={"a": 5.0, "b": 5.0}, compute_ms=[20.0, 20.0], weights=TWO_LAYERS)
    # a 0-5; forward 0 from 5: layer 0 5-15, layer 1's copy 15-25, layer 1 25-35, layer 0's copy 35-45; b 45-50;
    # forward 1 from 50: layer 0 50-60, layer 1's copy 60-70, layer 1 70-80
    assert times.forward_start_ms == (5.0, 50.0) and times.forward_end_ms == (35.0, 80.0)
    assert times.first_start_ms == (5.0, 15.0)


def test_weights_count_only_where_the_engine_copies_them():
    """Every offloaded layer in a slot of its own is copied once, at load: the stream runs as if resident."""
    own_slots = WeightsOnLink(num_layers=2, offloaded=(0, 1), prefetch_step=2, copy_ms=(10.0, 10.0))
    schedule = schedule_stream([["a"], ["b"]], 1, BLOCKING)
    times = simulate(schedule, copy_ms={"a": 5.0, "b": 5.0}, compute_ms=[20.0, 20.0], weights=own_slots)
    assert times.forward_end_ms == (25.0, 50.0)


def test_pure_compute_from_forwards_alone():
    """A forward alone takes its compute or its weights' link time: compute-bound it is its own compute; bound
    by the link, the most compute that leaves it so."""
    # layers 1 and 3 offloaded, one slot: each copy lands a layer's compute before it is needed
    fast = WeightsOnLink(num_layers=4, offloaded=(1, 3), prefetch_step=1, copy_ms=(1.0, 1.0))
    assert pure_compute_ms([50.0, 50.0], fast) == pytest.approx([50.0, 50.0])
    # layer 1's copy starts when layer 0 ends (one slot): alone, a forward takes its compute + 10
    assert pure_compute_ms([30.0], TWO_LAYERS) == pytest.approx([20.0])
    assert pure_compute_ms([30.0, 40.0], None) == [30.0, 40.0]


def test_measured_times_use_the_same_figures():
    schedule = schedule_stream([["a", "b"], ["a"]], 1, BLOCKING)
    times = times_from_events(schedule, [3.0, 10.0, 20.0], [8.0, 15.0, 26.0])
    assert times.ttft_ms == (8.0, 15.0, 11.0) and times.compute_idle_ms == pytest.approx(26.0 - 16.0)


def test_lora_scaling_is_peft_s():
    from planner.model.adapters import lora_scaling

    config = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj"]}
    assert lora_scaling(config, "x") == 2.0
    assert lora_scaling({**config, "use_rslora": True}, "x") == 8.0


def _h100_half_offloaded_weights(folder):
    """The half-offloaded plan's weights on the link, as the H100 benchmark made it: `make` for a Qwen3-8B-shaped
    checkpoint (headers only) with G=2 K=1 P=2 at 2048 tokens on h100-sxm: layers 1, 3, ..., 35 offloaded, each
    copy at the profile's link, the layers' compute shares and the LM head's time from the cost model."""
    from tests.conftest import invoke, make_checkpoint

    from planner.search.adapter_stream import weights_on_link
    from planner.plan.file import read_plan

    make_checkpoint(folder / "qwen3-8b", 36, 4096, 12288, vocab=151936, num_heads=32, num_kv_heads=8, data=False)
    result = invoke(["make", "-m", folder / "qwen3-8b", "-g", "h100-sxm", "--budget", "60GiB", "--tokens", "2048",
                     "--group-size", "2", "--num-in-group", "1", "--prefetch-step", "2", "-o", folder / "half.yaml"])
    assert result.exit_code == 0, result.output
    weights = weights_on_link(read_plan(folder / "half.yaml"))
    assert weights.offloaded == tuple(range(1, 36, 2)) and weights.prefetch_step == 2
    return weights


def _h100_stream_predictions(weights: WeightsOnLink) -> dict:
    """The H100 adapter benchmark (benchmarks/2026-11-24-adapters-h100.json, half offloaded) predicted again from
    its own inputs: the stream, each forward's time alone, the plan's adapter copy time and ``weights``."""
    import json
    import statistics
    from pathlib import Path

    from planner.search.adapter_stream import stream_batches

    recorded = json.loads((Path(__file__).parents[2] / "benchmarks/2026-11-24-adapters-h100.json").read_text())
    row = next(r for r in recorded["plans"] if r["num_offloaded"])
    batches = stream_batches([f"lora{k:02d}" for k in range(16)], 8, 4)
    one = row["forward_ms"]["1 requests, lora"]
    results = {}
    for mode in row["bench"]["modes"]:
        schedule = schedule_stream(batches, 4, mode["mode"])
        sizes = [len(forward.requests) for forward in schedule.forwards]
        # each forward's median alone is not recorded: the 4-request forwards share the total alone, the
        # pipelined lead is the recorded 1-request forward and the 3-request rests share the remainder
        if mode["mode"] == BLOCKING:
            alone = [mode["compute_ms"] / len(sizes)] * len(sizes)
        else:
            rest = (mode["compute_ms"] - one * sizes.count(1)) / sizes.count(3)
            alone = [one if size == 1 else rest for size in sizes]
        times = simulate(schedule, copy_ms=dict.fromkeys(schedule.request_adapters, row["bench"]["planned_copy_ms"]),
                         compute_ms=pure_compute_ms(alone, weights), weights=weights)
        results[mode["mode"]] = (mode, {"first_start_ms": statistics.mean(times.first_start_ms),
                                        "compute_idle_ms": times.compute_idle_ms, "total_ms": times.total_ms,
                                        "ttft_mean_ms": statistics.mean(times.ttft_ms)})
    return results


def test_h100_first_start_and_idle_with_weights_on_the_link(tmp_path):
    """Half offloaded on the H100, the first start and the compute idle were predicted as if the link were free
    when a batch arrives (24.2 ms measured against 20.6 blocking, 7.4 against 4.8 pipelined; idle 217 against
    184 and 76 against 19). With the weights' copies on the link as the engine issues them, and the LM head
    after the last layer (the next forward's first weight copies start under it), each lands within issue 27's
    10% or 1 ms, and totals and TTFTs within 2%."""
    for measured, predicted in _h100_stream_predictions(_h100_half_offloaded_weights(tmp_path)).values():
        for key, value in predicted.items():
            tolerance = 0.02 if key in ("total_ms", "ttft_mean_ms") else 0.10
            assert abs(value - measured[key]) <= max(tolerance * measured[key], 1.0), (measured["mode"], key, value)


def test_the_lm_head_runs_after_the_last_layer():
    """The head's time is the same for any forward (a weight read for each row's last token) and comes after
    the layers: the copy that waits for the last offloaded layer starts under it."""
    head = WeightsOnLink(num_layers=2, offloaded=(0, 1), prefetch_step=1, copy_ms=(10.0, 10.0), head_ms=4.0)
    schedule = schedule_stream([["a"], ["b"]], 1, PIPELINED)
    times = simulate(schedule, copy_ms={"a": 5.0, "b": 5.0}, compute_ms=[24.0, 24.0], weights=head)
    # a 0-5; forward 0 from 5: layer 0 5-15, layer 1's copy 15-25, layer 1 25-35, then the head 35-39 while
    # layer 0's copy (for forward 1) runs 35-45; b 45-50; forward 1 from 50: layer 0 50-60, layer 1's copy
    # 60-70, layer 1 70-80, head 80-84
    assert times.forward_start_ms == (5.0, 50.0) and times.forward_end_ms == (39.0, 84.0)
    assert times.compute_idle_ms == 5.0 + 11.0


def test_the_plan_chooses_the_mode_its_prediction_says_is_faster():
    """Resident, pipelined hides a wave's later copies under its lead; with forwards bound by the offloaded
    weights' copies, splitting a wave into two forwards costs one more pass of them, so blocking wins."""
    from planner.search.adapter_stream import choose_mode

    copy_ms = {f"a{k}": 5.0 for k in range(8)}
    resident = choose_mode(copy_ms=copy_ms, num_slots=2, request_ms=20.0, weights=None)
    assert resident.mode == PIPELINED and resident.requests_per_batch == 4
    assert resident.pipelined_total_ms < resident.blocking_total_ms
    assert resident.margin == pytest.approx(resident.blocking_total_ms / resident.pipelined_total_ms - 1)
    link_bound = WeightsOnLink(num_layers=4, offloaded=(0, 1, 2, 3), prefetch_step=2, copy_ms=(30.0,) * 4)
    offloaded = choose_mode(copy_ms=copy_ms, num_slots=2, request_ms=20.0, weights=link_bound)
    assert offloaded.mode == BLOCKING and offloaded.blocking_total_ms < offloaded.pipelined_total_ms
