"""Write header-only checkpoints with the real tensor names, dtypes and shapes of public models.

Each ``plans/models/NAME/config.json`` is the model's public config.json. From it this script writes
``.cache/checkpoints/NAME/``: the config, ``model.safetensors.index.json`` and sparse shards (headers only: the
disk holds a few MB, the files have their full sizes). Names and dtypes follow each release's own checkpoint
format, which transformers' in-memory names do not (transformers 5 fuses MoE experts into 3-D params):

- dense llama-style (Llama 3.1, Qwen3): ``model.layers.N.self_attn.{q,k,v,o}_proj.weight``, ``mlp.{gate,up,down}_proj``;
- Qwen3-MoE: Qwen3's attention and per-expert ``mlp.experts.E.{gate,up,down}_proj`` beside a router ``mlp.gate``;
- Mixtral: per-expert ``block_sparse_moe.experts.E.w1/w2/w3.weight``;
- DeepSeek-V3 and Kimi-K2: FP8 (F8_E4M3) weights with an F32 ``weight_scale_inv`` per 128x128 block, MLA
  attention, per-expert ``mlp.experts.E.{gate,up,down}_proj``, and DeepSeek-V3's multi-token-prediction layer
  at index ``num_hidden_layers`` (the planner reports it as unused);
- gpt-oss: MXFP4 experts as U8 ``*_blocks`` (two FP4 values a byte, 32 to a block) and U8 ``*_scales``, bf16
  elsewhere.

The same configs give the same bytes (sorted names, fixed shard size), so plans made from these folders are
reproducible; ``offload-plan check`` recomputes their fingerprints. The per-format tables are fixture code:
the planner itself reads names, never an architecture table.

    PYTHONPATH=. python3 scripts/real_checkpoints.py                 # every model under plans/models
    PYTHONPATH=. python3 scripts/real_checkpoints.py mixtral-8x7b    # one of them

Each folder is written as ``planner.header_checkpoint`` writes: a folder this script did not make is refused,
never replaced. (With the package installed, ``PYTHONPATH=.`` is not needed.)
"""

import argparse
import json
import math
import sys
from pathlib import Path

from planner.errors import OffloadPlanError, UsageError
from planner.header_checkpoint import write_checkpoint_folder

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "plans" / "models"
OUTPUT_DIR = REPO_ROOT / ".cache" / "checkpoints"
SHARD_BYTES = 5 * 2**30
FP8_BLOCK = 128
MXFP4_BLOCK = 32

BF16, F32, FP8, U8 = "BF16", "F32", "F8_E4M3", "U8"


def _text(config: dict) -> dict:
    """Head dimension and KV heads with the defaults llama-style configs leave implicit."""
    heads = config["num_attention_heads"]
    return {
        "hidden": config["hidden_size"],
        "heads": heads,
        "kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
    }


def _norms(hidden: int) -> list:
    return [("input_layernorm.weight", BF16, [hidden]), ("post_attention_layernorm.weight", BF16, [hidden])]


def _linear(name: str, out_features: int, in_features: int, dtype: str = BF16, bias: bool = False) -> list:
    specs = [(f"{name}.weight", dtype, [out_features, in_features])]
    return specs + ([(f"{name}.bias", dtype, [out_features])] if bias else [])


def _fp8_linear(name: str, out_features: int, in_features: int) -> list:
    """An FP8 weight and its F32 inverse scale per 128x128 block (DeepSeek's release format)."""
    blocks = [math.ceil(out_features / FP8_BLOCK), math.ceil(in_features / FP8_BLOCK)]
    return [(f"{name}.weight", FP8, [out_features, in_features]), (f"{name}.weight_scale_inv", F32, blocks)]


def _attention(config: dict, dtype: str = BF16) -> list:
    """Grouped-query attention: q/k/v/o projections (biases when attention_bias), Qwen3's q/k norms."""
    t, bias = _text(config), bool(config.get("attention_bias"))
    q, kv = t["heads"] * t["head_dim"], t["kv_heads"] * t["head_dim"]
    specs = (_linear("self_attn.q_proj", q, t["hidden"], dtype, bias)
             + _linear("self_attn.k_proj", kv, t["hidden"], dtype, bias)
             + _linear("self_attn.v_proj", kv, t["hidden"], dtype, bias)
             + _linear("self_attn.o_proj", t["hidden"], q, dtype, bias))
    if config["model_type"] in ("qwen3", "qwen3_moe"):
        specs += [("self_attn.q_norm.weight", dtype, [t["head_dim"]]),
                  ("self_attn.k_norm.weight", dtype, [t["head_dim"]])]
    return specs


def _gated_mlp(prefix: str, intermediate: int, hidden: int, linear=_linear,
               names=("gate_proj", "up_proj", "down_proj")) -> list:
    gate, up, down = names
    return (linear(f"{prefix}.{gate}", intermediate, hidden) + linear(f"{prefix}.{up}", intermediate, hidden)
            + linear(f"{prefix}.{down}", hidden, intermediate))


def dense_layer(config: dict, index: int) -> list:
    """Llama 3.1 and Qwen3 decoder layers."""
    hidden = config["hidden_size"]
    return _norms(hidden) + _attention(config) + _gated_mlp("mlp", config["intermediate_size"], hidden)


def mixtral_layer(config: dict, index: int) -> list:
    """Mixtral: a router and per-expert w1 (gate), w3 (up), w2 (down)."""
    hidden, experts = config["hidden_size"], config["num_local_experts"]
    specs = _norms(hidden) + _attention(config) + _linear("block_sparse_moe.gate", experts, hidden)
    for e in range(experts):
        specs += _gated_mlp(f"block_sparse_moe.experts.{e}", config["intermediate_size"], hidden,
                            names=("w1", "w3", "w2"))
    return specs


def qwen3_moe_layer(config: dict, index: int) -> list:
    """Qwen3-MoE: Qwen3 attention, a router and per-expert gate/up/down projections in every layer."""
    hidden, experts = config["hidden_size"], config["num_experts"]
    specs = _norms(hidden) + _attention(config) + _linear("mlp.gate", experts, hidden)
    for e in range(experts):
        specs += _gated_mlp(f"mlp.experts.{e}", config["moe_intermediate_size"], hidden)
    return specs


def _mla_attention(config: dict) -> list:
    """DeepSeek multi-head latent attention, FP8 projections and bf16 latent norms."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    q_head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    q_rank, kv_rank = config["q_lora_rank"], config["kv_lora_rank"]
    return (_fp8_linear("self_attn.q_a_proj", q_rank, hidden) + [("self_attn.q_a_layernorm.weight", BF16, [q_rank])]
            + _fp8_linear("self_attn.q_b_proj", heads * q_head, q_rank)
            + _fp8_linear("self_attn.kv_a_proj_with_mqa", kv_rank + config["qk_rope_head_dim"], hidden)
            + [("self_attn.kv_a_layernorm.weight", BF16, [kv_rank])]
            + _fp8_linear("self_attn.kv_b_proj", heads * (config["qk_nope_head_dim"] + config["v_head_dim"]), kv_rank)
            + _fp8_linear("self_attn.o_proj", hidden, heads * config["v_head_dim"]))


def _deepseek_moe(config: dict) -> list:
    hidden, experts, width = config["hidden_size"], config["n_routed_experts"], config["moe_intermediate_size"]
    specs = [("mlp.gate.weight", BF16, [experts, hidden])]
    if config.get("topk_method") == "noaux_tc":
        specs.append(("mlp.gate.e_score_correction_bias", F32, [experts]))
    for e in range(experts):
        specs += _gated_mlp(f"mlp.experts.{e}", width, hidden, _fp8_linear)
    return specs + _gated_mlp("mlp.shared_experts", width * config["n_shared_experts"], hidden, _fp8_linear)


def _nextn_extras(config: dict) -> list:
    """What a multi-token-prediction layer adds to a MoE layer: its own embedding, norms, projection and head."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    return [("embed_tokens.weight", BF16, [vocab, hidden]), ("enorm.weight", BF16, [hidden]),
            ("hnorm.weight", BF16, [hidden]), ("eh_proj.weight", BF16, [hidden, 2 * hidden]),
            ("shared_head.norm.weight", BF16, [hidden]), ("shared_head.head.weight", BF16, [vocab, hidden])]


def deepseek_layer(config: dict, index: int) -> list:
    """DeepSeek-V3 / Kimi-K2: dense MLP below first_k_dense_replace, MoE above; MTP layers past the stack."""
    hidden = config["hidden_size"]
    specs = _norms(hidden) + _mla_attention(config)
    if index < config["first_k_dense_replace"]:
        return specs + _gated_mlp("mlp", config["intermediate_size"], hidden, _fp8_linear)
    specs += _deepseek_moe(config)
    return specs + (_nextn_extras(config) if index >= config["num_hidden_layers"] else [])


def gpt_oss_layer(config: dict, index: int) -> list:
    """gpt-oss: biased attention with sinks, a biased router, MXFP4 experts stored as U8 blocks and scales."""
    t, experts, width = _text(config), config["num_local_experts"], config["intermediate_size"]
    hidden = t["hidden"]
    specs = _norms(hidden) + _attention(config) + [("self_attn.sinks", BF16, [t["heads"]])]
    specs += _linear("mlp.router", experts, hidden, bias=True)
    for name, out_features, in_features in (("gate_up_proj", 2 * width, hidden), ("down_proj", hidden, width)):
        blocks = in_features // MXFP4_BLOCK
        specs += [(f"mlp.experts.{name}_blocks", U8, [experts, out_features, blocks, MXFP4_BLOCK // 2]),
                  (f"mlp.experts.{name}_scales", U8, [experts, out_features, blocks]),
                  (f"mlp.experts.{name}_bias", BF16, [experts, out_features])]
    return specs


#: model_type -> layer generator (the number of layers written comes from the config)
FORMATS = {
    "llama": dense_layer,
    "qwen3": dense_layer,
    "qwen3_moe": qwen3_moe_layer,
    "mixtral": mixtral_layer,
    "deepseek_v3": deepseek_layer,
    "kimi_k2": deepseek_layer,
    "gpt_oss": gpt_oss_layer,
}


def tensor_specs(config: dict) -> list:
    """(name, dtype, shape) of every tensor of the release checkpoint, sorted by name."""
    layer = FORMATS[config["model_type"]]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    specs = [("model.embed_tokens.weight", BF16, [vocab, hidden]), ("model.norm.weight", BF16, [hidden])]
    if not config.get("tie_word_embeddings"):
        specs.append(("lm_head.weight", BF16, [vocab, hidden]))
    num_layers = config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 0)
    for index in range(num_layers):
        specs += [(f"model.layers.{index}.{name}", dtype, shape) for name, dtype, shape in layer(config, index)]
    return sorted(specs)


def write_checkpoint(name: str, output_dir: Path = OUTPUT_DIR) -> Path:
    """Write .cache/checkpoints/NAME from plans/models/NAME/config.json, replacing an earlier run's folder."""
    config_path = MODELS_DIR / name / "config.json"
    config = json.loads(config_path.read_text())
    folder = output_dir / name
    write_checkpoint_folder(config_path=config_path, specs=tensor_specs(config), out_dir=folder,
                            shard_bytes=SHARD_BYTES)
    return folder


def parser() -> argparse.ArgumentParser:
    """NAME ..., --output."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("names", nargs="*", help="models under plans/models (default: all)")
    result.add_argument("--output", type=Path, default=OUTPUT_DIR, help="where to write (default: .cache/checkpoints)")
    return result


def model_names(names: list[str]) -> list[str]:
    """The names asked for, or every model under plans/models; an unknown name is a one-line error."""
    known = sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())
    unknown = [name for name in names if name not in known]
    if unknown:
        raise UsageError(f"no plans/models/{unknown[0]}/config.json; choose from {', '.join(known)}")
    return names or known


def main(argv: list[str] | None = None) -> int:
    """Write each model's folder; bad input gets one line on stderr and the project's exit code."""
    args = parser().parse_args(argv)
    try:
        for name in model_names(args.names):
            print(f"wrote {write_checkpoint(name, args.output)}")
    except OffloadPlanError as error:
        print(f"offload-plan: error: {error}", file=sys.stderr)
        return error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
