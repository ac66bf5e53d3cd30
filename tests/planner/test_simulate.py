"""The simulator (planner.search.simulate) against cases computed by hand; the schedule's tables are in
tests/planner/test_schedule.py, the search's cases in tests/planner/test_search.py.

Times are small integers (exact in binary floating point), so step times compare with ==.
"""

import random

import pytest

from planner.search import simulate as simulate_module
from planner.search.schedule import PrefetchSchedule
from planner.search.simulate import simulate, simulate_fastest_boundary


def sim(layer_ms, offloaded, copy_ms, prefetch_step, head_ms=0.0):
    return simulate(layer_ms=tuple(layer_ms), head_ms=head_ms, offloaded=tuple(offloaded), copy_ms=tuple(copy_ms),
                    prefetch_step=prefetch_step)


def copies_per_step(offloaded, copy_ms, prefetch_step) -> float:
    schedule = PrefetchSchedule(len(offloaded), prefetch_step)
    return sum(copy_ms[k] for k in range(len(offloaded)) if schedule.needs_copy(k))


# ---- (i)-(iii), (v): hand-computed step times ------------------------------------------------------------------


@pytest.mark.parametrize("head_ms", [0.0, 2.0])
def test_copies_hide_behind_compute(head_ms):
    # Layers 1 and 3 offloaded, one slot. Copy of layer 3 (5 ms) starts when layer 1 ends and has layer 2's
    # 10 ms to hide in; the copy of layer 1 starts when layer 3 ends and hides behind head + layer 0.
    s = sim([10, 10, 10, 10], offloaded=[1, 3], copy_ms=[5, 5], prefetch_step=1, head_ms=head_ms)
    assert s.step_ms == 40 + head_ms
    assert s.stall_ms == 0
    assert s.layer_stall_ms == (0, 0, 0, 0)
    assert s.copy_busy_ms == 10


def test_link_bound_step_equals_link_floor():
    # 4 of 6 layers offloaded, 10 ms copies, 1 ms compute, two slots: the copy stream never idles, so the
    # step is the 40 ms of copies per step, far above the 6 ms of compute.
    s = sim([1] * 6, offloaded=[0, 1, 2, 3], copy_ms=[10] * 4, prefetch_step=2)
    floor = copies_per_step([0, 1, 2, 3], [10] * 4, 2)
    assert floor == 40
    assert s.step_ms == floor
    assert s.stall_ms == 40 - 6
    assert s.copy_busy_ms == 40


@pytest.mark.parametrize(
    "prefetch_step, step_ms, stall_ms",
    [
        # P=1: copy k waits for layer k-1 to finish, and layer k for copy k: 4 x (5 + 2) = 28 ms. The head
        # (1 ms) runs under the copy of layer 0, so layer 0 waits 4 and layers 1-3 wait 5: stall 19.
        (1, 28.0, 19.0),
        # P=2: copy k waits for layer k-2, which ended 3 ms after copy k-2 ended and 2 ms before copy k-1
        # ends: copies run back to back, 4 x 5 = 20 ms (the link floor). Waits 2 (layer 0) + 3 x 3 = 11.
        (2, 20.0, 11.0),
        # P=3: slots 0,1,2,0. Positions 1 and 2 own their slots and are never recopied; 0 and 3 share
        # slot 0, so copy 3 waits for layer 0 and copy 0 for layer 3: 2 + 5 (copy 3, under layers 1-2, 4 ms)
        # + 2 + 5 (copy 0; the head hides 1 ms of it) = 14 ms. Waits: layer 3 waits 1, layer 0 waits 4.
        (3, 14.0, 5.0),
        # P=4 (and more): a slot per layer, nothing is copied after the first step: compute only.
        (4, 9.0, 0.0),
        (7, 9.0, 0.0),
    ],
)
def test_prefetch_depth(prefetch_step, step_ms, stall_ms):
    s = sim([2, 2, 2, 2], offloaded=[0, 1, 2, 3], copy_ms=[5, 5, 5, 5], prefetch_step=prefetch_step, head_ms=1.0)
    assert s.step_ms == step_ms
    assert s.stall_ms == stall_ms
    assert s.step_ms == 9.0 + s.stall_ms  # compute (head 1 + 4 x 2) plus waits


@pytest.mark.parametrize("num_offloaded, prefetch_step", [(3, 3), (3, 5), (1, 1), (2, 9)])
def test_depth_at_least_n_never_recopies(num_offloaded, prefetch_step):
    schedule = PrefetchSchedule(num_offloaded, prefetch_step)
    assert schedule.num_slots == num_offloaded
    assert not schedule.recopies
    assert not any(schedule.needs_copy(k) for k in range(num_offloaded))
    assert schedule.issue_after() == ((),) * num_offloaded
    layers = [3.0] * (num_offloaded + 2)
    offloaded = list(range(1, num_offloaded + 1))
    s = sim(layers, offloaded, [100.0] * num_offloaded, prefetch_step, head_ms=1.0)
    assert s.step_ms == 1.0 + sum(layers)
    assert s.stall_ms == 0 and s.copies == () and s.copy_busy_ms == 0


# ---- (iv): depth not dividing the number offloaded ---------------------------------------------------------------


def _check_slot_discipline(s, offloaded, num_slots):
    """No copy into a slot overlaps a read of that slot, every read follows the copy of its own layer, and
    every copy is next read by its own layer (so it never started before the slot's previous reader ended)."""
    position = {layer: k for k, layer in enumerate(offloaded)}
    for slot in range(num_slots):
        reads = [(i.start_ms, i.end_ms, i.layer) for i in s.compute
                 if i.layer in position and position[i.layer] % num_slots == slot]
        writes = [(c.start_ms, c.end_ms, c.layer) for c in s.copies if position[c.layer] % num_slots == slot]
        for w_start, w_end, w_layer in writes:
            for r_start, r_end, r_layer in reads:
                assert not (w_start < r_end and r_start < w_end), (
                    f"copy of layer {w_layer} [{w_start}, {w_end}] overlaps layer {r_layer}'s read "
                    f"[{r_start}, {r_end}] of slot {slot}")
        for r_start, _, r_layer in reads:
            before = [w for w in writes if w[1] <= r_start]
            if before:
                assert max(before)[2] == r_layer, f"layer {r_layer} reads slot {slot} after a copy of {max(before)[2]}"
        for w_start, w_end, w_layer in writes:
            after = [r for r in reads if r[0] >= w_end]
            if after:
                assert min(after)[2] == w_layer, f"slot {slot}: copy of {w_layer} is read by {min(after)[2]}"


@pytest.mark.parametrize("warm_steps", range(0, 7))
def test_n5_p2_copies_never_overwrite_a_slot_in_use(monkeypatch, warm_steps):
    # Five of seven layers offloaded through two slots (5 % 2 != 0), uneven times; every simulated step is
    # displayed in turn by moving the measured window.
    monkeypatch.setattr(simulate_module, "NUM_WARM_STEPS", warm_steps)
    offloaded = [0, 1, 3, 4, 6]
    layer_ms = [1, 2, 3, 1, 2, 3, 1]
    copy_ms = [4, 1, 3, 2, 5]
    s = sim(layer_ms, offloaded, copy_ms, prefetch_step=2, head_ms=0.5)
    assert len(s.copies) >= (3 if warm_steps == 0 else 5)  # step 0 starts with two slots preloaded
    _check_slot_discipline(s, offloaded, 2)
    # one copy stream: copies run one at a time
    copies = sorted((c.start_ms, c.end_ms) for c in s.copies)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(copies, copies[1:]))


def test_slot_check_catches_vllms_wraparound(monkeypatch):
    """The check above is not vacuous: with vLLM's rule (copy (k + S) mod N after position k) the copy of
    position 0 starts after position 3 while position 4 still reads slot 0."""
    original = PrefetchSchedule.previous_reader

    def vllm_previous_reader(self, position):
        if position >= self.num_slots:
            return original(self, position)
        return 1, (position - self.num_slots) % self.num_offloaded

    monkeypatch.setattr(PrefetchSchedule, "previous_reader", vllm_previous_reader)
    offloaded = [0, 1, 3, 4, 6]
    s = sim([1, 2, 3, 1, 2, 3, 1], offloaded, [4, 1, 3, 2, 5], prefetch_step=2, head_ms=0.5)
    with pytest.raises(AssertionError):
        _check_slot_discipline(s, offloaded, 2)


def test_slot_discipline_random_cases():
    rng = random.Random(7)
    for _ in range(60):
        num_layers = rng.randint(3, 9)
        offloaded = sorted(rng.sample(range(num_layers), rng.randint(2, num_layers)))
        depth = rng.randint(1, len(offloaded) - 1)
        s = sim([rng.choice([0.5, 1, 2, 4]) for _ in range(num_layers)], offloaded,
                [rng.choice([0.5, 1, 3, 6]) for _ in offloaded], depth, head_ms=rng.choice([0, 1]))
        _check_slot_discipline(s, offloaded, min(depth, len(offloaded)))


# ---- the prediction never beats the link or the compute ----------------------------------------------------------


def test_prediction_never_beats_link_or_compute():
    rng = random.Random(12345)
    for _ in range(300):
        num_layers = rng.randint(1, 12)
        offloaded = sorted(rng.sample(range(num_layers), rng.randint(0, num_layers)))
        layer_ms = [rng.uniform(0, 5) for _ in range(num_layers)]
        copy_ms = [rng.uniform(0.01, 8) for _ in offloaded]
        depth = rng.randint(1, len(offloaded) + 1) if offloaded else 0
        head_ms = rng.uniform(0, 2)
        s = sim(layer_ms, offloaded, copy_ms, depth, head_ms)
        compute = head_ms + sum(layer_ms)
        link = copies_per_step(offloaded, copy_ms, depth) if offloaded else 0.0
        tolerance = 1e-9 * max(1.0, s.step_ms)
        assert s.step_ms >= compute - tolerance, (num_layers, offloaded, depth)
        assert s.step_ms >= link - tolerance, (num_layers, offloaded, depth, s.step_ms, link)
        assert s.stall_ms >= -tolerance
        assert abs(s.step_ms - (compute + s.stall_ms)) <= 1e-6 * max(1.0, s.step_ms)


def test_graph_replays_join_the_wrapped_copies_by_hand():
    """4 layers of 1 ms, layers 2 and 3 offloaded through one slot, 3 ms per copy.

    Eager: copy(2) 3 -> layer 2 1 -> copy(3) 3 -> layer 3 1 -> copy(2) ...: an 8 ms cycle, layers 0 and 1
    hide under the wrapped copy. Graphed: each replay ends only when the wrapped copy of layer 2 is done,
    so layers 0 and 1 run in the next replay, after it: 2 + 1 + 3 + 1 + 3 = 10 ms, 6 of them stalled.
    """
    common = dict(layer_ms=(1.0,) * 4, head_ms=0.0, offloaded=(2, 3), copy_ms=(3.0, 3.0), prefetch_step=1)
    assert simulate(**common).step_ms == pytest.approx(8.0)
    graphed = simulate(**common, join_every_steps=1)
    assert graphed.step_ms == pytest.approx(10.0) and graphed.stall_ms == pytest.approx(6.0)


def test_a_copy_left_to_the_next_replay_runs_under_its_first_layers_by_hand():
    """The example above with layer 2's wrapped copy left to the next replay: issued as it begins, it runs
    under layers 0 and 1 (3 ms against 2), layer 2 runs 3-4, copy(3) 4-7, layer 3 7-8; nothing is joined at
    the end. 8 ms, as eagerly, where joining it cost 10."""
    common = dict(layer_ms=(1.0,) * 4, head_ms=0.0, offloaded=(2, 3), copy_ms=(3.0, 3.0), prefetch_step=1)
    left = simulate(**common, join_every_steps=1, replay_start_copies=1)
    assert left.step_ms == pytest.approx(8.0) and left.join_ms == 0.0 and left.stall_ms == pytest.approx(1.0 + 3.0)
    assert simulate_fastest_boundary(**common, join_every_steps=1) == (1, left)
    assert simulate_fastest_boundary(**common, join_every_steps=0)[0] == 0  # eagerly nothing is split


def test_the_fastest_boundary_keeps_the_join_when_it_hides_under_the_tail_by_hand():
    """4 layers of 1 ms, layers 0 and 2 through one slot, 3 ms copies. Joined: layer 0 0-1, copy(2) 1-4,
    layer 2 4-5, copy(0) 5-8 under layer 3 (5-6), replay ends at 8. Left to the next replay, layer 0 (the
    first layer) waits for it: copy(0) 0-3, layer 0 3-4, copy(2) 4-7, layer 2 7-8, layer 3 8-9."""
    common = dict(layer_ms=(1.0,) * 4, head_ms=0.0, offloaded=(0, 2), copy_ms=(3.0, 3.0), prefetch_step=1)
    assert simulate(**common, join_every_steps=1, replay_start_copies=1).step_ms == pytest.approx(9.0)
    count, simulation = simulate_fastest_boundary(**common, join_every_steps=1)
    assert count == 0 and simulation.step_ms == pytest.approx(8.0)


def test_replays_of_several_steps_join_once_per_replay_by_hand():
    """The example above with 4 steps per replay: 3 steps wrap as eagerly (8 ms); the replay's last waits 3 ms
    for the wrapped copy (11 ms) and the next step finds its copy done and saves 1 ms (7 ms): 34 ms per 4."""
    common = dict(layer_ms=(1.0,) * 4, head_ms=0.0, offloaded=(2, 3), copy_ms=(3.0, 3.0), prefetch_step=1)
    four = simulate(**common, join_every_steps=4)
    assert four.step_ms == pytest.approx(34.0 / 4) and four.join_ms == pytest.approx(3.0 / 4)
    assert simulate(**common, join_every_steps=2).step_ms == pytest.approx((11.0 + 7.0) / 2)


def test_graph_replays_expose_the_copy_after_the_last_reader():
    """Layers 1, 3, 5 through 2 slots: 1 and 5 share slot 0, 3 keeps slot 1 (never re-copied).

    Eager, layer 1's copy for the next step runs under layer 5's successors and the next head: 31 ms. Graphed,
    it can start only when layer 5, the last layer, is done, and the replay waits for it: 32 ms.
    """
    common = dict(layer_ms=(5.0,) * 6, head_ms=1.0, offloaded=(1, 3, 5), copy_ms=(1.0,) * 3, prefetch_step=2)
    assert simulate(**common).step_ms == pytest.approx(31.0)
    assert simulate(**common, join_every_steps=1).step_ms == pytest.approx(32.0)
