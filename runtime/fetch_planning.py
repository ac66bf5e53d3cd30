"""A routed layer's fetch plan in one GPU kernel: which experts to gather into which slots, and each pair's row.

runtime.routed_experts.plan_fetch and plan_fetch_after_prefetch compute, with no host synchronisation, for one
decode step of one routed layer: the device-buffer row of every routed (token, expert) pair, the expert each
fetch slot must gather, and the fetch counters. Written with torch ops they are 15 and 35 small kernels; under a
CUDA graph each node costs a few microseconds whatever its size, and 48 routed layers made them the largest part
of the routed machinery's own cost on the H100 (scripts/bench_experts.py --machinery, every expert resident:
+3.0 ms per step without prefetch, +9.9 ms with). Here each is one Triton program over the layer's E experts,
F slots and S pairs (all small: E <= a few hundred, S = F = tokens x top_k at decode), with the same results.

The program works on one-hot matrices rather than sorts: routed[e] = any pair routes to e, an expert's slot is
its rank among the experts needing one in ascending expert order (a cumulative sum), and each pair's row is its
expert's row (a one-hot sum). Ids below 0 are pairs that route nowhere (a masked prediction).

A layer that splits each step's misses with the host CPU by their count (a plan's ``cpu_take``; runtime.cpu_handoff)
first takes, of the step's m misses (routed, not resident, not prefetched), the first j(m) that the CPU may compute
in ascending id order (``split_to_cpu``): those read as resident at the device buffer's zero row, so nothing
gathers them, and the pairs routed to them are the CPU's (``cpu_index``: the expert id, -1 for the GPU's pairs).
Where the plan's j(m) holds a fraction (``rows``: the intermediate rows of one more expert the CPU computes), the
next eligible miss is split by its rows: it keeps a fetch slot, its pairs are both the GPU's and the CPU's, and
``part`` [3] names it (expert id, rows, slot; -1, 0, -1 for none): the gather brings its rows [rows, I) into the
slot with rows [0, rows) zero (runtime.uva_gather), the CPU computes rows [0, rows) (runtime.cpu_kernel), and the
two outputs sum to the expert's.
"""

from dataclasses import dataclass

import torch

from planner.plan.experts_section import fraction_of

_KERNELS = {}


def fused_fetch_plan(top_k_index: torch.Tensor, resident_row: torch.Tensor, fetch_slots: int, slot_base: int,
                     counts: torch.Tensor, prefetched: torch.Tensor | None = None, sources_out: torch.Tensor | None
                     = None, cpu_split: "CpuSplit | None" = None, part_counts: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, ...]:
    """(pair -> device-buffer row [S], slot -> expert id to gather or -1 [fetch_slots]) as plan_fetch (``prefetched``
    None) or plan_fetch_after_prefetch computes them, with their counts added into ``counts`` [4] (FETCH_KINDS:
    without prefetch, every fetch is "unpredicted"). ``sources_out``: write the slot -> expert ids there (the
    prefetch's own record) instead of a new tensor. With ``cpu_split``, the step's misses are split with the CPU
    first (split_to_cpu) and two more returned: the CPU's pairs' expert ids [S] (-1: the GPU's), and where the
    split has ``rows``, the part [3] (module docstring; else None), its rows added into ``part_counts`` [4] at its
    kind (miss_kind: the rows the CPU computes of a fetched expert, which do not cross the link). One Triton
    program; CUDA tensors only."""
    ids = top_k_index.reshape(-1)
    num_pairs, num_experts = ids.numel(), resident_row.numel()
    pair_rows = torch.empty_like(ids)
    sources = sources_out if sources_out is not None else torch.empty(fetch_slots, dtype=torch.int64,
                                                                      device=ids.device)
    with_prefetch, with_cpu = prefetched is not None, cpu_split is not None
    with_part = with_cpu and cpu_split.rows is not None
    cpu_index = torch.empty_like(ids) if with_cpu else pair_rows
    eligible, take = (cpu_split.eligible, cpu_split.take) if with_cpu else (resident_row, resident_row)
    part = torch.empty(3, dtype=torch.int64, device=ids.device) if with_part else pair_rows
    if with_part and part_counts is None:
        part_counts = torch.zeros(len(counts), dtype=torch.int64, device=ids.device)
    from triton import next_power_of_2  # with the kernel: triton ships with CUDA builds of torch

    _kernel()[(1,)](ids, resident_row, prefetched if with_prefetch else sources, pair_rows, sources, counts,
                    eligible, take, cpu_index, cpu_split.rows if with_part else take, part,
                    part_counts if with_part else counts, take.numel(),
                    cpu_split.zero_row if with_cpu else 0, num_pairs, num_experts, fetch_slots, slot_base,
                    WITH_PREFETCH=with_prefetch, WITH_CPU=with_cpu, WITH_PART=with_part,
                    BLOCK_S=next_power_of_2(num_pairs), BLOCK_E=next_power_of_2(num_experts),
                    BLOCK_F=next_power_of_2(fetch_slots))
    if not with_cpu:
        return pair_rows, sources
    return pair_rows, sources, cpu_index, part if with_part else None


def torch_fetch_plan(top_k_index: torch.Tensor, resident_row: torch.Tensor, fetch_slots: int, slot_base: int,
                     counts: torch.Tensor, prefetched: torch.Tensor | None = None,
                     cpu_split: "CpuSplit | None" = None, part_counts: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, ...]:
    """fused_fetch_plan's twin in torch ops, on any device (the CPU stand-in's path): split_to_cpu first where
    ``cpu_split``, then plan_fetch or plan_fetch_after_prefetch; the same results, ``counts`` and ``part_counts``
    added to alike."""
    cpu_index = part = None
    if cpu_split is not None:
        resident_row, cpu_index, part = split_to_cpu(top_k_index, resident_row, cpu_split, prefetched)
    if prefetched is not None:
        pair_rows, sources, step_counts = plan_fetch_after_prefetch(top_k_index, resident_row, prefetched,
                                                                    slot_base=slot_base)
        counts.add_(step_counts)
    else:
        pair_rows, sources = plan_fetch(top_k_index, resident_row, fetch_slots, slot_base=slot_base)
        counts[miss_kind(False)] += (sources >= 0).sum()
    if cpu_split is None:
        return pair_rows, sources
    if part is not None:  # the part's slot: where the plan put its expert
        slots = torch.arange(sources.numel(), device=sources.device)
        slot = torch.where((sources == part[0]) & (part[0] >= 0), slots, -1).max()
        part = torch.cat((part, slot.view(1)))
        if part_counts is not None:
            part_counts[miss_kind(prefetched is not None)] += part[1]
    return pair_rows, sources, cpu_index, part


@dataclass(frozen=True, kw_only=True)
class CpuSplit:
    """One routed layer's split of each step's misses with the CPU, on the device."""

    #: [E] int64: 1 where the CPU may compute the expert (the plan's cpu ids), else 0
    eligible: torch.Tensor
    #: [M] int64: j(m), the whole misses a step with m of them sends to the CPU (past the end: the last entry)
    take: torch.Tensor
    #: the device buffer's row of zeros the CPU's experts read as resident at
    zero_row: int
    #: [M] int64 or None: the intermediate rows of the next eligible miss the CPU computes at m misses (0: none;
    #: the link brings the rest of it), where the plan's j(m) holds fractions
    rows: torch.Tensor | None = None


def miss_kind(prefetched: bool) -> int:
    """The FETCH_KINDS entry (runtime.routed_experts) a fetch after the router counts as: "missed" in a layer a
    prefetch predicted, else "unpredicted"."""
    return 2 if prefetched else 3


#: a part's rows are a multiple of this many intermediate rows (even: the gather moves 4-byte words of bf16 pairs)
PART_ROWS_MULTIPLE = 16


def part_rows(share: float, intermediate: int) -> int:
    """The intermediate rows of one more expert the CPU computes where a plan's j(m) is ``share`` experts: the
    fraction's rows, a multiple of PART_ROWS_MULTIPLE (0: whole experts only, or a fraction too small to split;
    a fraction that rounds to the whole expert is capped one multiple short of it)."""
    rows = round(fraction_of(share) * intermediate / PART_ROWS_MULTIPLE) * PART_ROWS_MULTIPLE
    return max(0, min(rows, intermediate - PART_ROWS_MULTIPLE))


def split_to_cpu(top_k_index: torch.Tensor, resident_row: torch.Tensor, split: CpuSplit,
                 prefetched: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(the step's resident rows [E], with the CPU's experts at the zero row; the CPU's pairs' expert ids [S], -1
    for the GPU's; the part [2], its expert id and rows, where the split has rows, else None): of the step's m
    misses (routed, not resident, not in ``prefetched``), the first ``take[min(m, M - 1)]`` of those ``eligible``
    in ascending id order go to the CPU, and where ``rows`` there is positive, the next one's first rows too (it
    stays a miss, fetched for its other rows). Torch ops, fixed shapes (the fused kernel's twin on the CPU
    stand-in)."""
    ids = top_k_index.reshape(-1)  # [S]
    num_experts = resident_row.numel()
    routed = torch.zeros(num_experts + 1, dtype=torch.bool, device=ids.device)
    routed.index_fill_(0, torch.where(ids >= 0, ids, num_experts), True)
    missed = routed[:num_experts] & (resident_row < 0)  # [E]
    if prefetched is not None:
        held = torch.zeros(num_experts + 1, dtype=torch.bool, device=ids.device)
        held.index_fill_(0, torch.where(prefetched >= 0, prefetched, num_experts), True)
        missed &= ~held[:num_experts]
    num_missed = missed.sum().clamp(max=split.take.numel() - 1)
    candidates = missed & (split.eligible > 0)
    rank = torch.cumsum(candidates, 0)
    chosen = candidates & (rank <= split.take[num_missed])  # [E]
    rows = torch.where(chosen, split.zero_row, resident_row)
    part = None
    shared = chosen
    if split.rows is not None:
        part_rows = split.rows[num_missed]
        parted = candidates & (rank == split.take[num_missed] + 1) & (part_rows > 0)  # [E], at most one
        shared = chosen | parted
        expert = torch.where(parted, torch.arange(num_experts, device=ids.device), -1).max()
        part = torch.stack((expert, torch.where(expert >= 0, part_rows, 0)))
    on_cpu = torch.cat((shared, shared.new_zeros(1)))[torch.where(ids >= 0, ids, num_experts)]  # [S]
    return rows, torch.where(on_cpu, ids, -1), part


def _kernel():
    """The Triton program, compiled on first use (triton ships with CUDA builds of torch)."""
    if "plan" not in _KERNELS:
        import triton
        import triton.language as tl

        @triton.jit
        def plan(ids_ptr, resident_ptr, prefetched_ptr, pair_rows_ptr, sources_ptr, counts_ptr, eligible_ptr,
                 take_ptr, cpu_index_ptr, rows_ptr, part_ptr, part_counts_ptr, take_len, zero_row, num_pairs,
                 num_experts, num_slots, slot_base, WITH_PREFETCH: tl.constexpr, WITH_CPU: tl.constexpr,
                 WITH_PART: tl.constexpr,
                 BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr):
            s = tl.arange(0, BLOCK_S)
            e = tl.arange(0, BLOCK_E)
            f = tl.arange(0, BLOCK_F)
            ids = tl.load(ids_ptr + s, mask=s < num_pairs, other=-1)
            pair_is = ids[:, None] == e[None, :]  # [S, E] one-hot (a masked pair matches nothing)
            routed = tl.max(pair_is.to(tl.int32), axis=0) > 0  # [E]
            resident = tl.load(resident_ptr + e, mask=e < num_experts, other=0)  # row, or -1 if not resident
            if WITH_PREFETCH:
                held = tl.load(prefetched_ptr + f, mask=f < num_slots, other=-1)  # [F] expert per slot, or -1
            else:
                held = tl.full((BLOCK_F,), -1, tl.int64)
            slot_is = held[:, None] == e[None, :]  # [F, E]
            slot_of = tl.max(tl.where(slot_is, f[:, None], -1), axis=0)  # [E] the slot holding e, or -1
            if WITH_CPU:  # split_to_cpu: the first take[m] eligible misses read as resident at the zero row
                missed = routed & (resident < 0) & (slot_of < 0)
                num_missed = tl.minimum(tl.sum(missed.to(tl.int32), axis=0), take_len - 1)
                eligible = tl.load(eligible_ptr + e, mask=e < num_experts, other=0) > 0
                candidates = missed & eligible
                rank = tl.cumsum(candidates.to(tl.int32), axis=0)
                whole = tl.load(take_ptr + num_missed)
                chosen = candidates & (rank <= whole)
                resident = tl.where(chosen, zero_row, resident)
                shared = chosen
                if WITH_PART:  # the next eligible miss's first rows too: it stays a miss, fetched for the rest
                    part_rows = tl.load(rows_ptr + num_missed)
                    parted = candidates & (rank == whole + 1) & (part_rows > 0)  # [E], at most one
                    shared = chosen | parted
                on_cpu = tl.max(tl.where(pair_is & shared[None, :], 1, 0), axis=1) > 0  # [S]
                tl.store(cpu_index_ptr + s, tl.where(on_cpu, ids, -1), mask=s < num_pairs)
            need = routed & (resident < 0)
            if WITH_PREFETCH:
                hit = need & (slot_of >= 0)
                miss = need & (slot_of < 0)
                # a slot keeps its expert when the step routes to it; the others (unused, wasted) are free
                keep = tl.max(tl.where(slot_is, routed[None, :].to(tl.int32), 0), axis=1) > 0  # [F]
                free = (~keep) & (f < num_slots)
                free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
                miss_rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
                takes = free[:, None] & (free_rank[:, None] == miss_rank[None, :]) & miss[None, :]  # [F, E]
                miss_slot = tl.max(tl.where(takes, f[:, None], -1), axis=0)
                slot = tl.where(hit, slot_of, miss_slot)
                num_held = tl.sum((held >= 0).to(tl.int64), axis=0)
                num_hits = tl.sum(hit.to(tl.int64), axis=0)
                tl.store(counts_ptr + 0, tl.load(counts_ptr + 0) + num_hits)
                tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + num_held - num_hits)
                tl.store(counts_ptr + 2, tl.load(counts_ptr + 2) + tl.sum(miss.to(tl.int64), axis=0))
            else:
                miss = need
                slot = tl.cumsum(need.to(tl.int32), axis=0) - 1
                tl.store(counts_ptr + 3, tl.load(counts_ptr + 3) + tl.sum(need.to(tl.int64), axis=0))
            row = tl.where(resident >= 0, resident, slot.to(tl.int64) + slot_base)  # [E]
            pair_rows = tl.sum(tl.where(pair_is, row[None, :], 0), axis=1)  # [S]
            tl.store(pair_rows_ptr + s, pair_rows, mask=s < num_pairs)
            fetches = (slot[None, :] == f[:, None]) & miss[None, :]  # [F, E]
            sources = tl.max(tl.where(fetches, e[None, :].to(tl.int64), -1), axis=1)
            tl.store(sources_ptr + f, sources, mask=f < num_slots)
            if WITH_CPU:
                if WITH_PART:
                    part_expert = tl.max(tl.where(parted, e, -1).to(tl.int64), axis=0)
                    tl.store(part_ptr, part_expert)
                    tl.store(part_ptr + 1, tl.where(part_expert >= 0, part_rows, 0).to(tl.int64))
                    tl.store(part_ptr + 2, tl.max(tl.where(parted, slot, -1).to(tl.int64), axis=0))
                    # its rows, which the CPU computes and the link does not bring, at the miss's kind
                    # (miss_kind: "missed" after a prefetch, else "unpredicted")
                    split_rows = tl.where(part_expert >= 0, part_rows, 0).to(tl.int64)
                    if WITH_PREFETCH:
                        tl.store(part_counts_ptr + 2, tl.load(part_counts_ptr + 2) + split_rows)
                    else:
                        tl.store(part_counts_ptr + 3, tl.load(part_counts_ptr + 3) + split_rows)

        _KERNELS["plan"] = plan
    return _KERNELS["plan"]


def plan_fetch(top_k_index: torch.Tensor, resident_row: torch.Tensor, fetch_slots: int, slot_base: int = 0):
    """(pair -> device-buffer row [S], fetch slot -> expert id to gather or -1 [fetch_slots]) for S <=
    fetch_slots routed pairs, in fixed shapes: each distinct non-resident expert gets one slot, numbered in
    ascending expert order (its row: ``slot_base`` + slot); resident experts map to their resident rows."""
    ids = top_k_index.reshape(-1)  # [S]
    sorted_ids, order = torch.sort(ids)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    resident = resident_row[sorted_ids]  # [S], -1 where not resident
    new = first & (resident < 0)
    slot = torch.cumsum(new, 0) - 1  # the distinct non-resident expert's slot, repeated over its pairs
    rows_sorted = torch.where(resident >= 0, resident, slot + slot_base)
    pair_rows = torch.empty_like(rows_sorted)
    pair_rows[order] = rows_sorted
    # slot -> expert: written by each expert's first pair; others write to a spare last entry
    sources = torch.full((fetch_slots + 1,), -1, dtype=torch.int64, device=ids.device)
    sources.scatter_(0, torch.where(new, slot, fetch_slots), torch.where(new, sorted_ids, -1))
    return pair_rows, sources[:fetch_slots]


def plan_fetch_after_prefetch(top_k_index: torch.Tensor, resident_row: torch.Tensor, prefetched: torch.Tensor,
                              slot_base: int = 0):
    """For a layer whose slot set already holds ``prefetched`` ([F] expert id per slot, -1 unused; distinct,
    non-resident): (pair -> device-buffer row [S], slot -> expert id to gather now or -1 [F], counts [4] as
    FETCH_KINDS: prefetched and routed, prefetched and not routed, missed, 0), in fixed shapes. Prefetched
    routed experts keep their slots; each miss (routed, not resident, not prefetched) takes the next slot that
    holds no routed expert (unused, or a wasted prediction), in ascending expert order. There are enough: with
    H hits, at most F - H distinct experts miss and F - H slots are free."""
    num_slots, num_experts = prefetched.numel(), resident_row.numel()
    ids = top_k_index.reshape(-1)  # [S]
    sorted_ids, order = torch.sort(ids)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    resident = resident_row[sorted_ids]  # [S], -1 where not resident
    # expert -> its slot in the set, -1 if not prefetched (unused slots write the spare last entry)
    slot_of = torch.full((num_experts + 1,), -1, dtype=torch.int64, device=ids.device)
    slot_of.scatter_(0, torch.where(prefetched >= 0, prefetched, num_experts),
                     torch.arange(num_slots, device=ids.device))
    hit_slot = slot_of[sorted_ids]  # [S]
    need = first & (resident < 0)
    hit, miss = need & (hit_slot >= 0), need & (hit_slot < 0)
    # a slot keeps its expert when the step routes to it; the others are free for the misses
    routed = torch.zeros(num_experts + 1, dtype=torch.bool, device=ids.device)
    # index_fill_, not `routed[sorted_ids] = True`: that copies a CPU scalar, which a CUDA graph capture refuses
    routed.index_fill_(0, sorted_ids, True)
    keep = (prefetched >= 0) & routed[torch.where(prefetched >= 0, prefetched, num_experts)]
    free_rank = torch.cumsum(~keep, 0) - 1  # [F]
    free_slot = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=ids.device)  # rank -> slot
    free_slot.scatter_(0, torch.where(keep, num_slots, free_rank), torch.arange(num_slots, device=ids.device))
    miss_rank = torch.cumsum(miss, 0) - 1  # the missed expert's rank, repeated over its pairs
    slot = torch.where(hit_slot >= 0, hit_slot, free_slot[miss_rank.clamp(min=0)])
    rows_sorted = torch.where(resident >= 0, resident, slot + slot_base)
    pair_rows = torch.empty_like(rows_sorted)
    pair_rows[order] = rows_sorted
    sources = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=ids.device)
    sources.scatter_(0, torch.where(miss, slot, num_slots), torch.where(miss, sorted_ids, -1))
    num_hits, num_missed = hit.sum(), miss.sum()
    counts = torch.stack((num_hits, (prefetched >= 0).sum() - num_hits, num_missed, torch.zeros_like(num_hits)))
    return pair_rows, sources[:num_slots], counts
