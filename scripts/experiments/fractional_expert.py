"""What splitting one routed expert between the link and the CPU costs: the pieces of a fractional CPU share.

    PYTHONPATH=. python3 scripts/experiments/fractional_expert.py [--threads 12] [--out DIR]   # on a GPU machine

Issue 37's per-step split sends whole experts to the CPU: a step that misses m experts sends j(m) of them and
the link brings m - j. Experts are indivisible there, so a step waits max(link(m - j), CPU(j)) at the best j, and
at one token that is well above the balance point: on the H200 host, one Qwen3-30B-A3B expert is 0.19 ms over the
link and 0.18 ms on the CPU, so m = 1 waits for one of them whole, and one Mixtral expert (352 MB) is about 7 ms
either way. A SwiGLU expert separates along its intermediate rows: y = sum over i of down[:, i] silu(gate[i] x)
up[i] x. The CPU can compute rows [0, r) of an expert while the link brings rows [r, I) and the GPU computes
those with the slot's rows [0, r) zero (silu(0) x 0 = 0), so the two parts sum to the expert and the split point
is continuous.

Measured here, for Qwen3-30B-A3B (H 2048, I 768), OLMoE (2048, 1024) and Mixtral-8x7B (4096, 14336) experts:

- **The link's part.** Rows [r, I) of gate and of up (two blocks per expert) and columns [r, I) of every row of
  down (H strided segments), read by GPU threads from page-locked mapped host memory into a slot whose rows
  [0, r) the same kernel writes as zeros; against the runtime's whole-expert gather (runtime.uva_gather) of the
  same experts in the same call. The slot is checked against the host rows (a rate of wrong bytes measures
  nothing).
- **The CPU's part.** The runtime's C kernel (runtime.cpu_kernel) on experts of intermediate size r, from a pool
  past the caches (runtime.cpu_experts.cpu_expert_ms) at 1 and 4 tokens. Contiguous r-row experts: the split
  would read down's first r columns of each row (segments of r x 2 bytes), which this does not time.

Prints a table; writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import torch

from runtime.backend import CudaBackend
from runtime.calibrate import median_event_ms
from runtime.cpu_experts import ExpertShape, cpu_expert_ms, pool_size, random_experts
from runtime.uva_gather import device_view, gather_rows

#: (name, hidden H, intermediate I, experts on the host, slots gathered a step)
SHAPES = (("qwen3-moe", 2048, 768, 128, 8), ("olmoe", 2048, 1024, 64, 8), ("mixtral", 4096, 14336, 8, 2))
#: the CPU's share of each expert's intermediate rows, r / I
CPU_SHARES = (0.0, 0.25, 0.5, 0.75)
REPEATS = 10
#: 32-bit words a program of the split gather copies at most (the runtime's block)
BLOCK_WORDS = 4096

_KERNELS: dict[str, object] = {}


def _split_kernel():
    """Each program copies one block of one row of one slot: words [zero_words, row_words) from the expert's row in
    host memory, zeros below zero_words (nothing crosses the link for them)."""
    if "split" not in _KERNELS:
        import triton
        import triton.language as tl

        @triton.jit
        def split_gather(source, destination, source_ids, rows, row_words, row_stride, expert_stride, zero_words,
                         chunks_per_row, num_items, BLOCK: tl.constexpr):
            for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
                slot = item // (rows * chunks_per_row)
                row = (item // chunks_per_row) % rows
                chunk = item % chunks_per_row
                expert = tl.load(source_ids + slot)
                if expert >= 0:
                    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
                    inside = offsets < row_words
                    read = inside & (offsets >= zero_words)
                    at = row.to(tl.int64) * row_stride + offsets
                    values = tl.load(source + expert.to(tl.int64) * expert_stride + at, mask=read, other=0)
                    tl.store(destination + slot.to(tl.int64) * expert_stride + at, values, mask=inside)

        _KERNELS["split"] = split_gather
    return _KERNELS["split"]


def split_gather(source: torch.Tensor, destination: torch.Tensor, ids: torch.Tensor, rows: int, row_words: int,
                 row_stride: int, zero_words: int) -> None:
    """destination[k] rows of ``row_words`` words (``rows`` of them, ``row_stride`` apart): zeros below
    ``zero_words``, source[ids[k]]'s words from there. ``source`` [E, ...] and ``destination`` [F, ...] int32."""
    expert_stride = source[0].numel()
    block = min(BLOCK_WORDS, 1 << (row_words - 1).bit_length())
    chunks = -(-row_words // block)
    items = ids.numel() * rows * chunks
    _split_kernel()[(items,)](source, destination, ids, rows, row_words, row_stride, expert_stride, zero_words,
                              chunks, items, BLOCK=block, num_warps=4)


def link_rows(backend: CudaBackend, device: torch.device, name: str, hidden: int, intermediate: int,
              num_experts: int, slots: int) -> list[dict]:
    """The whole-expert gather and the split gather at each CPU share, of ``slots`` experts spread over the host."""
    host = {"gate_up": torch.empty(num_experts, 2 * intermediate, hidden, dtype=torch.bfloat16),
            "down": torch.empty(num_experts, hidden, intermediate, dtype=torch.bfloat16)}
    for key, tensor in host.items():
        host[key] = backend.pin(tensor, mapped=True)
        host[key].view(torch.int16).random_()
    sources = {key: device_view(tensor, device) for key, tensor in host.items()}
    slots_buffer = {key: torch.empty(slots, *tensor.shape[1:], dtype=torch.bfloat16, device=device)
                    for key, tensor in host.items()}
    chosen = list(range(1, num_experts, max(1, num_experts // slots)))[:slots]
    ids = torch.tensor(chosen, device=device)
    expert_bytes = 3 * hidden * intermediate * 2

    def whole():
        for key in host:
            gather_rows(sources[key], slots_buffer[key], ids)

    whole_ms = median_event_ms(whole, repeats=REPEATS, warmups=2)
    rows = [{"model": name, "method": "whole experts (runtime gather)", "cpu_share": 0.0,
             "bytes": slots * expert_bytes, "ms": whole_ms, "gb_per_s": slots * expert_bytes / whole_ms / 1e6}]
    gate_up_words, down_words = intermediate * hidden // 2, intermediate // 2
    for share in CPU_SHARES:
        cpu_rows = int(round(share * intermediate / 64)) * 64  # whole 32-bit words, aligned rows
        words = {key: source.view(torch.int32) for key, source in sources.items()}
        out = {key: buffer.view(torch.int32) for key, buffer in slots_buffer.items()}

        def split():
            # gate rows and up rows: one row each of I x H / 2 words, zero below r x H / 2
            split_gather(words["gate_up"], out["gate_up"], ids, 2, gate_up_words, gate_up_words,
                         cpu_rows * hidden // 2)
            # down: H rows of I / 2 words, zero below r / 2
            split_gather(words["down"], out["down"], ids, hidden, down_words, down_words, cpu_rows // 2)

        ms = median_event_ms(split, repeats=REPEATS, warmups=2)
        _check_split(host, slots_buffer, chosen, cpu_rows, intermediate)
        moved = slots * 3 * hidden * (intermediate - cpu_rows) * 2
        rows.append({"model": name, "method": "split gather", "cpu_share": cpu_rows / intermediate, "bytes": moved,
                     "ms": ms, "gb_per_s": moved / ms / 1e6 if moved else None})
    for tensor in host.values():
        backend.unpin(tensor)
    return rows


def _check_split(host: dict, slots_buffer: dict, chosen: list[int], cpu_rows: int, intermediate: int) -> None:
    gate_up, down = slots_buffer["gate_up"].cpu().view(torch.int16), slots_buffer["down"].cpu().view(torch.int16)
    want_gate_up = host["gate_up"][chosen].view(torch.int16).clone()
    want_down = host["down"][chosen].view(torch.int16).clone()
    want_gate_up[:, :cpu_rows] = 0
    want_gate_up[:, intermediate:intermediate + cpu_rows] = 0
    want_down[:, :, :cpu_rows] = 0
    assert torch.equal(gate_up, want_gate_up) and torch.equal(down, want_down), "the split gather's slot is wrong"


def cpu_rows_ms(name: str, hidden: int, intermediate: int, threads: int) -> list[dict]:
    """The C kernel on experts of r intermediate rows (r = share x I), at 1 and 4 tokens."""
    rows = []
    for share in CPU_SHARES[1:] + (1.0,):
        cpu_rows = int(round(share * intermediate / 64)) * 64
        shape = ExpertShape(hidden_size=hidden, intermediate_size=cpu_rows)
        experts = random_experts(shape, pool_size(shape, "bf16"), "bf16")
        for tokens in (1, 4):
            rows.append({"model": name, "cpu_share": cpu_rows / intermediate, "tokens": tokens,
                         "ms": cpu_expert_ms(experts, tokens, threads), "pool_experts": experts.num_experts})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=12, help="the CPU experts' threads (calibrate's count)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", "/tmp")))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fractional_expert.py: needs a CUDA GPU; run it on one")
    device = torch.device("cuda")
    backend = CudaBackend(device)
    started = time.perf_counter()
    link, cpu = [], []
    for name, hidden, intermediate, num_experts, slots in SHAPES:
        link += link_rows(backend, device, name, hidden, intermediate, num_experts, slots)
        cpu += cpu_rows_ms(name, hidden, intermediate, args.threads)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "threads": args.threads,
              "seconds": round(time.perf_counter() - started, 1), "link": link, "cpu": cpu}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fractional_expert.json").write_text(json.dumps(result, indent=1))
    print(f"{result['device']}, torch {result['torch']}, {args.threads} CPU threads, {result['seconds']} s")
    print("| model | link method | CPU share | MB | ms | GB/s |\n|---|---|---|---|---|---|")
    for row in link:
        rate = f"{row['gb_per_s']:.1f}" if row["gb_per_s"] else "-"
        print(f"| {row['model']} | {row['method']} | {row['cpu_share']:.3f} | {row['bytes'] / 1e6:.1f} | "
              f"{row['ms']:.3f} | {rate} |")
    print("| model | CPU share | tokens | ms an expert |\n|---|---|---|---|")
    for row in cpu:
        print(f"| {row['model']} | {row['cpu_share']:.3f} | {row['tokens']} | {row['ms']:.3f} |")


if __name__ == "__main__":
    main()
