"""make --for sglang for a family SGLang 0.5.23 wires only through --cpu-offload-gb (OffloaderV1).

SGLang's sglang/srt/utils/offloader.py: OffloaderV1(cpu_offload_max_bytes=int(cpu_offload_gb * 1024**3)) walks the
layers make_layers builds, layer 0 onward, and each layer's params in registration order, moving a param while the
running total is below the limit (the one that reaches it moves whole); a layer with moved params copies them to
the GPU inside its forward, on the compute stream. The plan is that: one GiB figure, the layers it covers (the last
in part, at a param boundary), and a step with every copy added to it.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from planner.engines.read_at_use import GIB, engine_param_unit, layer_param_bytes, moved_bytes
from planner.errors import PlanError
from planner.make.make_plan import make_plan
from planner.plan.file import plan_from_dict, plan_to_dict, read_plan, render_plan
from planner.views.export import export_plan
from tests.conftest import assert_one_line_error, invoke, make_checkpoint, run_cli
from tests.plan_cli import MOE

PLANS = Path(__file__).resolve().parents[2] / "plans"
#: Llama-3.1-70B's layer as SGLang registers it: qkv_proj, o_proj, gate_up_proj, down_proj, the two norms (bf16)
LLAMA_70B_LAYER = (2 * 8192 * (8192 + 2 * 1024), 2 * 8192 * 8192, 2 * 2 * 28672 * 8192, 2 * 8192 * 28672,
                   2 * 8192, 2 * 8192)


@pytest.fixture(scope="module")
def llama_70b(tmp_path_factory) -> Path:
    """The header-only Llama-3.1-70B checkpoint plans/ are made from."""
    from scripts.real_checkpoints import write_checkpoint

    return write_checkpoint("llama-3.1-70b", tmp_path_factory.mktemp("ckpt"))


def test_offloader_v1_moves_params_in_order_until_the_limit():
    """The param that reaches the limit moves whole; the layers after it move nothing; 0 GiB moves nothing."""
    layers = ((3, 5), (4, 1), (2,))
    assert moved_bytes(layers, 4) == (8, 0, 0)
    assert moved_bytes(layers, 8) == (8, 0, 0)
    assert moved_bytes(layers, 9) == (8, 4, 0)
    assert moved_bytes(layers, 0) == (0, 0, 0)
    assert moved_bytes(layers, 100) == (8, 5, 2)


def test_param_order_is_the_engines_registration_with_its_fused_params():
    """Attention (qkv fused, then o), the MLP (gate_up fused, then down) or the MoE block (every expert's gate and
    up one w13 param, down one w2; Mixtral's router first, Qwen3-MoE's and gpt-oss's last), then the norms."""
    names = ["input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
             "post_attention_layernorm.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight",
             "self_attn.q_proj.weight", "self_attn.v_proj.weight"]
    order = sorted({engine_param_unit(name, "LlamaForCausalLM") for name in names})
    assert [unit for *_, unit in order] == ["self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                                            "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
                                            "input_layernorm.weight", "post_attention_layernorm.weight"]
    moe = ["mlp.gate.weight", "mlp.experts.0.gate_proj.weight", "mlp.experts.7.up_proj.weight",
           "mlp.experts.7.down_proj.weight"]
    for architecture, router_first in (("MixtralForCausalLM", True), ("Qwen3MoeForCausalLM", False)):
        units = [unit for *_, unit in sorted({engine_param_unit(name, architecture) for name in moe})]
        experts = ["mlp.experts.w13.weight", "mlp.experts.w2.weight"]
        assert units == (["mlp.gate.weight", *experts] if router_first else [*experts, "mlp.gate.weight"])


def test_make_for_sglang_plans_its_cpu_offload_gb(llama_70b):
    """Llama-3.1-70B on a GH200 within 64 GiB: the fewest whole GiB whose weights fit, the layers they cover (the
    last cut after its gate_up_proj), a step of compute plus every copy; export writes the plan's own figure and
    loses nothing; the file reads back as written; make --for vllm still prefetches."""
    prefetched = read_plan(PLANS / "llama-3.1-70b-gh200-64gib.yaml")
    inputs = replace(prefetched.inputs, model=str(llama_70b), engine="sglang")
    plan = make_plan(inputs).plan
    offload, memory, rows = plan.offload, plan.memory, plan.layers
    assert offload.mechanism == "read_at_use" and offload.read_at_use_gib == 69
    assert offload.layers == tuple(range(44))
    limit = 69 * GIB
    whole = sum(LLAMA_70B_LAYER)
    assert all(rows[i].offloaded_bytes == rows[i].bytes == whole for i in range(43))
    assert 43 * whole < limit <= 43 * whole + sum(LLAMA_70B_LAYER[:3])
    assert rows[43].offloaded_bytes == sum(LLAMA_70B_LAYER[:3]) and rows[44].offloaded_bytes == 0
    # every offloaded byte read at use: compute and copies add up, nothing hidden
    step = plan.prediction.head_ms + sum(row.compute_ms + (row.copy_ms if row.offloaded_bytes else 0) for row in rows)
    assert plan.prediction.step_ms == pytest.approx(step, abs=1e-3)
    assert plan.prediction.copy_bytes_per_step == memory.host_pinned_bytes == sum(r.offloaded_bytes for r in rows)
    # one layer's copies on the GPU at a time, within the budget; 68 GiB leave a layer's bytes more on the GPU
    assert memory.num_slots == 1 and memory.slot_bytes == whole and memory.gpu_bytes <= memory.budget_bytes
    fewer = moved_bytes((LLAMA_70B_LAYER,) * 80, 68 * GIB)
    assert memory.gpu_bytes + sum(r.offloaded_bytes for r in rows) - sum(fewer) > memory.budget_bytes
    exported = export_plan(plan, "sglang", exact=True)
    assert exported.flags == ("--cpu-offload-gb", "69") and exported.losses == ()
    assert exported.prediction.step_ms == plan.prediction.step_ms
    text = render_plan(plan, "offload-plan make")
    assert "mechanism: read_at_use" in text and "read_at_use_gib: 69" in text
    read_back = plan_from_dict(yaml.safe_load(text), "plan")
    assert read_back.offload == plan.offload
    assert [row.offloaded_bytes for row in read_back.layers] == [row.offloaded_bytes for row in rows]
    # the restated export of the prefetched plan keeps within that plan's own GPU bytes: more GiB, a slower step
    restated = export_plan(prefetched, "sglang")
    assert restated.flags == ("--cpu-offload-gb", "71") and restated.prediction.step_ms > plan.prediction.step_ms
    assert make_plan(replace(inputs, engine="vllm")).plan.offload == prefetched.offload


def test_make_for_sglang_refuses_knobs_its_read_at_use_offloader_has_not(tmp_path):
    make_checkpoint(tmp_path / "ckpt")
    for extra, words in ((["--params", "mlp"], "no --params"), (["--prefetch-step", "2"], "no --prefetch-step")):
        result = run_cli(["make", "--model", "ckpt", "--gpu", "h100-sxm", "--budget", "1MiB", "--for", "sglang",
                          *extra], cwd=tmp_path)
        assert_one_line_error(result.returncode, result.stderr, contains=("--cpu-offload-gb", words))


def _roomy_gpu(workdir, test_gpu: str) -> str:
    """The test GPU with 40 GB, for header-only checkpoints of GiB-sized layers."""
    roomy = workdir / "roomy.yaml"
    roomy.write_text((workdir / test_gpu).read_text().replace("value: 1000000000", "value: 40000000000", 1))
    return "roomy.yaml"


def test_a_serving_plan_for_sglang_checks_shows_and_exports(workdir, test_gpu):
    """A Qwen3-MoE serving plan under CUDA graphs: whole-layer experts read at use, check regenerates it byte for
    byte, show says how SGLang reads it, export writes its GiB and keeps one layer's copies out of the static
    fraction; another engine or TP is refused in one line."""
    from planner.engines.memory import sglang_memory

    make_checkpoint(workdir / "ckpt", num_layers=6, hidden=4096, intermediate=14336, num_heads=32, num_kv_heads=8,
                    data=False, moe={**MOE, "expert_intermediate": 14336})
    gpu = _roomy_gpu(workdir, test_gpu)
    args = ["make", "--model", "ckpt", "--gpu", gpu, "--gpu-memory", "8GB", "--concurrency", "4", "--context",
            "2048", "--cuda-graph", "--for", "sglang", "-o", "plan.yaml"]
    assert invoke(args).exit_code == 0
    plan = read_plan(workdir / "plan.yaml")
    assert plan.offload.mechanism == "read_at_use" and plan.offload.layers == tuple(range(len(plan.offload.layers)))
    assert plan.offload.read_at_use_gib >= 1 and plan.experts.regime == "whole_layer"
    assert invoke(["check", "plan.yaml"]).exit_code == 0
    shown = invoke(["show", "plan.yaml"]).stdout
    assert f"--cpu-offload-gb {plan.offload.read_at_use_gib}" in shown and "OffloaderV1" in shown
    exported = export_plan(plan, "sglang")
    assert exported.flags[:2] == ("--cpu-offload-gb", str(plan.offload.read_at_use_gib)) and not exported.losses
    # SGLang allocates a layer's copies inside its forward: out of the rest, not the static fraction
    as_prefetch = replace(plan, offload=replace(plan.offload, mechanism="prefetch", read_at_use_gib=0))
    read, slotted = sglang_memory(plan, 1), sglang_memory(as_prefetch, 1)
    assert read.max_share < slotted.max_share and read.share < slotted.share
    for engine, tp in (("vllm", 1), ("sglang", 2)):
        with pytest.raises(PlanError, match="make it again with --for"):
            export_plan(plan, engine, tp_size=tp)


def test_deepseek_keeps_the_prefetch_offloader(workdir, test_gpu):
    """SGLang wires OffloaderV2 for DeepSeek: make --for sglang still plans G, K, P over its experts there."""
    make_checkpoint(workdir / "ds", num_layers=4, moe=MOE, extra_config={"architectures": ["DeepseekV3ForCausalLM"]})
    result = invoke(["make", "--model", "ds", "--gpu", test_gpu, "--budget", "300KB", "--for", "sglang",
                     "--params", "experts", "-o", "ds.yaml"])
    assert result.exit_code == 0, result.stderr
    assert read_plan(workdir / "ds.yaml").offload.mechanism == "prefetch"
    assert "mechanism" not in (workdir / "ds.yaml").read_text()


def test_plans_without_the_keys_read_as_prefetch_and_a_stray_gib_is_refused():
    """Plans written before the mechanism keys (every plan in plans/) read as prefetch; a GiB figure on a prefetch
    plan is one line naming the field."""
    data = plan_to_dict(read_plan(PLANS / "llama-3.1-70b-gh200-64gib.yaml"))
    assert "mechanism" not in data["offload"] and plan_from_dict(data, "plan").offload.mechanism == "prefetch"
    data["offload"]["read_at_use_gib"] = 3
    with pytest.raises(PlanError, match="offload.read_at_use_gib applies to mechanism read_at_use"):
        plan_from_dict(data, "plan")


def test_layer_params_sum_to_the_layers(llama_70b):
    """Fusing and ordering params loses no byte of a layer."""
    from planner.model.layout import build_layout
    from planner.source.checkpoint import load_checkpoint

    layout = build_layout(load_checkpoint(str(llama_70b), None))
    units = layer_param_bytes(layout, "LlamaForCausalLM")
    assert units[0] == LLAMA_70B_LAYER
    assert [sum(params) for params in units] == [layer.nbytes for layer in layout.layers]


def test_an_unwired_family_is_still_refused(tmp_path):
    make_checkpoint(tmp_path / "ckpt", extra_config={"architectures": ["FalconForCausalLM"]})
    result = run_cli(["make", "--model", "ckpt", "--gpu", "h100-sxm", "--budget", "1MiB", "--for", "sglang"],
                     cwd=tmp_path)
    assert_one_line_error(result.returncode, result.stderr, contains=("offloads none of the weights",))


@pytest.mark.parametrize(("old", "new", "words"), [
    ("read_at_use_gib: 3", "read_at_use_gib: 1", "is not what offload.layers hold"),
    ("  engine: sglang", "  engine: null", "inputs.engine is null"),
    ("layers: [0, 1, 2]", "layers: [1, 2]", "are not the first layers"),
])
def test_a_hand_edited_read_at_use_plan_is_refused_in_one_line(workdir, test_gpu, old, new, words):
    make_checkpoint(workdir / "ckpt", num_layers=6, hidden=4096, intermediate=14336, num_heads=32, num_kv_heads=8,
                    data=False, moe={**MOE, "expert_intermediate": 14336})
    gpu = _roomy_gpu(workdir, test_gpu)
    assert invoke(["make", "--model", "ckpt", "--gpu", gpu, "--gpu-memory", "8GB", "--concurrency", "4",
                   "--context", "2048", "--for", "sglang", "-o", "plan.yaml"]).exit_code == 0
    text = (workdir / "plan.yaml").read_text()
    assert old in text
    (workdir / "edited.yaml").write_text(text.replace(old, new, 1))
    result = run_cli(["show", "edited.yaml"], cwd=workdir)
    assert_one_line_error(result.returncode, result.stderr, contains=(words,))

