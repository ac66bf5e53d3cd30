"""The third placement of a routed expert: computed on the host CPU, beside the ones fetched over the link.

A routed layer's decode step waits, after its router, for the touched experts that are not resident
(planner.model.experts). The host holds every expert already, and its CPU can compute some of them while the link
brings the others: the layer then waits for the later of two paths,

- the link: n_link experts fetched, n_link x f (f = expert bytes / the routed gather's rate);
- the CPU: the handoff h (the tokens' hidden states to the host, the CPU threads' wake-up, the results back) and
  n_cpu experts computed, h + n_cpu x c(t) (c(t): one expert for the t tokens routed to it, from the profile's
  measured table, ``cpu_expert_ms``), less the GPU's own work after the router that it overlaps (g: the resident
  and fetched experts' compute, already in the layer's compute time).

Both finish together where n_link x f = h - g + n_cpu x c, with n_link + n_cpu = n, the expected misses:
n_cpu = (n f - (h - g)) / (f + c), clamped to [0, n]. The layer then waits max(n_link f, h - g + n_cpu c, 0)
beyond its compute, against n f fetching alone; the split is taken only where it is faster, so it is never worse
than fetch-only. The split is in expectation: the runtime assigns a share n_cpu / n of the non-resident expert
ids to the CPU (any of them under uniform routing), and a step's integer counts scatter around it.

Run one after the other instead (the H100 host measured so with the host node in Python; CPU_PATH_OVERLAPS_LINK
says which holds), the layer waits for both,
n_link x f + h - g + n_cpu x c, which is linear in the split: the CPU takes every miss or none, whichever is
faster. The handoff h is the profile's (calibrate measures it: cpu_experts.handoff_us), else CPU_HANDOFF_MS.

The CPU is declined, and the reason said, where its time for one expert at the layer's tokens per expert is more
than CPU_WITHIN_LINK_FACTOR times the link's (a slower CPU would take too small a share to repay its handoff and
its threads), or where the profile holds no CPU figures. A prefill chunk decides by tokens per expert: its link
copies each non-resident expert whole, and the CPU's time grows with the tokens routed to an expert, so the CPU
takes experts only where few tokens reach each (``max_cpu_tokens_per_expert``: KTransformers' and llama.cpp's
hand-set prefill thresholds, computed from the measured rates).

Pure Python: the profile's figures in, a split out; planner.search.cpu_placement takes it into make's search.
"""

from collections.abc import Callable
from dataclasses import dataclass

from planner.model.expert_routing import CpuDraw, touched_counts
from planner.source.profile import CpuExperts

#: the CPU computes experts only where one expert at the layer's tokens per expert takes at most this many times
#: the link's time for it (issue 37's rule: beyond, the planner declines the CPU and says why). Issue 37 set 2x;
#: measured beyond it, a CPU still paid: on an H200 host whose CPU ran Qwen3-30B-A3B's experts 1.69x their price
#: (0.48 ms an expert, 2.5x the routed link's 0.19), the hybrid plan at one sequence stepped in 10.60 ms against
#: fetch-only's 12.83, 1.21x, with its tables set for a CPU 1.69x faster (benchmarks/2026-11-29-conformance-
#: rerun-h200.md); the split's own optimum takes no CPU expert where that is not faster
CPU_WITHIN_LINK_FACTOR = 3.0
#: a routed layer's handoff to the CPU and back where the profile has no measured figure (calibrate measures it:
#: cpu_experts.handoff_us): its tokens' hidden states to the host, the host's wake-up, the results back and the
#: join, with no pair to compute. On the H200 host calibrate's graph of such handoffs took 15.1 us each by the
#: doorbell and 54.7 us by a host node running the C body (runtime.calibrate.measure_handoff_ms, 2026-11-28);
#: the slower is taken where none was measured
CPU_HANDOFF_MS = 0.055
#: whether a layer's CPU path runs beside its link's fetches (the layer waits for the later) or after them (the
#: sum). Beside, since the host node runs in C and the miss gather leaves SMs to the handoff: on the H200 host the
#: smoke's hybrid steps (scripts/smoke_cpu_experts_graph.py, 2026-11-28) read within -3% to +18% of the later path
#: priced with the pairs as they ran there (below), where with the host node in Python on the H100 they had read
#: nearer the sum (benchmarks/2026-11-28-cpu-experts-graph-h100.md)
CPU_PATH_OVERLAPS_LINK = True
#: one (token, expert) pair computed inside the captured step: CPU_IN_STEP_FACTOR x calibrate's lone expert from
#: DRAM plus CPU_IN_STEP_EXTRA_MS. Inside a model's step the CPU's reads meet the link's in host memory (the
#: factor: 0.187 ms against 0.167 lone while the copy engine streamed), and the OpenMP team wakes for each expert
#: after the GPU's work between layers (the extra: 0.200 with a 0.35 ms gap after every two experts;
#: scripts/experiments/cpu_expert_contention.py). Fitted on the H200 host, 12 threads, 2026-11-28
#: (scripts/bench_hybrid.py --measure, benchmarks/2026-11-28-cpu-experts-grid-h200.md): a Qwen3-30B-A3B-shaped
#: pair took 0.283 ms (median of 5 runs) against 0.175 lone, a Mixtral-8x7B one 7.58 against 5.57; OLMoE's 0.344
#: measured, 0.350 by the fit. The 2.0x constant before priced Mixtral's CPU at 67.0 ms a step where it ran 47.6
CPU_IN_STEP_FACTOR = 1.35
CPU_IN_STEP_EXTRA_MS = 0.046
#: what a layer step that splits an expert by its rows waits beyond the later of its two paths (both paths then end
#: at the balance, where either's spread delays the step; the CPU reads down's first columns strided, row by row).
#: Measured on the H200 host, 12 threads, 2026-11-29 (scripts/bench_hybrid.py --measure, one sequence, 8-layer cuts;
#: benchmarks/2026-11-29-cpu-experts-rows-h200.md): priced without it, plans splitting experts by rows ran 0.963-
#: 1.002x of whole CPU experts for OLMoE and Qwen3-30B-A3B, where they priced 1.02-1.04x faster (0.05-0.08 ms a
#: split unaccounted), and 1.142x for Mixtral-8x7B. At this price make --cpu-experts rows splits Mixtral's experts (a
#: fraction saves whole ms there) and keeps the small ones whole
PART_EXTRA_MS = 0.08


def layer_wait_ms(link_ms: float, cpu_ms: float, overlapped: bool | None = None) -> float:
    """A routed layer's wait after its router for its link's ``link_ms`` and its CPU path's ``cpu_ms``: the later
    of the two where they run side by side, else both (``overlapped`` None: CPU_PATH_OVERLAPS_LINK)."""
    overlapped = CPU_PATH_OVERLAPS_LINK if overlapped is None else overlapped
    return max(link_ms, cpu_ms, 0.0) if overlapped else max(link_ms, 0.0) + max(cpu_ms, 0.0)


def expected_hybrid_wait_ms(draw: CpuDraw, link_ms_at: Callable[[int], float], handoff_ms: float,
                            cpu_ms_per_expert: float) -> float:
    """E[max(link, CPU)] over ``draw``: at each step's counts, the link's wait for its fetched experts
    (``link_ms_at(n)``, the timeline's wait for n experts) against the CPU's path, its handoff and its experts
    (``handoff_ms`` + n x ``cpu_ms_per_expert``; the handoff is paid at every step, as the captured step rings the
    host whatever the routing)."""
    link_ms = {}
    total = 0.0
    for n_cpu, n_link, p in touched_counts(draw):
        if n_link not in link_ms:
            link_ms[n_link] = link_ms_at(n_link)
        total += p * max(link_ms[n_link], handoff_ms + n_cpu * cpu_ms_per_expert, 0.0)
    return total


def resolved_handoff_ms(handoff_ms: float | None) -> float:
    """``handoff_ms``, or the measured CPU_HANDOFF_MS where None."""
    return CPU_HANDOFF_MS if handoff_ms is None else handoff_ms


def cpu_expert_ms(cpu: CpuExperts, expert_params: int, num_tokens: float) -> float:
    """ms for the CPU to compute one SwiGLU expert of ``expert_params`` weights (3 x H x I) for ``num_tokens``
    tokens inside the decode step: the profile's measured table read at ``num_tokens`` (linear between the
    measured counts, the first row below it; beyond the last, the fitted per-token FLOP rate adds each further
    token), scaled by the expert's size over the measured one's (a SwiGLU expert's bytes and FLOPs per token both
    scale with H x I), the fixed per-expert overhead kept; then as the step runs it (CPU_IN_STEP_FACTOR,
    CPU_IN_STEP_EXTRA_MS), times ``cpu.in_step_scale`` (make --cpu-time-scale: a host measured slower or faster
    than that price)."""
    if expert_params <= 0 or num_tokens < 0:
        raise ValueError(f"an expert of {expert_params} weights for {num_tokens} tokens")
    overhead_ms = cpu.overhead_us / 1e3
    measured_ms = _table_ms(cpu, num_tokens)
    alone_ms = overhead_ms + max(0.0, measured_ms - overhead_ms) * expert_params / cpu.num_params
    return cpu.in_step_scale * (CPU_IN_STEP_FACTOR * alone_ms + CPU_IN_STEP_EXTRA_MS)


def cpu_expert_fixed_ms(cpu: CpuExperts, cpu_ms_per_expert: float) -> float:
    """What a fraction of an expert's rows (planner.search.cpu_per_step) pays whole of ``cpu_ms_per_expert`` (one
    CPU expert's time inside the step, cpu_expert_ms): the profile's per-expert overhead as the step runs it; the
    rest in proportion to its rows. At most the whole expert's time."""
    return min(cpu_ms_per_expert,
               cpu.in_step_scale * (CPU_IN_STEP_FACTOR * cpu.overhead_us / 1e3 + CPU_IN_STEP_EXTRA_MS))


def _table_ms(cpu: CpuExperts, num_tokens: float) -> float:
    """The measured expert's ms at ``num_tokens``: the table, interpolated; beyond it, the FLOP rate's slope."""
    table = cpu.ms_per_expert_at_tokens
    if num_tokens <= table[0][0]:
        return table[0][1]
    for (low_tokens, low_ms), (high_tokens, high_ms) in zip(table, table[1:]):
        if num_tokens <= high_tokens:
            share = (num_tokens - low_tokens) / (high_tokens - low_tokens)
            return low_ms + share * (high_ms - low_ms)
    last_tokens, last_ms = table[-1]
    per_token_ms = 1e3 * 2 * cpu.num_params / cpu.flops_per_s
    return last_ms + (num_tokens - last_tokens) * per_token_ms


def link_expert_ms(expert_bytes: int, link_bytes_per_s: float) -> float:
    """ms for the link to bring one expert of ``expert_bytes``."""
    return 1e3 * expert_bytes / link_bytes_per_s


def tokens_per_touched_expert(num_tokens: int, share: float) -> float:
    """The tokens a step of ``num_tokens`` independently routed tokens sends to an expert that gets any, for an
    expert that takes ``share`` of the tokens (top_k / E under uniform routing): B p / (1 - (1 - p)^B)."""
    if num_tokens <= 0 or share <= 0:
        return 0.0
    touched = 1 - (1 - min(share, 1.0)) ** num_tokens
    return num_tokens * min(share, 1.0) / touched


@dataclass(frozen=True, kw_only=True)
class CpuSplit:
    """One routed layer's misses at one step, split between the link and the CPU."""

    #: expected touched, non-resident experts a step of the layer needs
    num_missed: float
    #: of them, expected computed on the CPU, and fetched over the link (num_missed together)
    cpu_experts: float
    link_experts: float
    #: the tokens the step routes to each of them (the CPU's time per expert is read at it)
    tokens_per_expert: float
    #: one expert's time on each path
    cpu_ms_per_expert: float
    link_ms_per_expert: float
    #: each path's time after the router: the link's fetches; the CPU's handoff and compute less the GPU work it
    #: overlaps (0 where the CPU takes nothing)
    link_ms: float
    cpu_ms: float
    #: the layer's wait beyond its compute: hybrid (the later path), and fetching every miss
    stall_ms: float
    fetch_only_stall_ms: float
    #: the layer's predicted time: its compute and its stall
    layer_ms: float
    #: why the CPU takes no expert (None: it takes cpu_experts)
    declined: str | None = None

    @property
    def cpu_share(self) -> float:
        """The share of the layer's non-resident experts to compute on the CPU (0 where nothing is missed)."""
        return self.cpu_experts / self.num_missed if self.num_missed else 0.0


def balanced_cpu_experts(num_missed: float, link_ms_per_expert: float, cpu_ms_per_expert: float,
                         cpu_fixed_ms: float) -> float:
    """The experts of ``num_missed`` to compute on the CPU so that the link's n_link x f and the CPU's
    fixed + n_cpu x c end together, clamped to [0, num_missed]."""
    balanced = (num_missed * link_ms_per_expert - cpu_fixed_ms) / (link_ms_per_expert + cpu_ms_per_expert)
    return min(num_missed, max(0.0, balanced))


def split_layer(*, num_missed: float, expert_bytes: int, expert_params: int, link_bytes_per_s: float,
                cpu: CpuExperts | None, tokens_per_expert: float, compute_ms: float, gpu_overlap_ms: float = 0.0,
                handoff_ms: float | None = None, overlapped: bool | None = None) -> CpuSplit:
    """One routed layer's ``num_missed`` expected misses split between the link (``link_bytes_per_s``: the routed
    gather's rate at decode, the copy engine's for a prefill chunk's whole copies) and the CPU (the profile's
    ``cpu``, None where not measured) so both finish together, each expert of ``expert_bytes`` on the link and
    ``expert_params`` weights on the CPU, ``tokens_per_expert`` tokens routed to each. ``compute_ms``: the
    layer's compute on the GPU, all experts resident; ``gpu_overlap_ms``: the part of it after the router that the
    CPU's work runs beside (the GPU's experts); ``handoff_ms``: the CPU path's fixed cost (None: CPU_HANDOFF_MS);
    ``overlapped``: the CPU path runs beside the link (None: CPU_PATH_OVERLAPS_LINK, as measured). The CPU is
    declined (its reason said) where it is not within CPU_WITHIN_LINK_FACTOR of the link per expert, and takes
    nothing where that is not faster than fetching every miss."""
    overlapped = CPU_PATH_OVERLAPS_LINK if overlapped is None else overlapped
    handoff_ms = resolved_handoff_ms(handoff_ms)
    if num_missed < 0 or expert_bytes <= 0 or link_bytes_per_s <= 0 or compute_ms < 0:
        raise ValueError("a layer's misses, expert bytes, link rate and compute must be positive")
    link_ms = link_expert_ms(expert_bytes, link_bytes_per_s)
    cpu_ms = 0.0 if cpu is None else cpu_expert_ms(cpu, expert_params, tokens_per_expert)
    fetch_only = num_missed * link_ms

    def split(cpu_experts: float, declined: str | None) -> CpuSplit:
        cpu_path = 0.0 if cpu_experts <= 0 else handoff_ms - gpu_overlap_ms + cpu_experts * cpu_ms
        link_path = (num_missed - cpu_experts) * link_ms
        stall = layer_wait_ms(link_path, cpu_path, overlapped)
        return CpuSplit(num_missed=num_missed, cpu_experts=cpu_experts, link_experts=num_missed - cpu_experts,
                        tokens_per_expert=tokens_per_expert, cpu_ms_per_expert=cpu_ms, link_ms_per_expert=link_ms,
                        link_ms=link_path, cpu_ms=cpu_path, stall_ms=stall, fetch_only_stall_ms=fetch_only,
                        layer_ms=compute_ms + stall, declined=declined)

    reason = _declined(cpu, num_missed, cpu_ms, link_ms, tokens_per_expert)
    if reason is not None:
        return split(0.0, reason)
    # side by side, the best split ends both paths together; one after the other, the step is linear in the CPU's
    # share, so the best is all or none
    taken = (balanced_cpu_experts(num_missed, link_ms, cpu_ms, handoff_ms - gpu_overlap_ms) if overlapped
             else num_missed)
    hybrid = split(taken, None)
    if hybrid.cpu_experts <= 0 or hybrid.stall_ms >= fetch_only:
        how = "beside the link" if overlapped else "after the link (serial)"
        return split(0.0, f"computing them on the CPU {how} takes {hybrid.cpu_ms:.3f} ms with its "
                          f"{handoff_ms:.3f} ms handoff and saves nothing: fetching {num_missed:.2f} experts takes "
                          f"{fetch_only:.3f} ms")
    return hybrid


def _declined(cpu: CpuExperts | None, num_missed: float, cpu_ms: float, link_ms: float,
              tokens_per_expert: float) -> str | None:
    """Why the CPU takes none of a layer's misses before any split is weighed (None: weigh it)."""
    if cpu is None:
        return "the profile has no cpu_experts figures (offload-plan calibrate measures them on the host)"
    if num_missed <= 0:
        return "the layer misses no expert: nothing to fetch or compute"
    if cpu_ms > CPU_WITHIN_LINK_FACTOR * link_ms:
        return (f"the CPU computes an expert for {tokens_per_expert:.3g} token(s) in {cpu_ms:.3f} ms, "
                f"{cpu_ms / link_ms:.2f}x the link's {link_ms:.3f} ms (more than {CPU_WITHIN_LINK_FACTOR:g}x): "
                "fetching only")
    return None


def decode_split(*, num_tokens: int, top_k: int, num_experts: int, num_missed: float, expert_bytes: int,
                 expert_params: int, routed_fetch_bytes_per_s: float, cpu: CpuExperts | None, compute_ms: float,
                 gpu_overlap_ms: float = 0.0, handoff_ms: float | None = None) -> CpuSplit:
    """A decode step of ``num_tokens`` sequences under uniform routing: each missed expert gets
    tokens_per_touched_expert tokens; the link is the routed gather (``routed_fetch_bytes_per_s``,
    planner.model.experts.routed_fetch_bytes_per_s). ``num_missed``: the routed model's expected touched,
    non-resident experts of the layer (RoutedLayer.expected_fetched_bytes / expert bytes)."""
    tokens = tokens_per_touched_expert(num_tokens, top_k / num_experts)
    return split_layer(num_missed=num_missed, expert_bytes=expert_bytes, expert_params=expert_params,
                       link_bytes_per_s=routed_fetch_bytes_per_s, cpu=cpu, tokens_per_expert=tokens,
                       compute_ms=compute_ms, gpu_overlap_ms=gpu_overlap_ms, handoff_ms=handoff_ms)


def prefill_split(*, num_tokens: int, top_k: int, num_experts: int, num_non_resident: int, expert_bytes: int,
                  expert_params: int, h2d_bytes_per_s: float, cpu: CpuExperts | None, compute_ms: float,
                  gpu_overlap_ms: float = 0.0, handoff_ms: float | None = None) -> CpuSplit:
    """A prefill chunk of ``num_tokens`` tokens: its link copies each of the ``num_non_resident`` experts whole
    over the copy engine (``h2d_bytes_per_s``), and each gets num_tokens x top_k / E tokens under uniform routing
    (an expert the chunk routes nothing to costs the CPU nothing; counted all the same: a chunk touches nearly
    every expert). The CPU takes experts only where so few tokens reach each that it is within
    CPU_WITHIN_LINK_FACTOR of the link (max_cpu_tokens_per_expert)."""
    tokens = num_tokens * top_k / num_experts
    return split_layer(num_missed=float(num_non_resident), expert_bytes=expert_bytes, expert_params=expert_params,
                       link_bytes_per_s=h2d_bytes_per_s, cpu=cpu, tokens_per_expert=tokens, compute_ms=compute_ms,
                       gpu_overlap_ms=gpu_overlap_ms, handoff_ms=handoff_ms)


def max_cpu_tokens_per_expert(cpu: CpuExperts, expert_params: int, link_ms_per_expert: float,
                              limit: int = 2**16) -> int:
    """The most tokens per expert at which the CPU's time for one expert stays within CPU_WITHIN_LINK_FACTOR of
    the link's ``link_ms_per_expert`` (0: not even one token): the prefill threshold, found by bisection (the
    CPU's time grows with tokens; ``limit`` bounds the search)."""
    bound = CPU_WITHIN_LINK_FACTOR * link_ms_per_expert

    def within(tokens: int) -> bool:
        return cpu_expert_ms(cpu, expert_params, tokens) <= bound

    if not within(1):
        return 0
    low, high = 1, limit
    if within(high):
        return high
    while high - low > 1:  # within(low), not within(high)
        middle = (low + high) // 2
        low, high = (middle, high) if within(middle) else (low, middle)
    return low

