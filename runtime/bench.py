"""``run --bench``: time the plan's workload on the GPU, back to back, and compare with the prediction."""

import statistics
from dataclasses import asdict, dataclass

import torch

from planner.errors import UsageError
from runtime.cpu_resplit import settle
from runtime.load import Loaded
from runtime.routed_fetches import RoutedFetches, routed_fetches, start_counting
from runtime.timing import forward_step, model_device, random_ids, step_figure, time_steps, timed_step_count

NUM_WARMUP_STEPS = 3
NUM_TIMED_STEPS = 10


@dataclass(frozen=True, kw_only=True)
class BenchResult:
    """Measured against predicted, for one plan."""

    step_ms: float
    predicted_step_ms: float
    resident_step_ms_predicted: float
    #: all step times, for spread
    step_ms_all: tuple[float, ...]
    weights_gpu_bytes: int
    planned_gpu_bytes: int
    peak_gpu_bytes: int
    budget_bytes: int
    #: None under CUDA graphs: timing events cannot sit inside a replay
    stall_ms: float | None
    copy_gb_per_s: float | None
    bytes_copied_per_step: int
    host_pinned_bytes: int
    #: "prefill", "decode eager" or "decode graphed"
    mode: str = "prefill"
    #: how step_ms sums step_ms_all: "median", or "mean" where the plan fetches routed experts (runtime.timing)
    step_statistic: str = "median"
    tokens_per_s: float = 0.0
    #: the process's GPU memory at its peak over the whole run (loading included): the allocator's reserved
    #: peak plus what CUDA holds outside it at the end; against memory.total_gpu_bytes
    process_peak_gpu_bytes: int = 0
    #: memory.total_gpu_bytes: what the plan predicts the process holds (0 where the KV cache is not modelled)
    predicted_total_gpu_bytes: int = 0
    #: GPU memory held outside the allocator at the end (CUDA context, kernels, library state, page tables of the
    #: registered host memory), against memory.cuda_context_bytes
    outside_allocator_bytes: int = 0
    #: wall seconds of the warm-up steps and of capturing the graph (graphed decode only)
    warmup_s: float = 0.0
    compile_s: float = 0.0
    capture_s: float = 0.0
    #: decode steps of a plan that fetches routed experts: what they fetched, beside the plan
    routed: RoutedFetches | None = None

    def as_dict(self) -> dict:
        """Plain data for --json."""
        return asdict(self)


def bench_inputs(loaded: Loaded, device: torch.device) -> torch.Tensor:
    """Random token ids of the plan's prefill workload shape: [sequences, tokens per sequence]."""
    workload = loaded.plan.workload
    shape = (workload.sequences_per_step, workload.tokens_per_step // workload.sequences_per_step)
    return random_ids(loaded.model, shape, device)


def check_decode_flags(plan, cuda_graph: bool, compile_backend: str | None) -> None:
    """--cuda-graph and --compile time decode steps: the plan must be made for decode (a KV context)."""
    if plan.workload.context_tokens:
        return
    for wanted, flag in ((cuda_graph, "--cuda-graph"), (compile_backend, "--compile")):
        if wanted:
            raise UsageError(f"{flag} applies to decode steps; make the plan for decode (--tokens B --sequences B "
                             f"--context N) or drop {flag}")


def run_bench(loaded: Loaded, num_steps: int = NUM_TIMED_STEPS, cuda_graph: bool = False,
              compile_backend: str | None = None) -> BenchResult:
    """Time the plan's workload: prefill steps (context 0), or decode steps over its KV context."""
    check_decode_flags(loaded.plan, cuda_graph, compile_backend)
    if loaded.plan.workload.context_tokens:
        return run_decode_bench(loaded, num_steps, cuda_graph, compile_backend)
    device = model_device(loaded.model)
    engine = loaded.engine
    input_ids = bench_inputs(loaded, device)
    with torch.inference_mode():
        for _ in range(NUM_WARMUP_STEPS):
            forward_step(loaded.model, input_ids)
        engine.take_stats()
        earlier_reserved_bytes = torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        engine.timing = True
        step_ms = time_steps(loaded.model, input_ids, num_steps)
        engine.timing = False
    return _result(loaded, step_ms, engine.take_stats(), device, timed=True,
                   earlier_reserved_bytes=earlier_reserved_bytes)


def _result(loaded: Loaded, step_ms: list[float], stats, device, *, timed: bool, earlier_reserved_bytes: int,
            **extra) -> BenchResult:
    """Measured step times and the offload counters, beside what the plan says. ``timed``: the engine's
    timing events ran (not under CUDA graphs), so stall and link rate were measured. ``earlier_reserved_bytes``:
    the allocator's reserved peak before the timed steps reset its statistics."""
    from runtime.outside_memory import outside_allocator_bytes

    plan, engine = loaded.plan, loaded.engine
    # a prefill step reads every expert: only decode steps of a routed plan vary with the routing
    median_ms, statistic = step_figure(plan, step_ms) if plan.workload.context_tokens else (
        statistics.median(step_ms), "median")
    outside_bytes = outside_allocator_bytes(device)
    return BenchResult(
        step_ms=median_ms,
        predicted_step_ms=plan.prediction.step_ms,
        resident_step_ms_predicted=plan.prediction.resident_step_ms,
        step_ms_all=tuple(step_ms),
        weights_gpu_bytes=loaded.weights_gpu_bytes,
        planned_gpu_bytes=plan.memory.gpu_bytes,
        peak_gpu_bytes=torch.cuda.max_memory_allocated(device),
        budget_bytes=plan.memory.budget_bytes,
        stall_ms=stats.stall_ms / len(step_ms) if timed else None,
        copy_gb_per_s=(stats.bytes_copied / stats.copy_ms / 1e6 if stats.copy_ms else 0.0) if timed else None,
        # counted by the engine where it ran Python per copy; from the schedule under graphs
        bytes_copied_per_step=stats.bytes_copied // len(step_ms) if timed else engine.copy_bytes_per_step,
        host_pinned_bytes=engine.host_bytes,
        tokens_per_s=plan.workload.tokens_per_step * 1e3 / median_ms,
        process_peak_gpu_bytes=max(earlier_reserved_bytes, torch.cuda.max_memory_reserved(device)) + outside_bytes,
        predicted_total_gpu_bytes=plan.memory.total_gpu_bytes,
        outside_allocator_bytes=outside_bytes,
        step_statistic=statistic,
        **extra,
    )


def run_decode_bench(loaded: Loaded, num_steps: int, cuda_graph: bool,
                     compile_backend: str | None = None) -> BenchResult:
    """Decode steps of the plan's batch over a static cache of its context, eager or replayed from a graph,
    compiled with ``compile_backend`` or not."""
    from runtime.graph import DecodeLoop, cache_tokens_for, steps_per_call_for

    plan, engine = loaded.plan, loaded.engine
    workload = plan.workload
    if workload.tokens_per_step != workload.sequences_per_step:
        raise UsageError("a plan with --context times decode steps, one token per sequence: make it with --tokens "
                         "equal to --sequences")
    device = model_device(loaded.model)
    batch, context = workload.sequences_per_step, workload.context_tokens
    loop = DecodeLoop(loaded.model, batch=batch, max_cache_tokens=cache_tokens_for(context), device=device,
                      engine=engine, compile_backend=compile_backend, steps_per_call=steps_per_call_for(cuda_graph))
    loop.prefill(random_ids(loaded.model, (batch, context), device))
    if cuda_graph:
        loop.capture()
    else:
        loop.warm_up()
    settle(loop)  # a plan whose CPU tables follow the host's rate: set before the timed steps
    loop.timed_steps(NUM_WARMUP_STEPS)
    engine.take_stats()
    earlier_reserved_bytes = torch.cuda.max_memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    engine.timing = not cuda_graph
    start_counting(loaded)
    step_ms = loop.timed_steps(timed_step_count(plan, num_steps))
    engine.timing = False
    routed = routed_fetches(loaded, len(step_ms) * loop.steps_per_call)
    mode = "decode " + ("graphed" if cuda_graph else "eager") + (", compiled" if compile_backend else "")
    return _result(loaded, step_ms, engine.take_stats(), device, timed=not cuda_graph, mode=mode,
                   earlier_reserved_bytes=earlier_reserved_bytes,
                   warmup_s=loop.warmup_s, compile_s=loop.compile_s, capture_s=loop.capture_s, routed=routed)
