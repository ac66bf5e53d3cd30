"""Serving benchmark on a CUDA GPU: the planner's pick of concurrency and placement against the alternatives.

At each point (a model shape, the GPU memory it is capped to, a context), `make --concurrency auto --cuda-graph
--measure` picks a concurrency and a placement; the alternatives are the best plan that offloads nothing (at
the largest concurrency where the whole model fits), the pick's placement at half and at twice its
concurrency, one layer per group more and one less offloaded at its concurrency, and the last layers offloaded
contiguously (as the engines' docs suggest) at its concurrency. Every arm that fits runs graphed decode over a
static cache filled to the context, in a process capped to the point's GPU memory (runtime.serving), and its
first decode step's logits are compared bit for bit with the all-resident model's (uncapped) over the same
cache. Regret = the fastest measured tokens/s over the pick's. Weights are random (one copy kept on the host,
shared by every arm); plans are made from header-only checkpoints with the calibrated profile.

    PYTHONPATH=. python3 scripts/bench_serving.py --points 8b-24g-4k 8b-24g-16k      # on a machine with a GPU
    PYTHONPATH=. python3 scripts/bench_serving.py --points 30b-a3b-24g-4k v2-lite-16g-4k   # the MoE points
    PYTHONPATH=. python3 scripts/bench_serving.py --points gemma3-16g-8k gpt-oss-16g-8k   # sliding-window caches

The sliding-window points are cut from the releases' configs (``Point.changes``): Gemma-3-27B's language model
(gemma3_text; five sliding layers of 1,024 tokens to one global) at 24 of its 62 layers, and gpt-oss at
gpt-oss-20b's 32 experts (top-4) and 12 layers, its experts in bf16 (no MXFP4), sliding layers of 128 tokens
alternating with full ones.
"""

import argparse
import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before CUDA starts

import torch  # noqa: E402

from planner.errors import OffloadPlanError  # noqa: E402
from scripts.benchmarking import (deterministic_decode, free, log, product_kernels, served_measure,  # noqa: E402
                                  write_calibrated)


@dataclass(frozen=True)
class Point:
    """One regime of the benchmark."""

    config: str
    gpu_memory_gib: int
    context_tokens: int
    #: config.json keys replaced (None: removed) to cut the release's shape down; the point's own config is
    #: written beside its checkpoint
    changes: tuple[tuple[str, object], ...] = ()


POINTS = {
    "8b-24g-4k": Point("examples/qwen3-8b/config.json", 24, 4096),
    "8b-24g-16k": Point("examples/qwen3-8b/config.json", 24, 16384),
    "14b-16g-4k": Point("examples/qwen3-14b/config.json", 16, 4096),
    "14b-24g-4k": Point("examples/qwen3-14b/config.json", 24, 4096),
    # MoE: 128 experts top-8 (61 GB in bf16), and MLA with 2 shared + 64 routed experts (31 GB) where 16 GiB
    # forces offloading
    "30b-a3b-24g-4k": Point("examples/qwen3-30b-a3b/config.json", 24, 4096),
    "v2-lite-16g-4k": Point("examples/deepseek-v2-lite/config.json", 16, 4096),
    # sliding-window and hybrid caches (issue 23): 24 GB and 21 GB of bf16 weights against 16 GiB at 8k context
    "gemma3-16g-8k": Point("examples/gemma-3-27b-it/config.json", 16, 8192, changes=(
        ("text_config", None), ("num_hidden_layers", 24), ("architectures", ["Gemma3ForCausalLM"]),
        ("model_type", "gemma3_text"))),
    "gpt-oss-16g-8k": Point("plans/models/gpt-oss-120b/config.json", 16, 8192, changes=(
        ("quantization_config", None), ("num_hidden_layers", 12), ("num_local_experts", 32), ("layer_types", None))),
}


def point_config(point: Point, folder: Path) -> Path:
    """The point's config.json: the release's, or with ``changes`` applied (a nested text_config lifted to the
    top, as the language model alone is benchmarked) and written under ``folder``."""
    if not point.changes:
        return Path(point.config)
    config = json.loads(Path(point.config).read_text())
    changes = dict(point.changes)
    if "text_config" in changes and isinstance(config.get("text_config"), dict):
        config = {"torch_dtype": config.get("torch_dtype"), **config["text_config"]}
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config, indent=1, sort_keys=True))
    return path


def header_checkpoint(config: str, root: Path, name: str | None = None) -> Path:
    """A header-only checkpoint of ``config`` (names, dtypes and shapes; no weights) for planning, in
    ``root``/``name`` (default: the config's folder name)."""
    from planner.source.header_checkpoint import marker_kind
    from runtime.header_checkpoint import write_header_checkpoint

    folder = root / (name or Path(config).parent.name)
    if marker_kind(folder) is None:
        write_header_checkpoint(config, folder)
    return folder


def point_checkpoint(name: str, point: Point, root: Path) -> Path:
    """The point's header-only checkpoint: of the release's config, or of the cut one under the point's name."""
    if not point.changes:
        return header_checkpoint(point.config, root)
    return header_checkpoint(str(point_config(point, root / "configs" / name)), root, name)


#: measure layer times on this GPU (False: roofline estimates, for --plan-only on a machine without one)
MEASURE = {"on": True}


def make(checkpoint: Path, profile: Path, point: Point, concurrency: str, knobs=(None, None, None),
         budget: int | None = None):
    """A serving plan of the point, measured on this GPU (knobs: pinned G, K, P; budget: fixed GPU bytes for
    the weights), or the one-line reason why none fits."""
    from planner.make.make_plan import make_plan
    from planner.plan.schema import Inputs

    group_size, num_in_group, prefetch_step = knobs
    inputs = Inputs(
        model=str(checkpoint), revision=None, gpu=str(profile), budget=None if budget is None else f"{budget}B",
        trigger=None, tokens=1, sequences=1, context=point.context_tokens, params=(), stack=None,
        group_size=group_size, num_in_group=num_in_group, prefetch_step=prefetch_step, measure=MEASURE["on"],
        measured_on="h100-sxm" if MEASURE["on"] else None, cuda_graph=True, concurrency=concurrency,
        gpu_memory=f"{point.gpu_memory_gib}GiB")
    try:
        return make_plan(inputs, measure=served_measure() if MEASURE["on"] else None).plan
    except OffloadPlanError as error:
        return str(error)


def alternatives(pick, checkpoint: Path, profile: Path, point: Point) -> dict:
    """name -> plan (or why none fits): the pick and the alternatives the module docstring lists, plus each
    other placement at the concurrency where it serves the most tokens/s, where that is not the pick's."""
    offload, batch, num_layers = pick.offload, pick.workload.concurrency, pick.model.num_layers

    def arm(concurrency, **pinned):
        return make(checkpoint, profile, point, str(concurrency), **pinned)

    arms = {"pick": pick}
    if pick.serving.no_offload_concurrency is not None and offload.layers:
        arms["no offload, most sequences"] = arm(pick.serving.no_offload_concurrency)
    # the pick's placement: its knobs pinned, or (offloading nothing) its weights' bytes as a fixed budget
    same = {"knobs": (offload.group_size, offload.num_in_group, offload.prefetch_step)} if offload.layers \
        else {"budget": pick.memory.gpu_bytes}
    arms["pick's placement, half the sequences"] = arm(max(1, batch // 2), **same)
    arms["pick's placement, twice the sequences"] = arm(2 * batch, **same)
    if offload.layers:
        group, count, depth = same["knobs"]
        placements = {"one more offloaded per group": (group, count + 1, depth) if count < group else None,
                      "one fewer offloaded per group": (group, count - 1, depth) if count > 1 else None,
                      "deeper prefetch": (group, count, depth + 1),
                      "last layers contiguous": (num_layers, len(offload.layers), depth)
                      if (group, count) != (num_layers, len(offload.layers)) else None}
    else:
        placements = {"last quarter offloaded": (num_layers, num_layers // 4, 2),
                      "last half offloaded": (num_layers, num_layers // 2, 2)}
    for name, knobs in placements.items():
        if knobs is None:
            continue
        arms[name] = arm(batch, knobs=knobs)
        best = arm("auto", knobs=knobs)  # the placement at the concurrency that suits it best
        if isinstance(arms[name], str) or (not isinstance(best, str) and best.workload.concurrency != batch):
            arms[f"{name}, its best concurrency"] = best
    return arms


def host_model(checkpoint: Path):
    """The model of the header checkpoint's config with random bf16 weights on the host (drawn on the GPU:
    faster), built once per shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint), dtype=torch.bfloat16)
    model = model.to("cpu").eval()
    free()
    return model


def sharing_copy(model):
    """A copy of ``model`` whose parameters share the host tensors: placing it leaves ``model`` as it is."""
    memo = {id(p): torch.nn.Parameter(p.data, requires_grad=False) for p in model.parameters()}
    return copy.deepcopy(model, memo)


def reference_logits(master, plan) -> torch.Tensor:
    """The all-resident model's first decode step over the plan's seeded cache, eager, uncapped."""
    from runtime.load import Loaded
    from runtime.serving import serve_and_time

    model = sharing_copy(master).cuda()
    _, logits = serve_and_time(Loaded(model=model, engine=None, plan=plan, weights_gpu_bytes=0), cuda_graph=False)
    del model
    free()
    return logits


def run_arm(master, plan, reference: torch.Tensor) -> dict:
    """Place the plan's weights, cap the process to its GPU memory, serve graphed; the figures as a dict."""
    from runtime.backend import CudaBackend
    from runtime.load import Loaded
    from runtime.placement import apply_plan
    from runtime.serving import cap_gpu_memory, release_cap, serve_and_time

    device = torch.device("cuda", torch.cuda.current_device())
    baseline = {"reserved_before_bytes": torch.cuda.memory_reserved(device)}  # what earlier arms left: 0 expected
    fraction = cap_gpu_memory(plan.memory.gpu_memory_bytes, device)
    model = sharing_copy(master)
    engine = None
    try:
        if plan.offload.layers:
            engine = apply_plan(model, plan, CudaBackend(device))
        else:
            model = model.cuda()
        # the first step's bits checked with deterministic kernels, the steps timed with serving's
        bench, _ = serve_and_time(Loaded(model=model, engine=engine, plan=plan, weights_gpu_bytes=0),
                                  cuda_graph=True, memory_fraction=fraction, reference_logits=reference,
                                  timing_kernels=product_kernels)
        return baseline | bench.as_dict()
    except (OffloadPlanError, torch.OutOfMemoryError) as error:
        return baseline | {"error": str(error).splitlines()[0]}
    finally:
        if engine is not None:
            engine.close()
        del model, engine
        free()
        release_cap(device)


def run_point(name: str, point: Point, profile: Path, root: Path, plan_only: bool = False,
              progress=None) -> list[dict]:
    """Every arm of one point: planned, and (unless ``plan_only``) run; ``progress(rows)`` after each arm."""
    checkpoint = point_checkpoint(name, point, root)
    pick = make(checkpoint, profile, point, "auto")
    if isinstance(pick, str):
        log(f"{name}: no plan: {pick}")
        return [{"point": name, "arm": "pick", "error": pick}]
    arms = alternatives(pick, checkpoint, profile, point)
    for arm, plan in arms.items():
        log(f"{name}: {arm}: " + (plan if isinstance(plan, str) else json.dumps(plan_figures(plan))))
    if plan_only:
        return [{"point": name, "arm": arm} | ({"error": plan} if isinstance(plan, str) else plan_figures(plan))
                for arm, plan in arms.items()]
    master = host_model(checkpoint)
    references = {}
    rows = []
    for arm, plan in arms.items():
        row = {"point": name, "arm": arm}
        if isinstance(plan, str):
            rows.append(row | {"error": plan})
            continue
        key = plan.workload.concurrency
        if key not in references:
            references[key] = reference_logits(master, plan)
        row |= plan_figures(plan) | run_arm(master, plan, references[key])
        log(json.dumps(row))
        rows.append(row)
        if progress is not None:
            progress(rows)
    del master
    free()
    return rows


def plan_figures(plan) -> dict:
    """What the plan predicts, for the table."""
    offload = plan.offload
    return {"concurrency": plan.workload.concurrency, "offloaded": len(offload.layers),
            "knobs": [offload.group_size, offload.num_in_group, offload.prefetch_step, offload.replay_start_copies],
            "predicted_tokens_per_s": plan.prediction.decode_tokens_per_s,
            "predicted_total_gpu_bytes": plan.memory.total_gpu_bytes,
            "predicted_activation_bytes": plan.memory.activation_bytes}


def table(rows: list[dict]) -> list[str]:
    """Markdown: one line per arm, and each point's regret (fastest measured over the pick's tokens/s)."""
    lines = ["| point | arm | sequences | offloaded (G,K,P,left) | tokens/s | predicted | error | per token ms | "
             "peak GPU GiB / planned / cap | bitwise |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "decode_tokens_per_s" not in row:
            planned = (f"{row['concurrency']} | {row['offloaded']} ({','.join(map(str, row['knobs']))}) | - | "
                       f"{row['predicted_tokens_per_s']:,.1f}") if "knobs" in row else "- | - | - | -"
            lines.append(f"| {row['point']} | {row['arm']} | {planned} | - | - | - | {row.get('error', '')[:90]} |")
            continue
        measured, predicted = row["decode_tokens_per_s"], row["predicted_tokens_per_s"]
        lines.append(
            f"| {row['point']} | {row['arm']} | {row['concurrency']} | "
            f"{row['offloaded']} ({','.join(map(str, row['knobs']))}) | {measured:,.1f} | {predicted:,.1f} | "
            f"{(predicted - measured) / measured:+.1%} | {row['decode_step_ms']:.2f} | "
            f"{row['peak_gpu_bytes'] / 2**30:.2f} / {row['predicted_total_gpu_bytes'] / 2**30:.2f} / "
            f"{row['gpu_memory_bytes'] / 2**30:.0f} | "
            f"{row['first_step_bitwise']} |")
    lines.append("")
    for point in dict.fromkeys(row["point"] for row in rows):
        measured = {r["arm"]: r["decode_tokens_per_s"] for r in rows
                    if r["point"] == point and "decode_tokens_per_s" in r}
        if "pick" in measured:
            best = max(measured, key=measured.get)
            lines.append(f"{point}: regret {measured[best] / measured['pick']:.3f} (fastest: {best})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="+", choices=sorted(POINTS), default=sorted(POINTS))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/bench-serving"))
    parser.add_argument("--root", type=Path, default=Path("/tmp/bench-serving-checkpoints"))
    parser.add_argument("--plan-only", action="store_true",
                        help="make the plans from roofline estimates with the h100-sxm profile and stop "
                             "(no GPU needed)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OFFLOAD_PLAN_CACHE", str(args.root / "cache"))
    if args.plan_only:
        MEASURE["on"] = False
        profile = Path("profiles/h100-sxm.yaml")
    else:
        deterministic_decode()
        log(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
        profile = write_calibrated(args.out)
    rows = []

    def save(point_rows: list[dict]) -> None:  # a run cut short still leaves every arm it finished
        (args.out / "serving.json").write_text(json.dumps(rows + point_rows, indent=1, default=str))

    for name in args.points:
        rows += run_point(name, POINTS[name], profile, args.root, args.plan_only, save)
        save([])
    text = "\n".join(table(rows))
    (args.out / "serving.md").write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
