"""How fast a graphed MoE decode layer reads its touched experts as the batch grows (issue 36: estimated decode
at 4 sequences was 56-66% optimistic on Qwen3-MoE and DeepSeek-V2-Lite shapes, all-resident, where one sequence
was within a few per cent).

For each shape (released widths, 2-3 layers, header-only checkpoints: make --measure builds the layers from
config.json) and each batch: the measured ms per MoE layer (runtime.measure, CUDA-graph replays, as make --measure
times it), the estimate (planner.model.cost with the local profile's layer floor), the experts a step touches in
expectation, and the rate at which the measured time beyond the one-sequence step reads the extra touched experts.

    PYTHONPATH=. python3 scripts/experiments/moe_decode_rate.py [SHAPES [BATCHES [CONTEXT]]]   # with a GPU
    e.g. ... moe_decode_rate.py mistral-nemo,olmoe 1,8 8192
"""

import json
from dataclasses import replace
import statistics
import sys
import tempfile
from pathlib import Path

from planner.model.cost import Workload, estimate_compute, geometry_from_config
from planner.model.layout import build_layout
from planner.source.checkpoint import load_checkpoint
from planner.source.profile import load_profile
from runtime.header_checkpoint import write_header_checkpoint
from runtime.measure import local_profile_name, measure_local

BATCHES = (1, 2, 4, 8, 16, 32)
SHAPES = {
    "qwen3-moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                  "intermediate_size": 6144, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                  "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                  "num_hidden_layers": 2, "vocab_size": 151936, "max_position_embeddings": 40960,
                  "decoder_sparse_step": 1, "torch_dtype": "bfloat16"},
    "olmoe": {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 2048,
              "intermediate_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 2,
              "vocab_size": 50304, "num_experts": 64, "num_experts_per_tok": 8, "max_position_embeddings": 4096,
              "torch_dtype": "bfloat16"},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
                "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2, "vocab_size": 32000,
                "max_position_embeddings": 32768, "torch_dtype": "bfloat16"},
    "mistral-nemo": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 5120,
                     "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "num_hidden_layers": 2, "vocab_size": 131072, "max_position_embeddings": 131072,
                     "torch_dtype": "bfloat16"},
    "qwen2-moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
                  "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 16,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts": 60,
                  "num_experts_per_tok": 4, "num_hidden_layers": 2, "vocab_size": 151936,
                  "max_position_embeddings": 8192, "torch_dtype": "bfloat16"},
}
CONTEXT_TOKENS = 4096


def touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts ``tokens`` independently routed tokens touch."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def main() -> int:
    profile = load_profile(local_profile_name())
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(SHAPES)
    batches = tuple(int(b) for b in sys.argv[2].split(",")) if len(sys.argv) > 2 else BATCHES
    context_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else CONTEXT_TOKENS
    rows = []
    print(f"context {context_tokens} tokens")
    print("| shape | batch | measured ms/layer | estimate ms/layer | touched experts | extra GB/s |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            config = SHAPES[name]
            config_path = Path(folder) / f"{name}.json"
            config_path.write_text(json.dumps(config))
            written = write_header_checkpoint(config_path, Path(folder) / name, dtype="bfloat16")
            checkpoint = load_checkpoint(str(written.folder))
            layout = build_layout(checkpoint)
            geometry = geometry_from_config(checkpoint.config, layout)
            shapes = {t.name: t.shape for t in checkpoint.tensors}
            expert_bytes = 3 * config["hidden_size"] * config["moe_intermediate_size" if "moe_intermediate_size"
                                                              in config else "intermediate_size"] * 2
            if not geometry.num_experts:  # a dense layer: its MLP read once, "touched" once
                geometry = replace(geometry, num_experts=1, top_k=1)
            base = None
            for batch in batches:
                workload = Workload(tokens_per_step=batch, sequences_per_step=batch, context_tokens=context_tokens)
                measured, rest_ms = measure_local(checkpoint, layout, workload, graphed=True)
                estimate = estimate_compute(layout, geometry, workload, profile, shapes, graphed=True).layer_ms
                layer_ms, estimate_ms = statistics.fmean(measured), statistics.fmean(estimate)
                hit = touched(geometry.num_experts, geometry.top_k, batch)
                extra = ""
                if base is None:
                    base = (layer_ms, hit)
                elif layer_ms > base[0]:
                    extra = f"{(hit - base[1]) * expert_bytes / ((layer_ms - base[0]) * 1e-3) / 1e9:.0f}"
                rows.append({"shape": name, "batch": batch, "context_tokens": context_tokens,
                             "measured_ms": layer_ms, "estimate_ms": estimate_ms,
                             "touched": hit, "expert_bytes": expert_bytes, "non_layer_ms": rest_ms})
                print(f"| {name} | {batch} | {layer_ms:.4f} | {estimate_ms:.4f} | {hit:.1f} | {extra} |", flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
