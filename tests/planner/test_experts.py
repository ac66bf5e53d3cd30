"""Expert-granular offloading: a checkpoint's experts (planner.model.experts) and the routed placement in plans (make,
show, check, diff, export); the routing model: test_expert_routing.py, the placement: test_expert_placement.py.
Routing trace files: tests/planner/test_routing_trace.py; recording them (runtime.trace, ``offload-plan trace``):
tests/runtime/test_trace.py."""

from pathlib import Path

import pytest

from planner.source.checkpoint import load_checkpoint
from planner.model.expert_routing import expected_distinct_uniform, uniform_routing
from planner.model.experts import MoeGeometry, moe_geometry
from planner.model.layout import build_layout
from planner.make.make_plan import make_plan
from planner.plan.schema import Inputs
from planner.plan.file import plan_from_dict, plan_to_dict, read_plan
from planner.units import format_rate
from tests.conftest import make_checkpoint, run_cli


def geometry_of(folder: Path) -> MoeGeometry:
    checkpoint = load_checkpoint(str(folder))
    return moe_geometry(checkpoint.config, build_layout(checkpoint, None))


# ---- the routing model -----------------------------------------------------------------------------------------


def test_distinct_experts_of_qwen3_30b_at_1_4_16_64_sequences(qwen3_30b):
    geometry = geometry_of(qwen3_30b)
    assert (geometry.num_experts, geometry.top_k, len(geometry.layers)) == (128, 8, 48)
    assert geometry.unroutable_reason is None
    # 128 experts of [2 x 768, 2048] + [2048, 768] bf16 weights, read from the tensors
    assert geometry.layers[0].expert_bytes == 3 * 768 * 2048 * 2
    routing = uniform_routing(geometry)[0]
    distinct = [round(routing.expected_distinct(b)) for b in (1, 4, 16, 64)]
    assert distinct == [8, 29, 82, 126]
    assert [round(expected_distinct_uniform(128, 8, b)) for b in (1, 4, 16, 64)] == distinct


# ---- plans -----------------------------------------------------------------------------------------------------


def serving_inputs(model: Path, concurrency: str, **extra) -> Inputs:
    return Inputs(model=str(model), gpu="h100-sxm", context=4096, concurrency=concurrency, cuda_graph=True, **extra)


def test_qwen3_30b_routed_at_one_sequence_whole_layers_at_64(qwen3_30b):
    """Routed at one sequence, whole layers at 64; the routed plan's prefill chunk (experts copied through the
    staging buffer) stays eager, the whole-layer plan's bf16 grouped_mm chunk is replayed from a graph."""
    one = make_plan(serving_inputs(qwen3_30b, "1", gpu_memory="24GiB")).plan
    assert one.experts.regime == "routed" and one.offload.layers == ()
    assert not one.workload.chunk_graphed
    point = one.experts.points[0]
    assert point.routed_step_ms < point.whole_layer_step_ms / 5
    assert one.prediction.step_ms == pytest.approx(point.routed_step_ms)
    # prefetch at the depth predicted fastest (one or two slot sets)
    slot_sets = 2 if one.experts.prefetch else 1
    assert one.experts.fetch_slots == 8 and one.experts.fetch_buffer_bytes == slot_sets * 8 * one.experts.expert_bytes
    assert all(row.regime == "routed" and row.resident for row in one.experts.layers)
    total = one.memory.total_gpu_bytes
    assert total <= one.memory.gpu_memory_bytes
    sixty_four = make_plan(serving_inputs(qwen3_30b, "64")).plan
    assert sixty_four.experts.regime == "whole_layer" and sixty_four.offload.layers
    assert sixty_four.workload.chunk_graphed
    point = sixty_four.experts.points[0]
    assert point.whole_layer_step_ms < point.routed_step_ms


def test_a_routed_plans_eager_chunk_leaves_its_experts_the_graphed_chunks_room(qwen3_30b):
    """A routed placement's prefill chunk stays eager, so the plan books the eager chunk (as a plan without
    --cuda-graph does at one sequence) and its weights budget is the rest of the GPU after that."""
    from dataclasses import replace

    inputs = serving_inputs(qwen3_30b, "1", gpu_memory="24GiB")
    routed = make_plan(inputs).plan
    eager = make_plan(replace(inputs, cuda_graph=False)).plan
    assert routed.experts.regime == "routed" and not routed.workload.chunk_graphed
    memory = routed.memory
    assert memory.activation_bytes == eager.memory.activation_bytes
    rest = memory.gpu_memory_bytes - (memory.kv_cache_bytes + memory.activation_bytes + memory.cuda_graph_pool_bytes
                                      + memory.cuda_context_bytes)
    assert memory.budget_bytes == rest and memory.total_gpu_bytes <= memory.gpu_memory_bytes


def test_a_routed_plan_reads_back_equal_and_check_regenerates_it(qwen3_30b, tmp_path):
    planned = make_plan(serving_inputs(qwen3_30b, "1", gpu_memory="24GiB")).plan
    assert plan_to_dict(plan_from_dict(plan_to_dict(planned), "test")) == plan_to_dict(planned)
    path = tmp_path / "plan.yaml"
    result = run_cli(["make", "--model", str(qwen3_30b), "--gpu", "h100-sxm", "--context", "4096", "--concurrency",
                      "1", "--cuda-graph", "--gpu-memory", "24GiB", "-o", "plan.yaml"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "routed experts fetched in 48/48 layers" in result.stderr
    assert plan_to_dict(read_plan(path))["experts"] == plan_to_dict(planned)["experts"]
    checked = run_cli(["check", "plan.yaml"], cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    shown = run_cli(["show", "plan.yaml", "--no-layers"], cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    fetch_words = ("after each layer's router" if planned.experts.prefetch is None else
                   f"the top {planned.experts.prefetch_depth} of each token's 8 predicted experts")
    for words in ("Experts: routed", "hit rate", fetch_words, "streaming whole layers",
                  "fetch 8 experts", "routed-expert fetch buffer"):
        assert words in text, words


def test_dense_plans_have_no_experts_section(tmp_path):
    written = make_checkpoint(tmp_path / "dense")
    plan = make_plan(Inputs(model=str(written.path), gpu="h100-sxm", budget="1MiB")).plan
    assert plan.experts is None and "experts" not in plan_to_dict(plan)


def test_an_architecture_the_runtime_cannot_route_fetch_falls_back_to_whole_layers(tmp_path):
    written = make_checkpoint(tmp_path / "moe", moe={"num_experts": 4, "top_k": 2, "expert_intermediate": 32})
    # gpt-oss style MXFP4 experts: packed U8 blocks and scales, fused
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    import json
    from tests.conftest import write_safetensors

    tensors = {name: spec for name, spec in written.tensors.items() if ".experts." not in name}
    for layer in range(4):
        tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj_blocks"] = ("U8", (4, 64, 2, 16))
        tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj_scales"] = ("U8", (4, 64, 2))
    write_safetensors(folder / "model.safetensors", tensors, data=False)
    (folder / "config.json").write_text((written.path / "config.json").read_text())
    plan = make_plan(Inputs(model=str(folder), gpu="h100-sxm", budget="1MiB", tokens=1, context=64)).plan
    assert plan.experts.regime == "whole_layer"
    assert "quantized" in plan.experts.routed_unavailable
    assert json.dumps(plan_to_dict(plan))  # plain data
    # quantized experts still come in whole experts: the routed regime is priced beside whole layers, on paper
    point = plan.experts.points[0]
    assert point.regime == "whole_layer" and point.routed_step_ms is not None and point.whole_layer_step_ms
    from planner.views.show_experts import experts_text

    assert "On paper, at 1 sequence(s): routed experts would take" in " ".join(experts_text(plan).plain.split())


def test_a_routed_placement_priced_on_paper_is_never_chosen():
    from types import SimpleNamespace as NS

    from planner.search.expert_choice import Comparison

    def choice(step_ms):
        return NS(simulation=NS(step_ms=step_ms))

    whole, routed = choice(100.0), choice(10.0)
    assert Comparison(num_tokens=1, whole=whole, routed=routed).chosen is routed
    assert Comparison(num_tokens=1, whole=whole, routed=routed, routed_runnable=False).chosen is whole
    assert Comparison(num_tokens=1, whole=None, routed=routed, routed_runnable=False).chosen is None


def test_pinned_knobs_keep_whole_layers(qwen3_30b):
    plan = make_plan(serving_inputs(qwen3_30b, "1", gpu_memory="24GiB", prefetch_step=2)).plan
    assert plan.experts.regime == "whole_layer"
    assert "--prefetch-step" in plan.experts.routed_unavailable
    # ruled out by the flags, not by the experts: nothing to price on paper
    assert all(point.routed_step_ms is None for point in plan.experts.points)


def test_diff_and_export_of_routed_and_whole_layer_plans(qwen3_30b, tmp_path):
    from planner.views.diff import compare_plans, summary_sentences
    from planner.errors import PlanError
    from planner.views.export import export_plan

    routed = make_plan(serving_inputs(qwen3_30b, "1", gpu_memory="24GiB")).plan
    whole = make_plan(serving_inputs(qwen3_30b, "64")).plan
    data = compare_plans(whole, routed)
    assert data["experts"]["regime"] == {"old": "whole_layer", "new": "routed"}
    assert data["experts"]["num_resident"]["new"] == routed.experts.points[0].num_resident
    sentence = next(s for s in summary_sentences(data) if s.startswith("Experts:"))
    assert "whole_layer -> routed" in sentence and "hit rate" in sentence
    dense = make_checkpoint(tmp_path / "dense")
    dense_plan = make_plan(Inputs(model=str(dense.path), gpu="h100-sxm", budget="1MiB")).plan
    assert "experts" not in compare_plans(dense_plan, dense_plan)
    with pytest.raises(PlanError, match="cannot express routed experts") as refused:
        export_plan(routed, "vllm", exact=True)
    message = str(refused.value)
    assert f"{format_rate(1e3 / routed.prediction.step_ms)} -> " in message and "\n" not in message
    exported = export_plan(whole, "sglang")
    assert any(note.startswith("experts: the plan streams whole layers") for note in exported.notes)


def test_export_of_a_routed_plan_gives_the_planners_whole_layer_plan_and_its_loss(qwen3_30b, tmp_path):
    """Neither engine fetches routed experts: export emits the whole-layer plan make would have made at the same
    workload and weight budget (the plan's own recorded whole-layer step), and states the loss in tokens/s."""
    from planner.engines.plan import expressible_plan
    from planner.views.export import export_plan
    from planner.plan.file import render_plan

    routed = make_plan(serving_inputs(qwen3_30b, "1", gpu_memory="24GiB")).plan
    whole, loss = expressible_plan(routed)
    (point,) = routed.experts.points
    # the re-search from the plan's rows finds make's own whole-layer step (rows rounded to 0.1 us)
    assert whole.prediction.step_ms == pytest.approx(point.whole_layer_step_ms, rel=1e-5)
    assert whole.memory.gpu_bytes <= routed.memory.budget_bytes and whole.experts is None
    assert whole.offload.layers and loss.plan_step_ms == routed.prediction.step_ms
    exported = export_plan(routed, "vllm")
    assert exported.flags[:6] == ("--offload-group-size", str(whole.offload.group_size),
                                  "--offload-num-in-group", str(whole.offload.num_in_group),
                                  "--offload-prefetch-step", str(whole.offload.prefetch_step))
    (line,) = exported.losses
    assert line.startswith("vLLM 0.33.0 cannot express routed experts in 48 MoE layers")
    # one step for the engine: the line's rate is the exported prediction's, and it names make --for vllm
    assert f"{format_rate(1e3 / routed.prediction.step_ms)} -> {format_rate(1e3 / exported.prediction.step_ms)} " \
        "tokens/s" in line
    assert "--for vllm` plans for vLLM from the start" in line
    assert exported.prediction.step_ms == pytest.approx(point.whole_layer_step_ms, rel=0.05)
    assert exported.plan_prediction.step_ms == routed.prediction.step_ms
    # SGLang 0.5.23 has no prefetch offloader for Qwen3-MoE either: one line for both, one step (--cpu-offload-gb)
    sglang = export_plan(routed, "sglang")
    (line,) = sglang.losses
    assert "routed experts in 48 MoE layers" in line and "; and a prefetched plan for Qwen3MoeForCausalLM" in line
    assert f"-> {format_rate(1e3 / sglang.prediction.step_ms)} tokens/s" in line and "--for sglang`" in line
    assert sglang.flags[0] == "--cpu-offload-gb"
    (tmp_path / "routed.yaml").write_text(render_plan(routed, "offload-plan make"))
    result = run_cli(["export", "routed.yaml", "--to", "vllm"], cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.count("\n") == 1 and "cannot express" in result.stderr
    explained = run_cli(["export", "routed.yaml", "--to", "vllm", "--explain"], cwd=tmp_path)
    assert explained.stdout.splitlines() == [result.stdout.strip(), exported_line(result.stderr)]


def exported_line(stderr: str) -> str:
    """export's loss line on stderr, without its prefix."""
    return next(line for line in stderr.splitlines() if "cannot express" in line).removeprefix("offload-plan: loss: ")
