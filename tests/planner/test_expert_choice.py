"""Next-layer expert prefetch in the planner: the step model (misses after the router, predicted bytes behind one
layer's compute), the doubled fetch slots in GPU bytes, the choice and its record in the plan (make, check,
show), and --prefetch-accuracy."""

from pathlib import Path

import pytest

from planner.model.cost import ComputeTimes
from planner.model.expert_placement import routed_placement
from planner.model.expert_prefetch import (GATHER_COMPUTE_SLOWDOWN, PREFETCH_ACCURACY, PREFETCH_MACHINERY_MS,
                                           prefetch_layer_stall_ms)
from planner.model.expert_routing import uniform_routing
from planner.model.experts import MoeGeometry, MoeLayer
from planner.make.make_plan import make_plan
from planner.search.expert_choice import decode_simulation
from planner.plan.schema import Inputs
from planner.plan.file import plan_from_dict, plan_to_dict
from tests.conftest import assert_one_line_error, make_checkpoint, run_cli



def _placement(accuracy, limit_bytes):
    layers = tuple(MoeLayer(index=i, expert_bytes=1000, other_bytes=500) for i in range(3))
    # fp32 experts: the decode's batched_mm copies its pair (a bf16 one's grouped_mm would not)
    geometry = MoeGeometry(num_experts=4, top_k=1, layers=layers, unroutable_reason=None, expert_dtype="F32")
    return routed_placement(geometry, uniform_routing(geometry), num_tokens=1, layer_total_bytes=(4500,) * 3,
                            non_layer_bytes=100, weight_limit_bytes=limit_bytes, h2d_bytes_per_s=1e6,
                            prefetch_accuracy=accuracy)


def test_prefetch_doubles_the_fetch_slots_in_gpu_bytes_at_the_cost_of_resident_experts():
    # base: non-layer 100 + 3 x 500 non-expert + staging 4 x 1000 + fetch slots (1 or 2) x 1000 + the decode
    # gather (1 pair) 1000
    limit = 100 + 1500 + 4000 + 1000 + 1000 + 3000
    without, with_prefetch = _placement(None, limit), _placement(0.8, limit)
    assert without.fetch_buffer_bytes == 1000 and with_prefetch.fetch_buffer_bytes == 2000
    assert without.num_resident == 3 and with_prefetch.num_resident == 2  # one expert's bytes went to slots
    assert with_prefetch.weight_bytes == without.weight_bytes
    assert with_prefetch.prefetch_accuracy == 0.8 and without.prefetch_accuracy is None
    layer_ms = (0.5, 0.5, 0.5)
    # the first layer waits for its whole fetch either way; the others overlap with their compute, a step
    # fetching 0 or 1 whole expert (1000 bytes at the gather's rate; one slot)
    from planner.model.experts import routed_fetch_bytes_per_s

    expert_ms = 1e3 * 1000 / routed_fetch_bytes_per_s(1e6)
    stalls = [prefetch_layer_stall_ms(0.5, row.fetch_ms, 0.8, predicted=i > 0, expert_ms=expert_ms, num_slots=1,
                                      compute_slowdown=GATHER_COMPUTE_SLOWDOWN,
                                      machinery_ms=PREFETCH_MACHINERY_MS)
              for i, row in enumerate(with_prefetch.layers)]
    # the plan prices the prefetch's measured costs beside its bytes: slower compute under it, its machinery
    compute = ComputeTimes(layer_ms=layer_ms, head_ms=0.1, source="test")
    assert decode_simulation(compute, with_prefetch).step_ms == pytest.approx(0.1 + 1.5 + sum(stalls))
    bare = [prefetch_layer_stall_ms(0.5, row.fetch_ms, 0.8, predicted=i > 0, expert_ms=expert_ms, num_slots=1)
            for i, row in enumerate(with_prefetch.layers)]
    assert sum(stalls) >= sum(bare) + 2 * PREFETCH_MACHINERY_MS - 1e-12
    assert decode_simulation(compute, without).step_ms == pytest.approx(0.1 + 1.5 + without.fetch_ms)


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


# ---- prefetch depth: the top-m ranks of each prediction ------------------------------------------------------


def _depth_pick(rank_accuracy, compute_ms, pinned=None):
    from planner.model.cost import ComputeTimes
    from planner.search.expert_choice import choose_prefetch_depth, expert_model

    layers = tuple(MoeLayer(index=i, expert_bytes=1000, other_bytes=500) for i in range(4))
    geometry = MoeGeometry(num_experts=16, top_k=len(rank_accuracy), layers=layers, unroutable_reason=None,
                           expert_dtype="F32")  # batched_mm's pair copies fill the limit: no resident expert
    placement = routed_placement(geometry, uniform_routing(geometry), num_tokens=1, layer_total_bytes=(16500,) * 4,
                                 non_layer_bytes=100, weight_limit_bytes=30100, h2d_bytes_per_s=1e6,
                                 prefetch_accuracy=0.5)
    experts = expert_model(geometry, None, "uniform", None, rank_accuracy=tuple(rank_accuracy), prefetch_depth=pinned)
    compute = ComputeTimes(layer_ms=(compute_ms,) * 4, head_ms=0.1, source="test")
    assert placement.num_resident == 0
    chosen, simulation = choose_prefetch_depth(experts, compute, placement)
    return chosen, simulation, placement


def test_the_depth_fills_the_compute_shadow_and_poor_deep_ranks_make_it_shallower():
    # no expert resident: per layer 4 experts x 1000 bytes, 4.5 ms at 0.89 MB/s; compute 2.5 ms hides ~2 ranks
    good = (0.95, 0.95, 0.95, 0.95)
    poor_deep = (0.95, 0.95, 0.3, 0.1)
    picks = {name: _depth_pick(ranks, 2.5)[0].prefetch_depth for name, ranks in (("good", good), ("poor", poor_deep))}
    assert picks["poor"] <= picks["good"] and picks["poor"] < 4
    # a perfect predictor with compute that hides the whole fetch: every rank; no compute to hide behind and a
    # useless deep rank: not that rank
    assert _depth_pick((1.0,) * 4, 100.0)[0].prefetch_depth == 4
    assert _depth_pick((0.9, 0.9, 0.9, 0.0), 0.0)[0].prefetch_depth < 4
    # monotone over a family: the worse the deep ranks, the shallower (never deeper)
    depths = [_depth_pick((0.95, 0.9, deep, deep), 2.5)[0].prefetch_depth for deep in (0.95, 0.7, 0.4, 0.1)]
    assert depths == sorted(depths, reverse=True) and depths[0] > depths[-1]


def test_the_chosen_depth_is_the_fastest_and_its_shares_match_the_ranks():
    from planner.model.expert_prefetch import prefetch_shares

    ranks = (0.9, 0.8, 0.5, 0.2)
    chosen, simulation, placement = _depth_pick(ranks, 2.5)
    assert (chosen.prefetch_accuracy, chosen.prefetch_ahead_share) == prefetch_shares(ranks, chosen.prefetch_depth)
    assert prefetch_shares(ranks, 2) == pytest.approx(((0.9 + 0.8) / 4, 0.5))
    for depth in range(1, 5):
        assert simulation.step_ms <= _depth_pick(ranks, 2.5, pinned=depth)[1].step_ms + 1e-9
    # at every rank the step is the depth-free model's at the mean accuracy (today's plans)
    full = _depth_pick(ranks, 2.5, pinned=4)[0]
    assert full.prefetch_accuracy == pytest.approx(sum(ranks) / 4) and full.prefetch_ahead_share == 1.0
    with pytest.raises(ValueError):
        prefetch_shares(ranks, 5)


def test_make_records_the_depth_and_its_ranks_and_prefetch_depth_pins_it(qwen3_30b, tmp_path):
    from planner.model.expert_prefetch import default_rank_accuracy

    chosen = make_plan(serving_inputs(qwen3_30b)).plan.experts
    assert chosen.prefetch_rank_accuracy == tuple(round(a, 4) for a in default_rank_accuracy(8))
    # the plan holds each rank to 4 decimals
    assert sum(chosen.prefetch_rank_accuracy) / 8 == pytest.approx(PREFETCH_ACCURACY, abs=1e-4)
    pinned = make_plan(serving_inputs(qwen3_30b, prefetch_depth=3)).plan
    assert pinned.experts.prefetch == "next_layer_router" and pinned.experts.prefetch_depth == 3
    off = make_plan(serving_inputs(qwen3_30b, prefetch_depth=0)).plan
    assert off.experts.prefetch is None and off.experts.prefetch_depth is None
    assert plan_to_dict(plan_from_dict(plan_to_dict(pinned), "test")) == plan_to_dict(pinned)
    words = ["make", "--model", str(qwen3_30b), "--gpu", "h100-sxm", "--context", "4096", "--concurrency", "1",
             "--cuda-graph", "--gpu-memory", "24GiB", "--prefetch-depth", "3", "-o", "plan.yaml"]
    result = run_cli(words, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "plan.yaml").read_text()
    assert "--prefetch-depth 3" in text.splitlines()[1] and "prefetch_depth: 3" in text
    checked = run_cli(["check", "plan.yaml"], cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    shown = " ".join(run_cli(["show", "plan.yaml", "--no-layers"], cwd=tmp_path).stdout.split())
    first, second = (round(100 * a) for a in default_rank_accuracy(8)[:2])
    assert "the top 3 of each token's 8 predicted experts" in shown and f"accuracy by rank {first}, {second}" in shown
    # a plan edited to another depth no longer checks
    (tmp_path / "plan.yaml").write_text(text.replace("prefetch_depth: 3", "prefetch_depth: 5"))
    assert run_cli(["check", "plan.yaml"], cwd=tmp_path).returncode != 0


@pytest.mark.parametrize("value, words", [("9", ("deeper than the router's top-k (8)",)),
                                          ("-1", ("not a number of ranks",)),
                                          ("two", ("--prefetch-depth",))])
def test_a_bad_prefetch_depth_is_one_line(qwen3_30b, tmp_path, value, words):
    result = run_cli(["make", "--model", str(qwen3_30b), "--gpu", "h100-sxm", "--context", "4096", "--concurrency",
                      "1", "--prefetch-depth", value], cwd=tmp_path)
    assert_one_line_error(result.returncode, result.stderr, result.stdout, words)


def test_prefetch_depth_on_a_dense_model_is_one_line(tmp_path):
    written = make_checkpoint(tmp_path / "dense")
    result = run_cli(["make", "--model", str(written.path), "--gpu", "h100-sxm", "--budget", "1MiB",
                      "--prefetch-depth", "2"], cwd=tmp_path)
    assert_one_line_error(result.returncode, result.stderr, result.stdout, ("applies to MoE models",))


def test_plans_made_before_the_depth_read_as_every_rank():
    from planner.plan.experts_section import ExpertsPlan

    old = ExpertsPlan(regime="routed", routing="uniform", fetch_slots=8, layers=(), num_experts=128, top_k=8,
                      expert_bytes=1, fetch_buffer_bytes=16, staging_buffer_bytes=128, gather_workspace_bytes=8,
                      routed_fetch_bytes_per_s=1.0,
                      routed_unavailable=None, points=(), prefetch="next_layer_router", prefetch_accuracy=0.7)
    assert old.prefetch_shares() == (0.7, 1.0)
    with pytest.raises(ValueError, match="prefetch_depth"):
        ExpertsPlan(**{**vars(old), "prefetch_depth": 9, "prefetch_rank_accuracy": (0.5,) * 8})


