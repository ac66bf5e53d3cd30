"""The one door to the PyTorch runtime (``runtime/``): ``run``, ``calibrate`` and ``make --measure`` pass here.

No other module outside ``runtime/`` imports it, and this one only inside its functions, so an install
without the ``runtime`` extra (no torch, no transformers) still plans, shows, checks, diffs and exports; the
commands that need the runtime say in one line how to install it.
"""

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


def run(plan, plan_path, loading_bar, **options):
    """``run``: the model loaded with ``plan`` applied on the local GPU(s), then generated from or measured as
    ``options`` (runtime.run.RunOptions's fields) ask; the record to print (runtime.run.RunResult)."""
    require_runtime("offload-plan run")
    from runtime.run import RunOptions
    from runtime.run import run as run_plan

    return run_plan(plan, plan_path, RunOptions(**options), loading_bar=loading_bar)


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


def write_header_checkpoint(config_path, out_dir, dtype: str | None):
    """``header-checkpoint``: the model's tensor list from transformers, written as sparse shards."""
    require_runtime("offload-plan header-checkpoint")
    from runtime.header_checkpoint import write_header_checkpoint as write

    return write(config_path, out_dir, dtype=dtype)


def measured_activation_bytes(checkpoint, layout, workload, graphed: bool, limit_bytes: int | None = None) -> int:
    """``make --measure`` of a serving plan, on the local GPU within ``limit_bytes`` of GPU memory
    (planner.errors.MeasuredOutOfMemoryError where it does not fit them), in bytes: an eager step's activation
    peak, or with ``graphed`` what capturing the step in a CUDA graph holds at its peak."""
    require_cuda("make --measure")
    from runtime.measure_activations import measured_activation_bytes as measure

    measured = measure(checkpoint, layout, workload, graphed, limit_bytes)
    return measured.reserved_bytes if graphed else measured.activation_bytes


def record_routing_trace(model: str, prompts_path, device: str | None, decode_tokens: int = 0):
    """``trace``: per-layer expert routing counts of ``model`` on the prompts
    (planner.source.routing_trace.RoutingTrace),
    or on ``decode_tokens`` greedy tokens after each."""
    require_runtime("offload-plan trace")
    from runtime.trace import read_prompts, record_trace

    return record_trace(model, read_prompts(prompts_path), device, decode_tokens)
