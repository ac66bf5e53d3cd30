"""planner.model.selection_bias: the optimism of keeping a trace's hottest experts resident, and its correction."""

import random
import statistics

import pytest

from planner.model.expert_routing import LayerRouting
from planner.model.selection_bias import SelectionOptimism, poisson


def skewed_counts(seed: int, num_tokens: int, num_experts: int = 128, top_k: int = 8, hot_share: float = 0.8):
    """A trace layer's counts: 20% of the experts take ``hot_share`` of the assignments (drawn per assignment);
    also the true per-assignment probabilities."""
    generator = random.Random(seed)
    hot = set(generator.sample(range(num_experts), num_experts // 5))
    probs = [hot_share / len(hot) if e in hot else (1 - hot_share) / (num_experts - len(hot))
             for e in range(num_experts)]
    counts = [0] * num_experts
    for expert in generator.choices(range(num_experts), weights=probs, k=num_tokens * top_k):
        counts[expert] += 1
    return tuple(counts), probs


def test_the_bootstrap_finds_most_of_the_true_selection_optimism():
    """Over simulated traces, the true gap between the chosen set's counted and true hit rate, against the
    bootstrap's estimate from the counts alone (Poisson noise only: the estimate runs a little short)."""
    true_gaps, estimates = [], []
    for seed in range(12):
        counts, probs = skewed_counts(seed, num_tokens=512)
        chosen = sorted(range(128), key=lambda e: (-counts[e], e))[:43]
        counted = sum(counts[e] for e in chosen) / sum(counts)
        true_gaps.append(counted - sum(probs[e] for e in chosen))
        estimates.append(SelectionOptimism(counts=counts, num_tokens=512).hit_rate_gap(43, 1))
    assert statistics.mean(true_gaps) > 0.01  # the optimism is real
    assert 0.5 < statistics.mean(estimates) / statistics.mean(true_gaps) < 1.5


def test_more_tokens_less_optimism_and_none_at_the_ends():
    counts, _ = skewed_counts(0, num_tokens=512)
    small = SelectionOptimism(counts=counts, num_tokens=512)
    large = SelectionOptimism(counts=tuple(100 * c for c in counts), num_tokens=51200)
    assert small.hit_rate_gap(43, 1) > 3 * large.hit_rate_gap(43, 1) > 0
    assert small.fetched_gap(43, 1) < 0  # the counts understate what crosses the link
    assert small.hit_rate_gap(0, 1) == 0 and abs(small.hit_rate_gap(128, 1)) < 1e-12


def test_draws_are_seeded_by_the_counts():
    counts, _ = skewed_counts(3, num_tokens=256)
    first, second = (SelectionOptimism(counts=counts, num_tokens=256) for _ in range(2))
    assert first.hit_rate_gap(30, 4) == second.hit_rate_gap(30, 4)
    assert first.fetched_gap(30, 4) == second.fetched_gap(30, 4)


def test_traced_routing_is_priced_out_of_sample_uniform_is_not():
    counts, _ = skewed_counts(1, num_tokens=512)
    shares = tuple(c / 512 for c in counts)
    resident = tuple(sorted(sorted(range(128), key=lambda e: (-counts[e], e))[:43]))
    exact = LayerRouting(index=0, shares=shares)
    traced = LayerRouting(index=0, shares=shares, num_counted_tokens=512)
    assert exact.out_of_sample(resident, 1) == (exact.hit_rate(resident), exact.expected_fetched(resident, 1))
    hit, fetched = traced.out_of_sample(resident, 1)
    assert hit < exact.hit_rate(resident) and fetched > exact.expected_fetched(resident, 1)


@pytest.mark.parametrize("mean", [0.5, 7.0, 29.0, 30.0, 400.0])
def test_poisson_draws_have_the_mean_and_variance(mean):
    generator = random.Random(0)
    draws = [poisson(generator, mean) for _ in range(20000)]
    assert abs(statistics.mean(draws) - mean) < 0.05 * mean + 0.02
    assert abs(statistics.variance(draws) - mean) < 0.1 * mean + 0.05
    assert poisson(generator, 0) == 0
