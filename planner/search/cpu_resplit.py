"""A per-step split's tables made again at the CPU rate a run measures (``run`` re-splits its steps with them).

A plan's per-step layers (planner.search.cpu_per_step) send the first j(m) of a step's m misses to the host CPU,
j chosen at calibrate's price of one CPU expert. Inside a captured step the host's CPU ran the same experts at
0.67-2.04x that price on the same H200 host type within a day (bench_hybrid, 2026-11-29), while the link's rate
held: tables set for one rate then keep the CPU busy past the link (OLMoE at four sequences and 2.04x: 59.0 ms a
step, where fetching every miss took 43.3). The resident experts, the CPU ids and every buffer stay as planned;
only j changes, so the plan's memory holds whatever the tables say. This module gives the tables and the step at
a scale of the price: each per-step layer's j(m) of least expected wait, by the same draw, link and handoff the
plan's timeline prices the layer with (routed_step.layer_wait_ms), its CPU experts at ``scale`` x their price.
Layers with fixed CPU ids keep them (their ids are the host's copy; the runtime cannot move them).
"""

from dataclasses import dataclass, replace

from planner.plan.schema import Plan
from planner.search.cpu_per_step import LinkWait, per_step_split
from planner.search.routed_step import plan_fetches, routed_decode_step, rows_at_cpu_scale, with_gathers

#: decode steps between two readings of the host's rate: a window of one sequence's steps computes 100-150 CPU
#: experts on Qwen3-30B-A3B- and OLMoE-shaped plans at 24 and 6 GiB (15 a step, 2026-11-29), enough for a rate
RESPLIT_WINDOW_STEPS = 16
#: the tables are made again where the measured scale is more than this share away from theirs. One process's
#: windows read scales up to 8% apart at a steady rate (0.63-0.71 and 0.64-0.74 in two conformance arms, 2026-11-29),
#: which a smaller margin would chase; at the margin's edge the tables made again save 1-5% of the step on paper
#: (OLMoE-shaped plans at one and four sequences)
RESPLIT_TOLERANCE = 0.15


@dataclass(frozen=True, kw_only=True)
class CpuResplit:
    """A plan's per-step tables at a scale of its CPU price, and its decode step with them and as planned."""

    #: the CPU experts' in-step time over the plan's price
    scale: float
    #: per-step layer index -> j(m) at ``scale`` (every per-step layer, changed or not)
    tables: dict[int, tuple[float, ...]]
    #: the plan's decode step at ``scale`` with ``tables``, ms
    step_ms: float
    #: the same with the plan's own tables (routed_step.cpu_rate_step_ms), ms
    planned_tables_step_ms: float


def per_step_tables(plan: Plan) -> dict[int, tuple[float, ...]]:
    """Layer index -> the plan's own j(m), for its layers that split each step's misses by their count."""
    experts = plan.experts
    if experts is None:
        return {}
    return {row.index: tuple(row.cpu_take) for row in experts.routed_layers if row.cpu_take}


def resplit_at_scale(plan: Plan, scale: float) -> CpuResplit | None:
    """The plan's per-step tables made again with its CPU experts at ``scale`` x their price (whole experts where
    the plan's layer takes whole ones, fractions where it already splits one by its rows), and its decode step
    with them and with its own; None for a plan without per-step layers priced per expert, or a scale not above
    0."""
    rows = rows_at_cpu_scale(plan, scale) if scale > 0 and per_step_tables(plan) else None
    if rows is None:
        return None
    fetches = plan_fetches(plan, rows)
    compute_ms = tuple(row.compute_ms for row in plan.layers)
    layer_ms = with_gathers(compute_ms, fetches)
    tables, resplit = {}, []
    for position, fetch in enumerate(fetches):
        per_step = fetch.cpu_per_step
        if per_step is not None:
            # the link as the timeline prices this layer (routed_step.layer_wait_ms): all but the first predicted
            link = LinkWait(compute_ms=layer_ms[fetch.index], expert_ms=per_step.expert_ms,
                            hit_share=fetch.hit_share, ahead_share=fetch.ahead_share, predicted=position > 0)
            split = per_step_split(per_step.draw, link, fetch.cpu_handoff_ms, fetch.cpu_ms_per_expert,
                                   per_step.fixed_ms)
            tables[fetch.index] = split.take
            fetch = replace(fetch, cpu_per_step=replace(per_step, take=split.take, fixed_ms=split.fixed_ms))
        resplit.append(fetch)

    def step_ms(with_fetches) -> float:
        return routed_decode_step(compute_ms, plan.prediction.head_ms, tuple(with_fetches),
                                  plan.experts.fetch_slots).step_ms

    return CpuResplit(scale=scale, tables=tables, step_ms=step_ms(resplit), planned_tables_step_ms=step_ms(fetches))
