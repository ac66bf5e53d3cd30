"""Options and arguments shared by several commands, as ``Annotated`` aliases (make's --model and --gpu come from
the fields of planner.plan.schema.Inputs, with its other flags)."""

from pathlib import Path
from typing import Annotated, Optional

import typer

PlanArgument = Annotated[Path, typer.Argument(help="A plan file written by `make`.")]
PlanFiles = Annotated[list[Path], typer.Argument(help="Plan files, e.g. plans/*.yaml.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON to stdout.")]
OutputOption = Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the file here (default: stdout).")]
