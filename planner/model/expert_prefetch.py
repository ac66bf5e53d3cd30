"""Next-layer prefetch of routed experts and what a routed layer waits for in a decode step.

The fetch of a routed layer waits for its router, so it is on the critical path: the layer takes its compute time
plus its fetch time. With next-layer prefetch the previous routed layer predicts this layer's experts (the next
layer's router on its router input: runtime.routed_experts) and their gather overlaps one layer's compute; only the
mispredicted ones are fetched after the router. A prediction ranks each token's k experts: prefetching the top m
ranks gathers m / k of the routed bytes ahead (``prefetch_shares``); a trace's per-expert figures give each layer its
own shares over its non-resident experts (``ExpertPrediction``). Pure arithmetic: the plan's reader
(planner.plan.schema) uses the same share rule as the planner.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass


#: the share of a decode step's routed, non-resident experts that next-layer prediction prefetches (the plan's
#: experts.prefetch next_layer_router: the next routed layer's router on this layer's router input). Measured
#: 0.777 on an H100 by scripts/bench_experts.py --prefetch on (Qwen3-30B-A3B shape, 24 GiB, one sequence,
#: uniform routing, random weights, 64 greedy steps; benchmarks/2026-11-25-prefetch-h100.md). Trained routers
#: differ by model: make --prefetch-accuracy overrides it, and the plan records the figure used
PREFETCH_ACCURACY = 0.78
#: the per-rank accuracy of that prediction (rank 1: the predicting router's highest score) measured on the H100 by
#: scripts/bench_experts.py --prefetch-depth (same shape and run as above, 64 steps x 47 predicted layers;
#: benchmarks/2026-11-25-prefetch-depth-h100.md): the planner's prefetch depth is chosen from this curve where no
#: trace measured one, resampled to the router's top-k and scaled to mean PREFETCH_ACCURACY
MEASURED_RANK_ACCURACY = (0.9641, 0.9388, 0.9076, 0.8620, 0.7832, 0.7028, 0.5864, 0.4817)
#: a predicting routed layer's own cost in a decode step, beyond its fetches: the next layer's predictor (that
#: router on this layer's router input), the fetch plans and the side stream's join. Measured on the H100 by
#: scripts/bench_experts.py --machinery, every expert resident so nothing crosses the link: 19.13 ms a step with
#: prefetch against 17.79 ms all-resident (17.64 routed without prefetch), 1.34 ms over 47 predicting layers
#: (Qwen3-30B-A3B shape, one sequence, serving's kernels; benchmarks/2026-11-26-routed-machinery-h100.json)
PREFETCH_MACHINERY_MS = 0.0285
#: how much slower a decode step's compute runs while a prefetch gather reads host memory beside it (its
#: programs share the SMs and the memory system): decode-sized bf16 products took 110.9 us alone and 125.4,
#: 128.2 and 132.1 us beside a gather of 1, 2 and 4 experts on the H100 (+13% to +19%;
#: scripts/experiments/gather_contention.py, benchmarks/2026-11-26-gather-contention-h100.json)
GATHER_COMPUTE_SLOWDOWN = 0.15


@dataclass(frozen=True, kw_only=True)
class ExpertPrediction:
    """One predicted layer's next-layer prediction, per expert and rank, from a routing trace: enough to price a
    prefetch for any resident set. Under skew the hot experts are resident and predicted well, so what a
    prefetch saves depends on the cold (non-resident) experts' predictions alone."""

    #: per expert, the tokens routed to it (the trace's counts)
    counts: tuple[int, ...]
    #: per expert, per rank: the tokens whose prediction at that rank was this expert and that the layer then
    #: routed to it
    hits: tuple[tuple[int, ...], ...]
    #: per expert, per rank: the tokens whose prediction at that rank was this expert
    predicted: tuple[tuple[int, ...], ...]

    def _cold(self, resident: tuple[int, ...]) -> list[int]:
        kept = set(resident)
        return [e for e in range(len(self.counts)) if e not in kept]

    def shares(self, resident: tuple[int, ...], depth: int) -> tuple[float, float]:
        """(hit share, ahead share) of a depth-``depth`` prefetch as shares of the non-resident experts' routed
        assignments (what prefetch_shares gives from a per-rank curve): the non-resident experts' hits at ranks
        1..depth, and their predictions there (hits and wasted: a resident expert predicted is not gathered).
        (0, 0) where no assignment routes to a non-resident expert: nothing to fetch."""
        cold = self._cold(resident)
        routed = sum(self.counts[e] for e in cold)
        if not routed:
            return 0.0, 0.0
        return (sum(sum(self.hits[e][:depth]) for e in cold) / routed,
                sum(sum(self.predicted[e][:depth]) for e in cold) / routed)

    def cold_rank_counts(self, resident: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """(per rank the non-resident experts' hits, per rank their predictions, their routed assignments)."""
        cold = self._cold(resident)
        top_k = len(self.hits[0]) if self.hits else 0
        return (tuple(sum(self.hits[e][rank] for e in cold) for rank in range(top_k)),
                tuple(sum(self.predicted[e][rank] for e in cold) for rank in range(top_k)),
                sum(self.counts[e] for e in cold))


def default_rank_accuracy(top_k: int, mean: float = PREFETCH_ACCURACY) -> tuple[float, ...]:
    """The default per-rank prediction accuracy for a top-``top_k`` router: MEASURED_RANK_ACCURACY read at each
    rank's relative position ((rank + 1/2) / k, linear between the measured ranks' positions), scaled so the
    ranks average ``mean``, clipped to [0, 1]; one rank: the mean."""
    if top_k == 1:
        return (mean,)
    measured = MEASURED_RANK_ACCURACY
    positions = [(rank + 0.5) / len(measured) for rank in range(len(measured))]

    def at(position: float) -> float:
        if position <= positions[0]:
            return measured[0]
        if position >= positions[-1]:
            return measured[-1]
        upper = next(i for i, p in enumerate(positions) if p >= position)
        share = (position - positions[upper - 1]) / (positions[upper] - positions[upper - 1])
        return measured[upper - 1] + share * (measured[upper] - measured[upper - 1])

    shape = [at((rank + 0.5) / top_k) for rank in range(top_k)]
    scale = mean * top_k / math.fsum(shape)
    return tuple(min(1.0, max(0.0, a * scale)) for a in shape)


def prefetch_shares(rank_accuracy: tuple[float, ...], depth: int) -> tuple[float, float]:
    """(hit share, ahead share) of prefetching the top ``depth`` ranks of each token's predicted k, as shares of
    the routed, non-resident experts a step fetches: the ranks' mean accuracy x depth / k of them were predicted
    right (hits), depth / k of them cross the link ahead (hits and wasted). A token's k routed experts are
    distinct, so at one sequence the shares are exact in expectation; with more, experts shared by tokens make
    them an approximation."""
    top_k = len(rank_accuracy)
    if not 0 <= depth <= top_k:
        raise ValueError(f"prefetch depth {depth} is not from 0 to top_k {top_k}")
    return math.fsum(rank_accuracy[:depth]) / top_k, depth / top_k


def layer_shares(row, hit: float | None, ahead: float) -> tuple[float | None, float]:
    """A routed layer's (hit, ahead) prefetch shares: its own where a trace's per-expert figures gave them
    (``row.prefetch_hit_share``, ``row.prefetch_ahead_share``: a RoutedLayer or a plan's experts.layers row), else
    the placement's ``hit`` and ``ahead`` (hit None: no prefetch, whatever the row holds)."""
    if hit is None or row.prefetch_hit_share is None:
        return hit, ahead
    return row.prefetch_hit_share, row.prefetch_ahead_share


def fetch_weighted_shares(rows, hit: float, ahead: float) -> tuple[float, float]:
    """(hit, ahead) of a step's predicted ``rows`` (every routed layer but the first) weighted by their expected
    fetched bytes, each row's own shares or ``hit`` and ``ahead`` (layer_shares); ``hit`` and ``ahead`` where the
    rows fetch nothing. One rule for the planner's placement and the plan read back."""
    weight = math.fsum(row.expected_fetched_bytes for row in rows)
    if not weight:
        return hit, ahead
    shares = [(layer_shares(row, hit, ahead), row.expected_fetched_bytes) for row in rows]
    return (math.fsum(row_hit * nbytes for (row_hit, _), nbytes in shares) / weight,
            math.fsum(row_ahead * nbytes for (_, row_ahead), nbytes in shares) / weight)


def prefetch_layer_stall_ms(compute_ms: float, fetch_ms: float, accuracy: float | None, predicted: bool,
                            ahead_share: float = 1.0, expert_ms: float | None = None,
                            num_slots: int | None = None, compute_slowdown: float = 0.0,
                            machinery_ms: float = 0.0) -> float:
    """What a routed layer waits for its experts in a decode step. Without a prediction (no prefetch, or the
    first routed layer: nothing before it predicts it), the whole fetch, after its router. With one, the
    previous routed layer's prefetch of the predicted experts (as many as the step routes to: ``fetch_ms`` of
    link, the hits and the wasted ones alike) overlaps one layer's compute (the rest of the previous layer, this
    layer's attention and router), then the misses, (1 - accuracy) of the fetch, after the router:
    max(0, fetch - compute) + (1 - accuracy) x fetch. The misses and the next layer's prefetch share the link
    (the runtime starts that prefetch as the layer's router finishes), so a link-bound step carries, per
    predicted layer, its routed bytes and the wasted ones back to back.

    With a prefetch depth m < k (``ahead_share`` = m / k of the fetch's bytes gathered ahead, ``accuracy`` the
    hits among them as a share of the fetch: prefetch_shares): max(0, ahead x fetch - compute) +
    (1 - accuracy) x fetch. A rank whose prediction rides in the compute's shadow only helps; beyond it, a link-
    bound step pays a rank's wasted bytes in full and gains nothing from its hits (they would have crossed after
    the router anyway), so the best depth fills one layer's compute with the most accurate ranks.

    ``expert_ms`` (one expert's fetch) and ``num_slots`` (the distinct experts a step can route a layer to,
    min(tokens x k, E)): the step's fetch is a whole number N of experts, not its mean. A batch-1 step fetches 0
    to 4 experts a layer where the mean is 1.3, and the part of the prefetch beyond one layer's compute is
    convex in N, so the step waits E[max(0, ahead x N x expert - compute)], over N ~ Binomial(num_slots,
    mean / num_slots), more than the same at the mean (without them: at the mean).

    ``compute_slowdown`` s: the compute the prefetch overlaps runs (1 + s) slower (GATHER_COMPUTE_SLOWDOWN), so a
    prefetch X shorter than the compute c costs s x X, and a longer one max(X - c, s x c): a link-bound layer
    hides the slower compute behind the link. ``machinery_ms``: the predicting layer's own cost
    (PREFETCH_MACHINERY_MS). Both 0 by default: the plan passes the measured figures (planned_layer_stall_ms)."""
    if accuracy is None or not predicted:
        return fetch_ms
    if expert_ms and num_slots:
        beyond = expected_excess_ms(ahead_share * expert_ms, compute_ms, fetch_ms / expert_ms, num_slots,
                                    compute_slowdown)
    else:
        beyond = _overlap_excess_ms(ahead_share * fetch_ms, compute_ms, compute_slowdown)
    return beyond + (1 - accuracy) * fetch_ms + machinery_ms


def planned_layer_stall_ms(compute_ms: float, fetch_ms: float, accuracy: float | None, predicted: bool,
                           ahead_share: float = 1.0, expert_ms: float | None = None,
                           num_slots: int | None = None) -> float:
    """prefetch_layer_stall_ms with a prefetch's measured costs beside its bytes: the compute it slows
    (GATHER_COMPUTE_SLOWDOWN) and its machinery (PREFETCH_MACHINERY_MS). What a plan, show and the benchmarks
    price."""
    return prefetch_layer_stall_ms(compute_ms, fetch_ms, accuracy, predicted, ahead_share, expert_ms, num_slots,
                                   GATHER_COMPUTE_SLOWDOWN, PREFETCH_MACHINERY_MS)


def _overlap_excess_ms(prefetch_ms: float, compute_ms: float, compute_slowdown: float) -> float:
    """What a layer adds to its compute when a prefetch of ``prefetch_ms`` overlaps it and slows it by
    ``compute_slowdown``: s x X under the compute, max(X - c, s x c) beyond it."""
    if prefetch_ms < compute_ms:
        return compute_slowdown * prefetch_ms
    return max(prefetch_ms - compute_ms, compute_slowdown * compute_ms)


@functools.lru_cache(maxsize=4096)  # a pure function the searches call with the same layers' figures again and again
def expected_excess_ms(ms_per_expert: float, compute_ms: float, mean_experts: float, num_slots: int,
                       compute_slowdown: float = 0.0) -> float:
    """E[excess(N x ms_per_expert)] for N ~ Binomial(num_slots, mean_experts / num_slots), excess the prefetch's
    part beyond its compute window (_overlap_excess_ms; without a slowdown, max(0, X - compute))."""
    if ms_per_expert <= 0.0 or mean_experts <= 0.0:
        return 0.0
    p = min(1.0, mean_experts / num_slots)
    if p >= 1.0:
        return _overlap_excess_ms(num_slots * ms_per_expert, compute_ms, compute_slowdown)
    # without a slowdown only the counts that outlast the window cost anything
    first = 1 if compute_slowdown else math.floor(compute_ms / ms_per_expert) + 1
    if first > num_slots:
        return 0.0
    return math.fsum(pmf * _overlap_excess_ms(count * ms_per_expert, compute_ms, compute_slowdown)
                     for count, pmf in binomial_terms(num_slots, p, first))


#: binomial terms smaller than this are left out: a step's excess is at most num_slots x one expert's fetch
#: (under a second), so what they carry is below 1e-12 ms
NEGLIGIBLE_PMF = 1e-16


def binomial_terms(trials: int, p: float, lowest: int) -> list[tuple[int, float]]:
    """(count, P[N = count]) for N ~ Binomial(trials, p), counts from ``lowest`` up, those whose probability is
    not negligible: the mode's from its logarithm, its neighbours by the ratio of consecutive terms (no
    log-gamma per term, the planner's inner loop at large batches), out to where the terms vanish."""
    log_q = math.log1p(-p)
    mode = min(trials, max(lowest, math.floor((trials + 1) * p)))
    mode_pmf = math.exp(math.lgamma(trials + 1) - math.lgamma(mode + 1) - math.lgamma(trials - mode + 1)
                        + mode * math.log(p) + (trials - mode) * log_q)
    odds = p / (1 - p)
    terms = [(mode, mode_pmf)]
    pmf = mode_pmf
    for count in range(mode, trials):  # up: P[k + 1] = P[k] (n - k) / (k + 1) x p / q
        pmf *= (trials - count) / (count + 1) * odds
        if pmf < NEGLIGIBLE_PMF:
            break
        terms.append((count + 1, pmf))
    pmf = mode_pmf
    for count in range(mode, lowest, -1):  # down: P[k - 1] = P[k] k / (n - k + 1) x q / p
        pmf *= count / (trials - count + 1) / odds
        if pmf < NEGLIGIBLE_PMF:
            break
        terms.append((count - 1, pmf))
    return terms
