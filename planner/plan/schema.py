"""The plan's schema: a frozen dataclass tree, one class per section, each field with its meaning.

The experts section (and the experts vocabulary) is planner.plan.experts_section, the adapters section
planner.plan.adapters_section. Reading and writing the file is planner.plan.file; the rules across fields a plan
must keep, planner.plan.rules; reading schema 1 plans, planner.plan.migration.
"""

from dataclasses import dataclass, field

from planner.model.cost import is_decode_step
from planner.model.activations import decode_copies_pairs
from planner.model.experts import decode_gathers
from planner.plan.adapters_section import AdaptersSection
from planner.plan.experts_section import ExpertLayer, ExpertsPlan
from planner.source.profile import FIGURE_MAX, FIGURE_MIN
from planner.units import SIZE_HELP


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
    prefetch_depth: int | None = field(default=None, metadata=option(
        "--prefetch-depth", "MoE, routed experts: prefetch the top N ranks of each token's predicted experts, "
                            "from 0 (no prefetch) to the router's top-k (default: the depth predicted fastest)."))
    tp: int = field(default=1, metadata=option(
        "--tp", "Tensor-parallel GPUs: plan one rank of N as vLLM shards the model, all-reduces at the profile's "
                "GPU link; 2,4 compares GPU counts (one plan per N, -o PATH written as PATH.tpN.yaml)."))
    engine: str | None = field(default=None, metadata=option(
        "--for", "Plan within what this engine expresses, vllm or sglang (whole layers, no routed experts; "
                 "SGLang: P divides the offloaded layers), so export gives exactly this plan."))
    cpu_experts: str = field(default="auto", metadata=option(
        "--cpu-experts", "MoE, routed experts, decode: auto (compute some non-resident experts on the host CPU where "
                         "the profile measured its rate and that step is faster; each step's misses split by their "
                         "count where that waits less), rows (as auto, and one expert split by its rows between the "
                         "CPU and the link where that waits less still; experimental: docs/limitations.md), fixed "
                         "(the CPU's experts fixed ids) or off (fetch every miss)."))
    cpu_time_scale: float | None = field(default=None, metadata=option(
        "--cpu-time-scale", "MoE, CPU experts: price each expert the host CPU computes at this many times the "
                            "profile's rate inside the step, e.g. 1.7 where run --bench counted this host's CPU that "
                            "much slower than the plan's price (default: 1)."))
    routed_experts: str = field(default="auto", metadata=option(
        "--routed-experts", "MoE: auto (fetch only a step's routed, non-resident experts where that is faster "
                            "than streaming whole layers) or off (every MoE layer resident or streamed whole, as "
                            "the engines offload)."))


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
    #: NCCL's buffers on a tensor-parallel rank, measured (calibrate's profile, make --tp N --measure); None: the
    #: planner's figure. Written only when measured
    nccl_bytes: int | None = None

    def __post_init__(self):
        # The same rules as planner.source.profile.HardwareProfile, from its tables: a plan read back must not divide by
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
    #: steps are CUDA-graph replays of planner.search.simulate.STEPS_PER_GRAPH steps (one): copies that wrap past a
    #: replay's last step finish inside it
    cuda_graph: bool = False
    #: sequences decoded together: a serving plan's chosen concurrency, else sequences_per_step
    concurrency: int = 1
    #: tokens of one prefill chunk: a serving plan's --chunk, else tokens_per_step
    chunk_tokens: int = 2048
    #: KV cache element type (bf16, fp16, fp8, fp32)
    kv_dtype: str = "bf16"
    #: a serving plan's prefill chunk is replayed from a CUDA graph (planner.make.model_record.Model.chunk_graphed),
    #: and predicted so; written only when true
    chunk_graphed: bool = False

    def __post_init__(self):
        if self.chunk_graphed and not self.cuda_graph:
            raise ValueError("workload.chunk_graphed needs workload.cuda_graph: a plan with eager steps replays no "
                             "chunk; regenerate the plan with make")
        if self.tokens_per_step < 1 or self.sequences_per_step < 1 or self.tokens_per_step % self.sequences_per_step:
            raise ValueError("workload.tokens_per_step must be a positive multiple of sequences_per_step (>= 1)")


#: OffloadSection.mechanism's values
OFFLOAD_MECHANISMS = ("prefetch", "read_at_use")


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
    #: how the engine moves the offloaded bytes (OFFLOAD_MECHANISMS; written only where not "prefetch"):
    #: "prefetch", copies P layers ahead into slots; "read_at_use", SGLang's --cpu-offload-gb (OffloaderV1): the
    #: first read_at_use_gib GiB of layer params, layer 0 onward, each layer's copied inside its forward
    mechanism: str = "prefetch"
    #: read_at_use: the engine's limit in GiB (--cpu-offload-gb); 0 for prefetch
    read_at_use_gib: int = 0

    def __post_init__(self):
        if list(self.layers) != sorted(set(self.layers)):
            raise ValueError("offload.layers must be ascending and distinct")
        if self.mechanism not in OFFLOAD_MECHANISMS:
            raise ValueError(f"offload.mechanism must be one of {', '.join(OFFLOAD_MECHANISMS)}")
        if self.read_at_use_gib and self.mechanism != "read_at_use":
            raise ValueError("offload.read_at_use_gib applies to mechanism read_at_use only")
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
    #: alignment pads and allocator rounding of the runtime's one GPU allocation (planner.model.placement)
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
    #: estimated from the shapes, or measured on the local GPU for a serving plan made with --measure, with the
    #: runtime's workspaces and the allocator's rounding (planner.search.serving.RUNTIME_ALLOCATOR_BYTES)
    activation_bytes: int | None = None
    #: a captured decode step's intermediates, held by its CUDA graph's pool (0 when not graphed)
    cuda_graph_pool_bytes: int = 0
    #: held outside torch's allocator: the CUDA context and loaded kernels (measured where the plan says so), the
    #: driver's page tables of page-locked host memory, NCCL's buffers on a TP rank
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
    #: MoE plans only: routed experts against whole layers (planner.model.experts)
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
            routed = {row.index for row in self.experts.routed_layers}
            if routed & set(self.offload.layers):
                raise ValueError("a routed MoE layer (experts.layers) must not be in offload.layers")
            if any(row.index >= self.model.num_layers for row in self.experts.layers):
                raise ValueError("experts.layers names a layer beyond model.num_layers")


#: Inputs keys a plan holds only when they are given (their defaults otherwise)
OPTIONAL_INPUTS = {"adapters": (), "adapter_slots": None, "routing_trace": None, "prefetch_accuracy": None,
                   "prefetch_depth": None,
                   "tp": 1, "engine": None, "cpu_experts": "auto", "cpu_time_scale": None, "routed_experts": "auto"}


#: offload keys written only where not these (plans for the prefetch offloader keep their bytes)
OPTIONAL_OFFLOAD = {"mechanism": "prefetch", "read_at_use_gib": 0}
#: workload keys written only when not their default, so plans made before them keep their bytes
OPTIONAL_WORKLOAD = {"chunk_graphed": False}
#: hardware keys written only when not their default (plans made before them, or without them, keep their bytes)
OPTIONAL_HARDWARE = {"nccl_bytes": None}


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


# ---- figures the plan's rows give (planner.plan.rules holds the stored ones to them; show prints them) ----


def copies_pairs(plan: Plan) -> bool:
    """Whether the plan's routed decode steps copy every pair's weights (planner.model.activations.
    decode_copies_pairs), by the experts' dtype as make read it (experts.expert_dtype), or in plans made before
    it, the dtype holding most of the checkpoint's bytes (a routed model's usually its experts')."""
    dtype = plan.experts.expert_dtype if plan.experts is not None else None
    if dtype is None and plan.model.dtype_bytes:
        dtype = max(plan.model.dtype_bytes, key=plan.model.dtype_bytes.get)
    return decode_copies_pairs(dtype) if dtype else True


def gathers(plan: Plan) -> bool:
    """Whether the plan's routed layers gather their step's experts: a decode step of at most num_experts pairs
    (planner.model.experts.decode_gathers); otherwise each step stages every expert of a routed layer whole."""
    experts = plan.experts
    return is_decode_step(plan.workload) and experts is not None and decode_gathers(
        plan.workload.tokens_per_step, experts.top_k, experts.num_experts)


def routed_rows(plan: Plan) -> dict:
    """index -> experts.layers row of every routed MoE layer."""
    if plan.experts is None:
        return {}
    return {row.index: row for row in plan.experts.routed_layers}


def routed_expert_bytes(plan: Plan) -> tuple[int, int]:
    """(bytes of the routed layers' resident experts, on the GPU; bytes of every expert of those layers, pinned on
    the host) as the plan's rows give them: what memory.resident_layer_bytes leaves out (0, 0 without routed
    layers). show's memory rows and the reader's rules both count them so."""
    routed = routed_rows(plan)
    each = {index: routed_layer_expert_bytes(plan, row) for index, row in routed.items()}
    return (sum(len(routed[index].resident) * nbytes for index, nbytes in each.items()),
            sum(plan.experts.num_experts * nbytes for nbytes in each.values()))


def routed_layer_expert_bytes(plan: Plan, row: ExpertLayer) -> int:
    """One expert of a routed layer: its non-resident bytes over its non-resident experts (the section's
    expert_bytes, the largest layer's, where every expert is resident)."""
    non_resident = plan.experts.num_experts - len(row.resident)
    return plan.layers[row.index].offloaded_bytes // non_resident if non_resident else plan.experts.expert_bytes
