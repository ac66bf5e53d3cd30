"""One command, one read: ``run`` (the load that --bench and --prompt share) and ``make --measure`` parse each
safetensors header once, read config.json once in the planner, and resolve the checkpoint path once; the
loader takes the parsed record (runtime.load.LoadSource) instead of reading again, and the transformers config
is built from that record's mapping (runtime.skeleton.transformers_config), not from the file. Counted here by
wrapping the readers and by the interpreter's audit hook on every file open, so a second read anywhere fails."""

import sys
from collections import Counter
from pathlib import Path

import pytest

from runtime.backend import CpuStandIn
from tests.conftest import invoke
from tests.runtime_models import plan_with, save_tiny_llama, write_plan

#: the counter the audit hook adds to while a test holds it (hooks cannot be removed, so it stays installed)
_OPENS: list[Counter] = []


def _count_opens(event: str, args: tuple) -> None:
    if event == "open" and _OPENS and isinstance(args[0], (str, bytes, Path)):
        _OPENS[-1][Path(args[0] if not isinstance(args[0], bytes) else args[0].decode()).name] += 1


sys.addaudithook(_count_opens)


@pytest.fixture
def counted(monkeypatch):
    """Counts, by key: header reads per file name, config.json parses by the planner, the path's resolution, and
    (under "opens") every open of a file by its name."""
    import planner.source.checkpoint
    import planner.source.safetensors_header
    import runtime.load
    import runtime.load_source

    counts: Counter = Counter()

    def wrap(module, name: str, key) -> None:
        original = getattr(module, name)

        def counting(*args, **kwargs):
            counts[key(*args) if callable(key) else key] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)

    for module in (planner.source.safetensors_header, planner.source.checkpoint):  # every binding of the header reader
        wrap(module, "read_header_bytes", lambda path: ("header", Path(path).name))
    wrap(planner.source.checkpoint, "_read_config", "config.json parses")
    # the path's resolution, in its two steps: a plan's source from the plan's folder, then a hub id to its
    # snapshot (a path as it is)
    wrap(planner.source.checkpoint, "resolve_local_source", "from the plan's folder")
    wrap(runtime.load_source, "resolve_local_source", "from the plan's folder")
    wrap(runtime.load_source, "local_weights", "to a local folder")
    for module in (runtime.load_source, runtime.load):  # open_source's read, and stream_model's when not handed one
        wrap(module, "load_checkpoint", "checkpoint reads")
    opens = Counter()
    _OPENS.append(opens)
    counts["opens"] = opens
    yield counts
    _OPENS.remove(opens)


@pytest.fixture
def sharded(tmp_path_factory) -> Path:
    folder = save_tiny_llama(tmp_path_factory.mktemp("reads") / "ckpt")
    assert len(list(folder.glob("*.safetensors"))) > 1  # the counts are per shard
    return folder


def _reset(counts: Counter) -> None:
    """Forget what the test's setup read (making its plan reads the checkpoint too)."""
    opens = counts["opens"]
    opens.clear()
    counts.clear()
    counts["opens"] = opens


def _shards(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.glob("*.safetensors"))


def _on_the_cpu(monkeypatch) -> None:
    """run's load with its GPU calls stood in for by the CPU stand-in (same files read, same order)."""
    import torch

    import runtime.load as load
    import runtime.run

    monkeypatch.setattr(runtime.run, "require_cuda", lambda what: torch.device("cpu"))
    monkeypatch.setattr(runtime.run, "check_stack_fits", lambda plan, device, **_: 0)
    monkeypatch.setattr(runtime.run, "cap_gpu_memory", lambda limit_bytes, device, booked_outside_bytes: None)
    monkeypatch.setattr(load, "require_cuda", lambda what="": torch.device("cpu"))
    monkeypatch.setattr(load, "CudaBackend", lambda device: CpuStandIn())
    monkeypatch.setattr(load, "check_memory", lambda plan, device, working_set_bytes: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_run_reads_each_header_once_and_resolves_the_path_once(sharded, tmp_path, monkeypatch, counted):
    """run PLAN --bench from another directory: the relative source resolved once, each shard's header parsed
    once and the shard opened twice in all (its header, then one descriptor for its data)."""
    import runtime.run

    plan_path = write_plan(plan_with(sharded, 3, 2, 1), tmp_path / "plan.yaml")
    loads = []

    class Result:
        def as_dict(self) -> dict:
            return {}

    def bench(loaded, *, cuda_graph, compile_backend):
        loads.append(loaded)
        return Result()

    _on_the_cpu(monkeypatch)
    monkeypatch.setattr(runtime.run, "run_bench", bench)
    _reset(counted)
    result = invoke(["run", plan_path, "--bench", "--json"])
    assert result.exit_code == 0, result.stderr
    shards = _shards(sharded)
    assert {name: counted[("header", name)] for name in shards} == dict.fromkeys(shards, 1)
    assert {name: counted["opens"][name] for name in shards} == dict.fromkeys(shards, 2)
    assert counted["from the plan's folder"] == counted["to a local folder"] == counted["checkpoint reads"] == 1
    assert counted["config.json parses"] == 1 and counted["opens"]["config.json"] == 1
    assert loads[0].source.folder == sharded  # --prompt's tokenizer is read from the same folder


def test_the_loader_reads_no_header_when_handed_the_checkpoint(sharded, counted):
    """stream_model given LoadSource's checkpoint parses nothing again (fails on a second read)."""
    from runtime.load import stream_model
    from runtime.load_source import open_source

    plan = plan_with(sharded, 3, 2, 1)
    source = open_source(plan, str(sharded))
    _reset(counted)
    stream_model(source.folder, plan, CpuStandIn(), checkpoint=source.checkpoint)
    assert not [key for key in counted if isinstance(key, tuple)], counted
    assert counted["config.json parses"] == 0 and counted["opens"]["config.json"] == 0


def test_make_measure_reads_each_header_and_config_once(sharded, tmp_path, monkeypatch, counted):
    """make --measure: the checkpoint read once, the measuring function handed its record."""
    from offload_plan import runtime_seam
    from planner.model.cost import ComputeTimes

    seen = []

    def measure(checkpoint, layout, workload, profile, measured_on, graphed):
        seen.append(checkpoint)
        return ComputeTimes(layer_ms=(0.1,) * len(layout.layers), head_ms=0.1, source="measured: a stand-in")

    monkeypatch.setattr(runtime_seam, "measured_compute", measure)
    monkeypatch.setattr(runtime_seam, "measured_context_bytes", lambda gpu, measured_on: None)
    monkeypatch.chdir(tmp_path)
    _reset(counted)
    result = invoke(["make", "-m", sharded, "-g", "h100-sxm", "--budget", "1GiB", "--measure",
                     "--measured-on", "h100-sxm", "-o", "plan.yaml"])
    assert result.exit_code == 0, result.stderr
    shards = _shards(sharded)
    assert {name: counted[("header", name)] for name in shards} == dict.fromkeys(shards, 1)
    assert {name: counted["opens"][name] for name in shards} == dict.fromkeys(shards, 1)
    assert counted["config.json parses"] == 1 and counted["opens"]["config.json"] == 1
    assert len(seen) == 1
