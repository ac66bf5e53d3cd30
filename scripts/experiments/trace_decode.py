"""Where a graphed offloaded decode step loses time against the eager one: a torch.profiler trace of each.

    PYTHONPATH=. python3 scripts/experiments/trace_decode.py --out DIR [--batch 64] [--shape 5 3 2] [--steps 1 4]
        [--label NAME]                                                  # on a machine with a GPU

Builds the model and plan of bench_replay_steps.py (scripts.benchmarking) (Qwen3-8B shape, random bf16
weights), prefills an eager loop,
a graphed one (one step per replay, the wrapped copies split as the plan says) and, if the plan leaves some
to the replay's start, a graphed one that joins them all at its end; times 24 steps of each, then traces a
few steps of each and prints,
per step: the link's busy and idle time between weight copies, the rate while copying, and the kernel time
that ran while the link sat idle (runtime.timeline). Run it under different environments (say
CUDA_DEVICE_MAX_CONNECTIONS) with ``--label`` to tell the runs apart; each writes DIR/trace_LABEL.json.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from runtime.backend import CudaBackend
from runtime.timing import random_ids
from scripts.benchmarking import (CONTEXT_TOKENS, NUM_ARM_STEPS, PLAN_SHAPE, arm_loops, arms_for, checkpoint_parser,
                                  deterministic_decode, enter, pinned_plan, time_arm, write_random_checkpoint)
from runtime.graph import calls_for
from runtime.load import build_model
from runtime.placement import apply_plan
from runtime.timeline import summarize

NUM_TRACED_STEPS = 4


def traced_events(loop, engine, arm, trace_path: Path) -> list[dict]:
    """Kineto's Chrome-trace events of NUM_TRACED_STEPS back-to-back steps (after one untraced call)."""
    from torch.profiler import ProfilerActivity, profile

    enter(arm, engine)
    saved = loop.save_state()
    loop.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls_for(NUM_TRACED_STEPS, loop.steps_per_call)):
            loop.step()
        torch.cuda.synchronize()
    loop.restore_state(saved)
    prof.export_chrome_trace(str(trace_path))
    events = json.loads(trace_path.read_text())["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    trace_path.write_text(json.dumps(gpu))  # the GPU side only: small enough to bring back
    return gpu


def main() -> None:
    parser = checkpoint_parser("/tmp/trace-decode")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--shape", type=int, nargs=3, default=list(PLAN_SHAPE),
                        help="group size, offloaded per group, prefetch depth")
    parser.add_argument("--steps", type=int, nargs="+", default=[1], choices=[1, 2, 4],
                        help="steps per replay of the graphed arms")
    parser.add_argument("--label", default="default")
    args = parser.parse_args()
    deterministic_decode()  # as the other decode benchmarks
    args.out.mkdir(parents=True, exist_ok=True)
    write_random_checkpoint(args.config, args.checkpoint)
    plan = pinned_plan(args.checkpoint, args.batch, tuple(args.shape))
    model = build_model(str(args.checkpoint), None)
    engine = apply_plan(model, plan, CudaBackend(torch.device("cuda")))
    prompt = random_ids(model, (args.batch, CONTEXT_TOKENS), torch.device("cuda"), seed=args.batch)
    loops = arm_loops(model, engine, args.batch, prompt, arms_for(plan, args.steps, joined=True))
    rows = {}
    for arm, loop in loops.items():
        name = arm.name
        step_ms = time_arm(arm, loop, engine)
        events = traced_events(loop, engine, arm, args.out / f"trace_{args.label}_{name.replace(' ', '_')}.json")
        try:
            summary = summarize(events, NUM_TRACED_STEPS)
        except ValueError as error:  # say what the trace did hold, for whoever reads the output
            memcpys = sorted({(e["name"], tuple(e.get("args", {}))) for e in events if e["cat"] == "gpu_memcpy"})
            sys.exit(f"{name}: {error}; memcpy events seen: {memcpys[:5]}")
        rows[name] = {"timed_step_ms": step_ms, **dataclasses.asdict(summary)}
    engine.set_graph_mode(False)
    (args.out / f"trace_{args.label}.json").write_text(json.dumps(rows, indent=1))
    print(f"{args.label}: batch {args.batch}, shape {tuple(args.shape)}, {engine.copy_bytes_per_step / 1e9:.2f} GB "
          f"per step, replay_start_copies {plan.offload.replay_start_copies}; {NUM_ARM_STEPS} timed steps, "
          f"{NUM_TRACED_STEPS} traced; ms per step")
    keys = list(next(iter(rows.values())))
    print("| arm | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[k]:.2f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
