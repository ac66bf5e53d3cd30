"""``offload-plan show``: explain a plan."""

import json
import sys
from typing import Annotated

import typer

from offload_plan.console import stdout
from offload_plan.options import JsonOption, PlanArgument
from planner.plan.file import plan_to_dict, read_plan


def show(
    plan: PlanArgument,
    json_output: JsonOption = False,
    layers: Annotated[bool, typer.Option("--layers/--no-layers", help="Include the per-layer table.")] = True,
):
    """Explain a plan: summary, memory, layers, timeline, stalls.

    Example: offload-plan show plan.yaml
    """
    loaded = read_plan(plan)
    if json_output:
        sys.stdout.write(json.dumps(plan_to_dict(loaded), indent=2) + "\n")
        return
    from planner.views.show import show_plan

    show_plan(loaded, stdout, layer_table=layers)
