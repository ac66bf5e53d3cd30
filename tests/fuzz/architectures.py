"""Fuzz family of architecture configs: one config.json of each family the KV cache and activation models know
(MoE, MLA, sliding-window, hybrid), with keys of the wrong JSON type or at the edges of their range, planned for
serving (which reads the KV cache and activation models)."""

from tests.fuzz.core import BASE_ARGS, GUARD_NAME, Base, Case, json_bytes

#: family -> (config over the base model's, keys the models read for it in every case)
FAMILY_CONFIGS = {
    "moe": ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
             "n_shared_experts": 1}, ("hidden_size", "num_attention_heads", "moe_intermediate_size",
                                      "shared_expert_intermediate_size", "n_shared_experts")),
    "mla": ({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 8,
             "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4, "q_lora_rank": 8},
            ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")),
    "sliding": ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 32},
                ("sliding_window", "num_key_value_heads", "head_dim")),
    "alternating": ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "sliding_window": 32},
                    ("sliding_window", "num_key_value_heads")),
    "qwen-window": ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32,
                     "use_sliding_window": True, "max_window_layers": 3}, ("max_window_layers", "sliding_window")),
    "layer-types": ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "sliding_window": 32,
                     "layer_types": ["full_attention", "sliding_attention"] * 3}, ("layer_types",)),
    "qwen3-next": ({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                    "full_attention_interval": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 4,
                    "linear_num_value_heads": 2, "linear_value_head_dim": 4, "linear_conv_kernel_dim": 4}, ()),
    "jamba": ({"model_type": "jamba", "architectures": ["JambaForCausalLM"], "attn_layer_period": 2,
               "attn_layer_offset": 1, "mamba_expand": 2, "mamba_d_conv": 4, "mamba_d_state": 8}, ()),
    "falcon-h1": ({"model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"], "mamba_d_ssm": 32,
                   "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8, "mamba_n_groups": 1,
                   "mamba_d_conv": 4}, ()),
}
#: wrong JSON types and values at the edges of an integer's range
VALUES = ("x", "12", "", [], [1], {}, {"a": 1}, True, False, None, 1.5, -1, -(2**40), 0, 1, 2**31, 2**63, 10**30,
          float("nan"), float("inf"), 1e300)
#: of VALUES, those no key the models read may hold (bool and null are read as flags or "absent" by some keys)
WRONG_TYPE = ("x", "12", "", [], [1], {}, {"a": 1}, 1.5, -1, -(2**40))


def gen_architectures(rng, base_: Base) -> Case:
    """One family's config with one key replaced, or the family's model_type itself of the wrong type."""
    family = rng.choice(sorted(FAMILY_CONFIGS))
    extra, always_read = FAMILY_CONFIGS[family]
    moe = family == "moe"
    config = {**(base_.moe if moe else base_.dense).config, **extra}
    if rng.random() < 0.1:
        config["model_type"] = rng.choice(([], ["llama"], 5, {"a": 1}, True))
        mutation, invalid = "model_type", True
    else:
        key = rng.choice(sorted(set(extra) - {"model_type", "architectures"} | set(always_read)))
        value = rng.choice(VALUES)
        if key == "layer_types" and rng.random() < 0.5:
            value = rng.choice((["full_attention"] * 2, ["nope"] * 6, [1] * 6, ["full_attention"] * 60))
        config[key] = value
        mutation = f"{family}:{key}"
        invalid = key in always_read and any(value is v or value == v and type(value) is type(v) for v in WRONG_TYPE)
    args = [*BASE_ARGS, "--context", "64", "--concurrency", "8", "-o", GUARD_NAME]
    return Case(family="architectures", mutation=mutation, args=args, invalid=invalid,
                files={"ckpt/config.json": json_bytes(config)}, moe=moe)
