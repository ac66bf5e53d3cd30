"""planner.source.safetensors_header: a shard's header read into its tensor entries."""

import pytest

from tests.conftest import nbytes_of, write_safetensors


@pytest.mark.parametrize("data", [True, False])
def test_read_entries_matches_what_was_written(tmp_path, data):
    from planner.source.safetensors_header import read_entries

    tensors = {"x": ("BF16", (4, 8)), "y": ("F8_E4M3", (16,)), "z": ("F32", ())}
    write_safetensors(tmp_path / "x.safetensors", tensors, data=data)
    entries = {e.name: e for e in read_entries(tmp_path / "x.safetensors", "x.safetensors")}
    assert {n: (e.dtype, e.shape, e.nbytes) for n, e in entries.items()} == {
        n: (d, s, nbytes_of(d, s)) for n, (d, s) in tensors.items()}
