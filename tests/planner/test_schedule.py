"""planner.search.schedule.PrefetchSchedule: the slot of each offloaded position, the reader its copy waits for, the
order copies issue in and the positions copied again, against tables computed by hand (the simulator holds the
slots to them: tests/planner/test_simulate.py)."""

import pytest

from planner.search.schedule import PrefetchSchedule


# ---- depth not dividing the number offloaded -------------------------------------------------------------------------


def test_schedule_tables_n5_p2():
    schedule = PrefetchSchedule(5, 2)
    assert schedule.num_slots == 2 and schedule.recopies
    assert [schedule.slot_of(k) for k in range(5)] == [0, 1, 0, 1, 0]
    # slot 0 holds positions 0, 2, 4: position 0's previous reader is position 4 of the previous step
    assert [schedule.previous_reader(k) for k in range(5)] == [(1, 4), (1, 3), (0, 0), (0, 1), (0, 2)]
    # vLLM would copy 0 after position 3 (while 4 still needs slot 0); here 0 and 1 both wait for 4
    assert schedule.issue_after() == ((2,), (3,), (4,), (), (0, 1))


def test_schedule_tables_n4_p2():
    schedule = PrefetchSchedule(4, 2)
    assert [schedule.slot_of(k) for k in range(4)] == [0, 1, 0, 1]
    assert [schedule.previous_reader(k) for k in range(4)] == [(1, 2), (1, 3), (0, 0), (0, 1)]
    assert schedule.issue_after() == ((2,), (3,), (0,), (1,))


def test_schedule_tables_n3_p1_and_n7_p3():
    assert PrefetchSchedule(3, 1).issue_after() == ((1,), (2,), (0,))
    assert [PrefetchSchedule(3, 1).previous_reader(k) for k in range(3)] == [(1, 2), (0, 0), (0, 1)]
    # N=7, S=3: slots 0,1,2,0,1,2,0; position 0 waits for 6, 1 for 4, 2 for 5; FIFO keeps 1 and 2 behind 0.
    schedule = PrefetchSchedule(7, 3)
    assert [schedule.previous_reader(k) for k in range(3)] == [(1, 6), (1, 4), (1, 5)]
    assert schedule.issue_after() == ((3,), (4,), (5,), (6,), (), (), (0, 1, 2))


@pytest.mark.parametrize("n, p", [(2, 1), (4, 2), (6, 3), (6, 2), (8, 4), (9, 3)])
def test_issue_after_is_vllms_rule_when_depth_divides(n, p):
    """vLLM issues the copy of (k + P) mod N after position k; that is right when P divides N."""
    assert PrefetchSchedule(n, p).issue_after() == tuple(((k + p) % n,) for k in range(n))


def test_copied_positions_match_needs_copy():
    for num_offloaded in range(0, 13):
        for depth in range(1, 14):
            schedule = PrefetchSchedule(num_offloaded, depth)
            expected = [k for k in range(num_offloaded) if schedule.needs_copy(k)]
            assert list(schedule.copied_positions()) == expected
