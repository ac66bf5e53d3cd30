"""``run --bench`` on a serving plan: the planned KV cache at the plan's concurrency, filled to its context, decode
steps timed (graphed where the plan is), a prefill chunk timed, and GPU memory held to the plan's figure.

When the plan was made for less GPU memory than this GPU has (a 24 GiB card planned, an 80 GiB H100 at hand),
the process caps its allocator to the plan's memory, so a plan that does not fit fails here as it would there.
"""

import contextlib
import statistics
from dataclasses import asdict, dataclass

import torch

from planner.errors import RuntimeUnavailableError
from planner.units import format_bytes
from runtime.cpu_resplit import settle
from runtime.experts_impl import PREFILL, use_phase
from runtime.outside_memory import outside_allocator_bytes
from runtime.routed_fetches import RoutedFetches, routed_fetches, start_counting

NUM_WARMUP_STEPS = 3
NUM_TIMED_STEPS = 10
#: prefill chunks timed (median) after NUM_WARMUP_CHUNKS. A small model's eager chunk is as long as the host
#: takes to issue its kernels, and the host's pace drifts: on the H100 one Gemma-3-shaped plan's chunk read 10.34,
#: 10.70 and 12.95 ms in three runs back to back in one process (scripts/experiments/chunk_timing.py); the
#: median of more chunks steadies the figure within a run, not across them
NUM_TIMED_CHUNKS = 15
NUM_WARMUP_CHUNKS = 2


@dataclass(frozen=True, kw_only=True)
class ServingBench:
    """A serving plan measured against its prediction."""

    concurrency: int
    context_tokens: int
    decode_step_ms: float
    predicted_decode_step_ms: float
    decode_tokens_per_s: float
    predicted_decode_tokens_per_s: float
    prefill_chunk_tokens: int
    prefill_chunk_ms: float
    predicted_prefill_chunk_ms: float
    #: the process's GPU memory at its peak: the allocator's reserved peak plus what CUDA holds outside it
    peak_gpu_bytes: int
    predicted_total_gpu_bytes: int
    #: the GPU memory the plan was made for (the cap when below this GPU's)
    gpu_memory_bytes: int
    #: the share of this GPU the allocator was capped to, None when uncapped
    memory_fraction: float | None
    mode: str
    decode_step_ms_all: tuple[float, ...]
    #: GPU memory held outside the allocator at the end (CUDA context, library handles): planned as part of
    #: memory.cuda_context_bytes
    outside_allocator_bytes: int = 0
    #: the allocator's reserved peak after each phase (fill, warm-up/capture, timed steps, prefill chunk)
    reserved_bytes_by_phase: dict | None = None
    #: the bytes still allocated at the end of each phase (what stays: the cache, a graph's pool, workspaces)
    allocated_bytes_by_phase: dict | None = None
    #: the first decode step's logits equal the reference's bit for bit (None: no reference given)
    first_step_bitwise: bool | None = None
    #: times the allocator found no free block under the cap, returned its cache to CUDA and tried again (slow:
    #: a step that does so each time runs slower than predicted though it fits)
    allocator_retries: int = 0
    #: every timed prefill chunk's ms, in order (the median is prefill_chunk_ms)
    prefill_chunk_ms_all: tuple[float, ...] = ()
    #: how decode_step_ms sums decode_step_ms_all: "median", or "mean" where the plan fetches routed experts
    decode_step_statistic: str = "median"
    #: the timed decode steps of a plan that fetches routed experts: what they fetched, beside the plan
    routed: RoutedFetches | None = None

    def as_dict(self) -> dict:
        """Plain data for --json."""
        return asdict(self)


class _LivePhases:
    """The bytes allocated at the end of each phase of the serving bench, beside its reserved peaks."""

    def __init__(self, device: torch.device):
        self.device, self.allocated = device, {}

    def after(self, phase: str, reserved_bytes: int) -> int:
        self.allocated[phase] = torch.cuda.memory_allocated(self.device)
        return reserved_bytes


def cap_gpu_memory(limit_bytes: int, device: torch.device, booked_outside_bytes: int = 0) -> float | None:
    """Cap the allocator so the process holds at most ``limit_bytes`` of this GPU; the share set, or None when
    the GPU has no more than that anyway. The allocator gets the limit less what CUDA holds outside it: the
    plan's booking of that (``booked_outside_bytes``: its CUDA context figure), or what it holds now where more,
    so a process whose outside memory grows as the plan booked stays within the limit. What other processes hold
    on the GPU counts against the cap as if it were ours: the plan's GPU is taken to be this process's alone."""
    total_bytes = torch.cuda.get_device_properties(device).total_memory
    if limit_bytes >= total_bytes:
        return None
    outside = max(outside_allocator_bytes(device), booked_outside_bytes)
    fraction = (limit_bytes - outside) / total_bytes
    if fraction <= 0:
        raise RuntimeUnavailableError(
            f"the plan's GPU memory {format_bytes(limit_bytes)} is less than CUDA holds here outside the allocator "
            f"({format_bytes(outside)}); make the plan with more --gpu-memory")
    torch.cuda.set_per_process_memory_fraction(fraction, _index(device))
    return fraction


def release_cap(device: torch.device) -> None:
    """Let the allocator use the whole GPU again (benchmarks that cap one arm after another)."""
    torch.cuda.set_per_process_memory_fraction(1.0, _index(device))


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def peak_gpu_bytes(device: torch.device) -> int:
    """The allocator's reserved peak plus what CUDA holds outside it now."""
    return torch.cuda.max_memory_reserved(device) + outside_allocator_bytes(device)


def out_of_memory(what: str, plan) -> RuntimeUnavailableError:
    """The one-line error for a plan that does not fit the GPU memory it was made for."""
    return RuntimeUnavailableError(
        f"out of GPU memory {what}: the plan predicts {format_bytes(plan.memory.total_gpu_bytes)} of "
        f"{format_bytes(plan.memory.gpu_memory_bytes)}; make the plan with a smaller --concurrency or --context, "
        "or --measure so activations are measured rather than estimated")


def time_prefill_chunk(loaded, chunk_tokens: int, device: torch.device) -> list[float]:
    """ms of each timed forward over one new sequence's ``chunk_tokens`` tokens (no cache): replays of a CUDA graph
    where the plan says its chunk is graphed (workload.chunk_graphed), else eager forwards, offload hooks eager."""
    from runtime.graph import chunk_graph
    from runtime.timing import forward_step, random_ids, time_calls, time_steps

    ids = random_ids(loaded.model, (1, chunk_tokens), device, seed=1)
    use_phase(loaded.model, PREFILL, device)  # the decode loop left its own implementation set
    if not loaded.plan.workload.chunk_graphed:
        with torch.inference_mode():
            for _ in range(NUM_WARMUP_CHUNKS):
                forward_step(loaded.model, ids)
            return time_steps(loaded.model, ids, NUM_TIMED_CHUNKS)
    graph = chunk_graph(loaded.model, ids, loaded.engine)
    try:
        for _ in range(NUM_WARMUP_CHUNKS):
            graph.replay()
        return time_calls(graph.replay, NUM_TIMED_CHUNKS)
    finally:
        if loaded.engine is not None:
            torch.cuda.synchronize(device)
            loaded.engine.set_graph_mode(False)
        del graph


def run_serving_bench(loaded, cuda_graph: bool, compile_backend: str | None = None,
                      memory_fraction: float | None = None) -> ServingBench:
    """Decode at the plan's concurrency over a cache holding its context, then one prefill chunk, within the
    plan's GPU memory (``memory_fraction``: the cap cap_gpu_memory set, reported)."""
    return serve_and_time(loaded, cuda_graph, compile_backend, memory_fraction)[0]


def serve_and_time(loaded, cuda_graph: bool, compile_backend: str | None = None, memory_fraction: float | None = None,
                   reference_logits: torch.Tensor | None = None, seed: int = 0,
                   timing_kernels=None) -> tuple[ServingBench, torch.Tensor]:
    """run_serving_bench, also returning the first decode step's logits [concurrency, vocab] (on the CPU) and
    comparing them with ``reference_logits`` (another model's over the same seeded cache). ``timing_kernels``: a
    context manager factory the timed steps run in, the step captured again inside it (a benchmark that checks
    bits with deterministic kernels and times the ones serving runs)."""
    from runtime.timing import model_device, step_figure, timed_step_count
    from runtime.graph import DecodeLoop, cache_tokens_for

    plan, engine = loaded.plan, loaded.engine
    workload = plan.workload
    device = model_device(loaded.model)
    concurrency, context = workload.concurrency, workload.context_tokens
    torch.cuda.reset_peak_memory_stats(device)
    phases: dict[str, int] = {}
    live = _LivePhases(device)
    try:
        loop = DecodeLoop(loaded.model, batch=concurrency, max_cache_tokens=cache_tokens_for(context), device=device,
                          engine=engine, compile_backend=compile_backend, steps_per_call=1)
        phases["cache"] = live.after("cache", torch.cuda.memory_reserved(device))
        loop.fill(context, seed)
        phases["fill"] = live.after("fill", torch.cuda.max_memory_reserved(device))
        if cuda_graph:
            loop.capture()
        else:
            loop.warm_up()
        phases["capture" if cuda_graph else "warm-up"] = live.after("capture" if cuda_graph else "warm-up",
                                                                    torch.cuda.max_memory_reserved(device))
        saved = loop.save_state()
        first_logits = loop.generate(1)[1][0].cpu()
        loop.restore_state(saved)
        settle(loop)  # a plan whose CPU tables follow the host's rate: set before the timed steps
        with contextlib.nullcontext() if timing_kernels is None else timing_kernels():
            if timing_kernels is not None and cuda_graph:
                loop.capture_again()
            loop.timed_steps(NUM_WARMUP_STEPS)
            start_counting(loaded)
            step_ms = loop.timed_steps(timed_step_count(plan, NUM_TIMED_STEPS))
            routed = routed_fetches(loaded, len(step_ms))
        if engine is not None:
            engine.set_graph_mode(False)
        # with the cache and the captured step still held, as a server prefills between decode steps
        phases["steps"] = live.after("steps", torch.cuda.max_memory_reserved(device))
        chunk_ms_all = time_prefill_chunk(loaded, workload.chunk_tokens, device)
        phases["chunk"] = live.after("chunk", torch.cuda.max_memory_reserved(device))
        del loop
    except torch.OutOfMemoryError:
        by_phase = ", ".join(f"{name} {format_bytes(value)}" for name, value in phases.items())
        held = f"; {format_bytes(torch.cuda.memory_reserved(device))} reserved ({by_phase})"
        raise out_of_memory(f"at {concurrency} sequences of {context} tokens{held}", plan) from None
    step_ms_figure, statistic = step_figure(plan, step_ms)
    mode = "decode " + ("graphed" if cuda_graph else "eager") + (", compiled" if compile_backend else "")
    bench = ServingBench(
        concurrency=concurrency, context_tokens=context, decode_step_ms=step_ms_figure,
        predicted_decode_step_ms=plan.prediction.decode_step_ms,
        decode_tokens_per_s=1e3 * concurrency / step_ms_figure,
        predicted_decode_tokens_per_s=plan.prediction.decode_tokens_per_s,
        prefill_chunk_tokens=workload.chunk_tokens, prefill_chunk_ms=statistics.median(chunk_ms_all),
        predicted_prefill_chunk_ms=plan.prediction.prefill_chunk_ms, peak_gpu_bytes=peak_gpu_bytes(device),
        predicted_total_gpu_bytes=plan.memory.total_gpu_bytes, gpu_memory_bytes=plan.memory.gpu_memory_bytes,
        memory_fraction=memory_fraction, mode=mode, decode_step_ms_all=tuple(step_ms),
        outside_allocator_bytes=outside_allocator_bytes(device), reserved_bytes_by_phase=phases,
        allocated_bytes_by_phase=live.allocated,
        first_step_bitwise=None if reference_logits is None else torch.equal(first_logits, reference_logits),
        allocator_retries=torch.cuda.memory_stats(device).get("num_alloc_retries", 0),
        prefill_chunk_ms_all=tuple(chunk_ms_all), decode_step_statistic=statistic, routed=routed)
    return bench, first_logits
