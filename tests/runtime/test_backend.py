"""runtime.backend: the CPU stand-in refuses what CUDA's host registration refuses."""

import pytest
import torch

from runtime.backend import CpuStandIn

transformers = pytest.importorskip("transformers")


def test_the_stand_in_refuses_what_cuda_host_register_refuses():
    """Pinning a range twice, a range sharing a page with a registered one, or unpinning what is not
    registered fail on CUDA; the stand-in asserts, so a loader that does any of these fails in CI."""
    import mmap

    backend = CpuStandIn()
    allocation = torch.empty(4 * mmap.PAGESIZE, dtype=torch.uint8)
    base = -allocation.data_ptr() % mmap.PAGESIZE
    first, second = allocation[base:base + 100], allocation[base + 200:base + 300]
    backend.pin(first)
    with pytest.raises(AssertionError, match="overlaps"):
        backend.pin(first)
    with pytest.raises(AssertionError, match="overlaps"):
        backend.pin(second)  # disjoint bytes, same page
    backend.pin(allocation[base + mmap.PAGESIZE:base + mmap.PAGESIZE + 1])  # the next page: fine
    with pytest.raises(AssertionError, match="not registered"):
        backend.unpin(second)
    backend.unpin(first)
    with pytest.raises(AssertionError, match="not registered"):
        backend.unpin(first)
