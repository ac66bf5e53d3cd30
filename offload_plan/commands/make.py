"""``offload-plan make``: search the fastest plan that fits and write it."""

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from offload_plan import runtime_seam
from offload_plan.console import say, warn
from offload_plan.options import GpuOption, ModelOption
from planner.plan import Inputs, render_plan, write_atomic
from planner.units import SIZE_HELP


def make(
    model: ModelOption,
    gpu: GpuOption,
    budget: Annotated[Optional[str], typer.Option(
        help=f"GPU bytes for weights, slots included: 40GiB, 80GB ({SIZE_HELP}).")] = None,
    trigger: Annotated[Optional[float], typer.Option(help="Budget as a share of GPU memory, e.g. 0.5.")] = None,
    tokens: Annotated[int, typer.Option(help="Tokens per forward step (prefill chunk or decode batch).")] = 2048,
    sequences: Annotated[int, typer.Option(help="Sequences those tokens belong to (decode: the batch).")] = 1,
    context: Annotated[int, typer.Option(help="Tokens already in each sequence's KV cache.")] = 0,
    params: Annotated[Optional[list[str]], typer.Option(
        "--params",
        help="Offload only params matching these name segments (repeat).")] = None,
    stack: Annotated[Optional[str], typer.Option(help="Layer stack to plan, e.g. model.language_model.layers.")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit).")] = None,
    group_size: Annotated[Optional[int], typer.Option(help="Pin G instead of searching it.")] = None,
    num_in_group: Annotated[Optional[int], typer.Option(help="Pin K instead of searching it.")] = None,
    prefetch_step: Annotated[Optional[int], typer.Option(help="Pin P instead of searching it.")] = None,
    measure: Annotated[bool, typer.Option(
        "--measure",
        help="Time one layer of each kind on the local GPU instead of estimating.")] = False,
    measured_on: Annotated[Optional[str], typer.Option(
        help="Profile of the local GPU for --measure (default: from its name).")] = None,
    cuda_graph: Annotated[bool, typer.Option(
        "--cuda-graph",
        help="Plan for decode steps replayed from CUDA graphs (run --cuda-graph), one step per replay: prefetches "
             "join at each replay's end; --measure times layers graphed.")] = False,
    host_memory: Annotated[Optional[str], typer.Option(
        help="Host memory the offloaded params may be pinned in, e.g. 480GB (default: the profile's figure; Grace "
             "profiles have one).")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o",
        help="Write the plan here (default: stdout).")] = None,
):
    """Search the fastest offload plan that fits.

    Example: offload-plan make -m org/model -g h100-sxm --budget 40GiB -o plan.yaml
    """
    from planner.make import make_plan, regenerate_command

    inputs = Inputs(
        model=model, revision=revision, gpu=gpu, budget=budget, trigger=trigger, tokens=tokens, sequences=sequences,
        context=context, params=tuple(params or ()), stack=stack, group_size=group_size,
        num_in_group=num_in_group, prefetch_step=prefetch_step, measure=measure, measured_on=measured_on,
        cuda_graph=cuda_graph, host_memory=host_memory,
    )
    planned = make_plan(inputs, measure=runtime_seam.measured_compute if measure else None)
    for warning in planned.warnings:
        warn(warning)
    text = render_plan(planned.plan, regenerate_command(inputs, str(output) if output else None))
    if output is None:
        sys.stdout.write(text)
    else:
        write_atomic(output, text)
    _print_outcome(planned.plan, output)


def _print_outcome(plan, output) -> None:
    """One line on stderr: what was offloaded, GPU bytes against the budget, the predicted step."""
    from planner.units import format_bytes, format_ms

    offload, prediction = plan.offload, plan.prediction
    where = f"wrote {output}: " if output else ""
    say(
        f"{where}{len(offload.layers)}/{plan.model.num_layers} layers offloaded "
        f"(G={offload.group_size} K={offload.num_in_group} P={offload.prefetch_step}), "
        f"GPU {format_bytes(plan.memory.gpu_bytes)} of {format_bytes(plan.memory.budget_bytes)}, "
        f"predicted step {format_ms(prediction.step_ms)} (all resident {format_ms(prediction.resident_step_ms)})"
    )
