"""Time issue 28's target: ``make --tp 2,4`` of DeepSeek-V3 on gb200 at context 8192, the whole command.

Runs ``python3 -m offload_plan make -m DEEPSEEK -g gb200 --concurrency auto --context 8192 --tp 2,4 -o ...`` as
a fresh process (imports included, as a user runs it) ``--repeat`` times, each checked to state both plans and
the verdict, and prints per run the wall seconds and the CPU seconds (user + sys) the command spent, then the
minimum and median of each. The load average before the first run goes with them: on a shared machine the wall
clock waits for other processes, the CPU column much less, so compare CPU seconds across busy runs and wall
seconds only on a quiet machine. The checkpoint is DeepSeek-V3's header checkpoint (92k tensors in 129 sparse
shards), written by scripts/real_checkpoints.py into .cache/checkpoints if it is not there.

    PYTHONPATH=. python3 scripts/bench_make_tp.py                 # 3 runs
    PYTHONPATH=. python3 scripts/bench_make_tp.py --repeat 5 --target-s 5

``--target-s S`` exits 1 when the fastest run's wall time is not under S seconds (the issue's figure is 5).
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts import real_checkpoints

MODEL = "deepseek-v3"
ARGS = ("-g", "gb200", "--concurrency", "auto", "--context", "8192", "--tp", "2,4")


def parser() -> argparse.ArgumentParser:
    """--repeat, --checkpoints, --target-s."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--repeat", type=int, default=3, help="runs of the command (default 3)")
    result.add_argument("--checkpoints", type=Path, default=real_checkpoints.OUTPUT_DIR,
                        help="folder holding deepseek-v3/ (written there if missing; default .cache/checkpoints)")
    result.add_argument("--target-s", type=float, default=None,
                        help="exit 1 unless the fastest run's wall time is under this many seconds")
    return result


def checkpoint_folder(checkpoints: Path) -> Path:
    """DeepSeek-V3's header checkpoint under ``checkpoints``, written first if it is missing."""
    folder = checkpoints / MODEL
    if not (folder / "model.safetensors.index.json").is_file():
        real_checkpoints.write_checkpoint(MODEL, checkpoints)
    return folder


def run_once(folder: Path, out_dir: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one make --tp 2,4; a run that fails or does not state both plans exits."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "offload_plan", "make", "-m", str(folder), *ARGS,
                           "-o", str(out_dir / "ds.yaml")], capture_output=True, text=True,
                          cwd=real_checkpoints.REPO_ROOT)
    wall_s = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = done.stderr.splitlines()
    stated = (done.returncode == 0 and any("2 GPU(s)" in line for line in lines)
              and any("4 GPU(s)" in line for line in lines) and "without" in lines[-1])
    if not stated:
        sys.exit(f"make --tp 2,4 failed (exit {done.returncode}): {done.stderr.strip()[-400:]}")
    return wall_s, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    """Time the runs, print the table; 1 where --target-s is missed."""
    args = parser().parse_args(argv)
    folder = checkpoint_folder(args.checkpoints)
    load = os.getloadavg()[0]
    print(f"make -m {MODEL} {' '.join(ARGS)}: {args.repeat} runs, load average {load:.2f} on "
          f"{os.cpu_count()} CPUs before the first")
    walls, cpus = [], []
    with tempfile.TemporaryDirectory() as out_dir:
        for index in range(args.repeat):
            wall_s, cpu_s = run_once(folder, Path(out_dir))
            walls.append(wall_s)
            cpus.append(cpu_s)
            print(f"run {index + 1}: {wall_s:.2f} s wall, {cpu_s:.2f} s CPU (user + sys)")
    print(f"wall: min {min(walls):.2f} s, median {statistics.median(walls):.2f} s; CPU: min {min(cpus):.2f} s, "
          f"median {statistics.median(cpus):.2f} s")
    if args.target_s is not None and min(walls) >= args.target_s:
        print(f"the fastest run took {min(walls):.2f} s, not under {args.target_s:g} s")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
