"""Routing traces: per MoE layer, how many (token, expert) assignments each expert took on the user's prompts.

Written by ``offload-plan trace`` (runtime.trace records it), read by ``make --routing-trace FILE``; the plan
names the file by the sha256 of its bytes, so ``check`` finds a changed trace. A small YAML file::

    schema_version: 1
    model_fingerprint: sha256:...   # planner.source.checkpoint's fingerprint of the model it was recorded on
    num_experts: 128
    top_k: 8
    num_tokens: 4096                # tokens routed per layer
    layers:
    - {index: 0, counts: [...]}     # one int per expert; each row sums to num_tokens x top_k
    - {index: 1, counts: [...], prefetch_hits: [...]}   # optional: one int per rank (below)
    - {index: 2, counts: [...], prefetch_hits: [...], expert_predicted: [[...], ...], expert_hits: [[...], ...]}

``prefetch_hits`` (optional, a layer that the previous MoE layer predicts): per rank r of the prediction (the
runtime's next-layer router on the previous MoE layer's router input, rank 1 its highest score), how many of the
num_tokens tokens the layer then routed to the expert predicted at rank r. The planner chooses its prefetch depth
from these accuracies (planner.model.expert_prefetch.prefetch_shares); traces without them leave it the default curve.

``expert_predicted`` and ``expert_hits`` (optional, together, on a layer with prefetch_hits): per expert a list
of one int per rank: how many tokens the prediction put at that rank on the expert, and how many of those the
layer then routed to it. Under skew the hot experts are resident, so a prefetch's worth is the cold experts'
accuracy, which differs from the all-expert per-rank figure; with these the planner prices each layer's prefetch
over its own non-resident experts (planner.model.expert_prefetch.ExpertPrediction). Each rank predicts one expert
per token (a rank's expert_predicted sum to num_tokens), a token's ranks name distinct experts (an expert's sum to
at most num_tokens), and each rank's expert_hits sum to its prefetch_hits.

A trace from another model (fingerprint), with other layers, or with impossible counts is one line of error.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

import yaml

from planner.errors import ModelInputError, printable, shown
from planner.model.expert_prefetch import ExpertPrediction
from planner.model.expert_routing import LayerRouting
from planner.model.experts import MoeGeometry
from planner.source.untrusted import load_yaml, read_capped

TRACE_SCHEMA_VERSION = 1
#: 100,000 layers of 2**12 experts' counts stay far below this
MAX_TRACE_BYTES = 64 * 2**20
#: counts are per token; more tokens than this is a typo or a corrupt file
MAX_TRACE_TOKENS = 2**40
#: a layer row's optional keys: per-rank, then per-expert prediction figures
_OPTIONAL_ROW_KEYS = ("prefetch_hits", "expert_predicted", "expert_hits")
_KEYS = ("schema_version", "model_fingerprint", "num_experts", "top_k", "num_tokens", "layers")


@dataclass(frozen=True, kw_only=True)
class RoutingTrace:
    """A validated trace (consistent in itself; ``check_against`` checks it against a model)."""

    model_fingerprint: str
    num_experts: int
    top_k: int
    num_tokens: int
    #: (layer index, counts per expert), layers ascending
    layers: tuple[tuple[int, tuple[int, ...]], ...]
    #: "sha256:<hex>" of the file's bytes (empty for a trace not read from a file)
    content_hash: str = ""
    #: (layer index, per rank the tokens whose prediction at that rank the layer routed to), for the layers
    #: predicted from the MoE layer before them; empty in traces recorded without prediction
    prefetch_hits: tuple[tuple[int, tuple[int, ...]], ...] = ()
    #: (layer index, per expert per rank the tokens predicted there, per expert per rank those routed to it), for
    #: layers with prefetch_hits; empty in traces recorded without per-expert figures
    expert_prediction: tuple[tuple[int, tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]], ...] = ()

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be from 1 to num_experts {self.num_experts}")
        if not 1 <= self.num_tokens <= MAX_TRACE_TOKENS:
            raise ValueError(f"num_tokens {self.num_tokens} must be from 1 to {MAX_TRACE_TOKENS}")
        indices = [index for index, _ in self.layers]
        if not indices or indices != sorted(set(indices)):
            raise ValueError("layers must be one or more rows with distinct indices, ascending")
        for index, counts in self.layers:
            _check_counts(index, counts, self.num_experts, self.top_k, self.num_tokens)
        for index, hits in self.prefetch_hits:
            if index not in indices or index == indices[0]:
                raise ValueError(f"layer {index} has prefetch_hits but no MoE layer before it in the trace predicts it")
            if len(hits) != self.top_k or any(not 0 <= h <= self.num_tokens for h in hits):
                raise ValueError(f"layer {index}'s prefetch_hits must be top_k ({self.top_k}) counts from 0 to "
                                 f"num_tokens ({self.num_tokens})")
        rank_hits, counts = dict(self.prefetch_hits), dict(self.layers)
        for index, predicted, hits in self.expert_prediction:
            if index not in rank_hits:
                raise ValueError(f"layer {index} has expert_predicted but no prefetch_hits")
            _check_expert_prediction(index, predicted, hits, counts[index], rank_hits[index], self.num_tokens)

    def expert_predictions(self) -> dict[int, ExpertPrediction]:
        """Per layer with per-expert figures, its ExpertPrediction (empty: none)."""
        counts = dict(self.layers)
        return {index: ExpertPrediction(counts=counts[index], hits=hits, predicted=predicted)
                for index, predicted, hits in self.expert_prediction}

    def rank_accuracy(self) -> tuple[float, ...] | None:
        """Per rank of the prediction, the share of predictions the layer then routed the token to, over every
        predicted layer; None when the trace has no prefetch_hits."""
        if not self.prefetch_hits:
            return None
        made = len(self.prefetch_hits) * self.num_tokens
        return tuple(sum(hits[rank] for _, hits in self.prefetch_hits) / made for rank in range(self.top_k))

    def routing(self) -> tuple[LayerRouting, ...]:
        """Per layer, each expert's share of tokens: count / num_tokens, counted over num_tokens (the plan prices
        the hottest on steps the trace did not see: LayerRouting.out_of_sample)."""
        return tuple(LayerRouting(index=index, shares=tuple(c / self.num_tokens for c in counts),
                                  num_counted_tokens=self.num_tokens)
                     for index, counts in self.layers)


def _check_counts(index: int, counts: tuple[int, ...], num_experts: int, top_k: int, num_tokens: int) -> None:
    if len(counts) != num_experts:
        raise ValueError(f"layer {index} has {len(counts)} counts for {num_experts} experts")
    if any(not 0 <= c <= num_tokens for c in counts):
        raise ValueError(f"layer {index} has a count outside 0..num_tokens ({num_tokens}): an expert takes a token "
                         "at most once")
    if sum(counts) != num_tokens * top_k:
        raise ValueError(f"layer {index}'s counts sum to {sum(counts)}, not num_tokens x top_k = {num_tokens * top_k}")


def _check_expert_prediction(index: int, predicted: tuple, hits: tuple, counts: tuple[int, ...],
                             rank_hits: tuple[int, ...], num_tokens: int) -> None:
    """One layer's per-expert figures: shapes, then counts no run can produce."""
    num_experts, top_k = len(counts), len(rank_hits)
    for name, rows in (("expert_predicted", predicted), ("expert_hits", hits)):
        if len(rows) != num_experts or any(len(row) != top_k for row in rows):
            raise ValueError(f"layer {index}'s {name} must be num_experts ({num_experts}) lists of top_k ({top_k}) "
                             "counts")
    for expert, (made, hit) in enumerate(zip(predicted, hits)):
        if any(h > m for h, m in zip(hit, made)):
            raise ValueError(f"layer {index}, expert {expert}: expert_hits exceed expert_predicted at a rank (a hit "
                             "is a prediction the layer routed)")
        if sum(hit) > counts[expert]:
            raise ValueError(f"layer {index}, expert {expert}: {sum(hit)} expert_hits, beyond its {counts[expert]} "
                             "routed tokens")
        if sum(made) > num_tokens:
            raise ValueError(f"layer {index}, expert {expert}: predicted {sum(made)} times, beyond num_tokens "
                             f"({num_tokens}): a token's ranks name distinct experts")
    for rank in range(top_k):
        if sum(row[rank] for row in predicted) != num_tokens:
            raise ValueError(f"layer {index}'s expert_predicted at rank {rank + 1} sum to "
                             f"{sum(row[rank] for row in predicted)}, not num_tokens ({num_tokens}): each rank "
                             "predicts one expert per token")
        if sum(row[rank] for row in hits) != rank_hits[rank]:
            raise ValueError(f"layer {index}'s expert_hits at rank {rank + 1} sum to {sum(row[rank] for row in hits)}"
                             f", not its prefetch_hits ({rank_hits[rank]})")


def read_trace(path: Path) -> RoutingTrace:
    """Load and validate a trace file; any problem is one ModelInputError line naming the file."""
    path = Path(path)
    raw = read_capped(path, MAX_TRACE_BYTES, ModelInputError, "routing trace")
    data = load_yaml(raw, str(path), ModelInputError, fix="record it again with offload-plan trace")
    return trace_from_dict(data, printable(path), content_hash=content_hash(raw))


def content_hash(raw: bytes) -> str:
    """sha256 of a trace file's bytes, as plans record it."""
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def trace_from_dict(data: object, origin: str, *, content_hash: str = "") -> RoutingTrace:
    """A RoutingTrace from parsed YAML; every problem one line."""
    fix = "record it again with offload-plan trace"
    if not isinstance(data, dict) or set(data) != set(_KEYS):
        found = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise ModelInputError(f"{origin}: not a routing trace (keys {found}, expected {list(_KEYS)}); {fix}")
    if data["schema_version"] != TRACE_SCHEMA_VERSION or type(data["schema_version"]) is not int:
        raise ModelInputError(f"{origin}: schema_version {shown(data['schema_version'])} is not "
                              f"{TRACE_SCHEMA_VERSION}; {fix}")
    for key in ("num_experts", "top_k", "num_tokens"):
        if not _whole(data[key]):
            raise ModelInputError(f"{origin}: {key} {shown(data[key])} is not a whole number; {fix}")
    if not isinstance(data["model_fingerprint"], str):
        raise ModelInputError(f"{origin}: model_fingerprint must be a string; {fix}")
    rows = data["layers"]
    if not isinstance(rows, list) or not all(_row(row) for row in rows):
        raise ModelInputError(f"{origin}: layers must be a list of {{index, counts}} rows of whole numbers (and an "
                              f"optional prefetch_hits list, expert_predicted and expert_hits lists of lists); {fix}")
    try:
        return RoutingTrace(model_fingerprint=data["model_fingerprint"], num_experts=data["num_experts"],
                            top_k=data["top_k"], num_tokens=data["num_tokens"],
                            layers=tuple((row["index"], tuple(row["counts"])) for row in rows),
                            content_hash=content_hash,
                            prefetch_hits=tuple((row["index"], tuple(row["prefetch_hits"])) for row in rows
                                                if "prefetch_hits" in row),
                            expert_prediction=tuple((row["index"], _nested(row["expert_predicted"]),
                                                     _nested(row["expert_hits"]))
                                                    for row in rows if "expert_predicted" in row))
    except ValueError as error:
        raise ModelInputError(f"{origin}: {error}; {fix}") from None


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TRACE_TOKENS


def _nested(rows: list) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(row) for row in rows)


def _row(row: object) -> bool:
    if not isinstance(row, dict) or set(row) - set(_OPTIONAL_ROW_KEYS) != {"index", "counts"}:
        return False
    if ("expert_predicted" in row) != ("expert_hits" in row) or not _whole(row["index"]):
        return False
    return (all(isinstance(row[key], list) and all(_whole(c) for c in row[key])
                for key in ("counts", "prefetch_hits") if key in row)
            and all(isinstance(row[key], list) and all(isinstance(r, list) and all(_whole(c) for c in r)
                                                       for r in row[key])
                    for key in ("expert_predicted", "expert_hits") if key in row))


def check_against(trace: RoutingTrace, geometry: MoeGeometry, fingerprint: str, origin: str) -> None:
    """The trace must come from this model: its fingerprint, expert count, top-k and MoE layers."""
    fix = "record a trace of this model with offload-plan trace --model ... --prompts ..."
    if trace.model_fingerprint != fingerprint:
        raise ModelInputError(f"{origin} was recorded on another model (fingerprint {trace.model_fingerprint[:19]}..., "
                              f"this one is {fingerprint[:19]}...); {fix}")
    if (trace.num_experts, trace.top_k) != (geometry.num_experts, geometry.top_k):
        raise ModelInputError(f"{origin} routes top-{trace.top_k} of {trace.num_experts} experts, the model top-"
                              f"{geometry.top_k} of {geometry.num_experts}; {fix}")
    traced = [index for index, _ in trace.layers]
    planned = [layer.index for layer in geometry.layers]
    if traced != planned:
        raise ModelInputError(f"{origin} has {len(traced)} MoE layers ({_span(traced)}), the model {len(planned)} "
                              f"({_span(planned)}); {fix}")


def _span(indices: list[int]) -> str:
    return f"{indices[0]}..{indices[-1]}" if indices else "none"


def _flow(rows: tuple[tuple[int, ...], ...]) -> str:
    """Lists of ints as one flow-style YAML line: [[1, 2], [3, 4]]."""
    return "[" + ", ".join("[" + ", ".join(map(str, row)) + "]" for row in rows) + "]"


def render_trace(trace: RoutingTrace, command: str) -> str:
    """The trace file's text: a header with the command that records it again, then the fields, one layer a
    line. Same trace, same bytes."""
    lines = [
        "# Routing trace written by offload-plan trace. Record it again with:",
        f"#   {command}",
        f"schema_version: {TRACE_SCHEMA_VERSION}",
        f"model_fingerprint: {trace.model_fingerprint}",
        f"num_experts: {trace.num_experts}",
        f"top_k: {trace.top_k}",
        f"num_tokens: {trace.num_tokens}",
        "layers:",
    ]
    hits = dict(trace.prefetch_hits)
    experts = {index: (predicted, expert_hits) for index, predicted, expert_hits in trace.expert_prediction}
    lines += [f"- {{index: {index}, counts: [{', '.join(map(str, counts))}]"
              + (f", prefetch_hits: [{', '.join(map(str, hits[index]))}]" if index in hits else "")
              + (f", expert_predicted: {_flow(experts[index][0])}, expert_hits: {_flow(experts[index][1])}"
                 if index in experts else "") + "}"
              for index, counts in trace.layers]
    text = "\n".join(lines) + "\n"
    assert yaml.safe_load(text)["num_tokens"] == trace.num_tokens  # the hand-written YAML parses as meant
    return text
