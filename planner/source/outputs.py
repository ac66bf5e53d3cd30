"""Where a command writes, checked before it does any work: one check for every command that writes a file.

A destination that cannot be written (a folder, a missing folder, a name longer than the file system allows) and
a destination that is one of the command's own inputs are refused in one line, before the model is read or run:
``make -o t.yaml --routing-trace t.yaml`` would replace the trace the plan records the sha256 of, ``make -o
ckpt/config.json`` the model's config, ``trace -o prompts.txt`` the prompts. An input folder (a checkpoint) holds
its files: writing over any file already in it is refused too.
"""

import os
from collections.abc import Iterable
from pathlib import Path

from planner.errors import OffloadPlanError, PlanError, UsageError, printable
from planner.source.untrusted import checked_path


def destination_problem(path: Path) -> str | None:
    """Why ``path`` cannot take a file written through a temporary beside it (None: it can)."""
    directory = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        return f"{printable(path)} is a folder; give a file name, e.g. {printable(path / 'plan.yaml')}"
    if not directory.is_dir():
        what = "is not a folder" if directory.exists() else "does not exist"
        return f"output folder {printable(directory)} {what}; create it first or choose another path"
    return None


def check_output(output: Path | str | None, inputs: Iterable[tuple[str, Path | str | None]], *,
                 error_class: type[OffloadPlanError] = UsageError) -> Path | None:
    """``output`` if a command may write it: a writable destination that is none of ``inputs`` ((flag, path)
    pairs; a path that names nothing on this machine, such as a hub id, is skipped), nor a file inside an input
    folder. A destination that cannot be written is the PlanError line write_atomic gives; an input as output is
    one ``error_class`` line naming both."""
    if output is None:
        return None
    path = checked_path(output, PlanError, "output")
    problem = destination_problem(path)
    if problem is not None:
        raise PlanError(problem)
    for flag, source in inputs:
        clash = _clash(path, source)
        if clash is not None:
            raise error_class(f"-o {printable(path)} {clash} {flag} {printable(source)}, which this command reads; "
                              "write the output elsewhere")
    return path


def _clash(output: Path, source: Path | str | None) -> str | None:
    """How ``output`` would overwrite ``source`` ("is", "is inside"), or None."""
    if source is None or str(source) == "":
        return None
    try:
        source_path = checked_path(source, UsageError, "input")
        if not source_path.exists():
            return None  # a hub id, or a file the command will refuse as missing
        if output.exists() and os.path.samefile(output, source_path):
            return "is"
        real_output, real_source = os.path.realpath(output), os.path.realpath(source_path)
    except (OSError, UsageError):
        return None  # an input the command itself refuses, in its own line
    if real_output == real_source:
        return "is"
    if source_path.is_dir() and output.exists() and real_output.startswith(real_source.rstrip(os.sep) + os.sep):
        return "is a file inside"
    return None
