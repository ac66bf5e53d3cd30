"""make --tp N --measure (issue 28): the rank's config and the model --measure builds from it, the all-reduce
link measured or assumed and what the plan says of it; on GPUs, the measurement itself."""

import math
import os
import subprocess
import sys

import pytest

from planner.model import all_reduce, tensor_parallel
from planner.source.checkpoint import load_checkpoint
from planner.model.cost import ComputeTimes
from planner.model.layout import build_layout
from planner.make.make_plan import make_plan
from planner.plan.schema import Inputs
from planner.plan.file import read_plan
from scripts import bench_tp
from tests.conftest import REPO_ROOT, assert_one_line_error, invoke
from tests.helpers import tiny_bench_tp_config as _tiny

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def tiny(request, tmp_path_factory):
    """(shape name, folder) of a transformers-saved checkpoint of the bench's shape, shrunk."""
    values = _tiny(request.param, vocab_size=1000)
    folder = tmp_path_factory.mktemp(request.param)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in values.items() if k != "architectures"})
    config.architectures = values["architectures"]
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    return request.param, folder


# ---- the rank's config (pure) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tp, heads, kv_heads, intermediate, vocab", [
    (2, 16, 4, 7168, 16000), (4, 8, 2, 3584, 8000), (8, 4, 1, 1792, 4000)])
def test_rank_config_of_the_llama_shape(tp, heads, kv_heads, intermediate, vocab):
    """QKVParallelLinear: query heads / N, the 8 KV heads / N; MergedColumnParallelLinear: the MLP / N;
    VocabParallelEmbedding: the padded vocabulary / N; the hidden size and head_dim stay whole."""
    config = tensor_parallel.rank_config(bench_tp.SHAPES["llama"], tp)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (heads, kv_heads)
    assert (config["intermediate_size"], config["vocab_size"]) == (intermediate, vocab)
    assert (config["hidden_size"], config["head_dim"], config["num_hidden_layers"]) == (4096, 128, 8)


@pytest.mark.parametrize("tp, heads, kv_heads, expert_width", [(2, 16, 2, 384), (4, 8, 1, 192), (8, 4, 1, 96)])
def test_rank_config_of_the_qwen3_moe_shape(tp, heads, kv_heads, expert_width):
    """FusedMoE without expert parallelism: every expert on every rank, each one's intermediate / N; at TP 8 the
    4 KV heads are fewer than the ranks, so each rank holds one, replicated."""
    config = tensor_parallel.rank_config(bench_tp.SHAPES["qwen3_moe"], tp)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (heads, kv_heads)
    assert config["moe_intermediate_size"] == expert_width
    assert (config["num_experts"], config["num_experts_per_tok"], config["head_dim"]) == (32, 8, 128)


def test_the_model_measure_builds_holds_the_ranks_shapes(tiny):
    """--measure builds the model from the rank's config: each of its tensors has the shape rank 0 holds under
    vLLM's sharding (planner.model.tensor_parallel.shard_entries), the padded vocabulary / N included."""
    from runtime.measure import build_measure_model, measured_kinds

    _, folder = tiny
    rank = tensor_parallel.shard_checkpoint(load_checkpoint(str(folder)), 2)
    layout = build_layout(rank, None)
    model = build_measure_model(rank.config, measured_kinds(layout, rank.config), layout.stack, device="cpu")
    built = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    planned = {t.name: t.shape for t in rank.tensors}
    named_alike = {name for name in planned if name in built}
    assert "model.layers.0.self_attn.q_proj.weight" in named_alike and "model.embed_tokens.weight" in named_alike
    assert {name: built[name] for name in named_alike} == {name: planned[name] for name in named_alike}
    # transformers 5 fuses each layer's experts ([experts, 2 x width, hidden]) where the checkpoint keeps one tensor
    # per expert: the layer's elements agree
    for prefix in ("model.layers.0.", "model.layers.1."):
        assert sum(math.prod(shape) for name, shape in built.items() if name.startswith(prefix)) == \
            sum(math.prod(shape) for name, shape in planned.items() if name.startswith(prefix))


def _fake_measure(checkpoint, layout, workload, profile, measured_on, graphed):
    return ComputeTimes(layer_ms=tuple(1.0 for _ in layout.layers), head_ms=0.5, source="measured: fake GPU")


def _fake_link(tp, profile, measured_on):
    return all_reduce.AllReduceLink(latency_us=20.0, bytes_per_s=200e9, measured="measured: fake NCCL")


def _plan(folder, **kwargs):
    inputs = Inputs(model=str(folder), gpu="h100-sxm", tokens=2048, sequences=1, context=0, tp=2, measure=True)
    return make_plan(inputs, measure=_fake_measure, **kwargs).plan


def test_a_measured_rank_plan_adds_the_measured_all_reduces_and_says_so(tiny):
    _, folder = tiny
    plan = _plan(folder, measure_link=_fake_link)
    hidden_bytes = 2048 * 256 * 2
    all_reduce_ms = 20e-3 + 1e3 * hidden_bytes / 200e9
    assert all(row.compute_ms == pytest.approx(1.0 + 2 * all_reduce_ms) for row in plan.layers)
    source = plan.workload.compute_source
    assert source.startswith("measured: fake GPU") and "at 200 GB/s and 20 us each (measured: fake NCCL)" in source


def test_nccl_buffers_measured_beside_the_link_are_booked_recorded_and_read_back(tiny, tmp_path):
    """NCCL's bytes measured with the all-reduce replace the planner's figure in the rank's outside-allocator
    booking, the plan records them (hardware.nccl_bytes), and check regenerates the plan from that record."""
    from planner.make.inputs import regenerate_command
    from planner.plan.file import render_plan, write_atomic
    from planner.search.serving import NCCL_BYTES_PER_RANK
    from planner.views.check import check_plan

    _, folder = tiny
    measured = 300 * 2**20

    def link(tp, profile, measured_on):
        return all_reduce.AllReduceLink(latency_us=20.0, bytes_per_s=200e9, measured="measured: fake NCCL",
                                        nccl_bytes=measured)

    assumed, plan = _plan(folder), _plan(folder, measure_link=link)
    assert assumed.hardware.nccl_bytes is None and plan.hardware.nccl_bytes == measured
    assert assumed.memory.cuda_context_bytes - plan.memory.cuda_context_bytes == NCCL_BYTES_PER_RANK - measured
    path = tmp_path / "rank.yaml"
    write_atomic(path, render_plan(plan, regenerate_command(plan.inputs, str(path))))
    back = read_plan(path)
    assert "nccl_bytes: 314572800" in path.read_text() and (back.hardware, back.memory) == (plan.hardware, plan.memory)
    assert "nccl_bytes" not in render_plan(assumed, "test")  # written only when measured: old plans keep their bytes
    result = check_plan(path)
    assert result.problems == (), (result.problems, result.diff)


def test_without_a_link_measurement_the_plan_says_the_link_is_assumed(tiny):
    _, folder = tiny
    source = _plan(folder).workload.compute_source
    assert "at 450 GB/s and 30 us each (assumed: the profile's link and 30 us;" in source


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures on a GPU there")
def test_tp_measure_without_a_gpu_is_one_line(tiny, monkeypatch):
    _, folder = tiny
    monkeypatch.chdir(folder)
    result = invoke(["make", "-m", str(folder), "-g", "h100-sxm", "--tp", "2", "--measure"])
    assert_one_line_error(result.exit_code, result.stderr, contains=("--measure", "CUDA"))


# ---- on GPUs ---------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("step", [("--tokens", "512", "--context", "0"),
                                  ("--tokens", "1", "--context", "512", "--cuda-graph")], ids=["prefill", "graphed"])
def test_make_tp_measure_times_the_ranks_layers_on_the_gpu(tiny, tmp_path, step):
    """One GPU: the layers measured, the link assumed (said why); two: both measured. A graphed decode step is
    timed replayed from its CUDA graph, and a captured all-reduce is timed inside it."""
    _, folder = tiny
    gpu = bench_tp.profile_for(torch.cuda.get_device_name())
    result = subprocess.run([sys.executable, "-m", "offload_plan", "make", "-m", str(folder), "-g", gpu, "--tp", "2",
                             "--measure", *step, "-o", str(tmp_path / "r.yaml")],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), OFFLOAD_PLAN_CACHE=str(tmp_path)))
    assert result.returncode == 0, result.stderr[-3000:]
    plan = read_plan(tmp_path / "r.yaml")
    source = plan.workload.compute_source
    assert source.startswith("measured: ") and all(row.compute_ms > 0 for row in plan.layers)
    if "--cuda-graph" in step:
        assert plan.inputs.cuda_graph and "graph" in source, source
    if torch.cuda.device_count() >= 2:
        assert "(measured: NCCL all-reduce on 2 x" in source
        # NCCL's buffers measured beside it: about 0.8 GiB a rank on two H200s (scripts/experiments/nccl_memory.py)
        assert 64 * 2**20 <= plan.hardware.nccl_bytes <= 4 * 2**30 and "NCCL held" in source
    else:
        assert "(assumed: the profile's link and 30 us; 1 GPU(s) visible here" in source


def test_rank_config_writes_head_dim_where_the_config_holds_null():
    """transformers' MixtralConfig writes "head_dim": null, meaning hidden / heads of the whole model: the rank's
    config holds that figure, not hidden / its own heads (a TP plan of such a checkpoint was refused)."""
    config = {"model_type": "mixtral", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
              "head_dim": None, "intermediate_size": 14336, "vocab_size": 32000}
    rank = tensor_parallel.rank_config(config, 2)
    assert (rank["head_dim"], rank["num_attention_heads"], rank["num_key_value_heads"]) == (128, 16, 4)
