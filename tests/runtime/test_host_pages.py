"""runtime.host_pages: host memory for weights the GPU reads, on a 2 MiB boundary and advised huge pages."""

import mmap

import pytest
import torch

from runtime.host_pages import HUGE_PAGE_BYTES, advise_huge_pages, huge_page_copy, huge_page_empty


@pytest.mark.parametrize("num_bytes", [1, 4096, 3 * HUGE_PAGE_BYTES + 12345])
def test_allocation_starts_on_a_huge_page_and_owns_its_storage(num_bytes):
    host = huge_page_empty(num_bytes)
    assert host.dtype == torch.uint8 and host.numel() == num_bytes
    assert host.data_ptr() % HUGE_PAGE_BYTES == 0
    # torch asks is_pinned about a storage's first byte: the storage must begin where the tensor does
    assert host.untyped_storage().data_ptr() == host.data_ptr()
    host.fill_(7)
    assert int(host.sum()) == 7 * num_bytes


def test_nothing_to_allocate_is_an_empty_tensor():
    host = huge_page_empty(0)
    assert host.dtype == torch.uint8 and host.numel() == 0


def test_the_mapping_lives_as_long_as_the_tensor():
    host = huge_page_empty(HUGE_PAGE_BYTES)
    view = host[10:20]
    del host
    view.fill_(3)
    assert view.tolist() == [3] * 10


def test_copy_is_equal_contiguous_and_aligned():
    source = torch.arange(3 * 5 * 7, dtype=torch.float32).view(3, 5, 7).transpose(0, 2)
    copied = huge_page_copy(source)
    assert torch.equal(copied, source) and copied.is_contiguous()
    assert copied.data_ptr() % HUGE_PAGE_BYTES == 0


def test_advice_is_a_hint_never_a_failure():
    mapping = mmap.mmap(-1, HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    assert advise_huge_pages(mapping) in (True, False)
