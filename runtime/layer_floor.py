"""The smallest time a decoder layer takes on this stack: tiny layers (hidden 256, whose roofline is ~0) timed
as make --measure times layers (runtime.measure.measure_local), so what they take is the kernels' launches and
the gaps between them. calibrate records it in the profile's layer_floor section (planner.source.profile)."""

import json
import statistics
import tempfile
from pathlib import Path

from planner.model.cost import Workload
from planner.model.layout import build_layout
from planner.source.checkpoint import load_checkpoint
from planner.source.profile import LayerFloor

_TINY = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "num_hidden_layers": 8, "vocab_size": 512, "max_position_embeddings": 8192,
         "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}
#: a dense and a MoE decoder layer as small as transformers builds them (Llama, Qwen3-MoE: 64 experts, top-8)
TINY_CONFIGS = {
    "dense": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_TINY},
    "moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **_TINY,
            "moe_intermediate_size": 128, "num_experts": 64, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
            "norm_topk_prob": True},
}
#: one sequence's decode step over a short context, replayed from a CUDA graph
GRAPHED_DECODE = Workload(tokens_per_step=1, sequences_per_step=1, context_tokens=512)
#: an eager prefill chunk of the serving default size
EAGER_PREFILL = Workload(tokens_per_step=2048, sequences_per_step=1, context_tokens=0)


def measured_layer_floor(stamp: str) -> LayerFloor:
    """Time the tiny layers on this GPU: graphed decode for both kinds, an eager prefill chunk for MoE."""
    from runtime.header_checkpoint import write_header_checkpoint
    from runtime.measure import measure_local

    with tempfile.TemporaryDirectory() as folder:
        times = {}
        for kind, config in TINY_CONFIGS.items():
            config_path = Path(folder) / f"{kind}.json"
            config_path.write_text(json.dumps(config))
            checkpoint = load_checkpoint(str(write_header_checkpoint(config_path, Path(folder) / kind).folder))
            layout = build_layout(checkpoint)
            times[kind, True] = statistics.median(measure_local(checkpoint, layout, GRAPHED_DECODE, True)[0])
            if kind == "moe":
                times[kind, False] = statistics.median(measure_local(checkpoint, layout, EAGER_PREFILL, False)[0])
    return LayerFloor(graphed_dense_ms=round(times["dense", True], 4), graphed_moe_ms=round(times["moe", True], 4),
                      eager_moe_ms=round(times["moe", False], 4), source="measured",
                      note=f"hidden-256 Llama and Qwen3-MoE layers (64 experts, top-8): graphed decode of one "
                           f"sequence over 512 tokens, and the MoE layer's eager 2048-token prefill; {stamp}")
