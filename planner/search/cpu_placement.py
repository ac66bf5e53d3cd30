"""The third placement wired into the routed decode step: which of a routed layer's non-resident experts the host
CPU computes (the split itself: planner.search.cpu_experts), and the placement and plan section that say so.

Per routed layer, split_layer balances the layer's expected misses between the link and the CPU at the step's
tokens per touched expert; the layer then sends round(cpu_share x non-resident) of its non-resident ids to the CPU
(the runtime sends every pair routed to them there), and the link fetches the rest. The CPU path is priced with no
overlap of the GPU's own experts (gpu_overlap_ms 0): the routed step computes its experts after its wait
(planner.search.routed_step), so nothing of the GPU's runs beside the CPU's in the step as priced.
"""

import math
from dataclasses import dataclass, replace

from planner.model.expert_placement import RoutedPlacement
from planner.model.expert_routing import LayerRouting
from planner.model.experts import MoeGeometry
from planner.plan.experts_section import CpuPlacement
from planner.search.cpu_experts import (CPU_WITHIN_LINK_FACTOR, link_expert_ms, max_cpu_tokens_per_expert,
                                        resolved_handoff_ms, split_layer, tokens_per_touched_expert)
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


def cpu_ids(routing: LayerRouting, resident: tuple[int, ...], share: float) -> tuple[int, ...]:
    """round(``share`` x the non-resident experts) of them for the CPU, ascending: the coldest first (the CPU's time
    grows with the tokens an expert gets), ties to the higher id, so under uniform routing, where any non-resident
    ids do as well, the highest ids."""
    kept = set(resident)
    non_resident = [e for e in range(len(routing.shares)) if e not in kept]
    count = round(share * len(non_resident))
    coldest = sorted(non_resident, key=lambda e: (routing.shares[e], -e))
    return tuple(sorted(coldest[:count]))


def hybrid_placement(placement: RoutedPlacement, *, geometry: MoeGeometry, routing: tuple[LayerRouting, ...],
                     inputs: CpuInputs, num_tokens: int, layer_ms: tuple[float, ...],
                     link_bytes_per_s: float) -> tuple[RoutedPlacement | None, CpuPlacement | None, str | None]:
    """``placement`` (a decode step of ``num_tokens`` sequences) with each routed layer's misses split between the
    link (``link_bytes_per_s``: the routed gather's rate) and the CPU: (the placement, its plan section, None), or
    (None, None, why the CPU takes no expert)."""
    cpu = inputs.cpu
    handoff_ms = resolved_handoff_ms(inputs.handoff_ms)
    tokens = tokens_per_touched_expert(num_tokens, geometry.top_k / geometry.num_experts)
    rows, reasons = [], []
    for row, layer, layer_routing, params in zip(placement.layers, geometry.layers, routing, inputs.expert_params):
        missed = row.expected_fetched_bytes / layer.expert_bytes
        split = split_layer(num_missed=missed, expert_bytes=layer.expert_bytes, expert_params=params,
                            link_bytes_per_s=link_bytes_per_s, cpu=cpu, tokens_per_expert=tokens,
                            compute_ms=layer_ms[row.index], handoff_ms=handoff_ms)
        ids = () if split.declined else cpu_ids(layer_routing, row.resident, split.cpu_share)
        if not ids:
            reasons.append(split.declined or f"the balanced share ({split.cpu_experts:.2f} of {missed:.2f} missed "
                                             "experts) rounds to no expert id")
            rows.append(row)
            continue
        touched = layer_routing.touched(num_tokens)
        on_cpu = min(missed, math.fsum(touched[e] for e in ids))
        link_bytes = max(0.0, row.expected_fetched_bytes - on_cpu * layer.expert_bytes)
        rows.append(replace(row, expected_fetched_bytes=link_bytes, fetch_ms=1e3 * link_bytes / link_bytes_per_s,
                            cpu=ids, cpu_ms=handoff_ms + on_cpu * split.cpu_ms_per_expert))
    if not any(row.cpu for row in rows):
        return None, None, reasons[0]
    copy_bytes = 0 if cpu.dtype == "bf16" else sum(
        len(row.cpu) * params * FP32_BYTES for row, params in zip(rows, inputs.expert_params))
    limit = inputs.host_limit_bytes
    if limit is not None and placement.host_pinned_bytes + copy_bytes > limit:
        return None, None, (f"an fp32 host copy of the CPU experts ({copy_bytes:,} bytes) beside the "
                            f"{placement.host_pinned_bytes:,} pinned does not fit the host's {limit:,} bytes")
    hybrid = replace(placement, layers=tuple(rows))
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
