"""Host memory for weights the GPU reads: an anonymous mapping on a 2 MiB boundary, advised MADV_HUGEPAGE.

The routed experts' gather (runtime.routed_experts.gather_rows) has GPU threads read page-locked host memory
mapped into the device. On an H100 host whose kernel hands out transparent huge pages on request only
(``/sys/kernel/mm/transparent_hugepage/enabled`` = madvise, the common default), the gather read such memory at
49.9-50.1 GB/s against 48.3-48.5 GB/s from torch's allocator, whose pages are 4 KiB; the copy engine's rate was
the same either way (scripts/experiments/gather_rate_sweep.py, benchmarks/2026-11-26-huge-pages-h100.md).
Kernels without transparent huge pages give ordinary pages: the advice is a hint, never a failure.
"""

import mmap

import torch

#: the x86-64 and arm64 (4 KiB granule) transparent huge page: the start is aligned to it so that every
#: whole 2 MiB of the allocation can be one page
HUGE_PAGE_BYTES = 2 << 20


def huge_page_empty(num_bytes: int) -> torch.Tensor:
    """``num_bytes`` of uninitialised host memory as a uint8 tensor whose storage begins on a 2 MiB boundary of
    an anonymous mapping advised MADV_HUGEPAGE (the tensor keeps the mapping alive). Raises OSError where the
    mapping cannot be made (out of address space or memory)."""
    if num_bytes == 0:  # nothing to map (torch.frombuffer refuses a count of 0)
        return torch.empty(0, dtype=torch.uint8)
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(mapping)
    skip_bytes = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE_BYTES
    # the pages before skip_bytes and after the end are never touched: address space only, no memory
    return torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes, offset=skip_bytes)


def advise_huge_pages(mapping: mmap.mmap) -> bool:
    """Ask for transparent huge pages over ``mapping``; False where this system has none to give."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if advice is None:
        return False
    try:
        mapping.madvise(advice)
    except OSError:  # a kernel built without transparent huge pages refuses the advice (EINVAL)
        return False
    return True


def huge_page_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``tensor`` (any device) in huge-page memory, its storage its own: what a
    benchmark's model adopts in place of torch's allocation, so its host weights sit as run's do."""
    host = huge_page_empty(tensor.numel() * tensor.element_size()).view(tensor.dtype).view(tensor.shape)
    host.copy_(tensor)
    return host
