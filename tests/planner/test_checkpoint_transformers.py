"""Checkpoints as transformers writes them (random weights, hidden 64, many small shards and an index)."""

import json

import pytest
import yaml

from tests.conftest import TEST_GPU, invoke

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _save(model, folder):
    torch.manual_seed(0)
    model.save_pretrained(folder, max_shard_size="50KB")
    return folder


def _file_tensors(folder) -> dict:
    """name -> (bytes, shape) of every tensor, read by the safetensors library itself."""
    from safetensors import safe_open

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                out[name] = (tensor.numel() * tensor.element_size(), tuple(tensor.shape))
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny_llama(request, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=request.param)
    return _save(LlamaForCausalLM(config), tmp_path_factory.mktemp("llama") / "tiny-llama")


MOE_MODELS = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16), "mlp.experts"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2),
                "block_sparse_moe.experts"),
}


@pytest.fixture(scope="module", params=sorted(MOE_MODELS))
def tiny_moe(request, tmp_path_factory):
    config_cls, model_cls, extra, experts = MOE_MODELS[request.param]
    config = getattr(transformers, config_cls)(vocab_size=256, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                               **extra)
    folder = _save(getattr(transformers, model_cls)(config), tmp_path_factory.mktemp("moe") / request.param)
    return folder, experts


def test_tiny_llama_is_sharded(tiny_llama):
    index = json.loads((tiny_llama / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 4


def test_tiny_llama_layout_and_bytes(tiny_llama):
    from planner.source.checkpoint import load_checkpoint
    from planner.model.layout import build_layout

    files = _file_tensors(tiny_llama)
    checkpoint = load_checkpoint(str(tiny_llama))
    assert checkpoint.kind == "local" and checkpoint.revision is None
    assert checkpoint.num_files == len(list(tiny_llama.glob("*.safetensors")))
    assert {t.name: (t.nbytes, t.shape) for t in checkpoint.tensors} == files
    assert checkpoint.total_bytes == sum(b for b, _ in files.values())

    layout = build_layout(checkpoint)
    assert layout.stack == "model.layers" and layout.stacks == {"model.layers": 5}
    assert [layer.index for layer in layout.layers] == [0, 1, 2, 3, 4] and layout.unused_layers == ()
    for layer in layout.layers:
        prefix = f"model.layers.{layer.index}."
        assert layer.nbytes == sum(b for n, (b, _) in files.items() if n.startswith(prefix))
    assert set(layout.non_layer_names) == {n for n in files if not n.startswith("model.layers.")}
    assert layout.non_layer_bytes + layout.layer_bytes == checkpoint.total_bytes


def test_tiny_llama_make(tiny_llama, workdir):
    files = _file_tensors(tiny_llama)
    result = invoke(["make", "--model", str(tiny_llama), "--gpu", TEST_GPU, "--budget", "400KB", "-o", "plan.yaml"])
    assert result.exit_code == 0, result.stderr
    plan = yaml.safe_load((workdir / "plan.yaml").read_text())
    model = plan["model"]
    assert model["num_layers"] == 5 and model["stack"] == "model.layers"
    assert model["architecture"] == "LlamaForCausalLM"
    assert model["num_tensors"] == len(files)
    assert model["total_bytes"] == sum(b for b, _ in files.values())
    assert model["dtype_bytes"] == {"F32": model["total_bytes"]}
    assert model["source"] == str(tiny_llama)  # as given: an absolute path stays absolute
    assert plan["memory"]["gpu_bytes"] <= 400_000
    assert plan["offload"]["layers"], "400KB must force offload of a ~0.7 MB model"
    assert sum(row["bytes"] for row in plan["layers"]) == model["layer_bytes"]


def test_tiny_moe_per_expert_names_and_expert_offload(tiny_moe, workdir):
    from planner.source.checkpoint import load_checkpoint
    from planner.model.cost import geometry_from_config
    from planner.model.layout import build_layout

    folder, experts = tiny_moe
    files = _file_tensors(folder)
    assert any(f".{experts}.3." in name for name in files), "transformers should save per-expert tensors"

    checkpoint = load_checkpoint(str(folder))
    layout = build_layout(checkpoint)
    assert layout.stack == "model.layers" and len(layout.layers) == 3
    geometry = geometry_from_config(checkpoint.config, layout)
    assert (geometry.num_experts, geometry.top_k) == (4, 2)

    total = sum(b for b, _ in files.values())
    layer0_experts = sum(b for n, (b, _) in files.items() if n.startswith(f"model.layers.0.{experts}."))
    budget = total - layer0_experts  # all resident misses by one layer's experts: at least two must move
    result = invoke(["make", "--model", str(folder), "--gpu", TEST_GPU, "--params", "experts", "--budget",
                     f"{budget}B", "-o", "plan.yaml"])
    assert result.exit_code == 0, result.stderr
    plan = yaml.safe_load((workdir / "plan.yaml").read_text())
    assert plan["model"]["total_bytes"] == sum(b for b, _ in files.values())
    assert plan["offload"]["params"] == ["experts"] and plan["offload"]["layers"]
    for row in plan["layers"]:
        prefix = f"model.layers.{row['index']}."
        expert_bytes = sum(b for n, (b, _) in files.items() if n.startswith(prefix + experts + "."))
        assert row["bytes"] == sum(b for n, (b, _) in files.items() if n.startswith(prefix))
        assert row["offloaded_bytes"] == (expert_bytes if row["index"] in plan["offload"]["layers"] else 0)
    assert plan["memory"]["gpu_bytes"] <= budget
    assert plan["memory"]["slot_bytes"] == layer0_experts
