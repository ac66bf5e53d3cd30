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
