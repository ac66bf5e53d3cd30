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
"""

import math
import types
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from planner.errors import PlanError, RuntimeUnavailableError
from planner.placement import ALIGN_BYTES, align_up
from planner.units import format_bytes
from runtime.engine import PackedParam, backend_unpin, view_as_param

#: 32-bit words each Triton program copies (4 warps: 32 words, eight 16-byte loads, per thread)
GATHER_BLOCK_WORDS = 4096


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
                 backend, adopt_host: bool = False):
        """Allocate (nothing read, nothing pinned yet): ``modules``: layer index -> its experts module (its
        params may be on the meta device: only their shapes are read here); ``resident``: layer index -> expert
        ids kept on the GPU; ``fetch_slots``: distinct experts one decode step can fetch (the plan's
        experts.fetch_slots); ``adopt_host``: page-lock the params' own host tensors in place (they must be
        contiguous CPU tensors, each its storage) rather than copy them into one allocation: a benchmark whose
        model already sits in host memory holds no second copy. ``start`` then takes the weights and routes
        the layers."""
        self.backend, self.device = backend, backend.device
        self.modules = dict(modules)
        self.layers = sorted(modules)
        self.fetch_slots = fetch_slots
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
        #: None when adopting the params' own host tensors
        self.host_allocation = None if adopt_host else self._allocate_host()
        #: (layer, param) -> where its [E, *row] tensor sits in host_allocation (the loader's destinations)
        self.host_items = {} if adopt_host else self._host_layout()
        num_rows = self.fetch_slots + sum(len(r) for r in self.resident.values())
        #: param -> [fetch_slots + resident rows, *row] on the device: fetch slots first, then each routed
        #: layer's resident experts in layer order
        self.buffer = {name: self._device_rows(name, num_rows) for name in self.param_names}
        #: param -> [E, *row] on the device: one routed layer's experts during a prefill chunk
        self.staging = {name: self._device_rows(name, self.num_experts) for name in self.param_names}
        #: [1] int64 on the device: distinct non-resident experts gathered by decode steps since reset
        self.fetched_experts = torch.zeros(1, dtype=torch.int64, device=self.device)
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
        on an aligned offset), page-aligned; a tensor whose storage begins there: torch asks is_pinned about a
        storage's first byte, and prefill's copies from it are asynchronous only when pinned."""
        from runtime.engine import _own_storage
        from runtime.load import host_allocation_or_fail

        num_bytes = align_up(len(self.layers) * len(self.param_names) * ALIGN_BYTES + self.host_bytes)
        allocation = host_allocation_or_fail(num_bytes, "the routed experts", "make a plan that routes fewer layers")
        return _own_storage(allocation, 0, num_bytes)

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
        from runtime.load import alloc_device_or_fail

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
        row = self.fetch_slots
        for index in self.layers:
            ids = list(self.resident[index])
            resident_row = torch.full((self.num_experts,), -1, dtype=torch.int64)
            resident_row[ids] = torch.arange(row, row + len(ids))
            for name in self.param_names:
                self.buffer[name][row:row + len(ids)].copy_(self.host[index, name][ids])
            self.tables[index] = RouteTables(resident_row=resident_row.to(self.device))
            row += len(ids)
        for index in self.layers:
            _route(modules[index], self, index)

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
        """Bytes decode steps gathered from host memory since the last reset (reads the device counter)."""
        return int(self.fetched_experts.item()) * self.expert_bytes

    def reset_counters(self) -> None:
        self.fetched_experts.zero_()
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
        pair_rows, source_ids = plan_fetch(top_k_index, self.tables[index].resident_row, self.fetch_slots)
        self.fetched_experts.add_((source_ids >= 0).sum())
        for name in self.param_names:
            gather_rows(self.host_device[index, name], self.buffer[name], source_ids)
        proxy = _Proxy(module, {name: self.buffer[name] for name in self.param_names})
        return batched_mm_forward()(proxy, hidden, pair_rows.view_as(top_k_index), top_k_weights)

    def prefill(self, module: nn.Module, index: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """A chunk with more pairs than fetch slots: the layer's E experts into the staging buffer from the
        host, then the configured experts implementation over it. No host sync either
        (a decode step with more sequences than planned lands here, captured or not); ``staged_bytes`` counts
        eager calls only."""
        for name in self.param_names:
            # one copy-engine copy of all E (the host holds the resident ones too): one large copy runs at the
            # link's rate, where copying around the resident rows would take up to R + 1 smaller ones
            self.staging[name].copy_(self.host[index, name], non_blocking=True)
        self.staged_bytes += self.num_experts * self.expert_bytes
        proxy = _Proxy(module, dict(self.staging))
        return prefill_experts_forward(module)(proxy, hidden, top_k_index, top_k_weights)


def plan_fetch(top_k_index: torch.Tensor, resident_row: torch.Tensor, fetch_slots: int):
    """(pair -> device-buffer row [S], fetch slot -> expert id to gather or -1 [fetch_slots]) for S <=
    fetch_slots routed pairs, in fixed shapes: each distinct non-resident expert gets one slot, numbered in
    ascending expert order; resident experts map to their resident rows."""
    ids = top_k_index.reshape(-1)  # [S]
    sorted_ids, order = torch.sort(ids)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    resident = resident_row[sorted_ids]  # [S], -1 where not resident
    new = first & (resident < 0)
    slot = torch.cumsum(new, 0) - 1  # the distinct non-resident expert's slot, repeated over its pairs
    rows_sorted = torch.where(resident >= 0, resident, slot)
    pair_rows = torch.empty_like(rows_sorted)
    pair_rows[order] = rows_sorted
    # slot -> expert: written by each expert's first pair; others write to a spare last entry
    sources = torch.full((fetch_slots + 1,), -1, dtype=torch.int64, device=ids.device)
    sources.scatter_(0, torch.where(new, slot, fetch_slots), torch.where(new, sorted_ids, -1))
    return pair_rows, sources[:fetch_slots]


def gather_rows(source: torch.Tensor, destination: torch.Tensor, source_ids: torch.Tensor) -> None:
    """destination[k] = source[source_ids[k]] for every k with source_ids[k] >= 0; the others untouched.
    ``source`` [E, ...] may be host memory mapped into the device (UVA): on CUDA a Triton kernel reads only the
    rows asked for; on the CPU (tests) the same semantics in torch."""
    if destination.device.type == "cuda":
        _gather_rows_triton(source, destination, source_ids)
        return
    take = (source_ids >= 0).nonzero().flatten()
    destination[take] = source[source_ids[take]]


def _gather_rows_triton(source: torch.Tensor, destination: torch.Tensor, source_ids: torch.Tensor) -> None:
    row_bytes = source[0].numel() * source.element_size()
    words = 4 if row_bytes % 4 == 0 else 1
    dtype = torch.int32 if words == 4 else torch.uint8
    row_words = row_bytes // words
    source_words = source.view(torch.uint8).view(dtype) if source.dtype != dtype else source
    destination_words = destination.view(torch.uint8).view(dtype) if destination.dtype != dtype else destination
    grid = (source_ids.numel(), -(-row_words // GATHER_BLOCK_WORDS))
    _gather_kernel()[grid](source_words, destination_words, source_ids, row_words, BLOCK=GATHER_BLOCK_WORDS)


_KERNEL = {}


def _gather_kernel():
    """The Triton gather, compiled on first use (triton ships with CUDA builds of torch)."""
    if "gather" not in _KERNEL:
        import triton
        import triton.language as tl

        @triton.jit
        def gather(source, destination, source_ids, row_words, BLOCK: tl.constexpr):
            slot = tl.program_id(0)
            chunk = tl.program_id(1)
            expert = tl.load(source_ids + slot)
            if expert < 0:  # an unused slot or one already resident: nothing crosses the link
                return
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
                         stack: str = "model.layers", adopt_host: bool = False) -> RoutedExperts | None:
    """Route-fetch the experts of the layers ``routed`` names (layer index -> resident expert ids): their
    fused expert params move to page-locked, mapped host memory (resident ones also to the GPU) and their
    forward fetches what each step routes to. Non-expert params are left where they are (the caller puts
    them on the GPU); ``adopt_host``: see RoutedExperts. None when ``routed`` is empty."""
    if not routed:
        return None
    layers = list(model.get_submodule(stack))
    bad = [index for index in routed if not 0 <= index < len(layers)]
    if bad:
        raise PlanError(f"routed layers {bad} are outside the model's {len(layers)} layers")
    modules = {index: experts_module(layers[index], index) for index in routed}
    experts = RoutedExperts(modules=modules, resident=routed, fetch_slots=fetch_slots, backend=backend,
                            adopt_host=adopt_host)
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
    return RoutedExperts(modules=modules, resident=routed, fetch_slots=fetch_slots, backend=backend)


def routed_from_plan(plan) -> tuple[dict[int, tuple[int, ...]], int]:
    """(layer -> resident ids, fetch_slots) of the plan's routed layers; empty where the plan has no
    ``experts`` section (dense plans, plans made before it) or routes no layer. Read defensively: the
    planner's dataclasses (planner.plan ExpertsPlan / ExpertLayer) may lack fields in older plans."""
    experts = getattr(plan, "experts", None)
    if experts is None:
        return {}, 0
    routed = {layer.index: tuple(layer.resident) for layer in getattr(experts, "layers", ())
              if getattr(layer, "regime", None) == "routed"}
    return routed, int(getattr(experts, "fetch_slots", 0) or 0)
