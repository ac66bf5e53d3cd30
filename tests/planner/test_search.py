"""planner.search.groups.Searcher and simulate.fast_step_ms against the slow code they replace, and their speed.

The search must choose exactly what it chose before it was made fast (tests/search_reference.py keeps that
code): same Choice, same simulation, same error message, on random small models, eager and graphed, with
pinned knobs, uneven layers and layers with nothing to offload. Then the search itself against cases computed
by hand and against brute force over every (G, K, P).
"""

import random
import time

import pytest

from planner.search import simulate as simulate_module
from planner.model.cost import ComputeTimes
from planner.errors import InfeasibleError
from planner.search.schedule import offloaded_by_rule
from planner.search.groups import (LayerBytes, Searcher, SearchSpace, copy_ms_of, gpu_bytes_of, minimum_gpu_bytes,
                                   search)
from planner.search.simulate import STEPS_PER_GRAPH, simulate, simulated_step_ms
from tests.search_reference import reference_search


def _outcome(function, **kwargs):
    """The Choice, or the InfeasibleError's message."""
    try:
        return function(**kwargs)
    except InfeasibleError as error:
        return f"InfeasibleError: {error}"


def _random_model(rng: random.Random) -> dict:
    num_layers = rng.randint(1, 14)
    if rng.random() < 0.3:
        sizes = (rng.choice([1000, 1200]),) * num_layers
    else:
        sizes = tuple(rng.choice([800, 1000, 1200, 5000]) for _ in range(num_layers))
    # some layers hold none or part of the selected params (--params)
    selected = tuple(s if rng.random() < 0.8 else rng.choice([0, s // 2]) for s in sizes)
    space = SearchSpace()
    if rng.random() < 0.2:
        space = SearchSpace(group_size=rng.choice([None, rng.randint(1, num_layers)]),
                            num_in_group=rng.choice([None, rng.randint(1, 3)]),
                            prefetch_step=rng.choice([None, rng.randint(1, 4)]))
    return dict(layers=LayerBytes(total=sizes, selected=selected, num_tensors=rng.choice([0, 3, 50])),
                fixed_bytes=rng.choice([0, 100, 3000]), h2d_bytes_per_s=rng.choice([1e6, 3e6, 1e7]),
                copy_overhead_us=rng.choice([0.0, 5.0]), space=space, join_every_steps=rng.choice([0, 1, 1, 2]))


def _random_compute(rng: random.Random, num_layers: int) -> ComputeTimes:
    layer_ms = tuple(rng.choice([0.0, 0.1, 0.2, 0.5, 1.0, 2.0]) if rng.random() < 0.5 else rng.uniform(0, 3)
                     for _ in range(num_layers))
    return ComputeTimes(layer_ms=layer_ms, head_ms=rng.choice([0.0, 0.1, 1.3]), source="test")


@pytest.mark.parametrize("seed", range(3))
def test_searcher_chooses_what_the_old_search_chose(seed):
    """One Searcher per model, several compute times and budgets each (from infeasible to all resident):
    its choice, the module's search() and the reference agree exactly, and fits() says which raise."""
    rng = random.Random(seed)
    for _ in range(25):
        model = _random_model(rng)
        layers, fixed = model["layers"], model["fixed_bytes"]
        searcher = Searcher(**model)
        least, resident = minimum_gpu_bytes(fixed, layers), gpu_bytes_of(fixed, layers, (), 0)
        for _ in range(4):
            compute = _random_compute(rng, len(layers.total))
            budget = rng.randint(max(0, least - 600), resident + 600)
            expected = _outcome(reference_search, compute=compute, budget_bytes=budget, **model)
            assert _outcome(searcher.search, compute=compute, budget_bytes=budget) == expected
            assert _outcome(search, compute=compute, budget_bytes=budget, **model) == expected
            assert searcher.fits(budget) == (not isinstance(expected, str)), expected


def test_minimum_gpu_bytes_is_the_least_budget_that_fits():
    rng = random.Random(5)
    for _ in range(40):
        model = _random_model(rng)
        searcher = Searcher(**model)
        compute = _random_compute(rng, len(model["layers"].total))
        try:
            least = searcher.minimum_gpu_bytes()
        except InfeasibleError as error:
            assert "pinned knobs" in str(error) and not searcher.fits(10**12)
            continue
        assert searcher.fits(least) and not searcher.fits(least - 1)
        assert searcher.search(compute=compute, budget_bytes=least).gpu_bytes <= least
        with pytest.raises(InfeasibleError):
            searcher.search(compute=compute, budget_bytes=least - 1)


@pytest.mark.parametrize("warm_steps", [0, 1, 6])
def test_fast_step_is_simulates_step_to_the_bit(monkeypatch, warm_steps):
    """The step time the search compares plans by is simulate()'s, to the last bit, eager and graphed, with
    every split of the wrapped copies and any number of warm steps."""
    monkeypatch.setattr(simulate_module, "NUM_WARM_STEPS", warm_steps)
    rng = random.Random(warm_steps)
    for _ in range(400):
        num_layers = rng.randint(1, 12)
        offloaded = tuple(sorted(rng.sample(range(num_layers), rng.randint(1, num_layers))))
        case = dict(
            layer_ms=tuple(rng.uniform(0, 5) if rng.random() < 0.7 else rng.choice([0.0, 1.0])
                           for _ in range(num_layers)),
            head_ms=rng.choice([0.0, rng.uniform(0, 2)]), offloaded=offloaded,
            copy_ms=tuple(rng.uniform(0.01, 8) for _ in offloaded), prefetch_step=rng.randint(1, len(offloaded) + 1),
            join_every_steps=rng.choice([0, 1, 2, 4]),
        )
        case["replay_start_copies"] = rng.randint(0, case["prefetch_step"])
        assert simulated_step_ms(**case) == simulate(**case).step_ms, case


def test_one_slot_chain_bound_holds():
    """Searcher skips one-slot simulations by the chain bound (planner.search.groups._Run._one_slot_loses): every
    simulated step through one slot is at least sum(copy + offloaded compute) - first copy / measured steps."""
    rng = random.Random(11)
    for _ in range(400):
        num_layers = rng.randint(2, 12)
        offloaded = tuple(sorted(rng.sample(range(num_layers), rng.randint(2, num_layers))))
        layer_ms = tuple(rng.uniform(0, 5) if rng.random() < 0.7 else 0.0 for _ in range(num_layers))
        copy_ms = tuple(rng.uniform(0.01, 8) for _ in offloaded)
        bound = sum(copy_ms) + sum(layer_ms[i] for i in offloaded) - copy_ms[0] / simulate_module.NUM_MEASURED_STEPS
        for join_every_steps in (0, 1):
            for count in range(2 if join_every_steps else 1):
                step_ms = simulate(layer_ms=layer_ms, head_ms=rng.uniform(0, 2), offloaded=offloaded,
                                   copy_ms=copy_ms, prefetch_step=1, join_every_steps=join_every_steps,
                                   replay_start_copies=count).step_ms
                assert step_ms >= bound * (1 - 1e-12), (offloaded, join_every_steps, count)


def _serving_sweep(num_layers: int, num_searches: int):
    """A 300-layer model of 22 MB layers over a 55 GB/s link, and what a serving make asks for: per
    concurrency, its compute times and the memory its KV cache leaves, from all resident to nearly the least."""
    layer_bytes = 22_413_312
    layers = LayerBytes(total=(layer_bytes,) * num_layers, selected=(layer_bytes,) * num_layers,
                        num_tensors=9 * num_layers + 3)
    fixed = 131_074_048
    least, resident = minimum_gpu_bytes(fixed, layers), gpu_bytes_of(fixed, layers, (), 0)
    cases = []
    for i in range(num_searches):
        batch = 2 ** (9 * i / (num_searches - 1))
        compute = ComputeTimes(layer_ms=(0.0135 + 0.0002 * batch,) * num_layers, head_ms=0.02 + 0.001 * batch,
                               source="test")
        cases.append((compute, int(resident - (i / (num_searches - 1)) * 0.97 * (resident - least))))
    return dict(layers=layers, fixed_bytes=fixed, h2d_bytes_per_s=55e9, copy_overhead_us=5.0), cases


@pytest.mark.parametrize("join_every_steps, num_searches", [(0, 20), (1, 10)])
def test_a_serving_sweep_of_300_layers_is_fast(join_every_steps, num_searches):
    """Searches over 300 layers, budgets from all resident to nearly the least: about 5 s of CPU eagerly for
    20 and 5 s graphed for 10 on a shared 2-core machine, where one search took 4 to 230 s before Searcher.
    The bound is generous and counts CPU time, not wall time, so a loaded CI machine passes; a return to the
    old cost fails."""
    model, cases = _serving_sweep(300, num_searches)
    start = time.process_time()
    searcher = Searcher(**model, join_every_steps=join_every_steps)
    choices = [searcher.search(compute=compute, budget_bytes=budget) for compute, budget in cases]
    cpu_s = time.process_time() - start
    assert choices[0].offloaded == () and all(choice.offloaded for choice in choices[1:])
    assert all(choice.gpu_bytes <= budget for choice, (_, budget) in zip(choices, cases))
    assert cpu_s < 15.0, f"{num_searches} searches over 300 layers took {cpu_s:.1f} s of CPU"


# ---- the search against cases computed by hand -----------------------------------------------------------------------


def _compute(num_layers, layer_ms=1.0, head_ms=0.0):
    return ComputeTimes(layer_ms=(layer_ms,) * num_layers, head_ms=head_ms, source="test")


def _layers(num_layers, nbytes):
    return LayerBytes(total=(nbytes,) * num_layers, selected=(nbytes,) * num_layers)


def test_search_everything_fits_offloads_nothing():
    layers = _layers(6, 1000)
    # 6500 bytes of weights in an arena rounded to 512 bytes: 6656 (planner.model.placement)
    choice = search(layers=layers, fixed_bytes=500, compute=_compute(6), h2d_bytes_per_s=1e9, copy_overhead_us=0,
                    budget_bytes=6656)
    assert choice.offloaded == () and choice.prefetch_step == 0 and choice.group_size == 0
    assert choice.gpu_bytes == 6656 and choice.host_pinned_bytes == 0 and choice.copy_bytes == 0
    assert choice.simulation.step_ms == 6.0 and choice.simulation.stall_ms == 0


def test_search_infeasible_names_bytes_needed_and_given():
    layers = _layers(6, 1000)
    # least possible: 500 fixed + one 1000-byte slot = 1500, in an arena rounded to 512 bytes: 1536
    with pytest.raises(InfeasibleError, match=r"1536 bytes .* budget is 1535 bytes"):
        search(layers=layers, fixed_bytes=500, compute=_compute(6), h2d_bytes_per_s=1e9, copy_overhead_us=0,
               budget_bytes=1535)
    choice = search(layers=layers, fixed_bytes=500, compute=_compute(6), h2d_bytes_per_s=1e9, copy_overhead_us=0,
                    budget_bytes=1536)
    assert choice.offloaded == (0, 1, 2, 3, 4, 5) and choice.prefetch_step == 1 and choice.gpu_bytes == 1536


@pytest.mark.parametrize("resident", [0, 1, 3, 5, 6])
def test_search_budget_for_k_resident_layers(resident):
    num_layers, nbytes, fixed = 8, 1000, 300
    layers = _layers(num_layers, nbytes)
    budget = fixed + resident * nbytes + nbytes  # k resident layers plus one slot
    budget = -(-budget // 512) * 512  # the arena's allocator rounding (planner.model.placement)
    choice = search(layers=layers, fixed_bytes=fixed, compute=_compute(num_layers), h2d_bytes_per_s=1e6,
                    copy_overhead_us=0, budget_bytes=budget)
    assert choice.gpu_bytes <= budget
    assert choice.gpu_bytes == gpu_bytes_of(fixed, layers, choice.offloaded, choice.prefetch_step)
    assert len(choice.offloaded) - choice.prefetch_step >= num_layers - resident - 1
    assert choice.offloaded == offloaded_by_rule(num_layers, choice.group_size, choice.num_in_group)
    assert 1 <= choice.prefetch_step < len(choice.offloaded)


def test_search_pinned_knobs_that_cannot_work_are_infeasible():
    layers = _layers(4, 1000)
    with pytest.raises(InfeasibleError, match="pinned"):
        # G=4, K=2 offloads 2 layers; depth 2 would keep both in slots: nothing saved, never a candidate
        search(layers=layers, fixed_bytes=0, compute=_compute(4), h2d_bytes_per_s=1e9, copy_overhead_us=0,
               budget_bytes=10_000, space=SearchSpace(group_size=4, num_in_group=2, prefetch_step=2))


def test_search_pinned_knobs_are_used_even_when_everything_fits():
    layers = _layers(8, 1000)
    choice = search(layers=layers, fixed_bytes=0, compute=_compute(8), h2d_bytes_per_s=1e9, copy_overhead_us=0,
                    budget_bytes=10**9, space=SearchSpace(group_size=4, num_in_group=2, prefetch_step=1))
    assert (choice.group_size, choice.num_in_group, choice.prefetch_step) == (4, 2, 1)
    assert choice.offloaded == (2, 3, 6, 7)


@pytest.mark.parametrize("graphed", [False, True])
def test_search_finds_the_brute_force_optimum(graphed):
    """The bound-ordered search with early exit returns the fastest of all feasible (G, K, P)."""
    rng = random.Random(99)
    for _ in range(25):
        num_layers = rng.randint(3, 9)
        sizes = tuple(rng.choice([800, 1000, 1200]) for _ in range(num_layers))
        layers = LayerBytes(total=sizes, selected=sizes)
        compute = ComputeTimes(layer_ms=tuple(rng.choice([0.2, 0.5, 1.0, 2.0]) for _ in range(num_layers)),
                               head_ms=0.1, source="test")
        fixed = 100
        budget = fixed + sum(sizes) - rng.randint(1, sum(sizes) - max(sizes) - 1)
        h2d, overhead = 1e6, 5.0
        choice = search(layers=layers, fixed_bytes=fixed, compute=compute, h2d_bytes_per_s=h2d,
                        copy_overhead_us=overhead, budget_bytes=budget,
                        join_every_steps=STEPS_PER_GRAPH if graphed else 0)
        assert choice.gpu_bytes <= budget
        best = None
        for g in range(1, num_layers + 1):
            for k in range(1, g + 1):
                offloaded = offloaded_by_rule(num_layers, g, k)
                for p in range(1, len(offloaded)):
                    if gpu_bytes_of(fixed, layers, offloaded, p) > budget:
                        continue
                    for count in range(p + 1 if graphed else 1):
                        s = simulate(layer_ms=compute.layer_ms, head_ms=compute.head_ms, offloaded=offloaded,
                                     copy_ms=tuple(copy_ms_of(sizes[i], h2d, overhead) for i in offloaded),
                                     prefetch_step=p, join_every_steps=STEPS_PER_GRAPH if graphed else 0,
                                     replay_start_copies=count)
                        best = s.step_ms if best is None else min(best, s.step_ms)
        assert best is not None
        assert round(choice.simulation.step_ms, 4) == round(best, 4)
