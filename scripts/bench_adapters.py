"""Adapter serving benchmark for issue 17: blocking against pipelined loading of LoRA adapters, on the H100.

Builds a Qwen3-8B-shaped checkpoint (random bf16 weights, under --work-dir) and 16 random rank-64 PEFT adapters
on every linear layer (saved with PEFT), makes two plans with `offload-plan make --adapter ... --adapter-slots 4
--tokens 512` (all resident, and half the layers offloaded: G=2 K=1), and for each serves a stream of 4 batches
of 8 requests over 8 adapters, blocking and pipelined (runtime.adapter_bench, as `run --bench` does). Each
request's last-token logits are compared with PEFT's (the base model on the GPU, every adapter loaded with
autocast_adapter_dtype=False, over the project's all-resident model: from_pretrained on the CPU, moved to
the GPU whole; PEFT's mixed-batch forward for the rows that mix adapters).

Issue 27's checks follow the table, per plan: the plan's loading mode (adapters.mode) against the mode that
measured faster (target: within 3%); first start, TTFT and compute idle predicted against measured (target:
within 10% or 1 ms); and `run --prompt --adapter`'s path (runtime.adapters.attach_adapter, greedy, 64 tokens)
against PEFT's generation with the same adapter. Without PEFT the adapters are written directly in its file
format (adapter_config.json, adapter_model.safetensors) and the PEFT comparisons are reported as skipped.

    PYTHONPATH=. python3 scripts/bench_adapters.py            # on the H100
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


#: issue 27's targets: the plan's mode within 3% of the faster measured one; first start, TTFT and idle
#: predicted within 10% or 1 ms, whichever is larger
MODE_TOLERANCE, PREDICTION_TOLERANCE, PREDICTION_FLOOR_MS = 0.03, 0.10, 1.0
#: tokens generated by the --prompt --adapter check
NUM_NEW_TOKENS = 64


def peft_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("peft") is not None


def write_random_adapters(base, folder: Path, names: list[str], *, rank: int, alpha: float = 16.0,
                          scale: float = 0.05) -> dict[str, Path]:
    """Without PEFT: random adapters on every linear layer of the decoder, written in PEFT's format (its tensor
    names, A (rank x in) and B (out x rank) in the model's dtype, a LoRA adapter_config.json)."""
    import torch
    from safetensors.torch import save_file

    from tests.adapter_models import ALL_LINEAR

    folders = {}
    for number, name in enumerate(names):
        generator = torch.Generator(device="cpu").manual_seed(number)
        tensors = {}
        for module_name, module in base.named_modules():
            if isinstance(module, torch.nn.Linear) and module_name.rsplit(".", 1)[-1] in ALL_LINEAR:
                for which, shape in (("A", (rank, module.in_features)), ("B", (module.out_features, rank))):
                    values = torch.randn(shape, generator=generator) * scale
                    tensors[f"base_model.model.{module_name}.lora_{which}.weight"] = values.to(module.weight.dtype)
        (folder / name).mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / name / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(ALL_LINEAR),
                  "base_model_name_or_path": None}
        (folder / name / "adapter_config.json").write_text(json.dumps(config) + "\n")
        folders[name] = folder / name
    return folders


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


def run_plan(label: str, plan_path: Path, checkpoint: Path, reference, device: str, num_rounds: int) -> dict:
    """Load the plan's model as `run` does, serve the stream both ways, check against PEFT."""
    import torch

    from planner.adapter_stream import MODES
    from planner.plan_file import read_plan
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
                                       pool_and_hooks=(pool, hooks), modes=MODES, num_rounds=num_rounds)
    checks = compare_with_peft(reference, outputs) if reference is not None else None
    forward_ms = forward_costs(loaded.model, pool, hooks, outputs.prompts) if device == "cuda" else {}
    hooks.remove()
    pool.close()
    generation = generate_against_peft(loaded, plan, plan_path, reference, sorted(pool.layouts)[0], device)
    row = {"label": label, "num_offloaded": len(plan.offload.layers), "bench": asdict(bench), "peft": checks,
           "generation": generation, "forward_ms": forward_ms,
           "planned_pipelined_first_wait_ms": plan.adapters.pipelined_first_wait_ms,
           "planned_blocking_wait_ms": plan.adapters.blocking_wait_ms}
    del loaded, outputs
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def greedy_tokens(model, prompt) -> list[int]:
    """NUM_NEW_TOKENS greedy tokens (end-of-sequence ignored: every token counts)."""
    import torch

    with torch.inference_mode():
        out = model.generate(input_ids=prompt, max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def generate_against_peft(loaded, plan, plan_path: Path, reference, name: str, device: str) -> dict:
    """run --prompt --adapter NAME's path (the adapter attached as run attaches it, eager greedy generation)
    against PEFT's generation with the same adapter; skipped without PEFT."""
    import torch

    from runtime.adapters import attach_adapter

    vocab = loaded.model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(5)).to(device)
    pool, hooks = attach_adapter(loaded.model, plan, loaded.engine.backend, name, plan_path)
    try:
        got = greedy_tokens(loaded.model, prompt)
    finally:
        hooks.remove()
        pool.close()
    if reference is None:
        return {"adapter": name, "num_tokens": len(got), "skipped": "PEFT is not importable"}
    reference.set_adapter(name)
    expected = greedy_tokens(reference, prompt)
    first = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    return {"adapter": name, "num_tokens": len(got), "equal": got == expected, "first_difference": first}


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
            peft = row["peft"][mode["mode"]] if row["peft"] else None
            print(" | ".join((
                f"{row['label']} ({row['num_offloaded']} offl.)", mode["mode"], str(mode["num_copies"]),
                f"{mode['total_ms']:.1f} ({mode['predicted_total_ms']:.1f}) [{min(mode['total_ms_all']):.0f}-"
                f"{max(mode['total_ms_all']):.0f}]", f"{floor:.1f}",
                f"{mode['total_ms'] / floor:.3f}" if floor else "-",
                f"{mode['first_start_ms']:.2f} ({mode['predicted_first_start_ms']:.2f})",
                f"{mode['ttft_mean_ms']:.1f} ({mode['predicted_ttft_mean_ms']:.1f})",
                f"{mode['ttft_max_ms']:.1f} ({mode['predicted_ttft_max_ms']:.1f})",
                f"{mode['compute_idle_ms']:.1f} ({mode['predicted_compute_idle_ms']:.1f})",
                "skipped (no PEFT)" if peft is None else "bitwise" if peft["bitwise_equal"]
                else f"max diff {peft['max_abs_diff']:.3g}")))
        if row["forward_ms"]:
            print("  forward alone: " + ", ".join(f"{k} {v:.1f} ms" for k, v in row["forward_ms"].items()))
        print(f"  one adapter copy: measured {bench['measured_copy_ms']:.2f} ms, planned "
              f"{bench['planned_copy_ms']:.2f} ms ({bench['slot_bytes'] / 1e6:.0f} MB)")


def _within(predicted: float, measured: float) -> bool:
    return abs(predicted - measured) <= max(PREDICTION_TOLERANCE * abs(measured), PREDICTION_FLOOR_MS)


def issue_27_checks(results: dict) -> list[dict]:
    """Per plan: its mode against the faster measured one, predictions against measurements, and generation."""
    checks = []
    for row in results["plans"]:
        bench = row["bench"]
        measured = {mode["mode"]: mode["total_ms"] for mode in bench["modes"]}
        faster = min(measured, key=measured.get)
        # the CPU stand-in's events time nothing (all 0): a ratio of 1 there
        ratio = measured[bench["plan_mode"]] / measured[faster] if measured[faster] > 0 else 1.0
        figures = {}
        for mode in bench["modes"]:
            for key in ("first_start_ms", "ttft_mean_ms", "compute_idle_ms"):
                figures[f"{mode['mode']} {key}"] = {"measured": mode[key], "predicted": mode[f"predicted_{key}"],
                                                    "within": _within(mode[f"predicted_{key}"], mode[key])}
        checks.append({"label": row["label"], "plan_mode": bench["plan_mode"],
                       "plan_mode_margin": bench["plan_mode_margin"], "faster_measured": faster,
                       "chosen_over_faster": ratio, "mode_within": ratio <= 1 + MODE_TOLERANCE,
                       "figures": figures, "generation": row["generation"]})
    return checks


def print_checks(checks: list[dict]) -> None:
    """Issue 27's targets, one line each, 'ok' or 'MISSED'."""
    def mark(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    print("\nissue 27 targets (mode within 3% of the faster measured; predictions within 10% or 1 ms; "
          f"--prompt --adapter equal to PEFT over {NUM_NEW_TOKENS} tokens)")
    for check in checks:
        print(f"{check['label']}: plan chose {check['plan_mode']} (predicted {check['plan_mode_margin']:.1%} "
              f"ahead), {check['faster_measured']} measured faster; chosen / faster = "
              f"{check['chosen_over_faster']:.3f} {mark(check['mode_within'])}")
        for name, figure in check["figures"].items():
            print(f"  {name}: predicted {figure['predicted']:.2f}, measured {figure['measured']:.2f} "
                  f"{mark(figure['within'])}")
        generation = check["generation"]
        if "skipped" in generation:
            print(f"  --prompt --adapter {generation['adapter']}: {generation['num_tokens']} tokens generated; "
                  f"PEFT comparison skipped ({generation['skipped']})")
        else:
            where = "" if generation["equal"] else f" (first difference at token {generation['first_difference']})"
            print(f"  --prompt --adapter {generation['adapter']}: {generation['num_tokens']} greedy tokens "
                  f"{'equal to' if generation['equal'] else 'DIFFER from'} PEFT's{where}")


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (seconds, CPU is enough): tests the logic")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/bench_adapters"))
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds per mode (each: the forwards alone, then served); 2 saves ~40 s")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    tokens, rank = (16, 8) if args.tiny else (PROMPT_TOKENS, RANK)
    start = time.perf_counter()
    base = build_base(TINY if args.tiny else QWEN3_8B, work / "checkpoint", device)
    names = [f"lora{k:02d}" for k in range(NUM_ADAPTERS)]
    if peft_importable():
        from tests.adapter_models import save_random_adapters

        folders = save_random_adapters(base, work / "adapters", names, rank=rank)
    else:
        log("PEFT is not importable: adapters written in its format directly, PEFT comparisons skipped")
        folders = write_random_adapters(base.cpu(), work / "adapters", names, rank=rank)
    log(f"checkpoint and {NUM_ADAPTERS} adapters written in {time.perf_counter() - start:.1f} s")
    del base  # the reference is the project's all-resident model (its rotary tables computed on the CPU, as
    # the loader computes them): from_pretrained on the CPU, moved to the device whole, wrapped by PEFT
    from runtime.load import build_model

    reference = None
    if peft_importable():
        from tests.adapter_models import peft_reference

        reference = peft_reference(build_model(str(work / "checkpoint"), None).to(device), folders)
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rank": rank,
               "prompt_tokens": tokens, "plans": []}
    for label, half in (("resident", False), ("half offloaded", True)):
        plan_path = make_plan(work / "checkpoint", folders, work / f"plan-{'half' if half else 'resident'}.yaml",
                              tokens, half)
        results["plans"].append(run_plan(label, plan_path, work / "checkpoint", reference, device, args.rounds))
        log(f"{label}: done")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else work
    out.mkdir(parents=True, exist_ok=True)
    results["checks"] = issue_27_checks(results)
    (out / "bench_adapters.json").write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print_checks(results["checks"])


if __name__ == "__main__":
    main()
