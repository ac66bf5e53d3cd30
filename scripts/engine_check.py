"""Check every export against the released engines: their own argument parsers and config validation.

The corpus is every checked-in plan (plans/*.yaml) and a set of generated plans, made with make over the
header-only checkpoints the repository writes (scripts/real_checkpoints.py's public configs and examples/*):
weights plans at several budgets (whole layers, --params experts, CUDA graphs), serving plans (contexts,
concurrency, FP8 KV cache), make --tp plans, plans with LoRA adapters (header-only PEFT folders) and plans made
with make --for each engine (SGLang's --cpu-offload-gb plans among them). Each is exported to vLLM and SGLang at
its own TP and, for a one-GPU plan, at --tp 2 (a make --for plan is refused for another engine or TP: counted).

Two checks:

- static (no engine needed): every exported flag is in the pinned version's accepted set with a value in its
  range (planner.engines.versions.flag_problems). Exports offload-plan itself refuses are counted, not failed.
- engine: each engine's own code, in a separate virtual environment with the pinned release installed from PyPI
  (vLLM and SGLang pin different compressed-tensors, so one venv each). vLLM: ``make_arg_parser`` (its
  ``vllm serve`` parser: FlexibleArgumentParser, AsyncEngineArgs.add_cli_args and the frontend's flags), then
  ``EngineArgs.from_cli_args(...).create_engine_config()`` (ModelConfig, CacheConfig, SchedulerConfig,
  OffloadConfig, LoRAConfig and ParallelConfig validation) on vLLM's CPU platform (VLLM_TARGET_DEVICE=cpu: the
  CUDA platform needs a GPU to start). SGLang: ``prepare_server_args`` (its ``sglang serve`` parser and
  ``ServerArgs.from_cli_args``), then, with ``--device cpu`` added (its resolution needs a device),
  ``ServerArgs.resolve_once`` and ``check_server_args``. Every
  model is also checked with no flags (its baseline): a model the engine cannot validate on this machine at all
  is reported, and only flags that turn a passing baseline into a refusal fail the check.

    PYTHONPATH=. python3 scripts/real_checkpoints.py
    PYTHONPATH=. python3 scripts/engine_check.py --static
    PYTHONPATH=. python3 scripts/engine_check.py --vllm-python /tmp/engines-venv-vllm/bin/python \\
        --sglang-python /tmp/engines-venv-sglang/bin/python

Exit status: 0 when every check passes, 1 on any failure (each printed on stderr), 2 on bad arguments.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ("gemma-3-27b-it", "qwen3-14b")
#: examples whose release layout planner.source.release_format does not know: written by offload-plan header-checkpoint
#: (transformers builds the model on the meta device)
META_EXAMPLES = ("deepseek-v2-lite",)
#: header-only PEFT adapters: rank and the modules every Llama/Qwen-style decoder layer has
ADAPTER_RANK = 16
ADAPTER_MODULES = ("q_proj", "v_proj")


@dataclass(frozen=True, kw_only=True)
class ExportCase:
    """One export of one plan: what was asked, and the flags or offload-plan's own refusal."""

    plan: str
    model_path: str
    engine: str
    tp_size: int
    flags: tuple[str, ...] = ()
    refused: str | None = None


@dataclass(kw_only=True)
class Tally:
    """What the run found, for the summary."""

    num_plans: int = 0
    num_make_refused: int = 0
    cases: list = field(default_factory=list)
    failures: list = field(default_factory=list)


def model_folders(work: Path) -> dict[str, Path]:
    """name -> header-only checkpoint: every public config under plans/models (.cache/checkpoints) and the
    examples release_format knows."""
    from planner.source.header_checkpoint import write_checkpoint_folder
    from planner.source.release_format import release_specs
    from scripts import real_checkpoints

    folders = {}
    for name in real_checkpoints.model_names([]):
        folder = real_checkpoints.OUTPUT_DIR / name
        if not folder.is_dir():
            real_checkpoints.write_checkpoint(name)
        folders[name] = folder
    for name in EXAMPLES:
        config_path = REPO_ROOT / "examples" / name / "config.json"
        folder = work / "checkpoints" / name
        write_checkpoint_folder(config_path=config_path, specs=release_specs(json.loads(config_path.read_text())),
                                out_dir=folder, shard_bytes=real_checkpoints.SHARD_BYTES)
        folders[name] = folder
    for name in META_EXAMPLES:
        folder = work / "checkpoints" / name
        subprocess.run([sys.executable, "-m", "offload_plan", "header-checkpoint",
                        str(REPO_ROOT / "examples" / name / "config.json"), str(folder)], check=True,
                       capture_output=True, cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
        folders[name] = folder
    return folders


def write_adapters(model: Path, work: Path, count: int) -> tuple[str, ...]:
    """``count`` header-only PEFT adapters for ``model`` (q_proj and v_proj of every layer): --adapter options."""
    from planner.source.checkpoint import load_checkpoint
    from planner.source.header_checkpoint import write_shard

    shapes = {entry.name: entry.shape for entry in load_checkpoint(str(model)).tensors}
    options = []
    for number in range(count):
        folder = work / "adapters" / model.name / f"a{number}"
        folder.mkdir(parents=True, exist_ok=True)
        specs = []
        for name, shape in sorted(shapes.items()):
            module = name.removesuffix(".weight").rsplit(".", 1)[-1]
            if module in ADAPTER_MODULES and name.startswith("model.layers.") and len(shape) == 2:
                stem = f"base_model.model.{name.removesuffix('.weight')}"
                specs += [(f"{stem}.lora_A.weight", "BF16", [ADAPTER_RANK, shape[1]]),
                          (f"{stem}.lora_B.weight", "BF16", [shape[0], ADAPTER_RANK])]
        write_shard(folder / "adapter_model.safetensors", specs)
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": ADAPTER_RANK, "lora_alpha": 32, "target_modules": list(ADAPTER_MODULES),
            "base_model_name_or_path": str(model), "task_type": "CAUSAL_LM"}))
        options.append(f"a{number}={folder}")
    return tuple(options)


def plan_inputs(name: str, folder: Path, work: Path) -> list:
    """The generated plans' Inputs for one model: weights plans at four budget shares (whole layers and, for a
    MoE model, --params experts; one with CUDA graphs), serving plans on three GPUs and contexts (one with an
    FP8 KV cache), make --tp 2/4/8 plans, make --for each engine (planned_for_engines) and, for a Llama/Qwen-style
    model, plans with 1 and 3 adapters."""
    from planner.source.checkpoint import load_checkpoint
    from planner.plan.schema import Inputs

    checkpoint = load_checkpoint(str(folder))
    total_gib = checkpoint.total_bytes / 2**30
    moe = any(".experts." in entry.name for entry in checkpoint.tensors)
    base = Inputs(model=str(folder), gpu="h100-sxm")
    inputs = []
    for share in (0.15, 0.25, 0.35, 0.5, 0.65, 0.8):
        budget = f"{max(1, int(total_gib * share))}GiB"
        inputs.append(replace(base, budget=budget))
        if moe:
            inputs.append(replace(base, budget=budget, params=("experts",)))
    for share in (0.3, 0.6):
        inputs.append(replace(base, budget=f"{max(1, int(total_gib * share))}GiB", tokens=8, sequences=8,
                              context=2048, cuda_graph=True))
    for gpu, context in (("h100-sxm", 4096), ("gh200", 8192), ("gb200", 32768), ("h100-sxm", 16384)):
        inputs.append(replace(base, gpu=gpu, concurrency="auto", context=context))
    inputs.append(replace(base, concurrency="8", context=8192, kv_dtype="fp8"))
    inputs.append(replace(base, gpu="gh200", concurrency="16", context=4096, cuda_graph=True))
    for tp in (2, 4, 8):
        inputs.append(replace(base, tp=tp, budget=f"{max(1, int(total_gib / tp * 0.5))}GiB"))
        inputs.append(replace(base, tp=tp, concurrency="auto", context=8192))
    inputs += planned_for_engines(base, checkpoint.config, total_gib)
    if not moe and any(name.endswith("q_proj.weight") for name in (e.name for e in checkpoint.tensors)):
        for count in (1, 3):
            adapters = write_adapters(folder, work, count)
            inputs.append(replace(base, adapters=adapters, concurrency="8", context=4096))
    return inputs


def planned_for_engines(base, config: dict, total_gib: float) -> list:
    """make --for each engine: weights plans at two budget shares, a CUDA-graph serving plan and a make --tp 2
    serving plan. For SGLang these are --cpu-offload-gb plans (offload.mechanism read_at_use) except for the
    family its prefetch offloader is wired for (DeepSeek: --params experts, which its model code fixes)."""
    from planner.engines.read_at_use import architecture_of
    from planner.engines.versions import ENGINE_VERSIONS, engine_version

    inputs = []
    for engine in ENGINE_VERSIONS:
        fixed = dict(engine_version(engine).prefetch.fixed_selection).get(architecture_of(config))
        engine_base = replace(base, engine=engine, params=(fixed,) if fixed else ())
        for share in (0.25, 0.6):
            inputs.append(replace(engine_base, budget=f"{max(1, int(total_gib * share))}GiB"))
        inputs.append(replace(engine_base, concurrency="auto", context=8192, cuda_graph=True))
        inputs.append(replace(engine_base, tp=2, concurrency="auto", context=8192))
    return inputs


def generated_plans(work: Path, tally: Tally) -> list:
    """(label, Plan) of every generated plan make writes; make's own refusals are counted."""
    from planner.errors import OffloadPlanError
    from planner.make.make_plan import make_plan

    plans = []
    for name, folder in model_folders(work).items():
        for number, inputs in enumerate(plan_inputs(name, folder, work)):
            try:
                plans.append((f"{name}#{number}", make_plan(inputs).plan))
            except OffloadPlanError:
                tally.num_make_refused += 1
    return plans


def checked_in_plans() -> list:
    from planner.plan.file import read_plan

    paths = sorted((REPO_ROOT / "plans").glob("*.yaml"))
    return [(str(path.relative_to(REPO_ROOT)), read_plan(path)) for path in paths]


def export_cases(label: str, plan) -> list[ExportCase]:
    """The plan exported to each engine at its own TP and, for a one-GPU plan, at --tp 2."""
    from planner.errors import OffloadPlanError
    from planner.views.export import ENGINES, export_plan

    model_path = str((REPO_ROOT / plan.model.source).resolve()) if not Path(plan.model.source).is_absolute() \
        else plan.model.source
    sizes = (plan.inputs.tp,) if plan.inputs.tp > 1 else (1, 2)
    cases = []
    for engine in ENGINES:
        for tp_size in sizes:
            case = ExportCase(plan=label, model_path=model_path, engine=engine, tp_size=tp_size)
            try:
                exported = export_plan(plan, engine, tp_size=tp_size)
                cases.append(replace(case, flags=exported.flags))
            except OffloadPlanError as error:
                cases.append(replace(case, refused=f"{type(error).__name__}: {error}"))
    return cases


def static_failures(cases: list[ExportCase]) -> list[str]:
    """Every exported flag outside the pinned version's accepted set or range."""
    from planner.engines.versions import engine_version, flag_problems

    failures = []
    for case in cases:
        if case.refused is None:
            failures += [f"{case.plan} --to {case.engine} --tp {case.tp_size}: {problem}"
                         for problem in flag_problems(case.flags, engine_version(case.engine))]
    return failures


def engine_failures(cases: list[ExportCase], engine: str, python: str, work: Path) -> tuple[list[str], dict]:
    """Run the engine's own parser and validation (in its venv) on every export to it, and each model's
    baseline; the refusals of flags whose baseline passed, and counts."""
    exported = [case for case in cases if case.engine == engine and case.refused is None]
    models = sorted({case.model_path for case in exported})
    requests = [{"model": m, "flags": []} for m in models] + [{"model": c.model_path, "flags": list(c.flags)}
                                                            for c in exported]
    request_path, result_path = work / f"{engine}-requests.json", work / f"{engine}-results.json"
    request_path.write_text(json.dumps(requests))
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", PYTHONPATH="")
    run = subprocess.run([python, __file__, "--worker", engine, str(request_path), str(result_path)], env=env,
                         capture_output=True, text=True)
    if run.returncode != 0:
        return [f"{engine} worker failed: {(run.stderr.strip().splitlines() or ['no output'])[-1]}"], {}
    results = json.loads(result_path.read_text())
    baseline = {models[i]: results[i] for i in range(len(models))}
    failures, counts = [], {"exports": len(exported), "parsed": 0, "validated": 0, "baseline_refused": 0}
    for case, result in zip(exported, results[len(models):]):
        if result["stage"] == "parser":
            failures.append(f"{case.plan} --to {engine} --tp {case.tp_size}: {engine}'s parser refused "
                            f"{' '.join(case.flags)}: {result['error']}")
            continue
        counts["parsed"] += 1
        if baseline[case.model_path]["stage"] != "ok":
            counts["baseline_refused"] += 1  # the engine cannot validate this model here at all
        elif result["stage"] != "ok":
            failures.append(f"{case.plan} --to {engine} --tp {case.tp_size}: {engine} refused "
                            f"{' '.join(case.flags)}: {result['error']}")
        else:
            counts["validated"] += 1
    counts["models_baseline_refused"] = {Path(m).name: r["error"][:160] for m, r in sorted(baseline.items())
                                         if r["stage"] != "ok"}
    return failures, counts


# ---- the workers: run by the engine's venv python, importing only the standard library and the engine ----


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _parsed(parse, argv: list[str]):
    """(namespace, None) or (None, the parser's refusal)."""
    import contextlib
    import io

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parse(argv), None
    except SystemExit:
        return None, _last_line(stderr.getvalue()) or "SystemExit"


def vllm_worker(requests: list[dict]) -> list[dict]:
    """vllm serve's parser, then EngineArgs.create_engine_config (its config classes' validation)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    results = []
    for request in requests:
        args, refusal = _parsed(parser.parse_args, ["--model", request["model"], *request["flags"]])
        if refusal is not None:
            results.append({"stage": "parser", "error": refusal})
            continue
        try:
            EngineArgs.from_cli_args(args).create_engine_config()
            results.append({"stage": "ok", "error": ""})
        except Exception as error:  # noqa: BLE001 - any refusal of the engine's validation is a result
            results.append({"stage": "config", "error": _last_line(f"{type(error).__name__}: {error}")})
    return results


def sglang_worker(requests: list[dict]) -> list[dict]:
    """sglang serve's parser and ServerArgs.from_cli_args (prepare_server_args) on the flags as exported; then,
    with --device cpu added (its resolution pipeline needs a device, and no GPU is here), ServerArgs.resolve_once
    and check_server_args (its resolution hooks and validation: offload, memory, LoRA, chunked prefill)."""
    from sglang.srt.server_args import prepare_server_args

    results = []
    for request in requests:
        argv = ["--model-path", request["model"], *request["flags"]]
        _, refusal = _parsed(prepare_server_args, argv)
        if refusal is not None:
            results.append({"stage": "parser", "error": refusal})
            continue
        try:
            server_args = prepare_server_args([*argv, "--device", "cpu"])
            server_args.resolve_once()
            server_args.check_server_args()
            results.append({"stage": "ok", "error": ""})
        except Exception as error:  # noqa: BLE001 - any refusal of the engine's validation is a result
            results.append({"stage": "config", "error": _last_line(f"{type(error).__name__}: {error}")})
    return results


def worker(engine: str, request_path: str, result_path: str) -> None:
    requests = json.loads(Path(request_path).read_text())
    results = (vllm_worker if engine == "vllm" else sglang_worker)(requests)
    Path(result_path).write_text(json.dumps(results))


# ---- the driver ----


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--static", action="store_true", help="only the static check (no engines)")
    result.add_argument("--vllm-python", help="python of a venv with vllm==0.33.0")
    result.add_argument("--sglang-python", help="python of a venv with sglang==0.5.23")
    result.add_argument("--no-generated", action="store_true", help="only plans/*.yaml (fast)")
    result.add_argument("--worker", nargs=3, metavar=("ENGINE", "REQUESTS", "RESULTS"), help=argparse.SUPPRESS)
    return result


def collect(work: Path, generated: bool) -> Tally:
    """The corpus and its exports."""
    tally = Tally()
    plans = checked_in_plans() + (generated_plans(work, tally) if generated else [])
    tally.num_plans = len(plans)
    for label, plan in plans:
        tally.cases += export_cases(label, plan)
    return tally


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    if not args.static and not (args.vllm_python or args.sglang_python):
        print("engine_check: give --static, or --vllm-python and/or --sglang-python", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="engine-check-") as folder:
        work = Path(folder)
        tally = collect(work, not args.no_generated)
        tally.failures += static_failures(tally.cases)
        summary = {"plans": tally.num_plans, "make_refused": tally.num_make_refused, "exports": len(tally.cases),
                   "export_refused": sum(case.refused is not None for case in tally.cases)}
        for engine, python in (("vllm", args.vllm_python), ("sglang", args.sglang_python)):
            if python and not args.static:
                failures, counts = engine_failures(tally.cases, engine, python, work)
                tally.failures += failures
                summary[engine] = counts
    for failure in tally.failures:
        print(f"engine_check: {failure}", file=sys.stderr)
    summary["failures"] = len(tally.failures)
    print(json.dumps(summary, indent=1))
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
