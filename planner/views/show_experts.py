"""``show``'s experts paragraph: the regime and why, what stays resident, what a step fetches and when, and the
figures that decided between routed experts and whole layers."""

from rich.text import Text

from planner.plan.experts_section import ExpertLayer, ExpertsPlan

from planner.plan.schema import Plan
from planner.search.routed_step import uniform_routing_step
from planner.views.show_cpu_experts import cpu_lines
from planner.units import format_bytes, format_ms


def experts_text(plan: Plan) -> Text:
    """The experts section in words: the regime, why, what stays resident, what a step fetches, and the figures
    that decide between routed experts and whole layers."""
    experts = plan.experts
    routed = experts.routed_layers
    lines = [f"Experts: {experts.regime.replace('_', ' ')} ({len(experts.layers)} MoE layers, top-{experts.top_k} of "
             f"{experts.num_experts} experts of {format_bytes(experts.expert_bytes)}; routing: "
             f"{_routing_words(experts)})."]
    if routed:
        lines += _routed_lines(plan, experts, routed) + cpu_lines(plan, experts) + _uniform_lines(plan)
    else:
        lines.append(_whole_layer_line(plan, experts))
    lines += _crossover_lines(plan, experts)
    return Text("\n".join(lines))


def _routing_words(experts: ExpertsPlan) -> str:
    if experts.routing == "uniform":
        return "uniform, every expert equally likely"
    return f"recorded {experts.routing.removeprefix('trace ')[:19]}..., the hottest experts kept resident"


def _routed_lines(plan: Plan, experts: ExpertsPlan, routed: tuple[ExpertLayer, ...]) -> list[str]:
    counts = sorted({len(row.resident) for row in routed})
    kept = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    rule = ("the first ids: under uniform routing any experts are alike" if experts.routing == "uniform"
            else "the most frequent in the trace")
    fetched = sum(row.expected_fetched_bytes for row in routed)
    hit = sum(row.hit_rate for row in routed) / len(routed)
    fetch_ms = 1e3 * fetched / experts.routed_fetch_bytes_per_s
    per_layer = fetched / len(routed) / experts.expert_bytes
    share = experts.routed_fetch_bytes_per_s / plan.hardware.h2d_bytes_per_s
    return [
        f"  Each routed layer keeps attention, norms, router and shared experts on the GPU and {kept} of its "
        f"{experts.num_experts} experts resident ({rule}); the rest stay in pinned host memory.",
        f"  A decode step of {plan.workload.concurrency} sequence(s) fetches {per_layer:.1f} experts per layer "
        f"(expected), {format_bytes(fetched)} per step; hit rate {100 * hit:.1f}% of routed (token, expert) pairs.",
        _fetch_line(experts, fetch_ms, plan.inputs.prefetch_depth == 0) + f" {format_ms(fetch_ms)} of link per step at "
        f"{experts.routed_fetch_bytes_per_s / 1e9:.1f} GB/s ({share:.2f} of the copy engine's "
        f"{plan.hardware.h2d_bytes_per_s / 1e9:.1f} GB/s: GPU threads reading mapped host memory).",
        f"  GPU buffers: fetch {experts.fetch_slots} experts{' x 2 slot sets' if experts.prefetching else ''} "
        f"({format_bytes(experts.fetch_buffer_bytes)}), prefill "
        f"staging {experts.num_experts} experts ({format_bytes(experts.staging_buffer_bytes)}); a prefill chunk copies "
        "each routed layer's non-resident experts whole.",
    ]


def _uniform_lines(plan: Plan) -> list[str]:
    """A traced plan's condition: its step with the same placement and tokens routed uniformly."""
    uniform = uniform_routing_step(plan)
    if uniform is None:
        return []
    return [f"  The step holds for traffic routed as the trace's was: routed uniformly instead, the resident "
            f"experts leave {uniform.fetched_experts:.1f} experts a step to fetch and the step takes "
            f"{'at least ' if uniform.floor else ''}{format_ms(uniform.step_ms)} (this plan: "
            f"{format_ms(plan.prediction.step_ms)})."]


def _fetch_line(experts: ExpertsPlan, fetch_ms: float, prefetch_off: bool = False) -> str:
    """How a routed step waits for its fetch: after each router, or prefetched from the previous layer's
    prediction with only the misses after the router."""
    if not experts.prefetching:
        tried = ("" if experts.prefetch_accuracy is None else " (next-layer prefetch off: --prefetch-depth 0)"
                 if prefetch_off else
                 f" (next-layer prefetch at {100 * experts.prefetch_accuracy:.0f}% accuracy was not faster)")
        return f"  The fetch starts after each layer's router, on the critical path{tried}:"
    return (f"  Each routed layer predicts the next one's experts with that layer's router and prefetches them "
            f"behind its compute ({100 * experts.prefetch_accuracy:.0f}% accuracy{_source_words(experts)})"
            f"{_depth_words(experts)}; the misses are fetched after the router, on the critical path:")


def _source_words(experts: ExpertsPlan) -> str:
    """Where the prediction's accuracy comes from, in words."""
    source = experts.prefetch_accuracy_source
    if source == "trace_per_expert":
        return (" over each layer's non-resident experts, from the trace's per-expert figures: predicting a "
                "resident expert saves nothing")
    if source == "trace_per_rank":
        return " over all experts, from the trace's per-rank figures"
    return " assumed"


def _depth_words(experts: ExpertsPlan) -> str:
    """The prefetch depth and the per-rank accuracies it was chosen from; nothing for plans made before it."""
    if experts.prefetch_depth is None or experts.prefetch_rank_accuracy is None:
        return ""
    ranks = experts.prefetch_rank_accuracy
    shown = ", ".join(f"{100 * a:.0f}" for a in ranks)
    hit, ahead = experts.prefetch_shares()
    over = " of the non-resident experts' predictions" if experts.prefetch_accuracy_source == "trace_per_expert" else ""
    return (f", the top {experts.prefetch_depth} of each token's {len(ranks)} predicted experts (accuracy by rank"
            f"{over} {shown}%): {100 * ahead:.0f}% of the routed experts' bytes cross ahead, {100 * hit:.0f}% of them "
            f"useful, {100 * (ahead - hit):.0f}% wasted")


def _whole_layer_line(plan: Plan, experts: ExpertsPlan) -> str:
    if experts.routed_unavailable is not None:
        return f"  Routed experts are not planned: {experts.routed_unavailable}; the plan streams whole layers."
    return ("  Every MoE layer is resident or streamed whole (offload.layers): fetching only routed experts is "
            "slower here, or does not fit.")


def _crossover_lines(plan: Plan, experts: ExpertsPlan) -> list[str]:
    here = next((p for p in experts.points if p.concurrency == plan.workload.concurrency), None)
    lines = []
    if here is not None and None not in (here.routed_step_ms, here.whole_layer_step_ms) and \
            experts.routed_unavailable is not None:
        ratio = here.whole_layer_step_ms / here.routed_step_ms if here.routed_step_ms > 0 else None
        than = "" if ratio is None else f" (x{ratio:.2f} {'faster' if ratio >= 1 else 'slower'} than whole layers)"
        lines.append(f"  On paper, at {here.concurrency} sequence(s): routed experts would take "
                     f"{format_ms(here.routed_step_ms)} per step{than} against "
                     f"{format_ms(here.whole_layer_step_ms)} streaming whole layers; not planned, as said above.")
    elif here is not None and here.routed_step_ms is not None and here.whole_layer_step_ms is not None:
        faster = "routed" if here.routed else "whole layers"
        slower_ms, faster_ms = sorted((here.routed_step_ms, here.whole_layer_step_ms), reverse=True)
        # a step rounds to 0 ms on a tiny model: no ratio to give then
        verdict = f"{faster} x{slower_ms / faster_ms:.2f} faster" if faster_ms > 0 else f"{faster} chosen"
        lines.append(f"  At {here.concurrency} sequence(s): routed {format_ms(here.routed_step_ms)} per step against "
                     f"{format_ms(here.whole_layer_step_ms)} streaming whole layers: {verdict}.")
    elif here is not None and here.routed_step_ms is None and experts.routed_unavailable is None:
        lines.append(f"  At {here.concurrency} sequence(s) routed experts do not fit: their buffers and the resident "
                     "non-expert weights need more than the budget.")
    routed_at = [p.concurrency for p in experts.points if p.routed]
    whole_at = [p.concurrency for p in experts.points if not p.routed and p.whole_layer_step_ms]
    if len(experts.points) > 1 and routed_at and whole_at:
        lines.append(f"  Across the concurrencies searched, routed wins at {_list(routed_at)} sequence(s), whole "
                     f"layers at {_list(whole_at)} (more sequences touch more experts per step).")
    return lines


def _list(values: list[int]) -> str:
    return ", ".join(map(str, values))
