"""Routing traces (planner.source.routing_trace): the file written and read back, checked against the model in one line,
and make's placement from it; then prediction accuracy by rank: recorded with the runtime's next-layer
predictor, written and read back byte for byte, checked in one line, and the rank accuracies the planner
chooses its prefetch depth from."""

import math
from dataclasses import replace

import pytest
import torch

from planner.source.checkpoint import load_checkpoint
from planner.errors import ModelInputError
from planner.model.experts import MoeGeometry, moe_geometry
from planner.model.layout import build_layout
from planner.make.make_plan import make_plan
from planner.plan.schema import Inputs
from planner.plan.file import read_plan
from planner.source.routing_trace import RoutingTrace, check_against, read_trace, render_trace, trace_from_dict
from planner.search.routed_step import (TRACE_CONDITION_WARN_RATIO, TRACE_UNSEEN_WARN_SHARE, unseen_share,
                                        uniform_routing_step)
from runtime.trace import count_routing
from tests.conftest import assert_one_line_error, make_checkpoint, run_cli
from tests.helpers import roofline_profile
from tests.runtime_models import exactly_predictable, routed_moe_model


# ---- trace files and make --------------------------------------------------------------------------------------------


def a_trace(geometry: MoeGeometry, fingerprint: str, num_tokens: int = 10) -> RoutingTrace:
    """Every token of every layer routes to experts 0..top_k-1."""
    counts = tuple(num_tokens if e < geometry.top_k else 0 for e in range(geometry.num_experts))
    return RoutingTrace(model_fingerprint=fingerprint, num_experts=geometry.num_experts, top_k=geometry.top_k,
                        num_tokens=num_tokens, layers=tuple((layer.index, counts) for layer in geometry.layers))


def test_trace_round_trip_and_one_line_errors(tmp_path):
    written = make_checkpoint(tmp_path / "moe", moe={"num_experts": 4, "top_k": 2, "expert_intermediate": 32})
    checkpoint = load_checkpoint(str(written.path))
    geometry = moe_geometry(checkpoint.config, build_layout(checkpoint, None))
    trace = a_trace(geometry, checkpoint.fingerprint())
    path = tmp_path / "trace.yaml"
    path.write_text(render_trace(trace, "offload-plan trace --model m --prompts p"))
    read = read_trace(path)
    assert replace(read, content_hash="") == trace and read.content_hash.startswith("sha256:")
    check_against(read, geometry, checkpoint.fingerprint(), "trace.yaml")
    with pytest.raises(ModelInputError, match="another model"):
        check_against(read, geometry, "sha256:" + "0" * 64, "trace.yaml")
    fewer = replace(read, layers=read.layers[:-1])
    with pytest.raises(ModelInputError, match="MoE layers"):
        check_against(fewer, geometry, checkpoint.fingerprint(), "trace.yaml")
    data = {"schema_version": 1, "model_fingerprint": "x", "num_experts": 4, "top_k": 2, "num_tokens": 10,
            "layers": [{"index": 0, "counts": [10, 10, 0, 1]}]}
    with pytest.raises(ModelInputError, match="sum to 21"):
        trace_from_dict(data, "t")
    data["layers"] = [{"index": 0, "counts": [11, 9, 0, 0]}]
    with pytest.raises(ModelInputError, match="at most once"):
        trace_from_dict(data, "t")
    data["layers"] = [{"index": 0, "counts": [10, 10, 0]}]
    with pytest.raises(ModelInputError, match="3 counts for 4 experts"):
        trace_from_dict(data, "t")


def test_make_with_a_trace_records_its_hash_keeps_hot_experts_and_check_finds_a_changed_trace(tmp_path):
    written = make_checkpoint(tmp_path / "moe", moe={"num_experts": 4, "top_k": 1, "expert_intermediate": 32})
    checkpoint = load_checkpoint(str(written.path))
    geometry = moe_geometry(checkpoint.config, build_layout(checkpoint, None))
    # experts 3 takes every token in every layer
    counts = (0, 0, 0, 20)
    trace = RoutingTrace(model_fingerprint=checkpoint.fingerprint(), num_experts=4, top_k=1, num_tokens=20,
                         layers=tuple((layer.index, counts) for layer in geometry.layers))
    (tmp_path / "trace.yaml").write_text(render_trace(trace, "offload-plan trace"))
    words = ["make", "--model", "moe", "--gpu", roofline_profile(tmp_path), "--tokens", "1", "--context", "64",
             "--budget"]
    # a budget with room for the non-expert weights, both buffers and one resident expert per layer, priced by the
    # roofline (the measured layer floor hides a tiny layer's whole copy, and whole layers would win)
    layer = geometry.layers[0]
    budget = (written.non_layer_bytes + 4 * layer.other_bytes + (1 + 4 + 1) * layer.expert_bytes) * 1.5
    words += [f"{math.ceil(budget)}B", "--routing-trace", "trace.yaml", "-o", "plan.yaml"]
    result = run_cli(words, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = read_plan(tmp_path / "plan.yaml")
    assert plan.inputs.routing_trace == "trace.yaml"
    assert plan.experts.routing == f"trace {read_trace(tmp_path / 'trace.yaml').content_hash}"
    assert plan.experts.regime == "routed"
    assert all(3 in row.resident and row.hit_rate == 1.0 for row in plan.experts.layers)
    assert run_cli(["check", "plan.yaml"], cwd=tmp_path).returncode == 0
    other = RoutingTrace(model_fingerprint=checkpoint.fingerprint(), num_experts=4, top_k=1, num_tokens=20,
                         layers=tuple((layer.index, (20, 0, 0, 0)) for layer in geometry.layers))
    (tmp_path / "trace.yaml").write_text(render_trace(other, "offload-plan trace"))
    stale = run_cli(["check", "plan.yaml"], cwd=tmp_path)
    assert stale.returncode != 0 and "routing: trace sha256:" in stale.stdout + stale.stderr


def test_make_refuses_a_trace_of_another_model_in_one_line(tmp_path):
    written = make_checkpoint(tmp_path / "moe", moe={"num_experts": 4, "top_k": 2, "expert_intermediate": 32})
    checkpoint = load_checkpoint(str(written.path))
    geometry = moe_geometry(checkpoint.config, build_layout(checkpoint, None))
    (tmp_path / "trace.yaml").write_text(render_trace(a_trace(geometry, "sha256:" + "1" * 64), "x"))
    result = run_cli(["make", "--model", "moe", "--gpu", "h100-sxm", "--budget", "1MiB", "--routing-trace",
                      "trace.yaml"], cwd=tmp_path)
    assert_one_line_error(result.returncode, result.stderr, contains=("another model",))
    dense = make_checkpoint(tmp_path / "dense")
    result = run_cli(["make", "--model", str(dense.path), "--gpu", "h100-sxm", "--budget", "1MiB",
                      "--routing-trace", "trace.yaml"], cwd=tmp_path)
    assert_one_line_error(result.returncode, result.stderr, contains=("MoE",))


# ---- prediction accuracy by rank -------------------------------------------------------------------------------------


def test_prefetch_hits_round_trip_and_give_the_rank_accuracy(tmp_path):
    counts = (10, 10, 0, 0)
    trace = RoutingTrace(model_fingerprint="sha256:x", num_experts=4, top_k=2, num_tokens=10,
                         layers=((0, counts), (1, counts), (2, counts)), prefetch_hits=((1, (9, 4)), (2, (7, 2))))
    path = tmp_path / "trace.yaml"
    path.write_text(render_trace(trace, "offload-plan trace"))
    assert "{index: 1, counts: [10, 10, 0, 0], prefetch_hits: [9, 4]}" in path.read_text()
    read = read_trace(path)
    assert replace(read, content_hash="") == trace
    assert read.rank_accuracy() == pytest.approx((16 / 20, 6 / 20))
    assert replace(trace, prefetch_hits=()).rank_accuracy() is None  # traces recorded before: no figures


@pytest.mark.parametrize("hits, words", [([11, 0], "from 0 to num_tokens"), ([1], r"top_k \(2\) counts"),
                                         ([1, -1], "whole numbers")])
def test_impossible_prefetch_hits_are_one_line(hits, words):
    data = {"schema_version": 1, "model_fingerprint": "x", "num_experts": 4, "top_k": 2, "num_tokens": 10,
            "layers": [{"index": 0, "counts": [10, 10, 0, 0]},
                       {"index": 1, "counts": [10, 10, 0, 0], "prefetch_hits": hits}]}
    with pytest.raises(ModelInputError, match=words) as error:
        trace_from_dict(data, "t")
    assert "\n" not in str(error.value)
    data["layers"] = [{"index": 0, "counts": [10, 10, 0, 0], "prefetch_hits": [1, 1]}]
    with pytest.raises(ModelInputError, match="no MoE layer before it"):
        trace_from_dict(data, "t")


def test_count_routing_counts_the_predictions_by_rank():
    """A model whose layer 1 sees layer 0's residual unchanged (layer 0's experts and layer 1's attention add
    nothing): the prediction is exact at every rank. The untouched model: counts from 0 to the tokens, rank by
    rank as the predictor's own top-k compared with the routed ids."""
    model = routed_moe_model(top_k=4)
    exact = exactly_predictable(model)
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 12)]
    hits: dict = {}
    num_tokens, _ = count_routing(exact, prompts, "model.layers", 16, prefetch_hits=hits)
    assert num_tokens == 19 and sorted(hits) == [1, 2, 3]
    assert hits[1] == (19,) * 4
    hits = {}
    count_routing(model, prompts, "model.layers", 16, prefetch_hits=hits)
    assert all(len(h) == 4 and all(0 <= c <= 19 for c in h) for h in hits.values())
    # without asking, no prediction runs: the counts alone, as before
    assert count_routing(model, prompts, "model.layers", 16)[0] == 19


def test_make_takes_the_rank_accuracy_from_the_trace(tmp_path):
    written = make_checkpoint(tmp_path / "moe", moe={"num_experts": 4, "top_k": 1, "expert_intermediate": 32})
    checkpoint = load_checkpoint(str(written.path))
    geometry = moe_geometry(checkpoint.config, build_layout(checkpoint, None))
    indices = [layer.index for layer in geometry.layers]
    trace = RoutingTrace(model_fingerprint=checkpoint.fingerprint(), num_experts=4, top_k=1, num_tokens=20,
                         layers=tuple((i, (0, 0, 0, 20)) for i in indices),
                         prefetch_hits=tuple((i, (15,)) for i in indices[1:]))
    (tmp_path / "trace.yaml").write_text(render_trace(trace, "offload-plan trace"))
    # as make's trace plan above: room for one resident expert per layer
    layer = geometry.layers[0]
    budget = (written.non_layer_bytes + 4 * layer.other_bytes + (1 + 4 + 1) * layer.expert_bytes) * 1.5
    plan = make_plan(Inputs(model=str(written.path), gpu=roofline_profile(tmp_path), tokens=1, context=64,
                            budget=f"{int(budget)}B", routing_trace=str(tmp_path / "trace.yaml"))).plan
    assert plan.experts.regime == "routed", plan.experts
    assert plan.experts.prefetch_rank_accuracy == (0.75,) and plan.experts.prefetch_accuracy == 0.75


def test_a_traced_plan_states_its_step_under_uniform_routing(tmp_path):
    """The trace's routing is the condition of a traced plan's promise: routed uniformly, the same residents leave
    (E - resident) x (1 - (1 - k/E)^B) experts a layer to fetch. make warns where that step is 1.5x the plan's or
    more and the trace never routed to a quarter of some layer's experts, show says it for every traced plan, and
    a plan of uniform routing has nothing to say."""
    written = make_checkpoint(tmp_path / "moe", moe={"num_experts": 4, "top_k": 1, "expert_intermediate": 32})
    checkpoint = load_checkpoint(str(written.path))
    geometry = moe_geometry(checkpoint.config, build_layout(checkpoint, None))
    layer = geometry.layers[0]
    budget = math.ceil((written.non_layer_bytes + 4 * layer.other_bytes + (1 + 4 + 1) * layer.expert_bytes) * 1.5)
    words = ["make", "--model", "moe", "--gpu", roofline_profile(tmp_path), "--tokens", "1", "--context", "64",
             "--budget", f"{budget}B", "-o"]
    warnings = {}
    for name, counts in (("hot", (0, 0, 0, 20)), ("even", (5, 5, 5, 5))):
        trace = RoutingTrace(model_fingerprint=checkpoint.fingerprint(), num_experts=4, top_k=1, num_tokens=20,
                             layers=tuple((moe.index, counts) for moe in geometry.layers))
        (tmp_path / f"{name}.yaml").write_text(render_trace(trace, "offload-plan trace"))
        made = run_cli([*words, f"{name}-plan.yaml", "--routing-trace", f"{name}.yaml"], cwd=tmp_path)
        assert made.returncode == 0, made.stderr
        plan = read_plan(tmp_path / f"{name}-plan.yaml")
        uniform = uniform_routing_step(plan)
        others = sum(4 - len(row.resident) for row in plan.experts.routed_layers)
        assert uniform.fetched_experts == pytest.approx(others * (1 - (1 - 1 / 4) ** 1))
        assert not uniform.floor
        warned = warnings[name] = "routed uniformly" in made.stderr
        unseen = unseen_share(trace.routing())
        assert unseen == counts.count(0) / 4
        assert warned == (uniform.step_ms >= TRACE_CONDITION_WARN_RATIO * uniform.planned_step_ms
                          and unseen >= TRACE_UNSEEN_WARN_SHARE)
        shown = run_cli(["show", f"{name}-plan.yaml"], cwd=tmp_path).stdout
        assert "The step holds for traffic routed as the trace's was" in " ".join(shown.split())
    hot, even = (read_plan(tmp_path / f"{name}-plan.yaml") for name in ("hot", "even"))
    assert all(row.hit_rate == 1.0 for row in hot.experts.routed_layers)  # the trace's promise: nothing to fetch
    assert uniform_routing_step(hot).step_ms > uniform_routing_step(hot).planned_step_ms  # uniform routing breaks it
    # a trace as even as uniform routing: no worse than the plan's own step (which prices the optimism of
    # choosing residents by 20 tokens' counts: planner.model.selection_bias), so no warning
    assert uniform_routing_step(even).step_ms <= uniform_routing_step(even).planned_step_ms
    assert warnings == {"hot": True, "even": False}
    made = run_cli([*words, "uniform-plan.yaml"], cwd=tmp_path)
    assert made.returncode == 0 and uniform_routing_step(read_plan(tmp_path / "uniform-plan.yaml")) is None
