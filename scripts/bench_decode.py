"""Decode benchmark on a CUDA GPU: offloading under CUDA graphs against eager and against the floor.

A Qwen3-8B-shaped model (random bf16 weights), KV context 1024, decode batches 1, 16, 64 and 256, the plan's
budget half of the layer bytes. For each batch: the all-resident model graphed, the plan graphed, the plan
eager, and the floor = max(all-resident graphed step, bytes the plan copies per step / pinned H2D bandwidth).
Plans come from make --cuda-graph with the calibrated profile and layer times measured from graph replays,
so the prediction is checked too. Token ids and logits of every run are compared bit for bit with the eager
all-resident model over the first steps. With --compile, both models are also compiled by Inductor and graphed.

Run from the repository root, on a machine with a CUDA GPU (writes bench.md, bench.json and calibrated.yaml
into --out, default $OUT or /tmp/bench-decode, after every batch; the table is printed last):

    PYTHONPATH=. python3 scripts/bench_decode.py [--out DIR] [--batches 1 16 64 256] [--compile BATCH ...]

Recorded results: benchmarks/2026-11-23-decode-h100.md.
"""

import datetime
import json
import os
import statistics

# Bitwise checks need a reproducible reference: eager decode on the H100 was not (the same model, inputs and
# cache gave logits 0.05-0.23 apart between two runs). Deterministic algorithms, and cuBLAS's fixed workspace
# config they require, must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

from planner.search.simulate import STEPS_PER_GRAPH  # noqa: E402
from runtime.backend import CudaBackend  # noqa: E402
from runtime.timing import random_ids  # noqa: E402
from scripts.benchmarking import (CONTEXT_TOKENS, checkpoint_parser, deterministic_decode, free, log,  # noqa: E402
                                  pinned_h2d_bytes_per_s, plan_for, product_kernels, write_calibrated,
                                  write_random_checkpoint, write_report)
from runtime.graph import DecodeLoop, cache_tokens_for  # noqa: E402
from runtime.load import build_model  # noqa: E402
from runtime.placement import apply_plan

BATCHES = (1, 16, 64, 256)
BUDGET_SHARE = 0.5
NUM_CHECKED_STEPS = 8  # two replays: the join between them is checked too
NUM_TIMED_STEPS = {"graphed": 20, "eager": 8}
MULTI_STEPS_PER_GRAPH = 4  # the other replay length timed


def decode_run(model, batch: int, prompt, engine=None, reference=None, graphed: bool = True,
               compile_backend: str | None = None, steps_per_graph: int = STEPS_PER_GRAPH) -> dict:
    """Prefill, check the first steps against ``reference`` (ids, logits), then time back-to-back steps."""
    loop = DecodeLoop(model, batch=batch, max_cache_tokens=cache_tokens_for(CONTEXT_TOKENS),
                      device=torch.device("cuda"), engine=engine, compile_backend=compile_backend,
                      steps_per_call=steps_per_graph if graphed else 1)
    loop.prefill(prompt)
    prefill_logits = loop.prefill_logits.cpu()
    if graphed:
        loop.capture()
    saved = loop.save_state()
    ids, logits = loop.generate(NUM_CHECKED_STEPS)
    outputs = (ids.cpu(), [out.cpu() for out in logits], prefill_logits)
    bitwise = None if reference is None else compare(outputs, reference)
    loop.restore_state(saved)
    with product_kernels():  # the bits were checked with deterministic kernels; time the ones serving runs
        if graphed:
            loop.capture_again()
        loop.timed_steps(3)
        step_ms = statistics.median(loop.timed_steps(NUM_TIMED_STEPS["graphed" if graphed else "eager"]))
    result = {"step_ms": step_ms, "bitwise": bitwise, "warmup_s": loop.warmup_s, "capture_s": loop.capture_s,
              "compile_s": loop.compile_s, "outputs": outputs}
    if engine is not None:
        engine.set_graph_mode(False)
    del loop
    free()
    return result


def compare(outputs, reference) -> dict:
    """Bit-for-bit checks against the reference run, and where they fail, the first difference's size."""
    (ids, logits, prefill), (ref_ids, ref_logits, ref_prefill) = outputs, reference
    return {
        "prefill_logits": torch.equal(prefill, ref_prefill),
        "ids": torch.equal(ids, ref_ids),
        "step_logits": all(torch.equal(a, b) for a, b in zip(logits, ref_logits)),
        "first_step_max_abs_diff": (logits[0].float() - ref_logits[0].float()).abs().max().item(),
    }


def all_equal(check: dict | None) -> bool:
    return check is not None and check["prefill_logits"] and check["ids"] and check["step_logits"]


def parser():
    """--out, --checkpoint, --config, --batches, --nondeterministic, --compile, --sdpa-cudnn."""
    result = checkpoint_parser("/tmp/bench-decode")
    result.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    result.add_argument("--nondeterministic", action="store_true", help="leave torch's default algorithms")
    result.add_argument("--compile", type=int, nargs="*", metavar="BATCH",
                        help="also time both models compiled by Inductor, graphed, at these batches "
                             "(all if none given)")
    result.add_argument("--sdpa-cudnn", action="store_true", help="let SDPA pick cuDNN attention (not reproducible)")
    return result


def compile_batches_for(batches: list[int], compile_arg: list[int] | None) -> set[int]:
    """--compile alone compiles every batch; --compile B ... those; no --compile, none."""
    return set(batches if compile_arg == [] else compile_arg or ())


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if not args.nondeterministic:
        deterministic_decode(cudnn_attention=args.sdpa_cudnn)
    elif not args.sdpa_cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    compile_batches = compile_batches_for(args.batches, args.compile)
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    write_random_checkpoint(args.config, args.checkpoint)
    h2d = pinned_h2d_bytes_per_s()
    log(f"pinned H2D {h2d / 1e9:.1f} GB/s (best single copy)")
    calibrated_path = write_calibrated(args.out)
    from planner.source.checkpoint import load_checkpoint
    from planner.model.layout import build_layout

    layout = build_layout(load_checkpoint(str(args.checkpoint)))
    resident = build_model(str(args.checkpoint), None).cuda()
    rows = []
    for batch in args.batches:
        plan = plan_for(args.checkpoint, BUDGET_SHARE, batch, layout, str(calibrated_path), measure=True,
                        sequences=batch, context=CONTEXT_TOKENS, cuda_graph=True)
        prompt = random_ids(resident, (batch, CONTEXT_TOKENS), torch.device("cuda"), seed=batch)
        eager_resident = decode_run(resident, batch, prompt, graphed=False)
        reference = eager_resident["outputs"]
        repeat = decode_run(resident, batch, prompt, reference=reference, graphed=False)  # is eager deterministic?
        graphed_resident = decode_run(resident, batch, prompt, reference=reference)
        model = build_model(str(args.checkpoint), None)
        engine = apply_plan(model, plan, CudaBackend(torch.device("cuda")))
        eager_plan = decode_run(model, batch, prompt, engine, reference, graphed=False)
        graphed_plan = decode_run(model, batch, prompt, engine, reference)
        # several steps per replay join the wrapped copies less often (bench_replay_steps.py compares them)
        multi_step_plan = decode_run(model, batch, prompt, engine, reference, steps_per_graph=MULTI_STEPS_PER_GRAPH)
        compiled = None
        if batch in compile_batches:
            compiled = compiled_runs(resident, model, engine, batch, prompt, reference)
        copy_bytes = engine.copy_bytes_per_step
        engine.close()
        del model, engine
        free()
        link_ms = 1e3 * copy_bytes / h2d
        floor_ms = max(graphed_resident["step_ms"], link_ms)
        rows.append({
            "batch": batch, "offloaded": len(plan.offload.layers), "prefetch": plan.offload.prefetch_step,
            "group_size": plan.offload.group_size, "num_in_group": plan.offload.num_in_group,
            "replay_start_copies": plan.offload.replay_start_copies,
            "copy_bytes_per_step": copy_bytes, "resident_eager_ms": eager_resident["step_ms"],
            "resident_graphed_ms": graphed_resident["step_ms"], "plan_eager_ms": eager_plan["step_ms"],
            "plan_graphed_ms": graphed_plan["step_ms"], "plan_graphed_multi_step_ms": multi_step_plan["step_ms"],
            "floor_ms": floor_ms, "steps_per_graph": STEPS_PER_GRAPH,
            "predicted_ms": plan.prediction.step_ms, "predicted_resident_ms": plan.prediction.resident_step_ms,
            "warmup_s": graphed_plan["warmup_s"], "capture_s": graphed_plan["capture_s"],
            "bitwise": {"resident eager again": repeat["bitwise"], "resident graphed": graphed_resident["bitwise"],
                        "plan eager": eager_plan["bitwise"], "plan graphed": graphed_plan["bitwise"],
                        f"plan graphed {MULTI_STEPS_PER_GRAPH} steps": multi_step_plan["bitwise"]},
            # the plan's inputs to the simulation, to re-run it offline
            "layer_ms": [row.compute_ms for row in plan.layers], "head_ms": plan.prediction.head_ms,
            "offloaded_layers": list(plan.offload.layers), "copy_ms": [row.copy_ms for row in plan.layers],
        })
        if compiled is not None:
            rows[-1]["compiled"] = compiled | {"floor_ms": max(compiled["resident_ms"], link_ms)}
        log(json.dumps(rows[-1]))
        report(rows, h2d, args.out, torch.cuda.get_device_name())  # after every batch: a run cut short keeps its rows


def compiled_runs(resident, model, engine, batch: int, prompt, eager_reference) -> dict:
    """Both models' steps compiled by Inductor and graphed. Compiled kernels round differently from eager ones,
    so the plan is checked bit for bit against the compiled resident model, and its ids against eager."""
    compiled_resident = decode_run(resident, batch, prompt, reference=eager_reference, compile_backend="inductor")
    compiled_plan = decode_run(model, batch, prompt, engine, compiled_resident["outputs"], compile_backend="inductor")
    return {"resident_ms": compiled_resident["step_ms"], "plan_ms": compiled_plan["step_ms"],
            "compile_s": compiled_plan["compile_s"], "resident_vs_eager": compiled_resident["bitwise"],
            "plan_vs_compiled_resident": compiled_plan["bitwise"]}


def report(rows, h2d: float, out, device_name: str) -> None:
    """bench.md and bench.json in ``out``, and the table on stdout."""
    mode = "deterministic algorithms" if torch.are_deterministic_algorithms_enabled() else "default algorithms"
    mode += "" if torch.backends.cuda.cudnn_sdp_enabled() else ", SDPA without cuDNN"
    header = (f"{datetime.date.today()} {device_name}, torch {torch.__version__} ({mode}), pinned H2D "
              f"{h2d / 1e9:.1f} GB/s, Qwen3-8B shape bf16, KV context {CONTEXT_TOKENS}, budget {BUDGET_SHARE:.0%} of "
              f"layer bytes; plans from make --cuda-graph --measure with the calibrated profile; "
              f"{STEPS_PER_GRAPH} step(s) per replay unless said")
    lines = [header, "",
             "| batch | offloaded (G, K, P, left to replay start) | resident graphed ms (eager) | floor ms | "
             f"plan graphed ms | floor/plan | plan {MULTI_STEPS_PER_GRAPH} steps/replay ms | plan eager ms | "
             "graph speed-up | tokens/s graphed | predicted ms | error | "
             "warm-up + capture s | bitwise |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        graphed = r["plan_graphed_ms"]
        lines.append(
            f"| {r['batch']} | {r['offloaded']} ({r['group_size']}, {r['num_in_group']}, {r['prefetch']}, "
            f"{r.get('replay_start_copies', 0)}) | "
            f"{r['resident_graphed_ms']:.2f} ({r['resident_eager_ms']:.2f}) | {r['floor_ms']:.2f} | {graphed:.2f} | "
            f"{r['floor_ms'] / graphed:.3f} | {r['plan_graphed_multi_step_ms']:.2f} | {r['plan_eager_ms']:.2f} | "
            f"{r['plan_eager_ms'] / graphed:.2f}x | "
            f"{r['batch'] * 1e3 / graphed:.1f} | {r['predicted_ms']:.2f} | "
            f"{(r['predicted_ms'] - graphed) / graphed:+.1%} | {r['warmup_s']:.2f} + {r['capture_s']:.2f} | "
            f"{all(all_equal(check) for check in r['bitwise'].values())} |")
    compiled = [r for r in rows if "compiled" in r]
    if compiled:
        lines += ["", "torch.compile (Inductor) inside the graph; floor = max(compiled resident step, copy time):", "",
                  "| batch | resident graphed ms | resident compiled ms | plan graphed ms | plan compiled ms | "
                  "floor ms | floor/plan | compile s | plan = compiled resident | resident ids = eager |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in compiled:
            c = r["compiled"]
            lines.append(f"| {r['batch']} | {r['resident_graphed_ms']:.2f} | {c['resident_ms']:.2f} | "
                         f"{r['plan_graphed_ms']:.2f} | {c['plan_ms']:.2f} | {c['floor_ms']:.2f} | "
                         f"{c['floor_ms'] / c['plan_ms']:.3f} | {c['compile_s']:.1f} | "
                         f"{all_equal(c['plan_vs_compiled_resident'])} | {c['resident_vs_eager']['ids']} |")
    write_report(out, header, lines, rows)


if __name__ == "__main__":
    main()
