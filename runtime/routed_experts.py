"""Expert-granular offloading: only the routed experts that are not resident cross the link, inside the step.

For each routed layer (a plan's ``experts`` section, regime "routed"), the fused expert params under
``<layer>.mlp.experts`` (transformers 5: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], biases where
present) live in one page-locked host allocation that the GPU reads at the same address (UVA). The layer's
resident experts are copied once into a GPU buffer. The experts module's forward is replaced by one that,
with no host synchronisation (so a CUDA graph captures it with the rest of the step):

1. finds the distinct experts the step routes to (sort, first occurrences, cumsum: fixed shapes);
2. gathers each distinct non-resident one ONCE from host memory into the shared fetch buffer (a Triton
   kernel whose programs for unused slots return at once, so only the routed, non-resident bytes cross);
3. computes with transformers' own ``batched_mm_experts_forward`` over a proxy whose weights are the device
   buffer (fetch slots, then every layer's resident experts) and whose routing is the (token, expert) pair ->
   buffer row map. batched_mm gathers each pair's weights, so the values it multiplies, and the products, are
   those of the all-resident model computed with batched_mm: the logits are bitwise equal.

Prefill chunks (more pairs than fetch slots) copy the layer's experts into one shared staging buffer of all E
experts (one copy-engine copy from the host, which holds all E: the resident ones too) and run the experts
implementation the model is configured with (prefill_experts_forward) over it.

One device buffer [fetch_slots + sum of resident counts, ...] per expert param holds the fetch slots and every
layer's resident experts, so one index tensor addresses both without copying resident experts per step.

Next-layer prefetch (``prefetch=True``; a plan's ``experts.prefetch: next_layer_router``): the fetch of step 2
waits for the layer's router, so without prediction the link and the compute take turns. At routed layer i's
experts the step holds layer i's router input, the residual stream normed by layer i's post-attention RMSNorm.
Rescaled by (norm_j.weight / norm_i.weight) it is what layer j's norm gives for the same residual (exact for
RMSNorm: weight x normalized), so layer j's own router module (the next routed layer's, called as its MoE block
calls it: same softmax / top-k / grouping rule) predicts layer j's experts from it. The predicted, non-resident
ones are gathered on a side stream into layer j's slot set while layer i gathers its misses and computes, and
layer j's attention runs; at layer j the step joins that stream, routes for real, and gathers on the main stream
only the misses (routed, not resident, not prefetched) into the slots the mispredicted (wasted) or unused ones
free. Slots are
double-buffered by the parity of the routed layer's ordinal (layer i still reads its set while j's is written),
so the buffer holds 2 x fetch_slots slot rows. The side stream's gather runs a bounded grid
(PREFETCH_GATHER_PROGRAMS persistent programs) so it leaves the SMs to the compute it overlaps. Everything stays
inside the captured step (fork and join through stream waits: legal under CUDA-graph capture); the values the
experts multiply are still the all-resident ones, so the logits stay bitwise equal. The first routed layer (no
previous one) and layers whose router cannot be called so fetch after their router, as without prefetch.
"""

import copy
import math
import types
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from planner.errors import PlanError, RuntimeUnavailableError
from planner.model.placement import ALIGN_BYTES, align_up
from planner.plan.experts_section import NEXT_LAYER_ROUTER
from planner.units import format_bytes
from runtime.allocation import alloc_device_or_fail, host_allocation_or_fail
from runtime.engine import PackedParam, backend_unpin, view_as_param
from runtime.fetch_planning import fused_fetch_plan

#: 32-bit words each Triton program copies (4 warps: 32 words, eight 16-byte loads, per thread)
GATHER_BLOCK_WORDS = 4096
#: warps per program of the gather (Triton's default; scripts/bench_experts.py --gather-shapes sweeps both)
GATHER_NUM_WARPS = 4
#: persistent programs of the side stream's prefetch gather: few enough to leave the SMs to the compute the
#: prefetch overlaps, enough to keep the link busy. On an H100 (scripts/bench_experts.py --gather-programs) 16,
#: 32, 64 and 128 programs gathered at 0.992, 0.995, 0.986 and 0.986 of the full grid's rate (47.3 GB/s); the
#: main stream's miss gather keeps the full grid
PREFETCH_GATHER_PROGRAMS = 32
#: fetch_counts entries: prefetched and routed; prefetched, not routed; routed, not resident, not prefetched
#: (fetched after the router of a predicted layer); fetched after the router of a layer nothing predicted
FETCH_KINDS = ("prefetched", "wasted", "missed", "unpredicted")


def experts_module(layer: nn.Module, index: int) -> nn.Module:
    """The fused experts module of a layer (``mlp.experts``), or a one-line error."""
    try:
        module = layer.get_submodule("mlp.experts")
    except AttributeError:
        module = None
    if module is None or not hasattr(module, "num_experts") or not _expert_params(module):
        raise PlanError(f"layer {index} has no fused routed experts at mlp.experts (transformers 5 MoE block): "
                        "this architecture's experts cannot be route-fetched; plan the layer whole_layer")
    return module


def _expert_params(module: nn.Module) -> list[str]:
    """Names of the module's own params that hold one row per expert, sorted."""
    num_experts = getattr(module, "num_experts", None)
    return sorted(name for name, p in module.named_parameters(recurse=False)
                  if p.dim() >= 1 and p.shape[0] == num_experts)


@dataclass(frozen=True, kw_only=True)
class RouteTables:
    """Per routed layer, on the device: where each expert's weights sit in the device buffer."""

    #: [E] int64: the expert's row among the resident rows of the device buffer, or -1 if not resident
    resident_row: torch.Tensor


class RoutedExperts:
    """Owns the host allocation (page-locked, mapped), the device buffer (fetch slots + resident experts), the
    staging buffer for prefill and the fetch counter of every routed layer of one model."""

    def __init__(self, *, modules: dict[int, nn.Module], resident: dict[int, tuple[int, ...]], fetch_slots: int,
                 backend, adopt_host: bool = False, decoder_layers: dict[int, nn.Module] | None = None,
                 prefetch: bool = False, prefetch_programs: int = PREFETCH_GATHER_PROGRAMS,
                 prefetch_depth: "int | dict[int, int] | None" = None):
        """Allocate (nothing read, nothing pinned yet): ``modules``: layer index -> its experts module (its
        params may be on the meta device: only their shapes are read here); ``resident``: layer index -> expert
        ids kept on the GPU; ``fetch_slots``: distinct experts one decode step can fetch (the plan's
        experts.fetch_slots); ``adopt_host``: page-lock the params' own host tensors in place (they must be
        contiguous CPU tensors, each its storage) rather than copy them into one allocation: a benchmark whose
        model already sits in host memory holds no second copy. ``start`` then takes the weights and routes
        the layers. ``prefetch``: predict and prefetch each next routed layer's experts (module docstring); it
        needs ``decoder_layers`` (layer index -> decoder layer: its post-attention norm and its router);
        ``prefetch_programs``: the side stream gather's persistent programs; ``prefetch_depth``: how many of
        each predicted token's top-k ranks are prefetched (``set_prefetch_depth``; None: all k)."""
        if prefetch and decoder_layers is None:
            raise PlanError("next-layer prefetch needs the decoder layers (their norms and routers); pass them")
        if prefetch_programs < 1:
            raise PlanError(f"prefetch_programs must be at least 1, got {prefetch_programs}")
        self.backend, self.device = backend, backend.device
        self.modules = dict(modules)
        self.layers = sorted(modules)
        self.fetch_slots = fetch_slots
        self.prefetch, self.prefetch_programs = prefetch, prefetch_programs
        self._depth_setting = prefetch_depth
        self.decoder_layers = dict(decoder_layers or {})
        #: slot rows at the head of the device buffer: two sets (by routed ordinal parity) when prefetching
        self.slot_rows = fetch_slots * (2 if prefetch else 1)
        #: routed layer index -> its position among the routed layers
        self.ordinal = {index: position for position, index in enumerate(self.layers)}
        first = modules[self.layers[0]]
        self.num_experts = first.num_experts
        self.param_names = _expert_params(first)
        #: param name -> (dtype, row shape): every routed layer must agree (one shared buffer)
        self.rows = {name: (getattr(first, name).dtype, tuple(getattr(first, name).shape[1:]))
                     for name in self.param_names}
        self._check(modules, resident, fetch_slots)
        self.resident = {index: tuple(sorted(resident.get(index, ()))) for index in self.layers}
        self.row_bytes = {name: math.prod(shape) * dtype.itemsize for name, (dtype, shape) in self.rows.items()}
        self.expert_bytes = sum(self.row_bytes.values())
        self._unpin = lambda: None
        self.adopt_host = adopt_host
        self._allocate()
        self._prediction_state()

    def _allocate(self) -> None:
        """The host allocation (unless adopting the params' own), the device rows, the prefill staging buffer and
        the fetch counter: nothing read, nothing pinned."""
        #: None when adopting the params' own host tensors
        self.host_allocation = None if self.adopt_host else self._allocate_host()
        #: (layer, param) -> where its [E, *row] tensor sits in host_allocation (the loader's destinations)
        self.host_items = {} if self.adopt_host else self._host_layout()
        num_rows = self.slot_rows + sum(len(r) for r in self.resident.values())
        #: param -> [slot rows + resident rows, *row] on the device: fetch slots first (one set, or two when
        #: prefetching), then each routed layer's resident experts in layer order
        self.buffer = {name: self._device_rows(name, num_rows) for name in self.param_names}
        #: param -> [E, *row] on the device: one routed layer's experts during a prefill chunk
        self.staging = {name: self._device_rows(name, self.num_experts) for name in self.param_names}
        #: [4] int64 on the device: distinct non-resident experts gathered by decode steps since reset, by kind
        #: (FETCH_KINDS)
        self.fetch_counts = torch.zeros(len(FETCH_KINDS), dtype=torch.int64, device=self.device)

    def _prediction_state(self) -> None:
        """The next-layer prediction's buffers, counters and knobs (filled by ``start``), and the host views."""
        #: [routed layers, fetch_slots] int64 on the device: the expert prefetched into each slot of the layer's
        #: set (-1: none), written by the previous routed layer's prediction
        self.prefetched = torch.full((len(self.layers), self.fetch_slots), -1, dtype=torch.int64, device=self.device)
        #: where the fused fetch plan of a prediction adds counts nobody reads
        self._prefetch_counts = torch.zeros(len(FETCH_KINDS), dtype=torch.int64, device=self.device)
        #: routed ordinal -> how to predict the next routed layer's routing (filled by start)
        self.predictors: dict[int, _Predictor] = {}
        #: the router's top-k as the predictors return it (0 until start finds a predictor)
        self.top_k = 0
        #: predicted routed layer index -> its prefetch depth m: the prediction's ranks 1..m are gathered ahead
        #: (0: predicted and counted, nothing gathered: the layer fetches after its router)
        self.prefetch_depth: dict[int, int] = {}
        #: [routed layers, 2, top_k] int64 on the device: per predicted layer and rank, the predictions that the
        #: layer then routed the same token to, and the predictions made (every rank, whatever the depth)
        self.rank_counts = torch.zeros((len(self.layers), 2, 0), dtype=torch.int64, device=self.device)
        #: [routed layers, fetch_slots, top_k] int64 on the device: each layer's prediction of this step, by token
        self.predicted_ids = torch.zeros((len(self.layers), 0, 0), dtype=torch.int64, device=self.device)
        #: routed layer index -> why nothing predicts it (its previous routed layer's norm or its router), for
        #: messages: a test or benchmark that expected prediction says why it is off
        self.prefetch_refusals: dict[int, str] = {}
        #: whether decode steps count the prediction's hits per rank (rank_counts): a few small kernels per
        #: predicted layer in the captured step; set before capturing, off where nobody reads the figures
        self.count_ranks = True
        #: (32-bit words a program copies at a time, warps a program) of every gather a decode step runs: a
        #: tuning knob that scripts/bench_experts.py sweeps; capture again after changing it
        self.gather_shape = (GATHER_BLOCK_WORDS, GATHER_NUM_WARPS)
        #: whether a layer starts the next layer's prefetch after its own misses' gather (the misses alone on
        #: the link first) rather than before it (both share the link); capture again after changing it
        self.prefetch_after_misses = False
        #: routed layers whose prefetch was started this step and not yet joined
        self._pending: set[int] = set()
        #: the side stream of the prefetches (CUDA only) and the router input it reads, copied on the main stream
        self.stream = None
        self._predict_input: torch.Tensor | None = None
        #: bytes copied into the staging buffer by prefill chunks (eager: counted on the host)
        self.staged_bytes = 0
        self.host: dict[tuple[int, str], torch.Tensor] = {}
        self.host_device: dict[tuple[int, str], torch.Tensor] = {}
        self.tables: dict[int, RouteTables] = {}

    def _check(self, modules, resident, fetch_slots: int) -> None:
        for index, module in modules.items():
            shapes = {name: (p.dtype, tuple(p.shape[1:])) for name, p in module.named_parameters(recurse=False)
                      if name in self.param_names}
            if module.num_experts != self.num_experts or shapes != self.rows:
                raise PlanError(f"routed layer {index}'s experts differ in count or shape from layer "
                                f"{self.layers[0]}'s; routed layers must share one expert shape")
            bad = [e for e in resident.get(index, ()) if not 0 <= e < self.num_experts]
            if bad or len(set(resident.get(index, ()))) != len(resident.get(index, ())):
                raise PlanError(f"routed layer {index}: resident experts must be distinct ids in [0, "
                                f"{self.num_experts}), got {sorted(resident.get(index, ()))}")
        if not 1 <= fetch_slots <= self.num_experts:
            raise PlanError(f"fetch_slots must be in [1, {self.num_experts}] (distinct experts one decode step "
                            f"fetches), got {fetch_slots}")

    def _allocate_host(self) -> torch.Tensor:
        """One host allocation for every routed layer's E experts per param, back to back (each param's rows
        on an aligned offset), on huge pages; its storage begins at its first byte: torch asks is_pinned about
        a storage's first byte, and prefill's copies from it are asynchronous only when pinned."""
        num_bytes = align_up(len(self.layers) * len(self.param_names) * ALIGN_BYTES + self.host_bytes)
        return host_allocation_or_fail(num_bytes, "the routed experts", "make a plan that routes fewer layers")

    def _host_layout(self) -> dict[tuple[int, str], PackedParam]:
        items, offset = {}, 0
        for index in self.layers:
            for name in self.param_names:
                dtype, shape = self.rows[name]
                num_bytes = self.num_experts * self.row_bytes[name]
                items[index, name] = PackedParam(name, offset, num_bytes, dtype, (self.num_experts, *shape))
                offset = align_up(offset + num_bytes)
        return items

    def _host_tensor(self, param: torch.Tensor, index: int, name: str) -> torch.Tensor:
        """Where layer ``index``'s param ``name`` lives on the host from now on: the param's own tensor when
        adopting, else its place in the host allocation (copied there unless the loader read it there)."""
        if self.adopt_host:
            if param.device.type != "cpu" or not param.is_contiguous() or param.storage_offset() != 0:
                raise PlanError(f"layer {index}'s {name} must be a contiguous CPU tensor of its own to be page-locked "
                                "in place; route the experts without adopt_host")
            return param
        host = view_as_param(self.host_allocation, self.host_items[index, name])
        if param.data_ptr() != host.data_ptr():
            host.copy_(param)
        return host

    def _device_rows(self, name: str, num_rows: int) -> torch.Tensor:
        dtype, shape = self.rows[name]
        raw = alloc_device_or_fail(self.backend, num_rows * self.row_bytes[name], f"routed experts ({name})",
                                   "make a plan with fewer resident experts")
        return raw.view(dtype).view(num_rows, *shape)

    def start(self) -> None:
        """Take the weights (copied from the modules' params unless the loader already read them into the host
        allocation), page-lock and map the host allocation, copy the resident experts to the device, and route
        the layers' forwards."""
        modules = self.modules
        for index in self.layers:
            for name in self.param_names:
                self.host[index, name] = self._host_tensor(getattr(modules[index], name).data, index, name)
        ranges = list(self.host.values()) if self.adopt_host else [self.host_allocation]
        pinned = []
        try:
            for tensor in ranges:
                self.backend.pin(tensor, mapped=True)
                pinned.append(tensor)
        finally:
            # unpinned before the memory can be freed, even if close is never called (as OffloadEngine does)
            self._unpin = weakref.finalize(self, backend_unpin, self.backend, pinned)
        self.host_device = {key: device_view(tensor, self.device) for key, tensor in self.host.items()}
        row = self.slot_rows
        for index in self.layers:
            ids = list(self.resident[index])
            resident_row = torch.full((self.num_experts,), -1, dtype=torch.int64)
            resident_row[ids] = torch.arange(row, row + len(ids))
            for name in self.param_names:
                self.buffer[name][row:row + len(ids)].copy_(self.host[index, name][ids])
            self.tables[index] = RouteTables(resident_row=resident_row.to(self.device))
            row += len(ids)
        if self.prefetch:
            self._start_prefetch()
        for index in self.layers:
            _route(modules[index], self, index)

    def _start_prefetch(self) -> None:
        """A predictor per routed layer whose next routed layer's router can be called on its router input;
        one warning naming the pairs that cannot (they fetch after their router)."""
        reasons = []
        for ordinal, (index, following) in enumerate(zip(self.layers, self.layers[1:])):
            predictor = next_layer_predictor(self.decoder_layers.get(index), self.decoder_layers.get(following),
                                             self.num_experts, self.device)
            if isinstance(predictor, str):
                reasons.append(f"layer {following} from layer {index}: {predictor}")
                self.prefetch_refusals[following] = predictor
            else:
                self.predictors[ordinal] = predictor
                self.top_k = predictor.top_k
        if reasons:
            warnings.warn(f"next-layer prefetch off for {len(reasons)} routed layer(s), which fetch after their "
                          f"router ({reasons[0]}{'; ...' if len(reasons) > 1 else ''})", stacklevel=3)
        if self.predictors:
            self.rank_counts = torch.zeros((len(self.layers), 2, self.top_k), dtype=torch.int64, device=self.device)
            self.predicted_ids = torch.full((len(self.layers), self.fetch_slots, self.top_k), -1, dtype=torch.int64,
                                            device=self.device)
        self.set_prefetch_depth(self._depth_setting)
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)

    def set_prefetch_depth(self, depth: "int | dict[int, int] | None") -> None:
        """Prefetch the top ``depth`` ranks of each predicted token's k (one int for every predicted layer, or
        predicted layer index -> its depth; None: all k). The depth fixes each step's shapes: a captured step
        keeps the depth it was captured with, so capture again after changing it."""
        predicted = [self.layers[ordinal + 1] for ordinal in sorted(self.predictors)]
        if not predicted:  # nothing predicted (warned at start): no depth to honour
            self.prefetch_depth = {}
            return
        per_layer = depth if isinstance(depth, dict) else {index: self.top_k if depth is None else depth
                                                           for index in predicted}
        for index, m in per_layer.items():
            if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= max(self.top_k, 0):
                raise PlanError(f"prefetch depth {m!r} for layer {index} is not a whole number from 0 to the "
                                f"router's top-k ({self.top_k}); give one in that range")
        unknown = sorted(set(per_layer) - set(predicted))
        if unknown:
            raise PlanError(f"prefetch depth given for layers {unknown}, which nothing predicts (predicted: "
                            f"{predicted}); give depths for predicted layers only")
        self.prefetch_depth = {index: per_layer.get(index, self.top_k) for index in predicted}

    # ---- accounting ----

    @property
    def host_bytes(self) -> int:
        """Host bytes of the experts: every routed layer's E experts (page-locked with alignment padding)."""
        return len(self.layers) * self.num_experts * self.expert_bytes

    @property
    def device_bytes(self) -> int:
        """GPU bytes: fetch slots and resident experts, and the staging buffer of E experts."""
        return sum(b.numel() * b.element_size() for b in (*self.buffer.values(), *self.staging.values()))

    def fetched_bytes(self) -> int:
        """Bytes decode steps gathered from host memory since the last reset, every kind (reads the device
        counter): with prefetch, wasted prefetches cross the link too."""
        return sum(self.fetched_bytes_by_kind().values())

    def fetched_bytes_by_kind(self) -> dict[str, int]:
        """FETCH_KINDS -> bytes gathered since the last reset (one read of the device counter)."""
        counts = self.fetch_counts.tolist()
        return {kind: count * self.expert_bytes for kind, count in zip(FETCH_KINDS, counts)}

    def rank_accuracy(self, index: int | None = None) -> tuple[float | None, ...]:
        """Per rank of the prediction (1 = the predicting router's highest score), the share of predictions the
        predicted layer then routed the same token to, since the last reset: one routed layer's (``index``), or
        every predicted layer's together; None for a rank nothing predicted (one read of the device counter)."""
        counts = self.rank_counts if index is None else self.rank_counts[self.ordinal[index]:self.ordinal[index] + 1]
        hits, made = counts.sum(0).tolist() if counts.numel() else ([], [])
        return tuple(h / n if n else None for h, n in zip(hits, made))

    def rank_accuracy_by_layer(self) -> dict[int, tuple[float | None, ...]]:
        """Predicted routed layer index -> its rank_accuracy."""
        return {self.layers[ordinal + 1]: self.rank_accuracy(self.layers[ordinal + 1])
                for ordinal in sorted(self.predictors)}

    def reset_counters(self) -> None:
        self.fetch_counts.zero_()
        self.rank_counts.zero_()
        self.staged_bytes = 0

    def close(self) -> None:
        """Unpin the host allocation (after the device stopped reading it); the model must not run after."""
        self._unpin()
        self.host_allocation = None
        self.host, self.host_device, self.buffer, self.staging, self.modules = {}, {}, {}, {}, {}

    # ---- the step ----

    def decode(self, module: nn.Module, index: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:
        """A step with at most fetch_slots (token, expert) pairs: gather the routed non-resident experts, then
        batched_mm over the device buffer. No host synchronisation."""
        ordinal = self.ordinal[index]
        base = self._slot_base(ordinal)
        resident_row = self.tables[index].resident_row
        predicted = self._join(index)
        # the next layer's prefetch first (by default): the link stays busy while this layer plans its misses,
        # and the misses' full grid takes most of the link from the prefetch's bounded one while both run
        if not self.prefetch_after_misses:
            self._prefetch_next(ordinal, hidden)
        if predicted and self.count_ranks:
            self._count_ranks(ordinal, top_k_index)
        ahead = predicted and self.prefetch_depth[index] > 0  # depth 0: predicted, nothing gathered ahead
        if self.device.type == "cuda":  # one kernel where the torch ops below are 15 or 35 graph nodes
            pair_rows, source_ids = fused_fetch_plan(top_k_index, resident_row, self.fetch_slots, base,
                                                     self.fetch_counts, self.prefetched[ordinal] if ahead else None)
        elif ahead:
            pair_rows, source_ids, counts = plan_fetch_after_prefetch(
                top_k_index, resident_row, self.prefetched[ordinal], slot_base=base)
            self.fetch_counts.add_(counts)
        else:
            pair_rows, source_ids = plan_fetch(top_k_index, resident_row, self.fetch_slots, slot_base=base)
            self.fetch_counts.add_(torch.nn.functional.pad((source_ids >= 0).sum().view(1), (len(FETCH_KINDS) - 1, 0)))
        words, warps = self.gather_shape
        for name in self.param_names:  # the misses, on the critical path: the full grid
            gather_rows(self.host_device[index, name], self.buffer[name][base:base + self.fetch_slots], source_ids,
                        block_words=words, num_warps=warps)
        if self.prefetch_after_misses:
            self._prefetch_next(ordinal, hidden)
        proxy = _Proxy(module, {name: self.buffer[name] for name in self.param_names})
        return batched_mm_forward()(proxy, hidden, pair_rows.view_as(top_k_index), top_k_weights)

    def _count_ranks(self, ordinal: int, top_k_index: torch.Tensor) -> None:
        """Per rank, how many of this step's predictions for this layer it routed the same token to."""
        num_tokens = top_k_index.shape[0]
        predicted = self.predicted_ids[ordinal, :num_tokens]  # [T, k]
        hits = (predicted.unsqueeze(-1) == top_k_index.reshape(num_tokens, 1, -1)).any(-1)  # [T, k]
        self.rank_counts[ordinal, 0].add_(hits.sum(0))
        self.rank_counts[ordinal, 1].add_(num_tokens)

    def _slot_base(self, ordinal: int) -> int:
        """The first slot row of a routed layer's slot set: by its ordinal's parity when prefetching."""
        return (ordinal % 2) * self.fetch_slots if self.prefetch else 0

    def _join(self, index: int) -> bool:
        """Whether a prefetch was started for this layer in this step; the main stream then waits for it."""
        if index not in self._pending:
            return False
        self._pending.discard(index)
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return True

    def _prefetch_next(self, ordinal: int, hidden: torch.Tensor) -> None:
        """Predict the next routed layer's experts from this layer's router input ``hidden`` [tokens, H] and
        gather its predicted, non-resident ones into that layer's slot set, on the side stream (inline on the
        CPU). The side stream first waits for the main stream, where the set's previous reader (the routed layer
        before this one: same parity) is enqueued; this layer's own set and prefetched ids are not touched."""
        predictor = self.predictors.get(ordinal)
        if predictor is None:
            return
        following = self.layers[ordinal + 1]
        inputs = self._router_input(hidden)
        base = self._slot_base(ordinal + 1)

        depth = self.prefetch_depth[following]

        def work():
            predicted = predictor.top_k_index(inputs)  # [tokens, top_k], ranks by descending router score
            self.predicted_ids[ordinal + 1, :predicted.shape[0]].copy_(predicted)
            if depth == 0:  # predicted and counted by rank; nothing gathered ahead
                return
            # the top ``depth`` ranks only: a fixed slice, so the captured shapes stay fixed
            predicted = predicted[:, :depth]
            source_ids = self.prefetched[ordinal + 1]
            if self.device.type == "cuda":  # the counts of a prediction are taken at its layer: a scratch here
                fused_fetch_plan(predicted, self.tables[following].resident_row, self.fetch_slots, 0,
                                 self._prefetch_counts, sources_out=source_ids)
            else:
                source_ids.copy_(plan_fetch(predicted, self.tables[following].resident_row, self.fetch_slots)[1])
            words, warps = self.gather_shape
            for name in self.param_names:
                gather_rows(self.host_device[following, name], self.buffer[name][base:base + self.fetch_slots],
                            source_ids, max_programs=self.prefetch_programs, block_words=words, num_warps=warps)

        if self.stream is None:
            work()
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                work()
        self._pending.add(following)

    def _router_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` copied (main stream) into a buffer the step keeps, which the side stream reads: the
        caller's tensor may be freed and its memory reused on the main stream before the side stream reads it.
        The next routed layer overwrites it only after joining the side stream."""
        buffer = self._predict_input
        if buffer is None or buffer.dtype != hidden.dtype or buffer.shape[1] != hidden.shape[1] or \
                buffer.shape[0] < hidden.shape[0]:
            # decode steps have at most fetch_slots tokens (each routes to at least one expert)
            buffer = torch.empty((max(self.fetch_slots, hidden.shape[0]), hidden.shape[1]), dtype=hidden.dtype,
                                 device=hidden.device)
            self._predict_input = buffer
        inputs = buffer[:hidden.shape[0]]
        inputs.copy_(hidden)
        return inputs

    def prefill(self, module: nn.Module, index: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """A chunk with more pairs than fetch slots: the layer's E experts into the staging buffer from the
        host, then the configured experts implementation over it. No host sync either
        (a decode step with more sequences than planned lands here, captured or not); ``staged_bytes`` counts
        eager calls only."""
        self._join(index)  # a decode step's prefetch cannot precede a prefill chunk; joined should one ever
        for name in self.param_names:
            # one copy-engine copy of all E (the host holds the resident ones too): one large copy runs at the
            # link's rate, where copying around the resident rows would take up to R + 1 smaller ones
            self.staging[name].copy_(self.host[index, name], non_blocking=True)
        self.staged_bytes += self.num_experts * self.expert_bytes
        proxy = _Proxy(module, dict(self.staging))
        return prefill_experts_forward(module)(proxy, hidden, top_k_index, top_k_weights)


def plan_fetch(top_k_index: torch.Tensor, resident_row: torch.Tensor, fetch_slots: int, slot_base: int = 0):
    """(pair -> device-buffer row [S], fetch slot -> expert id to gather or -1 [fetch_slots]) for S <=
    fetch_slots routed pairs, in fixed shapes: each distinct non-resident expert gets one slot, numbered in
    ascending expert order (its row: ``slot_base`` + slot); resident experts map to their resident rows."""
    ids = top_k_index.reshape(-1)  # [S]
    sorted_ids, order = torch.sort(ids)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    resident = resident_row[sorted_ids]  # [S], -1 where not resident
    new = first & (resident < 0)
    slot = torch.cumsum(new, 0) - 1  # the distinct non-resident expert's slot, repeated over its pairs
    rows_sorted = torch.where(resident >= 0, resident, slot + slot_base)
    pair_rows = torch.empty_like(rows_sorted)
    pair_rows[order] = rows_sorted
    # slot -> expert: written by each expert's first pair; others write to a spare last entry
    sources = torch.full((fetch_slots + 1,), -1, dtype=torch.int64, device=ids.device)
    sources.scatter_(0, torch.where(new, slot, fetch_slots), torch.where(new, sorted_ids, -1))
    return pair_rows, sources[:fetch_slots]


def plan_fetch_after_prefetch(top_k_index: torch.Tensor, resident_row: torch.Tensor, prefetched: torch.Tensor,
                              slot_base: int = 0):
    """For a layer whose slot set already holds ``prefetched`` ([F] expert id per slot, -1 unused; distinct,
    non-resident): (pair -> device-buffer row [S], slot -> expert id to gather now or -1 [F], counts [4] as
    FETCH_KINDS: prefetched and routed, prefetched and not routed, missed, 0), in fixed shapes. Prefetched
    routed experts keep their slots; each miss (routed, not resident, not prefetched) takes the next slot that
    holds no routed expert (unused, or a wasted prediction), in ascending expert order. There are enough: with
    H hits, at most F - H distinct experts miss and F - H slots are free."""
    num_slots, num_experts = prefetched.numel(), resident_row.numel()
    ids = top_k_index.reshape(-1)  # [S]
    sorted_ids, order = torch.sort(ids)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    resident = resident_row[sorted_ids]  # [S], -1 where not resident
    # expert -> its slot in the set, -1 if not prefetched (unused slots write the spare last entry)
    slot_of = torch.full((num_experts + 1,), -1, dtype=torch.int64, device=ids.device)
    slot_of.scatter_(0, torch.where(prefetched >= 0, prefetched, num_experts),
                     torch.arange(num_slots, device=ids.device))
    hit_slot = slot_of[sorted_ids]  # [S]
    need = first & (resident < 0)
    hit, miss = need & (hit_slot >= 0), need & (hit_slot < 0)
    # a slot keeps its expert when the step routes to it; the others are free for the misses
    routed = torch.zeros(num_experts + 1, dtype=torch.bool, device=ids.device)
    # index_fill_, not `routed[sorted_ids] = True`: that copies a CPU scalar, which a CUDA graph capture refuses
    routed.index_fill_(0, sorted_ids, True)
    keep = (prefetched >= 0) & routed[torch.where(prefetched >= 0, prefetched, num_experts)]
    free_rank = torch.cumsum(~keep, 0) - 1  # [F]
    free_slot = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=ids.device)  # rank -> slot
    free_slot.scatter_(0, torch.where(keep, num_slots, free_rank), torch.arange(num_slots, device=ids.device))
    miss_rank = torch.cumsum(miss, 0) - 1  # the missed expert's rank, repeated over its pairs
    slot = torch.where(hit_slot >= 0, hit_slot, free_slot[miss_rank.clamp(min=0)])
    rows_sorted = torch.where(resident >= 0, resident, slot + slot_base)
    pair_rows = torch.empty_like(rows_sorted)
    pair_rows[order] = rows_sorted
    sources = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=ids.device)
    sources.scatter_(0, torch.where(miss, slot, num_slots), torch.where(miss, sorted_ids, -1))
    num_hits, num_missed = hit.sum(), miss.sum()
    counts = torch.stack((num_hits, (prefetched >= 0).sum() - num_hits, num_missed, torch.zeros_like(num_hits)))
    return pair_rows, sources[:num_slots], counts


@dataclass(frozen=True, kw_only=True)
class _Predictor:
    """How routed layer i's router input predicts the next routed layer j's routing."""

    #: [H] float32: norm_j.weight / norm_i.weight (0 where norm_i's weight is 0: nothing to rescale)
    ratio: torch.Tensor
    #: layer j's router module: called as its MoE block calls it, (logits, weights, top-k index)
    gate: nn.Module
    #: experts the router picks per token (the top-k index's last dimension)
    top_k: int

    def top_k_index(self, hidden: torch.Tensor) -> torch.Tensor:
        """Layer j's router on ``hidden`` [tokens, H] (layer i's router input) rescaled to layer j's norm."""
        scaled = (hidden.float() * self.ratio).to(hidden.dtype)
        return self.gate(scaled)[-1]


def next_layer_predictor(layer: nn.Module | None, following: nn.Module | None, num_experts: int,
                         device: torch.device) -> "_Predictor | str":
    """A predictor of ``following``'s routing from ``layer``'s router input, or why there is none: both layers
    need an RMSNorm post_attention_layernorm (output = weight x normalized input, checked on a probe) and
    ``following`` a router at mlp.gate returning a tuple that ends with the top-k expert ids."""
    norms = [getattr(m, "post_attention_layernorm", None) for m in (layer, following)]
    weights = [getattr(norm, "weight", None) for norm in norms]
    if any(w is None or w.dim() != 1 for w in weights) or weights[0].shape != weights[1].shape:
        return "no post_attention_layernorm with a weight per hidden unit"
    gate = following.get_submodule("mlp").get_submodule("gate") if hasattr(following, "mlp") and \
        hasattr(following.mlp, "gate") else None
    if gate is None or any(w.is_meta for w in weights):
        return "no router at mlp.gate" if gate is None else "the norms' weights are not loaded"
    with torch.inference_mode():
        probe = torch.randn(2, weights[0].shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float32)
        ratio = torch.where(weights[0] != 0, weights[1].float() / weights[0].float(), 0.0).cpu()
        refused = _rescaling_refusal(norms[0], norms[1], ratio, probe)
        if refused:
            return refused
        gate_param = next(gate.parameters(), None)
        probe_device = probe.to(device=weights[0].device, dtype=weights[0].dtype)
        try:
            output = gate(probe_device if gate_param is None else probe_device.to(gate_param.device, gate_param.dtype))
        except Exception as error:  # an architecture's router with another signature
            return f"its router cannot be called on the hidden state ({type(error).__name__}: {error})"[:300]
    top_k = output[-1] if isinstance(output, tuple) else None
    if top_k is None or top_k.dtype not in (torch.int32, torch.int64) or top_k.dim() != 2 or top_k.shape[0] != 2 \
            or int(top_k.max()) >= num_experts:
        return "its router does not return (logits, weights, top-k expert ids)"
    return _Predictor(ratio=ratio.to(device), gate=gate, top_k=top_k.shape[1])


#: relative deviation of norm_i(x) x ratio from norm_j(x) (float32 copies of the norms on the CPU) above which
#: the norms are not both weight x normalized input: float32 rounding of the two products and the ratio is
#: ~1e-7 relative, so this only refuses a norm of another form (a shift, a mean, a different normalization)
NORM_CHECK_RTOL = 1e-4


def _rescaling_refusal(norm: nn.Module, following: nn.Module, ratio: torch.Tensor, probe: torch.Tensor) -> str | None:
    """Why rescaling ``norm``'s output by ``ratio`` does not give ``following``'s on the same input, or None.

    The check runs float32 copies of both norms on the CPU: the property is structural (RMSNorm's output is its
    weight times a normalized input), so it must not depend on the model's dtype or device. In bf16 a norm's
    own output rounds to 2^-9 relative and its weight may sit near zero (a random tiny model), so a check in the
    model's dtype against a fixed absolute tolerance refused true RMSNorms. It decides only whether prediction
    is attempted: the logits stay bitwise whatever it says. Where norm_i's weight is 0, nothing rescales to
    norm_j's output there: those units are left out of the check and of the prediction's input."""
    devices = list(dict.fromkeys([torch.device("cpu"), norm.weight.device]))
    for position, device in enumerate(devices):  # the CPU first; the norm's own device if it runs only there
        try:
            copies = [copy.deepcopy(n).to(device=device, dtype=torch.float32) for n in (norm, following)]
            expected, got = (c(probe.to(device)).cpu() for c in copies)
            break
        except Exception as error:  # a norm that cannot be copied or run in float32 there
            if position == len(devices) - 1:
                return f"its norm cannot be checked on a float32 probe ({type(error).__name__}: {error})"[:300]
    if not isinstance(expected, torch.Tensor) or expected.shape != probe.shape or got.shape != probe.shape:
        return "its norm does not map a hidden state to one of the same shape"
    rescaled = expected.float() * ratio
    # where norm_i's weight is 0 its output holds nothing to rescale: those units stay 0 in the prediction's input
    # (a little less information, never a wrong form), so the form is checked on the others. The H100's tiny test
    # model has exact zeros there (transformers 5.17 on torch 2.11), and refusing it turned prediction off
    informative = (ratio != 0) | (copies[1].weight.detach().float().cpu() == 0)
    deviation = ((rescaled - got.float()).abs() * informative)
    scale = got.float().abs().clamp(min=torch.finfo(torch.float32).tiny) + \
        NORM_CHECK_RTOL * got.float().abs().max().clamp(min=torch.finfo(torch.float32).tiny)
    relative = deviation / scale
    worst = int(relative.argmax())
    if float(relative.flatten()[worst]) <= NORM_CHECK_RTOL:
        return None
    unit = worst % probe.shape[1]
    return (f"its norm is not weight x normalized input (RMSNorm), so no rescaling gives layer j's (unit {unit}: "
            f"{float(rescaled.flatten()[worst]):.4g} rescaled vs {float(got.flatten()[worst]):.4g}, weights "
            f"{float(copies[0].weight[unit]):.4g} and {float(copies[1].weight[unit]):.4g})")


def gather_rows(source: torch.Tensor, destination: torch.Tensor, source_ids: torch.Tensor,
                max_programs: int | None = None, block_words: int = GATHER_BLOCK_WORDS,
                num_warps: int = GATHER_NUM_WARPS) -> None:
    """destination[k] = source[source_ids[k]] for every k with source_ids[k] >= 0; the others untouched.
    ``source`` [E, ...] may be host memory mapped into the device (UVA): on CUDA a Triton kernel reads only the
    rows asked for, with at most ``max_programs`` persistent programs (None: one per block of every slot, the
    full grid) of ``num_warps`` warps, each copying ``block_words`` 32-bit words at a time (a power of two); on
    the CPU (tests) the same semantics in torch."""
    if destination.device.type == "cuda":
        _gather_rows_triton(source, destination, source_ids, max_programs, block_words, num_warps)
        return
    take = (source_ids >= 0).nonzero().flatten()
    destination[take] = source[source_ids[take]]


def _gather_rows_triton(source: torch.Tensor, destination: torch.Tensor, source_ids: torch.Tensor,
                        max_programs: int | None = None, block_words: int = GATHER_BLOCK_WORDS,
                        num_warps: int = GATHER_NUM_WARPS) -> None:
    row_bytes = source[0].numel() * source.element_size()
    words = 4 if row_bytes % 4 == 0 else 1
    dtype = torch.int32 if words == 4 else torch.uint8
    row_words = row_bytes // words
    source_words = source.view(torch.uint8).view(dtype) if source.dtype != dtype else source
    destination_words = destination.view(torch.uint8).view(dtype) if destination.dtype != dtype else destination
    chunks_per_row = -(-row_words // block_words)
    num_items = source_ids.numel() * chunks_per_row
    grid = (max(1, min(num_items, max_programs or num_items)),)
    _gather_kernel()[grid](source_words, destination_words, source_ids, row_words, chunks_per_row, num_items,
                           BLOCK=block_words, num_warps=num_warps)


_KERNEL = {}


def _gather_kernel():
    """The Triton gather, compiled on first use (triton ships with CUDA builds of torch)."""
    if "gather" not in _KERNEL:
        import triton
        import triton.language as tl

        @triton.jit
        def gather(source, destination, source_ids, row_words, chunks_per_row, num_items, BLOCK: tl.constexpr):
            # persistent programs: item = slot x chunks_per_row + chunk, strided over the grid, so a bounded
            # grid (a side stream's prefetch) still covers every block of every slot
            for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
                slot = item // chunks_per_row
                chunk = item % chunks_per_row
                expert = tl.load(source_ids + slot)
                if expert >= 0:  # an unused slot or one already there: nothing crosses the link
                    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
                    mask = offsets < row_words
                    values = tl.load(source + expert.to(tl.int64) * row_words + offsets, mask=mask)
                    tl.store(destination + slot.to(tl.int64) * row_words + offsets, values, mask=mask)

        _KERNEL["gather"] = gather
    return _KERNEL["gather"]


class _CudaArray:
    """A page-locked, mapped host range described as a CUDA array (``__cuda_array_interface__``), so torch
    wraps it as a CUDA tensor at the same address (unified virtual addressing)."""

    def __init__(self, tensor: torch.Tensor):
        self._keep = tensor
        typestr = {torch.uint8: "|u1", torch.int16: "<i2", torch.int32: "<i4", torch.int64: "<i8"}[tensor.dtype]
        self.__cuda_array_interface__ = {"shape": tuple(tensor.shape), "typestr": typestr,
                                         "data": (tensor.data_ptr(), False), "version": 3,
                                         "strides": tuple(s * tensor.element_size() for s in tensor.stride())}


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (page-locked, mapped) as a tensor on ``device`` over the same memory; on the CPU, itself."""
    if device.type != "cuda":
        return host
    raw = host.view(torch.uint8) if host.element_size() == 1 else host.view({2: torch.int16, 4: torch.int32,
                                                                              8: torch.int64}[host.element_size()])
    try:
        view = torch.as_tensor(_CudaArray(raw), device=device)
    except RuntimeError as error:
        raise RuntimeUnavailableError(f"cannot map {format_bytes(host.numel() * host.element_size())} of page-locked "
                                      f"host memory into the GPU's address space ({str(error).splitlines()[0]}); "
                                      "routed experts need unified addressing (64-bit Linux, CUDA >= 4)") from None
    return view.view(host.dtype)


class _Proxy:
    """The experts module as transformers' experts functions see it, with other weights (the device buffer or
    the staging buffer) and num_experts their row count; everything else is the module's own."""

    def __init__(self, module: nn.Module, weights: dict[str, torch.Tensor]):
        self.__dict__["_module"] = module
        self.__dict__.update(weights)
        self.__dict__["num_experts"] = next(iter(weights.values())).shape[0]

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def batched_mm_forward():
    """transformers' batched_mm experts forward: the decode steps compute with it (capturable, and what the
    all-resident reference computes with)."""
    from transformers.integrations.moe import batched_mm_experts_forward

    return batched_mm_experts_forward


def prefill_experts_forward(module: nn.Module):
    """How prefill chunks compute their experts: the implementation the model is configured with (the lead's
    runtime.experts_impl sets it per phase), so a routed layer prefills as the all-resident model does."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    original = type(module).forward
    original = getattr(original, "__wrapped__", original)
    name = getattr(module.config, "_experts_implementation", None) or "eager"
    if name == "eager":
        return original
    return ALL_EXPERTS_FUNCTIONS.get_interface(name, original)


def _route(module: nn.Module, routed: RoutedExperts, index: int) -> None:
    """Replace the experts module's forward (instance attribute: the class's stays for other layers) and drop
    its params, whose bytes now live in the host allocation and the device buffer."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if top_k_index.numel() <= routed.fetch_slots:
            return routed.decode(self, index, hidden_states, top_k_index, top_k_weights)
        return routed.prefill(self, index, hidden_states, top_k_index, top_k_weights)

    module.forward = types.MethodType(forward, module)
    for name in routed.param_names:
        # an empty placeholder keeps the param's name (state_dict keys, planners) without its bytes
        empty = torch.empty((0,), dtype=routed.rows[name][0], device=routed.device)
        module._parameters[name] = nn.Parameter(empty, requires_grad=False)
    module._routed_experts = routed


def apply_routed_experts(model: nn.Module, routed: dict[int, tuple[int, ...]], fetch_slots: int, backend,
                         stack: str = "model.layers", adopt_host: bool = False, prefetch: bool = False,
                         prefetch_programs: int = PREFETCH_GATHER_PROGRAMS,
                         prefetch_depth: "int | dict[int, int] | None" = None) -> RoutedExperts | None:
    """Route-fetch the experts of the layers ``routed`` names (layer index -> resident expert ids): their
    fused expert params move to page-locked, mapped host memory (resident ones also to the GPU) and their
    forward fetches what each step routes to. Non-expert params are left where they are (the caller puts
    them on the GPU); ``adopt_host``, ``prefetch``, ``prefetch_programs``, ``prefetch_depth``: see
    RoutedExperts. None when ``routed`` is empty."""
    if not routed:
        return None
    layers = list(model.get_submodule(stack))
    bad = [index for index in routed if not 0 <= index < len(layers)]
    if bad:
        raise PlanError(f"routed layers {bad} are outside the model's {len(layers)} layers")
    modules = {index: experts_module(layers[index], index) for index in routed}
    experts = RoutedExperts(modules=modules, resident=routed, fetch_slots=fetch_slots, backend=backend,
                            adopt_host=adopt_host, decoder_layers={index: layers[index] for index in routed},
                            prefetch=prefetch, prefetch_programs=prefetch_programs, prefetch_depth=prefetch_depth)
    try:
        experts.start()
    except BaseException:
        experts.close()
        raise
    return experts


def allocate_for_plan(plan, layers: list[nn.Module], backend) -> "RoutedExperts | None":
    """The routed experts of a plan's ``experts`` section, allocated (host and device) but not started: the
    loader reads their params into ``host_allocation`` at ``host_items``, then calls ``start``. None where the
    plan routes no layer."""
    routed, fetch_slots = routed_from_plan(plan)
    if not routed:
        return None
    bad = [index for index in routed if not 0 <= index < len(layers)]
    if bad:
        raise PlanError(f"the plan routes layers {bad} but the model has {len(layers)}; regenerate the plan")
    overlap = sorted(set(routed) & set(plan.offload.layers))
    if overlap:
        raise PlanError(f"layers {overlap} are both offloaded whole and routed in the plan; regenerate it")
    modules = {index: experts_module(layers[index], index) for index in routed}
    return RoutedExperts(modules=modules, resident=routed, fetch_slots=fetch_slots, backend=backend,
                         decoder_layers={index: layers[index] for index in routed},
                         prefetch=prefetch_from_plan(plan), prefetch_depth=prefetch_depth_from_plan(plan))


def prefetch_from_plan(plan) -> bool:
    """Whether the plan's experts section asks for next-layer prefetch (``prefetch: next_layer_router``);
    plans made before it have no such field: no prefetch."""
    return getattr(getattr(plan, "experts", None), "prefetch", None) == NEXT_LAYER_ROUTER


def prefetch_depth_from_plan(plan) -> int | None:
    """The plan's experts.prefetch_depth (ranks of each prediction prefetched); None (all k) in plans made
    before it."""
    depth = getattr(getattr(plan, "experts", None), "prefetch_depth", None)
    return None if depth is None else int(depth)


def routed_from_plan(plan) -> tuple[dict[int, tuple[int, ...]], int]:
    """(layer -> resident ids, fetch_slots) of the plan's routed layers; empty where the plan has no
    ``experts`` section (dense plans, plans made before it) or routes no layer. Read defensively: the
    planner's dataclasses (planner.plan.schema ExpertsPlan / ExpertLayer) may lack fields in older plans."""
    experts = getattr(plan, "experts", None)
    if experts is None:
        return {}, 0
    routed = {layer.index: tuple(layer.resident) for layer in getattr(experts, "layers", ())
              if getattr(layer, "regime", None) == "routed"}
    return routed, int(getattr(experts, "fetch_slots", 0) or 0)
