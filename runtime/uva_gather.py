"""The routed experts' gather: rows of page-locked, mapped host memory read by GPU threads at their host address
(unified virtual addressing), only the rows a step asks for crossing the link; and the mapped host range as a
CUDA tensor over the same memory (device_view).

A step may split one expert by its intermediate rows with the host CPU (runtime.fetch_planning's part: expert id,
rows r, slot): its slot then gets the expert's values where PartLayout says an element lies in rows [r, I) and
zeros in rows [0, r), so the GPU's SwiGLU over the slot adds exactly nothing for the rows the CPU computes (silu(0)
x 0 = 0, times zero columns of down), and only the other rows' bytes cross the link.
"""

from dataclasses import dataclass

import torch

from planner.errors import RuntimeUnavailableError
from planner.units import format_bytes

#: 32-bit words each Triton program copies (4 warps: 32 words, eight 16-byte loads, per thread)
GATHER_BLOCK_WORDS = 4096


#: warps per program of the gather (Triton's default; scripts/bench_experts.py --gather-shapes sweeps both)
GATHER_NUM_WARPS = 4


@dataclass(frozen=True)
class PartLayout:
    """One expert's param as a matrix [rows, columns] and where its intermediate rows lie in it: gate_up [2I, H] by
    its rows (row i is intermediate row i mod ``period`` = I: gate rows, then up rows), down [H, I] by its columns
    (``by_columns``: column i is intermediate row i)."""

    rows: int
    columns: int
    period: int
    by_columns: bool

    def kept(self, rows: int) -> torch.Tensor:
        """[rows, columns] bool: the elements outside intermediate rows [0, ``rows``) (the link's part)."""
        if self.by_columns:
            return (torch.arange(self.columns) >= rows).expand(self.rows, self.columns)
        return ((torch.arange(self.rows) % self.period) >= rows).unsqueeze(1).expand(self.rows, self.columns)


def part_layout(name: str, row_shape: tuple[int, ...]) -> PartLayout:
    """The PartLayout of a SwiGLU expert param (``row_shape``: one expert's): gate_up_proj [2I, H], down_proj
    [H, I]."""
    if name == "gate_up_proj":
        return PartLayout(rows=row_shape[0], columns=row_shape[1], period=row_shape[0] // 2, by_columns=False)
    if name == "down_proj":
        return PartLayout(rows=row_shape[0], columns=row_shape[1], period=row_shape[1], by_columns=True)
    raise ValueError(f"{name} is not a SwiGLU expert param a part of an expert splits (gate_up_proj, down_proj)")


def gather_rows(source: torch.Tensor, destination: torch.Tensor, source_ids: torch.Tensor,
                max_programs: int | None = None, block_words: int = GATHER_BLOCK_WORDS,
                num_warps: int = GATHER_NUM_WARPS, part: torch.Tensor | None = None,
                layout: PartLayout | None = None) -> None:
    """destination[k] = source[source_ids[k]] for every k with source_ids[k] >= 0; the others untouched.
    ``source`` [E, ...] may be host memory mapped into the device (UVA): on CUDA a Triton kernel reads only the
    rows asked for, with at most ``max_programs`` persistent programs (None: one per block of every slot, the
    full grid) of ``num_warps`` warps, each copying ``block_words`` 32-bit words at a time (a power of two); on
    the CPU (tests) the same semantics in torch. ``part`` (int64 [3]: expert, rows r, slot; expert -1: none) with
    ``layout``: that slot gets the expert's elements in intermediate rows [r, I) and zeros in [0, r) (the module
    docstring), the rest of the step's slots as above."""
    if destination.device.type == "cuda":
        _gather_rows_triton(source, destination, source_ids, max_programs, block_words, num_warps, part, layout)
        return
    ids = source_ids if part is None else torch.where(source_ids == part[0], -1, source_ids)
    take = (ids >= 0).nonzero().flatten()
    destination[take] = source[ids[take]]
    if part is not None and int(part[0]) >= 0:
        expert, rows, slot = (int(value) for value in part[:3])
        values = source[expert].reshape(layout.rows, layout.columns)
        destination[slot].view(layout.rows, layout.columns).copy_(
            torch.where(layout.kept(rows), values, torch.zeros((), dtype=values.dtype)))


def _gather_rows_triton(source: torch.Tensor, destination: torch.Tensor, source_ids: torch.Tensor,
                        max_programs: int | None = None, block_words: int = GATHER_BLOCK_WORDS,
                        num_warps: int = GATHER_NUM_WARPS, part: torch.Tensor | None = None,
                        layout: PartLayout | None = None) -> None:
    row_bytes = source[0].numel() * source.element_size()
    words = 4 if row_bytes % 4 == 0 else 1
    dtype = torch.int32 if words == 4 else torch.uint8
    row_words = row_bytes // words
    source_words = source.view(torch.uint8).view(dtype) if source.dtype != dtype else source
    destination_words = destination.view(torch.uint8).view(dtype) if destination.dtype != dtype else destination
    chunks_per_row = -(-row_words // block_words)
    num_items = source_ids.numel() * chunks_per_row
    with_part = part is not None
    tiles = _part_tiles(layout, words, source.element_size(), block_words) if with_part else _PartTiles()
    # the part's tiles follow the slots' chunks: programs that return at once where the step splits no expert
    total_items = num_items + tiles.count
    grid = (max(1, min(total_items, max_programs or total_items)),)
    _gather_kernel()[grid](source_words, destination_words, source_ids, row_words, chunks_per_row, num_items,
                           part if with_part else source_ids, tiles.rows, tiles.row_words, tiles.period,
                           tiles.column_chunks, tiles.count, source.element_size(), words, WITH_PART=with_part,
                           BY_COLUMNS=tiles.by_columns, ROWS_BLOCK=tiles.rows_block, COLUMNS_BLOCK=tiles.columns_block,
                           BLOCK=block_words, num_warps=num_warps)


@dataclass(frozen=True)
class _PartTiles:
    """How the gather's programs tile a split expert's param: [rows, row_words] words in tiles of
    [rows_block, columns_block], column_chunks tiles across a row; count tiles in all."""

    rows: int = 1
    row_words: int = 1
    period: int = 1
    by_columns: bool = False
    rows_block: int = 1
    columns_block: int = 1
    column_chunks: int = 1
    count: int = 0


def _part_tiles(layout: PartLayout, word_bytes: int, element_bytes: int, block_words: int) -> _PartTiles:
    """The part's tiles: each whole words of a row, contiguous, so the loads vectorize (a mask by rows is constant
    along a row; by columns, the CPU's columns end on a PART_ROWS_MULTIPLE boundary, whole words)."""
    row_words = layout.columns * element_bytes // word_bytes
    columns_block = min(triton_next_power_of_2(row_words), block_words)
    column_chunks = -(-row_words // columns_block)
    rows_block = max(1, block_words // columns_block)
    count = -(-layout.rows // rows_block) * column_chunks
    return _PartTiles(rows=layout.rows, row_words=row_words, period=layout.period, by_columns=layout.by_columns,
                      rows_block=rows_block, columns_block=columns_block, column_chunks=column_chunks, count=count)


def triton_next_power_of_2(value: int) -> int:
    """The least power of two at least ``value`` (triton.next_power_of_2, without importing triton)."""
    return 1 << max(0, (value - 1).bit_length())


_KERNEL = {}


def _gather_kernel():
    """The Triton gather, compiled on first use (triton ships with CUDA builds of torch)."""
    if "gather" not in _KERNEL:
        import triton
        import triton.language as tl

        @triton.jit
        def gather(source, destination, source_ids, row_words, chunks_per_row, num_items, part, part_rows_total,
                   part_row_words, period, column_chunks, part_items, element_bytes, word_bytes,
                   WITH_PART: tl.constexpr, BY_COLUMNS: tl.constexpr, ROWS_BLOCK: tl.constexpr,
                   COLUMNS_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
            # persistent programs: item = slot x chunks_per_row + chunk, strided over the grid, so a bounded
            # grid (a side stream's prefetch) still covers every block of every slot; with a part, the items past
            # num_items are the part's tiles
            part_expert = -1
            if WITH_PART:
                part_expert = tl.load(part)
                part_rows = tl.load(part + 1)
                part_slot = tl.load(part + 2)
            for item in range(tl.program_id(0), num_items + part_items, tl.num_programs(0)):
                if item < num_items:
                    slot = item // chunks_per_row
                    chunk = item % chunks_per_row
                    expert = tl.load(source_ids + slot)
                    # an unused slot, one already there, or the part (its own chunks): nothing crosses here
                    if (expert >= 0) & (expert != part_expert):
                        offsets = chunk * BLOCK + tl.arange(0, BLOCK)
                        mask = offsets < row_words
                        values = tl.load(source + expert.to(tl.int64) * row_words + offsets, mask=mask)
                        tl.store(destination + slot.to(tl.int64) * row_words + offsets, values, mask=mask)
                elif WITH_PART:
                    if part_expert >= 0:
                        tile = item - num_items
                        rows = (tile // column_chunks) * ROWS_BLOCK + tl.arange(0, ROWS_BLOCK)
                        columns = (tile % column_chunks) * COLUMNS_BLOCK + tl.arange(0, COLUMNS_BLOCK)
                        inside = (rows[:, None] < part_rows_total) & (columns[None, :] < part_row_words)
                        if BY_COLUMNS:  # the CPU's first columns: whole words (a multiple of 16 elements)
                            skip = tl.multiple_of(part_rows * element_bytes // word_bytes, 8)
                            kept = columns[None, :] >= skip
                        else:
                            kept = (rows[:, None] % period) >= part_rows
                        offsets = rows[:, None].to(tl.int64) * part_row_words + columns[None, :]
                        values = tl.load(source + part_expert * row_words + offsets, mask=inside & kept, other=0)
                        tl.store(destination + part_slot * row_words + offsets, values, mask=inside)

        _KERNEL["gather"] = gather
    return _KERNEL["gather"]


class _CudaArray:
    """A page-locked, mapped host range described as a CUDA array (``__cuda_array_interface__``), so torch
    wraps it as a CUDA tensor at the same address (unified virtual addressing)."""

    def __init__(self, tensor: torch.Tensor):
        self._keep = tensor
        typestr = {torch.uint8: "|u1", torch.int16: "<i2", torch.int32: "<i4", torch.int64: "<i8"}[tensor.dtype]
        self.__cuda_array_interface__ = {"shape": tuple(tensor.shape), "typestr": typestr,
                                         "data": (tensor.data_ptr(), False), "version": 3,
                                         "strides": tuple(s * tensor.element_size() for s in tensor.stride())}


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (page-locked, mapped) as a tensor on ``device`` over the same memory; on the CPU, itself."""
    if device.type != "cuda":
        return host
    raw = host.view(torch.uint8) if host.element_size() == 1 else host.view({2: torch.int16, 4: torch.int32,
                                                                              8: torch.int64}[host.element_size()])
    try:
        view = torch.as_tensor(_CudaArray(raw), device=device)
    except RuntimeError as error:
        raise RuntimeUnavailableError(f"cannot map {format_bytes(host.numel() * host.element_size())} of page-locked "
                                      f"host memory into the GPU's address space ({str(error).splitlines()[0]}); "
                                      "routed experts need unified addressing (64-bit Linux, CUDA >= 4)") from None
    return view.view(host.dtype)
