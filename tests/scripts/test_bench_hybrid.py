"""scripts/bench_hybrid.py's arithmetic (no GPU): the budget scaled to a cut model, and its table's verdicts."""

import dataclasses
import os

import pytest

from scripts import bench_hybrid
from scripts.conformance import MODELS, config_dict

GiB = 2**30


def test_the_cut_budget_leaves_the_releases_share_of_expert_bytes_on_the_host():
    model = dataclasses.replace(MODELS["qwen3-moe"], num_layers=8)
    full = dataclasses.replace(model, num_layers=48)
    full_total, full_experts = bench_hybrid.bytes_split(config_dict(full, tiny=False))
    total, experts = bench_hybrid.bytes_split(config_dict(model, tiny=False))
    budget = bench_hybrid.scaled_budget(model, 24 * GiB, 48)
    left_share = (full_total - 24 * GiB) / full_experts
    assert (total - budget) / experts == pytest.approx(left_share, rel=1e-6)
    assert 0 < budget < total and experts < total
    assert bench_hybrid.scaled_budget(model, 1000 * GiB, 48) == total  # a release that fits leaves nothing out


def _row(arm: str, ms: float | None, predicted: float | None = None, sequences: int = 1) -> dict:
    bench = None if ms is None else {"step_ms": ms, "predicted_step_ms": predicted}
    return {"model": "m", "sequences": sequences, "arm": arm, "bench": bench}


def test_the_table_prices_the_choice_against_the_other_arms_not_the_resident_reference():
    rows = [_row("resident", 2.0), _row("choice", 10.0, 9.0), _row("fetch", 12.0, 11.0), _row("whole", 11.0)]
    table = bench_hybrid.table(rows)
    assert "| m | 1 | choice / fetch-only speed | 1.200x |" in table
    assert "| m | 1 | choice regret | 1.000 |" in table
    assert "| m | 1 | choice | 10.000 | 9.000 | -10.0% |" in table
    slower = bench_hybrid.table([_row("choice", 12.0), _row("fetch", 10.0), _row("whole", None)])
    assert "choice regret | 1.200 |" in slower and "| m | 1 | whole | - | - | - |" in slower
    assert "fixed CPU ids" not in table
    with_fixed = bench_hybrid.table(rows + [_row("fixed", 11.5)])
    assert "| m | 1 | choice / fixed CPU ids speed | 1.150x |" in with_fixed


def test_repeated_benches_are_priced_by_their_median():
    choice, fetch = _row("choice", 10.0, 9.0), _row("fetch", 12.0, 11.0)
    choice["step_ms_repeats"] = [10.0, 9.0, 30.0]  # one slow run does not move the median
    fetch["step_ms_repeats"] = [12.0, None, 11.0]  # a failed repeat is left out
    assert bench_hybrid.step_ms(choice) == (10.0, 9.0) and bench_hybrid.step_ms(fetch) == (11.5, 11.0)
    table = bench_hybrid.table([choice, fetch])
    assert "| m | 1 | choice | 10.000 (9.00-30.00, 3 runs) | 9.000 | -10.0% |" in table
    assert "| m | 1 | choice / fetch-only speed | 1.150x |" in table


def test_the_table_shows_the_cpus_host_ms_beside_the_plans():
    choice = _row("choice", 10.0, 9.0)
    choice["cpu_experts"] = 34
    choice["bench"]["routed"] = {"cpu": {"pairs_per_step": 16.5, "host_ms_per_step": 4.5,
                                         "planned_cpu_ms_per_step": 6.0856}}
    assert "| 34 (16.5 pairs, host 4.50 ms a step, planned 6.086) |" in bench_hybrid.table([choice])
    choice["bench"]["routed"]["cpu"] |= {"experts_per_step": 15.1, "planned_experts_per_step": 14.75}
    assert "| 34 (16.5 pairs, 15.1 experts (14.8 planned), host 4.50 ms a step, planned 6.086) |" in \
        bench_hybrid.table([choice])


def test_the_table_sets_both_arms_against_the_fetch_only_floor():
    """The floor is what the fetch-only arm's steps touched of the non-resident experts (wasted prefetches left
    out) over the copy engine, or the all-resident step where longer; each arm is put over it."""
    fetch = _row("fetch", 12.0, 11.0)
    fetch["bench"]["routed"] = {"bytes_per_step_by_kind": {"prefetched": 200e6, "wasted": 300e6, "missed": 220e6,
                                                           "unpredicted": 30e6}}
    rows = [_row("resident", 2.0), _row("choice", 8.0, 8.1), fetch]
    assert bench_hybrid.routed_floor_ms(fetch, 50e9, 2.0) == pytest.approx(9.0)
    assert bench_hybrid.routed_floor_ms(fetch, 50e9, 20.0) == 20.0
    assert bench_hybrid.routed_floor_ms(_row("fetch", 12.0), 50e9, None) is None
    table = bench_hybrid.table(rows, 50e9)
    assert "| m | 1 | fetch-only floor (touched routed bytes / copy engine, or all-resident) | 9.000 |" in table
    assert "| m | 1 | fetch-only over the floor (floor / step) | 0.750 |" in table
    assert "| m | 1 | choice over the floor (floor / step; above 1: under the floor) | 1.125 |" in table
    assert "floor" not in bench_hybrid.table(rows)


def test_the_host_arm_takes_the_scale_the_choice_arms_run_counted():
    """The ``host`` arm is the choice made again with --cpu-time-scale at the scale run --bench counted for the
    choice arm's CPU at the same sequence count; none where that run had no CPU experts; the table prices the
    choice against it."""
    choice = _row("choice", 11.6, 8.7)
    choice["bench"]["routed"] = {"cpu": {"pairs_per_step": 16.6, "host_ms_per_step": 8.46,
                                         "planned_cpu_ms_per_step": 5.12, "cpu_time_scale": 1.69}}
    fetch = _row("fetch", 12.8, 11.7)
    assert bench_hybrid.host_cpu_time_scale([choice, fetch], "m", 1) == 1.69
    assert bench_hybrid.host_cpu_time_scale([choice, fetch], "m", 4) is None
    assert bench_hybrid.host_cpu_time_scale([fetch], "m", 1) is None
    assert bench_hybrid.ARMS["host"] == [] and list(bench_hybrid.ARMS).index("host") > list(bench_hybrid.ARMS).index(
        "choice")
    table = bench_hybrid.table([choice, fetch, _row("host", 9.8, 9.78)])
    assert "| m | 1 | choice / made again for the host's CPU speed | 0.845x |" in table


def test_the_planned_arm_runs_with_the_resplit_off_and_puts_the_environment_back(monkeypatch):
    from scripts.bench_hybrid import ARMS, arm_env

    monkeypatch.delenv("OFFLOAD_PLAN_CPU_RESPLIT", raising=False)
    assert ARMS["planned"] == ARMS["choice"]
    with arm_env("planned"):
        assert os.environ["OFFLOAD_PLAN_CPU_RESPLIT"] == "off"
    assert "OFFLOAD_PLAN_CPU_RESPLIT" not in os.environ
    monkeypatch.setenv("OFFLOAD_PLAN_CPU_RESPLIT", "on")
    with arm_env("planned"), arm_env("choice"):
        assert os.environ["OFFLOAD_PLAN_CPU_RESPLIT"] == "off"
    assert os.environ["OFFLOAD_PLAN_CPU_RESPLIT"] == "on"
