"""What an FP8 block-quantized layer costs to compute, by the path that computes it.

``run`` builds FP8 checkpoints with transformers' own ``FP8Linear`` (runtime.quantized). Its matmul kernel
(``kernels-community/finegrained-fp8``, or DeepGEMM) comes from the hub through the ``kernels`` package in
transformers 5.17 to 5.24, which the supported stack does not have; there each FP8 linear dequantizes its weight
every step instead: FP8 -> bf16 (read 1 byte, write 2), times its block scale into bf16 (read 2, write 2), then
a bf16 matmul that reads the 2-byte weight. That is 9 bytes of HBM traffic per FP8 weight against the 1 byte
stored, and the matmul's FLOPs at the bf16 rate: a memory-bound decode step costs about 4.5x its bf16 bytes,
not half of them. The two passes run before the matmul, so their 7 bytes add to its time in a compute-bound
prefill chunk as in decode, at the rate such passes reach: far under the HBM rate (``dequant_bytes_per_s``). An
engine's FP8 kernel (vLLM, SGLang) reads the FP8 byte once and multiplies at the FP8 rate.

The link is unaffected: an offloaded layer copies its stored bytes (1 a weight, its float32 scales beside it),
as the layout counts them from the headers. ``make --measure`` times the path that actually runs.
"""

from dataclasses import dataclass

from planner.source.profile import HardwareProfile

#: the FP8 dtypes of safetensors headers
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
#: HBM bytes one step moves per FP8 weight on the dequantizing path: 1 + 2 (widen), 2 + 2 (scale), 2 (matmul)
DEQUANTIZED_BYTES_PER_FP8_BYTE = 9
#: of them, the matmul's own read of the widened weight
DEQUANTIZED_MATMUL_BYTES_PER_FP8_BYTE = 2
#: the share of the HBM rate the passes before the matmul reach, where the profile has no measured figure
#: (calibrate measures fp8_dequant_bytes_per_s). On the H100 a Qwen3-4B-shaped FP8 layer (101 MB of FP8 weights,
#: 706 MB moved by the passes) took 1.139 ms a graphed decode step and about 2.1 ms a 2048-token chunk with make
#: --measure, where the rest of the layer's estimate (roofline and layer floor) is 0.29 and 1.07 ms: the passes ran
#: at 0.83 and 0.69 TB/s, 0.28 and 0.23 of the 3.0 TB/s the card copies at
#: (benchmarks/2026-11-28-conformance-graphed-chunk-h100.md). At the full derated rate (0.574) the estimate was 36%
#: optimistic in decode and 45% in the chunk
FP8_DEQUANT_HBM_SHARE = 0.25


@dataclass(frozen=True, kw_only=True)
class Fp8Compute:
    """How a step computes FP8 linears: HBM traffic per stored FP8 byte and the FLOP rate of the matmul."""

    #: HBM bytes moved per byte of FP8 weight each step
    hbm_bytes_per_fp8_byte: float
    #: of them, what the matmul reads (the rest are passes before it: they add to its time, never overlap it)
    matmul_bytes_per_fp8_byte: float = 1
    #: the matmul runs at the profile's FP8 rate (an FP8 kernel), else at its bf16 rate
    fp8_rate: bool
    #: recorded in the plan's compute source
    description: str

    def __post_init__(self):
        if self.hbm_bytes_per_fp8_byte < 1:
            raise ValueError("hbm_bytes_per_fp8_byte must be at least 1: the stored byte is read")
        if not 1 <= self.matmul_bytes_per_fp8_byte <= self.hbm_bytes_per_fp8_byte:
            raise ValueError("matmul_bytes_per_fp8_byte must be from 1 to hbm_bytes_per_fp8_byte")


#: offload-plan's runtime without transformers' hub FP8 kernel (the supported stack)
DEQUANTIZED = Fp8Compute(hbm_bytes_per_fp8_byte=DEQUANTIZED_BYTES_PER_FP8_BYTE,
                         matmul_bytes_per_fp8_byte=DEQUANTIZED_MATMUL_BYTES_PER_FP8_BYTE, fp8_rate=False,
                         description="FP8 weights dequantized to bf16 each step (transformers' FP8Linear without its "
                                     "hub kernel)")
#: an engine's FP8 tensor-core kernel
NATIVE = Fp8Compute(hbm_bytes_per_fp8_byte=1, fp8_rate=True, description="FP8 matmuls at the FP8 rate")


#: a checkpoint with FP8 routed experts planned for run: run refuses them (transformers' FP8Experts computes only
#: through its hub kernels), so only an engine serves it, at the FP8 rate
ENGINE_ONLY = Fp8Compute(
    hbm_bytes_per_fp8_byte=1, fp8_rate=True,
    description="FP8 matmuls at the FP8 rate (FP8 experts: run cannot compute them, an engine can)")


def fp8_compute_for(engine: str | None, fp8_experts: bool = False) -> Fp8Compute:
    """The FP8 path of the plan's target: ``run`` (no engine) dequantizes, vLLM and SGLang have FP8 kernels. A
    checkpoint with FP8 routed experts (``fp8_experts``) is priced as an engine computes it: run refuses it, and
    pricing a path that cannot run would describe nothing."""
    if engine is not None:
        return NATIVE
    return ENGINE_ONLY if fp8_experts else DEQUANTIZED


def dequant_bytes_per_s(profile: HardwareProfile) -> float:
    """HBM bytes per second the dequantizing passes move on ``profile``'s GPU: its measured figure, else
    FP8_DEQUANT_HBM_SHARE of its HBM rate."""
    figure = profile.fp8_dequant_bytes_per_s
    return figure.value if figure is not None else FP8_DEQUANT_HBM_SHARE * profile.hbm_bytes_per_s.value


def dequant_rate_text(profile: HardwareProfile) -> str:
    """How the plan's compute source names the passes' rate."""
    rate = dequant_bytes_per_s(profile) / 1e12
    if profile.fp8_dequant_bytes_per_s is not None:
        return f"the dequantizing passes at {rate:.2f} TB/s ({profile.fp8_dequant_bytes_per_s.source})"
    return f"the dequantizing passes at {rate:.2f} TB/s ({FP8_DEQUANT_HBM_SHARE:g} of the HBM rate)"


def has_fp8_experts(tensors) -> bool:
    """Whether any routed-expert tensor (an ``.experts.`` segment in its name) is stored in FP8."""
    return any(t.dtype in FP8_DTYPES and ".experts." in f".{t.name}." for t in tensors)
