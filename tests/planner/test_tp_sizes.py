"""planner.make.tp_sizes: --tp's GPU counts, each count's plan path and the refusals before sharding (end to end
through make: tests/planner/test_tensor_parallel_plans.py)."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from planner.errors import ProfileError, UsageError
from planner.make.tp_sizes import check_tp_inputs, parse_tp_sizes, plan_path_for
from planner.source.profile import load_profile


def test_tp_is_one_count_or_distinct_counts_in_the_order_given():
    assert parse_tp_sizes(2) == [2]
    assert parse_tp_sizes("4,2,8") == [4, 2, 8]


@pytest.mark.parametrize("text, words", [("2,2", "given twice"), ("0", "from 1 to"), ("two", "not a GPU count"),
                                         ("2,", "not a GPU count"), ("1025", "from 1 to")])
def test_a_bad_tp_is_one_line(text, words):
    with pytest.raises(UsageError, match=words) as refused:
        parse_tp_sizes(text)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("output, expected", [("plan.yaml", "plan.tp2.yaml"), ("out/ds.yml", "out/ds.tp2.yml"),
                                              ("plan", "plan.tp2.yaml"), ("plan.v1", "plan.v1.tp2.yaml")])
def test_each_gpu_count_has_its_own_plan_beside_the_output(output, expected):
    assert plan_path_for(output, 2) == Path(expected)


def test_a_rank_plan_needs_the_profiles_link_and_no_adapters():
    h100, l40s = load_profile("h100-sxm"), load_profile("l40s")
    check_tp_inputs(SimpleNamespace(tp=1, adapters=("a=x",)), l40s)  # one GPU: no link, adapters planned
    check_tp_inputs(SimpleNamespace(tp=2, adapters=()), h100)
    with pytest.raises(ProfileError, match="gpu_link_bytes_per_s"):
        check_tp_inputs(SimpleNamespace(tp=2, adapters=()), l40s)
    with pytest.raises(UsageError, match="--adapter with --tp 2"):
        check_tp_inputs(SimpleNamespace(tp=2, adapters=("a=x",)), h100)
