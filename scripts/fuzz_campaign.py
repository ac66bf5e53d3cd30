"""The full fuzz campaign of offload-plan's input boundaries (issues 16, 25 and 39): >= 15,000 cases, then the table.

    PYTHONPATH=. python3 scripts/fuzz_campaign.py --seed 25 --cases 15000

Cases are split over the families of tests/fuzz/ in the proportions of SHARES. Prints, per family, the
cases, the failing ones and what failed (verdict and where, with counts), then the median ms per case. With
--failures FILE every failing case is written there as JSON lines (family, index, mutation, verdict, detail),
so ``tests.fuzz.case_for(family, seed, index)`` reproduces it. Exit status 1 when any case failed.
"""

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

from tests.fuzz import FAILURES, FAMILIES, FAMILY_TITLES, failure_summary, run_campaign

#: issue 16's families in its proportions (10,500 cases), and issue 25's beside them (routing traces: session 9);
#: issue 39's (derived figures, tensor parallel, trace's flags, header-checkpoint, outputs that are inputs), then
#: issue 37's CPU experts sections, last
SHARES = {"headers": 2200, "index": 1500, "config": 1500, "plans": 2600, "profiles": 1200, "flags": 1500,
          "adapters": 1500, "serving_flags": 1200, "sections": 2000, "architectures": 1200, "paths": 1000,
          "roundtrip": 600, "traces": 1000, "derived": 2000, "tp": 800, "trace_cli": 800, "header_checkpoint": 500,
          "outputs": 600, "cpu_plans": 600}


def split_cases(total: int, families: list[str]) -> dict[str, int]:
    """``total`` cases over ``families`` in the issue's proportions (at least one each)."""
    weight = sum(SHARES[f] for f in families)
    return {f: max(1, round(total * SHARES[f] / weight)) for f in families}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--cases", type=int, default=15_000, help="total cases over the chosen families")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--time-limit", type=float, default=1.0, help="seconds after which a case is a hang")
    parser.add_argument("--failures", type=Path, help="write every failing case here as JSON lines")
    parser.add_argument("--memory-limit-gib", type=float, default=4.0,
                        help="cap the heap, so a memory bomb is a MemoryError (a failing case), not the OOM killer")
    args = parser.parse_args()
    limit_bytes = int(args.memory_limit_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    counts = split_cases(args.cases, args.families)
    started = time.perf_counter()
    done = [0]

    def progress(result) -> None:
        done[0] += 1
        if done[0] % 500 == 0:
            print(f"  {done[0]}/{sum(counts.values())} cases, {time.perf_counter() - started:.0f} s", file=sys.stderr)

    results = run_campaign(args.seed, counts, args.time_limit, progress)
    if args.failures:
        with args.failures.open("w") as stream:
            for r in results:
                if r.verdict in FAILURES:
                    stream.write(json.dumps({"family": r.family, "index": r.index, "mutation": r.mutation,
                                             "verdict": r.verdict, "detail": r.detail}) + "\n")
    print_table(results, args.seed, time.perf_counter() - started)
    return 1 if any(r.verdict in FAILURES for r in results) else 0


def print_table(results, seed: int, wall_s: float) -> None:
    """The issue's table: family, cases, failing, what failed; then totals and the median time per case."""
    summary = failure_summary(results)
    print(f"\nfuzz campaign, seed {seed}: {len(results)} cases in {wall_s:.0f} s\n")
    print("| family | cases | failing | what failed |")
    print("|---|---|---|---|")
    for family, failures in summary.items():
        cases = [r for r in results if r.family == family]
        failing = sum(failures.values())
        what = "; ".join(f"{text} (x{count})" for text, count in sorted(failures.items(), key=lambda kv: -kv[1]))
        print(f"| {FAMILY_TITLES[family]} | {len(cases):,} | {failing} | {what or '-'} |")
    verdicts = {v: sum(r.verdict == v for r in results) for v in ("error", "accepted", *FAILURES)}
    print("\n" + ", ".join(f"{v}: {n}" for v, n in verdicts.items()))
    times = sorted(r.elapsed_ms for r in results)
    print(f"median {statistics.median(times):.1f} ms per case, p99 {times[int(0.99 * (len(times) - 1))]:.1f} ms, "
          f"slowest {times[-1]:.0f} ms")
    medians = {f: statistics.median(r.elapsed_ms for r in results if r.family == f) for f in summary}
    print("median ms by family: " + ", ".join(f"{FAMILY_TITLES[f]} {ms:.1f}" for f, ms in medians.items()))
    slowest = sorted(results, key=lambda r: -r.elapsed_ms)[:5]
    print("slowest: " + "; ".join(f"{r.family} #{r.index} {r.mutation} {r.elapsed_ms:.0f} ms" for r in slowest))


if __name__ == "__main__":
    sys.exit(main())
