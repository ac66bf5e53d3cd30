"""Routed experts computed on the host CPU inside the decode step, captured in a CUDA graph or run eagerly alike.

A routed layer (runtime.routed_experts) may name a static set of CPU experts (the plan's ``experts.layers[i].cpu``),
or split each step's misses with the CPU by their count (``cpu_take``: the fused fetch plan picks the step's CPU
experts, runtime.fetch_planning.split_to_cpu, and the handoff carries only their pairs, the others' ids -1).
Their pairs are computed by the host CPU from its own copy of their weights (runtime.cpu_experts.HostExperts) while
the GPU computes the others; neither side ever moves a CPU expert's weights over the link. One decode step of
such a layer, every operation capturable (no host synchronisation):

Two handoffs carry a step to the host and back (``handoff``; OFFLOAD_PLAN_CPU_HANDOFF picks one): by DOORBELL
(runtime.cpu_doorbell: a thread of the C kernel's own polls a word the GPU writes; no side stream, no host node)
wherever every layer's C kernel computes on a GPU, and otherwise by HOST NODE:

1. the main stream has run the router (``top_k_index``, ``top_k_weights``); a side stream forks from it (event
   wait) and writes the hidden states [T, H], the indices and the weights into page-locked host buffers through
   their device view (runtime.uva_gather.device_view: copy KERNELS storing over the link, not the copy engine's
   device-to-host copies; see below);
2. on the side stream, a HOST NODE: the driver's ``cuLaunchHostFunc`` (libcuda.so.1 through ctypes) enqueues a
   host function that runs, in stream order, once the copies have landed: eagerly, and on every replay of a
   graph that captured it (CUDA captures ``cuLaunchHostFunc`` as a host node). It computes the CPU's pairs
   (``threads`` threads), weights them and sums them per token into a page-locked fp32 output [T, H] (zeros for a
   token none of whose pairs is the CPU's). Where the C kernel computes the layer's experts (runtime.cpu_kernel),
   the host function is the kernel's own ``host_step``, bound to the buffers by a struct (runtime.cpu_kernel.
   HostStep): no Python runs in the node and it takes no GIL. Otherwise it is a Python callback (ctypes) running
   torch's path (runtime.cpu_experts.compute_pairs); see the GIL below. On the H200 host's smoke (a Qwen3-30B-A3B-
   shaped layer, 8 CPU experts, 0.35 pairs a step) the Python callback with the C body inside took 0.27 ms a
   layer step, most of it fixed (scripts/smoke_cpu_experts_graph.py, 2026-11-28);
3. nothing moves the output back: the main stream's add reads it where it lies, through its device view;
4. meanwhile the main stream fetches the layer's non-resident GPU experts and computes its pairs (batched_mm);
   a pair routed to a CPU expert reads the ZERO ROW, a device-buffer row of zeros that the fetch plan takes for a
   resident expert (so it is never gathered) and whose SwiGLU output is exactly 0;
5. the main stream waits for the side stream (event wait) and adds the CPU's output to its own.

Numerics. The GPU keeps its partial sum in fp32 (the weighted pairs summed over the ranks, as batched_mm sums them
before its one rounding), adds the CPU's fp32 sum and rounds the total once to the model's dtype; the CPU rounds as
the GPU's bf16 ops round (each expert's projections, SiLU, product and output, and each weighted pair where the
router's weights are bf16: runtime.cpu_kernel's partial_sum). What is left differs from the all-resident layer only
where fp32 sums taken in another order round to another bf16 value.

What kept the CPU path from running beside the fetch (scripts/experiments/host_node_overlap.py, H100): a captured
unit of [the routed gather, a kernel reading mapped host rows, 0.99 ms] beside [hand the data over, a 0.5 ms host
node, take it back] took 1.03 ms replayed alone, but 1.36-1.50 ms a unit when units ran one after another (8 in one
graph, or replays back to back), as a decode step's layers do, whether the side branch moved its data with the copy
engine's copies or with kernels through mapped memory; with no data moved, 1.01. The gather's full grid holds
every SM for its length, so the side branch's first node waited for it to end. Gathering with 32 persistent
programs (the same rate) the units took 1.01-1.04 ms with either; at 64 programs the copies serialized once more
(1.74 ms) where the kernels did not (1.02). So the routed layer's miss gather runs the prefetch's programs where the
layer has CPU experts (runtime.routed_experts), and the side branch moves its data with kernels.

The zero row stands in for the brief's weight-0 mask (is_cpu[E] on the GPU): with the CPU experts marked resident
at that row, the fetch plan (the fused Triton kernel and its torch twin, prefetch included) skips them as it skips
resident experts, with no new kernel and no extra node per step; a zero expert's output times any finite weight
adds exactly 0.0, so the GPU's partial sum is the sum of its own pairs in the router's order.

A host function must not call CUDA (CUDA forbids API calls in host functions): the Python callback runs torch CPU
ops on host tensors only. It must not raise either (an exception cannot cross the C frame): it catches, records
the first error, and fills the output with NaN so the step is visibly wrong; the next Python-side call (a decode
step, ``stats``) raises it as one line (RuntimeUnavailableError).

The GIL (the Python callback only): it runs on a CUDA driver thread and takes the GIL (ctypes' callback wrapper).
It cannot deadlock with the main thread, because every call by which the main thread waits for GPU work releases the GIL
while it waits (pytorch/pytorch, torch/csrc): ``CUDAGraph.replay`` is bound with ``wrap_pybind_function_no_gil``
(cuda/Graph.cpp); ``torch.cuda.synchronize`` runs ``c10::cuda::device_synchronize`` under
``pybind11::gil_scoped_release`` (cuda/Module.cpp, THCPModule_cudaSynchronize), as do ``Stream.synchronize``
(cuda/Stream.cpp, THCPStream_synchronize), ``Tensor.item`` (autograd/python_variable_methods.cpp, dispatch_item_)
and ``Tensor.tolist`` (utils/tensor_list.cpp: the device-to-host copy under gil_scoped_release); torch's generated
op bindings release it around every dispatch (so a launch that blocks on a full queue does not hold it), Triton's
launcher releases it around cuLaunchKernel, and ctypes releases it around ``cuLaunchHostFunc``. The runtime's own
waits (``stats``, ``close``) use those. Eagerly, a callback that wants the GIL while the main thread runs Python
gets it at the main thread's next torch call (each releases it), at worst after sys.getswitchinterval (5 ms): a
cost, not a deadlock; graphed, the main thread sits in replay or a synchronisation, GIL released.
"""

import ctypes
import functools
import math
import os
import time
import weakref
from dataclasses import dataclass

import torch

from planner.errors import PlanError, RuntimeUnavailableError
from planner.model.placement import align_up
from runtime.allocation import host_allocation_or_fail
from runtime.cpu_doorbell import FLAGS_WORDS, WAIT_POLLS, Doorbell, ring, wait_add
from runtime.cpu_experts import CPU_DTYPES, HostExperts, compute_pairs, cpu_threads
from runtime.cpu_kernel import PARTIAL_SUM_HIDDEN_DTYPES, HostStep, partial_sum, scratch_sizes
from runtime.engine import backend_unpin
from runtime.experts_impl import ExpertsProxy
from runtime.uva_gather import device_view

#: the host function's C type: CUhostFn, ``void (*)(void *userData)`` (cdecl on Linux)
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
#: where a plan's fetch_slots is capped at the number of experts, the handoff's buffers hold this many times
#: that in (token, expert) pairs (tokens x top-k can pass the cap)
CAPPED_PAIRS_FACTOR = 4
#: the params a CPU-computed experts module holds: gated SwiGLU experts without biases (HostExperts)
CPU_PARAMS = ["down_proj", "gate_up_proj"]
#: the handoff's part buffer (int64): the step's expert split by its rows and its rows, as the host reads them
#: (PART_HANDED of them; the GPU's part also holds its slot)
PART_WORDS = 4
PART_HANDED = 2


@dataclass(frozen=True, kw_only=True)
class CpuLayer:
    """One routed layer's CPU experts on the host: their weights and the per-expert tables the callback reads."""

    host: HostExperts
    #: [E] bool, on the host: whether expert e is computed on the CPU
    is_cpu: torch.Tensor
    #: [E] int64, on the host: expert e's index in ``host`` (-1 where not a CPU expert)
    local: torch.Tensor
    #: host bytes of a copy made for the CPU (its dtype differs from the routed host copy's), else 0
    copy_bytes: int


def cpu_layer(module: torch.nn.Module, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: tuple[int, ...],
              dtype: str) -> CpuLayer:
    """The CPU side of one routed layer: ``gate_up`` [E, 2I, H] and ``down`` [E, H, I] its experts in host memory
    (the routed experts' page-locked copy), ``expert_ids`` those the CPU computes, ``dtype`` the copy's ("bf16",
    "fp32"). Host weights already in ``dtype`` are read where they lie (no second copy); otherwise only the CPU
    experts are copied, in ``dtype`` (an fp32 copy of bf16 experts holds just theirs)."""
    num_experts = gate_up.shape[0]
    ids = torch.tensor(sorted(expert_ids), dtype=torch.int64)
    in_place = gate_up.dtype == CPU_DTYPES[dtype]
    weights = {"gate_up_proj": gate_up, "down_proj": down} if in_place else \
        {"gate_up_proj": gate_up[ids], "down_proj": down[ids]}
    try:
        host = HostExperts.from_module(ExpertsProxy(module, weights), dtype)
    except ValueError as error:
        raise PlanError(f"{error}; plan this model's experts without CPU experts") from None
    is_cpu = torch.zeros(num_experts, dtype=torch.bool)
    is_cpu[ids] = True
    local = torch.full((num_experts,), -1, dtype=torch.int64)
    local[ids] = ids if in_place else torch.arange(len(ids))
    return CpuLayer(host=host, is_cpu=is_cpu, local=local, copy_bytes=0 if in_place else host.nbytes)


def computed_in_c(layer: CpuLayer | None, hidden_dtype: torch.dtype) -> bool:
    """Whether the C kernel computes ``layer``'s experts from hidden states of ``hidden_dtype`` (partial_sum,
    HostStep, the doorbell); else torch's path does."""
    return layer is not None and layer.host.kernel is not None and hidden_dtype in PARTIAL_SUM_HIDDEN_DTYPES


def cpu_partial_sum(layer: CpuLayer, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    out: torch.Tensor, routing_bf16: bool | None = None,
                    part: torch.Tensor | None = None) -> tuple[int, int]:
    """``out`` [T, H] (fp32) = per token, the sum over its pairs routed to the layer's CPU experts of weight x the
    expert's output, in rank order (as batched_mm sums); zeros where a token has none. ``hidden`` [T, H],
    ``top_k_index`` and ``top_k_weights`` [T, k], all host tensors. Rounded as the GPU's experts function rounds: each
    expert's intermediates and output where ``hidden`` is bf16, each weighted pair where ``routing_bf16`` (default:
    whether ``top_k_weights`` are bf16; the handoff's buffer holds them widened to fp32). ``part``: int64 host
    tensor (expert id, rows): that expert's pairs over its first rows only (runtime.fetch_planning: the GPU
    computes its other rows). Returns (pairs, distinct experts) computed."""
    host = layer.host
    routing_bf16 = top_k_weights.dtype == torch.bfloat16 if routing_bf16 is None else routing_bf16
    if computed_in_c(layer, hidden.dtype) and out.is_contiguous():
        # the whole body in C, no torch op between the experts: with the Python below, the H200 host's smoke
        # (scripts/smoke_cpu_experts_graph.py, 2026-11-28) spent 1.37 ms a layer step in the callback for 1.8
        # bf16 pairs that calibrate computes in 0.22 ms each; on the 2-core dev host this body took 0.18 ms for
        # two pairs of tiny experts where the Python took 1.96
        return partial_sum(host.kernel, host.gate_up, host.down, layer.local, hidden, top_k_index, top_k_weights,
                           out, torch.get_num_threads(), routing_bf16, part)
    num_top_k = top_k_index.shape[1]
    ids = top_k_index.reshape(-1)  # [S], token-major; -1: a pair a per-step split left to the GPU
    rows = ((ids >= 0) & layer.is_cpu[ids.clamp(min=0)]).nonzero().squeeze(1)  # [P] the CPU's pairs: by token, rank
    out.zero_()
    if rows.numel() == 0:
        return 0, 0
    tokens = rows // num_top_k
    local = layer.local[ids[rows]]
    split = None
    if part is not None and part[0] >= 0 and 0 < part[1] < host.shape.intermediate_size:
        split = (int(layer.local[part[0]]), int(part[1]))  # the expert's index in the copy, its rows
    pairs = compute_pairs(layer.host, hidden[tokens], local, split)  # [P, H] unweighted, in the copy's dtype
    weighted = pairs.float() * top_k_weights.reshape(-1)[rows].float().unsqueeze(-1)
    if routing_bf16:  # the GPU's bf16 pair x bf16 weight is stored in bf16
        weighted = weighted.to(torch.bfloat16).float()
    out.index_add_(0, tokens, weighted)  # sequential on the CPU: each token's pairs in rank order
    return rows.numel(), torch.unique(local).numel()


@functools.cache
def _driver():
    """libcuda.so.1's cuLaunchHostFunc and cuGetErrorName, typed."""
    try:
        library = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise RuntimeUnavailableError(f"cannot load the CUDA driver (libcuda.so.1: {error}); CPU experts need a "
                                      "CUDA GPU's driver, or plan without CPU experts") from None
    launch = library.cuLaunchHostFunc
    launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    launch.restype = ctypes.c_int
    error_name = library.cuGetErrorName
    error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    error_name.restype = ctypes.c_int
    return launch, error_name


def launch_host_func(stream: "torch.cuda.Stream", callback, user_data: int | None = None) -> None:
    """Enqueue ``callback`` on ``stream`` with ``user_data`` (an address, or None): a HOST_FN, or a C function's
    address (a CUhostFn); the caller keeps it and whatever ``user_data`` points at alive as long as any graph that
    captures it. It runs on a driver thread once the stream's earlier work is done; under stream capture it becomes
    the graph's host node, run in order on each replay."""
    launch, error_name = _driver()
    function = callback if isinstance(callback, int) else ctypes.cast(callback, ctypes.c_void_p).value
    code = launch(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(function), ctypes.c_void_p(user_data))
    if code != 0:
        name = ctypes.c_char_p()
        error_name(code, ctypes.byref(name))
        raise RuntimeUnavailableError(f"cuLaunchHostFunc failed ({(name.value or b'').decode()} {code}); plan "
                                      "without CPU experts")


@dataclass
class CpuCounters:
    """Host-side counts of the CPU's work since the last reset, updated by the callback (or the inline path)."""

    #: layer steps computed on the CPU side, pairs they had in all, pairs routed to CPU experts, distinct CPU
    #: experts summed over layer steps
    calls: int = 0
    pairs_total: int = 0
    pairs_cpu: int = 0
    experts_cpu: int = 0
    #: wall seconds inside the host functions (their clocks), compute and bookkeeping: the rest of what the CPU side
    #: adds to a step is the handoff (copies, the host node's wake-up, the GIL where the callback is Python's)
    callback_s: float = 0.0


class CpuExperts:
    """The CPU side of the routed layers with CPU experts: their host copies, the page-locked buffers of the
    handoff, the side stream, the host functions (kept alive as long as this object: a graph that captured one
    must not be replayed after ``close``) and the counters."""

    def __init__(self, layers: dict[int, CpuLayer], *, hidden_size: int, max_pairs: int, hidden_dtype: torch.dtype,
                 threads: int, device: torch.device, backend, parted: frozenset = frozenset()):
        """``max_pairs``: the most (token, expert) pairs of a decode step (fetch_slots), so the most tokens too;
        ``parted``: the layers that may split one expert by its rows each step (runtime.fetch_planning's part,
        handed to the host with the pairs)."""
        if threads < 1:
            raise PlanError(f"CPU experts need at least 1 thread, got {threads}")
        self.layers, self.threads, self.device, self.backend = dict(layers), threads, device, backend
        self.parted = frozenset(parted)
        self.counters = CpuCounters()
        #: whether the router's weights are bf16 (the handoff's buffer widens them to fp32): the CPU then rounds
        #: each weighted pair as the GPU's bf16 product does; set by the first ``fork``
        self.routing_bf16 = False
        #: the first error a callback caught, one line; raised by the next Python-side call
        self.error: str | None = None
        self.closed = False
        self._allocate(hidden_size, max_pairs, hidden_dtype)
        intermediate = max((layer.host.gate_up.shape[1] // 2 for layer in self.layers.values()), default=0)
        floats, ints = scratch_sizes(max_pairs, hidden_size, intermediate)
        #: partial_sum's scratch, shared by the C host steps (their nodes run one after another on the side stream)
        self._scratch = torch.empty(floats, dtype=torch.float32), torch.empty(ints, dtype=torch.int64)
        #: (layer, tokens, top-k) -> its host node: a HostStep (C, where the layer's kernel computes) or a HOST_FN
        self._host_nodes: dict[tuple[int, int, int], object] = {}
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        #: the handoff (HANDOFFS): by doorbell where every layer's kernel computes on a GPU, else by host node
        self.handoff = handoff_kind(self.layers, device, hidden_dtype)
        self.doorbell = Doorbell(next(iter(self.layers.values())).host.kernel, self.buffers["flags"]) \
            if self.handoff == "doorbell" else None

    def _allocate(self, hidden_size: int, max_pairs: int, hidden_dtype: torch.dtype) -> None:
        """The handoff's host buffers in one allocation (page-locked and mapped when the device is a GPU: GPU kernels
        read and write them in place, capturable) and their device views."""
        shapes = {"hidden": ((max_pairs, hidden_size), hidden_dtype), "index": ((max_pairs,), torch.int64),
                  "weights": ((max_pairs,), torch.float32), "out": ((max_pairs, hidden_size), torch.float32),
                  "flags": ((FLAGS_WORDS,), torch.int32), "part": ((PART_WORDS,), torch.int64)}
        offsets, total = {}, 0
        for name, (shape, dtype) in shapes.items():
            offsets[name] = total
            total = align_up(total + math.prod(shape) * dtype.itemsize)
        self.allocation = host_allocation_or_fail(align_up(total), "the CPU experts' handoff", "plan fewer tokens")
        self.buffers = {name: self.allocation[offsets[name]:offsets[name] + math.prod(shape) * dtype.itemsize]
                        .view(dtype).view(shape) for name, (shape, dtype) in shapes.items()}
        self._unpin = lambda: None
        if self.device.type == "cuda":
            self.backend.pin(self.allocation)
            # unpinned before the memory can be freed, even if close is never called (as RoutedExperts does)
            self._unpin = weakref.finalize(self, backend_unpin, self.backend, [self.allocation])
            #: the same buffers as device tensors over the host memory: GPU kernels store and load them directly
            self.mapped = {name: device_view(buffer, self.device) for name, buffer in self.buffers.items()}

    @property
    def host_bytes(self) -> int:
        """Host bytes the CPU side holds beyond the routed experts' copy: copies in another dtype (only the CPU
        experts'; a copy in the experts' own dtype reads the routed host copy in place) and the buffers."""
        return sum(layer.copy_bytes for layer in self.layers.values()) + self.allocation.numel()

    # ---- the step ----

    def fork(self, index: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             part: torch.Tensor | None = None):
        """Start the CPU's pairs of layer ``index`` right after the router: by doorbell, the ring on the current
        stream (runtime.cpu_doorbell); by host node, steps 1 to 3 of the module docstring on the side stream.
        ``part``: the step's expert split by its rows (runtime.fetch_planning: expert id, rows, slot), in a layer of
        ``parted``. Returns what ``join`` takes. On the CPU stand-in (tests) nothing runs until ``join``."""
        self.check()
        self.routing_bf16 = top_k_weights.dtype == torch.bfloat16
        if (part is not None) != (index in self.parted):
            raise RuntimeUnavailableError(f"layer {index}: a step's part split by rows goes with the layers that plan "
                                          "one; regenerate the plan")
        if self.stream is None:
            return index, hidden, top_k_index, top_k_weights, part
        num_tokens, num_top_k = top_k_index.shape
        if num_tokens * num_top_k > self.buffers["index"].numel():
            raise RuntimeUnavailableError(f"a decode step of {num_tokens} tokens x top-{num_top_k} routes more pairs "
                                          f"than the CPU experts' buffers hold ({self.buffers['index'].numel()}); "
                                          "plan fewer sequences, or plan without CPU experts")
        if self.doorbell is not None:
            ring(hidden, top_k_index, top_k_weights, self.mapped,
                 self.doorbell.key(self.host_node(index, num_tokens, num_top_k)), part)
            return num_tokens
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        num_pairs, mapped = num_tokens * num_top_k, self.mapped
        with torch.cuda.stream(self.stream):
            # copy kernels storing into mapped host memory (module docstring: the copy engine's copies serialize
            # with the routed gather when layers follow one another)
            mapped["hidden"][:num_tokens].copy_(hidden)
            mapped["index"][:num_pairs].view(num_tokens, num_top_k).copy_(top_k_index)
            mapped["weights"][:num_pairs].view(num_tokens, num_top_k).copy_(top_k_weights)
            if part is not None:
                mapped["part"][:PART_HANDED].copy_(part[:PART_HANDED])
            node = self.host_node(index, num_tokens, num_top_k)
            if isinstance(node, HostStep):
                launch_host_func(self.stream, node.kernel.host_step_address, node.user_data)
            else:
                launch_host_func(self.stream, node)
        # the inputs are read on the side stream before ``join`` (called before the layer returns, so before
        # the caller can free them) makes the main stream wait for it: no record_stream needed
        return num_tokens

    def join(self, pending, out: torch.Tensor) -> torch.Tensor:
        """The main stream waits for the host's output (the doorbell's answer, or the side stream) and adds it to
        ``out`` [T, H], the GPU's partial sum (in place, in its dtype: runtime.routed_experts keeps it in fp32 and
        rounds the whole sum once, as batched_mm does); on the CPU stand-in the CPU's pairs are computed here,
        inline."""
        if self.stream is None:
            index, hidden, top_k_index, top_k_weights, part = pending
            partial = torch.empty(hidden.shape, dtype=torch.float32)
            with cpu_threads(self.threads):  # this thread's count restored after
                self._compute(index, hidden, top_k_index, top_k_weights, partial, part)
            self.check()
            return out.add_(partial)
        if self.doorbell is not None:
            return wait_add(self.mapped, pending, out)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return out.add_(self.mapped["out"][:pending])  # reads the host's output over the link, in the add

    def host_node(self, index: int, num_tokens: int, num_top_k: int):
        """The host node of layer ``index`` at ``num_tokens`` x ``num_top_k`` pairs (made once, kept here): where
        the layer's C kernel computes and reads the hidden states' dtype, a HostStep (the node runs in C: no Python,
        no GIL, the counters kept in its struct); otherwise a HOST_FN calling ``_host_step`` (torch's path)."""
        key = (index, num_tokens, num_top_k)
        if key not in self._host_nodes:
            layer, buffers = self.layers.get(index), self.buffers
            if computed_in_c(layer, buffers["hidden"].dtype):
                num_pairs = num_tokens * num_top_k
                self._host_nodes[key] = HostStep(
                    layer.host.kernel, layer.host.gate_up, layer.host.down, layer.local,
                    hidden=buffers["hidden"][:num_tokens], index=buffers["index"][:num_pairs],
                    weights=buffers["weights"][:num_pairs], out=buffers["out"][:num_tokens],
                    scratch=self._scratch[0], pairs=self._scratch[1], num_threads=self.threads,
                    routing_bf16=self.routing_bf16, part=buffers["part"] if index in self.parted else None)
            else:
                self._host_nodes[key] = HOST_FN(lambda _user_data: self._host_step(*key))
        return self._host_nodes[key]

    def _c_steps(self) -> list[HostStep]:
        return [node for node in self._host_nodes.values() if isinstance(node, HostStep)]

    def _host_step(self, index: int, num_tokens: int, num_top_k: int) -> None:
        """The host node's body: the CPU's pairs from the page-locked inputs into the page-locked output. Runs on a
        driver thread: no CUDA call, and nothing may escape (module docstring)."""
        if self.closed:
            return
        num_pairs = num_tokens * num_top_k
        buffers = self.buffers
        self._compute(index, buffers["hidden"][:num_tokens], buffers["index"][:num_pairs].view(num_tokens, num_top_k),
                      buffers["weights"][:num_pairs].view(num_tokens, num_top_k), buffers["out"][:num_tokens],
                      buffers["part"] if index in self.parted else None)

    def _compute(self, index: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 out: torch.Tensor, part: torch.Tensor | None = None) -> None:
        """cpu_partial_sum with the threads set and the counters kept; an error is recorded, the output NaN."""
        start = time.perf_counter()
        try:
            # torch's intra-op thread count is the calling thread's (OpenMP's per-thread setting): the driver's
            # thread starts with the process default, so it is set here, where the work runs
            if torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
            with torch.inference_mode():
                pairs, experts = cpu_partial_sum(self.layers[index], hidden, top_k_index, top_k_weights, out,
                                                 self.routing_bf16, part)
            counters = self.counters
            counters.calls += 1
            counters.pairs_total += top_k_index.numel()
            counters.pairs_cpu += pairs
            counters.experts_cpu += experts
        except BaseException as error:  # noqa: BLE001 - nothing may leave a host function
            if self.error is None:
                reason = (str(error).strip().splitlines() or [""])[0][:160]
                self.error = f"layer {index}: {type(error).__name__}: {reason}"
            try:
                out.fill_(float("nan"))
            except BaseException:  # noqa: BLE001
                pass
        self.counters.callback_s += time.perf_counter() - start

    # ---- the host side's bookkeeping ----

    def check(self) -> None:
        """Raise, in one line, the error a callback recorded (it filled its output with NaN)."""
        if self.error is None and self.doorbell is not None and self.doorbell.timed_out:
            self.error = (f"the doorbell thread did not answer the GPU within {WAIT_POLLS:,} polls (seconds); "
                          "the output it added was not the CPU's")
        if self.error is not None:
            raise RuntimeUnavailableError(f"the CPU experts failed inside a decode step ({self.error}); the steps "
                                          "since are wrong (NaN); plan without CPU experts or report it")

    def wait(self) -> None:
        """Wait for the host functions (the side stream's) or the doorbell's steps (the GPU's waits for them) to
        finish; the GIL released while waiting."""
        if self.doorbell is not None:
            torch.cuda.synchronize(self.device)
        elif self.stream is not None:
            self.stream.synchronize()

    def stats(self) -> dict:
        """The counters since the last reset, after the callbacks already enqueued have run; raises a recorded
        error. ``pairs_share``: the CPU's share of the routed layers-with-CPU-experts' pairs."""
        self.wait()
        self.check()
        counts = vars(self.counters).copy()
        for step in self._c_steps():
            for name, value in step.counters().items():
                counts[name] += value
        counts["pairs_share"] = counts["pairs_cpu"] / counts["pairs_total"] if counts["pairs_total"] else 0.0
        counts["callback_ms_per_call"] = 1e3 * counts["callback_s"] / counts["calls"] if counts["calls"] else 0.0
        return counts

    def work_by_layer(self) -> dict[int | None, tuple[int, float]]:
        """Routed layer index -> (CPU experts computed, seconds in the host step) since the last reset, after the steps
        already queued have run (``wait``: the host queues captured steps far ahead of the GPU, so counters read
        without it lag the steps the caller counted); the Python host function counts every layer together, under
        None."""
        self.wait()
        work: dict[int | None, tuple[int, float]] = {}
        for (index, _, _), node in self._host_nodes.items():
            if isinstance(node, HostStep):
                counts = node.counters()
                experts, seconds = work.get(index, (0, 0.0))
                work[index] = (experts + counts["experts_cpu"], seconds + counts["callback_s"])
        if self.counters.calls:
            work[None] = (self.counters.experts_cpu, self.counters.callback_s)
        return work

    def reset(self) -> None:
        self.wait()
        self.counters = CpuCounters()
        for step in self._c_steps():
            step.reset()

    def close(self) -> None:
        """Unpin the buffers once the side stream is idle; a host function still captured in a graph does nothing
        from now on (the graph must not be replayed: the device buffers it reads are gone too)."""
        if self.closed:
            return
        self.wait()
        self.closed = True
        if self.doorbell is not None:
            self.doorbell.close()
        for step in self._c_steps():
            step.close()
        self._unpin()
        self.layers = {}


#: the CPU experts' handoffs (OFFLOAD_PLAN_CPU_HANDOFF picks one; default: the doorbell where it can run)
HANDOFFS = ("doorbell", "host-node")


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable ``name`` as one of ``choices`` (unset: the first); one line (PlanError) otherwise."""
    asked = os.environ.get(name, choices[0])
    if asked not in choices:
        raise PlanError(f"{name}={asked!r} is not one of {', '.join(choices)}; unset it or pick one")
    return asked


def handoff_kind(layers: dict[int, CpuLayer], device: torch.device, hidden_dtype: torch.dtype) -> str:
    """"doorbell" (runtime.cpu_doorbell) where the device is a GPU and every layer's experts are computed by the C
    kernel from hidden states it reads, unless OFFLOAD_PLAN_CPU_HANDOFF=host-node; else "host-node" (a captured
    host node: the kernel's host_step, or torch's path in a Python callback)."""
    asked = env_choice("OFFLOAD_PLAN_CPU_HANDOFF", HANDOFFS)
    possible = device.type == "cuda" and bool(layers) and all(
        computed_in_c(layer, hidden_dtype) for layer in layers.values())
    return "doorbell" if asked == "doorbell" and possible else "host-node"


def check_cpu_experts(cpu: dict[int, tuple[int, ...]], resident: dict[int, tuple[int, ...]], num_experts: int,
                      param_names, dtype: str, threads: int) -> None:
    """One line (PlanError) unless CPU experts are in routed layers (``resident``'s keys), distinct ids in range,
    none resident, of gated SwiGLU experts without biases, in a known dtype, with at least one thread."""
    for index, ids in cpu.items():
        if index not in resident:
            raise PlanError(f"layer {index} has CPU experts but is not routed; route it or drop its CPU experts")
        bad = [e for e in ids if not 0 <= e < num_experts]
        if bad or len(set(ids)) != len(ids):
            raise PlanError(f"routed layer {index}: CPU experts must be distinct ids in [0, {num_experts}), "
                            f"got {list(ids)}")
        both = sorted(set(ids) & set(resident[index]))
        if both:
            raise PlanError(f"routed layer {index}: experts {both} are both resident and CPU experts; regenerate "
                            "the plan")
    if cpu and sorted(param_names) != CPU_PARAMS:
        raise PlanError(f"experts with params {list(param_names)} are not computed on the CPU (gated SwiGLU experts "
                        f"without biases: {CPU_PARAMS}); plan without CPU experts")
    if dtype not in CPU_DTYPES:
        raise PlanError(f"the CPU experts' dtype must be one of {', '.join(CPU_DTYPES)}, not {dtype!r}")
    if threads < 1:
        raise PlanError(f"CPU experts need at least 1 thread, got {threads}")


def check_cpu_take(cpu_take: dict[int, tuple[float, ...]], cpu: dict[int, tuple[int, ...]]) -> None:
    """One line (PlanError) unless every layer splitting its misses by count has CPU ids and a table j(m) of
    shares from 0 to m (whole experts, and a fraction of one more)."""
    for index, take in cpu_take.items():
        if index not in cpu:
            raise PlanError(f"routed layer {index} splits its misses with the CPU (cpu_take) but has no CPU experts; "
                            "regenerate the plan")
        wrong = [m for m, j in enumerate(take) if not 0 <= j <= m]
        if wrong:
            raise PlanError(f"routed layer {index}: cpu_take[{wrong[0]}] is {take[wrong[0]]}, not from 0 to "
                            f"{wrong[0]}; regenerate the plan")


def start_cpu_experts(routed) -> CpuExperts:
    """The CPU side of a started runtime.routed_experts.RoutedExperts: its zero row zeroed, and the CPU experts
    over its host copy (their own copy where the dtype differs)."""
    for name in routed.param_names:
        routed.buffer[name][routed.zero_row].zero_()
    layers = {index: cpu_layer(routed.modules[index], routed.host[index, "gate_up_proj"],
                               routed.host[index, "down_proj"], ids, routed.cpu_dtype)
              for index, ids in routed.cpu.items()}
    dtype, shape = routed.rows["down_proj"]  # [H, I]
    # a step's pairs are tokens x top-k, which fetch_slots counts until it is capped at the experts' number: past
    # the cap, room for CAPPED_PAIRS_FACTOR x that (fork refuses, in one line, a step with more)
    capped = routed.fetch_slots >= routed.num_experts
    max_pairs = routed.fetch_slots * (CAPPED_PAIRS_FACTOR if capped else 1)
    return CpuExperts(layers, hidden_size=shape[0], max_pairs=max_pairs, hidden_dtype=dtype,
                      threads=routed.cpu_threads, device=routed.device, backend=routed.backend,
                      parted=frozenset(routed.cpu_rows))

