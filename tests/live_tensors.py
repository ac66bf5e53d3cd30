"""Which tensors a forward holds at its peak, observed on any device (the CPU included).

``LiveTensors`` is a TorchDispatchMode: every storage an operator creates inside it (an output that aliases
none of the operator's inputs) is counted live until the storage dies, through a weakref on the storage
(PyTorch keeps one Python object per storage, so the weakref fires when the storage is freed, not when a view
goes). Tensors made before the mode (weights, a warmed-up cache) are not counted, and neither is what a kernel
allocates for itself; what remains is what transformers' Python holds, the set planner.model.activations models.
``window()`` gives the largest live set within a span of the forward (a module's call, through hooks), with
each storage's creating operator and the line of the model's source that called it.
"""

import traceback
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True, kw_only=True)
class LiveStorage:
    """One storage alive at a peak."""

    num_bytes: int
    #: the operator that created it (aten.mm.default, ...)
    operator: str
    #: "file.py:line function" of the innermost frame outside torch that made it
    source: str


def _source_line() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("live_tensors.py"):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"
    return "?"


class LiveTensors(TorchDispatchMode):
    """Live storages created inside the mode, and the largest set of them alive at once since ``reset_peak``."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, LiveStorage] = {}
        self._live_bytes = 0
        self.peak_bytes = 0
        self.peak: tuple[LiveStorage, ...] = ()

    @property
    def live_bytes(self) -> int:
        """Bytes of the counted storages alive now."""
        return self._live_bytes

    def reset_peak(self) -> None:
        """Start a new span: its peak is what is alive now, until more is."""
        self.peak_bytes, self.peak = self._live_bytes, tuple(self._live.values())

    def _forget(self, key: int) -> None:
        self._live_bytes -= self._live.pop(key).num_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        grew = False
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if not key or key in inputs or key in self._live:  # a view, an in-place result, or counted already
                continue
            self._live[key] = LiveStorage(num_bytes=storage.nbytes(), operator=str(func), source=_source_line())
            self._live_bytes += storage.nbytes()
            weakref.finalize(storage, self._forget, key).atexit = False
            grew = True
        if grew and self._live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak = self._live_bytes, tuple(self._live.values())
        return out

    @contextmanager
    def window(self, module: torch.nn.Module, peaks: list[tuple[int, tuple[LiveStorage, ...]]]):
        """While active, each call of ``module`` appends (peak bytes, live storages at that peak) to ``peaks``."""
        handles = (module.register_forward_pre_hook(lambda *_: self.reset_peak()),
                   module.register_forward_hook(lambda *_: peaks.append((self.peak_bytes, self.peak))))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
