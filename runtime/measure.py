"""``make --measure``: time one layer of each kind on the local GPU at the plan's workload.

A copy of the model with just enough layers to hold one of each kind is built on the GPU with random bf16
weights; the other layers are replaced by pass-throughs. The model's own forward runs, so each timed layer
gets exactly the arguments it gets in service (masks, rotary embeddings, caches), and CUDA events around the
timed layers and the LM head give their times. Results are cached by GPU, versions, config, layer shape and
workload. For a target GPU other than the local one, times are scaled per layer by the ratio of the two
profiles' roofline estimates, and the plan says so.
"""

import hashlib
import json
import os
import statistics
from pathlib import Path

import torch
from torch import nn

from planner.checkpoint import Checkpoint
from planner.cost import ComputeTimes, Workload, estimate_compute, geometry_from_config
from planner.errors import UsageError
from planner.layout import ModelLayout, layer_kinds
from planner.profile import HardwareProfile, load_profile

NUM_WARMUP = 2
NUM_TIMED = 5
# torch.cuda.get_device_name() fragments -> built-in profile, most specific first.
DEVICE_PROFILES = (
    ("GH200", "gh200"), ("GB300", "gb300"), ("GB200", "gb200"), ("B200", "b200"), ("H200", "h200"),
    ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("A100", "a100-80gb"), ("L40S", "l40s"),
    ("RTX 4090", "rtx4090"),
)
CALIBRATED_SUFFIX = "-calibrated"


class PassThrough(nn.Module):
    """Stands in for a layer that need not run: returns its input hidden states."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def local_profile_name() -> str:
    """The built-in profile of the local CUDA GPU, from its device name."""
    name = torch.cuda.get_device_name()
    for fragment, profile in DEVICE_PROFILES:
        if fragment in name:
            return profile
    raise UsageError(f"no built-in profile matches the local GPU {name!r}; pass --measured-on PROFILE")


def cache_path() -> Path:
    """Where measured layer times are kept between runs."""
    root = os.environ.get("OFFLOAD_PLAN_CACHE") or Path.home() / ".cache" / "offload-plan"
    return Path(root) / "layer-times.json"


def _cache_key(config: dict, signature: str, workload: Workload) -> str:
    import transformers

    identity = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
        "config": config, "layer": signature, "workload": vars(workload),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def _load_cache() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _save_cache(cache: dict) -> None:
    from planner.plan import write_atomic

    cache_path().parent.mkdir(parents=True, exist_ok=True)
    write_atomic(cache_path(), json.dumps(cache, indent=1, sort_keys=True))


def build_reduced_model(config: dict, keep: tuple[int, ...], stack: str) -> nn.Module:
    """The model with max(keep)+1 layers on the GPU, random bf16 weights, layers not in ``keep`` skipped."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {k: v for k, v in config.items() if k != "quantization_config"}  # measured in bf16
    hf_config = AutoConfig.for_model(**config)
    text_config = hf_config.get_text_config()
    text_config.num_hidden_layers = max(keep) + 1
    if hasattr(text_config, "layer_types") and text_config.layer_types:
        text_config.layer_types = text_config.layer_types[: max(keep) + 1]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    layers = model.get_submodule(stack)
    for index in range(len(layers)):
        if index not in keep:
            layers[index] = PassThrough()
    torch.cuda.empty_cache()
    return model.eval()


def _time_layers(model, stack: str, keep: tuple[int, ...], workload: Workload) -> tuple[dict[int, float], float]:
    """Median ms of each kept layer and of the LM head over NUM_TIMED forwards."""
    layers = model.get_submodule(stack)
    targets = {index: layers[index] for index in keep}
    head = model.get_output_embeddings()
    if head is not None:
        targets[-1] = head
    samples: dict[int, list] = {index: [] for index in targets}
    handles = []
    for index, module in targets.items():
        handles.append(module.register_forward_pre_hook(lambda m, a, i=index: _start(samples, i)))
        handles.append(module.register_forward_hook(lambda m, a, o, i=index: _stop(samples, i)))
    vocab = model.config.get_text_config().vocab_size
    sequences = workload.sequences_per_step
    step_ids = torch.randint(0, vocab, (sequences, workload.tokens_per_step // sequences), device="cuda")
    cache = _prefill(model, vocab, workload)
    with torch.inference_mode():
        for repeat in range(NUM_WARMUP + NUM_TIMED):
            if repeat == NUM_WARMUP:
                for values in samples.values():
                    values.clear()
            model(input_ids=step_ids, past_key_values=cache, use_cache=cache is not None, logits_to_keep=1)
            if cache is not None:
                cache.crop(workload.context_tokens)
    torch.cuda.synchronize()
    for handle in handles:
        handle.remove()
    times = {index: statistics.median(s.elapsed_time(e) for s, e in pairs) for index, pairs in samples.items()}
    return {i: t for i, t in times.items() if i >= 0}, times.get(-1, 0.0)


def _start(samples, index):
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    samples[index].append([event, None])


def _stop(samples, index):
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    samples[index][-1][1] = event


def _prefill(model, vocab: int, workload: Workload):
    """A KV cache holding ``context_tokens`` per sequence, or None for a prefill workload."""
    if not workload.context_tokens:
        return None
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.randint(0, vocab, (workload.sequences_per_step, workload.context_tokens), device="cuda")
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def measure_local(checkpoint: Checkpoint, layout: ModelLayout, workload: Workload) -> tuple[tuple[float, ...], float]:
    """(ms of every planned layer, head ms) on the local GPU, from one measured layer per kind (cached)."""
    from runtime.load import require_cuda

    require_cuda("make --measure")
    if checkpoint.config is None:
        raise UsageError("--measure builds layers from config.json, and this checkpoint has none")
    kinds = layer_kinds(layout.layers)
    cache = _load_cache()
    keys = {kind[0]: _cache_key(checkpoint.config, _signature(layout, kind[0]), workload) for kind in kinds}
    head_key = _cache_key(checkpoint.config, "head", workload)
    if not all(key in cache for key in [*keys.values(), head_key]):
        model = build_reduced_model(checkpoint.config, tuple(keys), layout.stack)
        times, head_ms = _time_layers(model, layout.stack, tuple(keys), workload)
        del model
        torch.cuda.empty_cache()
        cache.update({keys[index]: ms for index, ms in times.items()})
        cache[head_key] = head_ms
        _save_cache(cache)
    per_layer = [0.0] * len(layout.layers)
    for kind in kinds:
        for index in kind:
            per_layer[index] = cache[keys[kind[0]]]
    return tuple(per_layer), cache[head_key]


def _signature(layout: ModelLayout, index: int) -> str:
    return json.dumps([list(p[:3]) for p in layout.layers[index].params])


def measured_compute(
    checkpoint: Checkpoint, layout: ModelLayout, workload: Workload, target: HardwareProfile, measured_on: str | None
) -> ComputeTimes:
    """Measured times for the plan: local if the target is this GPU, else scaled by roofline ratio."""
    from runtime.load import require_cuda

    require_cuda("make --measure")
    local_name = measured_on or local_profile_name()
    layer_ms, head_ms = measure_local(checkpoint, layout, workload)
    source = (f"measured: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, "
              f"{workload.tokens_per_step} tokens in {workload.sequences_per_step} sequence(s), context "
              f"{workload.context_tokens}, median of {NUM_TIMED}")
    if target.name.removesuffix(CALIBRATED_SUFFIX) == local_name.removesuffix(CALIBRATED_SUFFIX):
        return ComputeTimes(layer_ms=layer_ms, head_ms=head_ms, source=source)
    local = load_profile(local_name)
    geometry = geometry_from_config(checkpoint.config, layout)
    shapes = {t.name: t.shape for t in checkpoint.tensors}
    on_local = estimate_compute(layout, geometry, workload, local, shapes)
    on_target = estimate_compute(layout, geometry, workload, target, shapes)
    scaled = tuple(m * t / l for m, t, l in zip(layer_ms, on_target.layer_ms, on_local.layer_ms))
    scaled_head = head_ms * on_target.head_ms / on_local.head_ms if on_local.head_ms else head_ms
    return ComputeTimes(layer_ms=scaled, head_ms=scaled_head,
                        source=f"{source}; scaled from {local.name} to {target.name} by roofline ratio")
