"""One routed expert's SwiGLU on the host CPU in C: the CPU-experts path's arithmetic without torch's per-op costs.

torch computes an expert at a decode step's few tokens as four matrix-vector products and three element-wise ops,
each its own call with its own thread fork and join, and in bf16 it rounds every intermediate to bf16. This
kernel streams the expert's weights once, as they lie (bf16 or fp32, transformers 5's fused layout: gate_up
[2I, H], gate rows first, then down [H, I]), and for each weight row computes the dot products of four tokens at a
time in fp32, in one OpenMP team per expert. On 2 cores of an AMD EPYC host (AVX2), a Qwen3-30B-A3B-shaped expert
from DRAM (runtime.cpu_experts.measure_cpu_experts) took 1.14 / 1.77 / 6.95 ms at 1 / 4 / 16 tokens with bf16
weights, against torch's 1.42 / 4.71 / 19.5 (bf16) and 1.35 / 9.39 / 32.8 (fp32); its output with bf16 weights was
within 2e-7 of an fp64 reference where torch's bf16 path was 3e-3 off (its fp32 path 4e-7). On the H200 host's
16-CPU Xeon (AVX-512) it was slower than torch's fp32 path at one token (0.221 ms bf16 against 0.175;
benchmarks/2026-11-28-cpu-experts-kernel-h200.md).

``partial_sum`` is a routed layer's whole host-node body in C: the pairs routed to CPU experts, each expert's
tokens gathered, the expert, and the weighted sum per token in rank order, with no torch op between the experts
(runtime.cpu_handoff.cpu_partial_sum takes it where the kernel computes).

The C source is below; it is compiled at first use with the host's C compiler (``$CC``, else ``cc``) for this
CPU (``-march=native``) into the offload-plan cache and loaded with ctypes. Where no compiler is found or the
build fails, ``load_kernel`` returns None and the torch path computes (runtime.cpu_experts), saying why
(``kernel_refusal``). OFFLOAD_PLAN_CPU_KERNEL=0 turns the kernel off.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

_SOURCE = r"""
#include <stdint.h>
#include <math.h>

static inline float bf16_to_f32(uint16_t value) {
    union { uint32_t u; float f; } bits;
    bits.u = ((uint32_t)value) << 16;
    return bits.f;
}

/* One weight row [N] (bf16 or fp32) times 1 or 4 fp32 vectors: each weight feeds every vector's multiply-add, the
   row read once for them. Separate loops per dtype and width, so each vectorizes. */
static float dot1_bf16(const uint16_t *w, const float *v, int64_t N) {
    float a = 0.f;
    for (int64_t i = 0; i < N; i++) a += bf16_to_f32(w[i]) * v[i];
    return a;
}

static float dot1_f32(const float *w, const float *v, int64_t N) {
    float a = 0.f;
    for (int64_t i = 0; i < N; i++) a += w[i] * v[i];
    return a;
}

static void dot4_bf16(const uint16_t *w, const float *v, int64_t N, float *out) {
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    for (int64_t i = 0; i < N; i++) {
        float x = bf16_to_f32(w[i]);
        a0 += x * v[i]; a1 += x * v[N + i]; a2 += x * v[2 * N + i]; a3 += x * v[3 * N + i];
    }
    out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3;
}

static void dot4_f32(const float *w, const float *v, int64_t N, float *out) {
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    for (int64_t i = 0; i < N; i++) {
        float x = w[i];
        a0 += x * v[i]; a1 += x * v[N + i]; a2 += x * v[2 * N + i]; a3 += x * v[3 * N + i];
    }
    out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3;
}

/* rows [R, N] of weights times each of T fp32 vectors x [T, N]: y[t * R + r]; tokens four at a time, the rest
   one at a time */
static void rows_times(const void *weights, int bf16, const float *x, float *y, int64_t T, int64_t R, int64_t N) {
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const uint16_t *wb = (const uint16_t *)weights + r * N;
        const float *wf = (const float *)weights + r * N;
        int64_t t = 0;
        for (; t + 4 <= T; t += 4) {
            float acc[4];
            if (bf16) dot4_bf16(wb, x + t * N, N, acc); else dot4_f32(wf, x + t * N, N, acc);
            for (int j = 0; j < 4; j++) y[(t + j) * R + r] = acc[j];
        }
        for (; t < T; t++) y[t * R + r] = bf16 ? dot1_bf16(wb, x + t * N, N) : dot1_f32(wf, x + t * N, N);
    }
}

/* out [T, H] = down [H, I] @ (silu(gate x) * (up x)) for x [T, H], gate_up [2I, H] (gate rows first).
   scratch: T * 3I floats. One OpenMP team of num_threads; each weight row is read once for all T tokens. */
void expert_swiglu(const void *gate_up, const void *down, int bf16, const float *x, float *out, float *scratch,
                   int64_t T, int64_t H, int64_t I, int num_threads) {
    float *projected = scratch;           /* [T, 2I]: gate then up, per token */
    float *activated = scratch + T * 2 * I;  /* [T, I] */
    #pragma omp parallel num_threads(num_threads)
    {
        rows_times(gate_up, bf16, x, projected, T, 2 * I, H);
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < T * I; j++) {
            int64_t t = j / I, r = j % I;
            float gate = projected[t * 2 * I + r], up = projected[t * 2 * I + I + r];
            activated[j] = gate / (1.f + expf(-gate)) * up;
        }
        rows_times(down, bf16, activated, out, T, H, I);
    }
}

/* One routed layer's CPU pairs at a decode step, summed per token (the host node's whole body, without Python):
   out [T, H] fp32 = per token t, over its ranks r in order whose expert e = index[t K + r] is a CPU expert
   (0 <= e < E, local[e] >= 0), the sum of weights[t K + r] x expert local[e]'s SwiGLU of hidden[t].
   hidden [T, H] bf16 (hidden_bf16) or fp32; index int64 [T K]; weights fp32 [T K]; local int64 [E];
   gate_up [L, 2I, H] and down [L, H, I], the CPU experts, bf16 (weights_bf16) or fp32.
   floats: scratch of 3 T K H + 3 T K I; ints: pairs of 2 T K. Each expert's weights are read once for all its
   tokens. Returns the pairs computed; *num_distinct the distinct experts among them. */
int64_t partial_sum(const void *hidden, int hidden_bf16, const int64_t *index, const float *weights, int64_t T,
                    int64_t K, const int64_t *local, int64_t E, const void *gate_up, const void *down,
                    int weights_bf16, int64_t H, int64_t I, float *out, float *scratch, int64_t *pairs,
                    int num_threads, int64_t *num_distinct) {
    int64_t S = T * K, P = 0, distinct = 0;
    int64_t *members = pairs + S;
    float *x = scratch, *y_expert = scratch + S * H, *y = scratch + 2 * S * H, *expert_scratch = scratch + 3 * S * H;
    int64_t element = weights_bf16 ? 2 : 4;
    for (int64_t i = 0; i < T * H; i++) out[i] = 0.f;
    for (int64_t s = 0; s < S; s++)
        if (index[s] >= 0 && index[s] < E && local[index[s]] >= 0) pairs[P++] = s;
    for (int64_t a = 0; a < P; a++) {
        if (pairs[a] < 0) continue;  /* taken by an earlier expert's group */
        int64_t l = local[index[pairs[a]]], n = 0;
        for (int64_t b = a; b < P; b++)
            if (pairs[b] >= 0 && local[index[pairs[b]]] == l) { members[n++] = pairs[b]; pairs[b] = -1 - pairs[b]; }
        for (int64_t m = 0; m < n; m++) {
            int64_t t = members[m] / K;
            for (int64_t h = 0; h < H; h++)
                x[m * H + h] = hidden_bf16 ? bf16_to_f32(((const uint16_t *)hidden)[t * H + h])
                                           : ((const float *)hidden)[t * H + h];
        }
        expert_swiglu((const char *)gate_up + l * 2 * I * H * element,
                      (const char *)down + l * H * I * element, weights_bf16, x, y_expert, expert_scratch,
                      n, H, I, num_threads);
        for (int64_t m = 0; m < n; m++)
            for (int64_t h = 0; h < H; h++) y[members[m] * H + h] = y_expert[m * H + h];
        distinct++;
    }
    for (int64_t a = 0; a < P; a++) {  /* pairs in ascending order: by token, then rank */
        int64_t s = -1 - pairs[a], t = s / K;
        float w = weights[s];
        for (int64_t h = 0; h < H; h++) out[t * H + h] += w * y[s * H + h];
    }
    *num_distinct = distinct;
    return P;
}
"""
#: -fassociative-math (with the two flags it needs) lets the compiler reorder each dot product's sum into vector
#: lanes (the order differs from a sequential sum by fp32 rounding; the tolerance of runtime.cpu_experts covers it);
#: -fno-math-errno lets expf vectorize. Not -ffast-math: GCC then links crtfastmath, whose constructor sets
#: flush-to-zero and denormals-are-zero for the whole process when the library loads (every denormal the process
#: computed with after, torch's and Python's, read as zero: a profile's denormal rate then passed as 0)
_FLAGS = ("-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
          "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")
#: why the kernel is not loaded, once load_kernel tried (None: loaded, or not tried)
_REFUSAL: list[str] = []


def kernel_refusal() -> str | None:
    """Why load_kernel returned None (no compiler, a failed build, turned off), else None."""
    return _REFUSAL[0] if _REFUSAL else None


def reset_kernel() -> None:
    """Forget the loaded kernel and why none loaded, so the next load_kernel tries again (a changed $CC, tests)."""
    load_kernel.cache_clear()
    _REFUSAL.clear()


def _cache_dir() -> Path:
    root = os.environ.get("OFFLOAD_PLAN_CACHE") or Path.home() / ".cache" / "offload-plan"
    return Path(root) / "kernels"


def _library_path(compiler: str) -> Path:
    """The built library's path: one per source, flags, compiler and host CPU (-march=native builds for it)."""
    identity = "\n".join((_SOURCE, " ".join(_FLAGS), compiler, platform.machine(), _cpu_model()))
    return _cache_dir() / f"cpu_experts_{hashlib.sha256(identity.encode()).hexdigest()[:16]}.so"


def _cpu_model() -> str:
    """The CPU's model and instruction-set flags (a VM may hide some of a model's flags: -march=native builds for
    what this one shows)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    first = {}
    for line in lines:
        key = line.split(":", 1)[0].strip()
        if key in ("model name", "flags"):
            first.setdefault(key, line)
    return "\n".join(first.values()) or platform.processor()


def _build(compiler: str, target: Path) -> None:
    """Compile the source into ``target`` (written whole, then moved into place: a concurrent build cannot leave
    half a library there)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        source, built = Path(folder) / "cpu_experts.c", Path(folder) / target.name
        source.write_text(_SOURCE)
        subprocess.run([compiler, *_FLAGS, str(source), "-o", str(built), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(built, target)


@dataclass(frozen=True)
class CpuKernel:
    """The compiled library's two functions (ctypes): one expert's SwiGLU, and a layer's CPU pairs summed per
    token (the host node's body)."""

    expert: object
    partial_sum: object


@functools.cache
def load_kernel():
    """The compiled kernel (CpuKernel: ctypes functions), building it on first use; None where it cannot be built
    here (kernel_refusal says why) or OFFLOAD_PLAN_CPU_KERNEL=0."""
    if os.environ.get("OFFLOAD_PLAN_CPU_KERNEL", "1") == "0":
        _REFUSAL.append("turned off (OFFLOAD_PLAN_CPU_KERNEL=0)")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        _REFUSAL.append(f"no C compiler ({os.environ.get('CC', 'cc')}) on PATH")
        return None
    target = _library_path(compiler)
    try:
        if not target.exists():
            _build(compiler, target)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        lines = (getattr(error, "stderr", None) or str(error)).strip().splitlines() or [""]
        # the compiler's first error names the cause; its last line is often a caret under the source
        detail = next((line for line in lines if "error" in line), lines[-1])
        _REFUSAL.append(f"the build failed: {detail.strip()[:160]}")
        return None
    expert = library.expert_swiglu
    expert.restype = None
    expert.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    pairs = library.partial_sum
    pairs.restype = ctypes.c_int64
    pairs.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                      ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                      ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                      ctypes.c_int, ctypes.c_void_p]
    return CpuKernel(expert=expert, partial_sum=pairs)



def expert_swiglu(kernel, gate_up: torch.Tensor, down: torch.Tensor, hidden: torch.Tensor,
                  num_threads: int) -> torch.Tensor:
    """One expert's SwiGLU through ``kernel`` (load_kernel's): ``gate_up`` [2I, H] and ``down`` [H, I] contiguous
    host tensors in bf16 or fp32, ``hidden`` [T, H]; [T, H] in fp32."""
    two_i, hidden_size = gate_up.shape
    if gate_up.dtype not in (torch.bfloat16, torch.float32) or down.dtype != gate_up.dtype:
        raise ValueError(f"the CPU kernel reads bf16 or fp32 weights, not {gate_up.dtype} and {down.dtype}")
    if not (gate_up.is_contiguous() and down.is_contiguous()) or down.shape != (hidden_size, two_i // 2):
        raise ValueError(f"gate_up {list(gate_up.shape)} and down {list(down.shape)}: contiguous [2I, H] and [H, I]")
    x = hidden.to(torch.float32).contiguous()
    num_tokens = x.shape[0]
    out = torch.empty(num_tokens, hidden_size, dtype=torch.float32)
    scratch = torch.empty(num_tokens * 3 * (two_i // 2), dtype=torch.float32)
    kernel.expert(gate_up.data_ptr(), down.data_ptr(), int(gate_up.dtype == torch.bfloat16), x.data_ptr(),
                  out.data_ptr(), scratch.data_ptr(), num_tokens, hidden_size, two_i // 2, max(1, num_threads))
    return out


#: the hidden states' dtypes partial_sum reads as they come (others: the caller's torch path)
PARTIAL_SUM_HIDDEN_DTYPES = (torch.bfloat16, torch.float32)


def partial_sum(kernel, gate_up: torch.Tensor, down: torch.Tensor, local: torch.Tensor, hidden: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor, out: torch.Tensor,
                num_threads: int) -> tuple[int, int]:
    """A routed layer's CPU pairs through ``kernel`` (load_kernel's), summed per token into ``out`` [T, H] (fp32,
    contiguous): ``gate_up`` [L, 2I, H] and ``down`` [L, H, I] the CPU experts (contiguous, bf16 or fp32),
    ``local`` [E] int64 each expert's index among them (-1: not a CPU expert; every other below L, which the caller
    keeps, as runtime.cpu_handoff.cpu_layer builds it), ``hidden`` [T, H] (bf16 or fp32),
    ``top_k_index`` [T, k] and ``top_k_weights`` [T, k]. Returns (pairs, distinct experts) computed."""
    num_tokens, num_top_k = top_k_index.shape
    num_local, two_i, hidden_size = gate_up.shape
    intermediate = two_i // 2
    if hidden.dtype not in PARTIAL_SUM_HIDDEN_DTYPES or not (out.is_contiguous() and out.dtype == torch.float32):
        raise ValueError(f"partial_sum reads bf16 or fp32 hidden states into a contiguous fp32 output, not "
                         f"{hidden.dtype} into {out.dtype}")
    # the C side reads these as laid out: a wrong shape or layout would read past them, not fail
    if (gate_up.dtype not in (torch.bfloat16, torch.float32) or down.dtype != gate_up.dtype
            or not (gate_up.is_contiguous() and down.is_contiguous())
            or down.shape != (num_local, hidden_size, intermediate) or hidden.shape != (num_tokens, hidden_size)
            or out.shape != hidden.shape or local.dtype != torch.int64 or not local.is_contiguous()):
        raise ValueError(f"partial_sum takes contiguous bf16 or fp32 experts gate_up [L, 2I, H] and down [L, H, I], "
                         f"hidden and out [T, H] and int64 local ids, not {list(gate_up.shape)}, "
                         f"{list(down.shape)}, {list(hidden.shape)}, {list(out.shape)}, {local.dtype}")
    hidden = hidden.contiguous()
    index = top_k_index.to(torch.int64).contiguous()
    weights = top_k_weights.to(torch.float32).contiguous()
    num_pairs = num_tokens * num_top_k
    scratch = torch.empty(3 * num_pairs * hidden_size + 3 * num_pairs * intermediate, dtype=torch.float32)
    pairs = torch.empty(2 * num_pairs, dtype=torch.int64)
    distinct = ctypes.c_int64(0)
    computed = kernel.partial_sum(
        hidden.data_ptr(), int(hidden.dtype == torch.bfloat16), index.data_ptr(), weights.data_ptr(), num_tokens,
        num_top_k, local.data_ptr(), local.numel(), gate_up.data_ptr(), down.data_ptr(),
        int(gate_up.dtype == torch.bfloat16), hidden_size, intermediate, out.data_ptr(), scratch.data_ptr(),
        pairs.data_ptr(), max(1, num_threads), ctypes.byref(distinct))
    return int(computed), int(distinct.value)
