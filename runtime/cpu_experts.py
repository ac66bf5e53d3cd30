"""Routed experts computed on the host CPU: their host copy, their rate, and a hybrid layer (eager, not graphed).

The third placement of a routed expert (planner.search.cpu_experts): the host holds every expert already, so its
CPU can compute some of a step's misses while the link fetches the others. Here:

- ``HostExperts``: one layer's experts as the CPU reads them: transformers 5's fused layout (``gate_up_proj``
  [E, 2I, H], gate rows then up rows, and ``down_proj`` [E, H, I]), one expert contiguous, in bf16 or fp32 (a
  host CPU without bf16 matrix units reads fp32 faster: 1.59 ms against 2.56 ms for 8 Qwen3-30B-A3B experts at
  one token on the H100 host's 16 cores, issue 37), from a fused module or per-expert tensors as checkpoints
  hold them (Qwen3's gate_proj / up_proj / down_proj, Mixtral's w1 / w3 / w2);
- ``compute_pairs``: the SwiGLU of each (token, expert) pair routed to the CPU, one expert at a time (its
  tokens gathered, two matrix products);
- ``cpu_expert_ms`` / ``measure_cpu_experts``: the rate, ms for one expert at T tokens, measured over a pool of
  experts larger than the CPU's caches (each timing computes every pool expert once, as a step's misses come
  from DRAM), with the thread count set explicitly; ``cpu_experts_profile`` fits the profile's section;
- ``hybrid_experts_forward``: a routed layer's experts with some computed on the CPU: every pair's output on its
  side, then weighted and summed over the router's top-k in the router's order, as transformers'
  ``batched_mm_experts_forward`` sums them. The GPU side computes exactly what batched_mm computes, pair by
  pair, so where no expert is on the CPU the output is batched_mm's, bit for bit.

Numerics: the CPU's products are not bitwise the GPU's (another kernel, another summation order). The tolerance,
with the same experts in fp32 on both sides as the reference: the hybrid layer's output is within
FP32_TOLERANCE x max |reference output| of the all-resident layer's, elementwise; in bf16, within
BF16_TOLERANCE x the same. In bf16 the CPU rounds where the GPU rounds (``compute_pairs``: bf16 hidden states
round each expert's intermediates and output), so at most BF16_DIFFERING_SHARE of the output elements differ,
each within BF16_ROUNDING of itself.
"""

import contextlib
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.cpu_kernel import expert_swiglu, kernel_refusal, load_kernel
from runtime.experts_impl import batched_mm_forward

#: the host copy's dtypes, by the profile's name (planner.source.profile.CPU_EXPERT_DTYPES)
CPU_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: token counts calibrate measures one expert at: a decode step's tokens per expert, and a few prefill ones
CALIBRATION_TOKENS = (1, 2, 4, 8, 16, 32)
#: Qwen3-30B-A3B's expert (examples/qwen3-30b-a3b/config.json): hidden 2048, moe_intermediate 768, 9 MiB in bf16
CALIBRATION_SHAPE = (2048, 768)
#: the pool each timing cycles through: 24 Qwen3 experts are 216 MiB in bf16, past any host CPU's last-level
#: cache, so every expert's weights come from DRAM as a step's misses do
CALIBRATION_POOL_BYTES = 2**28
#: the most experts a pool holds: small experts fit the caches whatever their number, and each costs a Python
#: call per timing
MAX_POOL_EXPERTS = 64
NUM_REPEATS = 5
#: the tolerances the hybrid layer's output keeps to the all-resident layer's, as a share of the reference
#: output's largest magnitude (module docstring); tests/runtime/test_cpu_experts.py holds them
FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 2**-6
#: in bf16, where the CPU rounds as the GPU does (runtime.cpu_kernel's partial_sum): the share of a layer's output
#: elements that may differ from the all-resident layer's at all, and how far each may (one unit in bf16's last
#: place, relative to the element: fp32 sums taken in another order that round to the neighbouring bf16 value)
BF16_DIFFERING_SHARE = 0.01
BF16_ROUNDING = 2**-7


@dataclass(frozen=True, kw_only=True)
class ExpertShape:
    """A SwiGLU expert's shape: hidden size H and intermediate size I."""

    hidden_size: int
    intermediate_size: int

    @property
    def num_params(self) -> int:
        """Gate, up and down: 3 x H x I weights."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def flops_per_token(self) -> int:
        """Three matrix-vector products of H x I: 6 H I."""
        return 2 * self.num_params


class HostExperts:
    """One layer's experts in host memory, laid out for the CPU: gate_up [E, 2I, H], down [E, H, I]."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, dtype: str = "fp32", act_fn=F.silu):
        if dtype not in CPU_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(CPU_DTYPES)}, not {dtype!r}")
        num_experts, double_intermediate, hidden = gate_up.shape
        if down.shape != (num_experts, hidden, double_intermediate // 2) or double_intermediate % 2:
            raise ValueError(f"gate_up {list(gate_up.shape)} and down {list(down.shape)} are not one SwiGLU "
                             "expert set ([E, 2I, H] and [E, H, I])")
        torch_dtype = CPU_DTYPES[dtype]
        # [E, 2I, H], [E, H, I], each expert one block the CPU streams through: contiguous host weights already
        # in the dtype (the runtime's pinned experts) are read where they lie, no second host copy; others are
        # copied (an fp32 copy of bf16 weights doubles their host bytes, nbytes)
        self.gate_up = gate_up.detach().to("cpu", torch_dtype).contiguous()
        self.down = down.detach().to("cpu", torch_dtype).contiguous()
        self.dtype = dtype
        self.act_fn = act_fn
        # the kernel computes SiLU: asked of the function itself (transformers wraps it in its own module class)
        probe = torch.linspace(-8.0, 8.0, 33)
        self.silu = torch.allclose(act_fn(probe), F.silu(probe), rtol=1e-6, atol=1e-7)
        #: the C kernel that computes these experts (runtime.cpu_kernel), None where torch does (it could not be
        #: built here, or the activation is not SiLU); resolved here, at load: a first build inside a decode step's
        #: host node would stall the step
        self.kernel = load_kernel() if self.silu else None
        self.shape = ExpertShape(hidden_size=hidden, intermediate_size=double_intermediate // 2)

    @classmethod
    def from_module(cls, module: torch.nn.Module, dtype: str = "fp32") -> "HostExperts":
        """A transformers 5 experts module's fused params (gated, untransposed, no biases: Qwen3-MoE, Mixtral)."""
        unsupported = [name for name in ("has_bias", "is_transposed", "has_post_expert_norm")
                       if getattr(module, name, False)] + ([] if getattr(module, "has_gate", True) else ["no gate"])
        if unsupported or not getattr(module, "is_concatenated", True):
            raise ValueError(f"experts with {', '.join(unsupported) or 'interleaved gate/up'} are not computed on "
                             "the CPU (gated SwiGLU experts without biases only)")
        return cls(module.gate_up_proj, module.down_proj, dtype, module.act_fn)

    @classmethod
    def from_per_expert(cls, gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor],
                        dtype: str = "fp32") -> "HostExperts":
        """Per-expert tensors as checkpoints hold them: gate and up [I, H] (Mixtral's w1, w3), down [H, I] (w2)."""
        if not len(gate) == len(up) == len(down) or not gate:
            raise ValueError(f"{len(gate)} gate, {len(up)} up and {len(down)} down tensors: one of each per expert")
        fused = torch.stack([torch.cat([g, u], dim=0) for g, u in zip(gate, up)])  # [E, 2I, H]
        return cls(fused, torch.stack(down), dtype)

    @property
    def num_experts(self) -> int:
        """Experts held."""
        return self.gate_up.shape[0]

    @property
    def nbytes(self) -> int:
        """Host bytes of the copy (counted in host memory beside the pinned experts)."""
        return self.gate_up.nbytes + self.down.nbytes

    def expert(self, expert: int, hidden: torch.Tensor, round_bf16: bool = False,
               rows: int | None = None) -> torch.Tensor:
        """One expert's SwiGLU on ``hidden`` [T, H]: [T, H], in fp32 from the C kernel (its products accumulate in
        fp32 from the weights as they lie), else torch's in the copy's dtype. ``round_bf16``: the intermediates and
        the output rounded to bf16 where a GPU computing the expert in bf16 rounds them (expert_swiglu; torch's
        path computes in bf16 then, an fp32 copy of bf16 weights holding their values exactly). ``rows``: over its
        first ``rows`` intermediate rows only (gate and up rows, down's columns: a part of the expert whose other
        rows the GPU computes; None: all)."""
        kernel = self.kernel
        if kernel is not None:
            return expert_swiglu(kernel, self.gate_up[expert], self.down[expert], hidden, torch.get_num_threads(),
                                 round_bf16, rows)
        dtype = torch.bfloat16 if round_bf16 else CPU_DTYPES[self.dtype]
        intermediate = self.shape.intermediate_size
        rows = intermediate if rows is None else rows
        gate_up, down = self.gate_up[expert].to(dtype), self.down[expert].to(dtype)
        gate = F.linear(hidden.to(dtype), gate_up[:rows])  # [T, rows]
        up = F.linear(hidden.to(dtype), gate_up[intermediate:intermediate + rows])
        return F.linear(self.act_fn(gate) * up, down[:, :rows])  # [T, H]


def compute_pairs(experts: HostExperts, hidden: torch.Tensor, expert_ids: torch.Tensor,
                  part: tuple[int, int] | None = None) -> torch.Tensor:
    """The CPU's output for each (token, expert) pair: ``hidden`` [P, H] the pairs' tokens on the host,
    ``expert_ids`` [P] their experts; [P, H] unweighted, in fp32 (HostExperts.expert's values), rounded as the GPU
    rounds where ``hidden`` is bf16 (the model computes in bf16). One expert at a time, its pairs gathered, so each
    expert's weights are read once however many tokens it has. ``part``: (expert, rows), that expert over its first
    rows only."""
    out = torch.empty(hidden.shape, dtype=torch.float32)
    round_bf16 = hidden.dtype == torch.bfloat16
    for expert in torch.unique(expert_ids).tolist():
        pairs = (expert_ids == expert).nonzero().squeeze(1)
        rows = part[1] if part is not None and part[0] == expert else None
        out[pairs] = experts.expert(expert, hidden[pairs], round_bf16, rows).float()
    return out


@contextlib.contextmanager
def cpu_threads(num_threads: int):
    """torch's intra-op threads set to ``num_threads`` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---- the rate -----------------------------------------------------------------------------------------------------


def random_experts(shape: ExpertShape, num_experts: int, dtype: str, seed: int = 0) -> HostExperts:
    """``num_experts`` experts of ``shape`` with random weights, in ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    torch_dtype = CPU_DTYPES[dtype]
    gate_up = torch.randn(num_experts, 2 * shape.intermediate_size, shape.hidden_size, generator=generator,
                          dtype=torch_dtype)
    down = torch.randn(num_experts, shape.hidden_size, shape.intermediate_size, generator=generator,
                       dtype=torch_dtype)
    return _scaled_experts(gate_up, down, dtype)


def _scaled_experts(gate_up: torch.Tensor, down: torch.Tensor, dtype: str) -> HostExperts:
    """HostExperts of random weights scaled as a trained model's (1 / sqrt(fan-in)), so activations stay finite."""
    gate_up.mul_(gate_up.shape[-1] ** -0.5)
    down.mul_(down.shape[-1] ** -0.5)
    return HostExperts(gate_up, down, dtype)


def pool_size(shape: ExpertShape, dtype: str, pool_bytes: int = CALIBRATION_POOL_BYTES) -> int:
    """Experts of ``shape`` whose host copies fill ``pool_bytes`` (2 to MAX_POOL_EXPERTS)."""
    itemsize = torch.empty((), dtype=CPU_DTYPES[dtype]).element_size()
    return min(MAX_POOL_EXPERTS, max(2, pool_bytes // (shape.num_params * itemsize)))


def cpu_expert_ms(experts: HostExperts, num_tokens: int, num_threads: int, repeats: int = NUM_REPEATS) -> float:
    """ms for the CPU to compute one of ``experts`` for ``num_tokens`` tokens with ``num_threads`` threads: the
    median over ``repeats`` timings of every expert computed once (each from DRAM, the pool past the caches),
    divided by their number, after one untimed pass."""
    hidden = torch.randn(num_tokens, experts.shape.hidden_size, generator=torch.Generator().manual_seed(1),
                         dtype=CPU_DTYPES[experts.dtype])

    def run():
        for expert in range(experts.num_experts):
            experts.expert(expert, hidden)

    with cpu_threads(num_threads), torch.inference_mode():
        run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times) / experts.num_experts


def torch_expert_ms(shape: ExpertShape, dtype: str, num_threads: int, pool_bytes: int, repeats: int) -> float:
    """cpu_expert_ms at one token through torch's path (the C kernel set aside), for calibrate's note."""
    experts = random_experts(shape, pool_size(shape, dtype, pool_bytes), dtype)
    experts.kernel = None
    return cpu_expert_ms(experts, 1, num_threads, repeats)


#: of torch's intra-op threads (the host's cores), the share the CPU experts leave to the rest of the process, at
#: most CPU_THREADS_LEFT_MOST: the main thread launching the steps, the driver's threads and the doorbell's. On the
#: H200 host (16 cores) a Qwen3-30B-A3B-shaped model's host steps took 0.416 ms a pair with 16 threads and 0.302
#: with 12 (scripts/bench_hybrid.py, one sequence, 18 CPU pairs a step, 2026-11-28): with every core, the threads
#: of one OpenMP team wait for one the others displaced
CPU_THREADS_LEFT_SHARE = 0.25
CPU_THREADS_LEFT_MOST = 4


def default_cpu_threads() -> int:
    """The CPU experts' threads where none are asked for: torch's count less CPU_THREADS_LEFT_SHARE of it (at
    most CPU_THREADS_LEFT_MOST), at least 1."""
    cores = torch.get_num_threads()
    return max(1, cores - min(CPU_THREADS_LEFT_MOST, int(cores * CPU_THREADS_LEFT_SHARE)))


def measure_cpu_experts(shape: ExpertShape, *, dtypes=tuple(CPU_DTYPES), tokens=CALIBRATION_TOKENS,
                        num_threads: int | None = None, pool_bytes: int = CALIBRATION_POOL_BYTES,
                        repeats: int = NUM_REPEATS) -> dict:
    """Per dtype, ms for one expert of ``shape`` at each of ``tokens`` (``{"bf16": {1: 0.31, ...}}``), with
    ``num_threads`` threads (default_cpu_threads where None), and the thread count used. The first count is measured
    again after the others and the smaller kept: measured first, right after the pool was written, it read 0.292
    ms where 2 tokens took 0.156 (bf16, the H200 host, 2026-11-28), and it alone picks the dtype."""
    threads = num_threads or default_cpu_threads()
    table = {}
    for dtype in dtypes:
        experts = random_experts(shape, pool_size(shape, dtype, pool_bytes), dtype)
        table[dtype] = {count: cpu_expert_ms(experts, count, threads, repeats) for count in tokens}
        first = tokens[0]
        table[dtype][first] = min(table[dtype][first], cpu_expert_ms(experts, first, threads, repeats))
        del experts
    return {"threads": threads, "ms_per_expert_at_tokens": table}


def fitted_rates(shape: ExpertShape, table: dict[int, float], small_ms: float, small_shape: ExpertShape,
                 itemsize: int) -> dict[str, float]:
    """The profile's fitted rates from a measured ``table`` (tokens -> ms) of ``shape`` and ``small_ms``, a small
    expert's time at one token: at one token an expert costs overhead + its bytes / the read rate, so two sizes
    give both (the overhead clamped at 0, the bytes rate from the large expert where the two are too close to
    tell apart); each token past the table's last two counts costs 6 H I / the FLOP rate (their slope, or the
    last count's mean where noise made it flat)."""
    big_bytes, small_bytes = shape.num_params * itemsize, small_shape.num_params * itemsize
    one_ms = table[min(table)]
    bytes_per_s = 1e3 * (big_bytes - small_bytes) / (one_ms - small_ms) if one_ms > small_ms else 0.0
    overhead_ms = one_ms - 1e3 * big_bytes / bytes_per_s if bytes_per_s else 0.0
    if not bytes_per_s or overhead_ms < 0:
        overhead_ms, bytes_per_s = 0.0, 1e3 * big_bytes / one_ms
    counts = sorted(table)
    last, previous = counts[-1], counts[-2] if len(counts) > 1 else counts[-1]
    slope_ms = (table[last] - table[previous]) / (last - previous) if last > previous else 0.0
    if slope_ms <= 0:
        slope_ms = table[last] / last
    return {"weight_bytes_per_s": bytes_per_s, "flops_per_s": 1e3 * shape.flops_per_token / slope_ms,
            "overhead_us": 1e3 * overhead_ms}


def cpu_experts_profile(shape: ExpertShape = ExpertShape(hidden_size=CALIBRATION_SHAPE[0],
                                                          intermediate_size=CALIBRATION_SHAPE[1]),
                        *, num_threads: int | None = None, tokens=CALIBRATION_TOKENS,
                        pool_bytes: int = CALIBRATION_POOL_BYTES, repeats: int = NUM_REPEATS, stamp: str = ""):
    """The profile's cpu_experts section (planner.source.profile.CpuExperts): both dtypes measured at
    ``tokens``, the faster at one token kept (its table and fitted rates), the other's figures in the note; and
    the measurements ({dtype: {tokens: ms}}) for the report."""
    from planner.source.profile import CpuExperts

    measured = measure_cpu_experts(shape, tokens=tokens, num_threads=num_threads, pool_bytes=pool_bytes,
                                   repeats=repeats)
    threads, tables = measured["threads"], measured["ms_per_expert_at_tokens"]
    dtype = min(tables, key=lambda name: tables[name][min(tokens)])
    small = ExpertShape(hidden_size=max(1, shape.hidden_size // 4),
                        intermediate_size=max(1, shape.intermediate_size // 4))
    small_ms = cpu_expert_ms(random_experts(small, pool_size(small, dtype, pool_bytes), dtype), 1, threads, repeats)
    itemsize = torch.empty((), dtype=CPU_DTYPES[dtype]).element_size()
    rates = fitted_rates(shape, tables[dtype], small_ms, small, itemsize)
    others = "; ".join(f"{name}: " + ", ".join(f"{t}: {ms:.3f}" for t, ms in table.items())
                       for name, table in tables.items() if name != dtype)
    if load_kernel() is None:
        computed_by = f"torch (no C kernel: {kernel_refusal()})"
    else:  # torch's path beside it, in the same run: which is faster differs by host
        computed_by = "the C kernel (torch's path at 1 token: " + ", ".join(
            f"{name} {torch_expert_ms(shape, name, threads, pool_bytes, repeats):.3f} ms" for name in tables) + ")"
    note = (f"{shape.hidden_size}x{shape.intermediate_size} SwiGLU experts from DRAM, {threads} threads, "
            f"{dtype} host copy (fastest at {min(tokens)} token), computed by {computed_by}; "
            f"ms per expert for the other dtype {others}; "
            f"overhead from a {small.hidden_size}x{small.intermediate_size} expert at 1 token ({small_ms:.4f} ms)"
            + (f"; {stamp}" if stamp else ""))
    section = CpuExperts(threads=threads, dtype=dtype, hidden_size=shape.hidden_size,
                         intermediate_size=shape.intermediate_size,
                         ms_per_expert_at_tokens=tuple((t, round(ms, 5)) for t, ms in sorted(tables[dtype].items())),
                         weight_bytes_per_s=float(f"{rates['weight_bytes_per_s']:.4g}"),
                         flops_per_s=float(f"{rates['flops_per_s']:.4g}"),
                         overhead_us=round(rates["overhead_us"], 2), source="measured", note=note)
    return section, tables


# ---- the hybrid layer ---------------------------------------------------------------------------------------------


def gpu_pair_outputs(module: torch.nn.Module, hidden: torch.Tensor, expert_ids: torch.Tensor,
                     forward=None) -> torch.Tensor:
    """Each (token, expert) pair's unweighted output as transformers' experts function ``forward`` (default
    batched_mm; grouped_mm alike) computes it: ``hidden`` [T, H], ``expert_ids`` [T x k] in token-major order;
    [T x k, H] in the hidden states' dtype. The function itself computes it, each pair as its own token of top-1
    at weight 1: the same pairs, so the same products (grouped_mm's groups hold the same pairs in the same order),
    and a weight of 1 and a sum over one rank change no bit."""
    forward = forward or batched_mm_forward()
    num_pairs = expert_ids.numel()
    selected = hidden.repeat_interleave(num_pairs // hidden.shape[0], dim=0)  # [S, H]
    ones = torch.ones(num_pairs, 1, dtype=hidden.dtype, device=hidden.device)
    return forward(module, selected, expert_ids.reshape(num_pairs, 1), ones)


def gpu_partial_sum(module: torch.nn.Module, hidden: torch.Tensor, expert_ids: torch.Tensor,
                    top_k_weights: torch.Tensor, forward=None) -> torch.Tensor:
    """The experts function's output before its one rounding: each pair's output (gpu_pair_outputs) times its
    weight, summed over the k ranks in fp32 as transformers' functions sum them; [T, H] fp32. A layer with CPU
    experts adds the CPU's fp32 sum to it and rounds once (runtime.routed_experts), so no pair of the GPU's is
    rounded twice."""
    return weighted_sum(gpu_pair_outputs(module, hidden, expert_ids, forward), top_k_weights)


def weighted_sum(pairs: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Each pair's output ``pairs`` [T x k, H] (token-major) times its weight, in the pairs' dtype as transformers'
    experts functions weight them, summed over each token's k ranks in fp32; [T, H] fp32, not yet rounded."""
    num_tokens, num_top_k = top_k_weights.shape
    weighted = pairs * top_k_weights.reshape(-1).unsqueeze(-1)  # [S, H]
    return weighted.view(num_tokens, num_top_k, -1).sum(dim=1, dtype=torch.float32)


def hybrid_experts_forward(module: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, *, host: HostExperts, on_cpu: torch.Tensor,
                           placeholder_expert: int = 0) -> torch.Tensor:
    """A routed layer's experts with those ``on_cpu`` marks ([E] bool) computed on the host CPU from ``host``,
    the rest on the module's device from its own params: ``hidden`` [T, H], ``top_k_index`` and
    ``top_k_weights`` [T, k] (the router's output); [T, H]. Eager: the host reads which pairs are its own.

    Order: the CPU's pairs' tokens copied to the host first, then the device's pairs computed (a CPU-assigned
    pair computes ``placeholder_expert``, a device expert, in its row: fixed shapes, its result overwritten),
    the CPU's pairs computed meanwhile on a CUDA device (its kernels queued before the host works), their
    outputs copied back into their rows, then every pair weighted and summed over the k ranks in the router's
    order, as batched_mm does."""
    num_top_k = top_k_index.shape[1]
    expert_ids = top_k_index.reshape(-1)  # [S], token-major as batched_mm's repeat_interleave
    cpu_pairs_device = on_cpu[expert_ids]  # [S] bool
    cpu_rows = cpu_pairs_device.nonzero().squeeze(1).cpu()  # host sync: eager only
    cpu_ids = expert_ids.cpu()[cpu_rows]
    cpu_hidden = hidden[cpu_rows.to(hidden.device) // num_top_k].cpu()  # [P, H], the CPU pairs' tokens
    device_ids = torch.where(cpu_pairs_device, torch.full_like(expert_ids, placeholder_expert), expert_ids)
    pairs = gpu_pair_outputs(module, hidden, device_ids)  # [S, H], queued on the device
    if cpu_rows.numel():
        cpu_out = compute_pairs(host, cpu_hidden, cpu_ids)  # [P, H] on the host, beside the device's work
        pairs.index_copy_(0, cpu_rows.to(pairs.device), cpu_out.to(pairs.device, pairs.dtype))
    return weighted_sum(pairs, top_k_weights).to(hidden.dtype)  # [T, H], rounded once
