"""Routed placements: resident experts within the budget, the buffers and what a step fetches
(planner.model.expert_placement)."""

import pytest

from planner.model.activations import decode_copies_pairs

from planner.model.expert_placement import choose_resident, decode_gather_bytes, routed_placement
from planner.model.expert_routing import LayerRouting, uniform_routing
from planner.model.experts import ROUTED_FETCH_EFFICIENCY, MoeGeometry, MoeLayer


def test_resident_experts_spread_over_layers_and_follow_the_savings():
    layers = tuple(MoeLayer(index=i, expert_bytes=100, other_bytes=50) for i in range(3))
    geometry = MoeGeometry(num_experts=8, top_k=2, layers=layers, unroutable_reason=None)
    # uniform: the layers take turns, each its first ids
    assert choose_resident(geometry, uniform_routing(geometry), 1, 700) == ((0, 1, 2), (0, 1), (0, 1))
    skewed = list(uniform_routing(geometry))
    skewed[2] = LayerRouting(index=2, shares=(0.9, 0.9, 0.05, 0.05, 0.025, 0.025, 0.025, 0.025))
    chosen = choose_resident(geometry, tuple(skewed), 1, 300)
    assert chosen[2] == (0, 1) and sum(map(len, chosen)) == 3
    assert choose_resident(geometry, uniform_routing(geometry), 1, 99) == ((), (), ())


@pytest.mark.parametrize("dtype, gathered", [("F32", 1000), ("BF16", 0)])
def test_routed_placement_counts_buffers_and_fetch_rate(dtype, gathered):
    layers = tuple(MoeLayer(index=i, expert_bytes=1000, other_bytes=500) for i in range(2))
    geometry = MoeGeometry(num_experts=4, top_k=1, layers=layers, unroutable_reason=None, expert_dtype=dtype)
    totals = (4500, 4500)
    # base: non-layer 100 + 2 x 500 non-expert + fetch buffer (1 slot) 1000 + staging (4 slots) 4000 + the decode
    # gather of 1 token x top-1 = 1 pair's weights 1000 where batched_mm copies it (fp32); bf16's grouped_mm: none
    base = 100 + 1000 + 1000 + 4000 + gathered
    assert routed_placement(geometry, uniform_routing(geometry), num_tokens=1, layer_total_bytes=totals,
                            non_layer_bytes=100, weight_limit_bytes=base - 1, h2d_bytes_per_s=1e9) is None
    placement = routed_placement(geometry, uniform_routing(geometry), num_tokens=1, layer_total_bytes=totals,
                                 non_layer_bytes=100, weight_limit_bytes=base + 2000, h2d_bytes_per_s=1e9)
    assert [row.resident for row in placement.layers] == [(0,), (0,)]
    # every expert pinned on the host, resident ones too (the runtime pins whole fused params)
    assert placement.weight_bytes == base + 2000 and placement.host_pinned_bytes == 2 * 4 * 1000
    assert placement.gather_workspace_bytes == gathered
    # one token touches one of 4 experts: 3/4 of the time a non-resident one, fetched at the derated rate
    assert placement.layers[0].expected_fetched_bytes == pytest.approx(750)
    assert placement.layers[0].fetch_ms == pytest.approx(1e3 * 750 / (1e9 * ROUTED_FETCH_EFFICIENCY))
    assert placement.layers[0].hit_rate == pytest.approx(0.25)


def test_the_decode_gather_holds_every_routed_pair_and_none_past_the_experts():
    assert decode_gather_bytes(num_tokens=4, top_k=8, num_experts=64, expert_bytes=12, copies_pairs=True) == 32 * 12
    assert decode_gather_bytes(num_tokens=8, top_k=8, num_experts=64, expert_bytes=12, copies_pairs=True) == 64 * 12
    # 72 pairs over 64 experts: the step runs the prefill path over the staging buffer, which gathers nothing
    assert decode_gather_bytes(num_tokens=9, top_k=8, num_experts=64, expert_bytes=12, copies_pairs=True) == 0
    # grouped_mm reads the buffer in place
    assert decode_gather_bytes(num_tokens=4, top_k=8, num_experts=64, expert_bytes=12, copies_pairs=False) == 0


def test_only_experts_grouped_mm_cannot_take_copy_their_pairs():
    """bf16 decodes through grouped_mm (no copy); fp16 and fp32 through batched_mm (runtime.experts_impl's
    fallback), which copies every pair."""
    assert not decode_copies_pairs("BF16")
    assert decode_copies_pairs("F16") and decode_copies_pairs("F32")
