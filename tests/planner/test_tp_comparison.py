"""planner.views.tp_comparison: make --tp N,M's lines and verdict (end to end through make and diff:
tests/planner/test_tensor_parallel_plans.py)."""

from planner.plan.file import read_plan
from planner.views.tp_comparison import TpRow, compare_tp, tp_row, tp_verdict


def _row(tp_size: int, tokens_per_s: float, pinned_bytes: int) -> TpRow:
    return TpRow(tp_size=tp_size, tokens_per_s=tokens_per_s, gpu_bytes_per_rank=70 * 2**30,
                 host_pinned_bytes_per_rank=pinned_bytes, num_offloaded=40 if pinned_bytes else 0, num_layers=80)


def test_fewer_gpus_with_offloading_against_more_without_names_the_better_per_gpu():
    few, many = _row(2, 300.0, 50 * 2**30), _row(4, 1000.0, 0)
    verdict = tp_verdict((few, many))
    assert verdict.startswith("2 GPU(s) with offloading serve 300 tokens/s (150 per GPU) against 1,000 (250 per GPU)")
    assert "3.33x the total" in verdict and verdict.endswith("4 GPUs without offloading give more per GPU")
    assert tp_verdict((_row(2, 600.0, 50 * 2**30), many)).endswith("2 GPUs with offloading give more per GPU")


def test_when_every_count_offloads_or_none_does_the_verdict_names_the_most_per_gpu():
    resident = tp_verdict((_row(2, 500.0, 0), _row(4, 800.0, 0)))
    assert resident == "every GPU count compared can keep every weight resident; 2 GPU(s) serve the most per GPU " \
                       "(250 tokens/s)"
    assert tp_verdict((_row(2, 100.0, 1), _row(4, 800.0, 1))).startswith("every GPU count compared must offload; 4")


def test_a_plan_reads_as_one_row_and_one_line(good_plan, workdir):
    plan = read_plan(workdir / "out.yaml")
    row = tp_row(plan)
    assert row.tp_size == 1 and row.tokens_per_s > 0 and row.tokens_per_s_per_gpu == row.tokens_per_s
    assert row.num_layers == plan.model.num_layers and row.offloads == (plan.memory.host_pinned_bytes > 0)
    comparison = compare_tp([plan])
    assert comparison.rows == (row,) and len(comparison.lines) == 1
    assert comparison.lines[0].startswith(f"1 GPU(s): {row.tokens_per_s:,.0f} tokens/s")
