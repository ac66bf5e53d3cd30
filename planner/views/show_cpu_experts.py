"""``show``'s lines on the third placement of a routed expert: which experts the host CPU computes, the CPU's and
the link's share of the step, the numerics, and why the CPU was declined where it was."""

import math
from dataclasses import replace
from itertools import groupby

from planner.plan.experts_section import ExpertsPlan
from planner.plan.schema import Plan
from planner.search.cpu_resplit import RESPLIT_TOLERANCE, RESPLIT_WINDOW_STEPS, resplit_at_scale
from planner.search.routed_step import cpu_rate_step_ms, plan_decode_step
from planner.units import format_bytes, format_ms

#: the CPU experts' tolerance against the all-resident layer on the GPU, as a share of the reference output's
#: largest magnitude: runtime.cpu_experts' FP32_TOLERANCE and BF16_TOLERANCE (planner/ imports no runtime module)
NUMERICS = ("CPU arithmetic is not bitwise the GPU's (another kernel, another summation order): with an fp32 host "
            "copy a layer's output is within 1e-5, with bf16 within 2^-6, of the reference output's largest "
            "magnitude (the same experts in fp32 on both sides); greedy tokens may split from all-resident's "
            "where its logits, or a router's scores, are that near a tie, and a router that chooses otherwise "
            "changes what the steps after compute (docs/experts.md, Numerics; scripts/conformance.py tells such a "
            "split from a fault)")


def cpu_lines(plan: Plan, experts: ExpertsPlan) -> list[str]:
    """The CPU experts in words, or why the CPU takes none (nothing where the profile measured no CPU)."""
    if experts.cpu_declined is not None:
        return [f"  CPU experts: declined: {experts.cpu_declined}."]
    cpu = experts.cpu
    if cpu is None:
        return []
    step = plan.prediction.step_ms
    return [
        *_placement_lines(experts),
        f"  After the routers, per step: the CPU {format_ms(cpu.cpu_ms_per_step)} (with a {format_ms(cpu.handoff_ms)} "
        f"handoff per layer), the link {format_ms(cpu.link_ms_per_step)}; against the step's {format_ms(step)}: "
        f"CPU {_share(cpu.cpu_ms_per_step, step)}, link {_share(cpu.link_ms_per_step, step)} (the two overlap).",
        *_spread_lines(plan, experts),
        *_rate_lines(plan),
        f"  Numerics: {NUMERICS}.",
    ]


def _placement_lines(experts: ExpertsPlan) -> list[str]:
    """Which experts the CPU computes: fixed ids (every pair routed to them), or, in layers that split each step
    by the count it misses (cpu_take), the first j(m) of a step's m misses."""
    cpu, layers = experts.cpu, experts.cpu_layers
    copy = (f", an fp32 copy of them: {format_bytes(cpu.host_copy_bytes)} of host memory beside the pinned experts"
            if cpu.host_copy_bytes else ", reading the pinned bf16 experts in place")
    split = [row for row in layers if row.cpu_take]
    fixed = [row for row in layers if not row.cpu_take]
    lines = []
    if fixed:
        lines.append(f"  Third placement: the host CPU computes {sum(len(row.cpu) for row in fixed)} fixed experts of "
                     f"{len(fixed)} routed layers ({cpu.threads} threads{copy}); every (token, expert) pair routed to "
                     "them goes to the CPU, the link fetches the other misses, and each layer waits after its router "
                     "for the later of the two.")
    if split:
        expected = math.fsum(experts.expected_cpu_experts(row) for row in split)
        lines.append(f"  Third placement, split per step: in {len(split)} routed layers ({cpu.threads} threads{copy}) "
                     "a step that misses m experts (touched, not resident, not prefetched) sends the first j(m) of "
                     "them by id to the CPU and fetches the rest, so both paths end near together whatever the step "
                     f"drew; {expected:.1f} CPU experts a step in expectation. j(m) for m = 0, 1, 2, ...: "
                     + _tables(split) + " (past the list, its last entry)." + _fraction_words(split))
    if fixed:
        lines.append("  Experts per layer, resident / CPU / fetched when touched: " + _per_layer(experts) + ".")
    return lines


def _fraction_words(rows) -> str:
    """Where a table holds fractions: what a fraction sends, and what it costs the CPU."""
    fixed = [row.cpu_fixed_ms for row in rows if row.cpu_fixed_ms is not None]
    if not fixed:
        return ""
    return (" A fraction f sends the first f of one more expert's intermediate rows to the CPU and fetches the rest "
            "of it (its slot's first rows zero), the two parts summed; the CPU pays "
            f"{format_ms(min(fixed))} of a part's time whole (the kernel's per-expert cost) and the rest in "
            "proportion.")


def _tables(rows) -> str:
    """Each split layer's table j(m), runs of equal tables as one range."""
    parts = []
    for take, run in groupby(rows, key=lambda row: row.cpu_take):
        indices = [row.index for row in run]
        where = f"layer {indices[0]}" if len(indices) == 1 else f"layers {indices[0]}-{indices[-1]}"
        parts.append(f"{where} {', '.join(map(str, take))}")
    return "; ".join(parts)


def _spread_lines(plan: Plan, experts: ExpertsPlan) -> list[str]:
    """What the spread of a step's routing costs: each layer waits for its later path at that step's routing, so
    the step's expected waits against the same paths at their means (nothing for a plan written without
    cpu_ms_per_expert, priced at the means)."""
    priced = [row.cpu_ms_per_expert for row in experts.cpu_layers if row.cpu_ms_per_expert is not None]
    if not priced:
        return []
    at_means = tuple(replace(row, cpu_ms_per_expert=None, cpu_take=(), cpu_fixed_ms=None)
                     for row in experts.routed_layers)
    spread_ms, means_ms = plan_decode_step(plan).stall_ms, plan_decode_step(plan, at_means).stall_ms
    return [f"  A CPU expert takes {format_ms(min(priced))}"
            + (f" to {format_ms(max(priced))}" if max(priced) > min(priced) else "")
            + " inside the step. A layer waits for the later path at its own step's routing (a step that sends more "
            f"pairs than usual to the CPU waits for it): {format_ms(spread_ms)} of waits a step in expectation, "
            f"where both paths at their means would wait {format_ms(means_ms)}."]


#: the host CPU's rate inside the step against its price (calibrate's lone expert x the in-step factor), as run
#: --bench counts it (the host's own ms a step in its expert kernel over the price of the experts it computed:
#: planner.search.routed_step.host_cpu_scale) on H200 hosts of 2026-11-29: 0.67 (OLMoE at four sequences, with the
#: per-step tables re-split) to 2.04 (OLMoE at four, on the plan's tables), the same profile's lone rate throughout;
#: one DeepSeek-V2-Lite arm 4.9 (benchmarks/2026-11-29-cpu-resplit-h200.md, 2026-11-29-conformance-rerun-h200.md)
CPU_RATE_SPREAD = (0.67, 2.04)


def _rate_lines(plan: Plan) -> list[str]:
    """What the host CPU's rate does to the step: the plan's timeline with the CPU experts at the ends of the
    spread measured inside steps (CPU_RATE_SPREAD), the tables as planned, and where run re-splits the plan's
    per-step tables at the rate it measures (planner.search.cpu_resplit), with the tables made again there (nothing
    without per-expert prices)."""
    fast, slow = (cpu_rate_step_ms(plan, scale) for scale in CPU_RATE_SPREAD)
    if fast is None or slow is None:
        return []
    scale = plan.inputs.cpu_time_scale
    priced = ("calibrate's rate" if scale is None
              else f"{scale:g}x calibrate's rate (--cpu-time-scale), as a host's run --bench counted it")
    lines = [f"  The host CPU's rate moves the step: at {CPU_RATE_SPREAD[0]:g}x its price "
             f"{format_ms(fast)}, at {CPU_RATE_SPREAD[1]:g}x {format_ms(slow)} (the prediction takes {priced}; "
             "inside steps H200 hosts ran their CPU experts at "
             f"{CPU_RATE_SPREAD[0]:g}-{CPU_RATE_SPREAD[1]:g}x of it from one host and day to the next, which a "
             "calibrate alone does not see: run --bench counts this host's against the plan)."]
    resplit = [resplit_at_scale(plan, scale) for scale in CPU_RATE_SPREAD]
    if None not in resplit:
        lines.append(f"  run re-splits each step's misses at the rate it measures (every {RESPLIT_WINDOW_STEPS} "
                     f"decode steps, where it is {RESPLIT_TOLERANCE:.0%} or more from the tables'): the step then "
                     f"{format_ms(resplit[0].step_ms)} at {CPU_RATE_SPREAD[0]:g}x and {format_ms(resplit[1].step_ms)} "
                     f"at {CPU_RATE_SPREAD[1]:g}x (OFFLOAD_PLAN_CPU_RESPLIT=off keeps these tables).")
    return lines


def _per_layer(experts: ExpertsPlan) -> str:
    """Each routed layer's resident / CPU / fetched counts, runs of equal counts as one range."""
    counts = [(row.index, (len(row.resident), len(row.cpu), experts.num_experts - len(row.resident) - len(row.cpu)))
              for row in experts.routed_layers if not row.cpu_take]
    parts = []
    for triple, run in groupby(counts, key=lambda item: item[1]):
        indices = [index for index, _ in run]
        where = f"layer {indices[0]}" if len(indices) == 1 else f"layers {indices[0]}-{indices[-1]}"
        parts.append(f"{where} {triple[0]} / {triple[1]} / {triple[2]}")
    return "; ".join(parts)


def _share(part_ms: float, step_ms: float) -> str:
    return f"{100 * part_ms / step_ms:.0f}%" if step_ms > 0 else "-"
