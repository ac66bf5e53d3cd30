"""Which experts a decode step touches. A MoE layer of E experts with top-k routing, at a step of B tokens (one per
sequence at decode), touches expert e with probability 1 - (1 - p_e)^B, where p_e is the share of tokens routed to
e: k/E under uniform routing (so the expected distinct experts are E(1 - (1 - k/E)^B): 8 / 29 / 82 / 126 of
Qwen3-30B-A3B's 128 at B = 1 / 4 / 16 / 64), or count_e / num_tokens from a recorded routing trace
(planner.source.routing_trace). Tokens of one step route independently: the model's approximation, which a trace
with correlated routing (the same expert for a whole batch) makes pessimistic.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from planner.model.expert_prefetch import binomial_terms
from planner.model.experts import MoeGeometry
from planner.model.selection_bias import SelectionOptimism


@dataclass(frozen=True, kw_only=True)
class LayerRouting:
    """Per expert of one layer: the share of tokens routed to it (each token picks top_k, so they sum to top_k)."""

    index: int
    shares: tuple[float, ...]
    #: the tokens a trace counted the shares over; None: shares known exactly (uniform routing)
    num_counted_tokens: int | None = None

    def touched(self, num_tokens: int) -> tuple[float, ...]:
        """Per expert, the chance a step of ``num_tokens`` independently routed tokens touches it."""
        return tuple(1 - (1 - min(p, 1.0)) ** num_tokens for p in self.shares)

    def expected_distinct(self, num_tokens: int) -> float:
        """Expected distinct experts a step of ``num_tokens`` tokens touches."""
        return math.fsum(self.touched(num_tokens))

    def hottest(self, num_resident: int) -> tuple[int, ...]:
        """The ``num_resident`` experts most tokens route to (ties: the lower id), ascending."""
        order = sorted(range(len(self.shares)), key=lambda e: (-self.shares[e], e))
        return tuple(sorted(order[:num_resident]))

    def hit_rate(self, resident: tuple[int, ...]) -> float:
        """Share of routed (token, expert) pairs that resident experts serve."""
        total = math.fsum(self.shares)
        return math.fsum(self.shares[e] for e in resident) / total if total else 0.0

    def expected_fetched(self, resident: tuple[int, ...], num_tokens: int) -> float:
        """Expected distinct experts a step touches that are not resident (each crosses the link once)."""
        kept = set(resident)
        return math.fsum(p for e, p in enumerate(self.touched(num_tokens)) if e not in kept)

    def out_of_sample(self, resident: tuple[int, ...], num_tokens: int) -> tuple[float, float]:
        """(hit rate, expected fetched experts) of the ``resident`` experts chosen as the hottest by these
        shares, on steps of ``num_tokens`` tokens the trace did not see: the counted figures less the optimism of
        choosing by the same counts (planner.model.selection_bias). Exact shares (uniform routing) need none."""
        hit, fetched = self.hit_rate(resident), self.expected_fetched(resident, num_tokens)
        if self.num_counted_tokens is None:
            return hit, fetched
        optimism = self._optimism
        hit -= optimism.hit_rate_gap(len(resident), num_tokens)
        fetched -= optimism.fetched_gap(len(resident), num_tokens)
        # a step fetches each non-resident expert at most once, however optimistic the counts were
        return min(1.0, max(0.0, hit)), min(float(len(self.shares) - len(resident)), max(0.0, fetched))

    @functools.cached_property
    def _optimism(self) -> SelectionOptimism:
        counts = tuple(round(share * self.num_counted_tokens) for share in self.shares)
        return SelectionOptimism(counts=counts, num_tokens=self.num_counted_tokens)


def uniform_routing(geometry: MoeGeometry) -> tuple[LayerRouting, ...]:
    """Every expert equally likely: p_e = top_k / num_experts in every MoE layer."""
    share = geometry.top_k / geometry.num_experts
    return tuple(LayerRouting(index=layer.index, shares=(share,) * geometry.num_experts) for layer in geometry.layers)


def expected_distinct_uniform(num_experts: int, top_k: int, num_tokens: int) -> float:
    """E(1 - (1 - k/E)^B): expected distinct experts B uniformly routed tokens touch."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


@dataclass(frozen=True, kw_only=True)
class CpuDraw:
    """How one decode step's touched experts fall on a hybrid layer's CPU ids and on its fetched ids: the two
    counts its paths wait on. A layer waits for the later path at each step, so its expected wait is
    E[max(link, CPU)] over these counts, more than the later of the two paths' expectations (a step that sends
    more pairs than usual to the CPU, or to the link, waits for that path)."""

    #: the layer's expert ids computed on the CPU, and the non-resident others fetched over the link
    num_cpu_ids: int
    num_link_ids: int
    #: the step's expected touched experts among each
    mean_cpu_experts: float
    mean_link_experts: float
    #: one token routed uniformly to top_k distinct of num_experts: the counts are drawn together (multivariate
    #: hypergeometric, exact). 0: each id is touched independently at its mean (binomial counts; many tokens, or a
    #: trace's shares)
    one_token_top_k: int = 0
    num_experts: int = 0

    def __post_init__(self):
        if min(self.num_cpu_ids, self.num_link_ids, self.mean_cpu_experts, self.mean_link_experts) < 0 \
                or self.mean_cpu_experts > self.num_cpu_ids + 1e-9 or self.mean_link_experts > self.num_link_ids + 1e-9:
            raise ValueError(f"a hybrid layer's draw of {self.mean_cpu_experts:g} of {self.num_cpu_ids} CPU ids and "
                             f"{self.mean_link_experts:g} of {self.num_link_ids} fetched ids")
        if self.one_token_top_k and self.num_experts < max(self.num_cpu_ids + self.num_link_ids,
                                                             self.one_token_top_k):
            raise ValueError(f"a one-token draw of {self.one_token_top_k} of {self.num_experts} experts")


#: joint terms below this probability are left out of a hybrid layer's expected wait (each is under a second)
NEGLIGIBLE_JOINT_PMF = 1e-12


@functools.lru_cache(maxsize=4096)  # the search prices the same layers at each candidate split again and again
def touched_counts(draw: CpuDraw) -> tuple[tuple[int, int, float], ...]:
    """(CPU experts touched, fetched experts touched, probability) over one step's routing, as ``draw`` says."""
    if draw.one_token_top_k:
        return _one_token_counts(draw)
    cpu = binomial_pmf(draw.num_cpu_ids, draw.mean_cpu_experts)
    link = binomial_pmf(draw.num_link_ids, draw.mean_link_experts)
    return tuple((n_cpu, n_link, p_cpu * p_link) for n_cpu, p_cpu in cpu for n_link, p_link in link
                 if p_cpu * p_link >= NEGLIGIBLE_JOINT_PMF)


def _one_token_counts(draw: CpuDraw) -> tuple[tuple[int, int, float], ...]:
    """One token's top_k distinct experts of num_experts: P[a on the CPU, b fetched] =
    C(cpu, a) C(link, b) C(rest, k - a - b) / C(E, k)."""
    top_k, rest = draw.one_token_top_k, draw.num_experts - draw.num_cpu_ids - draw.num_link_ids
    total = math.comb(draw.num_experts, top_k)
    terms = []
    for n_cpu in range(min(top_k, draw.num_cpu_ids) + 1):
        for n_link in range(min(top_k - n_cpu, draw.num_link_ids) + 1):
            ways = (math.comb(draw.num_cpu_ids, n_cpu) * math.comb(draw.num_link_ids, n_link)
                    * math.comb(rest, top_k - n_cpu - n_link))
            if ways:
                terms.append((n_cpu, n_link, ways / total))
    return tuple(terms)


def binomial_pmf(trials: int, mean: float) -> list[tuple[int, float]]:
    """(count, probability) of Binomial(trials, mean / trials), the degenerate ends exact."""
    p = mean / trials if trials else 0.0
    if p <= 0.0:
        return [(0, 1.0)]
    if p >= 1.0:
        return [(trials, 1.0)]
    return binomial_terms(trials, p, 0)


@dataclass(frozen=True, kw_only=True)
class StepDraw:
    """How many of a routed layer's non-resident experts a decode step touches."""

    num_non_resident: int
    #: the step's expected touched non-resident experts
    mean_touched: float
    #: one token routed uniformly to top_k distinct of num_experts: drawn exactly (hypergeometric); 0: binomial
    one_token_top_k: int = 0
    num_experts: int = 0

    def __post_init__(self):
        if self.num_non_resident < 0 or not 0 <= self.mean_touched <= self.num_non_resident + 1e-9:
            raise ValueError(f"a step drawing {self.mean_touched:g} of {self.num_non_resident} non-resident experts")
        if self.one_token_top_k and self.num_experts < max(self.num_non_resident, self.one_token_top_k):
            raise ValueError(f"a one-token draw of {self.one_token_top_k} of {self.num_experts} experts")


@dataclass(frozen=True, kw_only=True)
class PerStepCpu:
    """What prices a per-step hybrid layer beside the timeline's fetch: its draw, one expert on the link, and j."""

    draw: StepDraw
    expert_ms: float
    #: j(m): the experts' worth a step with m misses sends to the CPU (m past the table: its last entry): whole
    #: experts, and where j(m) has a fraction f, the first f of one more expert's intermediate rows
    #: (planner.search.cpu_per_step)
    take: tuple[float, ...]
    #: of one CPU expert's time inside the step, the part a fraction of it still pays (None: whole experts only)
    fixed_ms: float | None = None
