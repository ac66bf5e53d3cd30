"""``export``: the vLLM or SGLang flags that run a plan, and the plan's prediction restated for them.

What each released engine version accepts and which model families each offloading mechanism is wired for is
planner.engines.versions (one EngineVersion per pinned release, read from its wheel; ``--engine-version`` picks
one, the newest by default). Export writes only flags that version lists, for a model family it wires:

- The prefetch offloader (``--offload-group-size G --offload-num-in-group K --offload-prefetch-step P``; layer
  i when ``i % G >= G - K``, P layers copied ahead on a side stream). vLLM 0.33.0 wires it for every model that
  builds its layers with make_layers and selects params with ``--offload-params SEG ...``; SGLang 0.5.23 wires
  it (OffloaderV2) only in deepseek_v2.py, where the model code fixes the selection (the MoE layers' experts
  w13/w2) and a dense layer the rule picks keeps its place in the prefetch order with nothing to copy.
- Where the prefetch offloader is not wired (SGLang for Llama, Qwen, Mixtral, Gemma, gpt-oss), the mechanism the
  engine has: ``--cpu-offload-gb N`` (SGLang's OffloaderV1): the first N GiB of layer params, layer 0 onward, in
  pinned host memory, each copied to the GPU inside its layer's forward on the compute stream. Every offloaded
  byte is read at every step behind no compute, so the prediction is restated for it: each layer's compute
  plus the copy of its offloaded bytes at the plan's own link rate. N is the fewest whole GiB whose GPU weights
  fit within the plan's own GPU weights (every offloaded byte costs step time, so fewer is faster).
- Both engines match selection segments against the engine's own param names, where some checkpoint names are
  fused: q/k/v_proj into qkv_proj, gate/up_proj into gate_up_proj, per-expert tensors (experts.E.w1/w3) into
  one experts.w13_weight per layer (make refuses such a selection with --for; export refuses it always).

LoRA adapters (plans made with --adapter): vLLM takes ``--enable-lora --max-loras N`` (adapters in one batch, its
GPU slots), ``--max-cpu-loras M`` (adapters kept in CPU memory, at least N), ``--max-lora-rank R`` (one of
VLLM_LORA_RANKS) and ``--lora-modules NAME=PATH ...``; SGLang takes ``--enable-lora --lora-paths NAME=PATH ...``,
``--max-loras-per-batch N`` (GPU slots) and ``--max-loaded-loras M`` (adapters in CPU memory, at least N); its
``--enable-lora-overlap-loading`` copies adapters behind compute, the plan's pipelined case (vLLM's
``vllm/config/lora.py`` LoRAConfig; SGLang's ``arg_groups/lora_hook.py``).

With tensor parallelism each rank holds its share of every layer and copies it over its own link. A plan made
with ``make --tp N`` is one rank already (vLLM's sharding, the all-reduces: planner.model.tensor_parallel): export
restates it exactly. A one-GPU plan exported with --tp N is checked as make --tp N checks it (the plan's
checkpoint headers split over N ranks: heads, KV heads, FP8 blocks), then re-simulated with per-rank copies and
per-rank compute (1/N each; all-reduces not modelled), an approximation its note says.
Both engines capture decode in CUDA graphs of one step each and join the wrapped copies at every step's end;
a plan made with --cuda-graph is predicted so (offload-plan's own replays run STEPS_PER_GRAPH steps, one today).

Each engine's flag names and the wording of its notes are one entry of planner.engines.targets (EngineTarget);
this module fills an entry in from a plan and the version's data and has no per-engine branch. The step each
configuration is predicted to run is planner.views.export_prediction.
"""

import functools
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from planner.engines.memory import SHARE_DECIMALS, describe
from planner.engines.plan import Loss, expressible_plan
from planner.engines.targets import ENGINES, OFFLOAD_FLAGS, TARGETS, EngineTarget, check_segment, flag_values
from planner.engines.versions import EngineVersion, engine_version, flag_problems
from planner.errors import OffloadPlanError, PlanError, UsageError, cut, shown
from planner.make.inputs import regenerate_command
from planner.model.tensor_parallel import MAX_TP_SIZE
from planner.plan.schema import Plan
from planner.search.schedule import offloaded_by_rule
from planner.search.simulate import join_every_steps_for
from planner.units import format_bytes, format_ms
from planner.views.export_prediction import Prediction, predict, read_at_use, read_at_use_layers, recorded_prediction

#: FP8 weights per F32 block scale (128x128 blocks)
FP8_BLOCK_ELEMENTS = 128 * 128

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
    #: the pinned engine version the flags are for (planner.engines.versions)
    engine_version: str = ""

    def command_fragment(self) -> str:
        """The flags as one shell fragment."""
        return shlex.join(self.flags)


def export_plan(plan: Plan, engine: str, *, tp_size: int = 1, exact: bool = False,
                version: str | None = None) -> Export:
    """Flags for ``engine`` at ``version`` (default: the newest pinned): the plan's own, or where that version
    cannot express it (routed experts; a family its prefetch offloader is not wired for) the nearest
    configuration it can run, with the loss in predicted tokens/s (``losses``); with ``exact``, PlanError instead
    of any loss. PlanError where the engine cannot run even a nearby configuration."""
    if engine not in ENGINES:
        raise UsageError(f"--to {engine!r} is not an engine offload-plan exports to; choose {' or '.join(ENGINES)}")
    if not 1 <= tp_size <= MAX_TP_SIZE:
        raise UsageError(f"--tp {tp_size}: the tensor-parallel size must be from 1 to {MAX_TP_SIZE}")
    release = engine_version(engine, version)
    target = TARGETS[engine]
    tp_size, divisor = _planned_tp(plan, tp_size)
    if divisor > 1:
        check_export_tp(plan, tp_size)
    source = plan
    plan, routed = expressible_plan(source)
    built = _Built(release=release, target=target, plan=plan, tp_size=tp_size, divisor=divisor)
    expert_note = experts_note(source, target) if routed is None else f"experts: {target.experts_note}"
    if expert_note is not None:
        built.notes.append(expert_note)
    if source.experts is not None and source.experts.cpu is not None:
        built.notes.append(cpu_experts_note(source, target))
    built.flags += [target.tp_flag, str(tp_size)] if tp_size > 1 else []
    if plan.offload.layers:
        _offload(built)
    else:
        built.notes.append("the plan offloads nothing: serve without offload flags")
    _state_loss(built, source, routed, exact)
    if plan.serving is not None:
        built.flags += _serving_flags(plan, target, release, tp_size, divisor, built.notes, built.warnings)
    if plan.adapters is not None:
        built.flags += adapter_flags(plan, target, built.notes)
    if tp_size > 1:
        built.notes.append(_tp_note(plan, tp_size) if divisor > 1 else _rank_plan_note(plan))
    if plan.workload.cuda_graph and plan.offload.layers and built.prediction is None:
        built.notes.append(f"{engine} replays one decode step per CUDA graph and joins the copies that wrap into "
                           "the next step at every step's end: predicted so")
    problems = flag_problems(built.flags, release)
    if problems:  # every flag comes from the version's own list; a value out of its range is refused here
        raise PlanError(f"{problems[0]}; the plan's figures give a value the engine refuses: make the plan again")
    plan_prediction = recorded_prediction(source) if routed is not None or built.planned else predict(
        plan, 1, plan.offload.prefetch_step, join_every_steps_for(plan.workload.cuda_graph),
        plan.offload.replay_start_copies)
    prediction = built.prediction or _engine_prediction(built, divisor)
    return Export(engine=engine, tp_size=tp_size, flags=tuple(built.flags), prefetch_step=built.prefetch_step,
                  notes=tuple(built.notes), warnings=tuple(built.warnings), plan_prediction=plan_prediction,
                  prediction=prediction, planned_tp=plan.inputs.tp, losses=tuple(built.losses),
                  engine_version=release.version)


@dataclass(kw_only=True)
class _Built:
    """An export being assembled: the flags, notes, warnings and losses so far, and how it is predicted."""

    release: EngineVersion
    target: EngineTarget
    plan: Plan
    tp_size: int
    divisor: int
    flags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    losses: list[str] = field(default_factory=list)
    prefetch_step: int = 0
    #: the prefetch order's layers where it is not the plan's offloaded layers (SGLang's V2 keeps rule layers
    #: that move nothing in it)
    positions: tuple[int, ...] | None = None
    #: layers the engine holds on the GPU beyond the P it prefetches (SGLang's V2: the one in use)
    live_extra: int = 0
    #: the share of each offloaded layer's bytes the engine moves (SGLang's V2 leaves FP8 block scales behind)
    moved_share: float = 1.0
    #: a prediction made by the mechanism itself (read at use); None: predict() from the fields above
    prediction: "Prediction | None" = None
    #: what the read-at-use mechanism cannot express of the plan, its GiB and its step at the plan's TP
    read_at_use_what: str | None = None
    read_at_use_gib: float = 0
    read_at_use_step_ms: float = 0.0
    #: the plan was made for the engine's read-at-use offloader (make --for): its own figures are the engine's
    planned: bool = False


def fp8_weight_share(plan: Plan) -> float:
    """The share of an FP8 checkpoint's expert bytes that are weights, not block scales: one F32 scale per
    128x128 block (DeepSeek-V3's and Kimi-K2's weight_block_size); 1 for a checkpoint without FP8 weights."""
    if "F8_E4M3" not in plan.model.dtype_bytes:
        return 1.0
    block = FP8_BLOCK_ELEMENTS
    return block / (block + 4)


def _engine_prediction(built: "_Built", divisor: int) -> Prediction:
    """The prefetch offloader's step per rank (``divisor``: 1 for the plan's own TP)."""
    return predict(built.plan, divisor, built.prefetch_step, positions=built.positions, live_extra=built.live_extra,
                   moved_share=built.moved_share)


def _state_loss(built: "_Built", source: Plan, routed: Loss | None, exact: bool) -> None:
    """One loss line for all the engine cannot express (routed experts, the prefetch offloader for the family):
    the plan's step against the one step the engine is predicted to run, at the plan's TP; PlanError with
    ``exact``. A routed plan's line names the make --for command that plans for the engine from the start."""
    whats = [what for what in (routed.what if routed else None, built.read_at_use_what) if what]
    if not whats:
        return
    release, engine = built.release, built.release.engine
    engine_ms = built.read_at_use_step_ms if built.read_at_use_what else _engine_prediction(built, 1).step_ms
    loss = Loss(what="; and ".join(whats), num_tokens=source.workload.tokens_per_step,
                plan_step_ms=source.prediction.step_ms, engine_step_ms=engine_ms)
    make_for = f"{_make_for(source, engine)} plans for {release.display_name} from the start" if routed else ""
    if exact:
        fix = (f"drop --exact to export that, {make_for}," if routed else
               f"drop --exact to export {release.read_at_use_flag} {built.read_at_use_gib:g},")
        raise PlanError(f"{loss.statement(release.label)}; {fix} or serve the plan with offload-plan run")
    built.losses.append(loss.statement(release.label) + (f"; {make_for}" if routed else ""))


def _make_for(plan: Plan, engine: str) -> str:
    """`make --for ENGINE` with the plan's own inputs, as one quoted command."""
    return f"`{regenerate_command(replace(plan.inputs, engine=engine), None)}`"


def _offload(built: _Built) -> None:
    """The offload flags of the mechanism the version wires for the plan's model family, or a refusal."""
    plan, release = built.plan, built.release
    architecture = plan.model.architecture
    check_rule(plan)
    if plan.offload.mechanism == "read_at_use":
        planned_read_at_use(built)
    elif release.prefetch_wired(architecture):
        _prefetch(built)
    elif release.read_at_use_wired(architecture):
        _read_at_use(built)
    else:
        raise PlanError(f"{release.label} offloads the weights of {len(release.read_at_use_architectures)} "
                        f"architectures (pinned from its {release.prefetch.source}) and "
                        f"{shown(architecture, 40) if architecture else 'this model'} is not one of them: serve the "
                        "plan with offload-plan run")


def _prefetch(built: _Built) -> None:
    """G, K, P and the selection, as the prefetch offloader takes them."""
    plan, release = built.plan, built.release
    built.prefetch_step = plan.offload.prefetch_step
    offload = plan.offload
    values = {"group_size": str(offload.group_size), "num_in_group": str(offload.num_in_group),
              "prefetch_step": str(built.prefetch_step)}
    built.flags += flag_values(OFFLOAD_FLAGS, values) + list(built.target.offload_mode_flags)
    built.notes.append(built.target.mode_note)
    built.flags += _params_flags(plan, release, built.notes)
    if plan.model.architecture in dict(release.prefetch.fixed_selection):
        built.moved_share = fp8_weight_share(plan)
    if release.prefetch.empty_layers_take_positions:
        rule = offloaded_by_rule(plan.model.num_layers, offload.group_size, offload.num_in_group)
        built.positions = rule if rule != offload.layers else None
        built.live_extra = 1
        built.notes.append(f"{release.label} allocates each offloaded layer's tensors when it copies them and frees "
                           "them after the layer runs: P layers ahead and the one in use are on the GPU at once, "
                           "one layer more than the plan's slots (predicted so)")


def _read_at_use(built: _Built) -> None:
    """The version's read-at-use mechanism (--cpu-offload-gb) for a family its prefetch offloader is not wired
    for, with the prediction restated for it."""
    plan, release, divisor = built.plan, built.release, built.divisor
    gib, prediction = read_at_use(plan, divisor, release.read_at_use_whole_gib)
    num_layers = read_at_use_layers(plan, divisor, gib)
    built.read_at_use_what = (
        f"a prefetched plan for {plan.model.architecture} (its --offload-group-size offloader is wired only for "
        f"{', '.join(release.prefetch.architectures)}); it gets {release.read_at_use_flag} {gib:g}: layers "
        f"0-{num_layers - 1} read at use, no prefetch")
    built.read_at_use_gib = gib
    built.read_at_use_step_ms = read_at_use(plan, 1, release.read_at_use_whole_gib)[1].step_ms
    built.flags += [release.read_at_use_flag, f"{gib:g}"]
    built.notes.append(f"{release.read_at_use_flag} {gib:g}: {built.target.read_at_use_note}; the plan's "
                       f"selection ({' '.join(plan.offload.params) or 'whole layers'}), G, K and P do not apply")
    built.prediction = prediction


def planned_read_at_use(built: _Built) -> None:
    """A plan made for the engine's read-at-use offloader (offload.mechanism read_at_use): its own GiB, its own
    prediction (planner.engines.read_at_use made both as the engine's source runs it)."""
    plan, release = built.plan, built.release
    if plan.inputs.engine != release.engine or built.divisor > 1:
        raise PlanError(f"the plan was made for {plan.inputs.engine}'s --cpu-offload-gb at TP {plan.inputs.tp} (make "
                        f"--for {plan.inputs.engine}); for {release.label} at TP {built.tp_size} make it again with "
                        f"--for {release.engine} --tp {built.tp_size}")
    gib = plan.offload.read_at_use_gib
    built.flags += [release.read_at_use_flag, str(gib)]
    built.notes.append(f"{release.read_at_use_flag} {gib}: {built.target.read_at_use_note}; the plan was made for "
                       "it (offload.mechanism read_at_use): its layers, bytes and step are this flag's")
    built.prediction = recorded_prediction(plan)
    built.planned = True


def experts_note(plan: Plan, target: EngineTarget) -> str | None:
    """What the engine expresses of a whole-layer plan's experts section (a routed plan's loss is stated by
    planner.engines.plan instead)."""
    experts = plan.experts
    if experts is None or experts.fetch_slots != 0:
        return None
    here = next((p for p in experts.points if p.concurrency == plan.workload.concurrency), None)
    routed = (f" (routed experts would take {format_ms(here.routed_step_ms)} per step here)"
              if here is not None and here.routed_step_ms is not None else "")
    return f"experts: the plan streams whole layers, as {target.name} can{routed}; {target.experts_note}"


def cpu_experts_note(plan: Plan, target: EngineTarget) -> str:
    """What becomes of a plan's CPU experts (experts.cpu): the engine computes no expert on the CPU, and
    llama.cpp's nearest expression places whole layers' experts there, not single experts."""
    rows = plan.experts.cpu_layers
    layers = [row.index for row in rows]
    fixed = sum(len(row.cpu) for row in rows if not row.cpu_take)
    split = sum(1 for row in rows if row.cpu_take)
    what = " and ".join(part for part in (f"{fixed} fixed CPU experts" if fixed else "",
                                          f"the per-step split of {split} layer(s) (each step's misses shared with "
                                          "the CPU by their count; no engine splits so)" if split else "") if part)
    numbers = "|".join(str(index) for index in layers)
    return (f"experts: {target.display_name} has no CPU experts: in this export the link fetches every miss that "
            f"the plan's {what} ({len(layers)} layer(s)) would compute on the host CPU. llama.cpp keeps a layer's "
            "experts in one "
            f"stacked tensor, so its nearest expression puts layers {', '.join(map(str, layers))} on the CPU whole: "
            f'-ot "blk\\.({numbers})\\.ffn_(up|down|gate)_exps=CPU" (--n-cpu-moe N: the first N layers\' experts)')


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


def _params_flags(plan: Plan, release: EngineVersion, notes: list) -> list[str]:
    """The selection flag, or nothing where the model code fixes the selection; PlanError where the version cannot
    say the plan's selection."""
    segments = plan.offload.params
    for segment in segments:
        check_segment(segment)
    architecture = plan.model.architecture
    fixed = dict(release.prefetch.fixed_selection).get(architecture)
    if fixed is not None:
        if segments != (fixed,):
            raise PlanError(
                f"{release.label}'s {architecture} code offloads only the routed experts of each offloaded MoE "
                f"layer, but this plan moves {' '.join(segments) or 'whole layers'}: make the plan with --params "
                f"{fixed} (or --for {release.engine})"
            )
        notes.append(f"{release.label}'s {architecture} code offloads the routed experts' w13_weight and w2_weight "
                     "itself (no selection flag); their FP8 block scales (4 bytes per 128x128 block) stay on the "
                     "GPU: predicted with the bytes it moves")
        return []
    if not segments:
        return []
    flag = release.prefetch.params_flag
    if flag is None:
        raise PlanError(f"{release.label} has no flag that selects params, and the plan moves only "
                        f"{' '.join(segments)}: make the plan without --params")
    notes.append(f"{flag} matches whole dot-separated segments of the engine's param names, as the plan did of the "
                 f"checkpoint's: {' '.join(segments)!r} selects the same params")
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


def _serving_flags(plan: Plan, target: EngineTarget, release: EngineVersion, tp_size: int, divisor: int,
                   notes: list, warnings: list) -> list[str]:
    """Concurrency, context, the prefill chunk and the GPU memory share that leave the engine the plan's KV cache
    per rank of ``tp_size``, by the engine's own accounting (planner.engines.memory); ``divisor``: what divides the
    plan's figures into one rank's (1 for a make --tp plan)."""
    workload = plan.workload
    block_tokens = release.block_tokens_for(plan.model.architecture)
    memory = target.memory(plan, tp_size, divisor, block_tokens=block_tokens)
    values = {"concurrency": str(workload.concurrency), "context_tokens": str(workload.context_tokens),
              "chunk_tokens": str(max(workload.chunk_tokens, workload.concurrency)),
              "memory_share": f"{memory.share:.{SHARE_DECIMALS}f}", "block_tokens": str(block_tokens)}
    pairs = tuple(pair for pair in target.serving_flags if pair[1] != "block_tokens" or block_tokens is not None)
    flags = flag_values(pairs, values)
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


def check_export_tp(plan: Plan, tp_size: int) -> None:
    """A one-GPU plan exported at --tp N: the plan's checkpoint must split over N ranks as make --tp N checks it
    (heads, KV heads, FP8 blocks: planner.model.tensor_parallel); UsageError naming the fix where it does not, or
    where the checkpoint cannot be read to check."""
    source = plan.model.source
    # a local folder by its absolute path: the cache below must not carry one working directory's answer to another
    where = str(Path(source).resolve()) if Path(source).exists() else source
    try:
        _check_split(where, plan.model.revision, tp_size)
    except OffloadPlanError as error:
        why = str(error).removeprefix(f"--tp {tp_size}: ")
        raise UsageError(f"export --tp {tp_size} checks the plan's checkpoint ({source}) as make --tp does: "
                         f"{cut(why, 300)}") from None


@functools.lru_cache(maxsize=16)
def _check_split(source: str, revision: str | None, tp_size: int) -> None:
    """make --tp's check of one checkpoint at one size (cached: a snapshot exports each plan several times)."""
    from planner.source.checkpoint import load_checkpoint
    from planner.model.tensor_parallel import shard_checkpoint

    shard_checkpoint(load_checkpoint(source, revision), tp_size)


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


def describe_prediction(export: Export) -> str:
    """One sentence: the plan's step on one GPU against the exported configuration's, per rank."""
    before, after = export.plan_prediction, export.prediction
    where = f"per rank of TP={export.tp_size}" if export.tp_size > 1 else "on one GPU"
    planned = "per rank, as planned" if export.planned_tp > 1 else "on one GPU"
    return (f"predicted step {format_ms(after.step_ms)} {where} (plan: {format_ms(before.step_ms)} {planned}), "
            f"stall {format_ms(after.stall_ms)}, link floor {format_ms(after.link_floor_ms)}; GPU weights "
            f"{format_bytes(after.gpu_bytes)} and pinned host {format_bytes(after.host_pinned_bytes)} per rank")
