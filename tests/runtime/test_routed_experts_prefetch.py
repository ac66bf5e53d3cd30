"""Next-layer expert prefetch on the CPU stand-in: the next routed layer's router, applied to the current layer's
router input rescaled to its norm, predicts its experts; the prefetched, missed and wasted experts account for
every fetch; greedy decode stays bitwise equal to the all-resident model computed with batched_mm."""

import copy
import os
import subprocess
import sys

import pytest
import torch

from runtime.backend import CpuStandIn
from runtime.graph import DecodeLoop
from runtime.routed_experts import FETCH_KINDS
from runtime.routed_layers import apply_routed_experts
from runtime.routed_layers import prefetch_from_plan
from runtime.router_prediction import next_layer_predictor
from runtime.fetch_planning import plan_fetch_after_prefetch
from tests.runtime_models import exactly_predictable, routed_moe_model

#: layer -> resident ids over 16 experts: layer 0 (first routed: nothing predicts it), 1 none resident, 2 most
ROUTED = {0: (1, 5, 9), 1: (), 2: tuple(range(12))}


def _prompt(batch: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, 5), generator=torch.Generator().manual_seed(batch))


def _greedy(model, batch: int, num_steps: int):
    loop = DecodeLoop(model, batch=batch, max_cache_tokens=64, device=torch.device("cpu"), steps_per_call=1)
    loop.prefill(_prompt(batch))
    return loop.generate(num_steps)


def _routed(model, routed: dict, fetch_slots: int, prefetch: bool = True):
    routed_model = copy.deepcopy(model)
    routed_model.set_experts_implementation("batched_mm")
    return routed_model, apply_routed_experts(routed_model, routed, fetch_slots, CpuStandIn(), prefetch=prefetch)


def _record_gates(model, layers) -> dict[int, list[torch.Tensor]]:
    """Each layer's router top-k ids per call, in call order (the MoE block's calls and the predictions)."""
    calls = {index: [] for index in layers}
    for index in layers:
        gate = model.model.layers[index].mlp.gate
        gate.register_forward_hook(lambda m, args, out, i=index: calls[i].append(out[-1].clone()))
    return calls


@pytest.fixture(scope="module")
def model():
    return routed_moe_model()


def test_misses_take_the_slots_wasted_or_unused_predictions_free():
    resident_row = torch.full((8,), -1, dtype=torch.int64)
    resident_row[3] = 20
    prefetched = torch.tensor([0, 5, 7, -1, -1, -1])  # 7 is not routed: wasted
    top_k_index = torch.tensor([[5, 3], [1, 5], [2, 0]])
    pair_rows, sources, counts = plan_fetch_after_prefetch(top_k_index, resident_row, prefetched, slot_base=6)
    assert sources.tolist() == [-1, -1, 1, 2, -1, -1]  # misses 1 and 2 into the wasted slot and the first unused
    assert pair_rows.view(3, 2).tolist() == [[7, 20], [8, 7], [9, 6]]
    assert dict(zip(FETCH_KINDS, counts.tolist())) == {"prefetched": 2, "wasted": 1, "missed": 2, "unpredicted": 0}


def test_every_slot_predicted_wrong_still_leaves_room_for_every_miss():
    resident_row = torch.full((8,), -1, dtype=torch.int64)
    prefetched = torch.tensor([4, 5, 6, 7])
    pair_rows, sources, counts = plan_fetch_after_prefetch(torch.tensor([[0, 1], [2, 3]]), resident_row, prefetched)
    assert sources.tolist() == [0, 1, 2, 3]
    assert pair_rows.tolist() == [0, 1, 2, 3]
    assert counts.tolist() == [0, 4, 4, 0]


def test_predicted_ids_equal_the_router_when_the_hidden_state_is_unchanged(model):
    """Layer 0's experts add nothing and layer 1's attention adds nothing, so layer 1's norm sees layer 0's
    residual: its router, applied to layer 0's router input rescaled by the norms' weights (here x2, exact),
    picks exactly what layer 1 then routes to: every fetch of layer 1 is a prefetched hit."""
    changed = exactly_predictable(model)
    routed_model, routed = _routed(changed, {0: (), 1: ()}, fetch_slots=8)
    calls = _record_gates(routed_model, [1])
    loop = DecodeLoop(routed_model, batch=4, max_cache_tokens=64, device=torch.device("cpu"), steps_per_call=1)
    loop.prefill(_prompt(4))
    routed.reset_counters()
    loop.generate(5)
    decode_calls = calls[1][1:]  # call 0 is the prefill's; then each step: the prediction, the MoE block's
    assert len(decode_calls) == 10
    for predicted, actual in zip(decode_calls[::2], decode_calls[1::2]):
        assert torch.equal(predicted, actual)
    fetched = routed.fetched_bytes_by_kind()
    assert fetched["wasted"] == fetched["missed"] == 0
    assert fetched["prefetched"] == sum(len(set(c.flatten().tolist())) for c in decode_calls[1::2]) * \
        routed.expert_bytes


@pytest.mark.parametrize("batch", [1, 4])
def test_prefetch_decodes_bitwise_and_its_fetches_cover_the_routing(model, batch):
    reference = copy.deepcopy(model)
    reference.set_experts_implementation("batched_mm")
    ids, logits = _greedy(reference, batch, 8)
    routed_model, routed = _routed(model, ROUTED, fetch_slots=2 * batch)
    assert routed.buffer["gate_up_proj"].shape[0] == 2 * 2 * batch + sum(len(r) for r in ROUTED.values())
    calls = _record_gates(routed_model, ROUTED)
    loop = DecodeLoop(routed_model, batch=batch, max_cache_tokens=64, device=torch.device("cpu"), steps_per_call=1)
    loop.prefill(_prompt(batch))
    routed.reset_counters()
    routed_ids, routed_logits = loop.generate(8)
    assert torch.equal(ids, routed_ids)
    assert all(torch.equal(a, b) for a, b in zip(logits, routed_logits))
    fetched = {kind: b // routed.expert_bytes for kind, b in routed.fetched_bytes_by_kind().items()}

    def distinct(index, top_k_ids):
        return set(top_k_ids.flatten().tolist()) - set(ROUTED[index])

    real = {0: calls[0][1:], 1: calls[1][2::2], 2: calls[2][2::2]}  # layers 1 and 2: prediction, then the real
    predicted = {1: calls[1][1::2], 2: calls[2][1::2]}
    assert fetched["unpredicted"] == sum(len(distinct(0, c)) for c in real[0])
    routed_total = sum(len(distinct(i, c)) for i in (1, 2) for c in real[i])
    hits = sum(len(distinct(i, p) & distinct(i, c)) for i in (1, 2) for p, c in zip(predicted[i], real[i]))
    predicted_total = sum(len(distinct(i, p)) for i in (1, 2) for p in predicted[i])
    assert fetched["prefetched"] == hits
    assert fetched["prefetched"] + fetched["missed"] == routed_total  # with resident: the whole routing
    assert fetched["prefetched"] + fetched["wasted"] == predicted_total
    assert routed.fetched_bytes() == sum(fetched.values()) * routed.expert_bytes


def test_a_norm_that_is_not_rmsnorm_turns_prediction_off_with_one_warning(model):
    class Shifted(torch.nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.norm, self.weight = norm, norm.weight

        def forward(self, hidden):
            return self.norm(hidden) + 0.5

    changed = copy.deepcopy(model)
    changed.model.layers[2].post_attention_layernorm = Shifted(changed.model.layers[2].post_attention_layernorm)
    reference = copy.deepcopy(changed)
    reference.set_experts_implementation("batched_mm")
    expected = _greedy(reference, 1, 4)
    with pytest.warns(UserWarning, match="prefetch off for 1 routed layer"):
        routed_model, routed = _routed(changed, ROUTED, fetch_slots=2)
    assert sorted(routed.predictors) == [0]  # 0 -> 1 predicted; 1 -> 2 not
    got = _greedy(routed_model, 1, 4)
    assert torch.equal(expected[0], got[0]) and all(torch.equal(a, b) for a, b in zip(expected[1], got[1]))


def test_predictor_is_refused_without_a_router_tuple(model):
    layers = copy.deepcopy(model).model.layers
    layers[1].mlp.gate = torch.nn.Linear(64, 16, bias=False)  # Qwen2-MoE style: logits only
    assert "router" in next_layer_predictor(layers[0], layers[1], 16, torch.device("cpu"))
    assert not isinstance(next_layer_predictor(layers[0], layers[2], 16, torch.device("cpu")), str)


def test_prefetch_off_counts_every_fetch_unpredicted(model):
    routed_model, routed = _routed(model, ROUTED, fetch_slots=2, prefetch=False)
    _greedy(routed_model, 1, 3)
    fetched = routed.fetched_bytes_by_kind()
    assert fetched["unpredicted"] > 0 and fetched["prefetched"] == fetched["wasted"] == fetched["missed"] == 0
    assert routed.buffer["gate_up_proj"].shape[0] == 2 + sum(len(r) for r in ROUTED.values())


def test_prefetch_from_plan_reads_the_experts_section():
    from types import SimpleNamespace as NS

    assert prefetch_from_plan(NS(experts=NS(prefetch="next_layer_router")))
    assert not prefetch_from_plan(NS(experts=NS(prefetch=None)))
    assert not prefetch_from_plan(NS(experts=NS())) and not prefetch_from_plan(NS())


BOUNDED_GATHER_SCRIPT = """
import torch
from runtime.uva_gather import _gather_rows_triton
source = torch.arange(6 * 9000, dtype=torch.int32).view(6, 9000)
for programs in (None, 1, 3):
    destination = torch.full((4, 9000), -1, dtype=torch.int32)
    _gather_rows_triton(source, destination, torch.tensor([4, -1, 0, 5]), max_programs=programs)
    assert torch.equal(destination[0], source[4]) and torch.equal(destination[2], source[0])
    assert torch.equal(destination[3], source[5]) and (destination[1] == -1).all()
print("ok")
"""


PERSISTENT_LOOP_SCRIPT = """
import torch
import triton
import triton.language as tl

@triton.jit
def visit(out, n):
    for item in range(tl.program_id(0), n, tl.num_programs(0)):
        tl.store(out + item, item)

out = torch.zeros(8, dtype=torch.int32)
visit[(3,)](out, 8)
assert out.tolist() == list(range(8))
print("ok")
"""


def _interpreter_runs_persistent_loops(env: dict, root: str) -> bool:
    """Whether Triton's interpreter here runs a loop bounded by program ids at all (a kernel of that loop alone)."""
    probe = subprocess.run([sys.executable, "-c", PERSISTENT_LOOP_SCRIPT], env=env, capture_output=True, text=True,
                           cwd=root, timeout=120)
    return probe.returncode == 0 and "ok" in probe.stdout


def test_bounded_grid_gather_in_the_interpreter():
    """The persistent gather covers every block of every slot with 1, 3 or one program per block (rows of
    three blocks of GATHER_BLOCK_WORDS: the loop strides over slots and blocks). Run by Triton's interpreter on
    CPU tensors in a subprocess whose environment is the same on every host: no CUDA device visible (the
    interpreter then never touches a driver, which on a GPU host would compile and load one) and the repository
    first on the path; the assertion carries the subprocess's output, so a host where it fails says why."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    result = subprocess.run([sys.executable, "-c", BOUNDED_GATHER_SCRIPT], env=env, capture_output=True, text=True,
                            cwd=root, timeout=300)
    if result.returncode != 0 and not _interpreter_runs_persistent_loops(env, root):
        # the H100's Triton 3.6 interpreter: a program id is a 1-element array there, not a scalar, and range()
        # refuses it; the compiled kernel is what runs on a GPU (tests/runtime/test_routed_experts_gpu.py)
        pytest.skip("this Triton's interpreter cannot run a loop bounded by program ids (the gather's persistent "
                    "loop); the compiled kernel is tested on the GPU")
    assert result.returncode == 0 and "ok" in result.stdout, \
        f"exit {result.returncode}; stdout: {result.stdout[-1000:]!r}; stderr: {result.stderr[-3000:]}"


def test_the_norm_check_accepts_bf16_rmsnorms_with_random_weights_near_zero():
    """The GPU test's model (bf16, norm weights ~ N(0, 0.1), some near zero): every routed pair predicts; the
    check runs float32 copies of the norms, so bf16 rounding of the norms' outputs cannot refuse a true RMSNorm."""
    layers = routed_moe_model(hidden=256, num_experts=32, top_k=4, dtype=torch.bfloat16).model.layers
    with torch.no_grad():  # weights 1e-6 of their neighbours, in one norm or both; unit 1 is 0 in every norm
        layers[0].post_attention_layernorm.weight[:3] = torch.tensor([1e-7, 0.0, -3e-8])
        layers[1].post_attention_layernorm.weight[:3] = torch.tensor([-2e-7, 0.0, 5.0])
        for layer in layers[2:]:
            layer.post_attention_layernorm.weight[1] = 0.0
    for index in (0, 1, 2):
        predictor = next_layer_predictor(layers[index], layers[index + 1], 32, torch.device("cpu"))
        assert not isinstance(predictor, str), predictor
    # norm_i 0 where norm_j is not (as in the H100's test model): nothing to rescale there, so that unit is left
    # out of the prediction's input (ratio 0) rather than turning prediction off
    with torch.no_grad():
        layers[0].post_attention_layernorm.weight[1] = 0.0
        layers[1].post_attention_layernorm.weight[1] = 0.5
    predictor = next_layer_predictor(layers[0], layers[1], 32, torch.device("cpu"))
    assert not isinstance(predictor, str), predictor
    assert float(predictor.ratio[1]) == 0.0 and float(predictor.ratio[4]) != 0.0
    # a norm of another form (LayerNorm: the mean taken out, a bias) is refused, naming a unit
    layers[1].post_attention_layernorm = torch.nn.LayerNorm(256, dtype=torch.bfloat16)
    reason = next_layer_predictor(layers[0], layers[1], 32, torch.device("cpu"))
    assert isinstance(reason, str) and "RMSNorm" in reason and "unit" in reason


@pytest.mark.parametrize("streamed", [False, True], ids=["apply_plan", "stream_model"])
def test_a_plan_asking_for_prefetch_loads_with_it_and_decodes_bitwise(tmp_path, streamed):
    """Through the loader (apply_plan or streamed from the files, on the CPU stand-in): experts.prefetch:
    next_layer_router turns prediction on for the plan's routed layers, and greedy decode equals the same plan's
    without routing."""
    from types import SimpleNamespace as NS

    from tests.runtime_models import save_tiny_moe
    from tests.runtime.test_routed_experts import _greedy as greedy_with_prompt
    from tests.runtime.test_routed_experts import load_on_cpu, mixed_plan_and_reference

    checkpoint = save_tiny_moe(tmp_path / "moe")
    plan, routed, ids, logits = mixed_plan_and_reference(checkpoint)
    plan = NS(**{**vars(plan), "experts": NS(**{**vars(plan.experts), "prefetch": "next_layer_router"})})
    model, engine = load_on_cpu(checkpoint, plan, streamed)
    experts = engine.routed_experts
    assert experts.prefetch and len(experts.predictors) == len(routed) - 1
    routed_ids, routed_logits, _ = greedy_with_prompt(model, 1, 6)
    assert torch.equal(ids, routed_ids) and all(torch.equal(a, b) for a, b in zip(logits, routed_logits))
    assert experts.fetched_bytes_by_kind()["prefetched"] + experts.fetched_bytes_by_kind()["missed"] > 0
    engine.close()
