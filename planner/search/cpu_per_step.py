"""A hybrid layer that splits each decode step's misses by the count the step drew, instead of by fixed CPU ids.

With fixed CPU ids (planner.search.cpu_placement) a step waits for whichever path its routing loaded: a token whose
experts all fall on the CPU's ids waits for the CPU while the link idles, and the other way round. The host holds
every expert (pinned in bf16, read in place, or an fp32 copy of every non-resident one where the host holds it), so
the CPU can compute any of a step's misses: a step that draws m misses (touched, not resident, not prefetched) sends
j(m) of them to the CPU and fetches the rest. The runtime (runtime.fetch_planning, ``cpu_take``) counts m on the GPU
after the router and takes the first j(m) misses in ascending id order, inside the captured step; the plan holds the
table j.

Priced per layer: n, the step's touched non-resident experts, is drawn as planner.model.expert_routing draws a
layer's touched experts (one token routed uniformly: hypergeometric, exact; otherwise binomial at the mean); the
prefetch brings each with the layer's hit share, so m | n is binomial; the link then waits for the prefetch's
part beyond the layer's compute and the m - j misses (planned_layer_stall_ms at that count), the CPU for its
handoff and j experts. j(m) is the count of least expected wait given m, and the layer waits
E over (n, m) of max(link, CPU) at j(m).

Fractional shares: a SwiGLU expert separates along its intermediate rows (y = sum over i of down[:, i] x
silu(gate[i] x) up[i] x), so the CPU can compute rows [0, r) of one more expert while the link brings rows [r, I)
and the GPU computes those (runtime.fetch_planning, runtime.uva_gather). With a measured fixed part a of the
CPU's per-expert time (``fixed_ms``: what a fraction still pays, the kernel's per-expert overhead), j(m) may then
be whole experts and a fraction f in steps of 1 / CPU_TAKE_QUANTUM: the CPU takes handoff + c (floor(j) + [f > 0]
(a + (1 - a) f)) and the link m - j experts' bytes, and a step with a fraction waits cpu_experts.PART_EXTRA_MS
beyond the later path (measured: what splitting costs besides its rows). One Mixtral-8x7B expert is about 7 ms on
either path, so at one sequence the balance falls far between whole counts and a fraction saves whole ms (1.142x
measured on the H200); one Qwen3-30B-A3B expert is 0.19 ms on the link, where a fraction saves less than it costs,
and make keeps such experts whole. Fractions are make --cpu-experts rows's (opt-in: one conformance shape's plan
decoded logits far off on the GPU, docs/limitations.md); auto takes whole experts.
"""

import functools
import math
from dataclasses import dataclass

from planner.model.expert_prefetch import planned_layer_stall_ms
from planner.model.expert_routing import PerStepCpu, StepDraw, binomial_pmf
from planner.plan.experts_section import CPU_TAKE_QUANTUM, fraction_of
from planner.search import cpu_experts

#: joint (touched, missed) terms below this probability are left out, and the table stops at the largest miss
#: count with more (a step's wait is under a second: what they carry is below 1e-9 ms; the runtime reads a
#: larger count at the table's last entry)
NEGLIGIBLE_STEP_PMF = 1e-9


@dataclass(frozen=True, kw_only=True)
class PerStepSplit:
    """One layer's per-step split: its table, expected wait and the expected experts on each path."""

    take: tuple[float, ...]
    wait_ms: float
    mean_cpu_experts: float
    #: touched non-resident experts not computed on the CPU: crossing the link, the prefetched ones included
    mean_link_experts: float
    #: where the table holds a fraction: the part of a CPU expert's time a fraction pays (None: whole experts)
    fixed_ms: float | None = None


def touched_pmf(draw: StepDraw) -> tuple[tuple[int, float], ...]:
    """(touched non-resident experts n, probability) of one step."""
    count = draw.num_non_resident
    if draw.one_token_top_k:
        top_k, total = draw.one_token_top_k, math.comb(draw.num_experts, draw.one_token_top_k)
        rest = draw.num_experts - count
        return tuple((n, math.comb(count, n) * math.comb(rest, top_k - n) / total)
                     for n in range(min(top_k, count) + 1) if math.comb(rest, top_k - n))
    return tuple(binomial_pmf(count, draw.mean_touched))


@functools.lru_cache(maxsize=1024)  # make prices the same layers at each candidate and step size
def joint_pmf(draw: StepDraw, hit_share: float | None) -> tuple[tuple[int, int, float], ...]:
    """(touched n, missed m, probability): each touched expert prefetched with ``hit_share`` (None: nothing is,
    every touched expert misses)."""
    terms = []
    for n, p_n in touched_pmf(draw):
        misses = ((n, 1.0),) if hit_share is None else binomial_pmf(n, n * (1.0 - hit_share))
        terms += [(n, m, p_n * p_m) for m, p_m in misses if p_n * p_m >= NEGLIGIBLE_STEP_PMF]
    return tuple(terms)


@dataclass(frozen=True, kw_only=True)
class LinkWait:
    """The link's wait of a per-step layer at (n touched, r fetched after the router): the timeline's
    planned_layer_stall_ms at that count."""

    compute_ms: float
    expert_ms: float
    hit_share: float | None
    ahead_share: float
    predicted: bool

    @property
    def prefetched_share(self) -> float | None:
        """The share of touched experts a prefetch brings (None: nothing predicts the layer, every one misses)."""
        return self.hit_share if self.predicted else None

    def at(self, touched: int, fetched_after: int) -> float:
        if self.prefetched_share is None:
            return fetched_after * self.expert_ms
        # the prefetch brings n - m of the n touched: accuracy (n - m) / n, the misses' r after the router
        accuracy = 1.0 - fetched_after / touched if touched else self.hit_share
        return planned_layer_stall_ms(self.compute_ms, touched * self.expert_ms, accuracy, predicted=True,
                                      ahead_share=self.ahead_share)


def _cpu_ms(share: float, handoff_ms: float, cpu_ms_per_expert: float, fixed_ms: float | None = None) -> float:
    """The CPU path of a step sending it ``share`` experts' worth: whole experts at ``cpu_ms_per_expert``, a
    fraction f of one more at ``fixed_ms`` + f x the rest."""
    # the handoff is paid every step: the captured step rings the host whatever the routing
    part = fraction_of(share)
    part_ms = (fixed_ms or 0.0) + part * (cpu_ms_per_expert - (fixed_ms or 0.0)) if part else 0.0
    return handoff_ms + round(share - part) * cpu_ms_per_expert + part_ms


def _terms_by_miss(joint: tuple[tuple[int, int, float], ...]) -> dict[int, list[tuple[int, float]]]:
    by_miss: dict[int, list[tuple[int, float]]] = {}
    for n, m, p in joint:
        by_miss.setdefault(m, []).append((n, p))
    return by_miss


@functools.lru_cache(maxsize=1024)
def per_step_split(draw: StepDraw, link: LinkWait, handoff_ms: float, cpu_ms_per_expert: float,
                   fixed_ms: float | None = None) -> PerStepSplit:
    """The table j(m) of least expected wait at each miss count m, and the layer's E[max(link, CPU)] at it;
    ``fixed_ms``: the part of a CPU expert's time a fraction of it pays (None: whole experts only)."""
    by_miss = _terms_by_miss(joint_pmf(draw, link.prefetched_share))
    take: list[float] = []
    for m in range(max(by_miss) + 1):
        terms = by_miss.get(m, [])
        j = _best_take(m, terms, link, handoff_ms, cpu_ms_per_expert, fixed_ms) if terms else 0
        # never fewer than a smaller count took: the optimum rises with m, and the rarest counts' few terms (the
        # draw's tail, cut at NEGLIGIBLE_STEP_PMF) must not make the table's last entry, read past its end, drop
        take.append(min(max(j, take[-1] if take else 0), m))
    take = _trimmed(take)
    fractional = any(fraction_of(share) for share in take)
    per_step = PerStepCpu(draw=draw, expert_ms=link.expert_ms, take=take, fixed_ms=fixed_ms if fractional else None)
    steps = _steps(per_step, link)
    return PerStepSplit(take=per_step.take, wait_ms=expected_wait_ms(per_step, link, handoff_ms, cpu_ms_per_expert),
                        mean_cpu_experts=math.fsum(p * j for _, _, j, p in steps),
                        mean_link_experts=math.fsum(p * (n - j) for n, _, j, p in steps), fixed_ms=per_step.fixed_ms)


def expected_wait_ms(per_step: PerStepCpu, link: LinkWait, handoff_ms: float, cpu_ms_per_expert: float) -> float:
    """A per-step layer's E[max(link, CPU)] at its plan's table (``per_step.take``), over its step's draw (a step
    that splits an expert by its rows waits PART_EXTRA_MS more)."""
    return math.fsum(p * _wait_ms(link.at(n, m - j), _cpu_ms(j, handoff_ms, cpu_ms_per_expert, per_step.fixed_ms), j)
                     for n, m, j, p in _steps(per_step, link))


def _wait_ms(link_ms: float, cpu_ms: float, share: float) -> float:
    """A step's wait for the later of its two paths, and where ``share`` has a fraction (an expert split by its
    rows), cpu_experts.PART_EXTRA_MS more."""
    return max(link_ms, cpu_ms, 0.0) + (cpu_experts.PART_EXTRA_MS if fraction_of(share) else 0.0)


def _steps(per_step: PerStepCpu, link: LinkWait) -> list[tuple[int, int, float, float]]:
    """(touched n, missed m, sent to the CPU j(m), probability) over the layer's step draw."""
    return [(n, m, min(take_at(per_step.take, m), m), p)
            for n, m, p in joint_pmf(per_step.draw, link.prefetched_share)]


def take_at(take: tuple[float, ...], num_missed: int) -> float:
    """j(m) as the runtime reads it: the table's entry, its last past its end (0 for an empty table)."""
    return take[min(num_missed, len(take) - 1)] if take else 0


def _best_take(num_missed: int, terms: list[tuple[int, float]], link: LinkWait, handoff_ms: float,
               cpu_ms_per_expert: float, fixed_ms: float | None = None) -> float:
    """The j of least E[max(link, CPU)] over ``terms`` (n, P[n, m]) at ``num_missed`` misses. Whole counts: the
    wait is convex in j (a mean of maxima of a falling and a rising line), so walk from the paths' balance while a
    neighbour waits less; ties keep fewer CPU experts. With ``fixed_ms``, then every fraction (in steps of
    1 / CPU_TAKE_QUANTUM) within one expert of that count, where one waits less than it (ties keep the count)."""
    def wait(j: float) -> float:
        return round(math.fsum(p * _wait_ms(link.at(n, num_missed - j), _cpu_ms(j, handoff_ms, cpu_ms_per_expert,
                                                                                 fixed_ms), j)
                               for n, p in terms), 9)

    balance = (num_missed * link.expert_ms - handoff_ms) / (link.expert_ms + cpu_ms_per_expert)
    best = min(num_missed, max(0, round(balance)))
    for step in (-1, 1):
        while 0 <= best + step <= num_missed and wait(best + step) < wait(best):
            best += step
    if fixed_ms is None:
        return best
    fractions = [best + k / CPU_TAKE_QUANTUM for k in range(1 - CPU_TAKE_QUANTUM, CPU_TAKE_QUANTUM)
                 if k % CPU_TAKE_QUANTUM and 0 < best + k / CPU_TAKE_QUANTUM < num_missed]
    return min([best, *fractions], key=wait)


def _trimmed(take: list[float]) -> tuple[float, ...]:
    """The table without trailing entries equal to the one before (the runtime reads past the end as the last)."""
    end = len(take)
    while end > 1 and take[end - 1] == take[end - 2]:
        end -= 1
    return tuple(take[:end])
