"""Helpers the GPU benchmark scripts share (scripts/bench_*.py and scripts/experiments/*.py).

Random-weight checkpoints with a real model's names and shapes (one writer, one tensor held at a time), the best
pinned host-to-device rate (the floor's link term), a calibrated profile, plans at a share of the layer bytes,
the decode settings that make bitwise checks meaningful, report files, and the interleaved replay arms of the
decode experiments. Nothing here runs at import; every function that touches the GPU needs CUDA.

Here, beside the scripts, not in the runtime package: only the benchmarks and their tests import it, and
``pip install offload-plan[runtime]`` ships offload_plan, planner and runtime only (pyproject's packages), so
users' runtime carries no benchmark code; the scripts and tests run from the repository root, where
``scripts`` imports.
"""

from __future__ import annotations

import argparse
import gc
import contextlib
import json
import math
import os
import statistics
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from planner.source.header_checkpoint import marker_kind, write_owned_folder
from runtime.header_checkpoint import tensor_specs
from runtime.backend import CudaBackend
from runtime.calibrate import median_event_ms
from runtime.graph import DecodeLoop, cache_tokens_for

#: KV-cache tokens per sequence before the timed decode steps (every decode benchmark)
CONTEXT_TOKENS = 1024
#: what the marker of a checkpoint written by write_random_checkpoint says it is
RANDOM_WEIGHTS = "random-weights"
#: the default model: Qwen3-8B's config.json, relative to the repository root the scripts run from
DEFAULT_CONFIG = Path("examples/qwen3-8b/config.json")
DEFAULT_CHECKPOINT = Path("/tmp/qwen3-8b-random")
SHARD_BYTES = 4 * 2**30


#: the routed fetch kinds (runtime.routed_experts.FETCH_KINDS) that carried experts a step touched: every kind but
#: the wasted prefetches
TOUCHED_KINDS = ("prefetched", "missed", "unpredicted")


def touched_bytes(by_kind: dict) -> float:
    """The routed, non-resident bytes a step touched (of ``by_kind``, bytes per fetch kind): what the link must
    carry at the least, the routed floor's bytes."""
    return sum(by_kind.get(kind, 0.0) for kind in TOUCHED_KINDS)


def log(message: str) -> None:
    """A timestamped progress line on stderr (the scripts print their tables on stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def checkpoint_parser(default_out: str) -> argparse.ArgumentParser:
    """--out (default: $OUT where set, as on the lent GPU machines), and the random-weight checkpoint
    (--checkpoint, written from --config on first use)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or default_out),
                        help=f"folder for the results (default: $OUT, else {default_out})")
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                        help="random-weight checkpoint: reused if this tool wrote it, else written (new folder)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the model's config.json")
    return parser


def write_random_checkpoint(config_path: Path, folder: Path) -> None:
    """Random bf16 weights (std 0.02, norms 1) with the real names and shapes, in 4 GiB shards.

    A folder this function wrote before is reused; any other non-empty folder is refused, never written into.
    """
    if marker_kind(folder) == RANDOM_WEIGHTS:
        return
    write_owned_folder(folder, kind=RANDOM_WEIGHTS, fill=lambda staging: fill_random(config_path, staging))


def fill_random(config_path: Path, folder: Path) -> None:
    """config.json, shards of random weights and their index, into ``folder``."""
    (folder / "config.json").write_text(config_path.read_text())
    generator = torch.Generator(device="cuda").manual_seed(0)  # drawn on the GPU: faster

    def make(name: str, dtype: str, shape: list[int]) -> torch.Tensor:
        if "norm" in name:
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=generator, device="cuda") * 0.02).to(torch.bfloat16).cpu()

    write_random_shards(folder, tensor_specs(config_path, "BF16"), make)


#: safetensors dtype names of the random checkpoints -> torch dtypes
TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}


def write_random_shards(folder: Path, specs, make, *, shard_bytes: int = SHARD_BYTES) -> int:
    """The tensors of ``specs`` ((name, safetensors dtype, shape), in order) as model-NNNNN-of-NNNNN.safetensors
    shards of at most ``shard_bytes`` (a larger tensor alone), with save_pretrained's index (total_size and the
    weight map); each tensor made by ``make(name, dtype, shape)`` (a CPU tensor) in spec order and written at once,
    so one tensor is held at a time whatever the model's size. Returns the bytes of tensor data written."""
    shards, current, current_bytes = [], [], 0
    for spec in specs:
        num_bytes = _num_bytes(spec)
        if current and current_bytes + num_bytes > shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(spec)
        current_bytes += num_bytes
    shards.append(current)
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / file, shard, make)
        weight_map.update(dict.fromkeys((name for name, _, _ in shard), file))
    total = sum(_num_bytes(spec) for shard in shards for spec in shard)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def write_safetensors(path: Path, specs, make) -> None:
    """One safetensors file of ``specs`` ((name, dtype, shape)), each tensor made by ``make(name, dtype, shape)``
    and written as soon as it is made: the header first (names, shapes and offsets are known in advance), then
    the bytes, so no more than one tensor is held at a time and nothing is copied on the way to the file."""
    header, offset = {}, 0
    for spec in specs:
        name, dtype, shape = spec
        end = offset + _num_bytes(spec)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(blob)) + blob)
        for name, dtype, shape in specs:
            tensor = make(name, dtype, shape)
            assert tensor.dtype == TORCH_DTYPES[dtype] and list(tensor.shape) == list(shape), name
            file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _num_bytes(spec) -> int:
    _, dtype, shape = spec
    return math.prod(shape) * TORCH_DTYPES[dtype].itemsize


def write_random_release(config_path: Path, folder: Path, *, device: str = "cuda", seed: int = 0) -> None:
    """Random weights in the release's own format (planner.source.release_format: FP8 block-quantized linears with their
    float32 weight_scale_inv where config.json's quantization_config says so), in 4 GiB shards; reused or
    refused as write_random_checkpoint does."""
    if marker_kind(folder) == RANDOM_WEIGHTS:
        return

    def fill(staging: Path) -> None:
        from planner.source.release_format import release_specs

        (staging / "config.json").write_text(config_path.read_text())
        generator = torch.Generator(device=device).manual_seed(seed)
        write_random_shards(staging, release_specs(json.loads(config_path.read_text())),
                            lambda name, dtype, shape: random_release_tensor(name, dtype, shape, generator, device))

    write_owned_folder(folder, kind=RANDOM_WEIGHTS, fill=fill)


def random_release_tensor(name: str, dtype: str, shape: list[int], generator, device: str) -> torch.Tensor:
    """One tensor of write_random_release: FP8 weights drawn N(0, 1) (std 0.02 once scaled), block scales 0.02
    (times a little noise, so a misplaced scale shows), norms 1, other float tensors N(0, 0.02)."""
    draw = torch.randn(shape, generator=generator, device=device)
    if dtype == "F8_E4M3":
        return draw.to(torch.float8_e4m3fn).cpu()
    if name.endswith("scale_inv"):
        return (0.02 * (1 + 0.1 * draw)).float().cpu()
    torch_dtype = TORCH_DTYPES[dtype]
    if "norm" in name:
        return torch.ones(shape, dtype=torch_dtype)
    return (draw * 0.02).to(torch_dtype).cpu()


def pinned_h2d_bytes_per_s() -> float:
    """The best pinned host-to-device rate: 256 MiB and 1 GiB copies, torch-pinned and registered memory.

    The floor must be a bound the runtime cannot beat, so take the best of the ways it could copy.
    """
    backend = CudaBackend(torch.device("cuda"))
    best = 0.0
    for num_bytes in (2**28, 2**30):
        device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
        registered = backend.pin(torch.empty(num_bytes, dtype=torch.uint8))
        for host in (torch.empty(num_bytes, dtype=torch.uint8).pin_memory(), registered):
            ms = median_event_ms(lambda d=device, h=host: d.copy_(h, non_blocking=True), repeats=6, warmups=2)
            best = max(best, num_bytes / (ms / 1e3))
        backend.unpin(registered)
        del device, registered, host
    return best


def write_calibrated(out: Path) -> Path:
    """Run offload-plan's calibration, write the profile into ``out`` and log its copy-rate points."""
    from runtime.calibrate import calibrate, calibrated_yaml

    path = out / "calibrated.yaml"
    profile, details = calibrate()
    path.write_text(calibrated_yaml(profile))
    log(f"calibrated profile {path}: H2D {profile.h2d_bytes_per_s.value / 1e9:.1f} GB/s + "
        f"{profile.copy_overhead_us.value:.1f} us per copy; points (MiB, ms per copy, GB/s): " + ", ".join(
            f"({b / 2**20:.0f}, {ms:.3f}, {b / ms / 1e6:.1f})" for b, ms in details["h2d_points_bytes_ms"]))
    return path


def free() -> None:
    """Return GPU memory once the caller has dropped its references, cuBLAS's per-stream workspaces included
    (kept otherwise until the process ends; safe here: no captured graph that could use them is left)."""
    gc.collect()
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()


def budget_for_share(layout, share: float) -> int:
    """Weights on the GPU: every non-layer byte plus ``share`` of the layer bytes."""
    return int(layout.non_layer_bytes + share * layout.layer_bytes)


def plan_for(checkpoint: Path, share: float, tokens: int, layout, gpu: str, measure: bool, *, sequences: int = 1,
             context: int = 0, cuda_graph: bool = False):
    """The plan at a budget of non-layer weights + ``share`` of the layer bytes."""
    # here, not at import: planner.make.make_plan reaches the runtime for --measure
    from planner.make.make_plan import make_plan
    from planner.plan.schema import Inputs

    inputs = Inputs(
        model=str(checkpoint), revision=None, gpu=gpu, budget=f"{budget_for_share(layout, share)}B", trigger=None,
        tokens=tokens, sequences=sequences, context=context, params=(), stack=None, group_size=None,
        num_in_group=None, prefetch_step=None, measure=measure, measured_on="h100-sxm" if measure else None,
        cuda_graph=cuda_graph,
    )
    return make_plan(inputs, measure=served_measure() if measure else None).plan


def served_measure():
    """runtime.measure.measured_compute timing the kernels `run` runs (product_kernels): make --measure inside a
    benchmark whose bitwise checks hold deterministic algorithms on for the whole process. Measured under them,
    the skewed Qwen3-30B-A3B plan priced its step at 27.85 ms of compute where serving's kernels took 17.68 ms
    on the H100 (benchmarks/2026-11-26-routed-h100.md)."""
    from runtime.measure import measured_compute

    def measure(*args, **kwargs):
        with product_kernels():
            return measured_compute(*args, **kwargs)

    return measure


def deterministic_decode(*, cudnn_attention: bool = False) -> None:
    """Deterministic algorithms, and (unless asked) no cuDNN attention: what the bitwise decode checks need.

    Two eager decode steps from the same state differed on the H100 with cuDNN attention, which SDPA picks
    for the masked decode step from batch 16 (scripts/experiments/decode_determinism.py); flash, efficient
    and math attention did not. NaN-filling every empty() would add kernels, so that stays off.
    """
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    if not cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)


@contextlib.contextmanager
def product_kernels():
    """The kernels `run` runs, inside a process where deterministic_decode holds the bitwise checks:
    deterministic algorithms off and cuDNN attention allowed, then both as they were. Capture a step again
    inside it before timing: a CUDA graph keeps the kernels of its capture. On an H200 deterministic kernels
    took a Qwen3-30B-A3B decode step from 16.6 to 27.0 ms (scripts/experiments/measure_aliasing.py), a cost
    `run` never pays and `make --measure` does not time."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    cudnn_attention = torch.backends.cuda.cudnn_sdp_enabled()
    torch.use_deterministic_algorithms(False)
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        torch.backends.cuda.enable_cudnn_sdp(cudnn_attention)


def write_report(out: Path, header: str, lines: list[str], rows: list[dict]) -> None:
    """bench.md (the table), bench.json (every figure) and the table on stdout."""
    text = "\n".join(lines)
    (out / "bench.md").write_text(text + "\n")
    (out / "bench.json").write_text(json.dumps({"header": header, "rows": rows}, indent=2))
    print(text, flush=True)


# The replay experiments (scripts/experiments/bench_replay_steps.py and trace_decode.py): one offloaded model,
# one DecodeLoop per arm, all on one engine.

#: steps each arm times per round; divisible by every steps-per-replay count tried
NUM_ARM_STEPS = 24
#: the plan shape bench_decode.py picked at batches 16-64: group size, offloaded per group, prefetch depth
PLAN_SHAPE = (5, 3, 2)


def pinned_plan(checkpoint: Path, batch: int, shape: tuple[int, int, int] = PLAN_SHAPE):
    """The decode plan with ``shape`` pinned, so every batch copies the same bytes."""
    from planner.make.make_plan import make_plan
    from planner.plan.schema import Inputs

    group_size, num_in_group, prefetch_step = shape
    inputs = Inputs(model=str(checkpoint), revision=None, gpu="h100-sxm", budget="60GiB", trigger=None,
                    tokens=batch, sequences=batch, context=CONTEXT_TOKENS, params=(), stack=None,
                    group_size=group_size, num_in_group=num_in_group, prefetch_step=prefetch_step, cuda_graph=True)
    return make_plan(inputs).plan


@dataclass(frozen=True)
class Arm:
    """One way to run the decode steps: eagerly (``replay_start_copies`` None) or graphed."""

    name: str
    steps_per_call: int = 1
    replay_start_copies: int | None = None


def arms_for(plan, steps: list[int], joined: bool) -> list[Arm]:
    """Eager, then graphed with each replay length as the plan splits the wrapped copies and (``joined``) with
    all of them joined at the replay's end, where the plan splits them otherwise."""
    count = plan.offload.replay_start_copies
    arms = [Arm("eager")] + [Arm(f"graphed x{n}", n, count) for n in steps]
    if joined and count:
        arms += [Arm(f"graphed x{n} joined", n, 0) for n in steps]
    return arms


def enter(arm: Arm, engine) -> None:
    """Put the engine in the arm's mode; through eager mode, which makes any copy a replay left pending."""
    engine.set_graph_mode(False)
    if arm.replay_start_copies is not None:
        engine.set_replay_start_copies(arm.replay_start_copies)
        engine.set_graph_mode(True)


def arm_loops(model, engine, batch: int, prompt, arms: list[Arm]) -> dict[Arm, DecodeLoop]:
    """One loop per arm, each with its own KV cache, all prefilled eagerly (graph mode off: an eager forward
    in graph mode would leave its wrapped copies unjoined), then the graphed arms captured."""
    tokens = cache_tokens_for(CONTEXT_TOKENS + 4 * NUM_ARM_STEPS)
    engine.set_graph_mode(False)
    loops = {}
    for arm in arms:
        loops[arm] = DecodeLoop(model, batch=batch, max_cache_tokens=tokens, device=torch.device("cuda"),
                                engine=engine, steps_per_call=arm.steps_per_call)
        loops[arm].prefill(prompt)
    for arm, loop in loops.items():
        if arm.replay_start_copies is not None:
            enter(arm, engine)
            loop.capture()
    engine.set_graph_mode(False)
    return loops


def time_arm(arm: Arm, loop: DecodeLoop, engine) -> float:
    """Median ms per step of NUM_ARM_STEPS back-to-back steps; the loop's cache is put back afterwards."""
    enter(arm, engine)
    saved = loop.save_state()
    loop.timed_steps(loop.steps_per_call)  # one call first: leaves the link and clocks as the others find them
    step_ms = statistics.median(loop.timed_steps(NUM_ARM_STEPS))
    loop.restore_state(saved)
    return step_ms
