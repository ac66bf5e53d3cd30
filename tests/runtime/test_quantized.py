"""FP8 block-quantized checkpoints in run's loader (issue 23), on the CPU stand-in: transformers' FP8 modules in
the skeleton, FP8 weights and their scales placed and pinned as stored, the plan made from the same headers,
logits bitwise equal between offloaded and all-resident and to transformers' own dequantized load, and
one-line refusals of what run does not place."""

import json
from pathlib import Path

import pytest
import torch

from planner.errors import ModelInputError
from runtime.backend import CpuStandIn
from tests.runtime_models import stream_on_cpu
from tests.runtime_models import plan_with

#: a Qwen3 shape small enough for the CPU, with 32x32 blocks so every linear has several block rows and columns
TINY_FP8_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "torch_dtype": "bfloat16", "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [32, 32]},
}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def write_fp8_checkpoint(folder: Path, config: dict = TINY_FP8_CONFIG, seed: int = 0) -> Path:
    """Random weights in the release format (FP8 linears, float32 weight_scale_inv) into ``folder``/ckpt."""
    from scripts.benchmarking import write_random_release

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    write_random_release(folder / "config.json", folder / "ckpt", device="cpu", seed=seed)
    return folder / "ckpt"


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8"))


def resident_plan(folder: Path):
    """The plan the search makes at a 1 GiB budget: nothing offloaded."""
    from planner.make.make_plan import make_plan
    from planner.plan.schema import Inputs

    inputs = Inputs(model=str(folder), revision=None, gpu="h100-sxm", budget="1GiB", trigger=None, tokens=16,
                    sequences=1, context=0, params=(), stack=None, group_size=None, num_in_group=None,
                    prefetch_step=None)
    return make_plan(inputs).plan


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(_ids()).logits


def test_the_skeleton_holds_transformers_fp8_modules_with_weights_and_scales_as_stored(fp8_checkpoint):
    from safetensors import safe_open
    from transformers.integrations.finegrained_fp8 import FP8Linear

    model, engine = stream_on_cpu(fp8_checkpoint, plan_with(fp8_checkpoint, 2, 1, 1))
    stored = {}
    for path in fp8_checkpoint.glob("*.safetensors"):
        with safe_open(path, "pt") as file:
            stored.update({name: file.get_tensor(name) for name in file.keys()})
    for index in range(4):
        for linear in LINEARS:
            name = f"model.layers.{index}.{linear}"
            module = model.get_submodule(name)
            assert isinstance(module, FP8Linear) and list(module.block_size) == [32, 32]
            assert module.weight.dtype == torch.float8_e4m3fn and module.weight_scale_inv.dtype == torch.float32
            assert module.weight_scale_inv.shape == (module.out_features // 32, module.in_features // 32)
            if index in engine.offloaded:
                continue  # its params point at a GPU slot, refilled per step; its bytes: the next test
            # the bytes as stored: compared as bytes (FP8 has no equality kernel on every build)
            assert torch.equal(module.weight.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8))
            assert torch.equal(module.weight_scale_inv, stored[f"{name}.weight_scale_inv"])
    assert not isinstance(model.lm_head, FP8Linear) and model.lm_head.weight.dtype == torch.bfloat16
    engine.close()


def test_offloaded_layers_pin_and_copy_the_fp8_bytes_of_the_checkpoint(fp8_checkpoint):
    """The host arena holds each offloaded layer's tensors at their stored size (1 byte an FP8 weight, its
    float32 scales beside it), and a step copies exactly those pieces."""
    from safetensors import safe_open

    plan = plan_with(fp8_checkpoint, 2, 1, 1)
    backend = CpuStandIn()
    model, engine = stream_on_cpu(fp8_checkpoint, plan, backend=backend)
    stored_bytes = {}
    for path in fp8_checkpoint.glob("*.safetensors"):
        with safe_open(path, "pt") as file:
            for name in file.keys():
                tensor = file.get_slice(name)
                dtype = {"F8_E4M3": 1, "F32": 4, "BF16": 2}[tensor.get_dtype()]
                stored_bytes[name] = dtype * int(torch.Size(tensor.get_shape()).numel())
    assert plan.offload.layers == (1, 3)
    for position, index in enumerate(plan.offload.layers):
        layer_bytes = sum(n for name, n in stored_bytes.items() if name.startswith(f"model.layers.{index}."))
        fp8_bytes = sum(n for name, n in stored_bytes.items()
                        if name.startswith(f"model.layers.{index}.") and name.endswith("proj.weight"))
        packed = engine.layouts[position]
        assert sum(item.num_bytes for item in packed) == layer_bytes == plan.layers[index].offloaded_bytes
        assert sum(item.num_bytes for item in packed if item.dtype == torch.float8_e4m3fn) == fp8_bytes
        assert fp8_bytes == sum(model.get_submodule(f"model.layers.{index}.{linear}").weight.numel()
                                for linear in LINEARS)
    # every offloaded layer crosses the link each step, as its packed FP8 piece
    assert engine.copy_bytes_per_step == sum(engine.layer_bytes)
    assert sum(backend.pinned.values()) == sum(engine.layer_bytes)
    engine.close()


@pytest.mark.parametrize("shape", [(2, 1, 1), (1, 1, 2), (4, 3, 1)])
def test_logits_are_bitwise_equal_offloaded_and_all_resident(fp8_checkpoint, shape):
    resident, resident_engine = stream_on_cpu(fp8_checkpoint, resident_plan(fp8_checkpoint))
    assert resident_engine.offloaded == ()
    expected = _logits(resident)
    model, engine = stream_on_cpu(fp8_checkpoint, plan_with(fp8_checkpoint, *shape))
    assert engine.offloaded
    assert torch.equal(_logits(model), expected)
    assert torch.equal(_logits(model), expected)  # a second step: the slots were refilled
    engine.close()
    resident_engine.close()


def test_logits_equal_transformers_own_dequantized_load(fp8_checkpoint):
    """On a machine without a GPU, from_pretrained dequantizes FP8 at load (Fp8Dequantize); run keeps the FP8
    bytes and dequantizes per matmul with the same arithmetic: the same bits."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(fp8_checkpoint, dtype="auto").eval()
    model, engine = stream_on_cpu(fp8_checkpoint, plan_with(fp8_checkpoint, 2, 1, 1))
    assert torch.equal(_logits(model), _logits(reference))
    engine.close()


def test_dequantize_handles_a_ragged_last_block():
    from runtime.quantized import dequantize_fp8

    weight = torch.randn(70, 40).to(torch.float8_e4m3fn)
    scales = torch.rand(3, 2) + 0.5  # ceil(70/32), ceil(40/32)
    expected = weight.float() * scales.repeat_interleave(32, 0)[:70].repeat_interleave(32, 1)[:, :40]
    assert torch.equal(dequantize_fp8(weight, scales, (32, 32), torch.bfloat16), expected.to(torch.bfloat16))
    square = torch.randn(64, 64).to(torch.float8_e4m3fn)
    grid = torch.rand(2, 2) + 0.5
    wide = grid.repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(dequantize_fp8(square, grid, (32, 32), torch.bfloat16),
                       (square.float() * wide).to(torch.bfloat16))


@pytest.mark.parametrize("section, words", [
    ({"quant_method": "mxfp4"}, "MXFP4"),
    ({"quant_method": "awq", "bits": 4}, "awq"),
    ({"quant_method": "fp8", "fmt": "e4m3"}, "per-tensor"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "dynamic"),
])
def test_what_run_does_not_place_is_one_line(fp8_checkpoint, tmp_path, section, words):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(fp8_checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = section
    (folder / "config.json").write_text(json.dumps(config))
    backend = CpuStandIn()
    with pytest.raises(ModelInputError, match=words) as error:
        stream_on_cpu(folder, plan_with(fp8_checkpoint, 2, 1, 1), backend=backend)
    assert "\n" not in str(error.value) and len(str(error.value)) < 400 and backend.pinned == {}


def test_the_plan_counts_fp8_bytes_from_the_headers(fp8_checkpoint):
    """make reads the checkpoint's headers: an offloaded layer moves its FP8 bytes, about half its bf16 size."""
    plan = plan_with(fp8_checkpoint, 2, 1, 1)
    hidden, inner, q, kv = 128, 256, 128, 64
    linear_params = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inner
    scale_bytes = 4 * sum((out // 32) * (inp // 32) for out, inp in
                          ((q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inner, hidden), (inner, hidden),
                           (hidden, inner)))
    norm_bytes = 2 * (2 * hidden + 2 * 32)
    assert plan.layers[1].offloaded_bytes == linear_params + scale_bytes + norm_bytes


def test_fp8_moe_experts_are_one_line_where_transformers_kernels_cannot_load(tmp_path):
    """transformers' FP8Experts computes only through its hub kernels; run says so before reading weights."""
    config = dict(TINY_FP8_CONFIG, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                  moe_intermediate_size=64, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2)
    folder = write_fp8_checkpoint(tmp_path, config)
    backend = CpuStandIn()
    with pytest.raises(ModelInputError, match="FP8 MoE experts") as error:
        stream_on_cpu(folder, resident_plan(folder), backend=backend)
    assert "\n" not in str(error.value) and backend.pinned == {}


def test_make_measure_builds_transformers_fp8_modules_and_refuses_mxfp4():
    """make --measure times the FP8 linears as run computes them; MXFP4 is one line (built on the CPU here)."""
    from runtime.measure import build_measure_model
    from runtime.quantized import dequantized_class

    model = build_measure_model(dict(TINY_FP8_CONFIG), ((0, 1, 2, 3),), "model.layers", device="cpu")
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is dequantized_class() and q_proj.weight.dtype == torch.float8_e4m3fn
    assert model.model.layers[3].self_attn.q_proj.weight is q_proj.weight  # an alias of its kind's layer
    with pytest.raises(ModelInputError, match="MXFP4") as error:
        build_measure_model(dict(TINY_FP8_CONFIG, quantization_config={"quant_method": "mxfp4"}), ((0, 1, 2, 3),),
                            "model.layers", device="cpu")
    assert "\n" not in str(error.value)


def test_bench_fp8_writes_qwen3_8b_fp8s_release_format(tmp_path):
    """scripts/bench_fp8.py's checkpoint: Qwen3-8B-FP8's layout (FP8 linears with 128x128-block scales, bf16
    embeddings and head), and its link figures from a plan (the H100 runs the rest)."""
    from planner.source.release_format import release_specs
    from scripts import bench_fp8

    args = bench_fp8.parser().parse_args(["--out", str(tmp_path), "--layers", "2"])
    config = json.loads(bench_fp8.fp8_config(args.config, args.layers, tmp_path).read_text())
    assert config["num_hidden_layers"] == 2 and config["quantization_config"]["weight_block_size"] == [128, 128]
    specs = {name: (dtype, shape) for name, dtype, shape in release_specs(config)}
    assert specs["model.layers.1.mlp.down_proj.weight"] == ("F8_E4M3", [4096, 12288])
    assert specs["model.layers.1.mlp.down_proj.weight_scale_inv"] == ("F32", [32, 96])
    assert specs["lm_head.weight"][0] == "BF16" and specs["model.embed_tokens.weight"][0] == "BF16"


def test_bench_fp8_link_figures(fp8_checkpoint):
    from planner.source.checkpoint import load_checkpoint
    from planner.model.layout import build_layout
    from scripts import bench_fp8

    plan = plan_with(fp8_checkpoint, 2, 1, 1)
    figures = bench_fp8.link_bytes(build_layout(load_checkpoint(str(fp8_checkpoint))), plan)
    weights = 2 * sum(out * inp for out, inp in ((128, 128), (64, 128), (64, 128), (128, 128), (256, 128),
                                                 (256, 128), (128, 256)))
    assert figures["fp8_weight_bytes"] == weights
    assert figures["stored_bytes"] == 2 * plan.layers[1].offloaded_bytes
    assert figures["bf16_equivalent_bytes"] == figures["stored_bytes"] + weights
