"""``run --bench``'s tables for a plan that fetches routed experts: the bytes its decode steps brought over the
link and the next-layer prediction's accuracy, measured beside the plan's, and how to price the measured routing.

CPU only: the measurement is built by hand (the GPU side fills it: tests/runtime/test_routed_experts_gpu.py).
"""

from types import SimpleNamespace

import pytest
from rich.console import Console

from offload_plan.run_tables import result_table
from runtime.routed_fetches import RoutedFetches

pytest.importorskip("torch")


def _routed(rank_accuracy=(0.95, 0.77), planned=(0.9, 0.66)) -> RoutedFetches:
    return RoutedFetches(num_steps=60, fetched_bytes_per_step=900e6, predicted_bytes_per_step=1_000_000_000,
                         bytes_per_step_by_kind={"prefetched": 600e6, "wasted": 100e6, "missed": 200e6,
                                                 "unpredicted": 0.0},
                         rank_accuracy=rank_accuracy, planned_rank_accuracy=planned)


def _serving(routed) -> SimpleNamespace:
    return SimpleNamespace(mode="decode graphed", concurrency=1, context_tokens=4096, decode_tokens_per_s=40.0,
                           predicted_decode_tokens_per_s=36.0, decode_step_statistic="mean",
                           decode_step_ms_all=(25.0,) * 60, decode_step_ms=25.0, predicted_decode_step_ms=27.7,
                           prefill_chunk_tokens=2048, prefill_chunk_ms=168.0, predicted_prefill_chunk_ms=172.0,
                           peak_gpu_bytes=10e9, predicted_total_gpu_bytes=10.5e9, memory_fraction=0.07,
                           gpu_memory_bytes=11e9, routed=routed)


def _text(routed) -> str:
    console = Console(width=200, record=True)
    console.print(result_table(SimpleNamespace(kind="serving", measured=_serving(routed)), 1))
    return console.export_text()


def test_the_means_over_ranks():
    fetched = _routed()
    assert fetched.prefetch_accuracy == pytest.approx(0.86)
    assert fetched.planned_prefetch_accuracy == pytest.approx(0.78)
    assert _routed(rank_accuracy=(None, 0.5)).prefetch_accuracy == 0.5
    assert _routed(rank_accuracy=(), planned=None).prefetch_accuracy is None


def test_a_routed_serving_table_says_what_crossed_the_link_and_how_to_price_it():
    text = _text(_routed())
    assert "routed experts over the link a step (60 steps)" in text and "0.90" in text
    assert "86.0%" in text and "78.0%" in text
    assert "--prefetch-accuracy 0.86" in text


def test_without_a_prediction_the_table_gives_the_bytes_alone():
    text = _text(_routed(rank_accuracy=(), planned=None))
    assert "routed experts over the link" in text
    assert "prefetch-accuracy" not in text and "prediction right" not in text


def test_a_plan_without_routed_experts_has_no_such_rows():
    assert "routed experts" not in _text(None)


def test_a_plan_with_cpu_experts_shows_the_hosts_share_beside_the_plans():
    routed = _routed()
    routed = RoutedFetches(**{**vars(routed), "cpu": {"handoff": "doorbell", "pairs_per_step": 16.6,
                                                      "pairs_share": 0.26, "host_ms_per_step": 4.87,
                                                      "planned_cpu_ms_per_step": 4.2}})
    text = _text(routed)
    assert "host CPU's experts a step (16.6 pairs, doorbell)" in text and "1.16" in text
    assert "host CPU" not in _text(_routed())
    counted = RoutedFetches(**{**vars(routed), "cpu": {**routed.cpu, "experts_per_step": 15.2,
                                                       "planned_experts_per_step": 14.75}})
    assert "(16.6 pairs, 15.2 experts (14.8 planned), doorbell)" in _text(counted)
    assert "at this host's CPU rate" not in _text(counted)
    repriced = RoutedFetches(**{**vars(routed), "cpu": {**routed.cpu, "host_cpu_scale": 1.69,
                                                        "step_ms_at_host_cpu_rate": 11.53}})
    assert "the plan's decode step at this host's CPU rate (1.69x its price;" in _text(repriced)
    assert "11.53 ms" in _text(repriced) and "--cpu-time-scale" not in _text(repriced)
    suggested = RoutedFetches(**{**vars(repriced), "cpu": {**repriced.cpu, "cpu_time_scale": 1.69}})
    text = _text(suggested)
    assert "make the plan again with --cpu-time-scale 1.69" in text and "--prefetch-accuracy 0.86" in text
    near = RoutedFetches(**{**vars(suggested), "cpu": {**suggested.cpu, "host_cpu_scale": 1.1}})
    assert "--cpu-time-scale" not in _text(near)
    event = {"step": 32, "scale": 1.69, "previous_scale": 1.0, "changed_layers": [0, 1, 2], "step_ms": 9.8,
             "planned_tables_step_ms": 11.53}
    resplit = RoutedFetches(**{**vars(suggested), "cpu": {**suggested.cpu, "step_ms_resplit_at_host_cpu_rate": 9.81,
                                                          "resplit": {"tables_scale": 1.69, "events": [event],
                                                                      "window_scales": [1.69, 1.7]}}})
    text = " ".join(_text(resplit).split())
    assert "with its CPU tables made again at that rate (run re-splits the steps)" in text and "9.81 ms" in text
    assert "run re-split the CPU's share of each step's misses 1 time(s), last at 1.69x" in text
    assert "3 layers' tables changed" in text
    unchanged = RoutedFetches(**{**vars(resplit), "cpu": {**resplit.cpu, "resplit": {**resplit.cpu["resplit"],
                                                                                   "events": []}}})
    assert "run re-split the" not in " ".join(_text(unchanged).split())


@pytest.mark.parametrize("peak", [None, 9 * 2**30])
def test_the_adapter_stream_table_says_its_forwards_and_peak(peak):
    """An adapter plan's bench says its forwards ran at most the plan's step, and (on CUDA) the process's peak
    beside the plan's total."""
    from runtime.adapter_bench import AdapterBench, ModeResult

    mode = ModeResult(mode="pipelined", total_ms=100.0, predicted_total_ms=98.0, compute_ms=80.0, link_ms=20.0,
                      first_start_ms=5.0, predicted_first_start_ms=5.1, ttft_mean_ms=50.0, predicted_ttft_mean_ms=49.0,
                      ttft_max_ms=90.0, predicted_ttft_max_ms=88.0, compute_idle_ms=10.0,
                      predicted_compute_idle_ms=9.5, ttft_ms=(50.0,), num_copies=8)
    bench = AdapterBench(num_adapters=8, num_slots=4, requests_per_batch=8, num_batches=4, prompt_tokens=2048,
                         slot_bytes=2**20, measured_copy_ms=6.4, planned_copy_ms=6.3, plan_mode="pipelined",
                         plan_mode_margin=0.05, modes=(mode,), max_requests_per_forward=1, peak_gpu_bytes=peak,
                         predicted_total_gpu_bytes=None if peak is None else 10 * 2**30,
                         gpu_memory_bytes=None if peak is None else 80 * 2**30)
    console = Console(width=400, record=True)
    console.print(result_table(SimpleNamespace(kind="adapters", measured=bench), 1))
    text = " ".join(console.export_text().split())
    assert "forwards of at most 1 request(s), the plan's step" in text
    assert ("peak GPU 9.00 GiB (the plan's total 10.00 GiB)" in text) is (peak is not None)
