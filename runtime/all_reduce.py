"""``make --tp N --measure``: what one all-reduce costs between N local GPUs, timed through NCCL.

A bf16 all-reduce is timed at a small message (its latency) and a large one (its bandwidth); the planner draws
the line through both (planner.model.all_reduce.link_from_timings) and prices each layer's all-reduces of the
step's hidden states on it. Under torchrun (a process group of N ranks already up, as scripts/bench_tp.py runs)
every rank times it together in that group; otherwise N worker processes are spawned on GPUs 0..N-1 (one
process cannot be N NCCL ranks), and the figure is cached beside the layer times. Where fewer than N GPUs are
visible, or the plan's target is not the local GPU, the profile's link and the assumed latency stand, and the
plan says why.
"""

import hashlib
import json
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from planner.model.all_reduce import AllReduceLink, assumed_link, link_from_timings

#: message sizes timed: 4 KiB (all latency) and 64 MiB (all bandwidth: about 0.2 ms on NVLink)
MESSAGE_BYTES = (4 * 2**10, 64 * 2**20)
NUM_WARMUP = 5
#: all-reduces issued back to back per timing, and timings per size (the median is kept)
NUM_BACK_TO_BACK = 20
NUM_TIMED = 5


def time_all_reduces(message_bytes: tuple[int, ...] = MESSAGE_BYTES) -> tuple[tuple[int, float], ...]:
    """(bytes, ms of one all-reduce) for each size, over the default process group (every rank calls it; each
    figure is the slowest rank's). All-reduces run back to back, as a forward issues them between its kernels."""
    device = torch.device("cuda", torch.cuda.current_device())
    out = []
    for num_bytes in message_bytes:
        buffer = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device=device)
        for _ in range(NUM_WARMUP):
            dist.all_reduce(buffer)
        samples = []
        for _ in range(NUM_TIMED):
            dist.barrier()
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(NUM_BACK_TO_BACK):
                dist.all_reduce(buffer)
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end) / NUM_BACK_TO_BACK)
        slowest = torch.tensor([statistics.median(samples)], device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out.append((num_bytes, float(slowest.item())))
        del buffer
    return tuple(out)


def _worker(rank: int, world_size: int, init_file: str, result_file: str) -> None:
    """One spawned rank: join the group on GPU ``rank``, time the all-reduces, rank 0 writes them and what NCCL
    came to hold outside torch's allocator (the most of any rank)."""
    from runtime.outside_memory import outside_allocator_bytes

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.ones(1, device=device)  # the CUDA context and the fill kernel's module, before NCCL exists
    torch.cuda.synchronize(device)
    before_bytes = outside_allocator_bytes(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            device_id=device)
    try:
        timings = time_all_reduces()
        dist.barrier()
        torch.cuda.synchronize(device)
        grown = torch.tensor([outside_allocator_bytes(device) - before_bytes], device=device)
        dist.all_reduce(grown, op=dist.ReduceOp.MAX)
        if rank == 0:
            Path(result_file).write_text(json.dumps({"timings": timings, "nccl_bytes": int(grown.item())}))
    finally:
        dist.destroy_process_group()


def spawned_measurement(world_size: int) -> dict:
    """time_all_reduces over ``world_size`` processes spawned on GPUs 0..N-1 (seconds: each starts CUDA and NCCL),
    and the bytes NCCL held outside the allocator on a rank: {"timings": ..., "nccl_bytes": ...}."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="offload-plan-all-reduce-") as folder:
        init_file, result_file = str(Path(folder) / "init"), str(Path(folder) / "timings.json")
        mp.spawn(_worker, args=(world_size, init_file, result_file), nprocs=world_size, join=True)
        return json.loads(Path(result_file).read_text())


def _cache_key(world_size: int) -> str:
    identity = {"what": "all-reduce v2", "gpus": [torch.cuda.get_device_name(i) for i in range(world_size)],
                "torch": torch.__version__, "nccl": str(torch.cuda.nccl.version()), "sizes": MESSAGE_BYTES,
                "back_to_back": NUM_BACK_TO_BACK}
    return "all-reduce:" + hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def measured_all_reduce(world_size: int) -> tuple[tuple[tuple[int, float], ...], int | None]:
    """The all-reduce timings over ``world_size`` GPUs and NCCL's bytes outside the allocator on a rank: in the
    running process group when it has that many ranks (never cached: every rank must take part; NCCL's bytes are
    not measured there, the group having been up before), else spawned and cached."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size:
        return time_all_reduces(), None
    from runtime.measure import load_cache, save_cache

    key = _cache_key(world_size)
    cache = load_cache()
    if key not in cache:
        cache[key] = spawned_measurement(world_size)
        save_cache(cache)
    entry = cache[key]
    return tuple((int(size), float(ms)) for size, ms in entry["timings"]), entry.get("nccl_bytes")


def measured_link(tp: int, profile, measured_on: str | None) -> AllReduceLink:
    """The all-reduce between ``tp`` local GPUs, measured; the profile's link and the assumed latency, with why,
    where ``tp`` GPUs are not visible here or the plan is for another GPU than the local one."""
    from runtime.measure import CALIBRATED_SUFFIX, local_profile_name

    local = (measured_on or local_profile_name()).removesuffix(CALIBRATED_SUFFIX)
    if profile.name.removesuffix(CALIBRATED_SUFFIX) != local:
        return assumed_link(profile, tp, f"the GPUs here are {local}, the plan is for {profile.name}")
    visible = torch.cuda.device_count()
    if visible < tp:
        return assumed_link(profile, tp, f"{visible} GPU(s) visible here, fewer than the {tp} ranks")
    timings, nccl_bytes = measured_all_reduce(tp)
    described = ", ".join(f"{size} B in {1e3 * ms:.1f} us" for size, ms in timings)
    held = "" if nccl_bytes is None else f"; NCCL held {nccl_bytes / 2**20:.0f} MiB a rank outside the allocator"
    return link_from_timings(tp, timings, f"measured: NCCL all-reduce on {tp} x {torch.cuda.get_device_name()}, "
                                          f"torch {torch.__version__}: {described}{held}", nccl_bytes)
