"""A hybrid layer's wait over its step's routing: the counts of touched CPU and fetched experts
(planner.model.expert_routing.touched_counts) checked against brute-force enumeration, E[max(link, CPU)] against the
max of the expectations, and the planner's whole CPU count (planner.search.cpu_placement) against every count."""

import itertools
import math
import random

import pytest

from planner.model.expert_routing import CpuDraw, LayerRouting, touched_counts
from planner.search.cpu_experts import expected_hybrid_wait_ms
from planner.search.routed_step import cpu_draw


def _exact_one_token(num_experts: int, top_k: int, num_cpu: int, num_link: int) -> CpuDraw:
    """The one-token draw of a layer whose highest ids are fetched, the next on the CPU, the lowest resident."""
    return cpu_draw(num_experts=num_experts, top_k=top_k, num_resident=num_experts - num_cpu - num_link,
                    num_cpu_ids=num_cpu, mean_cpu_experts=num_cpu * top_k / num_experts,
                    mean_link_experts=num_link * top_k / num_experts, num_tokens=1, uniform=True)


def _enumerated(num_experts: int, top_k: int, num_cpu: int, num_link: int) -> dict[tuple[int, int], float]:
    """P[(CPU experts, fetched experts)] by listing every top-k set of one token (the CPU ids are the ones below
    the fetched ones, the resident ones lowest)."""
    resident = num_experts - num_cpu - num_link
    counts: dict[tuple[int, int], float] = {}
    sets = list(itertools.combinations(range(num_experts), top_k))
    for chosen in sets:
        key = (sum(resident <= e < resident + num_cpu for e in chosen), sum(e >= resident + num_cpu for e in chosen))
        counts[key] = counts.get(key, 0.0) + 1 / len(sets)
    return counts


@pytest.mark.parametrize(("num_experts", "top_k", "num_cpu", "num_link"),
                         [(8, 2, 3, 4), (8, 2, 7, 0), (8, 2, 0, 5), (16, 4, 5, 6), (12, 3, 2, 10), (10, 6, 4, 3)])
def test_one_token_counts_are_the_enumerated_draw(num_experts, top_k, num_cpu, num_link):
    draw = _exact_one_token(num_experts, top_k, num_cpu, num_link)
    got = {(a, b): p for a, b, p in touched_counts(draw)}
    want = _enumerated(num_experts, top_k, num_cpu, num_link)
    assert set(got) == set(want)
    for key, p in want.items():
        assert got[key] == pytest.approx(p, rel=1e-12)


@pytest.mark.parametrize(("num_cpu", "mean_cpu", "num_link", "mean_link"),
                         [(30, 7.2, 60, 18.0), (5, 0.0, 9, 9.0), (40, 40.0, 3, 1.2), (0, 0.0, 100, 37.5)])
def test_many_token_counts_are_independent_binomials_with_the_means(num_cpu, mean_cpu, num_link, mean_link):
    draw = CpuDraw(num_cpu_ids=num_cpu, num_link_ids=num_link, mean_cpu_experts=mean_cpu,
                   mean_link_experts=mean_link)
    terms = touched_counts(draw)
    assert math.fsum(p for *_, p in terms) == pytest.approx(1.0, abs=1e-9)
    assert math.fsum(a * p for a, _, p in terms) == pytest.approx(mean_cpu, abs=1e-9)
    assert math.fsum(b * p for _, b, p in terms) == pytest.approx(mean_link, abs=1e-9)
    p_link = mean_link / num_link
    var = math.fsum((b - mean_link) ** 2 * p for _, b, p in terms)
    assert var == pytest.approx(num_link * p_link * (1 - p_link), abs=1e-6)


def _monte_carlo_wait_ms(num_experts, top_k, num_cpu, num_link, link_ms, handoff_ms, cpu_ms, draws=40_000):
    """One token's top-k sampled: the later of the link's fetched experts and the CPU's handoff and experts."""
    rng, resident, total = random.Random(7), num_experts - num_cpu - num_link, 0.0
    for _ in range(draws):
        chosen = rng.sample(range(num_experts), top_k)
        on_cpu = sum(resident <= e < resident + num_cpu for e in chosen)
        fetched = sum(e >= resident + num_cpu for e in chosen)
        total += max(fetched * link_ms, handoff_ms + on_cpu * cpu_ms)
    return total / draws


@pytest.mark.parametrize(("num_experts", "top_k", "num_cpu", "num_link", "link_ms", "cpu_ms", "above"),
                         [(8, 2, 3, 4, 7.18, 7.57, 1.2), (128, 8, 34, 63, 0.2006, 0.282, 1.1),
                          (64, 8, 20, 30, 0.35, 0.2, 1.0)])
def test_the_expected_wait_is_the_sampled_later_path_and_above_the_later_expectation(
        num_experts, top_k, num_cpu, num_link, link_ms, cpu_ms, above):
    """Mixtral's and Qwen3-30B-A3B's layers as they ran on the H200 host (the link's and the CPU's ms an expert),
    and a layer the link dominates: the exact expectation agrees with sampling, and exceeds the later of the two
    paths' expectations (what the planner priced before) by ``above`` or more, most where the paths balance."""
    draw = _exact_one_token(num_experts, top_k, num_cpu, num_link)
    handoff_ms = 0.015
    exact = expected_hybrid_wait_ms(draw, lambda n: n * link_ms, handoff_ms, cpu_ms)
    sampled = _monte_carlo_wait_ms(num_experts, top_k, num_cpu, num_link, link_ms, handoff_ms, cpu_ms)
    assert exact == pytest.approx(sampled, rel=0.03)
    later_mean = max(draw.mean_link_experts * link_ms, handoff_ms + draw.mean_cpu_experts * cpu_ms)
    assert exact >= above * later_mean


def test_a_certain_draw_waits_the_later_path():
    """Every id touched: no spread, the wait is the later path's."""
    draw = CpuDraw(num_cpu_ids=4, num_link_ids=6, mean_cpu_experts=4.0, mean_link_experts=6.0)
    assert expected_hybrid_wait_ms(draw, lambda n: 0.5 * n, 0.1, 0.6) == pytest.approx(max(3.0, 0.1 + 2.4))


@pytest.mark.parametrize("keys", [{"mean_cpu_experts": 5.0}, {"num_link_ids": -1},
                                  {"one_token_top_k": 2, "num_experts": 5}])
def test_impossible_draws_are_refused(keys):
    base = {"num_cpu_ids": 4, "num_link_ids": 3, "mean_cpu_experts": 1.0, "mean_link_experts": 1.0}
    with pytest.raises(ValueError):
        CpuDraw(**{**base, **keys})


def test_a_traced_layer_draws_each_id_independently():
    """A trace's shares are not uniform: even at one token the counts are binomial at the trace's means."""
    draw = cpu_draw(num_experts=8, top_k=2, num_resident=1, num_cpu_ids=3, mean_cpu_experts=0.4,
                    mean_link_experts=1.1, num_tokens=1, uniform=False)
    assert draw.one_token_top_k == 0
    assert math.fsum(a * p for a, _, p in touched_counts(draw)) == pytest.approx(0.4)


def test_uniform_routing_is_a_layer_routing_without_counted_tokens():
    """cpu_placement draws exactly where LayerRouting says its shares are exact (num_counted_tokens None)."""
    assert LayerRouting(index=0, shares=(0.25,) * 8).num_counted_tokens is None


def _layer_split(num_tokens: int, cpu_ms_per_expert: float, predicted: bool, accuracy: float | None):
    """One Mixtral-shaped routed layer (8 experts top-2, one resident; an expert 7.18 ms over the link) behind a
    first routed layer, at ``num_tokens`` sequences, its CPU experts at ``cpu_ms_per_expert`` each."""
    from planner.model.expert_placement import RoutedLayer, RoutedPlacement
    from planner.search.cpu_placement import LayerCpuSplit

    expert_bytes, rate, resident = 352_321_536, 49.07e9, (0,)
    routing = LayerRouting(index=1, shares=(2 / 8,) * 8)
    missed = routing.expected_fetched(resident, num_tokens)
    row = RoutedLayer(index=1, resident=resident, expected_fetched_bytes=missed * expert_bytes, hit_rate=1 / 8,
                      fetch_ms=1e3 * missed * expert_bytes / rate, expert_bytes=expert_bytes)
    placement = RoutedPlacement(layers=(row, row), fetch_slots=min(2 * num_tokens, 8), weight_bytes=0,
                                fetch_buffer_bytes=0, staging_buffer_bytes=0, gather_workspace_bytes=0,
                                host_pinned_bytes=0, prefetch_accuracy=accuracy)
    return LayerCpuSplit(placement=placement, position=1 if predicted else 0, row=row, routing=routing,
                       expert_bytes=expert_bytes, num_experts=8, top_k=2, num_tokens=num_tokens, compute_ms=2.0,
                       link_bytes_per_s=rate, handoff_ms=0.015, cpu_ms_per_expert=cpu_ms_per_expert)


@pytest.mark.parametrize("num_tokens", [1, 4])
@pytest.mark.parametrize(("cpu_ms", "predicted", "accuracy"),
                         [(7.57, False, None), (3.0, False, None), (7.57, True, 0.5), (20.0, False, None)])
def test_the_chosen_cpu_count_waits_least_of_every_count(num_tokens, cpu_ms, predicted, accuracy):
    """best_count walks from the expectations' balance; it must find the least expected wait over every whole
    count, 0 (fetching every miss) included, whatever the balance said."""
    split = _layer_split(num_tokens, cpu_ms, predicted, accuracy)
    waits = [round(split.wait_ms(count), 6) for count in range(split.num_non_resident + 1)]
    for start in range(split.num_non_resident + 1):
        assert waits[split.best_count(start)] == min(waits)


def test_a_chosen_layer_states_its_draw_and_its_expected_cpu_path():
    """The layer at its count carries what the timeline and the plan need: its CPU ids, the expected CPU path
    (handoff and the expected touched CPU experts), the draw (exact at one token) and the link's remaining bytes."""
    split = _layer_split(1, 3.0, False, None)
    count = split.best_count(3)
    row = split.candidate(count)
    assert len(row.cpu) == count and row.cpu == tuple(range(8 - count, 8))
    assert row.cpu_draw.one_token_top_k == 2 and row.cpu_draw.num_cpu_ids == count
    assert row.cpu_ms == pytest.approx(0.015 + count * 2 / 8 * 3.0)
    assert row.cpu_draw.mean_link_experts == pytest.approx((7 - count) * 2 / 8)
