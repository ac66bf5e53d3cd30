"""planner.model.all_reduce: a ring all-reduce's bytes over the link, the profile's link refused where it has none,
and the link drawn through two measured timings (make --tp N --measure's figures: tests/runtime/test_measure_tp.py)."""

import pytest

from planner.errors import ProfileError, UsageError
from planner.model import all_reduce


def test_ring_all_reduce_moves_2_n_minus_1_over_n_of_the_bytes():
    link = 450e9
    ms = all_reduce.ring_all_reduce_ms(450e6, 4, link, latency_us=0)
    assert ms == pytest.approx(1e3 * 2 * 3 / 4 * 450e6 / link)
    assert all_reduce.ring_all_reduce_ms(1e9, 1, link) == 0.0


def test_a_profile_without_an_interconnect_refuses_tp():
    from planner.source.profile import load_profile

    with pytest.raises(ProfileError, match="gpu_link_bytes_per_s"):
        all_reduce.link_bytes_per_s(load_profile("l40s"), 2)


def test_the_link_through_two_timings_recovers_latency_and_bandwidth():
    latency_us, bus = 14.0, 380e9
    timings = tuple((size, latency_us / 1e3 + 1e3 * size / bus) for size in (4096, 64 * 2**20))  # tp 2: 2(N-1)/N = 1
    link = all_reduce.link_from_timings(2, timings, "measured: test")
    assert link.latency_us == pytest.approx(latency_us, abs=0.01)
    assert link.bytes_per_s == pytest.approx(bus, rel=1e-3)
    four = all_reduce.link_from_timings(4, tuple((s, latency_us / 1e3 + 1e3 * 1.5 * s / bus) for s, _ in timings),
                                        "measured: test")
    assert four.bytes_per_s == pytest.approx(bus, rel=1e-3)  # the ring's 2 (N - 1) / N of the bytes


def test_timings_that_do_not_grow_with_size_are_refused_in_one_line():
    with pytest.raises(UsageError, match="noise") as refused:
        all_reduce.link_from_timings(2, ((4096, 0.02), (64 * 2**20, 0.01)), "measured: test")
    assert "\n" not in str(refused.value)


def test_a_step_adds_two_all_reduces_a_layer_and_the_heads_reduce_and_gather():
    link_bytes_per_s, hidden, vocab = 400e9, 8192, 128256
    reduces = all_reduce.step_all_reduces(tp=4, num_layers=80, tokens_per_step=16, sequences_per_step=16,
                                          hidden_size=hidden, vocab_size=vocab, activation_bytes=2,
                                          link_bytes_per_s=link_bytes_per_s, latency_us=10.0)
    one = all_reduce.ring_all_reduce_ms(16 * hidden * 2, 4, link_bytes_per_s, 10.0)
    assert reduces.num_per_step == 2 * 80 + 2
    assert reduces.layer_ms == pytest.approx(2 * one)
    assert reduces.head_ms == pytest.approx(one + all_reduce.gather_ms(16 * vocab * 2, 4, link_bytes_per_s, 10.0))
    alone = all_reduce.step_all_reduces(tp=1, num_layers=80, tokens_per_step=16, sequences_per_step=16,
                                        hidden_size=hidden, vocab_size=vocab, activation_bytes=2,
                                        link_bytes_per_s=0.0)
    assert (alone.layer_ms, alone.head_ms, alone.num_per_step) == (0.0, 0.0, 0)


def test_the_link_says_whether_it_was_measured_or_assumed():
    measured = all_reduce.AllReduceLink(latency_us=17.5, bytes_per_s=360e9, measured="measured: NCCL")
    assumed = all_reduce.AllReduceLink(latency_us=all_reduce.ALL_REDUCE_LATENCY_US, bytes_per_s=450e9,
                                       assumed_why="1 GPU(s) visible here")
    assert measured.describe(2, 18) == ("+ 18 all-reduces a step over 2 GPUs at 360 GB/s and 17.5 us each "
                                        "(measured: NCCL)")
    assert assumed.describe(2, 18).endswith("(assumed: the profile's link and 30 us; 1 GPU(s) visible here)")
