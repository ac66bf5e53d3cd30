"""The plan's experts section (MoE plans): per MoE layer, routed experts against whole layers, and the vocabulary
its values take, declared here once: the planner writes it (planner.search.expert_choice), show, check and the
runtime read it through the predicates (ExpertLayer.routed, ExpertsPoint.routed, ExpertsPlan.routed_layers and
.prefetching) rather than comparing strings.
"""

import math
from dataclasses import dataclass

from planner.model.expert_prefetch import fetch_weighted_shares, prefetch_shares

#: a layer's regime (experts.layers, experts.points): only its routed, non-resident experts cross the link
ROUTED = "routed"
#: a layer's regime: resident, or streamed whole as offload.layers says
WHOLE_LAYER = "whole_layer"
#: experts.regime only: the section's layers hold both regimes
MIXED = "mixed"
EXPERT_REGIMES = (ROUTED, WHOLE_LAYER, MIXED)
#: experts.prefetch: each routed layer predicts the next routed layer's experts with that layer's router and
#: gathers them ahead (runtime.routed_experts)
NEXT_LAYER_ROUTER = "next_layer_router"
#: experts.prefetch: none, or the next routed layer's router
EXPERT_PREFETCH = (None, NEXT_LAYER_ROUTER)
#: experts.prefetch_accuracy_source: the default curve or make --prefetch-accuracy, a trace's per-rank figures over
#: every expert, or a trace's per-expert figures over each layer's non-resident experts
PREFETCH_ACCURACY_SOURCES = ("assumed", "trace_per_rank", "trace_per_expert")
#: make --cpu-experts (inputs.cpu_experts): auto (the planner weighs the host CPU where the profile measured it, a
#: layer's CPU experts fixed ids or split per step by the count it misses, whichever waits less), fixed (fixed ids
#: only) or off (fetch every miss)
CPU_EXPERTS_CHOICES = ("auto", "rows", "fixed", "off")
#: make --routed-experts: whether routed placements are weighed beside whole layers
ROUTED_EXPERTS_CHOICES = ("auto", "off")
#: experts.cpu.dtype: the host copy of the CPU experts the CPU reads (planner.source.profile.CPU_EXPERT_DTYPES)
CPU_COPY_DTYPES = ("bf16", "fp32")


#: a fractional share in a layer's cpu_take is a multiple of 1 / CPU_TAKE_QUANTUM of an expert (the runtime rounds
#: the rows it sends to the CPU to runtime.fetch_planning.PART_ROWS_MULTIPLE)
CPU_TAKE_QUANTUM = 16


def fraction_of(share: float) -> float:
    """The fraction of one more expert in a cpu_take entry of ``share`` experts (0 for a whole count)."""
    part = share - math.floor(share + 1e-9)
    return part if part > 1e-9 else 0.0


@dataclass(frozen=True, kw_only=True)
class ExpertLayer:
    """One MoE layer of the plan: whether it fetches routed experts or streams (or keeps) the whole layer."""

    #: the layer's index in the stack
    index: int
    #: "routed": only routed, non-resident experts cross the link; "whole_layer": as offload.layers says
    regime: str
    #: expert ids kept on the GPU, ascending (routed layers; () otherwise)
    resident: tuple[int, ...]
    #: expected bytes over the link per decode step, at the plan's concurrency
    expected_fetched_bytes: int
    #: share of routed (token, expert) pairs served by experts already on the GPU
    hit_rate: float
    #: prefetching plans priced from a trace's per-expert figures only (experts.prefetch_accuracy_source
    #: trace_per_expert): the layer's prefetch hits and predictions gathered ahead as shares of its non-resident
    #: experts' routed assignments (None elsewhere, and not written)
    prefetch_hit_share: float | None = None
    prefetch_ahead_share: float | None = None
    #: expert ids computed on the host CPU, ascending, disjoint from resident (routed layers only; () elsewhere,
    #: and not written): the runtime sends every (token, expert) pair routed to them to the CPU
    cpu: tuple[int, ...] = ()
    #: the layer's CPU path after its router, ms: the handoff and its CPU experts' expected compute (with cpu
    #: ids only; None elsewhere, and not written). The step waits for the later of it and the link's fetches
    cpu_ms: float | None = None
    #: one of its CPU experts inside the step, ms, for the tokens a step routes to it (with cpu ids; None elsewhere,
    #: and not written): with cpu_ms it gives the step's expected CPU experts, from which the layer's wait is
    #: E[max(link, CPU)] over the step's routing (planner.search.routed_step.layer_wait_ms). A plan written
    #: without it is priced as the later of the two paths' expectations
    cpu_ms_per_expert: float | None = None
    #: a layer that splits each step's misses by their count (planner.search.cpu_per_step; () elsewhere, and not
    #: written): j(m), the CPU experts a step that misses m experts takes (the first j(m) of its misses by id;
    #: past the list, its last entry), its cpu ids then every non-resident expert. Without it every pair routed to
    #: the cpu ids goes to the CPU
    cpu_take: tuple[float, ...] = ()
    #: where cpu_take holds a fraction f (a step sends the first f of one more expert's intermediate rows to the CPU,
    #: the rest crossing the link; in steps of 1 / CPU_TAKE_QUANTUM): the part of cpu_ms_per_expert such a fraction
    #: still pays whole, ms (None elsewhere, and not written)
    cpu_fixed_ms: float | None = None

    def __post_init__(self):
        if self.regime not in (ROUTED, WHOLE_LAYER):
            raise ValueError(f"experts.layers regime {self.regime!r} is not one of {ROUTED}, {WHOLE_LAYER}")
        if list(self.resident) != sorted(set(self.resident)):
            raise ValueError("experts.layers resident ids must be ascending and distinct")
        if self.resident and not self.routed:
            raise ValueError("experts.layers: only routed layers keep resident experts")
        if not 0 <= self.hit_rate <= 1:
            raise ValueError("experts.layers hit_rate must be a share in [0, 1]")
        if (self.prefetch_hit_share is None) != (self.prefetch_ahead_share is None):
            raise ValueError("experts.layers prefetch_hit_share and prefetch_ahead_share come together")
        if self.prefetch_hit_share is not None and not 0 <= self.prefetch_hit_share <= min(
                1.0, self.prefetch_ahead_share):
            raise ValueError("experts.layers prefetch_hit_share must be a share in [0, 1], at most "
                             "prefetch_ahead_share")
        self._check_cpu()

    def _check_cpu(self) -> None:
        """The CPU ids' invariants (ExpertsPlan checks them against num_experts and its cpu section)."""
        if list(self.cpu) != sorted(set(self.cpu)):
            raise ValueError("cpu ids must be ascending and distinct")
        if self.cpu and not self.routed:
            raise ValueError("a whole_layer row has cpu ids: only routed layers compute experts on the CPU (drop "
                             "its cpu ids)")
        if set(self.cpu) & set(self.resident):
            raise ValueError(f"cpu ids {sorted(set(self.cpu) & set(self.resident))} are also resident: an expert is "
                             "resident, fetched or on the CPU, not two")
        if bool(self.cpu) != (self.cpu_ms is not None):
            raise ValueError("cpu_ms is given exactly where cpu ids are")
        if self.cpu_ms_per_expert is not None and (not self.cpu or self.cpu_ms_per_expert <= 0):
            raise ValueError("cpu_ms_per_expert must be positive, and given only where cpu ids are")
        if self.cpu_take and self.cpu_ms_per_expert is None:
            raise ValueError("cpu_take is given only with cpu ids and cpu_ms_per_expert")
        wrong = [m for m, take in enumerate(self.cpu_take) if not 0 <= take <= min(m, len(self.cpu))]
        if wrong:
            raise ValueError(f"cpu_take[{wrong[0]}] is {self.cpu_take[wrong[0]]}: a step missing m experts sends from "
                             f"0 to m of them to the CPU (at most its {len(self.cpu)} cpu ids)")
        off_grid = [m for m, take in enumerate(self.cpu_take)
                    if abs(take * CPU_TAKE_QUANTUM - round(take * CPU_TAKE_QUANTUM)) > 1e-6]
        if off_grid:
            raise ValueError(f"cpu_take[{off_grid[0]}] is {self.cpu_take[off_grid[0]]}, not a multiple of "
                             f"1/{CPU_TAKE_QUANTUM} of an expert")
        fractional = any(fraction_of(take) for take in self.cpu_take)
        if fractional != (self.cpu_fixed_ms is not None):
            raise ValueError("cpu_fixed_ms is given exactly where cpu_take holds a fraction of an expert")
        if self.cpu_fixed_ms is not None and not 0 <= self.cpu_fixed_ms <= self.cpu_ms_per_expert:
            raise ValueError(f"cpu_fixed_ms {self.cpu_fixed_ms} must be from 0 to cpu_ms_per_expert "
                             f"({self.cpu_ms_per_expert})")
    @property
    def routed(self) -> bool:
        """Whether the layer fetches its routed experts (else it is resident or streams whole)."""
        return self.regime == ROUTED


def summary_regime(layers: tuple[ExpertLayer, ...]) -> str:
    """experts.regime for these layers: their one regime, or MIXED."""
    regimes = {row.regime for row in layers}
    return regimes.pop() if len(regimes) == 1 else MIXED


@dataclass(frozen=True, kw_only=True)
class ExpertsPoint:
    """One step size the expert regimes were compared at: a serving concurrency, or a weights plan's step."""

    concurrency: int
    #: the regime chosen there
    regime: str
    #: the step with every MoE layer routed (None: it does not fit, or routed is unavailable; priced on paper,
    #: never chosen, where only the experts' quantization keeps the runtime from gathering them)
    routed_step_ms: float | None
    #: the step streaming whole layers (today's search; None: nothing fits)
    whole_layer_step_ms: float | None
    #: resident experts of the routed placement, all layers (0 when it does not fit)
    num_resident: int

    @property
    def routed(self) -> bool:
        """Whether routed experts were chosen at this step size."""
        return self.regime == ROUTED


@dataclass(frozen=True, kw_only=True)
class CpuPlacement:
    """The routed experts the host CPU computes (experts.layers' cpu ids): how, and their share of the step."""

    #: the host copy the CPU reads: "bf16" (the pinned experts themselves) or "fp32" (a second copy of the CPU
    #: experts, host_copy_bytes more host memory)
    dtype: str
    #: CPU threads the experts are computed with (the profile's cpu_experts.threads)
    threads: int
    #: host bytes beside the pinned experts: an fp32 copy of the CPU experts (0 for bf16)
    host_copy_bytes: int
    #: a routed layer's fixed cost on the CPU path: hidden states to the host, the threads' wake-up, results back
    handoff_ms: float
    #: summed over routed layers, after their routers: the CPU's path (handoffs and compute) and the link's
    cpu_ms_per_step: float
    link_ms_per_step: float

    def __post_init__(self):
        if self.dtype not in CPU_COPY_DTYPES:
            raise ValueError(f"experts.cpu.dtype {self.dtype!r} is not one of {', '.join(CPU_COPY_DTYPES)}")
        if self.threads < 1:
            raise ValueError("experts.cpu.threads must be at least 1")
        if (self.host_copy_bytes > 0) != (self.dtype == "fp32"):
            raise ValueError("experts.cpu.host_copy_bytes counts an fp32 copy: positive for fp32, 0 for bf16")
        if min(self.handoff_ms, self.cpu_ms_per_step, self.link_ms_per_step) < 0:
            raise ValueError("experts.cpu handoff_ms, cpu_ms_per_step and link_ms_per_step must not be negative")


@dataclass(frozen=True, kw_only=True)
class ExpertsPlan:
    """MoE plans only: per MoE layer, routed experts against whole layers, and how the regime was chosen."""

    #: "routed", "whole_layer" or "mixed" (a summary of the layers)
    regime: str
    #: "uniform" or "trace sha256:<hex of the trace file's bytes>"
    routing: str
    #: experts the decode gather buffer holds: min(concurrency x top_k, num_experts) (0 without routed layers)
    fetch_slots: int
    #: one row per MoE layer
    layers: tuple[ExpertLayer, ...]
    num_experts: int
    top_k: int
    #: one routed expert (the largest layer's)
    expert_bytes: int
    #: fetch_slots x expert_bytes, on the GPU (counted in memory.gpu_bytes)
    fetch_buffer_bytes: int
    #: num_experts x expert_bytes, where prefill chunks copy a routed layer's experts (0 without routed layers)
    staging_buffer_bytes: int
    #: tokens_per_step x top_k x expert_bytes, where a routed decode step's batched_mm gathers each routed
    #: (token, expert) pair's weights (0 where a step routes more pairs than num_experts, and without routed layers)
    gather_workspace_bytes: int
    #: the routed gather's rate: hardware.h2d_bytes_per_s x planner.model.experts.ROUTED_FETCH_EFFICIENCY
    routed_fetch_bytes_per_s: float
    #: why no layer may be routed (an architecture the runtime cannot route-fetch, pinned knobs); None: it may
    routed_unavailable: str | None
    #: the regimes compared, ascending concurrency
    points: tuple[ExpertsPoint, ...]
    #: routed plans only: "next_layer_router" where each routed layer prefetches the next one's predicted experts
    #: (two slot sets in fetch_buffer_bytes), None where routed layers fetch after their router
    prefetch: str | None = None
    #: routed plans only: the prediction accuracy the step was modelled with (--prefetch-accuracy, else the
    #: planner's measured figure), whether or not prefetch was chosen
    prefetch_accuracy: float | None = None
    #: routed plans only: the ranks of each token's prediction gathered ahead (1..top_k) where prefetch is on;
    #: None where it is off, and in plans made before the depth (every rank)
    prefetch_depth: int | None = None
    #: routed plans only: per rank of the prediction, the accuracy the depth was chosen from (a trace's, the
    #: planner's default curve, or --prefetch-accuracy at every rank)
    prefetch_rank_accuracy: tuple[float, ...] | None = None
    #: routed plans only: where the accuracy comes from (PREFETCH_ACCURACY_SOURCES); with trace_per_expert,
    #: prefetch_accuracy and prefetch_rank_accuracy are the non-resident experts' (their assignments predicted at
    #: any rank; per rank, the share of their predictions routed) and each predicted layer row holds its shares.
    #: None in plans made before it
    prefetch_accuracy_source: str | None = None
    #: where some routed layer computes experts on the host CPU: how (None elsewhere, and not written)
    cpu: CpuPlacement | None = None
    #: why the CPU takes no expert, where the profile measured it and layers are routed (None elsewhere, and not
    #: written)
    cpu_declined: str | None = None
    #: the safetensors dtype holding most of the experts' bytes (BF16, F8_E4M3, ...): what decides whether a routed
    #: decode step copies its pairs' weights (planner.model.activations.decode_copies_pairs). None in plans made
    #: before it (readers then take the checkpoint's dominant dtype), and not written then
    expert_dtype: str | None = None

    @property
    def cpu_layers(self) -> tuple[ExpertLayer, ...]:
        """The routed layers with experts on the CPU, ascending."""
        return tuple(row for row in self.layers if row.cpu)

    def expected_cpu_experts(self, row: ExpertLayer) -> float | None:
        """The CPU experts a step of ``row`` touches in expectation: its CPU path less the section's handoff, over
        one expert's price (None without CPU experts, or in a plan written without cpu_ms_per_expert)."""
        if not row.cpu or row.cpu_ms_per_expert is None or self.cpu is None:
            return None
        return (row.cpu_ms - self.cpu.handoff_ms) / row.cpu_ms_per_expert

    @property
    def routed_layers(self) -> tuple[ExpertLayer, ...]:
        """The layers that fetch their routed experts, ascending."""
        return tuple(row for row in self.layers if row.routed)

    @property
    def prefetching(self) -> bool:
        """Whether routed layers prefetch the next one's predicted experts (NEXT_LAYER_ROUTER)."""
        return self.prefetch == NEXT_LAYER_ROUTER

    def prefetch_shares(self) -> tuple[float, float] | None:
        """(hit share, ahead share) of the routed, non-resident experts at the plan's depth, as the planner's
        placement holds them (planner.model.expert_placement.with_prefetch_depth): the per-rank curve's
        (planner.model.expert_prefetch.prefetch_shares), or, where layers hold a trace's per-expert shares, the
        predicted layers' fetch-weighted mean (fetch_weighted_shares). None without prefetch. Plans made before the
        depth gather every rank at their accuracy."""
        if not self.prefetching:
            return None
        if self.prefetch_depth is None or self.prefetch_rank_accuracy is None:
            hit, ahead = self.prefetch_accuracy, 1.0
        else:
            hit, ahead = prefetch_shares(self.prefetch_rank_accuracy, self.prefetch_depth)
        if any(row.prefetch_hit_share is not None for row in self.layers):
            return fetch_weighted_shares(self.layers[1:], hit, ahead)
        return hit, ahead

    def __post_init__(self):
        if self.prefetch not in EXPERT_PREFETCH:
            raise ValueError(f"experts.prefetch {self.prefetch!r} is not null or {EXPERT_PREFETCH[1]}")
        if self.expert_dtype == "":  # the reader checked its type
            raise ValueError(f"experts.expert_dtype {self.expert_dtype!r} is not a dtype name (BF16, F8_E4M3, ...)")
        if self.prefetch_accuracy is not None and not 0 <= self.prefetch_accuracy <= 1:
            raise ValueError("experts.prefetch_accuracy must be a share in [0, 1]")
        if self.prefetch is not None and self.prefetch_accuracy is None:
            raise ValueError("experts.prefetch needs its prefetch_accuracy")
        ranks = self.prefetch_rank_accuracy
        if ranks is not None and (len(ranks) != self.top_k or not all(0 <= a <= 1 for a in ranks)):
            raise ValueError(f"experts.prefetch_rank_accuracy must hold top_k ({self.top_k}) shares in [0, 1]")
        if self.prefetch_depth is not None and (self.prefetch is None or not 1 <= self.prefetch_depth <= self.top_k):
            raise ValueError(f"experts.prefetch_depth must be from 1 to top_k ({self.top_k}) with prefetch on, "
                             "null with it off")
        if self.prefetch_accuracy_source not in (None, *PREFETCH_ACCURACY_SOURCES):
            raise ValueError(f"experts.prefetch_accuracy_source {self.prefetch_accuracy_source!r} is not null or "
                             f"one of {', '.join(PREFETCH_ACCURACY_SOURCES)}")
        if any(row.prefetch_hit_share is not None for row in self.layers) and (
                self.prefetch is None or self.prefetch_accuracy_source != "trace_per_expert"):
            raise ValueError("experts.layers prefetch shares belong to prefetching plans priced from a trace's "
                             "per-expert figures (prefetch_accuracy_source trace_per_expert)")
        if self.regime not in EXPERT_REGIMES:
            raise ValueError(f"experts.regime {self.regime!r} is not one of {', '.join(EXPERT_REGIMES)}")
        if self.layers and self.regime != summary_regime(self.layers):
            raise ValueError("experts.regime must summarise its layers' regimes")
        if [row.index for row in self.layers] != sorted({row.index for row in self.layers}):
            raise ValueError("experts.layers must have distinct indices, ascending")
        if not self.routing == "uniform" and not self.routing.startswith("trace sha256:"):
            raise ValueError("experts.routing must be uniform or trace sha256:<hex>")
        if any(e >= self.num_experts for row in self.layers for e in row.resident):
            raise ValueError("experts.layers resident ids must be below num_experts")
        if any(e >= self.num_experts for row in self.layers for e in row.cpu):
            raise ValueError(f"experts.layers cpu ids must be below num_experts ({self.num_experts})")
        split = [row.index for row in self.layers if row.cpu_take and len(row.resident) + len(row.cpu)
                 != self.num_experts]
        if split:
            raise ValueError(f"experts.layers index {split[0]} splits its steps by count (cpu_take), so its cpu ids "
                             "must be every expert not resident")
        if bool(self.cpu_layers) != (self.cpu is not None):
            raise ValueError("experts.cpu is given exactly where some layer has cpu ids (add the section or drop "
                             "the ids)")
        if self.cpu is not None and self.cpu_declined is not None:
            raise ValueError("experts.cpu_declined says why the CPU takes no expert: not with experts.cpu")


#: experts keys written only where the plan routes layers (whole-layer MoE plans keep their bytes)
OPTIONAL_EXPERTS = {"prefetch": None, "prefetch_accuracy": None, "prefetch_depth": None,
                    "prefetch_rank_accuracy": None, "prefetch_accuracy_source": None}


#: experts keys written only where set (plans with CPU experts, or with the CPU measured and declined)
OPTIONAL_EXPERTS_SET = {"cpu": None, "cpu_declined": None, "expert_dtype": None}


#: experts.layers keys written only where set (a plan priced from a trace's per-expert figures; CPU experts)
OPTIONAL_EXPERT_LAYER = {"prefetch_hit_share": None, "prefetch_ahead_share": None, "cpu": (), "cpu_ms": None,
                         "cpu_ms_per_expert": None, "cpu_take": (), "cpu_fixed_ms": None}
