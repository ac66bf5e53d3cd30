"""The plan file: a frozen dataclass tree, written by one function with fixed YAML settings.

Same inputs, same bytes: stable key order, block style (one line per layer row so diffs stay readable),
floats rounded to fixed decimals, no timestamps, host names or absolute paths. A header comment holds the
command that regenerates the file. Written atomically: a failed write never leaves a partial file.
"""

import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from planner.errors import PlanError, printable, shown
from planner.profile import FIGURE_MAX, FIGURE_MIN
from planner.units import SIZE_HELP
from planner.untrusted import checked_path, load_yaml, read_capped

SCHEMA_VERSION = 2
#: versions read_plan accepts: older ones are upgraded on read (and check reports them stale)
READABLE_SCHEMA_VERSIONS = (1, 2)
#: a plan of 100,000 layers is about 10 MB
MAX_PLAN_BYTES = 16 * 2**20
#: plausible bounds of any number in a plan: byte counts and counts fit in 2**62, rates (FLOP/s) stay under
#: 1e21 and times under 1e15 ms; beyond these a plan was edited by hand or corrupted, and arithmetic on it
#: (floats of huge ints, table formatting) would overflow
MAX_PLAN_INT = 2**62
MAX_PLAN_FLOAT = 1e21
MS_DECIMALS = 4
#: a serving row's num_offloaded where no placement fits beside that concurrency's cache (its one negative number)
NOTHING_FITS = -1
SHARE_DECIMALS = 4


def option(flag: str, help: str, *, short: str | None = None, always: bool = False) -> dict:
    """An Inputs field's command-line form: ``make`` builds its option from it and ``regenerate_command``
    writes it back (``always``: written even at its default, so the header says it)."""
    return {"flag": flag, "short": short, "help": help, "always": always}


@dataclass(frozen=True, kw_only=True)
class Inputs:
    """The arguments of ``make`` that produced the plan: enough to regenerate it.

    The one declaration of make's inputs: each field's metadata (``option``) is its flag and help, from which
    the make command's options and the plan's regenerate command are both derived.
    """

    model: str = field(metadata=option("--model", "Checkpoint folder, .safetensors file, or hub repo id.",
                                       short="-m", always=True))
    revision: str | None = field(default=None, metadata=option("--revision", "Hub revision (branch, tag or commit)."))
    gpu: str = field(metadata=option("--gpu", "Built-in profile name (see `profiles`) or a profile .yaml.",
                                     short="-g", always=True))
    budget: str | None = field(default=None, metadata=option(
        "--budget", f"GPU bytes for weights, slots included: 40GiB, 80GB ({SIZE_HELP})."))
    trigger: float | None = field(default=None, metadata=option(
        "--trigger", "Budget as a share of GPU memory, e.g. 0.5."))
    tokens: int = field(default=2048, metadata=option(
        "--tokens", "Tokens per forward step (prefill chunk or decode batch).", always=True))
    sequences: int = field(default=1, metadata=option(
        "--sequences", "Sequences those tokens belong to (decode: the batch)."))
    context: int = field(default=0, metadata=option(
        "--context", "Tokens already in each sequence's KV cache; with --concurrency, the longest sequence served "
                     "(prompt and output)."))
    params: tuple[str, ...] = field(default=(), metadata=option(
        "--params", "Offload only params matching these name segments (repeat)."))
    stack: str | None = field(default=None, metadata=option(
        "--stack", "Layer stack to plan, e.g. model.language_model.layers."))
    group_size: int | None = field(default=None, metadata=option("--group-size", "Pin G instead of searching it."))
    num_in_group: int | None = field(default=None, metadata=option("--num-in-group", "Pin K instead of searching it."))
    prefetch_step: int | None = field(default=None, metadata=option(
        "--prefetch-step", "Pin P instead of searching it."))
    measure: bool = field(default=False, metadata=option(
        "--measure", "Time one layer of each kind on the local GPU instead of estimating."))
    measured_on: str | None = field(default=None, metadata=option(
        "--measured-on", "Profile of the local GPU for --measure (default: from its name)."))
    cuda_graph: bool = field(default=False, metadata=option(
        "--cuda-graph", "Plan for decode steps replayed from CUDA graphs (run --cuda-graph), one step per replay: "
                        "prefetches join at each replay's end; --measure times layers graphed."))
    host_memory: str | None = field(default=None, metadata=option(
        "--host-memory", "Host memory the offloaded params may be pinned in, e.g. 480GB (default: the profile's "
                         "figure; Grace profiles have one)."))
    concurrency: str | None = field(default=None, metadata=option(
        "--concurrency", "Serving target: plan the whole GPU for decode at this many sequences of up to --context "
                         "tokens: 64, a range 8..512, or auto (the most tokens/s)."))
    chunk: int = field(default=2048, metadata=option(
        "--chunk", "Serving: tokens of a prefill chunk (its activations are planned, its time reported)."))
    kv_dtype: str = field(default="auto", metadata=option(
        "--kv-dtype", "KV cache element type: auto (the checkpoint's), bf16, fp16, fp8."))
    max_tpot_ms: float | None = field(default=None, metadata=option(
        "--max-tpot-ms", "Serving: the longest decode step (per-token latency) allowed, in ms."))
    gpu_memory: str | None = field(default=None, metadata=option(
        "--gpu-memory", f"GPU memory the whole plan must fit, e.g. 24GiB ({SIZE_HELP}; default: the profile's; run "
                        "caps itself to it)."))
    adapters: tuple[str, ...] = field(default=(), metadata=option(
        "--adapter", "A LoRA adapter served beside the model: NAME=PATH, a PEFT folder or hub id (repeat)."))
    adapter_slots: int | None = field(default=None, metadata=option(
        "--adapter-slots", "GPU slots for adapters (default: as many as a batch can use, within GPU memory)."))
    routing_trace: str | None = field(default=None, metadata=option(
        "--routing-trace", "MoE: a routing trace (offload-plan trace) to choose resident experts from; the plan "
                           "records its sha256 (default: uniform routing)."))
    prefetch_accuracy: float | None = field(default=None, metadata=option(
        "--prefetch-accuracy", "MoE, routed experts: the share of a step's routed experts that next-layer "
                               "prediction prefetches, from 0 to 1 (default: the H100 measurement the planner "
                               "keeps)."))
    tp: int = field(default=1, metadata=option(
        "--tp", "Tensor-parallel GPUs: plan one rank of N as vLLM shards the model, all-reduces at the profile's "
                "GPU link; 2,4 compares GPU counts (one plan per N, -o PATH written as PATH.tpN.yaml)."))
    engine: str | None = field(default=None, metadata=option(
        "--for", "Plan within what this engine expresses, vllm or sglang (whole layers, no routed experts; "
                 "SGLang: P divides the offloaded layers), so export gives exactly this plan."))


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    """What was planned: the checkpoint's identity and how its bytes divide."""

    source: str
    #: hub commit the headers were read at; null for local checkpoints
    revision: str | None
    #: sha256 over every tensor's name, dtype and shape
    fingerprint: str
    architecture: str | None
    #: the planned layer stack's name prefix
    stack: str
    #: layers of the stack that run
    num_layers: int
    num_tensors: int
    #: every tensor of the checkpoint
    total_bytes: int
    #: bytes of the layers that run
    layer_bytes: int
    #: embeddings, norms, head and other stacks: always on the GPU
    non_layer_bytes: int
    #: stack layers beyond config's layer count (e.g. multi-token prediction): never loaded
    unused_layers: tuple[int, ...]
    unused_bytes: int
    #: dtype -> bytes, over the whole checkpoint
    dtype_bytes: dict[str, int]


@dataclass(frozen=True, kw_only=True)
class HardwareSection:
    """The profile figures the plan was computed with."""

    profile: str
    gpu_memory_bytes: int
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float | None
    h2d_bytes_per_s: float
    copy_overhead_us: float
    trigger: float
    reserve_bytes: int
    compute_efficiency: float
    #: host memory the plan's pinned bytes were checked against (--host-memory, else the profile's); None: unchecked
    host_memory_bytes: int | None = None
    #: the profile's CUDA context figure; None: the planner's default (memory.cuda_context_bytes says what was used)
    cuda_context_bytes: int | None = None

    def __post_init__(self):
        # The same rules as planner.profile.HardwareProfile, from its tables: a plan read back must not divide by
        # a zero rate, nor by a denormal one (times overflow to infinity)
        for key in ("gpu_memory_bytes", "hbm_bytes_per_s", "bf16_flops_per_s", "h2d_bytes_per_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"hardware.{key} must be positive")
        for key, lowest in FIGURE_MIN.items():  # the GPU link is a profile figure a plan does not record
            if getattr(self, key, None) is not None and 0 < getattr(self, key) < lowest:
                raise ValueError(f"hardware.{key} {getattr(self, key):g} is below any GPU (at least {lowest:g})")
        for key, highest in FIGURE_MAX.items():
            if getattr(self, key, None) is not None and getattr(self, key) > highest:
                raise ValueError(f"hardware.{key} {getattr(self, key):g} is beyond any GPU (at most {highest:g})")
        for key in ("fp8_flops_per_s", "host_memory_bytes"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                raise ValueError(f"hardware.{key} must be positive (or null)")
        for key in ("trigger", "compute_efficiency"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"hardware.{key} must be a share in (0, 1]")
        if not self.reserve_bytes < self.gpu_memory_bytes:
            raise ValueError("hardware.reserve_bytes must be less than gpu_memory_bytes")


@dataclass(frozen=True, kw_only=True)
class WorkloadSection:
    """One forward step."""

    tokens_per_step: int
    sequences_per_step: int
    context_tokens: int
    #: where the per-layer compute times come from ("estimated: ..." or "measured: ...")
    compute_source: str
    #: steps are CUDA-graph replays of planner.simulate.STEPS_PER_GRAPH steps (one): copies that wrap past a
    #: replay's last step finish inside it
    cuda_graph: bool = False
    #: sequences decoded together: a serving plan's chosen concurrency, else sequences_per_step
    concurrency: int = 1
    #: tokens of one prefill chunk: a serving plan's --chunk, else tokens_per_step
    chunk_tokens: int = 2048
    #: KV cache element type (bf16, fp16, fp8, fp32)
    kv_dtype: str = "bf16"

    def __post_init__(self):
        if self.tokens_per_step < 1 or self.sequences_per_step < 1 or self.tokens_per_step % self.sequences_per_step:
            raise ValueError("workload.tokens_per_step must be a positive multiple of sequences_per_step (>= 1)")


@dataclass(frozen=True, kw_only=True)
class OffloadSection:
    """The decisions, in the engines' terms, and the explicit layer list."""

    #: G: layers are taken in groups of G (0 when nothing is offloaded)
    group_size: int
    #: K: the last K layers of every group are offloaded
    num_in_group: int
    #: P: copies run this many offloaded layers ahead; also the number of GPU slots
    prefetch_step: int
    #: name segments selecting the params that move (empty: whole layers)
    params: tuple[str, ...]
    #: offloaded layer indices, ascending
    layers: tuple[int, ...]
    #: under CUDA graphs (workload.cuda_graph; written only then): of the copies that wrap past a replay, the
    #: last this many are issued by the next replay as it begins instead of joined at this one's end
    replay_start_copies: int = 0

    def __post_init__(self):
        if list(self.layers) != sorted(set(self.layers)):
            raise ValueError("offload.layers must be ascending and distinct")
        if not 0 <= self.replay_start_copies <= (self.prefetch_step if self.layers else 0):
            raise ValueError("offload.replay_start_copies must be between 0 and prefetch_step")
        if self.layers and (self.prefetch_step < 1 or self.group_size < 1):
            raise ValueError("offload.prefetch_step and offload.group_size must be >= 1 when layers are offloaded")


@dataclass(frozen=True, kw_only=True)
class MemorySection:
    """Where the weights live."""

    budget_bytes: int
    #: weights on the GPU: resident params + slots + non-layer tensors + allocation slack
    gpu_bytes: int
    resident_layer_bytes: int
    non_layer_bytes: int
    #: alignment pads and allocator rounding of the runtime's one GPU allocation (planner.placement)
    allocation_slack_bytes: int
    num_slots: int
    #: one slot holds the largest offloaded layer's selected params
    slot_bytes: int
    #: offloaded params in pinned host memory
    host_pinned_bytes: int
    #: the GPU memory the whole plan must fit: the profile's, --trigger's share of it, or --gpu-memory
    gpu_memory_bytes: int = 0
    #: KV cache of the workload's sequences at their context (None: the architecture's cache is not modelled)
    kv_cache_bytes: int | None = None
    #: peak activations of a step (serving: of a prefill chunk or an eager decode step, whichever is larger),
    #: estimated from the shapes, or measured on the local GPU for a serving plan made with --measure
    activation_bytes: int | None = None
    #: a captured decode step's intermediates, held by its CUDA graph's pool (0 when not graphed)
    cuda_graph_pool_bytes: int = 0
    #: CUDA context, library workspaces and allocator rounding beyond the tensors
    cuda_context_bytes: int = 0
    #: weights + KV cache + activations + graph pool + context + adapter slots (None when the KV cache is not
    #: modelled)
    total_gpu_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class PredictionSection:
    """The simulated steady-state step."""

    step_ms: float
    resident_step_ms: float
    #: compute outside the stack per step (embedding, final norm, LM head)
    head_ms: float
    stall_ms: float
    #: offloaded bytes copied per step / host-to-device bandwidth: no step can be faster than this
    link_floor_ms: float
    copy_bytes_per_step: int
    #: share of the step the link is busy
    link_busy_share: float
    #: a decode step of workload.concurrency sequences (the per-token latency); None for a prefill plan
    decode_step_ms: float | None = None
    #: decode tokens per second over all sequences; None for a prefill plan
    decode_tokens_per_s: float | None = None
    #: a prefill chunk of workload.chunk_tokens tokens with the same placement (serving plans and prefill plans)
    prefill_chunk_ms: float | None = None


@dataclass(frozen=True, kw_only=True)
class LayerRow:
    """One planned layer."""

    index: int
    bytes: int
    #: bytes of the layer's params that offload.params selects (the whole layer when it selects by layer), for
    #: every layer: 0 means offloading the layer would move nothing (schema 2)
    selected_bytes: int
    #: bytes moved over the link when offloaded (selected params); 0 for resident layers
    offloaded_bytes: int
    compute_ms: float
    #: copy time of the selected params (shown for every layer, to see what offloading it would cost)
    copy_ms: float


@dataclass(frozen=True, kw_only=True)
class ServingRow:
    """One concurrency the serving search evaluated, with the best placement there."""

    concurrency: int
    #: layers offloaded (0: all resident; -1: no placement fits beside this many sequences' cache)
    num_offloaded: int = field(metadata={"lowest": NOTHING_FITS})
    group_size: int
    num_in_group: int
    prefetch_step: int
    #: GPU bytes of the placed weights (0 when nothing fits)
    weights_gpu_bytes: int
    kv_cache_bytes: int
    #: weights + KV cache + activations + graph pool + context
    total_gpu_bytes: int
    #: decode step (per-token latency); None when nothing fits
    step_ms: float | None
    tokens_per_s: float


@dataclass(frozen=True, kw_only=True)
class ServingSection:
    """How the serving target was chosen (serving plans only): every concurrency tried, and the alternative."""

    #: the concurrencies searched, low to high (equal for --concurrency N)
    concurrency_low: int
    concurrency_high: int
    #: --max-tpot-ms: the longest decode step allowed (None: no limit)
    max_tpot_ms: float | None
    #: the most tokens/s with every weight resident, at this concurrency (None: the model never fits whole)
    no_offload_concurrency: int | None
    no_offload_step_ms: float | None
    no_offload_tokens_per_s: float | None
    #: rows in ascending concurrency, one line each
    points: tuple[ServingRow, ...]


@dataclass(frozen=True, kw_only=True)
class AdapterRow:
    """One LoRA adapter of the plan."""

    name: str
    #: the folder or hub id as given
    source: str
    #: hub commit the files were read at; null for local folders
    revision: str | None
    #: sha256 over the tensors' names, dtypes and shapes and the config's rank and alpha
    fingerprint: str
    rank: int
    alpha: float
    #: adapted module names (last name segments)
    target_modules: tuple[str, ...]
    num_tensors: int
    bytes: int
    #: copy time of this adapter over the whole link
    copy_ms: float


@dataclass(frozen=True, kw_only=True)
class AdaptersSection:
    """LoRA adapters served beside the model (make --adapter): GPU slots, the pinned pool, and the wait of a
    batch whose adapters are not loaded, blocking against pipelined (planner.adapters says how it is modelled)."""

    #: adapters kept on the GPU at once (the engines' max-loras per batch)
    num_slots: int
    #: one slot holds the largest adapter
    slot_bytes: int
    #: num_slots x slot_bytes, counted in memory.total_gpu_bytes
    gpu_bytes: int
    #: every adapter, pinned in host memory (slots hold copies)
    host_pinned_bytes: int
    max_rank: int
    #: adapters a new batch misses: min(slots, sequences, adapters)
    num_missing: int
    #: one slot-sized adapter over the whole link
    copy_ms: float
    #: one adapter over the link's share left by the running steps' weight copies
    shared_copy_ms: float
    #: blocking (copy all, then compute): every request waits this; the compute stream idles as long
    blocking_wait_ms: float
    #: pipelined (each request starts when its adapter lands): the first request's wait, compute idle as long
    pipelined_first_wait_ms: float
    #: pipelined: the last request's wait
    pipelined_last_wait_ms: float
    #: pipelined: a step while adapters load (longer than the plan's only where the weights give up link time)
    pipelined_step_ms: float
    #: the loading mode run serves: the one planner.adapter_stream predicts faster over the stream below
    mode: str
    #: that stream: stream_num_batches batches of stream_requests_per_batch requests over distinct adapters
    stream_requests_per_batch: int
    stream_num_batches: int
    #: its predicted total, each mode (the offloaded weights' copies on the link too)
    blocking_stream_ms: float
    pipelined_stream_ms: float
    #: the other mode's total over the chosen one's, less 1
    mode_margin: float
    #: rows by name
    items: tuple[AdapterRow, ...]

    def __post_init__(self):
        if not self.items or not 1 <= self.num_slots:
            raise ValueError("adapters needs at least one adapter and one slot")
        if self.gpu_bytes != self.num_slots * self.slot_bytes:
            raise ValueError("adapters.gpu_bytes must be num_slots x slot_bytes")
        if [row.name for row in self.items] != sorted({row.name for row in self.items}):
            raise ValueError("adapters.items must have distinct names, sorted")


EXPERT_REGIMES = ("routed", "whole_layer", "mixed")
#: experts.prefetch: none, or the next routed layer's router predicting its experts (runtime.routed_experts)
EXPERT_PREFETCH = (None, "next_layer_router")


@dataclass(frozen=True, kw_only=True)
class ExpertLayer:
    """One MoE layer of the plan: whether it fetches routed experts or streams (or keeps) the whole layer."""

    #: the layer's index in the stack
    index: int
    #: "routed": only routed, non-resident experts cross the link; "whole_layer": as offload.layers says
    regime: str
    #: expert ids kept on the GPU, ascending (routed layers; () otherwise)
    resident: tuple[int, ...]
    #: expected bytes over the link per decode step, at the plan's concurrency
    expected_fetched_bytes: int
    #: share of routed (token, expert) pairs served by experts already on the GPU
    hit_rate: float

    def __post_init__(self):
        if self.regime not in EXPERT_REGIMES[:2]:
            raise ValueError(f"experts.layers regime {self.regime!r} is not one of routed, whole_layer")
        if list(self.resident) != sorted(set(self.resident)):
            raise ValueError("experts.layers resident ids must be ascending and distinct")
        if self.resident and self.regime != "routed":
            raise ValueError("experts.layers: only routed layers keep resident experts")
        if not 0 <= self.hit_rate <= 1:
            raise ValueError("experts.layers hit_rate must be a share in [0, 1]")


@dataclass(frozen=True, kw_only=True)
class ExpertsPoint:
    """One step size the expert regimes were compared at: a serving concurrency, or a weights plan's step."""

    concurrency: int
    #: the regime chosen there
    regime: str
    #: the step with every MoE layer routed (None: it does not fit, or routed is unavailable)
    routed_step_ms: float | None
    #: the step streaming whole layers (today's search; None: nothing fits)
    whole_layer_step_ms: float | None
    #: resident experts of the routed placement, all layers (0 when it does not fit)
    num_resident: int


@dataclass(frozen=True, kw_only=True)
class ExpertsPlan:
    """MoE plans only: per MoE layer, routed experts against whole layers, and how the regime was chosen."""

    #: "routed", "whole_layer" or "mixed" (a summary of the layers)
    regime: str
    #: "uniform" or "trace sha256:<hex of the trace file's bytes>"
    routing: str
    #: experts the decode gather buffer holds: min(concurrency x top_k, num_experts) (0 without routed layers)
    fetch_slots: int
    #: one row per MoE layer
    layers: tuple[ExpertLayer, ...]
    num_experts: int
    top_k: int
    #: one routed expert (the largest layer's)
    expert_bytes: int
    #: fetch_slots x expert_bytes, on the GPU (counted in memory.gpu_bytes)
    fetch_buffer_bytes: int
    #: num_experts x expert_bytes, where prefill chunks copy a routed layer's experts (0 without routed layers)
    staging_buffer_bytes: int
    #: the routed gather's rate: hardware.h2d_bytes_per_s x planner.experts.ROUTED_FETCH_EFFICIENCY
    routed_fetch_bytes_per_s: float
    #: why no layer may be routed (an architecture the runtime cannot route-fetch, pinned knobs); None: it may
    routed_unavailable: str | None
    #: the regimes compared, ascending concurrency
    points: tuple[ExpertsPoint, ...]
    #: routed plans only: "next_layer_router" where each routed layer prefetches the next one's predicted experts
    #: (two slot sets in fetch_buffer_bytes), None where routed layers fetch after their router
    prefetch: str | None = None
    #: routed plans only: the prediction accuracy the step was modelled with (--prefetch-accuracy, else the
    #: planner's measured figure), whether or not prefetch was chosen
    prefetch_accuracy: float | None = None

    def __post_init__(self):
        if self.prefetch not in EXPERT_PREFETCH:
            raise ValueError(f"experts.prefetch {self.prefetch!r} is not null or {EXPERT_PREFETCH[1]}")
        if self.prefetch_accuracy is not None and not 0 <= self.prefetch_accuracy <= 1:
            raise ValueError("experts.prefetch_accuracy must be a share in [0, 1]")
        if self.prefetch is not None and self.prefetch_accuracy is None:
            raise ValueError("experts.prefetch needs its prefetch_accuracy")
        if self.regime not in EXPERT_REGIMES:
            raise ValueError(f"experts.regime {self.regime!r} is not one of {', '.join(EXPERT_REGIMES)}")
        regimes = {row.regime for row in self.layers}
        if self.layers and self.regime != (regimes.pop() if len(regimes) == 1 else "mixed"):
            raise ValueError("experts.regime must summarise its layers' regimes")
        if [row.index for row in self.layers] != sorted({row.index for row in self.layers}):
            raise ValueError("experts.layers must have distinct indices, ascending")
        if not self.routing == "uniform" and not self.routing.startswith("trace sha256:"):
            raise ValueError("experts.routing must be uniform or trace sha256:<hex>")
        if any(e >= self.num_experts for row in self.layers for e in row.resident):
            raise ValueError("experts.layers resident ids must be below num_experts")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A whole plan file."""

    schema_version: int
    inputs: Inputs
    model: ModelSection
    hardware: HardwareSection
    workload: WorkloadSection
    offload: OffloadSection
    memory: MemorySection
    prediction: PredictionSection
    layers: tuple[LayerRow, ...]
    #: serving plans only (make --concurrency): the concurrency search
    serving: ServingSection | None = None
    #: plans with adapters only (make --adapter): their slots and waits
    adapters: AdaptersSection | None = None
    #: MoE plans only: routed experts against whole layers (planner.experts)
    experts: ExpertsPlan | None = None

    def __post_init__(self):
        if any(not 0 <= row.offloaded_bytes <= row.selected_bytes <= row.bytes for row in self.layers):
            raise ValueError("every layer row needs 0 <= offloaded_bytes <= selected_bytes <= bytes")
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"schema_version must be {SCHEMA_VERSION}")
        if len(self.layers) != self.model.num_layers:
            raise ValueError("layers must have one row per planned layer")
        if any(i >= self.model.num_layers for i in self.offload.layers):
            raise ValueError("offload.layers names a layer beyond model.num_layers")
        if self.offload.replay_start_copies and not self.workload.cuda_graph:
            raise ValueError("offload.replay_start_copies applies to CUDA-graph plans (workload.cuda_graph) only")
        if self.offload.layers and not 1 <= self.offload.num_in_group <= self.offload.group_size:
            raise ValueError("offload.num_in_group must be between 1 and group_size when layers are offloaded")
        if bool(self.inputs.adapters) != (self.adapters is not None):
            raise ValueError("inputs.adapters and the adapters section come together")
        if self.adapters is not None and len(self.adapters.items) != len(self.inputs.adapters):
            raise ValueError("the adapters section needs one item per inputs.adapters entry")
        if self.experts is not None:
            routed = {row.index for row in self.experts.layers if row.regime == "routed"}
            if routed & set(self.offload.layers):
                raise ValueError("a routed MoE layer (experts.layers) must not be in offload.layers")
            if any(row.index >= self.model.num_layers for row in self.experts.layers):
                raise ValueError("experts.layers names a layer beyond model.num_layers")


#: Inputs keys a plan holds only when they are given (their defaults otherwise)
OPTIONAL_INPUTS = {"adapters": (), "adapter_slots": None, "routing_trace": None, "prefetch_accuracy": None,
                   "tp": 1, "engine": None}
#: experts keys written only where the plan routes layers (whole-layer MoE plans keep their bytes)
OPTIONAL_EXPERTS = {"prefetch": None, "prefetch_accuracy": None}
#: top-level sections a plan holds only when they apply
OPTIONAL_SECTIONS = ("serving", "adapters", "experts")

SECTIONS = {
    "inputs": Inputs,
    "model": ModelSection,
    "hardware": HardwareSection,
    "workload": WorkloadSection,
    "offload": OffloadSection,
    "memory": MemorySection,
    "prediction": PredictionSection,
}


# ---- writing ------------------------------------------------------------------------------------------------


class _FlowRow(dict):
    """A mapping dumped on one line: per-layer rows, so a moved layer is a one-line diff."""


class _Dumper(yaml.SafeDumper):
    pass


def _represent_flow_row(dumper, data):
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=True)


def _represent_flow_list(dumper, data):
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


class _FlowList(list):
    """A short list of scalars dumped on one line (layer indices, params)."""


_Dumper.add_representer(_FlowRow, _represent_flow_row)
_Dumper.add_representer(_FlowList, _represent_flow_list)


def _rounded(value: Any, decimals: int) -> Any:
    return round(value, decimals) if isinstance(value, float) else value


def plan_to_dict(plan: Plan) -> dict:
    """The plan as plain data in schema key order (also what ``show --json`` prints)."""
    out: dict = {"schema_version": plan.schema_version}
    for name in SECTIONS:
        section = asdict(getattr(plan, name))
        out[name] = {key: _plain(value) for key, value in section.items()}
    # written only when given, so plans without adapters keep their bytes
    for key in OPTIONAL_INPUTS:
        if out["inputs"][key] == _plain(OPTIONAL_INPUTS[key]):
            del out["inputs"][key]
    out["layers"] = [{key: _plain(value) for key, value in asdict(row).items()} for row in plan.layers]
    if plan.serving is not None:
        out["serving"] = {key: _plain(value) for key, value in asdict(plan.serving).items() if key != "points"}
        out["serving"]["points"] = [{key: _plain(value) for key, value in asdict(row).items()}
                                    for row in plan.serving.points]
    if plan.adapters is not None:
        out["adapters"] = {key: _plain(value) for key, value in asdict(plan.adapters).items() if key != "items"}
        out["adapters"]["items"] = [{key: _plain(value) for key, value in asdict(row).items()}
                                    for row in plan.adapters.items]
    if plan.experts is not None:
        rows = {"layers", "points"}
        out["experts"] = {key: _plain(value) for key, value in asdict(plan.experts).items() if key not in rows
                          and not (key in OPTIONAL_EXPERTS and plan.experts.fetch_slots == 0)}
        for name in sorted(rows):
            out["experts"][name] = [{key: _plain(value) for key, value in asdict(row).items()}
                                    for row in getattr(plan.experts, name)]
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float):
        return round(value, MS_DECIMALS) if abs(value) < 1e6 else value
    return value


def render_plan(plan: Plan, command: str) -> str:
    """The plan's file text: header comment with the regenerating command, then block-style YAML."""
    data = plan_to_dict(plan)
    for name in ("inputs", "offload", "model"):
        for key, value in data[name].items():
            if isinstance(value, list):
                data[name][key] = _FlowList(value)
    data["layers"] = [_FlowRow(row) for row in data["layers"]]
    if "serving" in data:
        data["serving"]["points"] = [_FlowRow(row) for row in data["serving"]["points"]]
    if "adapters" in data:
        data["adapters"]["items"] = [_FlowRow(row) for row in data["adapters"]["items"]]
    if "experts" in data:
        for name in ("layers", "points"):
            data["experts"][name] = [_FlowRow({key: _FlowList(value) if isinstance(value, list) else value
                                               for key, value in row.items()}) for row in data["experts"][name]]
    body = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120, allow_unicode=False)
    header = (
        "# Offload plan written by offload-plan. Do not edit by hand; regenerate with:\n"
        f"#   {command}\n"
    )
    return header + body


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never a partial file.

    Every problem with the destination (a folder, a missing or unwritable folder, a full disk) is one PlanError
    line, and the file that was there before is left as it was.
    """
    path = checked_path(path, PlanError, "output")
    directory = path.parent if str(path.parent) else Path(".")
    shown = printable(path)
    if path.is_dir():
        raise PlanError(f"{shown} is a folder; give a file name for the plan, e.g. {printable(path / 'plan.yaml')}")
    if not directory.is_dir():
        what = "is not a folder" if directory.exists() else "does not exist"
        raise PlanError(f"output folder {printable(directory)} {what}; create it first or choose another path")
    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as error:
        raise PlanError(f"cannot write in {printable(directory)} ({error.strerror}); check its permissions or choose "
                        "another path") from None
    try:
        with os.fdopen(handle, "w") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException as error:
        Path(temporary).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise PlanError(f"cannot write {shown} ({error.strerror}); check the path, its permissions and free "
                            "space") from None
        raise


# ---- reading ------------------------------------------------------------------------------------------------


def read_plan(path: Path) -> Plan:
    """Load and validate a plan file; any problem is a one-line PlanError naming the field."""
    path = Path(path)
    raw = read_capped(path, MAX_PLAN_BYTES, PlanError, "plan")
    data = load_yaml(raw, str(path), PlanError, fix="regenerate it with make")
    return plan_from_dict(data, str(path))


#: keys schema 1 plans may lack (added while it was current, with these values before them)
_SCHEMA_1_DEFAULTS = {
    "inputs": {"measure": False, "measured_on": None, "cuda_graph": False, "host_memory": None, "concurrency": None,
               "chunk": 2048, "kv_dtype": "auto", "max_tpot_ms": None, "gpu_memory": None},
    "hardware": {"host_memory_bytes": None, "cuda_context_bytes": None},
    "workload": {"cuda_graph": False, "kv_dtype": "bf16"},
    "offload": {"replay_start_copies": 0},
    # schema 1 planned the weights alone: the rest of the GPU is not known
    "memory": {"kv_cache_bytes": None, "activation_bytes": None, "cuda_graph_pool_bytes": 0, "cuda_context_bytes": 0,
               "total_gpu_bytes": None},
    "prediction": {"decode_step_ms": None, "decode_tokens_per_s": None, "prefill_chunk_ms": None},
}


def _schema_1_derived(data: dict) -> dict:
    """Schema 2 fields whose schema 1 value follows from others: section -> key -> value."""
    workload, hardware = data.get("workload"), data.get("hardware")
    if not isinstance(workload, dict) or not isinstance(hardware, dict):
        return {}
    return {"workload": {"concurrency": workload.get("sequences_per_step"),
                         "chunk_tokens": workload.get("tokens_per_step")},
            "memory": {"gpu_memory_bytes": hardware.get("gpu_memory_bytes")}}


def plan_from_dict(data: object, origin: str) -> Plan:
    """Build a Plan from parsed YAML; a schema 1 plan is upgraded to the current schema first."""
    if not isinstance(data, dict):
        raise PlanError(f"{origin}: not a plan (expected a mapping); regenerate it with offload-plan make")
    expected = {"schema_version", "layers", *SECTIONS}
    if set(data) - set(OPTIONAL_SECTIONS) != expected:
        problems = sorted((set(data) - set(OPTIONAL_SECTIONS)) ^ expected, key=str)  # YAML keys may be numbers too
        raise PlanError(f"{origin}: plan keys differ from schema {SCHEMA_VERSION} at {shown(problems, 120)}; "
                        "regenerate it")
    version = data["schema_version"]
    if type(version) is not int or version not in READABLE_SCHEMA_VERSIONS:  # 1.0 and true are not 1
        raise PlanError(f"{origin}: schema_version {shown(version)} is not one of "
                        f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}; regenerate it with this offload-plan")
    if version == 1:
        data = _upgraded_from_1(data, origin)
    kwargs: dict = {"schema_version": SCHEMA_VERSION}
    if isinstance(data["inputs"], dict):
        data = dict(data, inputs={**{key: list(value) if isinstance(value, tuple) else value
                                     for key, value in OPTIONAL_INPUTS.items()}, **data["inputs"]})
    for name, cls in SECTIONS.items():
        kwargs[name] = _section(cls, data[name], f"{origin}: {name}")
    rows = data["layers"]
    if not isinstance(rows, list):
        raise PlanError(f"{origin}: layers must be a list of rows; regenerate the plan")
    kwargs["layers"] = tuple(_section(LayerRow, row, f"{origin}: layers[{i}]") for i, row in enumerate(rows))
    if data.get("serving") is not None:
        kwargs["serving"] = _serving_section(data["serving"], f"{origin}: serving")
    if data.get("adapters") is not None:
        kwargs["adapters"] = _adapters_section(data["adapters"], f"{origin}: adapters")
    if data.get("experts") is not None:
        experts = data["experts"]
        if isinstance(experts, dict):
            experts = {**OPTIONAL_EXPERTS, **experts}
        kwargs["experts"] = _section(ExpertsPlan, experts, f"{origin}: experts",
                                     rows={"layers": ExpertLayer, "points": ExpertsPoint})
    misplaced = [i for i, row in enumerate(kwargs["layers"]) if row.index != i]
    if misplaced:
        raise PlanError(f"{origin}: layers[{misplaced[0]}] has index {kwargs['layers'][misplaced[0]].index}; rows must "
                        "be numbered 0, 1, 2, ... in order: regenerate the plan")
    try:
        plan = Plan(**kwargs)
    except ValueError as error:
        raise PlanError(f"{origin}: {error}; regenerate the plan") from None
    broken = first_broken_rule(plan)
    if broken is not None:
        raise PlanError(f"{origin}: {broken}; a plan make could not have written: regenerate it with make")
    return plan


# ---- whole-plan rules ---------------------------------------------------------------------------------------
# Each field's type and range is checked as it is read; these are the rules across fields that make follows
# when it writes a plan, with make's own bounds (planner.bounds). Each returns the first broken rule as
# "field value: why", or None.


def first_broken_rule(plan: Plan) -> str | None:
    """The first rule across fields that ``plan`` breaks ("field value: why"), None when it keeps them all."""
    for rules in (_input_rules, _workload_rules, _memory_rules, _serving_rules, _adapter_rules):
        broken = rules(plan)
        if broken is not None:
            return broken
    return None


def _outside(key: str, field_name: str, value: int) -> str | None:
    from planner.bounds import BOUNDS

    low, high = BOUNDS[key]
    return None if low <= value <= high else f"{field_name} {value} is outside {low}..{high}"


def _input_rules(plan: Plan) -> str | None:
    """inputs: every flag within the bounds make checks it against."""
    from planner.bounds import INPUT_KV_DTYPES, MAX_TPOT_MS

    inputs = plan.inputs
    for key in ("tokens", "sequences", "context", "chunk", "group_size", "num_in_group", "prefetch_step",
                "adapter_slots"):
        value = getattr(inputs, key)
        broken = None if value is None else _outside(key, f"inputs.{key}", value)
        if broken:
            return broken
    if inputs.kv_dtype not in INPUT_KV_DTYPES:
        return f"inputs.kv_dtype {shown(inputs.kv_dtype)} is not one of {', '.join(INPUT_KV_DTYPES)}"
    if inputs.prefetch_accuracy is not None and not 0 <= inputs.prefetch_accuracy <= 1:
        return f"inputs.prefetch_accuracy {inputs.prefetch_accuracy:g} is not a share from 0 to 1"
    if inputs.max_tpot_ms is not None and not 0 < inputs.max_tpot_ms <= MAX_TPOT_MS:
        return f"inputs.max_tpot_ms {inputs.max_tpot_ms:g} is not in (0, {MAX_TPOT_MS:g}]"
    if (inputs.concurrency is None) != (plan.serving is None):
        return "inputs.concurrency and the serving section come together"
    if not 1 <= inputs.tp <= 1024:
        return f"inputs.tp {inputs.tp} is not a number of GPUs from 1 to 1024"
    return None


def _workload_rules(plan: Plan) -> str | None:
    """workload: the step make planned from the inputs (a serving plan: a decode step of its concurrency)."""
    from planner.bounds import PLAN_KV_DTYPES

    workload, inputs = plan.workload, plan.inputs
    for key, field_name in (("tokens", "tokens_per_step"), ("sequences", "sequences_per_step"),
                            ("context", "context_tokens"), ("chunk", "chunk_tokens"), ("sequences", "concurrency")):
        broken = _outside(key, f"workload.{field_name}", getattr(workload, field_name))
        if broken:
            return broken
    if workload.concurrency != workload.sequences_per_step:
        return f"workload.concurrency {workload.concurrency} differs from sequences_per_step"
    if workload.kv_dtype not in PLAN_KV_DTYPES:
        return f"workload.kv_dtype {shown(workload.kv_dtype)} is not one of {', '.join(PLAN_KV_DTYPES)}"
    if inputs.kv_dtype != "auto" and workload.kv_dtype != inputs.kv_dtype:
        return f"workload.kv_dtype {workload.kv_dtype} differs from inputs.kv_dtype {inputs.kv_dtype}"
    if workload.context_tokens != inputs.context:
        return f"workload.context_tokens {workload.context_tokens} differs from inputs.context {inputs.context}"
    if plan.serving is None and workload.chunk_tokens != workload.tokens_per_step:
        return f"workload.chunk_tokens {workload.chunk_tokens} differs from tokens_per_step (not a serving plan)"
    return None


def _memory_rules(plan: Plan) -> str | None:
    """memory and prediction: the figures make computes together are there together."""
    memory, prediction = plan.memory, plan.prediction
    whole_gpu = (memory.kv_cache_bytes, memory.activation_bytes, memory.total_gpu_bytes)
    if len({value is None for value in whole_gpu}) > 1:
        return "memory.kv_cache_bytes, activation_bytes and total_gpu_bytes are all null or all numbers"
    if memory.gpu_bytes > memory.budget_bytes:
        return f"memory.gpu_bytes {memory.gpu_bytes} exceeds budget_bytes {memory.budget_bytes}"
    if (prediction.decode_step_ms is None) != (prediction.decode_tokens_per_s is None):
        return "prediction.decode_step_ms and decode_tokens_per_s are both null or both numbers"
    if plan.serving is not None:
        needed = {"memory.kv_cache_bytes": memory.kv_cache_bytes, "prediction.decode_step_ms":
                  prediction.decode_step_ms, "prediction.prefill_chunk_ms": prediction.prefill_chunk_ms}
        missing = [name for name, value in needed.items() if value is None]
        if missing:
            return f"{missing[0]} is null in a serving plan"
    return None


def _serving_rules(plan: Plan) -> str | None:
    """serving: the range --concurrency asked for, the chosen concurrency inside it, rows make can write."""
    from planner.serving import parse_concurrency

    serving, workload = plan.serving, plan.workload
    if serving is None:
        return None
    try:
        wanted = parse_concurrency(plan.inputs.concurrency)
    except ValueError:
        return f"inputs.concurrency {shown(plan.inputs.concurrency)} is not a concurrency make accepts"
    if (serving.concurrency_low, serving.concurrency_high) != (wanted.low, wanted.high):
        return (f"serving.concurrency_low..high {serving.concurrency_low}..{serving.concurrency_high} is not "
                f"inputs.concurrency's {wanted.low}..{wanted.high}")
    if not serving.concurrency_low <= workload.concurrency <= serving.concurrency_high:
        return f"workload.concurrency {workload.concurrency} is outside serving's {wanted.low}..{wanted.high}"
    if workload.tokens_per_step != workload.sequences_per_step:
        return "workload.tokens_per_step differs from sequences_per_step in a serving plan (a decode step)"
    if workload.context_tokens < 1:
        return "workload.context_tokens 0: a serving plan serves sequences of --context tokens, at least 1"
    if workload.chunk_tokens != plan.inputs.chunk:
        return f"workload.chunk_tokens {workload.chunk_tokens} differs from inputs.chunk {plan.inputs.chunk}"
    if serving.max_tpot_ms != plan.inputs.max_tpot_ms:
        return f"serving.max_tpot_ms {serving.max_tpot_ms} differs from inputs.max_tpot_ms {plan.inputs.max_tpot_ms}"
    alternative = (serving.no_offload_concurrency, serving.no_offload_step_ms, serving.no_offload_tokens_per_s)
    if len({value is None for value in alternative}) > 1:
        return "serving.no_offload_concurrency, _step_ms and _tokens_per_s are all null or all numbers"
    if serving.no_offload_concurrency is not None and not wanted.low <= serving.no_offload_concurrency <= wanted.high:
        return f"serving.no_offload_concurrency {serving.no_offload_concurrency} is outside {wanted.low}..{wanted.high}"
    return _serving_row_rules(plan)


def _serving_row_rules(plan: Plan) -> str | None:
    serving = plan.serving
    concurrencies = [row.concurrency for row in serving.points]
    if not concurrencies or concurrencies != sorted(set(concurrencies)):
        return "serving.points must be rows of distinct concurrencies, ascending"
    for i, row in enumerate(serving.points):
        where = f"serving.points[{i}]"
        if not serving.concurrency_low <= row.concurrency <= serving.concurrency_high:
            return f"{where}.concurrency {row.concurrency} is outside the serving range"
        if not NOTHING_FITS <= row.num_offloaded <= plan.model.num_layers:
            return f"{where}.num_offloaded {row.num_offloaded} is not from -1 to the {plan.model.num_layers} layers"
        nothing = row.num_offloaded == NOTHING_FITS
        if nothing != (row.step_ms is None):
            return f"{where}.step_ms is null exactly where num_offloaded is -1 (nothing fits)"
        if nothing and (row.group_size, row.num_in_group, row.prefetch_step, row.weights_gpu_bytes) != (0, 0, 0, 0):
            return f"{where}: a row where nothing fits has no placement (group_size ... weights_gpu_bytes 0)"
    return None


def _adapter_rules(plan: Plan) -> str | None:
    """adapters: names as make accepts them, matching inputs.adapters; ranks, slots and pool as make sizes them."""
    from planner.adapters import parse_adapter_option
    from planner.errors import UsageError

    section = plan.adapters
    if section is None:
        return None
    given = {}
    for option in plan.inputs.adapters:
        try:
            name, source = parse_adapter_option(option)
        except UsageError:
            return f"inputs.adapters entry {shown(option)} is not NAME=PATH as make accepts it"
        given[name] = source
    if len(given) != len(plan.inputs.adapters):
        return "inputs.adapters names an adapter twice"
    for i, row in enumerate(section.items):
        if given.get(row.name) != row.source:
            return f"adapters.items[{i}] {shown(row.name)}={shown(row.source)} is not in inputs.adapters"
        broken = _outside("rank", f"adapters.items[{i}].rank", row.rank)
        if broken:
            return broken
        if not 0 < row.alpha:
            return f"adapters.items[{i}].alpha {row.alpha} must be above 0"
    return _adapter_pool_rules(plan)


def _adapter_pool_rules(plan: Plan) -> str | None:
    section, items = plan.adapters, plan.adapters.items
    largest_rank, largest_bytes = max(row.rank for row in items), max(row.bytes for row in items)
    if section.max_rank != largest_rank:
        return f"adapters.max_rank {section.max_rank} is not the largest adapter's rank {largest_rank}"
    if not 1 <= section.num_slots <= len(items):
        return f"adapters.num_slots {section.num_slots} is not from 1 to the {len(items)} adapter(s)"
    if plan.inputs.adapter_slots is not None and section.num_slots != plan.inputs.adapter_slots:
        return f"adapters.num_slots {section.num_slots} differs from inputs.adapter_slots {plan.inputs.adapter_slots}"
    if section.slot_bytes != largest_bytes:
        return f"adapters.slot_bytes {section.slot_bytes} is not the largest adapter's {largest_bytes} bytes"
    if section.host_pinned_bytes != sum(row.bytes for row in items):
        return f"adapters.host_pinned_bytes {section.host_pinned_bytes} is not the sum of the adapters' bytes"
    if section.num_missing > section.num_slots:
        return f"adapters.num_missing {section.num_missing} exceeds num_slots {section.num_slots}"
    return _adapter_mode_rules(section)


def _adapter_mode_rules(section: AdaptersSection) -> str | None:
    """The chosen mode is one of the two and the faster of the recorded totals, by the recorded margin."""
    totals = {"blocking": section.blocking_stream_ms, "pipelined": section.pipelined_stream_ms}
    if section.mode not in totals:
        return f"adapters.mode {shown(section.mode)} must be blocking or pipelined"
    chosen = totals[section.mode]
    other = totals["pipelined" if section.mode == "blocking" else "blocking"]
    if chosen > other:
        return f"adapters.mode {section.mode} is not the mode of the lower stream total; regenerate the plan"
    if chosen > 0 and abs(other / chosen - 1.0 - section.mode_margin) > 1e-3:
        return f"adapters.mode_margin {section.mode_margin} does not follow from the stream totals"
    return None


def _serving_section(raw: object, origin: str) -> ServingSection:
    """The serving section: flat fields, and its points as rows."""
    return _section(ServingSection, raw, origin, rows={"points": ServingRow})


def _adapters_section(raw: object, origin: str) -> AdaptersSection:
    """The adapters section: flat fields, and its items as rows."""
    return _section(AdaptersSection, raw, origin, rows={"items": AdapterRow})


_TYPES = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}
_BASES = (bool, int, float, str)


def _upgraded_from_1(data: dict, origin: str) -> dict:
    """A schema 1 plan in schema 2's terms: keys added during schema 1 take their earlier values, and each layer
    row's selected_bytes is what its copy_ms implies (schema 1 kept only that rounded time)."""
    upgraded = dict(data, schema_version=SCHEMA_VERSION)
    derived = _schema_1_derived(data)
    for name, defaults in _SCHEMA_1_DEFAULTS.items():
        if isinstance(data[name], dict):
            upgraded[name] = {**defaults, **derived.get(name, {}), **data[name]}
    hardware, offload = upgraded["hardware"], upgraded["offload"]
    if not isinstance(data["layers"], list) or not isinstance(hardware, dict) or not isinstance(offload, dict):
        return upgraded  # the strict reader names what is wrong
    try:
        rows = [dict(row, selected_bytes=_selected_bytes_of_1(row, hardware, bool(offload.get("params"))))
                for row in data["layers"]]
    except (TypeError, ValueError, KeyError) as error:
        raise PlanError(f"{origin}: a schema 1 layer row cannot be read ({error}); regenerate the plan") from None
    return dict(upgraded, layers=rows)


def _selected_bytes_of_1(row: dict, hardware: dict, by_params: bool) -> int:
    if row["offloaded_bytes"] or not by_params:
        return row["offloaded_bytes"] or row["bytes"]
    link_ms = row["copy_ms"] - hardware["copy_overhead_us"] / 1e3
    return min(row["bytes"], max(0, round(link_ms * hardware["h2d_bytes_per_s"] / 1e3)))


def _section(cls, raw: object, origin: str, rows: dict[str, type] | None = None):
    """One section (or row) checked against its dataclass; ``rows``: fields that hold a list of rows of a class."""
    if not isinstance(raw, dict):
        raise PlanError(f"{origin} must be a mapping; regenerate the plan")
    names = [f.name for f in fields(cls)]
    if set(raw) != set(names):
        wrong = sorted(set(raw) ^ set(names), key=str)
        raise PlanError(f"{origin}: keys {shown(wrong, 120)} differ from the schema; regenerate the plan")
    values = {}
    for f in fields(cls):
        if rows and f.name in rows:
            values[f.name] = _rows(rows[f.name], raw[f.name], f"{origin}.{f.name}")
        else:
            values[f.name] = _check_type(raw[f.name], f.type, f"{origin}.{f.name}", f.metadata.get("lowest", 0))
    try:
        return cls(**values)
    except ValueError as error:
        raise PlanError(f"{origin}: {error}; regenerate the plan") from None


def _rows(cls, raw: object, origin: str) -> tuple:
    if not isinstance(raw, list):
        raise PlanError(f"{origin} must be a list of rows; regenerate the plan")
    return tuple(_section(cls, row, f"{origin}[{i}]") for i, row in enumerate(raw))


def _check_type(value: Any, annotation: Any, origin: str, lowest: int = 0) -> Any:
    """Check one field against its annotation (int, float, str, optional, tuples and str->int dicts)."""
    text = str(annotation)
    if value is None:
        if "None" in text:
            return None
        raise PlanError(f"{origin} must not be null; regenerate the plan")
    if text.startswith("tuple"):
        inner = int if "int" in text else str
        if not isinstance(value, list) or not all(_is(v, inner) for v in value):
            raise PlanError(f"{origin} must be a list of {inner.__name__}; regenerate the plan")
        if inner is int and not all(_plausible(v) for v in value):
            raise PlanError(f"{origin} must hold whole numbers from 0 to {MAX_PLAN_INT}; regenerate the plan")
        return tuple(value)
    if text.startswith("dict"):
        if not isinstance(value, dict) or not all(isinstance(k, str) and _is(v, int) and _plausible(v)
                                                  for k, v in value.items()):
            raise PlanError(f"{origin} must be a mapping of names to whole numbers; regenerate the plan")
        return value
    first = text.split("|")[0].strip()
    base = next(t for t in _BASES if t is annotation or first in (t.__name__, f"<class '{t.__name__}'>"))
    if base is bool:
        if not isinstance(value, bool):
            raise PlanError(f"{origin} must be true or false, got {shown(value)}; regenerate the plan")
        return value
    if not _is(value, base):
        raise PlanError(f"{origin} must be {base.__name__}, got {shown(value)}; regenerate the plan")
    if base in (int, float) and not _plausible(value, lowest):
        raise PlanError(f"{origin} is {value!r}; plan numbers are finite, not negative and below "
                        f"{MAX_PLAN_INT if base is int else MAX_PLAN_FLOAT:g}: regenerate the plan")
    return float(value) if base is float else value


def _plausible(value: int | float, lowest: int = 0) -> bool:
    limit = MAX_PLAN_INT if isinstance(value, int) else MAX_PLAN_FLOAT
    return lowest <= value <= limit  # False for NaN too


def _is(value: Any, kind: type) -> bool:
    return not isinstance(value, bool) and isinstance(value, _TYPES[kind])
