"""Commands for plans under review: ``check`` (CI and pre-commit), ``diff`` (pull requests), ``export`` (engines).

Registered on ``planner.cli.app`` when planner.cli imports this module. Thin, as the rest of the CLI: the work
is in planner.check, planner.compare and planner.export.
"""

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from planner.cli import JsonOption, PlanArgument, app, handle_errors, stderr

PlanFiles = Annotated[list[Path], typer.Argument(help="Plan files, e.g. plans/*.yaml.")]


@app.command()
@handle_errors
def check(
    plans: PlanFiles,
    update: Annotated[bool, typer.Option("--update", help="Rewrite plans that regenerate differently instead of failing.")] = False,
    json_output: JsonOption = False,
):
    """Regenerate each plan from its recorded inputs; fail on any difference. Example: offload-plan check plans/*.yaml"""
    from planner.check import check_plan

    results = [check_plan(path) for path in plans]
    updated = {result.path for result in results if update and _rewrite(result)}
    results = [dataclasses.replace(r, problems=()) if r.path in updated else r for r in results]
    if json_output:
        sys.stdout.write(json.dumps([_result_data(r, r.path in updated) for r in results], indent=2) + "\n")
    else:
        for result in results:
            _print_result(result, result.path in updated)
    _finish(results)


def _rewrite(result) -> bool:
    """Write the regenerated plan over a failing one (--update); False when it could not be regenerated."""
    from planner.plan import write_atomic

    if result.ok or result.regenerated is None:
        return False
    write_atomic(Path(result.path), result.regenerated)
    return True


def _result_data(result, updated: bool) -> dict:
    problems = [{"kind": p.kind, "message": p.message, "exit_code": p.error_class.exit_code} for p in result.problems]
    return {"path": result.path, "ok": result.ok, "updated": updated, "exit_code": result.exit_code,
            "problems": problems, "diff": result.diff, "fix_command": result.fix_command}


def _print_result(result, updated: bool) -> None:
    """Status on stderr; the diff on stdout, where it can be piped to a file or a pager."""
    if result.ok:
        status = ("updated", "yellow") if updated else ("ok", "green")
        stderr.print(Text.assemble(status, f" {result.path}"), soft_wrap=True)
        return
    for problem in result.problems:
        stderr.print(Text.assemble(("FAIL", "bold red"), f" {result.path}: {problem.message}"), soft_wrap=True)
    if result.diff:
        sys.stdout.write(result.diff)
        sys.stdout.flush()
    if result.regenerated is not None:
        stderr.print(f"  fix: {result.fix_command}\n  (or offload-plan check --update {result.path})",
                     markup=False, soft_wrap=True)
    elif result.fix_command:
        stderr.print(f"  recorded command: {result.fix_command}\n  (change what fails, then run it)",
                     markup=False, soft_wrap=True)


def _finish(results) -> None:
    """One summary line; the first failing plan's error sets the exit code."""
    failing = [r for r in results if not r.ok]
    if not failing:
        stderr.print(f"{len(results)} plan(s) up to date", markup=False)
        return
    listed = "; ".join(f"{r.path} ({', '.join(p.kind for p in r.problems)})" for r in failing)
    raise failing[0].problems[0].error_class(
        f"{len(failing)} of {len(results)} plan(s) fail check: {listed}; run the fix command shown for each, "
        "or offload-plan check --update PLAN..."
    )


@app.command("diff")
@handle_errors
def diff_plans(
    old: Annotated[Path, typer.Argument(help="The plan before the change.")],
    new: Annotated[Path, typer.Argument(help="The plan after the change.")],
    json_output: JsonOption = False,
):
    """What changed between two plans: layers, params, memory, predicted step. Example: offload-plan diff old.yaml new.yaml"""
    from planner.compare import compare_plans, summary_sentences
    from planner.plan import read_plan

    data = compare_plans(read_plan(old), read_plan(new))
    data = {"old_path": str(old), "new_path": str(new), **data, "summary": summary_sentences(data)}
    if json_output:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    for sentence in data["summary"]:
        stderr.print(sentence, markup=False, soft_wrap=True)
    stderr.print(_diff_table(data))


def _diff_table(data: dict) -> Table:
    from planner.compare import KNOB_FIELDS
    from planner.units import format_bytes, format_ms

    table = Table(title=f"{data['old_path']} -> {data['new_path']}", title_justify="left")
    for name in ("", "old", "new", "change"):
        table.add_column(name, justify="left" if name == "" else "right")
    offload, memory, prediction = data["offload"], data["memory"], data["prediction"]
    knobs = ["/".join(str(offload[k][side]) for k in KNOB_FIELDS) for side in ("old", "new")]
    table.add_row("G / K / P", *knobs, "")
    table.add_row("params", *(" ".join(offload["params"][side]) or "whole layers" for side in ("old", "new")), "")
    table.add_row("layers offloaded", *_row(offload["num_offloaded"], str))
    for label, key in (("GPU weights", "gpu_bytes"), ("budget", "budget_bytes"), ("pinned host", "host_pinned_bytes")):
        table.add_row(label, *_row(memory[key], format_bytes))
    table.add_row("prefetch slots", *_row(memory["num_slots"], str))
    for label, key in (("predicted step", "step_ms"), ("stall", "stall_ms"), ("link floor", "link_floor_ms"),
                       ("all resident step", "resident_step_ms")):
        table.add_row(label, *_row(prediction[key], format_ms))
    return table


def _row(pair: dict, formatter) -> tuple[str, str, str]:
    change = pair["change"]
    sign = "+" if change > 0 else ("-" if change < 0 else "")
    return formatter(pair["old"]), formatter(pair["new"]), (f"{sign}{formatter(abs(change))}" if change else "=")


@app.command()
@handle_errors
def export(
    plan: PlanArgument,
    to: Annotated[str, typer.Option("--to", help="The engine: vllm or sglang.")],
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size the engine runs with.")] = 1,
    exact: Annotated[bool, typer.Option("--exact", help="Fail instead of approximating what the engine cannot say.")] = False,
    json_output: JsonOption = False,
):
    """The engine flags that run a plan, its prediction restated. Example: offload-plan export plan.yaml --to vllm --tp 2"""
    from planner.export import describe_prediction, export_plan
    from planner.plan import read_plan

    result = export_plan(read_plan(plan), to, tp_size=tp, exact=exact)
    if json_output:
        sys.stdout.write(json.dumps(_export_data(result), indent=2) + "\n")
        return
    if result.flags:
        sys.stdout.write(result.command_fragment() + "\n")
    for note in result.notes:
        stderr.print(f"offload-plan: note: {note}", markup=False, soft_wrap=True)
    for warning in result.warnings:
        stderr.print(f"offload-plan: warning: {warning}", markup=False, soft_wrap=True)
    stderr.print(f"{result.engine}: {describe_prediction(result)}", markup=False, soft_wrap=True)


def _export_data(result) -> dict:
    def rounded(prediction) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in dataclasses.asdict(prediction).items()}

    return {"engine": result.engine, "tp_size": result.tp_size, "flags": list(result.flags),
            "command_fragment": result.command_fragment(), "prefetch_step": result.prefetch_step,
            "notes": list(result.notes), "warnings": list(result.warnings),
            "prediction": {"plan": rounded(result.plan_prediction), "exported": rounded(result.prediction)}}
