"""runtime.checkpoint_reader: the staging ring and reader that carry a checkpoint's bytes to their destinations."""

import pytest
import torch

from runtime.backend import CpuStandIn

transformers = pytest.importorskip("transformers")


def test_a_short_last_piece_does_not_shrink_the_staging_ring(tmp_path):
    """Device-bound bytes go through the ring in buffer-sized pieces; a tensor's last piece is shorter. With
    one 4 KiB buffer, a 4.25 KiB tensor and then an 8 KiB one must both arrive whole (the short piece's slice
    was given back to the ring instead of the buffer, and the next full piece failed: seen under load)."""
    from runtime.checkpoint_reader import Destination, Reader, SourceTensor, StagingRing
    from runtime.engine import PackedParam

    data = torch.arange(4352 + 8192, dtype=torch.int64).remainder(251).to(torch.uint8)
    path = tmp_path / "bytes.bin"
    path.write_bytes(data.numpy().tobytes())
    backend = CpuStandIn()
    reader = Reader(backend, StagingRing(backend, num_buffers=1, buffer_bytes=4096))
    device = torch.zeros(4352 + 8192, dtype=torch.uint8)
    for offset, size in ((0, 4352), (4352, 8192)):
        source = SourceTensor(name=f"t{offset}", path=path, offset_bytes=offset, num_bytes=size, dtype=torch.uint8,
                              shape=(size,))
        item = PackedParam(f"t{offset}", offset, size, torch.uint8, (size,))
        reader.to_destination(source, Destination(buffer=device, item=item, on_device=True), torch.uint8)
    assert torch.equal(device, data)
