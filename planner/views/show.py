"""``show``: explain a plan to a person with rich tables and a one-step copy/compute timeline."""

from rich.console import Console
from rich.table import Table
from rich.text import Text

from planner.engines import read_at_use
from planner.plan.schema import Plan, gathers, routed_expert_bytes
from planner.search.routed_step import plan_decode_step
from planner.search.schedule import PrefetchSchedule
from planner.search.simulate import STEPS_PER_GRAPH, Simulation, join_every_steps_for, simulate
from planner.search.serving import NCCL_BYTES_PER_RANK, OFFLOAD_MARGIN_SHARE
from planner.views.tp_comparison import tp_row
from planner.units import format_bytes, format_ms, format_rate
from planner.views.show_experts import experts_text
from planner.views.show_serving import adapters_table, chart_bar_columns, serving_chart

TIMELINE_COLUMNS = 96
NUM_STALLS_LISTED = 8


def counted(number: int, noun: str) -> str:
    """``number`` and ``noun``, plural unless one: "1 sequence", "8 sequences"."""
    return f"{number:,} {noun}" if number == 1 else f"{number:,} {noun}s"


def resimulate(plan: Plan) -> Simulation:
    """Re-run the plan's simulation from its recorded per-layer times (for the timeline); a routed decode step
    from its layers' expected fetches."""
    if routed_decode(plan):
        return plan_decode_step(plan)
    if plan.offload.mechanism == "read_at_use":
        return read_at_use.plan_simulation(plan)
    return simulate(
        layer_ms=tuple(row.compute_ms for row in plan.layers),
        head_ms=plan.prediction.head_ms,
        offloaded=plan.offload.layers,
        copy_ms=tuple(plan.layers[i].copy_ms for i in plan.offload.layers),
        prefetch_step=plan.offload.prefetch_step,
        join_every_steps=join_every_steps_for(plan.workload.cuda_graph),
        replay_start_copies=plan.offload.replay_start_copies,
    )


def routed_decode(plan: Plan) -> bool:
    """Whether the plan's step is a decode step with routed MoE layers."""
    return (plan.experts is not None and plan.experts.fetch_slots > 0 and plan.prediction.decode_step_ms is not None
            and gathers(plan))


def show_plan(plan: Plan, console: Console, *, layer_table: bool = True) -> None:
    """Print the verdict, summary, the serving chart, memory, per-layer table, timeline and stalls."""
    simulation = resimulate(plan)
    console.print(Text(verdict(plan), style="bold"))
    console.print(_summary(plan))
    if plan.serving is not None:
        console.print(serving_chart(plan, chart_bar_columns(console.width)))
    if plan.adapters is not None:
        console.print(adapters_table(plan))
    if plan.experts is not None:
        console.print(experts_text(plan))
    console.print(_memory(plan))
    if layer_table:
        console.print(_layer_table(plan, simulation))
    console.print(_timeline(plan, simulation, max(20, min(TIMELINE_COLUMNS, console.width - 12))))
    console.print(_stalls(plan, simulation))
    console.print(provenance_table(plan))


def verdict(plan: Plan) -> str:
    """The plan in one or two sentences: what it serves or runs, how fast, and against what."""
    offloaded, num_layers = len(plan.offload.layers), plan.model.num_layers
    where = f"{plan.hardware.profile} ({format_bytes(plan.memory.gpu_memory_bytes)} of GPU memory)"
    placement = f"offloading {offloaded} of {num_layers} layers" if offloaded else "with every weight resident"
    if plan.experts is not None and plan.experts.fetch_slots:
        num_routed = len(plan.experts.routed_layers)
        placement = (f"fetching routed experts in {num_routed} of {num_layers} layers"
                     + (f", offloading {offloaded} whole" if offloaded else ""))
    prediction, workload = plan.prediction, plan.workload
    if plan.serving is None:
        step = "decode step" if prediction.decode_step_ms is not None else "step"
        return (f"{counted(workload.tokens_per_step, 'token')} per {step} in "
                f"{counted(workload.sequences_per_step, 'sequence')} on "
                f"{where} {placement}: {format_ms(prediction.step_ms)} predicted, x{_slowdown(plan):.2f} the "
                "all-resident step." + _whole_gpu_words(plan) + _engine_words(plan))
    text = (f"Serves {counted(workload.concurrency, 'sequence')} of up to {workload.context_tokens} tokens on {where} "
            f"{placement}: {format_rate(prediction.decode_tokens_per_s)} decode tokens/s, "
            f"{format_ms(prediction.decode_step_ms)} per token; a {workload.chunk_tokens}-token prefill chunk takes "
            f"{format_ms(prediction.prefill_chunk_ms)}.")
    return text + " " + _against_no_offload(plan) + _engine_words(plan)


#: what make --for holds a plan to, per engine
ENGINE_LIMITS = {"vllm": ("vLLM", "whole layers only, no routed experts"),
                 "sglang": ("SGLang", "the experts of whole layers, its prefetch offloader's one family")}


def _engine_words(plan: Plan) -> str:
    """make --for ENGINE: say the plan was made within what that engine expresses."""
    if plan.inputs.engine not in ENGINE_LIMITS:
        return ""
    name, limits = ENGINE_LIMITS[plan.inputs.engine]
    limits = read_at_use.engine_limits(plan) if plan.offload.mechanism == "read_at_use" else limits
    return f" Planned for {name} (make --for {plan.inputs.engine}: {limits}): export gives exactly this plan."


def _whole_gpu_words(plan: Plan) -> str:
    """Where no --budget or --trigger was given, the weights had the whole GPU the step leaves them: say so."""
    if plan.inputs.budget is not None or plan.inputs.trigger is not None:
        return ""
    return (" No --budget was given: the weights had all the GPU memory the step's KV cache, activations and "
            f"CUDA context leave ({format_bytes(plan.memory.budget_bytes)}).")


def _against_no_offload(plan: Plan) -> str:
    serving = plan.serving
    if serving.no_offload_concurrency is None:
        return "Offloading nothing does not fit at any concurrency searched."
    routed = plan.experts is not None and plan.experts.fetch_slots
    if not plan.offload.layers and not routed:
        return (f"Offloading would not serve more than {OFFLOAD_MARGIN_SHARE:.0%} more tokens/s here (the margin "
                "past the predictions' measured error it must clear), so every weight stays resident.")
    ratio = plan.prediction.decode_tokens_per_s / serving.no_offload_tokens_per_s
    return (f"Offloading nothing fits at most {counted(serving.no_offload_concurrency, 'sequence')} for "
            f"{format_rate(serving.no_offload_tokens_per_s)} tokens/s "
            f"({format_ms(serving.no_offload_step_ms)} per token): "
            f"this plan gives x{ratio:.2f} the tokens/s.")


def _slowdown(plan: Plan) -> float:
    prediction = plan.prediction
    return prediction.step_ms / prediction.resident_step_ms if prediction.resident_step_ms else 1.0


#: the hardware figures a prediction rests on, as (plan.hardware field, label, how to show its value)
PROVENANCE_FIGURES = (
    ("gpu_memory_bytes", "GPU memory", format_bytes),
    ("hbm_bytes_per_s", "HBM bandwidth", lambda value: f"{format_rate(value / 1e12)} TB/s"),
    ("bf16_flops_per_s", "bf16 rate", lambda value: f"{format_rate(value / 1e12)} TFLOP/s"),
    ("fp8_flops_per_s", "fp8 rate", lambda value: f"{format_rate(value / 1e12)} TFLOP/s"),
    ("compute_efficiency", "compute efficiency", format_rate),
    ("h2d_bytes_per_s", "host link (H2D)", lambda value: f"{value / 1e9:.1f} GB/s"),
    ("copy_overhead_us", "per-copy overhead", lambda value: f"{format_rate(value)} us"),
    ("reserve_bytes", "reserve", format_bytes),
    ("host_memory_bytes", "host memory", format_bytes),
)


def provenance_table(plan: Plan) -> Table:
    """Where each hardware figure the prediction rests on comes from (datasheet, measured, fitted, assumed), with
    the profile's note: a GB200's link figure is GB300's, shared by two GPUs. The plan records the values; the
    sources are read from its profile, and a figure the profile no longer gives is said to be the plan's own."""
    from planner.errors import ProfileError
    from planner.source.profile import load_profile

    try:
        profile = load_profile(plan.inputs.gpu)
    except ProfileError:
        profile = None
    table = Table(title=f"Hardware figures of {plan.hardware.profile} (d = datasheet, m = measured, f = fitted, "
                        "a = assumed)", title_justify="left")
    for name in ("figure", "value", "", "source"):
        table.add_column(name, overflow="fold")
    for key, label, shown in PROVENANCE_FIGURES:
        value = getattr(plan.hardware, key)
        if value is None:
            continue
        figure = getattr(profile, key, None) if profile is not None else None
        if figure is None or figure.value != value:
            table.add_row(label, shown(value), "?", "the plan's own figure: its profile "
                          + ("cannot be read here" if profile is None else "now gives another"))
            continue
        table.add_row(label, shown(value), figure.source[0], figure.note or figure.source)
    return table


def _link_source(plan: Plan) -> str:
    """' (assumed: ...)' after the link figure when its profile does not have it from a datasheet or a measurement:
    the figure most predictions rest on should not pass for a measured one."""
    from planner.errors import ProfileError
    from planner.source.profile import load_profile

    try:
        figure = load_profile(plan.inputs.gpu).h2d_bytes_per_s
    except ProfileError:
        return " (source unknown: the plan's profile cannot be read here)"
    if figure.value != plan.hardware.h2d_bytes_per_s:
        return " (the plan's own figure: its profile now gives another)"
    if figure.source in ("datasheet", "measured"):
        return ""
    return f" ({figure.source}: see Hardware figures below)"


def tp_summary(plan: Plan) -> str:
    """A --tp plan: what its figures count, and its tokens/s per GPU."""
    row = tp_row(plan)
    return (f"one rank of {plan.inputs.tp} GPUs as vLLM shards the model: bytes, KV cache and pinned host memory "
            f"are the rank's; {row.tokens_per_s:,.1f} tokens/s for the {plan.inputs.tp} GPUs, "
            f"{row.tokens_per_s_per_gpu:,.1f} per GPU")


def _summary(plan: Plan) -> Table:
    model, offload, prediction = plan.model, plan.offload, plan.prediction
    table = Table(title="Plan", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("model", f"{model.source}" + (f" @ {model.revision}" if model.revision else ""))
    table.add_row("layers", f"{model.num_layers} in {model.stack}, {format_bytes(model.layer_bytes)}; "
                            f"{format_bytes(model.non_layer_bytes)} outside the stack; "
                            f"{format_bytes(model.unused_bytes)} unused")
    table.add_row("hardware", f"{plan.hardware.profile}: {format_bytes(plan.hardware.gpu_memory_bytes)}, "
                              f"link {plan.hardware.h2d_bytes_per_s / 1e9:.1f} GB/s{_link_source(plan)}")
    if plan.inputs.tp > 1:
        table.add_row("tensor parallel", tp_summary(plan))
    table.add_row("workload", f"{counted(plan.workload.tokens_per_step, 'token')}/step in "
                              f"{counted(plan.workload.sequences_per_step, 'sequence')}, context "
                              f"{plan.workload.context_tokens}; {plan.workload.compute_source}"
                              + _estimate_spread(plan)
                              + (f"; CUDA-graph replays of {_replay_steps()} ({_replay_boundary(plan)})"
                                 if plan.workload.cuda_graph else ""))
    if offload.mechanism == "read_at_use":
        table.add_row("offload", read_at_use.offload_words(plan))
    elif offload.layers:
        params = " ".join(offload.params) if offload.params else "whole layers"
        table.add_row("offload", f"{len(offload.layers)} of {model.num_layers} layers ({params}); "
                                 f"group size {offload.group_size}, {offload.num_in_group} per group, "
                                 f"prefetch {offload.prefetch_step}")
    elif plan.experts is not None and plan.experts.fetch_slots:
        table.add_row("offload", f"routed experts of {len(plan.experts.layers)} MoE layers (see Experts); no layer "
                                 "streams whole")
    else:
        table.add_row("offload", "nothing: every weight fits the budget")
    table.add_row("predicted step", f"{format_ms(prediction.step_ms)} "
                                    f"(all resident {format_ms(prediction.resident_step_ms)}, "
                                    f"x{_slowdown(plan):.2f}); stall {format_ms(prediction.stall_ms)}; "
                                    f"link floor {format_ms(prediction.link_floor_ms)}, "
                                    f"link busy {100 * prediction.link_busy_share:.0f}%")
    if prediction.prefill_chunk_ms is not None and plan.serving is not None:
        table.add_row("prefill chunk", f"{plan.workload.chunk_tokens} tokens of a new sequence: "
                                       f"{format_ms(prediction.prefill_chunk_ms)} with this placement")
    table.add_row("bound by", _bound_by(plan))
    return table


def _replay_boundary(plan: Plan) -> str:
    """How the copies wrapping into the next replay are split between this replay's end and the next's start."""
    joined, left = PrefetchSchedule(len(plan.offload.layers), plan.offload.prefetch_step).replay_boundary(
        plan.offload.replay_start_copies) if plan.offload.layers else ((), ())
    if not left:
        return "copies into the next replay join at each replay's end"
    def layers(positions):
        return "layer" + "s" * (len(positions) > 1) + " " + ", ".join(str(plan.offload.layers[k]) for k in positions)
    joined_text = f"{layers(joined)} join at each replay's end" if joined else "nothing joins at a replay's end"
    return f"{joined_text}; {layers(left)} copied as the next replay begins, so the link works while it computes"


def _bound_by(plan: Plan) -> str:
    prediction = plan.prediction
    if routed_decode(plan) and prediction.stall_ms >= 0.01 * prediction.step_ms:
        return ("the routed fetch: each MoE layer's experts wait for their fetch after its router; more resident "
                "experts (more GPU memory) or a faster link help")
    if not plan.offload.layers or prediction.stall_ms < 0.01 * prediction.step_ms:
        return "compute: copies hide behind compute"
    if plan.offload.mechanism == "read_at_use":
        return read_at_use.BOUND_WORDS
    if prediction.link_floor_ms >= 0.98 * prediction.step_ms:
        return "the host link: every copy back to back; more budget is the only way faster"
    return "prefetch latency: the link is idle part of the step; a deeper prefetch or a spread-out layer set helps"


def _expert_buffer_rows(plan: Plan) -> list[tuple[str, int]]:
    """A routed plan's fetch and staging buffers (part of the weights' GPU bytes)."""
    experts = plan.experts
    if experts is None or not experts.fetch_slots:
        return []
    rows = [(f"GPU: routed-expert fetch buffer ({experts.fetch_slots} experts)", experts.fetch_buffer_bytes),
            (f"GPU: prefill staging buffer ({experts.num_experts} experts)", experts.staging_buffer_bytes)]
    if experts.gather_workspace_bytes:
        pairs = plan.workload.tokens_per_step * experts.top_k
        rows.append((f"GPU: decode gather workspace ({pairs} routed pairs' weights)", experts.gather_workspace_bytes))
    return rows


def _memory(plan: Plan) -> Table:
    memory = plan.memory
    table = Table(title="Memory", title_justify="left")
    table.add_column("where")
    table.add_column("bytes", justify="right")
    table.add_column("", justify="right")
    resident_experts, _ = routed_expert_bytes(plan)
    num_routed = len(plan.experts.routed_layers) if resident_experts else 0
    rows = [
        ("GPU: resident layer params" + (" (routed layers: all but their experts)" if num_routed else ""),
         memory.resident_layer_bytes),
        *([(f"GPU: resident experts of the {num_routed} routed layer(s)", resident_experts)] if num_routed else []),
        ("GPU: outside the stack (embeddings, norms, head)", memory.non_layer_bytes),
        (read_at_use.SLOT_WORDS if plan.offload.mechanism == "read_at_use" else
         f"GPU: {memory.num_slots} prefetch slot(s) x {format_bytes(memory.slot_bytes)}",
         memory.num_slots * memory.slot_bytes),
        *_expert_buffer_rows(plan),
        ("GPU: alignment and allocator rounding (bound)", memory.allocation_slack_bytes),
        ("GPU: total weights", memory.gpu_bytes),
        ("GPU: budget", memory.budget_bytes),
        ("host: pinned every expert of the routed layers" if num_routed else "host: pinned offloaded params",
         memory.host_pinned_bytes),
    ]
    cpu = plan.experts.cpu if plan.experts is not None else None
    if cpu is not None and cpu.host_copy_bytes:
        rows.append(("host: fp32 copy of the CPU experts (not pinned; held to host memory with the pinned)",
                     cpu.host_copy_bytes))
    if plan.adapters is not None:
        rows += [(f"GPU: {plan.adapters.num_slots} adapter slot(s) x {format_bytes(plan.adapters.slot_bytes)}",
                  plan.adapters.gpu_bytes),
                 (f"host: pinned adapters ({len(plan.adapters.items)})", plan.adapters.host_pinned_bytes)]
    if memory.total_gpu_bytes is not None:
        rows += [
            (f"GPU: KV cache ({counted(plan.workload.concurrency, 'sequence')} x "
             f"{plan.workload.context_tokens} tokens, {plan.workload.kv_dtype})", memory.kv_cache_bytes),
            (f"GPU: activations (peak of a prefill chunk or an eager decode step, {_activations_source(plan)}), "
             "workspaces, allocator rounding", memory.activation_bytes),
            (f"GPU: CUDA-graph pool (a captured decode step, {_activations_source(plan)})",
             memory.cuda_graph_pool_bytes),
            (f"GPU: outside the allocator (CUDA context and kernels, {_context_source(plan)}; page tables of pinned "
             "host memory" + (f"; NCCL's buffers, {_nccl_source(plan)}" if plan.inputs.tp > 1 else "") + ")",
             memory.cuda_context_bytes),
            ("GPU: total", memory.total_gpu_bytes),
            ("GPU: memory the plan must fit", memory.gpu_memory_bytes),
        ]
    if plan.hardware.host_memory_bytes is not None:
        rows.append(("host: memory for pinned params (--host-memory or profile)", plan.hardware.host_memory_bytes))
    for label, value in rows:
        table.add_row(label, f"{value:,}", format_bytes(value))
    if memory.total_gpu_bytes is not None and plan.inputs.concurrency is not None:
        table.caption = _peak_spread(plan)
        table.caption_justify = "left"
    return table


#: a serving plan's measured peak over its predicted total GPU memory in the conformance sweep of 2026-11-28 on
#: the H200 (benchmarks/2026-11-28-conformance-captures-h200.md: 12 architectures, 56 serving arms): 20 estimated
#: plans 0.867-0.987 (the captures booked by factors over the estimated step, which cover the architectures whose
#: captures ran 2-2.9x their estimate), 36 with make --measure 0.921-1.000 (PhiMoE's whole-layer plan 3 MiB over)
PEAK_SPREAD_ESTIMATED = (0.87, 0.99)
PEAK_SPREAD_MEASURED = (0.92, 1.00)


def _peak_spread(plan: Plan) -> str:
    """How close a serving plan's GPU total came to the peaks measured of such plans."""
    measured = _activations_source(plan) == "measured"
    low, high = PEAK_SPREAD_MEASURED if measured else PEAK_SPREAD_ESTIMATED
    how = "with measured steps and captures" if measured else "with estimated steps and captures"
    return (f"Serving plans {how} peaked at {low:.2f}-{high:.2f} of their GPU total in the 2026-11-28 conformance "
            "sweep (H200, 12 architectures)" + ("" if measured else "; make --measure books the captures measured "
                                                                     f"and came to {PEAK_SPREAD_MEASURED[0]:.2f}-"
                                                                     f"{PEAK_SPREAD_MEASURED[1]:.2f}") + ".")


def _activations_source(plan: Plan) -> str:
    """How a serving plan's activations and captures were booked: measured on a GPU (make --measure), else
    estimated from the model's shapes."""
    return "measured" if plan.inputs.measure and plan.inputs.concurrency is not None else "estimated"


#: how far measured steps ran from estimated plans' predictions in the conformance sweeps of 2026-11-28: bf16 models'
#: decode steps, weights plans' steps and serving prefill chunks ran 0.90-1.40x on the H100
#: (benchmarks/2026-11-28-conformance-routed-h100.md, 43 figures) and 0.93-1.43x on the H200
#: (benchmarks/2026-11-28-conformance-h200.md, 46 figures; the high end a Gemma-2 prefill plan's step); the FP8
#: model's, since its dequantizing passes are priced at their own rate, 1.00-1.14x (H200, 4 figures)
ESTIMATE_SPREAD_BF16 = (0.90, 1.43)
ESTIMATE_SPREAD_FP8 = (1.00, 1.14)


def _estimate_spread(plan: Plan) -> str:
    """For an estimated plan, how far measured steps ran from such estimates."""
    if not plan.workload.compute_source.startswith("estimated"):
        return ""
    fp8 = any(dtype.startswith("F8") for dtype in plan.model.dtype_bytes)
    low, high = ESTIMATE_SPREAD_FP8 if fp8 else ESTIMATE_SPREAD_BF16
    kind = "FP8" if fp8 else "bf16"
    return (f" (an estimate: measured steps of {kind} models ran {low:.2f}-{high:.2f}x of such estimates on the "
            "H100 and H200; make --measure times the layers)")


def _nccl_source(plan: Plan) -> str:
    """Where the plan's figure for NCCL's buffers on a rank came from."""
    measured = plan.hardware.nccl_bytes
    if measured is None:
        return f"{format_bytes(NCCL_BYTES_PER_RANK)} measured on two H200s"
    return f"{format_bytes(measured)} measured (make --tp N --measure, or calibrate)"


def _context_source(plan: Plan) -> str:
    """Where the plan's figure for the CUDA context and loaded kernels comes from."""
    if plan.inputs.measure and plan.hardware.cuda_context_bytes is not None:
        return "measured by make --measure"
    if plan.hardware.cuda_context_bytes is not None:
        return f"{plan.hardware.profile}'s figure"
    return "the planner's default: make --measure or calibrate measures it"


def _layer_table(plan: Plan, simulation: Simulation) -> Table:
    table = Table(title="Layers (steady-state step)", title_justify="left")
    for name in ("layer", "where", "bytes", "moved", "compute", "copy", "waits"):
        table.add_column(name, justify="right" if name not in ("where",) else "left")
    offloaded = set(plan.offload.layers)
    fetch_ms = _fetch_ms_by_layer(plan)
    # a step moves an offloaded layer's selected params, a routed layer's expected fetch (not every expert it
    # leaves on the host)
    moved = {row.index: row.offloaded_bytes for row in plan.layers}
    if fetch_ms:
        moved.update({row.index: row.expected_fetched_bytes for row in plan.experts.routed_layers})
    for row in plan.layers:
        stall = simulation.layer_stall_ms[row.index]
        where = (Text("offloaded", style="cyan") if row.index in offloaded else Text("routed", style="magenta")
                 if row.index in fetch_ms else Text("resident", style="green"))
        copy = (format_ms(row.copy_ms) if row.index in offloaded else format_ms(fetch_ms[row.index])
                if row.index in fetch_ms else "-")
        table.add_row(
            str(row.index),
            where,
            format_bytes(row.bytes),
            format_bytes(moved[row.index]) if moved[row.index] else "-",
            format_ms(row.compute_ms),
            copy,
            Text(format_ms(stall), style="red") if stall > 1e-6 else "-",
        )
    return table


def _fetch_ms_by_layer(plan: Plan) -> dict[int, float]:
    """Each routed layer's expected fetch per step on the link (its copy column); empty without routed layers."""
    if plan.experts is None:
        return {}
    rate = plan.experts.routed_fetch_bytes_per_s
    return {row.index: 1e3 * row.expected_fetched_bytes / rate for row in plan.experts.routed_layers}


def timeline_rows(simulation: Simulation, offloaded: set[int], columns: int = TIMELINE_COLUMNS) -> tuple[str, str]:
    """Two character rows for one step: compute (# resident, o offloaded, . waiting) and copy (= busy)."""
    step_ms = simulation.step_ms or 1.0
    compute_row, copy_row = [], []
    for column in range(columns):
        moment = (column + 0.5) * step_ms / columns
        compute_row.append(_compute_char(simulation, offloaded, moment))
        copy_row.append("=" if any(_covers(c, moment, step_ms) for c in simulation.copies) else " ")
    return "".join(compute_row), "".join(copy_row)


def _covers(interval, moment: float, step_ms: float) -> bool:
    # Copies issued late in a step may run into the next one: fold them back onto this step.
    return interval.start_ms <= moment < interval.end_ms or interval.start_ms <= moment + step_ms < interval.end_ms


def _compute_char(simulation: Simulation, offloaded: set[int], moment: float) -> str:
    for interval in simulation.compute:
        if interval.start_ms <= moment < interval.end_ms:
            return "o" if interval.layer in offloaded else ("h" if interval.layer < 0 else "#")
    return "."


def _timeline(plan: Plan, simulation: Simulation, columns: int) -> Text:
    compute_row, copy_row = timeline_rows(simulation, set(plan.offload.layers), columns)
    text = Text()
    text.append(f"One step, {format_ms(simulation.step_ms)} ({format_ms(simulation.step_ms / columns)} a column)\n",
                style="bold")
    text.append("compute |")
    for char in compute_row:
        text.append(char, style={"#": "green", "o": "cyan", ".": "red", "h": "magenta"}[char])
    text.append("|\ncopy    |")
    text.append(copy_row, style="yellow")
    link = "= copy or expert fetch on the link" if _fetch_ms_by_layer(plan) else "= copy on the link"
    text.append(f"|\n         # resident layer, o offloaded layer, . waiting for a copy, h head, {link}\n")
    return text


def _replay_steps() -> str:
    return "one step" if STEPS_PER_GRAPH == 1 else f"{STEPS_PER_GRAPH} steps"


def _stalls(plan: Plan, simulation: Simulation) -> Text:
    waits = sorted(((stall, layer) for layer, stall in enumerate(simulation.layer_stall_ms) if stall > 1e-6),
                   reverse=True)
    per_step = f" ({format_ms(simulation.join_ms)} per step)" if STEPS_PER_GRAPH > 1 else ""
    join = (f"CUDA-graph replays of {_replay_steps()} wait {format_ms(simulation.join_ms * STEPS_PER_GRAPH)} "
            f"at their end for the copies wrapping into the next{per_step}\n")
    if not waits and simulation.join_ms <= 1e-6:
        return Text("No stalls: every copy finishes before its layer runs.\n", style="green")
    text = Text(f"Stalls: {len(waits)} layer(s) wait in the step shown; {format_ms(simulation.stall_ms)} per step "
                "in all, on average\n", style="red")
    if simulation.join_ms > 1e-6:
        text.append(join)
    for stall, layer in waits[:NUM_STALLS_LISTED]:
        text.append(f"  layer {layer} waits {format_ms(stall)} for its copy\n")
    if len(waits) > NUM_STALLS_LISTED:
        text.append(f"  ... and {len(waits) - NUM_STALLS_LISTED} more\n")
    return text
