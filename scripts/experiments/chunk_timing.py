"""Where a serving plan's prefill-chunk prediction and run's measured chunk part (issue 36): the same all-resident
plan's chunk timed by ``run --bench`` several times in one process (as scripts/conformance.py runs its arms), by
make --measure's method (per-layer events in a full-depth forward of aliased layers) and by run's method
(back-to-back forwards, events between them) on one model built whole, and how much of a chunk is the host
issuing kernels (the wall time of issuing one forward against its GPU time).

    PYTHONPATH=. python3 scripts/experiments/chunk_timing.py --out /tmp/chunk [--models gemma3,deepseek-v2-lite]

Prints one block per model and a table last; writes chunk_timing.json under --out.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from scripts.conformance import MODELS, cli, ensure_checkpoint, gpu_clean

CHUNK_TOKENS = 2048
NUM_RUNS = 3


def make_plan(folder: Path, out: Path, cache_dir: Path) -> dict:
    """An all-resident serving-1 plan with --measure (a fresh measurement cache); its predicted chunk."""
    import yaml

    os.environ["OFFLOAD_PLAN_CACHE"] = str(cache_dir)
    outcome = cli(["make", "--model", folder, "--gpu", "h100-sxm", "--concurrency", "1", "--context", "4096",
                   "--cuda-graph", "--gpu-memory", "60GiB", "--measure", "-o", out])
    if outcome.code:
        raise SystemExit(f"make failed: {outcome.stderr.strip()[-400:]}")
    plan = yaml.safe_load(out.read_text())
    return {"prefill_chunk_ms": plan["prediction"]["prefill_chunk_ms"],
            "compute_source": plan.get("compute", {}).get("source") if isinstance(plan.get("compute"), dict) else None}


def bench_chunks(plan: Path) -> dict:
    """run --bench --json in this process: the median chunk and every timed chunk."""
    gpu_clean()
    outcome = cli(["run", plan, "--bench", "--json"])
    if outcome.code:
        return {"error": outcome.stderr.strip()[-300:]}
    bench = json.loads(outcome.stdout[outcome.stdout.index("{"):])
    return {"median": bench["prefill_chunk_ms"], "all": bench.get("prefill_chunk_ms_all"),
            "decode": bench["decode_step_ms"]}


def whole_model_timings(folder: Path) -> dict:
    """One model built whole from config.json (random weights, not aliased): run's back-to-back method, make's
    per-layer method, and the host's issue time against the GPU's time for one forward."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from runtime.experts_impl import PREFILL, use_phase
    from runtime.measure import _time_forward
    from runtime.timing import forward_step, random_ids, time_steps
    from planner.model.cost import Workload

    hf = AutoConfig.from_pretrained(folder)
    if hasattr(hf, "quantization_config"):
        return {"skipped": "quantized"}
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16).eval()
    device = torch.device("cuda")
    use_phase(model, PREFILL, device)
    ids = random_ids(model, (1, CHUNK_TOKENS), device, seed=1)
    out = {}
    with torch.inference_mode():
        for _ in range(3):
            forward_step(model, ids)
        out["back_to_back"] = time_steps(model, ids, 20)
        torch.cuda.synchronize()
        issue_ms, total_ms = [], []
        for _ in range(10):
            torch.cuda.synchronize()
            start = time.perf_counter()
            forward_step(model, ids)
            issued = time.perf_counter()
            torch.cuda.synchronize()
            done = time.perf_counter()
            issue_ms.append(1e3 * (issued - start))
            total_ms.append(1e3 * (done - start))
        out["issue_ms"], out["synced_wall_ms"] = issue_ms, total_ms
    stack = "model.layers"
    layer_ms, rest_ms = _time_forward(model, stack, Workload(tokens_per_step=CHUNK_TOKENS, sequences_per_step=1,
                                                               context_tokens=0))
    out["per_layer_method"] = {"layer_ms": layer_ms, "rest_ms": rest_ms, "sum_ms": sum(layer_ms) + rest_ms}
    del model
    torch.cuda.empty_cache()
    return out


def aliased_timings(folder: Path) -> dict:
    """make --measure's own model (runtime.measure.build_measure_model: one layer per kind, aliases elsewhere):
    back-to-back forwards, and the per-layer method (now scaled to the unhooked forward)."""
    import torch

    from planner.model.cost import Workload
    from planner.model.layout import build_layout
    from planner.source.checkpoint import load_checkpoint
    from runtime.measure import _time_forward, build_measure_model, measured_kinds
    from runtime.timing import forward_step, random_ids, time_steps

    checkpoint = load_checkpoint(str(folder))
    layout = build_layout(checkpoint)
    kinds = measured_kinds(layout, checkpoint.config)
    model = build_measure_model(checkpoint.config, kinds, layout.stack)
    ids = random_ids(model, (1, CHUNK_TOKENS), torch.device("cuda"), seed=1)
    with torch.inference_mode():
        for _ in range(3):
            forward_step(model, ids)
        back_to_back = time_steps(model, ids, 20)
    layer_ms, rest_ms = _time_forward(model, layout.stack, Workload(tokens_per_step=CHUNK_TOKENS,
                                                                    sequences_per_step=1, context_tokens=0))
    del model
    torch.cuda.empty_cache()
    return {"kinds": [list(kind) for kind in kinds], "back_to_back": back_to_back,
            "per_layer_method": {"layer_ms": layer_ms, "rest_ms": rest_ms, "sum_ms": sum(layer_ms) + rest_ms}}


def clocks() -> str:
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,pstate",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp()))
    parser.add_argument("--models", default="gemma3,deepseek-v2-lite,qwen3-moe")
    parser.add_argument("--root", type=Path, default=Path("/tmp/conformance-checkpoints"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models.split(","):
        model = MODELS[name]
        folder, write_s = ensure_checkpoint(model, args.root, tiny=False, device="cuda")
        row = {"model": name, "write_s": round(write_s, 1), "clocks_start": clocks()}
        row["make"] = [make_plan(folder, args.out / f"{name}-{i}.yaml", args.out / f"cache-{name}-{i}")
                       for i in range(2)]
        row["run"] = [bench_chunks(args.out / f"{name}-0.yaml") for _ in range(NUM_RUNS)]
        row["clocks_after_runs"] = clocks()
        row["whole"] = whole_model_timings(folder)
        row["aliased"] = aliased_timings(folder)
        print(json.dumps(row), flush=True)
        rows.append(row)
    (args.out / "chunk_timing.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'model':18s} {'make pred ms':>16s} {'run median ms (x3)':>26s} {'whole b2b':>10s} "
          f"{'per-layer':>10s} {'issue':>7s} {'synced':>7s} {'alias b2b':>10s} {'alias scaled':>12s}")
    for row in rows:
        preds = "/".join(f"{m['prefill_chunk_ms']:.2f}" for m in row["make"])
        runs = "/".join(f"{r.get('median', float('nan')):.2f}" for r in row["run"])
        whole = row["whole"]
        if "back_to_back" in whole:
            print(f"{row['model']:18s} {preds:>16s} {runs:>26s} {statistics.median(whole['back_to_back']):10.2f} "
                  f"{whole['per_layer_method']['sum_ms']:10.2f} {statistics.median(whole['issue_ms']):7.2f} "
                  f"{statistics.median(whole['synced_wall_ms']):7.2f} "
                  f"{statistics.median(row['aliased']['back_to_back']):10.2f} "
                  f"{row['aliased']['per_layer_method']['sum_ms']:12.2f}")
        else:
            print(f"{row['model']:18s} {preds:>16s} {runs:>26s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
