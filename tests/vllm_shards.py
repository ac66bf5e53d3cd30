"""Rank 0's bytes under tensor parallelism as vLLM shards four public checkpoints, computed from the models'
published shapes and vLLM's rules, independently of planner.model.tensor_parallel (the sharding's tests and
scripts/bench_tp.py's are held to them):

- vllm/model_executor/layers/linear.py: ColumnParallelLinear / MergedColumnParallelLinear split the output dim
  (bias too), QKVParallelLinear splits query heads and key/value heads, one whole KV head per rank replicated
  where num_kv_heads < tp, RowParallelLinear splits the input dim and keeps its bias whole;
- vllm/model_executor/layers/vocab_parallel_embedding.py: the vocabulary padded to a multiple of 64, divided;
- vllm/model_executor/layers/fused_moe/layer.py: FusedMoE splits each expert's intermediate dim;
- vllm/model_executor/layers/quantization/fp8.py and utils/fp8_utils.py: one F32 scale per 128 x 128 block of
  the rank's FP8 partition, partitions whole blocks;
- vllm/model_executor/layers/quantization/mxfp4.py: MXFP4 experts' partition padded to a multiple of 64.
"""

import math


def rank_vocab(config: dict, tp: int) -> int:
    """One rank's rows of the vocabulary, padded to 64s."""
    return math.ceil(config["vocab_size"] / 64) * 64 // tp


def embeddings_bytes(config: dict, tp: int) -> int:
    """embed_tokens and lm_head (bf16, vocabulary-parallel) and the final norm."""
    return 2 * (2 * rank_vocab(config, tp) * config["hidden_size"] + config["hidden_size"])


def llama_rank_bytes(config: dict, tp: int) -> int:
    """Rank 0's bytes of a Llama (bf16, grouped KV heads)."""
    h, heads, kv, dim, inter = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                    "head_dim" if "head_dim" in config else "hidden_size",
                                                    "intermediate_size"))
    dim = config.get("head_dim") or h // heads
    kv_rank = max(1, kv // tp)
    attention = (heads // tp) * dim * h + 2 * kv_rank * dim * h + h * (heads // tp) * dim
    mlp = 3 * (inter // tp) * h
    per_layer = 2 * (attention + mlp + 2 * h)
    return config["num_hidden_layers"] * per_layer + embeddings_bytes(config, tp)


def qwen3_moe_rank_bytes(config: dict, tp: int) -> int:
    """Rank 0's bytes of a Qwen3-MoE (bf16, every expert on every rank, each expert's width split)."""
    h, heads, kv, dim = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    experts, inter = config["num_experts"], config["moe_intermediate_size"]
    kv_rank = max(1, kv // tp)
    attention = (heads // tp) * dim * h + 2 * kv_rank * dim * h + h * (heads // tp) * dim + 2 * dim
    moe = experts * h + experts * 3 * (inter // tp) * h
    per_layer = 2 * (attention + moe + 2 * h)
    return config["num_hidden_layers"] * per_layer + embeddings_bytes(config, tp)


def fp8_bytes(out_features: int, in_features: int) -> int:
    """An FP8 weight (1 byte an element) and its F32 scale per 128 x 128 block."""
    return out_features * in_features + 4 * math.ceil(out_features / 128) * math.ceil(in_features / 128)


def deepseek_v3_rank_bytes(config: dict, tp: int) -> int:
    """Rank 0's bytes of DeepSeek-V3 (FP8 blocks, MLA) without its multi-token-prediction layer."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_rank, kv_rank = config["q_lora_rank"], config["kv_lora_rank"]
    local = heads // tp
    attention = (fp8_bytes(q_rank, h) + 2 * q_rank + fp8_bytes(local * (nope + rope), q_rank)
                 + fp8_bytes(kv_rank + rope, h) + 2 * kv_rank + fp8_bytes(local * (nope + v), kv_rank)
                 + fp8_bytes(h, local * v) + 2 * 2 * h)
    dense = 2 * fp8_bytes(config["intermediate_size"] // tp, h) + fp8_bytes(h, config["intermediate_size"] // tp)
    width = config["moe_intermediate_size"] // tp
    expert = 2 * fp8_bytes(width, h) + fp8_bytes(h, width)
    experts = config["n_routed_experts"]
    moe = 2 * experts * h + 4 * experts + experts * expert + expert * config["n_shared_experts"]
    num_dense = config["first_k_dense_replace"]
    return (config["num_hidden_layers"] * attention + num_dense * dense
            + (config["num_hidden_layers"] - num_dense) * moe + embeddings_bytes(config, tp))


def gpt_oss_rank_bytes(config: dict, tp: int) -> int:
    """Rank 0's bytes of gpt-oss (MXFP4 experts padded to 64s, attention sinks per local head)."""
    h, heads, kv, dim = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    experts = config["num_local_experts"]
    padded = math.ceil(config["intermediate_size"] // tp / 64) * 64
    q, kv_rows = (heads // tp) * dim, max(1, kv // tp) * dim
    attention = 2 * (q * h + q + 2 * (kv_rows * h + kv_rows) + h * q + h + heads // tp + 2 * h)
    router = 2 * (experts * h + experts)
    gate_up = experts * 2 * padded * (h // 2 + h // 32) + 2 * experts * 2 * padded
    down = experts * h * (padded // 2 + padded // 32) + 2 * experts * h
    return config["num_hidden_layers"] * (attention + router + gate_up + down) + embeddings_bytes(config, tp)


#: rank 0's bytes by checkpoint name (plans/models/NAME)
RANK_BYTES = {"llama-3.1-70b": llama_rank_bytes, "qwen3-30b-a3b": qwen3_moe_rank_bytes,
            "deepseek-v3": deepseek_v3_rank_bytes, "gpt-oss-120b": gpt_oss_rank_bytes}
