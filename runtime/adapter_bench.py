"""``run --bench`` of a plan with adapters: a request stream, each request naming an adapter, served blocking
and pipelined from the plan's GPU slots, measured against planner.search.adapter_stream's prediction of the same
schedule."""

import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from planner.search.adapter_stream import (STREAM_NUM_BATCHES, StreamSchedule, StreamTimes, pure_compute_ms,
                                            schedule_stream, simulate, stream_batches, stream_requests_per_batch,
                                            weights_on_link)
from runtime.adapters import AdapterPool, LoraHooks, ServedStream, load_pool, serve_stream
from runtime.timing import random_ids
from runtime.load import Loaded
from runtime.serving import peak_gpu_bytes

#: timed rounds per mode (each: the forwards alone, then the stream with its copies)
NUM_ROUNDS = 3


@dataclass(frozen=True, kw_only=True)
class ModeResult:
    """One way of serving the stream: measured and predicted figures, ms."""

    mode: str
    total_ms: float
    predicted_total_ms: float
    #: compute alone (the same forwards with the adapters already in their slots)
    compute_ms: float
    #: the stream's adapter bytes over the link rate measured here
    link_ms: float
    #: mean over batches: from a batch's arrival to the start of its first forward
    first_start_ms: float
    predicted_first_start_ms: float
    ttft_mean_ms: float
    predicted_ttft_mean_ms: float
    ttft_max_ms: float
    predicted_ttft_max_ms: float
    compute_idle_ms: float
    predicted_compute_idle_ms: float
    ttft_ms: tuple[float, ...]
    num_copies: int
    #: every round's total and compute alone, for spread
    total_ms_all: tuple[float, ...] = ()
    compute_ms_all: tuple[float, ...] = ()
    #: each forward's median time alone, in schedule order (the prediction's input)
    forward_alone_ms: tuple[float, ...] = ()
    #: each forward's start and end in the reported round, measured and predicted (where the two part)
    forward_start_ms: tuple[float, ...] = ()
    forward_end_ms: tuple[float, ...] = ()
    predicted_forward_start_ms: tuple[float, ...] = ()
    predicted_forward_end_ms: tuple[float, ...] = ()


@dataclass(frozen=True, kw_only=True)
class AdapterBench:
    num_adapters: int
    num_slots: int
    requests_per_batch: int
    num_batches: int
    prompt_tokens: int
    slot_bytes: int
    #: one adapter's copy, pinned to a slot, measured (median of a few)
    measured_copy_ms: float
    planned_copy_ms: float
    #: the plan's loading mode (adapters.mode), and by how much its prediction beat the other's
    plan_mode: str
    plan_mode_margin: float
    #: the modes served: the plan's unless forced (run --adapter-mode) or both (the benchmark script)
    modes: tuple[ModeResult, ...]
    #: the most requests a forward ran: the plan's sequences per step
    max_requests_per_forward: int = 1
    #: GPU memory on CUDA: the process's peak (the allocator's reserved peak and what it holds outside the
    #: allocator), against the plan's predicted total and the GPU memory the plan is made for (None elsewhere)
    peak_gpu_bytes: int | None = None
    predicted_total_gpu_bytes: int | None = None
    gpu_memory_bytes: int | None = None

    def as_dict(self) -> dict:
        """Plain data for --json."""
        return asdict(self)


def _memory_figures(loaded: Loaded) -> dict:
    """The process's GPU peak beside the plan's predicted total (runtime.serving.peak_gpu_bytes); nothing off CUDA."""
    device = loaded.engine.backend.device
    if device.type != "cuda":
        return {}
    memory = loaded.plan.memory
    return {"peak_gpu_bytes": peak_gpu_bytes(device), "predicted_total_gpu_bytes": memory.total_gpu_bytes,
            "gpu_memory_bytes": memory.gpu_memory_bytes}


def measure_copy_ms(pool: AdapterPool, adapter: str, num_copies: int = 5) -> float:
    """Median time of copying ``adapter`` into slot 0 on the copy stream, alone on the link."""
    backend = pool.backend
    times = []
    for _ in range(num_copies):
        start, done = backend.new_event("copy-start", timing=True), backend.new_event("copy-done", timing=True)
        backend.record_on_copy(start)
        pool.copy(adapter, 0, done)
        backend.synchronize()
        times.append(backend.elapsed_ms(start, done))
    return statistics.median(times)


def run_mode(loaded: Loaded, pool: AdapterPool, hooks: LoraHooks, schedule: StreamSchedule, prompts: torch.Tensor,
             copy_ms: dict[str, float], link_ms_per_byte: float, num_rounds: int = NUM_ROUNDS,
             warm_up: StreamSchedule | None = None) -> tuple[ModeResult, ServedStream]:
    """Warm up (``warm_up``, else the whole stream), then ``num_rounds`` of (the forwards alone, the stream with
    its copies), interleaved so drift hits both alike. Reported: the served round of median total; predicted
    from each forward's median time alone."""
    with torch.inference_mode():
        serve_stream(loaded.model, pool, hooks, warm_up or schedule, prompts)  # kernels, allocator
        alone, served = [], []
        for _ in range(num_rounds):
            alone.append(serve_stream(loaded.model, pool, hooks, schedule, prompts, copies=False).times)
            served.append(serve_stream(loaded.model, pool, hooks, schedule, prompts))
    compute_ms = [statistics.median(t.forward_end_ms[k] - t.forward_start_ms[k] for t in alone)
                  for k in range(len(schedule.forwards))]
    # the forwards alone still copy the offloaded weights: their pure compute is what the link model needs
    weights = weights_on_link(loaded.plan)
    predicted = simulate(schedule, copy_ms=copy_ms, compute_ms=pure_compute_ms(compute_ms, weights), weights=weights)
    totals = [run.times.total_ms for run in served]
    middle = served[totals.index(statistics.median_low(totals))]
    link_ms = sum(pool.layouts[load.adapter].num_bytes for load in schedule.loads) * link_ms_per_byte
    result = _mode_result(schedule, middle.times, predicted, sum(compute_ms), link_ms)
    return replace(result, total_ms_all=tuple(totals), forward_alone_ms=tuple(compute_ms),
                   forward_start_ms=middle.times.forward_start_ms, forward_end_ms=middle.times.forward_end_ms,
                   predicted_forward_start_ms=predicted.forward_start_ms,
                   predicted_forward_end_ms=predicted.forward_end_ms,
                   compute_ms_all=tuple(sum(e - s for s, e in zip(t.forward_start_ms, t.forward_end_ms))
                                        for t in alone)), middle


def _mode_result(schedule: StreamSchedule, measured: StreamTimes, predicted: StreamTimes, compute_ms: float,
                 link_ms: float) -> ModeResult:
    return ModeResult(
        mode=schedule.mode, total_ms=measured.total_ms, predicted_total_ms=predicted.total_ms, compute_ms=compute_ms,
        link_ms=link_ms,
        first_start_ms=statistics.mean(measured.first_start_ms),
        predicted_first_start_ms=statistics.mean(predicted.first_start_ms),
        ttft_mean_ms=statistics.mean(measured.ttft_ms), predicted_ttft_mean_ms=statistics.mean(predicted.ttft_ms),
        ttft_max_ms=max(measured.ttft_ms), predicted_ttft_max_ms=max(predicted.ttft_ms),
        compute_idle_ms=measured.compute_idle_ms, predicted_compute_idle_ms=predicted.compute_idle_ms,
        ttft_ms=measured.ttft_ms, num_copies=len(schedule.loads))


@dataclass
class StreamOutputs:
    """The stream's prompts and, per mode, its schedule and what was served (for checks against PEFT)."""

    prompts: torch.Tensor
    served: dict[str, tuple[StreamSchedule, ServedStream]]


def run_adapter_bench(loaded: Loaded, plan_path: Path | None = None, *, requests_per_batch: int | None = None,
                      num_batches: int = STREAM_NUM_BATCHES, pool_and_hooks=None,
                      modes: tuple[str, ...] | None = None,
                      num_rounds: int = NUM_ROUNDS) -> tuple[AdapterBench, StreamOutputs]:
    """Serve the stream the plan chose its loading mode on, in ``modes`` (default: the plan's adapters.mode).
    Batches have twice as many requests as slots (each a different adapter, where there are enough), so every
    batch needs more adapters than fit at once."""
    plan = loaded.plan
    modes = modes or (plan.adapters.mode,)
    pool, hooks = pool_and_hooks or load_pool(loaded.model, plan, loaded.engine.backend, plan_path)
    names = sorted(pool.layouts)
    per_batch = requests_per_batch or stream_requests_per_batch(plan.adapters.num_slots)
    batches = stream_batches(names, per_batch, num_batches)
    prompt_tokens = plan.workload.tokens_per_step // plan.workload.sequences_per_step
    # a forward is at most the plan's step: the activations its memory books
    max_requests = plan.workload.sequences_per_step
    num_requests = sum(len(batch) for batch in batches)
    prompts = random_ids(loaded.model, (num_requests, prompt_tokens), loaded.engine.backend.device)
    copy_ms = {row.name: row.copy_ms for row in plan.adapters.items}
    measured_copy = measure_copy_ms(pool, names[0])
    link_ms_per_byte = measured_copy / pool.layouts[names[0]].num_bytes
    results, outputs = [], StreamOutputs(prompts=prompts, served={})
    for mode in modes:
        schedule = schedule_stream(batches, plan.adapters.num_slots, mode, max_requests)
        # every batch is cut alike (as many distinct adapters as requests): the first one's forwards and copies
        # have the stream's shapes, and warm up for a quarter of the whole stream's time
        warm_up = schedule_stream(batches[:1], plan.adapters.num_slots, mode, max_requests)
        result, served = run_mode(loaded, pool, hooks, schedule, prompts, copy_ms, link_ms_per_byte, num_rounds,
                                  warm_up)
        results.append(result)
        outputs.served[mode] = (schedule, served)
    bench = AdapterBench(num_adapters=len(names), num_slots=plan.adapters.num_slots, requests_per_batch=per_batch,
                         num_batches=num_batches, prompt_tokens=prompt_tokens, slot_bytes=plan.adapters.slot_bytes,
                         measured_copy_ms=measured_copy, planned_copy_ms=plan.adapters.copy_ms,
                         plan_mode=plan.adapters.mode, plan_mode_margin=plan.adapters.mode_margin, modes=tuple(results),
                         max_requests_per_forward=max_requests, **_memory_figures(loaded))
    if pool_and_hooks is None:
        hooks.remove()
        pool.close()
    return bench, outputs
