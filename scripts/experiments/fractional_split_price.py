"""Issue 37 on paper: the per-step split with a fractional CPU share (one expert split by its rows), priced by the
planner's own timeline.

    PYTHONPATH=. python3 scripts/experiments/fractional_split_price.py --gpu PROFILE [--accuracy 0.5]

First written (2026-11-29) to price the split before it was built, by patching planner.search.cpu_per_step's
pricing; make --cpu-experts rows now plans it (the CPU's fixed part of a fraction from the profile's overhead,
PART_EXTRA_MS for what a split step costs besides). This prints make's predicted step for fetch-only, auto (whole
CPU experts) and rows. Before PART_EXTRA_MS (as first printed: Mixtral-8x7B 68.80 to 60.20 ms, 1.14x; Qwen3-30B-A3B
1.04x) the small experts were split too; measured, that did not pay (benchmarks/2026-11-29-cpu-experts-rows-h200.md).

Nothing here runs on a GPU: the plans are made from header-only checkpoints (offload-plan header-checkpoint) of the
benchmarked cuts (8 layers), at the budgets scripts/bench_hybrid.py gave them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

from planner.make.make_plan import make_plan
from planner.plan.schema import Inputs

REPO = pathlib.Path(__file__).resolve().parents[2]
#: (name, example config, layers of the cut, budget of bench_hybrid's cut in MiB)
MODELS = (("qwen3-moe", "examples/qwen3-30b-a3b/config.json", 8, 5085),
          ("mixtral", "examples/mixtral-8x7b/config.json", 8, 8566))


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
    print("| model | S | fetch-only | auto (whole CPU experts) | rows (fractions) | rows over auto |")
    print("|---|---|---|---|---|---|")
    for name, config, layers, budget in MODELS:
        checkpoint = header_checkpoint(config, layers, work / name)
        for sequences in args.sequences:
            fetch, whole, part = (step_ms(checkpoint, args.gpu, budget, sequences, args.accuracy, choice)
                                  for choice in ("off", "auto", "rows"))
            print(f"| {name} | {sequences} | {fetch:.2f} | {whole:.2f} | {part:.2f} | {whole / part:.3f}x |")


if __name__ == "__main__":
    main()
