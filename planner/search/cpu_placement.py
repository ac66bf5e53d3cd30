"""The third placement wired into the routed decode step: which of a routed layer's non-resident experts the host
CPU computes (the split itself: planner.search.cpu_experts), and the placement and plan section that say so.

Per routed layer, split_layer weighs the CPU at the step's tokens per touched expert (its reasons to decline) and
balances the two paths' expectations; from there the layer takes the whole number of CPU experts whose expected
wait is least. A step waits for the later path at its own routing, so the wait is E[max(link, CPU)] over how the
step's touched experts fall on the CPU's ids and the link's (planner.search.routed_step.layer_wait_ms), more than
the later of the expectations: at one sequence a Mixtral layer with 3 of its 8 experts on the CPU waits for the
CPU when both of a token's experts land there. The runtime sends every pair routed to the CPU ids there; the link
fetches the rest. A layer may instead split each step's misses by their count (planner.search.cpu_per_step: any
non-resident expert may go to the CPU, j(m) of a step's m misses do; with an fp32 host copy, a copy of every
non-resident expert, else fixed ids where the host cannot hold it); LayerCpuSplit.best_row keeps whichever waits
less. The CPU path is priced with no overlap of the GPU's own experts (gpu_overlap_ms 0): the routed step computes
its experts after its wait (planner.search.routed_step), so nothing of the GPU's runs beside the CPU's in the step
as priced.
"""

import math
from dataclasses import dataclass, replace

from planner.model.expert_placement import RoutedLayer, RoutedPlacement
from planner.model.expert_routing import LayerRouting, PerStepCpu
from planner.model.experts import MoeGeometry
from planner.plan.experts_section import CpuPlacement
from planner.search.cpu_experts import (CPU_WITHIN_LINK_FACTOR, cpu_expert_fixed_ms, link_expert_ms,
                                        max_cpu_tokens_per_expert, resolved_handoff_ms, split_layer,
                                        tokens_per_touched_expert)
from planner.search.cpu_per_step import LinkWait, per_step_split
from planner.search.routed_step import cpu_draw, layer_fetch, layer_wait_ms, step_draw
from planner.source.profile import CpuExperts

#: bytes per weight of the fp32 host copy the CPU reads where the profile's fastest dtype is fp32
FP32_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class CpuInputs:
    """What the CPU placement needs beside a routed placement: the profile's figures and the model's experts."""

    cpu: CpuExperts
    #: per MoE layer (geometry order), one routed expert's weights (3 x H x I for a SwiGLU expert)
    expert_params: tuple[int, ...]
    #: host memory the plan is held to (--host-memory or the profile's); None: unchecked
    host_limit_bytes: int | None = None
    #: the CPU path's fixed cost a layer step: the profile's cpu_experts.handoff_us (None: not measured, and
    #: planner.search.cpu_experts.CPU_HANDOFF_MS, fitted on one host, is taken)
    handoff_ms: float | None = None
    #: whether a layer may split each step's misses by their count (planner.search.cpu_per_step; make
    #: --cpu-experts auto; fixed: fixed CPU ids only). With an fp32 host copy it then holds every non-resident
    #: expert; where the host cannot hold that, the layers keep fixed ids
    per_step: bool = True
    #: whether a per-step split may send a fraction of one more expert (its first rows) to the CPU
    #: (planner.search.cpu_per_step; make --cpu-experts rows)
    fractional: bool = False


def cpu_ids(routing: LayerRouting, resident: tuple[int, ...], count: int) -> tuple[int, ...]:
    """``count`` of the non-resident experts for the CPU, ascending: the coldest first (the CPU's time grows with
    the tokens an expert gets), ties to the higher id, so under uniform routing, where any non-resident ids do as
    well, the highest ids."""
    kept = set(resident)
    non_resident = [e for e in range(len(routing.shares)) if e not in kept]
    coldest = sorted(non_resident, key=lambda e: (routing.shares[e], -e))
    return tuple(sorted(coldest[:count]))


@dataclass(frozen=True, kw_only=True)
class LayerCpuSplit:
    """One routed layer of a decode placement with its candidate CPU counts: each count's layer (``candidate``),
    its expected wait (``wait_ms``) and the count of least wait (``best_count``)."""

    #: the placement the layer is in (its prefetch shares and fetch slots) and the layer's position among its
    #: routed layers (the first is predicted by none)
    placement: RoutedPlacement
    position: int
    #: the layer fetching every miss, and its routing
    row: RoutedLayer
    routing: LayerRouting
    expert_bytes: int
    num_experts: int
    top_k: int
    #: the step's tokens (one per sequence)
    num_tokens: int
    #: the layer's compute, all experts resident (its gather is added from the row)
    compute_ms: float
    #: the routed gather's rate
    link_bytes_per_s: float
    #: the CPU path's fixed cost a layer step, and one CPU expert inside the step at the step's tokens per expert
    handoff_ms: float
    cpu_ms_per_expert: float
    #: of cpu_ms_per_expert, the part a fraction of an expert still pays (planner.search.cpu_per_step; None: the
    #: per-step split takes whole experts only)
    cpu_fixed_ms: float | None = None

    @property
    def num_non_resident(self) -> int:
        """The layer's experts not on the GPU: the most the CPU can take."""
        return self.num_experts - len(self.row.resident)

    def candidate(self, count: int) -> RoutedLayer:
        """The layer with ``count`` of its non-resident experts on the CPU (0: the row, fetching every miss)."""
        row = self.row
        if count == 0:
            return row
        ids = cpu_ids(self.routing, row.resident, count)
        missed = row.expected_fetched_bytes / self.expert_bytes
        touched = self.routing.touched(self.num_tokens)
        on_cpu = min(missed, math.fsum(touched[e] for e in ids))
        link_bytes = max(0.0, row.expected_fetched_bytes - on_cpu * self.expert_bytes)
        draw = cpu_draw(num_experts=self.num_experts, top_k=self.top_k, num_resident=len(row.resident),
                        num_cpu_ids=count, mean_cpu_experts=on_cpu, mean_link_experts=link_bytes / self.expert_bytes,
                        num_tokens=self.num_tokens, uniform=self.routing.num_counted_tokens is None)
        return replace(row, expected_fetched_bytes=link_bytes, fetch_ms=1e3 * link_bytes / self.link_bytes_per_s,
                       cpu=ids, cpu_ms=self.handoff_ms + on_cpu * self.cpu_ms_per_expert,
                       cpu_handoff_ms=self.handoff_ms, cpu_ms_per_expert=self.cpu_ms_per_expert, cpu_draw=draw)

    def wait_ms(self, count: int) -> float:
        """The layer's expected wait between its router and its experts with ``count`` experts on the CPU."""
        return self.row_wait_ms(self.candidate(count))

    def row_wait_ms(self, row: RoutedLayer) -> float:
        """The expected wait between the router and the experts of ``row``, a candidate for the layer."""
        fetch = layer_fetch(self.placement, row)
        return layer_wait_ms(fetch, self.compute_ms + fetch.gather_ms, self.position > 0, self.placement.fetch_slots)

    def per_step(self) -> RoutedLayer:
        """The layer splitting each step's misses by their count (planner.search.cpu_per_step): any non-resident
        expert may go to the CPU, j(m) of a step's m misses do."""
        row = self.row
        fetch = layer_fetch(self.placement, row)
        expert_ms = link_expert_ms(self.expert_bytes, self.link_bytes_per_s)
        draw = step_draw(num_experts=self.num_experts, top_k=self.top_k, num_resident=len(row.resident),
                         mean_touched=row.expected_fetched_bytes / self.expert_bytes, num_tokens=self.num_tokens,
                         uniform=self.routing.num_counted_tokens is None)
        link = LinkWait(compute_ms=self.compute_ms + fetch.gather_ms, expert_ms=expert_ms, hit_share=fetch.hit_share,
                        ahead_share=fetch.ahead_share, predicted=self.position > 0)
        split = per_step_split(draw, link, self.handoff_ms, self.cpu_ms_per_expert, self.cpu_fixed_ms)
        link_bytes = split.mean_link_experts * self.expert_bytes
        kept = set(row.resident)
        return replace(row, expected_fetched_bytes=link_bytes, fetch_ms=1e3 * link_bytes / self.link_bytes_per_s,
                       cpu=tuple(e for e in range(self.num_experts) if e not in kept),
                       cpu_ms=self.handoff_ms + split.mean_cpu_experts * self.cpu_ms_per_expert,
                       cpu_handoff_ms=self.handoff_ms, cpu_ms_per_expert=self.cpu_ms_per_expert,
                       cpu_per_step=PerStepCpu(draw=draw, expert_ms=expert_ms, take=split.take,
                                               fixed_ms=split.fixed_ms))

    def best_row(self, start: int, per_step: bool) -> RoutedLayer:
        """The layer's candidate of least expected wait: fixed CPU ids at their best count (``start``: the
        expectations' balance), or, where ``per_step``, the per-step split if it waits less; ties keep the fixed
        ids."""
        fixed = self.candidate(self.best_count(start))
        if not per_step:
            return fixed
        split = self.per_step()
        if not any(split.cpu_per_step.take):
            return fixed
        waits = [round(self.row_wait_ms(row), WAIT_DECIMALS) for row in (fixed, split)]
        return split if waits[1] < waits[0] else fixed

    def best_count(self, start: int) -> int:
        """The CPU count of least expected wait, walking from ``start`` (the expectations' balance) while a
        neighbour waits less; 0 (fetching every miss) unless some count beats it. Ties keep fewer CPU experts."""
        waits = {}

        def wait(count: int) -> float:
            if count not in waits:
                waits[count] = round(self.wait_ms(count), WAIT_DECIMALS)
            return waits[count]

        best = min(max(start, 1), self.num_non_resident)
        for step in (-1, 1):
            while 0 < best + step <= self.num_non_resident and wait(best + step) < wait(best):
                best += step
        return best if wait(best) < wait(0) else 0


#: expected waits compared to this many decimals of a ms when choosing a layer's CPU count (a nanosecond: below
#: it, candidates tie and the fewer CPU experts win)
WAIT_DECIMALS = 6


def hybrid_placement(placement: RoutedPlacement, *, geometry: MoeGeometry, routing: tuple[LayerRouting, ...],
                     inputs: CpuInputs, num_tokens: int, layer_ms: tuple[float, ...],
                     link_bytes_per_s: float) -> tuple[RoutedPlacement | None, CpuPlacement | None, str | None]:
    """``placement`` (a decode step of ``num_tokens`` sequences) with each routed layer's misses split between the
    link (``link_bytes_per_s``: the routed gather's rate) and the CPU: (the placement, its plan section, None), or
    (None, None, why the CPU takes no expert). Per layer, split_layer weighs the CPU (its reasons to decline) and
    balances the paths' expectations; the layer then takes the whole CPU count, near that balance, whose expected
    wait E[max(link, CPU)] over the step's routing is least (LayerCpuSplit.best_count)."""
    cpu = inputs.cpu
    handoff_ms = resolved_handoff_ms(inputs.handoff_ms)
    tokens = tokens_per_touched_expert(num_tokens, geometry.top_k / geometry.num_experts)
    rows, reasons = [], []
    for position, (row, layer, layer_routing, params) in enumerate(zip(placement.layers, geometry.layers, routing,
                                                                       inputs.expert_params)):
        missed = row.expected_fetched_bytes / layer.expert_bytes
        split = split_layer(num_missed=missed, expert_bytes=layer.expert_bytes, expert_params=params,
                            link_bytes_per_s=link_bytes_per_s, cpu=cpu, tokens_per_expert=tokens,
                            compute_ms=layer_ms[row.index], handoff_ms=handoff_ms)
        if split.declined:
            reasons.append(split.declined)
            rows.append(row)
            continue
        layer_split = LayerCpuSplit(placement=placement, position=position, row=row, routing=layer_routing,
                                    expert_bytes=layer.expert_bytes, num_experts=geometry.num_experts,
                                    top_k=geometry.top_k, num_tokens=num_tokens, compute_ms=layer_ms[row.index],
                                    link_bytes_per_s=link_bytes_per_s, handoff_ms=handoff_ms,
                                    cpu_ms_per_expert=split.cpu_ms_per_expert,
                                    cpu_fixed_ms=cpu_expert_fixed_ms(cpu, split.cpu_ms_per_expert)
                                    if inputs.fractional else None)
        best = layer_split.best_row(round(split.cpu_share * layer_split.num_non_resident), inputs.per_step)
        if not best.cpu:
            reasons.append(f"no whole number of CPU experts near the balance ({split.cpu_experts:.2f} of "
                           f"{missed:.2f} missed experts) waits less than fetching every miss, over the step's "
                           "routing")
        rows.append(best)
    if not any(row.cpu for row in rows):
        return None, None, reasons[0]
    copy_bytes = 0 if cpu.dtype == "bf16" else sum(
        len(row.cpu) * params * FP32_BYTES for row, params in zip(rows, inputs.expert_params))
    limit = inputs.host_limit_bytes
    if limit is not None and placement.host_pinned_bytes + copy_bytes > limit:
        if inputs.per_step and any(row.cpu_per_step for row in rows):
            # a per-step split's fp32 copy holds every non-resident expert: fixed ids copy only theirs
            return hybrid_placement(placement, geometry=geometry, routing=routing,
                                    inputs=replace(inputs, per_step=False), num_tokens=num_tokens, layer_ms=layer_ms,
                                    link_bytes_per_s=link_bytes_per_s)
        return None, None, (f"an fp32 host copy of the CPU experts ({copy_bytes:,} bytes) beside the "
                            f"{placement.host_pinned_bytes:,} pinned does not fit the host's {limit:,} bytes")
    # the device buffer's zero row, which the CPU's experts read as resident at (runtime.routed_experts): the
    # caller left room for it (expert_choice._with_cpu)
    zero_row_bytes = geometry.max_expert_bytes
    hybrid = replace(placement, layers=tuple(rows), weight_bytes=placement.weight_bytes + zero_row_bytes,
                     fetch_buffer_bytes=placement.fetch_buffer_bytes + zero_row_bytes)
    section = CpuPlacement(dtype=cpu.dtype, threads=cpu.threads, host_copy_bytes=copy_bytes,
                           handoff_ms=handoff_ms, cpu_ms_per_step=math.fsum(row.cpu_ms for row in rows),
                           link_ms_per_step=math.fsum(row.fetch_ms for row in rows))
    return hybrid, section, None


def prefill_declined(inputs: CpuInputs, geometry: MoeGeometry, num_tokens: int, h2d_bytes_per_s: float) -> str:
    """Why a prefill chunk of ``num_tokens`` tokens computes no expert on the CPU: the tokens each expert gets
    against the most at which the CPU stays within the link's reach (max_cpu_tokens_per_expert, the largest
    layer's experts), and, below it, that routed prefill copies experts whole for now."""
    layer = max(geometry.layers, key=lambda row: row.expert_bytes)
    params = inputs.expert_params[geometry.layers.index(layer)]
    most = max_cpu_tokens_per_expert(inputs.cpu, params, link_expert_ms(layer.expert_bytes, h2d_bytes_per_s))
    tokens = num_tokens * geometry.top_k / geometry.num_experts
    if tokens > most:
        return (f"a prefill chunk of {num_tokens} tokens sends {tokens:.3g} to each expert, past the {most} the "
                f"CPU computes within {CPU_WITHIN_LINK_FACTOR:g}x of the link's copy: copying experts whole")
    return (f"a prefill chunk of {num_tokens} tokens sends {tokens:.3g} to each expert (the CPU keeps up to {most}), "
            "but routed prefill copies experts whole for now: the CPU is planned for decode steps")
