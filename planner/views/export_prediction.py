"""The step an exported configuration runs, per rank, as export restates it beside the plan's own: the prefetch
offloader's plan re-simulated with the engine's prefetch order, slots and moved bytes (``predict``), SGLang's
read-at-use ``--cpu-offload-gb`` (every offloaded byte copied inside its layer's forward, behind no compute:
``read_at_use``), or a routed plan's own figures (``recorded_prediction``). planner.views.export picks which.
"""

import math
from dataclasses import dataclass

from planner.engines.versions import GIB
from planner.plan.schema import Plan
from planner.search.groups import copy_ms_of
from planner.search.schedule import PrefetchSchedule
from planner.search.simulate import simulate


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """One step of the exported configuration, per rank."""

    step_ms: float
    stall_ms: float
    link_floor_ms: float
    copy_bytes_per_step: int
    gpu_bytes: int
    host_pinned_bytes: int
    num_slots: int




def predict(plan: Plan, tp_size: int, prefetch_step: int, join_every_steps: int | None = None,
            replay_start_copies: int = 0, *, positions: tuple[int, ...] | None = None, live_extra: int = 0,
            moved_share: float = 1.0) -> Prediction:
    """Re-simulate the plan's layers per rank of ``tp_size`` with ``prefetch_step``; ``join_every_steps`` and
    ``replay_start_copies`` as planner.search.simulate (defaults: the engines' one step per graph for a --cuda-graph
    plan, else eager, every wrapped copy joined at the step's end). ``positions``: the engine's prefetch order
    where it also holds rule layers with nothing to copy; ``live_extra``: layers on the GPU beyond the P
    prefetched; ``moved_share``: the share of each offloaded layer's bytes the engine moves (the rest stays on
    the GPU)."""
    if join_every_steps is None:
        join_every_steps = 1 if plan.workload.cuda_graph else 0
    offloaded = plan.offload.layers if positions is None else positions
    hardware = plan.hardware
    rank_bytes = [math.ceil(plan.layers[i].offloaded_bytes * moved_share / tp_size) for i in offloaded]
    copy_ms = tuple(copy_ms_of(b, hardware.h2d_bytes_per_s, hardware.copy_overhead_us) if b else 0.0
                    for b in rank_bytes)
    simulation = simulate(
        layer_ms=tuple(row.compute_ms / tp_size for row in plan.layers),
        head_ms=plan.prediction.head_ms / tp_size,
        offloaded=offloaded,
        copy_ms=copy_ms,
        prefetch_step=prefetch_step,
        join_every_steps=join_every_steps,
        replay_start_copies=replay_start_copies,
    )
    schedule = PrefetchSchedule(len(offloaded), prefetch_step)
    copy_bytes = sum(b for k, b in enumerate(rank_bytes) if schedule.needs_copy(k))
    num_slots = min(schedule.num_slots + live_extra, len(offloaded))
    kept_bytes = sum(plan.layers[i].offloaded_bytes for i in offloaded) - sum(rank_bytes) * tp_size
    return Prediction(
        step_ms=simulation.step_ms,
        stall_ms=simulation.stall_ms,
        link_floor_ms=1e3 * copy_bytes / hardware.h2d_bytes_per_s,
        copy_bytes_per_step=copy_bytes,
        gpu_bytes=math.ceil((_gpu_bytes(plan, num_slots) + max(kept_bytes, 0)) / tp_size),
        host_pinned_bytes=math.ceil((plan.memory.host_pinned_bytes - max(kept_bytes, 0)) / tp_size),
        num_slots=num_slots,
    )


def read_at_use(plan: Plan, divisor: int, whole_gib_only: bool) -> tuple[float, Prediction]:
    """(GiB, prediction) of the read-at-use mechanism per rank: the fewest GiB (whole ones where the engine's
    flag is an int) whose GPU weights fit within the plan's, and its step: every layer's compute plus
    the copy of its offloaded bytes at the plan's link rate, behind no compute."""
    # the plan's own GPU weights, not its budget: its KV cache and activations were planned beside them
    budget = math.floor(plan.memory.gpu_bytes / divisor)
    step = 1 if whole_gib_only else 0.25
    units = math.ceil(sum(_rank_layer_bytes(plan, divisor)) / GIB / step)
    for count in range(0, units + 1):
        prediction = _read_at_use_prediction(plan, divisor, count * step * GIB)
        if prediction.gpu_bytes <= budget:
            return count * step, prediction
    return units * step, _read_at_use_prediction(plan, divisor, units * step * GIB)


def _rank_layer_bytes(plan: Plan, divisor: int) -> list[int]:
    return [math.ceil(row.bytes / divisor) for row in plan.layers]


def read_at_use_layers(plan: Plan, divisor: int, gib: float) -> int:
    """How many layers, from layer 0, hold offloaded bytes under ``gib`` read at use, per rank of ``divisor``."""
    moved = _moved_bytes(_rank_layer_bytes(plan, divisor), gib * GIB)
    return max(1, sum(1 for b in moved if b))


def _moved_bytes(layer_bytes: list[int], limit_bytes: float) -> list[int]:
    """Each layer's offloaded bytes: layer 0 onward until ``limit_bytes`` (the engine stops at the param that
    reaches it; bytes stand in for params here)."""
    moved, left = [], limit_bytes
    for num_bytes in layer_bytes:
        take = int(min(num_bytes, max(left, 0)))
        moved.append(take)
        left -= take
    return moved


def _read_at_use_prediction(plan: Plan, divisor: int, limit_bytes: float) -> Prediction:
    hardware = plan.hardware
    moved = _moved_bytes(_rank_layer_bytes(plan, divisor), limit_bytes)
    copy_ms = sum(copy_ms_of(b, hardware.h2d_bytes_per_s, hardware.copy_overhead_us) for b in moved if b)
    compute_ms = sum(row.compute_ms for row in plan.layers) / divisor + plan.prediction.head_ms / divisor
    total = sum(moved)
    weights = math.ceil((plan.model.non_layer_bytes + sum(row.bytes for row in plan.layers)) / divisor)
    return Prediction(step_ms=compute_ms + copy_ms, stall_ms=copy_ms,
                      link_floor_ms=1e3 * total / hardware.h2d_bytes_per_s, copy_bytes_per_step=total,
                      gpu_bytes=weights - total + max(moved, default=0),
                      host_pinned_bytes=total, num_slots=1 if total else 0)


def recorded_prediction(plan: Plan) -> Prediction:
    """The plan's own prediction section as a Prediction (a routed plan, which predict() cannot re-simulate)."""
    prediction, memory = plan.prediction, plan.memory
    return Prediction(step_ms=prediction.step_ms, stall_ms=prediction.stall_ms,
                      link_floor_ms=prediction.link_floor_ms, copy_bytes_per_step=prediction.copy_bytes_per_step,
                      gpu_bytes=memory.gpu_bytes, host_pinned_bytes=memory.host_pinned_bytes,
                      num_slots=memory.num_slots)


def _gpu_bytes(plan: Plan, num_slots: int) -> int:
    """The plan's GPU weights with ``num_slots`` slots instead of its own."""
    return plan.memory.gpu_bytes + (num_slots - plan.memory.num_slots) * plan.memory.slot_bytes
