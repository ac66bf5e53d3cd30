"""Issue 37's targets, through the CLI alone: the planner's choice (CPU experts allowed) against fetch-only routed
experts and whole layers, side by side in one run, on MoE shapes in release format with random weights.

    PYTHONPATH=. python3 scripts/bench_hybrid.py --models qwen3-moe:8:24 --sequences 1 4 16 --out $OUT

Each ``--models`` entry is NAME:LAYERS:FULL_BUDGET_GIB: scripts/conformance.py's model cut to LAYERS layers, and
the weights budget the full release would get (Qwen3-30B-A3B at 24 GiB: the issue's target), scaled to the cut so
the same share of the experts' bytes is left on the host: budget = cut bytes - share x the cut's expert bytes,
share = (full bytes - FULL_BUDGET) / the full model's expert bytes (from the release's tensor headers, no
weights written for the full model). Per sequence count S, one plan each, all graphed, context 4096:

- ``choice``: ``make --tokens S --sequences S --budget B`` (``--cpu-experts auto``: the planner may put experts on
  the CPU);
- ``fixed``: the same with ``--cpu-experts fixed`` (the CPU's experts fixed ids, every pair routed to them on the
  CPU, where ``choice`` may split each step's misses by their count);
- ``fetch``: the same with ``--cpu-experts off`` (routed experts, every miss fetched);
- ``whole``: the same with ``--routed-experts off`` (whole layers, no routed experts; before 2026-11-28 late,
  ``--for vllm``, which vLLM's unwired families refuse);
- ``planned``: the choice's flags, run with OFFLOAD_PLAN_CPU_RESPLIT=off (the plan's own per-step tables
  throughout, where ``choice``'s run re-splits them at the rate it measures the host's CPU at: runtime.cpu_resplit);
- ``host`` (after ``choice``): the choice made again with ``--cpu-time-scale`` at the scale ``choice``'s run
  counted for this host's CPU (``run --bench``'s suggestion), where that run had CPU experts;

then ``run --bench --json`` (ms per step against the plan's prediction) and ``run --prompt`` (64 greedy tokens,
compared with the all-resident plan's; scripts/conformance.run_plan); with ``--logits``, every routed arm
(fetch-only too: what the routed step alone changes) also decodes the prompt in this process, and each step's
logits are compared with all-resident's (first_split:
where the tokens split, and whether at a near tie the bf16 tolerance admits); with ``--repeats R``, each sequence
count's plans are benched R times, arm after arm in turn, and priced by their medians. Rows go to
OUT/bench-hybrid.json as they finish; a table is printed last: ms per step, predicted, the choice's speed over
fetch-only and the choice's regret (its step over the fastest arm's), the CPU's share and whether the tokens equal
all-resident's.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

from offload_plan.run_tables import cpu_experts_text
from runtime.cpu_experts import BF16_TOLERANCE
from scripts import conformance
from scripts.benchmarking import touched_bytes
from scripts.conformance import (MODELS, calibrated_profile, cli, ensure_checkpoint, gpu_clean, run_bench,
                                 run_plan)

GiB = 2**30
CONTEXT = 4096
NEW_TOKENS = 64
#: make's flags per arm: its choice; the per-step split with one expert split by its rows too (--cpu-experts rows);
#: fixed CPU ids; fetch-only; whole layers
ARMS = {"choice": [], "planned": [], "rows": ["--cpu-experts", "rows"], "fixed": ["--cpu-experts", "fixed"],
        "fetch": ["--cpu-experts", "off"], "whole": ["--routed-experts", "off"], "host": []}
#: arms run with an environment of their own: "planned" is the choice run on the plan's own tables (run's re-split at
#: the host's measured rate off: runtime.cpu_resplit)
ARM_ENV = {"planned": {"OFFLOAD_PLAN_CPU_RESPLIT": "off"}}
#: the arm made again for the host's CPU: the choice with --cpu-time-scale at the scale the choice arm's run counted
#: (run --bench --json's routed.cpu.cpu_time_scale), so listed after "choice"
HOST_ARM = "host"


def bytes_split(config: dict) -> tuple[int, int]:
    """(all bytes, the routed experts' bytes) of the release checkpoint of ``config``, from its tensor headers."""
    from planner.source.header_checkpoint import num_bytes

    specs = conformance.checkpoint_specs(config)
    experts = sum(num_bytes(spec) for spec in specs if ".experts." in spec[0])
    return sum(num_bytes(spec) for spec in specs), experts


def scaled_budget(model: conformance.Model, full_budget_bytes: int, full_layers: int) -> int:
    """The cut model's budget leaving the same share of its experts' bytes on the host as the full release at
    ``full_budget_bytes`` would."""
    full = dataclasses.replace(model, num_layers=full_layers)
    full_total, full_experts = bytes_split(conformance.config_dict(full, tiny=False))
    total, experts = bytes_split(conformance.config_dict(model, tiny=False))
    share = max(0.0, min(1.0, (full_total - full_budget_bytes) / full_experts))
    return int(total - share * experts)


def with_cpu_threads(profile: str, threads: int, out: Path) -> str:
    """A copy of ``profile`` whose cpu_experts section says ``threads`` (its rates as measured)."""
    import yaml

    data = yaml.safe_load(Path(profile).read_text())
    data["cpu_experts"]["threads"] = threads
    path = out / f"profile-{threads}-threads.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def plan(folder: Path, profile: str, sequences: int, budget: int, flags: list, path: Path) -> dict:
    made = cli(["make", "--model", folder, "--gpu", profile, "--tokens", sequences, "--sequences", sequences,
                "--context", CONTEXT, "--cuda-graph", "--budget", f"{budget // 2**20}MiB", *flags, "-o", path])
    return {"exit": made.code, "error": made.error if made.code else None}


#: the routing trace's prompts (random weights route alike whatever the words) and decode steps after each
TRACE_PROMPTS = ("The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
                 "Explain how a transformer decodes one token.", "List three prime numbers:",
                 "Translate to German: good morning", "The quick brown fox", "In 1969, the first")
TRACE_DECODE_TOKENS = 32


def routing_trace(folder: Path, work: Path) -> list:
    """make's flags for the model's own routing trace, recorded once into ``work`` (none where trace fails)."""
    trace, prompts = work / "trace.yaml", work / "prompts.txt"
    if not trace.exists():
        prompts.write_text("\n".join(TRACE_PROMPTS) + "\n")
        done = cli(["trace", "--model", folder, "--prompts", prompts, "--decode-tokens", TRACE_DECODE_TOKENS,
                    "-o", trace])
        gpu_clean()  # the trace's model leaves the GPU before the plans' runs
        if done.code:
            print(f"  trace failed: {done.error}", flush=True)
            return []
    return ["--routing-trace", trace]


def plan_facts(path: Path) -> dict:
    """The plan's routed layers, its CPU experts and the CPU's expected ms a step, or why the CPU was declined."""
    import yaml

    experts = yaml.safe_load(path.read_text()).get("experts") or {}
    layers = experts.get("layers") or ()
    cpu = experts.get("cpu") or {}
    return {"routed_layers": sum(layer.get("regime") == "routed" for layer in layers),
            "cpu_experts": sum(len(layer.get("cpu") or ()) for layer in layers),
            "cpu_ms_per_step": cpu.get("cpu_ms_per_step"), "cpu_declined": experts.get("cpu_declined")}


def step_ms(row: dict) -> tuple[float | None, float | None]:
    """The bench's measured ms per step (the median over its repeats where rebench added some) and predicted."""
    bench = row.get("bench") or {}
    repeats = [ms for ms in row.get("step_ms_repeats", ()) if ms is not None]
    measured = statistics.median(repeats) if repeats else bench.get("step_ms")
    return measured, bench.get("predicted_step_ms")


def rebench(group: list[dict], extra: int) -> None:
    """``extra`` more ``run --bench`` of each arm of ``group`` (one sequence count's plans that ran), arm after arm
    in turn so that the host's drift falls on every arm alike; each row's ``step_ms_repeats`` lists every run's
    ms per step, the first run's included."""
    ran = [row for row in group if (row.get("bench") or {}).get("step_ms") is not None]
    for row in ran:
        row["step_ms_repeats"] = [row["bench"]["step_ms"]]
    for _ in range(extra):
        for row in ran:
            gpu_clean()
            with arm_env(row["arm"]):
                figures = run_bench(Path(row["plan_path"]))[1]
            row["step_ms_repeats"].append(None if figures is None else figures.get("step_ms"))
    gpu_clean()


@contextlib.contextmanager
def arm_env(arm: str):
    """The arm's environment (ARM_ENV) set inside, put back after: run reads it as it loads the plan."""
    before = {name: os.environ.get(name) for name in ARM_ENV.get(arm, {})}
    os.environ.update(ARM_ENV.get(arm, {}))
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def host_cpu_time_scale(rows: list[dict], model: str, sequences: int) -> float | None:
    """The make --cpu-time-scale the choice arm's run counted for its host's CPU (None: no such run, or no CPU
    experts in it)."""
    for row in rows:
        if (row["model"], row["sequences"], row["arm"]) == (model, sequences, "choice"):
            cpu = ((row.get("bench") or {}).get("routed") or {}).get("cpu") or {}
            return cpu.get("cpu_time_scale")
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-moe:8:24"])
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--logits", action="store_true",
                        help="for routed arms, compare each step's logits with all-resident's (first_split)")
    parser.add_argument("--measure", action="store_true", help="make every plan with --measure (the GPU's times)")
    parser.add_argument("--trace", action="store_true",
                        help="record the model's routing of TRACE_DECODE_TOKENS decode steps after each of "
                             "TRACE_PROMPTS (offload-plan trace) and make every plan with it (--routing-trace): "
                             "the prefetch's accuracy and the experts' shares measured, not assumed. Not for random "
                             "weights: their greedy decodes repeat two tokens, so the trace sees a few experts "
                             "and the plans priced from it expected 0.05%% of the routed bytes the bench's prompt "
                             "fetched (2026-11-28)")
    parser.add_argument("--prefetch-accuracy", nargs="+", default=[], metavar="MODEL=SHARE",
                        help="make a model's plans with --prefetch-accuracy SHARE (a run's measured share of "
                             "predictions right, where random weights predict worse than the planner's default)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="bench each sequence count's plans this many times, arm after arm in turn, and "
                             "report each arm's median step (the host's step varies 10-20%% between runs)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="the CPU experts' threads (default: the profile's, calibrate's count)")
    parser.add_argument("--gpu", dest="profile", default=None, help="profile (default: calibrate, once, into OUT)")
    parser.add_argument("--checkpoints", type=Path, default=Path("/tmp/bench-hybrid"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/bench-hybrid-out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    profile = args.profile or calibrated_profile(args.out)
    if args.cpu_threads:
        profile = with_cpu_threads(profile, args.cpu_threads, args.out)
    rows_path, rows = args.out / "bench-hybrid.json", []
    for entry in args.models:
        name, layers, full_gib = entry.split(":")
        model = dataclasses.replace(MODELS[name], num_layers=int(layers))
        full_layers = FULL_LAYERS[name]
        budget = scaled_budget(model, int(float(full_gib) * GiB), full_layers)
        folder, write_s = ensure_checkpoint(model, args.checkpoints, tiny=False, device="cuda")
        print(f"{name}: {layers} of {full_layers} layers, budget {budget / GiB:.2f} GiB "
              f"(the release at {full_gib} GiB), checkpoint {write_s:.0f} s", flush=True)
        work = args.out / name
        work.mkdir(exist_ok=True)
        flags = (["--measure"] if args.measure else []) + (routing_trace(folder, work) if args.trace else [])
        accuracy = dict(entry.split("=") for entry in args.prefetch_accuracy).get(name)
        flags += ["--prefetch-accuracy", accuracy] if accuracy else []
        reference = work / "resident.yaml"
        made = cli(["make", "--model", folder, "--gpu", profile, "--tokens", 1, "--sequences", 1, "--context",
                    CONTEXT, "--cuda-graph", "-o", reference])  # no budget: the whole GPU, every weight resident
        reference_row = run_plan(reference, NEW_TOKENS) if made.code == 0 else {"make_error": made.error}
        reference_logits = (conformance.greedy_logits(reference, NEW_TOKENS) if args.logits and made.code == 0
                            else None)
        rows.append({"model": name, "layers": int(layers), "sequences": 1, "arm": "resident", **reference_row})
        for sequences in args.sequences:
            for arm in args.arms:
                path = work / f"{arm}-{sequences}.yaml"
                row = {"model": name, "layers": int(layers), "budget_bytes": budget, "sequences": sequences,
                       "arm": arm, "plan_path": str(path)}
                arm_flags = ARMS[arm]
                if arm == HOST_ARM:
                    scale = host_cpu_time_scale(rows, name, sequences)
                    if scale is None:
                        rows.append(row | {"make": {"exit": None, "error": "no choice arm with CPU experts ran "
                                                                            "before it at this sequence count"}})
                        continue
                    arm_flags, row["cpu_time_scale"] = ["--cpu-time-scale", f"{scale:g}"], scale
                row["make"] = plan(folder, profile, sequences, budget, arm_flags + flags, path)
                if row["make"]["exit"] == 0:
                    with arm_env(arm):
                        row |= plan_facts(path) | run_plan(path, NEW_TOKENS)
                    row["tokens_equal"] = row.get("text") is not None and row["text"] == reference_row.get("text")
                    # every routed arm: fetch-only's logits say what the routed step alone changes, beside the CPU's
                    if reference_logits is not None and row.get("routed_layers"):
                        gpu_clean()
                        logits = conformance.greedy_logits(path, NEW_TOKENS)[1]
                        row["logits"] = conformance.first_split(logits, reference_logits[1], BF16_TOLERANCE)
                        gpu_clean()
                rows.append(row)
                rows_path.write_text(json.dumps(rows, indent=1))
                measured, predicted = step_ms(row)
                print(f"  {arm:<6} S={sequences:<3} {fmt(measured)} ms (predicted {fmt(predicted)}) "
                      f"cpu experts {row.get('cpu_experts')} equal {row.get('tokens_equal')} "
                      f"{row['logits'] if 'logits' in row else ''} "
                      f"{row['make'].get('error') or row.get('errors', {}).get('bench') or ''}", flush=True)
            rebench([row for row in rows if row["model"] == name and row["sequences"] == sequences
                     and row["arm"] != "resident"], args.repeats - 1)
            rows_path.write_text(json.dumps(rows, indent=1))
    print(table(rows, h2d_bytes_per_s(profile)))
    return 0


#: layers of each release (its config.json's num_hidden_layers)
FULL_LAYERS = {"qwen3-moe": 48, "mixtral": 32, "qwen2-moe": 24, "olmoe": 16, "deepseek-v2-lite": 27, "phimoe": 32}


def fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def h2d_bytes_per_s(profile: str) -> float:
    """The profile's copy-engine rate to the GPU (calibrate's measurement): the routed floor's link."""
    from planner.source.profile import load_profile

    return load_profile(profile).h2d_bytes_per_s.value


def routed_floor_ms(fetch: dict, link_bytes_per_s: float, resident_ms: float | None) -> float | None:
    """Issue 37's fetch-only floor: the routed, non-resident bytes the fetch-only arm's steps touched (run --bench's
    routed figures) over the copy engine's rate, or the all-resident step where longer (known at one sequence);
    None where the arm measured no routed bytes."""
    by_kind = (((fetch.get("bench") or {}).get("routed") or {}).get("bytes_per_step_by_kind")) or {}
    if not by_kind:
        return None
    link_ms = 1e3 * touched_bytes(by_kind) / link_bytes_per_s
    return max(link_ms, resident_ms or 0.0)


def table(rows: list[dict], link_bytes_per_s: float | None = None) -> str:
    """Per model and sequence count: each arm's ms per step (predicted), the choice over fetch-only and its regret;
    with ``link_bytes_per_s``, the fetch-only floor (routed_floor_ms) and each of fetch-only and the choice over it
    (above 1: faster than the floor)."""
    lines = ["| model | S | arm | ms/step | predicted | error | CPU experts | tokens equal |",
             "|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for row in rows:
        groups.setdefault((row["model"], row["sequences"]), []).append(row)
    for (model, sequences), group in groups.items():
        steps = {row["arm"]: step_ms(row)[0] for row in group if row["arm"] != "resident"}
        for row in group:
            measured, predicted = step_ms(row)
            error = f"{100 * (predicted / measured - 1):+.1f}%" if measured and predicted else "-"
            cpu = ((row.get("bench") or {}).get("routed") or {}).get("cpu") or {}
            on_cpu = f"{row.get('cpu_experts', '-')}" + (
                f" ({cpu['pairs_per_step']:.1f} pairs{cpu_experts_text(cpu)}, host {cpu['host_ms_per_step']:.2f} ms "
                f"a step, planned {fmt(cpu.get('planned_cpu_ms_per_step'))}{_at_host_rate(cpu)})" if cpu else "")
            repeats = [ms for ms in row.get("step_ms_repeats", ()) if ms is not None]
            spread = f" ({min(repeats):.2f}-{max(repeats):.2f}, {len(repeats)} runs)" if len(repeats) > 1 else ""
            lines.append(f"| {model} | {sequences} | {row['arm']} | {fmt(measured)}{spread} | {fmt(predicted)} | "
                         f"{error} | {on_cpu} | {row.get('tokens_equal', '-')} |")
        valid = [ms for ms in steps.values() if ms]
        for arm, label in (("fetch", "fetch-only"), ("fixed", "fixed CPU ids"), ("planned", "the plan's own tables"),
                           (HOST_ARM, "made again for the host's CPU")):
            if steps.get("choice") and steps.get(arm):
                lines.append(f"| {model} | {sequences} | choice / {label} speed | "
                             f"{steps[arm] / steps['choice']:.3f}x | | | | |")
        if steps.get("choice") and steps.get("rows"):
            lines.append(f"| {model} | {sequences} | split by rows (--cpu-experts rows) / choice speed | "
                         f"{steps['choice'] / steps['rows']:.3f}x | | | | |")
        if steps.get("choice") and valid:
            lines.append(f"| {model} | {sequences} | choice regret | {steps['choice'] / min(valid):.3f} | | | | |")
        fetch = next((row for row in group if row["arm"] == "fetch"), None)
        resident = next((step_ms(row)[0] for row in rows if row["model"] == model and row["arm"] == "resident"
                         and row["sequences"] == sequences), None)
        floor = routed_floor_ms(fetch, link_bytes_per_s, resident) if fetch and link_bytes_per_s else None
        if floor:
            lines.append(f"| {model} | {sequences} | fetch-only floor (touched routed bytes / copy engine"
                         f"{', or all-resident' if resident else ''}) | {floor:.3f} | | | | |")
            for arm, label in (("fetch", "fetch-only over the floor (floor / step)"),
                               ("choice", "choice over the floor (floor / step; above 1: under the floor)")):
                if steps.get(arm):
                    lines.append(f"| {model} | {sequences} | {label} | {floor / steps[arm]:.3f} | | | | |")
    return "\n".join(lines)


def _at_host_rate(cpu: dict) -> str:
    """"; the step at the host's CPU rate X ms (Nx)[, re-split Y ms; run re-split at S1, S2]": the plan re-timed at
    the rate the run's host CPU measured (runtime.routed_fetches.at_host_cpu_rate), with its tables as planned and
    made again there, and the scales run re-split its tables at (runtime.cpu_resplit), where the run's JSON has
    them."""
    if cpu.get("step_ms_at_host_cpu_rate") is None:
        return ""
    text = f"; the step at the host's CPU rate {cpu['step_ms_at_host_cpu_rate']:.2f} ms ({cpu['host_cpu_scale']:.2f}x)"
    if cpu.get("step_ms_resplit_at_host_cpu_rate") is not None:
        text += f", re-split {cpu['step_ms_resplit_at_host_cpu_rate']:.2f} ms"
    events = (cpu.get("resplit") or {}).get("events") or []
    if events:
        text += "; run re-split at " + ", ".join(f"{event['scale']:.2f}x" for event in events)
    return text


if __name__ == "__main__":
    sys.exit(main())
