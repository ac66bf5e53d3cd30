"""GPU and host allocations that fail in one line: the plan's arena, the routed experts' and the adapters' buffers.

Apart from runtime.load so that what load builds (the routed experts, the adapter pool) allocates without
importing it.
"""

import torch

from planner.errors import RuntimeUnavailableError
from planner.units import format_bytes
from runtime.host_pages import huge_page_empty


def alloc_device_or_fail(backend, num_bytes: int, what: str = "weights and slots",
                         fix: str = "make a plan with a smaller --budget") -> torch.Tensor:
    """A device buffer, or a one-line error when the GPU cannot hold it (another process took memory since
    the check, or the allocator is fragmented)."""
    try:
        return backend.alloc_device(num_bytes)
    except torch.OutOfMemoryError:
        raise RuntimeUnavailableError(
            f"the GPU ran out of memory allocating the plan's {num_bytes} bytes ({format_bytes(num_bytes)}) of "
            f"{what}; free GPU memory (other processes?) or {fix}"
        ) from None


def host_allocation_or_fail(num_bytes: int, what: str = "the offloaded layers",
                            fix: str = "make a plan with a larger --budget") -> torch.Tensor:
    """A host allocation to be pinned (the offloaded layers, piece by piece), or a one-line error. Its storage
    starts on a huge-page boundary (runtime.host_pages: GPU threads read such memory faster), and ``num_bytes``
    (host_offsets' total) is whole pages, so no piece shares a page with another or with any other allocation."""
    try:
        return huge_page_empty(num_bytes)
    except OSError:  # mmap's ENOMEM
        raise RuntimeUnavailableError(
            f"cannot allocate {num_bytes} bytes ({format_bytes(num_bytes)}) of host memory for {what}; free host "
            f"memory or {fix}"
        ) from None
