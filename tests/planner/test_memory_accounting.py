"""make holds a plan's pinned bytes to the host: the serving search moves to a concurrency whose placement the
host holds (auto never fails where a narrower range succeeds), and a plan with no host figure says so once."""

from pathlib import Path

import pytest

from planner.errors import InfeasibleError
from planner.make.make_plan import make_plan
from planner.plan.schema import Inputs
from tests.conftest import TEST_GPU_FILE, invoke, make_checkpoint
from tests.plan_cli import cli_make

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def qwen3_14b(tmp_path_factory):
    from runtime.header_checkpoint import write_header_checkpoint

    folder = tmp_path_factory.mktemp("q14") / "qwen3-14b"
    write_header_checkpoint(REPO / "examples/qwen3-14b/config.json", folder)
    return folder


def _serve(folder: Path, concurrency: str, host_memory: str | None):
    inputs = Inputs(model=str(folder), revision=None, gpu="h100-sxm", budget=None, trigger=None, tokens=1,
                    sequences=1, context=4096, params=(), stack=None, group_size=None, num_in_group=None,
                    prefetch_step=None, cuda_graph=True, concurrency=concurrency, gpu_memory="16GiB",
                    host_memory=host_memory)
    return make_plan(inputs)


def test_auto_moves_to_a_concurrency_the_host_holds(qwen3_14b):
    unbounded = _serve(qwen3_14b, "auto", None)
    pinned = unbounded.plan.memory.host_pinned_bytes
    assert any(w.startswith("host memory not checked") for w in unbounded.warnings)
    limit = pinned - 3 * 10**9  # the unbounded pick does not fit this host
    bounded = _serve(qwen3_14b, "auto", f"{limit}B")
    assert bounded.plan.memory.host_pinned_bytes <= limit
    assert bounded.plan.workload.concurrency < unbounded.plan.workload.concurrency
    assert not any(w.startswith("host memory not checked") for w in bounded.warnings)
    # the same concurrency asked for explicitly is planned the same way: auto is no stricter than a range
    explicit = _serve(qwen3_14b, str(bounded.plan.workload.concurrency), f"{limit}B")
    assert explicit.plan.memory.host_pinned_bytes <= limit


def test_a_host_that_holds_no_placement_is_one_line_naming_the_least_it_needs(qwen3_14b):
    with pytest.raises(InfeasibleError) as error:
        _serve(qwen3_14b, "auto", "5GB")
    message = str(error.value)
    assert "--host-memory allows" in message and "\n" not in message and len(message) <= 300


def test_grace_profiles_check_host_memory(workdir, test_gpu):
    """Pinned params must fit the host memory: from the profile (Grace superchips have one figure) or
    --host-memory, recorded in the plan and in its regenerating command."""
    make_checkpoint(workdir / "ckpt", num_layers=8, num_shards=3)
    plan = cli_make(["--gpu", test_gpu, "--budget", "500KB", "--host-memory", "1MB"])
    assert plan["hardware"]["host_memory_bytes"] == 1_000_000 and plan["inputs"]["host_memory"] == "1MB"
    assert "--host-memory 1MB" in (workdir / "plan.yaml").read_text().splitlines()[1]
    free = cli_make(["--gpu", test_gpu, "--budget", "500KB"], output="free.yaml")
    assert free["hardware"]["host_memory_bytes"] is None
    (workdir / "small-host.yaml").write_text(
        TEST_GPU_FILE.read_text() + "host_memory_bytes:\n  value: 50000\n  source: assumed\n  note: a tiny host\n")
    result = invoke(["make", "--model", "ckpt", "--gpu", "small-host.yaml", "--budget", "500KB"])
    assert result.exit_code == 5 and "the small-host.yaml profile allows 50000 bytes" in result.stderr


#: (arm, the plan's estimated decode step, the fill step's reserved growth, the capture's beyond it), bytes: the H100
#: sweeps of 2026-11-28 (benchmarks/2026-11-28-conformance-*h100.json). The capture's growth includes the warm-up
#: stream's 32 MiB cuBLAS workspace where the process had none yet (every arm but Mistral's 7 sequences)
CAPTURES = [
    ("mistral-sw/serving-auto/tight (7 sequences)", 478_643_120, 469_762_048, 4_194_304),
    ("mistral-sw/serving-4", 273_945_577, 268_435_456, 37_748_736),
    ("qwen2-moe/serving-auto (10 sequences)", 3_085_714, 20_971_520, 60_817_408),
    ("olmoe/serving-1", 171_429, 0, 37_748_736),
]


@pytest.mark.parametrize("arm, decode_bytes, fill_growth_bytes, capture_growth_bytes", CAPTURES)
def test_graph_pool_covers_the_measured_capture_without_booking_the_step_twice(arm, decode_bytes, fill_growth_bytes,
                                                                              capture_growth_bytes):
    """The booking holds what the capture grew the reserved peak by, and stays within 200 MB of the most the
    captured step can hold (the capture starts from the cache alone: the fill's growth and the capture's)."""
    from planner.model.memory_accounting import graph_pool_bytes

    booked = graph_pool_bytes(decode_bytes)
    assert booked >= capture_growth_bytes, arm
    assert booked - (fill_growth_bytes + capture_growth_bytes) < 200e6, arm
