"""One rank of a tensor-parallel plan (``make --tp N``), run under torchrun:

    torchrun --nproc-per-node N -m offload_plan run PLAN --bench

transformers shards the model (``from_pretrained(tp_plan="auto")``: q/k/v and gate/up split by column, o and down
by row, the LM head by vocabulary; its forwards hold the collectives), and each rank then applies its plan to
the shards it holds: runtime.load.apply_plan packs the rank's shards of its offloaded layers into page-locked host
memory and its resident shards into the GPU arena, as on one GPU; runtime.params keeps every DTensor the DTensor
it was, so transformers' forwards run their collectives as they would without the plan. Each rank copies its own
offloaded shards over its own link, on the schedule its plan gives.

This load goes through transformers, not the streaming loader (runtime.stream_load): each rank holds its whole
shard on the GPU until apply_plan has moved it, a peak of the rank's weights plus the plan's arena.
"""

import os
from dataclasses import dataclass

import torch

from planner.errors import UsageError
from planner.plan.experts_section import ROUTED
from planner.plan.schema import Plan

from runtime.params import local_bytes

#: torchrun's environment: this process's rank, the number of ranks, and its GPU on this host
RANK_ENV, WORLD_SIZE_ENV, LOCAL_RANK_ENV = "RANK", "WORLD_SIZE", "LOCAL_RANK"


@dataclass(frozen=True)
class Rank:
    """This process's place among the ranks torchrun started."""

    rank: int
    world_size: int
    local_rank: int


def launched_rank(environ=os.environ) -> Rank | None:
    """The rank torchrun started this process as, or None outside torchrun (or with one process). A variable
    that is not a whole number (torchrun writes them; a hand-set one may not be) is one line naming it."""
    world_size = _env_count(environ, WORLD_SIZE_ENV, "1", minimum=1)
    if world_size <= 1:
        return None
    rank = _env_count(environ, RANK_ENV, "0", minimum=0)
    local_rank = _env_count(environ, LOCAL_RANK_ENV, str(rank), minimum=0)
    if rank >= world_size:
        raise UsageError(f"{RANK_ENV}={rank} but {WORLD_SIZE_ENV}={world_size}: a rank is 0 to {world_size - 1}; "
                         "launch with torchrun, which sets both")
    return Rank(rank=rank, world_size=world_size, local_rank=local_rank)


def _env_count(environ, name: str, default: str, *, minimum: int) -> int:
    text = (environ.get(name, default) or default).strip()
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise UsageError(f"{name}={text[:40]!r} is not a whole number from {minimum}; unset it or launch with "
                         "torchrun, which sets it")
    return value


def check_launch(plan: Plan, plan_path, environ=os.environ) -> Rank | None:
    """A TP=N plan runs as N processes, one per GPU, and a one-GPU plan as one: anything else is a one-line error
    saying how to launch it. Returns this process's rank under a TP plan, else None."""
    rank = launched_rank(environ)
    size = plan.inputs.tp
    launched = 1 if rank is None else rank.world_size
    if size == launched:
        return rank
    if size > 1:
        raise UsageError(f"{plan_path} is one rank of TP={size} (make --tp {size}) and this is {launched} "
                         f"process(es); launch one per GPU: torchrun --nproc-per-node {size} -m offload_plan run "
                         f"{plan_path} --bench")
    raise UsageError(f"{plan_path} is a one-GPU plan but torchrun started {launched} processes; run it without "
                     f"torchrun, or make it with --tp {launched}")


def start_rank(rank: Rank, device_type: str = "cuda") -> torch.device:
    """Join the ranks' process group (NCCL between GPUs, gloo on the CPU) and take this rank's device."""
    import torch.distributed as dist

    if device_type == "cuda":
        if torch.cuda.device_count() <= rank.local_rank:
            raise UsageError(f"rank {rank.rank} wants GPU {rank.local_rank} but this host has "
                             f"{torch.cuda.device_count()}; launch at most one process per GPU")
        device = torch.device("cuda", rank.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if device_type == "cuda":  # bound to the rank's GPU: NCCL need not guess it from the rank
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return device


def load_tp_model(folder, device: torch.device):
    """transformers' tensor-parallel model of the checkpoint in ``folder``: this rank's shards on ``device``."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    from runtime.experts_impl import PREFILL, use_phase

    # the model's own plan (base_model_tp_plan); 5.17 deprecates from_pretrained(tp_plan=...) for this form
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto",
                                                 distributed_config=DistributedConfig(tp_plan="auto"))
    use_phase(model, PREFILL, device)  # forwards outside a decode loop are prefills, as run's loader leaves them
    return model.eval()


def check_rank_plan(plan: Plan) -> None:
    """What a TP rank's plan asks that this runtime does not run under transformers' sharding, refused before
    loading: routed experts (their gather reads whole experts) and LoRA adapters."""
    if plan.experts is not None and any(row.regime == ROUTED for row in plan.experts.layers):
        raise UsageError("run does not gather routed experts under --tp yet; make the rank plan again with make "
                         "--tp (which streams whole layers on a rank), or plan one GPU")
    if plan.adapters is not None:
        raise UsageError("a plan with adapters cannot be one rank of --tp; make it without --tp")


def load_rank_with_plan(plan: Plan, source, device: torch.device, backend=None):
    """This rank's shards loaded by transformers, then the rank's plan applied (runtime.load.Loaded; its
    ``weights_gpu_bytes`` is what the GPU holds after the plan: arena and slots)."""
    from runtime.backend import CudaBackend
    from runtime.load import Loaded
    from runtime.placement import apply_plan
    from runtime.load_source import check_fingerprint

    check_fingerprint(plan, source)
    check_rank_plan(plan)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize(device)
    baseline_bytes = torch.cuda.memory_allocated(device) if on_gpu else 0
    model = load_tp_model(source.folder, device)
    engine = apply_plan(model, plan, backend or CudaBackend(device))
    if on_gpu:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # transformers' copies of the shards, released by apply_plan
    weights_bytes = torch.cuda.memory_allocated(device) - baseline_bytes if on_gpu else engine_bytes(engine)
    return Loaded(model=model, engine=engine, plan=plan, weights_gpu_bytes=weights_bytes, source=source)


def engine_bytes(engine) -> int:
    """The device arena's bytes (the CPU stand-in's count of what the GPU would hold)."""
    return engine.arena.numel() * engine.arena.element_size()


def held_beyond_plan_bytes(model, tp: int) -> int:
    """Bytes this rank holds beyond vLLM's split, which the plan prices: transformers 5.17 keeps the input
    embedding whole on every rank where vLLM (and transformers 5.24, ``embedding_rowwise``) splits it by
    vocabulary."""
    weight = model.get_input_embeddings().weight
    held = local_bytes(weight)
    whole = weight.numel() * weight.element_size()
    return held - whole // tp if held == whole and tp > 1 else 0


def gather_to_first(value) -> list | None:
    """Every rank's ``value`` on rank 0 (in rank order), None on the others."""
    import torch.distributed as dist

    values = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, values, dst=0)
    return values


@dataclass(frozen=True)
class RankBench:
    """One rank's run --bench: its figures against its plan, and what transformers holds beyond the plan's
    split of the weights."""

    rank: int
    #: runtime.bench.BenchResult, or runtime.serving.ServingBench for a serving plan
    bench: object
    beyond_plan_bytes: int

    def as_dict(self) -> dict:
        """Plain data for --json."""
        return {"rank": self.rank, "beyond_plan_bytes": self.beyond_plan_bytes, **self.bench.as_dict()}


def bench_rank(rank: Rank, plan: Plan, source, *, cuda_graph: bool, compile_backend: str | None,
               device: torch.device | None = None, backend=None) -> list[RankBench] | None:
    """Load this rank with its plan and time what run --bench times on one GPU (a serving plan's point, else its
    workload), every rank running the same steps; every rank's figures on rank 0, None on the others. The GPU is
    capped to the plan's memory once loaded (transformers' load held the rank's whole shard beside the arena)."""
    from runtime.bench import run_bench
    from runtime.serving import cap_gpu_memory, run_serving_bench

    device = device or torch.device("cuda", rank.local_rank)
    loaded = load_rank_with_plan(plan, source, device, backend)
    memory_fraction = (cap_gpu_memory(plan.memory.gpu_memory_bytes, device, plan.memory.cuda_context_bytes)
                       if device.type == "cuda" else None)
    if plan.serving is not None:
        result = run_serving_bench(loaded, cuda_graph, compile_backend, memory_fraction)
    else:
        result = run_bench(loaded, cuda_graph=cuda_graph, compile_backend=compile_backend)
    row = RankBench(rank=rank.rank, bench=result,
                    beyond_plan_bytes=held_beyond_plan_bytes(loaded.model, rank.world_size))
    loaded.engine.close()
    gathered = gather_to_first(row)
    torch.distributed.destroy_process_group()  # the ranks are done: NCCL warns at exit about a group left up
    return gathered
