"""A stream of requests, each naming a LoRA adapter, served from a few GPU slots: which adapter is copied into
which slot and when, which requests run in one forward, and the times that follow.

The runtime (runtime.adapters) executes the schedule made here, and ``simulate`` predicts the same schedule
from the plan's copy times and the forwards' compute times, so measured and predicted are the same events.

Requests come in batches; batch b arrives when batch b-1 has finished (a saturated server), and no copy for a
batch starts before it arrives. Two ways to serve a batch:

- blocking (a batch waits for all its adapters): the batch is cut into waves of at most ``num_slots`` adapters
  (consecutive requests, first come first served); each wave's missing adapters are copied, then the wave runs
  as one forward whose rows mix its adapters.
- pipelined (a request starts as soon as its own adapter has landed): the same waves, each run as two forwards:
  the lead (the requests of the wave's first adapter) waits for that one copy only; the rest of the wave, rows
  mixing its other adapters, waits for theirs, which land while the lead computes. The copies are issued in
  need order before the lead, so the compute stream idles for one copy per wave at most (none where the
  previous wave's forwards cover it), and a forward's offloaded-weight copies, on the same link, queue behind
  at most one wave of adapter copies: neither kind starves the other.

A forward runs at most a plan's sequences per step (``max_requests``): the step whose activations the plan books.
A wave of more requests runs as several forwards; the first waits for the wave's copies (blocking) or for its
own adapters' (pipelined), and each later one for those of its own adapters not yet waited for.

A slot is reused for the least recently used adapter that the batch's remaining requests do not need; the copy
into it waits for the last forward that read the slot.
"""

import copy
import random
from dataclasses import dataclass

from planner.search.schedule import PrefetchSchedule

BLOCKING = "blocking"
PIPELINED = "pipelined"
MODES = (BLOCKING, PIPELINED)


@dataclass(frozen=True, kw_only=True)
class Load:
    """One adapter copied from the pinned pool into a GPU slot, on the copy stream."""

    adapter: str
    slot: int
    #: the batch it is for: the copy starts no earlier than the batch's arrival
    batch: int
    #: the last forward that read the slot's previous adapter (the copy waits for it); None for a free slot
    after_forward: int | None


@dataclass(frozen=True, kw_only=True)
class Forward:
    """One forward over some requests; each adapter's requests are consecutive rows."""

    batch: int
    #: request indices (stream order), grouped by adapter
    requests: tuple[int, ...]
    #: each request's adapter and slot
    adapters: tuple[str, ...]
    slots: tuple[int, ...]
    #: loads (indices into StreamSchedule.loads) issued on the copy stream just before this forward
    issue_loads: tuple[int, ...]
    #: loads this forward waits for
    waits: tuple[int, ...]

    def row_groups(self) -> list[tuple[int, int, str, int]]:
        """(first row, end row, adapter, slot) of each adapter's consecutive rows."""
        groups, start = [], 0
        for row in range(1, len(self.requests) + 1):
            if row == len(self.requests) or self.adapters[row] != self.adapters[start]:
                groups.append((start, row, self.adapters[start], self.slots[start]))
                start = row
        return groups


@dataclass(frozen=True, kw_only=True)
class StreamSchedule:
    """Every load and forward of a request stream, in the order they are issued."""

    mode: str
    num_slots: int
    #: adapter of each request, stream order
    request_adapters: tuple[str, ...]
    #: batch of each request
    request_batches: tuple[int, ...]
    loads: tuple[Load, ...]
    forwards: tuple[Forward, ...]

    def last_forward_of_batch(self) -> dict[int, int]:
        """Batch -> index of its last forward (its end is the next batch's arrival)."""
        return {forward.batch: index for index, forward in enumerate(self.forwards)}


class _Slots:
    """Which adapter each slot holds, the last forward that read it, and least-recent use."""

    def __init__(self, num_slots: int):
        self.adapter_of: list[str | None] = [None] * num_slots
        self.last_forward: list[int | None] = [None] * num_slots
        self.last_use: list[int] = [-1] * num_slots
        self._clock = 0

    def slot_of(self, adapter: str) -> int | None:
        return self.adapter_of.index(adapter) if adapter in self.adapter_of else None

    def victim(self, keep: set[str]) -> int:
        """A free slot, else the least recently used one whose adapter is not in ``keep`` (else any LRU)."""
        if None in self.adapter_of:
            return self.adapter_of.index(None)
        candidates = [s for s, a in enumerate(self.adapter_of) if a not in keep] or list(range(len(self.adapter_of)))
        return min(candidates, key=lambda s: self.last_use[s])

    def use(self, slot: int, forward: int) -> None:
        self._clock += 1
        self.last_use[slot], self.last_forward[slot] = self._clock, forward


def schedule_stream(batches: list[list[str]], num_slots: int, mode: str,
                    max_requests: int | None = None) -> StreamSchedule:
    """The schedule of ``batches`` (each a list of the adapter each request names) served from ``num_slots``,
    no forward running more than ``max_requests`` requests (a plan's sequences per step: the step its activations
    are booked for; None: a wave's requests in one forward)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}")
    if num_slots < 1:
        raise ValueError("num_slots must be at least 1")
    if max_requests is not None and max_requests < 1:
        raise ValueError("max_requests must be at least 1")
    builder = _Builder(num_slots, max_requests)
    first_request = 0
    for batch, adapters in enumerate(batches):
        requests = list(range(first_request, first_request + len(adapters)))
        if mode == BLOCKING:
            builder.blocking_batch(batch, requests, adapters)
        else:
            builder.pipelined_batch(batch, requests, adapters)
        first_request += len(adapters)
    return StreamSchedule(mode=mode, num_slots=num_slots,
                          request_adapters=tuple(a for batch in batches for a in batch),
                          request_batches=tuple(b for b, batch in enumerate(batches) for _ in batch),
                          loads=tuple(builder.loads), forwards=tuple(builder.forwards))


class _Builder:
    def __init__(self, num_slots: int, max_requests: int | None = None):
        self.num_slots = num_slots
        self.max_requests = max_requests
        self.slots = _Slots(num_slots)
        self.loads: list[Load] = []
        self.forwards: list[Forward] = []

    def _place(self, adapter: str, batch: int, keep: set[str]) -> tuple[int, int | None]:
        """The adapter's slot, and the index of the load that brings it there (None: already there)."""
        slot = self.slots.slot_of(adapter)
        if slot is not None:
            return slot, None
        slot = self.slots.victim(keep)
        self.loads.append(Load(adapter=adapter, slot=slot, batch=batch, after_forward=self.slots.last_forward[slot]))
        self.slots.adapter_of[slot] = adapter
        return slot, len(self.loads) - 1

    def blocking_batch(self, batch: int, requests: list[int], adapters: list[str]) -> None:
        for wave in _waves(list(zip(requests, adapters)), self.num_slots):
            order = list(dict.fromkeys(a for _, a in wave))  # the wave's adapters in need order
            placed = {adapter: self._place(adapter, batch, set(order)) for adapter in order}
            rows = [(r, a) for adapter in order for r, a in wave if a == adapter]
            new_loads = tuple(load for _, load in placed.values() if load is not None)
            slot_of = {a: slot for a, (slot, _) in placed.items()}
            # the wave's first forward waits for all its copies; the others follow it on the compute stream
            for number, part in enumerate(self._parts(rows)):
                copies = new_loads if number == 0 else ()
                self._forward(batch, part, slot_of, copies, copies)

    def pipelined_batch(self, batch: int, requests: list[int], adapters: list[str]) -> None:
        for wave in _waves(list(zip(requests, adapters)), self.num_slots):
            order = list(dict.fromkeys(a for _, a in wave))
            placed = {adapter: self._place(adapter, batch, set(order)) for adapter in order}
            slot_of = {a: slot for a, (slot, _) in placed.items()}
            issue = tuple(load for _, load in placed.values() if load is not None)
            lead = [(r, a) for r, a in wave if a == order[0]]
            rest = [(r, a) for adapter in order[1:] for r, a in wave if a == adapter]
            waited = set()
            for number, part in enumerate(self._parts(lead) + self._parts(rest)):
                # each forward waits for the copies of its own adapters not waited for yet
                needed = [a for a in dict.fromkeys(a for _, a in part) if a not in waited]
                waited.update(needed)
                self._forward(batch, part, slot_of, issue if number == 0 else (), _loads_of(placed, needed))

    def _parts(self, rows: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
        """``rows`` in forwards of at most max_requests requests (one where there is no bound)."""
        if not rows:
            return []
        size = self.max_requests or len(rows)
        return [rows[start:start + size] for start in range(0, len(rows), size)]

    def _forward(self, batch: int, rows: list[tuple[int, str]], slot_of: dict[str, int], issue: tuple[int, ...],
                 waits: tuple[int, ...]) -> None:
        index = len(self.forwards)
        self.forwards.append(Forward(batch=batch, requests=tuple(r for r, _ in rows),
                                     adapters=tuple(a for _, a in rows), slots=tuple(slot_of[a] for _, a in rows),
                                     issue_loads=issue, waits=waits))
        for adapter in dict.fromkeys(a for _, a in rows):
            self.slots.use(slot_of[adapter], index)


def _loads_of(placed: dict[str, tuple[int, int | None]], adapters: list[str]) -> tuple[int, ...]:
    """The loads that bring ``adapters`` to their slots (none for those already there)."""
    return tuple(placed[a][1] for a in adapters if placed[a][1] is not None)


def _waves(requests: list[tuple[int, str]], num_slots: int) -> list[list[tuple[int, str]]]:
    """Consecutive runs of requests needing at most ``num_slots`` distinct adapters."""
    waves, current, names = [], [], set()
    for request, adapter in requests:
        if adapter not in names and len(names) == num_slots:
            waves.append(current)
            current, names = [], set()
        current.append((request, adapter))
        names.add(adapter)
    return waves + [current] if current else waves


def stream_batches(names: list[str], requests_per_batch: int, num_batches: int, seed: int = 0) -> list[list[str]]:
    """Batches of requests over distinct adapters (as many as a batch has requests, fewer if fewer exist),
    drawn at random from ``names``."""
    rng = random.Random(seed)
    per_batch = min(requests_per_batch, len(names))
    batches = []
    for _ in range(num_batches):
        chosen = rng.sample(names, per_batch)
        batches.append([chosen[k % per_batch] for k in range(requests_per_batch)])
    return batches


# ---- prediction ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StreamTimes:
    """Times of a served stream, in ms from its start (predicted by ``simulate`` or measured by the runtime)."""

    #: when each forward starts computing and ends
    forward_start_ms: tuple[float, ...]
    forward_end_ms: tuple[float, ...]
    #: each request's time to its first token, from its batch's arrival
    ttft_ms: tuple[float, ...]
    total_ms: float
    #: time the compute stream sat idle (waiting for adapters)
    compute_idle_ms: float
    #: the first request of each batch: from the batch's arrival to the start of its first forward
    first_start_ms: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class WeightsOnLink:
    """The offloaded weights' copies, on the link the adapters' copies use, as the engine issues them
    (runtime.engine.OffloadEngine, eager steps): one FIFO copy stream; after offloaded position m's layer is
    enqueued, the copies of PrefetchSchedule.issue_after()[m] are enqueued, each waiting for its slot's previous
    reader; an offloaded layer waits for its own copy. The first ``prefetch_step`` positions' copies for the
    next forward are enqueued inside the forward before (after their slots' last readers), so they lie on the
    link ahead of any adapter copy issued for the next forward."""

    num_layers: int
    #: offloaded layer indices, ascending
    offloaded: tuple[int, ...]
    prefetch_step: int
    #: each offloaded position's copy, ms
    copy_ms: tuple[float, ...]
    #: each layer's share of a forward's layer compute (summing to 1); empty: every layer alike
    layer_shares: tuple[float, ...] = ()
    #: the LM head, after the last layer, ms a forward: it reads the head's weights once for each row's last
    #: token (logits_to_keep=1), so it does not grow with the forward's rows and tokens as the layers do
    head_ms: float = 0.0

    def __post_init__(self):
        if len(self.copy_ms) != len(self.offloaded) or not all(0 <= i < self.num_layers for i in self.offloaded):
            raise ValueError("one copy time per offloaded layer, each layer in the stack")
        if self.layer_shares and (len(self.layer_shares) != self.num_layers or abs(sum(self.layer_shares) - 1) > 1e-9):
            raise ValueError("layer_shares: one per layer, summing to 1")
        if not self.head_ms >= 0:
            raise ValueError("head_ms must be at least 0")

    def shares(self) -> tuple[float, ...]:
        return self.layer_shares or (1.0 / self.num_layers,) * self.num_layers


def weights_on_link(plan) -> WeightsOnLink | None:
    """The plan's offloaded weights as the engine copies them (None when nothing is offloaded)."""
    return weights_of_layers(plan.layers, tuple(plan.offload.layers), plan.offload.prefetch_step,
                             plan.prediction.head_ms)


def weights_of_layers(layers, offloaded: tuple[int, ...], prefetch_step: int, head_ms: float) -> WeightsOnLink | None:
    """Plan layer rows' copy times (at the plan's link) and compute shares, and the plan's LM head time; None when
    nothing is offloaded."""
    if not offloaded:
        return None
    layers_ms = sum(row.compute_ms for row in layers)
    shares = tuple(row.compute_ms / layers_ms for row in layers) if layers_ms > 0 else ()
    return WeightsOnLink(num_layers=len(layers), offloaded=offloaded, prefetch_step=prefetch_step,
                         copy_ms=tuple(layers[i].copy_ms for i in offloaded), layer_shares=shares, head_ms=head_ms)


class _Link:
    """The copy stream and the compute stream's layer events: the state that carries from forward to forward."""

    def __init__(self, weights: WeightsOnLink | None):
        self.weights = weights
        self.free_ms = 0.0
        if weights is None:
            return
        self.schedule = PrefetchSchedule(len(weights.offloaded), weights.prefetch_step)
        self.issue_after = self.schedule.issue_after()
        self.position_of = {layer: p for p, layer in enumerate(weights.offloaded)}
        self.shares = weights.shares()
        #: when each position's latest copy lands (the first slots were loaded before the stream began)
        self.copy_done = [0.0] * len(weights.offloaded)
        self.reader_done = [0.0] * len(weights.offloaded)

    def copy(self, ready_ms: float, copy_ms: float) -> float:
        """One copy enqueued now, startable at ``ready_ms``: FIFO behind every copy enqueued before; its end."""
        self.free_ms = max(self.free_ms, ready_ms) + copy_ms
        return self.free_ms

    def forward(self, start_ms: float, compute_ms: float) -> float:
        """A forward of ``compute_ms`` (pure compute) from ``start_ms``: its layers wait for their weights, and
        each enqueues the copies the engine issues after it. Its end."""
        weights = self.weights
        if weights is None:
            return start_ms + compute_ms
        head_ms = min(weights.head_ms, compute_ms)
        t = start_ms
        for layer, share in enumerate(self.shares):
            position = self.position_of.get(layer)
            if position is not None and self.schedule.needs_copy(position):
                t = max(t, self.copy_done[position])
            t += (compute_ms - head_ms) * share
            if position is None:
                continue
            self.reader_done[position] = t
            for target in self.issue_after[position]:
                reader = self.schedule.previous_reader(target)[1]
                self.copy_done[target] = self.copy(self.reader_done[reader], weights.copy_ms[target])
        # the LM head runs after the last layer: the copies that wait for the last offloaded layer (the next
        # forward's first slots) start under it, not at the forward's end
        return t + head_ms

    def clone(self) -> "_Link":
        twin = copy.copy(self)
        if self.weights is not None:
            twin.copy_done, twin.reader_done = list(self.copy_done), list(self.reader_done)
        return twin


def simulate(schedule: StreamSchedule, *, copy_ms: dict[str, float], compute_ms: list[float],
             weights: WeightsOnLink | None = None) -> StreamTimes:
    """Predicted times of ``schedule``: every copy on one link in the order the runtime enqueues them (the
    adapter's ``copy_ms``; with ``weights``, the offloaded weights' copies as the engine issues them, layer by
    layer, on the same stream), each forward's ``compute_ms`` (pure compute, spread over its layers) on the
    compute stream. An adapter copy waits for its batch's arrival and its slot's last reader, and, the stream
    being FIFO, for every copy enqueued before it: the weight copies the forward before issued near its end
    go ahead of the next batch's adapters."""
    link = _Link(weights)
    load_end: dict[int, float] = {}
    starts, ends = [], []
    arrival = {0: 0.0}
    last_of_batch = schedule.last_forward_of_batch()
    for index, forward in enumerate(schedule.forwards):
        for load_index in forward.issue_loads:
            load = schedule.loads[load_index]
            ready = max(arrival[load.batch], ends[load.after_forward] if load.after_forward is not None else 0.0)
            load_end[load_index] = link.copy(ready, copy_ms[load.adapter])
        start = max([ends[-1] if ends else 0.0, arrival[forward.batch]] + [load_end[i] for i in forward.waits])
        starts.append(start)
        ends.append(link.forward(start, compute_ms[index]))
        if last_of_batch[forward.batch] == index:
            arrival[forward.batch + 1] = ends[-1]
    return _times(schedule, starts, ends, arrival)


def pure_compute_ms(alone_ms: list[float], weights: WeightsOnLink | None) -> list[float]:
    """Each forward's pure compute, from its time measured alone (the forwards back to back, no adapter copies,
    the weights' copies on the link): the compute for which the same link model gives that time. Where the
    link alone takes longer than measured (the forward is bound by it), the most compute that leaves it bound."""
    if weights is None:
        return list(alone_ms)
    link, computes, clock = _Link(weights), [], 0.0
    for measured in alone_ms:
        def took(compute: float, state: _Link = link, start: float = clock) -> float:
            return state.clone().forward(start, compute) - start

        target = max(measured, took(0.0))
        low, high = 0.0, target
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if took(middle) <= target * (1 + 1e-12) else (low, middle)
        computes.append(low)
        clock = link.forward(clock, low)
    return computes


def _times(schedule: StreamSchedule, starts: list[float], ends: list[float], arrival: dict[int, float]) -> StreamTimes:
    """Per-request and whole-stream figures from each forward's start and end."""
    end_of_request = {r: ends[i] for i, f in enumerate(schedule.forwards) for r in f.requests}
    ttft = tuple(end_of_request[r] - arrival[b] for r, b in enumerate(schedule.request_batches))
    first_forward = {}
    for index, forward in enumerate(schedule.forwards):
        first_forward.setdefault(forward.batch, index)
    busy_ms = sum(e - s for s, e in zip(starts, ends))
    total_ms = ends[-1] if ends else 0.0
    return StreamTimes(forward_start_ms=tuple(starts), forward_end_ms=tuple(ends), ttft_ms=ttft, total_ms=total_ms,
                       compute_idle_ms=total_ms - busy_ms,
                       first_start_ms=tuple(starts[i] - arrival[b] for b, i in sorted(first_forward.items())))


def times_from_events(schedule: StreamSchedule, starts: list[float], ends: list[float]) -> StreamTimes:
    """Measured times: each forward's start and end in ms from the stream's start (the runtime's events)."""
    arrival = {0: 0.0}
    for batch, index in schedule.last_forward_of_batch().items():
        arrival[batch + 1] = ends[index]
    return _times(schedule, starts, ends, arrival)


# ---- the plan's choice --------------------------------------------------------------------------------------

#: batches in the stream a plan's loading mode is chosen for, and run --bench serves (each arrives when the one
#: before it has finished)
STREAM_NUM_BATCHES = 4


@dataclass(frozen=True, kw_only=True)
class ModeChoice:
    """The loading mode whose predicted total is lower for a stream, and by how much."""

    mode: str
    #: the stream: batches of this many requests (twice the slots: each batch needs more adapters than fit)
    requests_per_batch: int
    num_batches: int
    blocking_total_ms: float
    pipelined_total_ms: float
    #: the other mode's predicted total over the chosen one's, less 1
    margin: float


def stream_requests_per_batch(num_slots: int) -> int:
    """Requests per batch of the stream a plan is judged on: twice its slots, so every batch reloads."""
    return 2 * num_slots


def choose_mode(*, copy_ms: dict[str, float], num_slots: int, request_ms: float,
                weights: WeightsOnLink | None, max_requests: int | None = None) -> ModeChoice:
    """Blocking or pipelined, whichever ``simulate`` predicts faster over the stream run --bench serves (batches
    of ``stream_requests_per_batch`` requests over distinct adapters of ``copy_ms``), a forward of r requests
    computing r x ``request_ms``, at most ``max_requests`` of them (the plan's step). Pipelined splits each wave
    into a lead and the rest: with offloaded weights each forward copies them again, so it wins only where that
    pass is hidden under compute. A tie is pipelined (its first request starts sooner)."""
    per_batch = stream_requests_per_batch(num_slots)
    batches = stream_batches(sorted(copy_ms), per_batch, STREAM_NUM_BATCHES)
    totals = {}
    for mode in MODES:
        schedule = schedule_stream(batches, num_slots, mode, max_requests)
        compute = [len(forward.requests) * request_ms for forward in schedule.forwards]
        totals[mode] = simulate(schedule, copy_ms=copy_ms, compute_ms=compute, weights=weights).total_ms
    chosen = BLOCKING if totals[BLOCKING] < totals[PIPELINED] else PIPELINED
    other = PIPELINED if chosen == BLOCKING else BLOCKING
    margin = totals[other] / totals[chosen] - 1.0 if totals[chosen] > 0 else 0.0
    return ModeChoice(mode=chosen, requests_per_batch=per_batch, num_batches=STREAM_NUM_BATCHES,
                      blocking_total_ms=totals[BLOCKING], pipelined_total_ms=totals[PIPELINED], margin=margin)
