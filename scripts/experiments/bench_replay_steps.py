"""How many decode steps one CUDA-graph replay should run, and where its wrapped copies go: an interleaved A/B.

    PYTHONPATH=. python3 scripts/experiments/bench_replay_steps.py --out DIR [--batches 64] [--steps 1 4]
        [--joined] [--rounds 6]                                         # on a machine with a GPU

One offloaded Qwen3-8B-shaped model (random weights, the plan bench_decode.py picks at batch 16-64: 21 layers
offloaded, G=5, K=3, depth 2), one DecodeLoop per arm (eager, and graphed with each steps-per-replay count,
the wrapped copies split as the plan says; with ``--joined`` also every wrapped copy joined at the replay's
end, as before offload.replay_start_copies), all on the same engine. Each round times every arm once (24
steps), in an order that alternates between rounds, so a link whose rate drifts during the run moves every
arm alike. Prints each arm's median over the rounds, its spread, and each round's figures.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from runtime.backend import CudaBackend
from runtime.timing import random_ids
from scripts.benchmarking import (CONTEXT_TOKENS, NUM_ARM_STEPS, arm_loops, arms_for, checkpoint_parser,
                                  deterministic_decode, free, log, pinned_h2d_bytes_per_s, pinned_plan, time_arm,
                                  write_random_checkpoint)
from runtime.load import build_model
from runtime.placement import apply_plan

def run_batch(checkpoint: Path, batch: int, steps: list[int], joined: bool, rounds: int) -> dict:
    plan = pinned_plan(checkpoint, batch)
    model = build_model(str(checkpoint), None)
    engine = apply_plan(model, plan, CudaBackend(torch.device("cuda")))
    prompt = random_ids(model, (batch, CONTEXT_TOKENS), torch.device("cuda"), seed=batch)
    loops = arm_loops(model, engine, batch, prompt, arms_for(plan, steps, joined))
    arms = list(loops)
    per_round = {arm.name: [] for arm in arms}
    for index in range(rounds):
        for arm in arms if index % 2 == 0 else arms[::-1]:
            per_round[arm.name].append(time_arm(arm, loops[arm], engine))
        log(f"batch {batch} round {index}: " + ", ".join(f"{n} {v[-1]:.2f}" for n, v in per_round.items()))
    result = {"batch": batch, "copy_bytes_per_step": engine.copy_bytes_per_step, "offloaded": list(plan.offload.layers),
              "replay_start_copies": plan.offload.replay_start_copies, "rounds": per_round}
    engine.set_graph_mode(False)
    engine.close()
    del loops, model, engine
    free()
    return result


def report(results: list[dict], h2d: float) -> str:
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, best pinned H2D {h2d / 1e9:.1f} GB/s; "
             f"ms per decode step, median over rounds (min-max); {NUM_ARM_STEPS} steps per arm per round", ""]
    names = list(results[0]["rounds"])
    lines += ["| batch | link ms | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in results:
        cells = [f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in r["rounds"].values()]
        lines.append(f"| {r['batch']} | {1e3 * r['copy_bytes_per_step'] / h2d:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = checkpoint_parser("/tmp/bench-replay-steps")
    parser.add_argument("--batches", type=int, nargs="+", default=[64])
    # one KV cache per arm: eager and four graphed arms at batch 64 ran out of the H100's memory
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--joined", action="store_true",
                        help="also time graphed arms with every wrapped copy joined at the replay's end")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    bad = [count for count in args.steps if NUM_ARM_STEPS % count]
    if bad:
        parser.error(f"--steps {bad} must divide {NUM_ARM_STEPS}")
    deterministic_decode()  # as bench_decode.py, so figures compare
    args.out.mkdir(parents=True, exist_ok=True)
    write_random_checkpoint(args.config, args.checkpoint)
    h2d = pinned_h2d_bytes_per_s()
    results = []
    for batch in args.batches:
        results.append(run_batch(args.checkpoint, batch, args.steps, args.joined, args.rounds))
        (args.out / "replay_steps.json").write_text(json.dumps(results, indent=1))
        (args.out / "replay_steps.md").write_text(report(results, h2d))
    print(report(results, h2d))


if __name__ == "__main__":
    main()
