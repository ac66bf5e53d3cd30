"""runtime.allocation: the plan's GPU and host buffers, or one line saying what could not be allocated."""

import pytest
import torch

import runtime.allocation as allocation
from planner.errors import RuntimeUnavailableError
from runtime.backend import CpuStandIn
from runtime.host_pages import HUGE_PAGE_BYTES


def test_a_mapping_the_system_refuses_is_one_line(monkeypatch):
    def refuse(num_bytes):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(allocation, "huge_page_empty", refuse)
    with pytest.raises(RuntimeUnavailableError) as error:
        allocation.host_allocation_or_fail(1 << 40, "the routed experts", "make a plan that routes fewer layers")
    message = str(error.value)
    assert "\n" not in message and "host memory for the routed experts" in message
    assert "routes fewer layers" in message


def test_host_allocation_is_the_bytes_asked_on_a_huge_page_boundary():
    host = allocation.host_allocation_or_fail(3 * 4096)
    assert host.dtype == torch.uint8 and host.numel() == 3 * 4096
    assert host.data_ptr() % HUGE_PAGE_BYTES == 0


def test_a_device_the_plan_does_not_fit_is_one_line():
    class Full(CpuStandIn):
        def alloc_device(self, num_bytes: int) -> torch.Tensor:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert allocation.alloc_device_or_fail(CpuStandIn(), 64).numel() == 64
    with pytest.raises(RuntimeUnavailableError) as error:
        allocation.alloc_device_or_fail(Full(), 2 << 30, "adapter slots", "serve fewer adapters")
    message = str(error.value)
    assert "\n" not in message and "2.00 GiB" in message and "adapter slots" in message
    assert message.endswith("serve fewer adapters")
