"""Pinned host-to-device copy rate issued eagerly against the same copies replayed from a CUDA graph.

    PYTHONPATH=. python3 scripts/experiments/graph_copy_rate.py [--with-compute]     # on a machine with a GPU

Graphed decode steps of a link-bound plan run about 10-16 ms over eager ones at batch 64 with one step per
replay and with four (benchmarks/2026-11-23-decode-h100.md). If memcpy nodes in a graph moved bytes slower
than cudaMemcpyAsync, the gap would not depend on the replay length; this measures exactly that: 21 copies
of one layer's bytes (386 MB, Qwen3-8B bf16) on a side stream, eager and graphed, from torch-pinned and
from cudaHostRegister'd memory (what the engine uses).

``--with-compute`` also runs the copies beside a chain of bf16 matmuls on the compute stream (about as long
as the copies), eager and captured in one graph, and times matmuls alone, copies alone and both: if a graph
ran its copies through the SMs, or queued them behind kernels, "both" would exceed the longer of the two.
"""

from __future__ import annotations

import sys

import torch

from runtime.backend import CudaBackend
from runtime.calibrate import median_event_ms

LAYER_BYTES = 386_000_000
NUM_COPIES = 21
NUM_REPEATS = 5


def copies(device_buffers, host_buffers, stream) -> None:
    with torch.cuda.stream(stream):
        for index in range(NUM_COPIES):
            device_buffers[index % 2].copy_(host_buffers[index % len(host_buffers)], non_blocking=True)


def timed_ms(run) -> float:
    return median_event_ms(run, repeats=NUM_REPEATS)


MATMUL_SIZE = 8192
NUM_MATMULS = 100


def with_compute(device_buffers, host, side) -> None:
    """Matmuls alone, copies alone and both at once, eager and graphed: ms of each."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)

    def matmuls():
        for _ in range(NUM_MATMULS):
            torch.mm(a, b, out=out)

    def copies_only():
        side.wait_stream(torch.cuda.current_stream())
        copies(device_buffers, host, side)
        torch.cuda.current_stream().wait_stream(side)

    def both():
        side.wait_stream(torch.cuda.current_stream())
        copies(device_buffers, host, side)
        matmuls()
        torch.cuda.current_stream().wait_stream(side)

    print("| work | eager ms | graphed ms |")
    print("|---|---|---|")
    for name, run in (("matmuls", matmuls), ("copies", copies_only), ("both", both)):
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        print(f"| {name} | {timed_ms(run):.2f} | {timed_ms(graph.replay):.2f} |")


def main() -> None:
    backend = CudaBackend(torch.device("cuda"))
    device_buffers = [torch.empty(LAYER_BYTES, dtype=torch.uint8, device="cuda") for _ in range(2)]
    side = torch.cuda.Stream()
    sources = {"pin_memory": [torch.empty(LAYER_BYTES, dtype=torch.uint8).pin_memory() for _ in range(2)],
               "cudaHostRegister": [backend.pin(torch.empty(LAYER_BYTES, dtype=torch.uint8)) for _ in range(2)]}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: "
          f"{NUM_COPIES} copies of {LAYER_BYTES / 1e6:.0f} MB")
    print("| host memory | eager ms | eager GB/s | graphed ms | graphed GB/s |")
    print("|---|---|---|---|---|")
    for name, host in sources.items():
        def eager():
            side.wait_stream(torch.cuda.current_stream())
            copies(device_buffers, host, side)
            torch.cuda.current_stream().wait_stream(side)

        eager()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        eager_ms, graphed_ms = timed_ms(eager), timed_ms(graph.replay)
        total = NUM_COPIES * LAYER_BYTES
        print(f"| {name} | {eager_ms:.2f} | {total / eager_ms / 1e6:.1f} | {graphed_ms:.2f} | "
              f"{total / graphed_ms / 1e6:.1f} |")
    if "--with-compute" in sys.argv[1:]:
        with_compute(device_buffers, sources["cudaHostRegister"], side)


if __name__ == "__main__":
    main()
