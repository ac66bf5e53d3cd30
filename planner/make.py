"""``make``: read a checkpoint and a profile, search the plan, and build the Plan object."""

import functools
import math
import shlex
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from planner.adapter_stream import WeightsOnLink, choose_mode, weights_of_layers
from planner.adapters import (MAX_ADAPTERS, Adapter, adapter_waits, default_slots, load_adapters,
                              missing_per_batch, slot_bytes_of)
from planner.bounds import BOUNDS, MAX_KNOB, MAX_TPOT_MS, within
from planner.checkpoint import Checkpoint, load_checkpoint
from planner.cost import ComputeTimes, Workload, estimate_compute, geometry_from_config, is_expert_param
from planner.errors import InfeasibleError, ModelInputError, PlanError, UsageError, shown
from planner.activations import (
    ActivationShape, StepShape, activation_shape, estimate_activations, planned_experts_implementation,
)
from planner.engine_plan import check_engine_architecture, check_engine_input
from planner.expert_choice import (Comparison, ExpertModel, RoutedChoice, expert_model, experts_section,
                                   prefill_simulation, routed_choice)
from planner.experts import ROUTED_FETCH_EFFICIENCY, moe_geometry, non_resident_bytes
from planner.routing_trace import check_against, read_trace
from planner.kv_cache import KV_DTYPES, KvCacheModel, kv_cache_model
from planner.layout import ModelLayout, build_layout, param_selected
from planner.model_config import ModelConfig, model_config
from planner.plan import (
    MS_DECIMALS,
    SCHEMA_VERSION,
    AdapterRow,
    AdaptersSection,
    HardwareSection,
    Inputs,
    LayerRow,
    MemorySection,
    ModelSection,
    OffloadSection,
    Plan,
    PredictionSection,
    ServingRow,
    ServingSection,
    WorkloadSection,
)
from planner.profile import HardwareProfile, load_profile
from planner.tensor_parallel import check_tp_inputs, shard_checkpoint, with_all_reduces
from planner.search import (
    Choice,
    LayerBytes,
    Searcher,
    SearchSpace,
    copy_ms_of,
    gpu_bytes_of,
    minimum_gpu_bytes,
    weight_gpu_bytes,
)
from planner.serving import (
    CUDA_CONTEXT_BYTES,
    DECODE_ROOM_TOKENS,
    GRAPH_POOL_FACTOR,
    ConcurrencyRange,
    OtherBytes,
    ServingPoint,
    ServingSearch,
    parse_concurrency,
    search_serving,
)
from planner.simulate import join_every_steps_for, simulate
from planner.units import format_bytes, parse_bytes


#: times layers on the local GPU for --measure: (checkpoint, layout, workload, profile, measured_on, graphed) ->
#: ComputeTimes. The planner imports no runtime; the command line passes offload_plan.runtime_seam's.
MeasureFunction = Callable[[Checkpoint, ModelLayout, Workload, HardwareProfile, "str | None", bool], ComputeTimes]
#: measures a step's activation peak on the local GPU for --measure: (checkpoint, layout, workload, graphed) -> bytes
MeasureActivations = Callable[[Checkpoint, ModelLayout, Workload, bool], int]
#: the most layers a pinned knob may count (planner.checkpoint allows 100,000 layers)


@dataclass(frozen=True, kw_only=True)
class Planned:
    """A plan with the objects it was computed from (for show and the runtime)."""

    plan: Plan
    checkpoint: Checkpoint
    layout: ModelLayout
    warnings: tuple[str, ...]


def budget_bytes_for(inputs: Inputs, profile: HardwareProfile) -> int:
    """--budget, else --trigger x GPU memory, else the profile's trigger; never above memory less reserve."""
    if inputs.budget is not None and inputs.trigger is not None:
        raise UsageError("give --budget or --trigger, not both")
    if inputs.budget is not None:
        budget = parse_bytes(inputs.budget, "--budget")
    else:
        trigger = inputs.trigger if inputs.trigger is not None else profile.trigger.value
        if not 0 < trigger <= 1:
            raise UsageError(f"--trigger {trigger} is not a share of GPU memory; give a number in (0, 1]")
        budget = int(trigger * profile.gpu_memory_bytes.value)
    limit = profile.weight_limit_bytes
    if budget > limit:
        raise UsageError(
            f"budget {format_bytes(budget)} exceeds {profile.name}'s {format_bytes(profile.gpu_memory_bytes.value)} "
            f"less {format_bytes(profile.reserve_bytes.value)} held back for activations and KV cache; "
            f"use --budget {limit // 2**20}MiB or less"
        )
    if budget <= 0:
        raise UsageError("the budget must be positive")
    return budget


@dataclass(frozen=True, kw_only=True)
class _Model:
    """What make reads once and every search shares."""

    inputs: Inputs
    profile: HardwareProfile
    checkpoint: Checkpoint
    layout: ModelLayout
    layer_bytes: LayerBytes
    #: the cache model, None where the architecture's cache is not modelled (weights-only plans only)
    kv: KvCacheModel | None
    #: tensor dims for the activation estimate, None with kv
    activation_shape: ActivationShape | None
    warnings: list[str]
    #: the caller's timing function for --measure (None: not given)
    measure: MeasureFunction | None = None
    #: the caller's activation measurement for --measure (None: not given; the estimate stands)
    measure_activations: MeasureActivations | None = None
    #: --adapter's LoRA adapters, in the order given (empty: none)
    adapters: tuple[Adapter, ...] = ()
    #: a MoE model's experts (planner.expert_choice; None for a dense model)
    experts: ExpertModel | None = None

    def adapter_slots(self, num_sequences: int, free_bytes: int | None = None) -> int:
        """GPU slots for the adapters: --adapter-slots, else one per sequence of a batch (at most one per adapter)
        within ``free_bytes`` when given; 0 without adapters."""
        if not self.adapters:
            return 0
        if self.inputs.adapter_slots is not None:
            return self.inputs.adapter_slots
        return default_slots(self.adapters, num_sequences, 2**62 if free_bytes is None else free_bytes)

    @functools.cached_property
    def searcher(self) -> Searcher:
        """The weight search over this model's layers, shared by every budget and compute time."""
        inputs = self.inputs
        return Searcher(
            layers=self.layer_bytes,
            fixed_bytes=self.layout.non_layer_bytes,
            h2d_bytes_per_s=self.profile.h2d_bytes_per_s.value,
            copy_overhead_us=self.profile.copy_overhead_us.value,
            space=SearchSpace(
                group_size=inputs.group_size, num_in_group=inputs.num_in_group, prefetch_step=inputs.prefetch_step,
                prefetch_divides=inputs.engine == "sglang",
            ),
            join_every_steps=join_every_steps_for(inputs.cuda_graph),
        )

    def search(self, compute: ComputeTimes, budget_bytes: int) -> Choice:
        """The fastest placement of the weights within ``budget_bytes`` for steps of ``compute``."""
        return self.searcher.search(compute=compute, budget_bytes=budget_bytes)

    def compare(self, compute: ComputeTimes, budget_bytes: int, workload: Workload) -> Comparison:
        """Whole layers against routed experts within ``budget_bytes`` at ``workload`` (a MoE model; routed is
        None where unavailable or nothing routed fits, whole None where no whole-layer placement fits)."""
        whole = self.search(compute, budget_bytes) if self.searcher.fits(budget_bytes) else None
        decode = workload.tokens_per_step == workload.sequences_per_step and workload.context_tokens > 0
        routed = routed_choice(self.experts, searcher=self.searcher, compute=compute, budget_bytes=budget_bytes,
                               num_tokens=workload.tokens_per_step, decode=decode,
                               non_layer_bytes=self.layout.non_layer_bytes,
                               h2d_bytes_per_s=self.profile.h2d_bytes_per_s.value,
                               copy_overhead_us=self.profile.copy_overhead_us.value)
        return Comparison(num_tokens=workload.tokens_per_step, whole=whole, routed=routed)

    def activations(self, workload: Workload, static_cache_tokens: int | None = None) -> int:
        """Peak activation bytes of a step of ``workload`` as the runtime runs it: a decode step over a static
        cache of ``static_cache_tokens``, else a prefill (MoE experts as planned_experts_implementation says)."""
        if self.measured_activations:
            return self.measure_activations(self.checkpoint, self.layout, workload, False)
        tokens_per_sequence = workload.tokens_per_step // workload.sequences_per_step
        step = StepShape(num_sequences=workload.sequences_per_step, tokens_per_sequence=tokens_per_sequence,
                         context_tokens=workload.context_tokens, static_cache_tokens=static_cache_tokens)
        phase = "decode" if static_cache_tokens is not None else "prefill"
        implementation = planned_experts_implementation(phase, self.activation_shape.dtype)
        return estimate_activations(self.activation_shape, step, experts_implementation=implementation).planned_bytes

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape by name (read once: a serving search estimates every concurrency)."""
        return {t.name: t.shape for t in self.checkpoint.tensors}

    @property
    def measured_activations(self) -> bool:
        """A serving plan with --measure measures its activation peaks on the local GPU (a weights-only plan keeps
        the estimate, so check can replan it from its recorded rows without a GPU)."""
        inputs = self.inputs
        return inputs.measure and inputs.concurrency is not None and self.measure_activations is not None

    def compute(self, workload: Workload, graphed: bool | None = None) -> ComputeTimes:
        """Layer times for ``workload``: measured with --measure, else the roofline estimate. ``graphed``: steps
        replayed from CUDA graphs (default: the plan's --cuda-graph; a prefill chunk runs eagerly)."""
        graphed = self.inputs.cuda_graph if graphed is None else graphed
        compute = _compute_times(self.inputs, self.checkpoint, self.layout, workload, self.profile, self.kv,
                                 self.measure, graphed, self.shapes)
        return with_all_reduces(compute, self.checkpoint, workload, self.profile)


def _check_context(context_tokens: int, record: ModelConfig | None) -> None:
    """--context within what the model's positions and rope scaling allow (vLLM refuses a longer max model len)."""
    limit = record.context if record else None
    if limit is not None and context_tokens > limit.max_tokens:
        raise UsageError(f"--context {context_tokens} is beyond the model's {limit.max_tokens} tokens (config.json's "
                         f"{limit.source}); give --context {limit.max_tokens} or less")


def make_plan(inputs: Inputs, compute_override: ComputeTimes | None = None,
              measure: MeasureFunction | None = None,
              measure_activations: MeasureActivations | None = None,
              checkpoint: Checkpoint | None = None) -> Planned:
    """Read the checkpoint and profile named by ``inputs`` and search the fastest plan that fits: for the
    weights alone within a budget, or (``inputs.concurrency``) for a serving target on the whole GPU.

    Compute times: ``compute_override`` when given (check passes a --measure plan's recorded times; not for a
    serving plan, whose search times every concurrency), else ``measure`` for --measure (the caller's, which
    reaches the GPU), else the roofline estimate. A serving plan with --measure also measures its activation
    peaks with ``measure_activations`` where given (else estimates them). ``checkpoint``: the one --model names,
    already read (make --tp 2,4 reads it once for every GPU count).
    """
    if inputs.cuda_graph and inputs.concurrency is None and inputs.tokens != inputs.sequences:
        raise UsageError("--cuda-graph plans decode steps, one new token per sequence: give --tokens equal to "
                         "--sequences (the batch), e.g. --tokens 64 --sequences 64 --context 1024")
    model = _read_model(inputs, measure, measure_activations, checkpoint)
    if inputs.concurrency is not None:
        return make_serving_plan(model)
    workload = _workload(inputs.tokens, inputs.sequences, inputs.context)
    ignored = [flag for flag, given in (("--chunk", inputs.chunk != 2048), ("--max-tpot-ms", inputs.max_tpot_ms))
               if given]
    if ignored:
        model.warnings.append(f"{' and '.join(ignored)} apply to serving plans (--concurrency): ignored here")
    other = _weights_plan_other_bytes(model, workload)
    budget = budget_bytes_for(inputs, model.profile) if _budget_given(inputs) else _whole_gpu_budget(model, workload,
                                                                                                     other)
    compute = model.compute(workload) if compute_override is None else _as_recorded(compute_override,
                                                                                   len(model.layout.layers))
    points: tuple = ()
    if model.experts is None:
        choice = model.search(compute, budget)
    else:
        comparison = model.compare(compute, budget, workload)
        if comparison.chosen is None:
            model.search(compute, budget)  # raises the whole-layer search's reason
        choice, points = comparison.chosen, (comparison.point(workload.sequences_per_step),)
    host_limit = host_memory_bytes_for(inputs, model.profile)
    check_host_memory(choice.host_pinned_bytes + _adapter_host_bytes(model), host_limit, inputs)
    if host_limit is None and choice.host_pinned_bytes:
        model.warnings.append(_host_not_checked(choice.host_pinned_bytes + _adapter_host_bytes(model)))
    gpu_memory = gpu_memory_bytes_for(inputs, model.profile)
    # adapters take the GPU memory the budget leaves (beside the KV cache and activations where those are known)
    free = gpu_memory - choice.gpu_bytes - other.total_bytes if other is not None else gpu_memory - budget
    num_slots = model.adapter_slots(workload.sequences_per_step, free)
    _check_adapter_slots(model, num_slots, free, other is None)
    if other is not None:
        other = replace(other, adapter_bytes=num_slots * slot_bytes_of(model.adapters))
    if other is not None and choice.gpu_bytes + other.total_bytes > gpu_memory:
        raise InfeasibleError(
            f"the weights ({format_bytes(choice.gpu_bytes)}) with the KV cache ({format_bytes(other.kv_cache_bytes)}) "
            f"{_adapter_words(other)}and activations "
            f"({format_bytes(other.activation_bytes + other.cuda_graph_pool_bytes)}) of "
            f"{workload.sequences_per_step} sequence(s) at context {workload.context_tokens} and the CUDA context need "
            f"{format_bytes(choice.gpu_bytes + other.total_bytes)}, more than the {format_bytes(gpu_memory)} of GPU "
            "memory; lower --budget, or give --concurrency to let the planner divide the GPU"
        )
    plan = _assemble(model, workload, compute, choice, budget, host_limit, gpu_memory, other, serving=None,
                     num_adapter_slots=num_slots, expert_points=points)
    return Planned(plan=plan, checkpoint=model.checkpoint, layout=model.layout, warnings=tuple(model.warnings))


def _budget_given(inputs: Inputs) -> bool:
    """Whether the weights' share was given (--budget or --trigger); without one the plan takes the whole GPU."""
    return inputs.budget is not None or inputs.trigger is not None


def _whole_gpu_budget(model: _Model, workload: Workload, other: OtherBytes | None) -> int:
    """With no --budget or --trigger: the GPU memory the workload's KV cache, activations and CUDA context
    (``other``) leave the weights (the profile's memory less its reserve where the KV cache is not modelled)."""
    if other is None:
        return model.profile.weight_limit_bytes
    budget = gpu_memory_bytes_for(model.inputs, model.profile) - other.total_bytes
    if budget <= 0:
        raise InfeasibleError(
            f"the KV cache and activations of {workload.sequences_per_step} sequence(s) at context "
            f"{workload.context_tokens} need {format_bytes(other.total_bytes)}, all of the GPU's memory; plan fewer "
            "sequences or a shorter context")
    return budget


def _workload(tokens: int, sequences: int, context: int) -> Workload:
    try:
        return Workload(tokens_per_step=tokens, sequences_per_step=sequences, context_tokens=context)
    except ValueError as error:
        raise UsageError(f"workload: {error}") from None


def _check_adapter_inputs(inputs: Inputs) -> None:
    """--adapter-slots counts slots of the adapters given: 1 to their number."""
    slots = inputs.adapter_slots
    if slots is None:
        return
    if not inputs.adapters:
        raise UsageError("--adapter-slots applies to adapters: give them with --adapter NAME=PATH, or drop it")
    if not 1 <= slots <= min(len(inputs.adapters), MAX_ADAPTERS):
        raise UsageError(f"--adapter-slots {slots}: give from 1 to the {len(inputs.adapters)} adapter(s) given "
                         "(more slots than adapters hold nothing)")


def _check_adapter_slots(model: _Model, num_slots: int, free_bytes: int, unchecked: bool) -> None:
    """The adapters' slots must fit the GPU memory the weights leave (the caller checks it with the KV cache)."""
    need = num_slots * slot_bytes_of(model.adapters)
    if need and need > free_bytes:
        what = "the budget and the KV cache, activations and CUDA context leave" if not unchecked \
            else "the budget leaves"
        raise InfeasibleError(
            f"{num_slots} adapter slot(s) of {format_bytes(slot_bytes_of(model.adapters))} need {format_bytes(need)}, "
            f"more than the {format_bytes(max(0, free_bytes))} of GPU memory {what}; give fewer --adapter-slots or a "
            "smaller --budget"
        )


def _adapter_host_bytes(model: _Model) -> int:
    """Every adapter is pinned in host memory (the slots hold copies)."""
    return sum(adapter.total_bytes for adapter in model.adapters)


def _adapter_words(other: OtherBytes) -> str:
    return f"the adapter slots ({format_bytes(other.adapter_bytes)}) " if other.adapter_bytes else ""


def _adapter_warnings(adapters: tuple[Adapter, ...], inputs: Inputs) -> list[str]:
    """Adapters whose config names another base model than --model are planned, but said (in one line)."""
    model = inputs.model.rstrip("/")
    others = [a for a in adapters if a.base_model is not None and a.base_model.rstrip("/") != model
              and not model.endswith("/" + a.base_model.rstrip("/").rsplit("/", 1)[-1])]
    if not others:
        return []
    names = ", ".join(f"{a.name} ({a.base_model})" for a in others[:4]) + (
        f" and {len(others) - 4} more" if len(others) > 4 else "")
    return [f"adapter(s) {names} name another base model than {inputs.model}; planned against its params, whose "
            "names and shapes they match"]


def _check_knobs(inputs: Inputs) -> None:
    """Pinned G, K and P are counts of layers: 1 or more, and no more than a model has layers; the serving
    inputs are checked whether or not a serving plan uses them."""
    knobs = {"--group-size": inputs.group_size, "--num-in-group": inputs.num_in_group,
             "--prefetch-step": inputs.prefetch_step}
    for flag, value in knobs.items():
        if value is not None and not within(flag.strip("-").replace("-", "_"), value):
            raise UsageError(f"{flag} {value} is not a number of layers; give 1 or more (at most {MAX_KNOB}), or leave "
                             "it out to search it")
    _check_serving_inputs(inputs)


def _check_serving_inputs(inputs: Inputs) -> None:
    """--concurrency, --chunk, --kv-dtype, --max-tpot-ms and --gpu-memory: in range, one line each if not."""
    if inputs.concurrency is not None:
        try:
            parse_concurrency(inputs.concurrency)
        except ValueError as error:
            raise UsageError(str(error)) from None
    if not within("chunk", inputs.chunk):
        raise UsageError(f"--chunk {inputs.chunk}: a prefill chunk holds 1 to {BOUNDS['chunk'][1]} tokens, "
                         "e.g. --chunk 2048")
    if inputs.kv_dtype not in KV_DTYPES:
        raise UsageError(f"--kv-dtype {shown(inputs.kv_dtype)} is not a KV cache type; choose one of "
                         f"{', '.join(KV_DTYPES)}")
    if inputs.max_tpot_ms is not None and not (math.isfinite(inputs.max_tpot_ms)
                                               and 0 < inputs.max_tpot_ms <= MAX_TPOT_MS):
        raise UsageError(f"--max-tpot-ms {inputs.max_tpot_ms:g} is not a time; give milliseconds above 0 and at most "
                         f"{MAX_TPOT_MS:g}, e.g. 50")
    # --tokens and --sequences are checked with --concurrency too (which plans its own steps): a value refused
    # without it must not be accepted, and then silently ignored, with it
    _workload(inputs.tokens, inputs.sequences, inputs.context)
    if inputs.gpu_memory is not None:
        parse_bytes(inputs.gpu_memory, "--gpu-memory")


def _read_model(inputs: Inputs, measure: MeasureFunction | None = None,
                measure_activations: MeasureActivations | None = None, whole: Checkpoint | None = None) -> _Model:
    """Profile, checkpoint headers, layout, the bytes each layer would move, the KV cache model and adapters."""
    _check_knobs(inputs)
    _check_adapter_inputs(inputs)
    check_engine_input(inputs.engine, tuple(inputs.params))
    profile = load_profile(inputs.gpu)
    check_tp_inputs(inputs, profile)
    # one rank's shard under --tp: its tensors' shapes and its config (heads, KV heads, widths) as vLLM splits them
    whole = load_checkpoint(inputs.model, inputs.revision) if whole is None else whole
    _check_context(inputs.context, model_config(whole.config))
    checkpoint = shard_checkpoint(whole, inputs.tp)
    check_engine_architecture(inputs.engine, tuple(inputs.params), whole.config)
    layout = build_layout(checkpoint, inputs.stack)
    warnings = _layout_warnings(layout)
    params = tuple(inputs.params)
    selected = tuple(layer.matching_bytes(params) for layer in layout.layers)
    if params and not any(selected):
        raise UsageError(
            f"--params {' '.join(params)} matches no param of any layer (segments match whole dot-separated "
            f"parts, e.g. 'experts' or 'mlp'); layer 0 has: {', '.join(p[0] for p in layout.layers[0].params[:6])}"
        )
    layer_bytes = LayerBytes(
        total=tuple(layer.nbytes for layer in layout.layers),
        selected=selected,
        num_tensors=len(checkpoint.tensors) - sum(len(layer.params) for layer in layout.unused_layers),
    )
    try:
        kv, shape = kv_cache_model(checkpoint.config), activation_shape(checkpoint.config)
    except ModelInputError as error:
        if inputs.concurrency is not None:
            raise
        kv = shape = None
        warnings.append(f"{error}; the plan leaves the KV cache, activations and GPU total out")
    adapters = load_adapters(inputs.adapters, checkpoint, layout)
    warnings += _adapter_warnings(adapters, inputs)
    return _Model(inputs=inputs, profile=profile, checkpoint=checkpoint, layout=layout, layer_bytes=layer_bytes,
                  kv=kv, activation_shape=shape, warnings=warnings, measure=measure,
                  measure_activations=measure_activations, adapters=adapters,
                  experts=_read_experts(inputs, checkpoint, layout))


def _read_experts(inputs: Inputs, checkpoint: Checkpoint, layout: ModelLayout) -> ExpertModel | None:
    """A MoE model's experts: geometry, routing (uniform, or --routing-trace checked against the model), and why
    routed placements are out where they are (the runtime cannot route-fetch them, or the flags rule them out)."""
    geometry = moe_geometry(checkpoint.config, layout)
    accuracy = inputs.prefetch_accuracy
    if accuracy is not None and not 0 <= accuracy <= 1:
        raise UsageError(f"--prefetch-accuracy {accuracy:g} is not a share; give one from 0 to 1 (e.g. 0.8)")
    if geometry is None:
        for flag, value in (("--routing-trace", inputs.routing_trace), ("--prefetch-accuracy", accuracy)):
            if value is not None:
                raise UsageError(f"{flag} applies to MoE models; {shown(inputs.model)} has no routed experts: "
                                 "drop it")
        return None
    routing, label = None, "uniform"
    if inputs.routing_trace is not None:
        trace = read_trace(inputs.routing_trace)
        check_against(trace, geometry, checkpoint.fingerprint(), shown(inputs.routing_trace))
        routing, label = trace.routing(), f"trace {trace.content_hash}"
    return expert_model(geometry, routing, label, _routed_ruled_out(inputs, layout, geometry), accuracy)


def _routed_ruled_out(inputs: Inputs, layout: ModelLayout, geometry) -> str | None:
    """Flags that keep every layer whole: pinned knobs evaluate the whole-layer flags given, and --params that
    leave the experts resident never move them."""
    if inputs.engine is not None:
        return f"--for {inputs.engine}: the engine offloads whole params of chosen layers, not routed experts"
    pinned = [flag for flag, value in (("--group-size", inputs.group_size), ("--num-in-group", inputs.num_in_group),
                                       ("--prefetch-step", inputs.prefetch_step)) if value is not None]
    if pinned:
        return f"{', '.join(pinned)} pinned: the plan evaluates whole-layer offloading with them"
    params = tuple(inputs.params)
    moe = {layer.index for layer in geometry.layers}
    for layer in layout.layers:
        if layer.index in moe and not all(param_selected(name, params) for name, *_ in layer.params
                                          if is_expert_param(name)):
            return f"--params {' '.join(params)} does not select the routed experts"
    return None


def _compute_times(inputs: Inputs, checkpoint, layout, workload, profile, kv: KvCacheModel | None,
                   measure: MeasureFunction | None, graphed: bool, shapes: dict | None = None) -> ComputeTimes:
    """Measured by the caller's ``measure`` with --measure, else the roofline estimate (pure)."""
    if inputs.measure:
        if measure is None:
            raise UsageError("--measure times layers on the local GPU, which needs the runtime: run it as "
                             "offload-plan make --measure (with offload-plan[runtime] installed), or drop --measure")
        measured = measure(checkpoint, layout, workload, profile, inputs.measured_on, graphed)
        return _as_recorded(measured, len(layout.layers))
    if inputs.measured_on is not None:
        raise UsageError("--measured-on only applies with --measure")
    shapes = {t.name: t.shape for t in checkpoint.tensors} if shapes is None else shapes
    kv_bytes_of = None if kv is None else functools.partial(kv_step_bytes, kv, kv_dtype=inputs.kv_dtype)
    return estimate_compute(layout, geometry_from_config(checkpoint.config, layout), workload, profile, shapes,
                            kv_bytes_of)


def _as_recorded(compute: ComputeTimes, num_layers: int) -> ComputeTimes:
    """Times rounded as the plan records them, so a plan made from them regenerates from its own rows (check)."""
    if len(compute.layer_ms) != num_layers:
        raise PlanError(f"{len(compute.layer_ms)} layer times for {num_layers} planned layers: the times are for "
                        "another checkpoint; regenerate the plan with make")
    return replace(compute, layer_ms=tuple(round(ms, MS_DECIMALS) for ms in compute.layer_ms),
                   head_ms=round(compute.head_ms, MS_DECIMALS))


def kv_step_bytes(kv: KvCacheModel, layer_index: int, workload: Workload, *, kv_dtype: str) -> float:
    """KV cache bytes one layer reads and writes in a step of ``workload``: each sequence's held tokens."""
    tokens_per_sequence = workload.tokens_per_step // workload.sequences_per_step
    return kv.cache_bytes(num_sequences=workload.sequences_per_step,
                          context_tokens=workload.context_tokens + tokens_per_sequence, kv_dtype=kv_dtype,
                          layer_index=layer_index)


def gpu_memory_bytes_for(inputs: Inputs, profile: HardwareProfile) -> int:
    """The GPU memory a plan must fit: --gpu-memory, else --trigger's share of the profile's (serving plans),
    else all of the profile's. Never above the profile's."""
    memory = int(profile.gpu_memory_bytes.value)
    if inputs.gpu_memory is not None:
        limit = parse_bytes(inputs.gpu_memory, "--gpu-memory")
        if not 0 < limit <= memory:
            raise UsageError(f"--gpu-memory {inputs.gpu_memory} is not between 0 and {profile.name}'s "
                             f"{format_bytes(memory)}; give at most {memory // 2**20}MiB")
        return limit
    if inputs.concurrency is not None and inputs.trigger is not None:
        if not 0 < inputs.trigger <= 1:
            raise UsageError(f"--trigger {inputs.trigger} is not a share of GPU memory; give a number in (0, 1]")
        return int(inputs.trigger * memory)
    return memory


def serving_other_bytes(model: _Model, concurrency: int) -> OtherBytes:
    """GPU memory besides the weights when serving ``concurrency`` sequences of up to --context tokens: their KV
    cache, the activation peak (a prefill chunk's, or an eager decode step's when larger), a graphed decode
    step's pool, and the CUDA context. The decode step is the last one, over a full static cache."""
    inputs = model.inputs
    # run's static cache keeps room past the context for the steps it times; engines allocate the context alone
    cache_tokens = inputs.context + DECODE_ROOM_TOKENS
    decode_bytes = model.activations(_workload(concurrency, concurrency, inputs.context),
                                     static_cache_tokens=cache_tokens)
    chunk_bytes = model.activations(_workload(inputs.chunk, 1, 0))
    kv_bytes = model.kv.cache_bytes(num_sequences=concurrency, context_tokens=cache_tokens, kv_dtype=inputs.kv_dtype)
    other = _other_bytes(model, kv_bytes, decode_bytes, chunk_bytes, inputs.cuda_graph)
    # the adapters' slots are GPU memory at every concurrency: one per sequence by default, so they grow with it
    return replace(other, adapter_bytes=model.adapter_slots(concurrency) * slot_bytes_of(model.adapters))


def _other_bytes(model: _Model, kv_bytes: int, decode_bytes: int, chunk_bytes: int, graphed: bool) -> OtherBytes:
    context = model.profile.cuda_context_bytes
    return OtherBytes(kv_cache_bytes=kv_bytes, activation_bytes=max(chunk_bytes, 0 if graphed else decode_bytes),
                      cuda_graph_pool_bytes=math.ceil(GRAPH_POOL_FACTOR * decode_bytes) if graphed else 0,
                      cuda_context_bytes=CUDA_CONTEXT_BYTES if context is None else int(context.value))


def _weights_plan_other_bytes(model: _Model, workload: Workload) -> OtherBytes | None:
    """A weights-only plan's other GPU memory, its one step run as the runtime runs it (a decode plan over a
    static cache with run's room, a prefill without one); None when the KV cache is not modelled."""
    if model.kv is None:
        return None
    tokens_per_sequence = workload.tokens_per_step // workload.sequences_per_step
    # a decode plan (one token per sequence after a context) runs over run's static cache; any other step is a
    # prefill (a chunk after a context included) over a cache that grows to hold it
    decode = workload.context_tokens > 0 and tokens_per_sequence == 1
    cache_tokens = workload.context_tokens + (DECODE_ROOM_TOKENS if decode else tokens_per_sequence)
    step_bytes = model.activations(workload, static_cache_tokens=cache_tokens if decode else None)
    kv_bytes = model.kv.cache_bytes(num_sequences=workload.sequences_per_step, context_tokens=cache_tokens,
                                    kv_dtype=model.inputs.kv_dtype)
    return _other_bytes(model, kv_bytes, step_bytes, 0 if decode else step_bytes, model.inputs.cuda_graph and decode)


def make_serving_plan(model: _Model) -> Planned:
    """The concurrency and placement with the most decode tokens/s that fit the whole GPU (planner.serving)."""
    inputs = model.inputs
    if inputs.context < 1:
        raise UsageError("a serving plan needs --context, the longest sequence in tokens (prompt and output), "
                         "e.g. --context 4096")
    wanted = parse_concurrency(inputs.concurrency)  # checked by _check_serving_inputs
    gpu_memory = gpu_memory_bytes_for(inputs, model.profile)
    budget = parse_bytes(inputs.budget, "--budget") if inputs.budget is not None else None

    def decode(concurrency: int) -> Workload:
        return _workload(concurrency, concurrency, inputs.context)

    comparisons: dict[int, Comparison] = {}
    host = _HostLimit(host_memory_bytes_for(inputs, model.profile), _adapter_host_bytes(model))

    def place(compute: ComputeTimes, budget_bytes: int, concurrency: int) -> Choice | None:
        if model.experts is None:
            return host.within(_search_or_none(model, compute, budget_bytes))
        compared = model.compare(compute, budget_bytes, decode(concurrency))
        # each regime held to the host: routed pins every expert, whole layers only the offloaded ones
        comparisons[concurrency] = replace(compared, whole=host.within(compared.whole),
                                           routed=host.within(compared.routed))
        return comparisons[concurrency].chosen

    try:
        found = search_serving(
            wanted=wanted,
            gpu_memory_bytes=gpu_memory,
            other_bytes_at=lambda b: serving_other_bytes(model, b),
            compute_at=lambda b: model.compute(decode(b)),
            search_weights=place,
            minimum_weight_bytes=minimum_gpu_bytes(model.layout.non_layer_bytes, model.layer_bytes),
            resident_weight_bytes=gpu_bytes_of(model.layout.non_layer_bytes, model.layer_bytes, (), 0),
            weights_budget_bytes=budget,
            max_tpot_ms=inputs.max_tpot_ms,
        )
    except InfeasibleError:
        if host.refused_pinned_bytes:  # the GPU held some placement, the host none of them: say so
            check_host_memory(min(host.refused_pinned_bytes), host.limit_bytes, inputs)
        raise
    best = found.best
    workload = decode(best.concurrency)
    check_host_memory(best.choice.host_pinned_bytes + host.extra_bytes, host.limit_bytes, inputs)
    if host.limit_bytes is None and best.choice.host_pinned_bytes:
        model.warnings.append(_host_not_checked(best.choice.host_pinned_bytes + host.extra_bytes))
    points = tuple(comparisons[p.concurrency].point(p.concurrency) for p in found.points
                   if p.concurrency in comparisons)
    plan = _assemble(model, workload, model.compute(workload), best.choice, best.weights_budget_bytes,
                     host.limit_bytes, gpu_memory, best.other,
                     serving=_serving_section(found, wanted, inputs.max_tpot_ms),
                     num_adapter_slots=model.adapter_slots(best.concurrency), expert_points=points)
    return Planned(plan=plan, checkpoint=model.checkpoint, layout=model.layout, warnings=tuple(model.warnings))


def _search_or_none(model: _Model, compute: ComputeTimes, budget_bytes: int) -> Choice | None:
    """The fastest placement within the budget, None where none fits (pinned knobs can ask for more than the
    leanest placement needs)."""
    return model.search(compute, budget_bytes) if model.searcher.fits(budget_bytes) else None


def _serving_section(found: ServingSearch, wanted: ConcurrencyRange, max_tpot_ms: float | None) -> ServingSection:
    alternative = found.no_offload
    return ServingSection(
        concurrency_low=wanted.low,
        concurrency_high=wanted.high,
        max_tpot_ms=max_tpot_ms,
        no_offload_concurrency=None if alternative is None else alternative.concurrency,
        no_offload_step_ms=None if alternative is None else alternative.step_ms,
        no_offload_tokens_per_s=None if alternative is None else alternative.tokens_per_s,
        points=tuple(_serving_row(point) for point in found.points),
    )


def _serving_row(point: ServingPoint) -> ServingRow:
    choice = point.choice
    return ServingRow(
        concurrency=point.concurrency,
        # a routed placement moves the experts of every MoE layer (planner.expert_choice)
        num_offloaded=-1 if choice is None else len(choice.placement.layers) if isinstance(choice, RoutedChoice)
        else len(choice.offloaded),
        group_size=0 if choice is None else choice.group_size,
        num_in_group=0 if choice is None else choice.num_in_group,
        prefetch_step=0 if choice is None else choice.prefetch_step,
        weights_gpu_bytes=0 if choice is None else choice.gpu_bytes,
        kv_cache_bytes=point.other.kv_cache_bytes,
        total_gpu_bytes=point.total_gpu_bytes,
        step_ms=point.step_ms,
        tokens_per_s=point.tokens_per_s,
    )


def _layout_warnings(layout: ModelLayout) -> list[str]:
    warnings = []
    others = [prefix for prefix in layout.stacks if prefix != layout.stack]
    if others:
        warnings.append(
            f"planning stack {layout.stack} ({layout.stacks[layout.stack]} layers); other stacks stay resident: "
            f"{', '.join(f'{p} ({layout.stacks[p]} layers)' for p in others)}; choose with --stack"
        )
    if layout.unused_layers:
        indices = [layer.index for layer in layout.unused_layers]
        warnings.append(
            f"layers {indices} of {layout.stack} lie beyond config.json's layer count (e.g. multi-token "
            f"prediction): {format_bytes(layout.unused_bytes)} not loaded and not planned"
        )
    return warnings


def host_memory_bytes_for(inputs: Inputs, profile: HardwareProfile) -> int | None:
    """--host-memory, else the profile's host memory figure, else None (not checked)."""
    if inputs.host_memory is not None:
        host_bytes = parse_bytes(inputs.host_memory, "--host-memory")
        if host_bytes <= 0:
            raise UsageError(f"--host-memory {shown(inputs.host_memory)} holds nothing; give the host memory the "
                             "offloaded params may be pinned in, e.g. 480GB, or leave it out")
        return host_bytes
    return None if profile.host_memory_bytes is None else int(profile.host_memory_bytes.value)


class _HostLimit:
    """The host memory a serving search's placements must pin within (None: not checked)."""

    def __init__(self, limit_bytes: int | None, extra_bytes: int):
        self.limit_bytes = limit_bytes
        #: pinned besides the weights (the adapters' pool)
        self.extra_bytes = extra_bytes
        #: pinned bytes of the placements refused for the host
        self.refused_pinned_bytes: list[int] = []

    def within(self, choice: Choice | None) -> Choice | None:
        """``choice``, or None where it pins more than the host holds: the concurrency then does not fit, and the
        search moves to one that keeps more on the GPU (auto never fails where a narrower range succeeds)."""
        if choice is None or self.limit_bytes is None:
            return choice
        pinned = choice.host_pinned_bytes + self.extra_bytes
        if pinned > self.limit_bytes:
            self.refused_pinned_bytes.append(pinned)
            return None
        return choice


def _host_not_checked(pinned_bytes: int) -> str:
    """The one line that says host memory was not checked (no --host-memory, no platform figure)."""
    return (f"host memory not checked: the plan pins {format_bytes(pinned_bytes)}; give --host-memory (or a "
            "profile with host_memory_bytes) to hold it to the host it runs on")


def check_host_memory(pinned_bytes: int, host_limit: int | None, inputs: Inputs) -> None:
    """The offloaded params must fit in the host memory they are pinned in."""
    if host_limit is None or pinned_bytes <= host_limit:
        return
    where = "--host-memory" if inputs.host_memory is not None else f"the {inputs.gpu} profile"
    raise InfeasibleError(
        f"the plan pins {pinned_bytes} bytes ({format_bytes(pinned_bytes)}) of host memory but {where} allows "
        f"{host_limit} bytes ({format_bytes(host_limit)}); keep more on the GPU (raise --budget), offload fewer "
        "params, split the model over more GPUs, or give --host-memory for a host with more"
    )


def _assemble(model: _Model, workload: Workload, compute: ComputeTimes, choice: Choice, budget: int,
              host_limit: int | None, gpu_memory: int, other: OtherBytes | None,
              serving: ServingSection | None, num_adapter_slots: int = 0, expert_points: tuple = ()) -> Plan:
    inputs, profile, layout, layer_bytes = model.inputs, model.profile, model.layout, model.layer_bytes
    h2d = profile.h2d_bytes_per_s.value
    overhead_us = profile.copy_overhead_us.value
    offloaded = set(choice.offloaded)
    simulation = choice.simulation
    num_slots = min(choice.prefetch_step, len(choice.offloaded))
    slot_bytes = max((layer_bytes.selected[i] for i in choice.offloaded), default=0)
    resident_step_ms = compute.head_ms + sum(compute.layer_ms)
    routed = choice.placement if isinstance(choice, RoutedChoice) else None
    decode = workload.context_tokens > 0 and workload.tokens_per_step == workload.sequences_per_step
    # a routed decode step gathers at the routed fetch rate; a routed prefill copies whole through the copy engine
    link_rate = h2d * ROUTED_FETCH_EFFICIENCY if routed is not None and decode else h2d
    link_floor_ms = 1e3 * choice.copy_bytes / link_rate
    non_resident = {} if routed is None else non_resident_bytes(model.experts.geometry, routed)
    chunk_tokens = inputs.chunk if serving is not None else workload.tokens_per_step
    rows = tuple(
        LayerRow(
            index=i,
            bytes=layer_bytes.total[i],
            selected_bytes=layer_bytes.selected[i],
            offloaded_bytes=layer_bytes.selected[i] if i in offloaded else non_resident.get(i, 0),
            compute_ms=compute.layer_ms[i],
            copy_ms=copy_ms_of(layer_bytes.selected[i], h2d, overhead_us),
        )
        for i in range(len(layout.layers))
    )
    return Plan(
        schema_version=SCHEMA_VERSION,
        inputs=inputs,
        model=_model_section(model.checkpoint, layout),
        hardware=HardwareSection(profile=profile.name, **(profile.figures() | {"host_memory_bytes": host_limit})),
        workload=WorkloadSection(
            tokens_per_step=workload.tokens_per_step,
            sequences_per_step=workload.sequences_per_step,
            context_tokens=workload.context_tokens,
            compute_source=compute.source,
            cuda_graph=inputs.cuda_graph,
            concurrency=workload.sequences_per_step,
            chunk_tokens=chunk_tokens,
            kv_dtype=_kv_dtype_name(model),
        ),
        offload=OffloadSection(
            group_size=choice.group_size,
            num_in_group=choice.num_in_group,
            prefetch_step=choice.prefetch_step,
            params=tuple(inputs.params),
            layers=choice.offloaded,
            replay_start_copies=choice.replay_start_copies,
        ),
        memory=MemorySection(
            budget_bytes=budget,
            gpu_bytes=choice.gpu_bytes,
            resident_layer_bytes=sum(layer_bytes.total) - choice.host_pinned_bytes,
            non_layer_bytes=layout.non_layer_bytes,
            allocation_slack_bytes=choice.gpu_bytes - (routed.weight_bytes if routed is not None else weight_gpu_bytes(
                layout.non_layer_bytes, layer_bytes, choice.offloaded, num_slots)),
            num_slots=num_slots,
            slot_bytes=slot_bytes,
            host_pinned_bytes=choice.host_pinned_bytes,
            gpu_memory_bytes=gpu_memory,
            kv_cache_bytes=None if other is None else other.kv_cache_bytes,
            activation_bytes=None if other is None else other.activation_bytes,
            cuda_graph_pool_bytes=0 if other is None else other.cuda_graph_pool_bytes,
            cuda_context_bytes=0 if other is None else other.cuda_context_bytes,
            total_gpu_bytes=None if other is None else choice.gpu_bytes + other.total_bytes,
        ),
        prediction=PredictionSection(
            step_ms=simulation.step_ms,
            resident_step_ms=resident_step_ms,
            head_ms=compute.head_ms,
            stall_ms=simulation.stall_ms,
            link_floor_ms=link_floor_ms,
            copy_bytes_per_step=choice.copy_bytes,
            link_busy_share=_link_busy_ms(simulation, routed is not None and decode, link_floor_ms, routed)
            / simulation.step_ms if simulation.step_ms else 0.0,
            decode_step_ms=simulation.step_ms if decode else None,
            decode_tokens_per_s=1e3 * workload.sequences_per_step / simulation.step_ms if decode else None,
            # a weights-only plan's prefill step is its chunk; a serving plan's chunk has its own layer times
            prefill_chunk_ms=_prefill_chunk_ms(model, choice, chunk_tokens) if serving is not None
            else (None if decode else simulation.step_ms),
        ),
        layers=rows,
        serving=serving,
        adapters=_adapters_section(model, num_adapter_slots, workload, simulation, resident_step_ms,
                                   weights_of_layers(rows, tuple(choice.offloaded), choice.prefetch_step,
                                                     compute.head_ms)) if model.adapters else None,
        experts=None if model.experts is None else experts_section(model.experts, choice, layer_bytes, expert_points,
                                                                   h2d),
    )


def _link_busy_ms(simulation, routed_decode: bool, link_floor_ms: float, routed) -> float:
    """The link's busy time per step: its copies, or a routed decode step's fetches (its stalls; with prefetch,
    which hides fetches behind compute, every byte the link carries at the gather's rate)."""
    if routed_decode and routed.prefetch_accuracy is not None:
        return link_floor_ms
    return simulation.stall_ms if routed_decode else simulation.copy_busy_ms


def _adapters_section(model: _Model, num_slots: int, workload: Workload, simulation, compute_step_ms: float,
                      weights: WeightsOnLink | None) -> AdaptersSection:
    """The adapters' slots, pool and waits on the plan's link (planner.adapters models the waits), and the
    loading mode predicted faster for a stream of requests, each one of the workload's sequences (its share of
    ``compute_step_ms``, the step's compute without waits; planner.adapter_stream.choose_mode), with the
    offloaded ``weights`` on the link."""
    adapters, profile = model.adapters, model.profile
    h2d, overhead_us = profile.h2d_bytes_per_s.value, profile.copy_overhead_us.value
    slot_bytes = slot_bytes_of(adapters)
    step_ms = simulation.step_ms
    waits = adapter_waits(
        slot_bytes=slot_bytes, h2d_bytes_per_s=h2d, copy_overhead_us=overhead_us, step_ms=step_ms,
        num_missing=missing_per_batch(num_slots, workload.sequences_per_step, len(adapters)),
        link_busy_share=simulation.copy_busy_ms / step_ms if step_ms else 0.0)
    rows = tuple(AdapterRow(name=a.name, source=a.source, revision=a.revision, fingerprint=a.fingerprint, rank=a.rank,
                            alpha=a.alpha, target_modules=a.target_modules, num_tensors=a.num_tensors,
                            bytes=a.total_bytes, copy_ms=copy_ms_of(a.total_bytes, h2d, overhead_us))
                 for a in sorted(adapters, key=lambda a: a.name))
    request_ms = compute_step_ms / max(1, workload.sequences_per_step)
    choice = choose_mode(copy_ms={row.name: row.copy_ms for row in rows}, num_slots=num_slots,
                         request_ms=request_ms, weights=weights)
    return AdaptersSection(
        num_slots=num_slots, slot_bytes=slot_bytes, gpu_bytes=num_slots * slot_bytes,
        host_pinned_bytes=sum(a.total_bytes for a in adapters), max_rank=max(a.rank for a in adapters),
        num_missing=waits.num_missing, copy_ms=waits.copy_ms, shared_copy_ms=waits.shared_copy_ms,
        blocking_wait_ms=waits.blocking_wait_ms, pipelined_first_wait_ms=waits.pipelined_first_wait_ms,
        pipelined_last_wait_ms=waits.pipelined_last_wait_ms, pipelined_step_ms=waits.pipelined_step_ms,
        mode=choice.mode, stream_requests_per_batch=choice.requests_per_batch,
        stream_num_batches=choice.num_batches, blocking_stream_ms=choice.blocking_total_ms,
        pipelined_stream_ms=choice.pipelined_total_ms, mode_margin=choice.margin, items=rows)


def _kv_dtype_name(model: _Model) -> str:
    """--kv-dtype with auto resolved to the checkpoint's activation dtype."""
    if model.inputs.kv_dtype != "auto" or model.kv is None:
        return model.inputs.kv_dtype
    return model.kv.activation_dtype


def _prefill_chunk_ms(model: _Model, choice: Choice, chunk_tokens: int) -> float:
    """One prefill chunk of a new sequence with the plan's placement, steps back to back (eager); routed layers
    copy their non-resident experts whole through the staging buffer."""
    compute = model.compute(_workload(chunk_tokens, 1, 0), graphed=False)  # a chunk is never replayed
    if isinstance(choice, RoutedChoice):
        profile = model.profile
        return prefill_simulation(model.experts.geometry, choice.placement, compute, profile.h2d_bytes_per_s.value,
                                  profile.copy_overhead_us.value).step_ms
    copy_ms = tuple(copy_ms_of(model.layer_bytes.selected[i], model.profile.h2d_bytes_per_s.value,
                               model.profile.copy_overhead_us.value) for i in choice.offloaded)
    return simulate(layer_ms=compute.layer_ms, head_ms=compute.head_ms, offloaded=choice.offloaded,
                    copy_ms=copy_ms, prefetch_step=max(1, choice.prefetch_step)).step_ms


def _model_section(checkpoint: Checkpoint, layout: ModelLayout) -> ModelSection:
    dtype_bytes = Counter()
    for tensor in checkpoint.tensors:
        dtype_bytes[tensor.dtype] += tensor.nbytes
    record = model_config(checkpoint.config)
    return ModelSection(
        source=checkpoint.source,
        revision=checkpoint.revision,
        fingerprint=checkpoint.fingerprint(),
        architecture=record.architecture if record else None,
        stack=layout.stack,
        num_layers=len(layout.layers),
        num_tensors=len(checkpoint.tensors),
        total_bytes=checkpoint.total_bytes,
        layer_bytes=layout.layer_bytes,
        non_layer_bytes=layout.non_layer_bytes,
        unused_layers=tuple(layer.index for layer in layout.unused_layers),
        unused_bytes=layout.unused_bytes,
        dtype_bytes=dict(sorted(dtype_bytes.items())),
    )


def regenerate_command(inputs: Inputs, output: str | None) -> str:
    """The shell command that writes this plan again (recorded in the plan's header), from Inputs' options."""
    words = ["offload-plan", "make"]
    for spec in fields(Inputs):
        words += _option_words(spec, getattr(inputs, spec.name))
    if output:
        words += ["-o", output]
    return shlex.join(words)


def _option_words(spec, value) -> list[str]:
    """One input as its flag and value: nothing at its default (unless the option says always), a switch alone,
    a repeated flag for a tuple."""
    option = spec.metadata
    if value == spec.default and not option["always"]:
        return []
    if isinstance(value, bool):
        return [option["flag"]] if value else []
    if isinstance(value, tuple):
        return [word for item in value for word in (option["flag"], item)]
    return [option["flag"], f"{value:g}" if isinstance(value, float) else str(value)]
