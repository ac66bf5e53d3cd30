"""Prefetch depth m on the CPU stand-in: only the top-m ranks of each prediction are gathered ahead, the logits
stay bitwise at every m, the fetch counters split by what was gathered, and the prediction's accuracy is counted
per rank (every rank, whatever m)."""

import copy

import pytest
import torch

from planner.errors import PlanError
from runtime.backend import CpuStandIn
from runtime.graph import DecodeLoop
from runtime.routed_layers import apply_routed_experts
from tests.runtime_models import routed_moe_model

TOP_K = 4
#: layer -> resident ids over 16 experts: layer 0 first (nothing predicts it), 1 none resident, 2 some
ROUTED = {0: (1, 5), 1: (), 2: (0, 3, 7)}


@pytest.fixture(scope="module")
def model():
    return routed_moe_model(top_k=TOP_K)


def _prompt(batch: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, 5), generator=torch.Generator().manual_seed(batch))


def _decode(model, batch: int, num_steps: int, reset=None):
    loop = DecodeLoop(model, batch=batch, max_cache_tokens=64, device=torch.device("cpu"), steps_per_call=1)
    loop.prefill(_prompt(batch))
    if reset is not None:
        reset()
    return loop.generate(num_steps)


@pytest.fixture(scope="module")
def reference(model):
    expected = {}
    for batch in (1, 3):
        plain = copy.deepcopy(model)
        plain.set_experts_implementation("batched_mm")
        expected[batch] = _decode(plain, batch, 6)
    return expected


def _routed(model, depth):
    routed_model = copy.deepcopy(model)
    routed_model.set_experts_implementation("batched_mm")
    return routed_model, apply_routed_experts(routed_model, ROUTED, 3 * TOP_K, CpuStandIn(), prefetch=True,
                                              prefetch_depth=depth)


def _record_gates(model) -> dict[int, list[torch.Tensor]]:
    calls = {index: [] for index in (1, 2)}
    for index in calls:
        model.model.layers[index].mlp.gate.register_forward_hook(
            lambda m, args, out, i=index: calls[i].append(out[-1].clone()))
    return calls


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("depth", [0, 1, 2, TOP_K])
def test_every_depth_decodes_bitwise_and_gathers_only_its_ranks_ahead(model, reference, batch, depth):
    routed_model, routed = _routed(model, depth)
    assert routed.prefetch_depth == {1: depth, 2: depth}
    calls = _record_gates(routed_model)
    ids, logits = _decode(routed_model, batch, 6, reset=routed.reset_counters)
    expected_ids, expected_logits = reference[batch]
    assert torch.equal(ids, expected_ids) and all(torch.equal(a, b) for a, b in zip(expected_logits, logits))
    fetched = {kind: b // routed.expert_bytes for kind, b in routed.fetched_bytes_by_kind().items()}
    # per decode step, layers 1 and 2 see the prediction's call, then the MoE block's (call 0: the prefill)
    predicted = {i: calls[i][1::2] for i in calls}
    actual = {i: calls[i][2::2] for i in calls}

    def distinct(index, top_k_ids):
        return set(top_k_ids.flatten().tolist()) - set(ROUTED[index])

    ahead = sum(len(distinct(i, p[:, :depth])) for i in calls for p in predicted[i])
    hits = sum(len(distinct(i, p[:, :depth]) & distinct(i, a)) for i in calls for p, a in zip(predicted[i], actual[i]))
    routed_total = sum(len(distinct(i, a)) for i in calls for a in actual[i])
    if depth == 0:  # predicted, nothing gathered ahead: layers 1 and 2 fetch after their routers
        assert fetched["prefetched"] == fetched["wasted"] == fetched["missed"] == 0
        assert fetched["unpredicted"] >= routed_total
    else:
        assert fetched["prefetched"] == hits and fetched["prefetched"] + fetched["wasted"] == ahead
        assert fetched["prefetched"] + fetched["missed"] == routed_total
    # accuracy by rank, every rank whatever the depth: the predicted expert of rank r among that token's routed
    for index in calls:
        pairs = list(zip(predicted[index], actual[index]))
        expected = [sum(int((p[:, r:r + 1] == a).any(-1).sum()) for p, a in pairs) / (len(pairs) * batch)
                    for r in range(TOP_K)]
        assert routed.rank_accuracy(index) == pytest.approx(expected)
    assert routed.rank_accuracy_by_layer().keys() == {1, 2}
    assert routed.rank_counts[:, 1].sum() == 2 * 6 * batch * TOP_K  # two predicted layers, 6 steps, every rank


def test_depth_per_layer_and_a_bad_depth_is_one_line(model):
    routed_model, routed = _routed(model, {1: 0, 2: 3})
    assert routed.prefetch_depth == {1: 0, 2: 3}
    routed.set_prefetch_depth(None)
    assert routed.prefetch_depth == {1: TOP_K, 2: TOP_K}
    for bad, words in ((TOP_K + 1, "from 0 to the router's top-k (4)"), (-1, "from 0"), ({0: 1}, "nothing predicts"),
                       (1.5, "whole number")):
        with pytest.raises(PlanError) as error:
            routed.set_prefetch_depth(bad)
        assert words in str(error.value) and "\n" not in str(error.value) and len(str(error.value)) < 300


def test_rank_counting_can_be_left_out_of_the_step(model, reference):
    routed_model, routed = _routed(model, 2)
    routed.count_ranks = False
    ids, logits = _decode(routed_model, 1, 6, reset=routed.reset_counters)
    assert torch.equal(ids, reference[1][0]) and all(torch.equal(a, b) for a, b in zip(reference[1][1], logits))
    assert not routed.rank_counts.any() and routed.rank_accuracy() == (None,) * TOP_K
    assert routed.fetched_bytes_by_kind()["prefetched"] > 0
