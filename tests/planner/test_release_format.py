"""header-checkpoint writes what the hub ships (planner.source.release_format): the releases' names, dtypes and shapes,
quantized tensors and their scales, one tensor per expert, the vision tower of multimodal configs.

The published figures pinned here, each with where it was read:

- ``total_size``: the ``metadata.total_size`` of each release's ``model.safetensors.index.json`` (the sum of its
  tensors' bytes) as published on the hub, quoted in public code that reads those indexes: Qwen/Qwen3-30B-A3B
  61,064,245,248 (its index quoted with ``model.layers.0.mlp.experts.0.down_proj.weight``);
  mistralai/Mixtral-8x7B-v0.1 93,405,585,408 (an expert-selection script that rewrites its index);
  openai/gpt-oss-120b 65,248,815,744 (a gpt-oss-120b inventory test's tensor bytes);
  google/medgemma-27b-it 54,864,813,280 (its index metadata; the Gemma-3-27B architecture and config of
  google/gemma-3-27b-it, vision tower included); deepseek-ai/DeepSeek-V3 688,586,727,753 (the bytes of its
  weight files as listed; the shard headers, about 12 MB for 92k tensors, are in it).
- names, dtypes and shapes: the releases' tensors as their headers and indexes list them (DeepSeek-V3's MTP
  layer ``model.layers.61.shared_head.head.weight`` BF16 [129280, 7168], gpt-oss's
  ``mlp.experts.gate_up_proj_blocks`` U8 [128, 5760, 90, 16] and ``_scales`` [128, 5760, 90], Qwen3-MoE and
  Mixtral one tensor per expert, Gemma-3's ``language_model.model.*`` beside ``vision_tower.vision_model.*``).
"""

import json

import pytest

from planner.errors import ModelInputError
from planner.source.header_checkpoint import num_bytes
from planner.source.release_format import knows, release_specs
from tests.conftest import REPO_ROOT, assert_one_line_error, run_cli

#: model -> (config path, the release's published total bytes)
RELEASES = {
    "deepseek-v3": ("plans/models/deepseek-v3/config.json", 688_586_727_753),
    "gpt-oss-120b": ("plans/models/gpt-oss-120b/config.json", 65_248_815_744),
    "qwen3-30b-a3b": ("examples/qwen3-30b-a3b/config.json", 61_064_245_248),
    "mixtral-8x7b": ("examples/mixtral-8x7b/config.json", 93_405_585_408),
    "gemma-3-27b-it": ("examples/gemma-3-27b-it/config.json", 54_864_813_280),
}


def _config(name: str) -> dict:
    return json.loads((REPO_ROOT / RELEASES[name][0]).read_text())


def _specs(config: dict) -> dict:
    return {name: (dtype, shape) for name, dtype, shape in release_specs(config)}


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_total_bytes_within_one_percent_of_the_release(name):
    total = sum(num_bytes(spec) for spec in release_specs(_config(name)))
    assert total == pytest.approx(RELEASES[name][1], rel=0.01)
    if name != "deepseek-v3":  # the others' figures are the tensors' bytes themselves: equal to the byte
        assert total == RELEASES[name][1]


def test_deepseek_v3_fp8_blocks_and_its_mtp_layer():
    specs = _specs(_config("deepseek-v3"))
    assert specs["model.layers.3.mlp.experts.255.down_proj.weight"] == ("F8_E4M3", [7168, 2048])
    assert specs["model.layers.3.mlp.experts.255.down_proj.weight_scale_inv"] == ("F32", [56, 16])
    assert specs["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == ("F32", [5, 56])
    assert specs["model.layers.61.shared_head.head.weight"] == ("BF16", [129280, 7168])
    assert specs["lm_head.weight"] == ("BF16", [129280, 7168]) and "lm_head.weight_scale_inv" not in specs


def test_gpt_oss_mxfp4_blocks_and_scales():
    specs = _specs(_config("gpt-oss-120b"))
    assert specs["model.layers.35.mlp.experts.gate_up_proj_blocks"] == ("U8", [128, 5760, 90, 16])
    assert specs["model.layers.35.mlp.experts.gate_up_proj_scales"] == ("U8", [128, 5760, 90])
    assert specs["model.layers.0.mlp.experts.down_proj_bias"] == ("BF16", [128, 2880])
    assert specs["model.layers.0.self_attn.q_proj.weight"] == ("BF16", [4096, 2880])  # not converted


def test_qwen3_moe_and_mixtral_one_tensor_per_expert():
    qwen = _specs(_config("qwen3-30b-a3b"))
    assert qwen["model.layers.47.mlp.experts.127.down_proj.weight"] == ("BF16", [2048, 768])
    assert qwen["model.layers.0.mlp.gate.weight"] == ("BF16", [128, 2048])
    assert qwen["model.layers.0.self_attn.k_norm.weight"] == ("BF16", [128])
    assert not any(".experts.gate_up_proj" in name for name in qwen)
    mixtral = _specs(_config("mixtral-8x7b"))
    assert mixtral["model.layers.31.block_sparse_moe.experts.7.w2.weight"] == ("BF16", [4096, 14336])


def test_gemma3_language_model_vision_tower_and_projector():
    specs = _specs(_config("gemma-3-27b-it"))
    assert specs["language_model.model.embed_tokens.weight"] == ("BF16", [262208, 5376])  # the default vocab
    assert specs["language_model.model.layers.61.pre_feedforward_layernorm.weight"] == ("BF16", [5376])
    assert "language_model.lm_head.weight" not in specs  # tied
    assert specs["vision_tower.vision_model.encoder.layers.26.mlp.fc1.weight"] == ("BF16", [4304, 1152])
    assert specs["vision_tower.vision_model.embeddings.position_embedding.weight"] == ("BF16", [4096, 1152])
    assert specs["multi_modal_projector.mm_input_projection_weight"] == ("BF16", [1152, 5376])


def test_fp8_dense_release_keeps_embeddings_norms_and_head_in_bf16():
    """Qwen3-8B-FP8's layout: every linear of the stack FP8 with 128x128 F32 inverse scales."""
    config = json.loads((REPO_ROOT / "examples/qwen3-8b/config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    specs = _specs(config)
    assert specs["model.layers.0.mlp.down_proj.weight"] == ("F8_E4M3", [4096, 12288])
    assert specs["model.layers.0.mlp.down_proj.weight_scale_inv"] == ("F32", [32, 96])
    assert specs["model.layers.0.input_layernorm.weight"] == ("BF16", [4096])
    assert specs["lm_head.weight"][0] == specs["model.embed_tokens.weight"][0] == "BF16"
    config["quantization_config"]["modules_to_not_convert"] = ["model.layers.*.self_attn"]
    assert _specs(config)["model.layers.3.self_attn.o_proj.weight"][0] == "BF16"


def test_compressed_tensors_fp8_per_channel_scales():
    config = json.loads((REPO_ROOT / "examples/qwen3-8b/config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}
    specs = _specs(config)
    assert specs["model.layers.0.self_attn.q_proj.weight"] == ("F8_E4M3", [4096, 4096])
    assert specs["model.layers.0.self_attn.q_proj.weight_scale"] == ("F32", [4096, 1])


@pytest.mark.parametrize("quantization, words", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not a layout"),
    ({"quant_method": "fp8"}, "fp8 without weight_block_size"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "not one FP8 weight group"),
])
def test_unknown_quantization_is_one_line_never_a_silent_bf16(tmp_path, quantization, words):
    config = json.loads((REPO_ROOT / "examples/qwen3-8b/config.json").read_text())
    config["quantization_config"] = quantization
    with pytest.raises(ModelInputError, match=words):
        release_specs(config)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = run_cli(["header-checkpoint", str(path), str(tmp_path / "out")], cwd=tmp_path)
    assert_one_line_error(result.returncode, result.stderr, result.stdout)
    assert not (tmp_path / "out").exists()


def test_header_checkpoint_writes_the_release_and_plans_as_the_release(tmp_path, workdir):
    """gpt-oss-120b through the command: the index's total_size is the release's, and the plan made from it is
    the one made from the release-layout fixture (the same fingerprint, the same plan body)."""
    from planner.source.checkpoint import load_checkpoint
    from scripts import real_checkpoints

    config = REPO_ROOT / RELEASES["gpt-oss-120b"][0]
    out = tmp_path / "gpt-oss"
    result = run_cli(["header-checkpoint", str(config), str(out)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == RELEASES["gpt-oss-120b"][1]
    fixture = real_checkpoints.write_checkpoint("gpt-oss-120b", tmp_path / "fixture")
    assert load_checkpoint(str(out)).fingerprint() == load_checkpoint(str(fixture)).fingerprint()


def test_unknown_family_is_left_to_transformers():
    assert not knows({"model_type": "phi3", "hidden_size": 8})
    assert knows(_config("gemma-3-27b-it")) and knows({"model_type": "gemma3_text"})
    with pytest.raises(ModelInputError, match="release layout of model_type 'phi3' is not known"):
        release_specs({"model_type": "phi3", "hidden_size": 8})
    with pytest.raises(ModelInputError, match="lacks or mistypes"):
        release_specs({"model_type": "llama", "hidden_size": 8})

