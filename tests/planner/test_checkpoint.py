"""The hand-written checkpoints themselves, and how the planner reads them (local folders, files, layouts)."""

import pytest

from tests.conftest import make_checkpoint, nbytes_of, write_safetensors


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


@pytest.mark.parametrize("data", [True, False])
def test_read_entries_matches_what_was_written(tmp_path, data):
    from planner.safetensors_header import read_entries

    tensors = {"x": ("BF16", (4, 8)), "y": ("F8_E4M3", (16,)), "z": ("F32", ())}
    write_safetensors(tmp_path / "x.safetensors", tensors, data=data)
    entries = {e.name: e for e in read_entries(tmp_path / "x.safetensors", "x.safetensors")}
    assert {n: (e.dtype, e.shape, e.nbytes) for n, e in entries.items()} == {
        n: (d, s, nbytes_of(d, s)) for n, (d, s) in tensors.items()}


def test_fingerprint_ignores_sharding_and_config(tmp_path):
    from planner.checkpoint import load_checkpoint

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


def test_layout_of_dense_and_moe(tmp_path):
    from planner.checkpoint import load_checkpoint
    from planner.cost import geometry_from_config
    from planner.layout import build_layout

    dense = make_checkpoint(tmp_path / "dense", num_layers=5, num_shards=2)
    layout = build_layout(load_checkpoint(str(dense.path)))
    assert layout.stack == "model.layers" and len(layout.layers) == 5
    assert [layer.nbytes for layer in layout.layers] == [dense.layer_bytes(i) for i in range(5)]
    assert layout.non_layer_bytes == dense.non_layer_bytes
    assert set(layout.non_layer_names) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}

    moe = make_checkpoint(tmp_path / "moe", num_layers=3, num_shards=2,
                          moe={"num_experts": 8, "top_k": 2, "expert_intermediate": 16})
    checkpoint = load_checkpoint(str(moe.path))
    layout = build_layout(checkpoint)
    assert len(layout.layers) == 3, "experts.E must stay inside their layer"
    assert layout.layers[0].matching_bytes(("experts",)) == moe.expert_bytes(0)
    assert layout.layers[0].matching_bytes(("expert",)) == 0  # whole segments only
    assert layout.layers[0].matching_bytes(("mlp",)) == moe.expert_bytes(0) + nbytes_of("BF16", (8, 64))
    geometry = geometry_from_config(checkpoint.config, layout)
    assert (geometry.num_experts, geometry.top_k, geometry.head_dim) == (8, 2, 16)
    # without config.json the expert count comes from the names, top_k from the default
    no_config = make_checkpoint(tmp_path / "moe-nc", num_layers=3, num_shards=1, config=False,
                                moe={"num_experts": 8, "top_k": 2})
    layout = build_layout(load_checkpoint(str(no_config.path)))
    assert geometry_from_config(None, layout).num_experts == 8


def test_config_layer_count_marks_extra_layers_unused(tmp_path):
    from planner.checkpoint import load_checkpoint
    from planner.layout import build_layout

    written = make_checkpoint(tmp_path / "mtp", num_layers=5, num_shards=2, extra_config={"num_hidden_layers": 4})
    layout = build_layout(load_checkpoint(str(written.path)))
    assert len(layout.layers) == 4
    assert [layer.index for layer in layout.unused_layers] == [4]
    assert layout.unused_bytes == written.layer_bytes(4)


def test_parse_bytes():
    from planner.errors import UsageError
    from planner.units import parse_bytes

    assert parse_bytes("40GiB") == 40 * 2**30
    assert parse_bytes("80 GB") == 80 * 10**9
    assert parse_bytes("1.5KiB") == 1536
    assert parse_bytes("123B") == 123
    assert parse_bytes("40G") == parse_bytes("40g") == parse_bytes("40GB") == parse_bytes("40gb") == 40 * 10**9
    assert parse_bytes("40Gi") == parse_bytes("40gib") == 40 * 2**30
    assert parse_bytes("1e3KB") == 10**6 and parse_bytes("2T") == 2 * 10**12
    for bad, message in (("", "cannot read it as a size"), ("GiB", "cannot read"), ("5 parsecs", "cannot read"),
                         ("nan", "cannot read"), ("inf GB", "cannot read"), ("-5GB", "negative"),
                         ("1e400", "has no unit"), ("1e400GB", "too large"), ("2e18GiB", "too large"),
                         ("40", "40 has no unit: did you mean 40GiB"),
                         ("42949672960", "did you mean 42949672960B")):
        with pytest.raises(UsageError, match=message) as raised:
            parse_bytes(bad, "--budget")
        assert "\n" not in str(raised.value) and str(raised.value).startswith("--budget ")
