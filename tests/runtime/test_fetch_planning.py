"""runtime.fetch_planning: the one-kernel fetch plan gives what the torch ops of runtime.routed_experts give.

On this machine through Triton's interpreter (a subprocess: TRITON_INTERPRET is read when triton is imported);
compiled on a GPU (marked gpu)."""

import os
import subprocess
import sys

import pytest
import torch


def check_against_torch(device: str = "cpu") -> int:
    """Random layers (experts, top-k, tokens, resident rows, a slot set partly prefetched): the fused plan's pair
    rows, slot sources and counts equal plan_fetch's and plan_fetch_after_prefetch's. Returns the cases run."""
    from runtime.fetch_planning import fused_fetch_plan
    from runtime.fetch_planning import plan_fetch, plan_fetch_after_prefetch

    generator = torch.Generator().manual_seed(0)

    def draw(high: int, size=(1,)) -> torch.Tensor:
        return torch.randint(0, high, size, generator=generator)

    cases = 0
    for num_experts in (4, 16, 60, 128):
        for top_k in (1, 2, 8):
            for tokens in (1, 2, 4):
                if top_k > num_experts:
                    continue
                slots = min(tokens * top_k, num_experts)
                ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
                num_resident = int(draw(num_experts + 1))
                resident_row = torch.full((num_experts,), -1, dtype=torch.int64)
                resident_row[torch.randperm(num_experts, generator=generator)[:num_resident]] = \
                    torch.arange(num_resident) + 100
                non_resident = (resident_row < 0).nonzero().flatten()
                num_held = int(draw(min(slots, non_resident.numel()) + 1))
                held = torch.full((slots,), -1, dtype=torch.int64)
                held[torch.randperm(slots, generator=generator)[:num_held]] = \
                    non_resident[torch.randperm(non_resident.numel(), generator=generator)[:num_held]]
                base = int(draw(3)) * slots
                ids, resident_row, held = ids.to(device), resident_row.to(device), held.to(device)

                counts = torch.zeros(4, dtype=torch.int64, device=device)
                rows, sources = fused_fetch_plan(ids, resident_row, slots, base, counts)
                want_rows, want_sources = plan_fetch(ids, resident_row, slots, slot_base=base)
                assert torch.equal(rows, want_rows) and torch.equal(sources, want_sources)
                assert counts.tolist() == [0, 0, 0, int((want_sources >= 0).sum())]

                counts = torch.zeros(4, dtype=torch.int64, device=device)
                rows, sources = fused_fetch_plan(ids, resident_row, slots, base, counts, prefetched=held)
                want_rows, want_sources, want_counts = plan_fetch_after_prefetch(ids, resident_row, held,
                                                                                 slot_base=base)
                assert torch.equal(rows, want_rows) and torch.equal(sources, want_sources)
                assert torch.equal(counts, want_counts)

                written = torch.full((slots,), -7, dtype=torch.int64, device=device)
                fused_fetch_plan(ids, resident_row, slots, 0, torch.zeros(4, dtype=torch.int64, device=device),
                                 sources_out=written)
                assert torch.equal(written, plan_fetch(ids, resident_row, slots)[1])
                cases += 1
    return cases


def test_fused_fetch_plan_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = "from tests.runtime.test_fetch_planning import check_against_torch; print('cases', check_against_torch())"
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert result.returncode == 0 and "cases 33" in result.stdout, result.stderr[-3000:]


@pytest.mark.gpu
def test_fused_fetch_plan_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert check_against_torch("cuda") == 33
