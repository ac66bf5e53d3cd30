"""make --tp N,M's comparison of GPU counts, which diff restates and show's tensor-parallel line reads: each
plan's tokens/s in total and per GPU, its memory per rank and what it offloads, and one sentence of verdict."""

from dataclasses import dataclass

from planner.units import format_bytes


@dataclass(frozen=True, kw_only=True)
class TpRow:
    """One GPU count's plan, as the comparison reads it."""

    tp_size: int
    tokens_per_s: float
    gpu_bytes_per_rank: int
    host_pinned_bytes_per_rank: int
    num_offloaded: int
    num_layers: int

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.tp_size

    @property
    def offloads(self) -> bool:
        return self.host_pinned_bytes_per_rank > 0


@dataclass(frozen=True, kw_only=True)
class TpComparison:
    """make --tp N,M's comparison: one line per plan and the verdict."""

    rows: tuple[TpRow, ...]
    lines: tuple[str, ...]
    verdict: str


def tp_row(plan) -> TpRow:
    """Tokens/s of the engine (all ranks together: each rank runs every sequence's share), memory per rank."""
    prediction, memory = plan.prediction, plan.memory
    if prediction.decode_tokens_per_s is not None:
        tokens_per_s = prediction.decode_tokens_per_s
    else:
        tokens_per_s = 1e3 * plan.workload.tokens_per_step / prediction.step_ms if prediction.step_ms else 0.0
    return TpRow(tp_size=plan.inputs.tp, tokens_per_s=tokens_per_s,
                 gpu_bytes_per_rank=memory.total_gpu_bytes if memory.total_gpu_bytes is not None else memory.gpu_bytes,
                 host_pinned_bytes_per_rank=memory.host_pinned_bytes,
                 num_offloaded=len(plan.offload.layers) or (len(plan.experts.layers) if plan.experts is not None
                                                            and plan.experts.fetch_slots else 0),
                 num_layers=plan.model.num_layers)


def compare_tp(plans) -> TpComparison:
    """Tokens/s in total and per GPU, memory per rank and what each GPU count offloads, with the verdict."""
    rows = tuple(sorted((tp_row(plan) for plan in plans), key=lambda row: row.tp_size))
    lines = tuple(
        f"{row.tp_size} GPU(s): {row.tokens_per_s:,.0f} tokens/s, {row.tokens_per_s_per_gpu:,.0f} per GPU; "
        f"{format_bytes(row.gpu_bytes_per_rank)} of GPU memory per rank, "
        + (f"{format_bytes(row.host_pinned_bytes_per_rank)} pinned per rank ({row.num_offloaded}/{row.num_layers} "
           "layers offloaded)" if row.offloads else "nothing offloaded")
        for row in rows)
    return TpComparison(rows=rows, lines=lines, verdict=tp_verdict(rows))


def tp_verdict(rows: tuple[TpRow, ...]) -> str:
    """One sentence: the fewest GPUs with offloading against the fewest without, by tokens/s per GPU."""
    offloading = [row for row in rows if row.offloads]
    resident = [row for row in rows if not row.offloads]
    if not offloading or not resident:
        best = max(rows, key=lambda row: row.tokens_per_s_per_gpu)
        how = "offload" if offloading else "keep every weight resident"
        return (f"every GPU count compared must {how}" if offloading else f"every GPU count compared can {how}") + (
            f"; {best.tp_size} GPU(s) serve the most per GPU ({best.tokens_per_s_per_gpu:,.0f} tokens/s)")
    few, many = offloading[0], resident[0]
    better = few if few.tokens_per_s_per_gpu >= many.tokens_per_s_per_gpu else many
    ratio = many.tokens_per_s / few.tokens_per_s if few.tokens_per_s else float("inf")
    return (f"{few.tp_size} GPU(s) with offloading serve {few.tokens_per_s:,.0f} tokens/s "
            f"({few.tokens_per_s_per_gpu:,.0f} per GPU) against {many.tokens_per_s:,.0f} "
            f"({many.tokens_per_s_per_gpu:,.0f} per GPU) on {many.tp_size} without, {ratio:.2f}x the total: "
            + (f"{few.tp_size} GPUs with offloading give more per GPU" if better is few else
               f"{many.tp_size} GPUs without offloading give more per GPU"))
