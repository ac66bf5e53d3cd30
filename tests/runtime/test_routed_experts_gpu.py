"""Routed experts on a CUDA GPU: the gather from mapped host memory, graphed greedy decode bitwise equal to the
all-resident model computed with batched_mm, fetched bytes counted inside replays; with next-layer prefetch
(a side stream forked and joined inside the captured step), the same, and the fetch counters split.

Skipped without a GPU (CI); run on the device: PYTHONPATH=. python3 -m pytest tests/runtime/test_routed_experts_gpu.py
"""

import copy

import pytest
import torch

from runtime.backend import CudaBackend
from runtime.graph import DecodeLoop
from runtime.routed_layers import apply_routed_experts
from runtime.uva_gather import device_view, gather_rows
from tests.helpers import greedy_decode, seeded_prompt
from tests.runtime_models import routed_moe_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
#: layer -> resident ids over 32 experts: some resident, none, most; layer 3 stays all-resident
ROUTED = {0: (1, 5, 9, 30), 1: (), 2: tuple(range(24))}
NUM_STEPS = 64


@pytest.fixture(scope="module")
def model():
    return routed_moe_model(hidden=256, num_experts=32, top_k=4, dtype=torch.bfloat16)


def test_gather_from_mapped_host_memory_inside_a_graph():
    """Only the slots asked for are written, and a replay gathers the experts its indices name now."""
    backend = CudaBackend(CUDA)
    host = torch.randn(16, 64, 48).to(torch.bfloat16)
    backend.pin(host, mapped=True)
    try:
        source = device_view(host, CUDA)
        assert source.device.type == "cuda" and source.data_ptr() == host.data_ptr()
        destination = torch.zeros(4, 64, 48, dtype=torch.bfloat16, device=CUDA)
        ids = torch.tensor([3, -1, 15, -1], device=CUDA)
        gather_rows(source, destination, ids)  # compiles the kernel outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gather_rows(source, destination, ids)
        destination.zero_()
        ids.copy_(torch.tensor([7, 2, -1, -1]))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(destination[0].cpu(), host[7]) and torch.equal(destination[1].cpu(), host[2])
        assert not destination[2:].any()
    finally:
        backend.unpin(host)


@pytest.mark.parametrize("max_programs", [None, 3])
def test_a_split_experts_gather_inside_a_graph_is_the_torch_twins(max_programs):
    """The Triton gather with a part (runtime.uva_gather): bf16 gate_up and down from mapped host memory, one slot
    the part's (its first rows zero), replayed with another part and other ids: each replay equals the CPU twin."""
    from runtime.uva_gather import part_layout

    backend = CudaBackend(CUDA)
    hidden, intermediate = 64, 96
    hosts = {"gate_up_proj": torch.randn(12, 2 * intermediate, hidden).to(torch.bfloat16),
             "down_proj": torch.randn(12, hidden, intermediate).to(torch.bfloat16)}
    for host in hosts.values():
        backend.pin(host, mapped=True)
    try:
        ids = torch.tensor([3, -1, 11, 5], device=CUDA)
        part = torch.tensor([11, 32, 2], device=CUDA)
        slots = {name: torch.full((4, *host.shape[1:]), 7.0, dtype=torch.bfloat16, device=CUDA)
                 for name, host in hosts.items()}

        def gather():
            for name, host in hosts.items():
                gather_rows(device_view(host, CUDA), slots[name], ids, max_programs=max_programs, part=part,
                            layout=part_layout(name, tuple(host.shape[1:])))

        gather()  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gather()
        for new_ids, new_part in (([3, -1, 11, 5], [11, 32, 2]), ([0, 7, -1, 2], [0, 80, 0]), ([4, 1, -1, -1],
                                                                                             [-1, 0, -1])):
            ids.copy_(torch.tensor(new_ids))
            part.copy_(torch.tensor(new_part))
            for slot in slots.values():
                slot.fill_(7.0)
            graph.replay()
            torch.cuda.synchronize()
            for name, host in hosts.items():
                want = torch.full((4, *host.shape[1:]), 7.0, dtype=torch.bfloat16)
                gather_rows(host, want, torch.tensor(new_ids), part=torch.tensor(new_part),
                            layout=part_layout(name, tuple(host.shape[1:])))
                assert torch.equal(slots[name].cpu(), want), (name, new_part)
    finally:
        for host in hosts.values():
            backend.unpin(host)


def _decode(model, batch: int, graphed: bool, after_capture=None):
    return greedy_decode(model, batch, graphed, NUM_STEPS, after_capture)


def _record_routing(model):
    calls = {index: [] for index in ROUTED}
    for index in ROUTED:
        experts = model.model.layers[index].mlp.experts
        experts.register_forward_pre_hook(lambda m, args, i=index: calls[i].append(args[1].cpu()))
    return calls


@pytest.mark.parametrize("batch", [1, 4])
def test_graphed_routed_decode_bitwise_equal_over_64_tokens(model, batch):
    """Greedy decode through route-fetched layers, captured in CUDA graphs, gives the same tokens with every
    step's logits bitwise equal to the all-resident model's (batched_mm, eager); the device counter counts
    exactly the distinct routed non-resident experts of every step."""
    reference = copy.deepcopy(model).to(CUDA)
    calls = _record_routing(reference)
    expected_ids, expected_logits = _decode(reference, batch, graphed=False)
    expected_experts = sum(len(set(top_k.flatten().tolist()) - set(ROUTED[index]))
                           for index in ROUTED for top_k in calls[index][1:])  # call 0 is the prefill
    del reference
    routed_model = copy.deepcopy(model)
    routed = apply_routed_experts(routed_model, ROUTED, 4 * batch, CudaBackend(CUDA))
    routed_model.to(CUDA)
    try:
        ids, logits = _decode(routed_model, batch, graphed=True, after_capture=routed.reset_counters)
        assert torch.equal(ids, expected_ids)
        assert all(torch.equal(a, b) for a, b in zip(logits, expected_logits))
        assert routed.fetched_bytes() == expected_experts * routed.expert_bytes
    finally:
        routed.close()


@pytest.mark.parametrize("prefetch", [False, True], ids=["fetch after router", "next-layer prefetch"])
def test_plan_with_routed_layers_streams_and_decodes_graphed(tmp_path, prefetch):
    """Through the loader: layers offloaded whole and routed layers in one plan, streamed from the files,
    graphed decode bitwise equal to the all-resident model (the plan's experts.prefetch on or off)."""
    from types import SimpleNamespace as NS

    from runtime.load import build_model, stream_model
    from tests.runtime_models import plan_with, save_tiny_moe
    from tests.runtime.test_routed_experts import _with_experts

    checkpoint = save_tiny_moe(tmp_path / "moe", hidden=256)
    plan = plan_with(checkpoint, 7, 2, 1, tokens=1, sequences=1, context=40, cuda_graph=True)
    routed = {index: (1,) if index % 2 else () for index in range(7) if index not in plan.offload.layers}
    reference = build_model(str(checkpoint), None).to(CUDA)
    expected = _decode(reference, 1, graphed=False)
    plan = _with_experts(plan, routed, fetch_slots=2)
    if prefetch:
        plan = NS(**{**vars(plan), "experts": NS(**{**vars(plan.experts), "prefetch": "next_layer_router"})})
    model, engine = stream_model(checkpoint, plan, CudaBackend(CUDA))
    assert engine.routed_experts.prefetch == prefetch
    assert bool(engine.routed_experts.predictors) == prefetch, engine.routed_experts.prefetch_refusals
    try:
        loop = DecodeLoop(model, batch=1, max_cache_tokens=40 + NUM_STEPS + 16, device=CUDA, engine=engine,
                          steps_per_call=1)
        loop.prefill(seeded_prompt(1))
        loop.capture()
        ids, logits = loop.generate(NUM_STEPS)
        assert torch.equal(ids.cpu(), expected[0])
        assert all(torch.equal(a.cpu(), b) for a, b in zip(logits, expected[1]))
        assert engine.routed_experts.fetched_bytes() > 0
    finally:
        engine.close()


def test_bounded_gather_on_a_side_stream_inside_a_graph():
    """The prefetch's bounded grid (2 persistent programs) on a side stream forked and joined in the capture
    writes what the full grid writes."""
    backend = CudaBackend(CUDA)
    host = torch.randn(16, 64, 480).to(torch.bfloat16)  # 15 blocks of GATHER_BLOCK_WORDS per row
    backend.pin(host, mapped=True)
    try:
        source = device_view(host, CUDA)
        destination = torch.zeros(4, 64, 480, dtype=torch.bfloat16, device=CUDA)
        ids = torch.tensor([3, -1, 15, 0], device=CUDA)
        side = torch.cuda.Stream()

        def forked():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                gather_rows(source, destination, ids, max_programs=2)
            torch.cuda.current_stream().wait_stream(side)

        forked()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forked()
        destination.zero_()
        ids.copy_(torch.tensor([7, 2, -1, 9]))
        graph.replay()
        torch.cuda.synchronize()
        for slot, expert in ((0, 7), (1, 2), (3, 9)):
            assert torch.equal(destination[slot].cpu(), host[expert])
        assert not destination[2].any()
    finally:
        backend.unpin(host)


@pytest.mark.parametrize("batch", [1, 4])
def test_graphed_prefetch_decode_bitwise_and_counter_split(model, batch):
    """Next-layer prefetch inside the captured step: the same tokens and bitwise logits as the all-resident model;
    the prefetched hits, misses and the first routed layer's unpredicted fetches cover the routing exactly."""
    reference = copy.deepcopy(model).to(CUDA)
    calls = _record_routing(reference)
    expected_ids, expected_logits = _decode(reference, batch, graphed=False)

    def distinct(index):
        return sum(len(set(top_k.flatten().tolist()) - set(ROUTED[index])) for top_k in calls[index][1:])

    first = min(ROUTED)
    del reference
    routed_model = copy.deepcopy(model)
    routed = apply_routed_experts(routed_model, ROUTED, 4 * batch, CudaBackend(CUDA), prefetch=True)
    routed_model.to(CUDA)
    assert sorted(routed.predictors) == [0, 1], f"prefetch off: {routed.prefetch_refusals}"
    assert routed.stream is not None
    try:
        ids, logits = _decode(routed_model, batch, graphed=True, after_capture=routed.reset_counters)
        assert torch.equal(ids, expected_ids)
        assert all(torch.equal(a, b) for a, b in zip(logits, expected_logits))
        fetched = {kind: b // routed.expert_bytes for kind, b in routed.fetched_bytes_by_kind().items()}
        assert fetched["unpredicted"] == distinct(first)
        assert fetched["prefetched"] + fetched["missed"] == sum(distinct(i) for i in ROUTED if i != first)
        assert fetched["prefetched"] > 0
    finally:
        routed.close()


@pytest.mark.parametrize("depth", [0, 2])
def test_graphed_prefetch_at_a_depth_decodes_bitwise_and_counts_every_rank(model, depth):
    """Prefetch depth m inside the captured step (the top m of each token's 4 predicted ranks gathered ahead;
    0: predicted and counted, fetched after the router): bitwise logits, nothing gathered ahead at m = 0, and the
    prediction counted at every rank of both predicted layers in every replayed step."""
    reference = copy.deepcopy(model).to(CUDA)
    expected_ids, expected_logits = _decode(reference, 1, graphed=False)
    del reference
    routed_model = copy.deepcopy(model)
    routed = apply_routed_experts(routed_model, ROUTED, 4, CudaBackend(CUDA), prefetch=True, prefetch_depth=depth)
    routed_model.to(CUDA)
    assert sorted(routed.predictors) == [0, 1], f"prefetch off: {routed.prefetch_refusals}"
    try:
        ids, logits = _decode(routed_model, 1, graphed=True, after_capture=routed.reset_counters)
        assert torch.equal(ids, expected_ids)
        assert all(torch.equal(a, b) for a, b in zip(logits, expected_logits))
        fetched = {kind: b // routed.expert_bytes for kind, b in routed.fetched_bytes_by_kind().items()}
        if depth == 0:
            assert fetched["prefetched"] == fetched["wasted"] == fetched["missed"] == 0
        else:
            assert fetched["prefetched"] + fetched["wasted"] > 0
        assert int(routed.rank_counts[:, 1].sum()) == 2 * NUM_STEPS * 4
        assert all(a is not None and 0 <= a <= 1 for a in routed.rank_accuracy())
    finally:
        routed.close()


@pytest.mark.parametrize("prefetch", [False, True], ids=["fetch after router", "next-layer prefetch"])
def test_run_bench_counts_what_routed_steps_fetched(tmp_path, prefetch):
    """run --bench's decode steps report the routed experts they fetched: with no expert resident, each routed
    layer of a one-sequence step brings its top_k distinct experts (exactly, without prefetch; at least, with it,
    wasted predictions on top), and a predicting plan's per-rank accuracy is measured beside the plan's."""
    from types import SimpleNamespace as NS

    from runtime.bench import run_decode_bench
    from runtime.load import Loaded, stream_model
    from tests.runtime_models import plan_with, save_tiny_moe
    from tests.runtime.test_routed_experts import _with_experts

    checkpoint = save_tiny_moe(tmp_path / "moe", hidden=256)
    plan = plan_with(checkpoint, 7, 2, 1, tokens=1, sequences=1, context=40, cuda_graph=True)
    routed_layers = [index for index in range(7) if index not in plan.offload.layers]
    plan = _with_experts(plan, {index: () for index in routed_layers}, fetch_slots=2)
    rows = tuple(NS(**vars(row), routed=True) for row in plan.experts.layers)
    accuracy = (0.9, 0.7)
    plan = NS(**{**vars(plan), "experts": NS(**{**vars(plan.experts), "layers": rows, "prefetch_rank_accuracy":
                                                accuracy, "prefetch": "next_layer_router" if prefetch else None})})
    model, engine = stream_model(checkpoint, plan, CudaBackend(CUDA))
    try:
        result = run_decode_bench(Loaded(model=model, engine=engine, plan=plan, weights_gpu_bytes=0), 10,
                                  cuda_graph=True)
        expert_bytes = engine.routed_experts.expert_bytes
    finally:
        engine.close()
    fetched = result.routed
    assert fetched is not None and fetched.num_steps >= 10
    exact = len(routed_layers) * 2 * expert_bytes  # top_k 2, every expert fetched
    by_kind = fetched.bytes_per_step_by_kind
    if prefetch:
        assert by_kind["prefetched"] + by_kind["missed"] + by_kind["unpredicted"] == pytest.approx(exact)
        assert len(fetched.rank_accuracy) == 2 and all(0 <= share <= 1 for share in fetched.rank_accuracy)
        assert fetched.planned_prefetch_accuracy == pytest.approx(0.8)
    else:
        assert fetched.fetched_bytes_per_step == pytest.approx(exact)
        assert fetched.rank_accuracy == () and fetched.planned_rank_accuracy is None
