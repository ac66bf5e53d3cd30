"""Next-layer prefetch of routed experts (runtime.routed_experts, ``prefetch=True``): a routed layer predicts the
next routed layer's experts from its own router input and gathers the predicted, non-resident ones ahead, on the
side stream, into that layer's slot set. Functions over a started RoutedExperts (``routed``)."""

import torch

from runtime.fetch_planning import fused_fetch_plan, plan_fetch
from runtime.uva_gather import gather_rows


def prefetch_next(routed, ordinal: int, hidden: torch.Tensor) -> None:
    """Predict the next routed layer's experts from this layer's router input ``hidden`` [tokens, H] and
    gather its predicted, non-resident ones into that layer's slot set, on the side stream (inline on the
    CPU). The side stream first waits for the main stream, where the set's previous reader (the routed layer
    before this one: same parity) is enqueued; this layer's own set and prefetched ids are not touched."""
    predictor = routed.predictors.get(ordinal)
    if predictor is None:
        return
    following = routed.layers[ordinal + 1]
    inputs = router_input(routed, hidden)
    base = routed.slot_base(ordinal + 1)

    depth = routed.prefetch_depth[following]

    def work():
        predicted = predictor.top_k_index(inputs)  # [tokens, top_k], ranks by descending router score
        routed.predicted_ids[ordinal + 1, :predicted.shape[0]].copy_(predicted)
        if depth == 0:  # predicted and counted by rank; nothing gathered ahead
            return
        # the top ``depth`` ranks only: a fixed slice, so the captured shapes stay fixed
        predicted = predicted[:, :depth]
        source_ids = routed.prefetched[ordinal + 1]
        if routed.device.type == "cuda":  # the counts of a prediction are taken at its layer: a scratch here
            fused_fetch_plan(predicted, routed.tables[following].resident_row, routed.fetch_slots, 0,
                             routed.prefetch_counts, sources_out=source_ids)
        else:
            source_ids.copy_(plan_fetch(predicted, routed.tables[following].resident_row, routed.fetch_slots)[1])
        if ordinal + 1 in routed.planned_events:  # a layer splitting its misses with the CPU needs the ids only
            routed.planned_events[ordinal + 1].record(routed.stream)
        words, warps = routed.gather_shape
        for name in routed.param_names:
            gather_rows(routed.host_device[following, name], routed.buffer[name][base:base + routed.fetch_slots],
                        source_ids, max_programs=routed.prefetch_programs, block_words=words, num_warps=warps)

    if routed.stream is None:
        work()
    else:
        routed.stream.wait_stream(torch.cuda.current_stream(routed.device))
        with torch.cuda.stream(routed.stream):
            work()
    routed.pending.add(following)

def router_input(routed, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` copied (main stream) into a buffer the step keeps, which the side stream reads: the
    caller's tensor may be freed and its memory reused on the main stream before the side stream reads it.
    The next routed layer overwrites it only after joining the side stream."""
    buffer = routed.predict_input
    if buffer is None or buffer.dtype != hidden.dtype or buffer.shape[1] != hidden.shape[1] or \
            buffer.shape[0] < hidden.shape[0]:
        # decode steps have at most fetch_slots tokens (each routes to at least one expert)
        buffer = torch.empty((max(routed.fetch_slots, hidden.shape[0]), hidden.shape[1]), dtype=hidden.dtype,
                             device=hidden.device)
        routed.predict_input = buffer
    inputs = buffer[:hidden.shape[0]]
    inputs.copy_(hidden)
    return inputs
