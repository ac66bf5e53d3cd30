"""export's memory flags by each engine's own accounting (planner.engines.memory), pinned for two plans in plans/.

The formulas, from the engines' sources:
- vLLM, vllm/v1/worker/gpu_worker.py: init_device refuses to start when the free memory after the CUDA context
  and NCCL is below total x --gpu-memory-utilization; determine_available_memory gives the KV cache
  requested - (weights + profile_run's torch peak + non-torch memory); compile_or_warm_up_model captures CUDA
  graphs after the KV cache (outside the share) and allows 150 MiB for the profile's underestimate.
  vllm/v1/core/kv_cache_utils.py get_num_blocks: available // (block_size x bytes per token per layer) //
  num_layers blocks, logged as blocks x block_size tokens.
- SGLang, python/sglang/srt/model_executor/model_runner.py profile_max_num_token: rest = free after weights -
  total x (1 - mem_fraction_static), total being the free memory after the CUDA context; max_total_num_tokens =
  rest // cell_size.
"""

import math
from dataclasses import replace
from pathlib import Path

import pytest

from planner.engines.memory import (VLLM_PROFILE_SLACK_BYTES, sglang_memory, token_bytes, vllm_memory)
from planner.views.export import export_plan
from planner.search.serving import NCCL_BYTES_PER_RANK
from planner.plan.file import read_plan

PLANS = Path(__file__).resolve().parents[2] / "plans"
LLAMA_70B = PLANS / "llama-3.1-70b-h100-sxm-serve-8192.yaml"
QWEN3_32B = PLANS / "qwen3-32b-gh200-serve-8192.yaml"


def _flag(flags, name: str) -> str:
    return flags[flags.index(name) + 1]


def test_vllm_llama_70b_share_and_kv_tokens_by_gpu_worker_and_kv_cache_utils():
    plan = read_plan(LLAMA_70B)
    memory = plan.memory
    # 80 layers x 8 KV heads x 128 dims x K and V x 2 bytes: 320 KiB a token; the plan holds 64 more tokens per
    # sequence than its context (the runtime's DECODE_ROOM_TOKENS), so 24 x 8256 tokens
    assert plan.workload.concurrency == 24
    assert token_bytes(plan, 1) == 80 * 8 * 128 * 2 * 2 == 327_680
    assert memory.kv_cache_bytes == 24 * (8192 + 64) * 327_680
    result = vllm_memory(plan, 1)
    # 24 sequences x 512 blocks of 16 tokens
    assert result.needed_tokens == 24 * math.ceil(8192 / 16) * 16 == 196_608
    # gpu_worker.py determine_available_memory: share x total = weights + activations + KV cache
    non_kv = memory.gpu_bytes + memory.activation_bytes
    assert result.share == math.ceil((non_kv + 196_608 * 327_680) / 85_520_809_984 * 1e4) / 1e4 == 0.8779
    # kv_cache_utils.py get_num_blocks: whole blocks of what the share leaves, 16 tokens each
    blocks = (math.floor(0.8779 * 85_520_809_984) - non_kv) // (16 * 327_680)
    assert result.kv_tokens == blocks * 16 == 196_608
    # init_device's start-up check and the graphs captured outside the share: never 1.00
    free_at_start = 85_520_809_984 - memory.cuda_context_bytes
    assert result.max_share == math.floor((free_at_start - memory.cuda_graph_pool_bytes - VLLM_PROFILE_SLACK_BYTES)
                                          / 85_520_809_984 * 1e4) / 1e4 == 0.8898
    exported = export_plan(plan, "vllm")
    assert _flag(exported.flags, "--gpu-memory-utilization") == "0.8779"
    assert _flag(exported.flags, "--block-size") == "16" and _flag(exported.flags, "--max-num-batched-tokens") == "2048"
    note = next(n for n in exported.notes if n.startswith("serving memory"))
    assert '"GPU KV cache size: 196,608 tokens"' in note and "DECODE_ROOM_TOKENS" in note
    assert "gpu_worker.py determine_available_memory" in note and "kv_cache_utils.py get_num_blocks" in note
    assert not exported.warnings


def test_sglang_qwen3_32b_fraction_and_tokens_by_profile_max_num_token():
    plan = read_plan(QWEN3_32B)
    memory = plan.memory
    # 64 layers x 8 KV heads x 128 dims x K and V x 2 bytes: cell_size 256 KiB
    assert token_bytes(plan, 1) == 64 * 8 * 128 * 2 * 2 == 262_144
    result = sglang_memory(plan, 1)
    # total_gpu_memory: free once the CUDA context exists (GH200's 96 GB less the plan's context figure)
    total = 96_000_000_000 - memory.cuda_context_bytes
    assert result.free_at_start_bytes == total
    assert plan.workload.concurrency == 35
    assert result.share == math.ceil((memory.gpu_bytes + 35 * 8192 * 262_144) / total * 1e4) / 1e4 == 0.8463
    # rest_memory = (total - weights) - total x (1 - f) = f x total - weights; tokens = rest // cell_size
    assert result.kv_tokens == (math.floor(0.8463 * total) - memory.gpu_bytes) // 262_144 == 286_732
    assert result.kv_tokens >= result.needed_tokens == 35 * 8192
    # the rest of the free memory holds the activations and the CUDA graphs
    outside = memory.activation_bytes + memory.cuda_graph_pool_bytes
    assert (1 - result.share) * total >= outside and result.max_share == 0.8624
    exported = export_plan(plan, "sglang")
    assert _flag(exported.flags, "--mem-fraction-static") == "0.8463"
    assert _flag(exported.flags, "--chunked-prefill-size") == "2048"
    assert any("max_total_num_tokens=286,732" in n and "profile_max_num_token" in n for n in exported.notes)


def test_tensor_parallel_ranks_leave_room_for_nccl():
    plan = read_plan(LLAMA_70B)
    one, two = vllm_memory(plan, 1), vllm_memory(plan, 2)
    assert one.free_at_start_bytes - two.free_at_start_bytes == NCCL_BYTES_PER_RANK
    assert two.token_bytes == one.token_bytes // 2 and two.kv_tokens >= two.needed_tokens


def test_a_plan_that_fills_the_gpu_exports_below_one_and_says_the_kv_cache_is_short():
    """The issue's case: 79.62 of 79.65 GiB exported as utilization 1.00. Here the share stops where vLLM's
    start-up check and the graphs outside it allow, and export says how many tokens that leaves."""
    plan = read_plan(LLAMA_70B)
    full = replace(plan, memory=replace(plan.memory, kv_cache_bytes=plan.memory.kv_cache_bytes + 4 * 2**30))
    result = vllm_memory(full, 1)
    assert result.share == result.max_share < 1
    exported = export_plan(full, "vllm")
    assert float(_flag(exported.flags, "--gpu-memory-utilization")) < 1
    (warning,) = exported.warnings
    assert f"{result.kv_tokens:,} tokens" in warning and "short of" in warning and "\n" not in warning
    assert result.kv_tokens < result.needed_tokens


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_weights_plan_has_no_memory_flags(engine):
    plan = read_plan(PLANS / "qwen3-32b-h100-sxm-40gib.yaml")
    flags = export_plan(plan, engine).flags
    assert "--gpu-memory-utilization" not in flags and "--mem-fraction-static" not in flags


# ---- make --for ENGINE: plan within what the engine expresses --------------------------------------------------


@pytest.fixture(scope="module")
def llama_70b(tmp_path_factory) -> Path:
    """The header-only Llama-3.1-70B checkpoint plans/ are made from."""
    from scripts.real_checkpoints import write_checkpoint

    return write_checkpoint("llama-3.1-70b", tmp_path_factory.mktemp("ckpt"))


def test_make_for_sglang_plans_within_what_sglang_wires_for_the_family(llama_70b):
    """SGLang 0.5.23 wires its prefetch offloader only in deepseek_v2.py: make --for sglang plans a Llama model
    for --cpu-offload-gb (tests/planner/test_engine_read_at_use.py), which export restates any other plan for; a P
    that does not divide the offloaded layers is no loss (0.5.23 asserts nothing of it), and vLLM plans as make
    does."""
    from planner.make.make_plan import make_plan

    plan = read_plan(PLANS / "llama-3.1-70b-gh200-64gib.yaml")
    assert len(plan.offload.layers) % plan.offload.prefetch_step
    inputs = replace(plan.inputs, model=str(llama_70b), engine="sglang")
    assert make_plan(inputs).plan.offload.mechanism == "read_at_use"
    exported = export_plan(plan, "sglang")
    assert _flag(exported.flags, "--cpu-offload-gb") and len(exported.losses) == 1
    for_vllm = make_plan(replace(inputs, engine="vllm")).plan
    assert for_vllm.offload == plan.offload


def test_make_for_an_engine_plans_whole_layers_and_says_so(tmp_path):
    """A routed MoE plan becomes the whole-layer plan export would have given, and the verdict says it was
    planned for that engine; check regenerates it from its header (--for is an input)."""
    from planner.engines.plan import expressible_plan
    from planner.make.make_plan import make_plan
    from planner.plan.schema import Inputs
    from planner.plan.file import render_plan
    from planner.views.show import verdict
    from runtime.header_checkpoint import write_header_checkpoint

    folder = tmp_path / "qwen3-30b-a3b"
    write_header_checkpoint(PLANS.parent / "examples" / "qwen3-30b-a3b" / "config.json", folder)
    inputs = Inputs(model=str(folder), gpu="h100-sxm", context=4096, concurrency="1", cuda_graph=True,
                    gpu_memory="24GiB")
    routed = make_plan(inputs).plan
    assert routed.experts.regime == "routed"
    planned = make_plan(replace(inputs, engine="vllm")).plan
    assert planned.experts.regime == "whole_layer" and "--for vllm" in planned.experts.routed_unavailable
    # the same placement export derives from the routed plan
    assert planned.offload == expressible_plan(routed)[0].offload
    assert export_plan(planned, "vllm", exact=True).losses == ()
    assert "Planned for vLLM (make --for vllm" in verdict(planned)
    (tmp_path / "plan.yaml").write_text(render_plan(planned, "offload-plan make"))
    assert "engine: vllm" in (tmp_path / "plan.yaml").read_text()
    assert "Planned for" not in verdict(routed)
    # SGLang 0.5.23 prefetches only DeepSeek's experts: a Qwen3-MoE plan for it reads whole layers' params at use
    for_sglang = make_plan(replace(inputs, engine="sglang")).plan
    assert for_sglang.offload.mechanism == "read_at_use" and for_sglang.experts.regime == "whole_layer"
    assert export_plan(for_sglang, "sglang", exact=True).flags[0] == "--cpu-offload-gb"


def test_make_for_refuses_what_the_engine_cannot_select(tmp_path):
    from tests.conftest import assert_one_line_error, make_checkpoint, run_cli

    make_checkpoint(tmp_path / "ckpt")
    for extra, words in ((["--for", "tgi"], "is not an engine"),
                         (["--for", "vllm", "--params", "q_proj"], "fuse q_proj")):
        result = run_cli(["make", "--model", "ckpt", "--gpu", "h100-sxm", "--budget", "1MiB", *extra], cwd=tmp_path)
        assert_one_line_error(result.returncode, result.stderr, contains=(words,))
