"""``offload-plan diff``: what changed between two plans (pull requests)."""

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from offload_plan.console import stdout
from offload_plan.options import JsonOption


def diff(
    old: Annotated[Path, typer.Argument(help="The plan before the change.")],
    new: Annotated[Path, typer.Argument(help="The plan after the change.")],
    json_output: JsonOption = False,
):
    """What changed between two plans: layers, params, memory, predicted step.

    Example: offload-plan diff old.yaml new.yaml
    """
    from planner.views.diff import compare_plans, summary_sentences
    from planner.plan.file import read_plan

    data = compare_plans(read_plan(old), read_plan(new))
    data = {"old_path": str(old), "new_path": str(new), **data, "summary": summary_sentences(data)}
    if json_output:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    for sentence in data["summary"]:
        stdout.print(sentence, markup=False, soft_wrap=True)
    stdout.print(_diff_table(data))


def _diff_table(data: dict) -> Table:
    from planner.views.diff import KNOB_FIELDS
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
