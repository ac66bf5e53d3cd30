"""What a hybrid plan's step becomes when the host's CPU runs at another multiple of its price, with its own tables
and made again for that rate (arithmetic on plans bench_hybrid wrote; no GPU).

    PYTHONPATH=. python3 scripts/experiments/cpu_rate_replan.py --checkpoint /tmp/ckpt/qwen3-moe-header \
        --gpu calibrated.yaml OUT/qwen3-moe/choice-1.yaml OUT/qwen3-moe/choice-4.yaml --scales 1.13 1.69

For each plan and each scale: the plan's step by its own timeline with its CPU experts at that multiple of their
price and its tables unchanged (planner.search.routed_step.cpu_rate_step_ms: what the run gives on such a host),
and the prediction of the same make command with ``--cpu-time-scale`` at that scale (its resident experts, CPU
share and per-step tables chosen for that rate), from the plan's recorded layer times (a --measure plan's, as
check regenerates them) over ``--checkpoint``: the plan's checkpoint or a header-only copy of it
(scripts/conformance.py --dry-run writes them), since only headers are read. The fetch-only plan of the same
budget is priced beside (make --cpu-experts off).
"""

import argparse
from dataclasses import replace

from planner.make.make_plan import make_plan
from planner.plan.file import read_plan
from planner.search.routed_step import cpu_rate_step_ms
from planner.views.check import recorded_compute


def remade(plan, checkpoint: str, gpu: str, **inputs):
    """The plan's make command again over ``checkpoint`` with ``gpu`` and the given Inputs fields changed, from its
    recorded layer times."""
    changed = replace(plan.inputs, model=checkpoint, gpu=gpu, **inputs)
    context = plan.hardware.cuda_context_bytes if plan.inputs.measure else None
    return make_plan(changed, compute_override=recorded_compute(plan) if plan.inputs.measure else None,
                     context_bytes=context).plan


def cpu_experts_per_step(plan) -> float:
    """The plan's expected CPU experts a step (0 without CPU experts)."""
    experts = plan.experts
    if experts is None or experts.cpu is None:
        return 0.0
    return sum(experts.expected_cpu_experts(row) or 0.0 for row in experts.cpu_layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("plans", nargs="+")
    parser.add_argument("--checkpoint", required=True, help="the plans' checkpoint, or a header-only copy of it")
    parser.add_argument("--gpu", required=True, help="the profile the plans were made with")
    parser.add_argument("--scales", type=float, nargs="+", default=[0.75, 1.13, 1.69, 2.0])
    args = parser.parse_args()
    print("| plan | CPU at | its own tables, ms | made for that rate, ms | CPU experts a step | fetch-only, ms |")
    print("|---|---|---|---|---|---|")
    for path in args.plans:
        plan = read_plan(path)
        fetch_only = remade(plan, args.checkpoint, args.gpu, cpu_experts="off").prediction.step_ms
        for scale in [1.0, *args.scales]:
            again = remade(plan, args.checkpoint, args.gpu, cpu_time_scale=None if scale == 1.0 else scale)
            print(f"| {path} | {scale:g}x | {cpu_rate_step_ms(plan, scale):.3f} | {again.prediction.step_ms:.3f} | "
                  f"{cpu_experts_per_step(again):.1f} | {fetch_only:.3f} |")


if __name__ == "__main__":
    main()
