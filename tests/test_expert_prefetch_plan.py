"""Next-layer expert prefetch in the planner: the step model (misses after the router, predicted bytes behind one
layer's compute), the doubled fetch slots in GPU bytes, the choice and its record in the plan (make, check,
show), and --prefetch-accuracy."""

from pathlib import Path

import pytest

from planner.experts import (PREFETCH_ACCURACY, MoeGeometry, MoeLayer, prefetch_layer_stall_ms, routed_placement,
                             routed_step_ms, uniform_routing)
from planner.make import make_plan
from planner.plan import Inputs
from planner.plan_file import plan_from_dict, plan_to_dict
from tests.conftest import assert_one_line_error, make_checkpoint, run_cli



def test_the_stall_is_the_fetch_the_prefetch_cannot_hide_plus_the_misses():
    # no prediction (no prefetch, or the first routed layer): the whole fetch after the router
    assert prefetch_layer_stall_ms(0.5, 1.2, None, predicted=True) == 1.2
    assert prefetch_layer_stall_ms(0.5, 1.2, 0.9, predicted=False) == 1.2
    # every expert predicted: only what one layer's compute does not cover
    assert prefetch_layer_stall_ms(0.5, 1.2, 1.0, predicted=True) == pytest.approx(0.7)
    assert prefetch_layer_stall_ms(2.0, 1.2, 1.0, predicted=True) == 0.0
    # none predicted: the wasted prefetch takes the link first, then every miss
    assert prefetch_layer_stall_ms(0.5, 1.2, 0.0, predicted=True) == pytest.approx(0.7 + 1.2)
    assert prefetch_layer_stall_ms(0.5, 1.2, 0.75, predicted=True) == pytest.approx(0.7 + 0.3)


def _placement(accuracy, limit_bytes):
    layers = tuple(MoeLayer(index=i, expert_bytes=1000, other_bytes=500) for i in range(3))
    geometry = MoeGeometry(num_experts=4, top_k=1, layers=layers, unroutable_reason=None)
    return routed_placement(geometry, uniform_routing(geometry), num_tokens=1, layer_total_bytes=(4500,) * 3,
                            non_layer_bytes=100, weight_limit_bytes=limit_bytes, h2d_bytes_per_s=1e6,
                            prefetch_accuracy=accuracy)


def test_prefetch_doubles_the_fetch_slots_in_gpu_bytes_at_the_cost_of_resident_experts():
    # base: non-layer 100 + 3 x 500 non-expert + staging 4 x 1000 + fetch slots (1 or 2) x 1000
    limit = 100 + 1500 + 4000 + 1000 + 3000
    without, with_prefetch = _placement(None, limit), _placement(0.8, limit)
    assert without.fetch_buffer_bytes == 1000 and with_prefetch.fetch_buffer_bytes == 2000
    assert without.num_resident == 3 and with_prefetch.num_resident == 2  # one expert's bytes went to slots
    assert with_prefetch.weight_bytes == without.weight_bytes
    assert with_prefetch.prefetch_accuracy == 0.8 and without.prefetch_accuracy is None
    layer_ms = (0.5, 0.5, 0.5)
    # the first layer waits for its whole fetch either way; the others overlap with their compute
    stalls = [prefetch_layer_stall_ms(0.5, row.fetch_ms, 0.8, predicted=i > 0)
              for i, row in enumerate(with_prefetch.layers)]
    assert routed_step_ms(layer_ms, 0.1, with_prefetch) == pytest.approx(0.1 + 1.5 + sum(stalls))
    assert routed_step_ms(layer_ms, 0.1, without) == pytest.approx(0.1 + 1.5 + without.fetch_ms)


def serving_inputs(model: Path, **extra) -> Inputs:
    return Inputs(model=str(model), gpu="h100-sxm", context=4096, concurrency="1", cuda_graph=True,
                  gpu_memory="24GiB", **extra)


def test_an_accurate_prediction_is_planned_and_recorded_a_poor_one_is_not(qwen3_30b):
    accurate = make_plan(serving_inputs(qwen3_30b, prefetch_accuracy=1.0)).plan
    poor = make_plan(serving_inputs(qwen3_30b, prefetch_accuracy=0.0)).plan
    default = make_plan(serving_inputs(qwen3_30b)).plan
    assert accurate.experts.prefetch == "next_layer_router" and accurate.experts.prefetch_accuracy == 1.0
    assert poor.experts.prefetch is None and poor.experts.prefetch_accuracy == 0.0
    assert default.experts.prefetch_accuracy == PREFETCH_ACCURACY
    experts = accurate.experts
    assert experts.fetch_buffer_bytes == 2 * experts.fetch_slots * experts.expert_bytes
    assert poor.experts.fetch_buffer_bytes == poor.experts.fetch_slots * poor.experts.expert_bytes
    assert accurate.memory.total_gpu_bytes <= accurate.memory.gpu_memory_bytes
    # hidden fetches: faster than fetching after every router, at the cost of resident experts
    assert accurate.prediction.decode_step_ms < poor.prediction.decode_step_ms
    assert sum(len(r.resident) for r in accurate.experts.layers) < sum(len(r.resident) for r in poor.experts.layers)
    assert plan_to_dict(plan_from_dict(plan_to_dict(accurate), "test")) == plan_to_dict(accurate)
    # the link carries every routed byte either way: the floor is the same or more with prefetch
    assert accurate.prediction.link_floor_ms >= poor.prediction.link_floor_ms * 0.99


def test_a_prefetch_plan_checks_byte_for_byte_and_show_says_so(qwen3_30b, tmp_path):
    words = ["make", "--model", str(qwen3_30b), "--gpu", "h100-sxm", "--context", "4096", "--concurrency", "1",
             "--cuda-graph", "--gpu-memory", "24GiB", "--prefetch-accuracy", "0.95", "-o", "plan.yaml"]
    result = run_cli(words, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "plan.yaml").read_text()
    assert "--prefetch-accuracy 0.95" in text.splitlines()[1]
    assert "prefetch: next_layer_router" in text and "prefetch_accuracy: 0.95" in text
    checked = run_cli(["check", "plan.yaml"], cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    shown = run_cli(["show", "plan.yaml", "--no-layers"], cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    said = " ".join(shown.stdout.split())
    assert "predicts the next one's experts" in said and "95% accuracy" in said and "x 2 slot sets" in said


def test_prefetch_accuracy_outside_a_share_or_on_a_dense_model_is_one_line(qwen3_30b, tmp_path):
    result = run_cli(["make", "--model", str(qwen3_30b), "--gpu", "h100-sxm", "--context", "4096", "--concurrency",
                      "1", "--prefetch-accuracy", "1.5"], cwd=tmp_path)
    assert_one_line_error(result.returncode, result.stderr, result.stdout, ("from 0 to 1",))
    written = make_checkpoint(tmp_path / "dense")
    result = run_cli(["make", "--model", str(written.path), "--gpu", "h100-sxm", "--budget", "1MiB",
                      "--prefetch-accuracy", "0.5"], cwd=tmp_path)
    assert_one_line_error(result.returncode, result.stderr, result.stdout, ("applies to MoE models",))
