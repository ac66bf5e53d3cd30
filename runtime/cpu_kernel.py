"""One routed expert's SwiGLU on the host CPU in C: the CPU-experts path's arithmetic without torch's per-op costs.

torch computes an expert at a decode step's few tokens as four matrix-vector products and three element-wise ops,
each its own call with its own thread fork and join, and in bf16 it rounds every intermediate to bf16. This
kernel streams the expert's weights once, as they lie (bf16 or fp32, transformers 5's fused layout: gate_up
[2I, H], gate rows first, then down [H, I]), and for each weight row computes the dot products of four tokens at a
time in fp32, in one OpenMP team per expert. On 2 cores of an AMD EPYC host (AVX2), a Qwen3-30B-A3B-shaped expert
from DRAM (runtime.cpu_experts.measure_cpu_experts) took 1.14 / 1.77 / 6.95 ms at 1 / 4 / 16 tokens with bf16
weights, against torch's 1.42 / 4.71 / 19.5 (bf16) and 1.35 / 9.39 / 32.8 (fp32); its output with bf16 weights was
within 2e-7 of an fp64 reference where torch's bf16 path was 3e-3 off (its fp32 path 4e-7). On the H200 host's
16-core Xeon (AVX-512) the compiler's vectorization was slower than torch's fp32 path at one token (0.221 ms bf16
against 0.175; benchmarks/2026-11-28-cpu-experts-kernel-h200.md); with the AVX-512 bf16 rows below it took 0.148
against torch's 0.21 to 0.27 (benchmarks/2026-11-28-cpu-experts-doorbell-h200.md).

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
#include <stdlib.h>
#include <math.h>
#include <time.h>
#include <pthread.h>

static inline float bf16_to_f32(uint16_t value) {
    union { uint32_t u; float f; } bits;
    bits.u = ((uint32_t)value) << 16;
    return bits.f;
}

/* fp32 rounded to the nearest bf16 (ties to even), returned as fp32: what a GPU's bf16 op stores after computing
   in fp32. NaN and infinity pass unchanged. */
static inline float round_bf16(float value) {
    union { uint32_t u; float f; } bits;
    bits.f = value;
    if ((bits.u & 0x7f800000u) == 0x7f800000u) return value;
    bits.u = (bits.u + 0x7fffu + ((bits.u >> 16) & 1u)) & 0xffff0000u;
    return bits.f;
}

/* One weight row [N] (bf16 or fp32) times 1 or 4 fp32 vectors: each weight feeds every vector's multiply-add, the
   row read once for them. Separate loops per dtype and width, so each vectorizes. */
#if defined(__AVX512F__)
#include <immintrin.h>
/* bf16 rows with AVX-512: independent accumulators (one running sum waits the fused multiply-add's latency for
   every 16 weights) and a software prefetch ahead in the row. On the H200 host's 16-core Xeon a 2048x768 expert
   from DRAM took 0.148 / 0.147 / 0.398 ms at 1 / 4 / 16 tokens this way against 0.185 / 0.187 / 0.555 with the
   compiler's vectorization of the loops below (scripts/experiments/cpu_kernel_variants.py, 2026-11-28) */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024
#endif
static inline __m512 load_bf16(const uint16_t *w) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w)), 16));
}

static float dot1_bf16(const uint16_t *w, const float *v, int64_t N) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= N; i += 64) {
        if (PREFETCH_BYTES) _mm_prefetch((const char *)(w + i) + PREFETCH_BYTES, _MM_HINT_T0);
        a0 = _mm512_fmadd_ps(load_bf16(w + i), _mm512_loadu_ps(v + i), a0);
        a1 = _mm512_fmadd_ps(load_bf16(w + i + 16), _mm512_loadu_ps(v + i + 16), a1);
        a2 = _mm512_fmadd_ps(load_bf16(w + i + 32), _mm512_loadu_ps(v + i + 32), a2);
        a3 = _mm512_fmadd_ps(load_bf16(w + i + 48), _mm512_loadu_ps(v + i + 48), a3);
    }
    float a = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    for (; i < N; i++) a += bf16_to_f32(w[i]) * v[i];
    return a;
}

static void dot4_bf16(const uint16_t *w, const float *v, int64_t N, float *out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps(), b2 = _mm512_setzero_ps(), b3 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= N; i += 32) {
        if (PREFETCH_BYTES) _mm_prefetch((const char *)(w + i) + PREFETCH_BYTES, _MM_HINT_T0);
        __m512 x = load_bf16(w + i), y = load_bf16(w + i + 16);
        a0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v + i), a0);
        a1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v + N + i), a1);
        a2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v + 2 * N + i), a2);
        a3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v + 3 * N + i), a3);
        b0 = _mm512_fmadd_ps(y, _mm512_loadu_ps(v + i + 16), b0);
        b1 = _mm512_fmadd_ps(y, _mm512_loadu_ps(v + N + i + 16), b1);
        b2 = _mm512_fmadd_ps(y, _mm512_loadu_ps(v + 2 * N + i + 16), b2);
        b3 = _mm512_fmadd_ps(y, _mm512_loadu_ps(v + 3 * N + i + 16), b3);
    }
    out[0] = _mm512_reduce_add_ps(_mm512_add_ps(a0, b0)); out[1] = _mm512_reduce_add_ps(_mm512_add_ps(a1, b1));
    out[2] = _mm512_reduce_add_ps(_mm512_add_ps(a2, b2)); out[3] = _mm512_reduce_add_ps(_mm512_add_ps(a3, b3));
    for (; i < N; i++) {
        float x = bf16_to_f32(w[i]);
        out[0] += x * v[i]; out[1] += x * v[N + i]; out[2] += x * v[2 * N + i]; out[3] += x * v[3 * N + i];
    }
}
#else
static float dot1_bf16(const uint16_t *w, const float *v, int64_t N) {
    float a = 0.f;
    for (int64_t i = 0; i < N; i++) a += bf16_to_f32(w[i]) * v[i];
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
#endif

static float dot1_f32(const float *w, const float *v, int64_t N) {
    float a = 0.f;
    for (int64_t i = 0; i < N; i++) a += w[i] * v[i];
    return a;
}

static void dot4_f32(const float *w, const float *v, int64_t N, float *out) {
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    for (int64_t i = 0; i < N; i++) {
        float x = w[i];
        a0 += x * v[i]; a1 += x * v[N + i]; a2 += x * v[2 * N + i]; a3 += x * v[3 * N + i];
    }
    out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3;
}

/* rows [R, N] of weights (row r at r * stride elements) times each of T fp32 vectors x [T, N]: y[t * R + r];
   tokens four at a time, the rest one at a time */
static void rows_times(const void *weights, int bf16, const float *x, float *y, int64_t T, int64_t R, int64_t N,
                       int64_t stride) {
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const uint16_t *wb = (const uint16_t *)weights + r * stride;
        const float *wf = (const float *)weights + r * stride;
        int64_t t = 0;
        for (; t + 4 <= T; t += 4) {
            float acc[4];
            if (bf16) dot4_bf16(wb, x + t * N, N, acc); else dot4_f32(wf, x + t * N, N, acc);
            for (int j = 0; j < 4; j++) y[(t + j) * R + r] = acc[j];
        }
        for (; t < T; t++) y[t * R + r] = bf16 ? dot1_bf16(wb, x + t * N, N) : dot1_f32(wf, x + t * N, N);
    }
}

/* out [T, H] = down [H, I] @ (silu(gate x) * (up x)) for x [T, H], gate_up [2I, H] (gate rows first), over the
   first R of the I intermediate rows (R = I: the whole expert; R < I: gate and up rows [0, R) and down's columns
   [0, R), a part of the expert whose other rows another device computes, the two outputs summing to the expert's).
   scratch: T * 3I floats. One OpenMP team of num_threads; each weight row is read once for all T tokens.
   round: store every intermediate as a GPU computing in bf16 stores it (transformers' batched_mm: the projections
   rounded to bf16, SiLU's output rounded, the product rounded, the output rounded), each product summed in fp32 as
   before; 0: fp32 throughout. */
void expert_swiglu(const void *gate_up, const void *down, int bf16, const float *x, float *out, float *scratch,
                   int64_t T, int64_t H, int64_t I, int64_t R, int num_threads, int round) {
    float *gates = scratch;               /* [T, R] */
    float *ups = scratch + T * R;         /* [T, R] */
    float *activated = scratch + 2 * T * R;  /* [T, R] */
    const void *up_rows = (const char *)gate_up + I * H * (bf16 ? 2 : 4);
    #pragma omp parallel num_threads(num_threads)
    {
        rows_times(gate_up, bf16, x, gates, T, R, H, H);
        rows_times(up_rows, bf16, x, ups, T, R, H, H);
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < T * R; j++) {
            float gate = gates[j], up = ups[j];
            if (round) {
                gate = round_bf16(gate);
                activated[j] = round_bf16(round_bf16(gate / (1.f + expf(-gate))) * round_bf16(up));
            } else {
                activated[j] = gate / (1.f + expf(-gate)) * up;
            }
        }
        rows_times(down, bf16, activated, out, T, H, R, I);
        if (round) {
            #pragma omp for schedule(static)
            for (int64_t j = 0; j < T * H; j++) out[j] = round_bf16(out[j]);
        }
    }
}

/* One routed layer's CPU pairs at a decode step, summed per token (the host node's whole body, without Python):
   out [T, H] fp32 = per token t, over its ranks r in order whose expert e = index[t K + r] is a CPU expert
   (0 <= e < E, local[e] >= 0), the sum of weights[t K + r] x expert local[e]'s SwiGLU of hidden[t].
   hidden [T, H] bf16 (hidden_bf16) or fp32; index int64 [T K]; weights fp32 [T K]; local int64 [E];
   gate_up [L, 2I, H] and down [L, H, I], the CPU experts, bf16 (weights_bf16) or fp32.
   floats: scratch of 3 T K H + 3 T K I; ints: pairs of 2 T K. Each expert's weights are read once for all its
   tokens. Returns the pairs computed; *num_distinct the distinct experts among them.
   Rounded as the GPU's batched_mm rounds, so the sum the GPU finishes is the all-resident one's but for fp32
   summation order: with bf16 hidden states (a model computing in bf16) each expert's intermediates and output
   (expert_swiglu's round); with routing_bf16 (the router's weights were bf16) each weighted pair, as the GPU's
   bf16 product is. part (or NULL): {expert id, rows}: that expert's pairs over its first rows only (the GPU
   computes its other rows; part[0] < 0 or rows 0: none). */
int64_t partial_sum(const void *hidden, int hidden_bf16, const int64_t *index, const float *weights, int64_t T,
                    int64_t K, const int64_t *local, int64_t E, const void *gate_up, const void *down,
                    int weights_bf16, int64_t H, int64_t I, float *out, float *scratch, int64_t *pairs,
                    int num_threads, int64_t *num_distinct, int routing_bf16, const int64_t *part) {
    int64_t S = T * K, P = 0, distinct = 0;
    int64_t *members = pairs + S;
    float *x = scratch, *y_expert = scratch + S * H, *y = scratch + 2 * S * H, *expert_scratch = scratch + 3 * S * H;
    int64_t element = weights_bf16 ? 2 : 4;
    for (int64_t i = 0; i < T * H; i++) out[i] = 0.f;
    for (int64_t s = 0; s < S; s++)
        if (index[s] >= 0 && index[s] < E && local[index[s]] >= 0) pairs[P++] = s;
    for (int64_t a = 0; a < P; a++) {
        if (pairs[a] < 0) continue;  /* taken by an earlier expert's group */
        int64_t e = index[pairs[a]], l = local[e], n = 0;
        int64_t rows = (part && part[0] == e && part[1] > 0 && part[1] < I) ? part[1] : I;
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
                      n, H, I, rows, num_threads, hidden_bf16);
        for (int64_t m = 0; m < n; m++)
            for (int64_t h = 0; h < H; h++) y[members[m] * H + h] = y_expert[m * H + h];
        distinct++;
    }
    for (int64_t a = 0; a < P; a++) {  /* pairs in ascending order: by token, then rank */
        int64_t s = -1 - pairs[a], t = s / K;
        float w = weights[s];
        if (routing_bf16)
            for (int64_t h = 0; h < H; h++) out[t * H + h] += round_bf16(w * y[s * H + h]);
        else
            for (int64_t h = 0; h < H; h++) out[t * H + h] += w * y[s * H + h];
    }
    *num_distinct = distinct;
    return P;
}

/* The host node itself (the driver's CUhostFn, void (*)(void *)): a routed layer's partial_sum from the
   page-locked handoff buffers its struct names, counted, in C, so a captured step's host node runs no Python and
   takes no GIL. The fields are set once per (layer, tokens, top-k) by runtime.cpu_kernel.HostStep and never
   change while a graph that captured it may replay; ``closed`` set, it does nothing. */
typedef struct {
    const void *hidden; const int64_t *index; const float *weights; const int64_t *local;
    const void *gate_up; const void *down; float *out; float *scratch; int64_t *pairs; const int64_t *part;
    int64_t T, K, E, H, I;
    int32_t hidden_bf16, weights_bf16, num_threads, closed, routing_bf16, unused;
    int64_t calls, pairs_total, pairs_cpu, experts_cpu;
    double seconds;
} host_step_args;

void host_step(void *user_data) {
    host_step_args *a = (host_step_args *)user_data;
    if (a->closed) return;
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    int64_t distinct = 0;
    int64_t computed = partial_sum(a->hidden, a->hidden_bf16, a->index, a->weights, a->T, a->K, a->local, a->E,
                                   a->gate_up, a->down, a->weights_bf16, a->H, a->I, a->out, a->scratch, a->pairs,
                                   a->num_threads, &distinct, a->routing_bf16, a->part);
    clock_gettime(CLOCK_MONOTONIC, &end);
    a->calls += 1;
    a->pairs_total += a->T * a->K;
    a->pairs_cpu += computed;
    a->experts_cpu += distinct;
    a->seconds += (double)(end.tv_sec - start.tv_sec) + 1e-9 * (double)(end.tv_nsec - start.tv_nsec);
}

/* The doorbell: a thread of its own that waits for the GPU's ring instead of a host node. The GPU writes a step's
   inputs into the page-locked buffers and then a key into flags[0] (runtime.cpu_doorbell's ring kernel); this
   thread, polling flags[0], runs steps[key - 1] (a host_step_args), then writes 1 into flags[1], which the GPU's
   wait kernel polls before it adds the output. flags[2] counts the steps this thread ran. No driver thread, no
   host node, no GIL: a round trip is two PCIe writes and the polls. It spins while steps keep coming and sleeps
   between polls once none came for idle_spin_ns. */
typedef struct {
    volatile int32_t *flags;
    host_step_args *volatile *steps;
    int32_t capacity;
    int64_t idle_spin_ns, sleep_ns;
    volatile int32_t stop;
    pthread_t thread;
} doorbell_worker;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void spin_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void *doorbell_loop(void *argument) {
    doorbell_worker *w = (doorbell_worker *)argument;
    int64_t last = now_ns();
    while (!w->stop) {
        int32_t key = __atomic_load_n(&w->flags[0], __ATOMIC_ACQUIRE);
        if (key > 0 && key <= w->capacity && w->steps[key - 1] != 0) {
            __atomic_store_n(&w->flags[0], 0, __ATOMIC_RELAXED);
            host_step(w->steps[key - 1]);
            __atomic_store_n(&w->flags[2], w->flags[2] + 1, __ATOMIC_RELAXED);
            __atomic_store_n(&w->flags[1], 1, __ATOMIC_RELEASE);
            last = now_ns();
            continue;
        }
        if (now_ns() - last < w->idle_spin_ns) {
            spin_pause();
        } else {
            struct timespec pause = {0, w->sleep_ns};
            nanosleep(&pause, 0);
        }
    }
    return 0;
}

void *doorbell_start(volatile int32_t *flags, host_step_args *volatile *steps, int32_t capacity,
                     int64_t idle_spin_ns, int64_t sleep_ns) {
    doorbell_worker *w = (doorbell_worker *)calloc(1, sizeof(doorbell_worker));
    if (!w) return 0;
    w->flags = flags; w->steps = steps; w->capacity = capacity;
    w->idle_spin_ns = idle_spin_ns; w->sleep_ns = sleep_ns;
    if (pthread_create(&w->thread, 0, doorbell_loop, w) != 0) { free(w); return 0; }
    return w;
}

void doorbell_stop(void *worker) {
    doorbell_worker *w = (doorbell_worker *)worker;
    if (!w) return;
    w->stop = 1;
    pthread_join(w->thread, 0);
    free(w);
}
"""
#: -fassociative-math (with the two flags it needs) lets the compiler reorder each dot product's sum into vector
#: lanes (the order differs from a sequential sum by fp32 rounding; the tolerance of runtime.cpu_experts covers it);
#: -fno-math-errno lets expf vectorize. Not -ffast-math: GCC then links crtfastmath, whose constructor sets
#: flush-to-zero and denormals-are-zero for the whole process when the library loads (every denormal the process
#: computed with after, torch's and Python's, read as zero: a profile's denormal rate then passed as 0)
_FLAGS = ("-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
          "-fno-math-errno", "-fopenmp", "-pthread", "-fPIC", "-shared")
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
    """The compiled library's functions (ctypes): one expert's SwiGLU, a layer's CPU pairs summed per token (the
    host node's body), the host node itself (``host_step``, whose address the driver calls), and the doorbell's
    thread."""

    expert: object
    partial_sum: object
    host_step: object
    #: the doorbell's thread (runtime.cpu_doorbell): start one over a flags word and a steps table, stop it
    doorbell_start: object
    doorbell_stop: object

    @property
    def host_step_address(self) -> int:
        """host_step's address, a CUhostFn for cuLaunchHostFunc."""
        return ctypes.cast(self.host_step, ctypes.c_void_p).value


class HostStepArgs(ctypes.Structure):
    """host_step's struct (the C source's host_step_args, field for field): the buffers and sizes of one routed
    layer's host node, and the counters it adds to."""

    _fields_ = [("hidden", ctypes.c_void_p), ("index", ctypes.c_void_p), ("weights", ctypes.c_void_p),
                ("local", ctypes.c_void_p), ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("scratch", ctypes.c_void_p), ("pairs", ctypes.c_void_p),
                ("part", ctypes.c_void_p), ("T", ctypes.c_int64), ("K", ctypes.c_int64), ("E", ctypes.c_int64),
                ("H", ctypes.c_int64),
                ("I", ctypes.c_int64), ("hidden_bf16", ctypes.c_int32), ("weights_bf16", ctypes.c_int32),
                ("num_threads", ctypes.c_int32), ("closed", ctypes.c_int32), ("routing_bf16", ctypes.c_int32),
                ("unused", ctypes.c_int32), ("calls", ctypes.c_int64),
                ("pairs_total", ctypes.c_int64), ("pairs_cpu", ctypes.c_int64), ("experts_cpu", ctypes.c_int64),
                ("seconds", ctypes.c_double)]


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
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                       ctypes.c_int]
    pairs = library.partial_sum
    pairs.restype = ctypes.c_int64
    pairs.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                      ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                      ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                      ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    host_step = library.host_step
    host_step.restype = None
    host_step.argtypes = [ctypes.c_void_p]
    start = library.doorbell_start
    start.restype = ctypes.c_void_p
    start.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64]
    stop = library.doorbell_stop
    stop.restype = None
    stop.argtypes = [ctypes.c_void_p]
    return CpuKernel(expert=expert, partial_sum=pairs, host_step=host_step, doorbell_start=start,
                     doorbell_stop=stop)



def expert_swiglu(kernel, gate_up: torch.Tensor, down: torch.Tensor, hidden: torch.Tensor,
                  num_threads: int, round_bf16: bool = False, rows: int | None = None) -> torch.Tensor:
    """One expert's SwiGLU through ``kernel`` (load_kernel's): ``gate_up`` [2I, H] and ``down`` [H, I] contiguous
    host tensors in bf16 or fp32, ``hidden`` [T, H]; [T, H] in fp32. ``round_bf16``: its intermediates and output
    rounded to bf16 where a GPU computing the expert in bf16 rounds them (the values then bf16's). ``rows``: over
    the first ``rows`` intermediate rows only (a part of the expert; None: all I)."""
    two_i, hidden_size = gate_up.shape
    if gate_up.dtype not in (torch.bfloat16, torch.float32) or down.dtype != gate_up.dtype:
        raise ValueError(f"the CPU kernel reads bf16 or fp32 weights, not {gate_up.dtype} and {down.dtype}")
    if not (gate_up.is_contiguous() and down.is_contiguous()) or down.shape != (hidden_size, two_i // 2):
        raise ValueError(f"gate_up {list(gate_up.shape)} and down {list(down.shape)}: contiguous [2I, H] and [H, I]")
    x = hidden.to(torch.float32).contiguous()
    num_tokens = x.shape[0]
    out = torch.empty(num_tokens, hidden_size, dtype=torch.float32)
    scratch = torch.empty(num_tokens * 3 * (two_i // 2), dtype=torch.float32)
    intermediate = two_i // 2
    rows = intermediate if rows is None else rows
    if not 0 < rows <= intermediate:
        raise ValueError(f"rows {rows} of an expert of {intermediate} intermediate rows")
    kernel.expert(gate_up.data_ptr(), down.data_ptr(), int(gate_up.dtype == torch.bfloat16), x.data_ptr(),
                  out.data_ptr(), scratch.data_ptr(), num_tokens, hidden_size, intermediate, rows,
                  max(1, num_threads), int(round_bf16))
    return out


#: the hidden states' dtypes partial_sum reads as they come (others: the caller's torch path)
PARTIAL_SUM_HIDDEN_DTYPES = (torch.bfloat16, torch.float32)


def _check_layer(gate_up: torch.Tensor, down: torch.Tensor, local: torch.Tensor, hidden: torch.Tensor,
                 top_k_index: torch.Tensor, out: torch.Tensor) -> None:
    """ValueError, in one line, unless the tensors are what the C side reads as laid out (a wrong shape, layout or
    dtype would read past them, not fail): see partial_sum."""
    num_tokens = top_k_index.shape[0]
    num_local, two_i, hidden_size = gate_up.shape
    if hidden.dtype not in PARTIAL_SUM_HIDDEN_DTYPES or not (out.is_contiguous() and out.dtype == torch.float32):
        raise ValueError(f"partial_sum reads bf16 or fp32 hidden states into a contiguous fp32 output, not "
                         f"{hidden.dtype} into {out.dtype}")
    if (gate_up.dtype not in (torch.bfloat16, torch.float32) or down.dtype != gate_up.dtype
            or not (gate_up.is_contiguous() and down.is_contiguous())
            or down.shape != (num_local, hidden_size, two_i // 2) or hidden.shape != (num_tokens, hidden_size)
            or out.shape != hidden.shape or local.dtype != torch.int64 or not local.is_contiguous()):
        raise ValueError(f"partial_sum takes contiguous bf16 or fp32 experts gate_up [L, 2I, H] and down [L, H, I], "
                         f"hidden and out [T, H] and int64 local ids, not {list(gate_up.shape)}, "
                         f"{list(down.shape)}, {list(hidden.shape)}, {list(out.shape)}, {local.dtype}")


def scratch_sizes(num_pairs: int, hidden_size: int, intermediate_size: int) -> tuple[int, int]:
    """partial_sum's scratch at ``num_pairs`` (token, expert) pairs: (floats, int64s)."""
    return 3 * num_pairs * (hidden_size + intermediate_size), 2 * num_pairs


def partial_sum(kernel, gate_up: torch.Tensor, down: torch.Tensor, local: torch.Tensor, hidden: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor, out: torch.Tensor,
                num_threads: int, routing_bf16: bool | None = None,
                part: torch.Tensor | None = None) -> tuple[int, int]:
    """A routed layer's CPU pairs through ``kernel`` (load_kernel's), summed per token into ``out`` [T, H] (fp32,
    contiguous): ``gate_up`` [L, 2I, H] and ``down`` [L, H, I] the CPU experts (contiguous, bf16 or fp32),
    ``local`` [E] int64 each expert's index among them (-1: not a CPU expert; every other below L, which the caller
    keeps, as runtime.cpu_handoff.cpu_layer builds it), ``hidden`` [T, H] (bf16 or fp32),
    ``top_k_index`` [T, k] and ``top_k_weights`` [T, k]. Returns (pairs, distinct experts) computed. Rounded as
    the GPU rounds (the C source's partial_sum): bf16 ``hidden`` rounds each expert's intermediates and output,
    ``routing_bf16`` (default: whether ``top_k_weights`` are bf16) each weighted pair. ``part``: int64 host tensor
    (expert id, rows, ...): that expert's pairs over its first rows only (runtime.fetch_planning's part)."""
    _check_layer(gate_up, down, local, hidden, top_k_index, out)
    part = _checked_part(part)
    num_tokens, num_top_k = top_k_index.shape
    hidden_size, intermediate = gate_up.shape[2], gate_up.shape[1] // 2
    hidden = hidden.contiguous()
    index = top_k_index.to(torch.int64).contiguous()
    weights = top_k_weights.to(torch.float32).contiguous()
    floats, ints = scratch_sizes(num_tokens * num_top_k, hidden_size, intermediate)
    scratch = torch.empty(floats, dtype=torch.float32)
    pairs = torch.empty(ints, dtype=torch.int64)
    distinct = ctypes.c_int64(0)
    computed = kernel.partial_sum(
        hidden.data_ptr(), int(hidden.dtype == torch.bfloat16), index.data_ptr(), weights.data_ptr(), num_tokens,
        num_top_k, local.data_ptr(), local.numel(), gate_up.data_ptr(), down.data_ptr(),
        int(gate_up.dtype == torch.bfloat16), hidden_size, intermediate, out.data_ptr(), scratch.data_ptr(),
        pairs.data_ptr(), max(1, num_threads), ctypes.byref(distinct),
        int(top_k_weights.dtype == torch.bfloat16 if routing_bf16 is None else routing_bf16),
        None if part is None else part.data_ptr())
    return int(computed), int(distinct.value)


def _checked_part(part: torch.Tensor | None) -> torch.Tensor | None:
    """``part`` as the C side reads it (a contiguous int64 host tensor of at least 2: expert id, rows), or None."""
    if part is None:
        return None
    if part.dtype != torch.int64 or part.device.type != "cpu" or not part.is_contiguous() or part.numel() < 2:
        raise ValueError(f"part must be a contiguous int64 host tensor (expert id, rows), not {part.dtype} "
                         f"[{part.numel()}] on {part.device}")
    return part


#: HostStep's counters, in the order CpuCounters names them
HOST_STEP_COUNTERS = ("calls", "pairs_total", "pairs_cpu", "experts_cpu")


class HostStep:
    """One routed layer's host node at one (tokens, top-k) in C (the kernel's host_step): its struct, bound once
    to the page-locked buffers it reads and writes, and the tensors behind every pointer in it, kept alive here as
    long as a graph that captured it may replay. ``index`` and ``weights`` hold the step's [T x k] routed ids
    (int64) and weights (fp32) in token-major order; ``scratch`` and ``pairs`` partial_sum's scratch (scratch_sizes
    at least; shared between HostSteps whose nodes run one after another). ``routing_bf16``: the router's weights
    were bf16 before the handoff widened them (each weighted pair is rounded as the GPU's bf16 product is).
    ``part``: the page-locked (expert id, rows) the GPU writes each step of a layer that splits an expert by its rows
    (runtime.fetch_planning), read as partial_sum's part; None: whole experts."""

    def __init__(self, kernel, gate_up: torch.Tensor, down: torch.Tensor, local: torch.Tensor, *,
                 hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                 scratch: torch.Tensor, pairs: torch.Tensor, num_threads: int, routing_bf16: bool = False,
                 part: torch.Tensor | None = None):
        num_tokens, hidden_size = hidden.shape
        num_pairs = index.numel()
        if num_pairs % max(1, num_tokens) or index.dtype != torch.int64 or weights.dtype != torch.float32 \
                or weights.numel() != num_pairs or not (index.is_contiguous() and weights.is_contiguous()):
            raise ValueError(f"a host step takes contiguous int64 ids and fp32 weights of T x k pairs, not "
                             f"{index.dtype} [{index.numel()}] and {weights.dtype} [{weights.numel()}] for "
                             f"{num_tokens} tokens")
        num_top_k = num_pairs // max(1, num_tokens)
        _check_layer(gate_up, down, local, hidden, index.view(num_tokens, num_top_k), out)
        if not hidden.is_contiguous():
            raise ValueError("a host step reads its hidden states where they lie: they must be contiguous")
        intermediate = gate_up.shape[1] // 2
        floats, ints = scratch_sizes(num_pairs, hidden_size, intermediate)
        if scratch.dtype != torch.float32 or scratch.numel() < floats or pairs.dtype != torch.int64 \
                or pairs.numel() < ints:
            raise ValueError(f"a host step of {num_pairs} pairs needs {floats} fp32 and {ints} int64 of scratch")
        self.kernel = kernel
        part = _checked_part(part)
        self._tensors = (gate_up, down, local, hidden, index, weights, out, scratch, pairs, part)
        self.args = HostStepArgs(
            hidden=hidden.data_ptr(), index=index.data_ptr(), weights=weights.data_ptr(), local=local.data_ptr(),
            gate_up=gate_up.data_ptr(), down=down.data_ptr(), out=out.data_ptr(), scratch=scratch.data_ptr(),
            pairs=pairs.data_ptr(), part=None if part is None else part.data_ptr(), T=num_tokens, K=num_top_k,
            E=local.numel(), H=hidden_size, I=intermediate,
            hidden_bf16=int(hidden.dtype == torch.bfloat16), weights_bf16=int(gate_up.dtype == torch.bfloat16),
            num_threads=max(1, num_threads), closed=0, routing_bf16=int(routing_bf16))

    @property
    def user_data(self) -> int:
        """The struct's address: the host function's ``void *userData``."""
        return ctypes.addressof(self.args)

    def run(self) -> None:
        """Run the step here, on the calling thread (what the host node does on the driver's)."""
        self.kernel.host_step(self.user_data)

    def counters(self) -> dict:
        """The counts since the last reset: HOST_STEP_COUNTERS and ``callback_s`` (seconds inside the node)."""
        return {**{name: getattr(self.args, name) for name in HOST_STEP_COUNTERS}, "callback_s": self.args.seconds}

    def reset(self) -> None:
        for name in HOST_STEP_COUNTERS:
            setattr(self.args, name, 0)
        self.args.seconds = 0.0

    def close(self) -> None:
        """From now on the step does nothing (a graph that captured it must not be replayed after)."""
        self.args.closed = 1
