"""Whether a MoE model's prefill chunk can be replayed from a CUDA graph, and what that does to its time.

Serving plans of MoE models time their prefill chunk eagerly, and eager MoE chunks are host-bound: the sweep read
them 11-27% away from what make --measure had timed minutes before (benchmarks/2026-11-28-conformance-graphed-chunk-
h100.md). transformers' grouped_mm experts take their group offsets from torch.histc on the GPU, so a chunk through
them should capture. For each MoE family of the sweep, at its real widths and a few layers, this builds the model
with random bf16 weights, runs a 2048-token chunk eagerly and from a graph (runtime.graph.chunk_graph), and prints
whether the logits are bitwise equal and each one's median ms over back-to-back calls.

    PYTHONPATH=. python3 scripts/experiments/moe_chunk_capture.py --out $OUT/moe-chunk
"""

import argparse
import json
import statistics
from pathlib import Path

import torch

from scripts import conformance

FAMILIES = ("qwen2-moe", "olmoe", "qwen3-moe", "mixtral", "deepseek-v2-lite")
CHUNK_TOKENS = 2048
NUM_CALLS = 10


def one_family(name: str, num_layers: int) -> dict:
    import transformers

    from runtime.experts_impl import PREFILL, use_phase
    from runtime.graph import warm_up_and_capture
    from runtime.timing import time_calls

    model_spec = conformance.MODELS[name]
    config_json = conformance.config_dict(model_spec, tiny=False) | {"num_hidden_layers": num_layers}
    for key in ("layer_types", "mlp_only_layers"):  # per-layer lists follow the layers kept
        if isinstance(config_json.get(key), list):
            config_json[key] = config_json[key][:num_layers]
    config = transformers.AutoConfig.for_model(**config_json)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    device = torch.device("cuda")
    implementation = use_phase(model, PREFILL, device)
    ids = torch.randint(0, config.vocab_size, (1, CHUNK_TOKENS), device=device)
    row = {"family": name, "layers": num_layers, "implementation": implementation}
    with torch.inference_mode():
        eager_logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits.clone()
        for _ in range(3):
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
        eager_ms = time_calls(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), NUM_CALLS)
    row["eager_ms"] = statistics.median(eager_ms)
    row["eager_ms_all"] = eager_ms
    held = {}

    def forward() -> None:
        with torch.inference_mode():
            held["logits"] = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits

    def warm_up() -> None:
        with torch.inference_mode():
            for _ in range(2):
                forward()

    try:
        graph, row["capture_s"] = warm_up_and_capture(device, warm_up, forward, type(model).__name__, "prefill chunk")
    except Exception as error:  # the question is whether it captures at all
        row["capture_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        return row
    graph.replay()
    torch.cuda.synchronize()
    row["bitwise_equal"] = bool(torch.equal(held["logits"], eager_logits))
    row["max_abs_diff"] = float((held["logits"].float() - eager_logits.float()).abs().max())
    graphed_ms = time_calls(graph.replay, NUM_CALLS)
    row["graphed_ms"] = statistics.median(graphed_ms)
    row["graphed_ms_all"] = graphed_ms
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.families.split(","):
        torch.cuda.empty_cache()
        try:
            row = one_family(name, args.layers)
        except Exception as error:
            row = {"family": name, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
    (args.out / "moe_chunk_capture.json").write_text(json.dumps(rows, indent=1))
    print("\n| family | impl | eager ms | graphed ms | bitwise | capture |\n|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['family']} | {row.get('implementation')} | {row.get('eager_ms', float('nan')):.2f} | "
              f"{row.get('graphed_ms', float('nan')):.2f} | {row.get('bitwise_equal')} | "
              f"{row.get('capture_error') or row.get('error') or 'ok'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
