"""Conformance of tensor-parallel rank plans on N local GPUs: every `make --tp N` serving plan keeps its promise.

The single-GPU sweep (scripts/conformance.py) runs one process per plan; a rank plan runs one per GPU under
torchrun, so this sweep drives the CLI as a user does, in subprocesses: for each arm, ``make --tp N`` (its
``--measure`` times the rank's layers on GPU 0 and the all-reduce and NCCL's buffers between the N GPUs), then
``show``, ``export --to vllm``, ``export --to sglang`` and ``check``, then ``torchrun --nproc-per-node N -m
offload_plan run PLAN --bench --json``, whose rank 0 prints every rank's figures. The checkpoints are
scripts/conformance.py's (transformers config classes at released widths, random weights in release format),
cut to a few layers; the caps are shares of the rank's layer bytes, as that sweep's (CAP_SHARES).

Verdicts per arm and rank: every command exits 0; no out-of-memory; the rank's peak (the allocator's reserve plus
what CUDA and NCCL hold outside it) at or under the plan's GPU memory, and at least 0.9 of the plan's total; the
decode step and the prefill chunk within 10% of the prediction for --measure plans, 25% for estimated ones.
Greedy tokens are not compared here (`run --prompt` is not served under TP); scripts/bench_tp_offload.py checks
rank plans' logits bit for bit against transformers' own TP model.

    PYTHONPATH=. python3 scripts/conformance_tp.py --out $OUT --checkpoints /tmp/ctp      # on N >= 2 GPUs
    PYTHONPATH=. python3 scripts/conformance_tp.py --list
    PYTHONPATH=. python3 scripts/conformance_tp.py --dry-run --out /tmp/ctp-dry          # CPU: make and readers
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.conformance import (CAP_SHARES, GiB, MODELS, SERVING_CONTEXT, ensure_checkpoint, exits_ok, mib,
                                 verdicts)

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class TpArm:
    """One rank plan: a model, a serving concurrency ("1", "4", "auto") at a cap, measured or estimated."""

    model: str
    concurrency: str
    cap: str
    measure: bool

    @property
    def name(self) -> str:
        return f"{self.model}/serving-{self.concurrency}/{self.cap}/{'measure' if self.measure else 'estimate'}"


#: most important first: architectures whose transformers tp_plan splits as vLLM does (colwise / rowwise, and
#: Mixtral's experts packed colwise), a dense GQA model with a sliding window, a MoE model in release format
#: (whole layers: routed experts are not run under TP), a model with 256-wide heads and soft-capping
ARMS = (TpArm("mistral-sw", "4", "tight", True), TpArm("mixtral", "1", "tight", True),
        TpArm("mistral-sw", "auto", "tight", True), TpArm("gemma2", "4", "tight", True),
        TpArm("mistral-sw", "4", "loose", False), TpArm("mixtral", "4", "tight", False),
        TpArm("mistral-sw", "1", "tight", True), TpArm("gemma2", "1", "loose", False))
#: the caps at least this much over the leanest whole-layer placement and an all-resident plan's other memory
MEASURE_MARGIN = 1.1
#: seconds an arm is expected to take on two H200s (make --measure, the readers, torchrun's load and bench)
ARM_SECONDS = 70


def parser() -> argparse.ArgumentParser:
    """--out, --checkpoints, --gpu, --tp, --models, --time-budget-s, --list, --dry-run."""
    args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args.add_argument("--out", type=Path, default=Path("conformance-tp-out"))
    args.add_argument("--checkpoints", type=Path, default=Path("/tmp/conformance-tp-checkpoints"))
    args.add_argument("--gpu", default="h200", help="profile name or file (it needs gpu_link_bytes_per_s)")
    args.add_argument("--tp", type=int, default=2)
    args.add_argument("--models", help="comma-separated subset of the arms' models")
    args.add_argument("--time-budget-s", type=float, default=520.0, help="start no arm after this many seconds")
    args.add_argument("--list", action="store_true", help="print the arms and exit")
    args.add_argument("--dry-run", action="store_true",
                      help="CPU: header-only checkpoints, make (estimated) and the readers; no run")
    return args


def _with_repo_path() -> dict:
    """This process's environment with the repository first on PYTHONPATH (the subprocesses run it from the tree)."""
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def checkpoint_folder(name: str, root: Path, dry_run: bool) -> Path:
    """The model's checkpoint (scripts/conformance.py's), written by a subprocess on the GPU (--dry-run: header
    only, here): this process holds no CUDA context or cached blocks, which the ranks' probes would count as
    their own (the GPU's memory in use is what they read)."""
    if dry_run:
        return ensure_checkpoint(MODELS[name], root, tiny=False, device="cpu", header_only=True)[0]
    code = ("import sys; from pathlib import Path; from scripts.conformance import MODELS, ensure_checkpoint; "
            "print(ensure_checkpoint(MODELS[sys.argv[1]], Path(sys.argv[2]), tiny=False, device='cuda')[0])")
    done = subprocess.run([sys.executable, "-c", code, name, str(root)], capture_output=True, text=True,
                          env=_with_repo_path(), check=True)
    return Path(done.stdout.strip().splitlines()[-1])


def rank_caps(folder: Path, profile: str, tp: int) -> dict[str, int]:
    """GPU memory per cap for a rank: its non-layer bytes plus the cap's share of its layer bytes, plus what an
    all-resident serving plan of 4 sequences books beyond its weights (KV cache, activations, graph pool, CUDA
    context and NCCL), all of the rank's shard as vLLM splits it; at least MEASURE_MARGIN x the leanest
    placement's need."""
    from planner.make.make_plan import make_plan
    from planner.model.layout import build_layout
    from planner.model.tensor_parallel import shard_checkpoint
    from planner.plan.schema import Inputs
    from planner.source.checkpoint import load_checkpoint

    whole = load_checkpoint(str(folder))
    layout = build_layout(shard_checkpoint(whole, tp))
    resident = make_plan(Inputs(model=str(folder), gpu=profile, context=SERVING_CONTEXT, cuda_graph=True,
                                concurrency="4", tp=tp), checkpoint=whole).plan
    beyond = resident.memory.total_gpu_bytes - resident.memory.gpu_bytes
    # what --measure books can pass the estimate: Gemma-2's rank measured 648 MiB of activations at 4 sequences
    # where the estimate booked 413 (two H200s, 2026-11-29), and a cap at the leanest placement plus the estimate
    # left make nothing to plan. The caps stay MEASURE_MARGIN above that
    leanest = layout.non_layer_bytes + 2 * max(layer.nbytes for layer in layout.layers) + beyond
    return {cap: max(int(beyond + layout.non_layer_bytes + share * layout.layer_bytes), int(MEASURE_MARGIN * leanest))
            for cap, share in CAP_SHARES.items()}


def command(args: list, torchrun: int = 0, timeout_s: float = 600) -> dict:
    """``offload-plan ARGS`` in a subprocess (under torchrun with that many ranks): exit code, error line, stdout,
    seconds."""
    prefix = [sys.executable, "-m"] + (["torch.distributed.run", "--nproc-per-node", str(torchrun), "-m"]
                                       if torchrun else [])
    start = time.perf_counter()
    try:
        done = subprocess.run(prefix + ["offload_plan", *map(str, args)], capture_output=True, text=True,
                              env=_with_repo_path(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"code": 124, "error": f"timed out after {timeout_s:.0f} s", "stdout": "", "s": timeout_s}
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    # a rank's one-line error (torchrun prefixes it with the rank), else the last exception line, else any line
    errors = ([line for line in lines if "offload-plan: error" in line]
              or [line for line in lines if "Error:" in line and not line.startswith("traceback")])
    error = None if done.returncode == 0 else (errors or lines or [f"exit {done.returncode}"])[-1][:400]
    return {"code": done.returncode, "error": error, "stdout": done.stdout,
            "stderr_tail": done.stderr[-3000:] if done.returncode else "", "s": round(time.perf_counter() - start, 1)}


def make_args(arm: TpArm, folder: Path, profile: str, tp: int, cap_bytes: int, plan: Path,
              dry_run: bool = False) -> list:
    """make's flags for the arm: a serving plan of the rank at the cap, graphed (``dry_run``: estimated, as a CPU
    makes it)."""
    return ["make", "--model", folder, "--gpu", profile, "--tp", tp, "--concurrency", arm.concurrency,
            "--context", SERVING_CONTEXT, "--cuda-graph", "--gpu-memory", mib(cap_bytes), "-o", plan,
            *(["--measure"] if arm.measure and not dry_run else [])]


def ranks_of(stdout: str) -> list[dict] | None:
    """Every rank's figures from run --bench --json's stdout (rank 0 prints a list), None where it printed none."""
    try:
        data = json.loads(stdout[stdout.index("["):])
    except ValueError:
        return None
    return data if isinstance(data, list) else None


def rank_verdicts(arm: TpArm, cap_bytes: int, rank: dict) -> dict:
    """One rank's memory and time against its plan: scripts/conformance.py's verdicts on the rank's figures."""
    row = {"bench": rank, "plan": {"memory": {"gpu_memory_bytes": cap_bytes}}, "exit": {}, "errors": {}}
    judged = verdicts(arm, row, None)
    return {"rank": rank.get("rank"), "peak_over_cap": row["peak_over_cap"],
            "peak_over_predicted": row["peak_over_predicted"],
            "errors": {name: round(error, 4) for name, error in row["prediction_errors"].items()},
            **{key: judged[key] for key in ("peak_le_cap", "peak_ge_0.9_predicted", "error_within")}}


def run_arm(arm: TpArm, folder: Path, caps: dict, args, out: Path) -> dict:
    """make, the readers and (unless --dry-run) the ranks' bench: the arm's row."""
    plan = out / (arm.name.replace("/", "_") + ".yaml")
    cap_bytes = caps[arm.cap]
    row = {"arm": arm.name, "cap_bytes": cap_bytes, "exit": {}, "errors": {}}
    made = command(make_args(arm, folder, args.gpu, args.tp, cap_bytes, plan, args.dry_run))
    row["exit"]["make"], row["make_s"] = made["code"], made["s"]
    if made["error"]:
        row["errors"]["make"] = made["error"]
        return row
    row["plan"] = plan_summary(plan)
    for name, view in (("show", ["show", plan]), ("export_vllm", ["export", plan, "--to", "vllm"]),
                       ("export_sglang", ["export", plan, "--to", "sglang"]), ("check", ["check", plan])):
        outcome = command(view)
        row["exit"][name] = outcome["code"]
        if outcome["error"]:
            row["errors"][name] = outcome["error"]
    if args.dry_run:
        return row
    bench = command(["run", plan, "--bench", "--json"], torchrun=args.tp)
    row["exit"]["bench"], row["bench_s"] = bench["code"], bench["s"]
    if bench["error"]:
        row["errors"]["bench"], row["bench_stderr_tail"] = bench["error"], bench["stderr_tail"]
    ranks = ranks_of(bench["stdout"]) if bench["code"] == 0 else None
    row["ranks"] = ranks
    row["verdicts"] = [rank_verdicts(arm, row["plan"]["gpu_memory_bytes"], rank) for rank in ranks or []]
    return row


def plan_summary(path: Path) -> dict:
    """What the plan promises: its memory figures, offloaded layers, concurrency and predicted times."""
    from planner.plan.file import read_plan

    plan = read_plan(path)
    return {"architecture": plan.model.architecture, "gpu_memory_bytes": plan.memory.gpu_memory_bytes,
            "total_gpu_bytes": plan.memory.total_gpu_bytes,
            "cuda_context_bytes": plan.memory.cuda_context_bytes, "nccl_bytes": plan.hardware.nccl_bytes,
            "offloaded": len(plan.offload.layers), "num_layers": plan.model.num_layers,
            "concurrency": plan.workload.concurrency, "decode_step_ms": plan.prediction.step_ms,
            "compute_source": plan.workload.compute_source}


def passed(row: dict) -> dict:
    """The arm's verdicts over its ranks: exits (an export's one-line refusal where its engine wires no offloader
    for the architecture is its promise), no OOM, and each rank's figures."""
    errors = " ".join(row["errors"].values()).lower()
    verdicts = row.get("verdicts") or []
    out = {"exit_ok": exits_ok(row),
           "no_oom": "out of memory" not in errors and 70 not in row["exit"].values()}
    for key in ("peak_le_cap", "peak_ge_0.9_predicted", "error_within"):
        out[key] = all(verdict[key] for verdict in verdicts) if verdicts else None
    return out


def table(rows: list[dict]) -> str:
    """The arms as a markdown table: exits, offloaded layers, decode step and chunk errors, peak / cap and peak /
    predicted (worst rank), NCCL's booked bytes."""
    lines = ["| arm | exits | offloaded | predicted decode ms | errors (worst rank) | peak / cap | peak / predicted "
             "| NCCL booked | s |", "|" + "---|" * 9]
    for row in rows:
        plan, verdicts = row.get("plan") or {}, row.get("verdicts") or []
        exits = " ".join(f"{name}:{code}" for name, code in row["exit"].items())
        worst = {}
        for verdict in verdicts:
            for name, error in verdict["errors"].items():
                worst[name] = max(worst.get(name, error), error, key=abs)
        errors = ", ".join(f"{name} {error:+.1%}" for name, error in worst.items()) or "-"
        over_cap = max((v["peak_over_cap"] or 0 for v in verdicts), default=None)
        over_predicted = min((v["peak_over_predicted"] or 0 for v in verdicts), default=None)
        nccl = plan.get("nccl_bytes")
        lines.append(f"| {row['arm']} | {exits} | {plan.get('offloaded', '-')}/{plan.get('num_layers', '-')} | "
                     f"{plan.get('decode_step_ms', '-')} | {errors} | "
                     f"{'-' if over_cap is None else f'{over_cap:.3f}'} | "
                     f"{'-' if over_predicted is None else f'{over_predicted:.3f}'} | "
                     f"{'-' if nccl is None else f'{nccl / 2**20:.0f} MiB'} | "
                     f"{row.get('make_s', 0) + row.get('bench_s', 0):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    chosen = set(args.models.split(",")) if args.models else None
    arms = [arm for arm in ARMS if chosen is None or arm.model in chosen]
    if args.list:
        for arm in arms:
            print(arm.name)
        print(f"{len(arms)} arms; about {ARM_SECONDS * len(arms)} s on {args.tp} GPUs")
        return 0
    if not args.dry_run:
        import torch

        if torch.cuda.device_count() < args.tp:
            print(f"conformance_tp: needs {args.tp} CUDA GPUs, this machine has {torch.cuda.device_count()}; "
                  "--dry-run makes the plans and reads them on the CPU")
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    start, rows, caps = time.perf_counter(), [], {}
    for arm in arms:
        if time.perf_counter() - start > args.time_budget_s:
            print(f"time budget spent: {arm.name} and later arms not run")
            break
        folder = checkpoint_folder(arm.model, args.checkpoints, args.dry_run)
        if arm.model not in caps:
            caps[arm.model] = rank_caps(folder, args.gpu, args.tp)
        row = run_arm(arm, folder, caps[arm.model], args, args.out)
        row["verdicts_all"] = passed(row)
        rows.append(row)
        with open(args.out / "rows.jsonl", "a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(arm.name, row["verdicts_all"], row["errors"] or "", flush=True)
    (args.out / "table.md").write_text(table(rows) + "\n")
    print(table(rows))
    summary = {key: sum(1 for row in rows if row["verdicts_all"][key]) for key in rows[0]["verdicts_all"]} \
        if rows else {}
    worst = [v["peak_over_cap"] for row in rows for v in row.get("verdicts") or [] if v["peak_over_cap"]]
    print(f"{len(rows)} arms; passes {summary}; worst peak / cap "
          f"{max(worst) if worst else '-'}; caps GiB "
          f"{ {name: {cap: round(b / GiB, 2) for cap, b in c.items()} for name, c in caps.items()} }")
    return 0 if rows and all(all(v is not False for v in row["verdicts_all"].values()) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
