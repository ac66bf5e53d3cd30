"""``run``'s tables: what ``offload-plan run --bench`` measured against what the plan predicted, one table per
kind of runtime.run.RunResult (the figures are read off the result's record; nothing here imports the runtime).
"""

from rich.table import Table

from planner.units import format_bytes, format_ms, format_rate


def result_table(result, tp: int) -> Table:
    """The table of a --bench RunResult (``tp``: the plan's tensor-parallel ranks)."""
    if result.kind == "rank workload":
        return _rank_table(result.measured, tp)
    if result.kind == "rank serving":
        return _rank_serving_table(result.measured, tp)
    return {"workload": _bench_table, "serving": _serving_table, "adapters": _adapter_table}[result.kind](
        result.measured)


#: said under each rank table
_BEYOND_CAPTION = ("beyond the plan's split: what transformers holds that vLLM's sharding (the plan's) splits, e.g. "
                   "transformers 5.17's whole input embedding on every rank")


def _rank_table(rows, tp: int) -> Table:
    """Each rank measured against its plan: step, weights on the GPU (and what transformers holds beyond the
    plan's split), peak memory, link."""

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


def _serving_table(result) -> Table:
    """A serving plan measured against predicted: decode tokens/s and step, a prefill chunk, peak memory."""

    table = Table(title=f"run --bench ({result.mode}, {result.concurrency} sequences at context "
                        f"{result.context_tokens}): measured against predicted", title_justify="left")
    for name in ("", "measured", "predicted", "measured / predicted"):
        table.add_column(name, justify="right" if name else "left")
    rows = (("decode tokens/s", result.decode_tokens_per_s, result.predicted_decode_tokens_per_s, format_rate),
            (f"decode step ({result.decode_step_statistic} of {len(result.decode_step_ms_all)})",
             result.decode_step_ms, result.predicted_decode_step_ms, format_ms),
            (f"prefill chunk ({result.prefill_chunk_tokens} tokens)", result.prefill_chunk_ms,
             result.predicted_prefill_chunk_ms, format_ms),
            ("peak GPU memory", result.peak_gpu_bytes, result.predicted_total_gpu_bytes, format_bytes))
    for label, measured, predicted, text in rows:
        table.add_row(label, text(measured), text(predicted), f"{measured / predicted:.2f}")
    cap = f"capped to {result.memory_fraction:.3f} of this GPU" if result.memory_fraction else "uncapped"
    table.add_row("GPU memory of the plan", format_bytes(result.gpu_memory_bytes), cap, "")
    _add_routed_rows(table, result.routed)
    return table


def _add_routed_rows(table: Table, routed) -> None:
    """A routed plan's decode steps: the experts' bytes over the link a step and the next-layer prediction's
    accuracy, measured against the plan's; the caption says how to price the measured routing."""
    if routed is None:
        return
    predicted = routed.predicted_bytes_per_step
    table.add_row(f"routed experts over the link a step ({routed.num_steps} steps)",
                  format_bytes(round(routed.fetched_bytes_per_step)), format_bytes(predicted),
                  f"{routed.fetched_bytes_per_step / predicted:.2f}" if predicted else "")
    _add_cpu_row(table, routed.cpu)
    measured, planned = routed.prefetch_accuracy, routed.planned_prefetch_accuracy
    if measured is None or planned is None:
        return
    table.add_row("next-layer prediction right (mean over ranks)", f"{measured:.1%}", f"{planned:.1%}",
                  f"{measured / planned:.2f}" if planned else "")
    _add_caption(table, f"this run's routing: make the plan again with --prefetch-accuracy {measured:.2f} to price "
                        "it (or record a trace of your prompts: offload-plan trace, then make --routing-trace)")


def _add_caption(table: Table, text: str) -> None:
    """``text`` after what the table's caption already says (a routed plan's CPU and routing each add one)."""
    table.caption = f"{table.caption} {text}" if table.caption else text


#: run --bench suggests make --cpu-time-scale where the host's CPU ran further than this from its price (a margin
#: chosen, not measured, for drifts like the 0.75-1.69x counted between H200 hosts)
CPU_SCALE_TOLERANCE = 0.15


def _add_cpu_row(table: Table, cpu: dict | None) -> None:
    """Where the plan computes experts on the host CPU: the host's own ms a step (its pairs, by which handoff)
    against the plan's CPU ms a step. The host's ms leave out the handoff, which the plan's include."""
    if not cpu:
        return
    planned = cpu.get("planned_cpu_ms_per_step")
    measured = cpu["host_ms_per_step"]
    table.add_row(f"host CPU's experts a step ({cpu['pairs_per_step']:.1f} pairs{cpu_experts_text(cpu)}, "
                  f"{cpu['handoff']})",
                  format_ms(measured), format_ms(planned) if planned else "-",
                  f"{measured / planned:.2f}" if planned else "")
    repriced = cpu.get("step_ms_at_host_cpu_rate")
    if repriced is not None:
        table.add_row(f"the plan's decode step at this host's CPU rate ({cpu['host_cpu_scale']:.2f}x its price; "
                      "the prediction's error beyond it is not the CPU's)", "", format_ms(repriced), "")
        resplit_ms = cpu.get("step_ms_resplit_at_host_cpu_rate")
        if resplit_ms is not None:
            table.add_row("  with its CPU tables made again at that rate (run re-splits the steps)", "",
                          format_ms(resplit_ms), "")
        _add_resplit_caption(table, cpu.get("resplit"))
        if abs(cpu["host_cpu_scale"] - 1) > CPU_SCALE_TOLERANCE and cpu.get("cpu_time_scale"):
            _add_caption(table, f"this host's CPU computed its experts at {cpu['host_cpu_scale']:.2f}x the plan's "
                                f"price: make the plan again with --cpu-time-scale {cpu['cpu_time_scale']:g} to "
                                "split the steps for it")


def _add_resplit_caption(table: Table, resplit: dict | None) -> None:
    """Where run re-split the plan's per-step CPU tables at the host's rate (runtime.cpu_resplit): at what scale, and
    the layers changed."""
    if not resplit or not resplit["events"]:
        return
    last = resplit["events"][-1]
    _add_caption(table, f"run re-split the CPU's share of each step's misses {len(resplit['events'])} time(s), last "
                        f"at {last['scale']:.2f}x the plan's price of a CPU expert ({len(last['changed_layers'])} "
                        "layers' tables changed; OFFLOAD_PLAN_CPU_RESPLIT=off keeps the plan's).")


def cpu_experts_text(cpu: dict) -> str:
    """", N experts (M planned)": the host's distinct CPU experts a step (run --bench's counters, per step) against
    the plan's expectation, where counted ("" for rows from before 2026-11-29)."""
    measured, planned = cpu.get("experts_per_step"), cpu.get("planned_experts_per_step")
    if measured is None:
        return ""
    return f", {measured:.1f} experts" + (f" ({planned:.1f} planned)" if planned is not None else "")


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
    memory = "" if result.peak_gpu_bytes is None else f"; peak GPU {format_bytes(result.peak_gpu_bytes)}" + (
        "" if result.predicted_total_gpu_bytes is None else
        f" (the plan's total {format_bytes(result.predicted_total_gpu_bytes)})")
    table.caption = (f"one adapter copy: {result.measured_copy_ms:.2f} ms measured, {result.planned_copy_ms:.2f} ms "
                     f"planned; the plan chose {result.plan_mode}, predicted {result.plan_mode_margin:.1%} faster "
                     f"than the other (--adapter-mode serves either); forwards of at most "
                     f"{result.max_requests_per_forward} request(s), the plan's step{memory}")
    return table


def _bench_table(result) -> Table:
    """Measured against predicted: step, weights, peak memory, tokens/s, stall and link."""

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
    _add_routed_rows(table, result.routed)
    return table
