"""CPU experts inside the captured decode step on a CUDA GPU: a host node launched through ctypes replays with its
graph; routed layers with CPU experts decode graphed within the bf16 tolerance of the all-resident model, with its
greedy tokens, eager within the tolerance of graphed, the CPU experts never fetched and their pairs counted.

Skipped without a GPU (CI); run on the device: PYTHONPATH=. python3 -m pytest tests/runtime/test_cpu_handoff_gpu.py
(scripts/smoke_cpu_experts_graph.py checks the same in under two minutes and times the handoff).
"""

import copy

import pytest
import torch

from runtime.backend import CudaBackend
from runtime.cpu_experts import BF16_TOLERANCE
from runtime.cpu_handoff import HOST_FN, launch_host_func
from runtime.routed_layers import apply_routed_experts
from tests.helpers import greedy_decode
from tests.runtime_models import routed_moe_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
#: layer -> resident ids over 32 experts (tests/runtime/test_routed_experts_gpu.py's); layer 3 all-resident
ROUTED = {0: (1, 5, 9, 30), 1: (), 2: tuple(range(24))}
#: layer -> CPU experts: some of layer 0's non-resident, a third of layer 1's, two of layer 2's eight
CPU = {0: (0, 2, 4, 6, 8, 10), 1: tuple(range(0, 32, 3)), 2: (24, 27)}
NUM_STEPS = 16


@pytest.fixture(scope="module")
def model():
    return routed_moe_model(hidden=256, num_experts=32, top_k=4, dtype=torch.bfloat16)


def _decode(model, batch: int, graphed: bool, after_capture=None):
    ids, logits = greedy_decode(model, batch, graphed, NUM_STEPS, after_capture)
    return ids, [out.float() for out in logits]


def _within(actual, reference, tolerance=BF16_TOLERANCE):
    return all((a - b).abs().max() <= tolerance * b.abs().max() for a, b in zip(actual, reference))


def test_a_host_node_launched_through_ctypes_replays_with_its_graph():
    calls = []
    callback = HOST_FN(lambda _user_data: calls.append(1))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launch_host_func(stream, callback)  # eagerly: runs once the stream gets there
    stream.synchronize()
    assert len(calls) == 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_host_func(torch.cuda.current_stream(), callback)
    torch.cuda.synchronize()
    assert len(calls) == 1  # captured, not run
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert len(calls) == 4


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("cpu_dtype", ["fp32", "bf16"])
def test_graphed_decode_with_cpu_experts_is_within_the_tolerance(model, batch, cpu_dtype):
    """Graphed steps: greedy tokens of the all-resident model, logits within BF16_TOLERANCE x their largest
    magnitude; eager steps within the same of the graphed; the CPU's pairs counted in the callbacks."""
    expected_ids, expected_logits = _decode(copy.deepcopy(model).to(CUDA), batch, graphed=False)
    routed_model = copy.deepcopy(model)
    routed = apply_routed_experts(routed_model, ROUTED, 4 * batch, CudaBackend(CUDA), cpu=CPU, cpu_dtype=cpu_dtype)
    routed_model.to(CUDA)
    try:
        ids, logits = _decode(routed_model, batch, graphed=True, after_capture=routed.reset_counters)
        stats = routed.cpu_stats()
        assert torch.equal(ids, expected_ids)
        assert _within(logits, expected_logits)
        assert stats["calls"] == len(CPU) * NUM_STEPS and stats["pairs_cpu"] > 0 and stats["callback_s"] > 0
        eager_ids, eager_logits = _decode(routed_model, batch, graphed=False)
        assert torch.equal(eager_ids, ids) and _within(eager_logits, logits)
    finally:
        routed.close()


def test_cpu_experts_are_never_fetched(model):
    """Eager steps (the same host node, run in stream order): the fetch counter counts the routed experts neither
    resident nor on the CPU, and the callbacks count every pair routed to a CPU expert; the routing is the routed
    model's own (its hidden states differ from the all-resident model's within the tolerance, and a router near a
    tie may choose otherwise)."""
    batch = 2
    routed_model = copy.deepcopy(model)
    routed = apply_routed_experts(routed_model, ROUTED, 4 * batch, CudaBackend(CUDA), cpu=CPU)
    routed_model.to(CUDA)
    calls = {index: [] for index in ROUTED}
    for index in ROUTED:
        routed_model.model.layers[index].mlp.experts.register_forward_pre_hook(
            lambda m, args, i=index: calls[i].append(args[1].clone()))
    try:
        _decode(routed_model, batch, graphed=False, after_capture=routed.reset_counters)
        decode_calls = {index: [top_k.cpu() for top_k in calls[index][1:]] for index in ROUTED}  # 0: the prefill
        expected = sum(len(set(top_k.flatten().tolist()) - set(ROUTED[index]) - set(CPU.get(index, ())))
                       for index in ROUTED for top_k in decode_calls[index])
        assert routed.fetched_bytes() == expected * routed.expert_bytes
        cpu_pairs = sum(int(torch.isin(top_k, torch.tensor(CPU[index])).sum())
                        for index in CPU for top_k in decode_calls[index])
        assert routed.cpu_stats()["pairs_cpu"] == cpu_pairs > 0
    finally:
        routed.close()
