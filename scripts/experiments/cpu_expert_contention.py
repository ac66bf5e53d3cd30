"""Why a CPU expert inside a model's decode step costs about twice calibrate's lone figure (issue 37: 0.318 ms a
pair in a Qwen3-30B-A3B-shaped step on the H200 host, calibrate's 0.175 ms at one token): host memory shared with
the link, the pool calibrate reads, or the OpenMP team's wake-up between layers.

    PYTHONPATH=. python3 scripts/experiments/cpu_expert_contention.py [--threads 12] [--tokens 1 4]

Arms, each the C kernel's ms for one bf16 H 2048 x I 768 expert (runtime.cpu_experts.cpu_expert_ms's loop):

- ``pool``: calibrate's pool (CALIBRATION_POOL_BYTES) against 1 and 2 GiB pools (past any last-level cache);
- ``copying``: the 1 GiB pool while the copy engine streams pinned host memory to the GPU on a side stream, and
  the copy's GB/s alone and while the CPU computes (host memory read by both at once);
- ``gaps``: the 1 GiB pool, two experts at a time with a 0.35 ms idle gap between (a layer's GPU work between two
  host steps), timing the experts only.

Prints one JSON object and a table.
"""

import argparse
import json
import statistics
import threading
import time

import torch

from runtime.cpu_experts import CALIBRATION_POOL_BYTES, ExpertShape, cpu_threads, random_experts

SHAPE = ExpertShape(hidden_size=2048, intermediate_size=768)
EXPERT_BYTES = SHAPE.num_params * 2
GiB = 2**30


def experts_for(pool_bytes: int):
    return random_experts(SHAPE, max(2, pool_bytes // EXPERT_BYTES), "bf16")


def expert_ms(experts, tokens: int, threads: int, passes: int = 5, gap_s: float = 0.0, group: int = 2) -> float:
    """Median over passes of ms per expert, every pool expert once per pass; with ``gap_s``, an idle gap after
    each ``group`` experts, not timed."""
    hidden = torch.randn(tokens, SHAPE.hidden_size, dtype=torch.bfloat16)
    per_pass = []
    with cpu_threads(threads), torch.inference_mode():
        for expert in range(experts.num_experts):  # one untimed pass
            experts.expert(expert, hidden)
        for _ in range(passes):
            spent = 0.0
            for expert in range(experts.num_experts):
                start = time.perf_counter()
                experts.expert(expert, hidden)
                spent += time.perf_counter() - start
                if gap_s and expert % group == group - 1:
                    until = time.perf_counter() + gap_s
                    while time.perf_counter() < until:
                        time.sleep(0)
            per_pass.append(spent)
    return 1e3 * statistics.median(per_pass) / experts.num_experts


class Copier:
    """The copy engine streaming a pinned host buffer to the GPU, back to back, on a side stream, in a thread."""

    def __init__(self, num_bytes: int = GiB):
        self.source = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        self.target = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.stop = threading.Event()
        self.bytes_copied = 0
        self.seconds = 0.0

    def _loop(self):
        start = time.perf_counter()
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                for _ in range(4):
                    self.target.copy_(self.source, non_blocking=True)
                self.stream.synchronize()
                self.bytes_copied += 4 * self.source.numel()
        self.seconds = time.perf_counter() - start

    def __enter__(self):
        self.thread = threading.Thread(target=self._loop)
        self.thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    @property
    def gb_per_s(self) -> float:
        return self.bytes_copied / self.seconds / 1e9


def copy_alone_gb_per_s(seconds: float = 1.0) -> float:
    with Copier() as copier:
        time.sleep(seconds)
    return copier.gb_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[12])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    result = {"copy_alone_gb_per_s": copy_alone_gb_per_s(), "arms": []}
    pools = {"calibrate": CALIBRATION_POOL_BYTES, "1GiB": GiB, "2GiB": 2 * GiB}
    experts = {name: experts_for(size) for name, size in pools.items()}
    for threads in args.threads:
        for tokens in args.tokens:
            for name in pools:
                result["arms"].append({"arm": f"pool {name}", "threads": threads, "tokens": tokens,
                                       "ms": expert_ms(experts[name], tokens, threads)})
            with Copier() as copier:
                ms = expert_ms(experts["1GiB"], tokens, threads)
            result["arms"].append({"arm": "1GiB while copying", "threads": threads, "tokens": tokens, "ms": ms,
                                   "copy_gb_per_s": copier.gb_per_s})
            result["arms"].append({"arm": "1GiB, 2 then a 0.35 ms gap", "threads": threads, "tokens": tokens,
                                   "ms": expert_ms(experts["1GiB"], tokens, threads, gap_s=0.35e-3)})
            with Copier() as copier:
                ms = expert_ms(experts["1GiB"], tokens, threads, gap_s=0.35e-3)
            result["arms"].append({"arm": "gaps while copying", "threads": threads, "tokens": tokens, "ms": ms,
                                   "copy_gb_per_s": copier.gb_per_s})
    print(json.dumps(result))
    print(f"copy alone: {result['copy_alone_gb_per_s']:.1f} GB/s")
    print("| arm | threads | tokens | ms/expert | CPU GB/s | copy GB/s |")
    print("|---|---|---|---|---|---|")
    for arm in result["arms"]:
        print(f"| {arm['arm']} | {arm['threads']} | {arm['tokens']} | {arm['ms']:.3f} | "
              f"{EXPERT_BYTES / arm['ms'] / 1e6:.1f} | {arm.get('copy_gb_per_s', float('nan')):.1f} |")


if __name__ == "__main__":
    main()
