"""Rank plans with offloading, run on two GPUs: each rank's memory and step against its plan, outputs bitwise.

    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/bench_tp_offload.py --folder /tmp/tpck
    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/bench_tp_offload.py --shape llama --workload decode --share 0.25
    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/bench_tp_offload.py --device cpu --tiny   # the path, on gloo

For each shape (scripts/bench_tp.py's Llama and Qwen3-MoE shapes, random bf16 weights, saved by rank 0) and each
workload (``prefill``: one 2048-token step, eager; ``decode``: graphed decode steps of 16 sequences at context
2048), both ranks make the same ``make --tp 2 --measure`` plan at each --share (the GPU holds the non-layer
weights and that share of the rank's layer bytes; 1.0 is all resident): rank 0's plan, whose compute is timed on
its GPU with serving's kernels and whose all-reduce is timed between the two ranks. Then each rank:

1. loads transformers' tensor-parallel model untouched (``tp_plan="auto"``) and runs the reference: the prefill
   step's logits, or 16 graphed decode steps' logits after a 32-token prompt;
2. loads it again with its plan applied (runtime.tensor_parallel.load_rank_with_plan, what ``torchrun -m
   offload_plan run PLAN --bench`` loads) and runs the same steps: every logit must equal the reference's;
3. times the plan's workload as ``run --bench`` does (runtime.bench.run_bench) and reports the step against the
   prediction, and the weights the GPU holds against the plan's (plus what transformers holds beyond vLLM's split:
   5.17's whole input embedding).

It also times host-to-device copies from page-locked memory on each rank alone and on both at once: each rank
copies over its own link, and the plan prices each rank at the profile's rate.

On a machine without two GPUs, or without torchrun, it prints one line and exits 2. ``--device cpu --tiny`` runs
the plan-and-compare path on two gloo ranks (the CPU stand-in's copies; no timing, no graphs).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench_tp import SHAPES, not_runnable, profile_for, save_random_model, shape_config

WORKLOADS = {"prefill": {"tokens": 2048, "sequences": 1, "context": 0, "cuda_graph": False},
             "decode": {"tokens": 16, "sequences": 16, "context": 2048, "cuda_graph": True}}
#: the prompt and the decode steps the bitwise check runs
PROMPT_TOKENS, DECODE_STEPS = 32, 16
COPY_BYTES = 1 << 30
#: --tiny: the shapes shrunk to build and run in seconds on the CPU, with layers of about 4 MiB a rank (GPU memory
#: is planned in 2 MiB blocks, so smaller layers would leave nothing to offload)
TINY = {"hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 4,
        "num_hidden_layers": 4, "vocab_size": 1024, "max_position_embeddings": 512}
TINY_MOE = {"intermediate_size": 1024, "moe_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
            "head_dim": 64}


def tiny_config(name: str) -> dict:
    """``name``'s config.json values shrunk for the CPU (the same family, heads split over two ranks)."""
    values = {**shape_config(name), **TINY}
    return {**values, **TINY_MOE} if name == "qwen3_moe" else values
TOLERANCE = 0.10


def parser() -> argparse.ArgumentParser:
    """--shape, --workload, --share, --gpu, --folder, --device, --tiny."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    result.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    result.add_argument("--share", type=float, nargs="+", default=[1.0, 0.5],
                        help="shares of the rank's layer bytes the GPU holds (1.0: all resident)")
    result.add_argument("--gpu", default=None, help="profile to plan with (default: from the GPU's name)")
    result.add_argument("--folder", default=None, help="where rank 0 saves the checkpoints (default: a temp dir)")
    result.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    result.add_argument("--tiny", action="store_true", help="the shapes shrunk (CPU checks)")
    return result


def make_rank_plan(folder: Path, gpu: str, workload: dict, share: float, measure: bool, out: Path):
    """Both ranks make the plan (the all-reduce is timed between them); rank 0's is written to ``out`` and both
    read it back, so every rank runs one plan, as a user who makes it once and launches it."""
    import torch.distributed as dist

    from planner.source.checkpoint import load_checkpoint
    from planner.model.layout import build_layout
    from planner.make.make_plan import make_plan
    from planner.plan.schema import Inputs
    from planner.plan.file import read_plan, render_plan, write_atomic
    from planner.model.tensor_parallel import shard_checkpoint
    from scripts.benchmarking import budget_for_share, served_measure

    rank_layout = build_layout(shard_checkpoint(load_checkpoint(str(folder)), 2))
    budget = budget_for_share(rank_layout, share) + (64 << 20 if share >= 1 else 0)
    inputs = Inputs(model=str(folder), gpu=gpu, budget=f"{budget}B", tokens=workload["tokens"],
                    sequences=workload["sequences"], context=workload["context"], cuda_graph=workload["cuda_graph"],
                    tp=2, measure=measure, measured_on=gpu if measure else None)
    kwargs = {}
    if measure:
        from offload_plan import runtime_seam

        kwargs = {"measure": served_measure(), "measure_link": runtime_seam.measured_all_reduce}
    planned = make_plan(inputs, **kwargs)
    if dist.get_rank() == 0:
        write_atomic(out, render_plan(planned.plan, f"scripts/bench_tp_offload.py (share {share})"))
    dist.barrier()
    return read_plan(out)


def step_logits(model, workload: dict, device, engine=None) -> list:
    """The steps the bitwise check compares: the prefill step's logits, or a prompt then graphed decode steps
    (``engine``: the plan's, which a decode loop drives)."""
    import torch

    from runtime.timing import forward_step, random_ids

    if not workload["context"]:
        with torch.inference_mode():
            return [forward_step(model, random_ids(model, (1, workload["tokens"]), device)).float().cpu()]
    loop = _decode_loop(model, workload, device, engine)
    loop.prefill(random_ids(model, (workload["sequences"], PROMPT_TOKENS), device))
    if device.type == "cuda":
        loop.capture()
    _, logits = loop.generate(DECODE_STEPS)
    del loop
    return [row.float().cpu() for row in logits]


def _decode_loop(model, workload: dict, device, engine):
    from runtime.graph import DecodeLoop, cache_tokens_for, steps_per_call_for

    return DecodeLoop(model, batch=workload["sequences"], max_cache_tokens=cache_tokens_for(PROMPT_TOKENS + 64),
                      device=device, engine=engine, steps_per_call=steps_per_call_for(device.type == "cuda"))


def copy_rates(device) -> dict:
    """GB/s of a 1 GiB host-to-device copy from page-locked memory: rank 0 alone, then both ranks at once."""
    import torch
    import torch.distributed as dist

    if device.type != "cuda":
        return {}
    host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)

    def rate(active: bool) -> float | None:
        times = []
        for _ in range(5):
            dist.barrier()
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            if active:
                target.copy_(host, non_blocking=True)
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return COPY_BYTES / statistics.median(times) / 1e9 if active else None

    alone = rate(dist.get_rank() == 0)
    together = rate(True)
    return {"alone_gb_per_s": alone, "together_gb_per_s": together}


def bench_arm(folder: Path, plan, workload: dict, device, reference: list) -> dict:
    """One plan on this rank: loaded, the reference's steps compared bitwise, the workload timed."""
    import torch

    from runtime.backend import CpuStandIn
    from runtime.bench import run_bench
    from runtime.load_source import open_source
    from runtime.tensor_parallel import held_beyond_plan_bytes, load_rank_with_plan

    backend = CpuStandIn() if device.type == "cpu" else None
    loaded = load_rank_with_plan(plan, open_source(plan, str(folder)), device, backend)
    got = step_logits(loaded.model, workload, device, loaded.engine)
    bitwise = len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference))
    row = {"num_offloaded": len(plan.offload.layers), "bitwise": bitwise,
           "weights_gpu_bytes": loaded.weights_gpu_bytes, "planned_gpu_bytes": plan.memory.gpu_bytes,
           "allocation_slack_bytes": plan.memory.allocation_slack_bytes,
           "beyond_plan_bytes": held_beyond_plan_bytes(loaded.model, 2),
           "predicted_step_ms": plan.prediction.step_ms, "compute_source": plan.workload.compute_source}
    if device.type == "cuda":
        loaded.engine.set_graph_mode(False)  # the check's loop left it replaying; run_bench's starts eagerly
        result = run_bench(loaded, cuda_graph=workload["cuda_graph"])
        row.update(step_ms=result.step_ms, step_ms_all=result.step_ms_all, mode=result.mode,
                   peak_gpu_bytes=result.peak_gpu_bytes, bytes_copied_per_step=result.bytes_copied_per_step,
                   stall_ms=result.stall_ms, copy_gb_per_s=result.copy_gb_per_s)
        if not workload["context"] and not plan.offload.layers:
            row["graphed_step_ms"] = graphed_prefill_ms(loaded.model, workload, device)
    loaded.engine.close()
    del loaded
    _free(device)
    return row


def graphed_prefill_ms(model, workload: dict, device, num_steps: int = 10) -> float:
    """Median ms of the all-resident prefill step replayed from a CUDA graph (the collectives captured inside):
    the step without the host's launches, wrappers and waits, against which the eager step's excess is the
    host's."""
    import torch

    from runtime.graph import capture_steps, warm_up_stream
    from runtime.timing import forward_step, random_ids, time_calls

    ids = random_ids(model, (1, workload["tokens"]), device)
    side = warm_up_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(3):
            forward_step(model, ids)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    capture_steps(graph, lambda: forward_step(model, ids), type(model).__name__)
    times = time_calls(graph.replay, 3 + num_steps, device)[3:]
    del graph
    return statistics.median(times)


def _free(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_shape(name: str, root: Path, args, rank: int, gpu: str, device) -> list[dict]:
    import torch.distributed as dist

    from runtime.tensor_parallel import load_tp_model

    folder = root / name
    if rank == 0 and not (folder / "config.json").exists():
        save_random_model(tiny_config(name) if args.tiny else shape_config(name), folder, device.type)
    dist.barrier()
    rows = []
    workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    for workload_name in workloads:
        workload = dict(WORKLOADS[workload_name])
        if args.tiny:
            workload.update(tokens=min(workload["tokens"], 32), context=min(workload["context"], 64))
        plans = [make_rank_plan(folder, gpu, workload, share, device.type == "cuda",
                                folder / f"{workload_name}-{share}.tp2.yaml") for share in args.share]
        model = load_tp_model(folder, device)
        reference = step_logits(model, workload, device)
        del model
        _free(device)
        for share, plan in zip(args.share, plans):
            print(f"[rank {rank} {time.strftime('%H:%M:%S')}] {name} {workload_name} share {share}: "
                  f"{len(plan.offload.layers)} layers offloaded", file=sys.stderr, flush=True)
            row = bench_arm(folder, plan, workload, device, reference)
            rows.append({"shape": name, "workload": workload_name, "share": share, "rank": rank, "gpu": gpu, **row})
    return rows


def report_lines(rows: list[dict]) -> list[str]:
    """One line per rank and arm: offloaded layers, bitwise, weights against the plan, step against prediction."""
    lines = ["| shape | workload | share | rank | offloaded | bitwise | weights on GPU | planned (+ beyond the split) "
             "| step | predicted | error |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        planned = row["planned_gpu_bytes"] - row["allocation_slack_bytes"] + row["beyond_plan_bytes"]
        step = row.get("step_ms")
        error = "" if step is None else f"{step / row['predicted_step_ms'] - 1:+.1%}"
        graphed = row.get("graphed_step_ms")
        step_text = "" if step is None else f"{step:.2f} ms" + ("" if graphed is None else f" ({graphed:.2f} graphed)")
        lines.append(f"| {row['shape']} | {row['workload']} | {row['share']} | {row['rank']} | {row['num_offloaded']} "
                     f"| {row['bitwise']} | {row['weights_gpu_bytes'] / 1e9:.3f} GB | {planned / 1e9:.3f} GB "
                     f"| {step_text} | {row['predicted_step_ms']:.2f} ms | {error} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    problem = not_runnable(args.device)
    if problem is not None:
        print(problem.replace("bench_tp", "bench_tp_offload"), file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    from runtime.tensor_parallel import launched_rank, start_rank

    rank = launched_rank()
    device = start_rank(rank, args.device)
    gpu = args.gpu or (profile_for(torch.cuda.get_device_name()) if args.device == "cuda" else "h100-sxm")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    root = Path(args.folder or Path(tempfile.gettempdir()) / f"bench_tp_offload_{run_id}")
    shapes = list(SHAPES) if args.shape == "all" else [args.shape]
    rates = copy_rates(device)
    rows = [row for name in shapes for row in bench_shape(name, root, args, rank.rank, gpu, device)]
    gathered = [None] * rank.world_size
    dist.all_gather_object(gathered, {"rows": rows, "copy_rates": rates})
    if rank.rank == 0:
        every = [row for part in gathered for row in part["rows"]]
        every.sort(key=lambda row: (row["shape"], row["workload"], -row["share"], row["rank"]))
        print("\n".join(report_lines(every)), flush=True)
        print("copy rates (GB/s): " + json.dumps([part["copy_rates"] for part in gathered]), flush=True)
        out = os.environ.get("OUT")
        if out:
            Path(out, "bench_tp_offload.json").write_text(json.dumps(
                {"rows": every, "copy_rates": [part["copy_rates"] for part in gathered],
                 "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}, indent=1) + "\n")
    dist.destroy_process_group()
    return 0 if all(row["bitwise"] for part in gathered for row in part["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
