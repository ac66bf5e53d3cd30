"""Issue 37 on paper: the per-step split with a fractional CPU share (one expert split by its rows), priced by the
planner's own timeline.

    PYTHONPATH=. python3 scripts/experiments/fractional_split_price.py --gpu PROFILE [--accuracy 0.5]

The per-step split (planner.search.cpu_per_step) sends j(m) whole experts of a step's m misses to the CPU. Here j
may be fractional: the CPU computes floor(x) whole experts and rows [0, f I) of one more (f = x - floor(x)) while
the link brings m - x experts' bytes (scripts/experiments/fractional_expert.py measured both parts on the H200:
the split gather reads at the whole gather's rate, and the C kernel's time on r rows is a fixed cost plus a
share in r). The CPU's time for x experts is then h + c (floor(x) + [f > 0] (a + (1 - a) f)), c the plan's CPU
ms per expert inside the step and a the share of an expert's CPU time that does not shrink with its rows
(--fixed-share, from that measurement). For each m, x(m) is the share of least expected wait over a grid of
1/64 expert, and the layer's wait is E over the step's (touched, missed) draw of max(link, CPU) at x(m), as
cpu_per_step prices integers. Everything else (residency, prefetch, compute, the timeline) is make's.

Nothing here runs on a GPU: the plans are made from header-only checkpoints (offload-plan header-checkpoint) of
the benchmarked cuts (8 layers), at the budgets scripts/bench_hybrid.py gave them.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys
import tempfile

from planner.make.make_plan import make_plan
from planner.plan.schema import Inputs
from planner.search import cpu_per_step

REPO = pathlib.Path(__file__).resolve().parents[2]
#: (name, example config, layers of the cut, budget of bench_hybrid's cut in MiB, the fixed share a)
MODELS = (("qwen3-moe", "examples/qwen3-30b-a3b/config.json", 8, 5085, 0.245),
          ("mixtral", "examples/mixtral-8x7b/config.json", 8, 8566, 0.0))
GRID = 64
#: cpu_per_step's own pricing of whole experts, restored by fractional(False)
WHOLE = {"cpu_ms": cpu_per_step._cpu_ms, "best_take": cpu_per_step._best_take}
#: the share of a whole expert's CPU time that a split expert still pays (set per model in main)
FIXED_SHARE = {"value": 0.0}


def cpu_ms(x: float, handoff_ms: float, cpu_ms_per_expert: float) -> float:
    whole = math.floor(x + 1e-9)
    part = x - whole
    fixed = FIXED_SHARE["value"]
    return handoff_ms + cpu_ms_per_expert * (whole + (fixed + (1 - fixed) * part if part > 1e-9 else 0.0))


def best_share(num_missed: int, terms: list[tuple[int, float]], link, handoff_ms: float,
               cpu_ms_per_expert: float) -> float:
    """cpu_per_step._best_take with fractional shares: the x on a grid of 1/GRID expert of least expected wait."""
    choices = [k / GRID for k in range(num_missed * GRID + 1)]
    return min(choices, key=lambda x: math.fsum(
        p * max(link.at(n, num_missed - x), cpu_ms(x, handoff_ms, cpu_ms_per_expert)) for n, p in terms))


def fractional(on: bool) -> None:
    """Price per-step layers with fractional shares (True) or as make does (False): cpu_per_step's table and
    expected wait with this script's CPU time and choice of share in place of whole experts'."""
    cpu_per_step._cpu_ms = cpu_ms if on else WHOLE["cpu_ms"]
    cpu_per_step._best_take = best_share if on else WHOLE["best_take"]
    cpu_per_step.per_step_split.cache_clear()  # its tables were made under the other pricing


def header_checkpoint(config: str, layers: int, folder: pathlib.Path) -> pathlib.Path:
    values = json.loads((REPO / config).read_text())
    values["num_hidden_layers"] = layers
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(values))
    target = folder / "checkpoint"
    if not target.exists():
        subprocess.run([sys.executable, "-m", "offload_plan", "header-checkpoint", str(folder / "config.json"),
                        str(target)], check=True, cwd=REPO, capture_output=True)
    return target


def step_ms(model: pathlib.Path, gpu: str, budget_mib: int, sequences: int, accuracy: float, cpu: str) -> float:
    inputs = Inputs(model=str(model), gpu=gpu, budget=f"{budget_mib}MiB", tokens=sequences, sequences=sequences,
                    context=4096, cuda_graph=True, prefetch_accuracy=accuracy, cpu_experts=cpu)
    return make_plan(inputs).plan.prediction.step_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", required=True, help="a calibrated profile with cpu_experts")
    parser.add_argument("--accuracy", type=float, default=0.5)
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    work = pathlib.Path(tempfile.gettempdir()) / "fractional-split-price"
    print("| model | S | fetch-only | per-step, whole experts | per-step, fractional | fractional over whole |")
    print("|---|---|---|---|---|---|")
    for name, config, layers, budget, fixed in MODELS:
        FIXED_SHARE["value"] = fixed
        checkpoint = header_checkpoint(config, layers, work / name)
        for sequences in args.sequences:
            fractional(False)
            fetch = step_ms(checkpoint, args.gpu, budget, sequences, args.accuracy, "off")
            whole = step_ms(checkpoint, args.gpu, budget, sequences, args.accuracy, "auto")
            fractional(True)
            part = step_ms(checkpoint, args.gpu, budget, sequences, args.accuracy, "auto")
            fractional(False)
            print(f"| {name} | {sequences} | {fetch:.2f} | {whole:.2f} | {part:.2f} | {whole / part:.3f}x |")


if __name__ == "__main__":
    main()
