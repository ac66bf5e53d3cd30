"""``offload-plan run``: load the model with a plan applied and run it on the local GPU."""

import json
import sys
from typing import Annotated, Optional

import typer
from rich.table import Table

from offload_plan import runtime_seam
from offload_plan.console import say, stderr, stdout, warn
from offload_plan.options import JsonOption, PlanArgument
from planner.errors import UsageError, printable, shown
from planner.plan.file import read_plan


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
    source = runtime_seam.open_source(loaded_plan, model, plan)  # resolved and read once, from any directory
    rank = runtime_seam.check_tp_launch(loaded_plan, plan)  # one process per rank of a TP plan, else one
    runtime_seam.require_cuda("offload-plan run")
    if rank is not None:
        runtime_seam.start_tp_rank(rank)  # this rank's GPU taken before anything allocates on one
    compile_backend = "inductor" if compile_steps else None
    if bench:
        runtime_seam.check_decode_flags(loaded_plan, cuda_graph, compile_backend)  # before the minutes of loading
    if rank is not None:  # capped once loaded: transformers' load holds the rank's whole shard for a while
        _bench_rank(rank, loaded_plan, source, cuda_graph, compile_backend, json_output)
        return
    start_outside_bytes = runtime_seam.check_stack_fits(loaded_plan)  # before the minutes of loading
    memory_fraction = runtime_seam.cap_gpu_memory(loaded_plan)
    with runtime_seam.out_of_memory_in_one_line(loaded_plan, "while loading"):
        loaded = _load_with_progress(loaded_plan, source)
    if prompt is not None:
        with runtime_seam.out_of_memory_in_one_line(loaded_plan, f"generating {max_new_tokens} tokens"):
            text, tokens_per_s = runtime_seam.generate(loaded, prompt, max_new_tokens, cuda_graph, compile_backend,
                                                       adapter=adapter, plan_path=plan)
        sys.stdout.write(text + "\n")
        from planner.units import format_rate

        say(f"{format_rate(tokens_per_s)} tokens/s with the plan applied "
            f"({'CUDA graph replays' if cuda_graph else 'eager steps'})")
        return
    with runtime_seam.out_of_memory_in_one_line(loaded_plan, "in its bench"):
        _bench(loaded, loaded_plan, plan, adapter_mode, cuda_graph, compile_backend, memory_fraction, json_output,
               start_outside_bytes)


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


def _bench(loaded, plan, plan_path, adapter_mode: str | None, cuda_graph: bool, compile_backend: str | None,
           memory_fraction: float | None, json_output: bool, start_outside_bytes: int) -> None:
    """--bench: the plan's adapters served, its serving point, or its workload, timed against the prediction;
    a table on stdout, or --json (with ``start_outside_bytes``, what the stack held outside the allocator before
    loading)."""
    if plan.adapters is not None:
        result = runtime_seam.run_adapter_bench(loaded, plan_path, adapter_mode or plan.adapters.mode)
        table = _adapter_table
    elif plan.serving is not None:
        result = runtime_seam.run_serving_bench(loaded, cuda_graph, compile_backend, memory_fraction)
        table = _serving_table
    else:
        result = runtime_seam.run_bench(loaded, cuda_graph=cuda_graph, compile_backend=compile_backend)
        table = _bench_table
    if json_output:
        data = result.as_dict() | {"start_outside_allocator_bytes": start_outside_bytes}
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        stdout.print(table(result))


def _bench_rank(rank, plan, source, cuda_graph: bool, compile_backend: str | None, json_output: bool) -> None:
    """--bench of one rank of a TP plan, every rank alike; rank 0 prints each rank's figures (a table, or --json)."""
    results = runtime_seam.bench_tp_rank(rank, plan, source, cuda_graph, compile_backend)
    if results is None:  # not rank 0
        return
    if json_output:
        sys.stdout.write(json.dumps([row.as_dict() for row in results], indent=2) + "\n")
    else:
        stdout.print((_rank_serving_table if plan.serving is not None else _rank_table)(results, plan.inputs.tp))


#: said under each rank table
_BEYOND_CAPTION = ("beyond the plan's split: what transformers holds that vLLM's sharding (the plan's) splits, e.g. "
                   "transformers 5.17's whole input embedding on every rank")


def _rank_table(rows, tp: int) -> Table:
    """Each rank measured against its plan: step, weights on the GPU (and what transformers holds beyond the
    plan's split), peak memory, link."""
    from planner.units import format_bytes, format_ms

    table = Table(title=f"run --bench ({rows[0].bench.mode}), {tp} tensor-parallel ranks: measured against "
                        "predicted", title_justify="left", caption=_BEYOND_CAPTION)
    for name in ("rank", "step", "predicted", "ratio", "weights on GPU", "planned", "beyond the plan's split",
                 "peak GPU", "link bytes/step"):
        table.add_column(name, justify="right")
    for row in rows:
        bench = row.bench
        table.add_row(str(row.rank), format_ms(bench.step_ms), format_ms(bench.predicted_step_ms),
                      f"{bench.step_ms / bench.predicted_step_ms:.2f}", format_bytes(bench.weights_gpu_bytes),
                      format_bytes(bench.planned_gpu_bytes), format_bytes(row.beyond_plan_bytes),
                      format_bytes(bench.peak_gpu_bytes), format_bytes(bench.bytes_copied_per_step))
    return table


def _rank_serving_table(rows, tp: int) -> Table:
    """Each rank's serving point against its plan: decode step and tokens/s, a prefill chunk, peak memory."""
    from planner.units import format_bytes, format_ms, format_rate

    first = rows[0].bench
    table = Table(title=f"run --bench ({first.mode}, {first.concurrency} sequences at context "
                        f"{first.context_tokens}), {tp} tensor-parallel ranks: measured (predicted)",
                  title_justify="left", caption=_BEYOND_CAPTION)
    columns = ("rank", "decode step", "ratio", f"tokens/s (the {tp} GPUs)",
               f"prefill chunk ({first.prefill_chunk_tokens})", "peak GPU", "beyond the plan's split")
    for name in columns:
        table.add_column(name, justify="right")
    for row in rows:
        bench = row.bench
        table.add_row(str(row.rank), f"{format_ms(bench.decode_step_ms)} ({format_ms(bench.predicted_decode_step_ms)})",
                      f"{bench.decode_step_ms / bench.predicted_decode_step_ms:.2f}",
                      f"{format_rate(bench.decode_tokens_per_s)} ({format_rate(bench.predicted_decode_tokens_per_s)})",
                      f"{format_ms(bench.prefill_chunk_ms)} ({format_ms(bench.predicted_prefill_chunk_ms)})",
                      f"{format_bytes(bench.peak_gpu_bytes)} ({format_bytes(bench.predicted_total_gpu_bytes)})",
                      format_bytes(row.beyond_plan_bytes))
    return table


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


def _serving_table(result) -> Table:
    """A serving plan measured against predicted: decode tokens/s and step, a prefill chunk, peak memory."""
    from planner.units import format_bytes, format_ms, format_rate

    table = Table(title=f"run --bench ({result.mode}, {result.concurrency} sequences at context "
                        f"{result.context_tokens}): measured against predicted", title_justify="left")
    for name in ("", "measured", "predicted", "measured / predicted"):
        table.add_column(name, justify="right" if name else "left")
    rows = (("decode tokens/s", result.decode_tokens_per_s, result.predicted_decode_tokens_per_s, format_rate),
            ("decode step (per token)", result.decode_step_ms, result.predicted_decode_step_ms, format_ms),
            (f"prefill chunk ({result.prefill_chunk_tokens} tokens)", result.prefill_chunk_ms,
             result.predicted_prefill_chunk_ms, format_ms),
            ("peak GPU memory", result.peak_gpu_bytes, result.predicted_total_gpu_bytes, format_bytes))
    for label, measured, predicted, text in rows:
        table.add_row(label, text(measured), text(predicted), f"{measured / predicted:.2f}")
    cap = f"capped to {result.memory_fraction:.3f} of this GPU" if result.memory_fraction else "uncapped"
    table.add_row("GPU memory of the plan", format_bytes(result.gpu_memory_bytes), cap, "")
    return table


def _adapter_table(result) -> Table:
    """The adapter stream served blocking and pipelined: measured (predicted) per mode."""
    table = Table(title=f"run --bench: {result.num_batches} batches of {result.requests_per_batch} requests over "
                        f"{result.num_adapters} adapters, {result.num_slots} GPU slots, {result.prompt_tokens}-token "
                        "prompts; measured (predicted), ms", title_justify="left")
    for name in ("mode", "copies", "total", "compute alone", "first request starts", "TTFT mean", "TTFT max",
                 "compute idle"):
        table.add_column(name, justify="left" if name == "mode" else "right")
    for mode in result.modes:
        label = mode.mode + (" (the plan's)" if mode.mode == result.plan_mode else " (forced)")
        table.add_row(label, str(mode.num_copies), f"{mode.total_ms:.1f} ({mode.predicted_total_ms:.1f})",
                      f"{mode.compute_ms:.1f}", f"{mode.first_start_ms:.2f} ({mode.predicted_first_start_ms:.2f})",
                      f"{mode.ttft_mean_ms:.1f} ({mode.predicted_ttft_mean_ms:.1f})",
                      f"{mode.ttft_max_ms:.1f} ({mode.predicted_ttft_max_ms:.1f})",
                      f"{mode.compute_idle_ms:.1f} ({mode.predicted_compute_idle_ms:.1f})")
    table.caption = (f"one adapter copy: {result.measured_copy_ms:.2f} ms measured, {result.planned_copy_ms:.2f} ms "
                     f"planned; the plan chose {result.plan_mode}, predicted {result.plan_mode_margin:.1%} faster "
                     "than the other (--adapter-mode serves either)")
    return table


def _load_with_progress(plan, source):
    """Load with a bar in GB and GB/s on stderr (advanced from the loader's reader threads)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

    columns = (TextColumn("loading"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeElapsedColumn())
    with Progress(*columns, console=stderr, transient=True) as progress:
        task = progress.add_task("loading", total=max(1, plan.model.total_bytes))
        return runtime_seam.load_with_plan(plan, source, progress=lambda num_bytes: progress.advance(task, num_bytes))


def _bench_table(result) -> Table:
    """Measured against predicted: step, weights, peak memory, tokens/s, stall and link."""
    from planner.units import format_bytes, format_ms, format_rate

    table = Table(title=f"run --bench ({result.mode}): measured against predicted", title_justify="left")
    for name in ("", "measured", "predicted", "measured / predicted"):
        table.add_column(name, justify="right" if name else "left")
    table.add_row("step", format_ms(result.step_ms), format_ms(result.predicted_step_ms),
                  f"{result.step_ms / result.predicted_step_ms:.2f}")
    table.add_row("weights on GPU", format_bytes(result.weights_gpu_bytes), format_bytes(result.planned_gpu_bytes),
                  f"{result.weights_gpu_bytes / max(1, result.planned_gpu_bytes):.3f}")
    table.add_row("peak GPU (with activations)", format_bytes(result.peak_gpu_bytes),
                  f"budget {format_bytes(result.budget_bytes)}", "")
    table.add_row("tokens/s", format_rate(result.tokens_per_s), "", "")
    if result.stall_ms is not None:
        table.add_row("stall per step", format_ms(result.stall_ms), "", "")
        table.add_row("link", f"{result.copy_gb_per_s:.1f} GB/s",
                      f"{format_bytes(result.bytes_copied_per_step)}/step", "")
    else:
        table.add_row("link", f"{result.bytes_copied_per_step / result.step_ms / 1e6:.1f} GB/s (bytes / step)",
                      f"{format_bytes(result.bytes_copied_per_step)}/step", "")
        table.add_row("graph warm-up, capture", f"{result.warmup_s:.2f} s, {result.capture_s:.2f} s", "", "")
    if result.compile_s:
        table.add_row("torch.compile (first step)", f"{result.compile_s:.1f} s", "", "")
    return table
