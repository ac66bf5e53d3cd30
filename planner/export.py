"""``export``: the vLLM or SGLang flags that run a plan, and the plan's prediction restated for them.

Engine facts, from the engines' sources (vLLM's ``vllm/model_executor/offloader/``, its PRs 29941 and 34535;
SGLang's OffloaderV2 and its model code):

- Both engines offload layer i when ``i % G >= G - K`` (``--offload-group-size G``, ``--offload-num-in-group K``),
  skip a chosen layer whose selection matches no param, and prefetch P offloaded layers ahead through P static
  slots (``--offload-prefetch-step P``), slot = position % P.
- vLLM: the prefetch backend is chosen when G > 0; its selection flag is ``--offload-params SEG ...``
  (``--cpu-offload-params`` is the same selection for the UVA backend, ``--cpu-offload-gb``). Before its
  PR 54975 (fixed 2026-09) slot = position % P corrupts weights when P does not divide N.
- SGLang (OffloaderV2): ``--offload-mode cpu`` copies from pinned host memory (``shm_cpu`` and ``sharded_gpu``
  share one copy between data-parallel ranks and need TP size 1); its selection flag is
  ``--offload-param-names SEG ...``, except that the DeepSeek-V2/V3 model code (Kimi-K2 included) always
  offloads the routed experts. Its open PR asserts that P divides N.
- Both match segments against the engine's own param names, where some checkpoint names are fused: q/k/v_proj
  into qkv_proj, gate/up_proj into gate_up_proj, per-expert tensors (experts.E.w1/w3) into one
  experts.w13_weight per layer.

LoRA adapters (plans made with --adapter): vLLM takes ``--enable-lora --max-loras N`` (adapters in one batch, its
GPU slots), ``--max-cpu-loras M`` (adapters kept in CPU memory, at least N), ``--max-lora-rank R`` (one of
VLLM_LORA_RANKS) and ``--lora-modules NAME=PATH ...``; SGLang takes ``--enable-lora --lora-paths NAME=PATH ...``,
``--max-loras-per-batch N`` (GPU slots) and ``--max-loaded-loras M`` (adapters in CPU memory, at least N); its
``--enable-lora-overlap-loading`` copies adapters behind compute, the plan's pipelined case (vLLM's
``vllm/config/lora.py`` LoRAConfig; SGLang's docs, advanced_features/lora).

With tensor parallelism each rank holds its share of every layer and copies it over its own link. A plan made
with ``make --tp N`` is one rank already (planner.tensor_parallel: vLLM's sharding, the all-reduces): export
restates it exactly. A one-GPU plan exported with --tp is re-simulated with per-rank copies and per-rank compute
(1/TP each; all-reduces not modelled), an approximation its note says.
Both engines capture decode in CUDA graphs of one step each and join the wrapped copies at every step's end;
a plan made with --cuda-graph is predicted so (offload-plan's own replays run STEPS_PER_GRAPH steps, one today).

Each engine's flag names, the plan field each flag carries and what the engine cannot express are one entry of
planner.engine_targets (EngineTarget); this module fills an entry in from a plan and has no per-engine branch.
"""

import math
import shlex
from dataclasses import dataclass

from planner.engine_memory import SHARE_DECIMALS, describe
from planner.engine_plan import Loss, expressible_plan
from planner.engine_targets import ENGINES, OFFLOAD_FLAGS, TARGETS, EngineTarget, check_segment, flag_values
from planner.errors import PlanError, UsageError
from planner.plan import Plan
from planner.schedule import PrefetchSchedule, offloaded_by_rule
from planner.search import copy_ms_of
from planner.simulate import join_every_steps_for, simulate
from planner.units import format_bytes, format_ms

#: far above any tensor-parallel group (a node has 8 GPUs, an NVL72 rack 72); beyond it --tp is a typo
MAX_TP_SIZE = 1024
@dataclass(frozen=True, kw_only=True)
class Prediction:
    """One step of the exported configuration, per rank."""

    step_ms: float
    stall_ms: float
    link_floor_ms: float
    copy_bytes_per_step: int
    gpu_bytes: int
    host_pinned_bytes: int
    num_slots: int


@dataclass(frozen=True, kw_only=True)
class Export:
    """The flags for one engine, what they approximate, and the prediction they give."""

    engine: str
    tp_size: int
    flags: tuple[str, ...]
    prefetch_step: int
    #: explanations for people: what each flag means here, assumptions and approximations
    notes: tuple[str, ...]
    #: things that make the flags wrong on some engine builds
    warnings: tuple[str, ...]
    plan_prediction: Prediction
    prediction: Prediction
    #: the plan's own TP size (make --tp N: its figures are one rank's already)
    planned_tp: int = 1
    #: what the engine cannot express of the plan and the predicted tokens/s it loses, one line each (empty:
    #: the flags are the plan exactly)
    losses: tuple[str, ...] = ()

    def command_fragment(self) -> str:
        """The flags as one shell fragment."""
        return shlex.join(self.flags)


def export_plan(plan: Plan, engine: str, *, tp_size: int = 1, exact: bool = False) -> Export:
    """Flags for ``engine``: the plan's own, or where the engine cannot express it (routed experts; SGLang's P
    that does not divide N) the nearest plan it can, with the loss in predicted tokens/s (``losses``); with
    ``exact``, PlanError instead of any loss. PlanError where the engine cannot express even a nearby plan."""
    if engine not in ENGINES:
        raise UsageError(f"--to {engine!r} is not an engine offload-plan exports to; choose {' or '.join(ENGINES)}")
    if not 1 <= tp_size <= MAX_TP_SIZE:
        raise UsageError(f"--tp {tp_size}: the tensor-parallel size must be from 1 to {MAX_TP_SIZE}")
    target = TARGETS[engine]
    tp_size, divisor = _planned_tp(plan, tp_size)
    source = plan
    plan, loss = expressible_plan(source)
    losses: list[str] = []
    if loss is not None:
        if exact:
            raise PlanError(f"{loss.statement(target.display_name)}; drop --exact to export that plan, or serve "
                            "this one with offload-plan run")
        losses.append(loss.statement(target.display_name))
    notes: list[str] = []
    warnings: list[str] = []
    expert_note = experts_note(source, target) if loss is None else f"experts: {target.experts_note}"
    if expert_note is not None:
        notes.append(expert_note)
    flags = [target.tp_flag, str(tp_size)] if tp_size > 1 else []
    prefetch_step = plan.offload.prefetch_step
    if plan.offload.layers:
        check_rule(plan)
        prefetch_step = _engine_prefetch_step(plan, target, exact, losses, warnings)
        flags += _offload_flags(plan, target, prefetch_step)
        notes.append(target.mode_note)
        flags += _params_flags(plan, target, notes)
    else:
        notes.append("the plan offloads nothing: serve without offload flags")
    if plan.serving is not None:
        flags += _serving_flags(plan, target, tp_size, divisor, notes, warnings)
    if plan.adapters is not None:
        flags += adapter_flags(plan, target, notes)
    if tp_size > 1:
        notes.append(_tp_note(plan, tp_size) if divisor > 1 else _rank_plan_note(plan))
    if plan.workload.cuda_graph and plan.offload.layers:
        notes.append(f"{engine} replays one decode step per CUDA graph and joins the copies that wrap into the next "
                     "step at every step's end: predicted so")
    plan_prediction = recorded_prediction(source) if loss is not None else predict(
        plan, 1, plan.offload.prefetch_step, join_every_steps_for(plan.workload.cuda_graph),
        plan.offload.replay_start_copies)
    return Export(engine=engine, tp_size=tp_size, flags=tuple(flags), prefetch_step=prefetch_step, notes=tuple(notes),
                  warnings=tuple(warnings), plan_prediction=plan_prediction,
                  prediction=predict(plan, divisor, prefetch_step), planned_tp=plan.inputs.tp,
                  losses=tuple(losses))


def recorded_prediction(plan: Plan) -> Prediction:
    """The plan's own prediction section as a Prediction (a routed plan, which predict() cannot re-simulate)."""
    prediction, memory = plan.prediction, plan.memory
    return Prediction(step_ms=prediction.step_ms, stall_ms=prediction.stall_ms,
                      link_floor_ms=prediction.link_floor_ms, copy_bytes_per_step=prediction.copy_bytes_per_step,
                      gpu_bytes=memory.gpu_bytes, host_pinned_bytes=memory.host_pinned_bytes,
                      num_slots=memory.num_slots)


def experts_note(plan: Plan, target: EngineTarget) -> str | None:
    """What the engine expresses of a whole-layer plan's experts section (a routed plan's loss is stated by
    planner.engine_plan instead)."""
    experts = plan.experts
    if experts is None or experts.fetch_slots != 0:
        return None
    here = next((p for p in experts.points if p.concurrency == plan.workload.concurrency), None)
    routed = (f" (routed experts would take {format_ms(here.routed_step_ms)} per step here)"
              if here is not None and here.routed_step_ms is not None else "")
    return f"experts: the plan streams whole layers, as {target.name} can{routed}; {target.experts_note}"


def check_rule(plan: Plan) -> None:
    """The engines take G and K, not a layer list: the plan's layers must be what the rule gives."""
    offload = plan.offload
    rule = offloaded_by_rule(plan.model.num_layers, offload.group_size, offload.num_in_group) \
        if offload.num_in_group <= offload.group_size else ()
    # Layers the rule picks but that hold no selected params are skipped by the engines as by the planner.
    expected = tuple(i for i in rule if i in offload.layers or not _selects_nothing(plan, i))
    if expected != offload.layers:
        raise PlanError(
            f"offload.layers {list(offload.layers)} is not what the engines' rule gives for G={offload.group_size}, "
            f"K={offload.num_in_group} (layer i when i % G >= G - K: {list(expected)}); the engines take G, K and P, "
            "not a list of layers: regenerate the plan with make instead of editing offload.layers"
        )


def _selects_nothing(plan: Plan, index: int) -> bool:
    """A layer none of whose params offload.params selects (its row records the selected bytes)."""
    return plan.layers[index].selected_bytes == 0


def _offload_flags(plan: Plan, target: EngineTarget, prefetch_step: int) -> list[str]:
    """G, K and P as the engine's rule takes them, then its mode."""
    offload = plan.offload
    values = {"group_size": str(offload.group_size), "num_in_group": str(offload.num_in_group),
              "prefetch_step": str(prefetch_step)}
    return flag_values(OFFLOAD_FLAGS, values) + list(target.offload_mode_flags)


def _engine_prefetch_step(plan: Plan, target: EngineTarget, exact: bool, losses: list, warnings: list) -> int:
    """The plan's P, or for an engine that asserts P divides N (SGLang) the nearest P that does when the plan's
    does not."""
    num_offloaded, prefetch_step = len(plan.offload.layers), plan.offload.prefetch_step
    if num_offloaded % prefetch_step == 0:
        return prefetch_step
    divisor = nearest_divisor(plan, prefetch_step)
    restated = predict(plan, 1, divisor).step_ms
    if not target.prefetch_must_divide:
        if target.nondividing_warning is not None:
            warnings.append(target.nondividing_warning.format(prefetch_step=prefetch_step, num_offloaded=num_offloaded,
                                                              divisor=divisor, step=format_ms(restated)))
        return prefetch_step
    if exact:
        raise PlanError(
            f"{target.display_name} asserts that P divides the number of offloaded layers, and P={prefetch_step} does "
            f"not divide {num_offloaded}; drop --exact to export P={divisor}, or make the plan with --prefetch-step "
            f"{divisor}"
        )
    loss = Loss(what=f"the prefetch depth P={prefetch_step} (it asserts that P divides the {num_offloaded} offloaded "
                     f"layers); it gets P={divisor}, the nearest divisor within the plan's budget",
                num_tokens=plan.workload.tokens_per_step, plan_step_ms=plan.prediction.step_ms,
                engine_step_ms=restated)
    losses.append(loss.statement(target.display_name))
    return divisor


def nearest_divisor(plan: Plan, prefetch_step: int) -> int:
    """The divisor of N nearest to P whose slots fit the plan's budget (ties: fewer slots)."""
    num_offloaded = len(plan.offload.layers)
    fitting = [d for d in range(1, num_offloaded + 1)
               if num_offloaded % d == 0 and _gpu_bytes(plan, d) <= plan.memory.budget_bytes]
    if not fitting:  # a plan whose weights already exceed its budget (make never writes one; the reader refuses it)
        raise PlanError(f"no divisor of the {num_offloaded} offloaded layers fits the plan's budget; regenerate the "
                        "plan with make")
    return min(fitting, key=lambda d: (abs(d - prefetch_step), d))


def _gpu_bytes(plan: Plan, prefetch_step: int) -> int:
    """The plan's GPU weights with the slots of ``prefetch_step`` instead of its own."""
    num_offloaded = len(plan.offload.layers)
    slots = PrefetchSchedule(num_offloaded, prefetch_step).num_slots if num_offloaded else 0
    return plan.memory.gpu_bytes + (slots - plan.memory.num_slots) * plan.memory.slot_bytes


def _params_flags(plan: Plan, target: EngineTarget, notes: list) -> list[str]:
    """The selection flag, or an error when the engine cannot say the plan's selection."""
    segments = plan.offload.params
    for segment in segments:
        check_segment(segment)
    architecture = plan.model.architecture
    if architecture in target.experts_only_architectures:
        if segments != ("experts",):
            raise PlanError(
                f"{target.display_name}'s {architecture} code offloads only the routed experts of each offloaded "
                f"layer, but this plan moves {' '.join(segments) or 'whole layers'}: make the plan with --params "
                "experts"
            )
        notes.append(f"{target.display_name}'s {architecture} code offloads the routed experts (experts.w13_weight, "
                     "w2_weight) itself: no selection flag; their FP8 block scales stay on the GPU")
        return []
    if not segments:
        return []
    flag = target.params_flag
    notes.append(f"{flag} matches whole dot-separated segments of the engine's param names, as the plan did of the "
                 f"checkpoint's: {' '.join(segments)!r} selects the same params" + target.params_flag_caveat)
    return [flag, *segments]


def adapter_flags(plan: Plan, target: EngineTarget, notes: list) -> list[str]:
    """The engine's LoRA settings for the plan's adapters: slots, the host pool (every adapter) and the modules."""
    adapters = plan.adapters
    rank = adapters.max_rank
    if target.lora_ranks is not None:
        rank = next((r for r in target.lora_ranks if r >= adapters.max_rank), None)
        if rank is None:
            raise PlanError(f"the adapters' rank {adapters.max_rank} is above the {target.lora_ranks[-1]} "
                            f"{target.display_name}'s --max-lora-rank accepts; {target.lora_rank_fix}, or use "
                            "adapters of a lower rank")
        if rank != adapters.max_rank:
            notes.append(f"--max-lora-rank {rank}: {target.display_name} accepts "
                         f"{', '.join(map(str, target.lora_ranks))}, so the adapters' rank {adapters.max_rank} is "
                         f"rounded up; {target.display_name} sizes every slot at that rank for every module it "
                         "supports, more than the plan's slot of the largest adapter")
    values = {"slots": str(adapters.num_slots), "pool": str(len(adapters.items)), "rank": str(rank),
              "modules": [f"{row.name}={row.source}" for row in adapters.items]}
    notes.append(
        f"adapters: {adapters.num_slots} GPU slot(s) of {format_bytes(adapters.slot_bytes)} and all "
        f"{len(adapters.items)} adapter(s) in host memory ({format_bytes(adapters.host_pinned_bytes)}); relative paths "
        "are read from the folder the engine starts in. A batch missing "
        f"{adapters.num_missing} adapter(s) waits {format_ms(adapters.blocking_wait_ms)} when loading blocks"
        + target.lora_loading_note.format(first=format_ms(adapters.pipelined_first_wait_ms),
                                          last=format_ms(adapters.pipelined_last_wait_ms))
    )
    return flag_values(target.lora_flags, values)


def _serving_flags(plan: Plan, target: EngineTarget, tp_size: int, divisor: int, notes: list,
                   warnings: list) -> list[str]:
    """Concurrency, context, the prefill chunk and the GPU memory share that leave the engine the plan's KV cache
    per rank of ``tp_size``, by the engine's own accounting (planner.engine_memory); ``divisor``: what divides the
    plan's figures into one rank's (1 for a make --tp plan)."""
    workload = plan.workload
    memory = target.memory(plan, tp_size, divisor)
    values = {"concurrency": str(workload.concurrency), "context_tokens": str(workload.context_tokens),
              "chunk_tokens": str(max(workload.chunk_tokens, workload.concurrency)),
              "memory_share": f"{memory.share:.{SHARE_DECIMALS}f}"}
    flags = flag_values(target.serving_flags, values)
    kv_flag = target.kv_cache_dtype(workload.kv_dtype)
    if kv_flag is not None:
        flags += ["--kv-cache-dtype", kv_flag]
    notes.append(describe(target.memory_note, plan, tp_size, memory))
    if memory.kv_tokens < memory.needed_tokens:
        warnings.append(f"{target.display_name}'s memory accounting leaves a KV cache of {memory.kv_tokens:,} tokens "
                        f"per rank, short of the {memory.needed_tokens:,} the plan's {workload.concurrency} sequences "
                        "need: make the plan with fewer --concurrency or a shorter --context for this engine")
    return flags


def _planned_tp(plan: Plan, tp_size: int) -> tuple[int, int]:
    """(the engine's TP size, what to divide the plan's per-GPU figures by). A plan made with --tp N is one rank
    already (divide by 1): export runs it at N, and another size is refused; a one-GPU plan is halved per rank."""
    planned = plan.inputs.tp
    if planned == 1:
        return tp_size, tp_size
    if tp_size not in (1, planned):
        raise UsageError(f"the plan is one rank of TP={planned} (make --tp {planned}); export it with --tp {planned}, "
                         f"or make it again with --tp {tp_size}")
    return planned, 1


def _rank_plan_note(plan: Plan) -> str:
    tp_size = plan.inputs.tp
    return (f"TP={tp_size}: the plan is one rank of {tp_size} (make --tp {tp_size}): its weights, KV cache and pinned "
            f"host memory are the rank's as vLLM shards the model, and its step includes the all-reduces; the flags "
            "and the prediction are per rank as planned")


def _tp_note(plan: Plan, tp_size: int) -> str:
    rate_gb_per_s = plan.hardware.h2d_bytes_per_s / 1e9
    return (f"TP={tp_size}: each rank holds 1/{tp_size} of every layer and copies its share over its own link at "
            f"{rate_gb_per_s:.1f} GB/s (less where GPUs share a host link: a PCIe switch, a Grace of GB200); compute "
            f"per rank is taken as 1/{tp_size} (all-reduces not modelled). Per-rank weights are 1/{tp_size} of the "
            "plan's, which was made for one GPU: these flags may offload more than TP ranks need; make the plan with "
            f"--tp {tp_size} for exact per-rank flags")


def predict(plan: Plan, tp_size: int, prefetch_step: int, join_every_steps: int | None = None,
            replay_start_copies: int = 0) -> Prediction:
    """Re-simulate the plan's layers per rank of ``tp_size`` with ``prefetch_step``; ``join_every_steps`` and
    ``replay_start_copies`` as planner.simulate (defaults: the engines' one step per graph for a --cuda-graph
    plan, else eager, every wrapped copy joined at the step's end)."""
    if join_every_steps is None:
        join_every_steps = 1 if plan.workload.cuda_graph else 0
    offloaded = plan.offload.layers
    hardware = plan.hardware
    rank_bytes = [math.ceil(plan.layers[i].offloaded_bytes / tp_size) for i in offloaded]
    copy_ms = tuple(copy_ms_of(b, hardware.h2d_bytes_per_s, hardware.copy_overhead_us) for b in rank_bytes)
    simulation = simulate(
        layer_ms=tuple(row.compute_ms / tp_size for row in plan.layers),
        head_ms=plan.prediction.head_ms / tp_size,
        offloaded=offloaded,
        copy_ms=copy_ms,
        prefetch_step=prefetch_step,
        join_every_steps=join_every_steps,
        replay_start_copies=replay_start_copies,
    )
    schedule = PrefetchSchedule(len(offloaded), prefetch_step)
    copy_bytes = sum(b for k, b in enumerate(rank_bytes) if schedule.needs_copy(k))
    return Prediction(
        step_ms=simulation.step_ms,
        stall_ms=simulation.stall_ms,
        link_floor_ms=1e3 * copy_bytes / hardware.h2d_bytes_per_s,
        copy_bytes_per_step=copy_bytes,
        gpu_bytes=math.ceil(_gpu_bytes(plan, prefetch_step) / tp_size),
        host_pinned_bytes=math.ceil(plan.memory.host_pinned_bytes / tp_size),
        num_slots=schedule.num_slots,
    )


def describe_prediction(export: Export) -> str:
    """One sentence: the plan's step on one GPU against the exported configuration's, per rank."""
    before, after = export.plan_prediction, export.prediction
    where = f"per rank of TP={export.tp_size}" if export.tp_size > 1 else "on one GPU"
    planned = "per rank, as planned" if export.planned_tp > 1 else "on one GPU"
    return (f"predicted step {format_ms(after.step_ms)} {where} (plan: {format_ms(before.step_ms)} {planned}), "
            f"stall {format_ms(after.stall_ms)}, link floor {format_ms(after.link_floor_ms)}; GPU weights "
            f"{format_bytes(after.gpu_bytes)} and pinned host {format_bytes(after.host_pinned_bytes)} per rank")
