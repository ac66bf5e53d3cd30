"""Which of transformers' experts implementations a MoE model runs, for decode steps and for prefill chunks.

transformers 5 computes a MoE layer's routed experts through a named implementation, looked up at every
forward from ``config._experts_implementation`` (``transformers/integrations/moe.py``):

- ``grouped_mm`` sorts the (token, expert) pairs by expert and runs one grouped GEMM per projection over the
  fused weights; the group offsets come from ``torch.histc`` on the GPU, so no host synchronisation and a CUDA
  graph can capture it. Its memory is the pairs' activations only. Without torch's grouped GEMM kernel for
  the device it falls back to a loop that reads the offsets on the host (``offs.tolist()``): not capturable.
- ``batched_mm`` gathers every pair's expert weights and runs one bmm: capturable, but the gather is
  pairs x 3 x I x H elements. A 2048-token chunk of a 128-expert top-8 model gathers over 16,000 experts'
  weights (tens of GiB): on the H100 a serving plan's prefill chunk ran out of memory so.
- ``eager`` loops over the experts hit, asking the host which were: not capturable; one expert's tokens at a
  time.

The planner plans grouped_mm for both phases of bf16 weights (torch's CUDA grouped GEMM takes bf16 only) and
each phase's fallback otherwise (planner.model.activations.planned_experts_implementation): batched_mm for captured
decode, eager for prefill. The runtime runs the planned one, or the fallback where this stack has no native
grouped_mm: ``check_fallback_fits`` then holds the fallback's activation estimate to what the plan set aside,
before any weight is read.

The fused experts module itself (experts_module), and the proxy through which transformers' experts functions
compute over other weights (ExpertsProxy: runtime.routed_experts' device and staging buffers), are here too.
"""

import torch
from torch import nn

from planner.model.activations import (EXPERTS_FALLBACK, activation_shape, decode_activations,
                                        planned_experts_implementation, prefill_activations)
from planner.errors import PlanError, UsageError
from planner.units import format_bytes

DECODE, PREFILL = "decode", "prefill"


def has_experts(model) -> bool:
    """Whether the model has routed experts (a module named ``experts``)."""
    return any(name.rsplit(".", 1)[-1] == "experts" for name, _ in model.named_modules())


def grouped_mm_native(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether transformers' grouped_mm runs torch's grouped GEMM kernel on ``device`` for weights of ``dtype``
    (not a loop that reads the group offsets on the host). On CUDA torch's grouped GEMM is bf16 only: an fp32
    model's captured decode through it did not equal its eager steps on the H100."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    if "grouped_mm" not in ALL_EXPERTS_FUNCTIONS:
        return False
    has_kernel = hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")
    if not has_kernel:
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    # torch's CPU kernel wants 16-byte aligned operands up to 2.10; transformers falls back to its loop there
    return _torch_at_least(2, 11)


def _torch_at_least(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


def implementation_for(phase: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """The experts implementation ``phase`` ("decode" or "prefill") runs on ``device`` for weights of ``dtype``:
    the planned one (planner.model.activations.planned_experts_implementation), or its fallback where grouped_mm has
    no native kernel here."""
    planned = planned_experts_implementation(phase, str(dtype).removeprefix("torch."))
    if planned == "grouped_mm" and not grouped_mm_native(device, dtype):
        return EXPERTS_FALLBACK[phase]
    return planned


def phase_implementations(model, device: torch.device) -> dict[str, str] | None:
    """Each phase's experts implementation for this model on ``device`` (None for a dense model): resolved once,
    so a decode loop switches between them without walking the model every step."""
    if not has_experts(model):
        return None
    if not hasattr(model, "set_experts_implementation"):
        raise UsageError("this MoE model's experts have no selectable implementation (transformers >= 5 "
                         "set_experts_implementation); upgrade transformers")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)
    return {phase: implementation_for(phase, device, dtype) for phase in (DECODE, PREFILL)}


def switch(model, implementation: str) -> None:
    """Run the model's experts through ``implementation`` (a no-op when they already do). The choice is read at
    each forward, and a CUDA graph keeps the kernels of its capture."""
    if getattr(model.config, "_experts_implementation", None) != implementation:
        model.set_experts_implementation(implementation)


def use_phase(model, phase: str, device: torch.device) -> str | None:
    """Switch a MoE model to ``phase``'s implementation; returns it, None for a dense model."""
    implementations = phase_implementations(model, device)
    if implementations is None:
        return None
    switch(model, implementations[phase])
    return implementations[phase]


def check_fallback_fits(config: dict, device: torch.device, *, activation_bytes: int, num_sequences: int,
                        context_tokens: int, chunk_tokens: int, static_cache_tokens: int | None) -> None:
    """Refuse, in one line and before loading, a plan whose steps would run a fallback implementation that needs
    more activation memory than the plan set aside (``activation_bytes``)."""
    dtype_name = activation_shape(config).dtype  # the weights' dtype as the plan's estimate read it
    for phase in (DECODE, PREFILL):
        name = implementation_for(phase, device, getattr(torch, dtype_name))
        if name == planned_experts_implementation(phase, dtype_name):
            continue
        if phase == DECODE:
            peak = decode_activations(config, num_sequences=num_sequences, context_tokens=context_tokens,
                                      static_cache_tokens=static_cache_tokens, experts_implementation=name)
        else:
            peak = prefill_activations(config, chunk_tokens=chunk_tokens, experts_implementation=name)
        if peak.planned_bytes > activation_bytes:
            raise UsageError(
                f"this torch/transformers/GPU has no native grouped_mm for MoE experts, and {phase} through {name} "
                f"needs {format_bytes(peak.planned_bytes)} of activations where the plan set aside "
                f"{format_bytes(activation_bytes)}: use bf16 weights and torch >= 2.9 on an sm80+ GPU, or plan a "
                "smaller step")


def experts_module(layer: nn.Module, index: int) -> nn.Module:
    """The fused experts module of a layer (``mlp.experts``), or a one-line error."""
    try:
        module = layer.get_submodule("mlp.experts")
    except AttributeError:
        module = None
    if module is None or not hasattr(module, "num_experts") or not expert_param_names(module):
        raise PlanError(f"layer {index} has no fused routed experts at mlp.experts (transformers 5 MoE block): "
                        "this architecture's experts cannot be route-fetched; plan the layer whole_layer")
    return module


def expert_param_names(module: nn.Module) -> list[str]:
    """Names of the module's own params that hold one row per expert, sorted."""
    num_experts = getattr(module, "num_experts", None)
    return sorted(name for name, p in module.named_parameters(recurse=False)
                  if p.dim() >= 1 and p.shape[0] == num_experts)


class ExpertsProxy:
    """The experts module as transformers' experts functions see it, with other weights (the device buffer or
    the staging buffer) and num_experts their row count; everything else is the module's own."""

    def __init__(self, module: nn.Module, weights: dict[str, torch.Tensor]):
        self.__dict__["_module"] = module
        self.__dict__.update(weights)
        self.__dict__["num_experts"] = next(iter(weights.values())).shape[0]

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def batched_mm_forward():
    """transformers' batched_mm experts forward: the decode steps compute with it (capturable, and what the
    all-resident reference computes with)."""
    from transformers.integrations.moe import batched_mm_experts_forward

    return batched_mm_experts_forward


#: the implementations a routed layer's decode step may compute with: no host synchronisation, so a CUDA graph
#: captures them (eager asks the host which experts were hit)
CAPTURABLE_DECODE = ("grouped_mm", "batched_mm")


def decode_experts_forward(module: nn.Module):
    """How a routed layer's decode step computes over the device buffer: the implementation the model is
    configured with (runtime.graph switches it to the decode phase's: grouped_mm where bf16 has torch's kernel,
    else batched_mm), so the step multiplies as the all-resident model's decode does; batched_mm where that one is
    not capturable (eager)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    name = getattr(module.config, "_experts_implementation", None)
    if name not in CAPTURABLE_DECODE or name not in ALL_EXPERTS_FUNCTIONS:
        return batched_mm_forward()
    return ALL_EXPERTS_FUNCTIONS[name]


def prefill_experts_forward(module: nn.Module):
    """How prefill chunks compute their experts: the implementation the model is configured with (the lead's
    runtime.experts_impl sets it per phase), so a routed layer prefills as the all-resident model does."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    original = type(module).forward
    original = getattr(original, "__wrapped__", original)
    name = getattr(module.config, "_experts_implementation", None) or "eager"
    if name == "eager":
        return original
    return ALL_EXPERTS_FUNCTIONS.get_interface(name, original)
