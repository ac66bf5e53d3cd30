"""Adapter serving benchmark for issue 17: blocking against pipelined loading of LoRA adapters, on the H100.

Builds a Qwen3-8B-shaped checkpoint (random bf16 weights, under --work-dir) and 16 random rank-64 PEFT adapters
on every linear layer (saved with PEFT), makes two plans with `offload-plan make --adapter ... --adapter-slots 4
--tokens 512` (all resident, and half the layers offloaded: G=2 K=1), and for each serves a stream of 4 batches
of 8 requests over 8 adapters, blocking and pipelined (runtime.adapter_bench, as `run --bench` does). Each
request's last-token logits are compared with PEFT's (the base model on the GPU, every adapter loaded with
autocast_adapter_dtype=False, over the project's all-resident model: from_pretrained on the CPU, moved to
the GPU whole; PEFT's mixed-batch forward for the rows that mix adapters).

    PYTHONPATH=. python3 scripts/bench_adapters.py            # on the H100; PEFT must be importable
    PYTHONPATH=. python3 scripts/bench_adapters.py --tiny     # the same logic on a tiny model, CPU is enough

A short table is printed last; results go to $OUT/bench_adapters.json when OUT is set (else --work-dir).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                tie_word_embeddings=False)
TINY = dict(QWEN3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256)
#: the issue's workload: 16 adapters of rank 64 on every linear layer, 4 slots, batches of 8 over 8 adapters
NUM_ADAPTERS, RANK, NUM_SLOTS, REQUESTS_PER_BATCH = 16, 64, 4, 8
#: long enough that a forward is bound by the GPU, not by launching its kernels: at 512 tokens a one-request
#: forward measured 32 ms without adapters and 80 ms with them on the H100 host, nearly all of it Python and
#: launches (252 adapted layers, 4 kernels each), so times drifted 50% between identical rounds
PROMPT_TOKENS = 2048


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_base(config_fields: dict, folder: Path, device: str):
    """The base model with random weights (norms too), saved as a safetensors checkpoint; returned in memory."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**{k: v for k, v in config_fields.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, device=device) * 0.02 + (
                1.0 if param.dim() == 1 else 0.0))
    model.save_pretrained(folder, max_shard_size="5GB")
    return model.eval()


def make_plan(checkpoint: Path, adapters: dict[str, Path], out: Path, tokens: int, half: bool) -> Path:
    """`offload-plan make` with the adapters and 4 slots; all resident, or half the layers offloaded."""
    prefetch = "2" if tokens == PROMPT_TOKENS else "1"  # the tiny model offloads 2 layers: one ahead at most
    knobs = ["--group-size", "2", "--num-in-group", "1", "--prefetch-step", prefetch] if half else []
    args = [sys.executable, "-m", "offload_plan", "make", "-m", str(checkpoint), "-g", "h100-sxm", "--budget", "60GiB",
            "--tokens", str(tokens), "--adapter-slots", str(NUM_SLOTS), "-o", str(out), *knobs]
    for name, folder in adapters.items():
        args += ["--adapter", f"{name}={folder}"]
    proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise SystemExit(f"bench_adapters: make failed: {proc.stderr.strip()}")
    return out


def compare_with_peft(reference, outputs) -> dict:
    """Every request's logits against PEFT's for the same rows and adapters: bitwise, and the largest gap."""
    import torch

    from tests.adapter_models import peft_logits

    result = {}
    for mode, (schedule, served) in outputs.served.items():
        equal, max_abs = True, 0.0
        for forward in schedule.forwards:
            expected = peft_logits(reference, outputs.prompts[list(forward.requests)], list(forward.adapters))
            got = torch.stack([served.logits[r] for r in forward.requests])
            equal &= bool(torch.equal(got, expected))
            max_abs = max(max_abs, (got.float() - expected.float()).abs().max().item())
        result[mode] = {"bitwise_equal": equal, "max_abs_diff": max_abs}
    return result


def run_plan(label: str, plan_path: Path, checkpoint: Path, reference, device: str) -> dict:
    """Load the plan's model as `run` does, serve the stream both ways, check against PEFT."""
    import torch

    from planner.adapter_stream import MODES
    from planner.plan import read_plan
    from runtime.adapter_bench import run_adapter_bench
    from runtime.adapters import load_pool

    plan = read_plan(plan_path)
    if device == "cuda":
        from runtime.load import load_with_plan

        loaded = load_with_plan(plan, str(checkpoint))
    else:
        from runtime.load import Loaded, stream_on_cpu

        model, engine = stream_on_cpu(checkpoint, plan)
        loaded = Loaded(model=model, engine=engine, plan=plan, weights_gpu_bytes=0)
    pool, hooks = load_pool(loaded.model, plan, loaded.engine.backend, plan_path)
    bench, outputs = run_adapter_bench(loaded, plan_path, requests_per_batch=REQUESTS_PER_BATCH,
                                       pool_and_hooks=(pool, hooks), modes=MODES)
    checks = compare_with_peft(reference, outputs)
    forward_ms = forward_costs(loaded.model, pool, hooks, outputs.prompts) if device == "cuda" else {}
    hooks.remove()
    pool.close()
    row = {"label": label, "num_offloaded": len(plan.offload.layers), "bench": asdict(bench), "peft": checks,
           "forward_ms": forward_ms,
           "planned_pipelined_first_wait_ms": plan.adapters.pipelined_first_wait_ms,
           "planned_blocking_wait_ms": plan.adapters.blocking_wait_ms}
    del loaded, outputs
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def forward_costs(model, pool, hooks, prompts) -> dict:
    """Median ms of one forward of 1 and of 4 requests, without adapters and with (one adapter per request):
    what the LoRA layers add, and how much a one-request forward costs beside a batched one."""
    import statistics

    import torch

    from runtime.bench import time_calls

    names = sorted(pool.layouts)
    costs = {}
    for rows in (1, 4):
        ids = prompts[:rows]
        lora = [(r, r + 1, pool.views(names[r], r), pool.layouts[names[r]].scaling) for r in range(rows)]
        for label, groups in (("base", []), ("lora", lora)):
            hooks.groups = groups
            with torch.inference_mode():
                step = lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1)  # noqa: E731
                time_calls(step, 3)
                costs[f"{rows} requests, {label}"] = statistics.median(time_calls(step, 10))
    hooks.groups = []
    return costs


def print_table(results: dict) -> None:
    print(f"{results['device']}: {NUM_ADAPTERS} adapters rank {results['rank']}, {NUM_SLOTS} slots, batches of "
          f"{REQUESTS_PER_BATCH} requests over 8 adapters, {results['prompt_tokens']}-token prompts")
    header = ("plan", "mode", "copies", "total ms (pred)", "max(compute, link) ms", "total/max",
              "first start ms (pred)", "TTFT mean ms (pred)", "TTFT max ms (pred)", "compute idle ms (pred)", "= PEFT")
    print(" | ".join(header))
    for row in results["plans"]:
        bench = row["bench"]
        for mode in bench["modes"]:
            floor = max(mode["compute_ms"], mode["link_ms"])
            peft = row["peft"][mode["mode"]]
            print(" | ".join((
                f"{row['label']} ({row['num_offloaded']} offl.)", mode["mode"], str(mode["num_copies"]),
                f"{mode['total_ms']:.1f} ({mode['predicted_total_ms']:.1f}) [{min(mode['total_ms_all']):.0f}-"
                f"{max(mode['total_ms_all']):.0f}]", f"{floor:.1f}",
                f"{mode['total_ms'] / floor:.3f}" if floor else "-",
                f"{mode['first_start_ms']:.2f} ({mode['predicted_first_start_ms']:.2f})",
                f"{mode['ttft_mean_ms']:.1f} ({mode['predicted_ttft_mean_ms']:.1f})",
                f"{mode['ttft_max_ms']:.1f} ({mode['predicted_ttft_max_ms']:.1f})",
                f"{mode['compute_idle_ms']:.1f} ({mode['predicted_compute_idle_ms']:.1f})",
                "bitwise" if peft["bitwise_equal"] else f"max diff {peft['max_abs_diff']:.3g}")))
        if row["forward_ms"]:
            print("  forward alone: " + ", ".join(f"{k} {v:.1f} ms" for k, v in row["forward_ms"].items()))
        print(f"  one adapter copy: measured {bench['measured_copy_ms']:.2f} ms, planned "
              f"{bench['planned_copy_ms']:.2f} ms ({bench['slot_bytes'] / 1e6:.0f} MB)")


def main() -> None:
    import torch

    from tests.adapter_models import peft_reference, save_random_adapters

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (seconds, CPU is enough): tests the logic")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/bench_adapters"))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    tokens, rank = (16, 8) if args.tiny else (PROMPT_TOKENS, RANK)
    start = time.perf_counter()
    base = build_base(TINY if args.tiny else QWEN3_8B, work / "checkpoint", device)
    folders = save_random_adapters(base, work / "adapters", [f"lora{k:02d}" for k in range(NUM_ADAPTERS)], rank=rank)
    log(f"checkpoint and {NUM_ADAPTERS} adapters written in {time.perf_counter() - start:.1f} s")
    del base  # the reference is the project's all-resident model (its rotary tables computed on the CPU, as
    # the loader computes them): from_pretrained on the CPU, moved to the device whole, wrapped by PEFT
    from runtime.load import build_model

    reference = peft_reference(build_model(str(work / "checkpoint"), None).to(device), folders)
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rank": rank,
               "prompt_tokens": tokens, "plans": []}
    for label, half in (("resident", False), ("half offloaded", True)):
        plan_path = make_plan(work / "checkpoint", folders, work / f"plan-{'half' if half else 'resident'}.yaml",
                              tokens, half)
        results["plans"].append(run_plan(label, plan_path, work / "checkpoint", reference, device))
        log(f"{label}: done")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else work
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_adapters.json").write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)


if __name__ == "__main__":
    main()
