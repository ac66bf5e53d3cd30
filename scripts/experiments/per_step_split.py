"""What a hybrid plan's decode step would gain if each step split its misses between the CPU and the link by the
count it actually drew, instead of by fixed CPU ids (arithmetic on plans bench_hybrid wrote; no GPU).

    PYTHONPATH=. python3 scripts/experiments/per_step_split.py OUT/qwen3-moe/choice-1.yaml ...

A plan with CPU experts (make, a weights plan of one sequence under uniform routing) fixes each layer's CPU ids,
and its layers wait E[max(link, CPU)] over how a step's top-k falls on them (planner.search.routed_step). With
every expert pinned on the host in bf16, the CPU could compute any non-resident expert: a step that draws n
non-resident experts could send j of them to the CPU, j chosen for that n, and wait min over j of
max(link(n - j), handoff + j x c), with the plan's own link wait (planned_layer_stall_ms at n - j experts), handoff
and CPU price c. This prints both waits per step and the step each gives. Written before the planner and the
runtime split by count (planner.search.cpu_per_step, make --cpu-experts auto), for plans made with fixed ids
(--cpu-experts fixed); kept as the estimate the built split was measured against.
"""

import argparse
import math

from planner.model.expert_prefetch import planned_layer_stall_ms
from planner.plan.file import read_plan
from planner.plan.schema import routed_layer_expert_bytes
from planner.search.routed_step import plan_decode_step, plan_fetches


def per_step_waits_ms(path: str) -> tuple[float, float, float]:
    """(the plan's step, its layers' waits, the waits split by each step's count), ms."""
    plan = read_plan(path)
    experts = plan.experts
    if experts.cpu is None or experts.routing != "uniform" or plan.workload.tokens_per_step != 1:
        raise SystemExit(f"{path}: not a one-sequence plan with CPU experts under uniform routing")
    if any(row.cpu_take for row in experts.cpu_layers):
        raise SystemExit(f"{path}: already split per step; make the plan with --cpu-experts fixed")
    step = plan_decode_step(plan)
    num_experts, top_k, handoff_ms = experts.num_experts, experts.top_k, experts.cpu.handoff_ms
    planned = split = 0.0
    for position, (row, fetch) in enumerate(zip(experts.routed_layers, plan_fetches(plan))):
        expert_ms = 1e3 * routed_layer_expert_bytes(plan, row) / experts.routed_fetch_bytes_per_s
        compute_ms = plan.layers[row.index].compute_ms + fetch.gather_ms

        def link_ms(count: int) -> float:
            return planned_layer_stall_ms(compute_ms, count * expert_ms, fetch.hit_share, predicted=position > 0,
                                          ahead_share=fetch.ahead_share)

        non_resident = num_experts - len(row.resident)
        for drawn in range(top_k + 1):
            p = (math.comb(non_resident, drawn) * math.comb(num_experts - non_resident, top_k - drawn)
                 / math.comb(num_experts, top_k))
            split += p * min(max(link_ms(drawn - j), handoff_ms + j * row.cpu_ms_per_expert if j else 0.0)
                             for j in range(drawn + 1))
        planned += step.layer_stall_ms[row.index]
    return step.step_ms, planned, split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plans", nargs="+")
    args = parser.parse_args()
    rows = [(path, *per_step_waits_ms(path)) for path in args.plans]
    print("| plan | step, ms | waits (fixed CPU ids) | waits (split by count) | step split by count |")
    print("|---|---|---|---|---|")
    for path, step_ms, planned_ms, split_ms in rows:
        print(f"| {path} | {step_ms:.2f} | {planned_ms:.2f} | {split_ms:.2f} | {step_ms - planned_ms + split_ms:.2f} |")


if __name__ == "__main__":
    main()
