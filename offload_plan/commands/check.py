"""``offload-plan check``: regenerate plans from their recorded inputs and fail on any difference (CI)."""

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from offload_plan.console import say, stderr
from planner.errors import printable
from offload_plan.options import JsonOption, PlanFiles


def check(
    plans: PlanFiles,
    update: Annotated[bool, typer.Option(
        "--update",
        help="Rewrite plans that regenerate differently instead of failing.")] = False,
    json_output: JsonOption = False,
):
    """Regenerate each plan from its recorded inputs; fail on any difference.

    Example: offload-plan check plans/*.yaml
    """
    from planner.views.check import check_plan, missing_checkpoints, missing_checkpoints_error

    missing = missing_checkpoints(plans)
    if missing:  # a fresh clone: one line naming the build step, not a failure per plan
        raise missing_checkpoints_error(missing, len(plans))
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
    from planner.plan.file import write_atomic

    if result.ok or result.regenerated is None:
        return False
    write_atomic(Path(result.path), result.regenerated)
    return True


def _result_data(result, updated: bool) -> dict:
    problems = [{"kind": p.kind, "message": p.message, "exit_code": p.error_class.exit_code} for p in result.problems]
    return {"path": result.path, "ok": result.ok, "updated": updated, "exit_code": result.exit_code,
            "problems": problems, "diff": result.diff, "fix_command": result.fix_command, "note": result.note}


def _print_result(result, updated: bool) -> None:
    """Status on stderr; the diff on stdout, where it can be piped to a file or a pager."""
    if result.ok:
        status = ("updated", "yellow") if updated else ("ok", "green")
        note = f" ({result.note})" if result.note else ""
        stderr.print(Text.assemble(status, f" {result.path}{note}"), soft_wrap=True)
        return
    for problem in result.problems:
        stderr.print(Text.assemble(("FAIL", "bold red"), f" {result.path}: {problem.message}"), soft_wrap=True)
    if result.diff:
        sys.stdout.write(result.diff)
        sys.stdout.flush()
    if result.regenerated is not None:
        say(f"  fix: {result.fix_command}\n  (or offload-plan check --update {result.path})")
    elif result.fix_command:
        say(f"  recorded command: {result.fix_command}\n  (change what fails, then run it)")


def _cut(path: str, max_chars: int = 60) -> str:
    """A path for the summary line: printable, and cut in the middle when long."""
    text = printable(path)
    return text if len(text) <= max_chars else f"{text[:28]} ... {text[-28:]}"


def _finish(results) -> None:
    """One summary line; the first failing plan's error sets the exit code."""
    failing = [r for r in results if not r.ok]
    if not failing:
        say(f"{len(results)} plan(s) up to date")
        return
    # each path cut to a readable length: the FAIL lines above give them whole
    listed = "; ".join(f"{_cut(str(r.path))} ({', '.join(p.kind for p in r.problems)})" for r in failing[:5])
    listed += f" and {len(failing) - 5} more" if len(failing) > 5 else ""
    raise failing[0].problems[0].error_class(
        f"{len(failing)} of {len(results)} plan(s) fail check: {listed}; run the fix command shown for each, "
        "or offload-plan check --update PLAN..."
    )
