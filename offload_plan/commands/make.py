"""``offload-plan make``: search the fastest plan that fits and write it.

Its options are not written here: each comes from a field of planner.plan.schema.Inputs (flag and help in the
field's metadata), the one declaration that also gives the plan's inputs section and its regenerate command.
"""

import contextlib
import inspect
import sys
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Annotated, Optional

import typer

from offload_plan import runtime_seam
from offload_plan.console import say, warn
from planner.source.checkpoint import collector_paused
from planner.errors import InfeasibleError, UsageError
from planner.source.outputs import check_output
from planner.plan.schema import Inputs
from planner.plan.file import render_plan, write_atomic
from planner.make.tp_sizes import parse_tp_sizes


#: set by offload_plan.app.main: this process runs one command and ends (the script, python -m offload_plan), so
#: what planning built is frozen for the collector (planner.source.checkpoint.collector_paused); False in-process
#: (tests)
ONE_COMMAND_PROCESS = False


def make(**values):
    """Search the fastest offload plan that fits.

    Example: offload-plan make -m org/model -g h100-sxm --budget 40GiB -o plan.yaml
    """
    output = values.pop("output")
    tp = values.pop("tp")
    sizes = list(tp) if isinstance(tp, tuple) else [tp]
    repeated = {spec.name for spec in fields(Inputs) if typing.get_origin(spec.type) is tuple}
    inputs = Inputs(tp=sizes[0], **{name: tuple(value or ()) if name in repeated else value
                                    for name, value in values.items()})
    for path in _outputs(output, sizes):
        check_output(path, make_inputs_read(inputs))
    # --measure builds models on the GPU: the collector stays on for the cycles that may hold its memory
    with contextlib.nullcontext() if inputs.measure else collector_paused(freeze=ONE_COMMAND_PROCESS):
        if len(sizes) > 1:
            _make_tp_comparison(inputs, sizes, output)
        else:
            _make_one(inputs, output)


def _outputs(output: Path | None, sizes: list[int]) -> list[Path]:
    """The files make writes: -o PATH, or with several --tp sizes PATH.tpN.yaml for each."""
    from planner.make.tp_sizes import plan_path_for

    if output is None:
        return []
    return [output] if len(sizes) == 1 else [plan_path_for(output, size) for size in sizes]


def make_inputs_read(inputs: Inputs) -> list[tuple[str, str | None]]:
    """(flag, path) of every file or folder make reads: the checkpoint (and a single file's config.json beside
    it), the profile, the routing trace, the adapters, the profile --measure times against."""
    read = [("--model", inputs.model), ("--gpu", inputs.gpu), ("--routing-trace", inputs.routing_trace),
            ("--measured-on", inputs.measured_on)]
    if inputs.model and Path(inputs.model).suffix == ".safetensors":
        read.append(("--model's config", str(Path(inputs.model).with_name("config.json"))))
    read += [("--adapter", option.partition("=")[2] or None) for option in inputs.adapters]
    return read


def _make_one(inputs: Inputs, output: Path | None) -> None:
    """make: one plan, to -o PATH or stdout."""
    from planner.make.make_plan import make_plan
    from planner.make.inputs import regenerate_command

    planned = make_plan(inputs, **_measurers(inputs))
    for warning in planned.warnings:
        warn(warning)
    text = render_plan(planned.plan, regenerate_command(inputs, str(output) if output else None))
    if output is None:
        sys.stdout.write(text)
    else:
        write_atomic(output, text)
    _print_outcome(planned.plan, output)


def _measurers(inputs: Inputs) -> dict:
    """--measure's functions on the local GPU(s): the layers, the activation peaks and, with --tp, the all-reduce;
    and what the local stack holds outside torch's allocator, measured once."""
    if not inputs.measure:
        return {}
    return {"measure": runtime_seam.measured_compute, "measure_activations": runtime_seam.measured_activation_bytes,
            "measure_link": runtime_seam.measured_all_reduce if inputs.tp > 1 else None,
            "context_bytes": runtime_seam.measured_context_bytes(inputs.gpu, inputs.measured_on)}


def _make_tp_comparison(inputs: Inputs, sizes: list[int], output: Path | None) -> None:
    """make --tp 2,4: one plan per GPU count (PATH.tpN.yaml), then the comparison and its verdict on stderr."""
    from dataclasses import replace

    from planner.make.make_plan import make_plan
    from planner.make.inputs import regenerate_command
    from planner.make.tp_sizes import plan_path_for
    from planner.views.tp_comparison import compare_tp

    if output is None:
        raise UsageError(f"--tp {','.join(map(str, sizes))} writes one plan per GPU count: give -o PATH (each is "
                         "written as PATH.tpN.yaml)")
    from planner.source.checkpoint import load_checkpoint

    whole = load_checkpoint(inputs.model, inputs.revision)  # read once, sharded for each GPU count
    plans = []
    for size in sizes:
        sized = replace(inputs, tp=size)
        try:
            planned = make_plan(sized, checkpoint=whole, **_measurers(sized))
        except InfeasibleError as error:  # this GPU count does not fit; the others are still compared
            warn(f"tp {size}: no plan fits: {error}")
            continue
        for warning in planned.warnings:
            warn(f"tp {size}: {warning}")
        path = plan_path_for(output, size)
        write_atomic(path, render_plan(planned.plan, regenerate_command(sized, str(path))))
        plans.append((path, planned.plan))
    if not plans:
        raise InfeasibleError(f"no GPU count of --tp {','.join(map(str, sizes))} fits; try more GPUs")
    comparison = compare_tp([plan for _, plan in plans])
    for (path, _), line in zip(plans, comparison.lines):
        say(f"wrote {path}: {line}")
    say(comparison.verdict)


def tp_value(text: str) -> int | tuple[int, ...]:
    """--tp N (an int, as Inputs holds it) or N,M,... (the GPU counts to compare)."""
    sizes = parse_tp_sizes(text)
    return sizes[0] if len(sizes) == 1 else tuple(sizes)


class _TpSizes:
    """--tp's command-line type: one GPU count or several (typer calls tp_value to read it)."""


def _cli_type(annotation, name: str = "") -> object:
    """The command-line type of an Inputs field: a tuple of strings is a repeatable option; --tp takes a list
    of sizes to compare (2,4)."""
    if name == "tp":
        return _TpSizes
    if typing.get_origin(annotation) is tuple:
        return Optional[list[str]]
    return annotation


def _parameter(spec) -> inspect.Parameter:
    option = spec.metadata
    names = [option["flag"], *([option["short"]] if option["short"] else [])]
    default = None if spec.default == () else (... if spec.default is MISSING else spec.default)
    extra = {"parser": tp_value, "metavar": "N[,N...]"} if spec.name == "tp" else {}
    annotation = Annotated[_cli_type(spec.type, spec.name), typer.Option(*names, help=option["help"], **extra)]
    return inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _signature() -> inspect.Signature:
    """make's parameters: every Inputs field, then --output."""
    parameters = [_parameter(spec) for spec in fields(Inputs)]
    output = inspect.Parameter("output", inspect.Parameter.KEYWORD_ONLY, default=None,
                               annotation=Annotated[Optional[Path], typer.Option(
                                   "--output", "-o", help="Write the plan here (default: stdout).")])
    return inspect.Signature([*parameters, output])


make.__signature__ = _signature()
make.__annotations__ = {p.name: p.annotation for p in make.__signature__.parameters.values()}


def _print_outcome(plan, output) -> None:
    """One line on stderr: what was offloaded, GPU bytes against the budget, the predicted step."""
    from planner.units import format_bytes, format_ms, format_rate

    offload, prediction = plan.offload, plan.prediction
    where = f"wrote {output}: " if output else ""
    if plan.serving is not None:
        workload, memory = plan.workload, plan.memory
        say(f"{where}{workload.concurrency} sequences of up to {workload.context_tokens} tokens, "
            f"{format_rate(prediction.decode_tokens_per_s)} decode tokens/s "
            f"({format_ms(prediction.decode_step_ms)} per token), {_moved(plan)}, "
            f"GPU {format_bytes(memory.total_gpu_bytes)} of {format_bytes(memory.gpu_memory_bytes)}; "
            "offload-plan show for the trade")
        return
    knobs = "" if offload.group_size == 0 and plan.experts is not None and plan.experts.fetch_slots else (
        f" (G={offload.group_size} K={offload.num_in_group} P={offload.prefetch_step})")
    say(
        f"{where}{_moved(plan)}{knobs}, "
        f"GPU {format_bytes(plan.memory.gpu_bytes)} of {format_bytes(plan.memory.budget_bytes)}, "
        f"predicted step {format_ms(prediction.step_ms)} (all resident {format_ms(prediction.resident_step_ms)})"
    )


def _moved(plan) -> str:
    """What crosses the link: whole layers, or a MoE plan's routed experts."""
    if plan.experts is not None and plan.experts.fetch_slots:
        prefetch = ", next-layer prefetch" if plan.experts.prefetch else ""
        return f"routed experts fetched in {len(plan.experts.layers)}/{plan.model.num_layers} layers{prefetch}"
    return f"{len(plan.offload.layers)}/{plan.model.num_layers} layers offloaded"
