"""runtime.timeline: link and kernel figures from a profiler trace, checked on hand-made events."""

import pytest

from runtime.timeline import summarize


def _copy(start_us: float, duration_us: float, num_bytes: int = 50_000_000, stream: int = 13) -> dict:
    return {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": start_us, "dur": duration_us,
            "args": {"bytes": num_bytes, "stream": stream}}


def _kernel(start_us: float, duration_us: float) -> dict:
    return {"cat": "kernel", "name": "k", "ts": start_us, "dur": duration_us, "args": {"stream": 7}}


def test_idle_link_and_the_kernels_it_waited_behind_by_hand():
    """Two steps. 50 MB copies at 0-1000, 1000-2000, 2500-3500 and 3510-4500 us: one 500 us gap (the 10 us
    before the last copy is the copy engine's turnaround, no gap). Kernels at 900-1100 (with one nested in
    it) and 2100-2400, inside the gap. A 512-byte id copy and a CPU op are neither weights nor kernels."""
    events = [_copy(0, 1000), _copy(1000, 1000), _copy(2500, 1000), _copy(3510, 990),
              _kernel(900, 200), _kernel(950, 50), _kernel(2100, 300),
              _copy(2000, 1, num_bytes=512), {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9000}]
    summary = summarize(events, num_steps=2)
    assert summary.step_ms == pytest.approx(4.5 / 2)
    assert summary.copies_per_step == 2 and summary.num_gaps_per_step == 0.5
    assert summary.copy_busy_ms == pytest.approx(3.99 / 2)
    assert summary.link_idle_ms == pytest.approx(0.5 / 2) and summary.longest_gap_ms == pytest.approx(0.5)
    assert summary.kernel_busy_ms == pytest.approx(0.5 / 2)  # the nested kernel adds nothing
    assert summary.kernel_in_gaps_ms == pytest.approx(0.3 / 2)
    assert summary.copy_gb_per_s == pytest.approx(4 * 50e6 / 3990e-6 / 1e9)


def test_a_trace_without_weight_copies_is_an_error():
    with pytest.raises(ValueError, match="no host-to-device weight copies"):
        summarize([_kernel(0, 10), _copy(0, 1, num_bytes=100)], num_steps=1)
