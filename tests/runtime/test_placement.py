"""runtime.placement on the CPU stand-in: the host pieces (one per offloaded layer, page-aligned, disjoint), and every
piece unpinned when placement is released or refused part way."""

import pytest

from planner.errors import RuntimeUnavailableError
from runtime.backend import CpuStandIn
from runtime.load import build_model
from tests.runtime.conftest import engine_pieces, RefusesPiece, unpinned_placement
from tests.runtime_models import plan_with, stream_on_cpu

pytest.importorskip("transformers")


def test_host_pieces_are_the_layer_spans_page_aligned_and_disjoint(checkpoints):
    """A piece is exactly what the engine copies for one layer; each starts on a page and none shares a page
    with another (cudaHostRegister pins whole pages and refuses overlapping ranges)."""
    import mmap

    from runtime.engine import host_offsets, packed_bytes

    folder = checkpoints("qwen3-moe")
    placement = unpinned_placement(folder, plan_with(folder, 4, 3, 2), CpuStandIn())
    layer_bytes = [packed_bytes(layout) for layout in placement.layouts]
    offsets = host_offsets(layer_bytes)
    base = placement.host.data_ptr()
    assert base % mmap.PAGESIZE == 0 and placement.host.numel() == offsets[-1]
    assert [(p.data_ptr() - base, p.numel()) for p in placement.pieces] == list(zip(offsets, layer_bytes))
    assert all(p.numel() > 0 for p in placement.pieces) and len(placement.pieces) == 3
    for piece, following in zip(placement.pieces, placement.pieces[1:]):
        assert (piece.data_ptr() + piece.numel() - 1) // mmap.PAGESIZE < following.data_ptr() // mmap.PAGESIZE
    for destination in placement.destinations.values():  # every offloaded param lies in its layer's piece
        if destination.piece is not None:
            assert destination.buffer is placement.pieces[destination.piece]
            assert destination.item.offset_bytes + destination.item.num_bytes <= destination.buffer.numel()


def test_apply_plan_refused_part_way_unpins_the_pieces_pinned(checkpoints):
    """The non-streaming path pins every piece up front: a refusal at the third leaves none pinned."""
    from runtime.placement import apply_plan

    folder = checkpoints("llama")
    backend = RefusesPiece(num_allowed=2)
    with pytest.raises(RuntimeUnavailableError, match="memlock limit is") as error:
        apply_plan(build_model(str(folder), None), plan_with(folder, 3, 2, 1), backend)
    assert "\n" not in str(error.value) and backend.events == ["pin", "pin", "refused"] and backend.pinned == {}


def test_placement_release_and_engine_close_unpin_every_piece(checkpoints):
    from tests.runtime_models import apply_plan_on_cpu

    folder = checkpoints("llama")
    backend = CpuStandIn()
    placement = unpinned_placement(folder, plan_with(folder, 3, 2, 1), backend)
    placement.pin_host(backend)
    assert len(backend.pinned) == 4 and placement.host_pinned
    placement.release(backend)
    assert backend.pinned == {} and placement.pinned_pieces == []
    engine = apply_plan_on_cpu(build_model(str(folder), None), plan_with(folder, 3, 2, 1))
    assert engine.backend.pinned == engine_pieces(engine) and len(engine.backend.pinned) == 4  # place_plan(pin=True)
    engine.close()
    assert engine.backend.pinned == {}
    model, engine = stream_on_cpu(folder, plan_with(folder, 3, 2, 1))
    engine.close()
    assert engine.backend.pinned == {}
