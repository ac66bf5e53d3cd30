"""runtime.cpu_handoff on the CPU: the host node's compute equals the hybrid layer's CPU part, the GPU part (CPU
experts at a zero row) plus the CPU part is the all-resident layer within the stated tolerance, the callback runs
through its ctypes wrapper and turns an error into NaN and one line, and routed greedy decode with CPU experts on
the CPU stand-in equals the all-resident model's tokens with the CPU experts never fetched and their pairs counted.
The CUDA side (side stream, host node inside a captured step) is tests/runtime/test_cpu_handoff_gpu.py."""

import copy
from types import SimpleNamespace as NS

import pytest
import torch

from planner.errors import PlanError, RuntimeUnavailableError
from runtime.backend import CpuStandIn
from runtime.cpu_experts import (BF16_DIFFERING_SHARE, BF16_ROUNDING, BF16_TOLERANCE, FP32_TOLERANCE, HostExperts,
                                 gpu_partial_sum, hybrid_experts_forward)
from runtime.cpu_handoff import CpuExperts, cpu_layer, cpu_partial_sum
from runtime.experts_impl import ExpertsProxy, batched_mm_forward
from runtime.routed_layers import apply_routed_experts, cpu_from_plan
from tests.runtime.test_routed_experts import ROUTED, _greedy, _record_routing, _routed_copy
from tests.runtime_models import routed_moe_model

NUM_EXPERTS = 16
CPU_IDS = (0, 3, 6, 9, 12, 15)
#: routed layer -> CPU experts: none of them resident (ROUTED's), layer 2 has one of its few non-resident ones
CPU = {0: (0, 2, 4, 6), 1: (3, 7, 11), 2: (13, 15)}


@pytest.fixture(scope="module")
def model():
    return routed_moe_model(num_experts=NUM_EXPERTS)


@pytest.fixture(scope="module")
def layer(model):
    """Layer 0's experts module of the tiny model (fp32) and a batch of 6 tokens' routing."""
    block = model.model.layers[0].mlp
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, weights, index = block.gate(hidden)
    assert set(index.flatten().tolist()) & set(CPU_IDS) and set(index.flatten().tolist()) - set(CPU_IDS)
    return block.experts, hidden, index, weights


def _cpu_layer(experts, dtype="fp32", ids=CPU_IDS):
    return cpu_layer(experts, experts.gate_up_proj.detach(), experts.down_proj.detach(), ids, dtype)


def _within(actual, reference, tolerance):
    return (actual.float() - reference.float()).abs().max() <= tolerance * reference.float().abs().max()


def _gpu_part(experts, hidden, index, weights, ids=CPU_IDS):
    """What the GPU computes: batched_mm's pairs over the device rows, the CPU experts' rows zero (the zero row),
    weighted and summed in fp32, not yet rounded (runtime.routed_experts adds the CPU's sum, then rounds)."""
    rows = {name: getattr(experts, name).detach().clone() for name in ("gate_up_proj", "down_proj")}
    for tensor in rows.values():
        tensor[list(ids)] = 0
    with torch.no_grad():
        return gpu_partial_sum(ExpertsProxy(experts, rows), hidden, index.reshape(-1), weights)


def _combined(experts, hidden, index, weights, out, ids=CPU_IDS):
    """The layer's output as the runtime finishes it: the GPU's fp32 sum plus the CPU's, rounded once."""
    return _gpu_part(experts, hidden, index, weights, ids).add_(out).to(hidden.dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_host_nodes_compute_is_the_hybrid_layers_cpu_part(layer, dtype):
    """The CPU's partial sum equals hybrid_experts_forward with only the CPU experts' pairs weighted (the device's
    pairs times 0), each computed from a host copy in ``dtype``."""
    experts, hidden, index, weights = layer
    on_cpu = torch.zeros(NUM_EXPERTS, dtype=torch.bool)
    on_cpu[list(CPU_IDS)] = True
    cpu_only_weights = torch.where(on_cpu[index], weights, torch.zeros_like(weights))
    with torch.no_grad():
        expected = hybrid_experts_forward(experts, hidden, index, cpu_only_weights,
                                          host=HostExperts.from_module(experts, dtype), on_cpu=on_cpu,
                                          placeholder_expert=1)
    out = torch.full_like(hidden, 7.0)
    pairs, num_experts = cpu_partial_sum(_cpu_layer(experts, dtype), hidden, index, weights, out)
    assert pairs == int(on_cpu[index].sum()) and num_experts == len(set(index[on_cpu[index]].tolist()))
    assert _within(out, expected, FP32_TOLERANCE if dtype == "fp32" else BF16_TOLERANCE)
    untouched = ~on_cpu[index].any(dim=1)  # tokens with no CPU pair: exactly zero
    assert untouched.any() and not out[untouched].any()


def test_gpu_part_plus_cpu_part_is_the_all_resident_layer(layer):
    experts, hidden, index, weights = layer
    with torch.no_grad():
        reference = batched_mm_forward()(experts, hidden, index, weights)
    out = torch.empty_like(hidden)
    cpu_partial_sum(_cpu_layer(experts), hidden, index, weights, out)
    assert _within(_combined(experts, hidden, index, weights, out), reference, FP32_TOLERANCE)
    assert not torch.equal(_gpu_part(experts, hidden, index, weights), reference)  # the CPU had pairs to add


@pytest.mark.parametrize("routing", [torch.bfloat16, torch.float32], ids=["routing-bf16", "routing-fp32"])
def test_a_bf16_layer_with_either_host_copy_rounds_as_the_gpu_does(layer, routing):
    """In bf16 the CPU rounds where batched_mm rounds (each expert's projections, SiLU, product and output, and each
    weighted pair where the router's weights are bf16, as Qwen3-MoE's are and Mixtral's are not), and the GPU rounds
    the whole sum once: the layer's output is the all-resident layer's but for rare elements where fp32 sums taken
    in another order round apart, each within one rounding. Without the CPU's rounding (fp32 throughout) nearly
    every element of a token with CPU pairs differed."""
    experts, hidden, index, weights = layer
    experts = copy.deepcopy(experts).to(torch.bfloat16)
    args = (hidden.bfloat16(), index, weights.to(routing))
    with torch.no_grad():
        reference = batched_mm_forward()(experts, *args)
    for dtype in ("fp32", "bf16"):
        out = torch.empty(hidden.shape)
        cpu_partial_sum(_cpu_layer(experts, dtype), *args, out)
        combined = _combined(experts, *args, out)
        assert combined.dtype == torch.bfloat16 and _within(combined, reference, BF16_TOLERANCE)
        differing = combined != reference
        assert differing.float().mean() <= BF16_DIFFERING_SHARE, float(differing.float().mean())
        bound = BF16_ROUNDING * reference.float().abs()[differing]  # one bf16 rounding of each such element
        assert ((combined.float() - reference.float()).abs()[differing] <= bound).all()


def test_the_host_copy_holds_only_the_cpu_experts_in_another_dtype(layer):
    experts = copy.deepcopy(layer[0]).to(torch.bfloat16)
    copied = _cpu_layer(experts, "fp32")
    assert copied.host.num_experts == len(CPU_IDS) and copied.host.gate_up.dtype == torch.float32
    assert copied.copy_bytes == copied.host.nbytes == len(CPU_IDS) * experts.gate_up_proj[0].numel() * 3 * 4 // 2
    in_place = _cpu_layer(experts, "bf16")  # the routed host copy's own dtype: read where it lies
    assert in_place.copy_bytes == 0 and in_place.host.gate_up.data_ptr() == experts.gate_up_proj.data_ptr()
    assert in_place.local[list(CPU_IDS)].tolist() == list(CPU_IDS)
    assert copied.local[list(CPU_IDS)].tolist() == list(range(len(CPU_IDS))) and copied.local[1] == -1


def _side(experts, threads=1):
    return CpuExperts({0: _cpu_layer(experts)}, hidden_size=64, max_pairs=16, hidden_dtype=torch.float32,
                      threads=threads, device=torch.device("cpu"), backend=CpuStandIn())


def _stage(side, hidden, index, weights):
    """The side's host buffers as the device-to-host copies leave them."""
    num_tokens, num_top_k = index.shape
    side.buffers["hidden"][:num_tokens].copy_(hidden)
    side.buffers["index"][:index.numel()].copy_(index.flatten())
    side.buffers["weights"][:index.numel()].copy_(weights.flatten())


@pytest.mark.parametrize("with_kernel", [True, False], ids=["c-host-step", "python-callback"])
def test_the_host_function_runs_and_counts(layer, with_kernel, monkeypatch):
    """The host node the driver would call, called here: where the C kernel computes, the kernel's own host_step
    through its struct (runtime.cpu_kernel.HostStep); otherwise the HOST_FN through its ctypes wrapper. Either
    writes the CPU's partial sum into the output buffer and counts the pairs; one node per (layer, tokens, k),
    kept; after close a captured node does nothing."""
    from runtime import cpu_kernel

    if not with_kernel:
        monkeypatch.setenv("OFFLOAD_PLAN_CPU_KERNEL", "0")
    cpu_kernel.reset_kernel()
    experts, hidden, index, weights = layer
    side = _side(experts)
    _stage(side, hidden, index, weights)
    node = side.host_node(0, *index.shape)
    assert side.host_node(0, *index.shape) is node
    assert isinstance(node, cpu_kernel.HostStep) == (with_kernel and cpu_kernel.load_kernel() is not None)
    run = node.run if isinstance(node, cpu_kernel.HostStep) else lambda: node(None)
    run()
    expected = torch.empty_like(hidden)
    pairs, num_experts = cpu_partial_sum(_cpu_layer(experts), hidden, index, weights, expected)
    assert torch.equal(side.buffers["out"][:hidden.shape[0]], expected)
    stats = side.stats()
    assert (stats["calls"], stats["pairs_total"], stats["pairs_cpu"], stats["experts_cpu"]) == \
        (1, index.numel(), pairs, num_experts)
    assert stats["pairs_share"] == pairs / index.numel() and stats["callback_s"] > 0
    side.reset()
    assert side.stats()["calls"] == 0
    side.close()
    run()  # after close a captured node does nothing
    assert side.stats()["calls"] == 0
    cpu_kernel.reset_kernel()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_per_step_index_sends_only_its_pairs_to_the_cpu(layer, dtype):
    """A per-step split's ring carries the CPU's pairs' ids and -1 for the GPU's, every expert a CPU id (read in
    place in fp32, or from a bf16 copy of all of them): the CPU sums exactly the pairs the index names."""
    experts, hidden, index, weights = layer
    mine = torch.rand(index.shape, generator=torch.Generator().manual_seed(5)) < 0.5
    assert mine.any() and not mine.all()
    masked = torch.where(mine, index, torch.full_like(index, -1))
    with torch.no_grad():
        expected = hybrid_experts_forward(experts, hidden, index, torch.where(mine, weights, torch.zeros_like(weights)),
                                          host=HostExperts.from_module(experts, dtype),
                                          on_cpu=torch.ones(NUM_EXPERTS, dtype=torch.bool), placeholder_expert=1)
    out = torch.full_like(hidden, 7.0)
    every = tuple(range(NUM_EXPERTS))
    pairs, num_experts = cpu_partial_sum(_cpu_layer(experts, dtype, every), hidden, masked, weights, out)
    assert pairs == int(mine.sum()) and num_experts == len(set(index[mine].tolist()))
    assert _within(out, expected, FP32_TOLERANCE if dtype == "fp32" else BF16_TOLERANCE)


def test_an_error_in_the_host_function_is_nan_then_one_line(layer):
    experts, hidden, index, weights = layer
    side = _side(experts)
    _stage(side, hidden, index, weights)
    side.host_node(1, *index.shape)(None)  # layer 1 has no CPU side here: the callback's KeyError is caught
    assert side.buffers["out"][:hidden.shape[0]].isnan().all()
    with pytest.raises(RuntimeUnavailableError) as error:
        side.stats()
    assert "layer 1" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(RuntimeUnavailableError):
        side.fork(0, hidden, index, weights)  # the next decode step too


def _reference_and_routed(model, batch: int, num_steps: int, **options):
    """(the all-resident model's routing per call, its greedy (ids, logits, prefill logits), a routed copy with
    ``options`` (apply_routed_experts'), its RoutedExperts)."""
    reference = copy.deepcopy(model)
    calls = _record_routing(reference, ROUTED)
    expected = _greedy(reference, batch, num_steps)
    routed_model = copy.deepcopy(model)
    routed_model.set_experts_implementation("batched_mm")
    routed = apply_routed_experts(routed_model, ROUTED, 2 * batch, CpuStandIn(), cpu_threads=1, **options)
    return calls, expected, routed_model, routed


def test_greedy_decode_with_cpu_experts_on_the_stand_in(model):
    """Routed layers with CPU experts: the all-resident model's tokens, logits within a few fp32 roundings, every
    CPU pair computed on the CPU side and no CPU expert fetched."""
    batch, num_steps = 2, 8
    calls, (ids, logits, prefill), routed_model, routed = _reference_and_routed(model, batch, num_steps, cpu=CPU)
    try:
        routed_ids, routed_logits, routed_prefill = _greedy(routed_model, batch, num_steps)
        assert torch.equal(routed_prefill, prefill)  # prefill stages every expert on the device, as before
        assert torch.equal(routed_ids, ids)
        assert all(_within(a, b, 1e-5) for a, b in zip(routed_logits, logits))
        decode_calls = {index: calls[index][1:] for index in ROUTED}  # call 0 is the prefill
        cpu_pairs = sum(int(torch.isin(top_k, torch.tensor(CPU[index])).sum())
                        for index in CPU for top_k in decode_calls[index])
        fetched = sum(len(set(top_k.flatten().tolist()) - set(ROUTED[index]) - set(CPU[index]))
                      for index in ROUTED for top_k in decode_calls[index])
        stats = routed.cpu_stats()
        assert stats["calls"] == len(CPU) * num_steps and stats["pairs_cpu"] == cpu_pairs > 0
        assert routed.fetched_bytes() == fetched * routed.expert_bytes
    finally:
        routed.close()


def test_without_cpu_experts_nothing_is_added(model):
    """A layer with no CPU experts is as without the argument: no CPU side, no zero row; one with is one row more."""
    _, plain = _routed_copy(model, fetch_slots=2)
    empty = apply_routed_experts(copy.deepcopy(model), ROUTED, 2, CpuStandIn(), cpu={0: ()})
    assert empty.cpu_experts is None and empty.zero_row is None and empty.cpu_stats() is None
    assert empty.device_bytes == plain.device_bytes and empty.cpu_host_bytes == 0
    with_cpu = apply_routed_experts(copy.deepcopy(model), ROUTED, 2, CpuStandIn(), cpu={0: (0,)})
    assert with_cpu.device_bytes == plain.device_bytes + with_cpu.expert_bytes  # the zero row
    for routed in (plain, empty, with_cpu):
        routed.close()


@pytest.mark.parametrize("cpu, options, wrong", [
    ({3: (0,)}, {}, "not routed"),
    ({0: (16,)}, {}, "distinct ids"),
    ({0: (2, 2)}, {}, "distinct ids"),
    ({0: (1, 2)}, {}, "both resident"),
    ({0: (2,)}, {"cpu_dtype": "fp16"}, "dtype"),
    ({0: (2,)}, {"cpu_threads": 0}, "thread"),
])
def test_bad_cpu_experts_are_one_line(model, cpu, options, wrong):
    with pytest.raises(PlanError, match=wrong) as error:
        apply_routed_experts(copy.deepcopy(model), ROUTED, 2, CpuStandIn(), cpu=cpu, **options)
    assert "\n" not in str(error.value)


def test_cpu_experts_are_read_from_the_plan_where_it_has_them():
    layers = (NS(index=0, regime="routed", resident=(1,), cpu=(2, 3)), NS(index=1, regime="routed", resident=()),
              NS(index=2, regime="whole_layer", resident=(), cpu=(4,)))
    plan = NS(experts=NS(layers=layers, fetch_slots=2, cpu=NS(dtype="bf16", threads=12)))
    assert cpu_from_plan(plan) == ({0: (2, 3)}, "bf16", 12)
    older = NS(experts=NS(layers=layers[1:2], fetch_slots=2))  # made before CPU experts
    assert cpu_from_plan(older) == ({}, "fp32", None)
    assert cpu_from_plan(NS()) == ({}, "fp32", None)


#: every non-resident expert of each routed layer may go to the CPU; a step sends about half its misses there
SPLIT_CPU = {index: tuple(e for e in range(NUM_EXPERTS) if e not in resident) for index, resident in ROUTED.items()}
SPLIT_TAKE = {index: tuple(m // 2 for m in range(9)) for index in ROUTED}


def _split_by_count(top_k: torch.Tensor, index: int) -> tuple[set, set]:
    """(experts the CPU computes, experts fetched) of one step without prefetch: the first j(m) misses by id."""
    missed = sorted(set(top_k.flatten().tolist()) - set(ROUTED[index]))
    take = SPLIT_TAKE[index]
    chosen = set(missed[:take[min(len(missed), len(take) - 1)]])
    return chosen, set(missed) - chosen


@pytest.mark.parametrize("prefetch", [False, True])
def test_greedy_decode_splitting_each_steps_misses_by_count(model, prefetch):
    """A per-step split (cpu_take): the all-resident model's tokens, logits within a few fp32 roundings; without
    prefetch exactly the first j(m) misses by id of each step go to the CPU and the rest are fetched."""
    batch, num_steps = 2, 8
    calls, (ids, logits, _), routed_model, routed = _reference_and_routed(model, batch, num_steps, cpu=SPLIT_CPU,
                                                                          cpu_take=SPLIT_TAKE, prefetch=prefetch)
    try:
        routed_ids, routed_logits, _ = _greedy(routed_model, batch, num_steps)
        assert torch.equal(routed_ids, ids)
        assert all(_within(a, b, 1e-5) for a, b in zip(routed_logits, logits))
        stats = routed.cpu_stats()
        assert stats["calls"] == len(ROUTED) * num_steps and stats["pairs_cpu"] > 0
        if not prefetch:
            steps = [(index, top_k) for index in ROUTED for top_k in calls[index][1:]]  # call 0 is the prefill
            splits = [(top_k, *_split_by_count(top_k, index)) for index, top_k in steps]
            pairs = sum(int(torch.isin(top_k, torch.tensor(sorted(chosen) or [-1])).sum()) for top_k, chosen, _ in
                        splits)
            assert stats["pairs_cpu"] == pairs
            assert stats["experts_cpu"] == sum(len(chosen) for _, chosen, _ in splits)
            assert routed.fetched_bytes() == sum(len(fetched) for *_, fetched in splits) * routed.expert_bytes
    finally:
        routed.close()


def test_a_bad_split_table_is_one_line(model):
    for cpu_take, wrong in (({0: (0, 2)}, "cpu_take\\[1\\]"), ({1: (0, 1)}, "no CPU experts")):
        with pytest.raises(PlanError, match=wrong) as error:
            apply_routed_experts(copy.deepcopy(model), ROUTED, 2, CpuStandIn(), cpu={0: (2, 3)}, cpu_take=cpu_take)
        assert "\n" not in str(error.value)


#: a fractional split: j(m) = m / 2 + 1/4, so each step with misses sends whole experts and the first quarter or
#: three quarters of one more expert's rows to the CPU (16 or 48 of the tiny model's 64)
PART_TAKE = {index: tuple(min(m, m / 2 + 0.25) for m in range(9)) for index in ROUTED}


def _split_with_part(top_k: torch.Tensor, index: int) -> tuple[set, int | None, set]:
    """(experts the CPU computes whole, the expert split by its rows or None, experts fetched, the split one
    included) of one step without prefetch."""
    missed = sorted(set(top_k.flatten().tolist()) - set(ROUTED[index]))
    share = PART_TAKE[index][min(len(missed), len(PART_TAKE[index]) - 1)]
    whole = int(share)
    parted = missed[whole] if share > whole and whole < len(missed) else None
    return set(missed[:whole]), parted, set(missed[whole:])


def test_greedy_decode_splitting_the_first_miss_by_its_rows_beside_a_fetched_one(model):
    """j(2) = 0.75: the first miss's rows split, the second fetched whole: the all-resident model's tokens and
    logits within a few fp32 roundings (PhiMoE's conformance plan's case, on the stand-in)."""
    take = {index: tuple(max(0.0, m - 1.25) for m in range(9)) for index in ROUTED}
    _, (ids, logits, _), routed_model, routed = _reference_and_routed(model, 2, 8, cpu=SPLIT_CPU, cpu_take=take)
    try:
        assert routed.cpu_rows[0][2] == 48
        routed_ids, routed_logits, _ = _greedy(routed_model, 2, 8)
        assert torch.equal(routed_ids, ids)
        assert all(_within(a, b, 1e-5) for a, b in zip(routed_logits, logits))
    finally:
        routed.close()


@pytest.mark.parametrize("prefetch", [False, True])
def test_greedy_decode_splitting_one_expert_by_its_rows(model, prefetch):
    """A per-step split with fractions: the all-resident model's tokens, logits within a few fp32 roundings, so
    the GPU's rows of the split expert (its slot's first rows zero) and the CPU's add up to the expert; without
    prefetch the split expert is fetched (its other rows) and its pairs are the CPU's too."""
    batch, num_steps = 2, 8
    calls, (ids, logits, _), routed_model, routed = _reference_and_routed(model, batch, num_steps, cpu=SPLIT_CPU,
                                                                          cpu_take=PART_TAKE, prefetch=prefetch)
    try:
        assert routed.cpu_rows == {index: (0, 48, 16, 48, 16, 48, 16, 48, 16) for index in ROUTED}
        routed_ids, routed_logits, _ = _greedy(routed_model, batch, num_steps)
        assert torch.equal(routed_ids, ids)
        assert all(_within(a, b, 1e-5) for a, b in zip(routed_logits, logits))
        stats = routed.cpu_stats()
        if not prefetch:
            steps = [(index, top_k) for index in ROUTED for top_k in calls[index][1:]]  # call 0 is the prefill
            splits = [(top_k, *_split_with_part(top_k, index)) for index, top_k in steps]
            assert any(parted is not None for _, _, parted, _ in splits)
            on_cpu = [chosen | ({parted} if parted is not None else set()) for _, chosen, parted, _ in splits]
            assert stats["pairs_cpu"] == sum(int(torch.isin(top_k, torch.tensor(sorted(ids) or [-1])).sum())
                                             for (top_k, *_), ids in zip(splits, on_cpu))
            assert stats["experts_cpu"] == sum(len(ids) for ids in on_cpu)
            # the split expert counts as fetched for the rows the CPU did not compute (16 or 48 of 64)
            row_bytes = routed.expert_bytes // routed.intermediate
            split_rows = sum(routed.cpu_rows[index][min(len(chosen) + len(fetched), 8)]
                             for (index, _), (_, chosen, parted, fetched) in zip(steps, splits) if parted is not None)
            assert split_rows > 0
            assert routed.fetched_bytes() == (sum(len(fetched) for *_, fetched in splits) * routed.expert_bytes
                                              - split_rows * row_bytes)
    finally:
        routed.close()


@pytest.mark.parametrize("with_kernel", [True, False], ids=["c-kernel", "torch"])
def test_the_cpu_computes_the_first_rows_of_a_split_expert(layer, with_kernel):
    """cpu_partial_sum with a part: the split expert's pairs over its first rows only (C kernel and torch's path
    alike), and those plus its other rows are the whole expert's output."""
    experts, hidden, index, weights = layer
    expert = int(index[0, 0])
    host = _cpu_layer(experts, ids=tuple(range(NUM_EXPERTS)))
    if not with_kernel:
        host.host.kernel = None
    only = torch.where(index == expert, index, -1)  # the split expert's pairs alone
    rows = 32
    parts = []
    for part in (torch.tensor([expert, rows]), None):
        out = torch.empty(hidden.shape)
        cpu_partial_sum(host, hidden, only, weights, out, part=part)
        parts.append(out)
    first, whole = parts
    gate_up, down = experts.gate_up_proj[expert], experts.down_proj[expert]
    intermediate = down.shape[1]
    gate = hidden @ gate_up[rows:intermediate].T
    up = hidden @ gate_up[intermediate + rows:].T
    pair_weight = torch.where(index == expert, weights, 0).sum(-1, keepdim=True)
    rest = pair_weight * ((torch.nn.functional.silu(gate) * up) @ down[:, rows:].T)
    assert _within(first + rest, whole, 1e-5) and not _within(first, whole, 1e-2)
