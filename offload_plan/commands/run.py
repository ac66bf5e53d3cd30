"""``offload-plan run``: load the model with a plan applied and run it on the local GPU.

The command parses the flags and refuses or warns about their combinations against the plan (pure checks, before
anything is read and whether or not the runtime is installed), makes one call, runtime.run.run through the seam,
and prints the record it returns (its tables: offload_plan.run_tables).
"""

import contextlib
import json
import sys
from typing import Annotated, Optional

import typer

from offload_plan import runtime_seam
from offload_plan.console import say, stderr, stdout, warn
from offload_plan.options import JsonOption, PlanArgument
from offload_plan.run_tables import result_table
from planner.errors import UsageError, printable, shown
from planner.plan.file import read_plan
from planner.units import format_rate


def graphed_steps(flag: Optional[bool], plan) -> bool:
    """Whether decode steps replay CUDA graphs: ``--cuda-graph``/``--eager`` when given, else as the plan was made
    (a plan made graphed predicts graph replays; on the H100 eager steps ran at 0.49 of its floor, graphed at 1.0)."""
    return plan.workload.cuda_graph if flag is None else flag


def run(
    plan: PlanArgument,
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m",
        help="Checkpoint to load (default: the plan's source).")] = None,
    bench: Annotated[bool, typer.Option("--bench", help="Time the plan's workload against its prediction.")] = False,
    prompt: Annotated[Optional[str], typer.Option(help="Generate from this prompt with the plan applied.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate with --prompt.")] = 64,
    cuda_graph: Annotated[Optional[bool], typer.Option(
        "--cuda-graph/--eager",
        help="Replay decode steps from CUDA graphs, offload copies captured inside (--cuda-graph), or run them "
             "eagerly (--eager); default: as the plan was made (its workload.cuda_graph).")] = None,
    compile_steps: Annotated[bool, typer.Option(
        "--compile",
        help="Compile decode steps with torch.compile (Inductor), the offload hooks inside; with --cuda-graph the "
             "compiled step is captured.")] = False,
    adapter: Annotated[Optional[str], typer.Option(
        "--adapter", metavar="NAME",
        help="With --prompt: generate with this one of the plan's LoRA adapters (its name in the plan).")] = None,
    adapter_mode: Annotated[Optional[str], typer.Option(
        "--adapter-mode", metavar="MODE",
        help="With --bench on a plan with adapters: serve them blocking or pipelined instead of the plan's choice "
             "(adapters.mode).")] = None,
    json_output: JsonOption = False,
):
    """Load the model with the plan applied and run it on the local GPU.

    Example: offload-plan run plan.yaml --bench
    (a make --tp N plan, one process per GPU: torchrun --nproc-per-node N -m offload_plan run plan.tp2.yaml --bench)
    """
    if bench == (prompt is not None):
        raise UsageError("give exactly one of --bench or --prompt TEXT")
    loaded_plan = read_plan(plan)
    cuda_graph = graphed_steps(cuda_graph, loaded_plan)
    _check_run_flags(plan, loaded_plan, bench=bench, prompt=prompt, cuda_graph=cuda_graph,
                     compile_steps=compile_steps, adapter=adapter, adapter_mode=adapter_mode)
    result = runtime_seam.run(loaded_plan, plan, loading_bar=_loading_bar, model=model, prompt=prompt,
                              max_new_tokens=max_new_tokens, cuda_graph=cuda_graph,
                              compile_backend="inductor" if compile_steps else None, adapter=adapter,
                              adapter_mode=adapter_mode)
    _print(result, loaded_plan, cuda_graph, json_output)


def _check_run_flags(plan_path, plan, *, bench: bool, prompt: str | None, cuda_graph: bool, compile_steps: bool,
                     adapter: str | None, adapter_mode: str | None) -> None:
    """What the plan cannot run is refused, and what it runs other than planned is warned, before anything is
    read: --prompt on a rank of a TP plan, adapter flags the plan or the command does not take, --adapter with
    --compile; graph replays against eager steps, and --prompt without the plan's adapters."""
    if plan.inputs.tp > 1 and prompt is not None:
        raise UsageError(f"{plan_path} is one rank of TP={plan.inputs.tp}: run measures it with --bench (under "
                         "torchrun); generate with the engine's flags from offload-plan export")
    if bench and cuda_graph != plan.workload.cuda_graph:
        made, running = ("graph replays", "eager steps")
        if not plan.workload.cuda_graph:
            made, running = running, made
        warn(f"the plan predicts {made} and this runs {running}; for a like-for-like prediction make the plan "
             f"{'with' if cuda_graph else 'without'} --cuda-graph")
    check_adapter_flags(plan, bench, adapter, adapter_mode)
    if adapter is not None and compile_steps:
        # the LoRA hooks read Python state at each call, which a compiled step would bake in
        raise UsageError("--adapter with --compile is not built; drop --compile (eager or --cuda-graph steps)")
    if plan.adapters is not None and prompt is not None and adapter is None:
        warn(f"--prompt runs the base model without the plan's {len(plan.adapters.items)} LoRA adapter(s); "
             "give --adapter NAME to generate with one")


def check_adapter_flags(plan, bench: bool, adapter: str | None, adapter_mode: str | None) -> None:
    """--adapter names one of the plan's adapters and goes with --prompt; --adapter-mode is a mode and goes with
    --bench; both need a plan with adapters (checked before the minutes of loading)."""
    from planner.search.adapter_stream import MODES

    for flag, value, goes_with, ok in (("--adapter", adapter, "--prompt", not bench),
                                       ("--adapter-mode", adapter_mode, "--bench", bench)):
        if value is None:
            continue
        if plan.adapters is None:
            raise UsageError(f"{flag} {shown(value)}: the plan has no adapters; make it with --adapter NAME=PATH")
        if not ok:
            raise UsageError(f"{flag} goes with {goes_with}")
    if adapter is not None and adapter not in {row.name for row in plan.adapters.items}:
        names = printable(", ".join(row.name for row in plan.adapters.items))
        names = names if len(names) <= 200 else names[:195] + " ..."
        raise UsageError(f"--adapter {shown(adapter, 64)}: not one of the plan's adapters; give one of: {names}")
    if adapter_mode is not None and adapter_mode not in MODES:
        raise UsageError(f"--adapter-mode {shown(adapter_mode, 64)}: give {' or '.join(MODES)}")


def _print(result, plan, cuda_graph: bool, json_output: bool) -> None:
    """--prompt's text on stdout and its rate on stderr; --bench's table, or --json, on stdout (nothing on a TP rank
    other than 0, whose figures rank 0 prints)."""
    if result.kind == "other rank":
        return
    if result.kind == "generated":
        sys.stdout.write(result.text + "\n")
        say(f"{format_rate(result.tokens_per_s)} tokens/s with the plan applied "
            f"({'CUDA graph replays' if cuda_graph else 'eager steps'})")
    elif json_output:
        sys.stdout.write(json.dumps(result.json_data(), indent=2) + "\n")
    else:
        stdout.print(result_table(result, plan.inputs.tp))


@contextlib.contextmanager
def _loading_bar(total_bytes: int):
    """A bar in GB and GB/s on stderr while loading; yields ``advance(num_bytes)`` (called from the loader's reader
    threads)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

    columns = (TextColumn("loading"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeElapsedColumn())
    with Progress(*columns, console=stderr, transient=True) as progress:
        task = progress.add_task("loading", total=max(1, total_bytes))
        yield lambda num_bytes: progress.advance(task, num_bytes)
