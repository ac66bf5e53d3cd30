"""Does a captured host node run beside the graph's other branch, and what serializes the CPU experts' path with the
fetch (issue 37)? One CUDA GPU, about a minute.

    PYTHONPATH=. python3 scripts/experiments/host_node_overlap.py [--work-ms 1.0] [--host-ms 0.5]

Each arm is one CUDA graph: a main branch of GPU work (a spin kernel, torch.cuda._sleep, or the routed experts'
UVA gather of host rows, runtime.uva_gather) and, forked from it on a side stream and joined back, the CPU path
(a device-to-host copy, a host node, a host-to-device copy), as runtime.cpu_handoff lays out a step. The host node
is, by arm:

- ``none``: no side branch (the main branch's time alone);
- ``c-usleep``: libc's usleep(host-ms) as the host function itself (a C function: no Python, no GIL);
- ``py-sleep``: a ctypes Python callback that sleeps host-ms (takes the GIL, releases it while sleeping);
- ``py-spin``: a Python callback that spins host-ms (holds the GIL throughout);
- ``py-matmul``: a Python callback that runs torch CPU matmuls for about host-ms (the GIL released inside ops).

If the host node ran beside the main branch, every arm's replay would take max(work, host path); if the driver
serializes them, work + host path. Replays are timed back to back (events between them, one sync at the end, as a
decode loop runs) and one at a time (synchronized each). Prints a table; writes JSON to --out if given.
"""

import argparse
import ctypes
import json
import statistics
import time

import torch

HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
NUM_REPLAYS = 40


def driver_launch():
    library = ctypes.CDLL("libcuda.so.1")
    launch = library.cuLaunchHostFunc
    launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    launch.restype = ctypes.c_int
    return launch


def spin_cycles_for(ms: float) -> int:
    """torch.cuda._sleep cycles that take about ``ms`` on this GPU (timed once)."""
    cycles = 1_000_000
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return int(cycles * ms / start.elapsed_time(end))


def host_functions(host_ms: float) -> dict:
    """name -> (function pointer as int, user data as int, keep-alive)."""
    libc = ctypes.CDLL("libc.so.6")
    usleep = ctypes.cast(libc.usleep, ctypes.c_void_p).value
    weights = torch.randn(1024, 1024)
    rows = torch.randn(8, 1024)
    start = time.perf_counter()
    for _ in range(20):
        rows @ weights
    per_matmul_s = (time.perf_counter() - start) / 20
    num_matmuls = max(1, int(host_ms / 1e3 / per_matmul_s))

    def py_sleep(_):
        time.sleep(host_ms / 1e3)

    def py_spin(_):
        until = time.perf_counter() + host_ms / 1e3
        while time.perf_counter() < until:
            pass

    def py_matmul(_):
        for _ in range(num_matmuls):
            rows @ weights

    functions = {"c-usleep": (usleep, int(host_ms * 1e3), None)}
    for name, body in (("py-sleep", py_sleep), ("py-spin", py_spin), ("py-matmul", py_matmul)):
        callback = HOST_FN(body)
        functions[name] = (ctypes.cast(callback, ctypes.c_void_p).value, 0, callback)
    return functions


def uva_source(num_rows: int, row_bytes: int):
    from runtime.uva_gather import device_view

    host = torch.empty(num_rows, row_bytes // 4, dtype=torch.int32, pin_memory=True)
    return host, device_view(host, torch.device("cuda"))


def main_work(kind: str, cycles: int, gather):
    if kind == "spin":
        return lambda: torch.cuda._sleep(cycles)
    from runtime.uva_gather import gather_rows

    source, destination, ids = gather
    programs = int(kind.split("-")[1]) if "-" in kind else None  # "gather-32": at most 32 persistent programs
    return lambda: gather_rows(source, destination, ids, max_programs=programs)


def capture(work, host, launch, num_units: int = 1, copies: str = "copy"):
    """A graph of ``num_units`` units one after another, each ``work`` on the capture stream and, when ``host`` is
    given, the side branch beside it. ``copies``: how the side branch moves its data: "copy" (device-to-host and
    host-to-device copies, the copy engine's), "mapped" (kernels writing and reading mapped host memory through
    its device view: no copy-engine node) or "none"."""
    from runtime.uva_gather import device_view

    side = torch.cuda.Stream()
    small = torch.zeros(2048, device="cuda")
    pinned = torch.zeros(2048, pin_memory=True)
    mapped = device_view(pinned, torch.device("cuda"))
    back = torch.zeros(2048, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        capture_stream = torch.cuda.current_stream()
        for _ in range(num_units):
            if host is not None:
                side.wait_stream(capture_stream)
                with torch.cuda.stream(side):
                    if copies == "copy":
                        pinned.copy_(small, non_blocking=True)
                    elif copies == "mapped":
                        mapped.copy_(small)
                    code = launch(ctypes.c_void_p(side.cuda_stream), ctypes.c_void_p(host[0]),
                                  ctypes.c_void_p(host[1]))
                    assert code == 0, code
                    if copies == "copy":
                        back.copy_(pinned, non_blocking=True)
            work()
            if host is not None:
                capture_stream.wait_stream(side)
                small.add_(mapped if copies == "mapped" else back)
    return graph


def time_replays(graph) -> dict:
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(NUM_REPLAYS + 1)]
    events[0].record()
    for index in range(NUM_REPLAYS):
        graph.replay()
        events[index + 1].record()
    torch.cuda.synchronize()
    back_to_back = [events[i].elapsed_time(events[i + 1]) for i in range(NUM_REPLAYS)]
    synced = []
    for _ in range(10):
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        synced.append((time.perf_counter() - start) * 1e3)
    return {"back_to_back_ms": statistics.median(back_to_back), "synced_wall_ms": statistics.median(synced)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work-ms", type=float, default=1.0)
    parser.add_argument("--host-ms", type=float, default=0.5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    launch = driver_launch()
    cycles = spin_cycles_for(args.work_ms)
    # the gather: rows of 6 MiB (a Qwen3-30B-A3B expert is 9.4 MB in bf16) making about work-ms over PCIe
    row_bytes = 6 << 20
    num_rows = max(1, round(args.work_ms * 1e-3 * 50e9 / row_bytes))
    host, mapped = uva_source(num_rows * 2, row_bytes)
    destination = torch.empty(num_rows, row_bytes // 4, dtype=torch.int32, device="cuda")
    ids = torch.arange(num_rows, device="cuda")
    functions = host_functions(args.host_ms)
    rows = []
    arms = [(kind, name, 1, "copy") for kind in ("spin", "gather") for name in ("none", *functions)]
    arms += [("gather", name, 8, "copy") for name in ("none", "c-usleep", "py-sleep")]
    arms += [("gather", name, units, copies) for copies in ("none", "mapped") for units in (1, 8)
             for name in ("c-usleep", "py-sleep")]
    # the full grid holds every SM for the gather's length: does a side kernel (or copy) wait for SMs?
    arms += [(f"gather-{programs}", name, units, copies) for programs in (32, 64) for copies in ("copy", "mapped")
             for units in (1, 8) for name in ("none", "py-sleep")]
    for kind, name, num_units, copies in arms:
        work = main_work(kind, cycles, (mapped, destination, ids))
        work()
        torch.cuda.synchronize()
        graph = capture(work, None if name == "none" else functions[name], launch, num_units, copies)
        timing = time_replays(graph)
        rows.append({"work": kind, "host": name, "units": num_units, "copies": copies,
                     **{k: round(v / num_units, 4) for k, v in timing.items()}})
        print(json.dumps(rows[-1]), flush=True)
        del graph
    print(f"\nwork {args.work_ms} ms, host path {args.host_ms} ms; overlap means per unit ~ max, serial ~ sum")
    print(f"{'work':8s} {'host node':10s} {'units':>5s} {'copies':>6s} {'b2b ms/unit':>12s} {'synced ms/unit':>15s}")
    for row in rows:
        print(f"{row['work']:8s} {row['host']:10s} {row['units']:5d} {row['copies']:>6s} "
              f"{row['back_to_back_ms']:12.3f} {row['synced_wall_ms']:15.3f}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
