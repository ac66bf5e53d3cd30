"""Roofline estimate against measured layer times on the local GPU, for dense and MoE shapes.

For each example config, a header-only checkpoint gives the layout; one layer of each kind is timed at a
prefill and a decode workload (runtime.measure) and compared with the estimate from the built-in profile
(datasheet rates x compute_efficiency) and, with --calibrated FILE, from a calibrated profile.

    PYTHONPATH=. python3 scripts/experiments/layer_times.py [--calibrated my-gpu.yaml]   # on a machine with a GPU
"""

import argparse
import tempfile
from pathlib import Path

from planner.source.checkpoint import load_checkpoint
from planner.model.cost import Workload, estimate_compute, geometry_from_config
from runtime.header_checkpoint import write_header_checkpoint
from planner.model.layout import build_layout, layer_kinds
from planner.source.profile import load_profile
from runtime.measure import local_profile_name, measure_local

EXAMPLES = Path("examples")  # run from the repository root

MODELS = ("qwen3-8b", "mixtral-8x7b", "qwen3-30b-a3b")
WORKLOADS = {
    "prefill 2048": Workload(tokens_per_step=2048, sequences_per_step=1, context_tokens=0),
    "decode 64 x ctx 1024": Workload(tokens_per_step=64, sequences_per_step=64, context_tokens=1024),
}


def header_checkpoint(name: str, folder: Path) -> Path:
    """A bf16 header-only checkpoint of examples/NAME in ``folder``/NAME."""
    return write_header_checkpoint(EXAMPLES / name / "config.json", folder / name, dtype="bfloat16").folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calibrated", help="a profile written by offload-plan calibrate")
    args = parser.parse_args()
    profiles = [load_profile(local_profile_name())] + ([load_profile(args.calibrated)] if args.calibrated else [])
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in MODELS:
            checkpoint = load_checkpoint(str(header_checkpoint(name, Path(folder))))
            layout = build_layout(checkpoint)
            geometry = geometry_from_config(checkpoint.config, layout)
            shapes = {t.name: t.shape for t in checkpoint.tensors}
            representative = layer_kinds(layout.layers)[0][0]
            for label, workload in WORKLOADS.items():
                measured_ms, _ = measure_local(checkpoint, layout, workload)
                estimates = [estimate_compute(layout, geometry, workload, p, shapes).layer_ms[representative]
                             for p in profiles]
                rows.append((name, label, measured_ms[representative], estimates))
                print(rows[-1], flush=True)
    header = "| model | workload | measured ms/layer | " + " | ".join(
        f"{p.name} estimate ms (x measured)" for p in profiles) + " |"
    print("\n" + header)
    print("|" + "---|" * (3 + len(profiles)))
    for name, label, measured, estimates in rows:
        cells = " | ".join(f"{e:.3f} ({e / measured:.2f}x)" for e in estimates)
        print(f"| {name} | {label} | {measured:.3f} | {cells} |")


if __name__ == "__main__":
    main()
