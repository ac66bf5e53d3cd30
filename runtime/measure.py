"""``make --measure``: time the model's layers on the local GPU at the plan's workload.

The model is built at full depth, but only one layer of each kind (same params, same attention type) gets
weights on the GPU: every other position runs an alias of its kind's layer, sharing the weights and keeping
its own layer index (so KV-cache writes, masks and rotary work as in service). The model's own forward runs
all of them back to back, so the GPU is as busy, as hot and as launch-bound as in the real step, which a lone
layer run between idle gaps is not (the lent H100 clocks down by about 5% under sustained prefill). CUDA
events around each layer give its time; the whole forward minus the layers gives the non-layer time
(embedding, rotary, masks, final norm, LM head, gaps). Results are cached by GPU, versions, config, layout
and workload. For a target GPU other than the local one, times are scaled per layer by the ratio of the two
profiles' roofline estimates, and the plan says so.
"""

import copy
import hashlib
import json
import os
import statistics
from pathlib import Path

import torch
from torch import nn

from planner.source.checkpoint import Checkpoint
from planner.model.cost import ComputeTimes, Workload, estimate_compute, geometry_from_config
from planner.model.model_config import model_config, text_config
from planner.errors import OffloadPlanError, UsageError
from planner.model.kv_cache import attention_layer_types, with_weights_dtype
from planner.model.layout import ModelLayout, config_num_layers, layer_kinds
from planner.source.profile import HardwareProfile, load_profile
from runtime.experts_impl import PREFILL, use_phase
from runtime.graph import cache_argument
from runtime.quantized import check_runnable, fill_random_fp8, quantize_skeleton

NUM_WARMUP = 2
NUM_TIMED = 5
NUM_TIMED_REPLAYS = 20
# torch.cuda.get_device_name() fragments -> built-in profile, most specific first.
DEVICE_PROFILES = (
    ("GH200", "gh200"), ("GB300", "gb300"), ("GB200", "gb200"), ("B200", "b200"), ("H200", "h200"),
    ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("A100", "a100-80gb"), ("L40S", "l40s"),
    ("RTX 4090", "rtx4090"),
)
CALIBRATED_SUFFIX = "-calibrated"


class PassThrough(nn.Module):
    """Stands in for a layer left out of a timed graph: returns its input hidden states."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def set_layers(model: nn.Module, stack: str, modules: list[nn.Module]) -> None:
    parent_name, _, attribute = stack.rpartition(".")
    setattr(model.get_submodule(parent_name), attribute, nn.ModuleList(modules))


def local_profile_name() -> str:
    """The built-in profile of the local CUDA GPU, from its device name."""
    name = torch.cuda.get_device_name()
    for fragment, profile in DEVICE_PROFILES:
        if fragment in name:
            return profile
    raise UsageError(f"no built-in profile matches the local GPU {name!r}; pass --measured-on PROFILE")


def is_local_target(target: HardwareProfile, measured_on: str | None) -> bool:
    """Whether a plan for ``target`` is a plan for the local GPU (``measured_on``, else its name's profile), a
    calibrated profile the same GPU as its built-in one."""
    local_name = measured_on or local_profile_name()
    return target.name.removesuffix(CALIBRATED_SUFFIX) == local_name.removesuffix(CALIBRATED_SUFFIX)


def cache_path() -> Path:
    """Where measured layer times are kept between runs."""
    root = os.environ.get("OFFLOAD_PLAN_CACHE") or Path.home() / ".cache" / "offload-plan"
    return Path(root) / "layer-times.json"


def cache_key(config: dict, layout: ModelLayout, workload: Workload, graphed: bool) -> str:
    import transformers

    identity = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
        "config": config, "layers": [[list(p[:3]) for p in layer.params] for layer in layout.layers],
        "workload": vars(workload), "method": "full-depth aliases v5", "graphed": graphed,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def load_cache() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def save_cache(cache: dict) -> None:
    from planner.plan.file import write_atomic

    cache_path().parent.mkdir(parents=True, exist_ok=True)
    write_atomic(cache_path(), json.dumps(cache, indent=1, sort_keys=True))


def measured_kinds(layout: ModelLayout, config: dict) -> tuple[tuple[int, ...], ...]:
    """Layer indices grouped by params and attention type (sliding-window and full layers time differently)."""
    layer_types = _layer_types(config)
    groups: dict[tuple, list[int]] = {}
    for kind in layer_kinds(layout.layers):
        for index in kind:
            attention = layer_types[index] if index < len(layer_types) else None
            groups.setdefault((kind[0], attention), []).append(index)
    return tuple(tuple(indices) for indices in sorted(groups.values()))


def _layer_types(config: dict) -> tuple:
    """Each layer's attention type as transformers derives it (planner.model.kv_cache.attention_layer_types: a
    Gemma-3 config.json names no layer_types, they follow from sliding_window_pattern); config.json's explicit
    layer_types for the families that function leaves out (linear-attention hybrids)."""
    try:
        derived = attention_layer_types(config)
    except OffloadPlanError:
        derived = ()
    explicit = text_config(config).get("layer_types")
    return derived or (tuple(explicit) if isinstance(explicit, list) else ())


def alias_module(module: nn.Module, layer_index: int) -> nn.Module:
    """A copy of ``module`` that shares its parameters and buffers but has its own hooks and layer index."""
    clone = copy.copy(module)
    for name, value in vars(module).items():
        if isinstance(value, dict):  # parameters, buffers, submodules, hooks: own containers, shared tensors
            setattr(clone, name, type(value)(value))
    for name, child in module._modules.items():
        clone._modules[name] = None if child is None else alias_module(child, layer_index)
    if hasattr(clone, "layer_idx"):
        clone.layer_idx = layer_index
    return clone


def measured_config(checkpoint: Checkpoint) -> dict:
    """The checkpoint's config.json with the dtype run loads it in: the config's, else the headers' (a config
    silent on its dtype, as transformers' config classes write, loads in its weights' dtype, as
    runtime.skeleton loads it), so an fp32 checkpoint is measured in fp32, not in bf16 at half its activations."""
    return with_weights_dtype(checkpoint.config, checkpoint.tensors)


def measure_dtype(config: dict) -> torch.dtype:
    """The dtype the measured model's unquantized weights and activations take: config.json's (measured_config
    gives one), bf16 where it names none torch has."""
    name = model_config(config).dtype if config else None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16


def build_measure_model(config: dict, kinds: tuple[tuple[int, ...], ...], stack: str,
                        device: str = "cuda") -> nn.Module:
    """The model at full depth on the GPU with random weights in the dtype run loads it in (measure_dtype) for one
    layer per kind, aliases elsewhere; an FP8 block-quantized config's linears are transformers' FP8 modules with
    random FP8 weights, computed as run computes them (runtime.quantized)."""
    from transformers import AutoModelForCausalLM

    from runtime.skeleton import transformers_config

    quantization = config.get("quantization_config") or text_config(config).get("quantization_config")
    if quantization is not None:
        check_runnable(quantization, "make --measure")  # what run cannot place is not timed either
    dtype = measure_dtype(config)
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    # the config class run's skeleton builds (runtime.skeleton), so measure times the model run loads
    hf_config = transformers_config(config, Path("config.json"))
    language = hf_config.get_text_config()
    num_layers = language.num_hidden_layers
    layer_types = getattr(language, "layer_types", None)
    built = max(kind[0] for kind in kinds) + 1  # enough layers to hold one of each kind
    if layer_types:  # and one of each attention type: the model builds its rotary tables per type it holds
        built = max(built, *(layer_types.index(kind) + 1 for kind in set(layer_types)))
    language.num_hidden_layers = built
    if layer_types:
        language.layer_types = layer_types[:built]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    if quantization is not None:  # timed as run computes them: transformers' FP8 modules, random FP8 weights
        quantize_skeleton(model, quantization)
        fill_random_fp8(model, torch.device(device))
    layers = model.get_submodule(stack)
    owners = {index: layers[kind[0]] for kind in kinds for index in kind}
    representatives = {kind[0] for kind in kinds}
    set_layers(model, stack, [owners[i] if i in representatives else alias_module(owners[i], i)
                               for i in range(num_layers)])
    del layers
    language.num_hidden_layers = num_layers
    if layer_types:
        language.layer_types = layer_types
    use_phase(model, PREFILL, torch.device(device))  # as run's loader leaves it; decode loops switch their steps
    torch.cuda.empty_cache()
    return model.eval()


def _time_forward(model, stack: str, workload: Workload, captured: bool = False) -> tuple[list[float], float]:
    """Median ms of every layer position, and of the rest of the forward, over NUM_TIMED forwards, scaled so
    that they add up to the median forward timed without the per-layer events (``captured``: the forward replayed
    from a CUDA graph, as run replays a graphed serving plan's prefill chunk).

    The events ride on forward hooks, and the hooks cost the host time: an eager prefill chunk of a small model
    is as long as the host takes to issue its kernels (on the H100 a DeepSeek-V2-Lite-shaped chunk of 2048
    tokens took 7.70 ms to issue and 7.68 ms on the GPU), so the hooked layers added up to 8.48 ms where run's
    forwards, back to back and unhooked, took 7.68 (scripts/experiments/chunk_timing.py). The hooked figures
    say how the forward divides among the layers; the unhooked forward says how long it is."""
    layers = model.get_submodule(stack)
    samples: list[list] = [[] for _ in layers]
    handles = []
    for index, module in enumerate(layers):
        handles.append(module.register_forward_pre_hook(lambda m, a, i=index: _start(samples, i)))
        handles.append(module.register_forward_hook(lambda m, a, o, i=index: _stop(samples, i)))
    vocab = model.config.get_text_config().vocab_size
    sequences = workload.sequences_per_step
    step_ids = torch.randint(0, vocab, (sequences, workload.tokens_per_step // sequences), device="cuda")
    cache = _prefill(model, vocab, workload)
    unhooked_ms = _time_captured(model, step_ids) if captured else _time_unhooked(model, step_ids, cache, workload)
    forwards = []
    with torch.inference_mode():
        for repeat in range(NUM_WARMUP + NUM_TIMED):
            if repeat == NUM_WARMUP:
                for values in samples:
                    values.clear()
                forwards.clear()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(input_ids=step_ids, use_cache=cache is not None, logits_to_keep=1, **cache_argument(model, cache))
            end.record()
            forwards.append((start, end))
            if cache is not None:
                cache.crop(workload.context_tokens)
    torch.cuda.synchronize()
    for handle in handles:
        handle.remove()
    per_forward_layers = [sum(samples[i][r][0].elapsed_time(samples[i][r][1]) for i in range(len(layers)))
                          for r in range(NUM_TIMED)]
    rest_ms = statistics.median(s.elapsed_time(e) - in_layers
                                for (s, e), in_layers in zip(forwards, per_forward_layers))
    layer_ms = [statistics.median(s.elapsed_time(e) for s, e in pairs) for pairs in samples]
    hooked_ms = sum(layer_ms) + max(0.0, rest_ms)
    scale = unhooked_ms / hooked_ms if hooked_ms > 0 else 1.0
    return [ms * scale for ms in layer_ms], max(0.0, rest_ms) * scale


def _time_unhooked(model, step_ids: torch.Tensor, cache, workload: Workload) -> float:
    """Median ms of NUM_TIMED forwards back to back (after NUM_WARMUP), no hooks, as run times its chunks."""
    from runtime.timing import time_calls

    def forward():
        model(input_ids=step_ids, use_cache=cache is not None, logits_to_keep=1, **cache_argument(model, cache))
        if cache is not None:
            cache.crop(workload.context_tokens)

    with torch.inference_mode():
        for _ in range(NUM_WARMUP):
            forward()
        return statistics.median(time_calls(forward, NUM_TIMED))


def _time_captured(model, step_ids: torch.Tensor) -> float:
    """Median ms of NUM_TIMED replays back to back of one cacheless forward captured in a CUDA graph (the forward
    hooks must not be installed yet: their events cannot be captured)."""
    from runtime.graph import chunk_graph
    from runtime.timing import time_calls

    graph = chunk_graph(model, step_ids)
    for _ in range(NUM_WARMUP):
        graph.replay()
    ms = statistics.median(time_calls(graph.replay, NUM_TIMED))
    del graph
    torch.cuda.empty_cache()
    return ms


def _time_graphed(model, stack: str, kinds, workload: Workload) -> tuple[list[float], float]:
    """Per-layer and non-layer ms of decode steps replayed from CUDA graphs.

    Events cannot sit between the layers of a replay, so whole replays are timed: with every layer left out
    (pass-throughs: the non-layer time), and with the layers of one kind in (each kind alone when there are
    several, all of them when there is one); a kind's per-layer time is the difference over its count.
    """
    from runtime.graph import DecodeLoop, cache_tokens_for

    layers = list(model.get_submodule(stack))
    device = torch.device("cuda")
    sequences = workload.sequences_per_step
    context = max(1, workload.context_tokens)  # a decode step needs one token of cache at least
    loop = DecodeLoop(model, batch=sequences, max_cache_tokens=cache_tokens_for(context), device=device)
    loop.fill(context)  # a step over random cache entries costs what it costs over real ones (runtime.graph)
    saved = loop.save_state()

    def replay_ms(active: set[int]) -> float:
        set_layers(model, stack, [layers[i] if i in active else PassThrough() for i in range(len(layers))])
        loop.capture()
        loop.timed_steps(NUM_WARMUP)
        ms = statistics.median(loop.timed_steps(NUM_TIMED_REPLAYS))
        loop.restore_state(saved)
        loop.graph = None
        return ms

    none_ms = replay_ms(set())
    per_layer = [0.0] * len(layers)
    for kind in kinds:
        active = set(kind) if len(kinds) > 1 else set(range(len(layers)))
        kind_ms = (replay_ms(active) - none_ms) / len(kind)
        for index in kind:
            per_layer[index] = max(0.0, kind_ms)
    set_layers(model, stack, layers)
    return per_layer, none_ms


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
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_argument(model, cache))
    return cache


def measure_local(
    checkpoint: Checkpoint, layout: ModelLayout, workload: Workload, graphed: bool = False
) -> tuple[tuple[float, ...], float]:
    """(ms of every planned layer, non-layer ms) on the local GPU (cached).

    Each layer gets the median of its kind over all positions and forwards: one figure per kind, so the
    plan does not chase the noise between equal layers. ``graphed``: decode steps replayed from CUDA graphs.
    """
    from runtime.load import require_cuda

    require_cuda("make --measure")
    if checkpoint.config is None:
        raise UsageError("--measure builds layers from config.json, and this checkpoint has none")
    if config_num_layers(checkpoint.config) not in (None, len(layout.layers)):
        raise UsageError(f"--measure needs config.json's num_hidden_layers to match the {len(layout.layers)} "
                         f"planned layers of {layout.stack}; fix config.json or plan without --measure")
    config = measured_config(checkpoint)
    key = cache_key(config, layout, workload, graphed)
    cache = load_cache()
    if key not in cache:
        kinds = measured_kinds(layout, config)
        model = build_measure_model(config, kinds, layout.stack)
        if graphed and workload.context_tokens:
            layer_ms, rest_ms = _time_graphed(model, layout.stack, kinds, workload)
        else:  # a graphed prefill chunk: the layers' split from events, its length from replays
            layer_ms, rest_ms = _time_forward(model, layout.stack, workload, captured=graphed)
        del model
        torch.cuda.empty_cache()
        per_kind = {index: statistics.median(layer_ms[i] for i in kind) for kind in kinds for index in kind}
        cache[key] = {"layer_ms": [per_kind[i] for i in range(len(layout.layers))], "non_layer_ms": rest_ms,
                      "raw_layer_ms": layer_ms}
        save_cache(cache)
    return tuple(cache[key]["layer_ms"]), cache[key]["non_layer_ms"]


def measured_compute(
    checkpoint: Checkpoint, layout: ModelLayout, workload: Workload, target: HardwareProfile, measured_on: str | None,
    graphed: bool = False,
) -> ComputeTimes:
    """Measured times for the plan: local if the target is this GPU, else scaled by roofline ratio."""
    from runtime.load import require_cuda

    require_cuda("make --measure")
    local_name = measured_on or local_profile_name()
    layer_ms, head_ms = measure_local(checkpoint, layout, workload, graphed)
    how = (f"CUDA-graph replays, median of {NUM_TIMED_REPLAYS}" if graphed
           else f"full-depth forward, median of {NUM_TIMED}")
    dtype = str(measure_dtype(measured_config(checkpoint))).removeprefix("torch.")
    source = (f"measured: {torch.cuda.get_device_name()}, torch {torch.__version__}, {dtype}, "
              f"{workload.tokens_per_step} tokens in {workload.sequences_per_step} sequence(s), context "
              f"{workload.context_tokens}, {how}")
    if is_local_target(target, measured_on):
        return ComputeTimes(layer_ms=layer_ms, head_ms=head_ms, source=source)
    local = load_profile(local_name)
    geometry = geometry_from_config(checkpoint.config, layout)
    shapes = {t.name: t.shape for t in checkpoint.tensors}
    on_local = estimate_compute(layout, geometry, workload, local, shapes)
    on_target = estimate_compute(layout, geometry, workload, target, shapes)
    scaled = tuple(ms * there / here for ms, there, here in zip(layer_ms, on_target.layer_ms, on_local.layer_ms))
    scaled_head = head_ms * on_target.head_ms / on_local.head_ms if on_local.head_ms else head_ms
    return ComputeTimes(layer_ms=scaled, head_ms=scaled_head,
                        source=f"{source}; scaled from {local.name} to {target.name} by roofline ratio")


# --- activation peak ---------------------------------------------------------------------------------------------
