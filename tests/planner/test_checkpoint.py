"""The hand-written checkpoints themselves, and how the planner reads them (local folders, files, layouts)."""

import pytest

from tests.conftest import make_checkpoint, write_safetensors


def test_write_safetensors_is_readable_by_the_safetensors_library(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    tensors = {"a.weight": ("BF16", (3, 5)), "b.bias": ("F32", (7,)), "c": ("I64", (2, 2, 2)), "d": ("U8", (0,))}
    assert write_safetensors(tmp_path / "x.safetensors", tensors) == 30 + 28 + 64
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as handle:
        assert sorted(handle.keys()) == sorted(tensors)
        for name, (_, shape) in tensors.items():
            assert tuple(handle.get_tensor(name).shape) == shape


def test_fingerprint_ignores_sharding_and_config(tmp_path):
    from planner.source.checkpoint import load_checkpoint

    one = make_checkpoint(tmp_path / "one", num_layers=3, num_shards=1)
    three = make_checkpoint(tmp_path / "three", num_layers=3, num_shards=3, config=False)
    single = tmp_path / "single"
    write_safetensors(single / "model.safetensors", one.tensors)
    prints = {load_checkpoint(str(p)).fingerprint() for p in (one.path, three.path, single,
                                                               single / "model.safetensors")}
    assert len(prints) == 1
    other = make_checkpoint(tmp_path / "other", num_layers=3, num_shards=1, num_kv_heads=2)
    assert load_checkpoint(str(other.path)).fingerprint() not in prints
    assert load_checkpoint(str(three.path)).config is None and load_checkpoint(str(three.path)).num_files == 3
