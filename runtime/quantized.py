"""Quantized checkpoints in the runtime: FP8 with 128x128-style block scales (DeepSeek-V3, Qwen3-FP8), built with
transformers' own FP8 modules and placed as stored.

The skeleton is converted by transformers' own quantizer (``FineGrainedFP8HfQuantizer.preprocess_model``, what
``from_pretrained`` runs before loading a pre-quantized checkpoint on a GPU): each converted ``nn.Linear``
becomes an ``FP8Linear`` whose ``weight`` is ``float8_e4m3fn`` [out, in] and whose ``weight_scale_inv`` is
float32 [ceil(out/bo), ceil(in/bi)]. Both are ordinary params, so the plan places them like any other: an
offloaded layer's FP8 weights and their scales lie side by side in its pinned piece and cross the link as
stored (1 byte a weight), a resident layer's lie in the GPU arena as FP8.

Compute. ``FP8Linear.forward`` calls transformers' ``fp8_linear``, which needs the ``kernels`` package and a
kernel fetched from the hub (``kernels-community/finegrained-fp8``, or DeepGEMM, also through ``kernels``), in
transformers 5.17 and 5.24 alike; the project's stack has neither and the H100 reaches no hub. Where that
kernel loads, it runs as is. Elsewhere each FP8 linear dequantizes its weight where it lies (on the GPU for an
offloaded layer too, after the copy) with transformers' own arithmetic (``Fp8Dequantize``: the FP8 value times
its float32 block scale, rounded once to the activation dtype) and runs a bf16 matmul. One path for resident
and offloaded layers alike, so logits are bitwise equal to the all-resident FP8 model; the planner's FP8 cost
(planner.model.fp8_cost) prices that path's memory traffic.

MXFP4 (gpt-oss) runs quantized in transformers 5.17 and 5.24 only with the ``kernels`` package and a hub kernel
(``kernels-community/gpt-oss-triton-kernels``; ``Mxfp4HfQuantizer``); without them transformers dequantizes it
to bf16 at load (2 bytes a weight, not the shipped 0.53): refused in one line rather than run unlike its plan.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from planner.errors import ModelInputError, shown

#: the FP8 weight dtypes a block-quantized checkpoint stores (transformers' FP8Linear holds e4m3)
FP8_WEIGHT_DTYPES = (torch.float8_e4m3fn,)
#: compute paths an FP8 linear can take (``fp8_compute_path``)
KERNEL, DEQUANTIZE = "transformers-kernel", "dequantize"


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype activations compute in: the first floating param's that is not an FP8 weight."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point() and p.dtype not in FP8_WEIGHT_DTYPES)


def quantization_section(config) -> dict | None:
    """The transformers config's quantization_config as a dict, or None for an unquantized model."""
    section = getattr(config, "quantization_config", None)
    if section is None and hasattr(config, "get_text_config"):
        section = getattr(config.get_text_config(), "quantization_config", None)
    if section is None or isinstance(section, dict):
        return section or None
    return section.to_dict()


def check_runnable(section: dict, where: str) -> None:
    """What ``run`` can place: FP8 e4m3 with two-number block scales and dynamic activations; anything else is
    one line saying why."""
    method = section.get("quant_method")
    if method == "mxfp4":
        raise ModelInputError(f"{where}: MXFP4 (gpt-oss) runs quantized only with transformers' hub kernel "
                              "(kernels-community/gpt-oss-triton-kernels), which this stack cannot fetch, and "
                              "transformers dequantizes it to bf16 otherwise, unlike its plan: use a bf16 release")
    if method != "fp8":
        raise ModelInputError(f"{where}: quantization_config's quant_method {shown(method)} is not one run places; "
                              "it runs FP8 block-quantized checkpoints (quant_method fp8 with weight_block_size): "
                              "use an unquantized or FP8 block-quantized checkpoint")
    block = section.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ModelInputError(f"{where}: quantization_config is fp8 with weight_block_size {shown(block)}; run places "
                              "block-scaled FP8 (two whole numbers such as [128, 128]), not per-tensor scales")
    if section.get("fmt", "e4m3") != "e4m3" or section.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelInputError(f"{where}: quantization_config is fp8 with fmt {shown(section.get('fmt'))} and "
                              f"activation_scheme {shown(section.get('activation_scheme'))}; run places e4m3 weights "
                              "with dynamic activations (the DeepSeek-V3 / Qwen3-FP8 format)")


def quantize_skeleton(model: nn.Module, section: dict) -> None:
    """Swap the skeleton's linears for transformers' FP8 modules, as from_pretrained does on a GPU before it
    loads a pre-quantized checkpoint (the modules config.json's modules_to_not_convert and lm_head stay as they
    are). Params stay on meta; ``run``'s loader fills them from the files."""
    from transformers.quantizers.auto import AutoHfQuantizer, AutoQuantizationConfig

    quantization = AutoQuantizationConfig.from_dict(dict(section))
    quantizer = AutoHfQuantizer.from_config(quantization, pre_quantized=True)
    # on a machine without a GPU, validate_environment would switch from_pretrained to dequantizing at load;
    # run places the FP8 weights as stored, so the skeleton is the GPU's
    quantizer.quantization_config.dequantize = False
    quantizer.preprocess_model(model, dtype=compute_dtype(model))
    model.hf_quantizer = quantizer
    path = fp8_compute_path()
    if path == DEQUANTIZE:
        _refuse_fp8_experts(model)
    use_compute_path(model, path)


def _refuse_fp8_experts(model: nn.Module) -> None:
    """transformers' fused FP8 experts (FP8Experts) compute only through its hub kernels: a MoE checkpoint whose
    experts are FP8 is one line where those cannot load."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    experts = next((name for name, module in model.named_modules() if isinstance(module, FP8Experts)), None)
    if experts is not None:
        raise ModelInputError(f"{experts}: FP8 MoE experts run in transformers only through its hub kernels "
                              "(the kernels package and kernels-community/finegrained-fp8), which this stack "
                              "cannot load; run places FP8 dense linears: use a bf16 release of this MoE model")


def fill_random_fp8(model: nn.Module, device: torch.device, seed: int = 0) -> None:
    """Random FP8 weights (N(0, 1) in FP8, scales 0.02) for every FP8Linear still on meta (make --measure times
    them; values do not change the time)."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    generator = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        if isinstance(module, FP8Linear) and module.weight.device.type == "meta":
            weight = torch.randn(module.weight.shape, generator=generator, device=device)
            module.weight = nn.Parameter(weight.to(torch.float8_e4m3fn), requires_grad=False)
            module.weight_scale_inv = nn.Parameter(torch.full(module.weight_scale_inv.shape, 0.02, device=device),
                                                   requires_grad=False)
            if module.bias is not None and module.bias.device.type == "meta":
                module.bias = nn.Parameter(torch.zeros(module.bias.shape, dtype=compute_dtype(model), device=device),
                                           requires_grad=False)


@functools.cache
def fp8_compute_path() -> str:
    """``KERNEL`` where transformers' own FP8 matmul kernel loads on this machine (the ``kernels`` package and the
    kernel in the local hub cache), else ``DEQUANTIZE``."""
    from transformers.utils.import_utils import is_kernels_available

    if not torch.cuda.is_available() or not is_kernels_available():
        return DEQUANTIZE
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

        load_finegrained_fp8_kernel()
    except Exception:  # any failure to fetch or build the hub kernel: the dequantizing path runs instead
        return DEQUANTIZE
    return KERNEL


def use_compute_path(model: nn.Module, path: str) -> int:
    """Every FP8Linear of ``model`` computes by ``path``; returns how many there are."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    count = 0
    for module in model.modules():
        if isinstance(module, FP8Linear):
            module.__class__ = dequantized_class() if path == DEQUANTIZE else FP8Linear
            count += 1
    return count


def num_fp8_linears(model: nn.Module) -> int:
    from transformers.integrations.finegrained_fp8 import FP8Linear

    return sum(isinstance(module, FP8Linear) for module in model.modules())


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] weight in ``dtype``: each FP8 value times its block's float32 scale, rounded once (the
    arithmetic of transformers' Fp8Dequantize). FP8 -> bf16 is exact and bf16 x float32 computes in float32, so
    two passes (read 1 byte, write 2; read 2, write 2) give the same bits as the float32 product."""
    rows, cols = weight.shape
    block_rows, block_cols = block
    widened = weight.to(torch.bfloat16)
    out = torch.empty(rows, cols, dtype=dtype, device=weight.device)
    if rows % block_rows == 0 and cols % block_cols == 0:  # [R, br, C, bc] x [R, 1, C, 1]: scales broadcast
        shape = (rows // block_rows, block_rows, cols // block_cols, block_cols)
        torch.mul(widened.view(shape), scale_inv.view(shape[0], 1, shape[2], 1), out=out.view(shape))
        return out
    # a ragged last block: the scales expanded over the weight (small models only)
    expanded = scale_inv.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return torch.mul(widened, expanded, out=out)


def _dequantized_forward(self, input: torch.Tensor) -> torch.Tensor:
    # input: [..., in] -> [..., out]
    weight = dequantize_fp8(self.weight, self.weight_scale_inv, tuple(self.block_size), input.dtype)
    return F.linear(input, weight, self.bias)


@functools.cache
def dequantized_class() -> type:
    """FP8Linear computing by dequantize_fp8 (made on first use: importing this module imports no transformers)."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    return type("DequantizedFP8Linear", (FP8Linear,), {
        "forward": _dequantized_forward,
        "__doc__": "transformers' FP8Linear (same params, same state dict) computing by dequantize_fp8 and a "
                   "matmul in the activation dtype, where transformers' hub kernel is not loadable.",
        "__module__": __name__,
    })
