"""``show``'s serving and adapters tables: tokens/s by concurrency, and the adapters' slots, waits and loading mode."""

from rich import box
from rich.table import Table
from rich.text import Text

from planner.plan.schema import Plan
from planner.units import format_bytes, format_ms, format_rate


#: the serving chart's columns other than its bar, with their padding (six columns of 9 or 10 characters:
#: "sequences", "582.75 MiB"); measured on the checked-in serving plans (65-66), one spare: an 80-column terminal
#: leaves the bar 13
CHART_TEXT_COLUMNS = 67
CHART_MIN_BAR_COLUMNS, CHART_MAX_BAR_COLUMNS = 8, 40


def chart_bar_columns(console_columns: int) -> int:
    """The bar's width for a console this wide: the text columns keep theirs (issue 26: at 80 columns the headers
    collapsed to "sequenc…"), the bar takes what is left."""
    return max(CHART_MIN_BAR_COLUMNS, min(CHART_MAX_BAR_COLUMNS, console_columns - CHART_TEXT_COLUMNS))


def serving_chart(plan: Plan, bar_columns: int = CHART_MAX_BAR_COLUMNS) -> Table:
    """Tokens/s against concurrency, one row per concurrency searched, with the best placement at each."""
    points = plan.serving.points
    top = max((p.tokens_per_s for p in points), default=0.0) or 1.0
    title = "Decode tokens/s by concurrency (the best placement at each; > the plan, = offloads nothing)"
    if plan.serving.max_tpot_ms is not None:
        title += f"; x: over --max-tpot-ms {plan.serving.max_tpot_ms:g}"
    # no vertical rules and no edge padding: the six text columns and a bar fit 80 columns
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                  padding=(0, 1, 0, 0))
    for name in ("sequences", "tokens/s", "", "per token", "offloaded", "KV cache", "GPU total"):
        table.add_column(name, justify="left" if name == "" else "right")
    routed = {p.concurrency for p in plan.experts.points if p.routed} if plan.experts else set()
    for point in points:
        fits = point.step_ms is not None
        bar = "#" * round(bar_columns * point.tokens_per_s / top)
        resident = point.num_offloaded == 0 and point.concurrency not in routed
        mark = ">" if point.concurrency == plan.workload.concurrency else ("=" if resident else " ")
        if fits and plan.serving.max_tpot_ms is not None and point.step_ms > plan.serving.max_tpot_ms:
            mark = "x"
        table.add_row(
            f"{mark} {point.concurrency}",
            format_rate(point.tokens_per_s) if fits else "-",
            Text(bar, style="cyan" if mark == ">" else "green" if mark == "=" else ""),
            format_ms(point.step_ms) if fits else "does not fit",
            f"{point.num_offloaded}/{plan.model.num_layers}{' routed' if point.concurrency in routed else ''}"
            if fits else "-",
            format_bytes(point.kv_cache_bytes),
            format_bytes(point.total_gpu_bytes) if fits else "-",
        )
    return table


def adapters_table(plan: Plan) -> Table:
    """The adapters, their slots and pinned pool, and the wait of a batch whose adapters are not loaded."""
    adapters = plan.adapters
    title = (f"Adapters: {len(adapters.items)} pinned in host memory ({format_bytes(adapters.host_pinned_bytes)}), "
             f"{adapters.num_slots} GPU slot(s) x {format_bytes(adapters.slot_bytes)}")
    table = Table(title=title, title_justify="left")
    for name, justify in (("name", "left"), ("source", "left"), ("rank", "right"), ("alpha", "right"),
                          ("modules", "left"), ("bytes", "right"), ("copy", "right")):
        table.add_column(name, justify=justify)
    for row in adapters.items:
        table.add_row(row.name, row.source + (f" @ {row.revision[:12]}" if row.revision else ""), str(row.rank),
                      f"{row.alpha:g}", " ".join(row.target_modules), format_bytes(row.bytes), format_ms(row.copy_ms))
    table.caption = (
        f"A batch missing {adapters.num_missing} adapter(s): blocking (copy all, then compute) makes every request "
        f"wait {format_ms(adapters.blocking_wait_ms)}, the compute stream idle as long; pipelined (each request "
        f"starts when its adapter lands) starts the first after {format_ms(adapters.pipelined_first_wait_ms)} and "
        f"the last after {format_ms(adapters.pipelined_last_wait_ms)}, later copies sharing the link with the "
        f"offloaded weights ({format_ms(adapters.shared_copy_ms)} each); steps meanwhile take "
        f"{format_ms(adapters.pipelined_step_ms)} (planned {format_ms(plan.prediction.step_ms)}).\n"
        + mode_sentence(plan)
    )
    table.caption_justify = "left"
    return table


def mode_sentence(plan: Plan) -> str:
    """Which loading mode run serves, and why: the predicted totals of the stream it was chosen on."""
    adapters = plan.adapters
    totals = {"blocking": adapters.blocking_stream_ms, "pipelined": adapters.pipelined_stream_ms}
    other = "pipelined" if adapters.mode == "blocking" else "blocking"
    if adapters.mode == "pipelined":
        why = ("the copies after each wave's first land while its lead computes"
               + (", and the offloaded weights' extra pass per wave stays under compute" if plan.offload.layers
                  else ""))
    else:
        why = ("a pipelined wave's copies share the link with its forwards' passes over the offloaded weights"
               if plan.offload.layers else "a wave's adapters load before it as fast as beside its lead")
    per_forward = plan.workload.sequences_per_step
    requests = f"{per_forward} request{'' if per_forward == 1 else 's'}"
    return (f"Loading: {adapters.mode} (run --bench serves it; --adapter-mode {other} forces the other). Over "
            f"{adapters.stream_num_batches} batches of {adapters.stream_requests_per_batch} requests, each a "
            f"different adapter, in forwards of at most {requests} (the plan's step), "
            f"it is predicted {format_ms(totals[adapters.mode])} against "
            f"{format_ms(totals[other])} {other} ({other} takes {adapters.mode_margin:.1%} longer): {why}.")
