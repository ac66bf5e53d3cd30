"""Runtime benchmark on a CUDA GPU: all-resident vs the plan vs Accelerate vs the physical floor.

A Qwen3-8B-shaped model (random bf16 weights written to a local checkpoint) at three budgets (about 75%,
50% and 25% of its layer bytes on the GPU) and two prefill workloads, side by side in one run. The floor is
max(all-resident step, offloaded bytes per step / pinned H2D bandwidth measured in this run). Every plan's
logits are checked bitwise against the all-resident model's.

    PYTHONPATH=. python3 scripts/bench_runtime.py --out /tmp/bench      # on a machine with a GPU
"""

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from header_checkpoint import tensor_specs  # noqa: E402
from planner.make import make_plan  # noqa: E402
from planner.plan import Inputs  # noqa: E402
from runtime.bench import forward_step, time_steps  # noqa: E402
from runtime.load import apply_plan, build_model  # noqa: E402
from runtime.backend import CudaBackend  # noqa: E402
from runtime.calibrate import median_event_ms  # noqa: E402
from runtime.measure import measured_compute  # noqa: E402

BUDGET_SHARES = (0.75, 0.5, 0.25)
TOKENS = (2048, 8192)
NUM_STEPS = 8
NUM_ACCELERATE_STEPS = 3


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_random_checkpoint(config_path: Path, folder: Path) -> None:
    """Random bf16 weights (std 0.02, norms 1) with the real names and shapes, in 4 GiB shards."""
    from safetensors.torch import save_file

    if (folder / "model.safetensors.index.json").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config_path.read_text())
    generator = torch.Generator(device="cuda").manual_seed(0)
    shards, current, size, weight_map = [], {}, 0, {}
    for name, _, shape in tensor_specs(config_path, "BF16"):
        if "norm" in name:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator, device="cuda") * 0.02).to(torch.bfloat16).cpu()
        current[name] = tensor
        size += tensor.numel() * 2
        if size > 4 * 2**30:
            shards.append(current)
            current, size = {}, 0
    shards.append(current)
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def pinned_h2d_bytes_per_s() -> float:
    """The best pinned host-to-device rate: 256 MiB and 1 GiB copies, torch-pinned and registered memory.

    The floor must be a bound the runtime cannot beat, so take the best of the ways it could copy.
    """
    backend = CudaBackend(torch.device("cuda"))
    best = 0.0
    for num_bytes in (2**28, 2**30):
        device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
        registered = backend.pin(torch.empty(num_bytes, dtype=torch.uint8))
        for host in (torch.empty(num_bytes, dtype=torch.uint8).pin_memory(), registered):
            ms = median_event_ms(lambda d=device, h=host: d.copy_(h, non_blocking=True), repeats=6, warmups=2)
            best = max(best, num_bytes / (ms / 1e3))
        backend.unpin(registered)
        del device, registered, host
    return best


def write_calibrated(out: Path) -> Path:
    """Run offload-plan's calibration, write the profile into ``out`` and log its copy-rate points."""
    from runtime.calibrate import calibrate, calibrated_yaml

    path = out / "calibrated.yaml"
    profile, details = calibrate()
    path.write_text(calibrated_yaml(profile))
    log(f"calibrated profile {path}: H2D {profile.h2d_bytes_per_s.value / 1e9:.1f} GB/s + "
        f"{profile.copy_overhead_us.value:.1f} us per copy; points (MiB, ms per copy, GB/s): " + ", ".join(
            f"({b / 2**20:.0f}, {ms:.3f}, {b / ms / 1e6:.1f})" for b, ms in details["h2d_points_bytes_ms"]))
    return path


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


def free() -> None:
    """Return memory once the caller has dropped its references."""
    gc.collect()
    torch.cuda.empty_cache()


def plan_for(checkpoint: Path, share: float, tokens: int, layout, gpu: str, measure: bool, *, sequences: int = 1,
             context: int = 0, cuda_graph: bool = False):
    """The plan at a budget of non-layer weights + ``share`` of the layer bytes."""
    budget = int(layout.non_layer_bytes + share * layout.layer_bytes)
    inputs = Inputs(
        model=str(checkpoint), revision=None, gpu=gpu, budget=f"{budget}B", trigger=None, tokens=tokens,
        sequences=sequences, context=context, params=(), stack=None, group_size=None, num_in_group=None,
        prefetch_step=None, measure=measure, measured_on="h100-sxm" if measure else None, cuda_graph=cuda_graph,
    )
    return make_plan(inputs, measure=measured_compute if measure else None).plan


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench"))
    parser.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3-8b-random"))
    parser.add_argument("--config", type=Path,
                        default=Path(__file__).resolve().parent.parent / "examples/qwen3-8b/config.json")
    parser.add_argument("--no-accelerate", action="store_true")
    args = parser.parse_args()
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
    from planner.checkpoint import load_checkpoint
    from planner.layout import build_layout

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
            engine.take_stats()
            engine.timing = True
            with torch.inference_mode():
                time_steps(model, input_ids, 2)
            engine.timing = False
            stats = engine.take_stats()
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
    report(rows, h2d, args.out)


def report(rows, h2d, out: Path) -> None:
    header = (f"{datetime.date.today()} {torch.cuda.get_device_name()}, torch {torch.__version__}, "
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


def write_report(out: Path, header: str, lines: list[str], rows: list[dict]) -> None:
    """bench.md (the table), bench.json (every figure) and the table on stdout."""
    text = "\n".join(lines)
    (out / "bench.md").write_text(text + "\n")
    (out / "bench.json").write_text(json.dumps({"header": header, "rows": rows}, indent=2))
    print(text, flush=True)


if __name__ == "__main__":
    main()
