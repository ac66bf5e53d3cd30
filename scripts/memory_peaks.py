"""Where a plan's GPU memory goes: ``run PLAN --bench --json`` in this process with the allocator's history
recorded and the plan's cap lifted, then, per phase of the bench, the peak of allocated bytes and the sites
(runtime, transformers or torch source lines) of the blocks alive at that peak, against what the plan books.

A plan that runs out of memory at its cap stops at the first allocation over it; lifted, the run goes on and
every phase's true peak is seen, so the difference from the plan can be read per site, not guessed.

    PYTHONPATH=. python3 scripts/memory_peaks.py plans/x.yaml [--top 8] [--json out.json]

Needs a CUDA GPU. The phase marks are allocations of a size no step makes (MARK_BASE_BYTES + 512 x phase),
allocated and freed where the bench reads its reserved peak.
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

#: marker allocation sizes: MARK_BASE_BYTES + 512 * n (rounded by the allocator to 512: kept exact)
MARK_BASE_BYTES = 511 * 1024 * 1024 + 512 * 97
#: frames of these files name a site (the first one found, in this order of preference)
SITE_PREFERENCE = ("/runtime/", "/transformers/", "/torch/")
MIB = 1024 * 1024


def lift_cap_and_mark() -> list[str]:
    """Make set_per_process_memory_fraction a no-op and mark every reserved-peak read; the marks' labels."""
    labels: list[str] = []
    read_peak = torch.cuda.max_memory_reserved

    def marked_peak(*args, **kwargs):
        labels.append(f"mark {len(labels)}")
        torch.empty(MARK_BASE_BYTES + 512 * len(labels), dtype=torch.uint8, device="cuda")
        return read_peak(*args, **kwargs)

    torch.cuda.max_memory_reserved = marked_peak
    torch.cuda.set_per_process_memory_fraction = lambda *args, **kwargs: None
    return labels


def site_of(frames: list[dict]) -> str:
    """The block's allocation site: the first frame in the runtime, else transformers, else torch."""
    for part in SITE_PREFERENCE:
        for frame in frames:
            if part in frame["filename"]:
                name = frame["filename"].split(part, 1)[1]
                return f"{part.strip('/')}/{name}:{frame['line']} {frame['name']}"
    return "other"


def phases_of(trace: list[dict]) -> list[tuple[int, int]]:
    """(start, end) event indices between consecutive marks (the last one runs to the end)."""
    marks = [i for i, event in enumerate(trace) if event["action"] == "alloc"
             and event["size"] >= MARK_BASE_BYTES and (event["size"] - MARK_BASE_BYTES) % 512 == 0
             and event["size"] - MARK_BASE_BYTES <= 512 * 64]
    bounds = [0, *marks, len(trace)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def peaks(trace: list[dict], top: int) -> list[dict]:
    """Per phase: the allocated peak (bytes, marks excluded) and its top sites with the bytes they held then."""
    live: dict[int, tuple[int, str]] = {}
    allocated = 0
    results = []
    for start, end in phases_of(trace):
        best, best_sites = -1, {}
        for event in trace[start:end]:
            action, size = event["action"], event["size"]
            if size >= MARK_BASE_BYTES and (size - MARK_BASE_BYTES) % 512 == 0:
                continue
            if action == "alloc":
                live[event["addr"]] = (size, site_of(event.get("frames", [])))
                allocated += size
            elif action == "free_completed" and event["addr"] in live:
                allocated -= live.pop(event["addr"])[0]
            else:
                continue
            if allocated > best:
                by_site = defaultdict(int)
                for held, site in live.values():
                    by_site[site] += held
                best, best_sites = allocated, by_site
        ranked = sorted(best_sites.items(), key=lambda item: -item[1])[:top]
        results.append({"peak_allocated_bytes": max(best, allocated),
                        "sites": [{"site": site, "bytes": held} for site, held in ranked]})
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the bench of one plan with the history recorded and print each phase's peak and sites."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--top", type=int, default=8, help="sites listed per phase")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("memory_peaks needs a CUDA GPU", file=sys.stderr)
        return 2
    import typer

    from offload_plan.app import app

    lift_cap_and_mark()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    code = typer.main.get_command(app).main(["run", str(args.plan), "--bench", "--json"], standalone_mode=False)
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    found = peaks(trace, args.top)
    for index, phase in enumerate(found):
        print(f"phase {index}: peak allocated {phase['peak_allocated_bytes'] / MIB:,.1f} MiB")
        for site in phase["sites"]:
            print(f"    {site['bytes'] / MIB:10,.1f} MiB  {site['site']}")
    if args.json is not None:
        args.json.write_text(json.dumps({"plan": str(args.plan), "exit": code, "phases": found}, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
