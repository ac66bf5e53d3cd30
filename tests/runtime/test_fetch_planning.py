"""runtime.fetch_planning: the one-kernel fetch plan gives what the torch ops of runtime.routed_experts give.

On this machine through Triton's interpreter (a subprocess: TRITON_INTERPRET is read when triton is imported);
compiled on a GPU (marked gpu)."""

import os
import subprocess
import sys

import pytest
import torch


def check_against_torch(device: str = "cpu") -> int:
    """Random layers (experts, top-k, tokens, resident rows, a slot set partly prefetched, a split of the misses
    with the CPU): the fused plan's pair rows, slot sources, counts and CPU pairs equal plan_fetch's and
    plan_fetch_after_prefetch's (after split_to_cpu). Returns the cases run."""
    from runtime.fetch_planning import fused_fetch_plan, miss_kind, split_to_cpu, torch_fetch_plan
    from runtime.fetch_planning import plan_fetch, plan_fetch_after_prefetch

    generator = torch.Generator().manual_seed(0)

    def draw(high: int, size=(1,)) -> torch.Tensor:
        return torch.randint(0, high, size, generator=generator)

    cases = parts = 0
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

                for parted in (False, True):
                    split = _cpu_split(resident_row, slots, generator, parted)
                    for prefetched in (None, held):
                        counts = torch.zeros(4, dtype=torch.int64, device=device)
                        part_counts = torch.full((4,), 5, dtype=torch.int64, device=device)
                        rows, sources, cpu_index, part = fused_fetch_plan(ids, resident_row, slots, base, counts,
                                                                          prefetched=prefetched, cpu_split=split,
                                                                          part_counts=part_counts)
                        step_rows, want_cpu, want_part = split_to_cpu(ids, resident_row, split, prefetched)
                        if prefetched is None:
                            want_rows, want_sources = plan_fetch(ids, step_rows, slots, slot_base=base)
                        else:
                            want_rows, want_sources, _ = plan_fetch_after_prefetch(ids, step_rows, held,
                                                                                   slot_base=base)
                        assert torch.equal(cpu_index, want_cpu.view(-1))
                        assert torch.equal(rows, want_rows) and torch.equal(sources, want_sources)
                        assert not ((want_cpu >= 0) & (resident_row[want_cpu.clamp(min=0)] >= 0)).any()
                        _check_part(part, want_part, want_sources)
                        # the split expert's rows (the CPU's, not the link's) added at its fetch's kind
                        want_counts = [5, 5, 5, 5]
                        if want_part is not None:
                            want_counts[miss_kind(prefetched is not None)] += int(want_part[1])
                        assert part_counts.tolist() == want_counts
                        # the stand-in's path: the same results and counters from the twin
                        twin_counts = torch.zeros(4, dtype=torch.int64, device=device)
                        twin_part_counts = torch.full((4,), 5, dtype=torch.int64, device=device)
                        twin = torch_fetch_plan(ids, resident_row, slots, base, twin_counts, prefetched,
                                                cpu_split=split, part_counts=twin_part_counts)
                        assert all(torch.equal(a, b) for a, b in zip(twin[:3], (rows, sources, cpu_index)))
                        assert (twin[3] is None) == (part is None) and (part is None or torch.equal(twin[3], part))
                        assert torch.equal(twin_counts, counts) and torch.equal(twin_part_counts, part_counts)
                        parts += int(part is not None and int(part[0]) >= 0)
                cases += 1
    assert parts > 0  # some steps split an expert by its rows
    return cases


def _cpu_split(resident_row: torch.Tensor, slots: int, generator: torch.Generator, parted: bool = False):
    """A random split: some non-resident experts the CPU may compute, and a table j(m) <= m of random length;
    ``parted``: with random rows of one more expert (0 in some entries)."""
    from runtime.fetch_planning import CpuSplit

    num_experts, device = resident_row.numel(), resident_row.device
    eligible = ((resident_row.cpu() < 0) & (torch.rand(num_experts, generator=generator) < 0.7)).to(torch.int64)
    length = int(torch.randint(1, slots + 2, (1,), generator=generator))
    take = torch.tensor([int(torch.randint(0, m + 1, (1,), generator=generator)) for m in range(length)])
    rows = torch.randint(0, 3, (length,), generator=generator) * 16 if parted else None
    return CpuSplit(eligible=eligible.to(device), take=take.to(device), zero_row=999,
                    rows=None if rows is None else rows.to(device))


def _check_part(part, want_part, sources) -> None:
    """The fused plan's part [expert, rows, slot] is the torch twin's [expert, rows] and the slot its expert got."""
    if want_part is None:
        assert part is None
        return
    expert = int(want_part[0])
    want_slot = int((sources == expert).nonzero().flatten()[0]) if expert >= 0 else -1
    assert part.tolist() == [expert, int(want_part[1]), want_slot]


def test_split_to_cpu_takes_the_first_eligible_misses():
    """By hand: experts 1, 3, 5, 6 routed; 1 resident, 5 prefetched: misses 3 and 6 (m = 2, j(2) = 1); the CPU may
    compute 6 and 3: it takes 3, the lower id; its pair's row is the zero row."""
    from runtime.fetch_planning import CpuSplit, split_to_cpu

    ids = torch.tensor([[3, 1], [5, 6]])
    resident_row = torch.tensor([-1, 10, -1, -1, -1, -1, -1, -1])
    split = CpuSplit(eligible=torch.tensor([0, 0, 1, 1, 1, 1, 1, 1]), take=torch.tensor([0, 1, 1]), zero_row=99)
    rows, cpu_index, part = split_to_cpu(ids, resident_row, split, prefetched=torch.tensor([5, -1, -1, -1]))
    assert part is None
    assert cpu_index.tolist() == [3, -1, -1, -1]
    assert rows.tolist() == [-1, 10, -1, 99, -1, -1, -1, -1]
    split = CpuSplit(eligible=split.eligible, take=torch.tensor([0, 1, 2]), zero_row=99)
    # nothing prefetched: misses 3, 5, 6 (m = 3, past the table: its last entry, 2): 3 and 5
    assert split_to_cpu(ids, resident_row, split, prefetched=None)[1].tolist() == [3, -1, 5, -1]


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


def test_split_to_cpu_splits_the_next_miss_by_its_rows():
    """By hand: misses 3, 5, 6 (nothing prefetched; m = 3: j = 1 and 32 rows): the CPU computes 3 whole and the first
    32 rows of 5, whose pairs are the CPU's too while it stays a miss; 6 is fetched."""
    from runtime.fetch_planning import CpuSplit, split_to_cpu

    ids = torch.tensor([[3, 1], [5, 6]])
    resident_row = torch.tensor([-1, 10, -1, -1, -1, -1, -1, -1])
    split = CpuSplit(eligible=torch.tensor([0, 0, 1, 1, 1, 1, 1, 1]), take=torch.tensor([0, 1, 1, 1]), zero_row=99,
                     rows=torch.tensor([0, 0, 0, 32]))
    rows, cpu_index, part = split_to_cpu(ids, resident_row, split)
    assert cpu_index.tolist() == [3, -1, 5, -1] and part.tolist() == [5, 32]
    assert rows.tolist() == [-1, 10, -1, 99, -1, -1, -1, -1]  # 5 is not at the zero row: fetched for its rest
    split = CpuSplit(eligible=split.eligible, take=split.take, zero_row=99, rows=torch.tensor([0, 0, 0, 0]))
    assert split_to_cpu(ids, resident_row, split)[2].tolist() == [-1, 0]  # no rows at m = 3: no part


def test_the_gather_zeroes_a_split_experts_first_rows():
    """gather_rows with a part (its torch semantics, the Triton kernel's twin): the split expert's slot holds its
    gate and up rows and down columns from r on and zeros before; the other slots whole; per PartLayout."""
    from runtime.uva_gather import gather_rows, part_layout

    hidden, intermediate, rows = 8, 32, 16
    gate_up = torch.randn(4, 2 * intermediate, hidden)
    down = torch.randn(4, hidden, intermediate)
    ids = torch.tensor([2, 0, -1])
    part = torch.tensor([0, rows, 1])
    for name, source in (("gate_up_proj", gate_up), ("down_proj", down)):
        slots = torch.full((3, *source.shape[1:]), 7.0)
        gather_rows(source, slots, ids, part=part, layout=part_layout(name, tuple(source.shape[1:])))
        assert torch.equal(slots[0], source[2]) and torch.equal(slots[2], torch.full_like(slots[2], 7.0))
        want = source[0].clone()
        if name == "gate_up_proj":
            want[:rows], want[intermediate:intermediate + rows] = 0, 0
        else:
            want[:, :rows] = 0
        assert torch.equal(slots[1], want)
