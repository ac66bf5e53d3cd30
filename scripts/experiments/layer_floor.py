"""How much of a small layer's measured time the roofline leaves out: measured against estimated ms per layer,
for tiny layers (whose roofline is ~0, so what they take is the per-layer floor: kernel launches and their
gaps) and for the conformance sweep's shapes, at a graphed and an eager decode step and a prefill chunk.

    PYTHONPATH=. python3 scripts/experiments/layer_floor.py      # on a machine with a GPU

Prints one row per (shape, workload): measured ms/layer (runtime.measure, as make --measure times it), the
roofline estimate of the built-in profile, and their difference.
"""

import json
import statistics
import tempfile
from pathlib import Path

from planner.model.cost import Workload, estimate_compute, geometry_from_config
from planner.model.layout import build_layout
from planner.source.checkpoint import load_checkpoint
from planner.source.profile import load_profile
from runtime.header_checkpoint import write_header_checkpoint
from runtime.measure import local_profile_name, measure_local

_TINY = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 8, "vocab_size": 512, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
         "rms_norm_eps": 1e-5}
SHAPES = {
    "tiny llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_TINY},
    "tiny qwen3-moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **_TINY,
                       "moe_intermediate_size": 128, "num_experts": 64, "num_experts_per_tok": 8, "head_dim": 64,
                       "decoder_sparse_step": 1, "norm_topk_prob": True},
    "olmoe": {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 2048,
              "intermediate_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 3,
              "vocab_size": 50304, "num_experts": 64, "num_experts_per_tok": 8, "max_position_embeddings": 4096,
              "torch_dtype": "bfloat16"},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304,
               "intermediate_size": 9216, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
               "num_hidden_layers": 6, "vocab_size": 256000, "sliding_window": 4096, "max_position_embeddings": 8192,
               "torch_dtype": "bfloat16"},
}
WORKLOADS = {
    "decode 1 x ctx 512, graphed": (Workload(tokens_per_step=1, sequences_per_step=1, context_tokens=512), True),
    "decode 1 x ctx 512, eager": (Workload(tokens_per_step=1, sequences_per_step=1, context_tokens=512), False),
    "prefill 2048": (Workload(tokens_per_step=2048, sequences_per_step=1, context_tokens=0), False),
}


def main() -> None:
    profile = load_profile(local_profile_name())
    print("| shape | workload | measured ms/layer | estimate ms/layer | measured - estimate | non-layer ms |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for name, config in SHAPES.items():
            config_path = Path(folder) / f"{name.replace(' ', '-')}.json"
            config_path.write_text(json.dumps(config))
            written = write_header_checkpoint(config_path, Path(folder) / name.replace(" ", "-"), dtype="bfloat16")
            checkpoint = load_checkpoint(str(written.folder))
            layout = build_layout(checkpoint)
            geometry = geometry_from_config(checkpoint.config, layout)
            shapes = {t.name: t.shape for t in checkpoint.tensors}
            for label, (workload, graphed) in WORKLOADS.items():
                measured, rest_ms = measure_local(checkpoint, layout, workload, graphed)
                estimate = estimate_compute(layout, geometry, workload, profile, shapes).layer_ms
                mean_measured, mean_estimate = statistics.fmean(measured), statistics.fmean(estimate)
                print(f"| {name} | {label} | {mean_measured:.4f} | {mean_estimate:.4f} | "
                      f"{mean_measured - mean_estimate:+.4f} | {rest_ms:.4f} |", flush=True)


if __name__ == "__main__":
    main()
