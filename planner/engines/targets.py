"""The engines ``export`` writes flags for, and ``make --for`` plans within, as data: one EngineTarget each.

An entry holds an engine's flag names, which plan field each flag carries, and what of a plan the engine cannot
express (a prefetch depth that does not divide the offloaded layers, a selection its model code overrides, a
LoRA rank it does not accept), and the wording of its memory note. planner.views.export and planner.engines.memory
read the entry and hold no per-engine branch; the engines' own memory accounting stays in planner.engines.memory,
and the nearest plan an engine can run in planner.engines.plan. A new engine is one entry here (its memory
function in planner.engines.memory) plus tests.

What each released version accepts and which model families its offloaders are wired for is
planner.engines.versions (EngineVersion, read from the released wheels); an entry here holds what is the same for
every pinned version: the flag names export fills in and the wording of its notes.
"""

from dataclasses import dataclass
from typing import Callable

from planner.engines.memory import sglang_memory, vllm_memory
from planner.engines.versions import VLLM_LORA_RANKS
from planner.errors import PlanError

#: checkpoint name parts each engine fuses with others into one param: a segment naming one alone selects nothing
FUSED_PARTS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
               "up_proj": "gate_up_proj", "w1": "experts.w13_weight", "w3": "experts.w13_weight",
               "w2": "experts.w2_weight"}
#: both engines' layer rule and prefetch depth (vLLM's model_executor/offloader/, SGLang's OffloaderV2):
#: (flag, the plan's offload field it carries)
OFFLOAD_FLAGS = (("--offload-group-size", "group_size"), ("--offload-num-in-group", "num_in_group"),
                 ("--offload-prefetch-step", "prefetch_step"))


@dataclass(frozen=True, kw_only=True)
class EngineTarget:
    """One engine: the flags that say a plan to it and what of a plan it cannot say.

    Flag lists are (flag, field) pairs in the order written: ``field`` names the value planner.views.export fills in
    (None: a bare switch; a field starting with "=" is the literal value after the "=").
    """

    #: the --to / --for value
    name: str
    #: the engine's name in sentences
    display_name: str
    #: the tensor-parallel size flag
    tp_flag: str
    #: flags after OFFLOAD_FLAGS that pick the engine's offloading mode (copies from pinned host memory)
    offload_mode_flags: tuple[str, ...]
    #: how the engine offloads, for the notes
    mode_note: str
    #: how the engine reads params it offloads without prefetching them (--cpu-offload-gb), for the notes
    read_at_use_note: str
    #: what the engine says of expert-granular offloading
    experts_note: str
    #: (flag, field) of a serving plan; fields: concurrency, context_tokens, chunk_tokens, memory_share,
    #: block_tokens (written only where the engine version pins a block), or "=V"
    serving_flags: tuple[tuple[str, str], ...]
    #: the engine's memory accounting (planner.engines.memory): (plan, tp_size, divisor) -> EngineMemory
    memory: Callable
    #: what the share covers and what the engine will report, for planner.engines.memory.describe; fields: share,
    #: max_share, gpu_memory, chunk (the profile's tokens), kv_tokens, token_bytes, free_at_start, and_nccl
    memory_note: str
    #: the plan's KV dtype -> the engine's --kv-cache-dtype value (the model's own dtype: no flag)
    kv_cache_dtypes: tuple[tuple[str, str], ...]
    #: (flag, field) of a plan with LoRA adapters; fields: slots, pool, rank, modules (one value per adapter),
    #: None for a bare switch
    lora_flags: tuple[tuple[str, str | None], ...]
    #: the LoRA ranks the engine accepts (a plan's rank is rounded up to one); None: any
    lora_ranks: tuple[int, ...] | None
    #: what to do with adapters above the largest of lora_ranks
    lora_rank_fix: str = ""
    #: how the engine loads a batch's adapters, appended to the adapters note; {first} and {last}: the pipelined
    #: waits
    lora_loading_note: str

    def kv_cache_dtype(self, kv_dtype: str) -> str | None:
        """The --kv-cache-dtype value for the plan's KV dtype, None for the model's own."""
        return dict(self.kv_cache_dtypes).get(kv_dtype)


VLLM = EngineTarget(
    name="vllm", display_name="vLLM", tp_flag="--tensor-parallel-size", offload_mode_flags=(),
    mode_note="vLLM runs its prefetch backend (static slots, copies on a side stream) because --offload-group-size "
              "is above 0 (--offload-backend auto); the UVA backend (--cpu-offload-gb) reads weights in place instead",
    read_at_use_note="vLLM's UVA backend reads the offloaded params in place over the link at every use",
    experts_note="vLLM offloads whole params of chosen layers; its expert cache (PR 37190) is not merged",
    serving_flags=(("--max-num-seqs", "concurrency"), ("--max-model-len", "context_tokens"),
                   ("--max-num-batched-tokens", "chunk_tokens"), ("--block-size", "block_tokens"),
                   ("--gpu-memory-utilization", "memory_share")),
    memory=vllm_memory, kv_cache_dtypes=(("fp8", "fp8"),),
    memory_note=("--gpu-memory-utilization {share} of the GPU's {gpu_memory} covers the weights, the activations of "
                 "its {chunk}-token profile and the KV cache (gpu_worker.py determine_available_memory); the CUDA "
                 "context, NCCL, the CUDA graphs and vLLM's 150 MiB profile allowance stay outside it (at most "
                 "{max_share}); vLLM should log \"GPU KV cache size: {kv_tokens} tokens\" (blocks of "
                 "{block_tokens} x {token_bytes} per token, kv_cache_utils.py get_num_blocks)"),
    lora_flags=(("--enable-lora", None), ("--max-loras", "slots"), ("--max-cpu-loras", "pool"),
                ("--max-lora-rank", "rank"), ("--lora-modules", "modules")),
    lora_ranks=VLLM_LORA_RANKS, lora_rank_fix="serve them with SGLang",
    lora_loading_note=" (vLLM loads a batch's adapters before it runs it)",
)

SGLANG = EngineTarget(
    name="sglang", display_name="SGLang", tp_flag="--tp-size", offload_mode_flags=("--offload-mode", "cpu"),
    mode_note="--offload-mode cpu: each offloaded param lives in pinned host memory and is copied P layers ahead "
              "on SGLang's offload stream into a tensor allocated at each copy (shm_cpu and sharded_gpu share one "
              "copy between data-parallel ranks and need TP size 1)",
    read_at_use_note=("SGLang's OffloaderV1 keeps the params of the first layers in pinned host memory, layer 0 "
                      "onward, and copies a layer's params to the GPU inside its forward on the compute stream: every "
                      "offloaded byte is read at every step, behind no compute"),
    experts_note="SGLang offloads whole params (OffloaderV1: of the first layers; OffloaderV2: DeepSeek's experts "
                 "of the chosen layers), never the routed experts a step uses alone",
    serving_flags=(("--max-running-requests", "concurrency"), ("--context-length", "context_tokens"),
                   ("--chunked-prefill-size", "chunk_tokens"), ("--mem-fraction-static", "memory_share")),
    memory=sglang_memory, kv_cache_dtypes=(("fp8", "fp8_e4m3"),),
    memory_note=("--mem-fraction-static {share} of the {free_at_start} free after the CUDA context{and_nccl} covers "
                 "the weights and the KV pool (model_runner.py profile_max_num_token); the activations and CUDA "
                 "graphs use the rest (at most {max_share}); SGLang should report max_total_num_tokens={kv_tokens} "
                 "({token_bytes} per token)"),
    lora_flags=(("--enable-lora", None), ("--lora-paths", "modules"), ("--max-loras-per-batch", "slots"),
                ("--max-loaded-loras", "pool")),
    lora_ranks=None,
    lora_loading_note="; with --enable-lora-overlap-loading (SGLang builds with asynchronous loading) its first "
                      "request starts after {first} and the last after {last}",
)

#: every engine, by its --to name, in the order errors list them
TARGETS = {target.name: target for target in (VLLM, SGLANG)}
ENGINES = tuple(TARGETS)


def check_segment(segment: str) -> None:
    """Segments that name a fused checkpoint part or one expert cannot be said to an engine."""
    parts = segment.split(".")
    if any(part.isdigit() for part in parts):
        raise PlanError(f"--params {segment!r} names one expert or layer by index, but the engines hold each layer's "
                        "experts as one fused param: select 'experts' instead")
    fused = [part for part in parts if part in FUSED_PARTS]
    if fused:
        raise PlanError(f"--params {segment!r}: the engines fuse {fused[0]} into {FUSED_PARTS[fused[0]]} with its "
                        "siblings, so their matching cannot select it alone: select the enclosing module "
                        "(e.g. 'self_attn', 'mlp' or 'experts') and make the plan again")


def flag_values(pairs: tuple[tuple[str, str | None], ...], values: dict[str, str | list[str]]) -> list[str]:
    """The flags of (flag, field) pairs with the plan's values: a bare switch, a literal "=V", one value, or the
    values of a list field."""
    flags: list[str] = []
    for flag, field in pairs:
        flags.append(flag)
        if field is None:
            continue
        value = field[1:] if field.startswith("=") else values[field]
        flags += value if isinstance(value, list) else [value]
    return flags
