"""Stream a checkpoint's tensors from its safetensors files straight to where a plan puts them.

The model's skeleton is built with its parameters on the meta device (buffers, e.g. rotary tables, are
computed as transformers computes them). transformers' own conversion mapping (``get_model_conversion_mapping``
and ``rename_source_key``, the functions ``from_pretrained`` uses) says which model param each checkpoint
tensor becomes. A tensor that is only renamed is read once, with ``os.preadv``, into its destination:
offloaded params into the host arena at their packed offsets, resident ones through a ring of pinned staging
buffers into the device arena. Tensors that transformers converts (per-expert tensors fused into one, split
projections) are read into host memory one target at a time, converted by transformers' own
``convert_and_load_state_dict_in_model`` and copied to their destination, so the host's working set stays
bounded by the ring plus a few converted params.

The host arena is page-locked piece by piece, one piece per offloaded layer, each once all its bytes are in
place: the readers fault its pages in while they read (in parallel), and a pin thread registers each filled
piece while the later pieces are read. Registering pages already populated is much cheaper than having one
thread fault in and zero the whole arena before any read into it may start.
"""

import math
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from planner.errors import ModelInputError
from runtime.checkpoint_reader import Destination, Reader, SourceTensor, StagingRing
from runtime.engine import PackedParam, view_as_param
from runtime.skeleton import LoadWork, convert_group, param_owners, set_param

#: bytes of one staging buffer; the ring holds one per reader thread plus one, so reads overlap uploads (large
#: enough for full-speed NVMe reads, small enough that the ring stays a few hundred MB of host memory)
STAGING_BYTES = 32 << 20
#: reader threads: enough to keep an NVMe queue busy, few enough not to thrash a 2-core CI box
NUM_READERS = min(8, max(2, os.cpu_count() or 2))
#: converted groups read or converting at once (conversions run one at a time; one more is read meanwhile)
CONVERSIONS_IN_FLIGHT = 2


@dataclass
class LoadPhases:
    """Where a streamed load's time went: seconds from the start of stream_weights until each phase ended
    (None: not reached, or nothing of that kind in this plan)."""

    #: the last resident param (device-bound) was read and its upload issued (uploads are synchronized by
    #: streamed_s)
    device_reads_done_s: float | None = None
    #: the last offloaded param (host-bound) landed in the host arena
    host_reads_done_s: float | None = None
    #: the last host piece was page-locked
    last_pin_done_s: float | None = None
    #: seconds the pin thread spent inside page-locking calls
    pin_busy_s: float = 0.0
    num_pieces_pinned: int = 0
    #: stream_weights returned: every byte in place, uploads synchronized, every piece page-locked
    streamed_s: float | None = None


def stream_weights(model: nn.Module, work: LoadWork, destinations: dict[str, Destination], backend,
                   on_bytes=None, num_readers: int = NUM_READERS, pin_piece=None,
                   phases: LoadPhases | None = None) -> None:
    """Fill every destination from the files: direct tensors by reader threads, converted groups too, with
    their conversions one at a time. Returns when every byte is in place (uploads synchronized) and, with
    ``pin_piece``, every host piece page-locked; every param then points at its destination.

    ``pin_piece(k)`` page-locks host piece k (Destination.piece); it runs in a thread of its own as soon as
    all of piece k's params have landed, while later pieces are read. A failure of it stops the readers.
    ``phases``, if given, receives the times at which the reads and the pins ended."""
    phases = phases if phases is not None else LoadPhases()
    start_s = time.perf_counter()
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    owners = param_owners(model)
    _check_destinations(work, destinations)
    needs_ring = any(d.on_device for d in destinations.values())
    ring = StagingRing(backend, num_readers + 1, STAGING_BYTES) if needs_ring else None
    has_pieces = any(d.piece is not None for d in destinations.values())
    # after the ring: a ring refused leaves no pin thread running
    pinner = PiecePinner(pin_piece if has_pieces else None, phases, start_s)
    landings = Landings(destinations, pinner, phases, start_s)
    reader = Reader(backend, ring, on_bytes)
    lock = threading.Lock()
    in_flight = threading.Semaphore(CONVERSIONS_IN_FLIGHT)
    filled = {name for _, name in work.direct} | {name for _, name, _ in work.sliced}
    slices_left = SliceCounter(work.sliced)

    def load_direct(source, name):
        pinner.check()  # a refused page-lock stops the reads still queued
        reader.to_destination(source, destinations[name], dtypes[name])
        landings.landed(name)

    def load_slice(source, name, offset_bytes):
        pinner.check()
        reader.to_destination(source, slice_destination(destinations[name], source, offset_bytes, dtypes[name]),
                              dtypes[name])
        if slices_left.landed(name):
            landings.landed(name)

    def load_group(group):
        pinner.check()
        with in_flight:  # bounds the host working set (load.loading_working_set_bytes)
            for name, tensor in convert_group(model, reader, group, work.weight_mapping, lock).items():
                reader.place_tensor(tensor, destinations[name])
                filled.add(name)
                with lock:  # drop transformers' host copy now
                    set_param(owners[name], view_as_param(destinations[name].buffer, destinations[name].item))
                landings.landed(name)

    try:
        for source, name in work.buffers:
            _load_buffer(model, name, reader.read_tensor(source))
        with ThreadPoolExecutor(max_workers=num_readers, thread_name_prefix="offload-plan-read") as pool:
            loaders = {"direct": load_direct, "slice": load_slice}
            futures = [pool.submit(loaders[kind], *task) if kind in loaders else pool.submit(load_group, task)
                       for kind, task in read_order(work, destinations)]
            _wait_all(futures)
        backend.synchronize()
        _check_filled(destinations, filled)
        pinner.finish()  # the last pieces' page-locking; raises a refusal
    finally:
        pinner.stop()  # never unpin (release) while a pin is running
        if ring is not None:
            ring.close()
        reader.close()
    assert pin_piece is None or landings.all_handed(), "a host piece was never handed to the pin thread"
    for name, destination in destinations.items():
        set_param(owners[name], view_as_param(destination.buffer, destination.item))
    phases.streamed_s = time.perf_counter() - start_s


class SliceCounter:
    """Counts the slices of each fused param still to land (reader threads call ``landed``)."""

    def __init__(self, sliced):
        self._left: dict[str, int] = {}
        for _, name, _ in sliced:
            self._left[name] = self._left.get(name, 0) + 1
        self._lock = threading.Lock()

    def landed(self, name: str) -> bool:
        """One slice of ``name`` is in place; True when it was the last."""
        with self._lock:
            self._left[name] -= 1
            return self._left[name] == 0


def slice_destination(destination: Destination, source: SourceTensor, offset_bytes: int,
                      param_dtype: torch.dtype) -> Destination:
    """The part of a fused param's destination that one per-expert tensor fills."""
    num_bytes = math.prod(source.shape) * param_dtype.itemsize
    item = PackedParam(destination.item.name, destination.item.offset_bytes + offset_bytes, num_bytes, param_dtype,
                       source.shape)
    return Destination(buffer=destination.buffer, item=item, on_device=destination.on_device,
                       piece=destination.piece)


def read_order(work: LoadWork, destinations: dict[str, Destination]) -> list[tuple[str, object]]:
    """("direct", (source, name)) and ("group", sources) in the order they are read: device-bound first, then
    host piece by piece in layer order, largest first within each. Pieces fill one after another, so each can
    be page-locked while the later ones are read."""
    def piece_of(name: str) -> int:
        destination = destinations.get(name)
        return -1 if destination is None or destination.piece is None else destination.piece

    tasks = [((piece_of(name), -source.num_bytes), ("direct", (source, name))) for source, name in work.direct]
    tasks += [((piece_of(name), -source.num_bytes), ("slice", (source, name, offset)))
              for source, name, offset in work.sliced]
    targets = work.converted_targets or ("",) * len(work.converted)
    tasks += [((piece_of(target), -sum(s.num_bytes for s in group)), ("group", group))
              for group, target in zip(work.converted, targets)]
    return [task for _, task in sorted(tasks, key=lambda pair: pair[0])]


def _check_filled(destinations: dict[str, Destination], filled: set[str]) -> None:
    """Every param must have had a tensor in the checkpoint."""
    missing = sorted(set(destinations) - filled)
    if missing:
        raise ModelInputError(f"the checkpoint has no tensor for {len(missing)} of the model's params (first: "
                              f"{missing[0]}); it does not match its config.json")


def _load_buffer(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """A persistent buffer from the checkpoint, in the buffer's dtype (from_pretrained replaces it too)."""
    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name)
    current = module._buffers[attribute]
    if tuple(tensor.shape) != tuple(current.shape):
        raise ModelInputError(f"the checkpoint's {name} has shape {list(tensor.shape)} but the model expects "
                              f"{list(current.shape)}; the checkpoint does not match its config.json")
    module._buffers[attribute] = tensor.to(current.dtype)


def _check_destinations(work: LoadWork, destinations: dict[str, Destination]) -> None:
    """Each direct tensor must fill its param exactly: a shard replaced since the plan was checked could hold
    another shape."""
    for source, name in work.direct:
        item = destinations[name].item
        if source.shape != item.shape:
            raise ModelInputError(f"{source.path}: tensor {source.name} has shape {list(source.shape)} but the model "
                                  f"expects {list(item.shape)}; the checkpoint changed since the plan was made: "
                                  "regenerate the plan with offload-plan make")


class Landings:
    """Counts params into their places: a host piece goes to the pin thread when its last param has landed,
    and the phase record keeps the time of the last device-bound and host-bound landing."""

    def __init__(self, destinations: dict[str, Destination], pinner, phases: LoadPhases, start_s: float):
        self._destinations = destinations
        self._pinner = pinner
        self._phases = phases
        self._start_s = start_s
        #: piece -> names of its params not landed yet; a piece leaves when handed to the pin thread
        self._waiting: dict[int, set[str]] = {}
        for name, destination in destinations.items():
            if destination.piece is not None:
                self._waiting.setdefault(destination.piece, set()).add(name)
        self._lock = threading.Lock()

    def landed(self, name: str) -> None:
        """``name``'s bytes are all in place (called from reader threads)."""
        piece = self._destinations[name].piece
        elapsed_s = time.perf_counter() - self._start_s
        with self._lock:
            field = "device_reads_done_s" if piece is None else "host_reads_done_s"
            setattr(self._phases, field, max(elapsed_s, getattr(self._phases, field) or 0.0))
            waiting = self._waiting.get(piece)
            if waiting is None:
                return
            waiting.discard(name)
            if not waiting:
                del self._waiting[piece]
                self._pinner.submit(piece)

    def all_handed(self) -> bool:
        return not self._waiting


class PiecePinner:
    """Page-locks host pieces in a thread of its own, in the order they fill. Its failure (a memlock refusal)
    is raised to the readers by check(), so the load stops within the reads in flight, and by finish()."""

    def __init__(self, pin_piece, phases: LoadPhases, start_s: float):
        self._pin_piece = pin_piece
        self._phases = phases
        self._start_s = start_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = None
        if pin_piece is not None:
            self._thread = threading.Thread(target=self._run, name="offload-plan-pin", daemon=True)
            self._thread.start()

    def submit(self, piece: int) -> None:
        if self._thread is not None:
            self._queue.put(piece)

    def _run(self) -> None:
        while (piece := self._queue.get()) is not None:
            if self._error is not None or self._stopping:
                continue  # after a failure (ours or a reader's), nothing more gets pinned
            began_s = time.perf_counter()
            try:
                self._pin_piece(piece)
            except BaseException as error:  # handed to the readers, raised in the caller's thread
                self._error = error
                continue
            ended_s = time.perf_counter()
            self._phases.pin_busy_s += ended_s - began_s
            self._phases.num_pieces_pinned += 1
            self._phases.last_pin_done_s = ended_s - self._start_s

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """After the reads: wait for the pieces queued, then raise a failure."""
        self._join()
        self.check()

    def stop(self) -> None:
        """Skip the pieces not yet pinned and wait for the one being pinned (the caller releases after)."""
        self._stopping = True
        self._join()

    def _join(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


def _wait_all(futures) -> None:
    """Wait for every read; the first failure cancels what has not started and is raised."""
    for future in futures:
        error = future.exception()
        if error is not None:
            for other in futures:
                other.cancel()
            raise error
