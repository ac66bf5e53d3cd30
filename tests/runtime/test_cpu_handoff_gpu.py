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
from runtime.cpu_handoff import HANDOFFS, HOST_FN, launch_host_func
from runtime.cpu_kernel import load_kernel
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


def _agree_but_at_near_ties(actual, reference, tolerance=BF16_TOLERANCE) -> int:
    """Per-step logits [batch, vocab] of two greedy decodes: each sequence's logits are within ``tolerance`` x the
    step's largest reference magnitude, and its greedy token is the reference's, until a step whose reference top
    two are within twice that (a near tie the tolerance admits: the CPU's arithmetic may pick either); from there
    the sequences decode different tokens and are compared no further. Returns how many sequences split so
    (printed by -s runs)."""
    split = torch.zeros(reference[0].shape[0], dtype=torch.bool)
    for step_actual, step_reference in zip(actual, reference):
        bound = tolerance * step_reference.abs().max()
        live = ~split
        assert (step_actual[live] - step_reference[live]).abs().max() <= bound, "logits beyond the tolerance"
        differ = live & (step_actual.argmax(-1) != step_reference.argmax(-1))
        for sequence in differ.nonzero().flatten().tolist():
            top_two = step_reference[sequence].topk(2).values
            assert top_two[0] - top_two[1] <= 2 * bound, "a greedy token differs where the reference has no tie"
        split |= differ
    return int(split.sum())


def _closeness(actual, reference) -> str:
    """The share of logits bitwise equal to the reference's and the largest difference over the step's largest
    reference magnitude, over every step (printed by -s runs)."""
    equal = sum(int((a == b).sum()) for a, b in zip(actual, reference)) / sum(b.numel() for b in reference)
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(actual, reference))
    return f"logits bitwise equal {equal:.4f}, worst {worst:.2e} of the largest"


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
@pytest.mark.parametrize("handoff", HANDOFFS)
def test_graphed_decode_with_cpu_experts_is_within_the_tolerance(model, batch, cpu_dtype, handoff, monkeypatch):
    """Graphed steps, by either handoff (runtime.cpu_handoff.HANDOFFS): greedy tokens of the all-resident model,
    logits within BF16_TOLERANCE x their largest magnitude, but where the all-resident model's top two tokens are
    within the tolerance (random weights make near ties; the CPU's bf16 arithmetic may break one the other way: seen
    once at batch 4, step 15, on the H100); eager steps within the same of the graphed; the CPU's pairs counted."""
    monkeypatch.setenv("OFFLOAD_PLAN_CPU_HANDOFF", handoff)
    expected_ids, expected_logits = _decode(copy.deepcopy(model).to(CUDA), batch, graphed=False)
    routed_model = copy.deepcopy(model)
    routed = apply_routed_experts(routed_model, ROUTED, 4 * batch, CudaBackend(CUDA), cpu=CPU, cpu_dtype=cpu_dtype)
    routed_model.to(CUDA)
    try:
        ids, logits = _decode(routed_model, batch, graphed=True, after_capture=routed.reset_counters)
        assert routed.cpu_experts.handoff == (handoff if load_kernel() is not None else "host-node")
        stats = routed.cpu_stats()
        print(f"sequences split at a near tie: {_agree_but_at_near_ties(logits, expected_logits)} of {batch}; "
              f"{_closeness(logits, expected_logits)}")
        assert stats["calls"] == len(CPU) * NUM_STEPS and stats["pairs_cpu"] > 0 and stats["callback_s"] > 0
        eager_ids, eager_logits = _decode(routed_model, batch, graphed=False)
        assert torch.equal(eager_ids, ids) and _within(eager_logits, logits)
    finally:
        routed.close()


#: a per-step split: every non-resident expert may go to the CPU; a step sends about half its misses there
SPLIT_CPU = {index: tuple(e for e in range(32) if e not in resident) for index, resident in ROUTED.items()}
SPLIT_TAKE = {index: tuple(m // 2 for m in range(17)) for index in ROUTED}
#: with fractions: a step with m misses sends m / 2 + 1/4 experts' worth, a quarter or three quarters of one expert's
#: rows split between the CPU and the link
PART_TAKE = {index: tuple(min(m, m / 2 + 0.25) for m in range(17)) for index in ROUTED}
#: the split expert first and another miss fetched whole: m - 1.25 experts' worth (m = 2: three quarters of the first
#: miss's rows on the CPU, the second miss over the link), the case of PhiMoE's conformance plan
PART_FIRST_TAKE = {index: tuple(max(0.0, m - 1.25) for m in range(17)) for index in ROUTED}


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("handoff", HANDOFFS)
@pytest.mark.parametrize("take", [SPLIT_TAKE, PART_TAKE, PART_FIRST_TAKE], ids=["whole", "rows", "rows-first"])
def test_graphed_decode_splitting_each_steps_misses_is_within_the_tolerance(model, batch, prefetch, handoff, take,
                                                                            monkeypatch):
    """A per-step split (cpu_take: the fused fetch plan picks the CPU's misses inside the captured step, after the
    prefetch's plan where one is pending), of whole experts or with one expert split by its rows: the all-resident
    model's greedy tokens but at near ties, logits within the bf16 tolerance, eager steps within the same of the
    graphed, and the CPU computes pairs."""
    monkeypatch.setenv("OFFLOAD_PLAN_CPU_HANDOFF", handoff)
    expected_ids, expected_logits = _decode(copy.deepcopy(model).to(CUDA), batch, graphed=False)
    routed_model = copy.deepcopy(model)
    routed = apply_routed_experts(routed_model, ROUTED, 4 * batch, CudaBackend(CUDA), cpu=SPLIT_CPU,
                                  cpu_dtype="bf16", cpu_take=take, prefetch=prefetch)
    routed_model.to(CUDA)
    try:
        ids, logits = _decode(routed_model, batch, graphed=True, after_capture=routed.reset_counters)
        stats = routed.cpu_stats()
        print(f"sequences split at a near tie: {_agree_but_at_near_ties(logits, expected_logits)} of {batch}; "
              f"{_closeness(logits, expected_logits)}")
        assert stats["calls"] == len(SPLIT_CPU) * NUM_STEPS and stats["pairs_cpu"] > 0
        fetched = routed.fetched_bytes_by_kind()
        assert fetched["missed"] + fetched["unpredicted"] > 0  # the link still takes the other misses
        eager_ids, eager_logits = _decode(routed_model, batch, graphed=False)
        assert torch.equal(eager_ids, ids) and _within(eager_logits, logits)
    finally:
        routed.close()


@pytest.mark.parametrize("handoff", HANDOFFS)
def test_tables_written_between_replays_split_the_next_replays(model, handoff, monkeypatch):
    """RoutedExperts.set_cpu_take after the capture (what run's re-splitter does between replays): a table sending
    the CPU nothing fetches every miss and computes no CPU expert, one sending every miss fetches none; the greedy
    tokens stay the all-resident model's but at near ties, logits within the bf16 tolerance."""
    monkeypatch.setenv("OFFLOAD_PLAN_CPU_HANDOFF", handoff)
    expected_ids, expected_logits = _decode(copy.deepcopy(model).to(CUDA), 1, graphed=False)
    routed_model = copy.deepcopy(model)
    routed = apply_routed_experts(routed_model, ROUTED, 4, CudaBackend(CUDA), cpu=SPLIT_CPU, cpu_dtype="bf16",
                                  cpu_take=SPLIT_TAKE)
    routed_model.to(CUDA)
    try:
        for tables, on_cpu in (({index: (0,) for index in ROUTED}, False),
                               ({index: tuple(range(33)) for index in ROUTED}, True)):
            def after_capture(tables=tables):
                routed.set_cpu_take(tables)
                routed.reset_counters()

            ids, logits = _decode(routed_model, 1, graphed=True, after_capture=after_capture)
            stats, fetched = routed.cpu_stats(), routed.fetched_bytes()
            assert (stats["experts_cpu"] > 0 and fetched == 0) if on_cpu else (stats["experts_cpu"] == 0 < fetched)
            _agree_but_at_near_ties(logits, expected_logits)
    finally:
        routed.close()


def test_the_resplitter_counts_the_steps_it_saw_inside_graphed_decode(model, monkeypatch):
    """runtime.cpu_resplit inside a graphed decode loop: each window's host steps are counted once they ran (the host
    queues replays far ahead of the GPU), a rate far off the price re-splits, and the next replays split by the new
    tables (here: nothing to the CPU)."""
    from types import SimpleNamespace as NS

    from runtime import cpu_resplit
    from runtime.graph import DecodeLoop
    from tests.helpers import seeded_prompt

    routed_model = copy.deepcopy(model)
    routed = apply_routed_experts(routed_model, ROUTED, 4, CudaBackend(CUDA), cpu=SPLIT_CPU, cpu_dtype="bf16",
                                  cpu_take=SPLIT_TAKE)
    routed_model.to(CUDA)
    # a price far below any CPU's: the first measured window reads the range's top
    plan = NS(experts=NS(cpu_layers=tuple(NS(index=index, cpu_ms_per_expert=1e-6) for index in SPLIT_CPU)))
    nothing = {index: (0,) for index in SPLIT_CPU}
    monkeypatch.setattr(cpu_resplit, "resplit_at_scale",
                        lambda _plan, scale: NS(tables=nothing, step_ms=1.0, planned_tables_step_ms=2.0))
    try:
        loop = DecodeLoop(routed_model, batch=1, max_cache_tokens=40 + 32, device=CUDA, steps_per_call=1)
        loop.resplit = cpu_resplit.CpuResplitter(plan, routed, window_steps=4)
        loop.prefill(seeded_prompt(1))
        loop.capture()
        loop.generate(12)  # windows end at 4 (the baseline), 8 (measured: re-split) and 12 (measured)
        assert loop.resplit.measured[0] == cpu_resplit.RESPLIT_SCALE_RANGE[1]
        assert len(loop.resplit.history) == 1 and routed.cpu_take == {index: (0.0,) for index in SPLIT_CPU}
        routed.reset_counters()
        loop.generate(4)
        assert routed.cpu_stats()["experts_cpu"] == 0 and routed.fetched_bytes() > 0
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


@pytest.mark.parametrize("handoff", HANDOFFS)
def test_the_handoff_round_trip_is_measured(handoff, monkeypatch):
    """calibrate's handoff figure: a captured graph of handoffs with no pair, each well under a layer step, by the
    kind asked for (the doorbell where the kernel loads)."""
    from runtime.calibrate import measure_handoff_ms

    monkeypatch.setenv("OFFLOAD_PLAN_CPU_HANDOFF", handoff)
    ms, kind = measure_handoff_ms(CUDA, threads=4)
    print(f"{kind}: {1e3 * ms:.1f} us a handoff")
    assert kind == (handoff if load_kernel() is not None else "host-node")
    assert 0 < ms < 2.0
