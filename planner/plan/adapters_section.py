"""The plan's adapters section (make --adapter): the LoRA adapters served beside the model, their GPU slots and
pinned pool, and the wait of a batch whose adapters are not loaded."""

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class AdapterRow:
    """One LoRA adapter of the plan."""

    name: str
    #: the folder or hub id as given
    source: str
    #: hub commit the files were read at; null for local folders
    revision: str | None
    #: sha256 over the tensors' names, dtypes and shapes and the config's rank and alpha
    fingerprint: str
    rank: int
    alpha: float
    #: adapted module names (last name segments)
    target_modules: tuple[str, ...]
    num_tensors: int
    bytes: int
    #: copy time of this adapter over the whole link
    copy_ms: float


@dataclass(frozen=True, kw_only=True)
class AdaptersSection:
    """LoRA adapters served beside the model (make --adapter): GPU slots, the pinned pool, and the wait of a
    batch whose adapters are not loaded, blocking against pipelined (planner.model.adapters says how it is modelled)."""

    #: adapters kept on the GPU at once (the engines' max-loras per batch)
    num_slots: int
    #: one slot holds the largest adapter
    slot_bytes: int
    #: num_slots x slot_bytes, counted in memory.total_gpu_bytes
    gpu_bytes: int
    #: every adapter, pinned in host memory (slots hold copies)
    host_pinned_bytes: int
    max_rank: int
    #: adapters a new batch misses: min(slots, sequences, adapters)
    num_missing: int
    #: one slot-sized adapter over the whole link
    copy_ms: float
    #: one adapter over the link's share left by the running steps' weight copies
    shared_copy_ms: float
    #: blocking (copy all, then compute): every request waits this; the compute stream idles as long
    blocking_wait_ms: float
    #: pipelined (each request starts when its adapter lands): the first request's wait, compute idle as long
    pipelined_first_wait_ms: float
    #: pipelined: the last request's wait
    pipelined_last_wait_ms: float
    #: pipelined: a step while adapters load (longer than the plan's only where the weights give up link time)
    pipelined_step_ms: float
    #: the loading mode run serves: the one planner.search.adapter_stream predicts faster over the stream below
    mode: str
    #: that stream: stream_num_batches batches of stream_requests_per_batch requests over distinct adapters
    stream_requests_per_batch: int
    stream_num_batches: int
    #: its predicted total, each mode (the offloaded weights' copies on the link too)
    blocking_stream_ms: float
    pipelined_stream_ms: float
    #: the other mode's total over the chosen one's, less 1
    mode_margin: float
    #: rows by name
    items: tuple[AdapterRow, ...]

    def __post_init__(self):
        if not self.items or not 1 <= self.num_slots:
            raise ValueError("adapters needs at least one adapter and one slot")
        if self.gpu_bytes != self.num_slots * self.slot_bytes:
            raise ValueError("adapters.gpu_bytes must be num_slots x slot_bytes")
        if [row.name for row in self.items] != sorted({row.name for row in self.items}):
            raise ValueError("adapters.items must have distinct names, sorted")
