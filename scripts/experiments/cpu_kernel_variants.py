"""Why the CPU experts' C kernel reads weights at half the rate torch's fp32 path does on an AVX-512 host, and
which change closes it: variants of runtime/cpu_kernel.py's dot products, built side by side and timed on one
Qwen3-30B-A3B-shaped expert (H 2048 x I 768) from DRAM.

    PYTHONPATH=. python3 scripts/experiments/cpu_kernel_variants.py [--threads 8 16] [--tokens 1 4 16]

Variants (each a replacement of the kernel's bf16 dot products; fp32 weights keep the shipped ones):

- ``shipped``: the kernel as runtime.cpu_kernel builds it (since 2026-11-28 on AVX-512: ``acc4_prefetch``);
- ``portable``: the compiler's vectorization of one running sum (the kernel's fallback without AVX-512, and what
  it shipped on every host before: ``shipped`` in the first run's figures);
- ``acc4``: AVX-512 intrinsics, four independent accumulators of 16 lanes (a chain of dependent fused
  multiply-adds waits the FMA's latency per 16 weights): the shipped AVX-512 block without its prefetch;
- ``acc4_prefetch``: ``acc4`` plus a software prefetch 1 KiB ahead in the row (the shipped block);
- ``dpbf16``: AVX-512 BF16's dot-product instruction on bf16 weights and the input rounded to bf16 (exact for a
  bf16 model's hidden states, not for the down projection's fp32 input): the speed ceiling, with its error.

Each variant runs in its own process (its own OpenMP runtime), per thread count, with ``OMP_WAIT_POLICY`` unset
and ``passive``; torch's fp32 and bf16 paths at the same counts are timed beside it. Prints one row per arm: ms
per expert at each token count (median of 5 passes over a 1 GiB pool), the weight bytes read per second at one
token, and the max abs error of the variant's output against fp64 at one token.
"""

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HIDDEN, INTERMEDIATE = 2048, 768
POOL_BYTES = 2**30

_DPBF16 = r"""
#include <immintrin.h>
/* v rounded to bf16 pairs on the fly (the instruction multiplies bf16 by bf16 into fp32 sums) */
static inline __m512bh v_bf16(const float *v) {
    return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + 16), _mm512_loadu_ps(v));
}
static float dot1_bf16(const uint16_t *w, const float *v, int64_t N) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= N; i += 64) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(w + i)), v_bf16(v + i));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512((const void *)(w + i + 32)), v_bf16(v + i + 32));
    }
    float a = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    for (; i < N; i++) a += bf16_to_f32(w[i]) * v[i];
    return a;
}
static void dot4_bf16(const uint16_t *w, const float *v, int64_t N, float *out) {
    for (int j = 0; j < 4; j++) out[j] = dot1_bf16(w, v + j * N, N);
}
"""


def _bf16_block(source: str) -> tuple[int, int]:
    """Where the shipped source's bf16 dot products lie: its ``#if defined(__AVX512F__)`` ... ``#endif`` block."""
    start = source.index("#if defined(__AVX512F__)")
    fallback = source.index("#else\n", start)  # the block's own #ifndef closes before it
    return start, source.index("#endif\n", fallback) + len("#endif\n")


def variant_source(name: str) -> tuple[str, list[str]]:
    """The C source and the extra compiler flags of variant ``name``: the shipped source with its bf16 dot
    products' block replaced (``portable``: the block's own fallback, the compiler's vectorization of one running
    sum, which the kernel shipped before 2026-11-28 used on every host)."""
    from runtime.cpu_kernel import _SOURCE

    start, end = _bf16_block(_SOURCE)
    block = _SOURCE[start:end]
    portable = block[block.index("#else\n") + len("#else\n"):block.rindex("#endif")]
    replacements = {"shipped": (block, []), "portable": (portable, []), "acc4": (block, ["-DPREFETCH_BYTES=0"]),
                    "acc4_prefetch": (block, ["-DPREFETCH_BYTES=1024"]), "dpbf16": (_DPBF16, [])}
    replacement, flags = replacements[name]
    return _SOURCE[:start] + replacement + _SOURCE[end:], flags


def build(name: str, folder: Path):
    """Variant ``name`` compiled with the shipped flags; its expert_swiglu through ctypes."""
    from runtime.cpu_kernel import _FLAGS

    source, extra = variant_source(name)
    path, library = folder / f"{name}.c", folder / f"{name}.so"
    path.write_text(source)
    subprocess.run(["cc", *_FLAGS, *extra, str(path), "-o", str(library), "-lm"], check=True)
    expert = ctypes.CDLL(str(library)).expert_swiglu
    expert.restype = None
    expert.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    return expert


def pool(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of experts past the caches: gate_up [E, 2I, H], down [E, H, I], scaled as trained weights."""
    count = POOL_BYTES // (3 * HIDDEN * INTERMEDIATE * dtype.itemsize)
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(count, 2 * INTERMEDIATE, HIDDEN, generator=generator).mul_(HIDDEN ** -0.5).to(dtype)
    down = torch.randn(count, HIDDEN, INTERMEDIATE, generator=generator).mul_(INTERMEDIATE ** -0.5).to(dtype)
    return gate_up, down


def timed_ms(run, count: int) -> float:
    """Median ms per expert over 5 passes of ``run`` (one pass: ``count`` experts), after one untimed pass."""
    run()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times) / count


def reference(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU in fp64."""
    projected = x.double() @ gate_up.double().T
    gate, up = projected.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ down.double().T


def kernel_arm(name: str, threads: int, tokens: list[int]) -> dict:
    """One variant at one thread count: ms per expert at each token count and its error at one token."""
    gate_up, down = pool(torch.bfloat16)
    count = gate_up.shape[0]
    with tempfile.TemporaryDirectory() as folder:
        expert = build(name, Path(folder))
        row = {"arm": name, "threads": threads, "ms": {}}
        for num_tokens in tokens:
            x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).bfloat16().float()
            out = torch.empty(num_tokens, HIDDEN)
            scratch = torch.empty(num_tokens * 3 * INTERMEDIATE)

            def run():
                for e in range(count):
                    expert(gate_up[e].data_ptr(), down[e].data_ptr(), 1, x.data_ptr(), out.data_ptr(),
                           scratch.data_ptr(), num_tokens, HIDDEN, INTERMEDIATE, threads)

            row["ms"][num_tokens] = timed_ms(run, count)
            if num_tokens == 1:
                expert(gate_up[0].data_ptr(), down[0].data_ptr(), 1, x.data_ptr(), out.data_ptr(),
                       scratch.data_ptr(), 1, HIDDEN, INTERMEDIATE, threads)
                row["max_abs_error"] = float((out.double() - reference(gate_up[0], down[0], x)).abs().max())
    return row


def torch_arm(dtype: torch.dtype, threads: int, tokens: list[int]) -> dict:
    """torch's path (runtime.cpu_experts' arithmetic: two linears and the gate) at one thread count."""
    torch.set_num_threads(threads)
    gate_up, down = pool(dtype)
    count = gate_up.shape[0]
    row = {"arm": f"torch_{str(dtype).split('.')[-1]}", "threads": threads, "ms": {}}
    with torch.inference_mode():
        for num_tokens in tokens:
            x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)

            def run():
                for e in range(count):
                    gate, up = torch.nn.functional.linear(x, gate_up[e]).chunk(2, dim=-1)
                    torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down[e])

            row["ms"][num_tokens] = timed_ms(run, count)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="+", type=int, default=[8, 16])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--variants", nargs="+", default=["shipped", "portable", "acc4", "acc4_prefetch", "dpbf16"])
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # one arm, in a child process: name:threads
    args = parser.parse_args()
    if args.arm:
        name, threads = args.arm.split(":")
        torch_dtypes = {"torch_float32": torch.float32, "torch_bfloat16": torch.bfloat16}
        row = torch_arm(torch_dtypes[name], int(threads), args.tokens) if name in torch_dtypes else \
            kernel_arm(name, int(threads), args.tokens)
        print(json.dumps(row))
        return
    rows = []
    for threads in args.threads:
        for name in [*args.variants, "torch_float32", "torch_bfloat16"]:
            for policy in ([None, "passive"] if name in args.variants else [None]):
                env = dict(os.environ)
                env.pop("OMP_WAIT_POLICY", None)
                if policy:
                    env["OMP_WAIT_POLICY"] = policy
                command = [sys.executable, __file__, "--arm", f"{name}:{threads}", "--tokens", *map(str, args.tokens)]
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                if done.returncode:
                    print(f"{name} {threads}: failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
                    continue
                row = json.loads(done.stdout.strip().splitlines()[-1])
                row["wait_policy"] = policy or "default"
                rows.append(row)
                print(json.dumps(row), flush=True)
    expert_bytes = 3 * HIDDEN * INTERMEDIATE * 2
    print(f"\n{'arm':<16} {'thr':>3} {'wait':>8} " + " ".join(f"{t:>7}tok" for t in args.tokens)
          + "  GB/s@1  err@1")
    for row in rows:
        one = row["ms"].get("1") or row["ms"].get(1)
        rate = f"{expert_bytes * (2 if row['arm'] == 'torch_float32' else 1) / one / 1e6:7.1f}" if one else "   -"
        print(f"{row['arm']:<16} {row['threads']:>3} {row['wait_policy']:>8} "
              + " ".join(f"{ms:10.3f}" for ms in row["ms"].values())
              + f"  {rate}  {row.get('max_abs_error', float('nan')):.1e}")


if __name__ == "__main__":
    main()
