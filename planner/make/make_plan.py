"""``make``: read a checkpoint and a profile, search the plan, and build the Plan object.

The inputs are checked in planner.make.inputs, the memory besides the weights accounted in
planner.model.memory_accounting, and the plan's sections built in planner.make.assemble; this module reads the model and
runs the search (the weights within a budget, or a serving target on the whole GPU)."""

import contextlib
import functools
import math
from dataclasses import dataclass, replace

from planner.model.adapters import Adapter, load_adapters, slot_bytes_of
from planner.model.architectures import check_decode_capturable
from planner.model.activations import activation_shape
from planner.make.assemble import assemble, chunk_graphed, serving_section
from planner.source.checkpoint import Checkpoint, collector_paused, load_checkpoint
from planner.model.cost import ComputeTimes, Workload, is_expert_param
from planner.engines.plan import check_engine_architecture, check_engine_input, engine_input_warnings
from planner.engines.read_at_use import READ_AT_USE, ReadAtUseChoice, read_at_use_simulation
from planner.errors import InfeasibleError, ModelInputError, UsageError, shown
from planner.search.cpu_placement import CpuInputs
from planner.search.expert_choice import Comparison, ExpertModel, expert_model
from planner.model.experts import moe_geometry
from planner.model.kv_cache import activation_dtype, kv_cache_model, with_weights_dtype
from planner.model.layout import ModelLayout, build_layout, param_selected
from planner.make.inputs import (budget_bytes_for, budget_given, check_context, gpu_memory_bytes_for,
                                 host_memory_bytes_for, resolve_inputs, workload_of)
from planner.make.model_record import MeasureActivations, MeasureFunction, MeasureLink, Model, as_recorded
from planner.model.memory_accounting import (HostLimit, adapter_host_bytes, check_adapter_slots, check_gpu_total,
                                             check_host_memory, serving_other_bytes, weights_plan_other_bytes,
                                             whole_gpu_budget)
from planner.model.model_config import model_config
from planner.plan.schema import Inputs, Plan
from planner.source.profile import load_profile, with_measured_context
from planner.source.routing_trace import check_against, read_trace
from planner.search.groups import Choice, LayerBytes, gpu_bytes_of, minimum_gpu_bytes
from planner.search.serving import OtherBytes, search_serving
from planner.search.routed_step import trace_condition_warning, unseen_share
from planner.make.tp_sizes import check_tp_inputs
from planner.model.tensor_parallel import shard_checkpoint
from planner.units import format_bytes


@dataclass(frozen=True, kw_only=True)
class Planned:
    """A plan with the objects it was computed from (for show and the runtime)."""

    plan: Plan
    checkpoint: Checkpoint
    layout: ModelLayout
    warnings: tuple[str, ...]


def make_plan(inputs: Inputs, compute_override: ComputeTimes | None = None,
              measure: MeasureFunction | None = None,
              measure_activations: MeasureActivations | None = None,
              checkpoint: Checkpoint | None = None, measure_link: MeasureLink | None = None,
              context_bytes: int | None = None, nccl_bytes: int | None = None) -> Planned:
    """Read the checkpoint and profile named by ``inputs`` and search the fastest plan that fits: for the
    weights alone within a budget, or (``inputs.concurrency``) for a serving target on the whole GPU.

    Compute times: ``compute_override`` when given (check passes a --measure plan's recorded times; not for a
    serving plan, whose search times every concurrency), else ``measure`` for --measure (the caller's, which
    reaches the GPU), else the roofline estimate. A serving plan with --measure also measures its activation
    peaks with ``measure_activations`` where given (else estimates them), and with --tp N the all-reduce between
    the local GPUs with ``measure_link`` (else the profile's link stands, said so in the plan). ``checkpoint``: the
    one --model names, already read (make --tp 2,4 reads it once for every GPU count). ``context_bytes``: what
    the local stack holds outside torch's allocator, measured by make --measure (check passes a --measure plan's
    recorded figure), in place of the profile's; ``nccl_bytes`` likewise NCCL's buffers on a rank (check passes a
    --measure plan's recorded figure; make measures it beside the all-reduce).
    """
    # planning DeepSeek-V3 shards and groups its 92k tensors and searches hundreds of placements: objects that
    # form no reference cycles, which the cyclic collector would walk again and again (a fifth of make --tp 2,4).
    # Not while --measure builds models on the GPU, whose memory a collected cycle may be holding
    measuring = measure is not None or measure_activations is not None or measure_link is not None
    with contextlib.nullcontext() if measuring else collector_paused():
        return _make_plan(inputs, compute_override, measure, measure_activations, checkpoint, measure_link,
                          context_bytes, nccl_bytes)


def _make_plan(inputs: Inputs, compute_override: ComputeTimes | None, measure: MeasureFunction | None,
               measure_activations: MeasureActivations | None, checkpoint: Checkpoint | None,
               measure_link: MeasureLink | None, context_bytes: int | None, nccl_bytes: int | None) -> Planned:
    model = _read_model(inputs, measure, measure_activations, checkpoint, measure_link, context_bytes, nccl_bytes)
    planned = make_serving_plan(model) if inputs.concurrency is not None else _weights_plan(model, compute_override)
    condition = trace_condition_warning(planned.plan, unseen_share(model.experts.routing) if model.experts else 0.0)
    return planned if condition is None else replace(planned, warnings=(*planned.warnings, condition))


def _weights_plan(model: Model, compute_override: ComputeTimes | None) -> Planned:
    """The fastest plan for the weights alone within the budget (or the whole GPU's where none is given)."""
    inputs = model.inputs
    workload = model.resolved.workload
    ignored = [flag for flag, given in (("--chunk", inputs.chunk != 2048), ("--max-tpot-ms", inputs.max_tpot_ms))
               if given]
    if ignored:
        model.warnings.append(f"{' and '.join(ignored)} apply to serving plans (--concurrency): ignored here")
    other = weights_plan_other_bytes(model, workload)
    gpu_memory = gpu_memory_bytes_for(inputs, model.resolved, model.profile)
    budget = budget_bytes_for(inputs, model.resolved, model.profile) if budget_given(inputs) \
        else whole_gpu_budget(model, workload, other, gpu_memory)
    compute = model.compute(workload) if compute_override is None else as_recorded(compute_override,
                                                                                  len(model.layout.layers))
    choice, points = _weights_choice(model, compute, budget, workload)
    host_limit = host_memory_bytes_for(model.resolved, model.profile)
    HostLimit(host_limit, adapter_host_bytes(model)).check(choice, inputs, model.warnings)
    # adapters take the GPU memory the budget leaves (beside the KV cache and activations where those are known)
    free = gpu_memory - choice.gpu_bytes - other.total_bytes if other is not None else gpu_memory - budget
    num_slots = model.adapter_slots(workload.sequences_per_step, free)
    check_adapter_slots(model, num_slots, free, other is None)
    if other is not None:
        other = replace(other, adapter_bytes=num_slots * slot_bytes_of(model.adapters))
        check_gpu_total(choice, other, workload, gpu_memory)
    placed = _placed(model, choice)
    plan = assemble(placed, workload, compute, choice, budget, host_limit, gpu_memory, other, serving=None,
                    num_adapter_slots=num_slots, expert_points=points)
    plan = _read_at_use_plan(plan, placed, choice)
    return Planned(plan=plan, checkpoint=model.checkpoint, layout=model.layout, warnings=tuple(model.warnings))


def _weights_choice(model: Model, compute: ComputeTimes, budget: int, workload: Workload) -> tuple[Choice, tuple]:
    """The fastest placement within ``budget``: whole layers, or for a MoE model whole layers or routed experts,
    with the comparison's point for the plan's experts section."""
    if model.experts is None:
        return model.search(compute, budget), ()
    comparison = model.compare(compute, budget, workload)
    if comparison.chosen is None:
        model.search(compute, budget)  # raises the whole-layer search's reason
    return comparison.chosen, (comparison.point(workload.sequences_per_step),)


def make_serving_plan(model: Model) -> Planned:
    """The concurrency and placement with the most decode tokens/s that fit the whole GPU (planner.search.serving)."""
    inputs, resolved = model.inputs, model.resolved
    if inputs.context < 1:
        raise UsageError("a serving plan needs --context, the longest sequence in tokens (prompt and output), "
                         "e.g. --context 4096")
    gpu_memory = gpu_memory_bytes_for(inputs, resolved, model.profile)

    def decode(concurrency: int) -> Workload:
        return workload_of(concurrency, concurrency, inputs.context)

    comparisons: dict[int, Comparison] = {}
    host = HostLimit(host_memory_bytes_for(resolved, model.profile), adapter_host_bytes(model))

    @functools.cache  # the search asks for each concurrency's figures several times
    def other_at(concurrency: int) -> OtherBytes:
        return serving_other_bytes(model, concurrency, gpu_memory)

    def other_for(concurrency: int, choice: Choice) -> OtherBytes:
        """What ``choice`` holds besides its weights: not the graphed chunk's pool where its chunk stays eager."""
        other = other_at(concurrency)
        return other if chunk_graphed(model, choice) else other.with_eager_chunk()

    def place(compute: ComputeTimes, budget_bytes: int, concurrency: int) -> Choice | None:
        if model.experts is None:
            return host.within(model.search_or_none(compute, budget_bytes))
        # without --budget, routed experts may take the room a graphed chunk would have held
        extra = other_at(concurrency).chunk_graph_extra_bytes if resolved.budget_bytes is None else 0
        compared = model.compare(compute, budget_bytes, decode(concurrency), routed_extra_bytes=extra)
        # each regime held to the host: routed pins every expert, whole layers only the offloaded ones
        comparisons[concurrency] = replace(compared, whole=host.within(compared.whole),
                                           routed=host.within(compared.routed))
        return comparisons[concurrency].chosen

    try:
        found = search_serving(
            wanted=resolved.concurrency,
            gpu_memory_bytes=gpu_memory,
            other_bytes_at=other_at,
            compute_at=lambda b: model.compute(decode(b)),
            search_weights=place,
            minimum_weight_bytes=minimum_gpu_bytes(model.layout.non_layer_bytes, model.layer_bytes),
            resident_weight_bytes=gpu_bytes_of(model.layout.non_layer_bytes, model.layer_bytes, (), 0),
            weights_budget_bytes=resolved.budget_bytes,
            max_tpot_ms=inputs.max_tpot_ms,
            other_for=other_for,
        )
    except InfeasibleError:
        if host.refused_pinned_bytes:  # the GPU held some placement, the host none of them: say so
            check_host_memory(min(host.refused_pinned_bytes), host.limit_bytes, inputs)
        raise
    best = found.best
    workload = decode(best.concurrency)
    host.check(best.choice, inputs, model.warnings)
    points = tuple(comparisons[p.concurrency].point(p.concurrency) for p in found.points
                   if p.concurrency in comparisons)
    placed = _placed(model, best.choice)
    plan = assemble(placed, workload, model.compute(workload), best.choice, best.weights_budget_bytes,
                    host.limit_bytes, gpu_memory, best.other,
                    serving=serving_section(found, resolved.concurrency, inputs.max_tpot_ms),
                    num_adapter_slots=model.adapter_slots(best.concurrency), expert_points=points)
    plan = _read_at_use_plan(plan, placed, best.choice)
    return Planned(plan=plan, checkpoint=model.checkpoint, layout=model.layout, warnings=tuple(model.warnings))


def _placed(model: Model, choice: Choice) -> Model:
    """``model`` as the plan records it for ``choice``: a read-at-use placement selects what it moves of each layer
    by the engine's order, not by --params, so those bytes are the layers' selected bytes."""
    if not isinstance(choice, ReadAtUseChoice):
        return model
    return replace(model, layer_bytes=choice.layer_bytes(model.layer_bytes))


def _read_at_use_plan(plan: Plan, model: Model, choice: Choice) -> Plan:
    """A plan for the engine's read-at-use offloader says so (offload.mechanism, its GiB), and a serving plan's
    prefill chunk reads its offloaded bytes at use as its decode step does (behind no compute)."""
    if not isinstance(choice, ReadAtUseChoice):
        return plan
    prediction = plan.prediction
    if plan.serving is not None:
        compute = model.compute(workload_of(plan.workload.chunk_tokens, 1, 0), graphed=False)
        chunk = read_at_use_simulation(compute.layer_ms, compute.head_ms,
                                       {i: plan.layers[i].copy_ms for i in choice.offloaded})
        prediction = replace(prediction, prefill_chunk_ms=chunk.step_ms)
    return replace(plan, offload=replace(plan.offload, mechanism=READ_AT_USE, read_at_use_gib=choice.gib),
                   prediction=prediction)


def _read_model(inputs: Inputs, measure: MeasureFunction | None = None,
                measure_activations: MeasureActivations | None = None, whole: Checkpoint | None = None,
                measure_link: MeasureLink | None = None, context_bytes: int | None = None,
                nccl_bytes: int | None = None) -> Model:
    """Profile, checkpoint headers, layout, the bytes each layer would move, the KV cache model and adapters."""
    resolved = resolve_inputs(inputs)
    check_engine_input(inputs.engine, tuple(inputs.params))
    profile = with_measured_context(load_profile(inputs.gpu), context_bytes, nccl_bytes)
    check_tp_inputs(inputs, profile)
    # one rank's shard under --tp: its tensors' shapes and its config (heads, KV heads, widths) as vLLM splits them
    whole = load_checkpoint(inputs.model, inputs.revision) if whole is None else whole
    record = model_config(whole.config)
    check_context(inputs.context, record)
    # an engine's plan (--for) is captured by the engine, over its own model code
    check_decode_capturable(record and record.model_type, inputs.cuda_graph and inputs.engine is None)
    checkpoint = shard_checkpoint(whole, inputs.tp)
    check_engine_architecture(inputs.engine, tuple(inputs.params), whole.config, _pinned_knobs(inputs))
    layout = build_layout(checkpoint, inputs.stack)
    warnings = _layout_warnings(layout) + engine_input_warnings(inputs.engine, tuple(inputs.params))
    layer_bytes = _layer_bytes(tuple(inputs.params), checkpoint, layout)
    config = with_weights_dtype(checkpoint.config, whole.tensors)  # a config.json silent on dtype: the headers'
    try:
        kv, shape = kv_cache_model(config), activation_shape(config)
    except ModelInputError as error:
        if inputs.concurrency is not None:
            raise
        kv = shape = None
        warnings.append(f"{error}; the plan leaves the KV cache, activations and GPU total out")
    adapters = load_adapters(inputs.adapters, checkpoint, layout)
    warnings += _adapter_warnings(adapters, inputs)
    return Model(inputs=inputs, resolved=resolved, profile=profile, checkpoint=checkpoint, layout=layout,
                 layer_bytes=layer_bytes, kv=kv, activation_shape=shape, activation_dtype=activation_dtype(config),
                 warnings=warnings, measure=measure,
                 measure_activations=measure_activations, adapters=adapters,
                 experts=_with_cpu_experts(_read_experts(inputs, checkpoint, layout), inputs, profile, layout,
                                           host_memory_bytes_for(resolved, profile)),
                 measure_link=measure_link)


def _with_cpu_experts(experts: ExpertModel | None, inputs: Inputs, profile, layout: ModelLayout,
                      host_limit_bytes: int | None) -> ExpertModel | None:
    """The experts with the host CPU's figures where make weighs CPU experts: --cpu-experts auto or fixed, a profile
    with a cpu_experts section; a weights plan's decode step, or each concurrency a serving plan weighs."""
    if experts is None or inputs.cpu_experts == "off" or profile.cpu_experts is None:
        return experts
    by_index = {layer.index: layer for layer in layout.layers}
    params = tuple(_expert_params(by_index[layer.index], experts.geometry.num_experts)
                   for layer in experts.geometry.layers)
    handoff_us = profile.cpu_experts.handoff_us  # measured by calibrate where a GPU was there
    cpu = profile.cpu_experts if inputs.cpu_time_scale is None else replace(profile.cpu_experts,
                                                                          in_step_scale=inputs.cpu_time_scale)
    return replace(experts, cpu=CpuInputs(cpu=cpu, expert_params=params,
                                          host_limit_bytes=host_limit_bytes,
                                          per_step=inputs.cpu_experts in ("auto", "rows"),
                                          fractional=inputs.cpu_experts == "rows",
                                          handoff_ms=None if handoff_us is None else handoff_us / 1e3))


def _expert_params(layer, num_experts: int) -> int:
    """One routed expert's weights in ``layer``: its expert params' elements over the experts."""
    return max(1, sum(math.prod(shape) for name, _, shape, _ in layer.params if is_expert_param(name)) // num_experts)


def _pinned_knobs(inputs: Inputs) -> tuple[str, ...]:
    """The prefetch knobs given on the command line."""
    return tuple(flag for flag, value in (("--group-size", inputs.group_size), ("--num-in-group", inputs.num_in_group),
                                          ("--prefetch-step", inputs.prefetch_step)) if value is not None)


def _layer_bytes(params: tuple[str, ...], checkpoint: Checkpoint, layout: ModelLayout) -> LayerBytes:
    """Each layer's bytes and the bytes of it that --params selects (some layer must have some)."""
    selected = tuple(layer.matching_bytes(params) for layer in layout.layers)
    if params and not any(selected):
        raise UsageError(
            f"--params {' '.join(params)} matches no param of any layer (segments match whole dot-separated "
            f"parts, e.g. 'experts' or 'mlp'); layer 0 has: {', '.join(p[0] for p in layout.layers[0].params[:6])}"
        )
    return LayerBytes(
        total=tuple(layer.nbytes for layer in layout.layers),
        selected=selected,
        num_tensors=len(checkpoint.tensors) - sum(len(layer.params) for layer in layout.unused_layers),
    )


def _read_experts(inputs: Inputs, checkpoint: Checkpoint, layout: ModelLayout) -> ExpertModel | None:
    """A MoE model's experts: geometry, routing (uniform, or --routing-trace checked against the model), and why
    routed placements are out where they are (the runtime cannot route-fetch them, or the flags rule them out)."""
    geometry = moe_geometry(checkpoint.config, layout)
    accuracy = inputs.prefetch_accuracy  # a share: planner.make.inputs checked it
    if geometry is None:
        for flag, value in (("--routing-trace", inputs.routing_trace), ("--prefetch-accuracy", accuracy),
                            ("--prefetch-depth", inputs.prefetch_depth)):
            if value is not None:
                raise UsageError(f"{flag} applies to MoE models; {shown(inputs.model)} has no routed experts: "
                                 "drop it")
        return None
    routing, label, rank_accuracy, predictions = None, "uniform", None, None
    if inputs.routing_trace is not None:
        trace = read_trace(inputs.routing_trace)
        check_against(trace, geometry, checkpoint.fingerprint(), shown(inputs.routing_trace))
        routing, label, rank_accuracy = trace.routing(), f"trace {trace.content_hash}", trace.rank_accuracy()
        predictions = trace.expert_predictions()
    if inputs.prefetch_depth is not None and inputs.prefetch_depth > geometry.top_k:
        raise UsageError(f"--prefetch-depth {inputs.prefetch_depth} is deeper than the router's top-k "
                         f"({geometry.top_k}); give one from 0 (no prefetch) to {geometry.top_k}")
    experts = expert_model(geometry, routing, label, _routed_ruled_out(inputs, layout, geometry), accuracy,
                           rank_accuracy, inputs.prefetch_depth, predictions)
    if inputs.tp > 1 and experts.unavailable is None:
        # priced beside whole layers, never chosen: run gathers whole experts on one GPU, not a rank's shards of them
        experts = replace(experts, on_paper=True,
                          unavailable=f"--tp {inputs.tp}: run gathers routed experts on one GPU, not on a tensor-"
                                      "parallel rank's shards")
    return experts


def _routed_ruled_out(inputs: Inputs, layout: ModelLayout, geometry) -> str | None:
    """Flags that keep every layer whole: pinned knobs evaluate the whole-layer flags given, and --params that
    leave the experts resident never move them."""
    if inputs.engine is not None:
        return f"--for {inputs.engine}: the engine offloads whole params of chosen layers, not routed experts"
    if inputs.routed_experts == "off":
        return "--routed-experts off: every MoE layer resident or streamed whole"
    pinned = [flag for flag, value in (("--group-size", inputs.group_size), ("--num-in-group", inputs.num_in_group),
                                       ("--prefetch-step", inputs.prefetch_step)) if value is not None]
    if pinned:
        return f"{', '.join(pinned)} pinned: the plan evaluates whole-layer offloading with them"
    params = tuple(inputs.params)
    if not params:  # no --params: every param is selected, the experts too (param_selected)
        return None
    moe = {layer.index for layer in geometry.layers}
    for layer in layout.layers:
        if layer.index in moe and not all(param_selected(name, params) for name, *_ in layer.params
                                          if is_expert_param(name)):
            return f"--params {' '.join(params)} does not select the routed experts"
    return None


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
