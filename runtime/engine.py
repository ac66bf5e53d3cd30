"""Apply a plan's offload to a model's layer stack: packed host buffers, fixed GPU slots, prefetch hooks.

Each offloaded layer's selected params are packed into one contiguous host buffer (one copy moves the
layer) and re-pointed, permanently, at views of the layer's slot: addresses never change, which CUDA graphs
and torch.compile need. Hooks around each offloaded layer's forward make the compute stream wait for the
layer's copy, record that the layer has read its slot, and issue the copies that planner.search.schedule says
become possible at that point.

Under torch.compile the hooks are traced into the graph as one opaque op, ``offload_plan::layer_boundary``,
which runs the same engine code when the compiled step runs. The op claims to mutate the hidden states
passing the boundary (it leaves them as they are): that data dependence is what keeps Inductor from moving
a layer's kernels across its wait or its copies, and Inductor re-inplaces it, so it costs no copy.
"""

import itertools
import mmap
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from planner.model.layout import param_selected
from planner.model.placement import ALIGN_BYTES, align_up
from planner.search.schedule import PrefetchSchedule
from runtime.params import local_bytes, local_shape, repoint

#: each offloaded layer's bytes start on a page of their own in the host allocation: layers are page-locked
#: one by one (cudaHostRegister pins whole pages and refuses a range overlapping one already registered)
HOST_PIECE_ALIGN_BYTES = max(ALIGN_BYTES, mmap.PAGESIZE)


@dataclass(frozen=True)
class PackedParam:
    """Where one offloaded param lives inside its layer's packed bytes."""

    name: str
    offset_bytes: int
    num_bytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class OffloadStats:
    """Counters over the steps since the last ``take``."""

    bytes_copied: int = 0
    num_copies: int = 0
    stall_ms: float = 0.0
    copy_ms: float = 0.0
    #: (start, end) timing event pairs not yet read
    _stall_events: list = field(default_factory=list)
    _copy_events: list = field(default_factory=list)


def backend_unpin(backend, pieces: list[torch.Tensor]) -> None:
    """Finalizer body: must not reference the engine, or the engine would never be collected."""
    for piece in pieces:
        backend.unpin(piece)


def pack_layout(layer: nn.Module, segments: tuple[str, ...]) -> list[PackedParam]:
    """The selected params of one layer, in name order, at aligned offsets."""
    packed, offset = [], 0
    for name, param in sorted(layer.named_parameters(), key=lambda item: item[0]):
        if not param_selected(name, segments):
            continue
        num_bytes = local_bytes(param)  # a tensor-parallel rank's shard, not the whole DTensor
        packed.append(PackedParam(name, offset, num_bytes, param.dtype, local_shape(param)))
        offset = align_up(offset + num_bytes)
    return packed


def packed_bytes(packed: list[PackedParam]) -> int:
    """Bytes a packed layer occupies (its last param unpadded)."""
    return packed[-1].offset_bytes + packed[-1].num_bytes if packed else 0


def offloaded_layouts(layers: list[nn.Module], offloaded: tuple[int, ...], params: tuple[str, ...]):
    """The packed layout of each offloaded layer, in offloaded order."""
    return [pack_layout(layers[i], params) for i in offloaded]


def host_offsets(layer_bytes: list[int]) -> list[int]:
    """Start of each offloaded layer's packed bytes in the host allocation, and (last) its total bytes: each
    layer on pages of its own (HOST_PIECE_ALIGN_BYTES), so each can be page-locked apart."""
    offsets = [0]
    for num_bytes in layer_bytes:
        offsets.append(offsets[-1] + align_up(num_bytes, HOST_PIECE_ALIGN_BYTES))
    return offsets


def host_pieces(host: torch.Tensor, layer_bytes: list[int]) -> list[torch.Tensor]:
    """Each offloaded layer's packed bytes in ``host`` (a page-aligned allocation laid out by host_offsets):
    what one copy reads, and what is page-locked as one piece. Disjoint, none sharing a page."""
    offsets = host_offsets(layer_bytes)
    return [_own_storage(host, offsets[k], num_bytes) for k, num_bytes in enumerate(layer_bytes)]


def _own_storage(host: torch.Tensor, offset_bytes: int, num_bytes: int) -> torch.Tensor:
    """``host[offset:offset + num_bytes]`` as a tensor whose storage begins there (it keeps ``host`` alive).
    torch asks whether a CPU tensor is pinned about its storage's first byte (Tensor.is_pinned, and CUDA graph
    capture refuses a copy from an unpinned one): a plain view's storage begins at the allocation's start,
    which no piece's registration covers."""
    if num_bytes == 0:
        return host[offset_bytes:offset_bytes]
    return torch.frombuffer(host.numpy(), dtype=torch.uint8, count=num_bytes, offset=offset_bytes)


def pinnable(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """The pieces that are page-locked: all but empty ones (cudaHostRegister fails on an empty range)."""
    return [piece for piece in pieces if piece.numel() > 0]


def view_as_param(buffer: torch.Tensor, item: PackedParam) -> torch.Tensor:
    return buffer[item.offset_bytes : item.offset_bytes + item.num_bytes].view(item.dtype).view(item.shape)


#: live engines by key, for the compiled op (a graph can hold ints, not Python objects)
_ENGINES: "weakref.WeakValueDictionary[int, OffloadEngine]" = weakref.WeakValueDictionary()
_ENGINE_KEYS = itertools.count()


@torch.library.custom_op("offload_plan::layer_boundary", mutates_args=("hidden",))
def layer_boundary(hidden: torch.Tensor, engine_key: int, position: int, before: bool) -> None:
    """Enter (``before``) or leave offloaded position ``position`` of an engine; ``hidden`` is untouched."""
    engine = _ENGINES[engine_key]
    if before:
        engine._before_layer(position)
    else:
        engine._after_layer(position)


@layer_boundary.register_fake
def _layer_boundary_fake(hidden, engine_key, position, before) -> None:
    return None


def _hidden_states(value):
    """The hidden-states tensor among a layer's inputs or outputs (the first tensor)."""
    if isinstance(value, torch.Tensor):
        return value
    return next(item for item in value if isinstance(item, torch.Tensor))


class OffloadEngine:
    """Owns the host buffers, slots, events and hooks for one model's offloaded layers."""

    def __init__(
        self,
        *,
        layers: list[nn.Module],
        offloaded: tuple[int, ...],
        prefetch_step: int,
        params: tuple[str, ...],
        backend,
        slots: list[torch.Tensor],
        host: torch.Tensor | None,
        replay_start_copies: int = 0,
    ):
        """``slots``: one uint8 device buffer per slot, each at least as long as the largest packed layer;
        ``host``: the uint8 allocation already holding every offloaded layer's packed params at
        ``host_offsets``, each layer's piece page-locked (None when nothing is offloaded); the engine unpins
        the pieces when it is collected or closed;
        ``replay_start_copies``: in graph mode, how many of the copies wrapping past a replay the next replay
        issues as it begins (PrefetchSchedule.replay_boundary; the plan's offload.replay_start_copies)."""
        self.backend = backend
        self.offloaded = offloaded
        self.schedule = PrefetchSchedule(len(offloaded), prefetch_step)
        #: in graph mode: the wrapped copies a replay's last step joins, and those the next replay issues
        self.joined_positions, self.deferred_positions = self.schedule.replay_boundary(replay_start_copies)
        self.issue_after = self.schedule.issue_after()
        self.layouts = offloaded_layouts(layers, offloaded, params)
        self.layer_bytes = [packed_bytes(p) for p in self.layouts]
        self.stats = OffloadStats()
        self.timing = False
        #: steps are CUDA-graph replays: the first slots are loaded when a replay begins (see set_graph_mode)
        self.graph_mode = False
        #: in graph mode, the last step joined its wrapped copies: the joined positions need no wait
        self._first_slots_joined = False
        #: in graph mode, the step running (or, between steps, the last one run) ends its replay: it leaves the
        #: deferred positions' copies to the next replay, so they are pending until that one begins
        self._replay_last = False
        self._hooks = []
        #: the plan's routed layers' experts (runtime.routed_experts.RoutedExperts), set by the loader; closed
        #: with the engine
        self.routed_experts = None
        self.key = next(_ENGINE_KEYS)
        _ENGINES[self.key] = self
        self.host_buffers = self._adopt_host(host)
        assert len(slots) == self.schedule.num_slots and all(s.numel() >= self.slot_bytes for s in slots)
        self.slots = slots
        self._point_params_at_slots(layers)
        self.copy_done = [backend.new_event(f"copy-done-{k}") for k in range(len(offloaded))]
        self.reader_done = [backend.new_event(f"reader-done-{k}") for k in range(len(offloaded))]
        for position in range(self.schedule.num_slots):
            self._copy(position)
        self._install_hooks(layers)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one GPU slot."""
        return max(self.layer_bytes, default=0)

    @property
    def host_bytes(self) -> int:
        """Bytes of pinned host memory holding offloaded params."""
        return sum(self.layer_bytes)

    def _adopt_host(self, host: torch.Tensor | None) -> list[torch.Tensor]:
        """Views of each offloaded layer's packed bytes in ``host``; unpinned before the memory can be freed."""
        self._host_allocation = host
        if host is None:
            assert not self.offloaded, "offloaded layers need a host allocation"
            self._unpin = lambda: None
            return []
        assert host.numel() >= host_offsets(self.layer_bytes)[-1]
        pieces = host_pieces(host, self.layer_bytes)
        # A freed range that stays registered could be handed to a later allocation, and copies from it
        # would read the old pages: unpin first.
        self._unpin = weakref.finalize(self, backend_unpin, self.backend, pinnable(pieces))
        return pieces

    def _point_params_at_slots(self, layers) -> None:
        for position, layer_index in enumerate(self.offloaded):
            slot = self.slots[self.schedule.slot_of(position)]
            named = dict(layers[layer_index].named_parameters())
            for item in self.layouts[position]:
                repoint(named[item.name], view_as_param(slot, item))

    def _copy(self, position: int) -> None:
        """Copy one offloaded layer's packed params from host into its slot, on the copy stream."""
        num_bytes = self.layer_bytes[position]
        slot = self.slots[self.schedule.slot_of(position)]
        start = end = None
        if self.timing:
            start, end = self.backend.new_event("t", timing=True), self.backend.new_event("t", timing=True)
            self.backend.record_on_copy(start)
        self.backend.copy(slot[:num_bytes], self.host_buffers[position], self.copy_done[position],
                          f"layer-{self.offloaded[position]}")
        if self.timing:
            self.backend.record_on_copy(end)
            self.stats._copy_events.append((start, end))
        self.stats.bytes_copied += num_bytes
        self.stats.num_copies += 1

    @property
    def copy_bytes_per_step(self) -> int:
        """Bytes the schedule copies over the link in one step."""
        return sum(self.layer_bytes[k] for k in self.schedule.copied_positions())

    def set_graph_mode(self, on: bool) -> None:
        """Switch between eager steps and steps captured in (and replayed from) a CUDA graph.

        Eagerly, the copies for the next step's first S positions run on into that step, and its layers wait
        on their events. A replay cannot end with copies in flight nor wait on an event recorded outside its
        capture, so in graph mode the last step of each replay joins those copies at its end (finish_step with
        ``join``) and the next replay's joined positions need no wait: their slots are loaded before it begins.
        The deferred positions' copies are not issued by the last step but by the next replay as it begins
        (start_step), so the link works while that replay computes up to the first slot it frees. Steps
        inside a replay wrap as eagerly.
        """
        if on == self.graph_mode:
            return
        if on and self.timing:
            raise RuntimeError("timing events cannot be captured; turn timing off before graph mode")
        self.graph_mode = on
        if on:
            # Join every slot's last copy, not only those wrapping into the next step: a slot that holds one
            # layer for good was loaded once, outside any capture, and a wait on that load event inside a
            # capture is 'dependency created on uncaptured work' (cudaErrorStreamCaptureIsolation).
            for position in range(self.schedule.num_slots):
                self.backend.compute_waits(self.copy_done[position])
            self._first_slots_joined = True
        else:
            self._mark_first_slots_loaded()

    def _mark_first_slots_loaded(self) -> None:
        """Leaving graph mode: eager steps wait on the first S positions' copy-done events, but those were last
        recorded inside a capture, and CUDA rejects a wait on such an event outside its graph. The slots are
        loaded (every replay joins them at its end), so record the events afresh, after that join."""
        loaded = self.backend.new_event("graph-mode-exit")
        self.backend.record_on_compute(loaded)
        self.backend.copy_waits(loaded)
        for position in range(self.schedule.num_slots):
            if self._replay_last and position in self.deferred_positions:
                self._copy(position)  # the last replay left it to a next one
            else:
                self.backend.record_on_copy(self.copy_done[position])
        self._replay_last = False

    def set_replay_start_copies(self, count: int) -> None:
        """Change how many wrapped copies each replay issues as it begins (benchmarks compare splits on one
        engine); only outside graph mode, where no replay has a copy left pending."""
        if self.graph_mode:
            raise RuntimeError("change replay_start_copies outside graph mode")
        self.joined_positions, self.deferred_positions = self.schedule.replay_boundary(count)

    def start_step(self, first: bool, last: bool) -> None:
        """Start of a step; ``first``/``last``: it begins/ends its CUDA-graph replay (ignored eagerly). A
        replay's first step issues the deferred positions' copies at once: their slots' last readers ran in
        an earlier replay, so they wait only for the replay to begin."""
        if not self.graph_mode:
            return
        if first and self.deferred_positions:
            begun = self.backend.new_event("replay-start")
            self.backend.record_on_compute(begun)
            self.backend.copy_waits(begun)
            for position in self.deferred_positions:
                self._copy(position)
        self._replay_last = last

    def finish_step(self, join: bool = True) -> None:
        """End of a step. In graph mode with ``join`` (a replay's last step), the compute stream waits for the
        copies that wrap into the next step; without, the next step waits for them layer by layer."""
        if self.graph_mode:
            if join:
                self._join_wrapped_copies()
            self._first_slots_joined = join

    def _loaded_before_step(self, position: int) -> bool:
        """In graph mode: the position's slot was loaded before this step began, so it needs no wait (a wait
        would be on an event recorded outside the capture). True for a slot that holds one layer for good
        (joined when graph mode began) and, after a joining step, for the joined positions."""
        if not self.schedule.needs_copy(position):
            return True
        return self._first_slots_joined and position in self.joined_positions

    def _join_wrapped_copies(self) -> None:
        for position in self.joined_positions:
            self.backend.compute_waits(self.copy_done[position])

    def _before_layer(self, position: int) -> None:
        if self.graph_mode and self._loaded_before_step(position):
            return
        if not self.timing:
            self.backend.compute_waits(self.copy_done[position])
            return
        start, end = self.backend.new_event("t", timing=True), self.backend.new_event("t", timing=True)
        self.backend.record_on_compute(start)
        self.backend.compute_waits(self.copy_done[position])
        self.backend.record_on_compute(end)
        self.stats._stall_events.append((start, end))

    def _after_layer(self, position: int) -> None:
        self.backend.record_on_compute(self.reader_done[position])
        for target in self.issue_after[position]:
            if self.graph_mode and self._replay_last and target in self.deferred_positions:
                continue  # the next replay issues it as it begins
            _, reader = self.schedule.previous_reader(target)
            self.backend.copy_waits(self.reader_done[reader])
            self._copy(target)

    def _pre_hook(self, position: int, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():
            hidden = _hidden_states(args) if args else kwargs["hidden_states"]
            torch.ops.offload_plan.layer_boundary(hidden, self.key, position, True)
        else:
            self._before_layer(position)

    def _post_hook(self, position: int, output) -> None:
        if torch.compiler.is_compiling():
            torch.ops.offload_plan.layer_boundary(_hidden_states(output), self.key, position, False)
        else:
            self._after_layer(position)

    def _install_hooks(self, layers) -> None:
        for position, layer_index in enumerate(self.offloaded):
            module = layers[layer_index]
            self._hooks.append(module.register_forward_pre_hook(
                lambda m, args, kwargs, p=position: self._pre_hook(p, args, kwargs), with_kwargs=True))
            self._hooks.append(module.register_forward_hook(
                lambda m, args, output, p=position: self._post_hook(p, output)))

    def remove_hooks(self) -> None:
        """Detach the hooks (the params stay in their slots)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def close(self) -> None:
        """Detach hooks and unpin the host memory; the model must not run afterwards."""
        self.remove_hooks()
        self._unpin()
        if self.routed_experts is not None:
            self.routed_experts.close()
            self.routed_experts = None
        self._host_allocation = None
        self.host_buffers = []

    def take_stats(self) -> OffloadStats:
        """Counters since the last call; synchronizes to read timing events."""
        self.backend.synchronize()
        stats = self.stats
        stats.stall_ms = sum(self.backend.elapsed_ms(s, e) for s, e in stats._stall_events)
        stats.copy_ms = sum(self.backend.elapsed_ms(s, e) for s, e in stats._copy_events)
        stats._stall_events, stats._copy_events = [], []
        self.stats = OffloadStats()
        return stats
