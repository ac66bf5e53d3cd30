"""Every checked-in plan exported to every engine, pinned: the flags, notes, warnings, losses and predictions (or
the one-line refusal) of plans/*.yaml and tests/golden/*.yaml for each engine at --tp 1 and 2, with and without
--exact, compared with tests/golden/exports.json. A change to planner/views/export.py that alters any of them fails
here; a deliberate one regenerates the file with ``python3 -m tests.planner.test_export_snapshot``."""

import contextlib
import dataclasses
import json
from pathlib import Path

from planner.errors import OffloadPlanError
from planner.views.export import ENGINES, export_plan
from planner.plan.file import read_plan

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN = REPO_ROOT / "tests" / "golden" / "exports.json"
CASES = [(tp_size, exact) for tp_size in (1, 2) for exact in (False, True)]


def plan_paths() -> list[Path]:
    return sorted((REPO_ROOT / "plans").glob("*.yaml")) + sorted((REPO_ROOT / "tests" / "golden").glob("*.yaml"))


def exported(path: Path, engine: str, tp_size: int, exact: bool) -> dict:
    """One export as data, or its refusal (error class and line)."""
    try:
        result = export_plan(read_plan(path), engine, tp_size=tp_size, exact=exact)
    except OffloadPlanError as error:
        return {"error": type(error).__name__, "line": str(error)}
    return dataclasses.asdict(result) | {"command_fragment": result.command_fragment()}


def ensure_checkpoints() -> None:
    """plans/*.yaml name .cache/checkpoints/NAME, which export --tp reads to check the split as make --tp does:
    write the missing ones (header-only, the same bytes each time) so the snapshot is the same everywhere."""
    from scripts import real_checkpoints

    for name in real_checkpoints.model_names([]):
        if not (real_checkpoints.OUTPUT_DIR / name).is_dir():
            real_checkpoints.write_checkpoint(name)


def snapshot() -> dict:
    """Every export, from the repository root (where the plans' relative checkpoint paths resolve)."""
    ensure_checkpoints()
    with contextlib.chdir(REPO_ROOT):
        return {f"{path.relative_to(REPO_ROOT)} --to {engine} --tp {tp_size}{' --exact' if exact else ''}":
                exported(path, engine, tp_size, exact)
                for path in plan_paths() for engine in ENGINES for tp_size, exact in CASES}


def test_every_plan_exports_as_pinned():
    expected = json.loads(GOLDEN.read_text())
    actual = json.loads(json.dumps(snapshot()))  # tuples as lists, as the file holds them
    assert sorted(actual) == sorted(expected)
    changed = [key for key in expected if actual[key] != expected[key]]
    assert not changed, f"{len(changed)} exports changed, first: {changed[0]}"


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(snapshot(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN.relative_to(REPO_ROOT)}")
