"""planner.views.export_prediction: the step an exported configuration runs, per rank (through export end to end:
tests/planner/test_export.py)."""

import math

import pytest

from planner.plan.file import read_plan
from planner.search.simulate import join_every_steps_for
from planner.views.export_prediction import predict, read_at_use, read_at_use_layers, recorded_prediction


@pytest.fixture
def plan(dense, workdir):
    """The dense 8-layer plan (tests/conftest.py's ``dense``), as the reader gives it."""
    return read_plan(workdir / "plan.yaml")


def test_the_plans_own_configuration_restates_the_plan(plan):
    offload = plan.offload
    own = predict(plan, 1, offload.prefetch_step, join_every_steps_for(plan.workload.cuda_graph),
                  offload.replay_start_copies)
    assert own.step_ms == pytest.approx(plan.prediction.step_ms, abs=1e-3)
    assert own.copy_bytes_per_step == plan.prediction.copy_bytes_per_step
    assert (own.gpu_bytes, own.host_pinned_bytes, own.num_slots) == (plan.memory.gpu_bytes,
                                                                    plan.memory.host_pinned_bytes,
                                                                    plan.memory.num_slots)


def test_each_rank_holds_and_copies_its_share(plan):
    one, two = predict(plan, 1, plan.offload.prefetch_step), predict(plan, 2, plan.offload.prefetch_step)
    assert two.gpu_bytes == math.ceil(plan.memory.gpu_bytes / 2)
    assert two.host_pinned_bytes == math.ceil(plan.memory.host_pinned_bytes / 2)
    assert two.copy_bytes_per_step <= one.copy_bytes_per_step / 2 + len(plan.offload.layers)
    assert two.step_ms < one.step_ms


def test_a_slot_more_for_the_layer_in_use_costs_its_bytes(plan):
    offload = plan.offload
    base, live = predict(plan, 1, offload.prefetch_step), predict(plan, 1, offload.prefetch_step, live_extra=1)
    assert live.num_slots == base.num_slots + 1
    assert live.gpu_bytes == base.gpu_bytes + plan.memory.slot_bytes


def test_read_at_use_takes_the_fewest_gib_within_the_plans_gpu_weights(plan):
    gib, prediction = read_at_use(plan, 1, whole_gib_only=True)
    assert gib == int(gib) and prediction.gpu_bytes <= plan.memory.gpu_bytes
    assert prediction.stall_ms == pytest.approx(prediction.step_ms - sum(row.compute_ms for row in plan.layers)
                                                - plan.prediction.head_ms)
    quarter, _ = read_at_use(plan, 1, whole_gib_only=False)
    assert quarter <= gib and quarter * 4 == int(quarter * 4)
    assert 1 <= read_at_use_layers(plan, 1, gib) <= len(plan.layers)


def test_a_routed_plans_prediction_is_its_own(plan):
    recorded = recorded_prediction(plan)
    assert recorded.step_ms == plan.prediction.step_ms and recorded.gpu_bytes == plan.memory.gpu_bytes
    assert recorded.copy_bytes_per_step == plan.prediction.copy_bytes_per_step
