"""planner.plan.figures: a stored figure that disagrees with the plan's other fields is named in one line; the rules
across fields (planner.plan.rules) run first and skip these with derived=False (check reads so, to diff)."""

from dataclasses import replace

import pytest

from planner.plan.figures import first_disagreeing_figure, is_decode, near
from planner.plan.file import read_plan
from planner.plan.rules import first_broken_rule


@pytest.fixture
def plan(good_plan, workdir):
    return read_plan(workdir / "out.yaml")


def test_a_plan_as_make_writes_it_agrees_with_itself(plan):
    assert first_disagreeing_figure(plan) is None and first_broken_rule(plan) is None


@pytest.mark.parametrize("edit, words", [
    (lambda p: replace(p, model=replace(p.model, total_bytes=p.model.total_bytes + 1)), "model.dtype_bytes sum to"),
    (lambda p: replace(p, layers=(replace(p.layers[0], copy_ms=p.layers[0].copy_ms + 1),) + p.layers[1:]),
     "layers[0].copy_ms"),
    (lambda p: replace(p, memory=replace(p.memory, gpu_bytes=p.memory.gpu_bytes + 1)), "memory.gpu_bytes"),
    (lambda p: replace(p, prediction=replace(p.prediction, resident_step_ms=p.prediction.resident_step_ms + 1)),
     "prediction.resident_step_ms"),
    (lambda p: replace(p, inputs=replace(p.inputs, tp=2)), "inputs.tp 2"),
])
def test_an_edited_figure_is_named_and_only_derived_reading_refuses_it(plan, edit, words):
    edited = edit(plan)
    found = first_disagreeing_figure(edited)
    assert found is not None and words in found and "\n" not in found
    assert first_broken_rule(edited) == found
    assert first_broken_rule(edited, derived=False) is None


def test_stored_times_are_near_within_their_rounding():
    assert near(1.0001, 1.00014) and not near(1.0001, 1.0004)
    assert near(10.0, 10.0003, terms=3) and not near(10.0, 10.0003)
    assert near(1e9, 1e9 * (1 + 5e-7))  # rates: relative


def test_a_decode_step_has_a_context_and_one_token_per_sequence(plan):
    workload = plan.workload
    assert is_decode(replace(plan, workload=replace(workload, context_tokens=128, tokens_per_step=4,
                                                    sequences_per_step=4)))
    assert not is_decode(replace(plan, workload=replace(workload, context_tokens=0, tokens_per_step=4,
                                                        sequences_per_step=4)))
    assert not is_decode(replace(plan, workload=replace(workload, context_tokens=128, tokens_per_step=64,
                                                        sequences_per_step=4)))
