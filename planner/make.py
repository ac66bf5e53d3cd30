"""``make``: read a checkpoint and a profile, search the plan, and build the Plan object."""

import shlex
from collections import Counter
from dataclasses import dataclass

from planner.checkpoint import Checkpoint, load_checkpoint
from planner.cost import ComputeTimes, Workload, estimate_compute, geometry_from_config
from planner.errors import InfeasibleError, UsageError
from planner.layout import ModelLayout, build_layout
from planner.plan import (
    SCHEMA_VERSION,
    HardwareSection,
    Inputs,
    LayerRow,
    MemorySection,
    ModelSection,
    OffloadSection,
    Plan,
    PredictionSection,
    WorkloadSection,
)
from planner.profile import HardwareProfile, load_profile
from planner.search import Choice, LayerBytes, SearchSpace, copy_ms_of, search, weight_gpu_bytes
from planner.simulate import join_every_steps_for
from planner.units import format_bytes, parse_bytes


#: the most layers a pinned knob may count (planner.checkpoint allows 100,000 layers)
MAX_KNOB = 100_000


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
        budget = parse_bytes(inputs.budget)
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


def make_plan(inputs: Inputs, compute_override: ComputeTimes | None = None) -> Planned:
    """Read the checkpoint and profile named by ``inputs`` and search the fastest plan that fits."""
    try:
        workload = Workload(
            tokens_per_step=inputs.tokens, sequences_per_step=inputs.sequences, context_tokens=inputs.context
        )
    except ValueError as error:
        raise UsageError(f"workload: {error}") from None
    if inputs.cuda_graph and inputs.tokens != inputs.sequences:
        raise UsageError("--cuda-graph plans decode steps, one new token per sequence: give --tokens equal to "
                         "--sequences (the batch), e.g. --tokens 64 --sequences 64 --context 1024")
    _check_knobs(inputs)
    profile = load_profile(inputs.gpu)
    budget = budget_bytes_for(inputs, profile)
    checkpoint = load_checkpoint(inputs.model, inputs.revision)
    layout = build_layout(checkpoint, inputs.stack)
    warnings = _layout_warnings(layout)
    params = tuple(inputs.params)
    selected = tuple(layer.matching_bytes(params) for layer in layout.layers)
    if params and not any(selected):
        raise UsageError(
            f"--params {' '.join(params)} matches no param of any layer (segments match whole dot-separated "
            f"parts, e.g. 'experts' or 'mlp'); layer 0 has: {', '.join(p[0] for p in layout.layers[0].params[:6])}"
        )
    compute = compute_override or _compute_times(inputs, checkpoint, layout, workload, profile)
    layer_bytes = LayerBytes(
        total=tuple(layer.nbytes for layer in layout.layers),
        selected=selected,
        num_tensors=len(checkpoint.tensors) - sum(len(layer.params) for layer in layout.unused_layers),
    )
    choice = search(
        layers=layer_bytes,
        fixed_bytes=layout.non_layer_bytes,
        compute=compute,
        h2d_bytes_per_s=profile.h2d_bytes_per_s.value,
        copy_overhead_us=profile.copy_overhead_us.value,
        budget_bytes=budget,
        space=SearchSpace(
            group_size=inputs.group_size, num_in_group=inputs.num_in_group, prefetch_step=inputs.prefetch_step
        ),
        join_every_steps=join_every_steps_for(inputs.cuda_graph),
    )
    host_limit = host_memory_bytes_for(inputs, profile)
    check_host_memory(choice.host_pinned_bytes, host_limit, inputs)
    plan = _assemble(inputs, checkpoint, layout, profile, workload, compute, layer_bytes, choice, budget, host_limit)
    return Planned(plan=plan, checkpoint=checkpoint, layout=layout, warnings=tuple(warnings))


def _check_knobs(inputs: Inputs) -> None:
    """Pinned G, K and P are counts of layers: 1 or more, and no more than a model has layers."""
    knobs = {"--group-size": inputs.group_size, "--num-in-group": inputs.num_in_group,
             "--prefetch-step": inputs.prefetch_step}
    for flag, value in knobs.items():
        if value is not None and not 1 <= value <= MAX_KNOB:
            raise UsageError(f"{flag} {value} is not a number of layers; give 1 or more (at most {MAX_KNOB}), or leave "
                             "it out to search it")


def _compute_times(inputs: Inputs, checkpoint, layout, workload, profile) -> ComputeTimes:
    """Measured on the local GPU with --measure (runtime, torch), else the roofline estimate (pure)."""
    if inputs.measure:
        from runtime.measure import measured_compute

        return measured_compute(checkpoint, layout, workload, profile, inputs.measured_on, inputs.cuda_graph)
    if inputs.measured_on is not None:
        raise UsageError("--measured-on only applies with --measure")
    shapes = {t.name: t.shape for t in checkpoint.tensors}
    return estimate_compute(layout, geometry_from_config(checkpoint.config, layout), workload, profile, shapes)


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
        return parse_bytes(inputs.host_memory)
    return None if profile.host_memory_bytes is None else int(profile.host_memory_bytes.value)


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


def _assemble(inputs, checkpoint, layout, profile, workload, compute, layer_bytes, choice: Choice, budget,
              host_limit: int | None) -> Plan:
    h2d = profile.h2d_bytes_per_s.value
    overhead_us = profile.copy_overhead_us.value
    offloaded = set(choice.offloaded)
    simulation = choice.simulation
    num_slots = min(choice.prefetch_step, len(choice.offloaded))
    slot_bytes = max((layer_bytes.selected[i] for i in choice.offloaded), default=0)
    resident_step_ms = compute.head_ms + sum(compute.layer_ms)
    link_floor_ms = 1e3 * choice.copy_bytes / h2d
    rows = tuple(
        LayerRow(
            index=i,
            bytes=layer_bytes.total[i],
            offloaded_bytes=layer_bytes.selected[i] if i in offloaded else 0,
            compute_ms=compute.layer_ms[i],
            copy_ms=copy_ms_of(layer_bytes.selected[i], h2d, overhead_us),
        )
        for i in range(len(layout.layers))
    )
    return Plan(
        schema_version=SCHEMA_VERSION,
        inputs=inputs,
        model=_model_section(checkpoint, layout),
        hardware=HardwareSection(profile=profile.name, **(profile.figures() | {"host_memory_bytes": host_limit})),
        workload=WorkloadSection(
            tokens_per_step=workload.tokens_per_step,
            sequences_per_step=workload.sequences_per_step,
            context_tokens=workload.context_tokens,
            compute_source=compute.source,
            cuda_graph=inputs.cuda_graph,
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
            allocation_slack_bytes=choice.gpu_bytes - weight_gpu_bytes(
                layout.non_layer_bytes, layer_bytes, choice.offloaded, num_slots),
            num_slots=num_slots,
            slot_bytes=slot_bytes,
            host_pinned_bytes=choice.host_pinned_bytes,
        ),
        prediction=PredictionSection(
            step_ms=simulation.step_ms,
            resident_step_ms=resident_step_ms,
            head_ms=compute.head_ms,
            stall_ms=simulation.stall_ms,
            link_floor_ms=link_floor_ms,
            copy_bytes_per_step=choice.copy_bytes,
            link_busy_share=simulation.copy_busy_ms / simulation.step_ms if simulation.step_ms else 0.0,
        ),
        layers=rows,
    )


def _model_section(checkpoint: Checkpoint, layout: ModelLayout) -> ModelSection:
    dtype_bytes = Counter()
    for tensor in checkpoint.tensors:
        dtype_bytes[tensor.dtype] += tensor.nbytes
    architectures = (checkpoint.config or {}).get("architectures") or [None]
    return ModelSection(
        source=checkpoint.source,
        revision=checkpoint.revision,
        fingerprint=checkpoint.fingerprint(),
        architecture=architectures[0],
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
    """The shell command that writes this plan again (recorded in the plan's header)."""
    words = ["offload-plan", "make", "--model", inputs.model]
    if inputs.revision:
        words += ["--revision", inputs.revision]
    words += ["--gpu", inputs.gpu]
    if inputs.budget is not None:
        words += ["--budget", inputs.budget]
    if inputs.trigger is not None:
        words += ["--trigger", f"{inputs.trigger:g}"]
    words += ["--tokens", str(inputs.tokens)]
    if inputs.sequences != 1:
        words += ["--sequences", str(inputs.sequences)]
    if inputs.context:
        words += ["--context", str(inputs.context)]
    for segment in inputs.params:
        words += ["--params", segment]
    optional = {"--stack": inputs.stack, "--group-size": inputs.group_size, "--num-in-group": inputs.num_in_group,
                "--prefetch-step": inputs.prefetch_step}
    for flag, value in optional.items():
        if value is not None:
            words += [flag, str(value)]
    if inputs.measure:
        words += ["--measure"]
    if inputs.measured_on:
        words += ["--measured-on", inputs.measured_on]
    if inputs.cuda_graph:
        words += ["--cuda-graph"]
    if inputs.host_memory is not None:
        words += ["--host-memory", inputs.host_memory]
    if output:
        words += ["-o", output]
    return shlex.join(words)
