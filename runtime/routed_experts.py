"""Expert-granular offloading: only the routed experts that are not resident cross the link, inside the step.

For each routed layer (a plan's ``experts`` section, regime "routed"), the fused expert params under
``<layer>.mlp.experts`` (transformers 5: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], biases where
present) live in one page-locked host allocation that the GPU reads at the same address (UVA). The layer's
resident experts are copied once into a GPU buffer. The experts module's forward is replaced by one that,
with no host synchronisation (so a CUDA graph captures it with the rest of the step):

1. finds the distinct experts the step routes to (sort, first occurrences, cumsum: fixed shapes);
2. gathers each distinct non-resident one ONCE from host memory into the shared fetch buffer (a Triton
   kernel whose programs for unused slots return at once, so only the routed, non-resident bytes cross);
3. computes with the experts function the model decodes with (runtime.experts_impl.decode_experts_forward:
   transformers' grouped_mm where bf16 has torch's grouped GEMM, else batched_mm) over a proxy whose weights are
   the device buffer (fetch slots, then every layer's resident experts) and whose routing is the (token, expert)
   pair -> buffer row map. Each pair multiplies the all-resident model's values (grouped_mm's groups hold the same
   pairs: one buffer row per expert a step routes to), so the logits are the all-resident model's decode, bit
   for bit where the kernels compute a group alike whatever its place in the buffer.

Prefill chunks (more pairs than fetch slots) copy the layer's experts into one shared staging buffer of all E
experts (one copy-engine copy from the host, which holds all E: the resident ones too) and run the experts
implementation the model is configured with (prefill_experts_forward) over it.

One device buffer [fetch_slots + sum of resident counts, ...] per expert param holds the fetch slots and every
layer's resident experts, so one index tensor addresses both without copying resident experts per step.

Next-layer prefetch (``prefetch=True``; a plan's ``experts.prefetch: next_layer_router``): the fetch of step 2 waits
for the layer's router, so without prediction the link and the compute take turns. Layer i's router input, rescaled
to layer j's norm, predicts the next routed layer j's experts (runtime.router_prediction). The predicted, non-
resident ones are gathered on a side stream into layer j's slot set while layer i gathers its misses and computes,
and layer j's attention runs; at layer j the step joins that stream, routes for real, and gathers on the main stream
only the misses (routed, not resident, not prefetched) into the slots the mispredicted (wasted) or unused ones free.
Slots are double-buffered by the parity of the routed layer's ordinal (layer i still reads its set while j's is
written), so the buffer holds 2 x fetch_slots slot rows. The side stream's gather runs a bounded grid
(PREFETCH_GATHER_PROGRAMS persistent programs) so it leaves the SMs to the compute it overlaps. Everything stays
inside the captured step (fork and join through stream waits: legal under CUDA-graph capture); the values the
experts multiply are still the all-resident ones, so the logits stay bitwise equal. The first routed layer (no
previous one) and layers whose router cannot be called so fetch after their router, as without prefetch.

CPU experts (``cpu``: layer -> expert ids the host CPU computes): runtime.cpu_handoff says how such a layer's step
hands them to the host inside the captured step; without them the step is the one above, bit for bit.
"""

import math
import types
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from planner.errors import PlanError
from planner.plan.experts_section import fraction_of
from planner.model.placement import ALIGN_BYTES, align_up
from runtime.allocation import alloc_device_or_fail, host_allocation_or_fail
from runtime.cpu_experts import gpu_partial_sum
from runtime.cpu_handoff import CpuExperts, check_cpu_experts, check_cpu_take, start_cpu_experts
from runtime.engine import PackedParam, backend_unpin, view_as_param
from runtime.experts_impl import ExpertsProxy, decode_experts_forward, expert_param_names, prefill_experts_forward
from runtime.fetch_planning import CpuSplit, fused_fetch_plan, part_rows, torch_fetch_plan
from runtime.router_prediction import NextLayerPredictor, predictors_for, prefetch_depths
from runtime.routed_prefetch import prefetch_next
from runtime.uva_gather import GATHER_BLOCK_WORDS, GATHER_NUM_WARPS, device_view, gather_rows, part_layout

#: persistent programs of the side stream's prefetch gather: few enough to leave the SMs to the compute the
#: prefetch overlaps, enough to keep the link busy. On an H100 (scripts/bench_experts.py --gather-programs) 16,
#: 32, 64 and 128 programs gathered at 0.992, 0.995, 0.986 and 0.986 of the full grid's rate (47.3 GB/s); the
#: main stream's miss gather keeps the full grid
PREFETCH_GATHER_PROGRAMS = 32
#: fetch_counts entries: prefetched and routed; prefetched, not routed; routed, not resident, not prefetched
#: (fetched after the router of a predicted layer); fetched after the router of a layer nothing predicted
FETCH_KINDS = ("prefetched", "wasted", "missed", "unpredicted")


@dataclass(frozen=True, kw_only=True)
class RouteTables:
    """Per routed layer, on the device: where each expert's weights sit in the device buffer."""

    #: [E] int64: the expert's row among the resident rows of the device buffer, or -1 if not resident
    resident_row: torch.Tensor
    #: a layer splitting each step's misses with the CPU by their count (its CPU ids then eligible, not resident at
    #: the zero row); None: fixed CPU ids, or none
    cpu_split: CpuSplit | None = None


class RoutedExperts:
    """Owns the host allocation (page-locked, mapped), the device buffer (fetch slots + resident experts), the
    staging buffer for prefill and the fetch counter of every routed layer of one model."""

    def __init__(self, *, modules: dict[int, nn.Module], resident: dict[int, tuple[int, ...]], fetch_slots: int,
                 backend, adopt_host: bool = False, decoder_layers: dict[int, nn.Module] | None = None,
                 prefetch: bool = False, prefetch_programs: int = PREFETCH_GATHER_PROGRAMS,
                 prefetch_depth: "int | dict[int, int] | None" = None,
                 cpu: dict[int, tuple[int, ...]] | None = None, cpu_dtype: str = "fp32",
                 cpu_threads: int | None = None, cpu_take: dict[int, tuple[float, ...]] | None = None):
        """Allocate (nothing read, nothing pinned yet): ``modules``: layer index -> its experts module (its
        params may be on the meta device: only their shapes are read here); ``resident``: layer index -> expert
        ids kept on the GPU; ``fetch_slots``: distinct experts one decode step can fetch (the plan's
        experts.fetch_slots); ``adopt_host``: page-lock the params' own host tensors in place (they must be
        contiguous CPU tensors, each its storage) rather than copy them into one allocation: a benchmark whose
        model already sits in host memory holds no second copy. ``start`` then takes the weights and routes
        the layers. ``prefetch``: predict and prefetch each next routed layer's experts (module docstring); it
        needs ``decoder_layers`` (layer index -> decoder layer: its post-attention norm and its router);
        ``prefetch_programs``: the side stream gather's persistent programs; ``prefetch_depth``: how many of
        each predicted token's top-k ranks are prefetched (``set_prefetch_depth``; None: all k). ``cpu``: layer
        index -> expert ids the host CPU computes (runtime.cpu_handoff), from a host copy in ``cpu_dtype`` ("bf16",
        "fp32") with ``cpu_threads`` threads (None: torch's current count); ``cpu_take``: layer index -> j(m), for
        layers that send the first j(m) of a step's m misses among their CPU ids to the CPU instead of every pair
        routed to those ids (runtime.fetch_planning.split_to_cpu); a fraction f of j(m) sends the first f of one
        more expert's intermediate rows (part_rows)."""
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
        self.param_names = expert_param_names(first)
        #: param name -> (dtype, row shape): every routed layer must agree (one shared buffer)
        self.rows = {name: (getattr(first, name).dtype, tuple(getattr(first, name).shape[1:]))
                     for name in self.param_names}
        self._check(modules, resident, fetch_slots)
        self.resident = {index: tuple(sorted(resident.get(index, ()))) for index in self.layers}
        #: routed layer index -> the expert ids its CPU computes (layers with none left out)
        self.cpu = {index: tuple(sorted(ids)) for index, ids in (cpu or {}).items() if ids}
        self.cpu_dtype = cpu_dtype
        self.cpu_threads = torch.get_num_threads() if cpu_threads is None else int(cpu_threads)
        check_cpu_experts(self.cpu, self.resident, self.num_experts, self.param_names, self.cpu_dtype,
                          self.cpu_threads)
        #: routed layer index -> j(m) of the layers splitting each step's misses with the CPU by their count
        self.cpu_take = {index: tuple(float(j) for j in take) for index, take in (cpu_take or {}).items() if take}
        check_cpu_take(self.cpu_take, self.cpu)
        #: the experts' intermediate rows (0 where the experts are not SwiGLU's gate_up and down)
        self.intermediate = self.rows["down_proj"][1][-1] if "down_proj" in self.rows else 0
        #: routed layer index -> per miss count, the intermediate rows of one more expert its CPU computes, for the
        #: layers whose j(m) holds fractions
        self.cpu_rows = {}
        for index, take in self.cpu_take.items():
            rows = tuple(part_rows(j, self.intermediate) for j in take)
            if any(rows):
                self.cpu_rows[index] = rows
        #: param name -> where an expert's intermediate rows lie in it (the gather of an expert split by its rows)
        self.part_layouts = {name: part_layout(name, shape) for name, (_, shape) in self.rows.items()} \
            if self.cpu_rows else {}
        #: the CPU side (runtime.cpu_handoff.CpuExperts), made by start where some layer has CPU experts
        self.cpu_experts: CpuExperts | None = None
        #: what re-splits the per-step tables at the host's measured rate (runtime.cpu_resplit.CpuResplitter), set by
        #: the placement of a plan that has such tables; None: the tables stay as given
        self.resplit = None
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
        #: the row of zeros CPU experts map to (the last row), None without CPU experts
        self.zero_row = num_rows if self.cpu else None
        num_rows += 1 if self.cpu else 0
        #: param -> [slot rows + resident rows (+ the zero row), *row] on the device: fetch slots first (one set,
        #: or two when prefetching), then each routed layer's resident experts in layer order, then the zero row
        self.buffer = {name: self._device_rows(name, num_rows) for name in self.param_names}
        #: param -> [E, *row] on the device: one routed layer's experts during a prefill chunk
        self.staging = {name: self._device_rows(name, self.num_experts) for name in self.param_names}
        #: [4] int64 on the device: distinct non-resident experts gathered by decode steps since reset, by kind
        #: (FETCH_KINDS)
        self.fetch_counts = torch.zeros(len(FETCH_KINDS), dtype=torch.int64, device=self.device)
        #: [4] int64 on the device: of those, the intermediate rows of split experts the CPU computed (they did not
        #: cross the link), by kind
        self.part_row_counts = torch.zeros(len(FETCH_KINDS), dtype=torch.int64, device=self.device)

    def _prediction_state(self) -> None:
        """The next-layer prediction's buffers, counters and knobs (filled by ``start``), and the host views."""
        #: [routed layers, fetch_slots] int64 on the device: the expert prefetched into each slot of the layer's
        #: set (-1: none), written by the previous routed layer's prediction
        self.prefetched = torch.full((len(self.layers), self.fetch_slots), -1, dtype=torch.int64, device=self.device)
        #: where the fused fetch plan of a prediction adds counts nobody reads
        self.prefetch_counts = torch.zeros(len(FETCH_KINDS), dtype=torch.int64, device=self.device)
        #: routed ordinal -> how to predict the next routed layer's routing (filled by start)
        self.predictors: dict[int, NextLayerPredictor] = {}
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
        self.pending: set[int] = set()
        #: the side stream of the prefetches (CUDA only) and the router input it reads, copied on the main stream
        self.stream = None
        #: routed ordinal -> an event the side stream records once the prefetch for that layer has planned its ids
        #: (before its gather): a layer splitting its misses with the CPU waits for it, not for the gather (CUDA)
        self.planned_events: dict[int, torch.cuda.Event] = {}
        self.predict_input: torch.Tensor | None = None
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
            # fixed CPU experts read as resident at the zero row: never fetched, their pairs add exactly 0 here; a
            # per-step split maps the step's chosen ones there (runtime.fetch_planning.split_to_cpu)
            if index in self.cpu and index not in self.cpu_take:
                resident_row[list(self.cpu[index])] = self.zero_row
            for name in self.param_names:
                self.buffer[name][row:row + len(ids)].copy_(self.host[index, name][ids])
            self.tables[index] = RouteTables(resident_row=resident_row.to(self.device), cpu_split=self._split(index))
            row += len(ids)
        if self.cpu:
            self.cpu_experts = start_cpu_experts(self)
        if self.prefetch:
            self._start_prefetch()
        for index in self.layers:
            _route(modules[index], self, index)

    def _split(self, index: int) -> CpuSplit | None:
        """Layer ``index``'s per-step split on the device (None: fixed CPU ids, or none). The tables hold an entry for
        every miss count a step can have (0 to E, the plan's last entry repeated past its end, as the fetch plan reads
        it), so that set_cpu_take can write a table of any length in place, between replays of a captured step."""
        if index not in self.cpu_take:
            return None
        eligible = torch.zeros(self.num_experts, dtype=torch.int64)
        eligible[list(self.cpu[index])] = 1
        whole, rows = self._take_rows(self.cpu_take[index])
        return CpuSplit(eligible=eligible.to(self.device), zero_row=self.zero_row,
                        take=whole.to(self.device), rows=None if index not in self.cpu_rows else rows.to(self.device))

    def _take_rows(self, take: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """([E + 1] whole experts, [E + 1] intermediate rows of one more) of the table ``take`` on the host, its last
        entry repeated to the end (entries past E: miss counts no step has, left out)."""
        padded = (list(take) + [take[-1]] * (self.num_experts + 1))[:self.num_experts + 1]
        whole = torch.tensor([round(j - fraction_of(j)) for j in padded], dtype=torch.int64)
        return whole, torch.tensor([part_rows(j, self.intermediate) for j in padded], dtype=torch.int64)

    def set_cpu_take(self, tables: dict[int, tuple[float, ...]]) -> None:
        """Split each step's misses of the per-step layers in ``tables`` (layer index -> j(m)) by those tables from
        the next step on: the device tables are written in place on the current stream (ordered after the steps
        already queued), so a captured step reads them at its next replay. Only layers that split per step, and
        fractions only where the layer's plan already splits an expert by its rows (its buffers exist); raises
        PlanError otherwise."""
        check_cpu_take(tables, self.cpu)
        for index, take in tables.items():
            split = self.tables[index].cpu_split if index in self.tables else None
            if split is None or not take:
                raise PlanError(f"routed layer {index} does not split its misses with the CPU per step; its table "
                                "cannot be changed")
            if index not in self.cpu_rows and any(fraction_of(j) for j in take):
                raise PlanError(f"routed layer {index} computes whole experts on the CPU; its table cannot take a "
                                "fraction of one")
            self.cpu_take[index] = tuple(float(j) for j in take)
            whole, rows = self._take_rows(self.cpu_take[index])
            split.take.copy_(whole)
            if split.rows is not None:
                split.rows.copy_(rows)

    def _start_prefetch(self) -> None:
        """A predictor per routed layer whose next routed layer's router can be called on its router input;
        one warning naming the pairs that cannot (they fetch after their router)."""
        self.predictors, self.prefetch_refusals = predictors_for(self.layers, self.decoder_layers, self.num_experts,
                                                                 self.device)
        reasons = [f"layer {following} from layer {self.layers[self.layers.index(following) - 1]}: {reason}"
                   for following, reason in self.prefetch_refusals.items()]
        if reasons:
            warnings.warn(f"next-layer prefetch off for {len(reasons)} routed layer(s), which fetch after their "
                          f"router ({reasons[0]}{'; ...' if len(reasons) > 1 else ''})", stacklevel=3)
        if self.predictors:
            self.top_k = self.predictors[max(self.predictors)].top_k
            self.rank_counts = torch.zeros((len(self.layers), 2, self.top_k), dtype=torch.int64, device=self.device)
            self.predicted_ids = torch.full((len(self.layers), self.fetch_slots, self.top_k), -1, dtype=torch.int64,
                                            device=self.device)
        self.set_prefetch_depth(self._depth_setting)
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)
            self.planned_events = {ordinal + 1: torch.cuda.Event() for ordinal in self.predictors
                                   if self.layers[ordinal + 1] in self.cpu_take}

    def set_prefetch_depth(self, depth: "int | dict[int, int] | None") -> None:
        """Prefetch the top ``depth`` ranks of each predicted token's k (one int for every predicted layer, or
        predicted layer index -> its depth; None: all k). The depth fixes each step's shapes: a captured step
        keeps the depth it was captured with, so capture again after changing it."""
        predicted = [self.layers[ordinal + 1] for ordinal in sorted(self.predictors)]
        self.prefetch_depth = prefetch_depths(depth, predicted, self.top_k)

    # ---- accounting ----

    @property
    def host_bytes(self) -> int:
        """Host bytes of the experts: every routed layer's E experts (page-locked with alignment padding)."""
        return len(self.layers) * self.num_experts * self.expert_bytes

    @property
    def cpu_host_bytes(self) -> int:
        """Host bytes of the CPU side beyond host_bytes: the CPU experts' copy where its dtype differs (theirs
        only) and the handoff's buffers; 0 without CPU experts."""
        return 0 if self.cpu_experts is None else self.cpu_experts.host_bytes

    @property
    def device_bytes(self) -> int:
        """GPU bytes: fetch slots and resident experts, and the staging buffer of E experts."""
        return sum(b.numel() * b.element_size() for b in (*self.buffer.values(), *self.staging.values()))

    def fetched_bytes(self) -> int:
        """Bytes decode steps gathered from host memory since the last reset, every kind (reads the device
        counter): with prefetch, wasted prefetches cross the link too."""
        return sum(self.fetched_bytes_by_kind().values())

    def fetched_bytes_by_kind(self) -> dict[str, int]:
        """FETCH_KINDS -> bytes gathered since the last reset (one read of each device counter): whole experts, but
        for an expert split by its rows only the rows the CPU did not compute."""
        counts, part_rows_by_kind = self.fetch_counts.tolist(), self.part_row_counts.tolist()
        row_bytes = self.expert_bytes // self.intermediate if self.intermediate else 0
        return {kind: count * self.expert_bytes - rows * row_bytes
                for kind, count, rows in zip(FETCH_KINDS, counts, part_rows_by_kind)}

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

    def cpu_stats(self) -> dict | None:
        """The CPU side's counters since the last reset (runtime.cpu_handoff.CpuExperts.stats: layer steps, pairs,
        the CPU's share of them, callback ms), after the host functions already enqueued ran; None without CPU
        experts. Raises the error a callback recorded, in one line."""
        return None if self.cpu_experts is None else self.cpu_experts.stats()

    def reset_counters(self) -> None:
        if self.cpu_experts is not None:
            self.cpu_experts.reset()
        self.fetch_counts.zero_()
        self.part_row_counts.zero_()
        self.rank_counts.zero_()
        self.staged_bytes = 0

    def close(self) -> None:
        """Unpin the host allocation (after the device stopped reading it); the model must not run after."""
        if self.cpu_experts is not None:
            self.cpu_experts.close()
        self._unpin()
        self.host_allocation = None
        self.host, self.host_device, self.buffer, self.staging, self.modules = {}, {}, {}, {}, {}

    # ---- the step ----

    def decode(self, module: nn.Module, index: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:
        """A step with at most fetch_slots (token, expert) pairs: gather the routed non-resident experts, then
        batched_mm over the device buffer; with CPU experts, their pairs on the host meanwhile (module docstring). No
        host synchronisation."""
        cpu = self.cpu_experts if index in self.cpu else None
        ordinal = self.ordinal[index]
        base = self.slot_base(ordinal)
        split = self.tables[index].cpu_split
        # a prefetch for this layer is pending and gathered some ranks (depth 0: predicted, nothing gathered ahead)
        ahead = index in self.pending and self.prefetch_depth.get(index, 0) > 0
        if split is not None:
            # the CPU's share of the step's misses is chosen first, then handed to the host before the join: the
            # choice needs the prefetched ids (the prefetch's plan), not their weights (its gather)
            if ahead and self.stream is not None:
                torch.cuda.current_stream(self.device).wait_event(self.planned_events[ordinal])
            pair_rows, source_ids, cpu_index, part = self._fetch_plan(index, top_k_index, base, ahead, split)
            pending = cpu.fork(index, hidden, cpu_index.view_as(top_k_index), top_k_weights, part)
        else:
            # first, right after the router: the side stream's copies to the host start while the GPU plans its
            # fetch
            pending = None if cpu is None else cpu.fork(index, hidden, top_k_index, top_k_weights)
        predicted = self._join(index)
        # the next layer's prefetch first (by default): the link stays busy while this layer plans its misses,
        # and the misses' full grid takes most of the link from the prefetch's bounded one while both run
        if not self.prefetch_after_misses:
            prefetch_next(self, ordinal, hidden)
        if predicted and self.count_ranks:
            self._count_ranks(ordinal, top_k_index)
        if split is None:
            pair_rows, source_ids, _, part = self._fetch_plan(index, top_k_index, base, ahead, None)
        words, warps = self.gather_shape
        # the misses, on the critical path: the full grid, but in a layer whose CPU experts a host node computes
        # the prefetch's programs (the same rate): the full grid holds every SM for the gather's length, and the
        # host node's side stream kernels waited for it to end (on the H100, 8 captured units of a 0.99 ms gather
        # beside a 0.5 ms host path: 1.40-1.50 ms a unit at the full grid, 1.02-1.04 at 32 programs;
        # host_node_overlap.py). The doorbell's ring ran on this stream before the gather and has no side stream.
        programs = self.prefetch_programs if index in self.cpu and cpu.handoff == "host-node" else None
        for name in self.param_names:
            gather_rows(self.host_device[index, name], self.buffer[name][base:base + self.fetch_slots], source_ids,
                        max_programs=programs, block_words=words, num_warps=warps, part=part,
                        layout=self.part_layouts.get(name))
        if self.prefetch_after_misses:
            prefetch_next(self, ordinal, hidden)
        proxy = ExpertsProxy(module, {name: self.buffer[name] for name in self.param_names})
        forward = decode_experts_forward(module)
        if cpu is None:
            return forward(proxy, hidden, pair_rows.view_as(top_k_index), top_k_weights)
        # the GPU's pairs summed in fp32, the CPU's fp32 sum added, one rounding: the experts function's arithmetic
        # with the CPU's pairs rounded as the GPU rounds them (runtime.cpu_handoff, Numerics)
        partial = gpu_partial_sum(proxy, hidden, pair_rows.reshape(-1), top_k_weights, forward)
        return cpu.join(pending, partial).to(hidden.dtype)

    def _fetch_plan(self, index: int, top_k_index: torch.Tensor, base: int, ahead: bool, split: CpuSplit | None):
        """(pair -> device-buffer row, slot -> expert to gather, the CPU's pairs or None, the part split by its rows
        or None) of a step of layer ``index``, the fetch counters added: after the layer's prefetch where
        ``ahead``, its misses split with the CPU where ``split`` (runtime.fetch_planning)."""
        ordinal, resident_row = self.ordinal[index], self.tables[index].resident_row
        prefetched = self.prefetched[ordinal] if ahead else None
        # on CUDA one kernel where the torch ops of its twin are 15 or 35 graph nodes
        plan = fused_fetch_plan if self.device.type == "cuda" else torch_fetch_plan
        planned = plan(top_k_index, resident_row, self.fetch_slots, base, self.fetch_counts, prefetched,
                       cpu_split=split, part_counts=self.part_row_counts)
        return planned if split is not None else (*planned, None, None)
    def _count_ranks(self, ordinal: int, top_k_index: torch.Tensor) -> None:
        """Per rank, how many of this step's predictions for this layer it routed the same token to."""
        num_tokens = top_k_index.shape[0]
        predicted = self.predicted_ids[ordinal, :num_tokens]  # [T, k]
        hits = (predicted.unsqueeze(-1) == top_k_index.reshape(num_tokens, 1, -1)).any(-1)  # [T, k]
        self.rank_counts[ordinal, 0].add_(hits.sum(0))
        self.rank_counts[ordinal, 1].add_(num_tokens)

    def slot_base(self, ordinal: int) -> int:
        """The first slot row of a routed layer's slot set: by its ordinal's parity when prefetching."""
        return (ordinal % 2) * self.fetch_slots if self.prefetch else 0

    def _join(self, index: int) -> bool:
        """Whether a prefetch was started for this layer in this step; the main stream then waits for it."""
        if index not in self.pending:
            return False
        self.pending.discard(index)
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return True

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
        proxy = ExpertsProxy(module, dict(self.staging))
        return prefill_experts_forward(module)(proxy, hidden, top_k_index, top_k_weights)


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
