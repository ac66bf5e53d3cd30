"""The candidate offload sets of the layer-group search (planner.search.groups): the layers vLLM and SGLang can
offload, layer i when i % G >= G - K (planner.search.schedule.offloaded_by_rule), cut down to the layers holding
selected bytes, each set once with the (G, K) that expresses it, and what depends on neither the budget nor the
compute times: its host bytes, one slot's bytes, the GPU bytes before the slots and its copy times.
"""

import itertools
import operator
from typing import NamedTuple


class OffloadSet(NamedTuple):
    """One candidate offload set, with what depends on neither the budget nor the compute times (a tuple:
    there are O(num_layers^2) of them, built once per Searcher)."""

    offloaded: tuple[int, ...]
    group_size: int
    num_in_group: int
    #: selected bytes of the offloaded layers (pinned on the host)
    host_bytes: int
    #: the largest of them: one prefetch slot
    slot_bytes: int
    #: GPU weight bytes before the slots: everything but the offloaded selected bytes
    base_weight_bytes: int
    #: per position, the copy time of its layer (sums over its slices are the search's link bounds)
    copy_ms: tuple[float, ...]
    #: their sum, in order: what a step copies while 2 x depth <= num_offloaded
    all_copy_ms: float

    @property
    def num_offloaded(self) -> int:
        return len(self.offloaded)


def candidate_sets(total_bytes: tuple[int, ...], selected_bytes: tuple[int, ...], copy_ms: tuple[float, ...],
                   fixed_bytes: int, *, group_size: int | None = None,
                   num_in_group: int | None = None) -> tuple[OffloadSet, ...]:
    """Distinct offload sets, each with the (group_size, num_in_group) that expresses it (largest group first),
    sorted by (host bytes, -group_size, num_in_group): how the search breaks ties of its bound (the layers
    themselves never decide: no two sets share a (group_size, num_in_group))."""
    pinned_group_size, pinned_num_in_group = group_size, num_in_group
    num_layers, selected = len(total_bytes), selected_bytes
    eligible = [i for i in range(num_layers) if selected[i] > 0]
    # eligible_below[i]: eligible layers below layer i, so the eligible layers in [a, b) are one slice
    eligible_below = [0] * (num_layers + 1)
    for i in range(num_layers):
        eligible_below[i + 1] = eligible_below[i] + (selected[i] > 0)
    weight_bytes = fixed_bytes + sum(total_bytes)
    found: dict[tuple[int, ...], OffloadSet] = {}
    for group_size in range(num_layers, 0, -1):
        if pinned_group_size not in (None, group_size):
            continue
        for num_in_group in range(1, group_size + 1):
            if pinned_num_in_group not in (None, num_in_group):
                continue
            # offloaded_by_rule's layers a block at a time: [j G + G - K, j G + G) for each group j, each block
            # cut down to its eligible layers by one slice (C-level maps: O(num_layers^2) sets are built)
            starts = range(group_size - num_in_group, num_layers, group_size)
            ends = map(min, map(operator.add, starts, itertools.repeat(num_in_group)), itertools.repeat(num_layers))
            blocks = map(slice, map(eligible_below.__getitem__, starts), map(eligible_below.__getitem__, ends))
            chosen = tuple(itertools.chain.from_iterable(map(eligible.__getitem__, blocks)))
            if len(chosen) < 2 or chosen in found:
                continue
            chosen_bytes = operator.itemgetter(*chosen)(selected)
            chosen_copy_ms = operator.itemgetter(*chosen)(copy_ms)
            host_bytes = sum(chosen_bytes)
            found[chosen] = OffloadSet(
                offloaded=chosen, group_size=group_size, num_in_group=num_in_group, host_bytes=host_bytes,
                slot_bytes=max(chosen_bytes), base_weight_bytes=weight_bytes - host_bytes, copy_ms=chosen_copy_ms,
                all_copy_ms=sum(chosen_copy_ms),
            )
    return tuple(sorted(found.values(), key=lambda s: (s.host_bytes, -s.group_size, s.num_in_group)))
