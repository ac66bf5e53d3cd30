"""The open fault of make --cpu-experts rows (an expert split by its rows between the CPU and the link), on a GPU.

    PYTHONPATH=. python3 scripts/experiments/rows_split_fault.py --gpu PROFILE      # a profile with cpu_experts

scripts/conformance.py's phimoe model (PhiMoE widths, 3 layers, release format) at its serving-4 tight cap, made
estimated as the sweep makes it, once with --cpu-experts rows and once with auto (whole CPU experts), then each
decoded greedily at one sequence (the graphed static-cache decode run --prompt uses) against the all-resident plan,
by both handoffs: the worst logit difference per step as a share of the step's largest (conformance.first_split).

On the H200 on 2026-11-29 the rows plan's step 2 was 0.554 and step 7 0.204 of the largest logit off, by either
handoff alike (deterministic), where auto's steps stayed within 0.008; the same tables on the CPU stand-in at the
full PhiMoE widths (2 layers, the torch twins of the fused plan and the gather, the C kernel) stayed within 0.0045.
So the fault is in a GPU-only piece (the fused fetch plan's part, the gather's part tiles, or the routed layer
around them) on this shape; tests/runtime's GPU tests of those pieces pass on a small model.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from runtime.cpu_experts import BF16_TOLERANCE
from scripts import conformance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", required=True, help="a calibrated profile with a cpu_experts section")
    parser.add_argument("--work", type=Path, default=Path("/tmp/rows-split-fault"))
    args = parser.parse_args()
    start = time.time()
    model = conformance.MODELS["phimoe"]
    folder, _ = conformance.ensure_checkpoint(model, args.work / "checkpoints", False, "cuda")
    caps = conformance.caps_for(folder, args.gpu, moe=True, graphed=model.graphed)
    arm = conformance.Arm(model="phimoe", mode="serving-4", cap="tight", measure=False)
    args.work.mkdir(parents=True, exist_ok=True)
    reference = conformance.reference_path(args.work, False)
    resident = ["--tokens", 1, "--sequences", 1, "--context", conformance.DECODE_CONTEXT, *model.graph_flags,
                "--budget", conformance.mib(caps["all_resident_budget"])]
    conformance.cli(["make", "--model", folder, "--gpu", args.gpu, *resident, "-o", reference])
    reference_logits = conformance.reference_logits(reference)
    for choice in ("rows", "auto"):
        path = args.work / f"{choice}.yaml"
        made = conformance.cli([*conformance.make_args(arm, folder, args.gpu, caps, path), "--cpu-experts", choice])
        if made.code:
            print(f"{choice}: make failed: {made.error}")
            continue
        for handoff in ("doorbell", "host-node"):
            os.environ["OFFLOAD_PLAN_CPU_HANDOFF"] = handoff
            logits = conformance.greedy_logits(path, conformance.MAX_NEW_TOKENS)[1]
            split = conformance.first_split(logits, reference_logits, BF16_TOLERANCE)
            print(f"{choice} {handoff}: split at {split['split_at']}, worst {split['worst_share']:.4f}, per step "
                  f"{split['shares'][:10]} ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
