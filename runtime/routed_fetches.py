"""What a routed plan's timed decode steps fetched, measured beside what the plan expected.

A routed plan predicts the expected step over its routing: the bytes its non-resident experts bring over the link
a step (prediction.copy_bytes_per_step) and how often the next-layer prediction gathers them ahead
(experts.prefetch_rank_accuracy). One run's routing is one sample of that, and a trained router's prediction is
not the default curve's. The fetch plan's device counters (runtime.routed_experts: FETCH_KINDS, rank_counts) say
what the timed steps really moved, so ``run --bench`` can tell a step that was off because of its routing from one
that was off because of its timeline, and give the accuracy to make the plan again with.
"""

import statistics
from dataclasses import dataclass

import torch

from runtime.timing import fetches_routed_experts


@dataclass(frozen=True, kw_only=True)
class RoutedFetches:
    """The routed experts of the timed decode steps, measured, beside the plan's expectation."""

    num_steps: int
    #: bytes the routed layers gathered from host memory a step, every kind (wasted prefetches cross the link too)
    fetched_bytes_per_step: float
    #: prediction.copy_bytes_per_step: the plan's expected bytes a step
    predicted_bytes_per_step: int
    #: runtime.routed_experts.FETCH_KINDS -> bytes a step
    bytes_per_step_by_kind: dict
    #: per rank of the next-layer prediction, the share the predicted layer then routed the same token to
    #: (None: that rank predicted nothing); empty where the plan does not predict
    rank_accuracy: tuple
    #: experts.prefetch_rank_accuracy: the per-rank accuracy the plan was priced with, None where it predicts none
    planned_rank_accuracy: tuple | None
    #: where the plan computes experts on the host CPU: the handoff's kind, and a step's CPU pairs, its host steps'
    #: own ms (their compute and bookkeeping, summed over the layers) beside the plan's expected CPU ms a step
    cpu: dict | None = None

    @property
    def prefetch_accuracy(self) -> float | None:
        """The measured accuracy over every rank (each rank makes one prediction per token), None without any."""
        known = [share for share in self.rank_accuracy if share is not None]
        return statistics.fmean(known) if known else None

    @property
    def planned_prefetch_accuracy(self) -> float | None:
        """The plan's accuracy over every rank, None where it predicts none."""
        return statistics.fmean(self.planned_rank_accuracy) if self.planned_rank_accuracy else None


def _routed(loaded):
    """The loaded plan's runtime.routed_experts.RoutedExperts where its decode steps fetch routed experts."""
    if not fetches_routed_experts(loaded.plan):
        return None
    return getattr(loaded.engine, "routed_experts", None)


def start_counting(loaded) -> None:
    """Zero the routed experts' counters before the timed steps (after the steps already queued ran)."""
    routed = _routed(loaded)
    if routed is not None:
        torch.cuda.synchronize(routed.device)
        routed.reset_counters()
        if routed.resplit is not None:  # its windows count from the reset counters
            routed.resplit.restart()


def routed_fetches(loaded, num_steps: int) -> RoutedFetches | None:
    """What the ``num_steps`` decode steps since start_counting fetched, beside the plan; None where the plan's
    decode steps fetch no routed experts."""
    routed = _routed(loaded)
    if routed is None or num_steps < 1:
        return None
    torch.cuda.synchronize(routed.device)
    by_kind = {kind: count / num_steps for kind, count in routed.fetched_bytes_by_kind().items()}
    # the plan records the accuracy it priced whether or not it prefetches; only a predicting run measures one
    planned = loaded.plan.experts.prefetch_rank_accuracy if routed.predictors else None
    return RoutedFetches(num_steps=num_steps, fetched_bytes_per_step=sum(by_kind.values()),
                         predicted_bytes_per_step=loaded.plan.prediction.copy_bytes_per_step,
                         bytes_per_step_by_kind=by_kind,
                         rank_accuracy=routed.rank_accuracy() if routed.predictors else (),
                         planned_rank_accuracy=tuple(planned) if planned else None,
                         cpu=_cpu_per_step(routed, loaded.plan, num_steps))


def _cpu_per_step(routed, plan, num_steps: int) -> dict | None:
    """The CPU side's counters over the timed steps, per step, beside the plan's expected CPU ms a step and its
    expected CPU experts a step (distinct experts per layer step, summed: what the plan's CPU time is priced on;
    None for a plan written without cpu_ms_per_expert), the step re-timed at the host's rate (at_host_cpu_rate),
    and where run re-split the tables at that rate, how (``resplit``)."""
    stats = routed.cpu_stats()
    if not stats:
        return None
    planned = plan.experts.cpu
    host_ms, experts = 1e3 * stats["callback_s"] / num_steps, stats["experts_cpu"] / num_steps
    resplit = getattr(routed, "resplit", None)
    return {"handoff": routed.cpu_experts.handoff, "pairs_per_step": stats["pairs_cpu"] / num_steps,
            "experts_per_step": experts, "pairs_share": stats["pairs_share"], "host_ms_per_step": host_ms,
            "planned_cpu_ms_per_step": planned.cpu_ms_per_step if planned is not None else None,
            "planned_experts_per_step": planned_cpu_experts(plan),
            **at_host_cpu_rate(plan, host_ms, experts, resplit is not None),
            **({"resplit": resplit_record(resplit)} if resplit is not None else {})}


def at_host_cpu_rate(plan, host_ms_per_step: float, experts_per_step: float | None = None,
                     resplit: bool = False) -> dict:
    """The host CPU's measured rate over the plan's price (planner.search.routed_step.host_cpu_scale, per expert
    computed where ``experts_per_step`` is counted), the plan's decode step re-timed at it with its tables as planned
    (cpu_rate_step_ms), and with ``resplit`` (run re-splits the steps: runtime.cpu_resplit) with the tables made
    again at it (planner.search.cpu_resplit): what of a step's error the host's CPU explains, and the make
    --cpu-time-scale that prices this host's rate. {} where these cannot be had."""
    from planner.search.cpu_resplit import resplit_at_scale
    from planner.search.routed_step import cpu_rate_step_ms, host_cpu_scale

    scale = host_cpu_scale(plan, host_ms_per_step, experts_per_step)
    step_ms = None if scale is None else cpu_rate_step_ms(plan, scale)
    if step_ms is None:
        return {}
    # make --cpu-time-scale prices the CPU at a multiple of the profile's rate: this host's, over the profile's
    figures = {"host_cpu_scale": scale, "step_ms_at_host_cpu_rate": step_ms,
               "cpu_time_scale": round(scale * (plan.inputs.cpu_time_scale or 1.0), 2)}
    made = resplit_at_scale(plan, scale) if resplit else None
    return figures | ({"step_ms_resplit_at_host_cpu_rate": made.step_ms} if made is not None else {})


def resplit_record(resplit) -> dict:
    """What run's re-splitter did (runtime.cpu_resplit.CpuResplitter): the scale its tables are made for now, each
    re-split, and each window's measured scale (None: too few CPU experts)."""
    return {"tables_scale": round(resplit.scale, 4), "events": [event.as_dict() for event in resplit.history],
            "window_scales": [None if scale is None else round(scale, 4) for scale in resplit.measured]}


def planned_cpu_experts(plan) -> float | None:
    """The plan's expected CPU experts a step: each CPU layer's path less the handoff, over one expert's price."""
    experts = plan.experts
    expected = [experts.expected_cpu_experts(row) for row in experts.cpu_layers]
    if not expected or None in expected:
        return None
    return sum(expected)
