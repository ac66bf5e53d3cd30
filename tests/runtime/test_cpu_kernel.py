"""runtime.cpu_kernel: the C kernel computing one routed expert on the host CPU (issue 37), against an fp64
reference and torch's fp32 path, and the fallbacks where it cannot be built (the torch path then computes).

CPU only; it builds the kernel with the machine's C compiler (skipped where there is none).
"""

import shutil

import pytest
import torch
import torch.nn.functional as F

from runtime import cpu_kernel
from runtime.cpu_experts import FP32_TOLERANCE, HostExperts, compute_pairs

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
