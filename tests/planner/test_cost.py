"""planner.model.cost: the KV traffic of a step over a cache where query heads share KV heads."""

import pytest

from planner.model.cost import ModelGeometry, Workload, gqa_kv_traffic, layer_cost
from planner.model.layout import LayerInfo


def _geometry(num_heads: int, num_kv_heads: int) -> ModelGeometry:
    return ModelGeometry(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=128, num_experts=0, top_k=0)


DECODE = Workload(tokens_per_step=4, sequences_per_step=4, context_tokens=4096)
CHUNK = Workload(tokens_per_step=2048, sequences_per_step=1, context_tokens=0)


@pytest.mark.parametrize(("heads", "kv_heads", "workload", "expected"), [
    (32, 4, DECODE, 17.0),  # Qwen3-MoE: each KV head expanded to 8 query heads, written and read
    (32, 8, DECODE, 9.0),  # Mixtral
    (16, 16, DECODE, 1.0),  # OLMoE: no sharing, the cache read once
    (32, 4, CHUNK, 1.0),  # a new sequence's chunk: no cache, no mask, the kernel shares KV heads
])
def test_gqa_kv_traffic(heads, kv_heads, workload, expected):
    assert gqa_kv_traffic(_geometry(heads, kv_heads), workload) == expected


def test_a_shared_kv_head_decode_step_moves_the_expanded_cache():
    layer = LayerInfo(index=0, params=(("mlp.down_proj.weight", "BF16", (2048, 2048), 2048 * 2048 * 2),))
    kv_bytes = 1e8
    shared = layer_cost(layer, _geometry(32, 4), DECODE, kv_bytes=kv_bytes)
    unshared = layer_cost(layer, _geometry(32, 32), DECODE, kv_bytes=kv_bytes)
    assert shared.hbm_bytes - unshared.hbm_bytes == pytest.approx(16 * kv_bytes)  # the expansion's copies, reads
    assert shared.stream_bytes == unshared.stream_bytes == kv_bytes  # the cache's own read, once either way
    engine = layer_cost(layer, _geometry(32, 4), DECODE, kv_bytes=kv_bytes, expand_kv_heads=False)
    assert engine.hbm_bytes == unshared.hbm_bytes
