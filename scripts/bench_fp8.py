"""FP8 block-quantized checkpoints on a CUDA GPU (issue 23): run's loader at three budgets against the
all-resident FP8 model and the physical floor, prefill and graphed decode.

A Qwen3-8B-shaped checkpoint in the release format of Qwen3-8B-FP8 (planner.source.release_format: every linear
F8_E4M3 with a float32 ``weight_scale_inv`` per 128x128 block; embeddings, norms and the LM head bf16), random
weights, written once to /tmp. The model is built with transformers' FP8 modules and streamed by run's loader
(runtime.quantized). Plans at about 75%, 50% and 25% of the layer bytes on the GPU, made with the calibrated
profile and layer times measured by make --measure. Per budget:

- prefill (1 x 2048 tokens) and graphed decode (batch 16, KV context 1024): the plan's step against the floor,
  max(all-resident step computed the same way, bytes the plan copies per step / pinned H2D bandwidth), the
  same floor scripts/bench_runtime.py and scripts/bench_decode.py use;
- logits bitwise against the all-resident FP8 model (prefill logits; decode ids and logits of every step);
- predicted against measured step time;
- bytes on the link per step (counted by the engine while timing) against the stored bytes of the offloaded
  layers (FP8 weights, their scales and norms) and what the same layers would move in bf16.

Run from the repository root on a machine with a CUDA GPU (writes bench.md and bench.json into --out, default
$OUT or /tmp/bench-fp8; the table is printed last):

    PYTHONPATH=. python3 scripts/bench_fp8.py [--out DIR] [--layers N]
"""

import datetime
import json
import statistics
from pathlib import Path

from scripts.bench_decode import all_equal, decode_run  # sets the deterministic cuBLAS workspace first

import torch  # noqa: E402

from runtime.backend import CudaBackend  # noqa: E402
from runtime.timing import random_ids  # noqa: E402
from scripts.benchmarking import (CONTEXT_TOKENS, DEFAULT_CONFIG, checkpoint_parser, deterministic_decode,  # noqa: E402
                                  free, log, pinned_h2d_bytes_per_s, plan_for, write_calibrated, write_random_release,
                                  write_report)
from scripts.bench_runtime import copy_stats, timed  # noqa: E402

BUDGET_SHARES = (0.75, 0.5, 0.25)
#: the all-resident reference's budget, in shares of the layer bytes (beside the non-layer weights)
RESIDENT_SHARE = 2.0
PREFILL_TOKENS = 2048
DECODE_BATCH = 16
NUM_PREFILL_STEPS = 6
#: Qwen3-8B-FP8's quantization_config as released
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def parser():
    """--out, --config (a bf16 config.json; FP8 is added), --layers (cut the stack to fit the time)."""
    result = checkpoint_parser("/tmp/bench-fp8")
    result.add_argument("--layers", type=int, default=None, help="layers kept (default: the config's)")
    return result


def fp8_config(config_path: Path, num_layers: int | None, out: Path) -> Path:
    """The config with Qwen3-8B-FP8's quantization_config (and the stack cut to ``num_layers``), in ``out``."""
    config = json.loads(config_path.read_text())
    config["quantization_config"] = QUANTIZATION
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    path = out / "config-fp8.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def load(checkpoint: Path, plan):
    """run's loader on the GPU: (model, engine)."""
    from runtime.load import stream_model

    return stream_model(checkpoint, plan, CudaBackend(torch.device("cuda")))


def link_bytes(layout, plan) -> dict:
    """The offloaded layers' stored bytes, the FP8 weights among them, and the same layers in bf16."""
    offloaded = [layout.layers[i] for i in plan.offload.layers]
    fp8 = sum(nbytes for layer in offloaded for _, dtype, _, nbytes in layer.params if dtype == "F8_E4M3")
    stored = sum(plan.layers[i].offloaded_bytes for i in plan.offload.layers)
    return {"stored_bytes": stored, "fp8_weight_bytes": fp8, "bf16_equivalent_bytes": stored + fp8}


def prefill_row(checkpoint: Path, plan, reference, h2d: float, layout) -> dict:
    """The plan's prefill step against the resident one and the floor; link bytes counted over timed steps."""
    model, engine = load(checkpoint, plan)
    ids = random_ids(model, (1, PREFILL_TOKENS), torch.device("cuda"), seed=PREFILL_TOKENS)
    step_ms, logits = timed(model, ids, NUM_PREFILL_STEPS)
    stats = copy_stats(model, engine, ids)
    packed = sum(sum(item.num_bytes for item in layout_) for layout_ in engine.layouts)
    copy_bytes = engine.copy_bytes_per_step
    engine.close()
    del model, engine
    free()
    resident_ms = reference["prefill_ms"]
    return {"phase": "prefill", "step_ms": step_ms, "resident_ms": resident_ms,
            "floor_ms": max(resident_ms, 1e3 * copy_bytes / h2d), "predicted_ms": plan.prediction.step_ms,
            "bitwise_equal": bool(torch.equal(logits, reference["prefill_logits"])),
            "copy_bytes_per_step": copy_bytes, "measured_link_bytes_per_step": stats.bytes_copied / 2,
            "packed_bytes": packed, "link_gb_per_s": stats.bytes_copied / stats.copy_ms / 1e6 if stats.copy_ms else 0,
            **link_bytes(layout, plan)}


def decode_row(checkpoint: Path, plan, reference, h2d: float, layout) -> dict:
    """The plan's graphed decode against the all-resident graphed run (ids and logits bit for bit)."""
    model, engine = load(checkpoint, plan)
    prompt = random_ids(model, (DECODE_BATCH, CONTEXT_TOKENS), torch.device("cuda"), seed=DECODE_BATCH)
    result = decode_run(model, DECODE_BATCH, prompt, engine, reference["decode_outputs"])
    packed = sum(sum(item.num_bytes for item in layout_) for layout_ in engine.layouts)
    copy_bytes = engine.copy_bytes_per_step
    engine.close()
    del model, engine
    free()
    resident_ms = reference["decode_ms"]
    return {"phase": "decode", "step_ms": result["step_ms"], "resident_ms": resident_ms,
            "floor_ms": max(resident_ms, 1e3 * copy_bytes / h2d), "predicted_ms": plan.prediction.step_ms,
            "bitwise_equal": all_equal(result["bitwise"]), "bitwise": result["bitwise"],
            "copy_bytes_per_step": copy_bytes, "packed_bytes": packed, **link_bytes(layout, plan)}


def resident_reference(checkpoint: Path, layout, calibrated: str) -> dict:
    """The all-resident FP8 model through the same loader and kernels: prefill and graphed decode."""
    # a budget of twice the layer bytes: at exactly 100% the H100 run's plan still offloaded a layer (the budget
    # also holds what the plan reserves beside the weights)
    prefill_plan = plan_for(checkpoint, RESIDENT_SHARE, PREFILL_TOKENS, layout, calibrated, measure=True)
    decode_plan = plan_for(checkpoint, RESIDENT_SHARE, DECODE_BATCH, layout, calibrated, measure=True,
                           sequences=DECODE_BATCH, context=CONTEXT_TOKENS, cuda_graph=True)
    model, engine = load(checkpoint, prefill_plan)
    assert not engine.offloaded, "a budget of twice the layers offloads nothing"
    ids = random_ids(model, (1, PREFILL_TOKENS), torch.device("cuda"), seed=PREFILL_TOKENS)
    prefill_ms, prefill_logits = timed(model, ids, NUM_PREFILL_STEPS)
    prompt = random_ids(model, (DECODE_BATCH, CONTEXT_TOKENS), torch.device("cuda"), seed=DECODE_BATCH)
    graphed = decode_run(model, DECODE_BATCH, prompt)
    engine.close()
    del model, engine
    free()
    log(f"resident: prefill {prefill_ms:.2f} ms (predicted {prefill_plan.prediction.step_ms:.2f}), graphed decode "
        f"{graphed['step_ms']:.3f} ms (predicted {decode_plan.prediction.step_ms:.3f})")
    return {"prefill_ms": prefill_ms, "prefill_logits": prefill_logits, "decode_ms": graphed["step_ms"],
            "decode_outputs": graphed["outputs"], "prefill_predicted_ms": prefill_plan.prediction.step_ms,
            "decode_predicted_ms": decode_plan.prediction.step_ms}


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    deterministic_decode()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.checkpoint == parser().get_default("checkpoint"):  # not the bf16 benchmarks' folder
        stem = "qwen3-8b" if args.config == DEFAULT_CONFIG else args.config.parent.name
        args.checkpoint = Path(f"/tmp/{stem}-fp8-random-{args.layers or 'all'}")
    log(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    write_random_release(fp8_config(args.config, args.layers, args.out), args.checkpoint)
    log(f"checkpoint ready: {args.checkpoint}")
    h2d = pinned_h2d_bytes_per_s()
    log(f"pinned H2D {h2d / 1e9:.1f} GB/s (best single copy)")
    calibrated = str(write_calibrated(args.out))
    from planner.source.checkpoint import load_checkpoint
    from planner.model.layout import build_layout
    from runtime.quantized import fp8_compute_path

    layout = build_layout(load_checkpoint(str(args.checkpoint)))
    reference = resident_reference(args.checkpoint, layout, calibrated)
    rows = []
    for share in BUDGET_SHARES:
        prefill_plan = plan_for(args.checkpoint, share, PREFILL_TOKENS, layout, calibrated, measure=True)
        decode_plan = plan_for(args.checkpoint, share, DECODE_BATCH, layout, calibrated, measure=True,
                               sequences=DECODE_BATCH, context=CONTEXT_TOKENS, cuda_graph=True)
        for plan, measure in ((prefill_plan, prefill_row), (decode_plan, decode_row)):
            row = measure(args.checkpoint, plan, reference, h2d, layout)
            row.update(share=share, offloaded=len(plan.offload.layers), prefetch=plan.offload.prefetch_step,
                       budget_bytes=plan.memory.budget_bytes)
            rows.append(row)
            log(json.dumps({k: v for k, v in row.items() if k != "bitwise"}))
    report(rows, reference, h2d, args.out, fp8_compute_path(), len(layout.layers))


def report(rows, reference, h2d: float, out: Path, compute_path: str, num_layers: int) -> None:
    """bench.md and bench.json in ``out``, and the table on stdout."""
    header = (f"{datetime.date.today()} {torch.cuda.get_device_name()}, torch {torch.__version__}, pinned H2D "
              f"{h2d / 1e9:.1f} GB/s; Qwen3-8B shape ({num_layers} layers), FP8 e4m3 128x128 blocks, FP8 linears "
              f"computed by: {compute_path}; prefill 1 x {PREFILL_TOKENS} tokens, graphed decode batch "
              f"{DECODE_BATCH} at context {CONTEXT_TOKENS}; resident prefill {reference['prefill_ms']:.2f} ms "
              f"(predicted {reference['prefill_predicted_ms']:.2f}), resident decode {reference['decode_ms']:.3f} ms "
              f"(predicted {reference['decode_predicted_ms']:.3f})")
    lines = [header, "",
             "| phase | GPU share | offloaded/P | resident ms | floor ms | plan ms | plan/floor | predicted ms | error "
             "| link MB/step (measured) | stored MB of offloaded layers | bf16 MB of the same | bitwise |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        measured = r.get("measured_link_bytes_per_step")
        lines.append(
            f"| {r['phase']} | {r['share']:.0%} | {r['offloaded']}/{r['prefetch']} | {r['resident_ms']:.2f} | "
            f"{r['floor_ms']:.2f} | {r['step_ms']:.2f} | {r['step_ms'] / r['floor_ms']:.3f} | "
            f"{r['predicted_ms']:.2f} | {(r['predicted_ms'] - r['step_ms']) / r['step_ms']:+.1%} | "
            f"{r['copy_bytes_per_step'] / 1e6:.1f}"
            f"{f' ({measured / 1e6:.1f})' if measured is not None else ''} | {r['stored_bytes'] / 1e6:.1f} | "
            f"{r['bf16_equivalent_bytes'] / 1e6:.1f} | {r['bitwise_equal']} |")
    summary = {"resident_prefill_ms": reference["prefill_ms"], "resident_decode_ms": reference["decode_ms"],
               "compute_path": compute_path, "median_plan_over_floor": statistics.median(
                   r["step_ms"] / r["floor_ms"] for r in rows)}
    write_report(out, header, lines, [summary, *rows])


if __name__ == "__main__":
    main()
