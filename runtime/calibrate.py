"""``calibrate``: measure the local GPU and write a profile whose figures are readings, not datasheets.

Host-to-device: copies from page-locked memory registered the way the runtime registers it, 1 MiB to 1 GiB
in doublings, each size queued back to back on the copy stream (2 GiB a timing) as the runtime queues layer
copies, so the time per copy is what a steady stream of them costs; a line through (bytes, time) of the
layer-sized ones (16 MiB and up) gives the bandwidth (slope) and the fixed cost per copy (intercept). The line
is fitted to relative error, so every size counts alike: an ordinary least-squares fit is decided by the two
largest copies alone, and small copies (whose rate does not follow a line) pulled the slope 6% under the rate
layer copies reach on the lent H100. HBM: a 2 GiB device-to-device copy, bytes read plus written. Matmul: an
8192^3 bf16 product on random data. FP8: a layer-sized FP8 weight dequantized as run's FP8 linears do before
each matmul (the profile's fp8_dequant_bytes_per_s). Memory: what the driver reports; host memory: the host's
MemTotal; the CUDA context figure: what the process holds outside torch's allocator once a decoder step's kernel
families ran (runtime.outside_memory's probe); where two GPUs or more are visible, NCCL's buffers on a rank of a
group of them (nccl_figure). The host CPU's expert rate (the profile's cpu_experts section): a
Qwen3-30B-A3B-shaped SwiGLU expert at 1 to 32 tokens in bf16 and fp32 with the CPU experts' threads
(runtime.cpu_experts.default_cpu_threads), the faster dtype kept (runtime.cpu_experts.cpu_experts_profile), and a
layer's handoff to the CPU and back (measure_handoff_ms). The layer floor (the profile's layer_floor section):
tiny dense and MoE layers timed as make --measure times layers (runtime.layer_floor). Every timing is a median.
"""

import datetime
import statistics
from dataclasses import replace

import torch

from planner.errors import OffloadPlanError
from planner.source.profile import Figure, HardwareProfile, load_profile, profile_to_dict
from runtime.backend import CudaBackend
from runtime.cpu_experts import HostExperts, cpu_experts_profile
from runtime.cpu_handoff import CpuExperts, CpuLayer
from runtime.graph import warm_up_stream
from runtime.host_memory import meminfo_bytes
from runtime.layer_floor import measured_layer_floor
from runtime.measure import CALIBRATED_SUFFIX, local_profile_name
from runtime.outside_memory import probe_outside_allocator_bytes

COPY_SIZES_BYTES = tuple(2**e for e in range(20, 31))
#: the line is fitted to layer-sized copies; smaller ones are reported (their rate falls off a line's shape)
FIT_FROM_BYTES = 2**24
NUM_REPEATS = 7
#: each timing queues copies of one size back to back until this many bytes, as the runtime queues layers
STREAM_BYTES = 2**31


def median_event_ms(run, repeats: int = NUM_REPEATS, warmups: int = 1) -> float:
    """Median of ``repeats`` timings of ``run()`` with CUDA events (on the current stream, synchronized after
    each), after ``warmups`` untimed calls."""
    for _ in range(warmups):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def h2d_line() -> tuple[float, float, list[tuple[int, float]]]:
    """(bytes/s, fixed us per copy, [(bytes, ms)]) for pinned host-to-device copies on a side stream."""
    backend = CudaBackend(torch.device("cuda"))
    largest = max(COPY_SIZES_BYTES)
    # Register before filling: registration faults every page in from this thread. Filled first, random_()'s
    # worker threads would first-touch pages on every NUMA node. On two of three lent H100 hosts the old order
    # measured 47-50 GB/s while the runtime's layer copies reached 52-54 GB/s. Registered first, it read 54.0
    # and 54.6 GB/s on the next two hosts, whose single large copies reached 54.7 and 54.3.
    host = backend.pin(torch.empty(largest, dtype=torch.uint8))
    host.random_(0, 255)
    device = torch.empty(largest, dtype=torch.uint8, device="cuda")
    points = []
    with torch.cuda.stream(backend.copy_stream):
        for num_bytes in COPY_SIZES_BYTES:
            count = max(2, STREAM_BYTES // num_bytes)

            def queue(num_bytes=num_bytes, count=count):
                for _ in range(count):
                    device[:num_bytes].copy_(host[:num_bytes], non_blocking=True)

            points.append((num_bytes, median_event_ms(queue) / count))
    backend.unpin(host)
    slope_ms_per_byte, intercept_ms = _fit_line([p for p in points if p[0] >= FIT_FROM_BYTES])
    return 1e3 / slope_ms_per_byte, max(0.0, intercept_ms * 1e3), points


def _fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Slope and intercept of time against bytes, least squares on relative error (weights 1 / time^2)."""
    weights = [1 / y**2 for _, y in points]
    total = sum(weights)
    mean_x = sum(w * x for w, (x, _) in zip(weights, points)) / total
    mean_y = sum(w * y for w, (_, y) in zip(weights, points)) / total
    slope = (sum(w * (x - mean_x) * (y - mean_y) for w, (x, y) in zip(weights, points))
             / sum(w * (x - mean_x) ** 2 for w, (x, _) in zip(weights, points)))
    return slope, mean_y - slope * mean_x


def hbm_bytes_per_s() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read and written."""
    source = torch.empty(2**31, dtype=torch.uint8, device="cuda").random_(0, 255)
    target = torch.empty_like(source)
    ms = median_event_ms(lambda: target.copy_(source))
    return 2 * source.numel() / (ms / 1e3)


def bf16_flops_per_s(size: int = 8192) -> float:
    """An n^3 bf16 matrix product on random data."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    ms = median_event_ms(lambda: a @ b)
    return 2 * size**3 / (ms / 1e3)


#: the weight calibrate dequantizes: one MLP projection of a 7B model ([out, in] 14336 x 4096), 128 x 128 blocks
FP8_WEIGHT_SHAPE = (14336, 4096)
FP8_BLOCK = (128, 128)


def fp8_dequant_bytes_per_s() -> float:
    """HBM bytes per second of the passes run's FP8 linears make before each bf16 matmul
    (runtime.quantized.dequantize_fp8) over a layer-sized weight, counted as the planner prices them
    (planner.model.fp8_cost: the bytes beyond the matmul's read)."""
    from planner.model.fp8_cost import DEQUANTIZED
    from runtime.quantized import dequantize_fp8

    rows, cols = FP8_WEIGHT_SHAPE
    weight = torch.randn(rows, cols, device="cuda").to(torch.float8_e4m3fn)
    scale = torch.rand(rows // FP8_BLOCK[0], cols // FP8_BLOCK[1], device="cuda") + 0.5
    ms = median_event_ms(lambda: dequantize_fp8(weight, scale, FP8_BLOCK, torch.bfloat16))
    bytes_per_weight = DEQUANTIZED.hbm_bytes_per_fp8_byte - DEQUANTIZED.matmul_bytes_per_fp8_byte
    return bytes_per_weight * weight.numel() / (ms / 1e3)


def calibrate() -> tuple[HardwareProfile, dict]:
    """Measure this GPU; figures that cannot be measured come from its built-in profile, marked as such."""
    base = load_profile(local_profile_name())
    gpu = torch.cuda.get_device_name()
    stamp = f"calibrated on {gpu}, {datetime.date.today()}, torch {torch.__version__}"
    h2d, overhead_us, points = h2d_line()
    hbm = hbm_bytes_per_s()
    matmul = bf16_flops_per_s()
    free_bytes, total_bytes = torch.cuda.mem_get_info()
    context_bytes = probe_outside_allocator_bytes(torch.device("cuda", torch.cuda.current_device()))
    measured = {
        "gpu_memory_bytes": Figure(value=total_bytes, source="measured", note=f"cudaMemGetInfo total; {stamp}"),
        "hbm_bytes_per_s": Figure(value=hbm, source="measured",
                                  note=f"2 GiB device-to-device copy, read + written; {stamp}"),
        "bf16_flops_per_s": Figure(value=matmul, source="measured", note=f"8192^3 bf16 matmul, random data; {stamp}"),
        "h2d_bytes_per_s": Figure(value=h2d, source="measured",
                                  note=f"slope of back-to-back pinned H2D copies 16 MiB..1 GiB on a side stream, "
                                       f"fitted to relative error; {stamp}"),
        "copy_overhead_us": Figure(value=overhead_us, source="measured",
                                   note=f"intercept of the same line; {stamp}"),
        "fp8_dequant_bytes_per_s": Figure(
            value=fp8_dequant_bytes_per_s(), source="measured",
            note=f"FP8 weight {FP8_WEIGHT_SHAPE[0]}x{FP8_WEIGHT_SHAPE[1]} widened and scaled by its "
                 f"{FP8_BLOCK[0]}x{FP8_BLOCK[1]} block scales into bf16 as run's FP8 linears do, 7 bytes a weight; "
                 f"{stamp}"),
        "cuda_context_bytes": Figure(value=context_bytes, source="measured",
                                     note=f"held outside torch's allocator once a decoder step's kernels ran "
                                          f"(runtime.outside_memory's probe); {stamp}"),
    }
    host_bytes = meminfo_bytes("MemTotal")
    if host_bytes is not None:
        measured["host_memory_bytes"] = Figure(
            value=host_bytes, source="measured",
            note=f"MemTotal of this host, shared with the OS and with any other GPU of the host; {stamp}")
    nccl = nccl_figure(stamp)
    if nccl is not None:
        measured["nccl_bytes"] = nccl
    # the NVLink figure make --tp prices all-reduces with (make --tp N --measure times them on the local GPUs)
    fields = {key: getattr(base, key) for key in ("fp8_flops_per_s", "trigger", "reserve_bytes",
                                                  "gpu_link_bytes_per_s")}
    if host_bytes is None:
        fields["host_memory_bytes"] = base.host_memory_bytes
    fields["compute_efficiency"] = restated_efficiency(base, matmul)
    cpu_experts, cpu_tables = cpu_experts_profile(stamp=stamp)
    cpu_experts = with_measured_handoff(cpu_experts, torch.device("cuda", torch.cuda.current_device()))
    profile = HardwareProfile(name=base.name + CALIBRATED_SUFFIX, description=f"{base.description}; {stamp}",
                              **measured, **fields, cpu_experts=cpu_experts,
                              layer_floor=measured_layer_floor(stamp))
    return profile, {"h2d_points_bytes_ms": points, "free_bytes": free_bytes, "cpu_experts_ms": cpu_tables}


def nccl_figure(stamp: str) -> Figure | None:
    """What NCCL holds outside torch's allocator on a rank, measured where two GPUs or more are visible: every
    visible GPU a rank of one group (spawned processes), from joining it through all-reduces of 4 KiB and 64 MiB
    (runtime.all_reduce); None on one GPU."""
    from runtime.all_reduce import spawned_measurement

    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        return None
    nccl_bytes = spawned_measurement(num_gpus)["nccl_bytes"]
    return Figure(value=nccl_bytes, source="measured",
                  note=f"held outside torch's allocator on a rank of a {num_gpus}-GPU NCCL group once it reduced "
                       f"(the most of any rank); {stamp}")


def restated_efficiency(base: HardwareProfile, measured_flops_per_s: float) -> Figure:
    """The base profile's fitted efficiency, restated against the measured matmul rate.

    compute_efficiency was fitted as (roofline at the datasheet rate) / (measured layer time); against a lower
    measured rate the same layer time needs a higher share, else estimates from the calibrated profile would
    derate twice (1.22x the measured Qwen3-8B prefill layer instead of 0.96x, on the lent H100).
    """
    efficiency = base.compute_efficiency
    value = efficiency.value * base.bf16_flops_per_s.value / measured_flops_per_s
    return Figure(value=round(value, 4), source=efficiency.source,
                  note=f"{efficiency.note}; restated against the measured bf16 rate "
                       f"(x {base.bf16_flops_per_s.value:.3g} / {measured_flops_per_s:.3g})")


def calibrated_yaml(profile: HardwareProfile) -> str:
    """The profile as YAML that --gpu FILE reads."""
    import yaml

    header = "# Written by offload-plan calibrate; figures marked measured were read on this GPU.\n"
    return header + yaml.safe_dump(profile_to_dict(profile), sort_keys=False, width=120)


# ---- the handoff's own cost, for calibrate ------------------------------------------------------------------------

#: fork and join pairs in the handoff's timing graph, and the graph's timed replays
HANDOFF_UNITS = 16
HANDOFF_REPLAYS = 20


def measure_handoff_ms(device: torch.device, threads: int, hidden_size: int = 2048, top_k: int = 8,
                       num_experts: int = 128) -> tuple[float, str]:
    """ms of a routed layer's handoff to the CPU and back with no pair to compute, made as the runtime makes it (a
    CpuExperts of one layer whose one tiny CPU expert the routing never picks: fork, the host's step, join), in a
    captured graph of HANDOFF_UNITS handoffs back to back; the median replay over HANDOFF_REPLAYS, per handoff;
    and the handoff's kind (HANDOFFS)."""
    generator = torch.Generator().manual_seed(0)
    experts = HostExperts(torch.randn(1, 16, hidden_size, generator=generator).bfloat16(),
                          torch.randn(1, hidden_size, 8, generator=generator).bfloat16(), "bf16")
    local = torch.full((num_experts,), -1, dtype=torch.int64)
    layer = CpuLayer(host=experts, is_cpu=torch.zeros(num_experts, dtype=torch.bool), local=local, copy_bytes=0)
    side = CpuExperts({0: layer}, hidden_size=hidden_size, max_pairs=top_k, hidden_dtype=torch.bfloat16,
                      threads=threads, device=device, backend=CudaBackend(device))
    hidden = torch.randn(1, hidden_size, device=device).bfloat16()
    index = torch.arange(top_k, device=device).view(1, top_k)
    weights = torch.rand(1, top_k, device=device)
    out = torch.zeros(1, hidden_size, device=device, dtype=torch.bfloat16)

    def handoffs():
        for _ in range(HANDOFF_UNITS):
            side.join(side.fork(0, hidden, index, weights), out)

    try:
        warm = warm_up_stream(device)
        warm.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(warm):
            handoffs()  # compiles the kernels, starts the threads
        torch.cuda.current_stream(device).wait_stream(warm)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            handoffs()
        ms = median_event_ms(graph.replay, repeats=HANDOFF_REPLAYS)
        side.check()
        return ms / HANDOFF_UNITS, side.handoff
    finally:
        side.close()


def with_measured_handoff(section, device: torch.device):
    """The profile's cpu_experts ``section`` with its handoff measured on ``device`` (measure_handoff_ms, the
    section's threads); unchanged where there is no section, or the measurement fails (its note says why)."""
    if section is None:
        return None
    try:
        ms, kind = measure_handoff_ms(device, section.threads)
    except (RuntimeError, ImportError, OffloadPlanError) as error:  # a GPU or a driver that cannot: no figure
        reason = (str(error).strip().splitlines() or [""])[0][:160]
        return replace(section, note=f"{section.note}; handoff not measured ({reason})")
    return replace(section, handoff_us=round(1e3 * ms, 2),
                   note=f"{section.note}; handoff {1e3 * ms:.1f} us a layer step by {kind}, no pair")
