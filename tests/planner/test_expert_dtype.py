"""experts.expert_dtype: make records the dtype holding most of the experts' bytes, readers decide by it whether a
routed decode step copies its pairs' weights (where the checkpoint's dominant dtype may be another), plans made
before it read as before, and a hand edit naming no dtype of the checkpoint is one line."""

import dataclasses

import yaml

from planner.plan.file import read_plan
from planner.plan.schema import copies_pairs
from tests.conftest import assert_one_line_error, invoke
from tests.planner.test_cpu_plan import _edited, make, measured_moe, moe  # noqa: F401 - fixtures


def test_make_records_the_experts_dtype_and_readers_decide_by_it(moe):  # noqa: F811 - the fixture imported above
    make("fast.yaml", "plan.yaml")
    plan = read_plan("plan.yaml")
    assert plan.experts.expert_dtype == "BF16" and not copies_pairs(plan)  # grouped_mm reads bf16 in place
    # experts in another dtype than the checkpoint's dominant one: the experts' decides
    fp32_experts = dataclasses.replace(plan, experts=dataclasses.replace(plan.experts, expert_dtype="F32"))
    assert copies_pairs(fp32_experts)
    for reader in (["show", "plan.yaml"], ["check", "plan.yaml"], ["diff", "plan.yaml", "plan.yaml"]):
        assert invoke(reader).exit_code == 0


def test_a_plan_made_before_the_key_reads_by_the_checkpoints_dtype(moe):  # noqa: F811
    make("fast.yaml", "plan.yaml")
    older = _edited("plan.yaml", lambda data: data["experts"].pop("expert_dtype"))
    plan = read_plan(older)
    assert plan.experts.expert_dtype is None and not copies_pairs(plan)
    assert invoke(["show", older]).exit_code == 0
    assert "expert_dtype" not in yaml.safe_load(open(older))["experts"]


def test_a_hand_edited_experts_dtype_is_one_line(moe):  # noqa: F811
    make("fast.yaml", "plan.yaml")
    for value, words in (("F8_E4M3", "none of the checkpoint's dtypes"), (5, "expert_dtype must be str"),
                         ("", "is not a dtype name")):
        edited = _edited("plan.yaml", lambda data, value=value: data["experts"].update(expert_dtype=value))
        result = invoke(["show", edited])
        assert_one_line_error(result.exit_code, result.stderr, contains=(words,))
