"""A hybrid layer that splits each step's misses by the count drawn (planner.search.cpu_per_step): the draw against
enumeration, each table entry against every count, the expected wait against Monte Carlo, and the table's shape."""

import itertools
import math
import random

import pytest

from planner.model.expert_routing import PerStepCpu, StepDraw
from planner.search.cpu_experts import PART_EXTRA_MS
from planner.search.cpu_per_step import (LinkWait, _terms_by_miss, expected_wait_ms, joint_pmf, per_step_split,
                                         take_at, touched_pmf)


def _one_token(num_experts: int, top_k: int, num_resident: int) -> StepDraw:
    non_resident = num_experts - num_resident
    return StepDraw(num_non_resident=non_resident, mean_touched=non_resident * top_k / num_experts,
                    one_token_top_k=top_k, num_experts=num_experts)


@pytest.mark.parametrize(("num_experts", "top_k", "num_resident"), [(8, 2, 3), (16, 4, 0), (10, 6, 7), (12, 3, 11)])
def test_one_token_draw_is_the_enumerated_draw(num_experts, top_k, num_resident):
    sets = list(itertools.combinations(range(num_experts), top_k))
    want: dict[int, float] = {}
    for chosen in sets:
        n = sum(e >= num_resident for e in chosen)
        want[n] = want.get(n, 0.0) + 1 / len(sets)
    got = dict(touched_pmf(_one_token(num_experts, top_k, num_resident)))
    assert set(got) == set(want)
    assert all(got[n] == pytest.approx(p, rel=1e-12) for n, p in want.items())


def test_the_joint_draw_has_the_means():
    draw = StepDraw(num_non_resident=100, mean_touched=23.5)
    terms = joint_pmf(draw, 0.4)
    assert math.fsum(p for *_, p in terms) == pytest.approx(1.0, abs=1e-6)
    assert math.fsum(n * p for n, _, p in terms) == pytest.approx(23.5, abs=1e-4)
    assert math.fsum(m * p for _, m, p in terms) == pytest.approx(0.6 * 23.5, abs=1e-4)
    assert all(m <= n for n, m, _ in terms)
    assert joint_pmf(draw, None) == tuple((n, n, p) for n, _, p in joint_pmf(draw, None))  # no prefetch: all miss


#: (draw, link, handoff ms, one CPU expert ms): one token of Qwen3-30B-A3B-like and Mixtral-like layers, and a
#: batch with prefetch; the first layer (not predicted) and a predicted one
CASES = [
    (_one_token(128, 8, 40), LinkWait(compute_ms=0.4, expert_ms=0.17, hit_share=None, ahead_share=1.0,
                                      predicted=False), 0.015, 0.27),
    (_one_token(128, 8, 40), LinkWait(compute_ms=0.4, expert_ms=0.17, hit_share=0.5, ahead_share=1.0,
                                      predicted=True), 0.015, 0.27),
    (_one_token(8, 2, 3), LinkWait(compute_ms=1.0, expert_ms=6.4, hit_share=0.6, ahead_share=1.0, predicted=True),
     0.015, 6.4),
    (StepDraw(num_non_resident=90, mean_touched=22.0), LinkWait(compute_ms=0.6, expert_ms=0.17, hit_share=0.45,
                                                                ahead_share=0.75, predicted=True), 0.015, 0.3),
]


@pytest.mark.parametrize(("draw", "link", "handoff_ms", "cpu_ms"), CASES)
def test_each_table_entry_is_the_best_count_at_its_misses(draw, link, handoff_ms, cpu_ms):
    split = per_step_split(draw, link, handoff_ms, cpu_ms)
    by_miss = _terms_by_miss(joint_pmf(draw, link.prefetched_share))
    for m, terms in by_miss.items():
        if math.fsum(p for _, p in terms) < 1e-4:  # the tail: the table only rises there
            continue

        def wait(j: int) -> float:
            return math.fsum(p * max(link.at(n, m - j), handoff_ms + j * cpu_ms) for n, p in terms)

        best = min(wait(j) for j in range(m + 1))
        assert wait(take_at(split.take, m)) == pytest.approx(best, rel=1e-9, abs=1e-12), m
    assert all(0 <= j <= m for m, j in enumerate(split.take))
    assert list(split.take) == sorted(split.take)  # more misses never send fewer to the CPU
    assert len(split.take) == 1 or split.take[-1] != split.take[-2]  # trailing repeats trimmed


@pytest.mark.parametrize(("draw", "link", "handoff_ms", "cpu_ms"), CASES)
def test_the_expected_wait_is_what_the_table_gives_and_beats_fetching_only(draw, link, handoff_ms, cpu_ms):
    split = per_step_split(draw, link, handoff_ms, cpu_ms)
    per_step = PerStepCpu(draw=draw, expert_ms=link.expert_ms, take=split.take)
    assert expected_wait_ms(per_step, link, handoff_ms, cpu_ms) == pytest.approx(split.wait_ms, rel=1e-12)
    never = PerStepCpu(draw=draw, expert_ms=link.expert_ms, take=(0,))
    assert split.wait_ms <= expected_wait_ms(never, link, handoff_ms, cpu_ms) + 1e-12
    assert split.mean_cpu_experts + split.mean_link_experts == pytest.approx(draw.mean_touched, rel=1e-6)


def test_the_expected_wait_is_the_simulated_steps_mean():
    """One token routed uniformly to 8 of 128 experts, 40 resident; the prefetch brings each touched expert with
    probability 0.5: the mean of simulated steps' max(link, CPU) at the table is the priced expectation."""
    draw, link, handoff_ms, cpu_ms = CASES[1]
    split = per_step_split(draw, link, handoff_ms, cpu_ms)
    rng = random.Random(7)
    total, steps = 0.0, 40_000
    for _ in range(steps):
        n = sum(e >= 40 for e in rng.sample(range(128), 8))
        m = sum(rng.random() >= link.hit_share for _ in range(n))
        j = take_at(split.take, m)
        total += max(link.at(n, m - j), handoff_ms + j * cpu_ms)
    assert total / steps == pytest.approx(split.wait_ms, rel=0.02)


@pytest.mark.parametrize(("draw", "link", "handoff_ms", "cpu_ms"), CASES)
@pytest.mark.parametrize("fixed_share", [0.0, 0.3])
def test_a_fractional_table_takes_the_best_fraction_near_the_best_count_and_waits_less(draw, link, handoff_ms, cpu_ms,
                                                                                         fixed_share):
    """With a fixed part of a CPU expert's time (what a fraction of its rows still pays), each entry is the share of
    least wait on the 1/16 grid within one expert of the best whole count (a fraction f of one more expert costs
    fixed + f x the rest on the CPU, and m - j experts on the link; a step with a fraction waits PART_EXTRA_MS
    more), on the grid, and the layer waits no longer than
    with whole experts; the mean CPU and link experts still add to the touched ones."""
    fixed_ms = fixed_share * cpu_ms
    whole = per_step_split(draw, link, handoff_ms, cpu_ms)
    split = per_step_split(draw, link, handoff_ms, cpu_ms, fixed_ms)
    by_miss = _terms_by_miss(joint_pmf(draw, link.prefetched_share))

    def cpu_path(share: float) -> float:
        count = math.floor(share)
        part = share - count
        return handoff_ms + count * cpu_ms + (fixed_ms + part * (cpu_ms - fixed_ms) if part else 0.0)

    for m, terms in by_miss.items():
        if math.fsum(p for _, p in terms) < 1e-4:
            continue

        def wait(share: float) -> float:
            extra = PART_EXTRA_MS if share != int(share) else 0.0
            return math.fsum(p * (max(link.at(n, m - share), cpu_path(share)) + extra) for n, p in terms)

        count = take_at(whole.take, m)
        grid = [count + k / 16 for k in range(-15, 16) if 0 <= count + k / 16 <= m]
        assert wait(take_at(split.take, m)) == pytest.approx(min(map(wait, grid)), rel=1e-9, abs=1e-12), m
    assert all(share * 16 == int(share * 16) for share in split.take)
    assert split.wait_ms <= whole.wait_ms + 1e-12
    assert split.mean_cpu_experts + split.mean_link_experts == pytest.approx(draw.mean_touched, rel=1e-6)
    per_step = PerStepCpu(draw=draw, expert_ms=link.expert_ms, take=split.take, fixed_ms=split.fixed_ms)
    assert expected_wait_ms(per_step, link, handoff_ms, cpu_ms) == pytest.approx(split.wait_ms, rel=1e-12)


def test_a_fraction_is_taken_where_it_saves_more_than_splitting_costs():
    """One token: a Mixtral-like layer (an expert 6.4 ms on either path) sends part of an expert where two miss and
    waits less; a Qwen3-30B-A3B-like one (0.17 ms on the link, 0.28 on the CPU) would save less than a split costs
    (PART_EXTRA_MS) and keeps whole experts at one miss."""
    draw, link, handoff_ms, cpu_ms = CASES[2]
    split = per_step_split(draw, link, handoff_ms, cpu_ms, 0.084)
    assert 1 < take_at(split.take, 2) < 2 and split.fixed_ms == 0.084
    assert split.wait_ms < per_step_split(draw, link, handoff_ms, cpu_ms).wait_ms
    draw, link, handoff_ms, _ = CASES[0]
    assert take_at(per_step_split(draw, link, handoff_ms, 0.28, 0.084).take, 1) == 0
