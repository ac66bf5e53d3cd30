"""The Plan object from what make chose: one function per section of the plan."""

from collections import Counter

from planner.search.adapter_stream import WeightsOnLink, choose_mode, weights_of_layers
from planner.model.adapters import adapter_waits, missing_per_batch, slot_bytes_of
from planner.source.checkpoint import Checkpoint
from planner.model.cost import ComputeTimes, Workload, is_decode_step
from planner.search.expert_choice import RoutedChoice, experts_section, prefill_simulation
from planner.model.expert_placement import non_resident_bytes
from planner.model.experts import ROUTED_FETCH_EFFICIENCY
from planner.model.layout import ModelLayout
from planner.model.memory_accounting import measured_nccl_bytes
from planner.make.inputs import workload_of
from planner.make.model_record import Model
from planner.model.model_config import model_config
from planner.plan.adapters_section import AdapterRow, AdaptersSection
from planner.plan.schema import (SCHEMA_VERSION, HardwareSection, LayerRow, MemorySection, ModelSection, OffloadSection,
                                 Plan, PredictionSection, ServingRow, ServingSection, WorkloadSection)
from planner.search.groups import Choice, copy_ms_of, weight_gpu_bytes
from planner.search.serving import ConcurrencyRange, OtherBytes, ServingPoint, ServingSearch
from planner.search.simulate import simulate


def assemble(model: Model, workload: Workload, compute: ComputeTimes, choice: Choice, budget: int,
             host_limit: int | None, gpu_memory: int, other: OtherBytes | None,
             serving: ServingSection | None, num_adapter_slots: int = 0, expert_points: tuple = ()) -> Plan:
    """The plan of ``choice`` for ``workload`` (a serving plan with ``serving``): every section, in order."""
    profile = model.profile
    chunk_tokens = model.inputs.chunk if serving is not None else workload.tokens_per_step
    rows = _layer_rows(model, compute, choice)
    resident_step_ms = compute.head_ms + sum(compute.layer_ms)
    adapters = None
    if model.adapters:
        weights = weights_of_layers(rows, tuple(choice.offloaded), choice.prefetch_step, compute.head_ms)
        adapters = _adapters_section(model, num_adapter_slots, workload, choice.simulation, resident_step_ms, weights)
    return Plan(
        schema_version=SCHEMA_VERSION,
        inputs=model.inputs,
        model=model_section(model.checkpoint, model.layout),
        hardware=HardwareSection(profile=profile.name, **(profile.figures() | {
            "host_memory_bytes": host_limit, "nccl_bytes": measured_nccl_bytes(model)})),
        workload=_workload_section(model, workload, compute, chunk_tokens,
                                   serving is not None and chunk_graphed(model, choice)),
        offload=_offload_section(model, choice),
        memory=_memory_section(model, choice, budget, gpu_memory, other),
        prediction=_prediction_section(model, workload, compute, choice, resident_step_ms,
                                       chunk_tokens if serving is not None else None),
        layers=rows,
        serving=serving,
        adapters=adapters,
        experts=None if model.experts is None else experts_section(model.experts, choice, model.layer_bytes,
                                                                   expert_points, profile.h2d_bytes_per_s.value),
    )


def chunk_graphed(model: Model, choice: Choice) -> bool:
    """Whether run replays this placement's prefill chunk from a CUDA graph (Model.chunk_graphed): not where
    routed layers copy their experts through the staging buffer, which stays eager as measured."""
    return model.chunk_graphed and not isinstance(choice, RoutedChoice)


def _routed(choice: Choice):
    """A routed choice's placement of experts (planner.search.expert_choice), None for whole layers."""
    return choice.placement if isinstance(choice, RoutedChoice) else None


def _layer_rows(model: Model, compute: ComputeTimes, choice: Choice) -> tuple[LayerRow, ...]:
    """Each layer's bytes, the bytes it leaves on the host (a routed layer's non-resident experts), and times."""
    layer_bytes, profile = model.layer_bytes, model.profile
    offloaded = set(choice.offloaded)
    routed = _routed(choice)
    non_resident = {} if routed is None else non_resident_bytes(model.experts.geometry, routed)
    return tuple(
        LayerRow(
            index=i,
            bytes=layer_bytes.total[i],
            selected_bytes=layer_bytes.selected[i],
            offloaded_bytes=layer_bytes.selected[i] if i in offloaded else non_resident.get(i, 0),
            compute_ms=compute.layer_ms[i],
            copy_ms=copy_ms_of(layer_bytes.selected[i], profile.h2d_bytes_per_s.value, profile.copy_overhead_us.value),
        )
        for i in range(len(model.layout.layers))
    )


def _workload_section(model: Model, workload: Workload, compute: ComputeTimes, chunk_tokens: int,
                      graphed_chunk: bool) -> WorkloadSection:
    return WorkloadSection(
        tokens_per_step=workload.tokens_per_step,
        sequences_per_step=workload.sequences_per_step,
        context_tokens=workload.context_tokens,
        compute_source=compute.source,
        cuda_graph=model.inputs.cuda_graph,
        concurrency=workload.sequences_per_step,
        chunk_tokens=chunk_tokens,
        kv_dtype=_kv_dtype_name(model),
        chunk_graphed=graphed_chunk,
    )


def _offload_section(model: Model, choice: Choice) -> OffloadSection:
    return OffloadSection(
        group_size=choice.group_size,
        num_in_group=choice.num_in_group,
        prefetch_step=choice.prefetch_step,
        params=tuple(model.inputs.params),
        layers=choice.offloaded,
        replay_start_copies=choice.replay_start_copies,
    )


def _memory_section(model: Model, choice: Choice, budget: int, gpu_memory: int,
                    other: OtherBytes | None) -> MemorySection:
    """The weights' GPU and host bytes, and (where the KV cache is modelled, ``other``) the rest of the GPU's."""
    layout, layer_bytes = model.layout, model.layer_bytes
    routed = _routed(choice)
    num_slots = min(choice.prefetch_step, len(choice.offloaded))
    weight_bytes = routed.weight_bytes if routed is not None else weight_gpu_bytes(
        layout.non_layer_bytes, layer_bytes, choice.offloaded, num_slots)
    return MemorySection(
        budget_bytes=budget,
        gpu_bytes=choice.gpu_bytes,
        resident_layer_bytes=sum(layer_bytes.total) - choice.host_pinned_bytes,
        non_layer_bytes=layout.non_layer_bytes,
        allocation_slack_bytes=choice.gpu_bytes - weight_bytes,
        num_slots=num_slots,
        slot_bytes=max((layer_bytes.selected[i] for i in choice.offloaded), default=0),
        host_pinned_bytes=choice.host_pinned_bytes,
        gpu_memory_bytes=gpu_memory,
        kv_cache_bytes=None if other is None else other.kv_cache_bytes,
        activation_bytes=None if other is None else other.activation_bytes,
        cuda_graph_pool_bytes=0 if other is None else other.cuda_graph_pool_bytes,
        cuda_context_bytes=0 if other is None else other.cuda_context_bytes,
        total_gpu_bytes=None if other is None else choice.gpu_bytes + other.total_bytes,
    )


def _prediction_section(model: Model, workload: Workload, compute: ComputeTimes, choice: Choice,
                        resident_step_ms: float, serving_chunk_tokens: int | None) -> PredictionSection:
    """The step's time, stalls and link use; ``serving_chunk_tokens``: a serving plan's prefill chunk, which has
    its own layer times (a weights-only plan's prefill step is its chunk)."""
    simulation, routed, decode = choice.simulation, _routed(choice), is_decode_step(workload)
    h2d = model.profile.h2d_bytes_per_s.value
    # a routed decode step gathers at the routed fetch rate; a routed prefill copies whole through the copy engine,
    # as does a decode step routing more pairs than experts
    gathering = decode and routed is not None and model.experts.geometry.decode_gathers(workload.tokens_per_step)
    link_rate = h2d * ROUTED_FETCH_EFFICIENCY if gathering else h2d
    link_floor_ms = 1e3 * choice.copy_bytes / link_rate
    return PredictionSection(
        step_ms=simulation.step_ms,
        resident_step_ms=resident_step_ms,
        head_ms=compute.head_ms,
        stall_ms=simulation.stall_ms,
        link_floor_ms=link_floor_ms,
        copy_bytes_per_step=choice.copy_bytes,
        link_busy_share=_link_busy_ms(simulation, routed is not None and decode, link_floor_ms, routed)
        / simulation.step_ms if simulation.step_ms else 0.0,
        decode_step_ms=simulation.step_ms if decode else None,
        decode_tokens_per_s=1e3 * workload.sequences_per_step / simulation.step_ms if decode else None,
        prefill_chunk_ms=_prefill_chunk_ms(model, choice, serving_chunk_tokens) if serving_chunk_tokens is not None
        else (None if decode else simulation.step_ms),
    )


def _link_busy_ms(simulation, routed_decode: bool, link_floor_ms: float, routed) -> float:
    """The link's busy time per step: its copies, or a routed decode step's fetches (its stalls; with prefetch,
    which hides fetches behind compute, every byte the link carries at the gather's rate)."""
    if routed_decode and routed.prefetch_accuracy is not None:
        return link_floor_ms
    return simulation.stall_ms if routed_decode else simulation.copy_busy_ms


def _adapters_section(model: Model, num_slots: int, workload: Workload, simulation, compute_step_ms: float,
                      weights: WeightsOnLink | None) -> AdaptersSection:
    """The adapters' slots, pool and waits on the plan's link (planner.model.adapters models the waits), and the
    loading mode predicted faster for a stream of requests, each one of the workload's sequences (its share of
    ``compute_step_ms``, the step's compute without waits; planner.search.adapter_stream.choose_mode), with the
    offloaded ``weights`` on the link."""
    adapters, profile = model.adapters, model.profile
    h2d, overhead_us = profile.h2d_bytes_per_s.value, profile.copy_overhead_us.value
    slot_bytes = slot_bytes_of(adapters)
    step_ms = simulation.step_ms
    waits = adapter_waits(
        slot_bytes=slot_bytes, h2d_bytes_per_s=h2d, copy_overhead_us=overhead_us, step_ms=step_ms,
        num_missing=missing_per_batch(num_slots, workload.sequences_per_step, len(adapters)),
        link_busy_share=simulation.copy_busy_ms / step_ms if step_ms else 0.0)
    rows = tuple(AdapterRow(name=a.name, source=a.source, revision=a.revision, fingerprint=a.fingerprint, rank=a.rank,
                            alpha=a.alpha, target_modules=a.target_modules, num_tensors=a.num_tensors,
                            bytes=a.total_bytes, copy_ms=copy_ms_of(a.total_bytes, h2d, overhead_us))
                 for a in sorted(adapters, key=lambda a: a.name))
    request_ms = compute_step_ms / max(1, workload.sequences_per_step)
    choice = choose_mode(copy_ms={row.name: row.copy_ms for row in rows}, num_slots=num_slots,
                         request_ms=request_ms, weights=weights, max_requests=workload.sequences_per_step)
    return AdaptersSection(
        num_slots=num_slots, slot_bytes=slot_bytes, gpu_bytes=num_slots * slot_bytes,
        host_pinned_bytes=sum(a.total_bytes for a in adapters), max_rank=max(a.rank for a in adapters),
        num_missing=waits.num_missing, copy_ms=waits.copy_ms, shared_copy_ms=waits.shared_copy_ms,
        blocking_wait_ms=waits.blocking_wait_ms, pipelined_first_wait_ms=waits.pipelined_first_wait_ms,
        pipelined_last_wait_ms=waits.pipelined_last_wait_ms, pipelined_step_ms=waits.pipelined_step_ms,
        mode=choice.mode, stream_requests_per_batch=choice.requests_per_batch,
        stream_num_batches=choice.num_batches, blocking_stream_ms=choice.blocking_total_ms,
        pipelined_stream_ms=choice.pipelined_total_ms, mode_margin=choice.margin, items=rows)


def _kv_dtype_name(model: Model) -> str:
    """--kv-dtype with auto resolved to the checkpoint's activation dtype."""
    return model.activation_dtype if model.inputs.kv_dtype == "auto" else model.inputs.kv_dtype


def _prefill_chunk_ms(model: Model, choice: Choice, chunk_tokens: int) -> float:
    """One prefill chunk of a new sequence with the plan's placement, steps back to back (replayed from a CUDA graph
    where chunk_graphed, else eager); routed layers copy all their experts through the staging buffer, on the
    compute stream."""
    compute = model.compute(workload_of(chunk_tokens, 1, 0), graphed=chunk_graphed(model, choice))
    if isinstance(choice, RoutedChoice):
        profile = model.profile
        return prefill_simulation(model.experts.geometry, compute, profile.h2d_bytes_per_s.value,
                                  profile.copy_overhead_us.value).step_ms
    copy_ms = tuple(copy_ms_of(model.layer_bytes.selected[i], model.profile.h2d_bytes_per_s.value,
                               model.profile.copy_overhead_us.value) for i in choice.offloaded)
    return simulate(layer_ms=compute.layer_ms, head_ms=compute.head_ms, offloaded=choice.offloaded,
                    copy_ms=copy_ms, prefetch_step=max(1, choice.prefetch_step)).step_ms


def model_section(checkpoint: Checkpoint, layout: ModelLayout) -> ModelSection:
    """What the plan records of the checkpoint: source, fingerprint, architecture, layers and bytes by dtype."""
    dtype_bytes = Counter()
    for tensor in checkpoint.tensors:
        dtype_bytes[tensor.dtype] += tensor.nbytes
    record = model_config(checkpoint.config)
    return ModelSection(
        source=checkpoint.source,
        revision=checkpoint.revision,
        fingerprint=checkpoint.fingerprint(),
        architecture=record.architecture if record else None,
        stack=layout.stack,
        num_layers=len(layout.layers),
        num_tensors=len(checkpoint.tensors),
        total_bytes=checkpoint.total_bytes,
        layer_bytes=layout.layer_bytes,
        non_layer_bytes=layout.non_layer_bytes,
        unused_layers=tuple(layer.index for layer in layout.unused_layers),
        unused_bytes=layout.unused_bytes,
        dtype_bytes=dict(sorted(dtype_bytes.items())),
    )


def serving_section(found: ServingSearch, wanted: ConcurrencyRange, max_tpot_ms: float | None) -> ServingSection:
    """The concurrencies searched, the one chosen's neighbours, and the best plan that offloads nothing."""
    alternative = found.no_offload
    return ServingSection(
        concurrency_low=wanted.low,
        concurrency_high=wanted.high,
        max_tpot_ms=max_tpot_ms,
        no_offload_concurrency=None if alternative is None else alternative.concurrency,
        no_offload_step_ms=None if alternative is None else alternative.step_ms,
        no_offload_tokens_per_s=None if alternative is None else alternative.tokens_per_s,
        points=tuple(serving_row(point) for point in found.points),
    )


def serving_row(point: ServingPoint) -> ServingRow:
    """One concurrency searched; num_offloaded -1 where no placement fits."""
    choice = point.choice
    return ServingRow(
        concurrency=point.concurrency,
        # a routed placement moves the experts of every MoE layer (planner.search.expert_choice)
        num_offloaded=-1 if choice is None else len(choice.placement.layers) if isinstance(choice, RoutedChoice)
        else len(choice.offloaded),
        group_size=0 if choice is None else choice.group_size,
        num_in_group=0 if choice is None else choice.num_in_group,
        prefetch_step=0 if choice is None else choice.prefetch_step,
        weights_gpu_bytes=0 if choice is None else choice.gpu_bytes,
        kv_cache_bytes=point.other.kv_cache_bytes,
        total_gpu_bytes=point.total_gpu_bytes,
        step_ms=point.step_ms,
        tokens_per_s=point.tokens_per_s,
    )
