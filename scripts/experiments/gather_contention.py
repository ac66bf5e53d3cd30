"""How a layer's miss gather shares the link with the next layer's prefetch gather (issue 22's skewed step).

    PYTHONPATH=. python3 scripts/experiments/gather_contention.py [--out DIR]    # on a machine with a GPU

In a routed decode step (runtime.routed_experts.RoutedExperts.decode) the next layer's prefetch starts on a side
stream with a bounded grid (PREFETCH_GATHER_PROGRAMS persistent programs) and this layer's misses then gather on
the main stream with the full grid; the layer's experts wait for the misses. The planner prices a miss at the
gather's full rate. This measures, on Qwen3-30B-A3B expert rows in huge-page host memory as run places them,
the miss gather's time alone and with a prefetch of P experts started just before it, and the prefetch's time,
each case captured as a CUDA graph and timed by GPU timestamps taken in stream order; and how much a
concurrent prefetch gather slows decode-sized matrix products on the main stream (the step's compute).
Prints a table; writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics

import torch

from runtime.backend import CudaBackend
from runtime.host_pages import huge_page_empty
from runtime.routed_experts import PREFETCH_GATHER_PROGRAMS
from runtime.uva_gather import device_view, gather_rows

NUM_EXPERTS = 128
SLOTS = 8
ROWS = {"gate_up": (2 * 768, 2048), "down": (2048, 768)}
MISSES = (0, 1, 2, 3)
PREFETCHES = (0, 1, 2, 4)
REPEATS = 30


def host_rows(backend: CudaBackend, device: torch.device) -> dict[str, torch.Tensor]:
    """Per param, [E, *row] bf16 in huge-page host memory, filled, page-locked and mapped; its device view."""
    views = {}
    for name, shape in ROWS.items():
        host = huge_page_empty(NUM_EXPERTS * torch.Size(shape).numel() * 2).view(torch.bfloat16)
        host = host.view(NUM_EXPERTS, *shape)
        host.view(torch.int16).random_()
        backend.pin(host, mapped=True)
        views[name] = device_view(host, device)
    return views


def slot_ids(count: int, offset: int, device: torch.device) -> torch.Tensor:
    """SLOTS entries: ``count`` distinct expert ids from ``offset`` (spread over the allocation), -1 after."""
    ids = [(offset + 17 * k) % NUM_EXPERTS for k in range(count)] + [-1] * (SLOTS - count)
    return torch.tensor(ids, dtype=torch.int64, device=device)


_STAMP = {}


def stamp_kernel():
    """A one-thread Triton program writing the GPU's global timer (ns) to ``out[index]``: a timestamp taken in
    stream order inside a captured graph, where CUDA events cannot time."""
    if "stamp" not in _STAMP:
        import triton
        import triton.language as tl

        @triton.jit
        def stamp(out, index):
            now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                            pack=1)
            tl.store(out + index, now)

        _STAMP["stamp"] = stamp
    return _STAMP["stamp"]


def one_case(sources, buffers, misses: int, prefetches: int, side: torch.cuda.Stream) -> tuple[float, float]:
    """(miss gather us, prefetch gather us), both from a stamp taken as the prefetch is enqueued, medians over
    replays of the case captured as a graph (no launch overhead: as a captured decode step runs)."""
    device = buffers["gate_up"].device
    miss_ids, prefetch_ids = slot_ids(misses, 3, device), slot_ids(prefetches, 70, device)
    stamps = torch.zeros(3, dtype=torch.int64, device=device)
    stamp = stamp_kernel()

    def case():
        main = torch.cuda.current_stream(device)
        stamp[(1,)](stamps, 0)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for name, source in sources.items():
                gather_rows(source, buffers[name][SLOTS:], prefetch_ids, max_programs=PREFETCH_GATHER_PROGRAMS)
            stamp[(1,)](stamps, 2)
        for name, source in sources.items():
            gather_rows(source, buffers[name][:SLOTS], miss_ids)
        stamp[(1,)](stamps, 1)
        main.wait_stream(side)

    miss_us, prefetch_us = stamped_us(case, stamps)
    return miss_us, prefetch_us


def stamped_us(case, stamps: torch.Tensor) -> tuple[float, float]:
    """``case`` captured as a graph and replayed: the medians of stamps[1] and stamps[2] after stamps[0], in us
    (the first replays untimed)."""
    device = stamps.device
    case()  # compiles the kernels outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case()
    first, second = [], []
    for repeat in range(REPEATS + 2):
        graph.replay()
        torch.cuda.synchronize(device)
        start, one, two = stamps.tolist()
        if repeat >= 2:
            first.append((one - start) / 1e3)
            second.append((two - start) / 1e3)
    return statistics.median(first), statistics.median(second)


#: the compute probe: decode-sized bf16 products, one token against Qwen3-30B-A3B-sized weights (memory-bound,
#: as a batch-1 decode step's kernels are), chained so the probe lasts about a layer's compute
PROBE_WEIGHTS = ((2048, 4096), (4096, 2048), (2048, 1536), (768, 2048))
PROBE_CHAIN = 4


def compute_probe_us(side: torch.cuda.Stream, sources, buffers, prefetches: int) -> float:
    """GPU time of a chain of decode-sized products captured as a graph, alone or with a bounded prefetch gather
    of ``prefetches`` experts started on the side stream just before it (what the routed step overlaps)."""
    device = buffers["gate_up"].device
    weights = [torch.randn(shape, dtype=torch.bfloat16, device=device) for shape in PROBE_WEIGHTS * PROBE_CHAIN]
    hidden = torch.randn(1, 2048, dtype=torch.bfloat16, device=device)
    prefetch_ids = slot_ids(prefetches, 70, device)
    stamps = torch.zeros(3, dtype=torch.int64, device=device)
    stamp = stamp_kernel()

    def case():
        main = torch.cuda.current_stream(device)
        stamp[(1,)](stamps, 0)
        if prefetches:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for name, source in sources.items():
                    gather_rows(source, buffers[name][SLOTS:], prefetch_ids, max_programs=PREFETCH_GATHER_PROGRAMS)
        x = hidden
        for weight in weights:
            x = x[:, :weight.shape[0]] @ weight if x.shape[1] >= weight.shape[0] else \
                torch.nn.functional.pad(x, (0, weight.shape[0] - x.shape[1])) @ weight
        stamp[(1,)](stamps, 1)
        if prefetches:
            main.wait_stream(side)

    return stamped_us(case, stamps)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", "/tmp")))
    args = parser.parse_args()
    device = torch.device("cuda")
    backend = CudaBackend(device)
    sources = host_rows(backend, device)
    buffers = {name: torch.empty(2 * SLOTS, *shape, dtype=torch.bfloat16, device=device)
               for name, shape in ROWS.items()}
    expert_bytes = sum(torch.Size(shape).numel() * 2 for shape in ROWS.values())
    side = torch.cuda.Stream(device)
    rows = []
    for misses in MISSES:
        for prefetches in PREFETCHES:
            miss_us, prefetch_us = one_case(sources, buffers, misses, prefetches, side)
            rows.append({"misses": misses, "prefetches": prefetches, "miss_us": miss_us,
                         "prefetch_us": prefetch_us if prefetches else None,
                         "miss_gb_per_s": misses * expert_bytes / miss_us / 1e3 if misses else None})
    probe = {prefetches: compute_probe_us(side, sources, buffers, prefetches) for prefetches in (0, 1, 2, 4)}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "expert_bytes": expert_bytes,
              "prefetch_programs": PREFETCH_GATHER_PROGRAMS, "rows": rows, "compute_probe_us": probe}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gather_contention.json").write_text(json.dumps(result, indent=1))
    print(f"{'misses':>6} {'prefetch':>8} {'miss us':>8} {'miss GB/s':>9} {'prefetch us':>11}")
    for row in rows:
        rate = f"{row['miss_gb_per_s']:.1f}" if row["miss_gb_per_s"] else "-"
        pre = f"{row['prefetch_us']:.1f}" if row["prefetch_us"] else "-"
        print(f"{row['misses']:>6} {row['prefetches']:>8} {row['miss_us']:>8.1f} {rate:>9} {pre:>11}")
    print("compute probe (decode-sized products) us, by experts a concurrent prefetch gathers:",
          ", ".join(f"{n}: {us:.1f}" for n, us in probe.items()))


if __name__ == "__main__":
    main()
