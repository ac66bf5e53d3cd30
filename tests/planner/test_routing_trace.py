"""Prediction accuracy by rank in routing traces: recorded with the runtime's next-layer predictor, written and
read back byte for byte, checked in one line, and the rank accuracies the planner chooses its prefetch depth from."""

from dataclasses import replace

import pytest
import torch

from planner.checkpoint import load_checkpoint
from planner.errors import ModelInputError
from planner.experts import moe_geometry
from planner.layout import build_layout
from planner.make import make_plan
from planner.plan import Inputs
from planner.routing_trace import RoutingTrace, read_trace, render_trace, trace_from_dict
from runtime.trace import count_routing
from tests.conftest import make_checkpoint
from tests.runtime_models import exactly_predictable, routed_moe_model


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
    # as tests/planner/test_experts.py's trace plan: room for one resident expert per layer
    layer = geometry.layers[0]
    budget = (written.non_layer_bytes + 4 * layer.other_bytes + (1 + 4 + 1) * layer.expert_bytes) * 1.5
    plan = make_plan(Inputs(model=str(written.path), gpu="h100-sxm", tokens=1, context=64, budget=f"{int(budget)}B",
                            routing_trace=str(tmp_path / "trace.yaml"))).plan
    assert plan.experts.regime == "routed", plan.experts
    assert plan.experts.prefetch_rank_accuracy == (0.75,) and plan.experts.prefetch_accuracy == 0.75
