"""Measure one tensor-parallel rank against make --tp 2: per-rank weight memory and step time, on two GPUs.

    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/bench_tp.py     # both shapes, a few minutes on 2 H100s
    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/bench_tp.py --shape llama --tokens 4096
    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/bench_tp.py --device cpu --tiny   # the path, on gloo (CPU)

For each shape (a Llama-shape dense model and a Qwen3-MoE-shape model, random bf16 weights), rank 0 builds the
model on its GPU and saves it as a checkpoint; both ranks plan it with ``make --tp 2`` (planner.make.make_plan, the same
code as the command) and load it with transformers' own tensor parallelism (``from_pretrained(tp_plan="auto")``:
its models' ``base_model_tp_plan`` splits q/k/v and gate/up column-wise and o/down row-wise, Qwen3-MoE's experts
too, and the LM head by vocabulary, as vLLM does). Each rank then times prefill steps of --tokens tokens and
prints its weight memory (torch.cuda.memory_allocated after loading, less before) against the plan's and the
step time against the plan's prediction. The plan is ``make --tp 2 --measure``'s: each rank times the rank's
own layers (the config at heads / 2, KV heads / 2, MLP and experts' widths / 2) on its GPU, and both ranks time
the NCCL all-reduce together in torchrun's group (runtime.all_reduce), whose latency and bandwidth price the two
all-reduces a layer; the line prints that measured latency. ``--estimate`` plans with the roofline and the
profile's link instead (the figures before issue 28's --measure). The TP model runs its experts through the
implementation --measure timed (runtime.experts_impl, the prefill one).

What runs is the all-resident plan: transformers' TP model cannot stream offloaded layers through the project's
runtime (runtime/ places whole, unsharded params), so offloading under TP is planned (and exported to vLLM and
SGLang) but not run here. Where transformers and vLLM shard differently the line says so: transformers 5.17 keeps
the input embedding whole on every rank (its plans do not split embed_tokens), vLLM splits it by vocabulary, and so
does transformers 5.24 (the JSON's embedding_sharded).

Each shape is then taken apart, per decoder layer, to attribute a miss (issue 28: the Qwen3-MoE rank step was
+90% on two H200s). Beside the TP model each rank builds the rank's config alone on its GPU, as --measure builds
it (runtime.measure.build_measure_model), and times three runs with the same code: the TP model, the TP model with
its layers' all-reduces skipped (``dist.all_reduce`` a no-op: wrong outputs, the rest's time), and the rank's
config alone. Each layer's attention and MLP/MoE block is timed through forward hooks: host ms (the Python and
launches inside the part, until it returns) and device ms (CUDA events at the part's entry and exit: its kernels,
its collectives, any wait for the host or the peer rank); a device figure no larger than the host one says the
host bounds that part. TP minus skipped is what the all-reduces cost in place; skipped minus alone is what
transformers' TP adds beside them. torch.profiler names the kernels whose ms a step differ most, one forward of each
is counted op by op (a TorchDispatchMode: the collectives with their bytes and part, the ops on DTensors, the
experts' kernels), the router's spread of the tokens over the experts is read from one forward of each (the
two models route with different random weights), and one all-reduce of a layer's hidden states is timed alone.
The table prints after each rank's line; the JSON under $OUT holds every figure.

What transformers' ``tp_plan="auto"`` runs for Qwen3-MoE (5.17 and 5.24, ``distributed/tensor_parallel.py``):
q/k/v colwise and o_proj rowwise (one all-reduce of the hidden states, ``dist.all_reduce`` on the local output);
the experts' fused gate_up_proj ``packed_colwise`` (a strided shard: each rank holds its half of gate and of up)
and down_proj ``rowwise`` (split by the intermediate size), under ``moe_tp_experts``, which swaps the local shards
in for the forward and all-reduces the experts' output once; the router replicated; the LM head
``colwise_gather_output`` (one all-gather of the kept token's logits); the input embedding whole in 5.17, split by
vocabulary with one more all-reduce in 5.24 (``embedding_rowwise``, distributed/mixin.py). That is vLLM's split,
and the experts run the same implementation (config ``_experts_implementation``, grouped_mm) on shards of the rank
config's shapes: the breakdown's op counts check it.

On a machine without two GPUs, or without torchrun, it prints one line and exits 2. ``--device cpu --tiny`` runs
the whole path on two gloo ranks on the CPU (planned with the roofline): the sharding, the collectives and the
op counts are transformers' own there, the times are not a GPU's.
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

#: the shapes measured: big enough that a 2048-token step is not bound by kernel launches, small enough to build
#: and save in seconds (about 4 GB and 3 GB of bf16)
SHAPES = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
              "num_hidden_layers": 8, "vocab_size": 32000, "max_position_embeddings": 8192,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                  "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 32,
                  "num_experts_per_tok": 8, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                  "num_hidden_layers": 8, "vocab_size": 32000, "max_position_embeddings": 8192,
                  "tie_word_embeddings": False, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
}
#: the spread allowed between measured and planned (the issue's target)
TOLERANCE = 0.10
WORLD_SIZE = 2


def parser() -> argparse.ArgumentParser:
    """--shape, --tokens, --steps, --gpu, --folder, --estimate, --device, --tiny."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    result.add_argument("--tokens", type=int, default=2048, help="tokens of each timed prefill step")
    result.add_argument("--steps", type=int, default=10, help="timed steps (after 3 warm-up steps)")
    result.add_argument("--gpu", default=None, help="profile to plan with (default: from the GPU's name)")
    result.add_argument("--folder", default=None, help="where rank 0 saves the checkpoints (default: a temp dir)")
    result.add_argument("--estimate", action="store_true",
                        help="plan with the roofline and the profile's link instead of --measure")
    result.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: two gloo ranks on this host's CPU, planned with the roofline (a check that the "
                             "sharding, the collectives and the breakdown run; its times say nothing of a GPU's)")
    result.add_argument("--tiny", action="store_true", help="the shapes shrunk to build in a second (CPU checks)")
    return result


def not_runnable(device: str = "cuda") -> str | None:
    """Why this cannot run here (one line), else None."""
    try:
        import torch
    except ImportError:
        return "bench_tp: torch is not installed; install offload-plan[runtime]"
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and found < WORLD_SIZE:
        return (f"bench_tp: needs {WORLD_SIZE} CUDA GPUs, found {found}; run it on a two-GPU machine with "
                f"torchrun --nproc-per-node {WORLD_SIZE} scripts/bench_tp.py (or check it on the CPU with --device cpu "
                "--tiny)")
    if os.environ.get("WORLD_SIZE") != str(WORLD_SIZE):
        return (f"bench_tp: launch it with torchrun --nproc-per-node {WORLD_SIZE} scripts/bench_tp.py (WORLD_SIZE is "
                f"{os.environ.get('WORLD_SIZE', 'unset')})")
    return None


def shape_config(name: str, tiny: bool = False) -> dict:
    """The shape's config.json values; ``tiny``: shrunk to build and run in a second on the CPU (the same families,
    heads, experts and top-k split over two ranks)."""
    values = dict(SHAPES[name])
    if not tiny:
        return values
    values.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=1024)
    if name == "qwen3_moe":
        values.update(moe_intermediate_size=128, head_dim=32, num_experts=4, num_experts_per_tok=2)
    return values


def profile_for(device_name: str) -> str:
    """The built-in profile of the local GPU by its name."""
    name = device_name.lower()
    return "h200" if "h200" in name else "b200" if "b200" in name else "h100-sxm"


def plan_rank(folder: Path, gpu: str, tokens: int, tp: int = WORLD_SIZE, measure: bool = False) -> dict:
    """plan_rank_and_layout's figures alone."""
    return plan_rank_and_layout(folder, gpu, tokens, tp, measure)[0]


def plan_rank_and_layout(folder: Path, gpu: str, tokens: int, tp: int = WORLD_SIZE,
                         measure: bool = False) -> tuple[dict, object]:
    """make --tp ``tp`` of the checkpoint in ``folder`` for a prefill step of ``tokens`` tokens, all resident (the
    whole GPU's budget): the rank's weight bytes, its predicted step, what transformers holds beyond vLLM's
    sharding (the input embedding whole on every rank), and the all-reduce link the plan priced. ``measure``:
    make --measure's (the rank's layers on this GPU, the all-reduce in torchrun's group; every rank calls it)."""
    from planner.make.make_plan import make_plan
    from planner.plan.schema import Inputs

    links = []
    kwargs = {}
    if measure:
        from offload_plan import runtime_seam

        def measure_link(size, profile, measured_on):
            links.append(runtime_seam.measured_all_reduce(size, profile, measured_on))
            return links[-1]

        kwargs = {"measure": runtime_seam.measured_compute, "measure_link": measure_link}
    inputs = Inputs(model=str(folder), gpu=gpu, tokens=tokens, sequences=1, context=0, tp=tp, measure=measure)
    planned = make_plan(inputs, **kwargs)
    return _rank_figures(planned, tp, links[0] if links else None), planned


def _rank_figures(planned, tp: int, link) -> dict:
    """plan_rank's figures of one make --tp plan (``link``: the all-reduce link --measure timed, else None)."""
    plan = planned.plan
    embedding = next((t for t in planned.checkpoint.tensors if t.name.endswith("embed_tokens.weight")), None)
    whole_embedding = 0 if embedding is None else embedding.nbytes * tp - embedding.nbytes
    return {"weights_bytes": plan.memory.gpu_bytes - plan.memory.allocation_slack_bytes,
            "step_ms": plan.prediction.step_ms, "num_offloaded": len(plan.offload.layers),
            "transformers_extra_bytes": whole_embedding, "compute_source": plan.workload.compute_source,
            "all_reduce_latency_us": None if link is None else link.latency_us,
            "all_reduce_bus_bytes_per_s": None if link is None else link.bytes_per_s,
            "all_reduce_measured": bool(link is not None and link.measured)}


def save_random_model(values: dict, folder: Path, device: str) -> None:
    """Rank 0: build the shape with random bf16 weights on ``device`` and save it as a safetensors checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in values.items() if k != "architectures"})
    config.architectures = values["architectures"]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    _empty_cache(device)


def load_tp_model(folder: Path, device):
    """Both ranks: transformers' tensor-parallel model of the checkpoint; the weight bytes this rank allocated (on
    the CPU, which has no allocator count: the bytes of the rank's own parameters, DTensors' local shards)."""
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.experts_impl import PREFILL, use_phase

    _synchronize(device)
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, tp_plan="auto")
    model.eval()
    use_phase(model, PREFILL, device)  # as --measure timed the experts
    _synchronize(device)
    if device.type == "cuda":
        return model, torch.cuda.memory_allocated() - before
    return model, local_param_bytes(model)


def embedding_is_sharded(model) -> bool:
    """Whether transformers split the input embedding by vocabulary on this rank, as vLLM does (5.24 adds
    ``embed_tokens: embedding_rowwise`` to every plan, distributed/mixin.py; 5.17 keeps it whole on every rank)."""
    weight = model.get_input_embeddings().weight
    return hasattr(weight, "to_local") and weight.to_local().numel() < weight.numel()


def local_param_bytes(model) -> int:
    """The bytes of the parameters this rank holds (a DTensor's local shard, a plain tensor whole)."""
    from runtime.params import local_bytes

    return sum(local_bytes(param) for param in model.parameters())


def rank_config_model(planned, device):
    """The rank's config alone on this device, as make --measure builds and times it (runtime.measure: full depth,
    random bf16 weights, one layer per kind and aliases elsewhere, the prefill experts implementation)."""
    from runtime.measure import build_measure_model, measured_kinds

    kinds = measured_kinds(planned.layout, planned.checkpoint.config)
    return build_measure_model(planned.checkpoint.config, kinds, planned.layout.stack, device=device.type)


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _empty_cache(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.empty_cache()


def _step_ids(vocab: int, tokens: int, device):
    """The same ``tokens`` random token ids on every rank: [1, tokens]."""
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    return torch.randint(0, vocab, (1, tokens), device=device, generator=generator)


def time_steps(model, tokens: int, steps: int, device, parts: "PartTimes | None" = None) -> dict:
    """Median ms of a prefill step of ``tokens`` tokens, wall (to the device's end) and host (until the forward
    call returns, before synchronizing: about the wall where the host, not the device, bounds the step); 3
    warm-up steps first, both ranks step together. ``parts``: its hooks record each timed step's parts."""
    import torch
    import torch.distributed as dist

    input_ids = _step_ids(model.config.vocab_size, tokens, device)
    wall_ms, host_ms = [], []
    with torch.inference_mode():
        for step in range(3 + steps):
            dist.barrier()
            _synchronize(device)
            if parts is not None:
                parts.begin_forward()
            start = time.perf_counter()
            model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
            returned = time.perf_counter()
            _synchronize(device)
            end = time.perf_counter()
            if parts is not None:
                parts.end_forward(keep=step >= 3)
            if step >= 3:
                wall_ms.append(1e3 * (end - start))
                host_ms.append(1e3 * (returned - start))
    return {"wall_ms": statistics.median(wall_ms), "host_ms": statistics.median(host_ms)}


# ---- the per-layer breakdown --------------------------------------------------------------------------------------

#: a decoder layer's two parts, timed apart: attention (under TP with its o_proj's all-reduce) and the MLP or MoE
#: block (under TP with the all-reduce after its experts)
PARTS = ("self_attn", "mlp")
#: dispatcher names of collectives: c10d's in-place ops (dist.all_reduce is c10d.allreduce_) and the functional ones
#: DTensor redistributes with (_c10d_functional.all_gather_into_tensor, the LM head's gather)
_COLLECTIVE = re.compile(r"allreduce|all_reduce|allgather|all_gather|reduce_scatter|broadcast|alltoall|all_to_all")
#: functional-collective bookkeeping ops that move no bytes
_NOT_COLLECTIVE = re.compile(r"wait_tensor|wrap_tensor")


def decoder_layers(model) -> list:
    """The model's decoder layers (transformers' CausalLM: model.layers)."""
    return list(model.model.layers)


class _PartHooks:
    """Forward hooks on every decoder layer's parts that call ``enter(part)`` and ``leave(part)``."""

    def __init__(self, model, enter, leave):
        self._handles = []
        for layer in decoder_layers(model):
            for part in PARTS:
                module = getattr(layer, part)
                self._handles.append(module.register_forward_pre_hook(lambda m, a, part=part: enter(part)))
                self._handles.append(module.register_forward_hook(lambda m, a, o, part=part: leave(part)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class PartTimes:
    """Each timed forward's host ms inside each part (its Python, its launches, its collectives' calls: summed over
    the layers) and, on a GPU, its device ms between CUDA events recorded at the part's entry and exit (its kernels,
    its collectives, any wait for the host or for the peer rank). On the CPU the two are the same clock."""

    def __init__(self, model, device):
        self.device = device
        self.num_layers = len(decoder_layers(model))
        self.forwards: list[dict[str, tuple[float, float]]] = []
        self._open: dict[str, tuple] = {}
        self._current: dict[str, list] = {}
        self._hooks = _PartHooks(model, self._enter, self._leave)

    def _mark(self):
        import torch

        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _enter(self, part: str) -> None:
        self._open[part] = (time.perf_counter(), self._mark())

    def _leave(self, part: str) -> None:
        start_s, start_mark = self._open.pop(part)
        self._current[part].append((1e3 * (time.perf_counter() - start_s), start_mark, self._mark()))

    def begin_forward(self) -> None:
        self._current = {part: [] for part in PARTS}

    def end_forward(self, keep: bool) -> None:
        """Fold the forward just synchronized into per-part sums (``keep`` False: a warm-up, dropped)."""
        if keep:
            self.forwards.append({part: (sum(h for h, _, _ in marks), sum(_elapsed_ms(s, e) for _, s, e in marks))
                                  for part, marks in self._current.items()})

    def per_layer(self) -> dict:
        """{part: {"host_ms", "device_ms"}}: the median forward's sum over the layers, divided by the layers."""
        out = {}
        for part in PARTS:
            host = statistics.median(f[part][0] for f in self.forwards) / self.num_layers
            device = statistics.median(f[part][1] for f in self.forwards) / self.num_layers
            out[part] = {"host_ms": round(host, 4), "device_ms": round(device, 4)}
        return out

    def remove(self) -> None:
        self._hooks.remove()


def _elapsed_ms(start, end) -> float:
    if isinstance(start, float):
        return 1e3 * (end - start)
    return start.elapsed_time(end)


def count_ops(model, tokens: int, device) -> dict:
    """One forward's dispatched ops by part ("other": embedding, final norm, LM head): every op, those on DTensors
    (each through DTensor's sharding propagation, in Python), the collectives with their bytes, and the op names of
    each part (an experts implementation shows as its kernels: aten._grouped_mm, bmm, or eager's nonzero loop)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without DTensor: no op is on one
        DTensor = ()
    state = {"part": "other"}
    ops: dict[str, Counter] = {part: Counter() for part in (*PARTS, "other")}
    dtensor_ops: Counter = Counter()
    collectives: list[dict] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name, part = str(func), state["part"]
            ops[part][name] += 1
            leaves = [leaf for leaf in tree_leaves((args, kwargs or {})) if isinstance(leaf, torch.Tensor)]
            if DTensor and any(isinstance(leaf, DTensor) for leaf in leaves):
                dtensor_ops[part] += 1
            if _COLLECTIVE.search(name) and not _NOT_COLLECTIVE.search(name) and leaves:
                collectives.append({"part": part, "op": name,
                                    "bytes": leaves[0].numel() * leaves[0].element_size()})
            return func(*args, **(kwargs or {}))

    hooks = _PartHooks(model, lambda part: state.update(part=part), lambda part: state.update(part="other"))
    input_ids = _step_ids(model.config.vocab_size, tokens, device)
    try:
        with torch.inference_mode(), Count():
            model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    finally:
        hooks.remove()
    return {"num_ops": {part: sum(counter.values()) for part, counter in ops.items()},
            "num_dtensor_ops": {part: dtensor_ops[part] for part in ops}, "collectives": collectives,
            "ops": {part: dict(sorted(counter.items())) for part, counter in ops.items()}}


def time_all_reduce(num_bytes: int, device, repeats: int = 10) -> float:
    """Median ms of one bf16 all-reduce of ``num_bytes`` alone (synchronized before and after, as a forward's sits
    between a part's kernels and the next part's), the slowest rank's."""
    import torch
    import torch.distributed as dist

    buffer = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device=device)
    samples = []
    for repeat in range(3 + repeats):
        dist.barrier()
        _synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(buffer)
        _synchronize(device)
        if repeat >= 3:
            samples.append(1e3 * (time.perf_counter() - start))
    slowest = torch.tensor([statistics.median(samples)], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def _experts_implementation(model) -> str | None:
    """The experts implementation a MoE model's forward looks up (config._experts_implementation); None if dense."""
    from runtime.experts_impl import has_experts

    return getattr(model.config, "_experts_implementation", None) if has_experts(model) else None


@contextlib.contextmanager
def all_reduces_skipped():
    """``torch.distributed.all_reduce`` as a no-op, for a timing: transformers' TP layers call it for o_proj's and
    the experts' partial sums (the LM head's gather, and 5.24's embedding all-reduce, go through DTensor's functional
    collectives and still run). The outputs are wrong; the time is everything but those all-reduces. Every rank
    skips the same calls, so none waits on the other."""
    import torch.distributed as dist

    original = dist.all_reduce
    dist.all_reduce = lambda tensor, *args, **kwargs: None
    try:
        yield
    finally:
        dist.all_reduce = original


def top_ops(model, tokens: int, device, num_steps: int = 2, num_top: int = 40) -> list[dict]:
    """torch.profiler over ``num_steps`` forwards: the ``num_top`` kernels by device ms a step on a GPU (the ops by
    host ms on the CPU), each with its calls a step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    input_ids = _step_ids(model.config.vocab_size, tokens, device)
    with torch.inference_mode(), profile(activities=activities) as prof:
        for _ in range(num_steps):
            model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
            _synchronize(device)
    rows = []
    for event in prof.key_averages():
        if on_gpu:
            if str(getattr(event, "device_type", "")).rsplit(".", 1)[-1] != "CUDA":
                continue
            us = getattr(event, "self_device_time_total", None)
            us = getattr(event, "self_cuda_time_total", 0) if us is None else us
        else:
            us = event.self_cpu_time_total
        if us > 0:
            rows.append({"name": event.key, "ms": round(us / 1e3 / num_steps, 4),
                         "num_calls": event.count // num_steps})
    return sorted(rows, key=lambda row: -row["ms"])[:num_top]


def routing_load(model, tokens: int, device) -> dict | None:
    """How one forward's router spread the tokens over the experts, the median over the MoE layers: the experts hit
    and the busiest expert's tokens over the mean (1.0: even). The grouped GEMMs' time follows the spread, and the TP
    model and the rank's config alone route with different random weights. None for a dense model (no
    ``mlp.gate`` returning the top-k expert indices last)."""
    import torch

    loads: list[tuple[int, float]] = []

    def record(module, args, output) -> None:
        indices = output[-1] if isinstance(output, tuple) else None
        if indices is None or indices.dtype not in (torch.int64, torch.int32):
            return
        counts = torch.bincount(indices.flatten().long()).float()  # [experts up to the highest hit]
        hit = counts[counts > 0]
        loads.append((int(hit.numel()), float(counts.max() / hit.sum() * hit.numel())))

    gates = [layer.mlp.gate for layer in decoder_layers(model) if isinstance(getattr(layer.mlp, "gate", None),
                                                                            torch.nn.Module)]
    handles = [gate.register_forward_hook(record) for gate in gates]
    try:
        with torch.inference_mode():
            model(input_ids=_step_ids(model.config.vocab_size, tokens, device), use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    if not loads:
        return None
    return {"num_experts_hit": statistics.median(hit for hit, _ in loads),
            "busiest_over_mean": round(statistics.median(ratio for _, ratio in loads), 3)}


def _timed_run(model, tokens: int, steps: int, device) -> dict:
    """One model's hooked steps: the step's wall and host ms, each part's per layer, and its top kernels."""
    parts = PartTimes(model, device)
    try:
        step = time_steps(model, tokens, steps, device, parts)
    finally:
        parts.remove()
    return {"step": {k: round(v, 3) for k, v in step.items()}, "per_layer": parts.per_layer(),
            "top_ops": top_ops(model, tokens, device)}


def breakdown(tp_model, alone_model, tokens: int, steps: int, device) -> dict:
    """Where the TP rank's step goes, per layer, against the rank's config alone on this device: each part's host
    and device ms in the TP model, in the TP model with its layer all-reduces skipped, and alone; the ops each
    dispatches (the collectives among them); the top kernels; one all-reduce of a layer's hidden states alone."""
    figures = {"tp": _timed_run(tp_model, tokens, steps, device)}
    with all_reduces_skipped():
        figures["tp_skipped"] = _timed_run(tp_model, tokens, steps, device)
        figures["tp_skipped"]["ops"] = count_ops(tp_model, tokens, device)
    figures["alone"] = _timed_run(alone_model, tokens, steps, device)
    for label, model in (("tp", tp_model), ("alone", alone_model)):
        figures[label]["ops"] = count_ops(model, tokens, device)
        figures[label]["experts_implementation"] = _experts_implementation(model)
        figures[label]["routing"] = routing_load(model, tokens, device)
    hidden_bytes = tokens * tp_model.config.hidden_size * 2  # [1, tokens, hidden] bf16
    figures["all_reduce_alone_ms"] = round(time_all_reduce(hidden_bytes, device), 4)
    figures["all_reduce_bytes"] = hidden_bytes
    return figures


def bench_shape(name: str, root: Path, args, rank: int, gpu: str, device) -> dict:
    import torch.distributed as dist

    values = shape_config(name, args.tiny)
    folder = root / name
    if rank == 0:
        save_random_model(values, folder, device.type)
    dist.barrier()
    planned, whole = plan_rank_and_layout(folder, gpu, args.tokens, measure=not args.estimate)
    model, measured_bytes = load_tp_model(folder, device)
    sharded_embedding = embedding_is_sharded(model)
    step = time_steps(model, args.tokens, args.steps, device)
    alone = rank_config_model(whole, device)
    parts = breakdown(model, alone, args.tokens, args.steps, device)
    del model, alone
    _empty_cache(device.type)
    expected_bytes = planned["weights_bytes"] + (0 if sharded_embedding else planned["transformers_extra_bytes"])
    step_ms = step["wall_ms"]
    return {"shape": name, "rank": rank, "gpu": gpu, "device": device.type, "tokens": args.tokens,
            "measured_weights_bytes": measured_bytes, "planned_weights_bytes": planned["weights_bytes"],
            "planned_plus_whole_embedding_bytes": expected_bytes, "embedding_sharded": sharded_embedding,
            "memory_error": measured_bytes / expected_bytes - 1,
            "measured_step_ms": round(step_ms, 3), "measured_step_host_ms": round(step["host_ms"], 3),
            "predicted_step_ms": round(planned["step_ms"], 3),
            "step_error": step_ms / planned["step_ms"] - 1, "num_offloaded": planned["num_offloaded"],
            "compute_source": planned["compute_source"], "all_reduce_latency_us": planned["all_reduce_latency_us"],
            "all_reduce_bus_bytes_per_s": planned["all_reduce_bus_bytes_per_s"],
            "all_reduce_measured": planned["all_reduce_measured"], "breakdown": parts}


def report_line(row: dict) -> str:
    """One line per rank and shape: memory and step, measured against planned, and whether within 10%."""
    gib = 2**30
    memory = (f"weights {row['measured_weights_bytes'] / gib:.3f} GiB measured against "
              f"{row['planned_weights_bytes'] / gib:.3f} GiB planned (vLLM's sharding), "
              f"{row['planned_plus_whole_embedding_bytes'] / gib:.3f} GiB with transformers' whole embedding "
              f"({row['memory_error']:+.1%}, {_verdict(row['memory_error'])})")
    if row.get("embedding_sharded"):
        memory = (f"weights {row['measured_weights_bytes'] / gib:.3f} GiB measured against "
                  f"{row['planned_weights_bytes'] / gib:.3f} GiB planned (vLLM's sharding; transformers splits the "
                  f"embedding too) ({row['memory_error']:+.1%}, {_verdict(row['memory_error'])})")
    step = (f"step {row['measured_step_ms']:.2f} ms measured against {row['predicted_step_ms']:.2f} ms predicted "
            f"({row['step_error']:+.1%}, {_verdict(row['step_error'])})")
    if row.get("all_reduce_latency_us") is None:
        link = "all-reduce: the profile's link and the assumed latency (--estimate)"
    else:
        link = (f"all-reduce {'measured' if row['all_reduce_measured'] else 'ASSUMED'}: "
                f"{row['all_reduce_latency_us']:.1f} us + bytes at {row['all_reduce_bus_bytes_per_s'] / 1e9:.0f} GB/s")
    return (f"{row['shape']} rank {row['rank']} ({row['gpu']}, TP=2, {row['tokens']}-token step, all resident): "
            f"{memory}; {step}; {link}")


def _verdict(error: float) -> str:
    return "within 10%" if abs(error) <= TOLERANCE else "OFF by more than 10%"


def breakdown_table(row: dict) -> str:
    """The rank's step taken apart, per layer, as a few lines: the TP model, the TP model with its layer all-reduces
    skipped, and the rank's config alone; the differences are what the all-reduces cost in place (TP - skipped) and
    what transformers' TP adds beside them (skipped - alone: its wrappers' host time, any kernel that differs)."""
    parts, tp, skipped, alone = (row["breakdown"][key] for key in ("all_reduce_alone_ms", "tp", "tp_skipped", "alone"))
    names = {"self_attn": "attention", "mlp": "MLP/MoE block"}
    lines = [f"{row['shape']} rank {row['rank']}, ms a layer (median forward / layers):",
             f"  {'':<21} {'TP':>8} {'TP, no AR':>10} {'alone':>8} {'AR in TP':>9} {'TP rest':>8}"]
    for part in PARTS:
        for clock in ("device_ms", "host_ms"):
            figures = [run["per_layer"][part][clock] for run in (tp, skipped, alone)]
            lines.append(_table_row(f"{names[part]} {clock.removesuffix('_ms')}", figures))
    for clock in ("wall_ms", "host_ms"):
        lines.append(_table_row(f"step {clock.removesuffix('_ms')} (hooked)", [run["step"][clock]
                                                                              for run in (tp, skipped, alone)]))
    lines.append(f"  (AR in TP = TP - TP with the layer all-reduces skipped; TP rest = that - alone; one all-reduce "
                 f"of a layer's {row['breakdown']['all_reduce_bytes'] / 2**20:.2f} MiB alone: {parts:.3f} ms)")
    lines.append("  " + collectives_line(tp["ops"]["collectives"], len_layers(tp)))
    lines.append("  ops a forward (on DTensors): " + ", ".join(
        f"{names.get(part, part)} {tp['ops']['num_ops'][part]} ({tp['ops']['num_dtensor_ops'][part]}) vs "
        f"{alone['ops']['num_ops'][part]} alone" for part in (*PARTS, "other")))
    if tp["experts_implementation"] or alone["experts_implementation"]:
        lines.append(f"  experts: {tp['experts_implementation']} in the TP model ("
                     f"{experts_kernels(tp['ops']['ops']['mlp'])}), {alone['experts_implementation']} alone ("
                     f"{experts_kernels(alone['ops']['ops']['mlp'])})")
    if tp.get("routing") and alone.get("routing"):
        lines.append(f"  routing, median MoE layer: {_routing_text(tp['routing'])} in the TP model, "
                     f"{_routing_text(alone['routing'])} alone")
    lines.append(f"  {'ops' if row.get('device') == 'cpu' else 'kernels'} that differ most, ms a step (calls): "
                 "TP, alone, TP - alone")
    for name, there, here in kernel_differences(tp["top_ops"], alone["top_ops"]):
        lines.append(f"    {there['ms']:8.3f} ({there['num_calls']:4d}) {here['ms']:8.3f} ({here['num_calls']:4d}) "
                     f"{there['ms'] - here['ms']:+8.3f}  {name[:70]}")
    return "\n".join(lines)


def kernel_differences(tp_ops: list[dict], alone_ops: list[dict], num_top: int = 8) -> list[tuple[str, dict, dict]]:
    """The kernels (ops on the CPU) whose ms a step differ most between the TP model and the rank's config alone:
    (name, TP's figures, alone's), a kernel missing from one side at 0 ms there."""
    absent = {"ms": 0.0, "num_calls": 0}
    tp, alone = {op["name"]: op for op in tp_ops}, {op["name"]: op for op in alone_ops}
    rows = [(name, tp.get(name, absent), alone.get(name, absent)) for name in {*tp, *alone}]
    return sorted(rows, key=lambda row: (-abs(row[1]["ms"] - row[2]["ms"]), row[0]))[:num_top]


def _routing_text(routing: dict) -> str:
    return f"{routing['num_experts_hit']:g} experts hit, the busiest {routing['busiest_over_mean']:.2f} x the mean"


def _table_row(label: str, figures: list[float]) -> str:
    """One breakdown row: TP, TP without its layer all-reduces, alone, and the two differences."""
    tp, skipped, alone = figures
    return f"  {label:<21} {tp:8.3f} {skipped:10.3f} {alone:8.3f} {tp - skipped:+9.3f} {skipped - alone:+8.3f}"


def len_layers(figures: dict) -> int:
    """The decoder layers a breakdown covered (the TP forward's attention all-reduces count them)."""
    return max(1, sum(1 for c in figures["ops"]["collectives"] if c["part"] == "self_attn"))


def collectives_line(collectives: list[dict], num_layers: int) -> str:
    """The TP forward's collectives, by part and op: how many, and the bytes of each."""
    groups: Counter = Counter((c["part"], c["op"], c["bytes"]) for c in collectives)
    if not groups:
        return "collectives a forward: none"
    text = ", ".join(f"{count} x {op} of {num_bytes / 2**10:.1f} KiB in {part}"
                     for (part, op, num_bytes), count in sorted(groups.items()))
    return f"collectives a forward ({num_layers} layers): {text}"


def experts_kernels(ops: dict) -> str:
    """The experts' kernels among a forward's MLP ops: grouped GEMMs, batched GEMMs, eager's host-synchronizing
    nonzero."""
    found = {key: count for key, count in ops.items()
             if key.split(".")[1] in ("_grouped_mm", "grouped_mm", "bmm", "nonzero")}
    return ", ".join(f"{count} x {key}" for key, count in sorted(found.items())) or "no grouped/batched GEMM"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    problem = not_runnable(args.device)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
        gpu = args.gpu or profile_for(torch.cuda.get_device_name())
    else:
        device, gpu = torch.device("cpu"), args.gpu or "h100-sxm"
        args.estimate = True  # --measure times on a GPU
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    shapes = list(SHAPES) if args.shape == "all" else [args.shape]
    # one folder both ranks see (torchrun's ranks share the host): rank 0 writes, both read, rank 0 removes
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    root = Path(args.folder or Path(tempfile.gettempdir()) / f"bench_tp_{run_id}")
    try:
        rows = [bench_shape(name, root, args, rank, gpu, device) for name in shapes]
    finally:
        dist.barrier()
        if rank == 0 and args.folder is None:
            shutil.rmtree(root, ignore_errors=True)
    for row in rows:
        print(report_line(row), flush=True)
        print(breakdown_table(row), flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, f"bench_tp_rank{rank}.json").write_text(json.dumps(rows, indent=1) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
