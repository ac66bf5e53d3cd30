"""The ``offload-plan`` command line: thin commands that parse, call the planner or runtime, and print.

Data (plans, JSON) goes to stdout or a file; tables, progress and warnings go to stderr. Every
OffloadPlanError becomes one line on stderr and a non-zero exit; OFFLOAD_PLAN_DEBUG=1 shows tracebacks.
"""

import functools
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from planner.errors import OffloadPlanError
from planner.plan import Inputs, plan_to_dict, read_plan, render_plan, write_atomic

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Plan, explain and apply how a model's weights are split between GPU memory and host memory.",
)
# A pipe or file gets 120 columns (rich's default of 80 breaks the timeline); a terminal keeps its own width.
stderr = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 120)

ModelOption = Annotated[str, typer.Option("--model", "-m", help="Checkpoint folder, .safetensors file, or hub repo id.")]
GpuOption = Annotated[str, typer.Option("--gpu", "-g", help="Built-in profile name (see `profiles`) or a profile .yaml.")]
PlanArgument = Annotated[Path, typer.Argument(help="A plan file written by `make`.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON to stdout.")]


def handle_errors(command):
    """Turn project errors into one line on stderr and the error's exit code."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except OffloadPlanError as error:
            if os.environ.get("OFFLOAD_PLAN_DEBUG"):
                raise
            stderr.print(f"offload-plan: error: {error}", markup=False, soft_wrap=True)
            raise typer.Exit(error.exit_code) from None
        except KeyboardInterrupt:
            stderr.print("offload-plan: interrupted")
            raise typer.Exit(130) from None

    return wrapper


@app.command()
@handle_errors
def make(
    model: ModelOption,
    gpu: GpuOption,
    budget: Annotated[Optional[str], typer.Option(help="GPU bytes for weights, slots included: 40GiB, 80GB.")] = None,
    trigger: Annotated[Optional[float], typer.Option(help="Budget as a share of GPU memory, e.g. 0.5.")] = None,
    tokens: Annotated[int, typer.Option(help="Tokens per forward step (prefill chunk or decode batch).")] = 2048,
    sequences: Annotated[int, typer.Option(help="Sequences those tokens belong to (decode: the batch).")] = 1,
    context: Annotated[int, typer.Option(help="Tokens already in each sequence's KV cache.")] = 0,
    params: Annotated[Optional[list[str]], typer.Option("--params", help="Offload only params matching these name segments (repeat).")] = None,
    stack: Annotated[Optional[str], typer.Option(help="Layer stack to plan, e.g. model.language_model.layers.")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit).")] = None,
    group_size: Annotated[Optional[int], typer.Option(help="Pin G instead of searching it.")] = None,
    num_in_group: Annotated[Optional[int], typer.Option(help="Pin K instead of searching it.")] = None,
    prefetch_step: Annotated[Optional[int], typer.Option(help="Pin P instead of searching it.")] = None,
    measure: Annotated[bool, typer.Option("--measure", help="Time one layer of each kind on the local GPU instead of estimating.")] = False,
    measured_on: Annotated[Optional[str], typer.Option(help="Profile of the local GPU for --measure (default: from its name).")] = None,
    cuda_graph: Annotated[bool, typer.Option("--cuda-graph", help="Plan for decode steps replayed from CUDA graphs (run --cuda-graph), one step per replay: prefetches join at each replay's end; --measure times layers graphed.")] = False,
    host_memory: Annotated[Optional[str], typer.Option(help="Host memory the offloaded params may be pinned in, e.g. 480GB (default: the profile's figure; Grace profiles have one).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the plan here (default: stdout).")] = None,
):
    """Search the fastest offload plan that fits. Example: offload-plan make -m org/model -g h100-sxm --budget 40GiB -o plan.yaml"""
    from planner.make import make_plan, regenerate_command

    inputs = Inputs(
        model=model, revision=revision, gpu=gpu, budget=budget, trigger=trigger, tokens=tokens, sequences=sequences,
        context=context, params=tuple(params or ()), stack=stack, group_size=group_size,
        num_in_group=num_in_group, prefetch_step=prefetch_step, measure=measure, measured_on=measured_on,
        cuda_graph=cuda_graph, host_memory=host_memory,
    )
    planned = make_plan(inputs)
    for warning in planned.warnings:
        stderr.print(f"offload-plan: warning: {warning}", markup=False, soft_wrap=True)
    text = render_plan(planned.plan, regenerate_command(inputs, str(output) if output else None))
    if output is None:
        sys.stdout.write(text)
    else:
        write_atomic(output, text)
    _print_outcome(planned.plan, output)


def _print_outcome(plan, output) -> None:
    from planner.units import format_bytes, format_ms

    offload, prediction = plan.offload, plan.prediction
    where = f"wrote {output}: " if output else ""
    stderr.print(
        f"{where}{len(offload.layers)}/{plan.model.num_layers} layers offloaded "
        f"(G={offload.group_size} K={offload.num_in_group} P={offload.prefetch_step}), "
        f"GPU {format_bytes(plan.memory.gpu_bytes)} of {format_bytes(plan.memory.budget_bytes)}, "
        f"predicted step {format_ms(prediction.step_ms)} (all resident {format_ms(prediction.resident_step_ms)})",
        markup=False, soft_wrap=True,
    )


@app.command()
@handle_errors
def show(
    plan: PlanArgument,
    json_output: JsonOption = False,
    layers: Annotated[bool, typer.Option("--layers/--no-layers", help="Include the per-layer table.")] = True,
):
    """Explain a plan: summary, memory, layers, timeline, stalls. Example: offload-plan show plan.yaml"""
    loaded = read_plan(plan)
    if json_output:
        sys.stdout.write(json.dumps(plan_to_dict(loaded), indent=2) + "\n")
        return
    from planner.report import show_plan

    show_plan(loaded, stderr, layer_table=layers)


@app.command()
@handle_errors
def run(
    plan: PlanArgument,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Checkpoint to load (default: the plan's source).")] = None,
    bench: Annotated[bool, typer.Option("--bench", help="Time the plan's workload against its prediction.")] = False,
    prompt: Annotated[Optional[str], typer.Option(help="Generate from this prompt with the plan applied.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate with --prompt.")] = 64,
    cuda_graph: Annotated[bool, typer.Option("--cuda-graph", help="Replay decode steps from CUDA graphs, one per replay, offload copies captured inside.")] = False,
    compile_steps: Annotated[bool, typer.Option("--compile", help="Compile decode steps with torch.compile (Inductor), the offload hooks inside; with --cuda-graph the compiled step is captured.")] = False,
    json_output: JsonOption = False,
):
    """Load the model with the plan applied and run it on the local GPU. Example: offload-plan run plan.yaml --bench"""
    from planner.errors import UsageError

    if bench == (prompt is not None):
        raise UsageError("give exactly one of --bench or --prompt TEXT")
    loaded_plan = read_plan(plan)
    if bench and cuda_graph != loaded_plan.workload.cuda_graph:
        made, running = ("graph replays", "eager steps") if loaded_plan.workload.cuda_graph else ("eager steps", "graph replays")
        stderr.print(f"offload-plan: warning: the plan predicts {made} and this runs {running}; for a like-for-like "
                     f"prediction make the plan {'with' if cuda_graph else 'without'} --cuda-graph", markup=False)
    from runtime.load import load_with_plan, model_path_for, require_cuda

    require_cuda()
    compile_backend = "inductor" if compile_steps else None
    if bench:
        from runtime.bench import check_decode_flags

        check_decode_flags(loaded_plan, cuda_graph, compile_backend)  # before the minutes of loading
    loaded = _load_with_progress(loaded_plan, model, load_with_plan)
    if prompt is not None:
        from runtime.bench import generate

        text, tokens_per_s = generate(loaded, prompt, model_path_for(loaded_plan, model), max_new_tokens, cuda_graph,
                                      compile_backend)
        sys.stdout.write(text + "\n")
        stderr.print(f"{tokens_per_s:.2f} tokens/s with the plan applied")
        return
    from runtime.bench import run_bench

    result = run_bench(loaded, cuda_graph=cuda_graph, compile_backend=compile_backend)
    if json_output:
        sys.stdout.write(json.dumps(result.as_dict(), indent=2) + "\n")
    else:
        _print_bench(result)


def _load_with_progress(plan, model, load):
    """Load with a bar in GB and GB/s on stderr (advanced from the loader's reader threads)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

    columns = (TextColumn("loading"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeElapsedColumn())
    with Progress(*columns, console=stderr, transient=True) as progress:
        task = progress.add_task("loading", total=max(1, plan.model.total_bytes))
        return load(plan, model, progress=lambda num_bytes: progress.advance(task, num_bytes))


def _print_bench(result) -> None:
    from planner.units import format_bytes, format_ms

    table = Table(title=f"run --bench ({result.mode}): measured against predicted", title_justify="left")
    for name in ("", "measured", "predicted", "measured / predicted"):
        table.add_column(name, justify="right" if name else "left")
    table.add_row("step", format_ms(result.step_ms), format_ms(result.predicted_step_ms),
                  f"{result.step_ms / result.predicted_step_ms:.2f}")
    table.add_row("weights on GPU", format_bytes(result.weights_gpu_bytes), format_bytes(result.planned_gpu_bytes),
                  f"{result.weights_gpu_bytes / max(1, result.planned_gpu_bytes):.3f}")
    table.add_row("peak GPU (with activations)", format_bytes(result.peak_gpu_bytes), f"budget {format_bytes(result.budget_bytes)}", "")
    table.add_row("tokens/s", f"{result.tokens_per_s:.1f}", "", "")
    if result.stall_ms is not None:
        table.add_row("stall per step", format_ms(result.stall_ms), "", "")
        table.add_row("link", f"{result.copy_gb_per_s:.1f} GB/s", f"{format_bytes(result.bytes_copied_per_step)}/step", "")
    else:
        table.add_row("link", f"{result.bytes_copied_per_step / result.step_ms / 1e6:.1f} GB/s (bytes / step)",
                      f"{format_bytes(result.bytes_copied_per_step)}/step", "")
        table.add_row("graph warm-up, capture", f"{result.warmup_s:.2f} s, {result.capture_s:.2f} s", "", "")
    if result.compile_s:
        table.add_row("torch.compile (first step)", f"{result.compile_s:.1f} s", "", "")
    stderr.print(table)


@app.command()
@handle_errors
def calibrate(
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the profile here (default: stdout).")] = None,
):
    """Measure the local GPU and write a profile for --gpu FILE. Example: offload-plan calibrate -o my-h100.yaml"""
    from runtime.load import require_cuda

    require_cuda("offload-plan calibrate")
    from runtime.calibrate import calibrate as measure_gpu
    from runtime.calibrate import calibrated_yaml

    profile, details = measure_gpu()
    text = calibrated_yaml(profile)
    if output is None:
        sys.stdout.write(text)
    else:
        write_atomic(output, text)
    stderr.print(
        f"{profile.name}: H2D {profile.h2d_bytes_per_s.value / 1e9:.1f} GB/s + {profile.copy_overhead_us.value:.1f} us "
        f"per copy, HBM {profile.hbm_bytes_per_s.value / 1e12:.2f} TB/s, bf16 {profile.bf16_flops_per_s.value / 1e12:.0f} "
        f"TFLOP/s, memory {profile.gpu_memory_bytes.value / 2**30:.1f} GiB",
        markup=False,
    )
    for num_bytes, ms in details["h2d_points_bytes_ms"]:
        stderr.print(f"  H2D {num_bytes / 2**20:7.0f} MiB: {ms:8.3f} ms, {num_bytes / ms / 1e6:6.1f} GB/s", markup=False)


@app.command()
@handle_errors
def profiles(json_output: JsonOption = False):
    """List the built-in hardware profiles with their key figures. Example: offload-plan profiles"""
    from planner.profile import list_profile_names, load_profile, profile_to_dict

    loaded = [load_profile(name) for name in list_profile_names()]
    if json_output:
        sys.stdout.write(json.dumps([profile_to_dict(p) for p in loaded], indent=2) + "\n")
        return
    table = Table(title="Hardware profiles (d = datasheet, m = measured, f = fitted, a = assumed)", title_justify="left")
    for name in ("name", "GPU GiB", "HBM TB/s", "bf16 TFLOP/s", "H2D GB/s", "trigger", "description"):
        table.add_column(name, justify="left" if name in ("name", "description") else "right")
    for p in loaded:
        table.add_row(
            p.name,
            _with_source(p.gpu_memory_bytes, 2**30, ".1f"),
            _with_source(p.hbm_bytes_per_s, 1e12, ".2f"),
            _with_source(p.bf16_flops_per_s, 1e12, ".0f"),
            _with_source(p.h2d_bytes_per_s, 1e9, ".1f"),
            _with_source(p.trigger, 1, ".2f"),
            p.description,
        )
    stderr.print(table)


def _with_source(figure, scale: float, spec: str) -> str:
    return f"{figure.value / scale:{spec}} {figure.source[0]}"


import planner.cli_review  # noqa: E402,F401  (registers check, diff, export)


def main() -> None:
    """Entry point of the ``offload-plan`` script."""
    app()


if __name__ == "__main__":
    main()
