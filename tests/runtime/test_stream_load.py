"""runtime.stream_load on the CPU stand-in: the read order (device-bound first, then each offloaded layer's piece),
buffers, the phase record, and reads that never wait for page-locking."""

import pytest
import torch

from planner.errors import ModelInputError
from runtime.backend import CpuStandIn
from tests.runtime.conftest import engine_pieces, resident_plan, unpinned_placement
from tests.runtime_models import plan_with, skeleton, stream_on_cpu

pytest.importorskip("transformers")


def test_host_reads_do_not_wait_for_page_locking(checkpoints, monkeypatch):
    """Page-locking tens of GB takes seconds: while the first layer's piece is being page-locked, the later
    layers' bytes are read into unpinned host memory."""
    import runtime.checkpoint_reader as checkpoint_reader
    import runtime.stream_load as stream_load
    from runtime.load import stream_model

    folder = checkpoints("llama")
    backend = _SlowPinGpu()
    monkeypatch.setattr(stream_load, "STAGING_BYTES", 4096)  # a ring of 4 KiB buffers
    read_exact = checkpoint_reader.read_exact

    def logged_read(fd, offset, target, path):
        read_exact(fd, offset, target, path)
        backend.log_read(target)

    monkeypatch.setattr(checkpoint_reader, "read_exact", logged_read)
    model, engine = stream_model(folder, plan_with(folder, 3, 2, 1), backend)  # 4 of 7 layers offloaded
    assert backend.num_pieces_pinned == 4 and backend.pinned == engine_pieces(engine)  # the ring was unpinned


def test_reads_go_device_bound_first_then_piece_by_piece_largest_first(checkpoints):
    """So each piece fills early and is page-locked while the later ones are read; per-expert tensors (read
    into their fused params) are ordered with their layer's piece."""
    from runtime.checkpoint_reader import checkpoint_files, read_sources
    from runtime.skeleton import plan_reads
    from runtime.stream_load import read_order

    folder = checkpoints("qwen3-moe")
    files = checkpoint_files(folder)
    model = skeleton(folder)
    work = plan_reads(model, read_sources(files))
    placement = unpinned_placement(folder, plan_with(folder, 4, 3, 2), CpuStandIn())
    destinations = placement.destinations

    def key(task):
        kind, payload = task
        if kind in ("direct", "slice"):
            source, name = payload[:2]
            piece = destinations[name].piece
            return (-1 if piece is None else piece, -source.num_bytes)
        target = work.converted_targets[next(k for k, g in enumerate(work.converted) if g is payload)]
        piece = destinations[target].piece
        return (-1 if piece is None else piece, -sum(s.num_bytes for s in payload))

    order = [key(task) for task in read_order(work, destinations)]
    assert order == sorted(order) and len(order) == len(work.direct) + len(work.converted) + len(work.sliced)
    assert {piece for piece, _ in order} == {-1, 0, 1, 2}  # device-bound, then the 3 offloaded layers
    sliced = [task for task in read_order(work, destinations) if task[0] == "slice"]
    assert any(key(task)[0] >= 0 for task in sliced)  # per-expert tensors of offloaded layers among their piece


def test_a_persistent_buffer_in_the_checkpoint_is_loaded_like_from_pretrained(checkpoints, tmp_path):
    from safetensors.torch import save_file

    from runtime.checkpoint_reader import checkpoint_files, read_sources
    from runtime.skeleton import plan_reads
    from runtime.stream_load import _load_buffer

    folder = checkpoints("llama")
    files = checkpoint_files(folder)
    model = skeleton(folder)
    model.model.register_buffer("scale", torch.zeros(4))  # persistent: it is in the state dict
    extra = tmp_path / "extra.safetensors"
    save_file({"model.scale": torch.arange(4, dtype=torch.float64)}, str(extra))
    work = plan_reads(model, {**read_sources(files), **read_sources([extra])})
    assert [(source.name, name) for source, name in work.buffers] == [("model.scale", "model.scale")]
    _load_buffer(model, "model.scale", torch.arange(4, dtype=torch.float64))
    assert model.model.scale.dtype == torch.float32 and model.model.scale.tolist() == [0, 1, 2, 3]
    with pytest.raises(ModelInputError, match="shape"):
        _load_buffer(model, "model.scale", torch.zeros(5))


def test_the_phase_record_says_when_reads_and_pins_ended(checkpoints):
    from runtime.stream_load import LoadPhases

    folder = checkpoints("llama")
    phases = LoadPhases()
    stream_on_cpu(folder, plan_with(folder, 3, 2, 1), phases=phases)
    assert phases.num_pieces_pinned == 4 and phases.pin_busy_s >= 0
    assert 0 < phases.device_reads_done_s <= phases.streamed_s
    assert 0 < phases.host_reads_done_s <= phases.last_pin_done_s <= phases.streamed_s
    resident = LoadPhases()
    stream_on_cpu(folder, resident_plan(folder), phases=resident)
    assert resident.host_reads_done_s is None and resident.last_pin_done_s is None
    assert resident.num_pieces_pinned == 0 and resident.device_reads_done_s <= resident.streamed_s


class _SlowPinGpu(CpuStandIn):
    """A 'GPU' (resident bytes go through the staging ring) whose page-locking of the first host piece lasts
    until a read into another piece has finished."""

    def __init__(self):
        super().__init__()
        import threading

        self.device = torch.device("meta")  # not "cpu": the loader stages resident bytes
        self.ring = None
        #: start address of each read into host memory (not the ring), as it finishes
        self.host_reads = []
        self.read_landed = threading.Condition()
        self.num_pieces_pinned = 0

    def alloc_device(self, num_bytes):
        return torch.empty(num_bytes, dtype=torch.uint8)

    def pin(self, tensor):
        if self.ring is None:  # the staging ring, pinned first: at once
            self.ring = range(tensor.data_ptr(), tensor.data_ptr() + tensor.numel())
            return super().pin(tensor)
        if self.num_pieces_pinned == 0:
            piece = range(tensor.data_ptr(), tensor.data_ptr() + tensor.numel())
            with self.read_landed:
                assert self.read_landed.wait_for(lambda: any(a not in piece for a in self.host_reads), 30), (
                    "reads into the other pieces waited for the first piece's page-locking")
        self.num_pieces_pinned += 1
        return super().pin(tensor)

    def log_read(self, target):
        if target.data_ptr() not in self.ring:
            with self.read_landed:
                self.host_reads.append(target.data_ptr())
                self.read_landed.notify_all()
