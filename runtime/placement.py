"""Where every weight goes under a plan: the GPU arena (resident params, then the offload slots), the host
allocation (offloaded layers, packed layer by layer, page-locked piece by piece) and the routed experts'
allocation. place_plan allocates and gives each param its destination; finish_placement starts the engine over
them; apply_plan does both for a model already loaded on the CPU (tests and benchmark scripts).
"""

from dataclasses import dataclass, field

import torch
from torch import nn

from planner.errors import PlanError, RuntimeUnavailableError
from planner.model.placement import align_up
from planner.plan.schema import Plan
from planner.search.schedule import PrefetchSchedule
from planner.units import format_bytes
from runtime.allocation import alloc_device_or_fail, host_allocation_or_fail
from runtime.checkpoint_reader import Destination
from runtime.cpu_resplit import resplitter_for
from runtime.engine import (OffloadEngine, PackedParam, host_offsets, host_pieces, offloaded_layouts, pack_layout,
                            packed_bytes, view_as_param)
from runtime.params import local_bytes, local_shape, local_tensor
from runtime.routed_experts import RoutedExperts
from runtime.routed_layers import allocate_for_plan
from runtime.skeleton import param_owners, set_param

def layer_stack(model: nn.Module, plan: Plan) -> list[nn.Module]:
    """The module list the plan's stack prefix names, checked against the plan's layer count."""
    try:
        stack = model.get_submodule(plan.model.stack)
    except AttributeError:
        raise PlanError(f"the model has no module {plan.model.stack!r}; the plan does not match this model") from None
    layers = list(stack)
    if len(layers) < plan.model.num_layers:
        raise PlanError(f"{plan.model.stack} has {len(layers)} layers but the plan has {plan.model.num_layers}")
    return layers[: plan.model.num_layers]


def check_selection(plan: Plan, layers: list[nn.Module]) -> None:
    """The model's params selected by the plan's segments must hold the bytes the plan moves."""
    for index in plan.offload.layers:
        packed = pack_layout(layers[index], plan.offload.params)
        moved = sum(item.num_bytes for item in packed)
        expected = plan.layers[index].offloaded_bytes
        if moved != expected:
            raise PlanError(
                f"layer {index}: the plan moves {expected} bytes but the model's params matching "
                f"{list(plan.offload.params) or 'all'} hold {moved} (transformers renames some checkpoint "
                "tensors); choose --params segments that name the same params in both, e.g. 'experts'"
            )


@dataclass
class Placement:
    """Where every param of a model goes under a plan: the device arena (resident params, then the slots) and
    the host allocation (offloaded params, packed layer by layer), page-locked in pieces, one per offloaded
    layer."""

    layers: list[nn.Module]
    layouts: list[list[PackedParam]]
    arena: torch.Tensor
    slots: list[torch.Tensor]
    #: None when the plan offloads nothing: nothing is pinned
    host: torch.Tensor | None
    #: canonical param name (model.named_parameters) -> its destination
    destinations: dict[str, Destination]
    #: each offloaded layer's packed bytes in ``host`` (engine.host_pieces), in offloaded order: the ranges
    #: page-locked one by one, and exactly what the engine copies per layer
    pieces: list[torch.Tensor] = field(default_factory=list)
    #: positions of the pieces page-locked and not unpinned since, in the order they were pinned
    pinned_pieces: list[int] = field(default_factory=list)
    #: the plan's routed layers' experts (runtime.routed_experts), allocated; started by finish_placement
    routed: RoutedExperts | None = None

    @property
    def host_pinned(self) -> bool:
        """Every piece with bytes is page-locked (an empty one cannot be)."""
        return all(k in self.pinned_pieces for k, piece in enumerate(self.pieces) if piece.numel() > 0)

    def pin_piece(self, backend, position: int) -> None:
        """Page-lock one offloaded layer's piece (the streaming loader calls this once its bytes are all in
        place, from its pin thread); a refusal names the plan's total, which the memlock limit is against."""
        piece = self.pieces[position]
        if piece.numel() == 0:
            return
        try:
            backend.pin(piece)
        except RuntimeUnavailableError as error:
            total_bytes = sum(p.numel() for p in self.pieces)
            raise RuntimeUnavailableError(f"{error} (the plan pins {total_bytes} bytes, {format_bytes(total_bytes)}, "
                                          f"in {len(self.pieces)} layers; this was layer {position + 1})") from None
        self.pinned_pieces.append(position)

    def pin_host(self, backend) -> None:
        """Page-lock every piece not yet page-locked."""
        for position in range(len(self.pieces)):
            if position not in self.pinned_pieces:
                self.pin_piece(backend, position)

    def release(self, backend) -> None:
        """Undo the allocations after a failed load: unpin the pieces pinned, then drop the memory."""
        while self.pinned_pieces:
            backend.unpin(self.pieces[self.pinned_pieces.pop()])
        if self.routed is not None:
            self.routed.close()
            self.routed = None
        self.host = self.arena = None
        self.slots, self.destinations, self.pieces = [], {}, []


def place_plan(model: nn.Module, plan: Plan, backend, pin: bool = True) -> Placement:
    """Allocate the arenas the plan describes and give every param its place; params are not touched, so
    this works on a model whose params are on the meta device. With ``pin`` the host allocation is
    page-locked here; without, the caller pins it, piece by piece (Placement.pin_piece), before it is used for
    copies."""
    layers = layer_stack(model, plan)
    check_selection(plan, layers)
    offloaded = plan.offload.layers
    layouts = offloaded_layouts(layers, offloaded, plan.offload.params)
    names = {id(p): name for name, p in model.named_parameters()}
    offloaded_names = []
    for index, layout in zip(offloaded, layouts):
        named = dict(layers[index].named_parameters())
        offloaded_names.append([names[id(named[item.name])] for item in layout])
    moving = {name for group in offloaded_names for name in group}
    # routed layers: their experts go to the routed allocation on the host, the rest of the layer stays resident
    routed = allocate_for_plan(plan, layers, backend)
    routed_names = {} if routed is None else {
        names[id(getattr(module, param))]: (index, param)
        for index, module in routed.modules.items() for param in routed.param_names}
    resident = [(name, p) for name, p in model.named_parameters() if name not in moving and name not in routed_names]
    resident_layout, resident_bytes = _arena_layout([p for _, p in resident])
    slot_bytes = max((packed_bytes(layout) for layout in layouts), default=0)
    num_slots = PrefetchSchedule(len(offloaded), plan.offload.prefetch_step).num_slots if offloaded else 0
    arena = alloc_device_or_fail(backend, resident_bytes + num_slots * align_up(slot_bytes))
    slots = [arena[resident_bytes + k * align_up(slot_bytes):][:slot_bytes] for k in range(num_slots)]
    layer_bytes = [packed_bytes(layout) for layout in layouts]
    host = host_allocation_or_fail(host_offsets(layer_bytes)[-1]) if offloaded else None
    pieces = host_pieces(host, layer_bytes) if offloaded else []
    on_device = backend.device.type != "cpu"
    destinations = {name: Destination(buffer=arena, item=item, on_device=on_device)
                    for (name, _), item in zip(resident, resident_layout)}
    for position, layout in enumerate(layouts):
        for name, item in zip(offloaded_names[position], layout):
            destinations[name] = Destination(buffer=pieces[position], item=item, on_device=False, piece=position)
    for name, key in routed_names.items():  # page-locked whole once loaded (RoutedExperts.start)
        destinations[name] = Destination(buffer=routed.host_allocation, item=routed.host_items[key], on_device=False)
    placement = Placement(layers=layers, layouts=layouts, arena=arena, slots=slots, host=host,
                          destinations=destinations, pieces=pieces, routed=routed)
    if pin:
        try:
            placement.pin_host(backend)
        except BaseException:  # a refusal part way: the pieces pinned before it are undone
            placement.release(backend)
            raise
    return placement


def finish_placement(model: nn.Module, plan: Plan, placement: Placement, backend) -> OffloadEngine:
    """With every param in its destination: buffers to the device, the engine over the offloaded layers."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device != backend.device:
                module._buffers[name] = buffer.to(backend.device)
    engine = OffloadEngine(layers=placement.layers, offloaded=plan.offload.layers,
                           prefetch_step=max(1, plan.offload.prefetch_step), params=plan.offload.params,
                           backend=backend, slots=placement.slots, host=placement.host,
                           replay_start_copies=plan.offload.replay_start_copies)
    engine.arena = placement.arena
    if placement.routed is not None:
        placement.routed.start()
        engine.routed_experts = placement.routed
        # the per-step CPU tables follow the host's measured rate (runtime.cpu_resplit): DecodeLoop reports steps
        placement.routed.resplit = resplitter_for(plan, placement.routed)
    return engine


def apply_plan(model: nn.Module, plan: Plan, backend) -> OffloadEngine:
    """Apply a plan to a model already loaded on the CPU (tests and benchmark scripts compare against it):
    each param is copied to its place and released, one at a time. ``run`` streams from the files instead
    (stream_model)."""
    placement = place_plan(model, plan, backend)
    owners = param_owners(model)
    for name, destination in placement.destinations.items():
        view = view_as_param(destination.buffer, destination.item)
        view.copy_(local_tensor(model.get_parameter(name)))
        set_param(owners[name], view)  # the loaded copy is released here
    return finish_placement(model, plan, placement, backend)


def _arena_layout(params: list[nn.Parameter]) -> tuple[list[PackedParam], int]:
    """Aligned offsets for params packed back to back, and the bytes they span."""
    layout, offset = [], 0
    for param in params:
        num_bytes = local_bytes(param)
        layout.append(PackedParam("", offset, num_bytes, param.dtype, local_shape(param)))
        offset = align_up(offset + num_bytes)
    return layout, offset
