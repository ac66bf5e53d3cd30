"""Routed experts as a placement the searches weigh against streaming whole layers (planner.model.experts models the
physics; this module turns it into a Choice the weight and serving searches compare, and into the plan's
``experts`` section).

At every step size a MoE plan is searched at (a serving concurrency, or a weights plan's one step), two
placements compete within the same GPU bytes: today's whole-layer search (planner.search.groups), and every MoE layer
routed with as many resident experts as the budget holds (chosen by planner.model.expert_placement.choose_resident).
The faster step wins; a tie goes to whole layers (what engines run). Both use the one host link: a routed plan copies
nothing whole at decode, so its fetches have the link to themselves.
"""

import math
from dataclasses import dataclass

from planner.model.expert_placement import (RoutedPlacement, routed_placement, staged_bytes, wasted_prefetch_bytes,
                                             with_prefetch_depth)
from planner.model.expert_prefetch import PREFETCH_ACCURACY, ExpertPrediction, default_rank_accuracy
from planner.model.expert_routing import LayerRouting, uniform_routing
from planner.model.experts import MoeGeometry, routed_fetch_bytes_per_s
from planner.plan.experts_section import (NEXT_LAYER_ROUTER, ROUTED, WHOLE_LAYER, CpuPlacement, ExpertLayer,
                                          ExpertsPlan, ExpertsPoint, summary_regime)
from planner.search.cpu_placement import CpuInputs, hybrid_placement, prefill_declined
from planner.search.groups import STEP_MS_DECIMALS, Choice, LayerBytes, Searcher, copy_ms_of
from planner.search.routed_step import placement_fetches, routed_decode_step
from planner.search.simulate import Simulation
from planner.model.cost import ComputeTimes


@dataclass(frozen=True, kw_only=True)
class RoutedChoice(Choice):
    """A placement with every MoE layer routed (offloaded is empty: no layer streams whole)."""

    placement: RoutedPlacement
    #: the layers' experts on the host CPU (placement's rows hold their ids), None: fetch only
    cpu: CpuPlacement | None = None
    #: why the CPU takes no expert where the profile measured it (None: it takes some, or was not measured)
    cpu_declined: str | None = None


@dataclass(frozen=True, kw_only=True)
class ExpertModel:
    """A MoE model's experts as the searches see them."""

    geometry: MoeGeometry
    #: per MoE layer, each expert's share of tokens: uniform, or from a trace
    routing: tuple[LayerRouting, ...]
    #: the plan's experts.routing: "uniform" or "trace sha256:<hex>"
    routing_label: str
    #: why routed placements are not chosen (None: they are considered)
    unavailable: str | None
    #: unavailable only because the runtime cannot gather these (quantized) experts: routed placements are priced
    #: beside whole layers, on paper, never chosen
    on_paper: bool = False
    #: next-layer prefetch's accuracy over every rank (make --prefetch-accuracy, else the rank curve's mean)
    prefetch_accuracy: float = PREFETCH_ACCURACY
    #: per rank of the prediction (top_k of them), its accuracy: --prefetch-accuracy at every rank, a trace's
    #: measured figures, else planner.model.expert_prefetch.default_rank_accuracy
    rank_accuracy: tuple[float, ...] = ()
    #: make --prefetch-depth: the depth the plan must use (0: no prefetch); None: the planner chooses
    prefetch_depth: int | None = None
    #: per predicted MoE layer index, a trace's per-expert prediction statistics: each layer's prefetch is priced
    #: over its own non-resident experts (the rank curve serves the layers without them); None: the curve alone
    predictions: dict[int, ExpertPrediction] | None = None
    #: where the prediction's accuracy comes from (the plan's experts.prefetch_accuracy_source): "assumed" (the
    #: default curve or --prefetch-accuracy), "trace_per_rank" or "trace_per_expert"
    accuracy_source: str = "assumed"
    #: the host CPU's expert figures and the model's expert sizes (make --cpu-experts auto with a profile that
    #: measured them, weights plans); None: every miss is fetched
    cpu: CpuInputs | None = None


def expert_model(geometry: MoeGeometry, routing: tuple[LayerRouting, ...] | None, routing_label: str,
                 unavailable: str | None, prefetch_accuracy: float | None = None,
                 rank_accuracy: tuple[float, ...] | None = None, prefetch_depth: int | None = None,
                 predictions: dict[int, ExpertPrediction] | None = None) -> ExpertModel:
    """The model's experts with uniform routing unless ``routing`` is given; the prediction's per-rank accuracy
    ``prefetch_accuracy`` at every rank if given (the trace's figures unused), else ``rank_accuracy`` (a trace's)
    if given, else the default curve, and per layer a trace's per-expert ``predictions`` where given;
    ``prefetch_depth``: pinned by make --prefetch-depth."""
    if prefetch_accuracy is not None:
        ranks, predictions, source = (prefetch_accuracy,) * geometry.top_k, None, "assumed"
    else:
        ranks = tuple(rank_accuracy) if rank_accuracy else default_rank_accuracy(geometry.top_k)
        source = "trace_per_expert" if predictions else "trace_per_rank" if rank_accuracy else "assumed"
    return ExpertModel(geometry=geometry, routing=routing or uniform_routing(geometry), routing_label=routing_label,
                       unavailable=unavailable or geometry.unroutable_reason,
                       on_paper=unavailable is None and geometry.priced_on_paper,
                       prefetch_accuracy=round(math.fsum(ranks) / len(ranks), 4) if prefetch_accuracy is None
                       else prefetch_accuracy, rank_accuracy=ranks, prefetch_depth=prefetch_depth,
                       predictions=predictions or None, accuracy_source=source)


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Both placements at one step size, and the one chosen."""

    num_tokens: int
    whole: Choice | None
    routed: RoutedChoice | None
    #: False: the routed placement is priced on paper only (ExpertModel.on_paper) and never chosen
    routed_runnable: bool = True

    @property
    def chosen(self) -> Choice | None:
        """The faster (at the search's rounding); a tie, or routed alone absent, goes to whole layers."""
        if self.routed is None or not self.routed_runnable:
            return self.whole
        if self.whole is None:
            return self.routed
        routed_ms = round(self.routed.simulation.step_ms, STEP_MS_DECIMALS)
        return self.routed if routed_ms < round(self.whole.simulation.step_ms, STEP_MS_DECIMALS) else self.whole

    def point(self, concurrency: int) -> ExpertsPoint:
        """The plan's row for this comparison."""
        chosen = self.chosen
        return ExpertsPoint(
            concurrency=concurrency,
            regime=ROUTED if isinstance(chosen, RoutedChoice) else WHOLE_LAYER,
            routed_step_ms=None if self.routed is None else self.routed.simulation.step_ms,
            whole_layer_step_ms=None if self.whole is None else self.whole.simulation.step_ms,
            num_resident=0 if self.routed is None else self.routed.placement.num_resident,
        )


def routed_choice(experts: ExpertModel, *, searcher: Searcher, compute: ComputeTimes, budget_bytes: int,
                  num_tokens: int, decode: bool, non_layer_bytes: int, h2d_bytes_per_s: float,
                  copy_overhead_us: float, gather_bytes_per_s: float | None = None) -> RoutedChoice | None:
    """Every MoE layer routed, with the most resident experts whose arena fits ``budget_bytes``; None where
    routed placements are unavailable (unless priced on paper) or even none resident does not fit. ``decode``:
    steps of one token per sequence gather routed experts, with next-layer prefetch where that is predicted
    faster (its second slot set costs resident experts; a tie keeps one set) at the depth predicted fastest
    (``choose_prefetch_depth``);
    other steps (prefill, and decode steps routing more pairs than experts: planner.model.experts.decode_gathers)
    copy each layer's experts whole."""
    if experts.unavailable is not None and not experts.on_paper:
        return None
    layers = searcher.layers
    staged_decode = decode and not experts.geometry.decode_gathers(num_tokens)
    decode = decode and not staged_decode

    def placed(accuracy: float | None, spare_bytes: int = 0) -> RoutedPlacement | None:
        return routed_placement(experts.geometry, experts.routing, num_tokens=num_tokens,
                                layer_total_bytes=layers.total, non_layer_bytes=non_layer_bytes,
                                weight_limit_bytes=searcher.weight_limit(budget_bytes) - spare_bytes,
                                h2d_bytes_per_s=h2d_bytes_per_s, prefetch_accuracy=accuracy,
                                gather_bytes_per_s=gather_bytes_per_s if decode else None)

    def fetch_only(spare_bytes: int) -> list[RoutedPlacement]:
        """The decode placements fetching every miss within the budget less ``spare_bytes``: without prefetch
        (unless make --prefetch-depth pins one) and at each prefetch depth allowed (none where nothing fits)."""
        placement = placed(None, spare_bytes)
        if placement is None:
            return []
        wanted = experts.prefetch_depth != 0 and len(placement.layers) > 1
        prefetching = placed(experts.prefetch_accuracy, spare_bytes) if wanted else None
        if prefetching is None:
            return [placement]
        at_depths = [with_prefetch_depth(prefetching, experts.rank_accuracy, depth, experts.predictions)
                     for depth in prefetch_depths(experts)]
        return at_depths if experts.prefetch_depth is not None else [placement, *at_depths]

    if decode:
        candidates = fetch_only(0)  # empty where even no resident expert fits
        if not candidates:
            return None
        placement, simulation = fastest(compute, candidates)
        placement, simulation, cpu, declined = _with_cpu(experts, compute, placement, simulation, num_tokens,
                                                         h2d_bytes_per_s, fetch_only)
        # the link carries the ranks gathered ahead (hits and wasted) and the misses: as many as the step routes
        # to, plus the wasted ones
        copy_bytes = round(placement.expected_fetched_bytes + wasted_prefetch_bytes(placement))
    else:
        placement = placed(None)
        if placement is None:
            return None
        simulation = prefill_simulation(experts.geometry, compute, h2d_bytes_per_s, copy_overhead_us)
        copy_bytes = sum(staged_bytes(experts.geometry).values())
        cpu, declined = None, None if experts.cpu is None else (
            staged_declined(experts.geometry, num_tokens) if staged_decode else
            prefill_declined(experts.cpu, experts.geometry, num_tokens, h2d_bytes_per_s))
    return RoutedChoice(group_size=0, num_in_group=0, prefetch_step=0, offloaded=(), replay_start_copies=0,
                        simulation=simulation, gpu_bytes=searcher.gpu_bytes(placement.weight_bytes),
                        host_pinned_bytes=placement.host_pinned_bytes, copy_bytes=copy_bytes, placement=placement,
                        cpu=cpu, cpu_declined=declined)


def staged_declined(geometry, num_tokens: int) -> str:
    """Why a decode step routing more pairs than experts computes none on the CPU: it stages every expert whole."""
    return (f"a decode step of {num_tokens} sequences routes {num_tokens * geometry.top_k} (token, expert) pairs, "
            f"more than the {geometry.num_experts} experts: the runtime copies every expert whole (the staging "
            "path, as a prefill chunk), where the CPU computes none")


def _with_cpu(experts: ExpertModel, compute: ComputeTimes, placement: RoutedPlacement, simulation: Simulation,
              num_tokens: int, h2d_bytes_per_s: float, fetch_only):
    """The decode ``placement`` with experts on the CPU where the profile measured it and that step is faster:
    (placement, simulation, its CpuPlacement or None, why the CPU was declined or None). The hybrid is built on
    ``fetch_only(spare_bytes)``'s placement with room for the device buffer's zero row (one expert: the row the CPU's
    experts read as resident at, runtime.routed_experts)."""
    if experts.cpu is None:
        return placement, simulation, None, None
    zero_row_bytes = experts.geometry.max_expert_bytes
    rooms = fetch_only(zero_row_bytes)
    if not rooms:
        return placement, simulation, None, (f"no room beside the resident experts for the zero row the CPU's experts "
                                             f"read as resident at ({zero_row_bytes:,} bytes)")
    # the prefetch depth is chosen with the CPU beside the link, not for fetching alone: the CPU takes the misses a
    # wrong guess leaves, so a shallower prefetch (fewer wasted bytes on the link) can be faster with it
    hybrids = [hybrid_placement(room, geometry=experts.geometry, routing=experts.routing, inputs=experts.cpu,
                                num_tokens=num_tokens, layer_ms=compute.layer_ms,
                                link_bytes_per_s=routed_fetch_bytes_per_s(h2d_bytes_per_s)) for room in rooms]
    placed = [(hybrid, section) for hybrid, section, _ in hybrids if hybrid is not None]
    if not placed:
        return placement, simulation, None, hybrids[0][2]
    hybrid, with_cpu = fastest(compute, [hybrid for hybrid, _ in placed])
    section = next(section for candidate, section in placed if candidate is hybrid)
    if round(with_cpu.step_ms, STEP_MS_DECIMALS) < round(simulation.step_ms, STEP_MS_DECIMALS):
        return hybrid, with_cpu, section, None
    return placement, simulation, None, (f"the step with CPU experts ({with_cpu.step_ms:.3f} ms) is no faster than "
                                         f"fetching every miss ({simulation.step_ms:.3f} ms)")


def choose_prefetch_depth(experts: ExpertModel, compute: ComputeTimes,
                          placement: RoutedPlacement) -> tuple[RoutedPlacement, Simulation]:
    """The prefetching ``placement`` at the depth m (ranks of each token's prediction gathered ahead, 1..k) whose
    decode step is predicted fastest, with its simulation; make --prefetch-depth pins m. Ties go to the smaller m
    (fewer bytes on the link). Each rank gathered in one layer's compute shadow only saves; past it, a rank costs
    its wasted bytes on the critical path (planner.model.expert_prefetch.prefetch_layer_stall_ms), so poor deep
    ranks lower m.
    With a trace's per-expert figures each layer's shares are its non-resident experts' (with_prefetch_depth)."""
    return fastest(compute, [with_prefetch_depth(placement, experts.rank_accuracy, depth, experts.predictions)
                             for depth in prefetch_depths(experts)])


def fastest(compute: ComputeTimes, placements: list[RoutedPlacement]) -> tuple[RoutedPlacement, Simulation]:
    """Of ``placements``, the one whose decode step is predicted fastest, with its simulation; a tie (to
    STEP_MS_DECIMALS) keeps the earlier (no prefetch before prefetching, the smaller depth: fewer bytes on the
    link)."""
    best = None
    for placement in placements:
        simulation = decode_simulation(compute, placement)
        if best is None or round(simulation.step_ms, STEP_MS_DECIMALS) < round(best[1].step_ms, STEP_MS_DECIMALS):
            best = (placement, simulation)
    return best


def prefetch_depths(experts: ExpertModel) -> tuple[int, ...]:
    """The prefetch depths a placement may take: make --prefetch-depth's, else every rank 1..k."""
    pinned = experts.prefetch_depth
    return tuple(range(1, len(experts.rank_accuracy) + 1)) if pinned is None else (pinned,)


def decode_simulation(compute: ComputeTimes, placement: RoutedPlacement) -> Simulation:
    """A routed decode step of ``placement`` on the one routed timeline (planner.search.routed_step): each routed
    layer waits, between its router and its experts, for what its fetch leaves on the critical path."""
    return routed_decode_step(compute.layer_ms, compute.head_ms, placement_fetches(placement), placement.fetch_slots)


def prefill_simulation(geometry: MoeGeometry, compute: ComputeTimes, h2d_bytes_per_s: float,
                       copy_overhead_us: float) -> Simulation:
    """A prefill chunk with every MoE layer routed, as runtime.routed_experts runs it: at each routed layer, all
    its experts are copied into the one staging buffer on the compute stream (staged_bytes), then computed. The
    copy waits for the layer and the layer for the copy, so nothing overlaps: the step is the compute plus every
    staging copy. (Pricing only the non-resident experts, overlapped through one slot, predicted 1.27-1.62x too
    fast on the H100 conformance sweep of 2026-11-27.)"""
    staged = staged_bytes(geometry)
    stall_ms = tuple(copy_ms_of(staged[i], h2d_bytes_per_s, copy_overhead_us) if i in staged else 0.0
                     for i in range(len(compute.layer_ms)))
    total_stall_ms = math.fsum(stall_ms)
    return Simulation(step_ms=compute.head_ms + math.fsum(compute.layer_ms) + total_stall_ms,
                      stall_ms=total_stall_ms, compute=(), copies=(), layer_stall_ms=stall_ms)


def experts_section(experts: ExpertModel, chosen: Choice, layers: LayerBytes, points: tuple[ExpertsPoint, ...],
                    h2d_bytes_per_s: float) -> ExpertsPlan:
    """The plan's experts section for the chosen placement."""
    geometry = experts.geometry
    if isinstance(chosen, RoutedChoice):
        placement = chosen.placement
        rows = tuple(ExpertLayer(index=row.index, regime=ROUTED, resident=row.resident,
                                 expected_fetched_bytes=round(row.expected_fetched_bytes), hit_rate=row.hit_rate,
                                 prefetch_hit_share=_share(row.prefetch_hit_share),
                                 prefetch_ahead_share=_share(row.prefetch_ahead_share), cpu=row.cpu,
                                 cpu_ms=row.cpu_ms if row.cpu else None,
                                 cpu_ms_per_expert=row.cpu_ms_per_expert if row.cpu else None,
                                 cpu_take=row.cpu_per_step.take if row.cpu_per_step is not None else (),
                                 cpu_fixed_ms=row.cpu_per_step.fixed_ms if row.cpu_per_step is not None else None)
                     for row in placement.layers)
        buffers = (placement.fetch_slots, placement.fetch_buffer_bytes, placement.staging_buffer_bytes,
                   placement.gather_workspace_bytes)
        accuracy, ranks = experts.prefetch_accuracy, experts.rank_accuracy
        if experts.predictions:
            accuracy, ranks = cold_accuracy(experts, placement)
        prefetch = (None if placement.prefetch_accuracy is None else NEXT_LAYER_ROUTER, accuracy,
                    placement.prefetch_depth, tuple(round(a, 4) for a in ranks), experts.accuracy_source)
        cpu = (chosen.cpu, chosen.cpu_declined)
    else:
        offloaded = set(chosen.offloaded)
        rows = tuple(ExpertLayer(index=layer.index, regime=WHOLE_LAYER, resident=(),
                                 expected_fetched_bytes=layers.selected[layer.index] if layer.index in offloaded else 0,
                                 hit_rate=0.0 if layer.index in offloaded else 1.0)
                     for layer in geometry.layers)
        buffers = (0, 0, 0, 0)
        prefetch = (None, None, None, None, None)
        cpu = (None, None)
    return ExpertsPlan(
        regime=summary_regime(rows), routing=experts.routing_label,
        fetch_slots=buffers[0], layers=rows, num_experts=geometry.num_experts, top_k=geometry.top_k,
        expert_bytes=geometry.max_expert_bytes, fetch_buffer_bytes=buffers[1], staging_buffer_bytes=buffers[2],
        gather_workspace_bytes=buffers[3],
        routed_fetch_bytes_per_s=routed_fetch_bytes_per_s(h2d_bytes_per_s), routed_unavailable=experts.unavailable,
        points=points, prefetch=prefetch[0], prefetch_accuracy=prefetch[1], prefetch_depth=prefetch[2],
        prefetch_rank_accuracy=prefetch[3], prefetch_accuracy_source=prefetch[4], cpu=cpu[0], cpu_declined=cpu[1],
        expert_dtype=geometry.expert_dtype)


def _share(value: float | None) -> float | None:
    """A share as the plan holds it (4 decimals, as the rank accuracies)."""
    return None if value is None else round(value, 4)


def cold_accuracy(experts: ExpertModel, placement: RoutedPlacement) -> tuple[float, tuple[float, ...]]:
    """Over the trace's predicted layers' non-resident experts (``placement``'s resident sets): (the share of
    their routed assignments predicted at any rank, per rank the share of their predictions the layer routed
    to). The accuracy where a prefetch matters: the resident experts' predictions save nothing."""
    top_k = experts.geometry.top_k
    hits, made, routed = [0] * top_k, [0] * top_k, 0
    for row in placement.layers:
        if row.index in experts.predictions:
            row_hits, row_made, row_routed = experts.predictions[row.index].cold_rank_counts(row.resident)
            hits = [a + b for a, b in zip(hits, row_hits)]
            made = [a + b for a, b in zip(made, row_made)]
            routed += row_routed
    return (round(sum(hits) / routed, 4) if routed else 0.0,
            tuple(h / m if m else 0.0 for h, m in zip(hits, made)))
