"""runtime.host_memory: the host must hold what the plan pins plus the loader's bounded working set, and the memlock
limit what loading page-locks, each refused in one line before anything is read."""

import pytest

from planner.errors import RuntimeUnavailableError
from runtime.host_memory import check_host_memory
from tests.runtime_models import plan_with, skeleton

pytest.importorskip("transformers")


def test_host_memory_check_counts_pinned_bytes_and_working_set_not_the_checkpoint(checkpoints):
    from runtime.checkpoint_reader import checkpoint_files, read_sources
    from runtime.load import loading_working_set_bytes
    from runtime.skeleton import plan_reads
    from runtime.stream_load import NUM_READERS, STAGING_BYTES

    folder = checkpoints("moe")
    plan = plan_with(folder, 1, 1, 2)
    files = checkpoint_files(folder)
    work = plan_reads(skeleton(folder), read_sources(files))
    working_set = loading_working_set_bytes(work)
    # the hub's per-expert tensors are read straight into the fused params: no conversion holds host memory
    assert not work.converted and work.sliced
    assert working_set == (NUM_READERS + 1) * STAGING_BYTES
    needed = plan.memory.host_pinned_bytes + working_set
    check_host_memory(plan, working_set, needed)
    with pytest.raises(RuntimeUnavailableError) as error:
        check_host_memory(plan, working_set, needed - 1)
    message = str(error.value)
    assert f"loading needs {needed} bytes" in message and f"but {needed - 1} bytes" in message


def test_a_memlock_limit_below_the_pinned_bytes_fails_before_loading():
    """Layers are pinned as they land, so a refusal by cudaHostRegister would come late: run checks first."""
    from planner.errors import RuntimeUnavailableError
    from runtime.host_memory import check_memlock

    check_memlock(10 << 30, None)  # unlimited, or CAP_IPC_LOCK
    check_memlock(10 << 30, 10 << 30)
    with pytest.raises(RuntimeUnavailableError, match=r"memlock limit is 65536 bytes .*ulimit -l unlimited") as error:
        check_memlock(10 << 30, 65536)
    assert "\n" not in str(error.value)
