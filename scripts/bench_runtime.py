"""Runtime benchmark on a CUDA GPU: all-resident vs the plan vs Accelerate vs the physical floor.

A Qwen3-8B-shaped model (random bf16 weights written to a local checkpoint) at three budgets (about 75%,
50% and 25% of its layer bytes on the GPU) and two prefill workloads, side by side in one run. The floor is
max(all-resident step, offloaded bytes per step / pinned H2D bandwidth measured in this run). Every plan's
logits are checked bitwise against the all-resident model's.

Run from the repository root, on a machine with a CUDA GPU (writes bench.md, bench.json and calibrated.yaml
into --out, default $OUT or /tmp/bench; the table is printed last):

    PYTHONPATH=. python3 scripts/bench_runtime.py [--out DIR] [--no-accelerate]

Recorded results: benchmarks/2026-11-23-prefill-h100.md.
"""

import datetime
import json
import statistics
from pathlib import Path

import torch

from runtime.backend import CudaBackend
from runtime.timing import forward_step, time_steps
from scripts.benchmarking import (checkpoint_parser, free, log, pinned_h2d_bytes_per_s, plan_for, write_calibrated,
                                  write_random_checkpoint, write_report)
from runtime.load import build_model
from runtime.placement import apply_plan

BUDGET_SHARES = (0.75, 0.5, 0.25)
TOKENS = (2048, 8192)
NUM_STEPS = 8
NUM_ACCELERATE_STEPS = 3


def inputs_for(tokens: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(tokens)
    return torch.randint(0, vocab, (1, tokens), generator=generator).cuda()


def timed(model, input_ids, num_steps: int) -> tuple[float, torch.Tensor]:
    """(median step ms, logits) after one warm-up step."""
    with torch.inference_mode():
        logits = forward_step(model, input_ids).float().cpu()
        forward_step(model, input_ids)
        step_ms = statistics.median(time_steps(model, input_ids, num_steps))
    return step_ms, logits


def copy_stats(model, engine, input_ids):
    """The engine's copy statistics over two steps timed copy by copy (timing adds events, so it stays off while
    step times are taken)."""
    engine.take_stats()
    engine.timing = True
    with torch.inference_mode():
        time_steps(model, input_ids, 2)
    engine.timing = False
    return engine.take_stats()


def run_accelerate(checkpoint: Path, offloaded: tuple[int, ...], num_layers: int, input_ids) -> float:
    """Accelerate's dispatch_model with the plan's offloaded layers on "cpu" (its synchronous hooks)."""
    from accelerate import dispatch_model

    model = build_model(str(checkpoint), None)
    device_map = {"model.embed_tokens": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0}
    device_map.update({f"model.layers.{i}": ("cpu" if i in offloaded else 0) for i in range(num_layers)})
    model = dispatch_model(model, device_map=device_map, main_device=0)
    step_ms, _ = timed(model, input_ids, NUM_ACCELERATE_STEPS)
    del model
    free()
    return step_ms


def parser():
    """--out, --checkpoint, --config, --no-accelerate."""
    result = checkpoint_parser("/tmp/bench")
    result.add_argument("--no-accelerate", action="store_true", help="skip Accelerate's dispatch_model column")
    return result


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    write_random_checkpoint(args.config, args.checkpoint)
    log("checkpoint ready")
    h2d = pinned_h2d_bytes_per_s()
    log(f"pinned H2D {h2d / 1e9:.1f} GB/s (best single copy)")
    calibrated_path = write_calibrated(args.out)
    rows = []
    baseline_bytes = torch.cuda.memory_allocated()
    resident = build_model(str(args.checkpoint), None).cuda()
    resident_weights_bytes = torch.cuda.memory_allocated() - baseline_bytes
    vocab = resident.config.vocab_size
    reference, activation_bytes = {}, {}
    for tokens in TOKENS:
        torch.cuda.reset_peak_memory_stats()
        reference[tokens] = timed(resident, inputs_for(tokens, vocab), NUM_STEPS)
        activation_bytes[tokens] = torch.cuda.max_memory_allocated() - baseline_bytes - resident_weights_bytes
        log(f"resident {tokens} tokens: {reference[tokens][0]:.2f} ms, "
            f"activations {activation_bytes[tokens] / 2**30:.2f} GiB")
    del resident
    free()
    from planner.source.checkpoint import load_checkpoint
    from planner.model.layout import build_layout

    layout = build_layout(load_checkpoint(str(args.checkpoint)))
    for share in BUDGET_SHARES:
        for tokens in TOKENS:
            plan = plan_for(args.checkpoint, share, tokens, layout, str(calibrated_path), measure=True)
            estimated = plan_for(args.checkpoint, share, tokens, layout, "h100-sxm", measure=False)
            model = build_model(str(args.checkpoint), None)
            baseline_bytes = torch.cuda.memory_allocated()  # cuBLAS workspaces of earlier runs live here
            engine = apply_plan(model, plan, CudaBackend(torch.device("cuda")))
            torch.cuda.synchronize()
            weights_bytes = torch.cuda.memory_allocated() - baseline_bytes
            torch.cuda.reset_peak_memory_stats()
            input_ids = inputs_for(tokens, vocab)
            step_ms, logits = timed(model, input_ids, NUM_STEPS)
            peak_bytes = torch.cuda.max_memory_allocated() - baseline_bytes
            stats = copy_stats(model, engine, input_ids)
            engine.close()
            del model, engine
            free()
            accelerate_ms = None
            if not args.no_accelerate:
                accelerate_ms = run_accelerate(args.checkpoint, plan.offload.layers, len(layout.layers), input_ids)
            resident_ms = reference[tokens][0]
            floor_ms = max(resident_ms, 1e3 * plan.prediction.copy_bytes_per_step / h2d)
            rows.append({
                "tokens": tokens, "share": share, "offloaded": len(plan.offload.layers),
                "prefetch": plan.offload.prefetch_step, "budget_bytes": plan.memory.budget_bytes,
                "resident_ms": resident_ms, "floor_ms": floor_ms, "plan_ms": step_ms,
                "predicted_ms": plan.prediction.step_ms, "accelerate_ms": accelerate_ms,
                "resident_predicted_ms": plan.prediction.resident_step_ms,
                "estimated_plan_predicted_ms": estimated.prediction.step_ms,
                "estimated_plan_same_layers": estimated.offload.layers == plan.offload.layers
                and estimated.offload.prefetch_step == plan.offload.prefetch_step,
                "weights_gpu_bytes": weights_bytes, "peak_gpu_bytes": peak_bytes,
                "resident_activation_bytes": activation_bytes[tokens],
                "stall_ms": stats.stall_ms / 2,
                "link_gb_per_s": stats.bytes_copied / stats.copy_ms / 1e6 if stats.copy_ms else 0,
                "bitwise_equal": bool(torch.equal(logits, reference[tokens][1])),
            })
            log(json.dumps(rows[-1]))
    report(rows, h2d, args.out, torch.cuda.get_device_name())


def report(rows, h2d, out: Path, device_name: str) -> None:
    """bench.md and bench.json in ``out``, and the table on stdout."""
    header = (f"{datetime.date.today()} {device_name}, torch {torch.__version__}, "
              f"pinned H2D {h2d / 1e9:.1f} GB/s, Qwen3-8B shape bf16, prefill steps (1 x tokens); plans made with "
              f"the calibrated profile and measured layer times (make --measure)")
    lines = [header, "",
             "| tokens | GPU share | offloaded/P | resident ms (predicted) | floor ms | plan ms | plan/floor | "
             "predicted ms | error | roofline-plan predicted ms | Accelerate ms | Accel/plan | "
             "weights GiB / budget GiB | peak GiB (resident's activations) | stall ms | link GB/s | bitwise |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        accelerate = f"{r['accelerate_ms']:.1f}" if r["accelerate_ms"] else "-"
        ratio = f"{r['accelerate_ms'] / r['plan_ms']:.1f}x" if r["accelerate_ms"] else "-"
        lines.append(
            f"| {r['tokens']} | {r['share']:.0%} | {r['offloaded']}/{r['prefetch']} | {r['resident_ms']:.1f} "
            f"({r['resident_predicted_ms']:.1f}) | "
            f"{r['floor_ms']:.1f} | {r['plan_ms']:.1f} | {r['plan_ms'] / r['floor_ms']:.3f} | "
            f"{r['predicted_ms']:.1f} | "
            f"{(r['predicted_ms'] - r['plan_ms']) / r['plan_ms']:+.1%} | {r['estimated_plan_predicted_ms']:.1f}"
            f"{'' if r['estimated_plan_same_layers'] else ' (other layers)'} | "
            f"{accelerate} | {ratio} | {r['weights_gpu_bytes'] / 2**30:.2f} / {r['budget_bytes'] / 2**30:.2f} | "
            f"{r['peak_gpu_bytes'] / 2**30:.2f} ({r['resident_activation_bytes'] / 2**30:.2f}) | "
            f"{r['stall_ms']:.1f} | {r['link_gb_per_s']:.1f} | {r['bitwise_equal']} |")
    write_report(out, header, lines, rows)


if __name__ == "__main__":
    main()
