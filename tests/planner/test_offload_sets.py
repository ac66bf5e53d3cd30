"""planner.search.offload_sets: every (G, K) set once, cut to the layers with selected bytes, with its figures (the
search over them: tests/planner/test_search.py)."""

import math

from planner.search.offload_sets import candidate_sets
from planner.search.schedule import offloaded_by_rule


def _rule_sets(selected: tuple[int, ...], group_size=None, num_in_group=None) -> set[tuple[int, ...]]:
    """The sets the rule gives, layer by layer: the candidates are exactly these."""
    num_layers, found = len(selected), set()
    for size in range(1, num_layers + 1):
        for count in range(1, size + 1):
            if group_size in (None, size) and num_in_group in (None, count):
                chosen = tuple(i for i in offloaded_by_rule(num_layers, size, count) if selected[i] > 0)
                if len(chosen) >= 2:
                    found.add(chosen)
    return found


def test_the_sets_are_the_rules_cut_to_layers_with_selected_bytes_each_once():
    selected = (0, 5, 5, 7, 0, 5, 5, 5, 9, 5)
    total = tuple(b + 3 for b in selected)
    copy_ms = tuple(b / 10 for b in selected)
    sets = candidate_sets(total, selected, copy_ms, 100)
    assert {s.offloaded for s in sets} == _rule_sets(selected)
    assert len({s.offloaded for s in sets}) == len(sets)
    for s in sets:
        assert s.offloaded == tuple(i for i in offloaded_by_rule(10, s.group_size, s.num_in_group) if selected[i])
        assert s.host_bytes == sum(selected[i] for i in s.offloaded)
        assert s.slot_bytes == max(selected[i] for i in s.offloaded)
        assert s.base_weight_bytes == 100 + sum(total) - s.host_bytes
        assert s.copy_ms == tuple(copy_ms[i] for i in s.offloaded) and math.isclose(s.all_copy_ms, sum(s.copy_ms))
    keys = [(s.host_bytes, -s.group_size, s.num_in_group) for s in sets]
    assert keys == sorted(keys)


def test_a_set_two_knobs_express_keeps_the_largest_group():
    selected = (4,) * 8
    sets = {s.offloaded: (s.group_size, s.num_in_group) for s in candidate_sets(selected, selected, (1.0,) * 8, 0)}
    assert sets[tuple(range(8))] == (8, 8)  # also G=4 K=4, G=2 K=2, G=1 K=1
    assert sets[(1, 3, 5, 7)] == (2, 1)


def test_pinned_knobs_keep_only_their_sets():
    selected = (4,) * 12
    pinned = candidate_sets(selected, selected, (1.0,) * 12, 0, group_size=4)
    assert {s.group_size for s in pinned} == {4}
    assert {s.offloaded for s in pinned} == _rule_sets(selected, group_size=4)
    assert [s.num_in_group for s in candidate_sets(selected, selected, (1.0,) * 12, 0, group_size=6,
                                                    num_in_group=2)] == [2]
