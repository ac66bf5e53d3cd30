"""planner.model.layout: a checkpoint's tensors grouped into the stack's layers and the rest."""

from tests.conftest import make_checkpoint, nbytes_of


def test_layout_of_dense_and_moe(tmp_path):
    from planner.source.checkpoint import load_checkpoint
    from planner.model.cost import geometry_from_config
    from planner.model.layout import build_layout

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
    from planner.source.checkpoint import load_checkpoint
    from planner.model.layout import build_layout

    written = make_checkpoint(tmp_path / "mtp", num_layers=5, num_shards=2, extra_config={"num_hidden_layers": 4})
    layout = build_layout(load_checkpoint(str(written.path)))
    assert len(layout.layers) == 4
    assert [layer.index for layer in layout.unused_layers] == [4]
    assert layout.unused_bytes == written.layer_bytes(4)


def test_layer_kinds_groups_identical_layers():
    from planner.model.layout import LayerInfo, layer_kinds

    dense = (("mlp.w", "BF16", (4, 4), 32),)
    moe = (("mlp.experts.0.w", "BF16", (4, 4), 32), ("mlp.gate.weight", "BF16", (2, 4), 16))
    layers = tuple(LayerInfo(index=i, params=dense if i < 2 else moe) for i in range(5))
    assert layer_kinds(layers) == ((0, 1), (2, 3, 4))


def _layout_error(folder) -> str:
    import pytest

    from planner.source.checkpoint import load_checkpoint
    from planner.errors import ModelInputError
    from planner.model.layout import build_layout

    with pytest.raises(ModelInputError) as error:
        build_layout(load_checkpoint(str(folder)), None)
    return str(error.value)


def test_kv_heads_are_checked_against_k_proj(tmp_path):
    """A config with half the KV heads its k_proj holds would plan the KV cache at half its size (issue 39)."""
    import json

    make_checkpoint(tmp_path / "ckpt", num_heads=4, num_kv_heads=4)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["num_key_value_heads"] = 2
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    assert "2 KV heads x head_dim 16" in _layout_error(tmp_path / "ckpt")


def test_quantization_is_checked_against_the_stored_tensors(tmp_path):
    """quant_method fp8 over bf16 tensors, and FP8 block scales whose shape weight_block_size does not give."""
    import json

    from tests.conftest import write_safetensors

    folder = make_checkpoint(tmp_path / "bf16", extra_config={"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [16, 16]}}).path
    assert "no tensor is F8_E4M3" in _layout_error(folder)
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    tensors = {"model.embed_tokens.weight": ("BF16", (256, 64)), "model.norm.weight": ("BF16", (64,)),
               "lm_head.weight": ("BF16", (256, 64))}
    for i in range(2):
        for proj, rows in (("q_proj", 64), ("k_proj", 64), ("v_proj", 64), ("o_proj", 64)):
            tensors[f"model.layers.{i}.self_attn.{proj}.weight"] = ("F8_E4M3", (rows, 64))
            tensors[f"model.layers.{i}.self_attn.{proj}.weight_scale_inv"] = ("F32", (2, 2))  # blocks of 32, not 16
    write_safetensors(fp8 / "model.safetensors", dict(sorted(tensors.items())))
    (fp8 / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 256, "intermediate_size": 128,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}))
    assert "weight_block_size [16, 16]" in _layout_error(fp8)
