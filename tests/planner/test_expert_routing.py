"""Which experts a step touches (planner.model.expert_routing)."""

import pytest

from planner.model.expert_routing import LayerRouting


def test_skewed_routing_keeps_the_hottest_experts_and_hits_more():
    # 20% of the experts take 80% of the assignments
    num_experts, top_k = 10, 2
    hot, cold = 0.8 * top_k / 2, 0.2 * top_k / 8
    shares = tuple(hot if e in (3, 7) else cold for e in range(num_experts))
    routing = LayerRouting(index=0, shares=shares)
    assert routing.hottest(2) == (3, 7)
    assert routing.hit_rate((3, 7)) == pytest.approx(0.8)
    uniform = LayerRouting(index=0, shares=(top_k / num_experts,) * num_experts)
    assert uniform.hottest(2) == (0, 1)
    assert uniform.hit_rate((0, 1)) == pytest.approx(0.2)
    # at one token, the hot pair saves more of the expected fetch than the first two ids would
    assert routing.expected_fetched((3, 7), 1) < routing.expected_fetched((0, 1), 1)
    assert routing.expected_distinct(1) == pytest.approx(sum(1 - (1 - p) for p in shares))
