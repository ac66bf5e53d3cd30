"""One routed decode step as a timeline: the one a plan is priced with (planner.search.expert_choice), ``show``
draws (planner.views.show) and scripts/bench_experts.py predicts its arms with.

The runtime orders a routed layer so (runtime.routed_experts, ``RoutedExperts.decode``): the layer's attention
and router run; at its experts the step joins the prefetch the previous routed layer started (if any), starts the
next routed layer's prefetch, gathers its misses (with no prediction, every routed, non-resident expert), and
only then computes the experts. So a routed layer's wait for its experts sits inside the layer, between its
router and its experts: the layer ends its compute plus its wait after it starts, and the next layer starts then.
The plan records one compute figure per layer, not where its router falls in it, so the timeline draws the wait
at WAIT_AT_LAYER_SHARE of the layer's compute; the step and its stalls do not depend on it.
"""

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from planner.model.cost import is_decode_step
from planner.model.expert_placement import RoutedLayer, RoutedPlacement, gather_ms, gather_rate
from planner.model.expert_prefetch import layer_shares, planned_layer_stall_ms
from planner.model.expert_routing import CpuDraw, PerStepCpu, StepDraw
from planner.search import cpu_experts
from planner.search.cpu_per_step import LinkWait, expected_wait_ms
from planner.plan.experts_section import ExpertLayer
from planner.plan.schema import Plan, copies_pairs, routed_layer_expert_bytes
from planner.search.simulate import Interval, Simulation

#: where in a routed layer's compute the timeline draws its wait: after attention and the router, before the
#: experts. A picture's choice (see the module's docstring): the step and its waits do not depend on it
WAIT_AT_LAYER_SHARE = 0.5


@dataclass(frozen=True, kw_only=True)
class RoutedFetch:
    """What one routed layer's experts cost a decode step on the link."""

    #: the layer's index in the stack
    index: int
    #: its routed, non-resident experts' bytes at the gather's rate
    link_ms: float
    #: one expert at the gather's rate (the fetch comes in whole experts); None: the layer fetches nothing
    expert_ms: float | None
    #: next-layer prefetch: the hits and the predictions gathered ahead as shares of the layer's routed,
    #: non-resident experts (planner.model.expert_prefetch.layer_shares); hit_share None: no prefetch
    hit_share: float | None
    ahead_share: float = 1.0
    #: the decode gather's time in the layer's compute beyond the all-resident layer's
    #: (planner.model.expert_placement.gather_ms)
    gather_ms: float = 0.0
    #: the layer's CPU path after its router (handoff and its CPU experts' expected compute; 0: no CPU experts):
    #: the layer waits for the later of it and the link
    cpu_ms: float = 0.0
    #: with CPU experts: how a step's touched experts fall on its CPU and fetched ids, the handoff and one CPU
    #: expert's time inside the step; the layer then waits E[max(link, CPU)] over the draw (None: a plan written
    #: without the per-expert figure, priced as the later of the two paths' expectations)
    cpu_draw: CpuDraw | None = None
    cpu_handoff_ms: float = 0.0
    cpu_ms_per_expert: float = 0.0
    #: a layer splitting each step's misses by their count (planner.search.cpu_per_step): its draw and table; the
    #: layer then waits E[max(link, CPU)] at the table's split of each step (cpu_draw None)
    cpu_per_step: PerStepCpu | None = None


def routed_decode_step(layer_ms: Sequence[float], head_ms: float, fetches: Sequence[RoutedFetch],
                       num_slots: int) -> Simulation:
    """The decode step: head, then every layer in order, a routed layer (``fetches``, in layer order) waiting
    inside its interval for what its fetch leaves on the critical path (planned_layer_stall_ms; the first routed
    layer is predicted by none). On the link (``copies``): an unpredicted layer's fetch as it waits; a predicted
    one's prefetch (its ahead share) from the previous routed layer's wait, where the runtime starts it, and its
    misses ending as it stops waiting. ``num_slots``: the distinct experts a step can route a layer to."""
    layer_ms = with_gathers(layer_ms, fetches)
    waits = _waits_ms(layer_ms, fetches, num_slots)
    by_index = {fetch.index: (position, fetch) for position, fetch in enumerate(fetches)}
    compute, copies, stalls = [Interval(layer=-1, start_ms=0.0, end_ms=head_ms)], [], []
    now, previous_wait_ms = head_ms, None
    for index, duration in enumerate(layer_ms):
        wait = waits.get(index, 0.0)
        if index not in by_index:
            compute.append(Interval(layer=index, start_ms=now, end_ms=now + duration))
        else:
            wait_start = now + WAIT_AT_LAYER_SHARE * duration
            compute += [Interval(layer=index, start_ms=now, end_ms=wait_start),
                        Interval(layer=index, start_ms=wait_start + wait, end_ms=now + duration + wait)]
            position, fetch = by_index[index]
            copies += _fetch_intervals(fetch, position > 0 and fetch.hit_share is not None, previous_wait_ms,
                                       wait_start + wait)
            previous_wait_ms = wait_start
        stalls.append(wait)
        now += duration + wait
    stall_ms = math.fsum(stalls)
    return Simulation(step_ms=head_ms + math.fsum(layer_ms) + stall_ms, stall_ms=stall_ms, compute=tuple(compute),
                      copies=tuple(copies), layer_stall_ms=tuple(stalls))


def with_gathers(layer_ms: Sequence[float], fetches: Sequence[RoutedFetch]) -> tuple[float, ...]:
    """Each layer's compute, a routed layer's with its decode gather."""
    gathers = {fetch.index: fetch.gather_ms for fetch in fetches}
    return tuple(ms + gathers.get(index, 0.0) for index, ms in enumerate(layer_ms))


def _fetch_intervals(fetch: RoutedFetch, predicted: bool, previous_wait_ms: float | None,
                     wait_end_ms: float) -> list[Interval]:
    """One routed layer's time on the link: its whole fetch ending as its wait ends, or, predicted, its prefetch
    from the previous routed layer's wait and its misses ending as its wait ends (empty parts left out)."""
    if not predicted:
        parts = [(wait_end_ms - fetch.link_ms, wait_end_ms)]
    else:
        misses_ms = (1 - fetch.hit_share) * fetch.link_ms
        parts = [(previous_wait_ms, previous_wait_ms + fetch.ahead_share * fetch.link_ms),
                 (wait_end_ms - misses_ms, wait_end_ms)]
    return [Interval(layer=fetch.index, start_ms=start, end_ms=end) for start, end in parts if end > start]


def _waits_ms(layer_ms: Sequence[float], fetches: Sequence[RoutedFetch], num_slots: int) -> dict[int, float]:
    """Per routed layer index, its wait for its experts (layer_wait_ms): every layer but the first routed one is
    predicted."""
    return {fetch.index: layer_wait_ms(fetch, layer_ms[fetch.index], position > 0, num_slots)
            for position, fetch in enumerate(fetches)}


def layer_wait_ms(fetch: RoutedFetch, compute_ms: float, predicted: bool, num_slots: int) -> float:
    """A routed layer's wait between its router and its experts, ``compute_ms`` its compute (with its gather),
    ``predicted`` whether a previous routed layer prefetched for it: its link's (planned_layer_stall_ms); with CPU
    experts, the later of the link and the CPU path at each step's routing, in expectation (CpuDraw, or a per-step
    split's draw and table: planner.search.cpu_per_step), where they run side by side, else both one after the
    other (planner.search.cpu_experts.CPU_PATH_OVERLAPS_LINK)."""
    if fetch.cpu_per_step is not None and cpu_experts.CPU_PATH_OVERLAPS_LINK:
        per_step = fetch.cpu_per_step
        link = LinkWait(compute_ms=compute_ms, expert_ms=per_step.expert_ms, hit_share=fetch.hit_share,
                        ahead_share=fetch.ahead_share, predicted=predicted)
        return expected_wait_ms(per_step, link, fetch.cpu_handoff_ms, fetch.cpu_ms_per_expert)
    if fetch.cpu_draw is None or not cpu_experts.CPU_PATH_OVERLAPS_LINK:
        link_ms = planned_layer_stall_ms(compute_ms, fetch.link_ms, fetch.hit_share, predicted=predicted,
                                         ahead_share=fetch.ahead_share, expert_ms=fetch.expert_ms,
                                         num_slots=num_slots)
        return cpu_experts.layer_wait_ms(link_ms, fetch.cpu_ms)
    return _hybrid_wait_ms(fetch.cpu_draw, compute_ms, fetch.expert_ms or 0.0, fetch.hit_share, fetch.ahead_share,
                           predicted, fetch.cpu_handoff_ms, fetch.cpu_ms_per_expert)


@functools.lru_cache(maxsize=8192)  # make prices the same layers at each candidate split and step size
def _hybrid_wait_ms(draw: CpuDraw, compute_ms: float, expert_ms: float, hit_share: float | None,
                    ahead_share: float, predicted: bool, handoff_ms: float, cpu_ms_per_expert: float) -> float:
    """E[max(link, CPU)] of one hybrid layer: at each step's n fetched experts, the link's wait for n whole
    experts (planned_layer_stall_ms at n x ``expert_ms``, the count known)."""
    def link_ms_at(num_fetched: int) -> float:
        return planned_layer_stall_ms(compute_ms, num_fetched * expert_ms, hit_share, predicted=predicted,
                                      ahead_share=ahead_share)

    return cpu_experts.expected_hybrid_wait_ms(draw, link_ms_at, handoff_ms, cpu_ms_per_expert)


def placement_fetches(placement: RoutedPlacement) -> tuple[RoutedFetch, ...]:
    """The planner's routed placement as the timeline's fetches."""
    return tuple(layer_fetch(placement, row) for row in placement.layers)


def layer_fetch(placement: RoutedPlacement, row: RoutedLayer) -> RoutedFetch:
    """One routed layer of the planner's ``placement`` (``row``, or a candidate in its place) as the timeline's
    fetch."""
    hit, ahead = placement.prefetch_accuracy, placement.prefetch_ahead_share
    return RoutedFetch(index=row.index, link_ms=row.fetch_ms, expert_ms=row.expert_ms, gather_ms=row.gather_ms,
                       cpu_ms=row.cpu_ms, cpu_draw=row.cpu_draw, cpu_handoff_ms=row.cpu_handoff_ms,
                       cpu_ms_per_expert=row.cpu_ms_per_expert, cpu_per_step=row.cpu_per_step,
                       **_shares(layer_shares(row, hit, ahead)))


def plan_fetches(plan: Plan, rows: tuple[ExpertLayer, ...] | None = None) -> tuple[RoutedFetch, ...]:
    """A plan's routed layers (or ``rows`` in their place) as the timeline's fetches, from the figures the plan
    holds: each layer's expected fetched bytes and expert bytes at the section's gather rate, its prefetch shares
    (ExpertsPlan.prefetch_shares where the layer holds none)."""
    experts, hardware = plan.experts, plan.hardware
    rate = experts.routed_fetch_bytes_per_s
    hit, ahead = experts.prefetch_shares() or (None, 1.0)
    tokens = plan.workload.tokens_per_step
    gathering, pairs_copied = is_decode_step(plan.workload), copies_pairs(plan)
    fetches = []
    for row in experts.routed_layers if rows is None else rows:
        expert_bytes = routed_layer_expert_bytes(plan, row)
        expert_ms = 1e3 * expert_bytes / rate
        gather = gather_ms(tokens, experts.top_k, experts.num_experts, expert_bytes,
                           gather_rate(hardware.hbm_bytes_per_s, hardware.compute_efficiency),
                           copies_pairs=pairs_copied) if gathering else 0.0
        fetches.append(RoutedFetch(index=row.index, link_ms=1e3 * row.expected_fetched_bytes / rate,
                                   expert_ms=expert_ms if row.expected_fetched_bytes else None, gather_ms=gather,
                                   cpu_ms=row.cpu_ms or 0.0, **_plan_cpu_draw(plan, row, expert_bytes),
                                   **_shares(layer_shares(row, hit, ahead))))
    return tuple(fetches)


def _plan_cpu_draw(plan: Plan, row: ExpertLayer, expert_bytes: int) -> dict:
    """A plan row's CpuDraw, handoff and CPU expert figures for RoutedFetch ({} without CPU experts, or from a
    plan written without cpu_ms_per_expert): the step's expected CPU experts from its cpu_ms less the handoff."""
    experts = plan.experts
    expected = experts.expected_cpu_experts(row)
    if expected is None:
        return {}
    common = {"cpu_handoff_ms": experts.cpu.handoff_ms, "cpu_ms_per_expert": row.cpu_ms_per_expert}
    if row.cpu_take:
        draw = step_draw(num_experts=experts.num_experts, top_k=experts.top_k, num_resident=len(row.resident),
                         mean_touched=expected + row.expected_fetched_bytes / expert_bytes,
                         num_tokens=plan.workload.tokens_per_step, uniform=experts.routing == "uniform")
        per_step = PerStepCpu(draw=draw, expert_ms=1e3 * expert_bytes / experts.routed_fetch_bytes_per_s,
                              take=row.cpu_take, fixed_ms=row.cpu_fixed_ms)
        return {"cpu_per_step": per_step, **common}
    draw = cpu_draw(num_experts=experts.num_experts, top_k=experts.top_k, num_resident=len(row.resident),
                    num_cpu_ids=len(row.cpu), mean_cpu_experts=expected,
                    mean_link_experts=row.expected_fetched_bytes / expert_bytes,
                    num_tokens=plan.workload.tokens_per_step, uniform=experts.routing == "uniform")
    return {"cpu_draw": draw, **common}


def cpu_draw(*, num_experts: int, top_k: int, num_resident: int, num_cpu_ids: int, mean_cpu_experts: float,
             mean_link_experts: float, num_tokens: int, uniform: bool) -> CpuDraw:
    """How a step of ``num_tokens`` falls on a hybrid layer's ``num_cpu_ids`` CPU ids and its other non-resident
    ids: drawn together for one token routed ``uniform``-ly (exact), each id independently otherwise. The means are
    clamped to the ids (a plan's rounded figures may pass them by a hair)."""
    num_link_ids = num_experts - num_resident - num_cpu_ids
    exact = uniform and num_tokens == 1
    return CpuDraw(num_cpu_ids=num_cpu_ids, num_link_ids=num_link_ids,
                   mean_cpu_experts=min(max(mean_cpu_experts, 0.0), num_cpu_ids),
                   mean_link_experts=min(max(mean_link_experts, 0.0), num_link_ids),
                   one_token_top_k=top_k if exact else 0, num_experts=num_experts if exact else 0)


def step_draw(*, num_experts: int, top_k: int, num_resident: int, mean_touched: float, num_tokens: int,
              uniform: bool) -> StepDraw:
    """How many of a layer's non-resident experts a step of ``num_tokens`` touches: exactly for one token routed
    ``uniform``-ly, binomial at ``mean_touched`` otherwise (clamped to the ids: a plan's rounded figures may pass
    them by a hair)."""
    num_non_resident = num_experts - num_resident
    exact = uniform and num_tokens == 1
    return StepDraw(num_non_resident=num_non_resident, mean_touched=min(max(mean_touched, 0.0), num_non_resident),
                    one_token_top_k=top_k if exact else 0, num_experts=num_experts if exact else 0)


def plan_decode_step(plan: Plan, rows: tuple[ExpertLayer, ...] | None = None) -> Simulation:
    """A routed plan's decode step from its own rows (what show draws and check holds prediction.step_ms to), or
    from ``rows`` in their place."""
    return routed_decode_step(tuple(row.compute_ms for row in plan.layers), plan.prediction.head_ms,
                              plan_fetches(plan, rows), plan.experts.fetch_slots)


def cpu_rate_step_ms(plan: Plan, scale: float) -> float | None:
    """A plan with CPU experts: its decode step by the same timeline (plan_decode_step) with every CPU expert's
    in-step time ``scale`` x its price, and the placement and per-step tables as planned (what the plan runs at, its
    tables kept, on a host whose CPU computes at that share of calibrate's price; run re-splits them:
    planner.search.cpu_resplit). None for a plan without CPU experts priced per expert."""
    rows = rows_at_cpu_scale(plan, scale)
    return None if rows is None else plan_decode_step(plan, rows).step_ms


def rows_at_cpu_scale(plan: Plan, scale: float) -> tuple[ExpertLayer, ...] | None:
    """The plan's routed rows with every CPU expert's in-step time (its whole price, and the part a fraction of one
    pays) ``scale`` x the plan's, the handoff as planned; None for a plan without CPU experts priced per expert."""
    experts = plan.experts
    if experts is None or experts.cpu is None or any(row.cpu_ms_per_expert is None for row in experts.cpu_layers):
        return None
    handoff_ms = experts.cpu.handoff_ms
    return tuple(replace(row, cpu_ms_per_expert=scale * row.cpu_ms_per_expert,
                         cpu_ms=handoff_ms + scale * (row.cpu_ms - handoff_ms),
                         cpu_fixed_ms=None if row.cpu_fixed_ms is None else scale * row.cpu_fixed_ms)
                 if row.cpu else row for row in experts.routed_layers)


def host_cpu_scale(plan: Plan, host_ms_per_step: float, experts_per_step: float | None = None) -> float | None:
    """The host CPU's rate inside the steps run --bench timed, over the plan's price: the host's own ms a step in
    its expert kernel (its clock: the handoffs left out) over the price of the experts it computed
    (``experts_per_step`` at the CPU layers' mean price of one: the rate whatever the routing drew, and whatever
    tables run re-split the steps by), or where not counted, over the plan's CPU ms a step less its handoffs. None
    for a plan without CPU experts or CPU time to compare."""
    experts = plan.experts
    if experts is None or experts.cpu is None:
        return None
    prices = [row.cpu_ms_per_expert for row in experts.cpu_layers]
    if experts_per_step and None not in prices:
        priced_ms = experts_per_step * math.fsum(prices) / len(prices)
    else:
        priced_ms = math.fsum(row.cpu_ms - experts.cpu.handoff_ms for row in experts.cpu_layers)
    return host_ms_per_step / priced_ms if priced_ms > 0 and host_ms_per_step > 0 else None


#: make warns of a traced plan whose step, routed uniformly, would take this many times its own, where its trace
#: never routed to TRACE_UNSEEN_WARN_SHARE of some layer's experts or more (a trace too short, or of prompts
#: that route alike, to know them: random weights' decodes, which repeat two tokens, left 90% unseen; a
#: Zipf-skewed 2,048-token trace of Qwen3-30B-A3B's 128 experts none, and its plan's uniform step is x1.5)
TRACE_CONDITION_WARN_RATIO = 1.5
TRACE_UNSEEN_WARN_SHARE = 0.25


@dataclass(frozen=True, kw_only=True)
class UniformRouting:
    """A traced routed plan's placement with its tokens routed uniformly instead of as its trace's were."""

    #: expected experts fetched a step, over every routed layer
    fetched_experts: float
    #: the decode step, ms: with CPU experts a floor (more of the step's pairs would reach them than the trace's)
    step_ms: float
    #: the plan's own step by the same timeline (plan_decode_step: prediction.step_ms, unrounded)
    planned_step_ms: float
    #: whether the plan has CPU experts (step_ms is then a floor)
    floor: bool


def uniform_routing_step(plan: Plan) -> UniformRouting | None:
    """A routed plan made from a routing trace, decoding tokens routed uniformly instead: the same resident and
    CPU experts, each layer's other experts touched at 1 - (1 - k/E)^B (B the step's tokens), each CPU path as
    planned. The trace's routing is the condition of the plan's promise; this says what the plan does without it
    (the routing a trace of few tokens, or of other prompts, may not hold). None: uniform routing, or no routed
    layer, or not a decode step."""
    experts = plan.experts
    if experts is None or experts.routing == "uniform" or not experts.routed_layers \
            or not is_decode_step(plan.workload):
        return None
    touched = 1 - (1 - experts.top_k / experts.num_experts) ** plan.workload.tokens_per_step
    rows, fetched = [], 0.0
    for row in experts.routed_layers:
        others = touched * (experts.num_experts - len(row.resident) - len(row.cpu))
        fetched += others
        # the trace's per-expert prefetch figures describe its own routing: the section's shares serve instead
        rows.append(replace(row, expected_fetched_bytes=round(others * routed_layer_expert_bytes(plan, row)),
                            prefetch_hit_share=None, prefetch_ahead_share=None))
    step = plan_decode_step(plan, tuple(rows)).step_ms
    return UniformRouting(fetched_experts=fetched, step_ms=step, planned_step_ms=plan_decode_step(plan).step_ms,
                          floor=any(row.cpu for row in rows))


def unseen_share(routing: tuple) -> float:
    """The largest share, over a trace's layers (planner.model.expert_routing.LayerRouting), of experts the trace
    never routed a token to; 0 for uniform routing."""
    return max((sum(share == 0 for share in layer.shares) / len(layer.shares) for layer in routing
                if layer.num_counted_tokens is not None and layer.shares), default=0.0)


def trace_condition_warning(plan: Plan, unseen: float) -> str | None:
    """make's warning where a traced plan's step, routed uniformly, would take TRACE_CONDITION_WARN_RATIO x its
    own or more and its trace never routed to ``unseen`` (TRACE_UNSEEN_WARN_SHARE or more) of some layer's
    experts: the promise holds only for traffic routed as the trace's was, and the trace has not seen most of
    what other traffic would route to."""
    uniform = uniform_routing_step(plan)
    if uniform is None or unseen < TRACE_UNSEEN_WARN_SHARE \
            or uniform.step_ms < TRACE_CONDITION_WARN_RATIO * uniform.planned_step_ms:
        return None
    return (f"the trace never routed to {100 * unseen:.0f}% of some layer's experts, and the plan's "
            f"{plan.prediction.step_ms:.2f} ms step holds for traffic routed as the trace's was: routed "
            f"uniformly, its resident experts would leave {uniform.fetched_experts:.1f} experts a step to fetch and "
            f"the step would take {'at least ' if uniform.floor else ''}{uniform.step_ms:.2f} ms "
            f"(x{uniform.step_ms / uniform.planned_step_ms:.1f}); record the trace on prompts like your traffic, "
            "with --decode-tokens for decode steps")


def _shares(shares: tuple[float | None, float]) -> dict:
    return {"hit_share": shares[0], "ahead_share": shares[1]}
