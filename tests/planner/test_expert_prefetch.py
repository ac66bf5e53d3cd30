"""A routed layer's wait in a decode step, with and without next-layer prefetch (planner.model.expert_prefetch)."""

import pytest

from planner.model.expert_prefetch import prefetch_layer_stall_ms


def test_the_stall_is_the_fetch_the_prefetch_cannot_hide_plus_the_misses():
    # no prediction (no prefetch, or the first routed layer): the whole fetch after the router
    assert prefetch_layer_stall_ms(0.5, 1.2, None, predicted=True) == 1.2
    assert prefetch_layer_stall_ms(0.5, 1.2, 0.9, predicted=False) == 1.2
    # every expert predicted: only what one layer's compute does not cover
    assert prefetch_layer_stall_ms(0.5, 1.2, 1.0, predicted=True) == pytest.approx(0.7)
    assert prefetch_layer_stall_ms(2.0, 1.2, 1.0, predicted=True) == 0.0
    # none predicted: the wasted prefetch takes the link first, then every miss
    assert prefetch_layer_stall_ms(0.5, 1.2, 0.0, predicted=True) == pytest.approx(0.7 + 1.2)
    assert prefetch_layer_stall_ms(0.5, 1.2, 0.75, predicted=True) == pytest.approx(0.7 + 0.3)


def test_a_fetch_of_whole_experts_outlasts_the_window_more_than_its_mean():
    """A batch-1 step fetches a whole number of experts: the prefetch beyond one layer's compute is priced over
    N ~ Binomial(slots, mean / slots), not at the mean (convex: never less)."""
    from planner.model.expert_prefetch import expected_excess_ms

    # one slot, half the steps fetch the expert (1 ms) against a 0.6 ms window: 0.5 x 0.4, where the mean
    # (0.5 ms) fits the window
    assert expected_excess_ms(1.0, 0.6, 0.5, 1) == pytest.approx(0.2)
    # two slots, mean 1: P(1) = 0.5 (0.4 ms over), P(2) = 0.25 (1.4 ms over)
    assert expected_excess_ms(1.0, 0.6, 1.0, 2) == pytest.approx(0.5 * 0.4 + 0.25 * 1.4)
    assert expected_excess_ms(1.0, 2.5, 1.0, 2) == 0.0  # no count outlasts the window
    assert expected_excess_ms(1.0, 0.5, 3.0, 3) == pytest.approx(2.5)  # every slot, every step
    for mean in (0.3, 1.3, 5.5):
        spread = prefetch_layer_stall_ms(0.35, 0.19 * mean, 0.7, predicted=True, expert_ms=0.19, num_slots=8)
        at_mean = prefetch_layer_stall_ms(0.35, 0.19 * mean, 0.7, predicted=True)
        assert spread >= at_mean - 1e-12
    # many slots and a large mean: the spread narrows toward the mean's figure
    wide = prefetch_layer_stall_ms(1.0, 0.01 * 400, 0.9, predicted=True, expert_ms=0.01, num_slots=4096)
    assert wide == pytest.approx(prefetch_layer_stall_ms(1.0, 4.0, 0.9, predicted=True), rel=0.02)


def test_a_prefetch_slows_the_compute_it_overlaps_and_a_link_bound_layer_hides_it():
    """Hand-computed, one slot (a step fetches 0 or 1 expert, half the steps each), compute 0.6 ms, s = 0.15."""
    from planner.model.expert_prefetch import expected_excess_ms

    # an expert of 0.4 ms under the compute costs s x 0.4; none costs nothing
    assert expected_excess_ms(0.4, 0.6, 0.5, 1, 0.15) == pytest.approx(0.5 * 0.15 * 0.4)
    # an expert of 1.0 ms outlasts it: max(1.0 - 0.6, 0.15 x 0.6) = 0.4, the slower compute hidden behind it
    assert expected_excess_ms(1.0, 0.6, 0.5, 1, 0.15) == pytest.approx(0.5 * 0.4)
    # a prefetch barely past the compute: the slowed compute, not the link, sets the layer's time
    assert expected_excess_ms(0.62, 0.6, 1.0, 1, 0.15) == pytest.approx(0.15 * 0.6)
    # the machinery is the predicting layer's own, on top; an unpredicted layer waits for its fetch alone
    assert prefetch_layer_stall_ms(0.6, 0.4, 1.0, predicted=True, compute_slowdown=0.15, machinery_ms=0.03) == \
        pytest.approx(0.15 * 0.4 + 0.03)
    assert prefetch_layer_stall_ms(0.6, 0.4, 1.0, predicted=False, compute_slowdown=0.15, machinery_ms=0.03) == 0.4
