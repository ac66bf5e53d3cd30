"""make's inputs, parsed and checked once: each flag's bounds in one validator (``resolve_inputs``), and the
memory figures that also need the profile (budget, GPU memory, host memory). Also the command that regenerates a
plan from its inputs."""

import math
import shlex
from dataclasses import dataclass, fields

from planner.model.adapters import MAX_ADAPTERS
from planner.plan.bounds import BOUNDS, MAX_KNOB, MAX_TPOT_MS, within
from planner.model.cost import Workload
from planner.errors import UsageError, cut, shown
from planner.model.kv_cache import KV_DTYPES
from planner.plan.experts_section import CPU_EXPERTS_CHOICES, ROUTED_EXPERTS_CHOICES
from planner.model.model_config import ModelConfig
from planner.plan.schema import Inputs
from planner.source.profile import MAX_CPU_TIME_SCALE, HardwareProfile
from planner.search.serving import ConcurrencyRange, parse_concurrency
from planner.units import format_bytes, parse_bytes


@dataclass(frozen=True, kw_only=True)
class ResolvedInputs:
    """The flags make parses, parsed once (``resolve_inputs`` checked them; nothing parses them again)."""

    #: --tokens, --sequences and --context as a step (checked with --concurrency too, which plans its own steps)
    workload: Workload
    #: --concurrency's range (None: a weights-only plan)
    concurrency: ConcurrencyRange | None
    #: --budget in bytes (None: not given)
    budget_bytes: int | None
    #: --gpu-memory in bytes, not yet held to the profile's memory (None: not given)
    gpu_memory_bytes: int | None
    #: --host-memory in bytes, above zero (None: not given)
    host_memory_bytes: int | None


def resolve_inputs(inputs: Inputs) -> ResolvedInputs:
    """Every input that needs no model or profile, in range (one line each if not), with the values parsed."""
    if inputs.cuda_graph and inputs.concurrency is None and inputs.tokens != inputs.sequences:
        raise UsageError("--cuda-graph plans decode steps, one new token per sequence: give --tokens equal to "
                         "--sequences (the batch), e.g. --tokens 64 --sequences 64 --context 1024")
    _check_knobs(inputs)
    # the serving inputs are checked whether or not a serving plan uses them
    concurrency = _concurrency(inputs)
    _check_serving_inputs(inputs)
    workload = workload_of(inputs.tokens, inputs.sequences, inputs.context)
    gpu_memory = None if inputs.gpu_memory is None else parse_bytes(inputs.gpu_memory, "--gpu-memory")
    _check_adapter_inputs(inputs)
    _check_shares(inputs)
    return ResolvedInputs(workload=workload, concurrency=concurrency, budget_bytes=_budget_bytes(inputs),
                          gpu_memory_bytes=gpu_memory, host_memory_bytes=_host_memory_bytes(inputs))


def workload_of(tokens: int, sequences: int, context: int) -> Workload:
    """A step of ``tokens`` over ``sequences`` after ``context`` tokens; a one-line error if it is not one."""
    try:
        return Workload(tokens_per_step=tokens, sequences_per_step=sequences, context_tokens=context)
    except ValueError as error:
        raise UsageError(f"workload: {error}") from None


def _check_knobs(inputs: Inputs) -> None:
    """Pinned G, K and P are counts of layers: 1 or more, and no more than a model has layers."""
    knobs = {"--group-size": inputs.group_size, "--num-in-group": inputs.num_in_group,
             "--prefetch-step": inputs.prefetch_step}
    for flag, value in knobs.items():
        if value is not None and not within(flag.strip("-").replace("-", "_"), value):
            raise UsageError(f"{flag} {value} is not a number of layers; give 1 or more (at most {MAX_KNOB}), or leave "
                             "it out to search it")


def _concurrency(inputs: Inputs) -> ConcurrencyRange | None:
    if inputs.concurrency is None:
        return None
    try:
        return parse_concurrency(inputs.concurrency)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _check_serving_inputs(inputs: Inputs) -> None:
    """--chunk, --kv-dtype and --max-tpot-ms: in range, one line each if not."""
    if not within("chunk", inputs.chunk):
        raise UsageError(f"--chunk {inputs.chunk}: a prefill chunk holds 1 to {BOUNDS['chunk'][1]} tokens, "
                         "e.g. --chunk 2048")
    if inputs.kv_dtype not in KV_DTYPES:
        raise UsageError(f"--kv-dtype {shown(inputs.kv_dtype)} is not a KV cache type; choose one of "
                         f"{', '.join(KV_DTYPES)}")
    if inputs.cpu_experts not in CPU_EXPERTS_CHOICES:
        raise UsageError(f"--cpu-experts {shown(inputs.cpu_experts)} is not one of "
                         f"{', '.join(CPU_EXPERTS_CHOICES)}: auto (the default), rows (one expert split by its rows "
                         "too), fixed (fixed CPU ids) or off (fetch every miss)")
    if inputs.routed_experts not in ROUTED_EXPERTS_CHOICES:
        raise UsageError(f"--routed-experts {shown(inputs.routed_experts)} is not one of "
                         f"{', '.join(ROUTED_EXPERTS_CHOICES)}: auto (the default) or off (whole layers only)")
    if inputs.max_tpot_ms is not None and not (math.isfinite(inputs.max_tpot_ms)
                                               and 0 < inputs.max_tpot_ms <= MAX_TPOT_MS):
        raise UsageError(f"--max-tpot-ms {inputs.max_tpot_ms:g} is not a time; give milliseconds above 0 and at most "
                         f"{MAX_TPOT_MS:g}, e.g. 50")


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


#: the deepest --prefetch-depth read before the checkpoint (which then bounds it by its router's top-k)
MAX_PREFETCH_DEPTH = 2**12


def _check_shares(inputs: Inputs) -> None:
    """--budget or --trigger for the weights (a serving plan's --trigger shares the GPU memory, so it may take
    both); --trigger and --prefetch-accuracy are shares."""
    if inputs.concurrency is None and inputs.budget is not None and inputs.trigger is not None:
        raise UsageError("give --budget or --trigger, not both")
    if inputs.trigger is not None and not 0 < inputs.trigger <= 1:
        raise UsageError(f"--trigger {inputs.trigger} is not a share of GPU memory; give a number in (0, 1]")
    accuracy = inputs.prefetch_accuracy
    if accuracy is not None and not 0 <= accuracy <= 1:
        raise UsageError(f"--prefetch-accuracy {accuracy:g} is not a share; give one from 0 to 1 (e.g. 0.8)")
    scale = inputs.cpu_time_scale
    if scale is not None and not 0 < scale <= MAX_CPU_TIME_SCALE:
        raise UsageError(f"--cpu-time-scale {scale:g} is not a multiple of the CPU's price; give one above 0 and at "
                         f"most {MAX_CPU_TIME_SCALE:g} (e.g. the host CPU scale run --bench prints)")
    depth = inputs.prefetch_depth  # bounded by the router's top-k once the checkpoint is read (planner.make.make_plan)
    if depth is not None and not 0 <= depth <= MAX_PREFETCH_DEPTH:
        raise UsageError(f"--prefetch-depth {cut(str(depth))} is not a number of ranks; give one from 0 (no "
                         "prefetch) to the router's top-k, or leave it out to choose it")


def _budget_bytes(inputs: Inputs) -> int | None:
    return None if inputs.budget is None else parse_bytes(inputs.budget, "--budget")


def _host_memory_bytes(inputs: Inputs) -> int | None:
    if inputs.host_memory is None:
        return None
    host_bytes = parse_bytes(inputs.host_memory, "--host-memory")
    if host_bytes <= 0:
        raise UsageError(f"--host-memory {shown(inputs.host_memory)} holds nothing; give the host memory the "
                         "offloaded params may be pinned in, e.g. 480GB, or leave it out")
    return host_bytes


def check_context(context_tokens: int, record: ModelConfig | None) -> None:
    """--context within what the model's positions and rope scaling allow (vLLM refuses a longer max model len)."""
    limit = record.context if record else None
    if limit is not None and context_tokens > limit.max_tokens:
        raise UsageError(f"--context {context_tokens} is beyond the model's {limit.max_tokens} tokens (config.json's "
                         f"{limit.source}); give --context {limit.max_tokens} or less")


def budget_given(inputs: Inputs) -> bool:
    """Whether the weights' share was given (--budget or --trigger); without one the plan takes the whole GPU."""
    return inputs.budget is not None or inputs.trigger is not None


def budget_bytes_for(inputs: Inputs, resolved: ResolvedInputs, profile: HardwareProfile) -> int:
    """--budget, else --trigger x GPU memory, else the profile's trigger; never above memory less reserve."""
    if resolved.budget_bytes is not None:
        budget = resolved.budget_bytes
    else:
        trigger = inputs.trigger if inputs.trigger is not None else profile.trigger.value
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


def gpu_memory_bytes_for(inputs: Inputs, resolved: ResolvedInputs, profile: HardwareProfile) -> int:
    """The GPU memory a plan must fit: --gpu-memory, else --trigger's share of the profile's (serving plans),
    else all of the profile's. Never above the profile's."""
    memory = int(profile.gpu_memory_bytes.value)
    if resolved.gpu_memory_bytes is not None:
        limit = resolved.gpu_memory_bytes
        if not 0 < limit <= memory:
            raise UsageError(f"--gpu-memory {inputs.gpu_memory} is not between 0 and {profile.name}'s "
                             f"{format_bytes(memory)}; give at most {memory // 2**20}MiB")
        return limit
    if resolved.concurrency is not None and inputs.trigger is not None:
        return int(inputs.trigger * memory)
    return memory


def host_memory_bytes_for(resolved: ResolvedInputs, profile: HardwareProfile) -> int | None:
    """--host-memory, else the profile's host memory figure, else None (not checked)."""
    if resolved.host_memory_bytes is not None:
        return resolved.host_memory_bytes
    return None if profile.host_memory_bytes is None else int(profile.host_memory_bytes.value)


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
