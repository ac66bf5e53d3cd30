"""export's memory flags, computed with each engine's own accounting as its source writes it.

vLLM (vllm/v1/worker/gpu_worker.py, Worker):
- ``init_device`` takes its start-up snapshot after the CUDA context and NCCL exist, sets
  ``requested_memory = total_memory * gpu_memory_utilization`` and refuses to start when the snapshot's free
  memory is below it. So the share must leave the CUDA context, NCCL's buffers and, since CUDA graphs are
  captured after the KV cache is allocated (``compile_or_warm_up_model`` -> ``capture_model``), the graph pool
  outside the requested memory.
- ``determine_available_memory``: KV cache bytes = ``requested_memory - non_kv_cache_memory``, where the
  non-KV memory is the weights, the torch peak of ``profile_run`` (a dummy batch of --max-num-batched-tokens
  tokens, pinned here to the plan's chunk) and memory allocated outside torch during that run.
- ``compile_or_warm_up_model`` leaves ``redundancy_buffer_memory = 150 MiB`` because "the memory profiling may
  slightly underestimate the memory consumption": the same figure is left out of the share here.
- vllm/v1/core/kv_cache_utils.py ``get_num_blocks``: ``num_blocks = available_memory // page_size //
  num_layers`` with ``page_size = block_size x`` one layer's bytes per token; it logs "GPU KV cache size:
  num_blocks x block_size tokens". --block-size is pinned to the engine version's block for the model
  (planner.engines.versions: 16, CacheConfig's default; 64 for MLA models, which every first-choice MLA backend
  takes).

SGLang (python/sglang/srt/model_executor/model_runner.py, ModelRunner):
- ``total_gpu_memory`` is the free memory once the CUDA context and NCCL exist (``init_torch_distributed``),
  the weights are loaded next, and ``profile_max_num_token`` computes ``rest_memory = available_gpu_memory -
  total_gpu_memory * (1 - mem_fraction_static)`` and ``max_total_num_tokens = rest_memory // cell_size``
  (``cell_size`` = one token's KV bytes over every layer), rounded down to --page-size (1 by default). The
  memory outside the static fraction, ``total_gpu_memory * (1 - mem_fraction_static)``, must hold the
  activations and the CUDA graphs.
"""

import math
from dataclasses import dataclass

from planner.engines.read_at_use import READ_AT_USE
from planner.plan.schema import Plan
from planner.search.serving import DECODE_ROOM_TOKENS, nccl_bytes_or_default
from planner.units import format_bytes

#: vLLM's KV cache block in tokens where the caller gives none (CacheConfig's default)
VLLM_BLOCK_TOKENS = 16
#: vLLM's own allowance for its profile's underestimate (gpu_worker.py compile_or_warm_up_model,
#: redundancy_buffer_memory = 150 MiB)
VLLM_PROFILE_SLACK_BYTES = 150 * 2**20
#: shares are written with four decimals (both engines take any float): 0.0001 of an 80 GiB card is 8 MiB
SHARE_DECIMALS = 4


@dataclass(frozen=True, kw_only=True)
class EngineMemory:
    """One engine's memory share for a serving plan, per rank, and what the engine will report with it."""

    #: --gpu-memory-utilization (vLLM) or --mem-fraction-static (SGLang)
    share: float
    #: the KV cache tokens the engine will report at start-up ("GPU KV cache size" / max_total_num_tokens)
    kv_tokens: int
    #: tokens the plan's sequences need at full context (vLLM: padded to whole blocks per sequence)
    needed_tokens: int
    #: one token's KV bytes over every layer, per rank
    token_bytes: int
    #: what the engine sees at start: the GPU's memory less the CUDA context and NCCL
    free_at_start_bytes: int
    #: the largest share the start-up check and the memory outside the share allow
    max_share: float
    #: the KV cache block the accounting used (vLLM's --block-size; 1 for SGLang's default page)
    block_tokens: int = 1


def token_bytes(plan: Plan, divisor: int) -> int:
    """One token's KV bytes over every layer, per rank: the plan's KV figure over the tokens it holds
    (its sequences at context plus the runtime's DECODE_ROOM_TOKENS each), over ``divisor`` (the TP size for a
    one-GPU plan, 1 for a make --tp plan, whose figures are one rank's)."""
    workload = plan.workload
    held = workload.concurrency * (workload.context_tokens + DECODE_ROOM_TOKENS)
    return max(1, math.ceil(plan.memory.kv_cache_bytes / held / divisor))


def startup_bytes(plan: Plan, tp_size: int) -> int:
    """What exists before the engines' start-up snapshot: the plan's CUDA context figure, and NCCL's buffers (the
    plan's measured figure, else NCCL_BYTES_PER_RANK), which a make --tp plan's context figure already holds
    (planner.model.memory_accounting.other_bytes)."""
    nccl_bytes = nccl_bytes_or_default(plan.hardware.nccl_bytes) if tp_size > 1 and plan.inputs.tp == 1 else 0
    return plan.memory.cuda_context_bytes + nccl_bytes


def vllm_memory(plan: Plan, tp_size: int, divisor: int | None = None,
                block_tokens: int | None = VLLM_BLOCK_TOKENS) -> EngineMemory:
    """--gpu-memory-utilization for the plan's KV cache under vLLM's accounting (gpu_worker.py
    determine_available_memory, kv_cache_utils.py get_num_blocks), with --block-size ``block_tokens``."""
    memory, workload = plan.memory, plan.workload
    divisor = tp_size if divisor is None else divisor
    block = VLLM_BLOCK_TOKENS if block_tokens is None else block_tokens
    total = plan.hardware.gpu_memory_bytes
    per_token = token_bytes(plan, divisor)
    needed = workload.concurrency * -(-workload.context_tokens // block) * block
    non_kv = math.ceil((memory.gpu_bytes + (memory.activation_bytes or 0)) / divisor)
    free_at_start = total - startup_bytes(plan, tp_size)
    outside = math.ceil(memory.cuda_graph_pool_bytes / divisor) + VLLM_PROFILE_SLACK_BYTES
    max_share = _floor_share((free_at_start - outside) / total)
    share = _positive(min(_ceil_share((non_kv + needed * per_token) / total), max_share))
    available = math.floor(share * total) - non_kv
    kv_tokens = max(available // (block * per_token), 0) * block
    return EngineMemory(share=share, kv_tokens=kv_tokens, needed_tokens=needed, token_bytes=per_token,
                        free_at_start_bytes=free_at_start, max_share=max_share, block_tokens=block)


def sglang_memory(plan: Plan, tp_size: int, divisor: int | None = None,
                  block_tokens: int | None = None) -> EngineMemory:
    """--mem-fraction-static for the plan's KV cache under SGLang's accounting (model_runner.py
    profile_max_num_token); ``block_tokens`` is not used (SGLang pages by --page-size, 1 by default)."""
    memory, workload = plan.memory, plan.workload
    divisor = tp_size if divisor is None else divisor
    per_token = token_bytes(plan, divisor)
    needed = workload.concurrency * workload.context_tokens
    # read at use (--cpu-offload-gb): one layer's copies are allocated inside its forward, after the weights are
    # loaded and the pool is sized, so they come out of the rest as the activations do
    transient = memory.num_slots * memory.slot_bytes if plan.offload.mechanism == READ_AT_USE else 0
    weights = math.ceil((memory.gpu_bytes - transient) / divisor)
    free_at_start = plan.hardware.gpu_memory_bytes - startup_bytes(plan, tp_size)
    outside = math.ceil(((memory.activation_bytes or 0) + memory.cuda_graph_pool_bytes + transient) / divisor)
    max_share = _floor_share(1 - outside / free_at_start) if free_at_start > 0 else 0.0
    share = _positive(min(_ceil_share((weights + needed * per_token) / free_at_start), max_share)
                      if free_at_start > 0 else 0.0)
    rest = math.floor(share * free_at_start) - weights
    return EngineMemory(share=share, kv_tokens=max(rest // per_token, 0), needed_tokens=needed,
                        token_bytes=per_token, free_at_start_bytes=free_at_start, max_share=max_share)


def describe(memory_note: str, plan: Plan, tp_size: int, result: EngineMemory) -> str:
    """One note: the share's parts (``memory_note``, the engine's template in planner.engines.targets), the KV
    tokens the engine will report, the decode room, any shortfall."""
    workload = plan.workload
    how = memory_note.format(
        share=f"{result.share:.{SHARE_DECIMALS}f}", max_share=f"{result.max_share:.{SHARE_DECIMALS}f}",
        gpu_memory=format_bytes(plan.hardware.gpu_memory_bytes), chunk=_chunk(plan), kv_tokens=f"{result.kv_tokens:,}",
        token_bytes=format_bytes(result.token_bytes), free_at_start=format_bytes(result.free_at_start_bytes),
        block_tokens=result.block_tokens,
        and_nccl=" and NCCL" if tp_size > 1 else "")
    room = (f"; the plan's KV figure also holds {DECODE_ROOM_TOKENS} tokens per sequence of decode room that "
            "offload-plan's own runtime keeps past the context (DECODE_ROOM_TOKENS), which the engines do not need")
    short = ""
    if result.kv_tokens < result.needed_tokens:
        fit = result.kv_tokens // max(1, result.needed_tokens // workload.concurrency)
        short = (f"; SHORT: the engine's accounting leaves {result.kv_tokens:,} of the {result.needed_tokens:,} tokens "
                 f"{workload.concurrency} sequences of {workload.context_tokens} need, {fit} at full context")
    per_rank = f" per rank of TP={tp_size}" if tp_size > 1 else ""
    return f"serving memory{per_rank}: {how}{room}{short}"


def _chunk(plan: Plan) -> int:
    return max(plan.workload.chunk_tokens, plan.workload.concurrency)


def _positive(share: float) -> float:
    """At least the smallest share written: both engines refuse 0 (vLLM's CacheConfig gt=0), and a plan whose
    figures leave no room gets the smallest one with the SHORT note and warning instead."""
    return max(share, 10**-SHARE_DECIMALS)


def _ceil_share(share: float) -> float:
    """Rounded up to SHARE_DECIMALS (never below what the plan needs)."""
    scale = 10**SHARE_DECIMALS
    return math.ceil(share * scale - 1e-9) / scale


def _floor_share(share: float) -> float:
    scale = 10**SHARE_DECIMALS
    return max(0.0, math.floor(share * scale + 1e-9) / scale)
