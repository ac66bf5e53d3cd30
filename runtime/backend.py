"""Streams, events and copies behind one small interface: CUDA on a GPU, an in-order stand-in on the CPU.

The stand-in runs every operation in the order the engine issues it, each copy either at once or (with
``lazy_copies``) as late as CUDA allows: when the compute stream first waits on it or on a later copy.
Both are legal executions of the CUDA program. Copies at once give wrong outputs when a copy is issued
before its slot's last reader has run; copies as late as allowed give wrong outputs when a layer reads its
slot without waiting for its copy. So CI tests the schedule both ways without a GPU. The stand-in also logs
each operation, for tests that check the order itself.
"""

import mmap
import resource
import threading
from dataclasses import dataclass, field

import torch

from planner.errors import RuntimeUnavailableError
from planner.units import format_bytes

#: cudaHostRegisterMapped: map the registered range into the device's address space (under UVA the device
#: address is the host address)
CUDA_HOST_REGISTER_MAPPED = 0x02


def pin_error(num_bytes: int, cuda_error: int) -> RuntimeUnavailableError:
    """One line for a page-locking failure, naming the memlock limit (the usual cause in containers)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes ({format_bytes(soft)})"
    return RuntimeUnavailableError(
        f"cannot page-lock {num_bytes} bytes ({format_bytes(num_bytes)}) of host memory for the offloaded layers "
        f"(cudaHostRegister: CUDA error {cuda_error}); the memlock limit is {limit}: raise it (ulimit -l unlimited, "
        "docker --ulimit memlock=-1) or make a plan with a larger --budget, which pins less"
    )


def _pages_overlap(start: int, num_bytes: int, other_start: int, other_bytes: int) -> bool:
    """Whether two byte ranges touch a common page."""
    first, last = start // mmap.PAGESIZE, (start + num_bytes - 1) // mmap.PAGESIZE
    other_first, other_last = other_start // mmap.PAGESIZE, (other_start + other_bytes - 1) // mmap.PAGESIZE
    return first <= other_last and other_first <= last


@dataclass
class CpuEvent:
    """An event of the stand-in: remembers which operation recorded it last."""

    name: str
    recorded_at: int = -1
    #: the capture (numbered from 1) it was last recorded in, or None if outside any
    captured_in: int | None = None
    #: recorded on the copy stream (by a copy or record_on_copy)
    on_copy_stream: bool = False


@dataclass
class CpuStandIn:
    """Runs copies immediately (or, with ``lazy_copies``, when first awaited); waits are checks that the
    awaited event was recorded earlier.

    Between begin_capture and end_capture it also enforces CUDA stream capture's rules, so CI catches a
    schedule that could not be captured in a graph: no wait on an event recorded before the capture began,
    and no copy left un-joined (not waited on by the compute stream) when it ends. An event recorded inside a
    capture belongs to that graph: waiting on it outside the capture fails, as CUDA fails it (invalid argument).
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: land each copy only when the compute stream waits on it (or on a later copy), not when issued
    lazy_copies: bool = False
    log: list[tuple] = field(default_factory=list)
    #: log index where the current capture began, or None
    capture_start: int | None = None
    #: log index of the last copy not yet joined to the compute stream during a capture
    _unjoined_copy_at: int = -1
    _num_captures: int = 0
    #: (log index, destination, source) of copies issued and not yet landed, in copy-stream order
    _pending: list[tuple] = field(default_factory=list)
    #: data pointer -> bytes of the host allocations pinned and not yet unpinned (a failed load leaves none)
    pinned: dict[int, int] = field(default_factory=dict)

    def new_event(self, name: str, timing: bool = False) -> CpuEvent:
        return CpuEvent(name)

    def _record(self, event: CpuEvent, entry: tuple) -> None:
        self.log.append(entry)
        event.recorded_at = len(self.log) if entry[0] == "copy" else len(self.log) - 1
        event.captured_in = self._num_captures if self.capture_start is not None else None
        event.on_copy_stream = entry[0] in ("copy", "copy-record")

    def record_on_compute(self, event: CpuEvent) -> None:
        self._record(event, ("record", event.name))

    def record_on_copy(self, event: CpuEvent) -> None:
        self._record(event, ("copy-record", event.name))

    def _check_wait(self, stream: str, event: CpuEvent) -> None:
        assert event.recorded_at >= 0, f"{stream} waits on {event.name}, never recorded"
        current = self._num_captures if self.capture_start is not None else None
        assert event.captured_in in (None, current), (
            f"{stream} waits on {event.name}, recorded inside capture {event.captured_in}: invalid outside it")
        if self.capture_start is not None:
            assert event.recorded_at >= self.capture_start, (
                f"{stream} waits on {event.name}, recorded before the capture began: not capturable")

    def compute_waits(self, event: CpuEvent) -> None:
        self._check_wait("compute", event)
        if event.recorded_at >= self._unjoined_copy_at:
            self._unjoined_copy_at = -1  # the copy stream is in order: every copy up to the event is joined
        if event.on_copy_stream:
            self._land_copies(before=event.recorded_at)
        self.log.append(("compute-wait", event.name))

    def _land_copies(self, before: int) -> None:
        """Carry out the pending copies issued before log index ``before`` (the copy stream runs in order)."""
        while self._pending and self._pending[0][0] < before:
            _, destination, source = self._pending.pop(0)
            destination.copy_(source)

    def copy_waits(self, event: CpuEvent) -> None:
        self._check_wait("copy", event)
        self.log.append(("copy-wait", event.name))

    def copy(self, destination: torch.Tensor, source: torch.Tensor, done: CpuEvent, label: str) -> None:
        if self.capture_start is not None:
            # torch asks about the source's storage start (Tensor.is_pinned) and capture refuses an unpinned one
            assert source.untyped_storage().data_ptr() in self.pinned, (
                f"{label}: the source's storage does not begin at a pinned range; CUDA graph capture refuses it")
        if self.lazy_copies:
            self._pending.append((len(self.log), destination, source))
        else:
            destination.copy_(source)
        self._record(done, ("copy", label))
        if self.capture_start is not None:
            self._unjoined_copy_at = done.recorded_at

    def begin_capture(self) -> None:
        self.capture_start, self._unjoined_copy_at = len(self.log), -1
        self._num_captures += 1

    def end_capture(self) -> None:
        unjoined = self._unjoined_copy_at >= 0
        self.capture_start, self._unjoined_copy_at = None, -1
        assert not unjoined, "a copy issued during the capture was never joined to the compute stream"

    def synchronize(self) -> None:
        self._land_copies(before=len(self.log))

    def pin(self, tensor: torch.Tensor, mapped: bool = False) -> torch.Tensor:
        """Records the range (``mapped`` or not: host memory is the device's here); refuses what cudaHostRegister
        refuses: an empty range, or one overlapping a range
        already registered. The driver pins whole pages, so a range sharing a page with a registered one
        counts as overlapping here (stricter than needed, never looser)."""
        assert tensor.numel() > 0, "page-locking an empty allocation fails on CUDA"
        start, num_bytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for other_start, other_bytes in self.pinned.items():
            assert not _pages_overlap(start, num_bytes, other_start, other_bytes), (
                f"page-locking [{start:#x}, +{num_bytes}) overlaps the registered [{other_start:#x}, "
                f"+{other_bytes}): cudaHostRegister refuses it")
        self.pinned[start] = num_bytes
        return tensor

    def unpin(self, tensor: torch.Tensor) -> None:
        """cudaHostUnregister takes the start of a registered range: anything else is an error on CUDA."""
        assert tensor.data_ptr() in self.pinned, f"unpinning {tensor.data_ptr():#x}, which is not registered"
        del self.pinned[tensor.data_ptr()]

    def upload(self, destination: torch.Tensor, source: torch.Tensor):
        """A loading copy from a staging buffer; on the stand-in it lands at once."""
        destination.copy_(source)

    def wait_upload(self, pending) -> None:
        pass

    def alloc_device(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8)

    def elapsed_ms(self, start, end) -> float:
        return 0.0


class CudaBackend:
    """A side stream for copies; events order it against the compute (current) stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device)
        #: data pointer -> bytes of the host ranges registered (cudaHostRegister succeeded) and not unregistered
        self.pinned: dict[int, int] = {}
        self.log = None
        #: each loading thread's own stream (uploads from several readers overlap)
        self._threads = threading.local()

    def new_event(self, name: str, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def record_on_compute(self, event) -> None:
        event.record(torch.cuda.current_stream(self.device))

    def record_on_copy(self, event) -> None:
        event.record(self.copy_stream)

    def compute_waits(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def copy_waits(self, event) -> None:
        self.copy_stream.wait_event(event)

    def copy(self, destination: torch.Tensor, source: torch.Tensor, done, label: str) -> None:
        with torch.cuda.stream(self.copy_stream):
            destination.copy_(source, non_blocking=True)
            done.record(self.copy_stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def pin(self, tensor: torch.Tensor, mapped: bool = False) -> torch.Tensor:
        """Page-lock a host tensor in place, at its exact size; ``mapped``: also map it into the device's address
        space, where GPU threads read it (under UVA at the host address: runtime.routed_experts).

        torch's pinned allocator rounds each allocation up to a power of two (vLLM issue 56410: ~1.9x host
        memory); registering our own allocation costs exactly its bytes.
        """
        num_bytes = tensor.numel() * tensor.element_size()
        assert num_bytes > 0, "cudaHostRegister fails on an empty allocation"
        flags = CUDA_HOST_REGISTER_MAPPED if mapped else 0
        error = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), num_bytes, flags))
        if error != 0:
            raise pin_error(num_bytes, error)
        self.pinned[tensor.data_ptr()] = num_bytes
        return tensor

    def unpin(self, tensor: torch.Tensor) -> None:
        """Undo ``pin`` before the memory is freed."""
        torch.cuda.synchronize(self.device)
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
        self.pinned.pop(tensor.data_ptr(), None)

    def upload(self, destination: torch.Tensor, source: torch.Tensor):
        """Copy a pinned staging buffer to the device on this thread's loading stream; returns the event that
        says the staging buffer may be written again."""
        stream = getattr(self._threads, "stream", None)
        if stream is None:
            stream = self._threads.stream = torch.cuda.Stream(device=self.device)
        with torch.cuda.stream(stream):
            destination.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def wait_upload(self, pending) -> None:
        if pending is not None:
            pending.synchronize()

    def alloc_device(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, device=self.device)

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end)
