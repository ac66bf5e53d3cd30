"""Conformance sweep on a CUDA GPU: every plan `make` writes keeps its promise on architectures no benchmark used.

For each model (a transformers config class at a released model's real widths: hidden size, heads, KV heads,
head_dim, intermediate sizes, experts, vocab; only 3-6 layers, so each checkpoint is at most ~9 GB), a random-weight
checkpoint in release format (planner.source.release_format where it knows the family, else transformers'
``save_pretrained``, which writes one tensor per expert) with a word-level tokenizer over its whole vocab. Each
arm, through the CLI in-process (one process per model): ``make -o plan.yaml``, then ``show``, ``export --to
vllm``, ``export --to sglang``, ``check``, ``diff`` against the model's plan at the other cap of that mode, then
``run --bench --json`` and ``run --prompt`` (32 greedy tokens) compared with the all-resident plan's text. Each
arm is one JSON line in OUT/rows.jsonl as soon as it ends (a timeout keeps what finished); OUT/table.md and a
summary (arms, passes per verdict, worst peak / cap, median |error|) come last, the summary on stdout.

    PYTHONPATH=. python3 scripts/conformance.py --out $OUT                       # every model, on a GPU
    PYTHONPATH=. python3 scripts/conformance.py --out $OUT --models qwen2-moe,mixtral --time-budget-s 480
    PYTHONPATH=. python3 scripts/conformance.py --list                            # the arms, no GPU needed
    PYTHONPATH=. python3 scripts/conformance.py --tiny --no-run --out /tmp/c      # CPU: make and the readers
    PYTHONPATH=. python3 scripts/conformance.py --dry-run --out /tmp/c           # CPU: full widths, headers only

MoE models are planned at two caps of their own (caps_for): a loose one that holds every weight and a tight one
where make routes with about 45% of each layer's experts on the host and whole layers still fit, so routed and
whole-layer arms run beside the all-resident one. Dense models may take an adapters arm: four random LoRA adapters
on every linear of the decoder (PEFT's format, written beside the checkpoint), a prefill plan of four sequences
with two GPU slots, whose ``run --bench`` serves the adapter stream (its total against the prediction, its peak
against the plan's total) and whose ``run --prompt --adapter a0`` is compared with the all-resident plan's with
the same adapter. ``--list`` states the arms and the device seconds expected.

Verdicts per arm: every command exits 0; no out-of-memory; peak GPU at or under the plan's gpu_memory_bytes (the
cap of a serving plan); peak at least 0.9 of the predicted total; measured / predicted - 1 within 10% for
``--measure`` plans and 25% for estimated ones (decode step, and a serving plan's prefill chunk); greedy text
equal to the all-resident plan's. A plan with CPU experts computes their products in another order than the GPU
(docs/experts.md, Numerics): where its text differs, its logits are decoded against the all-resident plan's
(first_split), and it passes when the tokens split at a near tie (all-resident's top two within twice the bf16
tolerance) with every logit up to the split within the tolerance. Else both are decoded again eagerly with every
routed call's routing recorded (routing_against): it passes when the first call whose routing differs from
all-resident's had its input within the tolerance (a router's near tie: sparsemixer's threshold, a top-k tie),
every step before it had its logits within the tolerance, and every routed call's output was within the tolerance
of its experts computed in fp32 (the arithmetic, checked on whatever input each call had). Any other split fails.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

#: the prompt every arm generates from (words of the checkpoints' word-level tokenizers)
PROMPT = "w11 w42 w7 w99 w123 w5 w64 w200 w31 w8"
MAX_NEW_TOKENS = 32
SERVING_CONTEXT = 4096
DECODE_CONTEXT = 2048
DECODE_SEQUENCES = 4
#: sequences of each weights plan's decode mode: MoE models' routed decode arm is one sequence's (at 4 sequences
#: Mixtral's and Phi-3.5-MoE's top-2 of 8 and 16 route to most experts of a layer, and whole layers win)
DECODE_MODES = {"decode": DECODE_SEQUENCES, "decode-1": 1}
PREFILL_TOKENS = 2048
#: the adapters mode (dense models): a prefill plan of ADAPTER_SEQUENCES sequences serving LoRA adapters (random,
#: PEFT's format, every linear of the decoder) from ADAPTER_SLOTS GPU slots; run --bench serves its stream in
#: forwards of at most the plan's sequences, and --prompt generates with the first adapter
ADAPTER_NAMES = ("a0", "a1", "a2", "a3")
ADAPTER_RANK = 16
ADAPTER_SLOTS = 2
ADAPTER_SEQUENCES = 4
#: share of the layer bytes the GPU holds at each cap (weights plans: of the budget; serving: taken from an
#: all-resident serving plan's total)
CAP_SHARES = {"loose": 0.8, "tight": 0.35}
#: the tight cap's weights at least this much over the leanest whole-layer placement
LEANEST_MARGIN = 1.1
#: what a checkpoint folder's marker says this script wrote it
KIND = "conformance-random-weights"
ERROR_PREFIX = "offload-plan: error:"
GiB = 2**30


@dataclass(frozen=True)
class Model:
    """One architecture: a transformers config class at a release's widths, cut to ``num_layers``."""

    name: str
    config_class: str
    #: the release whose widths these are
    release: str
    num_layers: int
    moe: bool
    dims: dict
    #: config.json keys added after the class writes it (quantization_config)
    extra: dict = field(default_factory=dict)
    #: --tiny: widths small enough for the CPU (layers, layer types and the kind of attention kept)
    tiny: dict = field(default_factory=dict)
    #: decode steps planned --cuda-graph (make refuses it where transformers cannot capture the step)
    graphed: bool = True

    @property
    def graph_flags(self) -> list[str]:
        return ["--cuda-graph"] if self.graphed else []


_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 512}
_TINY_MOE = _TINY | {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}

MODELS = {model.name: model for model in (
    Model("qwen2-moe", "Qwen2MoeConfig", "Qwen/Qwen1.5-MoE-A2.7B", 4, True, dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=16,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
        max_position_embeddings=8192, tie_word_embeddings=False),
        tiny=_TINY_MOE | {"num_key_value_heads": 4, "shared_expert_intermediate_size": 64}),
    Model("mixtral", "MixtralConfig", "mistralai/Mixtral-8x7B-v0.1", 3, True, dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768, rope_theta=1e6,
        sliding_window=None, tie_word_embeddings=False),
        tiny=_TINY | {"num_local_experts": 4, "num_experts_per_tok": 2}),
    Model("qwen3-moe", "Qwen3MoeConfig", "Qwen/Qwen3-30B-A3B", 4, True, dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
        max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False),
        tiny=_TINY_MOE | {"head_dim": 16}),
    Model("olmoe", "OlmoeConfig", "allenai/OLMoE-1B-7B-0924", 4, True, dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=16,
        num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096, pad_token_id=1, eos_token_id=50279,
        tie_word_embeddings=False),
        tiny=_TINY_MOE | {"num_key_value_heads": 4, "intermediate_size": 32, "pad_token_id": 1, "eos_token_id": 2}),
    Model("deepseek-v2-lite", "DeepseekV2Config", "deepseek-ai/DeepSeek-V2-Lite", 5, True, dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy", n_group=1, topk_group=1,
        max_position_embeddings=163840, tie_word_embeddings=False),
        tiny=_TINY | {"num_key_value_heads": 4, "moe_intermediate_size": 32, "n_routed_experts": 8,
                      "n_shared_experts": 1, "num_experts_per_tok": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                      "qk_rope_head_dim": 8, "v_head_dim": 16}),
    # Phi-3.5-MoE: the release's Mixtral-style block_sparse_moe.experts.E.w1/w2/w3 and block_sparse_moe.gate (which
    # transformers 5 renames to mlp.router and fuses into mlp.experts on load, and save_pretrained writes back),
    # LayerNorms with biases, attention and lm_head biases
    Model("phimoe", "PhimoeConfig", "microsoft/Phi-3.5-MoE-instruct", 3, True, dict(
        vocab_size=32064, hidden_size=4096, intermediate_size=6400, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=16, num_experts_per_tok=2, max_position_embeddings=131072, rope_theta=1e4,
        attention_bias=True, lm_head_bias=True, sliding_window=None, tie_word_embeddings=False),
        tiny=_TINY | {"num_local_experts": 4, "num_experts_per_tok": 2},
        # its rotary embedding rebuilds inv_freq on the CPU every step: make --cuda-graph refuses it
        graphed=False),
    Model("qwen3-fp8", "Qwen3Config", "Qwen/Qwen3-4B-FP8", 6, False, dict(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=True),
        extra={"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                       "weight_block_size": [128, 128]}},
        tiny=_TINY | {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}),
    Model("gemma3", "Gemma3TextConfig", "google/gemma-3-4b-it (language model)", 6, False, dict(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, sliding_window=1024, max_position_embeddings=131072, rope_theta=1e6),
        tiny=_TINY | {"head_dim": 16, "sliding_window": 64}),
    Model("gemma2", "Gemma2Config", "google/gemma-2-2b", 6, False, dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, sliding_window=4096, max_position_embeddings=8192),
        tiny=_TINY | {"head_dim": 16, "sliding_window": 64}),
    Model("mistral-sw", "MistralConfig", "mistralai/Mistral-7B-v0.1 (sliding_window 4096)", 4, False, dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        sliding_window=4096, max_position_embeddings=32768, rope_theta=1e4, tie_word_embeddings=False),
        tiny=_TINY | {"sliding_window": 64}),
    Model("phi3", "Phi3Config", "microsoft/Phi-3-mini-4k-instruct (sliding_window 2047)", 4, False, dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32,
        sliding_window=2047, max_position_embeddings=4096, pad_token_id=32000, bos_token_id=1, eos_token_id=32000,
        tie_word_embeddings=False),
        tiny=_TINY | {"num_key_value_heads": 4, "sliding_window": 64, "pad_token_id": 0, "eos_token_id": 2}),
    Model("olmo2", "Olmo2Config", "allenai/OLMo-2-1124-7B", 4, False, dict(
        vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=4096, rope_theta=5e5, pad_token_id=100277, eos_token_id=100257,
        tie_word_embeddings=False),
        tiny=_TINY | {"num_key_value_heads": 4, "pad_token_id": 1, "eos_token_id": 2}),
)}


@dataclass(frozen=True)
class Arm:
    """One plan of one model: a mode at a cap, measured or estimated, routed or whole-layer experts."""

    model: str
    mode: str  # serving-1, serving-4, serving-auto, decode, decode-1, prefill
    cap: str  # loose, tight
    measure: bool
    #: MoE only: None (make's choice, routed where it pays) or "whole-layer" (whole_layer_flags)
    experts: str | None = None

    @property
    def name(self) -> str:
        return "/".join([self.model, self.mode, self.cap, "measure" if self.measure else "estimate"]
                        + ([self.experts] if self.experts else []))

    @property
    def serving(self) -> bool:
        return self.mode.startswith("serving")

    @property
    def adapters(self) -> bool:
        return self.mode == "adapters"


#: dense models: (mode, measure, experts) pairs run at both caps, most important first
CORE_MODES = [("serving-1", True, None), ("serving-4", False, None)]
#: one more pair per dense model, in turn, so that every mode is covered once the dense models are all run
ROTATING_MODES = [("serving-auto", True, None), ("adapters", False, None), ("decode", False, None),
                  ("prefill", False, None), ("serving-auto", False, None), ("serving-4", True, None)]
#: MoE models: (mode, measure, experts, caps), most important first. At the tight cap (caps_for: the routed plan's
#: own) make's choice is routed with part of each layer's experts on the host; the loose cap holds every weight (the
#: serving-1 plan there keeps them all resident); whole layers at the tight cap beside them. Loose serving-4 and
#: decode arms (all resident) are left out to keep two calls within ~15 minutes of device time
MOE_MODES = [("serving-1", True, None, ("loose", "tight")), ("serving-1", True, "whole-layer", ("tight",)),
             ("serving-4", False, None, ("tight",)), ("decode-1", False, None, ("tight",))]
ALL_MODES = [("serving-1", True, None), ("serving-1", True, "whole-layer"), ("serving-auto", True, None),
             ("serving-4", True, None), ("serving-1", False, None), ("serving-4", False, None),
             ("serving-auto", False, None), ("decode", False, None), ("decode", False, "whole-layer"),
             ("decode", True, None), ("decode-1", False, None), ("prefill", False, None), ("prefill", True, None),
             ("adapters", False, None)]
MODE_NAMES = sorted({mode for mode, _, _ in ALL_MODES})
CAPS = ("loose", "tight")


def arms_for(model: Model, modes: list[str] | None, everything: bool = False) -> list[Arm]:
    """The model's arms, most important first, each mode at the loose then the tight cap; ``modes`` filters by
    mode name, ``everything`` takes the whole grid at both caps instead of the model's own list (MoE: MOE_MODES;
    dense: the core pairs and the model's turn of the rest)."""
    if everything:
        chosen = [(mode, measure, experts, CAPS) for mode, measure, experts in ALL_MODES]
    elif model.moe:
        chosen = MOE_MODES
    else:
        dense = [name for name, other in MODELS.items() if not other.moe]
        turn = ROTATING_MODES[dense.index(model.name) % len(ROTATING_MODES)]
        chosen = [(mode, measure, experts, CAPS) for mode, measure, experts in CORE_MODES + [turn]]
    arms = []
    for mode, measure, experts, caps in chosen:
        # adapters: dense models (LoRA on the decoder's linears; a MoE layer's experts are not linears)
        if (experts and not model.moe) or (mode == "adapters" and model.moe) or (modes and mode not in modes):
            continue
        arms += [Arm(model.name, mode, cap, measure, experts) for cap in caps]
    return arms


#: estimated device seconds of an arm (make, the readers, run --bench and run --prompt; the 2026-11-28 sweep's
#: rows: 2-6 s, routed arms 4-8 s, serving-auto with --measure up to 15 s) and of a model's fixed work (its process
#: and imports, caps_for's ~100 estimated plans, 1-2 s on the CPU here, the all-resident reference make and run)
#: beside writing its checkpoint
ARM_S = {"serving-auto": 10.0, "prefill": 5.0, "adapters": 8.0}
ARM_DEFAULT_S = 4.0
ARM_MEASURE_S = 1.5
ARM_ROUTED_S = 2.5
MODEL_FIXED_S = 18.0
#: random weights written per second (the 2026-11-28 sweep: 6.3 GB in 19 s, 2.9-3.7 GB in 13-21 s), and the start
WRITE_BYTES_PER_S = 0.4e9
WRITE_START_S = 5.0
CALIBRATE_S = 30.0


def arm_seconds(arm: Arm) -> float:
    """The arm's estimated device seconds: its mode's, more with --measure and where the tight cap routes."""
    routed = MODELS[arm.model].moe and arm.cap == "tight" and arm.experts is None
    return ARM_S.get(arm.mode, ARM_DEFAULT_S) + ARM_MEASURE_S * arm.measure + ARM_ROUTED_S * routed


def model_seconds(model: Model, arms: list[Arm], checkpoint_bytes: int) -> float:
    """A model's estimated device seconds: writing its checkpoint, its fixed work and its arms."""
    return WRITE_START_S + checkpoint_bytes / WRITE_BYTES_PER_S + MODEL_FIXED_S + sum(map(arm_seconds, arms))


# --- checkpoints -----------------------------------------------------------------------------------------------

def config_dict(model: Model, tiny: bool) -> dict:
    """config.json of the model as its transformers config class writes it (dtype bfloat16, as the releases)."""
    import transformers

    dims = model.dims | (model.tiny if tiny else {})
    config = getattr(transformers, model.config_class)(num_hidden_layers=model.num_layers, dtype="bfloat16", **dims)
    written = json.loads(config.to_json_string(use_diff=False))
    # the release's key beside the class's own where the class renames it (transformers 5.24's Qwen3MoeConfig
    # writes num_local_experts; Qwen3-30B-A3B's config.json and planner.source.release_format say num_experts)
    written |= {key: getattr(config, key, value) for key, value in dims.items() if key not in written}
    if not written.get("architectures"):  # as save_pretrained and every release write it (make --for reads it)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        written["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[written["model_type"]]]
    extra = dict(model.extra)
    if tiny and "quantization_config" in extra:
        extra["quantization_config"] = extra["quantization_config"] | {"weight_block_size": [32, 32]}
    return written | extra


def ensure_checkpoint(model: Model, root: Path, tiny: bool, device: str, header_only: bool = False
                      ) -> tuple[Path, float]:
    """The model's checkpoint folder under ``root`` (reused when this script wrote it) and the seconds taken;
    ``header_only``: the tensors' headers at full widths and no weights (sparse shards: --dry-run's plans)."""
    from planner.source.header_checkpoint import HEADER_ONLY, marker_kind, write_owned_folder, write_sparse_shards

    folder = root / (model.name + ("-tiny" if tiny else "") + ("-header" if header_only else ""))
    start = time.perf_counter()
    if marker_kind(folder) != (HEADER_ONLY if header_only else KIND):
        config = config_dict(model, tiny)
        if header_only:
            def fill(staging: Path) -> None:
                (staging / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
                write_sparse_shards(checkpoint_specs(config), staging, 5 * GiB)

            write_owned_folder(folder, kind=HEADER_ONLY, fill=fill)
        else:
            write_owned_folder(folder, kind=KIND, fill=lambda staging: fill_checkpoint(config, staging, device))
            # the shards' dirty pages written back now, not during the first benches, whose host memory traffic
            # they would share: on the H200 host the first benches after writing 10 GB ran 1.2-1.6x the next two,
            # the CPU experts' host step 2x (bench_hybrid --repeats 3, 2026-11-28; a suspect, not proven)
            os.sync()
    return folder, time.perf_counter() - start


def checkpoint_specs(config: dict) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of every tensor the sweep's checkpoint of ``config`` holds, without writing it: the
    release layout where planner.source.release_format knows the family, else what save_pretrained writes (the
    model built on the meta device, its fused experts named back one tensor per expert as transformers 5 saves
    them)."""
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from planner.source.release_format import knows, release_specs

    if knows(config):
        return release_specs(config)
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        transformers_config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(transformers_config, dtype=torch.bfloat16)
    state = model.state_dict()
    try:  # transformers 5's saving map (the loading conversions reversed)
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(model, state)
    except ImportError:  # the fused names: the same bytes, which is what the plans read
        pass
    dtypes = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    tied = getattr(transformers_config, "tie_word_embeddings", False)
    return sorted((name, dtypes.get(tensor.dtype, "BF16"), list(tensor.shape)) for name, tensor in state.items()
                  if not (tied and name == "lm_head.weight"))


def checkpoint_bytes(config: dict) -> int:
    """The bytes of the sweep's checkpoint of ``config`` (checkpoint_specs), without writing it."""
    from planner.source.header_checkpoint import num_bytes

    return sum(num_bytes(spec) for spec in checkpoint_specs(config))


def fill_checkpoint(config: dict, folder: Path, device: str) -> None:
    """Random weights in release format, config.json and a word-level tokenizer over the whole vocab."""
    from planner.source.release_format import knows

    if knows(config):
        write_release(config, folder, device)
    else:
        save_transformers(config, folder, device)
    (folder / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    write_word_tokenizer(folder, config["vocab_size"])


def write_release(config: dict, folder: Path, device: str) -> None:
    """planner.source.release_format's tensors (per-expert names, FP8 blocks and scales), one at a time."""
    import torch

    from planner.source.release_format import release_specs
    from scripts.benchmarking import random_release_tensor, write_random_shards

    generator = torch.Generator(device=device).manual_seed(0)
    write_random_shards(folder, release_specs(config),
                        lambda name, dtype, shape: random_release_tensor(name, dtype, shape, generator, device))


def save_transformers(config: dict, folder: Path, device: str) -> None:
    """A random-init bf16 model (drawn on ``device``) through save_pretrained: transformers 5 writes MoE experts
    one tensor per expert (``mlp.experts.E.{gate,up,down}_proj.weight``), the releases' own names."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="4GB")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """Words w0..w{vocab_size-1}, one id each, so `run --prompt` loads a tokenizer and every id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)


def checkpoint_facts(model: Model, folder: Path) -> dict:
    """What the report states of a checkpoint: its bytes, layers, widths and the expert tensors' names."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        names = list(json.loads(index_path.read_text())["weight_map"])
    else:
        from safetensors import safe_open

        with safe_open(folder / "model.safetensors", "np") as opened:
            names = list(opened.keys())
    config = json.loads((folder / "config.json").read_text())
    expert_names = sorted({re.sub(r"\.\d+\.", ".N.", name) for name in names if "expert" in name})
    total_bytes = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    return {"kind": "checkpoint", "model": model.name, "family": config.get("model_type"), "release": model.release,
            "num_layers": model.num_layers, "moe": model.moe, "gb": round(total_bytes / 1e9, 2),
            "dims": {key: config.get(key) for key in model.dims}, "expert_tensor_names": expert_names,
            "quantization": (config.get("quantization_config") or {}).get("quant_method")}


# --- the CLI, in-process -----------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """One command: its exit code, its streams and its error line (None when it exited 0)."""

    code: int
    stdout: str
    stderr: str

    @property
    def error(self) -> str | None:
        if self.code == 0:
            return None
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith(ERROR_PREFIX)]
        return (errors or lines or [f"exit {self.code} with nothing on stderr"])[-1][:400]


def cli(args: list) -> Outcome:
    """``offload-plan ARGS`` in this process: exit code and captured stdout and stderr."""
    import typer

    from offload_plan.app import app

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = typer.main.get_command(app).main([str(a) for a in args], standalone_mode=False)
        except SystemExit as done:  # a command that exits by itself
            code = done.code if isinstance(done.code, int) else 1
    return Outcome(int(code or 0), out.getvalue(), err.getvalue())


def make_args(arm: Arm, folder: Path, profile: str, caps: dict, output: Path) -> list:
    """make's flags for the arm (its cap from ``caps``: {"budget"|"gpu_memory": {cap: bytes}})."""
    args = ["make", "--model", folder, "--gpu", profile, "-o", output]
    graph = MODELS[arm.model].graph_flags if arm.model in MODELS else ["--cuda-graph"]
    if arm.serving:
        args += ["--concurrency", arm.mode.split("-", 1)[1], "--context", SERVING_CONTEXT, *graph,
                 "--gpu-memory", mib(caps["gpu_memory"][arm.cap])]
    elif arm.mode in DECODE_MODES:
        sequences = DECODE_MODES[arm.mode]
        args += ["--tokens", sequences, "--sequences", sequences, "--context", DECODE_CONTEXT, *graph,
                 "--budget", mib(caps["budget"][arm.cap])]
    elif arm.adapters:
        args += ["--tokens", PREFILL_TOKENS, "--sequences", ADAPTER_SEQUENCES, "--budget", mib(caps["budget"][arm.cap]),
                 *adapter_flags(folder)]
    else:
        args += ["--tokens", PREFILL_TOKENS, "--budget", mib(caps["budget"][arm.cap])]
    if arm.measure:
        args.append("--measure")
    if arm.experts == "whole-layer":
        args += whole_layer_flags(folder)
    return args


def adapters_folder(folder: Path) -> Path:
    """Where the checkpoint's random adapters lie: beside it (ensure_adapters writes them)."""
    return folder.parent / f"{folder.name}-adapters"


def adapter_flags(folder: Path) -> list:
    """make's --adapter NAME=PATH for every adapter of the checkpoint, and the slots."""
    flags = []
    for name in ADAPTER_NAMES:
        flags += ["--adapter", f"{name}={adapters_folder(folder) / name}"]
    return flags + ["--adapter-slots", ADAPTER_SLOTS]


def ensure_adapters(folder: Path, device: str) -> None:
    """Random LoRA adapters of the checkpoint's model in PEFT's format (scripts.bench_adapters.write_random_adapters:
    built on the meta device from config.json, values streamed to the files), once."""
    target = adapters_folder(folder)
    if all((target / name / "adapter_config.json").is_file() for name in ADAPTER_NAMES):
        return
    from transformers import AutoConfig

    from scripts.bench_adapters import meta_model, write_random_adapters

    config = AutoConfig.from_pretrained(folder)
    write_random_adapters(meta_model(config), target, list(ADAPTER_NAMES), rank=ADAPTER_RANK, device=device)


def adapter_bytes(folder: Path) -> dict[str, int]:
    """Each adapter's bytes on disk (its safetensors): a slot holds the largest."""
    return {name: sum(path.stat().st_size for path in (adapters_folder(folder) / name).glob("*.safetensors"))
            for name in ADAPTER_NAMES}


def whole_layer_flags(folder: Path) -> list:
    """make's flags that keep every layer whole: --for vllm where vLLM wires the architecture's offloader (the plan
    an engine user gets), else a pinned --prefetch-step 1 (pinned knobs plan whole layers; the search still
    chooses the group and how many layers it offloads)."""
    from planner.engines.versions import engine_version

    architectures = json.loads((folder / "config.json").read_text()).get("architectures") or [None]
    if engine_version("vllm").prefetch_wired(architectures[0]):
        return ["--for", "vllm"]
    return ["--prefetch-step", 1]


def mib(num_bytes: int) -> str:
    """Bytes as a size flag, rounded up to a MiB (rounded down, a cap at an all-resident total would not fit)."""
    return f"{max(1, -(-num_bytes // 2**20))}MiB"


def caps_for(folder: Path, profile: str, moe: bool = False, graphed: bool = True) -> dict:
    """Budgets (weights plans) and GPU memory (serving plans) per cap.

    Dense models: all non-layer bytes plus the cap's share of the layer bytes; serving adds to that what an
    all-resident plan at 4 sequences books beyond its weights (KV cache, activations, graph pool, CUDA context), or
    3 GiB where the planner makes no such plan. MoE models (``moe``): the loose cap holds every weight (the
    all-resident serving-4 plan's total; the weights' bytes), the tight cap is the routed plan's own (moe_tight_cap):
    where make routes, about ROUTED_TARGET_SHARE of each layer's experts on the host, and whole layers still fit.
    ``graphed``: planned --cuda-graph, as the model's arms are."""
    from planner.source.checkpoint import load_checkpoint
    from planner.model.layout import build_layout
    from planner.make.make_plan import make_plan
    from planner.plan.schema import Inputs

    checkpoint = load_checkpoint(str(folder))
    layout = build_layout(checkpoint)
    # a cap below the leanest whole-layer placement (everything outside the stack and two layers' slots) is a make
    # refusal, not a plan: the tight cap stays a little above it
    leanest = layout.non_layer_bytes + 2 * max(layer.nbytes for layer in layout.layers)
    weights = {cap: max(int(layout.non_layer_bytes + share * layout.layer_bytes), int(LEANEST_MARGIN * leanest))
               for cap, share in CAP_SHARES.items()}
    total_bytes = layout.non_layer_bytes + layout.layer_bytes
    resident_total = None
    try:
        resident = make_plan(Inputs(model=str(folder), gpu=profile, context=SERVING_CONTEXT, cuda_graph=graphed,
                                    concurrency="4"), checkpoint=checkpoint).plan
        beyond = resident.memory.total_gpu_bytes - resident.memory.gpu_bytes
        resident_total = resident.memory.total_gpu_bytes
    except Exception:  # noqa: BLE001 -- the arms' own make records why; the caps only need a figure
        beyond = 3 * GiB
    caps = {"budget": weights, "gpu_memory": {cap: beyond + num_bytes for cap, num_bytes in weights.items()},
            "all_resident_budget": int(total_bytes * 1.05) + GiB, "total_bytes": total_bytes}
    if moe and resident_total is not None:
        plan = functools.partial(plan_at, folder, profile, checkpoint, graphed=graphed)
        serving = moe_tight_cap(lambda cap, **flags: plan("serving", cap, **flags), resident_total,
                                whole_layer=whole_layer_inputs(folder))
        decode = moe_tight_cap(lambda cap, **flags: plan("decode-1", cap, **flags), total_bytes)
        caps["gpu_memory"] = {"loose": resident_total + LOOSE_MARGIN_BYTES,
                              "tight": serving["cap_bytes"] or caps["gpu_memory"]["tight"]}
        caps["budget"] = {"loose": total_bytes + LOOSE_MARGIN_BYTES, "tight": decode["cap_bytes"] or weights["tight"]}
        caps["routed_search"] = {"serving-1": serving, "decode-1": decode}
    return caps


#: MoE tight caps: the share of each routed layer's experts left on the host that the cap aims at, the band it
#: accepts, and the caps tried (shares of the all-resident figure)
ROUTED_TARGET_SHARE = 0.45
ROUTED_SHARE_BAND = (0.3, 0.6)
CAP_GRID = [0.25 + 0.75 * step / 40 for step in range(41)]
#: above the all-resident figure at the loose cap (MiB rounding, the plan's own alignment)
LOOSE_MARGIN_BYTES = 64 * 2**20


def plan_at(folder: Path, profile: str, checkpoint, kind: str, cap_bytes: int, graphed: bool = True, **flags):
    """make's plan of ``kind`` ("serving": serving-1 as the arms make it; a DECODE_MODES name: that mode's weights
    plan) at ``cap_bytes`` of GPU memory (serving) or budget (decode), estimated; ``flags``: more Inputs fields."""
    from planner.make.make_plan import make_plan
    from planner.plan.schema import Inputs

    if kind == "serving":
        inputs = Inputs(model=str(folder), gpu=profile, context=SERVING_CONTEXT, cuda_graph=graphed, concurrency="1",
                        gpu_memory=mib(cap_bytes), **flags)
    else:
        sequences = DECODE_MODES[kind]
        inputs = Inputs(model=str(folder), gpu=profile, tokens=sequences, sequences=sequences,
                        context=DECODE_CONTEXT, cuda_graph=graphed, budget=mib(cap_bytes), **flags)
    return make_plan(inputs, checkpoint=checkpoint).plan


def whole_layer_inputs(folder: Path) -> dict:
    """whole_layer_flags as Inputs fields."""
    flags = whole_layer_flags(folder)
    return {"engine": "vllm"} if flags[0] == "--for" else {"prefetch_step": 1}


def host_shares(plan) -> list[float] | None:
    """Each routed layer's share of its experts not resident (None: the plan routes no layer)."""
    from planner.plan.experts_section import MIXED, ROUTED

    experts = getattr(plan, "experts", None)
    if experts is None or experts.regime not in (ROUTED, MIXED):
        return None
    return [1 - len(layer.resident) / experts.num_experts for layer in experts.layers if layer.routed]


def moe_tight_cap(plan, top_bytes: int, whole_layer: dict | None = None) -> dict:
    """The tight cap of a MoE model's mode: of the caps CAP_GRID tries below ``top_bytes`` (the all-resident
    figure), the one where ``plan(cap)`` routes with each layer's host share nearest ROUTED_TARGET_SHARE, inside
    ROUTED_SHARE_BAND where one is, and (``whole_layer``: Inputs fields that keep layers whole) where a whole-layer
    plan fits too. Returns the cap (None: make routes at no cap tried) and what make chose there."""
    tried = []
    for share in CAP_GRID:
        cap_bytes = int(share * top_bytes)
        try:
            made = plan(cap_bytes)
        except Exception:  # noqa: BLE001 -- a cap make refuses is no candidate
            continue
        shares = host_shares(made)
        if shares:
            tried.append((cap_bytes, shares, made.experts.regime))
    low, high = ROUTED_SHARE_BAND
    tried.sort(key=lambda item: (not low <= min(item[1]) <= max(item[1]) <= high,
                                 abs(statistics.mean(item[1]) - ROUTED_TARGET_SHARE)))
    for cap_bytes, shares, regime in tried:
        if whole_layer is not None:
            try:
                whole = plan(cap_bytes, **whole_layer)
            except Exception:  # noqa: BLE001 -- whole layers do not fit here: a higher cap
                continue
            offloaded = len(whole.offload.layers) if whole.offload else 0
        return {"cap_bytes": cap_bytes, "gib": round(cap_bytes / GiB, 2), "regime": regime,
                "host_share": [round(min(shares), 2), round(max(shares), 2)],
                "whole_layer_offloaded": offloaded if whole_layer is not None else None}
    return {"cap_bytes": None, "gib": None, "regime": None, "host_share": None, "whole_layer_offloaded": None}


# --- one arm -----------------------------------------------------------------------------------------------------

def plan_figures(path: Path) -> dict:
    """What the plan predicts, read from its file (defensively: other fields may come and go)."""
    import yaml

    plan = yaml.safe_load(path.read_text())
    memory, prediction = plan.get("memory") or {}, plan.get("prediction") or {}
    offload, experts = plan.get("offload") or {}, plan.get("experts") or {}
    return {"predicted": {key: value for key, value in prediction.items() if not isinstance(value, (list, dict))},
            "memory": {key: value for key, value in memory.items() if not isinstance(value, (list, dict))},
            "regime": experts.get("regime"), "offloaded_layers": len(offload.get("layers") or []),
            "host_share": host_share_figures(experts),
            "knobs": [offload.get("group_size"), offload.get("num_in_group"), offload.get("prefetch_step")],
            "concurrency": (plan.get("workload") or {}).get("concurrency"),
            "architecture": (plan.get("model") or {}).get("architecture"),
            "mechanism": offload.get("mechanism", "prefetch"),
            "adapters": {key: value for key, value in (plan.get("adapters") or {}).items()
                         if key in ("num_slots", "slot_bytes", "gpu_bytes", "mode", "mode_margin")} or None}


def host_share_figures(experts: dict) -> list[float] | None:
    """[least, most] of the routed layers' shares of experts left on the host, from the plan file's experts
    section (None: no layer routed)."""
    num_experts = experts.get("num_experts")
    shares = [1 - len(layer.get("resident") or []) / num_experts for layer in experts.get("layers") or []
              if layer.get("regime") == "routed"] if num_experts else []
    return [round(min(shares), 2), round(max(shares), 2)] if shares else None


def gpu_clean() -> int:
    """Free what the last command left on the GPU and lift run's cap; the bytes still allocated (~0 expected)."""
    import gc

    import torch

    gc.collect()
    if not torch.cuda.is_available():
        return 0
    torch.cuda.set_per_process_memory_fraction(1.0)
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def views(arm: Arm, plan: Path, other: Path | None) -> dict:
    """show, export to both engines, check and diff against the other cap's plan: exit code and error line."""
    commands = {"show": ["show", plan], "export_vllm": ["export", plan, "--to", "vllm"],
                "export_sglang": ["export", plan, "--to", "sglang"], "check": ["check", plan]}
    if other is not None:
        commands["diff"] = ["diff", other, plan]
    outcomes = {name: cli(args) for name, args in commands.items()}
    result = {"exit": {name: o.code for name, o in outcomes.items()},
              "errors": {name: o.error for name, o in outcomes.items() if o.error}}
    if other is None:
        result["errors"]["diff"] = "skipped: the other cap's plan was not made"
    return result


#: the link probe before each bench: pinned host-to-device copies of this many bytes, timed back to back
LINK_PROBE_BYTES = 256 * 2**20
LINK_PROBE_COPIES = 4


def link_rate_now() -> float:
    """GB/s of pinned host-to-device copies right now, recorded beside each arm's steps: link-bound steps drift
    from arm to arm and within one run (on the H100, a Mistral-SW plan whose link floor is 16.1 ms stepped 16.7 to
    30.8 ms in one run of ten steps)."""
    import torch

    host = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(LINK_PROBE_COPIES):
        device.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    rate = LINK_PROBE_COPIES * LINK_PROBE_BYTES / (start.elapsed_time(end) * 1e6)
    del host, device
    return round(rate, 2)


def run_bench(plan: Path) -> tuple[Outcome, dict | None]:
    """``run PLAN --bench --json``: its outcome, and the figures its JSON holds (None where it printed none)."""
    bench = cli(["run", plan, "--bench", "--json"])
    figures = None
    if not bench.error:
        with contextlib.suppress(ValueError):
            figures = json.loads(bench.stdout[bench.stdout.index("{"):])
    return bench, figures


def run_plan(plan: Path, new_tokens: int = MAX_NEW_TOKENS, prompt_flags: tuple = ()) -> dict:
    """run --bench --json and run --prompt (``new_tokens`` greedy tokens, with ``prompt_flags``: an adapter), each
    from a clean GPU; their exit codes, figures and text."""
    row = {"exit": {}, "errors": {}}
    row["allocated_before_bench_bytes"] = gpu_clean()
    row["link_gb_per_s_before"] = link_rate_now()
    bench, figures = run_bench(plan)
    row["link_gb_per_s_after"] = link_rate_now()  # a link that moved during the bench shows here
    row["exit"]["bench"] = bench.code
    if bench.error:
        row["errors"]["bench"] = bench.error
    elif figures is not None:
        row["bench"] = figures
    row["allocated_before_prompt_bytes"] = gpu_clean()
    prompt = cli(["run", plan, "--prompt", PROMPT, "--max-new-tokens", new_tokens, *prompt_flags])
    row["exit"]["prompt"] = prompt.code
    if prompt.error:
        row["errors"]["prompt"] = prompt.error
    row["text"] = prompt.stdout.strip() if prompt.code == 0 else None
    gpu_clean()
    return row


def verdicts(arm: Arm, row: dict, reference_text: str | None) -> dict:
    """Each verdict True/False, or None where the arm has no figure for it (run skipped or failed before)."""
    bench, memory = row.get("bench"), row.get("plan", {}).get("memory", {})
    errors = " ".join(row.get("errors", {}).values()).lower()
    result = {"exit_ok": exits_ok(row),
              "no_oom": "out of memory" not in errors and "out of gpu memory" not in errors
              and 70 not in row["exit"].values()}
    if not bench:
        return result | {"peak_le_cap": None, "peak_ge_0.9_predicted": None, "error_within": None,
                         "tokens_equal": tokens_equal(row, reference_text)}
    # a weights plan's peak_gpu_bytes is the timed steps' allocated peak; the process's (loading, the context and
    # kernels outside the allocator included) is what the plan's total promises
    peak = bench.get("process_peak_gpu_bytes") or bench.get("peak_gpu_bytes")
    cap = memory.get("gpu_memory_bytes") or bench.get("gpu_memory_bytes")
    predicted_total = bench.get("predicted_total_gpu_bytes") or memory.get("total_gpu_bytes")
    row["peak_over_cap"] = peak / cap if peak and cap else None
    row["peak_over_predicted"] = peak / predicted_total if peak and predicted_total else None
    row["prediction_errors"] = prediction_errors(bench)
    limit = 0.10 if arm.measure else 0.25
    return result | {
        "peak_le_cap": None if row["peak_over_cap"] is None else row["peak_over_cap"] <= 1.0,
        "peak_ge_0.9_predicted": None if row["peak_over_predicted"] is None else row["peak_over_predicted"] >= 0.9,
        "error_within": all(abs(error) <= limit for error in row["prediction_errors"].values())
        if row["prediction_errors"] else None,
        "tokens_equal": tokens_equal(row, reference_text)}


def exits_ok(row: dict) -> bool:
    """Every command exited 0, or refused in one line where that is the promise: an export whose engine wires no
    offloader for the architecture (expected_refusals), or one that names the make command whose plan the engine
    can express (SGLang's DeepSeek code offloads only routed experts, never whole layers)."""
    expected = expected_refusals(row.get("plan", {}).get("architecture"))
    errors = row.get("errors", {})
    return all(code == 0 or (code not in (2, 70) and (step in expected or _names_the_fix(step, errors.get(step))))
               for step, code in row["exit"].items())


def _names_the_fix(step: str, error: str | None) -> bool:
    """An export's one-line refusal that says which plan to make instead."""
    return step.startswith("export_") and bool(error) and "\n" not in error.strip() and "make the plan" in error


def expected_refusals(architecture: str | None) -> set[str]:
    """The exports whose engine wires no offloader for the architecture: a one-line refusal (a plan error, not a
    usage error or a crash) is what they promise."""
    from planner.engines.versions import engine_version

    refused = set()
    for engine in ("vllm", "sglang"):
        release = engine_version(engine)
        if not release.prefetch_wired(architecture) and not release.read_at_use_wired(architecture):
            refused.add(f"export_{engine}")
    return refused


def prediction_errors(bench: dict) -> dict:
    """measured / predicted - 1 of the decode step (or the weights plan's step) and a serving prefill chunk."""
    pairs = {"decode_step": ("decode_step_ms", "predicted_decode_step_ms"),
             "prefill_chunk": ("prefill_chunk_ms", "predicted_prefill_chunk_ms"),
             "step": ("step_ms", "predicted_step_ms")}
    errors = {name: bench[measured] / bench[predicted] - 1 for name, (measured, predicted) in pairs.items()
              if bench.get(measured) and bench.get(predicted)}
    # an adapter plan's bench: the stream served in the plan's mode, its total against the prediction
    served = [mode for mode in bench.get("modes") or () if mode.get("mode") == bench.get("plan_mode")]
    if served and served[0].get("total_ms") and served[0].get("predicted_total_ms"):
        errors["adapter_stream"] = served[0]["total_ms"] / served[0]["predicted_total_ms"] - 1
    return errors


def tokens_equal(row: dict, reference_text: str | None) -> bool | None:
    """The arm's greedy text is the all-resident plan's; or, for a plan with CPU experts, whose arithmetic is not
    the GPU's bit for bit (docs/experts.md, Numerics), it splits at a near tie with every logit up to the split
    within the bf16 tolerance (``row["logits"]``: first_split against the all-resident plan's decode)."""
    if row.get("text") is None or reference_text is None:
        return None if "prompt" not in row["exit"] else False
    if row["text"] == reference_text:
        return True
    split = row.get("logits")
    return bool(split and ((split.get("near_tie") and split["within_tolerance"])
                           or (split.get("routing") or {}).get("router_tie")))


def tokens_text(row: dict) -> str:
    """The tokens verdict for the table, with where and how a CPU-experts plan's decode split."""
    verdict = row.get("verdicts", {}).get("tokens_equal", "-")
    split = row.get("logits")
    if not split or split.get("split_at") is None:
        return str(verdict)
    routing = split.get("routing") or {}
    kind = "near tie" if split["near_tie"] else "router near tie" if routing.get("router_tie") else "fault"
    text = (f"{verdict}: {kind} at step {split['split_at']} (top-two gap {split['margin_share']:.2%}, logits within "
            f"{split['worst_share']:.2%})")
    flip = routing.get("flip")
    if flip:
        where = "the prefill" if flip["step"] is None else f"step {flip['step']}"
        which = "a router's near tie" if routing["router_tie"] else "a router's choice"
        change = "another expert" if flip["other_expert"] else f"a weight {flip['weight_gap']:.2f} off"
        worst = routing["experts_worst_share"]
        calls = "" if worst is None else f"; every routed call within {worst:.2%} of its fp32 experts"
        text += (f"; from {which} at {where}, layer {flip['layer']} (input within {flip['input_share']:.2%}, "
                 f"{change}{calls})")
    return text


def has_cpu_experts(path: Path) -> bool:
    """Whether the plan computes experts on the CPU (an experts.cpu section)."""
    import yaml

    return bool((yaml.safe_load(path.read_text()).get("experts") or {}).get("cpu"))


@functools.lru_cache(maxsize=2)
def reference_logits(path: Path) -> list:
    """The all-resident plan's greedy logits (decoded once per model)."""
    return greedy_logits(path, MAX_NEW_TOKENS)[1]


def split_against(plan: Path, reference_plan: Path) -> dict:
    """first_split of the plan's greedy decode against the all-resident plan's, at the bf16 tolerance; where that
    is no near tie within the tolerance, ``routing``: both decoded again eagerly with their routing recorded
    (routing_against)."""
    from runtime.cpu_experts import BF16_TOLERANCE

    split = first_split(greedy_logits(plan, MAX_NEW_TOKENS)[1], reference_logits(reference_plan), BF16_TOLERANCE)
    gpu_clean()
    if split["split_at"] is not None and not (split["near_tie"] and split["within_tolerance"]):
        split["routing"] = routing_against(plan, reference_plan, BF16_TOLERANCE)
        gpu_clean()
    return split


def routing_against(plan: Path, reference_plan: Path, tolerance: float) -> dict:
    """The plan's and the all-resident plan's eager decodes with their routing recorded: the eager first_split's
    step and shares, ``experts_worst_share`` (every routed call of the plan against its experts in fp32:
    the CPU's and the GPU's arithmetic, on whatever input the call had), the first routing_flip, and
    ``router_tie``: that flip is a router's near tie (its input within the tolerance), every routed call within
    the tolerance of its fp32 experts, and every step's logits before the flip's within the tolerance. The CPU's
    fp32 sums then moved a router's input across its boundary, as a near tie of the logits moves the argmax: from
    that step on the two decodes differ in what they compute, and their logits are compared no further."""
    records, reference_records = [], []
    logits = greedy_logits(plan, MAX_NEW_TOKENS, routing=records)[1]
    reference = greedy_logits(reference_plan, MAX_NEW_TOKENS, routing=reference_records)[1]
    split = first_split(logits, reference, tolerance)
    flip = routing_flip(records, reference_records, tolerance)
    checked = [record["experts_share"] for record in records if record["experts_share"] is not None]
    experts_worst = max(checked, default=None)
    flip_step = None if flip is None else (flip["step"] or 0)  # a flip in the prefill: before step 0
    router_tie = bool(flip and flip["near_tie"] and experts_worst is not None and experts_worst <= tolerance
                      and all(share <= tolerance for share in split["shares"][:flip_step]))
    return {"split_at": split["split_at"], "worst_share": split["worst_share"], "shares": split["shares"],
            "experts_worst_share": experts_worst, "experts_calls": len(checked), "flip": flip,
            "router_tie": router_tie}


def first_split(logits: list, reference_logits: list, tolerance: float) -> dict:
    """Where a greedy decode first takes another token than the reference's, and whether the tolerance admits it.
    ``logits``: per decode step, a 1-D tensor over the vocabulary; step k's argmax is the token that step k + 1
    reads (the prefill's argmax is read by step 0), so the split is the first step whose argmax differs, and
    every step up to it read the same tokens in both decodes. Each step's logits against the reference's, as a
    share of the reference step's largest magnitude, up to and at the split (``worst_share``, and per step in
    ``shares``); the reference's top-two gap there, as the same share (``margin_share``); a near tie is a gap
    within twice the tolerance (the CPU's fp32 sums may then break it the other way), anything else a fault.
    ``equal_share``: the share of those steps' logits bitwise equal to the reference's."""
    split = next((step for step, (a, b) in enumerate(zip(logits, reference_logits))
                  if int(a.argmax()) != int(b.argmax())), None)
    last = min(len(logits), len(reference_logits)) - 1 if split is None else split
    shares = [float((logits[step] - reference_logits[step]).abs().max()) / float(reference_logits[step].abs().max())
              for step in range(last + 1)]
    worst = max(shares, default=0.0)
    equal = sum(int((logits[step] == reference_logits[step]).sum()) for step in range(last + 1))
    total = sum(reference_logits[step].numel() for step in range(last + 1))
    result = {"split_at": split, "worst_share": worst, "within_tolerance": worst <= tolerance,
              "equal_share": equal / total if total else None, "shares": [round(share, 5) for share in shares]}
    if split is not None:
        top_two = reference_logits[split].topk(2).values
        margin = float(top_two[0] - top_two[1]) / float(reference_logits[split].abs().max())
        result |= {"margin_share": margin, "near_tie": margin <= 2 * tolerance}
    return result


def greedy_logits(path: Path, num_tokens: int, graphed: bool | None = None, routing: list | None = None
                  ) -> tuple[list[int], list]:
    """The plan's greedy decode of PROMPT, in this process, over the static cache ``run --prompt`` decodes with
    (replayed from CUDA graphs where the plan was made graphed, or as ``graphed`` says): its ids and each step's
    logits (CPU). ``routing`` (a list): decoded eagerly, with every routed experts call appended to it in order
    (routing_records)."""
    import torch
    from transformers import AutoTokenizer

    from planner.plan.file import read_plan
    from runtime.graph import NUM_WARMUP_CALLS, DecodeLoop, calls_for, steps_per_call_for
    from runtime.load import load_with_plan

    plan = read_plan(path)
    if routing is not None:
        graphed = False  # hooks do not run in a graph's replay
    elif graphed is None:
        graphed = bool(plan.workload.cuda_graph)
    loaded = load_with_plan(plan)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(loaded.source.folder))
        prompt = tokenizer(PROMPT, return_tensors="pt")["input_ids"].to("cuda")
        steps = steps_per_call_for(graphed)
        room_tokens = max(NUM_WARMUP_CALLS, calls_for(num_tokens, steps)) * steps  # as run --prompt's cache
        loop = DecodeLoop(loaded.model, batch=1, max_cache_tokens=prompt.shape[1] + room_tokens,
                          device=prompt.device, engine=loaded.engine, steps_per_call=steps)
        with routing_records(loaded.model, routing, loaded.engine.routed_experts) as forwards:
            loop.prefill(prompt)
            loop.capture() if graphed else loop.warm_up()
            forwards["decode_from"] = forwards["count"]
            ids, logits = loop.generate(num_tokens)
        torch.cuda.synchronize()
        return ids[0].tolist(), [step[0].float().cpu() for step in logits]
    finally:
        loaded.engine.close()


@contextlib.contextmanager
def routing_records(model, records: list | None, routed=None):
    """While entered (``records`` not None), each call of a layer's ``mlp.experts`` appends {"forward": the
    model's forward it ran in, "step": the decode step (None before the decode), "layer", "hidden" [T, H] fp32,
    "ids" [T, k], "weights" [T, k] fp32, "experts_share": for a layer of ``routed`` (runtime.routed_experts.
    RoutedExperts) whose experts are SwiGLU's (swiglu_experts), the call's output against its experts in fp32
    from the host copy (experts_fp32), as a share of that's largest magnitude, else None} (on the CPU) to
    ``records``. Yields a dict whose "decode_from" the caller sets to "count" (the forwards run) where the decode
    starts."""
    import re as regex

    forwards = {"count": 0, "decode_from": None}
    if records is None:
        yield forwards
        return

    def counted(module, args):
        forwards["count"] += 1

    def recorded(layer: int):
        def hook(module, args, kwargs, output):
            hidden, ids, weights = [*args, *kwargs.values()][:3]
            forward = forwards["count"] - 1
            start = forwards["decode_from"]
            share = None
            if routed is not None and layer in routed.layers and swiglu_experts(routed, layer):
                reference = experts_fp32(routed, layer, hidden, ids, weights)
                share = float((output.float().reshape(reference.shape) - reference).abs().max()
                              / reference.abs().max())
            records.append({"forward": forward, "step": None if start is None else forward - start,
                            "layer": layer, "hidden": hidden.detach().float().cpu(), "ids": ids.detach().cpu(),
                            "weights": weights.detach().float().cpu(), "experts_share": share})
        return hook

    handles = [model.register_forward_pre_hook(counted)]
    for name, module in model.named_modules():
        found = regex.search(r"layers\.(\d+)\.mlp\.experts$", name)
        if found and hasattr(module, "num_experts"):
            handles.append(module.register_forward_hook(recorded(int(found.group(1))), with_kwargs=True))
    try:
        yield forwards
    finally:
        for handle in handles:
            handle.remove()


def swiglu_experts(routed, layer: int) -> bool:
    """Whether the routed layer's experts are what experts_fp32 computes: gate_up and down, no biases, an act_fn."""
    return sorted(routed.param_names) == ["down_proj", "gate_up_proj"] and hasattr(routed.modules[layer], "act_fn")


def experts_fp32(routed, layer: int, hidden, ids, weights):
    """A routed layer's experts call computed in fp32 from the host copy of its experts (SwiGLU: gate_up [2I, H]
    gate rows first, down [H, I], the module's activation): [T, H] on the hidden states' device."""
    import torch

    module = routed.modules[layer]
    x = hidden.reshape(-1, hidden.shape[-1]).float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for token in range(ids.shape[0]):
        for rank in range(ids.shape[1]):
            expert = int(ids[token, rank])
            if expert < 0:
                continue
            gate_up = routed.host[layer, "gate_up_proj"][expert].to(x.device).float()
            down = routed.host[layer, "down_proj"][expert].to(x.device).float()
            gate, up = (gate_up @ x[token]).chunk(2)
            out[token] += float(weights[token, rank]) * (down @ (module.act_fn(gate) * up))
    return out


def routing_flip(records: list, reference_records: list, tolerance: float) -> dict | None:
    """The first routed experts call of a decode (routing_records) whose routing differs from the reference's
    (another expert for a token, or a routing weight off by more than ``tolerance``), with its step, its layer and
    its input against the reference's as a share of the reference's largest magnitude; ``near_tie``: that input
    is within ``tolerance``, so the router's decision lay that close to its boundary (a router is discontinuous:
    the top-k at a tie, PhiMoE's sparsemixer at its threshold). None where the calls never differ, or the two
    decodes' calls do not align."""
    import torch

    for mine, theirs in zip(records, reference_records):
        if (mine["layer"], mine["forward"], mine["ids"].shape) != (theirs["layer"], theirs["forward"],
                                                                   theirs["ids"].shape):
            return None
        order, reference_order = mine["ids"].sort(-1), theirs["ids"].sort(-1)
        other_expert = not torch.equal(order.values, reference_order.values)
        weight_gap = 0.0 if other_expert else float(
            (mine["weights"].gather(-1, order.indices) - theirs["weights"].gather(-1, reference_order.indices))
            .abs().max())
        if other_expert or weight_gap > tolerance:
            input_share = float((mine["hidden"] - theirs["hidden"]).abs().max() / theirs["hidden"].abs().max())
            return {"step": mine["step"], "layer": mine["layer"], "input_share": input_share,
                    "other_expert": other_expert, "weight_gap": weight_gap, "near_tie": input_share <= tolerance,
                    "ids": mine["ids"].tolist(), "reference_ids": theirs["ids"].tolist(),
                    "weights": [[round(w, 4) for w in row] for row in mine["weights"].tolist()],
                    "reference_weights": [[round(w, 4) for w in row] for row in theirs["weights"].tolist()]}
    return None


# --- one model, in its own process ---------------------------------------------------------------------------------

def run_model(model: Model, arms: list[Arm], args, emit) -> None:
    """Write (or reuse) the checkpoint, then every arm in pairs of caps; ``emit(row)`` as each ends."""
    device = "cpu" if args.no_run else "cuda"
    try:
        folder, write_s = ensure_checkpoint(model, args.checkpoints, args.tiny, device, header_only=args.dry_run)
    except Exception as error:  # noqa: BLE001 -- the sweep never crashes: the failure is the model's row
        emit({"kind": "checkpoint", "model": model.name, "error": one_line(error)})
        return
    emit(checkpoint_facts(model, folder) | {"write_s": round(write_s, 1)})
    work = args.out / "plans" / folder.name
    work.mkdir(parents=True, exist_ok=True)
    caps = caps_for(folder, args.profile, moe=model.moe, graphed=model.graphed)
    emit(caps_row(model, caps))
    family = json.loads((folder / "config.json").read_text()).get("model_type")
    reference = None if args.no_run else reference_text(folder, args.profile, caps, work, emit, model)
    adapter_reference = None
    if any(arm.adapters for arm in arms):
        try:
            ensure_adapters(folder, device)
        except Exception as error:  # noqa: BLE001 -- as a checkpoint: the failure is the model's row
            emit({"kind": "adapters", "model": model.name, "error": one_line(error)})
            arms = [arm for arm in arms if not arm.adapters]
        else:
            if not args.no_run:
                adapter_reference = reference_text(folder, args.profile, caps, work, emit, model, adapters=True)
    pairs: dict[tuple, list[Arm]] = {}
    for arm in arms:
        pairs.setdefault((arm.mode, arm.measure, arm.experts), []).append(arm)
    # (mode, cap) -> a plan made there: an arm without a pair is diffed against the same mode's plan at either cap,
    # else a plan of its kind (serving or weights) at its cap
    plans: dict[tuple, Path] = {}
    for pair in pairs.values():
        if time.time() > args.deadline:
            emit({"kind": "skipped", "model": model.name, "arms": [arm.name for arm in pair],
                  "why": "past --time-budget-s"})
            continue
        made = {arm: make_arm(arm, folder, args.profile, caps, work, args.dry_run) for arm in pair}
        for arm in pair:
            other = next((made[a]["path"] for a in pair if a != arm and made[a]["exit"]["make"] == 0), None)
            other = other or next((path for (mode, cap), path in plans.items()
                                   if (mode, cap) == (arm.mode, arm.cap) or mode == arm.mode), None) or next(
                (path for (mode, cap), path in plans.items()
                 if cap == arm.cap and mode.startswith("serving") == arm.serving), None)
            emit(finish_arm(arm, made[arm], other, caps, args.no_run, adapter_reference if arm.adapters
                            else reference, reference_path(work, arm.adapters)) | {"family": family})
        plans |= {(arm.mode, arm.cap): made[arm]["path"] for arm in pair
                  if made[arm]["exit"]["make"] == 0 and (arm.mode, arm.cap) not in plans}


def caps_row(model: Model, caps: dict) -> dict:
    """The caps the model's arms are made at, in GiB, and (MoE) what make chose at each tight cap."""
    return {"kind": "caps", "model": model.name,
            "gpu_memory_gib": {cap: round(b / GiB, 2) for cap, b in caps["gpu_memory"].items()},
            "budget_gib": {cap: round(b / GiB, 2) for cap, b in caps["budget"].items()},
            "routed_search": caps.get("routed_search")}


def make_arm(arm: Arm, folder: Path, profile: str, caps: dict, work: Path, dry_run: bool = False) -> dict:
    """make -o for the arm: its plan's path, exit code, error line and seconds (``dry_run``: estimated, without
    --measure, which needs the GPU)."""
    start = time.perf_counter()
    path = work / (arm.name.split("/", 1)[1].replace("/", "-") + ".yaml")
    path.unlink(missing_ok=True)  # a plan a previous sweep left must not stand in for a failed make
    made = cli([a for a in make_args(arm, folder, profile, caps, path) if not (dry_run and a == "--measure")])
    return {"path": path, "exit": {"make": made.code}, "errors": {"make": made.error} if made.error else {},
            "make_s": time.perf_counter() - start}


def finish_arm(arm: Arm, made: dict, other: Path | None, caps: dict, no_run: bool, reference: str | None,
               reference_plan: Path) -> dict:
    """The arm's row: the plan's figures, the readers' exits, run's figures and the verdicts (``reference``: the
    all-resident plan's greedy text, ``reference_plan`` its plan)."""
    start = time.perf_counter()
    row = {"kind": "arm", "arm": arm.name, "model": arm.model, "family": None, "moe": MODELS[arm.model].moe,
           "mode": arm.mode, "cap": arm.cap, "measure": arm.measure, "experts": arm.experts or "make's choice",
           "cap_bytes": (caps["gpu_memory"] if arm.serving else caps["budget"])[arm.cap],
           "exit": dict(made["exit"]), "errors": dict(made["errors"])}
    if made["exit"]["make"] == 0:
        row["plan"] = plan_figures(made["path"])
        checked = views(arm, made["path"], other)
        row["exit"] |= checked["exit"]
        row["errors"] |= checked["errors"]
        if not no_run:
            ran = run_plan(made["path"], prompt_flags=("--adapter", ADAPTER_NAMES[0]) if arm.adapters else ())
            row["exit"] |= ran.pop("exit")
            row["errors"] |= ran.pop("errors")
            row |= ran
            if (reference is not None and row["text"] is not None and row["text"] != reference
                    and has_cpu_experts(made["path"])):
                row["logits"] = split_against(made["path"], reference_plan)
    row["verdicts"] = verdicts(arm, row, reference) if not no_run else {"exit_ok": exits_ok(row)}
    row["seconds"] = round(made["make_s"] + time.perf_counter() - start, 1)
    return row


def reference_text(folder: Path, profile: str, caps: dict, work: Path, emit, model: Model,
                   adapters: bool = False) -> str | None:
    """The all-resident plan's greedy text (a budget that holds every weight), run first; ``adapters``: the
    adapters arms' reference, the plan with the adapters (their slots on top of the budget) generating with the
    first."""
    path = reference_path(work, adapters)
    path.unlink(missing_ok=True)
    if adapters:
        slots_bytes = ADAPTER_SLOTS * max(adapter_bytes(folder).values())
        step = ["--tokens", PREFILL_TOKENS, "--sequences", ADAPTER_SEQUENCES, *adapter_flags(folder), "--budget",
                mib(caps["all_resident_budget"] + slots_bytes)]
    else:
        step = ["--tokens", 1, "--sequences", 1, "--context", DECODE_CONTEXT, *model.graph_flags, "--budget",
                mib(caps["all_resident_budget"])]
    made = cli(["make", "--model", folder, "--gpu", profile, *step, "-o", path])
    row = {"kind": "reference", "model": model.name, "adapters": adapters, "exit": {"make": made.code},
           "errors": {"make": made.error} if made.error else {}}
    if made.code == 0:
        ran = run_plan(path, prompt_flags=("--adapter", ADAPTER_NAMES[0]) if adapters else ())
        row["exit"] |= ran.pop("exit")
        row["errors"] |= ran.pop("errors")
        row |= ran
    emit(row)
    return row.get("text")


def reference_path(work: Path, adapters: bool) -> Path:
    """The all-resident plan's path in the model's plans folder."""
    return work / ("all-resident-adapters.yaml" if adapters else "all-resident.yaml")


def one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:400]


# --- the sweep -------------------------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/conformance-out"),
                        help="folder for rows.jsonl, table.md and the plans (default: $OUT, else "
                             "/tmp/conformance-out)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    parser.add_argument("--modes", default="", help=f"comma-separated, of: {', '.join(MODE_NAMES)} (default: all)")
    parser.add_argument("--all-arms", action="store_true",
                        help="every mode pair for every model (default: the core pairs and each model's turn)")
    parser.add_argument("--time-budget-s", type=float, default=540.0,
                        help="start no arm past this many seconds; the table is still written")
    parser.add_argument("--checkpoints", type=Path, default=Path("/tmp/conformance"),
                        help="checkpoint folders: reused when this script wrote them")
    parser.add_argument("--gpu", dest="profile", default=None,
                        help="profile for make (default: calibrate once into OUT/calibrated.yaml; h100-sxm with "
                             "--no-run)")
    parser.add_argument("--list", action="store_true", help="print the arms and exit (no GPU needed)")
    parser.add_argument("--tiny", action="store_true", help="tiny widths (a CPU smoke of the non-run parts)")
    parser.add_argument("--no-run", action="store_true",
                        help="make and the readers only, on the CPU, in this process (no run --bench/--prompt)")
    parser.add_argument("--dry-run", action="store_true",
                        help="--no-run on header-only checkpoints at full widths (no weights written) and estimated "
                             "plans (--measure dropped): the caps and the regimes make picks, on the CPU")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return parser


def selected(args) -> list[tuple[Model, list[Arm]]]:
    """The models and arms the filters leave, in run order (a model no arm is left for is not built); an unknown
    name is one line on stderr, exit 2."""
    names = [name for name in args.models.split(",") if name]
    modes = [mode for mode in args.modes.split(",") if mode]
    unknown = [n for n in names if n not in MODELS] + [m for m in modes if m not in MODE_NAMES]
    if unknown:
        raise SystemExit(f"conformance: unknown model or mode {', '.join(unknown)}; models: {', '.join(MODELS)}; "
                         f"modes: {', '.join(MODE_NAMES)}")
    chosen = [(MODELS[name], arms_for(MODELS[name], modes, args.all_arms)) for name in names]
    return [(model, arms) for model, arms in chosen if arms]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.no_run = args.no_run or args.dry_run
    plan = selected(args)
    if args.list:
        for model, arms in plan:
            for arm in arms:
                print(arm.name)
        print(f"{sum(len(arms) for _, arms in plan)} arms over {len(plan)} models; {estimate(plan, args.tiny)}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    args.deadline = args.deadline or time.time() + args.time_budget_s
    rows_path = args.out / "rows.jsonl"
    if args.worker:
        model, arms = next((m, a) for m, a in plan if m.name == args.worker)
        run_model(model, arms, args, lambda row: append_row(rows_path, row))
        return 0
    args.profile = args.profile or ("h100-sxm" if args.no_run else calibrated_profile(args.out))
    start = time.perf_counter()
    for model, arms in plan:
        if args.no_run:  # the CPU smoke: this process, no CUDA to keep apart
            run_model(model, arms, args, lambda row: append_row(rows_path, row))
        else:
            run_worker(model, argv if argv is not None else sys.argv[1:], args, rows_path)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    text = report(rows, wall_s=time.perf_counter() - start)
    (args.out / "table.md").write_text(text + "\n")
    print(text.split("\n## Arms")[0] if "\n## Arms" in text else text, flush=True)
    return 0


def estimate(plan: list[tuple[Model, list[Arm]]], tiny: bool) -> str:
    """The device seconds the selection is expected to take (model_seconds, and calibrate), per model."""
    seconds = {model.name: model_seconds(model, arms, checkpoint_bytes(config_dict(model, tiny)))
               for model, arms in plan}
    each = ", ".join(f"{name} {value:.0f}" for name, value in seconds.items())
    return f"about {sum(seconds.values()) + CALIBRATE_S:.0f} s of device time with calibrate ({each})"


def append_row(path: Path, row: dict) -> None:
    """One JSON line, appended and flushed as the arm ends, and a line of progress on stderr."""
    with open(path, "a") as file:
        file.write(json.dumps(row, default=str) + "\n")
    failed = {name: error for name, error in row.get("errors", {}).items()}
    print(f"[{time.strftime('%H:%M:%S')}] {row.get('kind')} {row.get('arm') or row.get('model')}"
          f" {row.get('verdicts', '')} {failed or ''}", file=sys.stderr, flush=True)


def calibrated_profile(out: Path) -> str:
    """`offload-plan calibrate` in its own process (this one never holds CUDA: a model's process is capped to
    its plan's memory, and what another process holds counts against the cap); reused when already in OUT."""
    path = out / "calibrated.yaml"
    if not path.is_file():
        done = subprocess.run([sys.executable, "-m", "offload_plan", "calibrate", "-o", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(f"calibrate failed ({done.stderr.strip()[-300:]}); planning with h100-sxm", file=sys.stderr)
            return "h100-sxm"
    return str(path)


def run_worker(model: Model, argv: list[str], args, rows_path: Path) -> None:
    """The model's arms in a process of their own; a process that dies leaves a row saying so."""
    command = [sys.executable, __file__, *argv, "--worker", model.name, "--deadline", str(args.deadline),
               "--gpu", args.profile, "--out", str(args.out)]
    done = subprocess.run(command, stdout=sys.stderr)
    if done.returncode != 0:
        append_row(rows_path, {"kind": "worker", "model": model.name, "errors": {
            "worker": f"the model's process exited {done.returncode}; its later arms did not run"}})


# --- the report -------------------------------------------------------------------------------------------------------

VERDICTS = ("exit_ok", "no_oom", "peak_le_cap", "peak_ge_0.9_predicted", "error_within", "tokens_equal")


def report(rows: list[dict], wall_s: float) -> str:
    """Markdown: the summary (arms, passes per verdict, worst peak / cap, median |error|), the models, the arms."""
    arms = [row for row in rows if row.get("kind") == "arm"]
    lines = ["# Conformance sweep", "", f"{len(arms)} arms in {wall_s:.0f} s; "
             f"{sum(len(r['arms']) for r in rows if r.get('kind') == 'skipped')} not started (time budget)", "",
             "| verdict | pass | fail | no figure |", "|---|---|---|---|"]
    for verdict in VERDICTS:
        values = [row.get("verdicts", {}).get(verdict) for row in arms]
        lines.append(f"| {verdict} | {values.count(True)} | {values.count(False)} | {values.count(None)} |")
    over_cap = [row["peak_over_cap"] for row in arms if row.get("peak_over_cap")]
    lines.append("")
    lines.append(f"worst peak / cap: {max(over_cap):.3f}" if over_cap else "worst peak / cap: -")
    for label, measure in (("--measure", True), ("estimated", False)):
        errors = [abs(e) for row in arms if row["measure"] == measure
                  for e in (row.get("prediction_errors") or {}).values()]
        lines.append(f"median |error| {label}: " + (f"{statistics.median(errors):.1%} over {len(errors)}"
                                                    if errors else "-"))
    failures = [row for row in rows if row.get("kind") in ("reference", "worker") and row.get("errors")]
    lines += [f"{row['kind']} {row['model']}: {row['errors']}" for row in failures]
    lines += ["", "## Models", "", "| model | family | layers | GB | expert tensors | write s |",
              "|---|---|---|---|---|---|"]
    for row in rows:
        if row.get("kind") == "checkpoint":
            lines.append(f"| {row['model']} | {row.get('family', '-')} | {row.get('num_layers', '-')} | "
                         f"{row.get('gb', '-')} | {', '.join(row.get('expert_tensor_names', [])[:4]) or '-'} | "
                         f"{row.get('write_s', row.get('error', '-'))} |")
    lines += ["", "## Caps", "", "| model | serving GiB loose / tight | budget GiB loose / tight | make at the tight "
              "caps (estimated: regime, share of experts on the host) |", "|---|---|---|---|"]
    lines += [caps_line(row) for row in rows if row.get("kind") == "caps"]
    lines += ["", "## Arms", "", "| arm | exits | regime | predicted / measured ms | error | peak / cap | "
              "peak / predicted | tokens | link GB/s before / after | routed bytes measured / predicted, prediction "
              "right measured / planned | s | first error |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [arm_line(row) for row in arms]
    return "\n".join(lines)


def caps_line(row: dict) -> str:
    searched = "; ".join(f"{mode}: {found['regime']} {found['host_share'][0]:.2f}-{found['host_share'][1]:.2f}"
                         if found.get("regime") else f"{mode}: routed at no cap"
                         for mode, found in (row.get("routed_search") or {}).items()) or "-"
    serving, budget = row["gpu_memory_gib"], row["budget_gib"]
    return (f"| {row['model']} | {serving['loose']} / {serving['tight']} | {budget['loose']} / {budget['tight']} | "
            f"{searched} |")


def arm_line(row: dict) -> str:
    bench = row.get("bench") or {}
    predicted = bench.get("predicted_decode_step_ms") or bench.get("predicted_step_ms")
    measured = bench.get("decode_step_ms") or bench.get("step_ms")
    timing = f"{predicted:.2f} / {measured:.2f}" if predicted and measured else "-"
    errors = row.get("prediction_errors") or {}
    error = ", ".join(f"{name} {value:+.1%}" for name, value in errors.items()) or "-"
    first = next(iter(row.get("errors", {}).items()), None)
    return (f"| {row['arm']} | {' '.join(f'{k}:{v}' for k, v in row['exit'].items())} | "
            f"{regime_text(row.get('plan') or {})} | {timing} | {error} | "
            f"{fmt(row.get('peak_over_cap'))} | {fmt(row.get('peak_over_predicted'))} | "
            f"{tokens_text(row)} | {link_text(row)} | {routing_text(bench)} | "
            f"{row['seconds']} | "
            f"{f'{first[0]}: {first[1][:120]}' if first else ''} |")


def link_text(row: dict) -> str:
    """The link probe's rates around the arm's bench (a link that moved shows as two figures apart)."""
    before, after = row.get("link_gb_per_s_before"), row.get("link_gb_per_s_after")
    return "-" if before is None else f"{before} / {after if after is not None else '-'}"


def routing_text(bench: dict) -> str:
    """A routed arm's decode steps: the experts' bytes they fetched over the plan's expected bytes, the next-layer
    prediction's accuracy (mean over ranks) against the plan's, and with CPU experts the host CPU's rate against
    its price and the step the plan re-timed at it, as run --bench --json measured them."""
    from runtime.routed_fetches import RoutedFetches

    if not bench.get("routed") or not bench["routed"]["predicted_bytes_per_step"]:
        return "-"
    routed = RoutedFetches(**bench["routed"])  # its JSON is the record's fields
    text = f"{routed.fetched_bytes_per_step / routed.predicted_bytes_per_step:.2f}"
    measured, planned = routed.prefetch_accuracy, routed.planned_prefetch_accuracy
    if measured is not None and planned is not None:
        text += f", {measured:.2f} / {planned:.2f}"
    cpu = routed.cpu or {}
    step_ms = bench.get("decode_step_ms") or bench.get("step_ms")
    # what of the step's error the host's CPU explains: the plan there with the tables run split the steps by (made
    # again at that rate where run re-split them: runtime.cpu_resplit), else its own
    resplit = bool(((cpu.get("resplit") or {}).get("events")))
    there = cpu.get("step_ms_resplit_at_host_cpu_rate") if resplit else cpu.get("step_ms_at_host_cpu_rate")
    if there and step_ms:
        text += (f"; CPU at {cpu['host_cpu_scale']:.2f}x its price, the plan there{' re-split' if resplit else ''} "
                 f"{there:.2f} ms ({step_ms / there - 1:+.1%})")
    return text


def regime_text(plan: dict) -> str:
    """The plan's experts regime, with its routed layers' shares of experts on the host where it routes."""
    share = plan.get("host_share")
    return (plan.get("regime") or "-") + (f" {share[0]:.2f}-{share[1]:.2f}" if share else "")


def fmt(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
