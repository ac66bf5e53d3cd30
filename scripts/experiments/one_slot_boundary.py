"""A graphed serving plan that streams two layers through one slot (knobs 6/2/1): where its step goes.

The sweep's Gemma-2 tight arm (benchmarks/2026-11-28-conformance-graphed-chunk-h100.md) made this shape and ran
+85% over its prediction, steps 8.3-13.9 ms against 6.30. With one slot the two copies are a serial chain
(copy A, compute A, copy B, compute B), and the replay boundary decides whether copy A overlaps the next replay's
first layers (offload.replay_start_copies 1) or ends the replay joined (0). This script makes that plan with the
knobs pinned and runs `run --bench --json` on it, and on a copy edited to replay_start_copies 0, alternating, each
bench between two link probes, so a slow step can be told from a slow link. On the H200 `run` refused the edited
copy in one line (its prediction is no longer its schedule's), as it refuses any such hand edit; the plan as made
ran 6.64-6.72 ms against 6.44 predicted, the link at 55.4 GB/s before and after.

    PYTHONPATH=. python3 scripts/experiments/one_slot_boundary.py --gpu calibrated-h100.yaml --out $OUT/one-slot
"""

import argparse
import json
from pathlib import Path

import yaml

from scripts import conformance

#: the sweep's cap for that arm (3,576,701,015 bytes) and its knobs
CAP = "3412MiB"
KNOBS = ("6", "2", "1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", required=True, help="profile for make")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folder, _ = conformance.ensure_checkpoint(conformance.MODELS["gemma2"], Path("/tmp/conformance"), False, "cuda")
    plan = args.out / "gemma2-one-slot.yaml"
    made = conformance.cli(["make", "--model", folder, "--gpu", args.gpu, "-o", plan, "--concurrency", "1",
                            "--context", "4096", "--cuda-graph", "--gpu-memory", CAP, "--measure",
                            "--group-size", KNOBS[0], "--num-in-group", KNOBS[1], "--prefetch-step", KNOBS[2]])
    if made.code:
        print("make failed:", made.stderr.strip()[-400:])
        return 1
    text = yaml.safe_load(plan.read_text())
    offload = text["offload"]
    print("offloaded", offload.get("layers"), "replay_start_copies", offload.get("replay_start_copies"),
          "predicted", text["prediction"])
    rows = []
    for repeat in range(args.repeats):
        for count in (0, 1):
            edited = dict(text, offload=dict(offload, replay_start_copies=count))
            path = args.out / f"gemma2-one-slot-rsc{count}.yaml"
            path.write_text(yaml.safe_dump(edited, sort_keys=False))
            conformance.gpu_clean()
            before = conformance.link_rate_now()
            bench = conformance.cli(["run", path, "--bench", "--json"])
            after = conformance.link_rate_now()
            figures = json.loads(bench.stdout[bench.stdout.index("{"):]) if bench.code == 0 else {}
            row = {"repeat": repeat, "replay_start_copies": count, "exit": bench.code,
                   "error": bench.stderr.strip()[-300:] if bench.code else None,
                   "link_gb_per_s_before": before, "link_gb_per_s_after": after,
                   "decode_step_ms": figures.get("decode_step_ms"),
                   "decode_step_ms_all": figures.get("decode_step_ms_all"),
                   "predicted_decode_step_ms": figures.get("predicted_decode_step_ms")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (args.out / "one_slot_boundary.json").write_text(json.dumps({"plan": text, "rows": rows}, indent=1))
    print("\n| rsc | link before/after GB/s | median step ms | min | max | predicted |\n|---|---|---|---|---|---|")
    for row in rows:
        steps = row["decode_step_ms_all"] or [float("nan")]
        print(f"| {row['replay_start_copies']} | {row['link_gb_per_s_before']}/{row['link_gb_per_s_after']} | "
              f"{row['decode_step_ms']} | {min(steps):.2f} | {max(steps):.2f} | {row['predicted_decode_step_ms']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
