"""What limits the routed gather's read rate from mapped host memory: page placement, program shape, load hints.

    PYTHONPATH=. python3 scripts/experiments/gather_rate_sweep.py [--out DIR]    # on a machine with a GPU

The routed-experts runtime reads non-resident experts with GPU threads from page-locked host memory mapped into
the device (runtime.routed_experts.gather_rows). In decode steps on the H100 it reads at 46-50 GB/s where one
large copy-engine copy reaches ~55 GB/s. Two candidate causes are measured here, on Qwen3-30B-A3B-shaped expert
rows (gate_up 2 x 768 x 2048 and down 2048 x 768, bf16; 8 distinct experts of 128 per gather, as one token's
decode step fetches):

- **Where the pages are.** Memory filled by torch's multi-threaded random_() before it is page-locked is
  first-touched by worker threads on every NUMA node; memory page-locked first is faulted in by the locking
  thread. runtime/calibrate.py's H2D line found the first order 47-50 GB/s and the second 54-55 GB/s for the
  copy engine. The benchmarks' routed arms adopt a model's host tensors (filled first); `run` loads into an
  allocation it page-locks first.
- **The kernel's shape and load hints**: 32-bit words per program, warps per program, and Triton's cache
  modifier for the loads (none, .cg: L2 only, .cv: no caching).

Per host placement: the copy engine (one large copy, and the 8 experts' rows as 16 copies), then the Triton
gather in every shape x modifier. Prints a table; writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pathlib
import subprocess

import torch

from runtime.calibrate import median_event_ms
from runtime.backend import CudaBackend
from runtime.uva_gather import device_view

NUM_EXPERTS = 128
TOP_K = 8
HIDDEN = 2048
INTERMEDIATE = 768
ROWS = {"gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}
SHAPES = ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 4), (2048, 2))
MODIFIERS = ("", ".cg", ".cv")
REPEATS = 10

_KERNELS: dict[str, object] = {}


def _kernel(modifier: str):
    """The runtime's gather loop with the loads' cache modifier a parameter (compiled per modifier)."""
    if modifier not in _KERNELS:
        import triton
        import triton.language as tl

        @triton.jit
        def gather(source, destination, source_ids, row_words, chunks_per_row, num_items, BLOCK: tl.constexpr,
                   CACHE: tl.constexpr):
            for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
                slot = item // chunks_per_row
                chunk = item % chunks_per_row
                expert = tl.load(source_ids + slot)
                if expert >= 0:
                    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
                    mask = offsets < row_words
                    values = tl.load(source + expert.to(tl.int64) * row_words + offsets, mask=mask,
                                     cache_modifier=CACHE)
                    tl.store(destination + slot.to(tl.int64) * row_words + offsets, values, mask=mask)

        _KERNELS[modifier] = gather
    return _KERNELS[modifier]


#: how the host rows are placed: page-locked before random_() fills them, after, or in an anonymous mapping
#: advised MADV_HUGEPAGE (transparent 2 MiB pages where the kernel allows them), filled, then page-locked
PLACEMENTS = {"locked-first": "page-locked, then filled", "filled-first": "filled, then page-locked",
              "huge-pages": "huge pages, filled, then page-locked"}


def huge_page_tensor(shape: tuple[int, ...]) -> torch.Tensor:
    """A bf16 tensor over an anonymous mapping advised MADV_HUGEPAGE (the mapping lives as long as the tensor)."""
    num_bytes = torch.Size(shape).numel() * 2
    mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.bfloat16).view(shape)


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page mode (the bracketed word), or why it is unknown."""
    try:
        return pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError as error:
        return f"unknown ({error})"


def host_experts(backend: CudaBackend, placement: str) -> dict[str, torch.Tensor]:
    """[E, *row] bf16 per param, page-locked and mapped, placed as PLACEMENTS[placement] says."""
    experts = {}
    for name, shape in ROWS.items():
        if placement == "huge-pages":
            host = huge_page_tensor((NUM_EXPERTS, *shape))
        else:
            host = torch.empty(NUM_EXPERTS, *shape, dtype=torch.bfloat16)
        if placement == "locked-first":
            host = backend.pin(host, mapped=True)
            host.view(torch.int16).random_()
        else:
            host.view(torch.int16).random_()
            host = backend.pin(host, mapped=True)
        experts[name] = host
    return experts


def gather_ms(sources: dict, destinations: dict, ids: torch.Tensor, words: int, warps: int, modifier: str) -> float:
    def run():
        for name, source in sources.items():
            row_words = source[0].numel() // 2
            chunks = -(-row_words // words)
            items = ids.numel() * chunks
            _kernel(modifier)[(items,)](source.view(torch.int32), destinations[name].view(torch.int32), ids,
                                        row_words, chunks, items, BLOCK=words, CACHE=modifier, num_warps=warps)

    return median_event_ms(run, repeats=REPEATS, warmups=2)


def copy_engine_ms(host: dict, destinations: dict, ids_list: list[int]) -> float:
    def run():
        for name, source in host.items():
            for slot, expert in enumerate(ids_list):
                destinations[name][slot].copy_(source[expert], non_blocking=True)

    return median_event_ms(run, repeats=REPEATS, warmups=2)


def placement_rows(backend: CudaBackend, placement_key: str, device: torch.device, shapes=SHAPES) -> list[dict]:
    host = host_experts(backend, placement_key)
    sources = {name: device_view(tensor, device) for name, tensor in host.items()}
    destinations = {name: torch.empty(TOP_K, *shape, dtype=torch.bfloat16, device=device)
                    for name, shape in ROWS.items()}
    ids_list = list(range(3, 3 + 16 * TOP_K, 16))  # 8 experts spread over the allocation
    ids = torch.tensor(ids_list, device=device)
    num_bytes = TOP_K * sum(torch.Size(shape).numel() * 2 for shape in ROWS.values())
    placement = PLACEMENTS[placement_key]
    big = host["gate_up"].view(-1)
    big_device = torch.empty_like(big, device=device)
    whole_ms = median_event_ms(lambda: big_device.copy_(big, non_blocking=True), repeats=REPEATS, warmups=2)
    rows = [{"placement": placement, "method": "copy engine, one copy", "bytes": big.numel() * 2,
             "gb_per_s": big.numel() * 2 / whole_ms / 1e6},
            {"placement": placement, "method": "copy engine, 16 row copies", "bytes": num_bytes,
             "gb_per_s": num_bytes / copy_engine_ms(host, destinations, ids_list) / 1e6}]
    for words, warps in shapes:
        for modifier in MODIFIERS if (words, warps) == (4096, 4) else ("",):
            ms = gather_ms(sources, destinations, ids, words, warps, modifier)
            rows.append({"placement": placement, "method": f"gather {words}x{warps} {modifier or 'default'}",
                         "bytes": num_bytes, "gb_per_s": num_bytes / ms / 1e6})
    # the gather's result equals the rows asked for (a rate of wrong bytes measures nothing); compared as
    # integers: random bits hold bf16 NaNs, which torch.equal counts unequal to themselves
    for name in ROWS:
        assert torch.equal(destinations[name].cpu().view(torch.int16), host[name][ids_list].view(torch.int16)), name
    for tensor in host.values():
        backend.unpin(tensor)
    return rows


def topology() -> str:
    """nvidia-smi's topology matrix (CPU and NUMA affinity of the GPU), or why there is none."""
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return f"nvidia-smi topo -m failed: {error}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", "/tmp")))
    parser.add_argument("--placements", nargs="+", choices=tuple(PLACEMENTS), default=list(PLACEMENTS))
    parser.add_argument("--runtime-shape-only", action="store_true",
                        help="gather in the runtime's 4096x4 shape only (the other shapes moved the rate under 1%%)")
    args = parser.parse_args()
    device = torch.device("cuda")
    backend = CudaBackend(device)
    shapes = ((4096, 4),) if args.runtime_shape_only else SHAPES
    rows = [row for key in args.placements for row in placement_rows(backend, key, device, shapes)]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "affinity": os.sched_getaffinity(0)
              .__len__(), "transparent_huge_pages": transparent_huge_pages(), "topology": topology(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gather_rate_sweep.json").write_text(json.dumps(result, indent=1))
    print(result["topology"])
    print("transparent huge pages:", result["transparent_huge_pages"])
    print(f"{'placement':<26} {'method':<30} {'GB/s':>6}")
    for row in rows:
        print(f"{row['placement']:<26} {row['method']:<30} {row['gb_per_s']:>6.1f}")


if __name__ == "__main__":
    main()
