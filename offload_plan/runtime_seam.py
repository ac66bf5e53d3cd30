"""The one door to the PyTorch runtime (``runtime/``): ``run``, ``calibrate`` and ``make --measure`` pass here.

No other module outside ``runtime/`` imports it, and this one only inside its functions, so an install
without the ``runtime`` extra (no torch, no transformers) still plans, shows, checks, diffs and exports; the
commands that need the runtime say in one line how to install it.
"""

import contextlib
import importlib.util

from planner.errors import RuntimeUnavailableError

#: the packages the runtime imports, and the install line that brings them
RUNTIME_PACKAGES = ("torch", "transformers", "safetensors")
RUNTIME_INSTALL = "pip install 'offload-plan[runtime]'"


def require_runtime(what: str) -> None:
    """The runtime's packages are importable, else a one-line error naming ``what`` and the install line."""
    missing = [name for name in RUNTIME_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeUnavailableError(
            f"{what} needs the runtime, and {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
            f"installed: {RUNTIME_INSTALL} (planning, show, check, diff and export work without it)"
        )


def require_cuda(what: str) -> None:
    """The runtime and a local CUDA GPU, else a one-line error naming ``what``."""
    require_runtime(what)
    from runtime.load import require_cuda as runtime_require_cuda

    runtime_require_cuda(what)


def measured_compute(checkpoint, layout, workload, profile, measured_on: str | None, graphed: bool):
    """``make --measure``: per-layer times on the local GPU (planner.model.cost.ComputeTimes), scaled to ``profile``."""
    require_runtime("make --measure")
    from runtime.measure import measured_compute as measure

    return measure(checkpoint, layout, workload, profile, measured_on, graphed)


def measured_all_reduce(tp: int, profile, measured_on: str | None):
    """``make --tp N --measure``: the all-reduce's latency and bandwidth between N local GPUs
    (planner.model.tensor_parallel.AllReduceLink), or the profile's figure, with why, where it cannot be measured
    here."""
    require_cuda("make --measure")
    from runtime.all_reduce import measured_link

    return measured_link(tp, profile, measured_on)


def calibrate():
    """``calibrate``: (the measured profile, its YAML text, the H2D points behind it)."""
    require_cuda("offload-plan calibrate")
    from runtime.calibrate import calibrate as measure_gpu
    from runtime.calibrate import calibrated_yaml

    profile, details = measure_gpu()
    return profile, calibrated_yaml(profile), details


def check_decode_flags(plan, cuda_graph: bool, compile_backend: str | None) -> None:
    """Refuse decode options the plan's workload cannot run, before the minutes of loading."""
    from runtime.bench import check_decode_flags as check

    check(plan, cuda_graph, compile_backend)


def open_source(plan, model: str | None, plan_path):
    """The checkpoint ``run`` loads, resolved and its headers and config.json read once (runtime.load.LoadSource)."""
    require_runtime("offload-plan run")  # runtime.load imports torch
    from runtime.load import open_source as open_checkpoint

    return open_checkpoint(plan, model, plan_path)


def load_with_plan(plan, source, progress):
    """Load the checkpoint (a LoadSource) with the plan applied (runtime.load.Loaded)."""
    from runtime.load import load_with_plan as load

    return load(plan, progress=progress, source=source)


def generate(loaded, prompt: str, max_new_tokens: int, cuda_graph: bool, compile_backend,
             adapter: str | None = None, plan_path=None):
    """(generated text, tokens per second) with the plan applied, and ``adapter`` (one of the plan's) if given;
    the tokenizer comes from the folder the weights were loaded from (resolved once, by the load)."""
    from runtime.generate import generate as run_generate

    return run_generate(loaded, prompt, str(loaded.source.folder), max_new_tokens, cuda_graph, compile_backend,
                        adapter, plan_path)


def run_bench(loaded, *, cuda_graph: bool, compile_backend: str | None):
    """The plan's workload timed against its prediction (runtime.bench.BenchResult)."""
    from runtime.bench import run_bench as bench

    return bench(loaded, cuda_graph=cuda_graph, compile_backend=compile_backend)


@contextlib.contextmanager
def out_of_memory_in_one_line(plan, what: str):
    """CUDA running out of memory inside, as the one line a plan that does not fit gets (runtime.serving)."""
    import torch

    from runtime.serving import out_of_memory

    try:
        yield
    except torch.OutOfMemoryError:
        raise out_of_memory(what, plan) from None


def check_stack_fits(plan) -> int:
    """What the local stack holds outside torch's allocator before loading (runtime.outside_memory's probe); one
    line where that breaks the plan's promise."""
    import torch

    from runtime.outside_memory import check_stack_fits as check

    return check(plan, torch.device("cuda", torch.cuda.current_device()))


def cap_gpu_memory(plan):
    """Hold this process to the plan's GPU memory where the local GPU has more, the plan's booking of what CUDA
    holds outside the allocator set aside; the share set, or None."""
    import torch

    from runtime.serving import cap_gpu_memory as cap

    return cap(plan.memory.gpu_memory_bytes, torch.device("cuda", torch.cuda.current_device()),
               booked_outside_bytes=plan.memory.cuda_context_bytes)


def measured_context_bytes(gpu: str, measured_on: str | None) -> int | None:
    """make --measure: what this process holds outside torch's allocator once a decoder step's kernel families ran
    on the local GPU (runtime.outside_memory's probe), for a plan of this GPU; None for another GPU's plan, whose
    profile's figure stands."""
    require_cuda("make --measure")
    import torch

    from planner.source.profile import load_profile
    from runtime.measure import is_local_target
    from runtime.outside_memory import probe_outside_allocator_bytes

    if not is_local_target(load_profile(gpu), measured_on):
        return None
    return probe_outside_allocator_bytes(torch.device("cuda", torch.cuda.current_device()))


def run_serving_bench(loaded, cuda_graph: bool, compile_backend: str | None, memory_fraction: float | None):
    """``run --bench`` of a serving plan (runtime.serving.ServingBench)."""
    from runtime.serving import run_serving_bench as bench

    return bench(loaded, cuda_graph=cuda_graph, compile_backend=compile_backend, memory_fraction=memory_fraction)


def run_adapter_bench(loaded, plan_path, mode: str):
    """``run --bench`` of a plan with adapters, served in ``mode`` (runtime.adapter_bench.AdapterBench)."""
    from runtime.adapter_bench import run_adapter_bench as bench

    result, _ = bench(loaded, plan_path, modes=(mode,))
    return result


def write_header_checkpoint(config_path, out_dir, dtype: str | None):
    """``header-checkpoint``: the model's tensor list from transformers, written as sparse shards."""
    require_runtime("offload-plan header-checkpoint")
    from runtime.header_checkpoint import write_header_checkpoint as write

    return write(config_path, out_dir, dtype=dtype)


def measured_activation_bytes(checkpoint, layout, workload, graphed: bool, limit_bytes: int | None = None) -> int:
    """``make --measure`` of a serving plan: a step's activation peak on the local GPU, in bytes, measured within
    ``limit_bytes`` of GPU memory (planner.errors.MeasuredOutOfMemoryError where it does not fit them)."""
    require_cuda("make --measure")
    from runtime.measure import measured_activation_bytes as measure

    return measure(checkpoint, layout, workload, graphed, limit_bytes).activation_bytes


def record_routing_trace(model: str, prompts_path, device: str | None, decode_tokens: int = 0):
    """``trace``: per-layer expert routing counts of ``model`` on the prompts
    (planner.source.routing_trace.RoutingTrace),
    or on ``decode_tokens`` greedy tokens after each."""
    require_runtime("offload-plan trace")
    from runtime.trace import read_prompts, record_trace

    return record_trace(model, read_prompts(prompts_path), device, decode_tokens)


def check_tp_launch(plan, plan_path):
    """One process per rank of a TP plan (torchrun), one for a one-GPU plan, else a one-line error; this
    process's rank (runtime.tensor_parallel.Rank) under a TP plan, else None."""
    from runtime.tensor_parallel import check_launch

    return check_launch(plan, plan_path)


def start_tp_rank(rank) -> None:
    """Take this rank's GPU and join the ranks' process group."""
    from runtime.tensor_parallel import start_rank

    start_rank(rank)


def bench_tp_rank(rank, plan, source, cuda_graph: bool, compile_backend: str | None):
    """``run --bench`` of one rank of a TP plan; every rank's figures on rank 0 (runtime.tensor_parallel.RankBench),
    None on the others."""
    from runtime.tensor_parallel import bench_rank

    return bench_rank(rank, plan, source, cuda_graph=cuda_graph, compile_backend=compile_backend)
