"""The CPU experts' handoff by doorbell: a thread of the C kernel's own polls a word the GPU writes, instead of a
host node the driver wakes (runtime.cpu_handoff's other handoff).

On the H200 host a bare round trip (no pair to compute; runtime.calibrate.measure_handoff_ms) took 15.1 us by
doorbell against 54.7 us by a host node running the C body, and one Qwen3-30B-A3B-shaped layer with 32 bf16 CPU
experts stepped in 0.939 ms against 0.968 (benchmarks/2026-11-28-cpu-experts-doorbell-h200.md).

One step of a layer by doorbell, all on the main stream, capturable:

1. ``ring`` (one Triton program, right after the router): the tokens' hidden states, the routed ids and weights
   stored into the page-locked handoff buffers through their device view, then, after a barrier, the step's key
   written into ``flags[0]`` with a system-scope release, so the host sees the inputs before the key;
2. the doorbell thread (runtime.cpu_kernel's ``doorbell_loop``, started with the runtime) sees the key, clears it,
   runs the key's host step (runtime.cpu_kernel.HostStep: the CPU's pairs summed per token into the page-locked
   output), and writes 1 into ``flags[1]``;
3. meanwhile the GPU fetches and computes its own experts;
4. ``wait_add`` (one program): polls ``flags[1]`` until the host's 1 (``WAIT_POLLS`` at most, then it sets
   ``flags[3]``, which the next ``check`` raises as one line), clears it, and adds the host's output to the GPU's
   partial sum, rounded once to its dtype (as ``Tensor.add_`` rounds).

Layers follow one another (a layer's ring comes after the previous layer's wait), so one pair of words serves
every layer; a key names a (layer, tokens, top-k) step, registered before the first ring that writes it.
``flags[2]`` counts the steps the thread ran. The thread spins while steps keep coming and sleeps between polls
after ``IDLE_SPIN_NS`` without one (a first step after idle waits up to ``SLEEP_NS`` more).
"""

import ctypes
import weakref

import torch

from planner.errors import RuntimeUnavailableError
from runtime.cpu_kernel import HostStep

#: keys the steps table holds: (layer, tokens, top-k) steps a runtime may capture
CAPACITY = 4096
#: the doorbell thread spins this long after its last step before it sleeps between polls
IDLE_SPIN_NS = 20_000_000
SLEEP_NS = 20_000
#: polls of flags[1] before the GPU gives up on the host (each a read over the link, ~1 us): seconds, not a hang
WAIT_POLLS = 1 << 23
#: the flags words: the key rung, the host's done, the steps the thread ran, the GPU's timeout
FLAGS_WORDS = 4
BLOCK = 1024


class Doorbell:
    """The doorbell thread over ``flags`` (int32 [FLAGS_WORDS], page-locked host memory; the GPU's kernels write
    and poll it through its device view, ``ring`` and ``wait_add``) and its table of host steps; ``close`` stops
    the thread."""

    def __init__(self, kernel, flags: torch.Tensor):
        self.kernel, self.flags = kernel, flags
        self._table = (ctypes.c_void_p * CAPACITY)()
        self._keys: dict[int, int] = {}
        self._steps: list[HostStep] = []
        flags.zero_()
        worker = kernel.doorbell_start(flags.data_ptr(), ctypes.addressof(self._table), CAPACITY, IDLE_SPIN_NS,
                                       SLEEP_NS)
        if not worker:
            raise RuntimeUnavailableError("cannot start the CPU experts' doorbell thread; plan without CPU experts")
        # the thread reads the flags, the table and the steps' memory until it is joined: stopped here on close,
        # or when this object is collected unclosed (a runtime dropped without close), the finalizer holding all
        # of them alive until then
        self._stop = weakref.finalize(self, _stop_thread, kernel, worker, flags, self._table, self._steps)

    def key(self, step: HostStep) -> int:
        """``step``'s key (1-based), registered in the table the thread reads on first use."""
        if id(step) not in self._keys:
            if len(self._steps) >= CAPACITY:
                raise RuntimeUnavailableError(f"more than {CAPACITY} CPU-experts steps (layer x tokens x top-k) in one "
                                              "runtime; plan fewer tokens or layers with CPU experts")
            self._steps.append(step)
            self._table[len(self._steps) - 1] = step.user_data
            self._keys[id(step)] = len(self._steps)
        return self._keys[id(step)]

    @property
    def steps_run(self) -> int:
        return int(self.flags[2])

    @property
    def timed_out(self) -> bool:
        return bool(self.flags[3])

    def close(self) -> None:
        """Stop the thread (after the GPU's work that rings it is done: the caller synchronizes first)."""
        self._stop()


def _stop_thread(kernel, worker: int, *_kept) -> None:
    """Join the doorbell thread (``_kept``: what it reads, alive until now)."""
    kernel.doorbell_stop(worker)


def ring(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
         mapped: dict[str, torch.Tensor], key: int, part: torch.Tensor | None = None) -> None:
    """Step 1 on the current stream: the inputs (and ``part``'s expert id and rows, where a layer splits one
    expert by its rows: runtime.fetch_planning) into the mapped buffers, then ``key`` into flags[0]."""
    hidden = hidden.contiguous()
    index, weights = top_k_index.contiguous(), top_k_weights.contiguous()
    with_part = part is not None
    _kernels()["ring"][(1,)](hidden, index, weights, mapped["hidden"], mapped["index"], mapped["weights"],
                             mapped["flags"], key, hidden.numel(), index.numel(), part if with_part else index,
                             mapped["part"], WITH_PART=with_part, BLOCK=BLOCK, num_warps=4)


def wait_add(mapped: dict[str, torch.Tensor], num_tokens: int, out: torch.Tensor) -> torch.Tensor:
    """Step 4 on the current stream: wait for the host's output and add it to ``out`` [T, H] in place."""
    target = out if out.is_contiguous() else out.contiguous()
    _kernels()["wait_add"][(1,)](mapped["flags"], mapped["out"][:num_tokens], target, target.numel(), WAIT_POLLS,
                                 BLOCK=BLOCK, num_warps=4)
    return target if target is out else out.copy_(target)


_KERNELS: dict = {}


def _kernels() -> dict:
    """The two Triton kernels, compiled on first use (triton ships with CUDA builds of torch)."""
    if _KERNELS:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def ring_kernel(hidden, index, weights, hidden_host, index_host, weights_host, flags, key, num_hidden,
                    num_pairs, part, part_host, WITH_PART: tl.constexpr, BLOCK: tl.constexpr):
        for start in range(0, num_hidden, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < num_hidden
            tl.store(hidden_host + offsets, tl.load(hidden + offsets, mask=mask), mask=mask)
        for start in range(0, num_pairs, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < num_pairs
            tl.store(index_host + offsets, tl.load(index + offsets, mask=mask).to(tl.int64), mask=mask)
            tl.store(weights_host + offsets, tl.load(weights + offsets, mask=mask).to(tl.float32), mask=mask)
        if WITH_PART:  # the expert split by its rows, and its rows
            two = tl.arange(0, 2)
            tl.store(part_host + two, tl.load(part + two))
        # every thread's stores before the key; the release at system scope orders them for the host
        tl.debug_barrier()
        tl.atomic_xchg(flags, key, sem="release", scope="sys")

    @triton.jit
    def wait_add_kernel(flags, out_host, out, num_out, max_polls, BLOCK: tl.constexpr):
        # volatile loads: each poll reads host memory over the link (no atomic: a read-modify-write over PCIe
        # need not be atomic with the host's store)
        done = tl.load(flags + 1, volatile=True)
        polls = 0
        while (done == 0) & (polls < max_polls):
            done = tl.load(flags + 1, volatile=True)
            polls += 1
        tl.debug_barrier()
        if done == 0:
            tl.store(flags + 3, 1)
        tl.store(flags + 1, 0)
        for start in range(0, num_out, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < num_out
            partial = tl.load(out_host + offsets, mask=mask, volatile=True)
            mine = tl.load(out + offsets, mask=mask).to(tl.float32)
            tl.store(out + offsets, (mine + partial).to(out.dtype.element_ty), mask=mask)

    _KERNELS.update(ring=ring_kernel, wait_add=wait_add_kernel)
    return _KERNELS
