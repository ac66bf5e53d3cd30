"""Host memory before loading: what is available (/proc/meminfo), and the memlock limit against what loading
page-locks, each a one-line refusal before anything is read.
"""

from pathlib import Path

from planner.errors import RuntimeUnavailableError
from planner.plan.schema import Plan
from planner.units import format_bytes

def check_memlock(pinned_bytes: int, limit_bytes: int | None) -> None:
    """Fail before reading anything when the memlock limit is below what will be page-locked: the layers are
    pinned as they land, so cudaHostRegister would refuse only after the resident reads (seconds, cold)."""
    if limit_bytes is not None and limit_bytes < pinned_bytes:
        raise RuntimeUnavailableError(
            f"loading page-locks {pinned_bytes} bytes ({format_bytes(pinned_bytes)}) of host memory but the memlock "
            f"limit is {limit_bytes} bytes ({format_bytes(limit_bytes)}): raise it (ulimit -l unlimited, docker "
            "--ulimit memlock=-1) or make a plan with a larger --budget, which pins less"
        )


def memlock_limit_bytes() -> int | None:
    """The soft RLIMIT_MEMLOCK that applies to this process, or None where none does: unlimited, or the process
    holds CAP_IPC_LOCK (root usually does), which lets it lock past the limit."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or _has_ipc_lock():
        return None
    return soft


def _has_ipc_lock() -> bool:
    """CAP_IPC_LOCK (capability 14) in the effective set, from /proc/self/status."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 14 & 1)
    except (OSError, ValueError):
        pass
    return False


def check_host_memory(plan: Plan, working_set_bytes: int, available_bytes: int | None) -> None:
    """The host must hold the plan's pinned bytes plus the loading working set."""
    pinned = plan.memory.host_pinned_bytes
    needed = pinned + working_set_bytes
    if available_bytes is not None and available_bytes < needed:
        raise RuntimeUnavailableError(
            f"loading needs {needed} bytes ({format_bytes(needed)}) of host memory: {format_bytes(pinned)} the plan "
            f"pins plus {format_bytes(working_set_bytes)} of loading buffers, but {available_bytes} bytes "
            f"({format_bytes(available_bytes)}) are available; make a plan with a larger --budget (pins less)"
        )


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is no such file."""
    return meminfo_bytes("MemAvailable")


def meminfo_bytes(key: str) -> int | None:
    """One /proc/meminfo figure in bytes (``MemTotal``, ``MemAvailable``), or None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
