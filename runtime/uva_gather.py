"""The routed experts' gather: rows of page-locked, mapped host memory read by GPU threads at their host address
(unified virtual addressing), only the rows a step asks for crossing the link; and the mapped host range as a
CUDA tensor over the same memory (device_view).
"""

import torch

from planner.errors import RuntimeUnavailableError
from planner.units import format_bytes

#: 32-bit words each Triton program copies (4 warps: 32 words, eight 16-byte loads, per thread)
GATHER_BLOCK_WORDS = 4096


#: warps per program of the gather (Triton's default; scripts/bench_experts.py --gather-shapes sweeps both)
GATHER_NUM_WARPS = 4


def gather_rows(source: torch.Tensor, destination: torch.Tensor, source_ids: torch.Tensor,
                max_programs: int | None = None, block_words: int = GATHER_BLOCK_WORDS,
                num_warps: int = GATHER_NUM_WARPS) -> None:
    """destination[k] = source[source_ids[k]] for every k with source_ids[k] >= 0; the others untouched.
    ``source`` [E, ...] may be host memory mapped into the device (UVA): on CUDA a Triton kernel reads only the
    rows asked for, with at most ``max_programs`` persistent programs (None: one per block of every slot, the
    full grid) of ``num_warps`` warps, each copying ``block_words`` 32-bit words at a time (a power of two); on
    the CPU (tests) the same semantics in torch."""
    if destination.device.type == "cuda":
        _gather_rows_triton(source, destination, source_ids, max_programs, block_words, num_warps)
        return
    take = (source_ids >= 0).nonzero().flatten()
    destination[take] = source[source_ids[take]]


def _gather_rows_triton(source: torch.Tensor, destination: torch.Tensor, source_ids: torch.Tensor,
                        max_programs: int | None = None, block_words: int = GATHER_BLOCK_WORDS,
                        num_warps: int = GATHER_NUM_WARPS) -> None:
    row_bytes = source[0].numel() * source.element_size()
    words = 4 if row_bytes % 4 == 0 else 1
    dtype = torch.int32 if words == 4 else torch.uint8
    row_words = row_bytes // words
    source_words = source.view(torch.uint8).view(dtype) if source.dtype != dtype else source
    destination_words = destination.view(torch.uint8).view(dtype) if destination.dtype != dtype else destination
    chunks_per_row = -(-row_words // block_words)
    num_items = source_ids.numel() * chunks_per_row
    grid = (max(1, min(num_items, max_programs or num_items)),)
    _gather_kernel()[grid](source_words, destination_words, source_ids, row_words, chunks_per_row, num_items,
                           BLOCK=block_words, num_warps=num_warps)


_KERNEL = {}


def _gather_kernel():
    """The Triton gather, compiled on first use (triton ships with CUDA builds of torch)."""
    if "gather" not in _KERNEL:
        import triton
        import triton.language as tl

        @triton.jit
        def gather(source, destination, source_ids, row_words, chunks_per_row, num_items, BLOCK: tl.constexpr):
            # persistent programs: item = slot x chunks_per_row + chunk, strided over the grid, so a bounded
            # grid (a side stream's prefetch) still covers every block of every slot
            for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
                slot = item // chunks_per_row
                chunk = item % chunks_per_row
                expert = tl.load(source_ids + slot)
                if expert >= 0:  # an unused slot or one already there: nothing crosses the link
                    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
                    mask = offsets < row_words
                    values = tl.load(source + expert.to(tl.int64) * row_words + offsets, mask=mask)
                    tl.store(destination + slot.to(tl.int64) * row_words + offsets, values, mask=mask)

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
