"""runtime.cpu_kernel: the C kernel computing one routed expert on the host CPU (issue 37), against an fp64
reference and torch's fp32 path, and the fallbacks where it cannot be built (the torch path then computes).

CPU only; it builds the kernel with the machine's C compiler (skipped where there is none).
"""

import shutil

import pytest
import torch
import torch.nn.functional as F

from runtime import cpu_kernel
from runtime.cpu_experts import BF16_DIFFERING_SHARE, BF16_ROUNDING, FP32_TOLERANCE, HostExperts, compute_pairs

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture(autouse=True)
def fresh_kernel(monkeypatch, tmp_path):
    """Each test loads (and builds, in its own cache) the kernel anew."""
    monkeypatch.setenv("OFFLOAD_PLAN_CACHE", str(tmp_path))
    monkeypatch.delenv("OFFLOAD_PLAN_CPU_KERNEL", raising=False)
    cpu_kernel.reset_kernel()
    yield
    cpu_kernel.reset_kernel()


def _experts(dtype: torch.dtype, num_experts: int = 3, hidden: int = 96, intermediate: int = 40):
    generator = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * hidden ** -0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, intermediate, generator=generator) * intermediate ** -0.5).to(dtype)
    return gate_up, down


def _reference(gate_up: torch.Tensor, down: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The SwiGLU in fp64 from the weights as they lie."""
    gate, up = (hidden.double() @ gate_up.double().T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.double().T


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 9])
def test_the_kernel_computes_the_swiglu_in_fp32(dtype, num_tokens):
    kernel = cpu_kernel.load_kernel()
    assert kernel is not None, cpu_kernel.kernel_refusal()
    gate_up, down = _experts(dtype)
    hidden = torch.randn(num_tokens, gate_up.shape[-1], generator=torch.Generator().manual_seed(1))
    out = cpu_kernel.expert_swiglu(kernel, gate_up[1], down[1], hidden, num_threads=2)
    expected = _reference(gate_up[1], down[1], hidden)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_host_experts_take_the_kernel_and_agree_with_torchs_fp32_path(monkeypatch):
    gate_up, down = _experts(torch.float32)
    hidden = torch.randn(5, gate_up.shape[-1], generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([2, 0, 2, 1, 0])
    experts = HostExperts(gate_up, down, "fp32")
    assert experts.kernel is not None
    with_kernel = compute_pairs(experts, hidden, ids)
    monkeypatch.setenv("OFFLOAD_PLAN_CPU_KERNEL", "0")
    cpu_kernel.reset_kernel()
    experts = HostExperts(gate_up, down, "fp32")
    assert experts.kernel is None and "OFFLOAD_PLAN_CPU_KERNEL" in cpu_kernel.kernel_refusal()
    with_torch = compute_pairs(experts, hidden, ids)
    assert (with_kernel - with_torch).abs().max() <= FP32_TOLERANCE * with_torch.abs().max()


def test_a_bf16_copy_through_the_kernel_is_closer_to_fp64_than_torchs_bf16(monkeypatch):
    """The kernel accumulates bf16 weights in fp32; torch's bf16 path rounds each intermediate to bf16."""
    gate_up, down = _experts(torch.bfloat16)
    hidden = torch.randn(2, gate_up.shape[-1], generator=torch.Generator().manual_seed(3))
    experts = HostExperts(gate_up, down, "bf16")
    expected = _reference(gate_up[0], down[0], hidden)
    kernel_error = (experts.expert(0, hidden).double() - expected).abs().max()
    monkeypatch.setenv("OFFLOAD_PLAN_CPU_KERNEL", "0")
    cpu_kernel.reset_kernel()
    experts = HostExperts(gate_up, down, "bf16")
    assert experts.kernel is None
    torch_error = (experts.expert(0, hidden).double() - expected).abs().max()
    assert kernel_error < torch_error


def test_an_activation_other_than_silu_stays_with_torch():
    gate_up, down = _experts(torch.float32)
    assert HostExperts(gate_up, down, "fp32", act_fn=F.gelu).kernel is None
    assert HostExperts(gate_up, down, "fp32", act_fn=torch.nn.SiLU()).kernel is not None


def test_no_compiler_or_a_failed_build_falls_back_to_torch_saying_why(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert cpu_kernel.load_kernel() is None
    assert "no C compiler (no-such-compiler-here)" in cpu_kernel.kernel_refusal()
    cpu_kernel.reset_kernel()
    monkeypatch.setenv("CC", "false")  # found, and fails every build
    assert cpu_kernel.load_kernel() is None and cpu_kernel.kernel_refusal().startswith("the build failed")


def test_the_build_is_cached_per_compiler_and_cpu(tmp_path):
    assert cpu_kernel.load_kernel() is not None
    built = list((tmp_path / "kernels").glob("cpu_experts_*.so"))
    assert len(built) == 1
    cpu_kernel.reset_kernel()
    assert cpu_kernel.load_kernel() is not None
    assert list((tmp_path / "kernels").glob("cpu_experts_*.so")) == built


def _gpu_rounded(gate_up: torch.Tensor, down: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The SwiGLU as a GPU computes it in bf16 (torch's CPU bf16 ops round at the same points: each projection,
    SiLU, the product and the output), in fp64."""
    gate, up = F.linear(hidden.bfloat16(), gate_up.bfloat16()).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down.bfloat16()).double()


def _weighted_sum_reference(gate_up, down, local, hidden, top_k_index, top_k_weights) -> torch.Tensor:
    """Per token, its CPU pairs' weighted SwiGLU outputs summed in rank order, in fp64; where ``hidden`` is bf16,
    each pair rounded as the GPU rounds it (and its weighted value, where the weights are bf16)."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    rounded = hidden.dtype == torch.bfloat16
    for token in range(hidden.shape[0]):
        for rank, expert in enumerate(top_k_index[token].tolist()):
            if local[expert] >= 0:
                weights, one = (gate_up[local[expert]], down[local[expert]]), hidden[token:token + 1]
                row = (_gpu_rounded(*weights, one) if rounded else _reference(*weights, one.float()))[0]
                weighted = float(top_k_weights[token, rank]) * row
                if top_k_weights.dtype == torch.bfloat16:
                    weighted = weighted.to(torch.bfloat16).double()
                out[token] += weighted
    return out


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32], ids=["hidden-bf16", "hidden-fp32"])
@pytest.mark.parametrize("num_tokens", [1, 4, 7])
def test_the_host_nodes_body_in_c_sums_each_tokens_cpu_pairs(weights_dtype, hidden_dtype, num_tokens):
    """partial_sum (the host node's whole body): per token the CPU experts' outputs weighted and summed in rank
    order, pairs grouped by expert (one read of its weights), experts that are not the CPU's skipped; the counts
    it returns; and cpu_partial_sum takes it where the kernel computes (torch's path within 2e-2 of the reference).
    With bf16 hidden states (bf16-valued weights, bf16 routing weights, as a bf16 model's) it rounds as the GPU
    does: within one bf16 rounding of the GPU-rounded reference, where fp32 would be up to 2^-8 off."""
    from runtime.cpu_handoff import CpuLayer, cpu_partial_sum

    kernel = cpu_kernel.load_kernel()
    assert kernel is not None, cpu_kernel.kernel_refusal()
    gate_up, down = _experts(weights_dtype, num_experts=4)
    rounded = hidden_dtype == torch.bfloat16
    if rounded:  # a bf16 model's weights, whatever the host copy's dtype
        gate_up, down = gate_up.bfloat16().to(weights_dtype), down.bfloat16().to(weights_dtype)
    num_experts, top_k = 10, 3
    local = torch.full((num_experts,), -1, dtype=torch.int64)
    local[torch.tensor([1, 4, 7, 8])] = torch.arange(4)  # experts 1, 4, 7, 8 on the CPU
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(num_tokens, gate_up.shape[-1], generator=generator).to(hidden_dtype)
    top_k_index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    top_k_index[0] = torch.tensor([4, 2, 4 if top_k == 1 else 8])  # an expert twice over the tokens, and a miss
    top_k_weights = torch.rand(num_tokens, top_k, generator=generator).to(hidden_dtype)
    out = torch.full((num_tokens, gate_up.shape[-1]), float("nan"))
    pairs, distinct = cpu_kernel.partial_sum(kernel, gate_up, down, local, hidden, top_k_index, top_k_weights, out,
                                             num_threads=2)
    is_cpu = local[top_k_index] >= 0
    assert pairs == int(is_cpu.sum()) and distinct == len(set(top_k_index[is_cpu].tolist()))
    expected = _weighted_sum_reference(gate_up, down, local, hidden, top_k_index, top_k_weights)
    error, scale = (out.double() - expected).abs(), max(1e-30, float(expected.abs().max()))
    # rounded: fp32-close but where a sum taken in another order rounded to the neighbouring bf16 value
    assert error.max() <= (BF16_ROUNDING if rounded else 1e-5) * scale
    assert (error <= 1e-5 * scale).float().mean() >= 1 - (BF16_DIFFERING_SHARE if rounded else 0)

    layer = CpuLayer(host=HostExperts(gate_up, down, "bf16" if weights_dtype == torch.bfloat16 else "fp32"),
                     is_cpu=local >= 0, local=local, copy_bytes=0)
    assert layer.host.kernel is not None
    through_layer = torch.empty_like(out)
    assert cpu_partial_sum(layer, hidden, top_k_index, top_k_weights, through_layer) == (pairs, distinct)
    assert torch.equal(through_layer, out)
    torch_path = torch.empty_like(out)
    object.__setattr__(layer.host, "kernel", None)  # torch's path, as where no compiler is found
    assert cpu_partial_sum(layer, hidden, top_k_index, top_k_weights, torch_path) == (pairs, distinct)
    assert (torch_path.double() - expected).abs().max() <= 2e-2 * max(1e-30, float(expected.abs().max()))


def test_a_step_with_no_cpu_pair_is_zeros():
    kernel = cpu_kernel.load_kernel()
    gate_up, down = _experts(torch.float32, num_experts=2)
    local = torch.tensor([-1, 0, -1, 1])
    out = torch.full((2, gate_up.shape[-1]), float("nan"))
    counted = cpu_kernel.partial_sum(kernel, gate_up, down, local, torch.randn(2, gate_up.shape[-1]),
                                     torch.tensor([[0, 2], [2, 0]]), torch.rand(2, 2), out, num_threads=2)
    assert counted == (0, 0) and torch.equal(out, torch.zeros_like(out))


def test_loading_the_kernel_leaves_the_process_denormals_alone():
    """Built with -ffast-math, the library's load set flush-to-zero for the whole process (GCC's crtfastmath), and
    a profile's denormal rate then read as zero in the same test process (tests/contract/test_fuzz_profile.py)."""
    assert cpu_kernel.load_kernel() is not None, cpu_kernel.kernel_refusal()
    tiny = float("5e-324")
    assert tiny * 1.0 > 0 and torch.tensor([tiny], dtype=torch.float64).mul(1.0).item() > 0


def test_partial_sum_refuses_what_its_c_side_would_read_past():
    kernel = cpu_kernel.load_kernel()
    gate_up, down = _experts(torch.float32, num_experts=2)
    hidden, out = torch.randn(2, gate_up.shape[-1]), torch.empty(2, gate_up.shape[-1])
    index, weights = torch.tensor([[0, 1], [1, 0]]), torch.rand(2, 2)
    local = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernel.partial_sum(kernel, gate_up, down.transpose(1, 2), local, hidden, index, weights, out, 1)
    with pytest.raises(ValueError, match="int64 local ids"):
        cpu_kernel.partial_sum(kernel, gate_up, down, local.int(), hidden, index, weights, out, 1)
    with pytest.raises(ValueError, match="hidden and out"):
        cpu_kernel.partial_sum(kernel, gate_up, down, local, hidden[:, :8], index, weights, out, 1)


@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32], ids=["hidden-bf16", "hidden-fp32"])
def test_the_host_step_in_c_computes_partial_sum_from_its_buffers_and_counts(hidden_dtype):
    """HostStep: the host node itself in C, bound once to the handoff's buffers, computes what partial_sum does from
    whatever the buffers hold when it runs (a replay writes new ids and hidden states into the same memory), adds
    to its counters, resets them, and does nothing once closed."""
    kernel = cpu_kernel.load_kernel()
    assert kernel is not None, cpu_kernel.kernel_refusal()
    gate_up, down = _experts(torch.bfloat16, num_experts=3)
    num_experts, num_tokens, top_k = 8, 3, 2
    local = torch.full((num_experts,), -1, dtype=torch.int64)
    local[torch.tensor([0, 3, 5])] = torch.arange(3)
    max_pairs, hidden_size = 16, gate_up.shape[-1]
    buffer_hidden = torch.zeros(max_pairs, hidden_size, dtype=hidden_dtype)
    buffer_index = torch.zeros(max_pairs, dtype=torch.int64)
    buffer_weights = torch.zeros(max_pairs, dtype=torch.float32)
    buffer_out = torch.zeros(max_pairs, hidden_size, dtype=torch.float32)
    floats, ints = cpu_kernel.scratch_sizes(max_pairs, hidden_size, gate_up.shape[1] // 2)
    step = cpu_kernel.HostStep(kernel, gate_up, down, local, hidden=buffer_hidden[:num_tokens],
                               index=buffer_index[:num_tokens * top_k], weights=buffer_weights[:num_tokens * top_k],
                               out=buffer_out[:num_tokens], scratch=torch.empty(floats),
                               pairs=torch.empty(ints, dtype=torch.int64), num_threads=2)
    generator = torch.Generator().manual_seed(4)
    computed = []
    for _ in range(2):  # as two replays: new inputs written into the same buffers, the step run again
        hidden = torch.randn(num_tokens, hidden_size, generator=generator).to(hidden_dtype)
        index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
        index[0, 0] = 3  # at least one CPU pair
        weights = torch.rand(num_tokens, top_k, generator=generator)
        buffer_hidden[:num_tokens] = hidden
        buffer_index[:num_tokens * top_k] = index.reshape(-1)
        buffer_weights[:num_tokens * top_k] = weights.reshape(-1)
        step.run()
        expected = torch.empty(num_tokens, hidden_size)
        computed.append(cpu_kernel.partial_sum(kernel, gate_up, down, local, hidden, index, weights, expected, 2))
        assert torch.equal(buffer_out[:num_tokens], expected)
    counters = step.counters()
    assert counters["calls"] == 2 and counters["pairs_total"] == 2 * num_tokens * top_k
    assert (counters["pairs_cpu"], counters["experts_cpu"]) == tuple(map(sum, zip(*computed)))
    assert counters["callback_s"] > 0
    step.reset()
    assert step.counters() == {"calls": 0, "pairs_total": 0, "pairs_cpu": 0, "experts_cpu": 0, "callback_s": 0.0}
    step.close()
    buffer_out.fill_(7.0)
    step.run()
    assert step.counters()["calls"] == 0 and bool((buffer_out == 7.0).all())


def test_a_host_step_refuses_buffers_its_c_side_would_misread():
    kernel = cpu_kernel.load_kernel()
    gate_up, down = _experts(torch.float32, num_experts=2)
    hidden_size = gate_up.shape[-1]
    floats, ints = cpu_kernel.scratch_sizes(4, hidden_size, gate_up.shape[1] // 2)
    good = dict(hidden=torch.zeros(2, hidden_size), index=torch.zeros(4, dtype=torch.int64), weights=torch.zeros(4),
                out=torch.zeros(2, hidden_size), scratch=torch.empty(floats),
                pairs=torch.empty(ints, dtype=torch.int64), num_threads=1)
    local = torch.tensor([0, 1])
    cpu_kernel.HostStep(kernel, gate_up, down, local, **good)
    for name, bad, message in [("index", torch.zeros(4, dtype=torch.int32), "int64 ids"),
                               ("weights", torch.zeros(3), "fp32 weights"),
                               ("scratch", torch.empty(floats - 1), "scratch"),
                               ("hidden", torch.zeros(hidden_size, 2).T, "contiguous")]:
        with pytest.raises(ValueError, match=message):
            cpu_kernel.HostStep(kernel, gate_up, down, local, **{**good, name: bad})
