"""The search as it was before planner.search.groups.Searcher (commit 2be4948), kept verbatim (with the
simulate_fastest_boundary of then) as the reference the fast search must agree with, choice for choice: it
enumerates every (G, K) set with offloaded_by_rule, bounds each with per-position generator sums, and
simulates every candidate and every split of its wrapped copies with simulate(). Slow (its cost grows as the
fourth power of the layer count when nearly everything fits); only for tests.
"""

import bisect

from planner.model.cost import ComputeTimes
from planner.errors import InfeasibleError
from planner.search.schedule import PrefetchSchedule, offloaded_by_rule
from planner.search.groups import (STEP_MS_DECIMALS, Choice, LayerBytes, SearchSpace, choice_key, copy_ms_of,
                                   gpu_bytes_of, minimum_gpu_bytes)
from planner.search.simulate import simulate
from planner.units import format_bytes


def _candidate_sets(layers: LayerBytes, space: SearchSpace) -> dict[tuple[int, ...], tuple[int, int]]:
    """Distinct offload sets -> the (group_size, num_in_group) that expresses them (largest group first)."""
    num_layers = len(layers.total)
    sets: dict[tuple[int, ...], tuple[int, int]] = {}
    for group_size in range(num_layers, 0, -1):
        if space.group_size not in (None, group_size):
            continue
        for num_in_group in range(1, group_size + 1):
            if space.num_in_group not in (None, num_in_group):
                continue
            chosen = offloaded_by_rule(num_layers, group_size, num_in_group)
            chosen = tuple(i for i in chosen if layers.selected[i] > 0)
            if len(chosen) >= 2 and chosen not in sets:
                sets[chosen] = (group_size, num_in_group)
    return sets


def reference_search(
    *,
    layers: LayerBytes,
    fixed_bytes: int,
    compute: ComputeTimes,
    h2d_bytes_per_s: float,
    copy_overhead_us: float,
    budget_bytes: int,
    space: SearchSpace = SearchSpace(),
    join_every_steps: int = 0,
) -> Choice:
    """The fastest plan within ``budget_bytes`` (offloading nothing when everything fits).

    ``join_every_steps``: steps are CUDA-graph replays of this many steps, so copies into the next replay
    finish inside each one (0: eager steps).
    """
    resident_ms = compute.head_ms + sum(compute.layer_ms)
    copy_ms = tuple(copy_ms_of(b, h2d_bytes_per_s, copy_overhead_us) for b in layers.selected)
    resident = _evaluate(layers, fixed_bytes, compute, copy_ms, (), 0, 0, 0, join_every_steps)
    if resident.gpu_bytes <= budget_bytes and space == SearchSpace():
        return resident
    needed = minimum_gpu_bytes(fixed_bytes, layers)
    if needed > budget_bytes:
        raise InfeasibleError(
            f"no plan fits: even with every layer offloaded through one slot the weights need "
            f"{needed} bytes ({format_bytes(needed)}) of GPU memory, but the budget is {budget_bytes} bytes "
            f"({format_bytes(budget_bytes)}); raise --budget or --trigger, offload more params, or use a larger GPU"
        )
    best = None
    for offloaded, bound, (group_size, num_in_group) in _ordered(layers, fixed_bytes, copy_ms, resident_ms,
                                                                 budget_bytes, space):
        if best is not None and round(bound, STEP_MS_DECIMALS) > round(best.simulation.step_ms, STEP_MS_DECIMALS):
            break
        for depth in _depths(layers, fixed_bytes, offloaded, budget_bytes, space):
            if best is not None and _key_floor(layers, fixed_bytes, copy_ms, resident_ms, offloaded,
                                               group_size, num_in_group, depth) >= best.key():
                continue  # cannot beat the best even at its link bound: skip the simulation
            choice = _evaluate(layers, fixed_bytes, compute, copy_ms, offloaded, group_size, num_in_group, depth,
                               join_every_steps)
            if best is None or choice.key() < best.key():
                best = choice
            if choice.simulation.step_ms <= _link_bound(copy_ms, offloaded, depth, resident_ms) + 1e-9:
                break  # at the floor: more depth only costs memory
    if best is None:
        raise InfeasibleError(
            f"no plan with the pinned knobs ({_describe(space)}) works: it must offload at least 2 layers, with "
            f"prefetch_step below the number offloaded, within the budget of {format_bytes(budget_bytes)}; "
            "unpin them or raise --budget"
        )
    return best


def _describe(space: SearchSpace) -> str:
    pinned = {k: v for k, v in vars(space).items() if v is not None and k != "prefetch_divides"}
    return ", ".join(f"{k}={v}" for k, v in pinned.items()) or "none"


def _depths(layers, fixed_bytes, offloaded, budget_bytes, space):
    """Depths from 1 up to the most the budget allows, fewer than the number offloaded (else nothing saved)."""
    top = len(offloaded) - 1
    if space.prefetch_step is not None:
        depth = space.prefetch_step
        return [depth] if depth <= top and gpu_bytes_of(fixed_bytes, layers, offloaded, depth) <= budget_bytes else []
    # GPU bytes grow with depth (one slot per step of lookahead), so the feasible depths are a prefix.
    fits = bisect.bisect_right(range(1, top + 1), budget_bytes,
                               key=lambda d: gpu_bytes_of(fixed_bytes, layers, offloaded, d))
    return range(1, fits + 1)


def _link_bound(copy_ms, offloaded, depth, resident_ms) -> float:
    positions = PrefetchSchedule(len(offloaded), depth).copied_positions()
    return max(resident_ms, sum(copy_ms[offloaded[k]] for k in positions))


def _copy_bytes(layers: LayerBytes, offloaded: tuple[int, ...], depth: int) -> int:
    """Bytes copied over the link per step (layers alone in their slot are copied once, at load)."""
    positions = PrefetchSchedule(len(offloaded), depth).copied_positions()
    return sum(layers.selected[offloaded[k]] for k in positions)


def _key_floor(layers, fixed_bytes, copy_ms, resident_ms, offloaded, group_size, num_in_group, depth) -> tuple:
    """A lower bound on Choice.key() without simulating: every field but the step time is exact.

    When many sets reach the resident bound (nearly everything fits) the step times tie and the later key
    fields decide; this lets the search skip the simulation of every set that loses on them.
    """
    num_slots = PrefetchSchedule(len(offloaded), depth).num_slots
    return choice_key(_link_bound(copy_ms, offloaded, depth, resident_ms), _copy_bytes(layers, offloaded, depth),
                      gpu_bytes_of(fixed_bytes, layers, offloaded, num_slots), depth, group_size, num_in_group)


def _ordered(layers, fixed_bytes, copy_ms, resident_ms, budget_bytes, space):
    """Feasible offload sets sorted by their lower bound on step time."""
    ranked = []
    for offloaded, knobs in _candidate_sets(layers, space).items():
        depths = _depths(layers, fixed_bytes, offloaded, budget_bytes, space)
        if not depths:
            continue
        bound = min(_link_bound(copy_ms, offloaded, depth, resident_ms) for depth in (depths[0], depths[-1]))
        ranked.append((bound, sum(layers.selected[i] for i in offloaded), -knobs[0], knobs[1], offloaded, knobs))
    ranked.sort()
    return [(entry[4], entry[0], entry[5]) for entry in ranked]


def _evaluate(layers, fixed_bytes, compute, copy_ms, offloaded, group_size, num_in_group, depth,
              join_every_steps) -> Choice:
    replay_start_copies, simulation = simulate_fastest_boundary(
        layer_ms=compute.layer_ms,
        head_ms=compute.head_ms,
        offloaded=offloaded,
        copy_ms=tuple(copy_ms[i] for i in offloaded),
        prefetch_step=depth,
        join_every_steps=join_every_steps,
    )
    schedule = PrefetchSchedule(len(offloaded), depth)
    return Choice(
        group_size=group_size,
        num_in_group=num_in_group,
        prefetch_step=depth,
        offloaded=offloaded,
        replay_start_copies=replay_start_copies,
        simulation=simulation,
        gpu_bytes=gpu_bytes_of(fixed_bytes, layers, offloaded, schedule.num_slots),
        host_pinned_bytes=sum(layers.selected[i] for i in offloaded),
        copy_bytes=_copy_bytes(layers, offloaded, depth),
    )


def simulate_fastest_boundary(*, prefetch_step: int, offloaded: tuple[int, ...], join_every_steps: int,
                              **times):
    """planner.search.simulate.simulate_fastest_boundary as it was: every split simulated with a trace."""
    wrapped, _ = PrefetchSchedule(len(offloaded), prefetch_step).replay_boundary(0)
    num_wrapped = len(wrapped) if join_every_steps else 0
    runs = [(simulate(prefetch_step=prefetch_step, offloaded=offloaded, join_every_steps=join_every_steps,
                      replay_start_copies=count, **times), count) for count in range(num_wrapped + 1)]
    simulation, count = min(runs, key=lambda run: (round(run[0].step_ms, 6), run[1]))
    return count, simulation
