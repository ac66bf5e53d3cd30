"""The optimism of choosing resident experts from a trace's counts, and the figures corrected for it.

A routing trace counts each expert's assignments over N tokens; the planner keeps the R experts with the most
counts resident and would price them at their counted share. Those counts are noisy, and choosing by them
picks the experts whose noise ran high, so the chosen set's counted share overstates what it serves on steps
the trace did not see (the winner's curse). On the H100 (scripts/bench_experts.py --skew-trace: 512 steps, 128
experts, 20% of them taking 80% of the assignments), the plan counted a hit rate of 0.877 where decode measured
0.835, and 0.98 fetched experts a layer where 1.33 crossed the link: the 17 cold experts each layer kept beside
the 26 hot ones were chosen by their noise.

The correction is a parametric bootstrap of that choice (Efron and Tibshirani, An Introduction to the
Bootstrap, 1993, ch. 17: the bootstrap estimate of optimism). The counts stand in for the truth; each draw
resamples every count as Poisson(count), chooses the top R of the draw as the planner chooses, and measures how
much better the draw's own counts rate that choice than the truth does. The mean gap over the draws is taken
off the counted figures. Draws are seeded by the layer's counts, so a plan regenerates byte for byte.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field

#: bootstrap draws per traced layer: the gap's standard error shrinks as 1 / sqrt(draws), and the planner
#: averages it over every routed layer (48 for Qwen3-30B-A3B)
OPTIMISM_DRAWS = 32
#: counts at or above this draw from the normal approximation to the Poisson (skewness 1 / sqrt(count) <= 0.18);
#: below it, by multiplying uniforms (Knuth), which takes about count + 1 uniforms
NORMAL_APPROXIMATION_COUNT = 30


@dataclass(frozen=True)
class SelectionOptimism:
    """One traced layer's counts and their bootstrap draws: the optimism of choosing its top R by the counts."""

    counts: tuple[int, ...]
    #: tokens the counts were taken over (a share is count / num_tokens)
    num_tokens: int
    #: per draw: (expert ids in descending drawn count, ties to the lower id; the drawn counts)
    draws: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = field(init=False, repr=False, compare=False)
    #: step tokens -> (hit-rate gap, fetched-experts gap) for every R from 0 to E
    _gaps: dict = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self):
        generator = random.Random(zlib.crc32(repr((self.num_tokens, self.counts)).encode()))
        draws = []
        for _ in range(OPTIMISM_DRAWS):
            drawn = tuple(poisson(generator, count) for count in self.counts)
            order = tuple(sorted(range(len(drawn)), key=lambda e: (-drawn[e], e)))
            draws.append((order, drawn))
        object.__setattr__(self, "draws", tuple(draws))

    def hit_rate_gap(self, num_resident: int, step_tokens: int) -> float:
        """Counted minus true hit rate of the top ``num_resident``, in expectation over the draws."""
        return self._gaps_for(step_tokens)[0][num_resident]

    def fetched_gap(self, num_resident: int, step_tokens: int) -> float:
        """Counted minus true expected fetched experts per step of ``step_tokens`` tokens (negative: the counts
        understate what crosses the link)."""
        return self._gaps_for(step_tokens)[1][num_resident]

    def _gaps_for(self, step_tokens: int) -> tuple[list[float], list[float]]:
        """Both gaps for every R at once (prefix and suffix sums over each draw's order), cached per step size."""
        if step_tokens not in self._gaps:
            num_experts = len(self.counts)
            hit = [0.0] * (num_experts + 1)
            fetched = [0.0] * (num_experts + 1)
            # the truth's side is the same in every draw: its total, and each expert's chance of being touched
            true_total = sum(self.counts)
            true_by_expert = [touched(count / self.num_tokens, step_tokens) for count in self.counts]
            true_all = math.fsum(true_by_expert)
            for order, drawn in self.draws:
                counted_total = sum(drawn)
                if not counted_total or not true_total:
                    continue
                counted_hit = true_hit = 0.0
                counted_touched = [touched(drawn[e] / self.num_tokens, step_tokens) for e in order]
                true_touched = [true_by_expert[e] for e in order]
                counted_left, true_left = math.fsum(counted_touched), true_all
                for rank in range(num_experts + 1):
                    hit[rank] += counted_hit / counted_total - true_hit / true_total
                    fetched[rank] += counted_left - true_left
                    if rank < num_experts:
                        expert = order[rank]
                        counted_hit += drawn[expert]
                        true_hit += self.counts[expert]
                        counted_left -= counted_touched[rank]
                        true_left -= true_touched[rank]
            self._gaps[step_tokens] = ([g / len(self.draws) for g in hit], [g / len(self.draws) for g in fetched])
        return self._gaps[step_tokens]


def touched(share: float, step_tokens: int) -> float:
    """The chance a step of ``step_tokens`` independently routed tokens touches an expert taking ``share``."""
    return 1 - (1 - min(share, 1.0)) ** step_tokens


def poisson(generator: random.Random, mean: float) -> int:
    """One Poisson(``mean``) draw: Knuth's product of uniforms for small means, else the rounded normal."""
    if mean <= 0:
        return 0
    if mean >= NORMAL_APPROXIMATION_COUNT:
        return max(0, round(generator.gauss(mean, math.sqrt(mean))))
    limit, product, count = math.exp(-mean), generator.random(), 0
    while product > limit:
        product *= generator.random()
        count += 1
    return count
