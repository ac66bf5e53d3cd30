"""Per-expert prediction figures in routing traces (issue 22's skewed target): under skew the hot experts are
resident and predicted well, so a prefetch's worth is the cold experts' accuracy. Recorded with the runtime's
next-layer predictor, written and read back byte for byte, impossible counts refused in one line, and the
planner's prefetch priced per layer over the plan's own non-resident experts."""

from dataclasses import replace

import pytest
import torch

from planner.model.cost import ComputeTimes
from planner.errors import ModelInputError
from planner.source.checkpoint import load_checkpoint
from planner.search.expert_choice import choose_prefetch_depth, cold_accuracy, expert_model
from planner.model.expert_placement import routed_placement, wasted_prefetch_bytes
from planner.model.expert_prefetch import (PREFETCH_MACHINERY_MS, ExpertPrediction, planned_layer_stall_ms,
                                           prefetch_layer_stall_ms)
from planner.model.experts import MoeGeometry, MoeLayer, moe_geometry
from planner.model.layout import build_layout
from planner.plan.file import read_plan
from planner.source.routing_trace import RoutingTrace, read_trace, render_trace, trace_from_dict
from runtime.trace import count_routing, prediction_counts
from tests.conftest import make_checkpoint, run_cli
from tests.runtime_models import exactly_predictable, routed_moe_model

#: one layer of 4 experts, top-1, 20 tokens: expert 0 is hot (12 tokens) and always predicted right; experts 1
#: and 2 take 4 tokens each and are predicted right once each; expert 3 is never routed nor predicted
COUNTS = (12, 4, 4, 0)
PREDICTED = ((12,), (4,), (4,), (0,))
HITS = ((12,), (1,), (1,), (0,))


def _trace(num_layers: int = 3) -> RoutingTrace:
    return RoutingTrace(model_fingerprint="sha256:x", num_experts=4, top_k=1, num_tokens=20,
                        layers=tuple((i, COUNTS) for i in range(num_layers)),
                        prefetch_hits=tuple((i, (14,)) for i in range(1, num_layers)),
                        expert_prediction=tuple((i, PREDICTED, HITS) for i in range(1, num_layers)))


def test_expert_figures_round_trip_and_old_traces_keep_their_bytes(tmp_path):
    trace = _trace()
    path = tmp_path / "trace.yaml"
    path.write_text(render_trace(trace, "offload-plan trace"))
    assert ("{index: 1, counts: [12, 4, 4, 0], prefetch_hits: [14], expert_predicted: [[12], [4], [4], [0]], "
            "expert_hits: [[12], [1], [1], [0]]}") in path.read_text()
    read = read_trace(path)
    assert replace(read, content_hash="") == trace
    assert read.expert_predictions()[2] == ExpertPrediction(counts=COUNTS, hits=HITS, predicted=PREDICTED)
    old = replace(trace, expert_prediction=())
    assert "expert_" not in render_trace(old, "offload-plan trace") and old.expert_predictions() == {}
    assert old.rank_accuracy() == trace.rank_accuracy() == (14 / 20,)


def _data(**row) -> dict:
    layer = {"index": 1, "counts": [6, 4], "prefetch_hits": [7], "expert_predicted": [[6], [4]],
             "expert_hits": [[5], [2]], **row}
    return {"schema_version": 1, "model_fingerprint": "x", "num_experts": 2, "top_k": 1, "num_tokens": 10,
            "layers": [{"index": 0, "counts": [6, 4]}, {key: value for key, value in layer.items() if value != "-"}]}


@pytest.mark.parametrize("row, words", [
    ({"expert_hits": [[5], [5]], "prefetch_hits": [10]}, r"expert 1: expert_hits exceed expert_predicted"),
    ({"expert_predicted": [[3], [7]], "expert_hits": [[1], [5]], "prefetch_hits": [6]},
     r"expert 1: 5 expert_hits, beyond its 4 routed tokens"),
    ({"expert_predicted": [[6]]}, r"expert_predicted must be num_experts \(2\) lists of top_k \(1\)"),
    ({"expert_hits": [[5, 0], [2, 0]]}, r"expert_hits must be num_experts \(2\) lists of top_k \(1\)"),
    ({"expert_predicted": [[6], [3]]}, r"at rank 1 sum to 9, not num_tokens \(10\)"),
    ({"prefetch_hits": [6]}, r"expert_hits at rank 1 sum to 7, not its prefetch_hits \(6\)"),
    ({"expert_hits": "-"}, "expert_predicted and expert_hits lists of lists"),
    ({"expert_predicted": [6, 4]}, "lists of lists"),
    ({"expert_hits": [[5], [-2]]}, "lists of lists"),
    ({"prefetch_hits": "-"}, "has expert_predicted but no prefetch_hits"),
])
def test_impossible_expert_figures_are_one_line(row, words):
    with pytest.raises(ModelInputError, match=words) as error:
        trace_from_dict(_data(**row), "t")
    assert "\n" not in str(error.value) and len(str(error.value)) < 300
    trace_from_dict(_data(), "t")  # the unchanged row is valid


def test_an_expert_predicted_twice_for_one_token_is_refused():
    data = _data(**{"counts": [10, 10], "prefetch_hits": [10, 10], "expert_predicted": [[10, 1], [0, 9]],
                    "expert_hits": [[10, 0], [0, 9]]})
    data.update(top_k=2, layers=[{"index": 0, "counts": [10, 10]}, data["layers"][1]])
    data["layers"][1]["prefetch_hits"] = [10, 9]
    with pytest.raises(ModelInputError, match=r"expert 0: predicted 11 times, beyond num_tokens \(10\)"):
        trace_from_dict(data, "t")


def test_the_cold_experts_shares_over_any_resident_set():
    prediction = _trace().expert_predictions()[1]
    # every expert fetched: the all-expert figure
    assert prediction.shares((), 1) == (14 / 20, 20 / 20)
    # the hot expert resident: 2 of the 8 cold assignments predicted, the 8 cold predictions all cross
    assert prediction.shares((0,), 1) == (2 / 8, 8 / 8)
    # a cold expert resident instead: 13 of 16 predicted; nothing left cold: nothing to fetch
    assert prediction.shares((1,), 1) == (13 / 16, 16 / 16)
    assert prediction.shares((0, 1, 2, 3), 1) == (0.0, 0.0)
    assert prediction.cold_rank_counts((0,)) == ((2,), (8,), 8)


def _geometry() -> MoeGeometry:
    layers = tuple(MoeLayer(index=i, expert_bytes=1000, other_bytes=500) for i in range(3))
    # fp32 experts: the decode's batched_mm copies its pair (the hand counts below book it)
    return MoeGeometry(num_experts=4, top_k=1, layers=layers, unroutable_reason=None, expert_dtype="F32")


def test_the_planner_prices_the_prefetch_from_the_cold_experts_accuracy():
    """Hand-computed: one resident expert per layer (room for 3 after a prefetching placement's buffers), the
    hot one; each layer's counts fetch 0.4 experts (400 bytes, 0.449 ms at 0.89 MB/s), priced a little higher
    out of sample (planner.model.selection_bias). The all-expert accuracy is 0.7, the cold experts' 0.25: the prediction
    uses 0.25, all 8 cold predictions cross the link."""
    geometry, trace = _geometry(), _trace()
    routing = trace.routing()
    # non-layer 100 + 3 x 500 other + fetch buffer 2 x 1000 (two slot sets) + staging 4 x 1000 + gather 1000
    # (one pair) + 3 resident
    placement = routed_placement(geometry, routing, num_tokens=1, layer_total_bytes=(4500,) * 3, non_layer_bytes=100,
                                 weight_limit_bytes=11_600, h2d_bytes_per_s=1e6, prefetch_accuracy=0.7)
    assert [row.resident for row in placement.layers] == [(0,)] * 3
    fetched_experts = routing[1].out_of_sample((0,), 1)[1]
    assert 0.4 < fetched_experts < 0.45  # 20 tokens counted: the hot expert's count ran a little high
    fetch_ms = 1e3 * fetched_experts * 1000 / 0.89e6
    assert placement.layers[1].fetch_ms == pytest.approx(fetch_ms)
    compute = ComputeTimes(layer_ms=(0.2,) * 3, head_ms=0.1, source="test")
    per_expert = expert_model(geometry, routing, "trace", None, rank_accuracy=trace.rank_accuracy(),
                              predictions=trace.expert_predictions())
    per_rank = expert_model(geometry, routing, "trace", None, rank_accuracy=trace.rank_accuracy())
    assert (per_expert.accuracy_source, per_rank.accuracy_source) == ("trace_per_expert", "trace_per_rank")
    chosen, simulation = choose_prefetch_depth(per_expert, compute, placement)
    assert [(row.prefetch_hit_share, row.prefetch_ahead_share) for row in chosen.layers] == [
        (None, None), (0.25, 1.0), (0.25, 1.0)]
    # a step fetches 0 or 1 whole expert (one slot): ~0.4 of the steps gather one (1.124 ms) past the 0.2 ms
    # compute, where the mean's 0.449 ms would outlast it by less
    expert_ms = 1e3 * 1000 / 0.89e6
    stall = prefetch_layer_stall_ms(0.2, fetch_ms, 0.25, predicted=True, ahead_share=1.0, expert_ms=expert_ms,
                                    num_slots=1)
    assert stall == pytest.approx(fetched_experts * (expert_ms - 0.2) + 0.75 * fetch_ms)
    # the plan adds the prefetch's measured costs: its machinery, and the compute it slows (hidden here: the
    # expert outlasts the compute by more than the slowdown)
    planned = planned_layer_stall_ms(0.2, fetch_ms, 0.25, predicted=True, ahead_share=1.0, expert_ms=expert_ms,
                                     num_slots=1)
    assert planned == pytest.approx(stall + PREFETCH_MACHINERY_MS)
    assert simulation.layer_stall_ms == pytest.approx((fetch_ms, planned, planned))
    assert wasted_prefetch_bytes(chosen) == pytest.approx(2 * 0.75 * fetched_experts * 1000)
    assert cold_accuracy(per_expert, chosen) == (0.25, (0.25,))
    # the all-expert figure would have predicted a faster step: the 0.86 of issue 22's skewed run
    _, optimistic = choose_prefetch_depth(per_rank, compute, placement)
    assert optimistic.layer_stall_ms[1] == pytest.approx(fetched_experts * (expert_ms - 0.2) + 0.3 * fetch_ms +
                                                          PREFETCH_MACHINERY_MS)
    assert optimistic.step_ms < simulation.step_ms
    # --prefetch-accuracy overrides the trace's figures: assumed
    pinned = expert_model(geometry, routing, "trace", None, 0.9, trace.rank_accuracy(), None,
                          trace.expert_predictions())
    assert pinned.accuracy_source == "assumed" and pinned.predictions is None


def test_at_more_sequences_the_cold_shares_scale_the_layer_fetch_as_the_rank_curve_does():
    """Batch > 1: the shares stay those of one token's assignments and apply to the step's expected distinct
    non-resident bytes, as planner.model.expert_prefetch.prefetch_shares' curve does."""
    geometry, trace = _geometry(), _trace()
    routing = trace.routing()
    placement = routed_placement(geometry, routing, num_tokens=4, layer_total_bytes=(4500,) * 3, non_layer_bytes=100,
                                 weight_limit_bytes=20_000, h2d_bytes_per_s=1e6, prefetch_accuracy=0.7)
    experts = expert_model(geometry, routing, "trace", None, rank_accuracy=trace.rank_accuracy(),
                           predictions=trace.expert_predictions())
    compute = ComputeTimes(layer_ms=(0.2,) * 3, head_ms=0.1, source="test")
    chosen, simulation = choose_prefetch_depth(experts, compute, placement)
    row = chosen.layers[1]
    share = trace.expert_predictions()[1].shares(row.resident, 1)
    assert (row.prefetch_hit_share, row.prefetch_ahead_share) == share
    expert_ms = 1e3 * 1000 / 0.89e6  # the step routes to up to 4 distinct experts (4 tokens, top-1)
    assert simulation.layer_stall_ms[1] == pytest.approx(
        planned_layer_stall_ms(0.2, row.fetch_ms, share[0], predicted=True, ahead_share=share[1],
                               expert_ms=expert_ms, num_slots=placement.fetch_slots))
    assert placement.fetch_slots == 4


def test_the_routed_choice_carries_the_cold_figures_into_the_plan_section():
    from planner.search.expert_choice import Comparison, experts_section
    from planner.search.groups import LayerBytes

    geometry, trace = _geometry(), _trace()
    experts = expert_model(geometry, trace.routing(), "trace sha256:" + "0" * 64, None,
                           rank_accuracy=trace.rank_accuracy(), predictions=trace.expert_predictions())
    placement = routed_placement(geometry, experts.routing, num_tokens=1, layer_total_bytes=(4500,) * 3,
                                 non_layer_bytes=100, weight_limit_bytes=11_600, h2d_bytes_per_s=1e6,
                                 prefetch_accuracy=0.7)
    compute = ComputeTimes(layer_ms=(0.2,) * 3, head_ms=0.1, source="test")
    chosen, simulation = choose_prefetch_depth(experts, compute, placement)
    from planner.search.expert_choice import RoutedChoice

    choice = RoutedChoice(group_size=0, num_in_group=0, prefetch_step=0, offloaded=(), replay_start_copies=0,
                          simulation=simulation, gpu_bytes=0, host_pinned_bytes=0, copy_bytes=0, placement=chosen)
    layers = LayerBytes(total=(4500,) * 3, selected=(4500,) * 3, num_tensors=1)
    point = Comparison(num_tokens=1, whole=None, routed=choice).point(1)
    section = experts_section(experts, choice, layers, (point,), 1e6)
    assert section.prefetch_accuracy_source == "trace_per_expert"
    assert (section.prefetch_accuracy, section.prefetch_rank_accuracy, section.prefetch_depth) == (0.25, (0.25,), 1)
    assert [(row.prefetch_hit_share, row.prefetch_ahead_share) for row in section.layers[1:]] == [(0.25, 1.0)] * 2
    assert section.prefetch_shares() == (0.25, 1.0)


def test_make_check_and_show_a_plan_priced_from_the_expert_figures(tmp_path):
    """make with the trace (prefetch pinned at depth 1: a tiny model's compute hides nothing, so the planner
    would not choose it), the plan's rows hold the cold shares, check regenerates it byte for byte and show
    says where the accuracy comes from."""
    # experts of 1.5 MB: a routed step saves more link time than the prefetch's own machinery costs a layer
    # (planner.model.expert_prefetch.PREFETCH_MACHINERY_MS), so the routed regime is the plan's
    written = make_checkpoint(tmp_path / "moe", moe={"num_experts": 4, "top_k": 1, "expert_intermediate": 4096})
    checkpoint = load_checkpoint(str(written.path))
    geometry = moe_geometry(checkpoint.config, build_layout(checkpoint, None))
    trace = replace(_trace(len(geometry.layers)), model_fingerprint=checkpoint.fingerprint())
    (tmp_path / "trace.yaml").write_text(render_trace(trace, "offload-plan trace"))
    layer = geometry.layers[0]
    budget = int((written.non_layer_bytes + 4 * layer.other_bytes + 6 * layer.expert_bytes) * 1.5)
    made = run_cli(["make", "--model", written.path, "--gpu", "h100-sxm", "--tokens", "1", "--context", "64",
                    "--budget", f"{budget}B", "--routing-trace", "trace.yaml", "--prefetch-depth", "1", "-o",
                    "plan.yaml"], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    plan = read_plan(tmp_path / "plan.yaml")
    experts = plan.experts
    assert (experts.prefetch, experts.prefetch_accuracy_source) == ("next_layer_router", "trace_per_expert")
    for row in experts.layers[1:]:  # each layer's own cold experts' shares
        assert (row.prefetch_hit_share, row.prefetch_ahead_share) == trace.expert_predictions()[1].shares(
            row.resident, 1)
    assert experts.layers[0].prefetch_hit_share is None  # nothing predicts the first routed layer
    assert run_cli(["check", "plan.yaml"], cwd=tmp_path).returncode == 0
    shown = run_cli(["show", "plan.yaml", "--no-layers"], cwd=tmp_path)
    assert "non-resident experts, from the trace's per-expert figures" in " ".join(shown.stdout.split())
    # the same trace without its per-expert figures: the per-rank source, and no per-layer shares written
    (tmp_path / "trace.yaml").write_text(render_trace(replace(trace, expert_prediction=()), "offload-plan trace"))
    assert run_cli(["make", "--model", written.path, "--gpu", "h100-sxm", "--tokens", "1", "--context", "64",
                    "--budget", f"{budget}B", "--routing-trace", "trace.yaml", "--prefetch-depth", "1", "-o",
                    "plan.yaml"], cwd=tmp_path).returncode == 0
    text = (tmp_path / "plan.yaml").read_text()
    assert "prefetch_accuracy_source: trace_per_rank" in text and "prefetch_hit_share" not in text


def test_prediction_counts_by_expert_and_rank():
    predicted = torch.tensor([[0, 1], [2, 0], [0, 3]])
    routed = torch.tensor([[1, 0], [3, 1], [0, 2]])
    rank_hits, made, hits = prediction_counts(predicted, routed, 4)
    assert rank_hits.tolist() == [2, 1]
    assert made.tolist() == [[2, 1], [0, 1], [1, 0], [0, 1]]
    assert hits.tolist() == [[2, 0], [0, 1], [0, 0], [0, 0]]


def test_count_routing_records_the_expert_figures_the_trace_validates():
    """The exactly predictable model: every prediction at every rank is a hit, so each expert's hits are its
    predictions and sum to its count. The untouched model: figures the trace accepts."""
    model = routed_moe_model(top_k=4)
    exact = exactly_predictable(model)
    prompts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 12)]
    for net, perfect in ((exact, True), (model, False)):
        hits, experts = {}, {}
        num_tokens, counts = count_routing(net, prompts, "model.layers", 16, prefetch_hits=hits,
                                           expert_prediction=experts)
        assert sorted(experts) == sorted(hits) == [1, 2, 3]
        trace = RoutingTrace(model_fingerprint="x", num_experts=16, top_k=4, num_tokens=num_tokens,
                             layers=tuple(counts.items()), prefetch_hits=tuple(sorted(hits.items())),
                             expert_prediction=tuple((i, made, h) for i, (made, h) in sorted(experts.items())))
        made, layer_hits = experts[1]
        if perfect:
            assert made == layer_hits and [sum(row) for row in layer_hits] == list(counts[1])
        assert trace.expert_predictions()[1].shares((), 4)[1] == 1.0  # all k predictions per token cross
