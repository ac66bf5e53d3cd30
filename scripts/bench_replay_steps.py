"""How many decode steps one CUDA-graph replay should run, and where its wrapped copies go: an interleaved A/B.

    PYTHONPATH=. python3 scripts/bench_replay_steps.py --out DIR [--batches 64] [--steps 1 4] [--joined]
        [--rounds 6]                                                    # on a machine with a GPU

One offloaded Qwen3-8B-shaped model (random weights, the plan bench_decode.py picks at batch 16-64: 21 layers
offloaded, G=5, K=3, depth 2), one DecodeLoop per arm (eager, and graphed with each steps-per-replay count,
the wrapped copies split as the plan says; with ``--joined`` also every wrapped copy joined at the replay's
end, as before offload.replay_start_copies), all on the same engine. Each round times every arm once (24
steps), in an order that alternates between rounds, so a link whose rate drifts during the run moves every
arm alike. Prints each arm's median over the rounds, its spread, and each round's figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
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


def pinned_plan(checkpoint: Path, batch: int, shape: tuple[int, int, int] = PLAN_SHAPE):
    """The plan with bench_decode's usual shape (or ``shape``) pinned, so every batch copies the same bytes."""
    group_size, num_in_group, prefetch_step = shape
    inputs = Inputs(model=str(checkpoint), revision=None, gpu="h100-sxm", budget="60GiB", trigger=None,
                    tokens=batch, sequences=batch, context=CONTEXT_TOKENS, params=(), stack=None,
                    group_size=group_size, num_in_group=num_in_group, prefetch_step=prefetch_step, cuda_graph=True)
    return make_plan(inputs).plan


@dataclass(frozen=True)
class Arm:
    """One way to run the decode steps: eagerly (``replay_start_copies`` None) or graphed."""

    name: str
    steps_per_call: int = 1
    replay_start_copies: int | None = None


def arms_for(plan, steps: list[int], joined: bool) -> list[Arm]:
    """Eager, then graphed with each replay length as the plan splits the wrapped copies and (``joined``) with
    all of them joined at the replay's end, where the plan splits them otherwise."""
    count = plan.offload.replay_start_copies
    arms = [Arm("eager")] + [Arm(f"graphed x{n}", n, count) for n in steps]
    if joined and count:
        arms += [Arm(f"graphed x{n} joined", n, 0) for n in steps]
    return arms


def enter(arm: Arm, engine) -> None:
    """Put the engine in the arm's mode; through eager mode, which makes any copy a replay left pending."""
    engine.set_graph_mode(False)
    if arm.replay_start_copies is not None:
        engine.set_replay_start_copies(arm.replay_start_copies)
        engine.set_graph_mode(True)


def arm_loops(model, engine, batch: int, prompt, arms: list[Arm]) -> dict[Arm, DecodeLoop]:
    """One loop per arm, each with its own KV cache, all prefilled eagerly (graph mode off: an eager forward
    in graph mode would leave its wrapped copies unjoined), then the graphed arms captured."""
    tokens = cache_tokens_for(CONTEXT_TOKENS + 4 * NUM_TIMED_STEPS)
    engine.set_graph_mode(False)
    loops = {}
    for arm in arms:
        loops[arm] = DecodeLoop(model, batch=batch, max_cache_tokens=tokens, device=torch.device("cuda"),
                                engine=engine, steps_per_call=arm.steps_per_call)
        loops[arm].prefill(prompt)
    for arm, loop in loops.items():
        if arm.replay_start_copies is not None:
            enter(arm, engine)
            loop.capture()
    engine.set_graph_mode(False)
    return loops


def time_arm(arm: Arm, loop: DecodeLoop, engine) -> float:
    """Median ms per step of NUM_TIMED_STEPS back-to-back steps; the loop's cache is put back afterwards."""
    enter(arm, engine)
    saved = loop.save_state()
    loop.timed_steps(loop.steps_per_call)  # one call first: leaves the link and clocks as the others find them
    step_ms = statistics.median(loop.timed_steps(NUM_TIMED_STEPS))
    loop.restore_state(saved)
    return step_ms


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
             f"ms per decode step, median over rounds (min-max); {NUM_TIMED_STEPS} steps per arm per round", ""]
    names = list(results[0]["rounds"])
    lines += ["| batch | link ms | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in results:
        cells = [f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in r["rounds"].values()]
        lines.append(f"| {r['batch']} | {1e3 * r['copy_bytes_per_step'] / h2d:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def model_parser(default_out: str) -> argparse.ArgumentParser:
    """--out, and the random Qwen3-8B-shaped checkpoint (written on first use) this script and trace_decode.py
    share."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(default_out))
    parser.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3-8b-random"))
    parser.add_argument("--config", type=Path,
                        default=Path(__file__).resolve().parent.parent / "examples/qwen3-8b/config.json")
    return parser


def main() -> None:
    parser = model_parser("/tmp/bench-replay-steps")
    parser.add_argument("--batches", type=int, nargs="+", default=[64])
    # one KV cache per arm: eager and four graphed arms at batch 64 ran out of the H100's memory
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--joined", action="store_true",
                        help="also time graphed arms with every wrapped copy joined at the replay's end")
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
        results.append(run_batch(args.checkpoint, batch, args.steps, args.joined, args.rounds))
        (args.out / "replay_steps.json").write_text(json.dumps(results, indent=1))
        (args.out / "replay_steps.md").write_text(report(results, h2d))
    print(report(results, h2d))


if __name__ == "__main__":
    main()
