"""runtime.run, the sequence of offload-plan run, on the CPU: the loading bar it is handed, and the record it
returns."""

import pytest

from runtime.backend import CpuStandIn
from tests.runtime_models import plan_with

pytest.importorskip("transformers")


def test_the_cli_progress_bar_counts_bytes_from_reader_threads(checkpoints, monkeypatch):
    """run's bar (offload_plan.commands.run._loading_bar, handed to runtime.run) takes the loader's byte counts,
    from several threads."""
    import runtime.run
    from offload_plan.commands.run import _loading_bar
    from runtime.load import stream_model

    folder = checkpoints("llama")
    plan = plan_with(folder, 3, 2, 1)
    counted = []

    def load(plan, progress, source):
        def on_bytes(num_bytes):
            counted.append(num_bytes)
            progress(num_bytes)
        return stream_model(folder, plan, CpuStandIn(), on_bytes=on_bytes)

    monkeypatch.setattr(runtime.run, "load_with_plan", load)
    model, _ = runtime.run._load(plan, None, _loading_bar)
    assert sum(counted) == plan.model.total_bytes


def test_a_bench_result_gives_its_json_with_what_the_stack_held_before_loading():
    from types import SimpleNamespace

    from runtime.run import RunResult

    measured = SimpleNamespace(as_dict=lambda: {"step_ms": 1.5})
    result = RunResult(kind="workload", measured=measured, start_outside_allocator_bytes=512)
    assert result.json_data() == {"step_ms": 1.5, "start_outside_allocator_bytes": 512}


def test_a_tp_result_gives_each_ranks_json_and_other_ranks_give_none():
    from types import SimpleNamespace

    from runtime.run import RunResult

    rows = tuple(SimpleNamespace(as_dict=lambda rank=rank: {"rank": rank}) for rank in (0, 1))
    assert RunResult(kind="rank serving", measured=rows).json_data() == [{"rank": 0}, {"rank": 1}]
    assert RunResult(kind="other rank").measured is None


def test_an_unknown_kind_is_refused():
    from runtime.run import RunResult

    with pytest.raises(ValueError, match="kind 'bench'"):
        RunResult(kind="bench")
