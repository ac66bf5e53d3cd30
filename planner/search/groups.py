"""Search group size, offloaded layers per group and prefetch depth for the fastest plan within a budget.

Candidates are vLLM/SGLang-expressible offload sets (layer i offloaded when i % G >= G - K), restricted to
layers that hold selected params (planner.search.offload_sets). Each set is bounded from below by
max(all-resident step, copies it must make / link bandwidth); sets are simulated in order of that bound, and the
search stops once no remaining set can beat the best plan found.

A serving plan searches once per candidate concurrency, so Searcher holds what the searches share (the
O(num_layers^2) candidate sets, their bytes and copy times) and search() is a Searcher used once. The walk
makes the same comparisons, on the same floats, as it always has (tests/search_reference.py keeps the old
code and tests/planner/test_search.py compares the two); what changed is their cost: simulate.fast_step_ms gives
simulate()'s step time bit for bit without building a trace, sums run over tuple slices in C, and runs of
depths or whole sets that the walk would skip one by one are skipped at once.
"""

import bisect
import math
import operator
from dataclasses import dataclass

from planner.model.cost import ComputeTimes
from planner.errors import InfeasibleError
from planner.model.placement import allocation_slack_bytes
from planner.search.offload_sets import OffloadSet, candidate_sets
from planner.search.schedule import PrefetchSchedule
from planner.search import simulate as simulate_module
from planner.search.simulate import Simulation, fastest_boundary_step_ms, simulate_fastest_boundary
from planner.units import format_bytes

# Step times closer than this are equal for choosing between plans (0.1 us).
STEP_MS_DECIMALS = 4


@dataclass(frozen=True, kw_only=True)
class LayerBytes:
    """Bytes of each planned layer: all of it, and the part selected for offload."""

    total: tuple[int, ...]
    selected: tuple[int, ...]
    #: tensors the runtime places on the GPU (for the arena's alignment pads)
    num_tensors: int = 0


@dataclass(frozen=True, kw_only=True)
class Choice:
    """One evaluated plan."""

    group_size: int
    num_in_group: int
    prefetch_step: int
    offloaded: tuple[int, ...]
    #: under CUDA graphs: wrapped copies each replay issues as it begins (planner.search.schedule.replay_boundary)
    replay_start_copies: int
    simulation: Simulation
    gpu_bytes: int
    host_pinned_bytes: int
    #: bytes copied over the link per step
    copy_bytes: int

    def key(self) -> tuple:
        """The order plans are chosen in (choice_key)."""
        return choice_key(self.simulation.step_ms, self.copy_bytes, self.gpu_bytes, self.prefetch_step,
                          self.group_size, self.num_in_group)


def choice_key(step_ms: float, copy_bytes: int, gpu_bytes: int, prefetch_step: int, group_size: int,
               num_in_group: int) -> tuple:
    """Fastest first; then fewest bytes over the link, least GPU memory, fewest slots, largest groups."""
    return (round(step_ms, STEP_MS_DECIMALS), copy_bytes, gpu_bytes, prefetch_step, -group_size, num_in_group)


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """The user may pin any of the three knobs (e.g. to evaluate flags they already run with)."""

    group_size: int | None = None
    num_in_group: int | None = None
    prefetch_step: int | None = None
    #: only depths P that divide the number of offloaded layers (make --for an engine version that asserts it:
    #: planner.engines.versions PrefetchWiring.must_divide)
    prefetch_divides: bool = False

    def unpinned(self) -> bool:
        """No knob pinned: the all-resident plan is a candidate."""
        return self.group_size is None and self.num_in_group is None and self.prefetch_step is None


def copy_ms_of(num_bytes: int, h2d_bytes_per_s: float, copy_overhead_us: float) -> float:
    """Time of one host-to-device copy of ``num_bytes``."""
    return copy_overhead_us / 1e3 + 1e3 * num_bytes / h2d_bytes_per_s


def weight_gpu_bytes(fixed_bytes: int, layers: LayerBytes, offloaded: tuple[int, ...], num_slots: int) -> int:
    """Resident weights + slots: everything but the offloaded selected params, plus num_slots of the largest.

    ``fixed_bytes`` is what stays on the GPU whatever the plan: the weights outside the stack.
    """
    offloaded_selected = [layers.selected[i] for i in offloaded]
    slot_bytes = max(offloaded_selected, default=0)
    return fixed_bytes + sum(layers.total) - sum(offloaded_selected) + num_slots * slot_bytes


def gpu_bytes_of(fixed_bytes: int, layers: LayerBytes, offloaded: tuple[int, ...], num_slots: int) -> int:
    """What the runtime allocates for weights: their bytes plus the arena's slack (planner.model.placement)."""
    weights = weight_gpu_bytes(fixed_bytes, layers, offloaded, num_slots)
    return weights + allocation_slack_bytes(weights, layers.num_tensors)


def minimum_gpu_bytes(fixed_bytes: int, layers: LayerBytes) -> int:
    """GPU bytes with every eligible layer offloaded through one slot: the least any plan needs."""
    eligible = tuple(i for i, b in enumerate(layers.selected) if b > 0)
    return gpu_bytes_of(fixed_bytes, layers, eligible, 1 if eligible else 0)


def search(
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
    finish inside each one (0: eager steps). To search many budgets or compute times over the same layers,
    build a Searcher once and call its search().
    """
    searcher = Searcher(layers=layers, fixed_bytes=fixed_bytes, h2d_bytes_per_s=h2d_bytes_per_s,
                        copy_overhead_us=copy_overhead_us, space=space, join_every_steps=join_every_steps)
    return searcher.search(compute=compute, budget_bytes=budget_bytes)


class Searcher:
    """The search over one model's layers, for many budgets and compute times.

    A serving plan searches once per candidate concurrency: the same layers and search space, each time with
    that concurrency's compute times and the GPU memory its KV cache leaves as the budget. What depends on
    neither (the candidate offload sets, their bytes and copy times) is computed here, once.
    """

    def __init__(self, *, layers: LayerBytes, fixed_bytes: int, h2d_bytes_per_s: float, copy_overhead_us: float,
                 space: SearchSpace = SearchSpace(), join_every_steps: int = 0):
        self.layers = layers
        self.fixed_bytes = fixed_bytes
        self.space = space
        self.join_every_steps = join_every_steps
        self.copy_ms = tuple(copy_ms_of(b, h2d_bytes_per_s, copy_overhead_us) for b in layers.selected)
        self.sets = candidate_sets(layers.total, layers.selected, self.copy_ms, fixed_bytes,
                                   group_size=space.group_size, num_in_group=space.num_in_group)
        sizes = set(layers.selected) - {0}
        #: the selected bytes of every layer that has some, when they are all equal (most models, 0 otherwise):
        #: then the bytes a step copies are a product
        self.uniform_bytes = sizes.pop() if len(sizes) == 1 else 0
        self._resident_bytes = gpu_bytes_of(fixed_bytes, layers, (), 0)
        self._least_bytes = minimum_gpu_bytes(fixed_bytes, layers)
        self._least_plan_bytes = self._least_plan()

    def minimum_gpu_bytes(self) -> int:
        """The least budget search() finds a plan within (InfeasibleError when no budget has one)."""
        if self._least_plan_bytes is None:
            raise InfeasibleError(self._pinned_message("any budget"))
        return self._least_plan_bytes

    def fits(self, budget_bytes: int) -> bool:
        """Whether search() finds a plan within ``budget_bytes`` rather than raising InfeasibleError."""
        return self._least_plan_bytes is not None and self._least_plan_bytes <= budget_bytes

    def search(self, *, compute: ComputeTimes, budget_bytes: int) -> Choice:
        """The fastest plan within ``budget_bytes`` for these compute times, as the module's search()."""
        if self.space.unpinned() and self._resident_bytes <= budget_bytes:
            return _evaluate(self.layers, self.fixed_bytes, compute, self.copy_ms, (), 0, 0, 0, self.join_every_steps)
        if self._least_bytes > budget_bytes:
            needed = self._least_bytes
            raise InfeasibleError(
                f"no plan fits: even with every layer offloaded through one slot the weights need "
                f"{needed} bytes ({format_bytes(needed)}) of GPU memory, but the budget is {budget_bytes} bytes "
                f"({format_bytes(budget_bytes)}); raise --budget or --trigger, offload more params, or use a larger GPU"
            )
        run = _Run(self, compute, budget_bytes)
        best = run.best()
        if best is None:
            raise InfeasibleError(self._pinned_message(f"the budget of {format_bytes(budget_bytes)}"))
        offloaded_set, depth = best
        choice = _evaluate(self.layers, self.fixed_bytes, compute, self.copy_ms, offloaded_set.offloaded,
                           offloaded_set.group_size, offloaded_set.num_in_group, depth, self.join_every_steps)
        assert choice.key() == run.best_key, "fast_step_ms must give simulate()'s step time bit for bit"
        return choice

    def gpu_bytes(self, weight_bytes: int) -> int:
        """GPU bytes of an arena holding ``weight_bytes`` of this model's weights (planner.model.placement)."""
        return weight_bytes + allocation_slack_bytes(weight_bytes, self.layers.num_tensors)

    def weight_limit(self, budget_bytes: int) -> int:
        """The most weight bytes whose arena fits ``budget_bytes`` (-1: none). The arena only grows with its
        weights, so the plans within the budget are exactly those with at most this many weight bytes."""
        return bisect.bisect_right(range(max(budget_bytes, 0) + 1), budget_bytes, key=self.gpu_bytes) - 1

    def _first_depth(self, offloaded_set: "OffloadSet") -> int | None:
        """The shallowest depth tried for a set: 1, or the pinned one; None when the set is too small for it."""
        depth = 1 if self.space.prefetch_step is None else self.space.prefetch_step
        return depth if depth <= offloaded_set.num_offloaded - 1 else None

    def _least_plan(self) -> int | None:
        """GPU bytes of the smallest plan there is: the resident one or a set at its first depth."""
        weights = [s.base_weight_bytes + depth * s.slot_bytes
                   for s in self.sets if (depth := self._first_depth(s)) is not None]
        least = [self.gpu_bytes(min(weights))] if weights else []
        if self.space.unpinned():
            least.append(self._resident_bytes)
        return min(least, default=None)

    def _pinned_message(self, within: str) -> str:
        return (f"no plan with the pinned knobs ({_describe(self.space)}) works: it must offload at least 2 layers, "
                f"with prefetch_step below the number offloaded, within {within}; unpin them or raise --budget")


def _describe(space: SearchSpace) -> str:
    pinned = {k: v for k, v in vars(space).items() if v is not None and k != "prefetch_divides"}
    return ", ".join(f"{k}={v}" for k, v in pinned.items()) or "none"


class _Run:
    """One search. Each candidate set is bounded from below by max(all-resident step, what it must copy per
    step); sets are tried in order of that bound and the walk stops once no remaining set can beat the best.
    Within a set, depths are tried in order, each skipped when its key floor cannot beat the best, and the
    set is left once a simulated depth reaches its floor."""

    def __init__(self, searcher: Searcher, compute: ComputeTimes, budget_bytes: int):
        self.searcher = searcher
        self.compute = compute
        self.resident_ms = compute.head_ms + sum(compute.layer_ms)
        self.resident_rounded = round(self.resident_ms, STEP_MS_DECIMALS)
        self.weight_limit = searcher.weight_limit(budget_bytes)
        self.best_key: tuple | None = None

    def best(self) -> tuple[OffloadSet, int] | None:
        """(set, depth) of the fastest plan, or None when no candidate fits."""
        best, last_bound, last_rounded = None, None, None
        for bound, offloaded_set, first, deepest in self._ranked():
            if best is not None:
                if bound != last_bound:  # bounds tie in runs: round each value once
                    last_bound, last_rounded = bound, round(bound, STEP_MS_DECIMALS)
                if last_rounded > self.best_key[0]:
                    break
                if self._loses_on_bytes(offloaded_set, first, deepest):
                    continue
            depth = self._walk(offloaded_set, first, deepest)
            if depth is not None:
                best = (offloaded_set, depth)
        return best

    def _loses_on_bytes(self, offloaded_set: OffloadSet, first: int, deepest: int) -> bool:
        """Whether the walk would skip every depth of the set, found without visiting them: when the best runs
        at the all-resident step, no key floor has a smaller step, so a depth wins only on the fields after it.

        Copy bytes stay while 2 x depth <= num_offloaded, then fall with each depth; GPU bytes and depth rise.
        So of all depths, the smallest (copy bytes, GPU bytes, depth) is at the first depth in the first case
        and at the deepest in the second.
        """
        if self.best_key[0] != self.resident_rounded:
            return False
        depth = first if 2 * deepest <= len(offloaded_set.offloaded) else deepest
        copy_bytes = self._copy_bytes(offloaded_set, depth)
        if copy_bytes != self.best_key[1]:
            return copy_bytes > self.best_key[1]
        least = (copy_bytes, self._gpu_bytes(offloaded_set, depth), depth, -offloaded_set.group_size,
                 offloaded_set.num_in_group)
        return least >= self.best_key[1:]

    def _ranked(self) -> list[tuple[float, OffloadSet, int, int]]:
        """(bound, set, first depth, deepest depth) of each set that fits, by bound: min(link bound at the first
        and at the deepest depth that fit). The sort is stable, so ties keep the sets' own order."""
        ranked = []
        limit, pinned, resident_ms = self.weight_limit, self.searcher.space.prefetch_step, self.resident_ms
        for offloaded_set in self.searcher.sets:
            base, slot = offloaded_set.base_weight_bytes, offloaded_set.slot_bytes
            top = len(offloaded_set.offloaded) - 1
            if pinned is None:
                first, deepest = 1, min((limit - base) // slot, top)  # GPU bytes grow with depth: a prefix fits
                if deepest < 1:
                    continue
                copied_ms = offloaded_set.all_copy_ms  # depth 1 copies every position (num_offloaded >= 2)
                bound = copied_ms if copied_ms > resident_ms else resident_ms  # max(resident_ms, copied_ms)
            else:
                first = deepest = pinned
                if pinned > top or base + pinned * slot > limit:
                    continue
                bound = self._link_bound(offloaded_set, first)
            if deepest != first and bound > resident_ms:  # a bound at resident_ms is the least: no need to look
                copy_ms = offloaded_set.copy_ms
                if 2 * deepest > top + 1:  # else the same sum as at the first depth
                    copied_ms = sum(copy_ms[:top + 1 - deepest] + copy_ms[deepest:])  # _copied_ms, inlined
                    deep_bound = copied_ms if copied_ms > resident_ms else resident_ms
                    bound = deep_bound if deep_bound < bound else bound  # as min() does: the first of equals
            ranked.append((bound, offloaded_set, first, deepest))
        ranked.sort(key=operator.itemgetter(0))
        return ranked

    def _walk(self, offloaded_set: OffloadSet, first: int, deepest: int) -> int | None:
        """Try the set's depths from ``first`` to ``deepest``; the depth that became the best plan, if any."""
        won, runs, depth = None, None, first
        divides = self.searcher.space.prefetch_divides
        while depth <= deepest:
            if divides and len(offloaded_set.offloaded) % depth:
                depth += 1
                continue  # the engine cannot run this depth (every bound above holds for the depths left)
            if self.best_key is not None and self._key_floor(offloaded_set, depth) >= self.best_key:
                depth = self._next_depth(offloaded_set, depth, deepest)
                continue  # cannot beat the best even at its link bound: skip the simulation
            if depth == 1 and self.best_key is not None and self._one_slot_loses(offloaded_set):
                depth += 1
                continue  # the simulation would neither win nor reach the floor: what the walk does next
            if runs is None:
                runs = self._runs(offloaded_set)
            _, step_ms = fastest_boundary_step_ms(**runs, prefetch_step=depth,
                                                  join_every_steps=self.searcher.join_every_steps)
            key = choice_key(step_ms, self._copy_bytes(offloaded_set, depth), self._gpu_bytes(offloaded_set, depth),
                             depth, offloaded_set.group_size, offloaded_set.num_in_group)
            if self.best_key is None or key < self.best_key:
                self.best_key, won = key, depth
            if step_ms <= self._link_bound(offloaded_set, depth) + 1e-9:
                break  # at the floor: more depth only costs memory
            depth += 1
        return won

    def _one_slot_loses(self, offloaded_set: OffloadSet) -> bool:
        """Whether simulating the set through one slot would show a step that loses to the best and stays above
        the link bound (so the walk would go on to depth 2), from a bound instead of the simulation.

        Through one slot everything is in series: each copy waits for the previous offloaded layer to finish
        and each offloaded layer for its copy, so from the start of a measured step to the end of the last
        offloaded layer NUM_MEASURED_STEPS steps later, the chain holds every copy and every offloaded layer's
        compute of those steps but the first copy: step >= sum(copy + compute) - first copy / NUM_MEASURED_STEPS,
        eager or graphed (joins and deferred copies only delay). The simulation's floats stray from the exact
        times by far less than a billionth, the margin taken here.
        """
        layer_ms = self.compute.layer_ms
        chain_ms = math.fsum(offloaded_set.copy_ms) + math.fsum(layer_ms[i] for i in offloaded_set.offloaded)
        bound_ms = (chain_ms - offloaded_set.copy_ms[0] / simulate_module.NUM_MEASURED_STEPS) * (1 - 1e-9)
        if bound_ms <= self._link_bound(offloaded_set, 1) + 1e-9:
            return False
        floor = choice_key(bound_ms, self._copy_bytes(offloaded_set, 1), self._gpu_bytes(offloaded_set, 1), 1,
                           offloaded_set.group_size, offloaded_set.num_in_group)
        return floor >= self.best_key

    def _next_depth(self, offloaded_set: OffloadSet, depth: int, deepest: int) -> int:
        """After a skipped depth, the next depth whose key floor may be below the (unchanged) best key.

        While 2 x depth <= num_offloaded every position is copied: the floor's step and copy bytes stay and its
        GPU bytes and depth grow, so it only rises. And once the best runs at the all-resident step, a depth
        beats it only by copying no more bytes than it; a step's copies shrink as depth grows, so the depths
        that may are the deepest ones, found by bisection.
        """
        count = len(offloaded_set.offloaded)
        depth = max(depth + 1, count // 2 + 1) if 2 * depth <= count else depth + 1
        if depth > deepest or self.best_key[0] != self.resident_rounded:
            return depth
        most_bytes = self.best_key[1]
        if self._copy_bytes(offloaded_set, deepest) > most_bytes:
            return deepest + 1
        low, high = depth, deepest
        while low < high:
            middle = (low + high) // 2
            if self._copy_bytes(offloaded_set, middle) > most_bytes:
                low = middle + 1
            else:
                high = middle
        return low

    def _runs(self, offloaded_set: OffloadSet) -> dict:
        """fastest_boundary_step_ms's arguments for this set and these compute times."""
        return dict(layer_ms=self.compute.layer_ms, head_ms=self.compute.head_ms,
                    offloaded=offloaded_set.offloaded, copy_ms=offloaded_set.copy_ms)

    def _copied_ms(self, offloaded_set: OffloadSet, depth: int) -> float:
        """Copy time per step: the sum over copied_positions(), in their order, so the same float."""
        copy_ms = offloaded_set.copy_ms
        count = len(copy_ms)
        if 2 * depth <= count:
            return offloaded_set.all_copy_ms
        return sum(copy_ms[:count - depth] + copy_ms[depth:])

    def _link_bound(self, offloaded_set: OffloadSet, depth: int) -> float:
        return max(self.resident_ms, self._copied_ms(offloaded_set, depth))

    def _copy_bytes(self, offloaded_set: OffloadSet, depth: int) -> int:
        """Bytes copied per step: all offloaded bytes but those of the positions alone in their slot."""
        offloaded = offloaded_set.offloaded
        count = len(offloaded)
        if 2 * depth <= count:
            return offloaded_set.host_bytes
        if self.searcher.uniform_bytes:
            return 2 * (count - depth) * self.searcher.uniform_bytes
        selected = self.searcher.layers.selected.__getitem__
        if 4 * depth > 3 * count:  # fewer positions copied than alone: add the copied ones (exact either way)
            return sum(map(selected, offloaded[:count - depth])) + sum(map(selected, offloaded[depth:]))
        return offloaded_set.host_bytes - sum(map(selected, offloaded[count - depth:depth]))

    def _gpu_bytes(self, offloaded_set: OffloadSet, depth: int) -> int:
        return self.searcher.gpu_bytes(offloaded_set.base_weight_bytes + depth * offloaded_set.slot_bytes)

    def _key_floor(self, offloaded_set: OffloadSet, depth: int) -> tuple:
        """A lower bound on the plan's key without simulating: every field but the step time is exact.

        When many sets reach the resident bound (nearly everything fits) the step times tie and the later key
        fields decide; this lets the search skip the simulation of every set that loses on them.
        """
        return choice_key(self._link_bound(offloaded_set, depth), self._copy_bytes(offloaded_set, depth),
                          self._gpu_bytes(offloaded_set, depth), depth, offloaded_set.group_size,
                          offloaded_set.num_in_group)


def _copy_bytes(layers: LayerBytes, offloaded: tuple[int, ...], depth: int) -> int:
    """Bytes copied over the link per step (layers alone in their slot are copied once, at load)."""
    positions = PrefetchSchedule(len(offloaded), depth).copied_positions()
    return sum(layers.selected[offloaded[k]] for k in positions)


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
