"""``offload-plan run``'s sequence, one call from the command line: the checkpoint opened once, the launch and the
local GPU checked, the GPU capped to the plan's memory, the model loaded with the plan applied, then --prompt's
generation or --bench's measurement (the plan's adapters served, its serving point, or its workload; each rank's
figures for a TP plan). The command prints the returned RunResult: a table or --json on stdout.
"""

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from planner.plan.schema import Plan
from runtime.adapter_bench import run_adapter_bench
from runtime.bench import check_decode_flags, run_bench
from runtime.generate import generate
from runtime.load import Loaded, load_with_plan, require_cuda
from runtime.load_source import LoadSource, open_source
from runtime.outside_memory import check_stack_fits
from runtime.serving import cap_gpu_memory, out_of_memory, run_serving_bench
from runtime.tensor_parallel import Rank, bench_rank, check_launch, start_rank

#: what a RunResult holds: generated text, one of the three --bench measurements, each rank's figures of a TP
#: plan (its workload or its serving point), or nothing (a TP rank other than 0, whose figures rank 0 prints)
KINDS = ("generated", "workload", "serving", "adapters", "rank workload", "rank serving", "other rank")


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """What ``run`` was asked for, its flags resolved (the command checked them against each other and the plan)."""

    #: --model, else None: the plan's source
    model: str | None
    #: --prompt TEXT, or None for --bench
    prompt: str | None
    max_new_tokens: int
    #: decode steps replayed from CUDA graphs (--cuda-graph/--eager, else the plan's workload.cuda_graph)
    cuda_graph: bool
    #: "inductor" with --compile, else None
    compile_backend: str | None
    #: --adapter NAME (with --prompt): one of the plan's adapters
    adapter: str | None
    #: --adapter-mode (with --bench), else None: the plan's adapters.mode
    adapter_mode: str | None


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """What ``run`` produced, for the command to print."""

    #: one of KINDS
    kind: str
    #: --prompt: the generated text and its rate
    text: str | None = None
    tokens_per_s: float | None = None
    #: --bench: runtime.bench.BenchResult, runtime.serving.ServingBench, runtime.adapter_bench.AdapterBench, or
    #: the ranks' runtime.tensor_parallel.RankBench rows
    measured: object = None
    #: what the local stack held outside torch's allocator before loading (one-GPU --bench)
    start_outside_allocator_bytes: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r}: one of {', '.join(KINDS)}")

    def json_data(self) -> dict | list:
        """--json's data: the measurement's fields (with start_outside_allocator_bytes), or each rank's."""
        if self.kind.startswith("rank"):
            return [row.as_dict() for row in self.measured]
        return self.measured.as_dict() | {"start_outside_allocator_bytes": self.start_outside_allocator_bytes}


def run(plan: Plan, plan_path: Path, options: RunOptions, loading_bar=None) -> RunResult:
    """Load the model with ``plan`` applied on the local GPU(s) and generate or measure as ``options`` ask.
    ``loading_bar(total_bytes)``: a context manager giving ``advance(num_bytes)``, called from the loader's
    reader threads as bytes land (None: no bar)."""
    source = open_source(plan, options.model, plan_path)  # resolved and read once, from any directory
    rank = check_launch(plan, plan_path)  # one process per rank of a TP plan, else one
    device = require_cuda("offload-plan run")
    if rank is not None:
        device = start_rank(rank)  # this rank's GPU taken before anything allocates on one
    if options.prompt is None:  # before the minutes of loading
        check_decode_flags(plan, options.cuda_graph, options.compile_backend)
    start_outside_bytes = check_stack_fits(plan, device, every_rank=rank is not None)  # before the loading
    if rank is not None:  # capped once loaded: transformers' load holds the rank's whole shard for a while
        return _bench_rank(rank, plan, source, options)
    memory_fraction = cap_gpu_memory(plan.memory.gpu_memory_bytes, device,
                                     booked_outside_bytes=plan.memory.cuda_context_bytes)
    with out_of_memory_in_one_line(plan, "while loading"):
        loaded = _load(plan, source, loading_bar)
    if options.prompt is not None:
        with out_of_memory_in_one_line(plan, f"generating {options.max_new_tokens} tokens"):
            return _generate(loaded, plan_path, options)
    with out_of_memory_in_one_line(plan, "in its bench"):
        measured, kind = _bench(loaded, plan_path, options, memory_fraction)
    return RunResult(kind=kind, measured=measured, start_outside_allocator_bytes=start_outside_bytes)


@contextlib.contextmanager
def out_of_memory_in_one_line(plan: Plan, what: str):
    """CUDA running out of memory inside, as the one line a plan that does not fit gets (runtime.serving)."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise out_of_memory(what, plan) from None


def _load(plan: Plan, source: LoadSource, loading_bar) -> Loaded:
    """The model streamed with the plan applied, advancing ``loading_bar`` (if any) by the bytes read."""
    if loading_bar is None:
        return load_with_plan(plan, source=source)
    with loading_bar(plan.model.total_bytes) as advance:
        return load_with_plan(plan, progress=advance, source=source)


def _generate(loaded: Loaded, plan_path: Path, options: RunOptions) -> RunResult:
    """--prompt: greedy text with the plan applied (and --adapter's adapter); the tokenizer is read from the
    folder the weights were loaded from (resolved once, by the load)."""
    text, tokens_per_s = generate(loaded, options.prompt, str(loaded.source.folder), options.max_new_tokens,
                                  options.cuda_graph, options.compile_backend, options.adapter, plan_path)
    return RunResult(kind="generated", text=text, tokens_per_s=tokens_per_s)


def _bench(loaded: Loaded, plan_path: Path, options: RunOptions, memory_fraction: float | None) -> tuple[object, str]:
    """--bench: the plan's adapters served, its serving point, or its workload, timed against the prediction;
    (the measurement, its kind)."""
    plan = loaded.plan
    if plan.adapters is not None:
        bench, _ = run_adapter_bench(loaded, plan_path, modes=(options.adapter_mode or plan.adapters.mode,))
        return bench, "adapters"
    if plan.serving is not None:
        return run_serving_bench(loaded, cuda_graph=options.cuda_graph, compile_backend=options.compile_backend,
                                 memory_fraction=memory_fraction), "serving"
    return run_bench(loaded, cuda_graph=options.cuda_graph, compile_backend=options.compile_backend), "workload"


def _bench_rank(rank: Rank, plan: Plan, source: LoadSource, options: RunOptions) -> RunResult:
    """--bench of one rank of a TP plan, every rank alike; rank 0 gets each rank's figures."""
    rows = bench_rank(rank, plan, source, cuda_graph=options.cuda_graph, compile_backend=options.compile_backend)
    if rows is None:
        return RunResult(kind="other rank")
    return RunResult(kind="rank serving" if plan.serving is not None else "rank workload", measured=tuple(rows))
