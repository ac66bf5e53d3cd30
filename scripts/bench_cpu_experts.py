"""The host CPU's routed-expert rate against the link's (issue 37): can the CPU compute experts while the link
fetches others?

For each expert shape (``--shapes``: Qwen3-30B-A3B's H 2048 x I 768, Mixtral-8x7B's H 4096 x I 14336, from
examples/*/config.json; ``tiny``, H 64 x I 32, the default, so the logic runs on any CPU), rows appended to the
JSON as they finish:

- cpu: ms for one expert at each of ``--tokens`` per dtype (bf16, fp32) with ``--threads`` threads, over a pool
  of experts past the caches (runtime.cpu_experts.measure_cpu_experts), the profile section calibrate would write
  for the shape (the faster dtype, its fitted rates);
- link: on a CUDA GPU, ms for one expert's bf16 bytes copied from pinned host memory by the copy engine, back to
  back over a pool (runtime.calibrate.median_event_ms), and the routed gather's by the planner's efficiency
  (planner.model.experts.ROUTED_FETCH_EFFICIENCY); without one, the rate of ``--link-gb-per-s`` (assumed, said so);
- handoff: on a CUDA GPU, a layer's round trip beside the CPU's compute: the top-k pairs' hidden states to
  pinned host memory, the host's wait, the outputs back (median, ms); and the CPU threads' wake-up, the first
  small product after 5 ms idle less the same warm;
- verdict: per token count, the CPU's best ms over the routed link's, within CPU_WITHIN_LINK_FACTOR or not, and the
  planner's split of a decode layer missing ``--missed`` experts at one token (planner.search.cpu_experts.
  decode_split: the share on the CPU, the layer's stall against fetch-only, or why the CPU is declined), with the
  measured handoff.

    PYTHONPATH=. python3 scripts/bench_cpu_experts.py                                  # tiny, CPU is enough
    PYTHONPATH=. python3 scripts/bench_cpu_experts.py --shapes qwen3-30b-a3b mixtral --out $OUT   # the GPU host
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from planner.model.experts import ROUTED_FETCH_EFFICIENCY
from planner.search.cpu_experts import CPU_HANDOFF_MS, CPU_WITHIN_LINK_FACTOR, cpu_expert_ms, decode_split
from runtime.cpu_experts import CALIBRATION_TOKENS, CPU_DTYPES, ExpertShape, cpu_experts_profile, cpu_threads

#: name -> (hidden size, intermediate size, top_k, num_experts)
SHAPES = {"tiny": (64, 32, 2, 16), "qwen3-30b-a3b": (2048, 768, 8, 128), "mixtral": (4096, 14336, 2, 8)}
#: pinned host memory the link's timing cycles through (so no copy repeats one expert's bytes back to back)
LINK_POOL_BYTES = 2**30
#: the link's rate where no GPU is present: the h100-sxm profile's copy engine
ASSUMED_LINK_GB_PER_S = 55.0


def parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["tiny"])
    parser.add_argument("--tokens", nargs="+", type=int, default=list(CALIBRATION_TOKENS[:5]))
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--pool-mib", type=int, default=256, help="host experts each CPU timing cycles through")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--missed", type=float, default=None,
                        help="misses of the decode layer the planner splits (default: the shape's top-k)")
    parser.add_argument("--link-gb-per-s", type=float, default=ASSUMED_LINK_GB_PER_S,
                        help="copy-engine rate assumed without a CUDA GPU")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/bench-cpu-experts"))
    return parser


def link_ms_per_expert(expert_bytes: int) -> float:
    """ms for the copy engine to bring one expert's bytes from pinned host memory, back to back over a pool."""
    from runtime.backend import CudaBackend
    from runtime.calibrate import median_event_ms

    backend = CudaBackend(torch.device("cuda"))
    count = max(2, LINK_POOL_BYTES // expert_bytes)
    host = backend.pin(torch.empty(count * expert_bytes, dtype=torch.uint8))
    device = torch.empty(expert_bytes, dtype=torch.uint8, device="cuda")

    def run():
        for index in range(count):
            device.copy_(host[index * expert_bytes:(index + 1) * expert_bytes], non_blocking=True)

    ms = median_event_ms(run) / count
    backend.unpin(host)
    return ms


def handoff_ms(hidden_size: int, top_k: int, repeats: int = 50) -> float:
    """A decode layer's round trip to the host and back, beside the CPU's compute: one token's top_k pairs'
    hidden states to pinned memory, the host's wait for them, the outputs back; median ms."""
    hidden = torch.randn(top_k, hidden_size, dtype=torch.bfloat16, device="cuda")
    to_host = torch.empty(top_k, hidden_size, dtype=torch.bfloat16).pin_memory()
    back = torch.empty_like(to_host).pin_memory()
    result = torch.empty_like(hidden)
    times = []
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        to_host.copy_(hidden, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        result.copy_(back, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[2:])


def wake_ms(num_threads: int, repeats: int = 20) -> float:
    """The CPU threads' wake-up: a small product after 5 ms idle, less the same product warm (median ms)."""
    weight, hidden = torch.randn(256, 256), torch.randn(1, 256)
    cold, warm = [], []
    with cpu_threads(num_threads):
        for _ in range(repeats):
            time.sleep(0.005)
            for times in (cold, warm):
                start = time.perf_counter()
                torch.nn.functional.linear(hidden, weight)
                times.append(time.perf_counter() - start)
    return max(0.0, 1e3 * (statistics.median(cold) - statistics.median(warm)))


def shape_row(name: str, args) -> dict:
    """One shape's CPU table, link, handoff and verdict."""
    hidden, intermediate, top_k, num_experts = SHAPES[name]
    shape = ExpertShape(hidden_size=hidden, intermediate_size=intermediate)
    section, tables = cpu_experts_profile(shape, num_threads=args.threads, tokens=tuple(args.tokens),
                                          pool_bytes=args.pool_mib * 2**20, repeats=args.repeats)
    expert_bytes = 2 * shape.num_params  # the checkpoint's bf16 bytes cross the link
    on_gpu = torch.cuda.is_available()
    copy_ms = link_ms_per_expert(expert_bytes) if on_gpu else 1e3 * expert_bytes / (args.link_gb_per_s * 1e9)
    routed_ms = copy_ms / ROUTED_FETCH_EFFICIENCY
    handoff = handoff_ms(hidden, top_k) if on_gpu else None
    wake = wake_ms(section.threads)
    missed = args.missed if args.missed is not None else float(top_k)
    split = decode_split(num_tokens=1, top_k=top_k, num_experts=num_experts, num_missed=missed,
                         expert_bytes=expert_bytes, expert_params=shape.num_params,
                         routed_fetch_bytes_per_s=1e3 * expert_bytes / routed_ms, cpu=section, compute_ms=0.0,
                         handoff_ms=CPU_HANDOFF_MS if handoff is None else handoff + wake)
    verdict = {tokens: {"cpu_ms": cpu_expert_ms(section, shape.num_params, tokens),
                        "over_link": cpu_expert_ms(section, shape.num_params, tokens) / routed_ms}
               for tokens in args.tokens}
    for row in verdict.values():
        row["within_factor"] = row["over_link"] <= CPU_WITHIN_LINK_FACTOR
    return {"shape": name, "hidden_size": hidden, "intermediate_size": intermediate, "expert_bytes": expert_bytes,
            "threads": section.threads, "cpu_ms_per_expert": tables, "profile_section_dtype": section.dtype,
            "fitted": {"weight_bytes_per_s": section.weight_bytes_per_s, "flops_per_s": section.flops_per_s,
                       "overhead_us": section.overhead_us},
            "link": {"measured": on_gpu, "copy_ms_per_expert": copy_ms, "routed_ms_per_expert": routed_ms},
            "handoff_ms": handoff, "wake_ms": wake, "verdict": verdict,
            "split": {"missed": missed, "cpu_experts": split.cpu_experts, "stall_ms": split.stall_ms,
                      "fetch_only_stall_ms": split.fetch_only_stall_ms, "declined": split.declined}}


def report(rows: list[dict], device: str) -> list[str]:
    """The table printed on stdout."""
    lines = [f"CPU experts against the link on {device} ({torch.get_num_threads()} torch threads by default)",
             f"| shape | dtype | tokens | CPU ms | routed link ms | CPU / link | within {CPU_WITHIN_LINK_FACTOR:g}x |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        for tokens, figures in row["verdict"].items():
            lines.append(f"| {row['shape']} | {row['profile_section_dtype']} | {tokens} | {figures['cpu_ms']:.3f} | "
                         f"{row['link']['routed_ms_per_expert']:.4g} | {figures['over_link']:.2f} | "
                         f"{'yes' if figures['within_factor'] else 'no'} |")
        split = row["split"]
        outcome = split["declined"] or (f"{split['cpu_experts']:.2f} on the CPU, stall {split['stall_ms']:.3f} ms "
                                        f"against {split['fetch_only_stall_ms']:.3f} fetch-only")
        lines.append(f"{row['shape']}: {split['missed']:g} missed at one token: {outcome}")
    return lines


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if any(tokens < 1 for tokens in args.tokens) or (args.threads is not None and args.threads < 1):
        print("error: --tokens and --threads take whole numbers from 1", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (link rate assumed)"
    rows = []
    for name in args.shapes:
        rows.append(shape_row(name, args))
        (args.out / "bench_cpu_experts.json").write_text(json.dumps(
            {"device": device, "dtypes": list(CPU_DTYPES), "rows": rows}, indent=2) + "\n")
    print("\n".join(report(rows, device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
