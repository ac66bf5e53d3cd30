"""``check``: regenerate checked-in plans from their recorded inputs and compare them byte for byte.

A plan fails when it is not a valid plan, when its checkpoint or profile cannot be read, when the checkpoint's
fingerprint is no longer the one the plan records, when it no longer fits its profile's GPU memory, or when
``make`` with the recorded inputs now writes different bytes. A ``--measure`` plan is regenerated from the layer
times it records (no GPU, no torch): check covers what the planner does with them, not the timing itself. Each
failure keeps the error class whose exit code the CLI returns, and the command that fixes the plan.
"""

import contextlib
import difflib
import os
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from planner.source.checkpoint import load_checkpoint
from planner.model.cost import ComputeTimes
from planner.errors import (InfeasibleError, ModelInputError, OffloadPlanError, PlanError, PlanStaleError, ProfileError)
from planner.make.make_plan import make_plan
from planner.make.inputs import budget_given, regenerate_command
from planner.plan.schema import Plan
from planner.plan.file import read_plan, render_plan
from planner.source.profile import HardwareProfile, load_profile
from planner.units import format_bytes


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One reason a plan fails check."""

    #: invalid, profile, model, fingerprint, fit, regenerate or stale
    kind: str
    #: one line for people
    message: str
    #: raised by the CLI when this is the first problem: its exit code is check's
    error_class: type[OffloadPlanError]


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    """What check found for one plan file."""

    #: the file, relative to the working directory
    path: str
    problems: tuple[Problem, ...]
    #: unified diff of the file against the regenerated plan; empty when equal or not regenerated
    diff: str
    #: the shell command that rewrites the plan; None when the file is not a plan
    fix_command: str | None
    #: the plan make writes now; None when it could not be regenerated
    regenerated: str | None
    #: what check did not compare, for people ("" when it regenerated the whole plan)
    note: str = ""

    @property
    def ok(self) -> bool:
        """True when the plan is up to date."""
        return not self.problems

    @property
    def exit_code(self) -> int:
        """The exit code of the first problem, 0 when none."""
        return self.problems[0].error_class.exit_code if self.problems else 0


def check_plan(path: Path) -> CheckResult:
    """Check one plan file against its checkpoint, its profile and what make writes from its inputs now."""
    display = os.path.relpath(path)
    try:
        # first: a FIFO or folder is refused before anything reads it; figures that disagree with the rest of
        # the plan are a stale plan here, shown as the difference from what make writes
        plan = read_plan(path, derived=False)
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError, PlanError) as error:
        message = str(error) if isinstance(error, PlanError) else f"{display}: cannot read ({error})"
        return _failed(display, Problem(kind="invalid", message=message, error_class=PlanError), None)
    # the header's command is part of the bytes compared: regenerate with the -o it records, whatever this copy is
    # called (a plan copied to another name is the same plan); the fix command writes this file
    header = regenerate_command(plan.inputs, recorded_output(text, display))
    command = regenerate_command(plan.inputs, display)
    try:
        with _where_make_ran(plan.inputs.model, path):
            profile = load_profile(plan.inputs.gpu)
            return _compare(display, text, plan, profile, header, command)
    except ProfileError as error:
        return _failed(display, Problem(kind="profile", message=str(error), error_class=ProfileError), command)
    except ModelInputError as error:
        return _failed(display, Problem(kind="model", message=str(error), error_class=ModelInputError), command)


@contextlib.contextmanager
def _where_make_ran(model: str, plan_path: Path) -> Iterator[None]:
    """Run the regeneration in the folder a relative model path resolves from: the working directory, else the
    plan's folder or the parent make ran in, so check passes from any directory. Relative profile and adapter
    paths were given in that same folder. Hub ids and absolute paths change nothing."""
    folder = _make_folder(model, plan_path)
    if folder is None:
        yield
        return
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def _make_folder(model: str, plan_path: Path) -> Path | None:
    """The plan's folder or the parent where a relative ``model`` exists, when the working directory has none
    (planner.source.checkpoint.resolve_local_source's rule, which run uses); None otherwise."""
    if Path(model).expanduser().is_absolute() or Path(model).exists():
        return None
    return next((parent for parent in Path(plan_path).resolve().parents if (parent / model).exists()), None)


#: where this repository's checked-in plans get their header-only checkpoints (plans/README.md): a fresh clone
#: has none until this script has run
CHECKPOINT_BUILDERS = {".cache/checkpoints/": "scripts/real_checkpoints.py"}


def missing_checkpoints(paths: list[Path]) -> list[str]:
    """The local checkpoints that readable plans among ``paths`` name and that are not here (fresh clone)."""
    missing = []
    for path in paths:
        try:
            source = read_plan(path, derived=False).inputs.model
        except PlanError:
            continue  # check_plan reports it
        if (source.startswith((".", "/")) and not Path(source).expanduser().exists()
                and _make_folder(source, path) is None and source not in missing):
            missing.append(source)
    return missing


def missing_checkpoints_error(missing: list[str], num_plans: int) -> ModelInputError:
    """One line for a check run whose plans name checkpoints that were never built or downloaded here."""
    builders = {script for prefix, script in CHECKPOINT_BUILDERS.items()
                if all(source.startswith(prefix) for source in missing) and Path(script).is_file()}
    how = (f"build them first with python3 {builders.pop()}" if builders
           else "download or build them first (a relative path is taken from the working directory, else the plan's "
           "folder or a parent)")
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return ModelInputError(f"the {num_plans} plan(s) name {len(missing)} checkpoint(s) that are not here ({shown}): "
                           f"{how}, then check again")


def _failed(display: str, problem: Problem, command: str | None) -> CheckResult:
    return CheckResult(path=display, problems=(problem,), diff="", fix_command=command, regenerated=None)


def _compare(display: str, text: str, plan: Plan, profile: HardwareProfile, header: str,
             command: str) -> CheckResult:
    """Regenerate the plan (``header`` its recorded command) and collect every difference; ``command`` rewrites
    this file. A checkpoint that cannot be read raises."""
    problems = list(fit_problems(plan, profile))
    if plan.inputs.measure and plan.serving is not None:
        return _measured_serving(display, plan, problems, command)
    regenerated = None
    try:
        planned = make_plan(plan.inputs, compute_override=recorded_compute(plan) if plan.inputs.measure else None,
                            context_bytes=plan.hardware.cuda_context_bytes if plan.inputs.measure else None,
                            nccl_bytes=plan.hardware.nccl_bytes if plan.inputs.measure else None)
        regenerated = render_plan(planned.plan, header)
        fingerprint = planned.checkpoint.fingerprint()
    except ModelInputError:
        raise
    except OffloadPlanError as error:
        problems.append(Problem(kind="regenerate", message=f"make with the recorded inputs fails: {error}",
                                error_class=type(error)))
        fingerprint = load_checkpoint(plan.inputs.model, plan.inputs.revision).fingerprint()
    problems[:0] = _fingerprint_problems(plan, fingerprint)
    diff = unified_diff(text, regenerated, display) if regenerated not in (None, text) else ""
    if diff:
        problems.append(Problem(kind="stale", error_class=PlanStaleError,
                                message="out of date: make with the recorded inputs writes a different plan"))
    return CheckResult(path=display, problems=tuple(problems), diff=diff, fix_command=command, regenerated=regenerated)


def _fingerprint_problems(plan: Plan, fingerprint: str) -> list[Problem]:
    if fingerprint == plan.model.fingerprint:
        return []
    return [Problem(
        kind="fingerprint", error_class=PlanError,
        message=f"the checkpoint at {plan.inputs.model} is not the one planned (fingerprint {fingerprint[:19]}... "
                f"against the plan's {plan.model.fingerprint[:19]}...): its tensor names, dtypes or shapes changed",
    )]


def _measured_serving(display: str, plan: Plan, problems: list[Problem], command: str) -> CheckResult:
    """A make --measure serving plan: its search timed every concurrency on a GPU, which check cannot do again, so
    it checks the checkpoint's fingerprint and the fit and says what it did not regenerate."""
    fingerprint = load_checkpoint(plan.inputs.model, plan.inputs.revision).fingerprint()
    problems = _fingerprint_problems(plan, fingerprint) + problems
    note = ("not regenerated: a make --measure serving plan's concurrencies were timed on a GPU; checked its "
            "checkpoint and its fit")
    return CheckResult(path=display, problems=tuple(problems), diff="", fix_command=command, regenerated=None,
                       note=note)


def recorded_compute(plan: Plan) -> ComputeTimes:
    """A --measure plan's own layer times: check plans from them instead of timing a GPU (it needs no torch)."""
    return ComputeTimes(layer_ms=tuple(row.compute_ms for row in plan.layers), head_ms=plan.prediction.head_ms,
                        source=plan.workload.compute_source)


def fit_problems(plan: Plan, profile: HardwareProfile) -> tuple[Problem, ...]:
    """The plan's weights or budget above what the profile now allows for weights (memory less reserve); a plan
    whose weights take what the rest of the GPU leaves (a serving plan, or one made without --budget or --trigger
    where the KV cache is modelled: make's whole-GPU budget) against the profile's whole memory, as make sized it."""
    memory = plan.memory
    whole_gpu = not budget_given(plan.inputs) and memory.total_gpu_bytes is not None
    if plan.serving is not None or whole_gpu:
        if memory.total_gpu_bytes <= memory.gpu_memory_bytes <= profile.gpu_memory_bytes.value:
            return ()
        message = (f"no longer fits {profile.name}: the plan puts {format_bytes(memory.total_gpu_bytes)} on a GPU "
                   f"of {format_bytes(profile.gpu_memory_bytes.value)} (planned for "
                   f"{format_bytes(memory.gpu_memory_bytes)}); regenerate it with make")
        return (Problem(kind="fit", message=message, error_class=InfeasibleError),)
    limit = profile.weight_limit_bytes
    if memory.gpu_bytes <= limit and memory.budget_bytes <= limit:
        return ()
    message = (
        f"no longer fits {profile.name}: weights may take {format_bytes(limit)} (GPU memory "
        f"{format_bytes(profile.gpu_memory_bytes.value)} less reserve {format_bytes(profile.reserve_bytes.value)}) "
        f"but the plan puts {format_bytes(memory.gpu_bytes)} on the GPU within a budget of "
        f"{format_bytes(memory.budget_bytes)}; regenerate it with a smaller --budget"
    )
    return (Problem(kind="fit", message=message, error_class=InfeasibleError),)


def recorded_output(text: str, display: str) -> str:
    """The -o of the plan's header command, else the file's path as checked.

    The header is part of the bytes compared, so a plan regenerates with the output name it was made with,
    even when copied or moved to another name (issue 26: a copy failed check); a plan written to stdout is
    regenerated with the path it has now.
    """
    lines = text.splitlines()
    words = _split_command(lines[1].lstrip("#").strip()) if len(lines) > 1 else []
    if "-o" in words[:-1]:
        return words[words.index("-o") + 1]
    return display


def _split_command(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError:
        return []


def unified_diff(old_text: str, new_text: str, path: str) -> str:
    """The file against the regenerated plan, as ``diff -u`` shows it."""
    lines = difflib.unified_diff(old_text.splitlines(True), new_text.splitlines(True), path, f"{path} (regenerated)")
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)
