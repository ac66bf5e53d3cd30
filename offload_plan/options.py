"""Options and arguments shared by several commands, as ``Annotated`` aliases."""

from pathlib import Path
from typing import Annotated, Optional

import typer

ModelOption = Annotated[str, typer.Option("--model", "-m",
                                          help="Checkpoint folder, .safetensors file, or hub repo id.")]
GpuOption = Annotated[str, typer.Option("--gpu", "-g",
                                        help="Built-in profile name (see `profiles`) or a profile .yaml.")]
PlanArgument = Annotated[Path, typer.Argument(help="A plan file written by `make`.")]
PlanFiles = Annotated[list[Path], typer.Argument(help="Plan files, e.g. plans/*.yaml.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON to stdout.")]
OutputOption = Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the file here (default: stdout).")]
