"""How many decode steps one CUDA-graph replay should run: an interleaved A/B on a CUDA GPU.

    PYTHONPATH=. python3 scripts/bench_replay_steps.py --out DIR [--batches 64] [--steps 1 4] [--rounds 6]

One offloaded Qwen3-8B-shaped model (random weights, the plan bench_decode.py picks at batch 16-64: 21 layers
offloaded, G=5, K=3, depth 2), one DecodeLoop per arm (eager, and graphed with each steps-per-replay count),
all on the same engine. Each round times every arm once (24 steps), in an order that alternates between
rounds, so a link whose rate drifts during the run moves every arm alike. Prints each arm's median over the
rounds, its spread, and each round's figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_decode import CONTEXT_TOKENS  # noqa: E402
from bench_runtime import free, log, pinned_h2d_bytes_per_s, write_random_checkpoint  # noqa: E402
from planner.make import Inputs, make_plan  # noqa: E402
from runtime.backend import CudaBackend  # noqa: E402
from runtime.bench import random_ids  # noqa: E402
from runtime.graph import DecodeLoop, cache_tokens_for  # noqa: E402
from runtime.load import apply_plan, build_model  # noqa: E402

NUM_TIMED_STEPS = 24  # divisible by every steps-per-replay count tried
PLAN_SHAPE = (5, 3, 2)  # group size, offloaded per group, prefetch depth


def pinned_plan(checkpoint: Path, batch: int):
    """The plan with bench_decode's usual shape pinned, so every batch copies the same bytes."""
    group_size, num_in_group, prefetch_step = PLAN_SHAPE
    inputs = Inputs(model=str(checkpoint), revision=None, gpu="h100-sxm", budget="60GiB", trigger=None,
                    tokens=batch, sequences=batch, context=CONTEXT_TOKENS, params=(), stack=None,
                    group_size=group_size, num_in_group=num_in_group, prefetch_step=prefetch_step, cuda_graph=True)
    return make_plan(inputs).plan


def arm_loops(model, engine, batch: int, prompt, steps: list[int]) -> dict[str, DecodeLoop]:
    """One loop per arm, each with its own KV cache, all prefilled eagerly (graph mode off: an eager forward
    in graph mode would leave its wrapped copies unjoined), then the graphed arms captured."""
    tokens = cache_tokens_for(CONTEXT_TOKENS + 4 * NUM_TIMED_STEPS)
    engine.set_graph_mode(False)
    loops = {}
    for name, count in [("eager", 1)] + [(f"graphed x{count}", count) for count in steps]:
        loops[name] = DecodeLoop(model, batch=batch, max_cache_tokens=tokens, device=torch.device("cuda"),
                                 engine=engine, steps_per_call=count)
        loops[name].prefill(prompt)
    for name, loop in loops.items():
        if name != "eager":
            loop.capture()
    return loops


def time_arm(name: str, loop: DecodeLoop, engine) -> float:
    """Median ms per step of NUM_TIMED_STEPS back-to-back steps; the loop's cache is put back afterwards."""
    engine.set_graph_mode(name != "eager")
    saved = loop.save_state()
    loop.timed_steps(loop.steps_per_call)  # one call first: leaves the link and clocks as the others find them
    step_ms = statistics.median(loop.timed_steps(NUM_TIMED_STEPS))
    loop.restore_state(saved)
    return step_ms


def run_batch(checkpoint: Path, batch: int, steps: list[int], rounds: int) -> dict:
    plan = pinned_plan(checkpoint, batch)
    model = build_model(str(checkpoint), None)
    engine = apply_plan(model, plan, CudaBackend(torch.device("cuda")))
    prompt = random_ids(model, (batch, CONTEXT_TOKENS), torch.device("cuda"), seed=batch)
    loops = arm_loops(model, engine, batch, prompt, steps)
    names = list(loops)
    per_round = {name: [] for name in names}
    for index in range(rounds):
        order = names if index % 2 == 0 else names[::-1]
        for name in order:
            per_round[name].append(time_arm(name, loops[name], engine))
        log(f"batch {batch} round {index}: " + ", ".join(f"{n} {per_round[n][-1]:.2f}" for n in names))
    result = {"batch": batch, "copy_bytes_per_step": engine.copy_bytes_per_step, "offloaded": list(plan.offload.layers),
              "rounds": per_round}
    engine.set_graph_mode(False)
    engine.close()
    del loops, model, engine
    free()
    return result


def report(results: list[dict], h2d: float) -> str:
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, best pinned H2D {h2d / 1e9:.1f} GB/s; "
             f"ms per decode step, median over rounds (min-max); {NUM_TIMED_STEPS} steps per arm per round", ""]
    names = list(results[0]["rounds"])
    lines += ["| batch | link ms | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in results:
        cells = [f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in r["rounds"].values()]
        lines.append(f"| {r['batch']} | {1e3 * r['copy_bytes_per_step'] / h2d:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-replay-steps"))
    parser.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3-8b-random"))
    parser.add_argument("--config", type=Path,
                        default=Path(__file__).resolve().parent.parent / "examples/qwen3-8b/config.json")
    parser.add_argument("--batches", type=int, nargs="+", default=[64])
    # one KV cache per arm: eager and four graphed arms at batch 64 ran out of the H100's memory
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    bad = [count for count in args.steps if NUM_TIMED_STEPS % count]
    if bad:
        parser.error(f"--steps {bad} must divide {NUM_TIMED_STEPS}")
    torch.use_deterministic_algorithms(True, warn_only=True)  # as bench_decode.py, so figures compare
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cuda.enable_cudnn_sdp(False)
    args.out.mkdir(parents=True, exist_ok=True)
    write_random_checkpoint(args.config, args.checkpoint)
    h2d = pinned_h2d_bytes_per_s()
    results = []
    for batch in args.batches:
        results.append(run_batch(args.checkpoint, batch, args.steps, args.rounds))
        (args.out / "replay_steps.json").write_text(json.dumps(results, indent=1))
        (args.out / "replay_steps.md").write_text(report(results, h2d))
    print(report(results, h2d))


if __name__ == "__main__":
    main()
