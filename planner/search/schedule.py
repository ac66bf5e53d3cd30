"""The prefetch schedule: which slot each offloaded layer uses, and when each copy is issued.

Shared by the simulator (planner) and the runtime, so the prediction models exactly what the runtime does.

Offloaded layers are numbered by *position* 0..N-1 in execution order. With S = min(depth, N) slots, position
k always lives in slot k % S, so every offloaded param keeps one GPU address forever (CUDA graphs rely on it).
The copy of position k may only start after the slot's previous reader has finished: position k - S, or,
for the first S positions of a step, the last position of the previous step that used the same slot. vLLM
issues the copy of (k + S) mod N after position k, which is the same rule when S divides N; when it does
not, vLLM's wrap-around copy overwrites a slot a later layer still needs (its PR 54975). Here each copy waits
on its slot's true previous reader instead, and copies run on one stream in the order layers need them.
"""

from dataclasses import dataclass


def offloaded_by_rule(num_layers: int, group_size: int, num_in_group: int) -> tuple[int, ...]:
    """vLLM/SGLang's rule: layer i is offloaded when i % group_size >= group_size - num_in_group."""
    if group_size < 1 or not 1 <= num_in_group <= group_size:
        raise ValueError("need group_size >= 1 and 1 <= num_in_group <= group_size")
    return tuple(i for i in range(num_layers) if i % group_size >= group_size - num_in_group)


@dataclass(frozen=True)
class PrefetchSchedule:
    """Slots and copy order for ``num_offloaded`` layers with ``prefetch_step`` slots of lookahead."""

    num_offloaded: int
    prefetch_step: int

    def __post_init__(self):
        if self.num_offloaded < 0 or (self.num_offloaded and self.prefetch_step < 1):
            raise ValueError("need num_offloaded >= 0 and prefetch_step >= 1")

    @property
    def num_slots(self) -> int:
        """GPU slots: one per layer of lookahead, never more than there are offloaded layers."""
        return min(self.prefetch_step, self.num_offloaded)

    @property
    def recopies(self) -> bool:
        """False when every offloaded layer has a slot of its own: copied once at load, never again."""
        return self.num_offloaded > self.num_slots

    def needs_copy(self, position: int) -> bool:
        """False when the position's slot holds no other layer, so its weights are still there next step."""
        return self.recopies and self.previous_reader(position) != (1, position)

    def copied_positions(self) -> range | tuple[int, ...]:
        """The positions needs_copy() is true for, in order, without testing each one.

        A position p is alone in its slot when no other position shares p mod S: p - S < 0 and p + S >= N,
        i.e. N - S <= p < S. Everything else is re-copied every step.
        """
        n, slots = self.num_offloaded, self.num_slots
        if not self.recopies:
            return ()
        if 2 * slots <= n:
            return range(n)
        return tuple(range(n - slots)) + tuple(range(slots, n))

    def replay_boundary(self, replay_start_copies: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(joined, deferred): the positions whose copies wrap past a CUDA-graph replay, split in need order.

        The copies of the first S positions (those re-copied) wrap into the next step. A replay cannot end
        with copies in flight, so each either ends the replay joined, or (the last ``replay_start_copies``)
        is left to the next replay, which issues it as it begins: then the link has work while that replay
        computes its way to the first slot it frees, instead of sitting idle.
        """
        wrapped = tuple(k for k in range(self.num_slots) if self.needs_copy(k))
        split = len(wrapped) - min(replay_start_copies, len(wrapped))
        return wrapped[:split], wrapped[split:]

    def slot_of(self, position: int) -> int:
        """The slot that offloaded position ``position`` always lives in."""
        return position % self.num_slots

    def previous_reader(self, position: int) -> tuple[int, int]:
        """(steps back, position) of the last layer that used this position's slot before it.

        steps back is 0 when the previous reader ran earlier in the same step, 1 when in the previous step.
        """
        slots = self.num_slots
        if position >= slots:
            return 0, position - slots
        last_same_slot = position + slots * ((self.num_offloaded - 1 - position) // slots)
        return 1, last_same_slot

    def issue_after(self) -> tuple[tuple[int, ...], ...]:
        """For each position m: the positions whose next copy is enqueued right after m's forward is enqueued.

        Copies are enqueued in the order layers need them (one FIFO copy stream). A copy is enqueued once its
        slot's previous reader has been enqueued on the compute stream (its event exists) and every copy
        needed earlier has been enqueued. Positions wrap into the next step.
        """
        table: list[list[int]] = [[] for _ in range(self.num_offloaded)]
        if not self.recopies:
            return tuple(tuple(row) for row in table)
        n = self.num_offloaded
        enqueue_after = -1
        # Copies of positions >= num_slots in step 0, then positions < num_slots of step 1 (the wrap).
        for index in range(self.num_slots, n + self.num_slots):
            position = index % n
            if not self.needs_copy(position):
                continue
            steps_back, reader = self.previous_reader(position)
            reader_index = reader + (index // n - steps_back) * n
            enqueue_after = max(enqueue_after, reader_index)
            table[enqueue_after % n].append(position)
        return tuple(tuple(row) for row in table)
