"""Discrete-event simulation of one compute stream and one copy stream, run to steady state.

Events follow the runtime exactly (planner.search.schedule): before the first step the first S offloaded layers
are loaded; the compute stream runs the head work and every layer in order, an offloaded layer waiting for
its copy; the copy stream runs copies one at a time in the order layers need them, each copy waiting for its
slot's previous reader to finish. Several steps are simulated so prefetches wrap into the next step, and
the steady-state step is reported. Under CUDA graphs (``join_every_steps``) one graph replay runs that many
steps, and a replay cannot end with copies in flight: the copies of the next step's first S positions, which
the schedule issues after their slots' last readers, must finish before the replay ends (vLLM and SGLang
replay one step per graph, so they join at every step; inside a replay the copies wrap as eagerly), except
the last ``replay_start_copies`` of them, which the next replay issues as it begins.
"""

import functools
import math
import operator
from dataclasses import dataclass

from planner.search.schedule import PrefetchSchedule

NUM_WARM_STEPS = 6
NUM_MEASURED_STEPS = 4
#: decode steps per CUDA-graph replay (run --cuda-graph, make --cuda-graph), as vLLM and SGLang capture decode.
#: More steps per replay would join less often, but on the H100 4-step replays ran 10-15 ms per step slower
#: than 1-step ones: the graph executor spreads their copies over several streams, where each moved 42-45
#: GB/s instead of 55 (scripts/experiments/trace_decode.py --steps 1 4, benchmarks/2026-11-23-decode-trace-h100.md),
#: which this model does not capture. So one step it is. Divides NUM_MEASURED_STEPS.
STEPS_PER_GRAPH = 1


def join_every_steps_for(cuda_graph: bool) -> int:
    """simulate's ``join_every_steps`` for a plan: STEPS_PER_GRAPH under CUDA graphs, else 0 (never joined)."""
    return STEPS_PER_GRAPH if cuda_graph else 0


@dataclass(frozen=True, kw_only=True)
class Interval:
    """One thing on one stream during the reported step, times relative to the step's start."""

    layer: int
    start_ms: float
    end_ms: float


@dataclass(frozen=True, kw_only=True)
class Simulation:
    """The steady-state step."""

    step_ms: float
    #: time the compute stream waits for copies, per step
    stall_ms: float
    #: compute stream intervals of one steady-state step (layer -1 is head work)
    compute: tuple[Interval, ...]
    #: copy stream intervals that start in that step
    copies: tuple[Interval, ...]
    #: per layer, ms waited for its copy in that step
    layer_stall_ms: tuple[float, ...]
    #: ms per step, on average, that CUDA-graph replays wait at their end for copies wrapping past them
    join_ms: float = 0.0

    @property
    def copy_busy_ms(self) -> float:
        """Time the link is busy per step."""
        return sum(c.end_ms - c.start_ms for c in self.copies)


def simulate(
    *,
    layer_ms: tuple[float, ...],
    head_ms: float,
    offloaded: tuple[int, ...],
    copy_ms: tuple[float, ...],
    prefetch_step: int,
    join_every_steps: int = 0,
    replay_start_copies: int = 0,
) -> Simulation:
    """Simulate steps until steady state. ``copy_ms[k]`` is the copy time of offloaded position k;
    ``join_every_steps``: the steps per CUDA-graph replay (0: eager steps, never joined);
    ``replay_start_copies``: of the copies wrapping past a replay, how many (the last, in need order) are
    left to the next replay, which issues them when it begins."""
    assert join_every_steps >= 0 and NUM_MEASURED_STEPS % max(1, join_every_steps) == 0
    schedule = PrefetchSchedule(len(offloaded), prefetch_step)
    joined, deferred = schedule.replay_boundary(replay_start_copies if join_every_steps else 0)
    position_of = {layer: k for k, layer in enumerate(offloaded)}
    n = len(offloaded)
    compute_end: dict[tuple[int, int], float] = {}  # (step, position) -> end of that offloaded layer
    copy_end: dict[tuple[int, int], float] = {}
    copy_log: list[tuple[int, int, float, float]] = []
    # The copy stream's order: every copy after the preloaded first num_slots positions of step 0.
    per_step = [k for k in range(n) if schedule.needs_copy(k)]
    order = ((step, k) for step in range(NUM_WARM_STEPS + NUM_MEASURED_STEPS + 1) for k in per_step)
    order = (item for item in order if item[0] > 0 or item[1] >= schedule.num_slots)
    stream_free_ms = 0.0

    def ensure_copy(step: int, position: int) -> float:
        """Run the copy stream in order up to (step, position); return when that copy ends."""
        nonlocal stream_free_ms
        if (step == 0 and position < schedule.num_slots) or not schedule.needs_copy(position):
            return 0.0
        while (step, position) not in copy_end:
            copy_step, copy_position = next(order)
            steps_back, reader = schedule.previous_reader(copy_position)
            ready = compute_end[(copy_step - steps_back, reader)]
            if copy_position in deferred and copy_step % join_every_steps == 0:
                ready = max(ready, step_starts[copy_step])  # issued when the replay begins
            start = max(stream_free_ms, ready)
            end = start + copy_ms[copy_position]
            copy_end[(copy_step, copy_position)] = end
            copy_log.append((copy_step, offloaded[copy_position], start, end))
            stream_free_ms = end
        return copy_end[(step, position)]

    now = 0.0
    step_starts, traces = [], []
    for step in range(NUM_WARM_STEPS + NUM_MEASURED_STEPS):
        step_starts.append(now)
        trace = [Interval(layer=-1, start_ms=now, end_ms=now + head_ms)]
        now += head_ms
        stalls = []
        for layer, duration in enumerate(layer_ms):
            ready = now
            if layer in position_of:
                ready = max(now, ensure_copy(step, position_of[layer]))
            stalls.append(ready - now)
            trace.append(Interval(layer=layer, start_ms=ready, end_ms=ready + duration))
            now = ready + duration
            if layer in position_of:
                compute_end[(step, position_of[layer])] = now
        join_wait = 0.0
        if join_every_steps and (step + 1) % join_every_steps == 0:
            joined_at = max([now, *(ensure_copy(step + 1, k) for k in joined)])
            join_wait, now = joined_at - now, joined_at
        traces.append((trace, stalls, join_wait))
    step_starts.append(now)
    return _steady_state(step_starts, traces, copy_log)


def _steady_state(step_starts, traces, copy_log) -> Simulation:
    """Average the last steps (a schedule may repeat with a period above one step) and keep one for display."""
    first = NUM_WARM_STEPS
    step_ms = (step_starts[-1] - step_starts[first]) / NUM_MEASURED_STEPS
    origin = step_starts[first]
    trace, stalls, _ = traces[first]
    compute = tuple(
        Interval(layer=i.layer, start_ms=i.start_ms - origin, end_ms=i.end_ms - origin) for i in trace
    )
    window_end = step_starts[first + 1]
    copies = tuple(
        Interval(layer=layer, start_ms=start - origin, end_ms=end - origin)
        for _, layer, start, end in copy_log
        if origin <= start < window_end
    )
    measured_stalls = [sum(traces[s][1]) + traces[s][2] for s in range(first, len(traces))]
    joins = [traces[s][2] for s in range(first, len(traces))]
    return Simulation(
        step_ms=step_ms,
        stall_ms=sum(measured_stalls) / len(measured_stalls),
        compute=compute,
        copies=copies,
        layer_stall_ms=tuple(stalls),
        join_ms=sum(joins) / len(joins),
    )


def simulate_fastest_boundary(*, prefetch_step: int, offloaded: tuple[int, ...], join_every_steps: int,
                              **times) -> tuple[int, Simulation]:
    """(replay_start_copies, simulation): under CUDA graphs, the split of the wrapped copies between a
    replay's end and the next one's start that gives the fastest step (the fewest left to the start on a
    tie); eagerly nothing is split. ``times``: simulate's layer_ms, head_ms and copy_ms. The split is chosen
    by fastest_boundary_step_ms (the same step times, bit for bit), and only its run is simulated with a trace."""
    count, _ = fastest_boundary_step_ms(prefetch_step=prefetch_step, offloaded=offloaded,
                                        join_every_steps=join_every_steps, **times)
    return count, simulate(prefetch_step=prefetch_step, offloaded=offloaded, join_every_steps=join_every_steps,
                           replay_start_copies=count, **times)


def simulated_step_ms(*, layer_ms: tuple[float, ...], head_ms: float, offloaded: tuple[int, ...],
                      copy_ms: tuple[float, ...], prefetch_step: int, join_every_steps: int = 0,
                      replay_start_copies: int = 0) -> float:
    """``simulate(...).step_ms`` bit for bit, several times faster: the search compares thousands of plans by
    their step time alone, so this keeps no trace. Same arguments as simulate."""
    assert join_every_steps >= 0 and NUM_MEASURED_STEPS % max(1, join_every_steps) == 0
    table = copy_table(len(offloaded), prefetch_step, replay_start_copies if join_every_steps else 0)
    return fast_step_ms(layer_ms=layer_ms, head_ms=head_ms, offloaded=offloaded, copy_ms=copy_ms, table=table,
                        join_every_steps=join_every_steps)


def fastest_boundary_step_ms(*, prefetch_step: int, offloaded: tuple[int, ...], join_every_steps: int,
                             **times) -> tuple[int, float]:
    """simulate_fastest_boundary's (replay_start_copies, step_ms), bit for bit, with fast_step_ms."""
    wrapped = copy_table(len(offloaded), prefetch_step, 0).joined
    runs = []
    for count in range(len(wrapped), -1, -1) if join_every_steps else (0,):
        if count == 0 and runs and _joining_all_loses(runs, offloaded, prefetch_step, join_every_steps, **times):
            continue
        table = copy_table(len(offloaded), prefetch_step, count)
        runs.append((fast_step_ms(offloaded=offloaded, table=table, join_every_steps=join_every_steps, **times),
                     count))
    step_ms, count = min(runs, key=lambda run: (round(run[0], 6), run[1]))
    return count, step_ms


def _joining_all_loses(runs, offloaded: tuple[int, ...], prefetch_step: int, join_every_steps: int, *,
                       layer_ms: tuple[float, ...], head_ms: float, copy_ms: tuple[float, ...]) -> bool:
    """Whether joining every wrapped copy (replay_start_copies 0) surely gives a step slower, at 6 decimals,
    than one of ``runs``, so that simulate_fastest_boundary would not choose it.

    Replays of one step that join every wrapped copy leave the link idle as each begins: its first copy
    (position S) replaces position 0 in their slot, so it waits for that layer to finish, and every copy a
    replay issues ends within it. So each step takes at least head + the layers up to the first offloaded
    one + all the step's copies. The simulation's floats stray from the exact times by far less than the
    billionth taken as margin.
    """
    if join_every_steps != 1:
        return False
    per_step = copy_table(len(offloaded), prefetch_step, 0).per_step
    idle_ms = head_ms + math.fsum(layer_ms[:offloaded[0] + 1])
    bound_ms = (idle_ms + math.fsum(copy_ms[k] for k in per_step)) * (1 - 1e-9)
    return round(bound_ms, 6) > min(round(step_ms, 6) for step_ms, _ in runs)


@dataclass(frozen=True)
class CopyTable:
    """The copy stream's order for one schedule, as flat tables (fast_step_ms's input). Positions alone in
    their slot are never copied and never read before a copy, so only the copied positions have entries."""

    num_slots: int
    #: the positions copied each step, in stream order (ascending)
    per_step: tuple[int, ...]
    #: per copied position, in per_step order: steps back to its slot's previous reader, and that reader's
    #: index in per_step (a reader shares its slot, so it is copied too)
    reader_steps_back: tuple[int, ...]
    reader_index: tuple[int, ...]
    #: per copied position: whether a replay leaves its wrapped copy to the next replay's start
    deferred: tuple[bool, ...]
    #: the indexes in per_step of the wrapped copies joined at the end of a replay
    joined: tuple[int, ...]
    #: copies preloaded before step 0: the first ones of per_step, those below num_slots
    num_preloaded: int


@functools.lru_cache(maxsize=16384)
def copy_table(num_offloaded: int, prefetch_step: int, replay_start_copies: int) -> CopyTable:
    """The CopyTable of PrefetchSchedule(num_offloaded, prefetch_step), with the replay boundary split."""
    schedule = PrefetchSchedule(num_offloaded, prefetch_step)
    per_step = tuple(schedule.copied_positions())
    index = {position: i for i, position in enumerate(per_step)}
    readers = [schedule.previous_reader(position) for position in per_step]
    joined, deferred = schedule.replay_boundary(replay_start_copies)
    return CopyTable(
        num_slots=schedule.num_slots,
        per_step=per_step,
        reader_steps_back=tuple(back for back, _ in readers),
        reader_index=tuple(index[reader] for _, reader in readers),
        deferred=tuple(position in deferred for position in per_step),
        joined=tuple(index[position] for position in joined),
        num_preloaded=sum(1 for position in per_step if position < schedule.num_slots),
    )


def fast_step_ms(*, layer_ms: tuple[float, ...], head_ms: float, offloaded: tuple[int, ...],
                 copy_ms: tuple[float, ...], table: CopyTable, join_every_steps: int) -> float:
    """The steady-state step of simulate(), computed with the same floating-point operations in the same order
    (so the same bits) and nothing else: the compute stream adds each layer's time to the clock in turn
    (functools.reduce over the layers between two copied ones, offloaded layers alone in their slot included:
    they never wait), a copied layer first waits for its copy, and the copy stream runs in order as far as the
    layer waiting needs it. ``table`` must be built with the run's replay_start_copies."""
    add, reduce = operator.add, functools.reduce
    per_step, steps_back, reader_index = table.per_step, table.reader_steps_back, table.reader_index
    deferred, per_step_count, preloaded = table.deferred, len(per_step), table.num_preloaded
    # One row per wait of the compute stream: (layer times before the wait, the copied layer's time or None
    # for the replay's join, the copy's index counted from the step's first copy, preloaded in step 0).
    rows, start = [], 0
    for i, position in enumerate(per_step):
        layer = offloaded[position]
        rows.append((layer_ms[start:layer], layer_ms[layer], i, position < table.num_slots))
        start = layer + 1
    rows.append((layer_ms[start:], None, -1, False))
    rows_joined = rows + [((), None, per_step_count + i, False) for i in table.joined]
    copies = [copy_ms[position] for position in per_step]
    ends: list[float] = []  # end of each copy, in stream order, from the first after the preload
    compute_end: list[list[float]] = []  # per step, per copied position: when its layer ends
    step_starts: list[float] = []
    stream_free = now = 0.0
    num_done = 0  # len(ends)
    copy_step, at = divmod(preloaded, per_step_count) if per_step_count else (0, 0)
    for step in range(NUM_WARM_STEPS + NUM_MEASURED_STEPS):
        step_starts.append(now)
        now += head_ms
        ended: list[float] = []
        compute_end.append(ended)
        first = step * per_step_count - preloaded
        joins = join_every_steps and (step + 1) % join_every_steps == 0
        for segment, duration, index, preloaded_at_start in rows_joined if joins else rows:
            if segment:
                now = reduce(add, segment, now)
            if index >= 0 and (step or not preloaded_at_start):
                number = first + index
                while num_done <= number:  # the copy stream, in order, up to this copy
                    ready = compute_end[copy_step - steps_back[at]][reader_index[at]]
                    if deferred[at] and copy_step % join_every_steps == 0:
                        ready = max(ready, step_starts[copy_step])  # issued when the replay begins
                    if ready > stream_free:
                        stream_free = ready
                    stream_free += copies[at]
                    ends.append(stream_free)
                    num_done += 1
                    at += 1
                    if at == per_step_count:
                        copy_step, at = copy_step + 1, 0
                if ends[number] > now:
                    now = ends[number]
            if duration is not None:
                now += duration
                ended.append(now)
    step_starts.append(now)
    return (step_starts[-1] - step_starts[NUM_WARM_STEPS]) / NUM_MEASURED_STEPS
