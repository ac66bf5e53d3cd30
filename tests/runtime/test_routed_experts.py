"""Routed experts on the CPU stand-in: greedy decode through route-fetched layers equals the all-resident model
computed with batched_mm bit for bit, only routed non-resident experts are fetched, prefill works."""

import copy
import os
import subprocess
import sys

import pytest
import torch

from planner.errors import PlanError
from runtime.backend import CpuStandIn
from runtime.graph import DecodeLoop
from runtime.routed_layers import apply_routed_experts
from runtime.routed_layers import routed_from_plan
from runtime.fetch_planning import plan_fetch
from tests.runtime_models import routed_moe_model

#: layer -> resident expert ids: a layer with some resident, one with none, one with most, one not routed (3)
ROUTED = {0: (1, 5, 9), 1: (), 2: tuple(range(12))}


def _prompt(batch: int, tokens: int = 5) -> torch.Tensor:
    return torch.randint(0, 256, (batch, tokens), generator=torch.Generator().manual_seed(batch))


def _greedy(model, batch: int, num_steps: int):
    """(ids [batch, steps], logits per step, prefill logits) of eager greedy decode over a static cache."""
    loop = DecodeLoop(model, batch=batch, max_cache_tokens=64, device=torch.device("cpu"), steps_per_call=1)
    loop.prefill(_prompt(batch))
    ids, logits = loop.generate(num_steps)
    return ids, logits, loop.prefill_logits


def _routed_copy(model, fetch_slots: int, routed=ROUTED):
    routed_model = copy.deepcopy(model)
    routed_model.set_experts_implementation("batched_mm")
    return routed_model, apply_routed_experts(routed_model, routed, fetch_slots, CpuStandIn())


def _record_routing(model, layers):
    """Each routed layer's top_k_index per experts call, in call order."""
    calls = {index: [] for index in layers}
    for index in layers:
        experts = model.model.layers[index].mlp.experts
        experts.register_forward_pre_hook(lambda m, args, i=index: calls[i].append(args[1].clone()))
    return calls


@pytest.fixture(scope="module")
def model():
    return routed_moe_model()


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_decode_equals_all_resident_batched_mm(model, batch):
    reference = copy.deepcopy(model)
    ids, logits, prefill = _greedy(reference, batch, 8)
    routed_model, routed = _routed_copy(model, fetch_slots=2 * batch)
    routed_ids, routed_logits, routed_prefill = _greedy(routed_model, batch, 8)
    assert torch.equal(prefill, routed_prefill)
    assert torch.equal(ids, routed_ids)
    assert all(torch.equal(a, b) for a, b in zip(logits, routed_logits))
    assert routed.staged_bytes == len(ROUTED) * 16 * routed.expert_bytes  # one prefill chunk, each layer whole
    assert routed.fetched_bytes() > 0


def test_only_routed_non_resident_experts_are_fetched(model):
    batch = 4
    routed_model, routed = _routed_copy(model, fetch_slots=2 * batch)
    calls = _record_routing(routed_model, ROUTED)
    loop = DecodeLoop(routed_model, batch=batch, max_cache_tokens=64, device=torch.device("cpu"), steps_per_call=1)
    loop.prefill(_prompt(batch))
    routed.reset_counters()
    num_prefill_calls = {index: len(c) for index, c in calls.items()}
    loop.generate(6)
    expected = 0
    for index, resident in ROUTED.items():
        for top_k_index in calls[index][num_prefill_calls[index]:]:
            expected += len(set(top_k_index.flatten().tolist()) - set(resident))
    assert expected > 0
    assert routed.fetched_bytes() == expected * routed.expert_bytes
    assert routed.staged_bytes == 0  # decode steps never stage whole layers


def test_fetch_plan_maps_pairs_to_rows_and_fetches_each_expert_once():
    resident_row = torch.full((8,), -1, dtype=torch.int64)
    resident_row[3], resident_row[6] = 10, 11
    top_k_index = torch.tensor([[5, 3], [1, 5], [6, 0]])
    pair_rows, sources = plan_fetch(top_k_index, resident_row, fetch_slots=6)
    assert sources.tolist() == [0, 1, 5, -1, -1, -1]  # distinct non-resident, ascending; the rest unused
    assert pair_rows.view(3, 2).tolist() == [[2, 10], [1, 2], [11, 0]]


def test_params_leave_the_model_and_the_host_is_pinned(model):
    routed_model, routed = _routed_copy(model, fetch_slots=4)
    experts = routed_model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.numel() == 0 and experts.down_proj.numel() == 0
    assert routed_model.model.layers[3].mlp.experts.gate_up_proj.numel() > 0  # layer 3 is not routed
    allocation = routed.host_allocation
    assert routed.backend.pinned == {allocation.data_ptr(): allocation.numel()}
    assert routed.host_bytes == len(ROUTED) * 16 * routed.expert_bytes
    assert 0 <= allocation.numel() - routed.host_bytes <= 4096 + 2 * len(ROUTED) * 256  # page and alignment only
    resident_rows = sum(len(r) for r in ROUTED.values())
    assert routed.buffer["gate_up_proj"].shape[0] == 4 + resident_rows
    routed.close()
    assert routed.backend.pinned == {}


def test_bad_routing_is_one_line(model):
    with pytest.raises(PlanError, match="distinct ids"):
        _routed_copy(model, 4, {0: (1, 1)})
    with pytest.raises(PlanError, match="fetch_slots"):
        _routed_copy(model, 17, {0: ()})
    with pytest.raises(PlanError, match="outside"):
        _routed_copy(model, 4, {9: ()})


def test_routed_from_plan_reads_the_experts_section():
    from types import SimpleNamespace as NS

    plan = NS(experts=NS(fetch_slots=8, layers=(NS(index=0, regime="routed", resident=(2, 4)),
                                                 NS(index=1, regime="whole_layer", resident=()))))
    assert routed_from_plan(plan) == ({0: (2, 4)}, 8)
    assert routed_from_plan(NS()) == ({}, 0)


GATHER_SCRIPT = """
import torch
from runtime.uva_gather import _gather_rows_triton
source = torch.arange(6 * 40, dtype=torch.int32).view(6, 40).to(torch.bfloat16)
destination = torch.full((4, 40), -1.0, dtype=torch.bfloat16)
ids = torch.tensor([4, -1, 0, -1])
_gather_rows_triton(source, destination, ids)
assert torch.equal(destination[0], source[4]) and torch.equal(destination[2], source[0])
assert (destination[1] == -1).all() and (destination[3] == -1).all()
print("ok")
"""


def test_triton_gather_in_the_interpreter():
    """The CUDA gather kernel's logic, run by Triton's interpreter on the CPU."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", GATHER_SCRIPT], env=env, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def _with_experts(plan, routed: dict, fetch_slots: int):
    """The plan with an ``experts`` section routing ``routed`` (layer -> resident ids) as the planner's
    ExpertsPlan carries it, read by attribute (the runtime reads it so), whatever the plan's own section says."""
    from dataclasses import fields
    from types import SimpleNamespace as NS

    layers = tuple(NS(index=index, regime="routed", resident=resident, expected_fetched_bytes=0, hit_rate=0.0)
                   for index, resident in sorted(routed.items()))
    section = NS(regime="mixed", routing="uniform", fetch_slots=fetch_slots, layers=layers)
    return NS(**{**{f.name: getattr(plan, f.name) for f in fields(plan)}, "experts": section})


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from tests.runtime_models import save_tiny_moe

    return save_tiny_moe(tmp_path_factory.mktemp("moe"))


def mixed_plan_and_reference(checkpoint):
    """The tiny MoE's plan with 2 of 7 layers offloaded whole and the others routed (odd ones keep expert 1
    resident, 2 fetch slots), and the same plan's greedy decode without routing: (plan, routed, ids, logits)."""
    from runtime.load import build_model
    from tests.runtime_models import apply_plan_on_cpu
    from tests.runtime_models import plan_with

    plan = plan_with(checkpoint, 7, 2, 1)
    routed = {index: (1,) if index % 2 else () for index in range(7) if index not in plan.offload.layers}
    reference = build_model(str(checkpoint), None)
    apply_plan_on_cpu(reference, plan)
    reference.set_experts_implementation("batched_mm")
    ids, logits, _ = _greedy(reference, 1, 6)
    return _with_experts(plan, routed, fetch_slots=2), routed, ids, logits


def load_on_cpu(checkpoint, plan, streamed: bool):
    """``plan`` applied to a built model, or streamed from the files, on the CPU stand-in, experts computed by
    batched_mm: (model, engine)."""
    from runtime.load import build_model
    from tests.runtime_models import apply_plan_on_cpu, stream_on_cpu

    if streamed:
        model, engine = stream_on_cpu(checkpoint, plan)
    else:
        model = build_model(str(checkpoint), None)
        engine = apply_plan_on_cpu(model, plan)
    model.set_experts_implementation("batched_mm")
    return model, engine


@pytest.mark.parametrize("streamed", [False, True], ids=["apply_plan", "stream_model"])
def test_plan_with_routed_layers_loads_and_decodes_bitwise(moe_checkpoint, streamed):
    """Layers offloaded whole and routed layers in one plan, through the loader: the routed experts land in
    the routed host allocation (never on the GPU whole), greedy decode equals the same plan's without routing
    (on the CPU, fp32 matmuls of the slots' weights differ from the resident model's in the last bit: the
    kernels depend on alignment)."""
    plan, routed, ids, logits = mixed_plan_and_reference(moe_checkpoint)
    model, engine = load_on_cpu(moe_checkpoint, plan, streamed)
    experts = engine.routed_experts
    assert sorted(experts.layers) == sorted(routed)
    assert all(model.model.layers[i].mlp.experts.gate_up_proj.numel() == 0 for i in routed)
    routed_ids, routed_logits, _ = _greedy(model, 1, 6)
    assert torch.equal(ids, routed_ids)
    assert all(torch.equal(a, b) for a, b in zip(logits, routed_logits))
    assert experts.fetched_bytes() > 0
    backend = engine.backend
    assert experts.host_allocation.data_ptr() in backend.pinned
    engine.close()
    assert backend.pinned == {}


def test_a_plan_routing_an_offloaded_layer_is_refused(moe_checkpoint):
    from runtime.load import build_model
    from tests.runtime_models import apply_plan_on_cpu
    from tests.runtime_models import plan_with

    plan = plan_with(moe_checkpoint, 7, 2, 1)
    plan = _with_experts(plan, {plan.offload.layers[0]: ()}, fetch_slots=2)
    with pytest.raises(PlanError, match="both offloaded whole and routed"):
        apply_plan_on_cpu(build_model(str(moe_checkpoint), None), plan)


def _own_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` on whole pages of its own, its storage beginning there."""
    import mmap

    from runtime.engine import _own_storage
    from runtime.allocation import host_allocation_or_fail

    num_bytes = tensor.numel() * tensor.element_size()
    pages = -(-num_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    own = _own_storage(host_allocation_or_fail(pages), 0, num_bytes)
    return own.view(tensor.dtype).view(tensor.shape).copy_(tensor)


def test_adopted_host_tensors_are_pinned_in_place_and_decode_the_same(model):
    """adopt_host (benchmarks holding the model on the host): no second copy, each param pinned where it is."""
    reference = copy.deepcopy(model)
    expected = _greedy(reference, 1, 4)
    routed_model = copy.deepcopy(model)
    routed_model.set_experts_implementation("batched_mm")
    for index in ROUTED:  # on pages of their own, as a large tensor's allocation is (the tiny ones share pages)
        experts = routed_model.model.layers[index].mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            experts._parameters[name] = torch.nn.Parameter(_own_pages(getattr(experts, name).data), False)
    owned = {index: routed_model.model.layers[index].mlp.experts.gate_up_proj.data_ptr() for index in ROUTED}
    routed = apply_routed_experts(routed_model, ROUTED, 2, CpuStandIn(), adopt_host=True)
    assert routed.host_allocation is None
    assert all(routed.host[index, "gate_up_proj"].data_ptr() == ptr for index, ptr in owned.items())
    assert len(routed.backend.pinned) == 2 * len(ROUTED)
    got = _greedy(routed_model, 1, 4)
    assert torch.equal(expected[0], got[0]) and all(torch.equal(a, b) for a, b in zip(expected[1], got[1]))
    routed.close()
    assert routed.backend.pinned == {}


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_routed_decode_computes_with_the_models_own_experts_function(implementation):
    """A bf16 model decodes with grouped_mm where torch has its grouped GEMM (runtime.experts_impl): the routed
    layers compute with the function the model is configured with (decode_experts_forward), over the device
    buffer's rows, and greedy decode is the all-resident model's bit for bit whichever it is. On this CPU the two
    functions happen to multiply alike; on the H200 the conformance sweep's fetch-only routed plans kept 25 of 25
    arms' greedy tokens through grouped_mm (benchmarks/2026-11-29-cpu-rounding-h200.md)."""
    from runtime.experts_impl import grouped_mm_native

    if implementation == "grouped_mm" and not grouped_mm_native(torch.device("cpu")):
        pytest.skip("this torch has no native grouped_mm on the CPU")
    model = routed_moe_model(dtype=torch.bfloat16)
    model.set_experts_implementation(implementation)
    ids, logits, prefill = _greedy(copy.deepcopy(model), 4, 8)
    routed_model = copy.deepcopy(model)
    routed = apply_routed_experts(routed_model, ROUTED, 8, CpuStandIn())
    routed_ids, routed_logits, routed_prefill = _greedy(routed_model, 4, 8)
    assert torch.equal(prefill, routed_prefill) and torch.equal(ids, routed_ids)
    assert all(torch.equal(a, b) for a, b in zip(logits, routed_logits))
    assert routed.fetched_bytes() > 0
