"""transformers' experts implementations side by side on a CUDA GPU: the evidence for runtime.experts_impl's choice.

A Qwen3-30B-A3B-shaped model cut to 4 layers (bf16, random weights, all on the GPU) runs decode steps captured
in a CUDA graph (as `run` serves them) at 1, 8, 32 and 128 sequences over a 1024-token static cache, and
2048-token prefill chunks, through each implementation: grouped_mm, batched_mm and eager (eager in prefill
only: its loop asks the host which experts were hit, so no graph can capture it). Each arm reports the median
step time and the step's activation peak (max allocated during the step minus allocated after it). An arm
that runs out of memory says so (batched_mm gathers every pair's weights).

    PYTHONPATH=. python3 scripts/bench_experts_impl.py          # on a machine with a GPU; about a minute

A table is printed last; rows go to $OUT/experts_impl.json when OUT is set.
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
NUM_LAYERS = 4
CONTEXT_TOKENS = 1024
CHUNK_TOKENS = 2048
BATCHES = (1, 8, 32, 128)
NUM_TIMED = 20


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((REPO / "examples/qwen3-30b-a3b/config.json").read_text())
    config["num_hidden_layers"] = NUM_LAYERS
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16).eval()


def decode_arm(model, implementation: str, batch: int) -> dict:
    """Median ms of a captured decode step and its activation peak, experts through ``implementation``."""
    import runtime.experts_impl as experts_impl
    from runtime.graph import DecodeLoop, cache_tokens_for
    from runtime.measure_activations import decode_activation_peak

    original = experts_impl.implementation_for
    # decode steps only: the prefill that fills the cache keeps the runtime's choice (batched_mm would gather
    # every prompt token's expert weights there)
    experts_impl.implementation_for = lambda phase, device, dtype=None: (
        implementation if phase == "decode" else original(phase, device, dtype))
    try:
        torch.cuda.empty_cache()
        peak = decode_activation_peak(model, num_sequences=batch, context_tokens=CONTEXT_TOKENS, graphed=True)
        loop = DecodeLoop(model, batch=batch, max_cache_tokens=cache_tokens_for(CONTEXT_TOKENS) + 4 * NUM_TIMED,
                          device=torch.device("cuda"), steps_per_call=1)
        loop.fill(CONTEXT_TOKENS)
        loop.capture()
        step_ms = statistics.median(loop.timed_steps(NUM_TIMED))
        del loop
        return {"step_ms": step_ms, "activation_bytes": peak.activation_bytes}
    finally:
        experts_impl.implementation_for = original


def prefill_arm(model, implementation: str) -> dict:
    """Median ms of a 2048-token chunk and its activation peak."""
    from runtime.measure_activations import prefill_activation_peak

    model.set_experts_implementation(implementation)
    torch.cuda.empty_cache()
    peak = prefill_activation_peak(model, chunk_tokens=CHUNK_TOKENS)
    ids = torch.randint(0, model.config.vocab_size, (1, CHUNK_TOKENS), device="cuda")
    times = []
    with torch.inference_mode():
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return {"step_ms": statistics.median(times[1:]), "activation_bytes": peak.activation_bytes}


def guarded(run, **row) -> dict:
    try:
        return row | run()
    except torch.OutOfMemoryError as error:
        torch.cuda.empty_cache()
        return row | {"error": "out of memory: " + str(error).splitlines()[0][:80]}
    except Exception as error:  # an implementation a graph cannot capture, say: a row, not the end of the run
        torch.cuda.empty_cache()
        return row | {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:100] if str(error) else ''}"}


def main() -> None:
    import argparse

    import transformers

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"{Path(__file__).name}: needs a CUDA GPU (torch {torch.__version__} sees none); run it on one")

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    model = build_model()
    rows = []
    for implementation in ("grouped_mm", "batched_mm", "eager"):
        # eager asks the host which experts were hit: no graph can capture it (and a failed capture is no row)
        for batch in BATCHES if implementation != "eager" else ():
            rows.append(guarded(lambda: decode_arm(model, implementation, batch), phase="decode graphed",
                                implementation=implementation, sequences=batch))
            log(json.dumps(rows[-1]))
        rows.append(guarded(lambda: prefill_arm(model, implementation), phase=f"prefill {CHUNK_TOKENS}",
                            implementation=implementation, sequences=1))
        log(json.dumps(rows[-1]))
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "layers": NUM_LAYERS, "rows": rows}
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "experts_impl.json").write_text(json.dumps(header, indent=1))
    print(f"{header['device']}, torch {header['torch']}, transformers {header['transformers']}, "
          f"Qwen3-30B-A3B shape x {NUM_LAYERS} layers")
    print("| phase | implementation | sequences | step ms | activation MiB |\n|---|---|---|---|---|")
    for row in rows:
        figures = (f"{row['step_ms']:.3f} | {row['activation_bytes'] / 2**20:.1f}" if "step_ms" in row
                   else f"{row['error']} | -")
        print(f"| {row['phase']} | {row['implementation']} | {row['sequences']} | {figures} |")


if __name__ == "__main__":
    main()
