"""Small transformers checkpoints (random weights) and plans for runtime tests, CPU and GPU alike."""

from pathlib import Path

import torch

from planner.make.make_plan import make_plan
from planner.plan.schema import Inputs, Plan

# (group_size, num_in_group, prefetch_step): whole stack, depths dividing and not dividing the number
# offloaded, back-to-back offloaded layers with depth 1, depth past the number offloaded, spread groups.
PLAN_SHAPES = [(1, 1, 1), (1, 1, 2), (1, 1, 3), (1, 1, 6), (7, 5, 2), (3, 2, 1), (3, 2, 3), (3, 1, 1), (2, 1, 2)]


def save_tiny_llama(folder: Path, *, hidden: int = 64, num_layers: int = 7, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> Path:
    """A sharded Llama checkpoint with random weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2)
    return save_random(AutoModelForCausalLM.from_config(config).to(dtype), folder, seed)


def save_tiny_moe(folder: Path, *, hidden: int = 64, num_layers: int = 7, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> Path:
    """A Qwen3-MoE checkpoint: per-expert tensors on disk, fused expert params in the model."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                            moe_intermediate_size=hidden, num_hidden_layers=num_layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2)
    return save_random(AutoModelForCausalLM.from_config(config).to(dtype), folder, seed)


def save_tiny_gemma3(folder: Path, *, hidden: int = 64, num_layers: int = 6, window: int = 8, seed: int = 0,
                     dtype: torch.dtype = torch.float32) -> Path:
    """A Gemma-3 text checkpoint: every third layer global, the rest sliding over ``window`` tokens."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    types = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_layers)]
    config = Gemma3TextConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                              num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, sliding_window=window, layer_types=types)
    return save_random(AutoModelForCausalLM.from_config(config).to(dtype), folder, seed)


def save_tiny_gpt_oss(folder: Path, *, hidden: int = 64, num_layers: int = 4, window: int = 8, seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> Path:
    """A gpt-oss-shaped checkpoint (sliding and full layers alternating, attention sinks, routed experts),
    written unquantized (no MXFP4)."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(vocab_size=256, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=num_layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                          num_local_experts=4, num_experts_per_tok=2)
    return save_random(AutoModelForCausalLM.from_config(config).to(dtype), folder, seed)


def save_random(model, folder: Path, seed: int) -> Path:
    """Save ``model`` to ``folder`` in 200 KB shards with every weight drawn at random from ``seed``; the folder."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)  # norms too: random everywhere, so a wrong weight always shows
    model.save_pretrained(folder, max_shard_size="200KB")
    return folder


def plan_with(model: Path, group_size: int, num_in_group: int, prefetch_step: int, params=(), *, tokens: int = 16,
              sequences: int = 1, context: int = 0, cuda_graph: bool = False) -> Plan:
    """A plan with pinned knobs (the search alone would offload nothing for a tiny model)."""
    inputs = Inputs(model=str(model), revision=None, gpu="h100-sxm", budget="1GiB", trigger=None, tokens=tokens,
                    sequences=sequences, context=context, params=tuple(params), stack=None, group_size=group_size,
                    num_in_group=num_in_group, prefetch_step=prefetch_step, cuda_graph=cuda_graph)
    return make_plan(inputs).plan


def with_replay_start_copies(plan: Plan, count: int) -> Plan:
    """The plan made for CUDA graphs with ``count`` wrapped copies left to each replay's start (capped at what
    the plan allows), whatever the search chose."""
    from dataclasses import replace

    count = min(count, plan.offload.prefetch_step)
    return replace(plan, workload=replace(plan.workload, cuda_graph=True),
                   offload=replace(plan.offload, replay_start_copies=count))


def save_word_tokenizer(folder: Path, vocab_size: int = 256) -> None:
    """A word-level tokenizer over vocab_size made-up words, so `run --prompt` has one to load."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)


def skeleton(folder: Path):
    """The checkpoint's meta skeleton as run builds it: headers and config.json from one planner read."""
    from planner.source.checkpoint import load_checkpoint
    from runtime.checkpoint_reader import sources_of
    from runtime.skeleton import build_skeleton

    checkpoint = load_checkpoint(str(folder))
    return build_skeleton(folder, sources_of(checkpoint, folder), checkpoint.config)


def write_plan(plan: Plan, path: Path) -> Path:
    """Write a plan file as make would."""
    from planner.plan.file import render_plan, write_atomic

    write_atomic(path, render_plan(plan, "test"))
    return path


def routed_moe_model(*, hidden: int = 64, num_layers: int = 4, num_experts: int = 16, top_k: int = 2, seed: int = 0,
                     dtype: torch.dtype = torch.float32):
    """A Qwen3-MoE model in memory (random weights, eval) with enough experts that some are resident and some
    not, for the routed-experts tests."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                            moe_intermediate_size=hidden, num_hidden_layers=num_layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=num_experts, num_experts_per_tok=top_k)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    return model.eval()


def exactly_predictable(model):
    """A copy of ``model`` whose layer 1 sees layer 0's residual unchanged (layer 0's experts and layer 1's
    attention add nothing) behind a norm of twice layer 0's weights: the next-layer prediction from layer 0's
    router input, rescaled by the norms' ratio, is exactly layer 1's routing."""
    import copy

    changed = copy.deepcopy(model)
    layers = changed.model.layers
    with torch.no_grad():
        layers[1].post_attention_layernorm.weight.copy_(2 * layers[0].post_attention_layernorm.weight)
        layers[0].mlp.experts.down_proj.zero_()
        layers[1].self_attn.o_proj.weight.zero_()
    return changed


def apply_plan_on_cpu(model, plan: Plan, lazy_copies: bool = False):
    """runtime.placement.apply_plan on the CPU stand-in: the plan's schedule executed in issue order, copies
    landing at once or (with ``lazy_copies``) only when awaited; the engine."""
    from runtime.backend import CpuStandIn
    from runtime.placement import apply_plan

    return apply_plan(model, plan, CpuStandIn(lazy_copies=lazy_copies))


def stream_on_cpu(folder: Path, plan: Plan, lazy_copies: bool = False, backend=None, phases=None):
    """``run``'s loader (runtime.load.stream_model) on the CPU stand-in: (the model streamed from its files, its
    engine); ``phases``: a runtime.stream_load.LoadPhases to fill."""
    from runtime.backend import CpuStandIn
    from runtime.load import stream_model

    return stream_model(Path(folder), plan, backend or CpuStandIn(lazy_copies=lazy_copies), phases=phases)
