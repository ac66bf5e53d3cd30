"""Next-layer prediction for the routed experts' prefetch: routed layer i's router input predicts the next routed
layer j's experts.

At routed layer i's experts the step holds layer i's router input, the residual stream normed by layer i's
post-attention RMSNorm. Rescaled by (norm_j.weight / norm_i.weight) it is what layer j's norm gives for the same
residual (exact for RMSNorm: weight x normalized), so layer j's own router module (the next routed layer's,
called as its MoE block calls it: same softmax / top-k / grouping rule) predicts layer j's experts from it.
runtime.routed_experts gathers the predicted experts ahead on a side stream; runtime.trace counts how often the
prediction is right.
"""

import copy
from dataclasses import dataclass

import torch
from torch import nn

from planner.errors import PlanError

@dataclass(frozen=True, kw_only=True)
class NextLayerPredictor:
    """How routed layer i's router input predicts the next routed layer j's routing."""

    #: [H] float32: norm_j.weight / norm_i.weight (0 where norm_i's weight is 0: nothing to rescale)
    ratio: torch.Tensor
    #: layer j's router module: called as its MoE block calls it, (logits, weights, top-k index)
    gate: nn.Module
    #: experts the router picks per token (the top-k index's last dimension)
    top_k: int

    def top_k_index(self, hidden: torch.Tensor) -> torch.Tensor:
        """Layer j's router on ``hidden`` [tokens, H] (layer i's router input) rescaled to layer j's norm."""
        scaled = (hidden.float() * self.ratio).to(hidden.dtype)
        return self.gate(scaled)[-1]


def next_layer_predictor(layer: nn.Module | None, following: nn.Module | None, num_experts: int,
                         device: torch.device) -> "NextLayerPredictor | str":
    """A predictor of ``following``'s routing from ``layer``'s router input, or why there is none: both layers
    need an RMSNorm post_attention_layernorm (output = weight x normalized input, checked on a probe) and
    ``following`` a router at mlp.gate returning a tuple that ends with the top-k expert ids."""
    norms = [getattr(m, "post_attention_layernorm", None) for m in (layer, following)]
    weights = [getattr(norm, "weight", None) for norm in norms]
    if any(w is None or w.dim() != 1 for w in weights) or weights[0].shape != weights[1].shape:
        return "no post_attention_layernorm with a weight per hidden unit"
    gate = following.get_submodule("mlp").get_submodule("gate") if hasattr(following, "mlp") and \
        hasattr(following.mlp, "gate") else None
    if gate is None or any(w.is_meta for w in weights):
        return "no router at mlp.gate" if gate is None else "the norms' weights are not loaded"
    with torch.inference_mode():
        probe = torch.randn(2, weights[0].shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float32)
        ratio = torch.where(weights[0] != 0, weights[1].float() / weights[0].float(), 0.0).cpu()
        refused = _rescaling_refusal(norms[0], norms[1], ratio, probe)
        if refused:
            return refused
        gate_param = next(gate.parameters(), None)
        probe_device = probe.to(device=weights[0].device, dtype=weights[0].dtype)
        try:
            output = gate(probe_device if gate_param is None else probe_device.to(gate_param.device, gate_param.dtype))
        except Exception as error:  # an architecture's router with another signature
            return f"its router cannot be called on the hidden state ({type(error).__name__}: {error})"[:300]
    top_k = output[-1] if isinstance(output, tuple) else None
    if top_k is None or top_k.dtype not in (torch.int32, torch.int64) or top_k.dim() != 2 or top_k.shape[0] != 2 \
            or int(top_k.max()) >= num_experts:
        return "its router does not return (logits, weights, top-k expert ids)"
    return NextLayerPredictor(ratio=ratio.to(device), gate=gate, top_k=top_k.shape[1])


#: relative deviation of norm_i(x) x ratio from norm_j(x) (float32 copies of the norms on the CPU) above which
#: the norms are not both weight x normalized input: float32 rounding of the two products and the ratio is
#: ~1e-7 relative, so this only refuses a norm of another form (a shift, a mean, a different normalization)
NORM_CHECK_RTOL = 1e-4


def _rescaling_refusal(norm: nn.Module, following: nn.Module, ratio: torch.Tensor, probe: torch.Tensor) -> str | None:
    """Why rescaling ``norm``'s output by ``ratio`` does not give ``following``'s on the same input, or None.

    The check runs float32 copies of both norms on the CPU: the property is structural (RMSNorm's output is its
    weight times a normalized input), so it must not depend on the model's dtype or device. In bf16 a norm's
    own output rounds to 2^-9 relative and its weight may sit near zero (a random tiny model), so a check in the
    model's dtype against a fixed absolute tolerance refused true RMSNorms. It decides only whether prediction
    is attempted: the logits stay bitwise whatever it says. Where norm_i's weight is 0, nothing rescales to
    norm_j's output there: those units are left out of the check and of the prediction's input."""
    devices = list(dict.fromkeys([torch.device("cpu"), norm.weight.device]))
    for position, device in enumerate(devices):  # the CPU first; the norm's own device if it runs only there
        try:
            copies = [copy.deepcopy(n).to(device=device, dtype=torch.float32) for n in (norm, following)]
            expected, got = (c(probe.to(device)).cpu() for c in copies)
            break
        except Exception as error:  # a norm that cannot be copied or run in float32 there
            if position == len(devices) - 1:
                return f"its norm cannot be checked on a float32 probe ({type(error).__name__}: {error})"[:300]
    if not isinstance(expected, torch.Tensor) or expected.shape != probe.shape or got.shape != probe.shape:
        return "its norm does not map a hidden state to one of the same shape"
    rescaled = expected.float() * ratio
    # where norm_i's weight is 0 its output holds nothing to rescale: those units stay 0 in the prediction's input
    # (a little less information, never a wrong form), so the form is checked on the others. The H100's tiny test
    # model has exact zeros there (transformers 5.17 on torch 2.11), and refusing it turned prediction off
    informative = (ratio != 0) | (copies[1].weight.detach().float().cpu() == 0)
    deviation = ((rescaled - got.float()).abs() * informative)
    scale = got.float().abs().clamp(min=torch.finfo(torch.float32).tiny) + \
        NORM_CHECK_RTOL * got.float().abs().max().clamp(min=torch.finfo(torch.float32).tiny)
    relative = deviation / scale
    worst = int(relative.argmax())
    if float(relative.flatten()[worst]) <= NORM_CHECK_RTOL:
        return None
    unit = worst % probe.shape[1]
    return (f"its norm is not weight x normalized input (RMSNorm), so no rescaling gives layer j's (unit {unit}: "
            f"{float(rescaled.flatten()[worst]):.4g} rescaled vs {float(got.flatten()[worst]):.4g}, weights "
            f"{float(copies[0].weight[unit]):.4g} and {float(copies[1].weight[unit]):.4g})")


def predictors_for(layers: list[int], decoder_layers: dict[int, nn.Module], num_experts: int,
                   device: torch.device) -> tuple[dict[int, NextLayerPredictor], dict[int, str]]:
    """For routed ``layers`` (ascending indices): (routed ordinal -> the predictor of the next routed layer's
    routing from this one's router input; next routed layer index -> why nothing predicts it)."""
    predictors, refusals = {}, {}
    for ordinal, (index, following) in enumerate(zip(layers, layers[1:])):
        predictor = next_layer_predictor(decoder_layers.get(index), decoder_layers.get(following), num_experts,
                                         device)
        if isinstance(predictor, str):
            refusals[following] = predictor
        else:
            predictors[ordinal] = predictor
    return predictors, refusals


def prefetch_depths(depth: "int | dict[int, int] | None", predicted: list[int], top_k: int) -> dict[int, int]:
    """Predicted routed layer index -> how many of each predicted token's top-k ranks are prefetched: ``depth``,
    one int for every predicted layer or a depth per layer (None: all k; empty where nothing is predicted)."""
    if not predicted:  # nothing predicted (warned at start): no depth to honour
        return {}
    per_layer = depth if isinstance(depth, dict) else {index: top_k if depth is None else depth for index in predicted}
    for index, m in per_layer.items():
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= max(top_k, 0):
            raise PlanError(f"prefetch depth {m!r} for layer {index} is not a whole number from 0 to the "
                            f"router's top-k ({top_k}); give one in that range")
    unknown = sorted(set(per_layer) - set(predicted))
    if unknown:
        raise PlanError(f"prefetch depth given for layers {unknown}, which nothing predicts (predicted: "
                        f"{predicted}); give depths for predicted layers only")
    return {index: per_layer.get(index, top_k) for index in predicted}
